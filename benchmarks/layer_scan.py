"""The scan over repeating layers (k3jax/layer_scan.py, `EngineConfig.scan_layers`): start-up compile time
against depth, and what the scan costs a step once compiled.

    python benchmarks/layer_scan.py           # the recorded run, ~15 min on the 2-core CPU host
    python benchmarks/layer_scan.py --quick   # smoke run (writes to the temp dir)

1. Compile. tiny-k3's width with K3's layer pattern (MLA every 4th layer and the last, latent MoE, AttnRes
   blocks of 12) at 48 and 93 layers, unrolled and scanned: the engine's start-up (one decode bucket of
   8 rows, one prefill bucket of 1 x 64 tokens, `compile_threads=1`), each start in a fresh process with no
   persistent compilation cache (benchmarks/startup.py's harness).
2. Step time. k3-small's width (hidden 512, 32 experts) at 29 layers (6 scanned groups of 4), unrolled and
   scanned: the compiled decode program (8 rows x 1 token), prefill program (1 x 64) and speculative verify
   program (8 rows x 4 tokens: 3 drafts; scanned, the accepted tokens are committed by a second scan over the
   groups) called on full rows of random tokens, median of 15 calls after 3 warm ones. Decode on CPU reads
   every weight once a step, so this is where a loop's per-iteration slicing of the stacked weights would show.
   `--steps-only` runs this part alone.

Results: `results/layer_scan-cpu.json`.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import bench_start, med, write_result  # noqa: E402
from startup import in_fresh_process, script_main  # noqa: E402


def step_times(spec: dict) -> dict:
    """Build one engine as `spec` says (in this process) -> warm-up seconds and median program times."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import k3jax
    from k3jax.config import _k3_mla_layers, get_preset
    from k3jax.runtime import Model, init_model
    from serve.engine import Engine, EngineConfig

    n = spec["layers"]
    cfg = dataclasses.replace(get_preset(spec["width"]), num_hidden_layers=n, mla_layers=_k3_mla_layers(n))
    graphdef, params = init_model(cfg, jnp.float32, 0)
    model = Model(cfg, graphdef, params, jnp.float32, k3jax.load_model("tiny-k3").tokenizer, source=f"deep-{n}")
    ecfg = EngineConfig(max_model_len=256, page_size=16, cache_bytes=256 << 20, max_num_seqs=8, prefill_chunk=64,
                        max_prefill_seqs=1, decode_buckets=(8,), prefill_buckets=(1,), context_buckets=(16,),
                        enable_prefix_caching=False, measure_moe_time=False, compile_threads=1,
                        scan_layers=spec["scan"], speculative_config=dict(num_speculative_tokens=3, adaptive=False))
    t0 = time.perf_counter()
    engine = Engine(model, ecfg, warmup=True, progress=False)
    out = dict(spec, warmup_s=time.perf_counter() - t0, scan_plan=str(engine.layer_scan))
    rng = np.random.default_rng(0)
    for name, rows, t in (("decode_8x1", 8, 1), ("prefill_1x64", 1, 64), ("verify_8x4", 8, 4)):
        batch = engine._pad_batch(rows, t, 16, [])
        batch = dataclasses.replace(batch, tokens=jnp.asarray(rng.integers(3, cfg.vocab_size, (rows, t)), jnp.int32),
                                    valid=jnp.full((rows,), t, jnp.int32))
        times = []
        for i in range(18):
            t1 = time.perf_counter()
            jax.block_until_ready(engine._step_fn(batch))
            if i >= 3:
                times.append(time.perf_counter() - t1)
        out[f"{name}_ms"] = 1e3 * med(times)
    weights = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d, _ in engine._leaf_specs)
    out["weight_bytes"] = weights
    return out


def main(argv=None) -> dict:
    args, out_path, log, t_start, result = bench_start(
        "layer_scan", __doc__, argv, lambda ap: ap.add_argument("--steps-only", action="store_true"))
    depths = () if args.steps_only else (8,) if args.quick else (48, 93)
    if args.steps_only and not args.out:
        out_path = out_path.with_name(out_path.stem + "-steps" + out_path.suffix)
    rows = []
    for n in depths:
        for scan in (False, True):
            r = in_fresh_process(dict(model="deep", layers=n, scan_layers=scan))
            r["per_program_s"] = r["warmup_s"] / r["programs"]
            rows.append(r)
            log(f"{n:3d} layers, scan={scan}: {r['programs']} programs in {r['warmup_s']:.1f} s "
                f"({r['per_program_s']:.1f} s each; {r['scan_plan']})")
    result["compile"] = rows
    steps = []
    for scan in (False, True):
        spec = dict(width="tiny-k3" if args.quick else "k3-small", layers=9 if args.quick else 29, scan=scan)
        r = in_fresh_process(spec, __file__)
        steps.append(r)
        log(f"{spec['width']} x {spec['layers']} layers, scan={scan}: warm-up {r['warmup_s']:.1f} s, decode 8x1 "
            f"{r['decode_8x1_ms']:.1f} ms, prefill 1x64 {r['prefill_1x64_ms']:.1f} ms, verify 8x4 "
            f"{r['verify_8x4_ms']:.1f} ms ({r['scan_plan']})")
    result["steps"] = steps
    # the decode roofline's numerator on CPU (dequantized experts: every weight read once per step)
    result["decode_weight_read_floor_ms"] = steps[0]["weight_bytes"] / (result["bandwidth"]["read_GBps"] * 1e9) * 1e3
    write_result(result, out_path, t_start, log)
    return result


if __name__ == "__main__":
    script_main(step_times, main)
