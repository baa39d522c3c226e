"""Expert-parallel load balancing (`enable_eplb`): how even the ranks' expert work gets, what a move costs, and
that outputs do not change.

    python benchmarks/eplb.py           # the recorded run, ~3 min on the 2-core CPU host
    python benchmarks/eplb.py --quick   # tiny-k3 (~1 min with compiles)

k3-small (32 routed experts, 4 per token, 11 MoE layers) under the `ep` config on 4 simulated CPU devices (the
script sets XLA_FLAGS before JAX starts), with `--redundant` (default 4) redundant experts: 32 + 4 stacked
experts, 9 per rank, each rank multiplying the tokens routed to the experts it holds.

1. Wave A (random prompts, greedy) with the initial placement (checkpoint order, then copies of experts
   0..3); its routed-token counts are the window.
2. `engine.rebalance_experts()`: the plan from wave A's counts, the layers moved, the seconds the move took.
3. Wave B: fresh prompts, so the placement is judged on traffic it was not planned from: the busiest rank's
   load over the mean rank load per MoE layer under checkpoint order, a plan from wave A without copies
   (host arithmetic), and the engine's plan with copies (all from wave B's counts).
4. Wave A again: the same greedy tokens as its first run (logprobs bit for bit: tests/test_sharding.py).
5. More ranks, host arithmetic on the same counts: plans from wave A for 4 ... 32 ranks (32 ... 1 experts per
   rank) with 0, R / 2, R and 2 R redundant experts, judged on wave B. Where a rank holds one or two experts a
   permutation cannot split a hot expert; copies can.

Step times are recorded too, but the 4 simulated devices share 2 cores, so a rank's share of the work does
not decide a step's time here the way the busiest rank does on accelerators; the balance numbers are the
measurement (no device was lent to time them).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import simulated_devices  # noqa: E402

simulated_devices.use(4)  # before JAX starts

import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.eplb import balanced_placement, imbalance  # noqa: E402
from serve.types import SamplingParams  # noqa: E402
from serving import bench_start, med, run_wave, write_result  # noqa: E402


def wave(eng: Engine, prompts: list[list[int]], gen: int) -> tuple[dict, np.ndarray, list]:
    """Run `prompts`; -> (timings, routed-token counts [MoE layer, expert] of this wave, token ids)."""
    before = eng.expert_counts.copy()
    w = run_wave(eng, prompts, SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
    return w, eng.expert_counts - before, w.pop("token_ids")


def balance(counts: np.ndarray, placement: np.ndarray, ranks: int) -> dict:
    per_layer = [imbalance(c, p, ranks) for c, p in zip(counts, placement)]
    return dict(mean=float(np.mean(per_layer)), max=float(np.max(per_layer)), per_layer=per_layer)


def sweep(counts_a: np.ndarray, counts_b: np.ndarray) -> list[dict]:
    """Plans from wave A's counts for more ranks and copies, judged on wave B's counts (mean over layers)."""
    e, rows = counts_a.shape[1], []
    for ranks in (4, 8, 16, 32):
        for redundant in sorted({0, ranks // 2, ranks, 2 * ranks}):
            if (e + redundant) % ranks or redundant > e * (ranks - 1):
                continue
            plans = [balanced_placement(a, ranks, redundant) for a in counts_a]
            judged = [imbalance(b, p, ranks) for b, p in zip(counts_b, plans)]
            rows.append(dict(ranks=ranks, redundant=redundant, experts_per_rank=(e + redundant) // ranks,
                             mean=float(np.mean(judged)), max=float(np.max(judged))))
    return rows


def main(argv=None):
    args, out, log, t_start, result = bench_start("eplb", __doc__, argv, extra=lambda p: p.add_argument(
        "--redundant", type=int, default=4, help="redundant experts per MoE layer (default 4)"))
    name = "tiny-k3" if args.quick else "k3-small"
    model = k3jax.load_model(name, seed=0)
    n, plen, gen = (8, 48, 8) if args.quick else (16, 192, 32)
    cfg = EngineConfig(max_model_len=plen + gen + 16, page_size=16, cache_bytes=64 << 20, max_num_seqs=n,
                       prefill_chunk=64, max_prefill_seqs=4, decode_buckets=(n,), prefill_buckets=(4,), max_logprobs=1,
                       enable_prefix_caching=False, sharding="ep", enable_eplb=True, eplb_window_size=10 ** 6,
                       eplb_step_interval=10 ** 9, eplb_num_redundant_experts=args.redundant)
    eng = Engine(model, cfg, progress=False)
    ranks = eng.eplb.ranks
    rng = np.random.default_rng(7)
    prompts_a = rng.integers(0, 250, (n, plen)).tolist()
    prompts_b = rng.integers(0, 250, (n, plen)).tolist()
    initial = eng.eplb.placement.copy()
    checkpoint_order = np.tile(np.arange(model.cfg.num_experts), (len(initial), 1))
    wa, counts_a, tokens_a = wave(eng, prompts_a, gen)
    summary = eng.rebalance_experts()
    log(f"plan from wave A ({summary['tokens']} routed tokens): {summary['layers_moved']} of {len(initial)} layers "
        f"moved, busiest / mean rank {summary['imbalance_before']:.3f} -> {summary['imbalance_after']:.3f}, "
        f"{summary['seconds']:.2f} s")
    wb, counts_b, _ = wave(eng, prompts_b, gen)
    old = balance(counts_b, checkpoint_order, ranks)
    permuted = balance(counts_b, np.stack([balanced_placement(a, ranks) for a in counts_a]), ranks)
    new = balance(counts_b, eng.eplb.placement, ranks)
    log(f"wave B (fresh prompts), busiest / mean rank load: checkpoint order {old['mean']:.3f} (worst layer "
        f"{old['max']:.3f}) -> balanced without copies {permuted['mean']:.3f} (worst {permuted['max']:.3f}) -> "
        f"with {args.redundant} copies {new['mean']:.3f} (worst {new['max']:.3f})")
    rows = sweep(counts_a, counts_b)
    for r in rows:
        log(f"  {r['ranks']:>2} ranks, {r['redundant']:>2} redundant ({r['experts_per_rank']} per rank): busiest / mean "
            f"{r['mean']:.3f} (worst layer {r['max']:.3f})")
    wa2, _, tokens_a2 = wave(eng, prompts_a, gen)
    log(f"wave A again: tokens identical {tokens_a2 == tokens_a}")

    def times(w):
        dec = [dt for dt, _ in w["decode_only_steps"]]
        return dict(wall_s=w["wall_s"], decode_step_median_s=med(dec) if dec else None,
                    prefill_step_median_s=med(w["prefill_only_steps"]) if w["prefill_only_steps"] else None)

    result.update(model=name, sharding="ep", devices=4, ranks=ranks, experts=model.cfg.num_experts,
                  redundant_experts=args.redundant, top_k=model.cfg.num_experts_per_token, moe_layers=len(initial),
                  requests=n, prompt_len=plen, gen=gen, plan=summary,
                  wave_b_balance=dict(checkpoint_order=old, balanced_without_copies=permuted,
                                      balanced_with_copies=new), more_ranks=rows,
                  placement=eng.eplb.placement.tolist(), tokens_identical_after_move=tokens_a2 == tokens_a,
                  times=dict(wave_a=times(wa), wave_b=times(wb), wave_a_again=times(wa2)),
                  compiles_after_warmup=eng.stats()["compiles_after_warmup"])
    for k, w in result["times"].items():
        log(f"{k}: wall {w['wall_s']:.2f} s, decode step {w['decode_step_median_s']}, prefill step "
            f"{w['prefill_step_median_s']}")
    write_result(result, out, t_start, log)


if __name__ == "__main__":
    main()
