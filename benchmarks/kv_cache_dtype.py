"""fp8 MLA latent cache (`kv_cache_dtype="fp8"`): capacity, accuracy and speed against the model dtype.

    python benchmarks/kv_cache_dtype.py           # the recorded run, ~5 min quiet
    python benchmarks/kv_cache_dtype.py --quick   # smoke run on tiny presets (~1 min with compiles)

1. Capacity (arithmetic from `ArenaLayout.plan`, no device): bytes per token and MLA layer, and how
   many sequences of a given context one rank's arena holds, for K3 at full size (bf16, KDA heads
   split over 8 tensor-parallel ranks, every rank keeping every MLA page) and for k3-small (fp32).
2. Accuracy, against HF transformers: an HF-written random Kimi-Linear checkpoint (float32, the
   structure of benchmarks/serving.py) runs the same prompts in three places: HF `generate` (the
   peer, its cache in float32), the engine with the model-dtype cache and with the fp8 cache.
   Reported: greedy tokens identical to HF (requests, and tokens before the first divergence), and
   teacher-forced logprobs (every position of prompt + HF's continuation, through
   `prompt_logprobs`): mean / max |delta| against the model-dtype engine, and how often both agree
   on whether the given token is the most likely one.
3. Capacity and speed, measured (k3-small on CPU): one arena budget, a KV-bound wave (long prompts,
   more requests than the model-dtype arena holds at once), each engine running as many requests at
   once as its arena holds at full length; peak running requests, preemptions, wall time, tokens/s,
   decode step median, against the latent bytes a decode step must read. Then the fp8 wave again with
   max_num_seqs = every request, without and with the admission look-ahead
   (`schedule_conservativeness` 0 / 1): preemptions and wall time.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO / "tests"))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from k3jax.config import PRESETS  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.memory import ArenaLayout  # noqa: E402
from serve.types import SamplingParams  # noqa: E402
from serving import bench_start, build_kimi_linear, hf_generate, med, run_wave, track_peak_running, write_result  # noqa: E402

KINDS = ("auto", "fp8")


def layout_capacity(lay: ArenaLayout, contexts: list[int]) -> dict:
    """What one arena layout costs a request (its state slot, its latent bytes per token over every MLA layer) and
    how many requests of each context length it holds: the capacity rows of this benchmark and kda_state_dtype.py."""
    return dict(slot_bytes=lay.slot_units * lay.unit_bytes,
                mla_bytes_per_token=lay.latent_words * 4 * lay.num_mla_layers,
                sequences={str(c): lay.sequences_at(c) for c in contexts})


def capacity(cfg, dtype, budget: int, page: int, ranks: int, contexts: list[int]) -> dict:
    """Sequences of each context length one rank's arena holds (a slot + every MLA layer's pages each)."""
    out = {}
    for kind in KINDS:
        lay = ArenaLayout.plan(cfg, budget, page, dtype, ranks, kind)
        out[kind] = dict(bytes_per_token_per_layer=lay.latent_words * 4, units=lay.num_units,
                         **layout_capacity(lay, contexts))
    out["token_ratio"] = out["auto"]["bytes_per_token_per_layer"] / out["fp8"]["bytes_per_token_per_layer"]
    return out


def engine_for(model, max_len: int, seqs: int, budget: int = 64 << 20, page: int = 16, buckets: tuple = (),
               **cfg) -> Engine:
    """The engines of this benchmark and kda_state_dtype.py: `seqs` requests at once (decode buckets `buckets`,
    default `(seqs,)`), chunks of 64, no prefix cache, one logprob; `cfg`: the other EngineConfig fields (the
    cache dtypes compared)."""
    return Engine(model, EngineConfig(max_model_len=max_len, page_size=page, cache_bytes=budget, max_num_seqs=seqs,
                                      prefill_chunk=64, max_prefill_seqs=4, decode_buckets=buckets or (seqs,),
                                      prefill_buckets=(4,), max_logprobs=1, enable_prefix_caching=False, **cfg),
                  progress=False)


@contextlib.contextmanager
def hf_reference(quick: bool, n: int, prompt_len: int, gen: int):
    """The HF-written Kimi-Linear checkpoint loaded in k3jax, `n` random prompts [n, prompt_len] and HF's greedy
    continuations [n, gen] -> (rng, model, prompts, hf_out, result head); `rng` goes on after the prompts' draws."""
    rng = np.random.default_rng(3)
    with tempfile.TemporaryDirectory() as tmp:
        path, hf_model, _ = build_kimi_linear(tmp, quick)
        model = k3jax.load_model(path)
        prompts = rng.integers(0, 500, (n, prompt_len)).tolist()
        t_hf, hf_out = hf_generate(hf_model, prompts, gen)
        res = dict(model="Kimi-Linear (HF checkpoint, float32)", requests=n, prompt_len=prompt_len, gen=gen,
                   hf_generate_s=t_hf)
        yield rng, model, prompts, hf_out.tolist(), res


