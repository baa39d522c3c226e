"""Engine start-up: how the step programs' compile time grows with model depth, and what compiling them side
by side (`EngineConfig.compile_threads`) saves.

    python benchmarks/startup.py           # the recorded run, ~10 min on the 2-core CPU host
    python benchmarks/startup.py --quick   # smoke run (~1 min; writes to the temp dir)

1. Depth. tiny-k3's width with K3's layer pattern (MLA every 4th layer and the last, latent MoE and AttnRes
   blocks of 12 layers) at 8 / 24 / 48 / 93 layers (93: K3's depth). One engine per depth with one decode
   bucket (8 rows) and one prefill bucket (1 x 64 tokens), compiled one after the other
   (`compile_threads=1`): seconds per program, and per program and layer. The model's layers are unrolled
   in the step (`scan_layers=False`; benchmarks/layer_scan.py measures the scan), so a program's compile
   time grows with depth; the number of programs
   is fixed by the buckets (printed for K3's defaults below).
2. Threads. k3-small with the serving benchmark's five buckets (decode 1 / 8 / 32, prefill 1 / 4 x 64),
   `Engine(...)` until warm with `compile_threads` 1 and 2, each start in a fresh process (an in-process
   rerun would find the programs in JAX's compilation cache) and no persistent cache; pairs alternate.

Every start is a fresh process with no persistent compilation cache. Results: `results/startup-cpu.json`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import bench_start, med, write_result  # noqa: E402

DEPTHS = (8, 24, 48, 93)


def one_start(spec: dict) -> dict:
    """Build one engine as `spec` says (in this process) -> seconds to build the model and to warm up."""
    import jax.numpy as jnp

    import k3jax
    from k3jax.config import _k3_mla_layers, get_preset
    from k3jax.runtime import Model, init_model
    from serve.engine import Engine, EngineConfig

    t0 = time.perf_counter()
    if spec["model"] == "deep":
        n = spec["layers"]
        cfg = dataclasses.replace(get_preset("tiny-k3"), num_hidden_layers=n, mla_layers=_k3_mla_layers(n),
                                  attn_res_block_size=12)
        graphdef, params = init_model(cfg, jnp.float32, 0)
        model = Model(cfg, graphdef, params, jnp.float32, k3jax.load_model("tiny-k3").tokenizer, source=f"deep-{n}")
        ecfg = EngineConfig(max_model_len=256, page_size=16, cache_bytes=64 << 20, max_num_seqs=8, prefill_chunk=64,
                            max_prefill_seqs=1, decode_buckets=(8,), prefill_buckets=(1,), context_buckets=(16,),
                            enable_prefix_caching=False, measure_moe_time=False, compile_threads=1,
                            scan_layers=spec.get("scan_layers", False))
    else:
        model = k3jax.load_model(spec["model"])
        ecfg = EngineConfig(max_model_len=1024, page_size=16, cache_bytes=256 << 20, max_num_seqs=32,
                            prefill_chunk=64, max_prefill_seqs=4, decode_buckets=(1, 8, 32), prefill_buckets=(1, 4),
                            context_buckets=(64,), enable_prefix_caching=False, measure_moe_time=False,
                            compile_threads=spec["threads"], scan_layers=spec.get("scan_layers", False))
    t1 = time.perf_counter()
    engine = Engine(model, ecfg, warmup=True, progress=False)
    t2 = time.perf_counter()
    return dict(spec, model_s=t1 - t0, warmup_s=t2 - t1, programs=len(engine.bucket_shapes()),
                compiled_ahead=engine.counters["programs_compiled_ahead"],
                layers=model.cfg.num_hidden_layers, scan_plan=str(engine.layer_scan))


def in_fresh_process(spec: dict, script: str = __file__) -> dict:
    """Run `script --one SPEC` (its one-start function) in a fresh process with no compilation cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    proc = subprocess.run([sys.executable, script, "--one", json.dumps(spec)], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=1800)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
    if proc.returncode or not line:
        raise RuntimeError(f"start {spec} failed:\n{proc.stderr[-2000:]}")
    return json.loads(line[0][len("RESULT"):])


def script_main(one: Callable[[dict], dict], main: Callable[[], Any]) -> None:
    """A script's entry: `--one SPEC` (a child of `in_fresh_process`) prints `one(SPEC)` on the line it reads,
    anything else runs `main()`."""
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        print("RESULT" + json.dumps(one(json.loads(sys.argv[2]))), flush=True)
    else:
        main()


def default_programs(max_num_seqs: int, max_model_len: int, page_size: int = 16) -> dict:
    """The step programs an engine compiles with the default buckets (no speculative decoding), and how many
    where one-token decodes need only the widest context bucket (a GPU's paged MLA decode kernel)."""
    from serve.buckets import default_buckets, program_shapes
    from serve.engine import EngineConfig

    decode, prefill, context = default_buckets(max_num_seqs, EngineConfig.max_prefill_seqs, max_model_len, page_size)
    chunk = EngineConfig.prefill_chunk
    return dict(decode_buckets=list(decode), context_buckets=list(context), prefill_buckets=list(prefill),
                programs=len(program_shapes(decode, prefill, context, context, chunk)),
                programs_with_gpu_paged_decode=len(program_shapes(decode, prefill, context, context[-1:], chunk)))


def k3_default_programs() -> dict:
    """How many step programs K3 compiles with the engine's default buckets at serving-sized configs."""
    return {f"max_num_seqs={seqs}, max_model_len={ctx}": default_programs(seqs, ctx)
            for seqs, ctx in ((64, 32768), (256, 131072))}


def main(argv=None) -> dict:
    args, out_path, log, t_start, result = bench_start("startup", __doc__, argv)
    depths = (4, 8) if args.quick else DEPTHS
    rows = []
    for n in depths:
        r = in_fresh_process(dict(model="deep", layers=n))
        r["per_program_s"] = r["warmup_s"] / r["programs"]
        r["per_program_and_layer_s"] = r["per_program_s"] / n
        rows.append(r)
        log(f"depth {n:3d}: {r['programs']} programs in {r['warmup_s']:.1f} s ({r['per_program_s']:.1f} s each, "
            f"{r['per_program_and_layer_s']:.2f} s per layer)")
    result["depth"] = rows
    model = "tiny-k3" if args.quick else "k3-small"
    runs = {1: [], 2: []}
    for rep in range(1 if args.quick else 2):
        for threads in ((1, 2) if rep % 2 == 0 else (2, 1)):
            r = in_fresh_process(dict(model=model, threads=threads))
            runs[threads].append(r)
            log(f"{model} compile_threads={threads}: warm after {r['warmup_s']:.1f} s ({r['programs']} programs, "
                f"{r['compiled_ahead']} compiled ahead)")
    result["threads"] = dict(model=model, runs={str(k): v for k, v in runs.items()},
                             median_warmup_s={str(k): med([r["warmup_s"] for r in v]) for k, v in runs.items()})
    result["k3_default_programs"] = k3_default_programs()
    for k, v in result["k3_default_programs"].items():
        log(f"K3 with {k}: {v['programs']} step programs")
    write_result(result, out_path, t_start, log)
    return result


if __name__ == "__main__":
    script_main(one_start, main)
