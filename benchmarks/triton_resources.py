"""Static GPU resources of the Pallas Triton kernels, read without a GPU: shared memory, registers, spills.

A kernel that asks for more shared memory than the GPU has does not launch (two did not on the H200:
benchmarks/results/kernels-gpu.json); one whose values do not fit in 255 registers per thread spills
them to local memory, which every use then reads and writes through the cache. Both can be seen before
a GPU is lent:

1. Capture (this project's Python; jax only): every configuration in :func:`configs` is lowered for
   CUDA with ``jax.export`` and the Triton IR that JAX's Pallas Triton lowering hands to XLA is kept
   (its generic MLIR text), with a manifest.
2. Compile (a Python with the ``triton`` package, e.g. a side venv: ``pip install triton``): Triton
   compiles each IR for sm_90 (H100 / H200) with the configuration's ``num_warps``; recorded are the
   kernel's shared memory (Triton's metadata) and registers and stack bytes per thread (``cuobjdump
   --dump-resource-usage`` of the cubin; stack > 0 means spills).

The Triton that compiles here is PyPI's, not the one inside the GPU machine's jaxlib, so the numbers
are indicative, not exact: against the two launch failures the H200 reported (JAX 0.11.2) it reads
shared memory 14-44 % low (``CALIBRATION``). Compare configurations with each other; a configuration
near the limit needs the device.

    python benchmarks/triton_resources.py --triton-python /tmp/tvenv/bin/python   # ~3 min
    python benchmarks/triton_resources.py --capture-only --ir-dir /tmp/ir          # step 1 alone
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "triton-resources.json"
SHARED_LIMIT = 232448          # bytes of shared memory one H100 / H200 block may opt into (227 KiB)
TARGET = ("cuda", 90, 32)      # sm_90, warp size 32
# What the H200 reported at launch (RESOURCE_EXHAUSTED, JAX 0.11.2) for two configurations captured here
CALIBRATION = {"kda_chunk_fused/bv32_bc64_tf32x3/w4": 294912, "moe_gmm_mxfp4/tn128/w4": 247808}


# ----------------------------------------------------------------------------------------
# step 1: capture (jax)
# ----------------------------------------------------------------------------------------
def configs():
    """``(name, num_warps, num_stages, build[, pick])``: ``build()`` -> (jitted function, argument shapes)
    lowering one Pallas Triton kernel (several: ``pick`` indexes the one kept, default the last) at K3's
    tile sizes (K = V = 128, MLA latent 576, one EP shard of the MoE); warps and stages as the kernel
    passes them to Triton (they are compile options, not IR)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.kda.pallas_kda import chunk_kda_pallas, fused_recurrent_kda_pool_pallas
    from pallas_kernels.mla.fp8_latents import Fp8Latents
    from pallas_kernels.mla.kernel import paged_mla_decode_pallas
    from pallas_kernels.moe.kernel import gmm_pallas
    from pallas_kernels.moe.mxfp4 import MXFP4Weight

    f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
    S = jax.ShapeDtypeStruct
    K = 128
    chunk_args = [S((1, 128, 2, K), f32)] * 4 + [S((1, 128, 2), f32), S((1, 2, K, K), f32)]
    pool_args = [S((2, 1, 2, K), f32)] * 4 + [S((2, 1, 2), f32), S((3, 2, K, K), f32)]
    out = []
    for form, bv, bc, prec, nw in itertools.product(("fused", "split", "staged"), (16, 32, 64), (16, 32, 64, 128),
                                                    ("tf32x3", "bf16"), (4, 8)):
        if (form != "fused" and bc not in (64, 128)) or (form == "fused" and bc == 128) or (
                form == "fused" and bc == 64 and (bv, prec, nw) != (32, "tf32x3", 4)) or (
                form == "staged" and nw == 8):
            continue  # bc: the fused form's tile (64: the hardware's launch failure, for calibration);
            #           the split and staged forms' K-block (128: whole-K products)
        kw = dict(variant="gpu", form=form, block_v=bv, dot_precision=prec, num_warps=nw,
                  **(dict(block_c=bc) if form == "fused" else dict(block_k=bc)))
        name = f"kda_chunk_{form}/bv{bv}" + (f"_bc{bc}" if form == "fused" else f"_bk{bc}") + f"_{prec}"
        build = lambda kw=kw: (jax.jit(lambda *a: chunk_kda_pallas(
            *a[:5], initial_state=a[5], output_final_state=True, **kw)), chunk_args)
        out.append((name, nw, 1, build))
        if form == "staged" and bc == 64 and bv <= 32:   # its chunk loop's loads pipelined 2 / 3 deep
            out += [(f"{name}_s{ns}", nw, ns, build) for ns in (2, 3)]
    from pallas_kernels.kda.pallas_kda import _call_gpu_prep
    tok_args = [S((128, 2, K), f32)] * 4 + [S((128, 2, 1), f32)]
    for (part, pick), nw in itertools.product((("pairs", 0), ("solve", 1), ("columns", 2)), (4, 8)):
        # the split forms' prep kernels: pairs per (64-token chunk, head, 16-token row tile), solve per (chunk,
        # head), columns per (chunk, head, K-block)
        out.append((f"kda_chunk_prep_{part}/tf32x3", nw, 1, lambda nw=nw: (jax.jit(lambda *a: _call_gpu_prep(
            *a, C=64, scale=K ** -0.5, prec="tf32x3", interpret=False, num_warps=nw)), tok_args), pick))
    for bv, nw in ((8, 1), (16, 1), (16, 2), (32, 2), (32, 4), (64, 4), (64, 8), (128, 8)):
        out.append((f"kda_decode_pool/bv{bv}", nw, 1, lambda bv=bv, nw=nw: (jax.jit(
            lambda *a: fused_recurrent_kda_pool_pallas(*a, jnp.asarray([2, 0], i32), variant="gpu", block_v=bv,
                                                       num_warps=nw)), pool_args)))
    m, k, n, g = 128, 3584, 3072, 8
    mx = MXFP4Weight(S((g, n, k // 2), jnp.uint8), S((g, n, k // 32), jnp.uint8))
    gmm = [("moe_gmm_bf16/default", S((g, n, k), bf16), None, 2), ("moe_gmm_mxfp4/default", mx, None, 2),
           ("moe_gmm_mxfp4/tn128", mx, (64, 512, 128), 2)]
    gmm += [(f"moe_gmm_mxfp4/tm{tm}_tn{tn}_s{ns}", mx, (tm, 512, tn), ns)   # MXFP4 tiles and pipeline stages
            for tm, tn, ns in itertools.product((16, 64), (32, 64), (1, 2)) if (tm, tn, ns) != (64, 32, 2)]
    for label, w, tiling, ns in gmm:
        out.append((label, 4, ns, lambda w=w, tiling=tiling: (jax.jit(
            lambda a, b, c: gmm_pallas(a, b, c, variant="triton", tiling=tiling)), [S((m, k), bf16), w, S((g,), i32)])))
    mla_args = [S((4, 16, 512), bf16), S((4, 16, 64), bf16), S((64, 64, 576), bf16), S((4, 8), i32), S((4,), i32)]
    out.append(("mla_paged_decode/bf16_H16", 4, 2, lambda: (jax.jit(lambda *a: paged_mla_decode_pallas(
        *a, scale=192 ** -0.5, variant="triton")), mla_args)))
    fp8 = Fp8Latents(512, 64, 128)  # fp8 latent pages (kv_cache_dtype="fp8"): 164 words a token
    fp8_args = mla_args[:2] + [S((64, 64, fp8.words), jnp.float32)] + mla_args[3:]
    out.append(("mla_paged_decode/fp8_H16", 4, 2, lambda: (jax.jit(lambda *a: paged_mla_decode_pallas(
        *a, scale=192 ** -0.5, variant="triton", kv_format=fp8)), fp8_args)))
    return out


def capture(ir_dir: Path, only: str | None = None) -> list[dict]:
    """Lower every configuration for CUDA, writing each kernel's Triton IR to ``ir_dir``; -> manifest rows.
    Hooks JAX's (private) Pallas Triton lowering entry point to read the module it builds."""
    import jax
    from jax._src.pallas.triton import pallas_call_registration as reg

    captured = []
    lower = reg.lowering.lower_jaxpr_to_triton_module

    def keep(*a, **kw):
        res = lower(*a, **kw)
        captured.append(res.module.operation.get_asm(print_generic_op_form=True))
        return res

    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    rows = []
    reg.lowering.lower_jaxpr_to_triton_module = keep
    try:
        for i, (name, nw, ns, build, *pick) in enumerate(configs()):
            if only and only not in name:
                continue
            fn, args = build()
            n0 = len(captured)
            jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(*args)
            kernels = captured[n0:]
            if not kernels:
                raise RuntimeError(f"{name}: no Triton kernel was lowered (is the Pallas Triton lowering in use?)")
            path = ir_dir / f"{i:03d}.ttir"
            path.write_text(kernels[pick[0] if pick else -1])  # the op's Pallas call (default: the last one lowered)
            rows.append(dict(config=f"{name}/w{nw}", num_warps=nw, num_stages=ns, ir=path.name))
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = lower
    (ir_dir / "manifest.json").write_text(json.dumps(rows, indent=1))
    return rows


# ----------------------------------------------------------------------------------------
# step 2: compile (triton)
# ----------------------------------------------------------------------------------------
def resource_usage(cuobjdump_text: str) -> dict:
    """Registers and stack bytes per thread from ``cuobjdump --dump-resource-usage`` (one kernel):
    its line ``REG:128 STACK:0 SHARED:1024 LOCAL:0 ...`` (SHARED there is the static part only)."""
    lines = [line for line in cuobjdump_text.splitlines() if "REG:" in line]
    if len(lines) != 1:
        raise ValueError(f"expected one kernel's resource line, got {len(lines)}")
    fields = dict(f.split(":", 1) for f in lines[0].split() if ":" in f)
    return dict(registers=int(fields["REG"]), stack_bytes=int(fields["STACK"]))


def compile_all(ir_dir: Path) -> list[dict]:
    """Compile every IR of the manifest with Triton for sm_90 -> rows with shared memory, registers, stack."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # XLA's Triton fuses multiply-adds too
    import triton
    from triton.backends.compiler import GPUTarget

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    rows = json.loads((ir_dir / "manifest.json").read_text())
    for row in rows:
        try:
            kernel = triton.compile(str(ir_dir / row["ir"]), target=GPUTarget(*TARGET),
                                    options=dict(num_warps=row["num_warps"], num_stages=row["num_stages"]))
            cubin = ir_dir / (row["ir"] + ".cubin")
            cubin.write_bytes(kernel.asm["cubin"])
            usage = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True,
                                   text=True, check=True).stdout
            row.update(shared_bytes=int(kernel.metadata.shared), **resource_usage(usage))
            row.update(launches=row["shared_bytes"] <= SHARED_LIMIT, spills=row["stack_bytes"] > 0)
        except Exception as e:  # noqa: BLE001
            row.update(error=f"{type(e).__name__}: {e}"[:1000])
        print(f"{row['config']:44s} " + (f"shared {row['shared_bytes']:7d}  regs {row['registers']:3d}  "
                                          f"stack {row['stack_bytes']:5d}" if "error" not in row else row["error"]),
              flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--triton-python", help="a Python with the triton package (default: this one)")
    ap.add_argument("--ir-dir", help="where the captured IR goes (default: a temp dir)")
    ap.add_argument("--capture-only", action="store_true")
    ap.add_argument("--compile-only", action="store_true", help="step 2 on --ir-dir (run by --triton-python)")
    ap.add_argument("--only", help="configurations whose name contains this")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    ir_dir = Path(a.ir_dir or tempfile.mkdtemp(prefix="k3jax-ttir-"))
    ir_dir.mkdir(parents=True, exist_ok=True)
    if a.compile_only:
        (ir_dir / "compiled.json").write_text(json.dumps(dict(
            rows=compile_all(ir_dir), triton=__import__("triton").__version__), indent=1))
        return None
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    rows = capture(ir_dir, a.only)
    print(f"captured {len(rows)} kernels into {ir_dir}", flush=True)
    if a.capture_only:
        return rows
    subprocess.run([a.triton_python or sys.executable, str(Path(__file__).resolve()), "--compile-only",
                    "--ir-dir", str(ir_dir)], check=True)
    compiled = json.loads((ir_dir / "compiled.json").read_text())
    by_name = {r["config"]: r for r in compiled["rows"]}
    result = dict(
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        jax=jax.__version__, triton=compiled["triton"], target=dict(zip(("backend", "arch", "warp_size"), TARGET)),
        shared_limit_bytes=SHARED_LIMIT,
        calibration={c: dict(hardware_shared_bytes=hw, here=by_name.get(c, {}).get("shared_bytes"))
                     for c, hw in CALIBRATION.items()},
        rows=compiled["rows"])
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
