"""Decode context parallelism (`decode_context_parallel_size`): capacity and cost against whole MLA pages on
every rank (what tensor parallelism alone keeps, as MLA has one KV head).

    python benchmarks/context_parallel.py           # the recorded run, ~10 min on the 2-core CPU host
    python benchmarks/context_parallel.py --quick   # smoke run on tiny-k3 (~2 min with compiles)

1. Capacity (arithmetic from `ArenaLayout.plan`, no device): K3 at full size (bf16 latents, page 64, a 40 GiB
   arena per rank), KDA heads split over 8 and 16 tensor-parallel ranks, MLA pages whole on every rank
   (dcp 1) or split over the same ranks (dcp = ranks): one rank's bytes per token, and how many sequences of
   8K / 32K / 128K / 256K tokens one rank's arena holds at once. Also with fp8 latents and bf16 states.
2. Measured on 4 simulated CPU devices (the script sets XLA_FLAGS before JAX starts): k3-small under the
   `tp` config, one per-rank arena budget, a KV-bound wave of long prompts, each engine running as many
   requests at once as its arena holds at full length (max_num_seqs set to that, as an operator would):
   peak running, preemptions, wall time, decode step median; greedy tokens compared between the two
   engines. The 4 devices share the host's 2 cores, so the times say what the step costs here (the
   all-gather of the queries and the three all-reduces per MLA layer are memory copies), not what four
   accelerators would see.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import simulated_devices  # noqa: E402

simulated_devices.use(4)  # before JAX starts

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from k3jax.config import PRESETS  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.memory import ArenaLayout  # noqa: E402
from serve.types import SamplingParams  # noqa: E402
from serving import bench_start, med, run_wave, track_peak_running, write_result  # noqa: E402

CONTEXTS = (8192, 32768, 131072, 262144)


def k3_capacity(ranks: int, budget: int, kv_cache_dtype: str = "auto", kda_state_dtype: str = "float32") -> dict:
    """One rank's arena under tp over `ranks`, MLA pages whole (dcp 1) or split by position (dcp = ranks)."""
    out = {}
    for dcp in (1, ranks):
        lay = ArenaLayout.plan(PRESETS["k3"], budget, 64, jnp.bfloat16, ranks, kv_cache_dtype, kda_state_dtype, dcp)
        out[f"dcp{dcp}"] = dict(mla_bytes_per_token_per_rank=lay.latent_words * 4 * lay.num_mla_layers // dcp,
                                state_slot_bytes_per_rank=lay.slot_units * lay.unit_bytes,
                                sequences={str(c): lay.sequences_at(c) for c in CONTEXTS})
    whole, split = out["dcp1"]["sequences"], out[f"dcp{ranks}"]["sequences"]
    out["ratio"] = {c: (split[c] / whole[c] if whole[c] else None) for c in whole}
    return out


def wave(model, dcp: int, budget: int, n: int, prompt_len: int, gen: int, page: int) -> dict:
    probe = ArenaLayout.plan(model.cfg, budget, page, model.dtype, 4, "auto", "float32", dcp)
    seqs = max(1, min(n, probe.sequences_at(prompt_len + gen)))
    cfg = EngineConfig(max_model_len=prompt_len + gen + page, page_size=page, cache_bytes=budget, max_num_seqs=seqs,
                       prefill_chunk=64, max_prefill_seqs=4, decode_buckets=(seqs,), prefill_buckets=(4,),
                       max_logprobs=1, enable_prefix_caching=False, sharding="tp", decode_context_parallel_size=dcp)
    t0 = time.perf_counter()
    eng = Engine(model, cfg, progress=False)
    build = time.perf_counter() - t0
    running = track_peak_running(eng)
    prompts = np.random.default_rng(5).integers(0, 250, (n, prompt_len)).tolist()
    w = run_wave(eng, prompts, SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
    st = eng.stats()
    steps = [dt for dt, rows in w["decode_only_steps"]]
    return dict(decode_context_parallel_size=dcp, mla_form=st["decode_forms"]["mla"], cache_bytes_per_rank=budget,
                units=eng.layout.num_units, unit_bytes=eng.layout.unit_bytes, sequences_at_full_length=seqs,
                build_s=build, peak_running=running["peak"], preemptions=st.get("preemptions", 0), wall_s=w["wall_s"],
                gen_tok_s=w["gen_tok_s"], total_tok_s=w["total_tok_s"], ttft_p50_s=med(w["ttft"]),
                decode_step_median_s=med(steps) if steps else None, decode_steps=len(steps),
                prefill_step_median_s=med(w["prefill_only_steps"]) if w["prefill_only_steps"] else None,
                compiles_after_warmup=st["compiles_after_warmup"], token_ids=w["token_ids"])


def main(argv=None):
    args, out, log, t_start, result = bench_start("context_parallel", __doc__, argv)
    result["capacity_k3"] = {f"tp{r}{'_' + name if name else ''}": dict(ranks=r, budget_per_rank_GiB=40,
                                                                        **k3_capacity(r, 40 << 30, *kinds))
                             for r in (8, 16) for name, kinds in (("", ()), ("fp8_bf16state", ("fp8", "bfloat16")))}
    for name, c in result["capacity_k3"].items():
        d = f"dcp{c['ranks']}"
        log(f"K3 {name}: MLA bytes/token/rank {c['dcp1']['mla_bytes_per_token_per_rank']} -> "
            f"{c[d]['mla_bytes_per_token_per_rank']}; sequences {c['dcp1']['sequences']} -> {c[d]['sequences']}")
    model = k3jax.load_model("tiny-k3" if args.quick else "k3-small", seed=0)
    n, plen, gen, page = (6, 96, 8, 16) if args.quick else (8, 1024, 16, 16)
    one = ArenaLayout.plan(model.cfg, 1 << 30, page, model.dtype, 4)
    per_seq = one.slot_units + one.pages_for(plen + gen)  # units one request holds at full length, dcp 1
    budget = (2 + one.slot_units + 2 * per_seq) * one.unit_bytes + one.unit_bytes // 2  # dcp 1 holds 2 at once
    waves = [wave(model, dcp, budget, n, plen, gen, page) for dcp in (1, 4)]
    same = sum(a == b for a, b in zip(waves[0].pop("token_ids"), waves[1].pop("token_ids")))
    result["kv_bound_wave"] = dict(model="tiny-k3" if args.quick else "k3-small", sharding="tp", devices=4,
                                   requests=n, prompt_len=plen, gen=gen, page_size=page,
                                   greedy_identical_requests=same, engines=waves)
    for w in waves:
        log(f"wave dcp {w['decode_context_parallel_size']}: {w['sequences_at_full_length']} at full length, peak running "
            f"{w['peak_running']}, preemptions {w['preemptions']}, wall {w['wall_s']:.2f} s, {w['gen_tok_s']:.1f} gen "
            f"tok/s, decode step {w['decode_step_median_s']}, prefill step {w['prefill_step_median_s']}, "
            f"compiles after warm-up {w['compiles_after_warmup']}")
    log(f"greedy tokens identical in {same}/{n} requests")
    write_result(result, out, t_start, log)


if __name__ == "__main__":
    main()
