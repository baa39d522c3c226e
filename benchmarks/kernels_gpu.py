"""Device check of the Pallas kernels: compile them for real, compare each with its jnp
reference, time them at K3-like shapes, and time fla's Triton KDA kernels (the peer) on the
same inputs.

    bash benchmarks/device_kernels.sh             # on a lent GPU (pallas_kernels/kda/README.md)
    python benchmarks/kernels_gpu.py --quick --interpret --skip-peer --out /tmp/kg.json  # CPU

Cases, in this order (the time budget can only cut the tail):

1. correctness at small ragged shapes (``check_*``): KDA ``chunk_kda`` (dense with an initial
   state, and varlen ``cu_seqlens`` with an empty sequence), ``fused_recurrent_kda``,
   ``fused_recurrent_kda_pool`` (a padded row, untouched slots), MoE ``gmm`` (fp32, bf16 and
   MXFP4 weights, rows past ``sum(group_sizes)``), paged MLA decode (fp32, bf16, a zero-length
   row); KDA also against the token-by-token scan (the ground truth);
2. timing at K3-like shapes, each also checked against the reference on the same inputs:
   KDA pooled decode (H=96, batch 1..256; fla ``fused_recurrent_kda`` as the peer), KDA
   prefill (B=1, H=96, T up to 8192; fla ``chunk_kda`` as the peer), MoE gmm (one
   expert-parallel shard of K3: 112 experts, 3584 -> 3072), paged MLA decode, KDA prefill on a
   tensor-parallel shard (H=8).

Kernels run with ``backend="pallas"`` (``--interpret``: ``"interpret"``); references with
``backend="reference"`` (fp32 at ``Precision.HIGHEST``). Inputs are fresh random draws; the KDA
gate has K3's form ``-5 * sigmoid(.)`` pushed toward the lower bound. Errors: ``rel_l2`` =
``|a - b|_2 / |b|_2`` and ``max_rel`` = ``max|a - b| / max|b|``; a check passes when both are
within the case's tolerances (see ``TOL``) and the output is finite.

Timing (compile excluded): ``time_blocked`` = median of ``reps`` calls each ended by
``block_until_ready`` (``benchmarks/kernels.py:_time``); ``time`` (the headline, used for
rates, ratios and goals) = median over samples of *pipelined* calls: ``n`` calls issued back
to back and one wait at the end, divided by ``n``, so host dispatch overlaps the device work
as it does inside a serving step. fla is timed the same way (``time``) and with CUDA events
per call (``time_events``). Roofline: ``benchmarks/kernels.py:measure_roofline`` in the same
run (fp32 ``x + 1`` bandwidth; fp32/bf16 matmul rates).

Every case is wrapped: an exception is recorded (type and message) and the run goes on; the
JSON is rewritten after every case, so a run cut short still leaves what it measured. Cases
starting after ``--time-budget`` seconds are recorded as skipped.
"""

from __future__ import annotations

import os

# Before JAX initialises its GPU client: torch (fla) needs GPU memory in the same process,
# and JAX would otherwise reserve 75% of it up front. fla: pin its default Triton kernels.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _load_bench_kernels():
    """Import ``benchmarks/kernels.py`` by path (``benchmarks`` is not a package, and a bare
    ``import kernels`` could pick up an unrelated installed module)."""
    name = "k3jax_bench_kernels"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("kernels.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


kb = _load_bench_kernels()

from pallas_kernels.dispatch import resolve_interpret  # noqa: E402
from pallas_kernels.kda import (  # noqa: E402
    chunk_kda,
    fused_recurrent_kda,
    fused_recurrent_kda_pool,
    naive_recurrent_kda,
)
from pallas_kernels.kda.pallas_kda import triton_available  # noqa: E402
from pallas_kernels.mla import paged_mla_decode  # noqa: E402
from pallas_kernels.moe import MXFP4Weight, gmm  # noqa: E402

HI = jax.lax.Precision.HIGHEST
LOWER_BOUND = -5.0            # K3's KDA gate lower bound (g = -5 * sigmoid(.))
RESULT_NAME = "kernels-gpu.json"

# (rel_l2, max_rel) tolerances of a kernel vs its reference, by what is compared.
TOL = {
    # fp32 KDA: kernel (chunked WY form / token loop, fp32 dots) vs the fp32 HIGHEST
    # reference; interpret mode on CPU lands at ~2e-7.
    "kda_f32": (1e-5, 5e-5),
    # a bf16-stored state: an fp32 difference of one ulp can flip one value's bf16 rounding (2^-8 of it)
    "kda_bf16_state": (1e-3, 1e-2),
    # one-pass TF32 data products (10-bit mantissas; gate sums stay fp32): interpret-mode
    # emulation on CPU lands at ~4e-4
    "kda_tf32": (3e-3, 1e-2),
    # bf16 data products (8-bit mantissas, fp32 sums; gate sums as two TF32 halves): fla's
    # production inputs are bf16 too
    "kda_bf16_products": (3e-2, 1e-1),
    # fp32 gmm / MLA: HIGHEST dots (IEEE fp32 in the Triton lowering) on both sides.
    "f32": (1e-5, 1e-4),
    # bf16 / MXFP4 gmm: the products are exact in fp32 (MXFP4 decodes exactly to bf16), only
    # the summation order differs.
    "gmm_bf16": (1e-3, 1e-3),
    # bf16 MLA: the kernel rounds the softmax probabilities to bf16 for the PV product, the
    # reference keeps them fp32 (as tests/test_mla_paged.py: 3e-2).
    "mla_bf16": (1e-2, 3e-2),
    # fla vs our reference: only "computes the same thing" (fla uses TF32 / bf16 dots), so
    # only rel_l2 is gated; a semantic mismatch (gate, scale, layout) gives O(0.1 .. 1).
    "peer_float32": (1e-2, None),
    "peer_bfloat16": (5e-2, None),
}

# fla prefill variants: same fp32 inputs (apples to apples), and K3's production form
# (bf16 q/k/v/beta, fp32 g and state, ``safe_gate`` since K3's gate is bounded at -5).
PEER_PREFILL_VARIANTS = {
    "fp32": dict(dtype="float32", kwargs={}),
    "bf16_safe_gate": dict(dtype="bfloat16",
                           kwargs=dict(safe_gate=True, lower_bound=LOWER_BOUND)),
}
SMALL_ELEMENTS = 1 << 22       # errors of outputs up to this size: numpy float64, else device
L2_BYTES = 64 << 20            # about an H100/H200's L2 (50 MB), rounded up
GOAL_PREFILL_RATIO = 0.8       # our KDA prefill throughput / fla's
# chunk_kda_pallas(dot_precision=...) variants timed beside the kernel's default, less the default
# itself (GPU: tf32x3, so tf32 and bf16; IEEE "highest" is never timed there: Triton unrolls IEEE fp32
# dots into FMA loops and the kernel did not compile in 5 minutes, see default_dot_precision)
PREFILL_DOT_PRECISIONS = ("tf32x3", "tf32", "bf16")
GOAL_DECODE_BW = 0.7           # KDA decode fraction of measured HBM bandwidth, batch >= 64


# ----------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------
def config(quick):
    """Shapes. Full: K3 (KDA 96 heads of dim 128, MLA 576-wide latent, latent MoE
    3584 -> 3072 over one 8-way expert-parallel shard of 896 experts = 112). Quick: tiny."""
    if quick:
        return dict(
            kda_dim=16, reps=2, pipeline_target_s=0.002, slow_case_s=30.0,
            check_chunk=dict(B=2, T=50, H=2), check_varlen=dict(cu=[0, 20, 20, 50], H=2),
            check_recurrent=dict(B=2, T=10, H=2), check_pool=dict(B=4, S=6, H=2),
            check_gmm=dict(M=64, K=128, N=64, G=4), check_mla=dict(B=2, H=16, S=64, page=16),
            decode_heads=2, decode_batch=[3], prefill=[(2, 64)], prefill_shard=[],
            decode_sweep=dict(shapes={3: [(8, 1), (16, 2)]}),
            gmm=dict(E=4, d=128, I=64, M=[64]), mla=[(4, 2, 128)], mla_page=16,
            peer_prefill_variants=["fp32"])
    return dict(
        kda_dim=128, reps=5, pipeline_target_s=0.05, slow_case_s=5.0,
        check_chunk=dict(B=2, T=300, H=4), check_varlen=dict(cu=[0, 100, 100, 333, 512], H=4),
        check_recurrent=dict(B=2, T=20, H=4), check_pool=dict(B=8, S=12, H=4),
        check_gmm=dict(M=512, K=1024, N=512, G=8), check_mla=dict(B=4, H=32, S=512, page=64),
        decode_heads=96, decode_batch=[1, 8, 64, 256],
        # pooled decode kernel shapes (block_v, num_warps) per batch: the goal's batches, 4 x 128
        # threads over 4096 state values (the default) against fewer/more per program
        decode_sweep=dict(shapes={64: [(8, 1), (16, 1), (16, 2), (32, 2), (32, 4), (64, 4), (64, 8),
                                       (128, 8)],
                                  256: [(16, 1), (32, 2), (32, 4), (64, 4)]}),
        # the goal's shape (T = 8192) first: a phase that runs out of time cuts the shorter ones
        prefill=[(96, 8192), (96, 1024), (96, 4096)],
        prefill_shard=[(8, 1024), (8, 4096), (8, 8192)],
        # M = routed rows on the shard: 64 decode tokens * top-16 / 8, 8192 prefill tokens
        gmm=dict(E=112, d=3584, I=3072, M=[128, 16384]),
        # (H, B, S): 16 heads = a tensor-parallel shard of 96, plus all 96 heads once
        mla=[(16, 1, 8192), (16, 32, 8192), (16, 128, 4096), (96, 32, 8192)], mla_page=64,
        peer_prefill_variants=list(PEER_PREFILL_VARIANTS))


# ----------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------
@jax.jit
def _jnp_errors(a, b):
    """Error metrics on the device (fp32; GB-sized outputs would be slow in numpy)."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    d = jnp.abs(a - b)
    tiny = jnp.float32(1e-30)
    return (jnp.sqrt(jnp.sum(d * d)) / jnp.maximum(jnp.sqrt(jnp.sum(b * b)), tiny),
            jnp.max(d) / jnp.maximum(jnp.max(jnp.abs(b)), tiny), jnp.max(d),
            jnp.all(jnp.isfinite(a)))


def _torch_errors(torch, a, b):
    """Same metrics for a torch output against a numpy / torch reference, on ``a``'s device."""
    if not isinstance(b, torch.Tensor):
        b = torch.from_numpy(np.require(np.asarray(b), requirements=["C", "W"]))
    a, b = a.float(), b.to(a.device).float()
    d = (a - b).abs()
    tiny = 1e-30
    return (float(torch.linalg.vector_norm(d) / max(float(torch.linalg.vector_norm(b)), tiny)),
            float(d.max() / max(float(b.abs().max()), tiny)), float(d.max()),
            bool(torch.isfinite(a).all()))


def errors(out, ref):
    """``rel_l2``, ``max_rel`` (relative to ``max|ref|``), ``max_abs`` and finiteness of
    ``out`` (jax / numpy / torch) against ``ref`` (jax / numpy; numpy or torch for a torch
    ``out``)."""
    if hasattr(out, "detach"):                                  # torch (the peer)
        e = _torch_errors(sys.modules["torch"], out.detach(), ref)
    elif np.size(out) <= SMALL_ELEMENTS:                        # float64 on the host
        a, b = (np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64) for x in (out, ref))
        d, tiny = np.abs(a - b), 1e-30
        e = (np.linalg.norm(d) / max(np.linalg.norm(b), tiny) if d.size else 0.0,
             d.max() / max(np.abs(b).max(), tiny) if d.size else 0.0,
             d.max() if d.size else 0.0, np.isfinite(a).all())
    else:                                                       # on the device (one compile
        e = [v.item() for v in _jnp_errors(jnp.asarray(out), jnp.asarray(ref))]  # per shape)
    return dict(rel_l2=float(e[0]), max_rel=float(e[1]), max_abs=float(e[2]),
                finite=bool(e[3]))


