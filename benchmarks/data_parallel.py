"""Data-parallel replicas (serve/data_parallel.py): what the router's choice does to prefix reuse.

    python benchmarks/data_parallel.py           # the recorded run: k3-small on 2 simulated CPU devices, ~5 min
    python benchmarks/data_parallel.py --quick   # smoke run on tiny-k3 (~1 min with compiles)

Trace (benchmarks/prefix_cache.py's): a shared system prompt, then `sessions` agent sessions of `turns`
turns each, closed loop (each session sends its next turn, its whole conversation so far plus a new user
message, as soon as its previous turn finishes; session 0 first, the others once its first turn is done). Greedy, so every run sees the same conversations
(checked). A second trace, `rounds`, models users who come back later: turn t of every session is sent once all of
turn t - 1 has finished, the sessions in a new random order each turn (in the closed loop a session's
next turn arrives just as its replica frees a row, so even load-only routing tends to send it back there).
Each trace runs three ways, all on the same two warm engines (one per device; prefix caches reset in
between, so nothing compiles between runs):

* `dp1`: one replica (device 0) serves the whole trace;
* `dp2_cache_aware`: both replicas, the default router (a request goes where its prefix was sent);
* `dp2_load`: both replicas, the least loaded always (vLLM's data-parallel balancing).

Measured: prefix-cache hit tokens / prompt tokens, prompt tokens computed, mean TTFT of later turns,
generated tokens/s, wall time, each replica's share. The 2 "devices" here are 2 simulated XLA:CPU devices
on the same 2 cores, so dp2 cannot compute faster than dp1: the speed columns show what the router's
choice costs in recomputation, not what a second accelerator adds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import simulated_devices  # noqa: E402

simulated_devices.use(2)  # before JAX starts (also when XLA_FLAGS already holds other flags)

import numpy as np  # noqa: E402

from k3jax.runtime import load_model  # noqa: E402
from serve.data_parallel import DataParallelEngine, build_replicas  # noqa: E402
from serve.engine import EngineConfig  # noqa: E402
from serve.types import SamplingParams  # noqa: E402
from prefix_cache import run_agent_trace  # noqa: E402
from serving import machine_info, mean, write_result  # noqa: E402


def run_rounds(dp: DataParallelEngine, system: list[int], users: list[list[list[int]]], sp: SamplingParams,
               seed: int) -> dict:
    """Returning users: turn t of every session is sent once all of turn t - 1 is done, the sessions in a
    new random order each turn (session 0's first turn alone first, so the system prompt is cached)."""
    sessions, turns = len(users), len(users[0])
    prompt = {s: system + users[s][0] for s in range(sessions)}
    rng = np.random.default_rng(seed)
    records = []
    t0 = time.perf_counter()
    for t in range(turns):
        order = [0] if t == 0 else []
        order += [int(s) for s in rng.permutation(sessions) if t or s]
        for wave in ([order[:1], order[1:]] if t == 0 else [order]):
            live = {dp.add_request(prompt[s], sp, request_id=f"s{s}-t{t}"): s for s in wave}
            while live:
                for o in dp.step():
                    if o.finished:
                        s = live.pop(o.request_id)
                        records.append(dict(session=s, turn=t, prompt_len=len(prompt[s]), ttft=o.metrics.ttft,
                                            tokens=list(o.token_ids), cached=o.num_cached_tokens))
                        if t + 1 < turns:
                            prompt[s] = prompt[s] + list(o.token_ids) + users[s][t + 1]
    wall = time.perf_counter() - t0
    ptok = sum(r["prompt_len"] for r in records)
    gtok = sum(len(r["tokens"]) for r in records)
    return dict(wall_s=wall, records=records, prompt_tokens=ptok, gen_tokens=gtok, gen_tok_s=gtok / wall)


def summarize(dp: DataParallelEngine, run) -> dict:
    """Run a trace over the replicas -> hit rate, prompt tokens computed, TTFT, each replica's share."""
    gen0 = [e.counters["generation_tokens"] for e in dp.replicas]
    tr = run()
    records = tr["records"]
    hit = sum(r["cached"] for r in records)
    return dict(wall_s=tr["wall_s"], requests=len(records), prompt_tokens=tr["prompt_tokens"], hit_tokens=hit,
                hit_rate=hit / tr["prompt_tokens"], computed_prompt_tokens=tr["prompt_tokens"] - hit,
                gen_tokens=tr["gen_tokens"], gen_tok_s=tr["gen_tok_s"],
                ttft_later_mean_s=mean([r["ttft"] for r in records if r["turn"] > 0]),
                ttft_first_mean_s=mean([r["ttft"] for r in records if r["turn"] == 0]),
                replica_gen_tokens=[e.counters["generation_tokens"] - g for e, g in zip(dp.replicas, gen0)],
                router=dict(dp.router.counters),
                conversations={f"{r['session']}/{r['turn']}": r["tokens"] for r in records})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny-k3 smoke run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t_start = time.perf_counter()
    log = lambda msg: print(f"[data_parallel] {msg}", flush=True)
    quick = args.quick
    name = "tiny-k3" if quick else "k3-small"
    sessions, turns, system_len, user_lo, user_hi, gen = (6, 3, 48, 16, 32, 8) if quick else (16, 4, 256, 64, 128, 32)
    model = load_model(name, dtype="float32", seed=0)
    rng = np.random.default_rng(0)
    hi = min(model.cfg.vocab_size, 256)
    system = rng.integers(1, hi, system_len).tolist()
    users = [[rng.integers(1, hi, int(rng.integers(user_lo, user_hi + 1))).tolist() for _ in range(turns)]
             for _ in range(sessions)]
    max_len = 128 * (-(-(system_len + turns * (user_hi + gen) + 16) // 128))
    cfg = EngineConfig(max_model_len=max_len, page_size=16, prefill_chunk=64, max_num_seqs=16, max_prefill_seqs=2,
                       decode_buckets=(16,), prefill_buckets=(2,), cache_bytes=(48 if quick else 640) << 20,
                       max_num_batched_tokens=512, measure_moe_time=False)
    log(f"building 2 replicas of {name} (max_model_len {max_len}, {cfg.cache_bytes >> 20} MiB arena each) ...")
    t0 = time.perf_counter()
    engines, devices = build_replicas(model, cfg, 2, progress=False)
    build_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    runs = {}
    traces = {"closed_loop": lambda dp: run_agent_trace(dp, system, users, sp),
              "rounds": lambda dp: run_rounds(dp, system, users, sp, seed=1)}
    for trace, run in traces.items():
        for label, reps, routing in (("dp1", 1, "cache_aware"), ("dp2_cache_aware", 2, "cache_aware"),
                                     ("dp2_load", 2, "load")):
            dp = DataParallelEngine(engines[:reps], devices[:reps], routing=routing)
            dp.reset_prefix_cache()
            r = runs[f"{trace}/{label}"] = summarize(dp, lambda: run(dp))
            log(f"{trace}/{label}: hit rate {r['hit_rate']:.3f}, computed prompt tokens {r['computed_prompt_tokens']}, "
                f"later-turn TTFT {r['ttft_later_mean_s']:.3f} s, {r['gen_tok_s']:.1f} gen tok/s, "
                f"wall {r['wall_s']:.1f} s, replicas {r['replica_gen_tokens']}")
    same = len({str(sorted(r["conversations"].items())) for r in runs.values()}) == 1
    for r in runs.values():
        r.pop("conversations")
    result = dict(
        benchmark="data_parallel", model=name, machine=machine_info(), build_2_replicas_s=build_s,
        trace=dict(sessions=sessions, turns=turns, system_len=system_len, user_len=[user_lo, user_hi], max_tokens=gen),
        engine=dict(max_model_len=max_len, cache_mib_per_replica=cfg.cache_bytes >> 20, decode_buckets=[16],
                    prefill_rows=2, prefill_chunk=64, devices=[list(d) for d in devices]),
        outputs_identical_across_runs=same, runs=runs)
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / (
        "data_parallel-cpu-quick.json" if quick else "data_parallel-cpu.json")
    write_result(result, out, t_start, log)


if __name__ == "__main__":
    main()
