"""Deterministic inference on CPU: what it costs, and whether a request's bits then stop depending on its batch.

    python benchmarks/deterministic.py            # k3-small, ~6 min quiet
    python benchmarks/deterministic.py --quick    # tiny-k3 (writes to the temp dir)

Two engines on the same weights: the default buckets (decode rows 1, 4, 16, 32; prefill rows 1 and 4; context
1, 4, 16, 32 pages) and `enable_deterministic_inference=True` (decode programs of 16 and 32 rows run as tiles of
8 rows, every context bucket, one 4-row prefill program, all compiled without XLA:CPU's library fusions of
reductions). Waves of c = 1, 8 and 32 requests (64-128 random prompt tokens, 32 greedy tokens), interleaved
between the engines and repeated: generated tokens/s and the median decode step. Then the check: a probe request
alone, first in a full batch, and last in a full batch whose prompts arrive a few steps apart -- its greedy
tokens and the bits of its logprobs on each engine."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.types import SamplingParams  # noqa: E402
from serving import bench_start, med, run_wave, write_result  # noqa: E402


def probe(engine: Engine, target: list[int], others: list[list[int]], gen: int) -> dict:
    """The target's (tokens, logprobs) alone, first in a batch, and last in a batch arriving a few steps apart."""
    sp = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True, logprobs=0)

    def run(prompts, at, stagger=False):
        engine.reset_prefix_cache()
        ids, done = [], {}
        for i, p in enumerate(prompts):
            ids.append(engine.add_request(p, sp))
            if stagger and i % 4 == 3:
                for _ in range(2):
                    done.update({o.request_id: o for o in engine.step() if o.finished})
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        c = done[ids[at]].outputs[0]
        return c.token_ids, np.asarray([lp.chosen.logprob for lp in c.logprobs])

    alone = run([target], 0)
    out = {}
    for name, (prompts, at, stagger) in {"first in a full batch": ([target] + others, 0, False),
                                         "last in a staggered full batch": (others + [target], len(others), True)}.items():
        toks, lps = run(prompts, at, stagger)
        out[name] = dict(tokens_equal=toks == alone[0], logprobs_bitwise_equal=bool((lps == alone[1]).all()),
                         logprob_max_abs_diff=float(np.abs(lps - alone[1]).max()))
    return out


def main(argv=None):
    args, out_path, log, t_start, result = bench_start("deterministic", __doc__, argv)
    quick = args.quick
    model = k3jax.load_model("tiny-k3" if quick else "k3-small", seed=0)
    top, gen, reps = (8, 8, 1) if quick else (32, 32, 3)
    kw = dict(max_model_len=512, page_size=16, cache_bytes=(64 if quick else 384) << 20, max_num_seqs=top,
              max_prefill_seqs=4, measure_moe_time=False)
    engines = {"default buckets": Engine(model, EngineConfig(**kw), progress=False),
               "deterministic": Engine(model, EngineConfig(**kw, enable_deterministic_inference=True), progress=False)}
    result["buckets"] = {k: dict(decode=e.decode_buckets, prefill=e.prefill_buckets, context=e.context_buckets)
                         for k, e in engines.items()}
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    conc = (1, 4, 8) if quick else (1, 8, 32)
    runs = {(k, c): [] for k in engines for c in conc}
    for _ in range(reps):
        for c in conc:
            prompts = [list(map(int, rng.integers(3, model.cfg.vocab_size, rng.integers(64, 129)))) for _ in range(c)]
            for k, e in engines.items():
                e.reset_prefix_cache()
                runs[(k, c)].append(run_wave(e, prompts, sp))
    result["waves"] = {}
    for (k, c), ws in runs.items():
        steps = [dt for w in ws for dt, rows in w["decode_only_steps"] if rows == c]
        row = dict(gen_tok_s=med([w["gen_tok_s"] for w in ws]), decode_step_median_s=med(steps),
                   decode_steps=len(steps))
        result["waves"][f"{k}, c={c}"] = row
        log(f"  {k}, c = {c}: {row['gen_tok_s']:.1f} gen tok/s, decode step "
            f"{(row['decode_step_median_s'] or 0) * 1e3:.1f} ms")
    same = [a == b for c in conc for w1, w2 in zip(runs[("default buckets", c)], runs[("deterministic", c)])
            for a, b in zip(w1["token_ids"], w2["token_ids"])]
    result["greedy_tokens_equal_between_engines"] = f"{sum(same)}/{len(same)}"
    target = list(map(int, rng.integers(3, model.cfg.vocab_size, 100)))
    others = [list(map(int, rng.integers(3, model.cfg.vocab_size, rng.integers(20, 200)))) for _ in range(top - 1)]
    result["probe"] = {k: probe(e, target, others, gen) for k, e in engines.items()}
    for k, p in result["probe"].items():
        for case, r in p.items():
            log(f"  probe on {k}, {case}: tokens equal {r['tokens_equal']}, logprobs bitwise "
                f"{r['logprobs_bitwise_equal']} (max diff {r['logprob_max_abs_diff']:.2e})")
    result["compiles_after_warmup"] = {k: e.stats()["compiles_after_warmup"] for k, e in engines.items()}
    write_result(result, out_path, t_start, log)


if __name__ == "__main__":
    main()
