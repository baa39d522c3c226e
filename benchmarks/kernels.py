"""Kernel benchmarks: each op as dispatched (``backend="auto"``) vs. its reference and vs. a
roofline measured in the same run.

    python benchmarks/kernels.py            # K3-like shapes (CPU: a TP shard, T capped)
    python benchmarks/kernels.py --quick    # tiny shapes, seconds (smoke test)
    python benchmarks/kernels.py --out PATH # default benchmarks/results/kernels-<backend>.json

Roofline: bandwidth from a large fp32 ``x + 1`` (bytes read + written / time) and matmul
rate from a large fp32 (and bf16) ``jnp.dot`` (2MNK / time), both timed here, so the
fractions are relative to what this machine delivered to plain XLA at that moment. A case's
roofline time is ``max(bytes / bandwidth, flops / matmul_rate)`` with ``bytes`` the
compulsory traffic (inputs, outputs, states read and written once) and ``flops`` the
algorithm's arithmetic (formulas below); ``fraction`` = roofline time / measured time.

Timing: ``jax.jit``, one warm-up call (compile + first run excluded), then ``--reps`` calls
each ended by ``block_until_ready``; the median is reported (min and all samples kept).
``chunk_kda`` and its token-scan reference are called alternately so that both see the
same machine load (the CPU host this was written on is shared).
On CPU the dispatched backend is the jnp reference (Pallas only runs there in interpret
mode, an HLO emulator for testing, not a performance path, so it is not timed), except where
``auto`` picks a CPU form (``gmm`` -> ``gmm_cpu``, pool decode -> the row loop of
``pool_cpu.py``), which are timed beside their reference; the "reference" of ``chunk_kda`` is
the token-by-token scan (the ground truth).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pallas_kernels.dispatch import resolve_backend  # noqa: E402
from pallas_kernels.kda import chunk_kda, fused_recurrent_kda_pool  # noqa: E402
from pallas_kernels.kda import reference as kda_ref  # noqa: E402
from pallas_kernels.mla import paged_mla_decode, paged_mla_decode_reference  # noqa: E402
from pallas_kernels.moe import MXFP4Weight, gmm, gmm_reference  # noqa: E402

F32 = 4


# ----------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------
def _time(fn, args, reps, *, chain=None):
    """Median wall time of ``fn(*args)``. ``chain(out, args) -> args`` feeds outputs back
    (donated buffers). Returns dict(median, min, samples)."""
    out = jax.block_until_ready(fn(*args))            # compile + warm-up, not timed
    if chain is not None:
        args = chain(out, args)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
        if chain is not None:
            args = chain(out, args)
    return dict(median=statistics.median(samples), min=min(samples),
                samples=[round(s, 6) for s in samples]), out


def _time_pair(f1, f2, args, reps):
    """Like :func:`_time` for two functions of the same arguments, calls interleaved."""
    outs = [jax.block_until_ready(f(*args)) for f in (f1, f2)]
    samples = ([], [])
    for _ in range(reps):
        for i, f in enumerate((f1, f2)):
            t0 = time.perf_counter()
            outs[i] = jax.block_until_ready(f(*args))
            samples[i].append(time.perf_counter() - t0)
    return tuple((dict(median=statistics.median(sm), min=min(sm),
                       samples=[round(v, 6) for v in sm]), o) for sm, o in zip(samples, outs))


# ----------------------------------------------------------------------------------------
# roofline probes
# ----------------------------------------------------------------------------------------
def measure_roofline(quick, reps, n=None, m=None):
    """Bandwidth over ``n`` fp32 values and matmul rates at ``m``^3 (defaults: 256 MiB and 2048, or
    16 MiB and 512 with ``quick``; an accelerator needs larger ones, see ``kernels_gpu.py``)."""
    n = n or ((1 << 22) if quick else (1 << 26))       # 16 MiB / 256 MiB of fp32
    x = jnp.arange(n, dtype=jnp.float32)
    # one op into a fresh output buffer (what a single XLA op sees, allocation included) ...
    t1, _ = _time(jax.jit(lambda a: a + 1.0), (x,), reps)
    # ... and sustained: 8 passes inside one loop, buffers reused (STREAM-like)
    loop = jax.jit(lambda a: jax.lax.fori_loop(0, 8, lambda i, b: b + 1.0, a))
    t8, _ = _time(loop, (x,), reps)
    single, sustained = 2 * n * F32 / t1["median"], 8 * 2 * n * F32 / t8["median"]
    res = dict(bandwidth=dict(
        what=f"fp32 x + 1 over {n * F32 >> 20} MiB (read + write); roof = the larger of a "
             f"single op (fresh output buffer) and 8 passes in a loop (buffers reused)",
        single_op=dict(time=t1, gbps=single / 1e9),
        sustained=dict(time=t8, gbps=sustained / 1e9),
        gbps=max(single, sustained) / 1e9))
    m = m or (512 if quick else 2048)
    for dt in (jnp.float32, jnp.bfloat16):
        a = jax.random.normal(jax.random.PRNGKey(0), (m, m), jnp.float32).astype(dt)
        f = jax.jit(lambda p, q: jnp.dot(p, q, precision=jax.lax.Precision.HIGHEST,
                                         preferred_element_type=jnp.float32))
        t, _ = _time(f, (a, a), reps)
        res[f"matmul_{jnp.dtype(dt).name}"] = dict(
            what=f"{jnp.dtype(dt).name} [{m},{m}] @ [{m},{m}] (fp32 accumulate)",
            flops=2 * m ** 3, time=t, gflops=2 * m ** 3 / t["median"] / 1e9)
    del x
    return res


def _finish(case, roof, *, flops, bytes_, mm="matmul_float32"):
    t = case["time"]["median"]
    bw = roof["bandwidth"]["gbps"] * 1e9
    rate = roof[mm]["gflops"] * 1e9
    t_mem, t_flop = bytes_ / bw, flops / rate
    case.update(flops=int(flops), bytes=int(bytes_), gflops=flops / t / 1e9,
                gbps=bytes_ / t / 1e9, roofline_time=max(t_mem, t_flop),
                bound="memory" if t_mem >= t_flop else "compute",
                roofline_rate=mm, fraction_of_roofline=max(t_mem, t_flop) / t)
    return case


def _rel_err(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ----------------------------------------------------------------------------------------
# KDA
# ----------------------------------------------------------------------------------------
def kda_inputs(seed, B, T, H, K, V, key=None):
    """K3-like inputs: L2-normalised q/k, K3 decay gate (-5 * sigmoid, pushed to the bound).
    ``key``, if given, replaces ``PRNGKey(seed)`` (e.g. an RBG key: much faster to compile)."""
    ks = jax.random.split(jax.random.PRNGKey(seed) if key is None else key, 5)
    l2 = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q = l2(jax.random.normal(ks[0], (B, T, H, K)))
    k = l2(jax.random.normal(ks[1], (B, T, H, K)))
    v = jax.random.normal(ks[2], (B, T, H, V))
    g = -5.0 * jax.nn.sigmoid(2.0 * jax.random.normal(ks[3], (B, T, H, K)) + 2.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    return q, k, v, g, beta


def kda_chunk_flops(T, H, K, V, P):
    """FLOPs of the chunked WY form with P-token (sub-)chunks, per batch row: exponent range
    sums ((2 + log2 P) P x P x K matmul), binary-tree A_kk/A_qk (2*P*K*(P-1) each), diagonal
    q.k^T (2P^2K), block-doubling inverse, W and U (2P^2(K+V)), and per chunk
    [W; q e^G] S (4PKV), A_qk V_new (2P^2V), k_d^T V_new (2PKV). (The jnp reference's
    algorithm with P = 16; for the Pallas kernel, P = 64 is an approximation.)"""
    n = -(-T // P)
    tree = (2 * (2 + P.bit_length() - 1) * P * P * K + 2 * (2 * P * K * (P - 1))
            + 2 * P * P * K)
    inv = sum(2 * 2 * (P // (2 * s)) * s ** 3 for s in (2 ** i for i in range(P.bit_length() - 1)))
    wu = 2 * P * P * (K + V)
    state = 4 * P * K * V + 2 * P * P * V + 2 * P * K * V
    return n * H * (tree + inv + wu + state)


def kda_token_flops(T, H, K, V):
    """Token scan: decay (KV) + k^T S (2KV) + rank-1 update (2KV) + q^T S (2KV) per token."""
    return 7 * T * H * K * V


def kda_io_bytes(B, T, H, K, V):
    """q, k, g, v, beta in; o out; the state read and written once (fp32)."""
    return F32 * (B * T * H * (3 * K + V + 1) + B * T * H * V + 2 * B * H * K * V)


def bench_kda_prefill(cfg, roof, reps, backend):
    B, K, V = 1, cfg["kda_dim"], cfg["kda_dim"]
    P = 16 if backend == "reference" else 64
    chunk = jax.jit(lambda q, k, v, g, b: chunk_kda(q, k, v, g, b, output_final_state=True))
    token = jax.jit(lambda q, k, v, g, b: kda_ref.naive_recurrent_kda(q, k, v, g, b))
    cases = []
    for H, T, with_ref in cfg["kda_prefill"]:
        x = kda_inputs(T + H, B, T, H, K, V)
        shape = dict(B=B, T=T, H=H, K=K, V=V, chunk_size=64, dtype="float32", gate="k3")
        io = kda_io_bytes(B, T, H, K, V)
        if with_ref:      # interleave kernel and reference calls: same load for both
            (tk, (o_k, s_k)), (tr, (o_r, s_r)) = _time_pair(chunk, token, x, reps)
        else:
            tk, (o_k, s_k) = _time(chunk, x, reps)
        c = _finish(dict(name=f"kda_chunk_prefill_H{H}_T{T}", op="chunk_kda", impl=backend,
                         shape=shape, time=tk), roof,
                    flops=kda_chunk_flops(T, H, K, V, P) * B, bytes_=io)
        if with_ref:
            r = _finish(dict(name=f"kda_token_scan_H{H}_T{T}", op="naive_recurrent_kda",
                             impl="reference (token scan)", shape=shape, time=tr), roof,
                        flops=kda_token_flops(T, H, K, V) * B, bytes_=io)
            c["reference"] = dict(op="naive_recurrent_kda (token scan, ground truth)",
                                  time=tr, gflops=r["gflops"],
                                  fraction_of_roofline=r["fraction_of_roofline"])
            c["speedup_vs_reference"] = tr["median"] / tk["median"]
            c["rel_err_vs_reference"] = dict(o=_rel_err(o_k, o_r), state=_rel_err(s_k, s_r))
            cases.append(r)
        cases.append(c)
        print(_line(c), flush=True)
    return cases


def bench_kda_decode(cfg, roof, reps, backend):
    H, K, V = cfg["kda_decode_heads"], cfg["kda_dim"], cfg["kda_dim"]

    def stepper(be):
        return jax.jit(lambda pool, slots, q, k, v, g, b:
                       fused_recurrent_kda_pool(q, k, v, g, b, pool, slots, backend=be)[::-1],
                       donate_argnums=0)

    step, ref_step = stepper("auto"), stepper("reference")
    cases = []
    for Bd in cfg["decode_batch"]:
        x = kda_inputs(100 + Bd, Bd, 1, H, K, V)
        pool = 0.1 * jax.random.normal(jax.random.PRNGKey(Bd), (Bd, H, K, V), jnp.float32)
        slots = jnp.asarray(np.random.default_rng(Bd).permutation(Bd), jnp.int32)
        chain = lambda out, args: (out[0],) + tuple(args[1:])   # donated pool -> next step
        o_k = step(pool + 0, slots, *x)[1]
        t, _ = _time(step, (pool + 0, slots) + x, reps, chain=chain)
        io = F32 * (Bd * H * (3 * K + V + 1) + Bd * H * V + 2 * Bd * H * K * V)
        cpu = backend == "reference"
        c = _finish(dict(name=f"kda_decode_pool_B{Bd}", op="fused_recurrent_kda_pool",
                         impl="row loop (pool_cpu.py)" if cpu else backend,
                         shape=dict(B=Bd, T=1, H=H, K=K, V=V, pool=Bd, dtype="float32", pool_donated=True),
                         time=t), roof,
                    flops=kda_token_flops(1, H, K, V) * Bd, bytes_=io)
        if cpu:  # auto on CPU is the row loop; time the gather -> scan -> scatter reference beside it
            o_r = ref_step(pool + 0, slots, *x)[1]
            tr, _ = _time(ref_step, (pool + 0, slots) + x, reps, chain=chain)
            c["reference"] = dict(op="fused_recurrent_kda_pool_reference", time=tr)
            c["speedup_vs_reference"] = tr["median"] / t["median"]
            c["rel_err_vs_reference"] = dict(o=_rel_err(o_k, o_r))
        cases.append(c)
        print(_line(c), flush=True)
    return cases


# ----------------------------------------------------------------------------------------
# MoE grouped matmul
# ----------------------------------------------------------------------------------------
def gmm_cost(M, d, I, E, kind):
    """(flops, bytes) of ``gmm`` with ``M`` routed bf16 rows of width ``d`` against ``E``
    experts ``[I, d]``: the whole weight read once (bf16, or MXFP4 packed nibbles + one E8M0
    scale byte per 32), the rows read, the fp32 output written."""
    wbytes = E * I * d * 2 if kind == "dense_bf16" else E * I * (d // 2 + d // 32)
    return 2 * M * d * I, M * d * 2 + wbytes + M * I * F32


def bench_gmm(cfg, roof, reps, backend):
    E, d, I = cfg["moe_experts"], cfg["moe_d"], cfg["moe_i"]
    rng = np.random.default_rng(7)
    w = jnp.asarray(rng.standard_normal((E, I, d)) * 0.05, jnp.bfloat16)
    wq = MXFP4Weight(packed=jnp.asarray(rng.integers(0, 256, (E, I, d // 2), dtype=np.uint8)),
                     scale=jnp.asarray(rng.integers(119, 125, (E, I, d // 32), dtype=np.uint8)),
                     group_size=32)
    f = jax.jit(lambda x, r, gs: gmm(x, r, gs, preferred_element_type=jnp.float32))
    w_in_out = jnp.swapaxes(w, 1, 2)
    f_in_out = jax.jit(lambda x, r, gs: gmm(x, r, gs, preferred_element_type=jnp.float32, rhs_layout="in_out"))
    cases = []
    for M in cfg["moe_M"]:
        x = jnp.asarray(rng.standard_normal((M, d)), jnp.bfloat16)
        gs = jnp.asarray(np.bincount(rng.integers(0, E, M), minlength=E), jnp.int32)
        for kind, rhs in (("dense_bf16", w), ("mxfp4", wq)):
            t, _ = _time(f, (x, rhs, gs), reps)
            flops, bytes_ = gmm_cost(M, d, I, E, kind)
            # on CPU `gmm(backend="auto")` runs the block-padded jnp path (moe/blocked.py), not ragged_dot
            c = _finish(dict(name=f"moe_gmm_{kind}_M{M}", op="gmm",
                             impl="blocked (jnp)" if backend == "reference" else backend,
                             shape=dict(M=M, K=d, N=I, G=E, lhs="bfloat16", rhs=kind,
                                        out="float32"),
                             time=t, reference="gmm_reference (ragged_dot)"), roof,
                        flops=flops, bytes_=bytes_, mm="matmul_bfloat16")
            tr, _ = _time(jax.jit(lambda a, r, g_: gmm_reference(a, r, g_)), (x, rhs, gs), reps)
            c["reference"] = dict(op="gmm_reference", time=tr)
            c["speedup_vs_reference"] = tr["median"] / t["median"]
            if kind == "dense_bf16":  # the same experts held [E, K, N] (k3jax/weight_layout.py)
                ti, _ = _time(f_in_out, (x, w_in_out, gs), reps)
                c["in_out"] = dict(op='gmm(rhs_layout="in_out")', time=ti,
                                   speedup_vs_out_in=t["median"] / ti["median"])
            cases.append(c)
            print(_line(c) + (f" | in_out {c['in_out']['speedup_vs_out_in']:.2f}x" if "in_out" in c else ""),
                  flush=True)
    return cases


# ----------------------------------------------------------------------------------------
# paged MLA decode
# ----------------------------------------------------------------------------------------
def mla_cost(B, S, H, L, R, page_table_size, token_bytes=None):
    """(flops, bytes) of one absorbed paged MLA decode step in bf16: scores over ``L + R``
    and context over ``L`` per head and token; the ``B*S`` cached ``[L + R]`` rows read once
    (``token_bytes`` each: bf16 by default, 656 for fp8 latent pages), the queries read, the context
    written, the int32 page table read."""
    flops = 2 * B * H * S * (L + R) + 2 * B * H * S * L
    per_token = (L + R) * 2 if token_bytes is None else token_bytes
    bytes_ = B * S * per_token + B * H * (L + R) * 2 + B * H * L * 2 + page_table_size * 4
    return flops, bytes_


def bench_mla(cfg, roof, reps, backend):
    H, L, R, PS = cfg["mla_heads"], 512, 64, cfg["mla_page"]
    rng = np.random.default_rng(11)
    f = jax.jit(lambda *a: paged_mla_decode(*a, scale=(128 + 64) ** -0.5))
    cases = []
    for Bm, S in cfg["mla_BS"]:
        npg = Bm * S // PS
        q = jnp.asarray(rng.standard_normal((Bm, H, L)), jnp.bfloat16)
        qr = jnp.asarray(rng.standard_normal((Bm, H, R)), jnp.bfloat16)
        kv = jnp.asarray(rng.standard_normal((npg, PS, L + R)), jnp.bfloat16)
        pt = jnp.asarray(rng.permutation(npg).reshape(Bm, S // PS), jnp.int32)
        sl = jnp.full((Bm,), S, jnp.int32)
        t, _ = _time(f, (q, qr, kv, pt, sl), reps)
        flops, bytes_ = mla_cost(Bm, S, H, L, R, pt.size)
        c = _finish(dict(name=f"mla_paged_decode_B{Bm}_S{S}", op="paged_mla_decode",
                         impl=backend, shape=dict(B=Bm, S=S, H=H, L=L, R=R, page_size=PS,
                                                  dtype="bfloat16"),
                         time=t, reference="paged_mla_decode_reference (same code)"
                         if backend == "reference" else None), roof,
                    flops=flops, bytes_=bytes_, mm="matmul_bfloat16")
        if backend != "reference":
            tr, _ = _time(jax.jit(lambda *a: paged_mla_decode_reference(
                *a, scale=(128 + 64) ** -0.5)), (q, qr, kv, pt, sl), reps)
            c["reference"] = dict(op="paged_mla_decode_reference", time=tr)
            c["speedup_vs_reference"] = tr["median"] / t["median"]
        cases.append(c)
        print(_line(c), flush=True)
    return cases


# ----------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------
def _line(c):
    s = (f"{c['name']:32s} {c['time']['median'] * 1e3:10.2f} ms  {c['gflops']:8.2f} GFLOP/s "
         f"{c['gbps']:8.2f} GB/s  roofline {c['fraction_of_roofline'] * 100:5.1f}% "
         f"({c['bound']})")
    if "speedup_vs_reference" in c:
        s += f"  x{c['speedup_vs_reference']:.2f} vs reference"
    return s


def config(quick, backend):
    accel = backend in ("gpu", "tpu")
    if quick:
        return dict(kda_dim=32, kda_prefill=[(2, 256, True), (2, 1024, True)],
                    kda_decode_heads=2, decode_batch=[1, 8], moe_experts=4, moe_d=128,
                    moe_i=64, moe_M=[64], mla_heads=4, mla_page=16, mla_BS=[(2, 256)])
    # KDA prefill (H, T, time the token-scan reference too): K3 has 96 KDA heads of dim 128;
    # on CPU a tensor-parallel shard of 8 heads up to T = 8192, plus one full-width case
    prefill = ([(96, T, T in (1024, 4096)) for T in (1024, 2048, 4096, 8192)] if accel else
               [(8, T, T != 2048) for T in (1024, 2048, 4096, 8192)] + [(96, 1024, True)])
    return dict(
        kda_dim=128, kda_prefill=prefill, kda_decode_heads=96 if accel else 8,
        decode_batch=[1, 8, 32, 64, 128, 256],
        # latent MoE scaled down: 32 experts, latent width 1024, expert width 512;
        # M = routed rows (tokens * top-k)
        moe_experts=32 if not accel else 256, moe_d=1024 if not accel else 2048,
        moe_i=512 if not accel else 1024, moe_M=[256, 2048] if not accel else [256, 8192],
        # absorbed MLA: 576-wide latent (512 + 64 rope); 16 query heads (a TP shard)
        mla_heads=16, mla_page=64,
        mla_BS=[(1, 4096), (8, 4096), (32, 2048)] if not accel else
        [(1, 8192), (32, 8192), (128, 4096)])


def machine_info():
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as fh:
            names = [ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    info = dict(platform=platform.platform(), python=platform.python_version(), cpu=cpu,
                cpu_count=os.cpu_count(), jax=jax.__version__,
                jaxlib=getattr(jax.lib, "__version__", None) or
                __import__("jaxlib").__version__,
                backend=jax.default_backend(), devices=[str(d) for d in jax.devices()],
                xla_flags=os.environ.get("XLA_FLAGS", ""),
                kernels_env=os.environ.get("K3JAX_KERNELS", ""))
    try:
        info["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (seconds)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per case")
    ap.add_argument("--out", default=None, help="JSON path")
    ap.add_argument("--only", default="", help="comma list: prefill,decode,gmm,mla")
    a = ap.parse_args(argv)
    reps = a.reps or (3 if a.quick else 7)
    plat = jax.default_backend()
    backend = resolve_backend("auto")
    cfg = config(a.quick, plat)
    only = set(filter(None, a.only.split(",")))
    t_start = time.time()
    info = machine_info()
    print(f"backend={plat} dispatched={backend} jax={jax.__version__} "
          f"loadavg={info.get('loadavg_start')}", flush=True)
    roof = measure_roofline(a.quick, reps)
    print(f"roofline: {roof['bandwidth']['gbps']:.1f} GB/s, "
          f"{roof['matmul_float32']['gflops']:.1f} GFLOP/s fp32, "
          f"{roof['matmul_bfloat16']['gflops']:.1f} GFLOP/s bf16", flush=True)
    cases = []
    for key, fn in (("prefill", bench_kda_prefill), ("decode", bench_kda_decode),
                    ("gmm", bench_gmm), ("mla", bench_mla)):
        if not only or key in only:
            cases += fn(cfg, roof, reps, backend)
    summary = {}
    for c in cases:
        if c["op"] == "chunk_kda" and "speedup_vs_reference" in c:
            summary[f"speedup_chunk_vs_token_scan_H{c['shape']['H']}_T{c['shape']['T']}"] = \
                c["speedup_vs_reference"]
    info["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    result = dict(
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        mode="quick" if a.quick else "default", reps=reps, machine=info,
        dispatched_backend=backend,
        note=("CPU: 'kernel' = the dispatched backend, i.e. the jnp reference; Pallas "
              "interpret mode is an HLO emulator for tests, not a performance path, and is "
              "not timed.") if plat == "cpu" else "",
        roofline=roof, config={k: v for k, v in cfg.items()}, summary=summary, cases=cases,
        wall_seconds=time.time() - t_start)
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"kernels-{plat}.json"
    if a.quick and not a.out:
        out = out.with_name(f"kernels-{plat}-quick.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    print(f"summary: {summary}\nwrote {out} in {result['wall_seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