def check(pairs, tol_key):
    """Compare named ``(out, ref)`` pairs; pass when every one is finite and within
    ``TOL[tol_key]``. Returns a JSON-able dict."""
    tol_l2, tol_max = TOL[tol_key]
    tensors = {name: errors(o, r) for name, (o, r) in pairs.items()}
    ok = all(e["finite"] and e["rel_l2"] <= tol_l2
             and (tol_max is None or e["max_rel"] <= tol_max) for e in tensors.values())
    return dict(passed=bool(ok), tol=dict(rel_l2=tol_l2, max_rel=tol_max, key=tol_key),
                tensors=tensors)


def _block(x):
    return jax.block_until_ready(x)


def _timed_first_call(fn, *args):
    """``(out, seconds)`` of the first call: compile + one run."""
    t0 = time.perf_counter()
    out = _block(fn(*args))
    return out, time.perf_counter() - t0


def _stats(samples):
    return dict(median=statistics.median(samples), min=min(samples),
                samples=[round(s, 7) for s in samples])


def time_pipelined(fn, args, *, per_call_s, target_s, samples=3, chain=None, max_calls=200):
    """Per-call time of ``n`` back-to-back calls and one wait, median over ``samples``; ``fn``
    must be warm. ``n`` is sized from ``per_call_s`` so a sample lasts about ``target_s``.
    ``chain(out, args) -> args`` feeds outputs back (donated buffers).
    Returns ``(stats, args)`` (``args`` valid afterwards)."""
    n = int(max(1, min(max_calls, target_s / max(per_call_s, 1e-6))))
    per = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
            if chain is not None:
                args = chain(out, args)
        _block(out)
        per.append((time.perf_counter() - t0) / n)
    st = _stats(per)
    st["calls_per_sample"] = n
    return st, args


def time_jax(fn, args, cfg, chain=None):
    """``(time, time_blocked)`` of a jitted ``fn`` (compile excluded): the blocked per-call
    median (``kernels._time``), then the pipelined one, unless the case is so slow that the
    blocked calls already took ``cfg['slow_case_s']`` (then ``time`` is the blocked one)."""
    tb, out = kb._time(fn, args, cfg["reps"], chain=chain)
    if chain is not None:
        args = chain(out, args)
    del out
    if tb["median"] * cfg["reps"] > cfg["slow_case_s"]:
        return dict(tb, calls_per_sample=1, note="slow case: blocked timing only"), tb
    tp, _ = time_pipelined(fn, args, per_call_s=tb["median"], target_s=cfg["pipeline_target_s"],
                           chain=chain)
    return tp, tb


def kernel_backend(interpret):
    """The ``backend=`` string for our kernels: ``"interpret"`` or ``"pallas"``."""
    return "interpret" if interpret else "pallas"


def require_lowering(interpret):
    """Raise NotImplementedError when a compiled Pallas kernel cannot run here: on GPU all our
    kernels use the Pallas Triton lowering, and without it ``ops`` would silently fall back to
    the jnp reference (timing the reference as if it were the kernel)."""
    if interpret or jax.default_backend() != "gpu":
        return
    if not triton_available():
        raise NotImplementedError(
            f"jax {jax.__version__} has no Pallas Triton lowering "
            "(jax.experimental.pallas.triton); the GPU kernels need it")


def _rbg_key(seed):
    """An RBG PRNG key: its programs compile in about a fifth of threefry's time on CPU."""
    return jax.random.key(seed, impl="rbg")


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6))
def kda_case(seed, B, T, H, K, N, state_scale=0.5):
    """``(q, k, v, g, beta)`` from ``kernels.kda_inputs`` (K = V; K3 gate) and a fresh random
    state ``[N, H, K, K]`` fp32, jitted whole (eagerly every random op compiles on its own)."""
    k_x, k_s = jax.random.split(_rbg_key(seed))
    x = kb.kda_inputs(seed, B, T, H, K, K, key=k_x)
    return x, state_scale * jax.random.normal(k_s, (N, H, K, K), jnp.float32)


def _rates(case, roof, *, flops, bytes_, mm="matmul_float32", tokens=None):
    """Add rates and roofline fractions (``kernels._finish``) plus the fraction of the
    measured HBM bandwidth and tokens/s."""
    kb._finish(case, roof, flops=flops, bytes_=bytes_, mm=mm)
    case["fraction_of_bandwidth"] = case["gbps"] / roof["bandwidth"]["gbps"]
    if tokens is not None:
        case["tokens_per_s"] = tokens / case["time"]["median"]
    return case


# ----------------------------------------------------------------------------------------
# case runner
# ----------------------------------------------------------------------------------------
class Runner:
    """Runs cases, each wrapped so a failure is recorded and the run goes on; rewrites the
    JSON after every case; skips cases once the time budget is spent."""

    def __init__(self, result, paths, budget_s, t0=None, case_timeout_s=None):
        self.result, self.paths = result, paths
        self.t0 = time.time() if t0 is None else t0
        self.budget_s = budget_s
        self.case_timeout_s = case_timeout_s

    def _watchdog(self, name, t0):
        """A case past ``case_timeout_s`` (a compile that does not end cannot be interrupted from
        Python): record it as timed out, save, and end the process (the next phase goes on)."""
        case = dict(name=name, status="timeout", wall_s=round(time.time() - t0, 3),
                    error=f"timeout: still running after {self.case_timeout_s:.0f} s "
                          "(compile or run); process ended")
        self.result["cases"].append(case)
        print(_line(case), flush=True)
        self.save()
        os._exit(4)

    def elapsed(self):
        return time.time() - self.t0

    def save(self):
        self.result["wall_seconds"] = self.elapsed()
        text = json.dumps(self.result, indent=1, default=_json_default) + "\n"
        for p in self.paths:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)

    def run(self, name, fn):
        """Run ``fn() -> dict`` as case ``name``; record ok / error / skipped."""
        if self.elapsed() > self.budget_s:
            case = dict(status="skipped", reason=f"time budget of {self.budget_s:.0f} s spent "
                                                 f"({self.elapsed():.0f} s elapsed)")
        else:
            t0 = time.time()
            timer = None
            if self.case_timeout_s:
                import threading
                timer = threading.Timer(self.case_timeout_s, self._watchdog, (name, t0))
                timer.daemon = True
                timer.start()
            try:
                case = fn()
                case.setdefault("status", "ok")
            except Exception as e:  # noqa: BLE001 -- record every failure, keep going
                case = dict(status="error", error=f"{type(e).__name__}: {e}"[:2000],
                            traceback=traceback.format_exc()[-3000:])
            finally:
                if timer is not None:
                    timer.cancel()
            case["wall_s"] = round(time.time() - t0, 3)
        case = dict(name=name, **case)
        self.result["cases"].append(case)
        print(_line(case), flush=True)
        self.save()
        return case


