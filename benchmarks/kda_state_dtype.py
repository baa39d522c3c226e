"""bf16 KDA state storage (`kda_state_dtype="bfloat16"`): capacity, accuracy and speed against fp32 states.

    python benchmarks/kda_state_dtype.py           # the recorded run, ~6 min quiet
    python benchmarks/kda_state_dtype.py --quick   # smoke run on tiny presets (~1 min with compiles)

1. Capacity (arithmetic from `ArenaLayout.plan`, no device): one rank's state slot and how many
   requests of each context length its arena holds, for K3 at full size (bf16 weights, 60 GiB per rank;
   KDA heads over 8 tensor-parallel ranks, or whole on every rank as with data-parallel attention),
   with both state dtypes and both latent formats.
2. Accuracy, against HF transformers: the HF-written random Kimi-Linear checkpoint of
   benchmarks/serving.py. Greedy tokens of HF `generate` (the peer, fp32 states) against the engine
   with fp32 and with bf16 states; teacher-forced logprobs over prompt + HF's continuation (every
   position, `prompt_logprobs`): |delta| between the two engines, and agreement on whether HF's
   token is the argmax. Then the drift over long recurrences: teacher-forced random sequences of
   2048 tokens, |delta| by position bucket (the state is rounded after every chunk of 64).
3. Speed and concurrency (k3-small on CPU): a state-bound wave (many short requests) through one arena
   budget that holds ~8 fp32 slots; each engine runs as many requests at once as its arena holds.
   Then the same batch size in both (a large arena): decode step median, which isolates the cost of
   converting states in the in-place row loop against the halved state traffic.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from k3jax.config import PRESETS  # noqa: E402
from kv_cache_dtype import against_hf, engine_for, hf_reference, hf_summary, layout_capacity, teacher_forced  # noqa: E402
from serve.memory import ArenaLayout  # noqa: E402
from serve.types import SamplingParams  # noqa: E402
from serving import bench_start, med, run_wave, track_peak_running, write_result  # noqa: E402

STATES = ("float32", "bfloat16")


def capacity(cfg, dtype, budget: int, page: int, ranks: int, contexts: list[int]) -> dict:
    out = {}
    for kv in ("auto", "fp8"):
        for st in STATES:
            lay = ArenaLayout.plan(cfg, budget, page, dtype, ranks, kv, st)
            out[f"{st}_states_{kv}_latents"] = layout_capacity(lay, contexts)
    return out


def accuracy(quick: bool, n: int, prompt_len: int, gen: int, long_n: int, long_len: int, log) -> dict:
    with hf_reference(quick, n, prompt_len, gen) as (rng, model, prompts, hf_out, res):
        longs = rng.integers(0, 500, (long_n, long_len)).tolist()
        per, long_lps = {}, {}
        for st in STATES:
            eng = engine_for(model, max(prompt_len + gen, long_len) + 16, n, kda_state_dtype=st)
            per[st] = against_hf(eng, prompts, hf_out)
            long_lps[st] = np.array([[x[0] for x in s] for s in teacher_forced(eng, longs)])
            log(f"  {st} states: {per[st]['identical_to_hf']}/{n} requests token-identical to HF")
        res.update(hf_summary(per, "float32", "bfloat16"))
        dl = np.abs(long_lps["float32"] - long_lps["bfloat16"])  # [long_n, long_len - 1]
        bucket = max(64, long_len // 8)
        res["long_recurrence"] = dict(
            sequences=long_n, tokens=long_len, bucket=bucket,
            mean_abs_delta_by_position=[float(dl[:, i:i + bucket].mean()) for i in range(0, dl.shape[1], bucket)],
            p99_abs_delta_by_position=[float(np.percentile(dl[:, i:i + bucket], 99))
                                       for i in range(0, dl.shape[1], bucket)])
        return res


def wave(model, state: str, budget: int, n: int, prompt_len: int, gen: int, seqs: int, bw: float) -> dict:
    # two decode buckets: a wave's last partial batch pays for half the rows, not all (more buckets, more
    # compiled programs in this one process: LLVM ran out of code memory with five)
    buckets = tuple(sorted({max(1, seqs // 2), seqs}))
    eng = engine_for(model, prompt_len + gen + 16, seqs, budget, buckets=buckets, kda_state_dtype=state)
    prompts = np.random.default_rng(5).integers(0, 250, (n, prompt_len)).tolist()
    running = track_peak_running(eng)
    w = run_wave(eng, prompts, SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
    full = [dt for dt, rows in w["decode_only_steps"] if rows == seqs]
    lay = eng.layout
    state_rw = 2 * seqs * lay.state_words * 4 * lay.num_kda_layers  # read + written per decode step
    return dict(kda_state_dtype=state, cache_bytes=budget, max_num_seqs=seqs, peak_running=running["peak"],
                slot_bytes=lay.slot_units * lay.unit_bytes, preemptions=eng.stats().get("preemptions", 0),
                wall_s=w["wall_s"], gen_tok_s=w["gen_tok_s"], total_tok_s=w["total_tok_s"],
                full_decode_steps=len(full), decode_step_median_s=med(full) if full else None,
                state_bytes_per_decode_step=state_rw, state_roofline_s=state_rw / (bw * 1e9),
                compiles_after_warmup=eng.stats()["compiles_after_warmup"], token_ids=w["token_ids"])


def main(argv=None):
    args, out, log, t_start, result = bench_start("kda_state_dtype", __doc__, argv)
    bw = result["bandwidth"]
    ctxs = [2048, 8192, 32768, 131072]
    k3 = lambda ranks: dict(budget_per_rank_GiB=60, kda_state_ranks=ranks,
                            **capacity(PRESETS["k3"], jnp.bfloat16, 60 << 30, 64, ranks, ctxs))
    # KDA heads split over 8 tensor-parallel ranks, or whole on every rank (data-parallel attention)
    result["capacity"] = dict(k3_bf16_tp8=k3(8), k3_bf16_dp_attention=k3(1))
    for name, c in result["capacity"].items():
        for k, v in c.items():
            if isinstance(v, dict):
                log(f"capacity {name} {k}: slot {v['slot_bytes'] / 2**20:.1f} MiB, sequences {v['sequences']}")
    log("accuracy (Kimi-Linear checkpoint vs HF generate)")
    result["accuracy"] = accuracy(args.quick, 4 if args.quick else 16, 64 if args.quick else 256,
                                  8 if args.quick else 32, 2 if args.quick else 4, 256 if args.quick else 2048, log)
    log(f"  teacher-forced: {result['accuracy']['teacher_forced']}")
    log(f"  long recurrence: {result['accuracy']['long_recurrence']}")
    jax.clear_caches()  # the accuracy engines' programs
    gc.collect()
    model = k3jax.load_model("tiny-k3" if args.quick else "k3-small", seed=0)
    n, plen, gen = (8, 48, 8) if args.quick else (32, 64, 32)
    lay = ArenaLayout.plan(model.cfg, 1 << 30, 16, model.dtype)
    budget = (2 + lay.slot_units + 8 * (lay.slot_units + lay.pages_for(plen + gen))) * lay.unit_bytes
    fits = {st: ArenaLayout.plan(model.cfg, budget, 16, model.dtype, kda_state_dtype=st).sequences_at(plen + gen)
            for st in STATES}
    bound = [wave(model, st, budget, n, plen, gen, min(n, fits[st]), bw["GBps"]) for st in STATES]
    same = sum(a == b for a, b in zip(bound[0].pop("token_ids"), bound[1].pop("token_ids")))
    result["state_bound_wave"] = dict(model="tiny-k3" if args.quick else "k3-small", requests=n, prompt_len=plen,
                                      gen=gen, greedy_identical_requests=same, engines=bound)
    for w in bound:
        log(f"state-bound wave {w['kda_state_dtype']}: {w['max_num_seqs']} at once (peak {w['peak_running']}), "
            f"preemptions {w['preemptions']}, wall {w['wall_s']:.2f} s, {w['gen_tok_s']:.1f} gen tok/s")
    seqs = 8
    same_batch = [wave(model, st, 256 << 20, seqs, plen, 2 * gen, seqs, bw["GBps"]) for st in STATES]
    for w in same_batch:
        w.pop("token_ids")
        log(f"batch {seqs} {w['kda_state_dtype']}: decode step {w['decode_step_median_s']}, state bytes "
            f"{w['state_bytes_per_decode_step'] / 2**20:.1f} MiB (roofline {w['state_roofline_s'] * 1e3:.2f} ms)")
    result["same_batch"] = dict(rows=seqs, engines=same_batch)
    write_result(result, out, t_start, log)


if __name__ == "__main__":
    main()
