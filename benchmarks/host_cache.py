"""Host-memory tier of the prefix cache: many idle conversations, an arena that holds a few of them.

    python benchmarks/host_cache.py           # the recorded run (k3-small), ~4 min quiet
    python benchmarks/host_cache.py --quick   # smoke run on tiny-k3 (~30 s with compiles)

Trace: `sessions` chat sessions, each with its own document-sized first prompt (random byte tokens),
take turns round-robin, `concurrency` at a time: turn t + 1 of a session = its previous prompt + the
model's greedy response + a new user message, submitted after every other session has had turn t. The
arena is sized to hold only a few sessions' pages and checkpoints (plus the running requests), so by
the time a session comes back its prefix has been evicted from the device. Three engines that differ
only in the cache run the same trace: no prefix cache, the device tier alone, and the device tier
plus `host_cache_bytes` of host memory. Measured: hit rate, mean TTFT of later turns, bytes spilled
and restored, the host time of those copies against a memory roofline (each byte read once and
written once: 2 x bytes / the read + write bandwidth of a large elementwise copy measured in the same
process), and whether the greedy responses agree across the three engines.
Compile time is excluded (all engines warm up first and share compiled programs).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.types import SamplingParams  # noqa: E402
from serving import machine_info, mean, measure_bandwidth, pct, trace_bench_start, write_result  # noqa: E402


def run_round_robin(engine: Engine, docs, users, sp, concurrency: int) -> list[dict]:
    """Every session's turn t, `concurrency` requests in flight, then turn t + 1; per-request records."""
    prompts = [list(d) for d in docs]
    records = []
    for t in range(len(users[0])):
        queue = list(range(len(docs)))
        live = {}
        while queue or live:
            while queue and len(live) < concurrency:
                s = queue.pop(0)
                live[engine.add_request(prompts[s], sp, request_id=f"s{s}-t{t}")] = s
            for o in engine.step():
                if o.finished:
                    s = live.pop(o.request_id)
                    records.append(dict(session=s, turn=t, prompt_len=len(prompts[s]), ttft=o.metrics.ttft,
                                        cached=o.num_cached_tokens, tokens=list(o.token_ids)))
                    prompts[s] = prompts[s] + list(o.token_ids) + users[s][t]
    return records


def summarize(records: list[dict], wall: float) -> dict:
    later = [r["ttft"] for r in records if r["turn"] > 0]
    ptok = sum(r["prompt_len"] for r in records)
    return dict(wall_s=wall, requests=len(records), prompt_tokens=ptok,
                cached_tokens=sum(r["cached"] for r in records),
                hit_rate=sum(r["cached"] for r in records) / ptok,
                ttft_mean_s=mean([r["ttft"] for r in records]), ttft_mean_later_turns_s=mean(later),
                ttft_p50_later_turns_s=pct(later, 50), ttft_p99_later_turns_s=pct(later, 99))