def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def _line(c):
    """One log line per case."""
    s = f"{c['name']:34s} {c['status']:7s}"
    if c["status"] in ("error", "timeout"):
        return s + " " + c["error"].splitlines()[0][:200]
    if c["status"] == "skipped":
        return s + " " + c["reason"]
    chk = c.get("check")
    if chk:
        worst = max(chk["tensors"].values(), key=lambda e: e["rel_l2"])
        s += (f" {'PASS' if chk['passed'] else 'FAIL'} rel_l2 {worst['rel_l2']:.2e} "
              f"max_rel {worst['max_rel']:.2e}")
    if "time" in c:
        s += f"  {c['time']['median'] * 1e3:9.3f} ms {c['gbps']:8.1f} GB/s"
        if "tokens_per_s" in c:
            s += f" {c['tokens_per_s']:12.0f} tok/s"
    for v, p in (c.get("peer") or {}).items():
        if isinstance(p, dict) and "ratio_ours_over_peer" in p:
            s += f"  ours/fla[{v}] {p['ratio_ours_over_peer']:.2f}"
    return s


# ----------------------------------------------------------------------------------------
# correctness cases (small ragged shapes)
# ----------------------------------------------------------------------------------------
def check_kda_chunk(cfg, interpret):
    """Dense ``chunk_kda`` (T not a multiple of 64, initial state) vs the chunked reference
    and the token scan."""
    require_lowering(interpret)
    B, T, H = (cfg["check_chunk"][k] for k in "BTH")
    K = V = cfg["kda_dim"]
    x, S0 = kda_case(11, B, T, H, K, B)
    (o, s), comp = _timed_first_call(lambda *a: chunk_kda(
        *a, initial_state=S0, output_final_state=True, backend=kernel_backend(interpret)), *x)
    o_r, s_r = chunk_kda(*x, initial_state=S0, output_final_state=True, backend="reference")
    o_n, s_n = naive_recurrent_kda(*x, None, S0)
    return dict(op="chunk_kda", shape=dict(B=B, T=T, H=H, K=K, V=V, dtype="float32"),
                compile_s=comp,
                check=check({"o": (o, o_r), "final_state": (s, s_r),
                             "o_vs_token_scan": (o, o_n),
                             "final_state_vs_token_scan": (s, s_n)}, "kda_f32"))


def check_kda_chunk_bf16_state(cfg, interpret):
    """Dense ``chunk_kda`` with the state rounded to bf16 at every chunk end (``state_dtype``, the
    engine's ``kda_state_dtype="bfloat16"``) vs the reference doing the same."""
    require_lowering(interpret)
    B, T, H = (cfg["check_chunk"][k] for k in "BTH")
    K = V = cfg["kda_dim"]
    x, S0 = kda_case(12, B, T, H, K, B)
    S0 = S0.astype(jnp.bfloat16).astype(jnp.float32)
    run = lambda backend: chunk_kda(*x, initial_state=S0, output_final_state=True, state_dtype="bfloat16",
                                    backend=backend)
    (o, s), comp = _timed_first_call(lambda: run(kernel_backend(interpret)))
    o_r, s_r = run("reference")
    return dict(op="chunk_kda", shape=dict(B=B, T=T, H=H, K=K, V=V, dtype="float32", state_dtype="bfloat16"),
                compile_s=comp, check=check({"o": (o, o_r), "final_state": (s, s_r)}, "kda_bf16_state"))


def check_kda_chunk_varlen(cfg, interpret):
    """Varlen ``chunk_kda`` (``cu_seqlens`` with an empty sequence, per-sequence initial
    states) vs the reference."""
    require_lowering(interpret)
    cu, H = cfg["check_varlen"]["cu"], cfg["check_varlen"]["H"]
    K = V = cfg["kda_dim"]
    T, N = cu[-1], len(cu) - 1
    x, S0 = kda_case(21, 1, T, H, K, N)
    cu_a = jnp.asarray(cu, jnp.int32)
    run = lambda backend: chunk_kda(*x, initial_state=S0, output_final_state=True,
                                    cu_seqlens=cu_a, backend=backend)
    (o, s), comp = _timed_first_call(lambda: run(kernel_backend(interpret)))
    o_r, s_r = run("reference")
    return dict(op="chunk_kda", shape=dict(B=1, T=T, H=H, K=K, V=V, cu_seqlens=cu,
                                           dtype="float32"),
                compile_s=comp, check=check({"o": (o, o_r), "final_state": (s, s_r)}, "kda_f32"))


def check_kda_recurrent(cfg, interpret):
    """``fused_recurrent_kda`` (T not a multiple of the 8-token block) vs the reference."""
    require_lowering(interpret)
    B, T, H = (cfg["check_recurrent"][k] for k in "BTH")
    K = V = cfg["kda_dim"]
    x, S0 = kda_case(31, B, T, H, K, B)
    run = lambda backend: fused_recurrent_kda(*x, initial_state=S0, output_final_state=True,
                                              backend=backend)
    (o, s), comp = _timed_first_call(lambda: run(kernel_backend(interpret)))
    o_r, s_r = run("reference")
    return dict(op="fused_recurrent_kda", shape=dict(B=B, T=T, H=H, K=K, V=V, dtype="float32"),
                compile_s=comp, check=check({"o": (o, o_r), "final_state": (s, s_r)}, "kda_f32"))


def check_kda_pool(cfg, interpret):
    """Pooled decode: a padded row (slot -1), slots in shuffled order, untouched slots."""
    require_lowering(interpret)
    B, S, H = (cfg["check_pool"][k] for k in "BSH")
    K = V = cfg["kda_dim"]
    x, pool = kda_case(41, B, 1, H, K, S)
    slots = np.random.default_rng(43).permutation(S)[:B].astype(np.int32)
    slots[1] = -1
    slots = jnp.asarray(slots)
    run = lambda backend: fused_recurrent_kda_pool(*x, pool, slots, backend=backend)
    (o, p), comp = _timed_first_call(lambda: run(kernel_backend(interpret)))
    o_r, p_r = run("reference")
    return dict(op="fused_recurrent_kda_pool",
                shape=dict(B=B, T=1, H=H, K=K, V=V, pool=S, slots=np.asarray(slots).tolist(),
                           dtype="float32"),
                compile_s=comp, check=check({"o": (o, o_r), "pool": (p, p_r)}, "kda_f32"))


