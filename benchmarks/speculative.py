"""Speculative decoding (n-gram drafts, serve/speculative.py) on the CPU host: what a verify step costs
and what it returns.

    python benchmarks/speculative.py           # k3-small, ~6-8 min on the 2-core host; writes results/speculative-cpu.json
    python benchmarks/speculative.py --quick   # tiny-k3, ~1 min (temp dir)

What is measured
----------------
* One `Engine` (k3-small, `speculative_config={"method": "ngram", "num_speculative_tokens": 3}`; decode
  buckets 1 / 8 / 32, each with its verify program of 4 tokens per row, all compiled at start-up), waves
  of c = 1 / 8 / 32 greedy requests (64-192 random prompt tokens, 48 generated), each wave run in four
  modes, interleaved, on the same prompts:
  - `plain`: no drafts (the engine's ordinary decode program);
  - `oracle`: drafts that are the plain run's own continuation, so every draft is accepted (the best
    case: 4 tokens per verify step);
  - `half`: the same drafts with the second one wrong, so 1 of 3 is accepted (2 tokens per step);
  - `ngram`: the real proposer. These models have random weights: their text does not quote the
    prompt or itself the way code edits and retrieval answers do, so few proposals exist and fewer are
    accepted; this row measures what proposals that miss cost.
  These four run with the engine's draft gate off (every proposal verified: the raw cost). The
  `*_gated` modes run `half` and `ngram` with the gate on (`speculative_config.adaptive`, the default:
  drafts only where their expected accepted tokens pay for the verify step's measured extra cost).
  Every mode's tokens are compared with `plain`'s (they must be equal: speculation changes the speed,
  never the output). Reported: generated tok/s over the wave (median of the reps; prefill included),
  decode tok/s (tokens / time of the decode-only steps: what speculation changes), median step time of
  decode-only steps with all c rows (verify steps in the draft modes), tokens per such step, acceptance.
* The verify step against its floor on this machine: bytes (every weight once, the experts touched by
  c x 4 tokens, the KDA states read and written twice: the verify pass and the commit, the MLA context)
  / the bandwidth, and weight FLOPs (2 x active params x c x 4) / the matmul rate, both measured in the
  same process; the larger of the two is the floor.
* Peer: HF transformers' prompt-lookup decoding (`generate(prompt_lookup_num_tokens=3)`) on a small
  Kimi-Linear checkpoint it writes, in the same run: transformers 5.23 refuses it for this model family
  (stateful KDA cache), which the run records verbatim.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from serving import (active_matmul_params, arena_budget, decode_bytes, machine_info, measure_bandwidth,  # noqa: E402
                     measure_matmul_rate, med, prompts_for, write_result)
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.types import SamplingParams  # noqa: E402

K = 3
MODES = ("plain", "oracle", "half", "ngram", "half_gated", "ngram_gated")


def run_wave(engine: Engine, prompts, sp: SamplingParams) -> dict:
    """Submit the prompts at once and step to completion; decode-only step times with all rows."""
    steps, done = [], {}
    t0 = time.perf_counter()
    rids = [engine.add_request(p, sp) for p in prompts]
    c0 = dict(engine.counters)
    while engine.has_unfinished():
        before = dict(engine.counters)
        s0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - s0
        d = {k: engine.counters[k] - before[k] for k in ("decode_steps", "prefill_steps", "generation_tokens")}
        running = engine.stats()["num_requests_running"] if d["decode_steps"] else 0
        if d["decode_steps"] and not d["prefill_steps"]:
            steps.append((dt, d["generation_tokens"], running))
        for o in outs:
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    wall = time.perf_counter() - t0
    gen = sum(len(done[r]) for r in rids)
    c = {k: engine.counters[k] - c0[k] for k in engine.counters}
    return dict(wall_s=wall, gen_tokens=gen, gen_tok_s=gen / wall, steps=steps, tokens=[done[r] for r in rids],
                drafts=c["spec_decode_num_draft_tokens"], accepted=c["spec_decode_num_accepted_tokens"])


def proposer(engine: Engine, mode: str, want: dict):
    ngram = Engine._propose.__get__(engine)
    if mode == "ngram":
        return ngram
    if mode == "plain":
        return lambda s, k: []

    def oracle(s, k):
        d = list(want[tuple(s.prompt_ids)][len(s.output_ids):][:k])
        if mode == "half" and len(d) > 1:
            d[1] = (d[1] + 1) % engine.cfg.vocab_size
        return d
    return oracle


def verify_floor(model, c: int, ctx: float, bw: float, rate: float, page_size: int) -> dict:
    t = c * (1 + K)
    b = decode_bytes(model, t, ctx, page_size)  # experts touched by c x (1 + K) tokens
    kda_rows = decode_bytes(model, c, ctx, page_size)["kda_state_bytes"]
    total = b["weights_bytes"] + 2 * kda_rows + b["mla_cache_bytes"] / (1 + K)
    flops = 2 * active_matmul_params(model) * t
    return dict(bytes=total, memory_s=total / (bw * 1e9), flops=flops, compute_s=flops / rate,
                floor_s=max(total / (bw * 1e9), flops / rate))


def hf_peer(log) -> dict:
    """transformers' prompt-lookup decoding on a small Kimi-Linear checkpoint (what a user of HF gets)."""
    try:
        import torch
        from serving import build_kimi_linear
    except Exception as e:  # pragma: no cover
        return dict(status="not run", error=repr(e))
    import transformers
    tmp = tempfile.mkdtemp(prefix="k3jax_spec_hf_")
    _, m, _ = build_kimi_linear(tmp, quick=True)
    prompt = torch.tensor([list(range(3, 43))])
    out = dict(transformers=transformers.__version__, model="KimiLinearForCausalLM (4 layers, random)")
    with torch.no_grad():
        try:
            m.generate(prompt, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=K, pad_token_id=0)
            out["status"] = "ran"
        except Exception as e:
            out.update(status="refused", error=f"{type(e).__name__}: {e}")
    log(f"HF prompt lookup: {out['status']} {out.get('error', '')}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    log = lambda s: print(f"[{time.perf_counter() - t_start:7.1f}s] {s}", flush=True)  # noqa: E731
    quick = args.quick
    out_path = Path(args.out) if args.out else (
        Path(tempfile.gettempdir()) / "speculative-cpu-quick.json" if quick else REPO / "benchmarks/results/speculative-cpu.json")
    result = dict(benchmark="speculative", quick=quick, machine=machine_info(), num_speculative_tokens=K)
    bw = measure_bandwidth(64 if quick else 512, 3 if quick else 7)
    rate = measure_matmul_rate(512 if quick else 2048)
    result.update(bandwidth=bw, matmul_flops_per_s=rate)
    log(f"bandwidth {bw['GBps']:.1f} GB/s, matmul {rate / 1e9:.0f} GFLOP/s")

    name = "tiny-k3" if quick else "k3-small"
    model = k3jax.load_model(name, dtype="float32", seed=0)
    conc = (1, 4) if quick else (1, 8, 32)
    reps = {c: 1 for c in conc} if quick else {1: 3, 8: 2, 32: 2}
    gen, mml = (16, 128) if quick else (48, 256)
    ecfg = dict(max_model_len=mml, page_size=16, max_num_seqs=conc[-1], prefill_chunk=64, max_prefill_seqs=4,
                max_num_batched_tokens=512, decode_buckets=conc, prefill_buckets=(4,), context_buckets=(mml // 16,),
                enable_prefix_caching=False, measure_moe_time=False,
                speculative_config=dict(method="ngram", num_speculative_tokens=K))
    ecfg["cache_bytes"] = arena_budget(model, 16, mml, conc[-1])
    t0 = time.perf_counter()
    eng = Engine(model, EngineConfig(**ecfg), progress=False)
    log(f"{name}: {len(eng.bucket_shapes())} programs compiled in {time.perf_counter() - t0:.0f} s; verify / decode "
        f"step cost measured at warm-up {eng.gate.cost}")
    gate = eng.gate
    result["verify_cost_at_warmup"] = dict(gate.cost)
    sp = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    rng = np.random.default_rng(0)
    lo, hi = (16, 48) if quick else (64, 192)
    result["workload"] = dict(model=name, concurrency=list(conc), reps=reps, max_tokens=gen, greedy=True,
                              prompt_len_range=[lo, hi], engine=dict(ecfg, cache_bytes=ecfg["cache_bytes"]))
    rows = {}
    for c in conc:
        waves = {m: [] for m in MODES}
        for r in range(reps[c]):
            prompts = prompts_for(rng, c, lo, hi, 256)
            want = None
            for mode in MODES:  # interleaved: all modes see the same machine load
                eng._propose = proposer(eng, mode.replace("_gated", ""), want or {})
                eng.gate = gate if mode.endswith("_gated") else None
                w = run_wave(eng, prompts, sp)
                if mode == "plain":
                    want = {tuple(p): t for p, t in zip(prompts, w["tokens"])}
                w["equal_to_plain"] = all(t == want[tuple(p)] for p, t in zip(prompts, w["tokens"]))
                waves[mode].append(w)
        ctx = (lo + hi) / 2 + gen / 2
        cell = dict(floor=verify_floor(model, c, ctx, bw["GBps"], rate, 16))
        for mode, ws in waves.items():
            full = [(dt, g) for w in ws for dt, g, running in w["steps"] if running == c]
            drafted, acc = sum(w["drafts"] for w in ws), sum(w["accepted"] for w in ws)
            dec = [(dt, g) for w in ws for dt, g, _ in w["steps"]]
            cell[mode] = dict(gen_tok_s=med([w["gen_tok_s"] for w in ws]),
                              decode_tok_s=(sum(g for _, g in dec) / sum(dt for dt, _ in dec)) if dec else None,
                              gen_tok_s_reps=[round(w["gen_tok_s"], 2) for w in ws],
                              step_median_s=med([dt for dt, _ in full]),
                              tokens_per_step=(sum(g for _, g in full) / len(full) / c) if full else None,
                              draft_tokens=drafted, accepted_tokens=acc,
                              acceptance=acc / drafted if drafted else None,
                              outputs_equal_plain=all(w["equal_to_plain"] for w in ws))
        p = cell["plain"]
        cell["gate_p_after"] = list(gate.p)
        for mode in MODES[1:]:
            m = cell[mode]
            m["speedup_vs_plain"] = m["gen_tok_s"] / p["gen_tok_s"]
            m["decode_speedup_vs_plain"] = m["decode_tok_s"] / p["decode_tok_s"] if m["decode_tok_s"] else None
            m["step_over_plain_step"] = (m["step_median_s"] / p["step_median_s"]
                                         if m["step_median_s"] and p["step_median_s"] else None)
        cell["oracle"]["step_over_floor"] = (cell["oracle"]["step_median_s"] / cell["floor"]["floor_s"]
                                             if cell["oracle"]["step_median_s"] else None)
        rows[c] = cell
        log(f"c={c}: " + ", ".join(f"{m} {cell[m]['gen_tok_s']:.1f} ({cell[m]['decode_tok_s'] or 0:.1f}) tok/s step {1e3 * (cell[m]['step_median_s'] or 0):.1f} ms"
                                   f" acc {cell[m]['acceptance'] if cell[m]['acceptance'] is None else round(cell[m]['acceptance'], 2)}"
                                   f" eq {cell[m]['outputs_equal_plain']}" for m in MODES)
            + f"; verify floor {1e3 * cell['floor']['floor_s']:.1f} ms")
    st = eng.stats()
    result.update(results=rows, compiles_after_warmup=st["compiles_after_warmup"],
                  spec_decode_accepted_per_pos=st["spec_decode_accepted_per_pos"])
    result["hf_prompt_lookup"] = hf_peer(log)
    return write_result(result, out_path, t_start, log)


if __name__ == "__main__":
    main()