def teacher_forced(engine: Engine, seqs: list[list[int]]) -> list[list[tuple[float, int]]]:
    """Per sequence, per position after the first: (logprob of the given token, its rank)."""
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    ids = [engine.add_request(s, sp) for s in seqs]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [[(lp.chosen.logprob, lp.chosen.rank) for lp in done[i].prompt_logprobs[1:]] for i in ids]


def against_hf(engine: Engine, prompts: list[list[int]], hf_out: list[list[int]]) -> dict:
    """Greedy tokens of `engine` against HF's continuations `hf_out`, and the teacher-forced (logprob, rank)
    of every position of prompt + HF's continuation (`lps`)."""
    gen = len(hf_out[0])
    wave = run_wave(engine, prompts, SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
    agree = [next((i for i, (a, b) in enumerate(zip(o, h)) if a != b), gen) for o, h in zip(wave["token_ids"], hf_out)]
    return dict(identical_to_hf=sum(a == gen for a in agree), tokens_before_divergence=agree,
                lps=teacher_forced(engine, [p + h for p, h in zip(prompts, hf_out)]))


def teacher_forced_delta(per: dict, base: str, other: str) -> dict:
    """|delta logprob| between two engines' teacher-forced positions (`per[k]["lps"]`), and how often both
    agree on whether the given token is the argmax."""
    a, b = (np.array([[x[0] for x in s] for s in per[k]["lps"]]) for k in (base, other))
    top1 = lambda k: np.array([[x[1] == 1 for x in s] for s in per[k]["lps"]])  # noqa: E731
    d = np.abs(a - b)
    return {"positions": int(d.size), "mean_abs_delta": float(d.mean()), "p99_abs_delta": float(np.percentile(d, 99)),
            "max_abs_delta": float(d.max()), f"mean_logprob_{base}": float(a.mean()),
            f"mean_logprob_{other}": float(b.mean()), "rank1_agreement": float((top1(base) == top1(other)).mean())}


def hf_summary(per: dict, base: str, other: str) -> dict:
    """Each engine's `against_hf` result (`per[k]`) without its logprobs, and the teacher-forced deltas of the two."""
    return {**{k: {f: v for f, v in r.items() if f != "lps"} for k, r in per.items()},
            "teacher_forced": teacher_forced_delta(per, base, other)}


def accuracy(quick: bool, n: int, prompt_len: int, gen: int, log) -> dict:
    with hf_reference(quick, n, prompt_len, gen) as (_, model, prompts, hf_out, res):
        per = {}
        for kind in KINDS:
            eng = engine_for(model, prompt_len + gen + 16, n, kv_cache_dtype=kind)
            per[kind] = against_hf(eng, prompts, hf_out)
            log(f"  {kind}: {per[kind]['identical_to_hf']}/{n} requests token-identical to HF")
        return dict(res, **hf_summary(per, "auto", "fp8"))


def full_length_capacity(model, kind: str, budget: int, page: int, tokens: int) -> int:
    """Requests of `tokens` tokens the arena holds at once (each: a state slot + its pages)."""
    return ArenaLayout.plan(model.cfg, budget, page, model.dtype, kv_cache_dtype=kind).sequences_at(tokens)


def kv_bound_wave(model, kind: str, budget: int, n: int, prompt_len: int, gen: int, page: int, bw: float,
                  seqs: int | None = None, conservativeness: float = 1.0) -> dict:
    """`n` requests through an arena of `budget` bytes, by default run with as many at once as it holds at
    full length (max_num_seqs set to that, as an operator would; more may be preempted and recomputed)."""
    seqs = seqs or min(n, full_length_capacity(model, kind, budget, page, prompt_len + gen))
    t0 = time.perf_counter()
    eng = engine_for(model, prompt_len + gen + page, seqs, budget, page, kv_cache_dtype=kind,
                     schedule_conservativeness=conservativeness)
    build = time.perf_counter() - t0
    prompts = np.random.default_rng(5).integers(0, 250, (n, prompt_len)).tolist()
    running = track_peak_running(eng)
    wave = run_wave(eng, prompts, SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
    lay = eng.layout
    steps = [dt for dt, rows in wave["decode_only_steps"]]
    decoded = sum(g for _, g in wave["decode_only_steps"])
    ctx = prompt_len + gen / 2
    peak = running["peak"]
    latent_read = peak * ctx * lay.latent_words * 4 * lay.num_mla_layers
    return dict(kv_cache_dtype=kind, cache_bytes=budget, max_num_seqs=seqs, schedule_conservativeness=conservativeness,
                build_s=build, units=lay.num_units,
                bytes_per_token_per_layer=lay.latent_words * 4, peak_running=peak,
                preemptions=eng.stats().get("preemptions", 0), wall_s=wave["wall_s"], gen_tok_s=wave["gen_tok_s"],
                total_tok_s=wave["total_tok_s"], decode_step_median_s=med(steps) if steps else None,
                decode_phase_tok_s=decoded / sum(steps) if steps else None,
                decode_steps=len(steps), latent_bytes_read_per_decode_step=latent_read,
                latent_read_roofline_s=latent_read / (bw * 1e9), compiles_after_warmup=eng.stats()["compiles_after_warmup"],
                token_ids=wave["token_ids"])


def main(argv=None):
    args, out, log, t_start, result = bench_start("kv_cache_dtype", __doc__, argv)
    bw = result["bandwidth"]
    ctxs = [8192, 32768, 131072]
    result["capacity"] = dict(
        k3_bf16_tp8=dict(budget_per_rank_GiB=60, **capacity(PRESETS["k3"], jnp.bfloat16, 60 << 30, 64, 8, ctxs)),
        k3_small_fp32=dict(budget_MiB=256, **capacity(PRESETS["k3-small"], jnp.float32, 256 << 20, 16, 1,
                                                       [1024, 4096, 16384])))
    for name, c in result["capacity"].items():
        log(f"capacity {name}: {c['auto']['bytes_per_token_per_layer']} -> {c['fp8']['bytes_per_token_per_layer']} "
            f"B/token/layer ({c['token_ratio']:.2f}x); sequences {c['auto']['sequences']} -> {c['fp8']['sequences']}")
    log("accuracy (Kimi-Linear checkpoint vs HF generate)")
    result["accuracy"] = accuracy(args.quick, 4 if args.quick else 16, 64 if args.quick else 256,
                                  8 if args.quick else 32, log)
    log(f"  teacher-forced: {result['accuracy']['teacher_forced']}")
    model = k3jax.load_model("tiny-k3" if args.quick else "k3-small", seed=0)
    n, plen, gen, page = (8, 96, 8, 16) if args.quick else (16, 512, 64, 16)
    lay = ArenaLayout.plan(model.cfg, 1 << 30, page, model.dtype)
    per_seq = lay.slot_units + lay.pages_for(plen + gen)  # units one request holds at its longest (auto)
    budget = (2 + lay.slot_units + 4 * per_seq) * lay.unit_bytes  # the model-dtype arena holds ~4 at once
    waves = [kv_bound_wave(model, kind, budget, n, plen, gen, page, bw["GBps"]) for kind in KINDS]
    same = sum(a == b for a, b in zip(waves[0].pop("token_ids"), waves[1].pop("token_ids")))
    result["kv_bound_wave"] = dict(model="tiny-k3" if args.quick else "k3-small", requests=n, prompt_len=plen,
                                   gen=gen, greedy_identical_requests=same, engines=waves)
    for w in waves:
        log(f"wave {w['kv_cache_dtype']}: peak running {w['peak_running']}, preemptions {w['preemptions']}, "
            f"wall {w['wall_s']:.2f} s, {w['gen_tok_s']:.1f} gen tok/s, decode phase {w['decode_phase_tok_s']:.1f} "
            f"tok/s, decode step {w['decode_step_median_s']}")
    # the same fp8 wave with max_num_seqs = all requests: what fits now is admitted, and decodes that run
    # out of pages preempt (recompute) the newest, unless the admission look-ahead holds requests back
    over = [kv_bound_wave(model, "fp8", budget, n, plen, gen, page, bw["GBps"], seqs=n, conservativeness=c)
            for c in (0.0, 1.0)]
    for w in over:
        w.pop("token_ids")
        log(f"over-admitted fp8, conservativeness {w['schedule_conservativeness']}: peak running {w['peak_running']}, "
            f"preemptions {w['preemptions']}, wall {w['wall_s']:.2f} s, {w['gen_tok_s']:.1f} gen tok/s")
    result["admission_look_ahead"] = dict(max_num_seqs=n, engines=over)
    write_result(result, out, t_start, log)


if __name__ == "__main__":
    main()