def _gmm_inputs(seed, M, K, N, G, kind):
    """``x [M,K]``, weights ``[G,N,K]`` (dense or MXFP4), ragged group sizes summing to less
    than M (the tail rows must come out zero)."""
    rng = np.random.default_rng(seed)
    dt = jnp.float32 if kind == "float32" else jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((M, K)), dt)
    if kind == "mxfp4":
        w = MXFP4Weight.from_float(rng.standard_normal((G, N, K)) * 0.05)
    else:
        w = jnp.asarray(rng.standard_normal((G, N, K)) * 0.05, dt)
    cuts = np.sort(rng.integers(0, M - M // 8, G - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [M - M // 8]]))
    sizes[1] = 0                                               # an empty expert
    return x, w, jnp.asarray(sizes, jnp.int32)


def check_gmm(cfg, interpret, kind):
    """``gmm`` vs ``gmm_reference`` (``ragged_dot`` at HIGHEST) for fp32 / bf16 / MXFP4."""
    require_lowering(interpret)
    M, K, N, G = (cfg["check_gmm"][k] for k in "MKNG")
    x, w, gs = _gmm_inputs(51, M, K, N, G, kind)
    out, comp = _timed_first_call(
        lambda: gmm(x, w, gs, preferred_element_type=jnp.float32,
                    backend=kernel_backend(interpret)))
    ref = gmm(x, w, gs, preferred_element_type=jnp.float32, backend="reference")
    tail = int(np.asarray(gs).sum())
    c = check({"out": (out, ref)}, "f32" if kind == "float32" else "gmm_bf16")
    c["tail_rows_zero"] = bool(np.all(np.asarray(out)[tail:] == 0))
    c["passed"] = c["passed"] and c["tail_rows_zero"]
    return dict(op="gmm", shape=dict(M=M, K=K, N=N, G=G, rhs=kind,
                                     group_sizes=np.asarray(gs).tolist(), out="float32"),
                compile_s=comp, check=c)


def _mla_inputs(seed, B, H, S, page, dtype, ragged=True):
    """Paged absorbed-MLA decode inputs (L=512, R=64); pages shuffled; with ``ragged`` the
    sequence lengths vary and one is zero."""
    rng = np.random.default_rng(seed)
    L, R = 512, 64
    mp = S // page
    npg = B * mp + 3                                           # a few spare pages
    q = jnp.asarray(rng.standard_normal((B, H, L)), dtype)
    qr = jnp.asarray(rng.standard_normal((B, H, R)), dtype)
    kv = jnp.asarray(rng.standard_normal((npg, page, L + R)), dtype)
    pt = jnp.asarray(rng.permutation(npg)[:B * mp].reshape(B, mp), jnp.int32)
    sl = rng.integers(1, S + 1, B) if ragged else np.full(B, S)
    if ragged:
        sl[0], sl[-1] = 0, S
    return q, qr, kv, pt, jnp.asarray(sl, jnp.int32)


MLA_SCALE = (128 + 64) ** -0.5


def _fp8_pages(args):
    """bf16 MLA inputs with the pages stored as the engine's fp8 cache stores them -> (args, kv_format)."""
    from serve.latent_codec import LatentCodec

    codec = LatentCodec.make("fp8", "bfloat16", 576, 64)
    q, qr, kv, pt, sl = args
    return (q, qr, codec.encode(kv), pt, sl), codec.kernel_format()


def check_mla(cfg, interpret, dtype):
    """Paged MLA decode vs the reference (fp32 or bf16 cache, or fp8 pages dequantised in the tile)."""
    require_lowering(interpret)
    c = cfg["check_mla"]
    dt = jnp.float32 if dtype == "float32" else jnp.bfloat16
    args, fmt = _mla_inputs(61, c["B"], c["H"], c["S"], c["page"], dt), None
    if dtype == "fp8":
        args, fmt = _fp8_pages(args)
    out, comp = _timed_first_call(lambda: paged_mla_decode(
        *args, scale=MLA_SCALE, backend=kernel_backend(interpret), kv_format=fmt))
    ref = paged_mla_decode(*args, scale=MLA_SCALE, backend="reference", kv_format=fmt)
    return dict(op="paged_mla_decode",
                shape=dict(B=c["B"], H=c["H"], S=c["S"], L=512, R=64, page_size=c["page"],
                           seq_lens=np.asarray(args[4]).tolist(), dtype=dtype),
                compile_s=comp,
                check=check({"ctx": (out, ref)}, "f32" if dtype == "float32" else "mla_bf16"))


# ----------------------------------------------------------------------------------------
# the peer: fla's Triton KDA kernels (torch)
# ----------------------------------------------------------------------------------------
def load_fla():
    """torch + fla's KDA ops on CUDA, as a namespace (``pool_fwd``: fla's internal in-place
    pooled decode, the path vLLM uses; None if missing)."""
    import torch
    from fla.ops.kda import chunk_kda as fla_chunk, fused_recurrent_kda as fla_recurrent
    from fla.ops.kda import fused_recurrent as fla_fr

    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    return SimpleNamespace(torch=torch, chunk_kda=fla_chunk, fused_recurrent_kda=fla_recurrent,
                           pool_fwd=getattr(fla_fr, "fused_recurrent_kda_fwd", None),
                           device="cuda")


def to_torch(peer, arrays, dtype):
    """numpy ``{name: array}`` -> torch tensors on ``peer.device``: ``q k v beta`` in
    ``dtype``, everything else (``g``, states) fp32, int arrays kept int."""
    torch = peer.torch
    low = getattr(torch, dtype)
    out = {}
    for name, a in arrays.items():
        t = torch.from_numpy(np.require(a, requirements=["C", "W"]))  # copies only if needed
        if t.is_floating_point():
            t = t.to(low if name in ("q", "k", "v", "beta") else torch.float32)
        out[name] = t.to(peer.device)
    return out


def _peer_sync(peer):
    if peer.device != "cpu":
        peer.torch.cuda.synchronize()


def time_peer(peer, fn, reps, target_s, samples=3, max_calls=200):
    """fla timing: ``time`` = pipelined per-call median (as ours), ``time_events`` = CUDA
    events around each call (wall clock on CPU)."""
    torch = peer.torch
    fn()
    _peer_sync(peer)
    ev = []
    for _ in range(reps):
        if peer.device == "cpu":
            t0 = time.perf_counter()
            fn()
            ev.append(time.perf_counter() - t0)
        else:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ev.append(a.elapsed_time(b) / 1e3)
    n = int(max(1, min(max_calls, target_s / max(statistics.median(ev), 1e-6))))
    per = []
    for _ in range(samples):
        _peer_sync(peer)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        _peer_sync(peer)
        per.append((time.perf_counter() - t0) / n)
    st = _stats(per)
    st["calls_per_sample"] = n
    return dict(time=st, time_events=_stats(ev))


def _peer_first_call(peer, fn):
    t0 = time.perf_counter()
    out = fn()
    _peer_sync(peer)
    return out, time.perf_counter() - t0


def peer_prefill(peer, x_np, S0_np, ref, variant, *, scale, reps, target_s):
    """fla ``chunk_kda`` on our inputs (``x_np`` = q,k,v,g,beta ``[B,T,H,*]`` numpy,
    ``S0_np [B,H,K,V]``), checked against our reference ``ref = (o, final_state)``."""
    spec = PEER_PREFILL_VARIANTS[variant]
    t = to_torch(peer, dict(zip(("q", "k", "v", "g", "beta"), x_np), S0=S0_np), spec["dtype"])
    fn = lambda: peer.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], scale=scale,
                                initial_state=t["S0"], output_final_state=True,
                                **spec["kwargs"])
    with peer.torch.inference_mode():
        (o, s), comp = _peer_first_call(peer, fn)
        chk = check({"o": (o, ref[0]), "final_state": (s, ref[1])}, f"peer_{spec['dtype']}")
        res = dict(op="fla.ops.kda.chunk_kda", dtype=spec["dtype"], kwargs=spec["kwargs"],
                   compile_s=comp, check=chk, **time_peer(peer, fn, reps, target_s))
    return res


def peer_decode(peer, x_np, pool_np, slots_np, ref, *, scale, reps, target_s):
    """fla decode on our pooled-decode inputs, fp32, checked against our reference
    ``ref = (o [B,1,H,V], new_pool)``. ``public``: ``fused_recurrent_kda`` from the gathered
    rows ``pool[slots]`` (writes a new state, same bytes as ours); ``pool_inplace``: fla's
    internal pooled path (``ssm_state_indices``, state updated in place)."""
    o_ref, pool_ref = ref
    rows_ref = np.asarray(pool_ref)[slots_np]
    arrays = dict(zip(("q", "k", "v", "g", "beta"), x_np), S0=pool_np[slots_np])
    t = to_torch(peer, arrays, "float32")
    out = {}
    fn = lambda: peer.fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"],
                                          scale=scale, initial_state=t["S0"],
                                          output_final_state=True)
    with peer.torch.inference_mode():
        (o, s), comp = _peer_first_call(peer, fn)
        out["public"] = dict(op="fla.ops.kda.fused_recurrent_kda", dtype="float32",
                             compile_s=comp,
                             check=check({"o": (o, o_ref), "state": (s, rows_ref)},
                                         "peer_float32"),
                             **time_peer(peer, fn, reps, target_s))
        if peer.pool_fwd is None:
            out["pool_inplace"] = dict(status="unavailable")
            return out
        tp = to_torch(peer, dict(pool=pool_np, slots=slots_np), "float32")
        fnp = lambda: peer.pool_fwd(q=t["q"], k=t["k"], v=t["v"], g=t["g"], beta=t["beta"],
                                    scale=scale, initial_state=tp["pool"],
                                    inplace_final_state=True, ssm_state_indices=tp["slots"])
        (o, _), comp = _peer_first_call(peer, fnp)
        rows = tp["pool"][tp["slots"].long()]
        out["pool_inplace"] = dict(op="fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd "
                                      "(inplace_final_state, ssm_state_indices)",
                                   dtype="float32", compile_s=comp,
                                   check=check({"o": (o, o_ref), "state": (rows, rows_ref)},
                                               "peer_float32"),
                                   **time_peer(peer, fnp, reps, target_s))
    return out


def _attach_peer(case, name, fn, ours_time):
    """Run one peer measurement into ``case['peer'][name]`` (errors recorded, not raised)
    and the throughput ratio ours / fla (= fla time / our time)."""
    try:
        res = fn()
    except Exception as e:  # noqa: BLE001
        res = dict(status="error", error=f"{type(e).__name__}: {e}"[:2000],
                   traceback=traceback.format_exc()[-2000:])
    if "time" in res:
        res.setdefault("status", "ok")
        res["ratio_ours_over_peer"] = res["time"]["median"] / ours_time
    case.setdefault("peer", {})[name] = res
    return res


# ----------------------------------------------------------------------------------------
# timing cases (K3-like shapes)
# ----------------------------------------------------------------------------------------
def _decode_setup(cfg, Bd):
    """Pooled decode inputs at batch ``Bd``: T=1, K3's heads, a pool of Bd slots read in shuffled
    order. -> ``(x, pool, slots)``."""
    x, pool = kda_case(100 + Bd, Bd, 1, cfg["decode_heads"], cfg["kda_dim"], Bd, 0.1)
    return x, pool, jnp.asarray(np.random.default_rng(Bd).permutation(Bd), jnp.int32)


def _time_pool_step(case, step, pool, slots, x, ref, cfg, roof):
    """First call of a pooled-decode ``step(pool, slots, q, k, v, g, beta) -> (pool, o)`` with the
    pool donated (compile + one run, checked against ``ref``), then its timing, into ``case``."""
    (p, o), case["compile_s"] = _timed_first_call(step, pool, slots, *x)
    case["check"] = check({"o": (o, ref[0]), "pool": (p, ref[1])}, "kda_f32")
    del o
    chain = lambda out, args: (out[0],) + tuple(args[1:])
    case["time"], case["time_blocked"] = time_jax(step, (p, slots) + tuple(x), cfg, chain=chain)
    Bd, _, H, K = x[0].shape
    V = x[2].shape[-1]
    return _rates(case, roof, flops=kb.kda_token_flops(1, H, K, V) * Bd,
                  bytes_=kb.kda_io_bytes(Bd, 1, H, K, V), tokens=Bd)


def bench_kda_decode(cfg, roof, interpret, Bd, peer):
    """Pooled decode, T=1, pool of Bd slots in shuffled order, pool donated (in place)."""
    require_lowering(interpret)
    H, K = cfg["decode_heads"], cfg["kda_dim"]
    V = K
    x, pool, slots = _decode_setup(cfg, Bd)
    backend = kernel_backend(interpret)
    # the timed step: pool donated, so the kernel updates it in place (output aliases input)
    step = jax.jit(lambda pl_, sl, q, k, v, g, b:
                   fused_recurrent_kda_pool(q, k, v, g, b, pl_, sl, backend=backend)[::-1],
                   donate_argnums=0)
    ref = fused_recurrent_kda_pool(*x, pool, slots, backend="reference")
    peer_args = None
    if peer is not None:                      # host copies before the pool is donated
        peer_args = ([np.asarray(a) for a in x], np.asarray(pool), np.asarray(slots),
                     (np.asarray(ref[0]), np.asarray(ref[1])))
    case = dict(op="fused_recurrent_kda_pool", impl=backend,
                shape=dict(B=Bd, T=1, H=H, K=K, V=V, pool=Bd, dtype="float32",
                           pool_donated=True))
    _time_pool_step(case, step, pool, slots, x, ref, cfg, roof)   # checks the timed executable
    if Bd * H * K * V * 4 <= L2_BYTES:
        case["note"] = ("the whole pool fits in L2 (H200: 50 MB): repeated steps may be served "
                        "partly from cache, so GB/s can exceed HBM's")
    if peer_args is not None:
        _decode_peer(case, peer, peer_args, cfg, K, roof, Bd, H, V)
    return case