def main(argv=None):
    args, name, out_path, log, t_start = trace_bench_start("host_cache", __doc__, argv)
    q = args.quick
    P = dict(sessions=4 if q else 8, turns=2 if q else 3, concurrency=2, doc_len=(100, 160) if q else (320, 448),
             user_len=(8, 16), response_len=8 if q else 16, resident_sessions=1 if q else 2)
    mml, ps, chunk = (256, 16, 16) if q else (768, 16, 64)
    result = dict(benchmark="host_cache", quick=q, machine=machine_info(), model=name, trace_params=P)
    model = k3jax.load_model(name, dtype="float32", seed=args.seed)
    from serve.memory import ArenaLayout
    lay = ArenaLayout.plan(model.cfg, 1 << 30, ps, model.dtype)
    longest = P["doc_len"][1] + P["turns"] * (P["user_len"][1] + P["response_len"])
    per_session = lay.slot_units * 2 + -(-longest // ps) * lay.num_mla_layers  # working slot + a checkpoint
    units = 2 + lay.slot_units + (P["concurrency"] + P["resident_sessions"]) * per_session
    cache_bytes = units * lay.unit_bytes
    host_bytes = 2 * P["sessions"] * per_session * lay.unit_bytes * 2  # room for every session, twice over
    ecfg = dict(max_model_len=mml, page_size=ps, cache_bytes=cache_bytes, max_num_seqs=P["concurrency"],
                prefill_chunk=chunk, max_prefill_seqs=P["concurrency"],
                max_num_batched_tokens=P["concurrency"] * (chunk + 1), decode_buckets=(P["concurrency"],),
                prefill_buckets=(P["concurrency"],), context_buckets=(mml // ps,), checkpoint_interval=256,
                decode_checkpoint_interval=chunk, seed=args.seed)
    result["engine_config"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in ecfg.items()}
    result["host_cache_bytes"] = host_bytes
    result["arena"] = dict(bytes=cache_bytes, unit_bytes=lay.unit_bytes, slot_units=lay.slot_units,
                           slot_bytes=lay.slot_units * lay.unit_bytes, session_units=per_session)
    log(f"{name}: arena {cache_bytes / 2**20:.1f} MiB (a session needs {per_session} units of "
        f"{lay.unit_bytes} B), host tier {host_bytes / 2**20:.1f} MiB")

    variants = {"no_cache": dict(enable_prefix_caching=False), "device": {}, "device_host": dict(host_cache_bytes=host_bytes)}
    engines = {}
    t0 = time.perf_counter()
    for k, extra in variants.items():
        engines[k] = Engine(model, EngineConfig(**ecfg, **extra), warmup=True, progress=False)
    result["warmup_compile_s"] = time.perf_counter() - t0
    log(f"engines ready ({result['warmup_compile_s']:.1f} s)")

    rng = np.random.default_rng(args.seed)
    docs = [rng.integers(0, 256, int(rng.integers(*P["doc_len"]))).tolist() for _ in range(P["sessions"])]
    users = [[rng.integers(0, 256, int(rng.integers(*P["user_len"]))).tolist() for _ in range(P["turns"])]
             for _ in range(P["sessions"])]
    sp = SamplingParams(temperature=0.0, max_tokens=P["response_len"], ignore_eos=True)
    recs = {}
    for k, eng in engines.items():
        t0 = time.perf_counter()
        recs[k] = run_round_robin(eng, docs, users, sp, P["concurrency"])
        st = eng.stats()
        result[k] = dict(summarize(recs[k], time.perf_counter() - t0), compiles_after_warmup=st["compiles_after_warmup"],
                         preemptions=st["preemptions"], prefix_cache=st["prefix_cache"])
        log(f"{k}: hit rate {result[k]['hit_rate']:.3f}, mean TTFT later turns "
            f"{result[k]['ttft_mean_later_turns_s']:.3f} s, wall {result[k]['wall_s']:.1f} s")
    key = lambda r: (r["session"], r["turn"])  # noqa: E731
    ref = {key(r): r["tokens"] for r in recs["no_cache"]}
    prev = {key(r): r["prompt_len"] + len(r["tokens"]) for r in recs["no_cache"]}  # what turn t + 1 repeats
    reusable = sum(min(r["prompt_len"] - 1, prev[(r["session"], r["turn"] - 1)]) for r in recs["no_cache"] if r["turn"])
    result["trace_reusable_fraction"] = reusable / sum(r["prompt_len"] for r in recs["no_cache"])
    for k in ("device", "device_host"):
        same = sum(1 for r in recs[k] if ref[key(r)] == r["tokens"])
        result[k]["identical_greedy_responses"] = f"{same}/{len(ref)}"
    pc = result["device_host"]["prefix_cache"]
    bw = measure_bandwidth(256, 5)
    result["bandwidth"] = bw
    copy_bps = bw.get("copy_GBps", bw.get("read_GBps", 0.0)) * 1e9
    moved = pc["host_bytes_stored"] + pc["host_bytes_restored"]
    secs = pc["host_spill_seconds"] + pc["host_restore_seconds"]
    result["transfers"] = dict(bytes_stored=pc["host_bytes_stored"], bytes_restored=pc["host_bytes_restored"],
                               seconds=secs, GBps=moved / secs / 1e9 if secs else None,
                               roofline_s=2 * moved / copy_bps if copy_bps else None,
                               over_roofline=secs / (2 * moved / copy_bps) if copy_bps and moved else None)
    result["ttft_later_turns_ratio"] = dict(
        device_over_no_cache=result["device"]["ttft_mean_later_turns_s"] / result["no_cache"]["ttft_mean_later_turns_s"],
        device_host_over_no_cache=result["device_host"]["ttft_mean_later_turns_s"] / result["no_cache"]["ttft_mean_later_turns_s"],
        device_host_over_device=result["device_host"]["ttft_mean_later_turns_s"] / result["device"]["ttft_mean_later_turns_s"])
    log(f"trace reusable fraction {result['trace_reusable_fraction']:.3f}; transfers {result['transfers']}")
    log(f"TTFT ratios {result['ttft_later_turns_ratio']}")
    return write_result(result, out_path, t_start, log)


if __name__ == "__main__":
    main()
