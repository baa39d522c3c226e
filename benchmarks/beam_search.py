"""Beam search on CPU: the engine's forked beams against vLLM v1's resubmission and HF transformers.

    python benchmarks/beam_search.py            # an HF-written Kimi-Linear checkpoint (small), ~3 min
    python benchmarks/beam_search.py --quick    # test-size checkpoint, ~1 min (writes to the temp dir)

One checkpoint (Kimi-Linear's structure at small size, written by transformers), P prompts of L tokens,
width W, G tokens, no EOS (`ignore_eos`; HF's `eos_token_id=None`), three ways:

1. engine: the P beam searches at once (`BeamSearchParams`); beams fork inside the engine (shared pages,
   copy-on-write partial page and KDA slot), so every round is one decode row per beam.
2. vLLM v1's algorithm on the same engine (prefix cache on, default intervals): every round, each live
   beam is submitted as a new one-token request (prompt + its tokens, `logprobs = 2W`) and the prefix cache
   finds what it can; the same selection (`serve.beam_search.expand`). On a hybrid model the cache can
   resume a KDA state only at its checkpoints, so each request recomputes the tokens since the deepest one:
   reported as prefill tokens per round.
3. HF transformers' `generate(num_beams=W, num_return_sequences=W)` on the same prompts (torch CPU), the
   peer.

Reported: wall time and beam tokens/s (P x W x G / wall) of each, whether the hypotheses agree with the
engine's, the engine's median decode step (P x W rows) against its memory roofline (the weights and cache
it reads / bandwidth measured in the same process, `serving.decode_bytes`).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from serve.beam_search import BeamSearchParams, Hypothesis, best, expand  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.types import SamplingParams  # noqa: E402
from serving import bench_start, build_kimi_linear, decode_bytes, med, write_result  # noqa: E402


def engine_beams(eng: Engine, prompts, params) -> tuple[float, list, list[float]]:
    """All searches at once -> (wall s, outputs, wall of every decode-only step)."""
    t0 = time.perf_counter()
    rids = [eng.add_request(p, params) for p in prompts]
    done, steps = {}, []
    while eng.has_unfinished():
        d, p, s0 = eng.counters["decode_steps"], eng.counters["prefill_steps"], time.perf_counter()
        outs = eng.step()
        if eng.counters["decode_steps"] > d and eng.counters["prefill_steps"] == p:
            steps.append(time.perf_counter() - s0)
        for o in outs:
            if o.finished:
                done[o.request_id] = o
    return time.perf_counter() - t0, [done[r].outputs for r in rids], steps


def resubmitted_beams(eng: Engine, prompts, width: int, gen: int) -> tuple[float, list, int, int]:
    """vLLM v1's `LLM.beam_search` loop on the engine -> (wall s, hypotheses per prompt, requests, prefill
    tokens computed (prompt tokens not taken from the prefix cache))."""
    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * width, ignore_eos=True)
    beams = [[Hypothesis()] for _ in prompts]
    t0, requests, computed = time.perf_counter(), 0, 0
    for _ in range(gen):
        rids = {}
        for i, (p, bs) in enumerate(zip(prompts, beams)):
            for j, h in enumerate(bs):
                rids[eng.add_request(p + list(h.tokens), sp)] = (i, j)
        outs = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o
        requests += len(rids)
        rows = [[] for _ in prompts]
        for rid, (i, j) in rids.items():
            o = outs[rid]
            computed += len(o.prompt_token_ids) - o.num_cached_tokens
            top = o.outputs[0].logprobs[0].top
            rows[i].append((j, (beams[i][j], [t.token_id for t in top], [t.logprob for t in top])))
        for i, p in enumerate(prompts):
            live, _ = expand([r for _, r in sorted(rows[i], key=lambda x: x[0])], width, frozenset(), len(p), 1.0)
            beams[i] = [h for _, h in live]
    wall = time.perf_counter() - t0
    return wall, [best(bs, width, len(p), 1.0) for p, bs in zip(prompts, beams)], requests, computed


def main(argv=None):
    args, out, log, t_start, result = bench_start("beam_search", __doc__, argv)
    import torch

    quick = args.quick
    P, W, L, G = (2, 2, 24, 6) if quick else (4, 4, 96, 32)
    tmp = tempfile.mkdtemp()
    path, hf, _ = build_kimi_linear(f"{tmp}/ckpt", quick)
    model = k3jax.load_model(path)
    rows = P * W
    ecfg = dict(max_model_len=256, page_size=16, cache_bytes=(64 if quick else 256) << 20, max_num_seqs=rows,
                decode_buckets=(rows,), prefill_buckets=(4,), context_buckets=(16,), max_num_batched_tokens=512,
                max_logprobs=2 * W)
    t0 = time.perf_counter()
    eng = Engine(model, EngineConfig(**ecfg), progress=False)
    log(f"engine warm in {time.perf_counter() - t0:.1f} s")
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(3, model.cfg.vocab_size - 3, L))) for _ in range(P)]
    params = BeamSearchParams(W, G, ignore_eos=True)
    engine_beams(eng, prompts, BeamSearchParams(W, 2, ignore_eos=True))  # first use of every path
    eng.reset_prefix_cache()
    runs = []
    for _ in range(1 if quick else 3):
        eng.reset_prefix_cache()
        runs.append(engine_beams(eng, prompts, params))
    wall = med([r[0] for r in runs])
    outs = runs[0][1]
    steps = [s for r in runs for s in r[2]]
    roof = decode_bytes(eng.model, rows, L + G / 2, 16)["total_bytes"] / (result["bandwidth"]["GBps"] * 1e9)
    forks = eng.counters["beam_forks"]
    log(f"engine: {wall:.2f} s, {rows * G / wall:.1f} beam tok/s, decode step {med(steps) * 1e3:.1f} ms "
        f"({med(steps) / roof:.2f}x its roofline {roof * 1e3:.1f} ms), forks {forks}")

    eng.reset_prefix_cache()
    r_wall, r_hyps, r_reqs, r_computed = resubmitted_beams(eng, prompts, W, G)
    same_resub = sum(tuple(c.token_ids) == h.tokens for o, hs in zip(outs, r_hyps) for c, h in zip(o, hs))
    log(f"resubmission: {r_wall:.2f} s, {rows * G / r_wall:.1f} beam tok/s, {r_reqs} requests, "
        f"{r_computed} prefill tokens ({r_computed / (P * G):.0f} per prompt per round); "
        f"hypotheses equal {same_resub}/{rows}")

    hf_walls, same_hf = [], 0
    for rep in range(1 if quick else 2):
        t0 = time.perf_counter()
        with torch.no_grad():
            g = hf.generate(torch.tensor(prompts), num_beams=W, num_return_sequences=W, max_new_tokens=G,
                            do_sample=False, eos_token_id=None, pad_token_id=0, length_penalty=1.0)
        hf_walls.append(time.perf_counter() - t0)
    hf_hyps = g[:, L:].tolist()
    same_hf = sum(c.token_ids == hf_hyps[i * W + k] for i, o in enumerate(outs) for k, c in enumerate(o))
    hf_wall = med(hf_walls)
    log(f"HF generate(num_beams={W}): {hf_wall:.2f} s, {rows * G / hf_wall:.1f} beam tok/s; "
        f"hypotheses equal {same_hf}/{rows}")
    result.update(
        checkpoint="Kimi-Linear structure (HF-written), " + ("test size" if quick else "hidden 512, 3 KDA + 1 MLA"),
        prompts=P, width=W, prompt_len=L, gen=G, rows_per_decode_step=rows,
        engine=dict(wall_s=wall, walls_s=[r[0] for r in runs], beam_tok_s=rows * G / wall,
                    decode_step_median_s=med(steps), decode_steps=len(steps), roofline_s=roof,
                    step_over_roofline=med(steps) / roof, forks=forks,
                    compiles_after_warmup=eng.stats()["compiles_after_warmup"]),
        resubmission=dict(wall_s=r_wall, beam_tok_s=rows * G / r_wall, requests=r_reqs,
                          prefill_tokens=r_computed, prefill_tokens_per_prompt_round=r_computed / (P * G),
                          hypotheses_equal_engine=same_resub, engine_speedup=r_wall / wall),
        hf=dict(wall_s=hf_wall, walls_s=hf_walls, beam_tok_s=rows * G / hf_wall, hypotheses_equal_engine=same_hf,
                engine_speedup=hf_wall / wall),
        hypotheses=rows)
    write_result(result, out, t_start, log)


if __name__ == "__main__":
    main()