def bench_kda_decode_sweep(cfg, roof, interpret, Bd):
    """The pooled decode kernel (GPU variant) at batch ``Bd`` over its per-program shapes: the state
    tile [K, block_v] and the warps it is spread over (``cfg['decode_sweep']``), each checked and
    timed like ``bench_kda_decode``: which shape the default should be, and whether any meets the
    bandwidth goal."""
    require_lowering(interpret)
    from pallas_kernels.kda.pallas_kda import NUM_WARPS, _pick_block_v, fused_recurrent_kda_pool_pallas
    H, K = cfg["decode_heads"], cfg["kda_dim"]
    x, pool, slots = _decode_setup(cfg, Bd)
    ref = fused_recurrent_kda_pool(*x, pool, slots, backend="reference")
    pool_host = np.asarray(pool)              # each shape starts from the same pool (donated)
    del pool
    variants = {}
    for bv, nw in cfg["decode_sweep"]["shapes"][Bd]:
        res = dict(block_v=bv, num_warps=nw)
        try:
            step = jax.jit(lambda pl_, sl, q, k, v, g, b, bv=bv, nw=nw: fused_recurrent_kda_pool_pallas(
                q, k, v, g, b, pl_, sl, interpret=interpret, variant="gpu", block_v=bv,
                num_warps=nw)[::-1], donate_argnums=0)
            _time_pool_step(res, step, jnp.asarray(pool_host), slots, x, ref, cfg, roof)
            res["status"] = "ok"
        except Exception as e:  # noqa: BLE001
            res.update(status="error", error=f"{type(e).__name__}: {e}"[:2000])
        variants[f"bv{bv}_w{nw}"] = res
    timed = {n: r for n, r in variants.items() if "time" in r}
    case = dict(op="fused_recurrent_kda_pool_sweep", impl=kernel_backend(interpret),
                shape=dict(B=Bd, T=1, H=H, K=K, V=K, pool=Bd, dtype="float32", pool_donated=True),
                default=dict(block_v=_pick_block_v(K, None, "gpu"), num_warps=NUM_WARPS), variants=variants)
    if timed:
        best = min(timed, key=lambda n: timed[n]["time"]["median"])
        # the case's check: the best shape's errors, passed only if every timed shape passed its own
        case.update(best=best, time=timed[best]["time"], time_blocked=timed[best]["time_blocked"],
                    gbps=timed[best]["gbps"], fraction_of_bandwidth=timed[best]["fraction_of_bandwidth"],
                    compile_s=sum(r["compile_s"] for r in timed.values()),
                    check=dict(timed[best]["check"],
                               passed=all(r["check"]["passed"] for r in timed.values())))
    return case


def _decode_peer(case, peer, peer_args, cfg, K, roof, Bd, H, V):
    """fla decode variants into ``case['peer']``, with their rates."""
    x_np, pool_np, slots_np, ref = peer_args
    try:
        res = peer_decode(peer, x_np, pool_np, slots_np, ref, scale=K ** -0.5,
                          reps=cfg["reps"], target_s=cfg["pipeline_target_s"])
    except Exception as e:  # noqa: BLE001
        res = {"public": dict(status="error", error=f"{type(e).__name__}: {e}"[:2000],
                              traceback=traceback.format_exc()[-2000:])}
    for name, r in res.items():
        if "time" in r:
            r.setdefault("status", "ok")
            _rates(r, roof, flops=kb.kda_token_flops(1, H, K, V) * Bd,
                   bytes_=kb.kda_io_bytes(Bd, 1, H, K, V), tokens=Bd)
            r["ratio_ours_over_peer"] = r["time"]["median"] / case["time"]["median"]
        case.setdefault("peer", {})[name] = r


def _prefill_inputs(cfg, H, T):
    """B=1 prefill inputs (K3's gate) from a random initial state, the same draws for every case at
    (H, T), and the reference outputs. -> ``(x, S0, scale, ref)``."""
    K = cfg["kda_dim"]
    scale = K ** -0.5
    x, S0 = kda_case(T + H, 1, T, H, K, 1)
    ref = chunk_kda(*x, scale=scale, initial_state=S0, output_final_state=True, backend="reference")
    return x, S0, scale, ref


def _prefill_shape(cfg, H, T):
    K = cfg["kda_dim"]
    return dict(B=1, T=T, H=H, K=K, V=K, chunk_size=64, dtype="float32", gate="k3 (-5*sigmoid)",
                initial_state=True)


def bench_kda_prefill(cfg, roof, interpret, H, T, peer):
    """Dense prefill B=1 from a random initial state, final state returned: the default kernel, fla
    right after it (the goal's ratio), the other product precisions and XLA's chunked reference."""
    require_lowering(interpret)
    K = V = cfg["kda_dim"]
    x, S0, scale, ref = _prefill_inputs(cfg, H, T)
    backend = kernel_backend(interpret)
    fn = jax.jit(lambda q, k, v, g, b, s0: chunk_kda(q, k, v, g, b, scale=scale,
                                                     initial_state=s0,
                                                     output_final_state=True,
                                                     backend=backend))
    args = tuple(x) + (S0,)
    (o, s), comp = _timed_first_call(fn, *args)
    from pallas_kernels.kda.pallas_kda import _default_variant, default_dot_precision
    case = dict(op="chunk_kda", impl=backend,
                dot_precision=default_dot_precision(_default_variant(), interpret),
                shape=_prefill_shape(cfg, H, T), compile_s=comp,
                check=check({"o": (o, ref[0]), "final_state": (s, ref[1])}, "kda_f32"))
    del o, s
    case["time"], case["time_blocked"] = time_jax(fn, args, cfg)
    flops = kb.kda_chunk_flops(T, H, K, V, 64)
    _rates(case, roof, flops=flops, bytes_=kb.kda_io_bytes(1, T, H, K, V), tokens=T)
    peer_times = {}
    if peer is not None:
        x_np = [np.asarray(a) for a in x]
        ref_np = (np.asarray(ref[0]), np.asarray(ref[1]))
        for variant in cfg["peer_prefill_variants"]:
            r = _attach_peer(case, variant, lambda: peer_prefill(
                peer, x_np, np.asarray(S0), ref_np, variant, scale=scale, reps=cfg["reps"],
                target_s=cfg["pipeline_target_s"]), case["time"]["median"])
            if "time" in r:
                _rates(r, roof, flops=flops, bytes_=kb.kda_io_bytes(1, T, H, K, V), tokens=T)
                peer_times[variant] = r["time"]["median"]
        _free_peer_memory(peer)
    case["dot_precision_variants"] = {
        prec: _prefill_precision_variant(cfg, roof, interpret, x, S0, ref, scale, prec, flops, T)
        for prec in PREFILL_DOT_PRECISIONS if prec != case["dot_precision"]}
    case["reference_xla"] = _time_reference_prefill(cfg, roof, x, S0, scale, flops, T)
    for v in [*case["dot_precision_variants"].values(), case["reference_xla"]]:
        _peer_ratios(v, peer_times)
    return case


def _peer_ratios(variant, peer_times):
    """fla time / the variant's time, per fla variant (> 1: ours faster)."""
    if "time" in variant:
        for name, t in peer_times.items():
            variant.setdefault("ratio_ours_over_peer", {})[name] = t / variant["time"]["median"]


# The split / staged variants of the chunk kernel timed by the device run, in two cases per shape:
# name -> (form, products (None: the default kernel's), num_stages, prep). "prep_kernel" is its own case
# (its three kernels compile in ~13 s offline, PyPI Triton, sm_90; as one kernel it took ~90 s).
FORM_CASES = {
    "forms": {"split": ("split", None, None, "xla"), "staged": ("staged", None, None, "xla"),
              "staged_s2": ("staged", None, 2, "xla"), "staged_bf16": ("staged", "bf16", None, "xla")},
    "prep_kernel": {"staged_pk": ("staged", None, None, "pallas"), "split_pk": ("split", None, None, "pallas")},
}


def bench_kda_prefill_forms(cfg, roof, interpret, H, T, group="forms"):
    """The chunk kernel's other GPU forms (``FORM_CASES[group]``) at the shape and draws of
    ``kda_prefill_H{H}_T{T}``, a case of their own (own watchdog and JSON write, so these compiles
    cannot cost that case's numbers or fla's): the split form (XLA-batched chunk terms, the four state
    products in Pallas), the staged form (the loop doing the two products of the next state, outputs
    batched after it: fla's organisation) with 2 load stages (``staged_s2``, 88 KiB of shared memory
    offline), bf16 products, or the chunk terms from the prep kernels (``staged_pk``, ``split_pk``); with
    "forms" also the staged form's stages timed alone. The case's time is its fastest variant's; ratios to fla are
    joined in the summary."""
    require_lowering(interpret)
    K = V = cfg["kda_dim"]
    x, S0, scale, ref = _prefill_inputs(cfg, H, T)
    from pallas_kernels.kda.pallas_kda import _default_variant, default_dot_precision
    dp = default_dot_precision(_default_variant(), interpret)
    flops = kb.kda_chunk_flops(T, H, K, V, 64)
    variants = {name: _prefill_precision_variant(
        cfg, roof, interpret, x, S0, ref, scale, prec or dp, flops, T, form=form, num_stages=ns, prep=pp)
        for name, (form, prec, ns, pp) in FORM_CASES[group].items()}
    case = dict(op="chunk_kda_forms", impl=kernel_backend(interpret), dot_precision=dp,
                shape=_prefill_shape(cfg, H, T), form_variants=variants)
    if group == "forms":
        case["staged_parts"] = _time_staged_parts(cfg, interpret, x, S0, scale, dp)
    if group == "prep_kernel":
        case["staged_parts"] = _time_prep_kernels(cfg, interpret, x, scale, dp)
    ok = {n: v for n, v in variants.items() if "time" in v and (v.get("check") or {}).get("passed")}
    if not ok:
        raise RuntimeError("no split / staged form ran and passed its check: "
                           + "; ".join(f"{n}: {v.get('error', 'check failed')}"[:300] for n, v in variants.items()))
    best = min(ok, key=lambda n: ok[n]["time"]["median"])
    case.update(best=best, time=ok[best]["time"], time_blocked=ok[best]["time_blocked"],
                check=ok[best]["check"], compile_s=ok[best]["compile_s"])
    return _rates(case, roof, flops=flops, bytes_=kb.kda_io_bytes(1, T, H, K, V), tokens=T)


def _timed_prefill(res, fn, args, cfg, roof, flops, T):
    """Time a prefill variant ``fn(*args)`` (B=1 inputs q, k, v, g, beta, S0) into ``res``."""
    res["time"], res["time_blocked"] = time_jax(fn, args, cfg)
    H, K, V = args[0].shape[2], args[0].shape[3], args[2].shape[3]
    _rates(res, roof, flops=flops, bytes_=kb.kda_io_bytes(1, T, H, K, V), tokens=T)
    res["status"] = "ok"
    return res


def _time_staged_parts(cfg, interpret, x, S0, scale, prec, C=64):
    """Where the staged form's time goes: each of its stages jitted and timed alone at the case's
    shape -- the head-major fp32 layout (XLA transposes), the chunk terms (XLA prep), the Pallas state
    loop, the output products (XLA) -- so the next change goes to the stage that dominates (``staged_pk``
    minus loop and output: the prep kernel's share). Errors are recorded, not raised."""
    from pallas_kernels.kda import pallas_kda as pk
    try:
        K, V = x[0].shape[-1], x[2].shape[-1]
        bk, bv = pk.default_split_tiles(K, V, "staged")
        layout = jax.jit(lambda *a: pk._prep_dense(*a, scale, C)[0])
        prep = jax.jit(lambda *a: pk._split_prep(*a, C, pk.prep_precision(prec, interpret)))
        rows = pk._prep_dense(*x, scale, C)[1]
        loop = jax.jit(lambda p, s0: pk._call_gpu_split(p, s0, rows, C=C, block_v=bv, chunk_states=False,
                                                        interpret=interpret, prec=prec, state_dtype=None,
                                                        block_k=bk, staged=True))
        output = jax.jit(lambda p, vn, h: pk._staged_output(p[2], p[3], vn, h, C=C, prec=prec, emulate=interpret))
        res = {}
        xs = _block(layout(*x))
        p = _block(prep(*xs))
        vn, _, h = _block(loop(p, S0))
        for name, fn, args in (("layout", layout, tuple(x)), ("prep", prep, tuple(xs)), ("loop", loop, (p, S0)),
                               ("output", output, (p, vn, h))):
            res[name] = time_jax(fn, args, cfg)[0]["median"]
        res["sum_s"] = sum(res.values())
        return res
    except Exception as e:  # noqa: BLE001
        return dict(status="error", error=f"{type(e).__name__}: {e}"[:2000])


def _time_prep_kernels(cfg, interpret, x, scale, prec, C=64):
    """The prep kernels alone (pairs, solve, columns: ``prep="pallas"``) on the caller's token-major
    operands -> {"prep_kernels": seconds}, beside ``_time_staged_parts``'s XLA "prep" (which starts
    from the head-major layout); an error is recorded as {"prep_kernels_error": message}."""
    from pallas_kernels.kda import pallas_kda as pk
    try:
        fn = jax.jit(lambda q, k, v, g, b: pk._call_gpu_prep(
            q[0], k[0], v[0], g[0], b[0][..., None], C=C, scale=scale, prec=pk.prep_precision(prec, interpret),
            interpret=interpret))
        _block(fn(*x[:5]))
        return {"prep_kernels": time_jax(fn, tuple(x[:5]), cfg)[0]["median"]}
    except Exception as e:  # noqa: BLE001
        return {"prep_kernels_error": f"{type(e).__name__}: {e}"[:2000]}


def _time_reference_prefill(cfg, roof, x, S0, scale, flops, T):
    """The jnp reference (``backend="reference"``) timed like the kernels; errors recorded."""
    try:
        fn = jax.jit(lambda q, k, v, g, b, s0: chunk_kda(q, k, v, g, b, scale=scale, initial_state=s0,
                                                         output_final_state=True, backend="reference"))
        args = tuple(x) + (S0,)
        _, comp = _timed_first_call(fn, *args)
        return _timed_prefill(dict(impl="reference", compile_s=comp), fn, args, cfg, roof, flops, T)
    except Exception as e:  # noqa: BLE001
        return dict(impl="reference", status="error", error=f"{type(e).__name__}: {e}"[:2000])


def _prefill_precision_variant(cfg, roof, interpret, x, S0, ref, scale, prec, flops, T, form="fused",
                               num_warps=None, num_stages=None, prep="xla"):
    """The Pallas chunk kernel with tensor-core data products (``dot_precision=prec``) or in
    another ``form``, checked against the fp32 reference and timed like the main case; errors
    are recorded, not raised."""
    from pallas_kernels.kda.pallas_kda import chunk_kda_pallas
    try:
        fn = jax.jit(lambda q, k, v, g, b, s0: chunk_kda_pallas(
            q, k, v, g, b, scale=scale, initial_state=s0, output_final_state=True,
            interpret=interpret, dot_precision=prec, form=form, num_warps=num_warps, num_stages=num_stages,
            prep=prep, variant="gpu" if form != "fused" or num_warps or num_stages else None))
        args = tuple(x) + (S0,)
        (o, s), comp = _timed_first_call(fn, *args)
        res = dict(dot_precision=prec, form=form, num_warps=num_warps, num_stages=num_stages, prep=prep,
                   compile_s=comp, check=check(
            {"o": (o, ref[0]), "final_state": (s, ref[1])},
            {"tf32": "kda_tf32", "bf16": "kda_bf16_products"}.get(prec, "kda_f32")))
        del o, s
        return _timed_prefill(res, fn, args, cfg, roof, flops, T)
    except Exception as e:  # noqa: BLE001
        return dict(dot_precision=prec, form=form, status="error", error=f"{type(e).__name__}: {e}"[:2000],
                    traceback=traceback.format_exc()[-2000:])


def _free_peer_memory(peer):
    if peer.device != "cpu":
        peer.torch.cuda.empty_cache()


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _gmm_big_device(seed, E, d, I, M, kind):
    """bf16 rows ``[M, d]`` and dense bf16 or random MXFP4 weights ``[E, I, d]`` (E8M0 scales
    2^-8 .. 2^-3), drawn on the device (numpy would be slow at GBs)."""
    ks = jax.random.split(_rbg_key(seed), 3)
    x = jax.random.normal(ks[0], (M, d), jnp.float32).astype(jnp.bfloat16)
    if kind == "dense_bf16":
        w = (0.05 * jax.random.normal(ks[1], (E, I, d), jnp.float32)).astype(jnp.bfloat16)
    else:
        w = MXFP4Weight(
            packed=jax.random.randint(ks[1], (E, I, d // 2), 0, 256, jnp.int32).astype(jnp.uint8),
            scale=jax.random.randint(ks[2], (E, I, d // 32), 119, 125, jnp.int32).astype(jnp.uint8),
            group_size=32)
    return x, w


def _gmm_big_inputs(seed, E, d, I, M, kind):
    """K3-sized gmm inputs: rows, weights and uniform random routing (group sizes)."""
    x, w = _gmm_big_device(seed, E, d, I, M, kind)
    gs = jnp.asarray(np.bincount(np.random.default_rng(seed).integers(0, E, M), minlength=E),
                     jnp.int32)
    return x, w, gs


def _gmm_row_reference(x, w, gs, rows):
    """``out[i] = x[i] @ w[g(i)].T`` at HIGHEST for the sampled ``rows`` only (the full
    ``ragged_dot`` reference is too costly at K3 size)."""
    ends = np.cumsum(np.asarray(gs))
    gid = np.searchsorted(ends, rows, side="right")
    wsel = w[jnp.asarray(gid)]                                 # [rows, N, K]
    wsel = (wsel.dequantize(jnp.float32) if isinstance(wsel, MXFP4Weight)
            else wsel.astype(jnp.float32))
    return jnp.einsum("mk,mnk->mn", x[jnp.asarray(rows)].astype(jnp.float32), wsel,
                      precision=HI)


def bench_gmm(cfg, roof, interpret, kind, M):
    """MoE gmm at K3 size (one expert-parallel shard), bf16 rows, fp32 output; checked on
    64 sampled rows against the per-row definition."""
    require_lowering(interpret)
    E, d, I = (cfg["gmm"][k] for k in ("E", "d", "I"))
    x, w, gs = _gmm_big_inputs(300 + M, E, d, I, M, kind)
    backend = kernel_backend(interpret)
    fn = jax.jit(lambda a, r, g: gmm(a, r, g, preferred_element_type=jnp.float32,
                                     backend=backend))
    out, comp = _timed_first_call(fn, x, w, gs)
    rows = np.sort(np.random.default_rng(M).choice(M, size=min(M, 64), replace=False))
    ref = _gmm_row_reference(x, w, gs, rows)
    case = dict(op="gmm", impl=backend,
                shape=dict(M=M, K=d, N=I, G=E, lhs="bfloat16", rhs=kind, out="float32"),
                compile_s=comp,
                check=check({"out_sampled_rows": (out[jnp.asarray(rows)], ref)}, "gmm_bf16"),
                reference=f"per-row definition at HIGHEST on {len(rows)} sampled rows")
    del out
    case["time"], case["time_blocked"] = time_jax(fn, (x, w, gs), cfg)
    flops, bytes_ = kb.gmm_cost(M, d, I, E, kind)
    return _rates(case, roof, flops=flops, bytes_=bytes_, mm="matmul_bfloat16", tokens=M)


def bench_mla(cfg, roof, interpret, H, B, S, fp8=False):
    """Paged MLA decode (bf16 cache, or fp8 pages dequantised in the tile; all rows full length) vs the
    reference, both timed."""
    require_lowering(interpret)
    page = cfg["mla_page"]
    args, fmt = _mla_inputs(400 + B, B, H, S, page, jnp.bfloat16, ragged=False), None
    if fp8:
        args, fmt = _fp8_pages(args)
    backend = kernel_backend(interpret)
    fn = jax.jit(lambda *a: paged_mla_decode(*a, scale=MLA_SCALE, backend=backend, kv_format=fmt))
    fr = jax.jit(lambda *a: paged_mla_decode(*a, scale=MLA_SCALE, backend="reference", kv_format=fmt))
    out, comp = _timed_first_call(fn, *args)
    ref = _block(fr(*args))
    case = dict(op="paged_mla_decode", impl=backend,
                shape=dict(B=B, S=S, H=H, L=512, R=64, page_size=page, dtype="fp8" if fp8 else "bfloat16"),
                compile_s=comp, check=check({"ctx": (out, ref)}, "mla_bf16"))
    del out, ref
    case["time"], case["time_blocked"] = time_jax(fn, args, cfg)
    rt, rtb = time_jax(fr, args, cfg)
    case["reference"] = dict(op="paged_mla_decode_reference (jnp)", time=rt, time_blocked=rtb)
    case["speedup_vs_reference"] = rt["median"] / case["time"]["median"]
    flops, bytes_ = kb.mla_cost(B, S, H, 512, 64, args[3].size, token_bytes=fmt.words * 4 if fp8 else None)
    _rates(case, roof, flops=flops, bytes_=bytes_, mm="matmul_bfloat16")
    if not interpret and jax.default_backend() == "gpu" and not fp8:   # the Triton kernel: split-K or not
        from pallas_kernels.mla.kernel import default_num_splits, paged_mla_decode_pallas
        case["num_splits"] = default_num_splits(B, -(-H // 16) if H % 32 else H // 32, args[3].shape[1])
        try:
            f1 = jax.jit(lambda *a: paged_mla_decode_pallas(*a, scale=MLA_SCALE, num_splits=1))
            _block(f1(*args))
            t1, _ = time_jax(f1, args, cfg)
            case["one_split"] = dict(time=t1, speedup_of_default=t1["median"] / case["time"]["median"])
        except Exception as e:  # noqa: BLE001
            case["one_split"] = dict(error=f"{type(e).__name__}: {e}"[:1000])
    return case


# ----------------------------------------------------------------------------------------
# machine info, summary, driver
# ----------------------------------------------------------------------------------------
def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(interpret):
    """``kernels.machine_info()`` plus device, lowering and peer-stack versions."""
    try:
        info = kb.machine_info()
    except Exception as e:  # noqa: BLE001
        info = dict(error=f"{type(e).__name__}: {e}", jax=jax.__version__)
    dev = jax.devices()[0]
    info.update(device_kind=getattr(dev, "device_kind", str(dev)),
                pallas_triton_lowering=triton_available(),
                kernel_backend=kernel_backend(interpret),
                interpret_effective=resolve_interpret(kernel_backend(interpret)),
                torch=_version("torch"), triton=_version("triton"),
                fla_core=_version("fla-core"), einops=_version("einops"),
                env={k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_PREALLOCATE",
                                                    "FLA_DISABLE_BACKEND_DISPATCH",
                                                    "PYTHONPATH")})
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                            "clocks.max.sm,clocks.max.mem", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=15)
        info["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()[:300]
    except (OSError, subprocess.SubprocessError) as e:
        info["nvidia_smi"] = f"unavailable ({type(e).__name__})"
    return info


def measure_roofline(quick, reps):
    """``kernels.measure_roofline``; on failure NaN rates (the cases still run) and the error."""
    try:
        if quick or jax.default_backend() == "cpu":
            return kb.measure_roofline(quick, reps)
        # an H200 moves 256 MiB in ~0.1 ms (dispatch-bound: the 2026-12-04 run read 2.4-2.9 TB/s)
        # and runs a 2048^3 product in ~20 us: probe with 1 GiB and 8192^3 instead
        return kb.measure_roofline(quick, reps, n=1 << 28, m=8192)
    except Exception as e:  # noqa: BLE001
        nan = float("nan")
        return dict(error=f"{type(e).__name__}: {e}"[:2000], bandwidth=dict(gbps=nan),
                    matmul_float32=dict(gflops=nan), matmul_bfloat16=dict(gflops=nan))


def _fastest_prefill(case, variants):
    """The checked prefill variant with the most tokens/s (the default kernel is "default"), with its
    ratio to each fla variant: which form and product precision to make the default."""
    timed = {"default": dict(tokens_per_s=case["tokens_per_s"], check_passed=case["check"]["passed"],
                             ratio_ours_over_fla={v: p["ratio_ours_over_peer"]
                                                  for v, p in (case.get("peer") or {}).items()
                                                  if "ratio_ours_over_peer" in p})}
    timed.update(variants)
    ok = {n: v for n, v in timed.items() if v.get("tokens_per_s") and v.get("check_passed")}
    if not ok:
        return None
    name = max(ok, key=lambda n: ok[n]["tokens_per_s"])
    return dict(variant=name, tokens_per_s=ok[name]["tokens_per_s"],
                ratio_ours_over_fla=ok[name]["ratio_ours_over_fla"],
                met={f: r >= GOAL_PREFILL_RATIO for f, r in ok[name]["ratio_ours_over_fla"].items()})


def summarize(cases):
    """Correctness roll-up, errors, and the two goals (recorded whether met or not)."""
    checks = {c["name"]: c["check"]["passed"] for c in cases if "check" in c}
    prefill, decode = [], []
    # the split / staged forms run as cases of their own (kda_prefill_forms_*); joined to the default
    # kernel's case of the same shape, whose fla times give their ratios
    forms = {}
    for c in cases:
        if c.get("op") == "chunk_kda_forms" and c["status"] == "ok":
            f = forms.setdefault((c["shape"]["H"], c["shape"]["T"]), {"form_variants": {}})
            f["form_variants"].update(c["form_variants"])
            f["staged_parts"] = {**(f.get("staged_parts") or {}), **(c.get("staged_parts") or {})} or None
    for c in cases:
        if c["status"] != "ok" or "time" not in c:
            continue
        ratios = {v: p["ratio_ours_over_peer"] for v, p in (c.get("peer") or {}).items()
                  if "ratio_ours_over_peer" in p}
        if c["op"] == "chunk_kda":
            roll = lambda vs: {p: dict(tokens_per_s=v.get("tokens_per_s"),
                                       check_passed=(v.get("check") or {}).get("passed"),
                                       ratio_ours_over_fla=v.get("ratio_ours_over_peer", {}),
                                       met={f: r >= GOAL_PREFILL_RATIO
                                            for f, r in v.get("ratio_ours_over_peer", {}).items()},
                                       error=v.get("error"))
                               for p, v in vs.items()}
            fc = forms.get((c["shape"]["H"], c["shape"]["T"])) or {}
            peer_times = {v: p["time"]["median"] for v, p in (c.get("peer") or {}).items() if "time" in p}
            form_variants = copy.deepcopy(fc.get("form_variants") or {})
            for v in form_variants.values():
                _peer_ratios(v, peer_times)
            variants = dict(roll(c.get("dot_precision_variants") or {}), **roll(form_variants))
            prefill.append(dict(case=c["name"], tokens_per_s=c["tokens_per_s"],
                                dot_precision=c.get("dot_precision"),
                                ratio_ours_over_fla=ratios,
                                met={v: r >= GOAL_PREFILL_RATIO for v, r in ratios.items()},
                                dot_precision_variants=roll(c.get("dot_precision_variants") or {}),
                                form_variants=roll(form_variants),
                                fastest=_fastest_prefill(c, variants),
                                staged_parts=fc.get("staged_parts"),
                                reference_xla=roll({"reference": c["reference_xla"]})["reference"]
                                if "reference_xla" in c else None))
        if c["op"] == "fused_recurrent_kda_pool":
            decode.append(dict(case=c["name"], batch=c["shape"]["B"], gbps=c["gbps"],
                               fraction_of_bandwidth=c["fraction_of_bandwidth"],
                               goal_applies=c["shape"]["B"] >= 64,
                               met=c["fraction_of_bandwidth"] >= GOAL_DECODE_BW,
                               ratio_ours_over_fla=ratios))
        if c["op"] == "fused_recurrent_kda_pool_sweep":
            decode.append(dict(case=c["name"], batch=c["shape"]["B"], best=c["best"], gbps=c["gbps"],
                               fraction_of_bandwidth=c["fraction_of_bandwidth"],
                               goal_applies=c["shape"]["B"] >= 64,
                               met=c["fraction_of_bandwidth"] >= GOAL_DECODE_BW,
                               shapes={n: v.get("fraction_of_bandwidth", v.get("error"))
                                       for n, v in c["variants"].items()}))
    return dict(
        all_checks_passed=bool(checks) and all(checks.values()),
        checks=checks,
        errors={c["name"]: c["error"].splitlines()[0] for c in cases
                if c["status"] in ("error", "timeout")},
        skipped=[c["name"] for c in cases if c["status"] == "skipped"],
        goal_kda_prefill=dict(goal=f"ours >= {GOAL_PREFILL_RATIO}x fla throughput", cases=prefill),
        goal_kda_decode=dict(goal=f">= {GOAL_DECODE_BW:.0%} of measured HBM bandwidth at "
                                  f"batch >= 64", cases=decode))


def plan(cfg, roof, interpret, peer):
    """``(name, thunk)`` for every case, in run order (most important first)."""
    cases = [
        ("check_kda_chunk", lambda: check_kda_chunk(cfg, interpret)),
        ("check_kda_chunk_varlen", lambda: check_kda_chunk_varlen(cfg, interpret)),
        ("check_kda_chunk_bf16_state", lambda: check_kda_chunk_bf16_state(cfg, interpret)),
        ("check_kda_recurrent", lambda: check_kda_recurrent(cfg, interpret)),
        ("check_kda_pool", lambda: check_kda_pool(cfg, interpret)),
    ]
    cases += [(f"check_gmm_{k}", lambda k=k: check_gmm(cfg, interpret, k))
              for k in ("float32", "bfloat16", "mxfp4")]
    cases += [(f"check_mla_{d}", lambda d=d: check_mla(cfg, interpret, d))
              for d in ("float32", "bfloat16", "fp8")]
    cases += [(f"kda_decode_pool_B{b}", lambda b=b: bench_kda_decode(cfg, roof, interpret, b,
                                                                     peer))
              for b in cfg["decode_batch"]]
    cases += [(f"kda_decode_pool_sweep_B{b}", lambda b=b: bench_kda_decode_sweep(cfg, roof, interpret, b))
              for b in cfg["decode_sweep"]["shapes"]]
    prefill = lambda H, T: (f"kda_prefill_H{H}_T{T}",
                            lambda: bench_kda_prefill(cfg, roof, interpret, H, T, peer))
    forms = lambda H, T, grp, tag: (f"kda_prefill_{tag}_H{H}_T{T}",
                                    lambda: bench_kda_prefill_forms(cfg, roof, interpret, H, T, grp))
    cases += [c for H, T in cfg["prefill"]
              for c in (prefill(H, T), forms(H, T, "forms", "forms"), forms(H, T, "prep_kernel", "prepk"))]
    cases += [(f"moe_gmm_{kind}_M{M}", lambda kind=kind, M=M: bench_gmm(cfg, roof, interpret,
                                                                       kind, M))
              for M in cfg["gmm"]["M"] for kind in ("dense_bf16", "mxfp4")]
    cases += [(f"mla_paged_decode_H{H}_B{B}_S{S}",
               lambda H=H, B=B, S=S: bench_mla(cfg, roof, interpret, H, B, S))
              for H, B, S in cfg["mla"]]
    cases += [(f"mla_paged_decode_fp8_H{H}_B{B}_S{S}",  # fp8 pages: 656 B a token instead of 1152
               lambda H=H, B=B, S=S: bench_mla(cfg, roof, interpret, H, B, S, fp8=True))
              for H, B, S in cfg["mla"][-2:]]
    cases += [prefill(H, T) for H, T in cfg["prefill_shard"]]
    return cases


def _out_paths(a, plat):
    """``--out`` (else ``benchmarks/results/kernels-gpu[-<platform>][-quick][-interpret].json``),
    plus ``$OUT/kernels-gpu.json`` when ``$OUT`` is set and no ``--out`` was given."""
    if a.out:
        return [Path(a.out)]
    tag = "" if (plat == "gpu" and not a.quick and not a.interpret) else (
        f"-{plat}" + ("-quick" if a.quick else "") + ("-interpret" if a.interpret else ""))
    paths = [ROOT / "benchmarks" / "results" / RESULT_NAME.replace(".json", f"{tag}.json")]
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / RESULT_NAME)
    return paths


def _setup_peer(a, result):
    """Load fla unless skipped; record the outcome in ``result['peer']``."""
    if a.skip_peer:
        result["peer"] = dict(status="skipped", reason="--skip-peer")
        return None
    try:
        peer = load_fla()
    except Exception as e:  # noqa: BLE001
        result["peer"] = dict(status="error", error=f"{type(e).__name__}: {e}"[:2000])
        return None
    result["peer"] = dict(status="ok", fla=getattr(sys.modules.get("fla"), "__version__", None),
                          torch=peer.torch.__version__, triton=_version("triton"),
                          prefill_variants={v: PEER_PREFILL_VARIANTS[v]
                                            for v in result["config"]["peer_prefill_variants"]},
                          note="fla gets the same random draws as our kernels (numpy -> "
                               "torch); ratios = fla time / our time (> 1: ours faster)")
    return peer


def merge_runs(paths, notes=None):
    """One result from several runs (``device_kernels.sh``'s phases, each its own process): the
    first run's machine, every run's filter / roofline / wall time, all cases (each tagged with
    its run) and one summary over them. A phase that left no file (killed before its first case
    ended) is named in the notes, not fatal."""
    missing = [str(p) for p in paths if not Path(p).is_file()]
    paths = [p for p in paths if Path(p).is_file()]
    runs = [json.loads(Path(p).read_text()) for p in paths]
    if not runs:
        raise ValueError("merge_runs: no result files")
    notes = list(notes or []) + [f"no result file: {m}" for m in missing]
    cases = [dict(c, run=i) for i, r in enumerate(runs) for c in r["cases"]]
    return dict(
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        mode=runs[0]["mode"], interpret=runs[0]["interpret"], machine=runs[0]["machine"],
        config=runs[0]["config"], tolerances=runs[0]["tolerances"],
        timing_note=runs[0]["timing_note"], peer=runs[0].get("peer"),
        runs=[dict(file=Path(p).name, created=r["created"], cases_filter=r.get("cases_filter"),
                   roofline=r.get("roofline"), wall_seconds=r.get("wall_seconds"))
              for p, r in zip(paths, runs)],
        notes=notes, cases=cases, summary=summarize(cases))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--out", default=None, help="JSON path")
    ap.add_argument("--skip-peer", action="store_true", help="do not run fla")
    ap.add_argument("--interpret", action="store_true",
                    help="Pallas interpret mode (runs on CPU; not a performance path)")
    ap.add_argument("--time-budget", type=float, default=300.0,
                    help="seconds after which remaining cases are skipped")
    ap.add_argument("--cases", default=None,
                    help="regex: run only the cases whose name it matches (re.search)")
    ap.add_argument("--case-timeout", type=float, default=None,
                    help="seconds after which a case still running is recorded as timed out "
                         "and the process ends")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="merge these result files into --out (see merge_runs) and exit")
    a = ap.parse_args(argv)
    if a.merge:
        merged = merge_runs(a.merge)
        Path(a.out or ROOT / "benchmarks" / "results" / RESULT_NAME).write_text(
            json.dumps(merged, indent=1, default=_json_default) + "\n")
        print(f"merged {len(a.merge)} runs, {len(merged['cases'])} cases; errors: "
              f"{list(merged['summary']['errors'])}", flush=True)
        return merged
    t0 = time.time()                          # the budget counts from here
    plat = jax.default_backend()
    cfg = config(a.quick)
    result = dict(
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        mode="quick" if a.quick else "full", interpret=a.interpret,
        time_budget_s=a.time_budget, machine=machine_info(a.interpret), config=cfg,
        tolerances={k: dict(rel_l2=v[0], max_rel=v[1]) for k, v in TOL.items()},
        timing_note=__doc__.split("Timing (compile excluded): ")[1].split("\n\n")[0],
        cases=[])
    runner = Runner(result, _out_paths(a, plat), a.time_budget, t0=t0,
                    case_timeout_s=a.case_timeout)
    print(f"platform={plat} device={result['machine']['device_kind']} jax={jax.__version__} "
          f"triton_lowering={result['machine']['pallas_triton_lowering']} "
          f"backend={kernel_backend(a.interpret)}", flush=True)
    peer = _setup_peer(a, result)
    print(f"peer: {result['peer']}", flush=True)
    roof = result["roofline"] = measure_roofline(a.quick, cfg["reps"])
    print(f"roofline: {roof['bandwidth']['gbps']:.1f} GB/s, "
          f"{roof['matmul_float32']['gflops']:.1f} GFLOP/s fp32, "
          f"{roof['matmul_bfloat16']['gflops']:.1f} GFLOP/s bf16", flush=True)
    result["cases_filter"] = a.cases
    for name, thunk in plan(cfg, roof, a.interpret, peer):
        if a.cases is None or re.search(a.cases, name):
            runner.run(name, thunk)
    try:
        result["summary"] = summarize(result["cases"])
    except Exception as e:  # noqa: BLE001 -- the cases are already saved
        result["summary"] = dict(error=f"{type(e).__name__}: {e}", all_checks_passed=False,
                                 errors={}, skipped=[])
    runner.save()
    s = result["summary"]
    print(f"checks passed: {s['all_checks_passed']}  errors: {list(s['errors'])}  "
          f"skipped: {s['skipped']}\nwrote {', '.join(map(str, runner.paths))} "
          f"in {result['wall_seconds']:.0f} s", flush=True)
    return result


if __name__ == "__main__":
    main()
