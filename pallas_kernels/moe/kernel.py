"""Pallas grouped matmul (MoE expert GEMM) for dense and MXFP4 expert weights.

``out[i] = lhs[i] @ rhs[g(i)].T`` where the rows of ``lhs [M, K]`` are sorted by
group (expert) and ``rhs`` is ``[G, N, K]`` (PyTorch ``[out, in]`` per expert) or
an :class:`MXFP4Weight` (packed ``[G, N, K/2]`` uint8 + E8M0 scale ``[G, N, K/gs]``).
Rows at or past ``sum(group_sizes)`` are zero.

Two kernel variants share the metadata and MXFP4 tile decoder:

``"mosaic"`` (TPU Mosaic, also the CPU ``interpret=True`` path) -- megablox style.
  Row tiles of ``tm`` rows are mapped to groups by scalar-prefetched metadata: one
  *work item* per (row tile, non-empty group overlapping it), plus one empty item per
  row tile past ``sum(group_sizes)`` (so those rows are written as zeros), padded to
  the static bound ``tiles_m + G - 1``. Grid ``(N tiles, work items, K tiles)``:
  consecutive work items of the same row tile keep the output block resident and
  accumulate into an fp32 VMEM scratch; each item masks the rows of its group. Each
  expert's ``[tn, tk]`` weight block is DMA'd by the BlockSpec pipeline through the
  prefetched group id (the same id is re-used for padding items, so no refetch).
  Dimension semantics ``("parallel", "arbitrary", "arbitrary")`` (megacore splits N).

``"triton"`` (GPU, Pallas Triton backend) -- one program per (row tile, N tile):
  the program loops over the non-empty groups overlapping its rows (range read from
  metadata) and, for each, over K with dynamically indexed loads of the expert
  weight; fp32 register accumulator; no cross-program races. Block sizes must be
  powers of two and ``tm, tn, tk/2 >= 16`` (``tl.dot``). Lowering is checked on CPU
  with ``jax.export(platforms=["cuda"])``; the Triton backend is deprecated as of
  JAX 0.11 (Mosaic GPU is the successor) but still shipped.

MXFP4 tiles are dequantised inside the kernel: the packed byte tile is widened to
int32, split into low nibbles (even columns) and high nibbles (odd columns), decoded
arithmetically (selects, no gather), multiplied by the E8M0 scale expanded to one
value per byte column via an exact 0/1 matmul, cast to the activation dtype (exact
for bf16) and fed to two MXU/tensor-core dots against the matching even / odd
columns of ``lhs``. To make those column sets contiguous the wrapper permutes each
``tk``-wide K tile of ``lhs`` to ``[even columns | odd columns]`` (an activation-side
copy; the weights are never expanded in HBM).

Expectations / limits:
* K3 shapes: K = 3584 or 3072, N = 3072 or 3584 -- default tiles ``tk = 512``,
  ``tn = 256/512`` divide them, so the weights are never padded (padding dense or
  packed weights costs a full HBM copy per call; pick tiles that divide K and N).
* TPU: ``tm`` multiple of 8 (16 for bf16), ``tn`` multiple of 128, ``tk/2`` multiple
  of 128 for MXFP4 (``tk >= 256``). uint8 -> int32 widening in-kernel needs a TPU
  generation with 8-bit vector support (v5e+); validated here only by lowering to
  Mosaic MLIR (``jax.export(platforms=["tpu"])``) and by interpret mode.
* fp32 inputs use ``Precision.HIGHEST`` dots; bf16 inputs accumulate in fp32.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.moe.mxfp4 import MXFP4Weight, decode_e2m1
from pallas_kernels.moe.reference import check_gmm_args

__all__ = ["gmm_pallas", "make_group_metadata", "default_tiling"]

_SQUEEZED = getattr(pl, "squeezed", None)


def _cdiv(a, b):
    return (a + b - 1) // b


def _round_up(a, b):
    return _cdiv(a, b) * b


# ----------------------------------------------------------------------------- metadata
def _group_rows(group_sizes: jax.Array, m_pad: int):
    """Each group's row range ``[starts, ends)`` in the sorted rows (int32 [G] each): negative sizes count as
    empty, and the ranges are clipped to the ``m_pad`` rows there are (both metadata forms read them)."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m_pad).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def make_group_metadata(group_sizes: jax.Array, m_pad: int, tm: int):
    """Work-item metadata for the megablox-style kernel (traceable, static shapes).

    Returns int32 arrays:
      work_tile [W], work_group [W] (G = "no group": writes zeros), work_rhs [W]
      (expert block to fetch; never G), gstart [G+1], gend [G+1] (row ranges, the
      sentinel group G is empty), with ``W = m_pad // tm + G - 1``.
    """
    g = group_sizes.shape[0]
    tiles_m = m_pad // tm
    starts, ends = _group_rows(group_sizes, m_pad)
    nonempty = ends > starts
    first = starts // tm
    last = (ends - 1) // tm
    cnt = jnp.where(nonempty, last - first + 1, 0)
    cum = jnp.cumsum(cnt)
    total = cum[-1]
    nw = tiles_m + g - 1
    w = jnp.arange(nw, dtype=jnp.int32)
    gid = jnp.minimum(jnp.searchsorted(cum, w, side="right"), g - 1).astype(jnp.int32)
    in_g = w < total
    tile_g = first[gid] + (w - (cum[gid] - cnt[gid]))
    covered = _cdiv(ends[-1], tm)
    tile_u = jnp.minimum(covered + (w - total), tiles_m - 1)
    work_tile = jnp.where(in_g, tile_g, tile_u).astype(jnp.int32)
    work_group = jnp.where(in_g, gid, g).astype(jnp.int32)
    work_rhs = jnp.maximum(lax.cummax(jnp.where(in_g, gid, -1)), 0).astype(jnp.int32)
    zero = jnp.zeros((1,), jnp.int32)
    gstart = jnp.concatenate([starts, zero])
    gend = jnp.concatenate([ends, zero])
    return work_tile, work_group, work_rhs, gstart, gend


def make_tile_group_ranges(group_sizes: jax.Array, m_pad: int, tm: int):
    """Metadata for the per-row-tile kernel: the non-empty groups, compacted.

    Returns int32 arrays ``ne_ids [G]`` (ids of non-empty groups, in order),
    ``ne_start [G]``, ``ne_end [G]`` (their row ranges), and per row tile
    ``tile_lo [T]``, ``tile_hi [T]``: tile ``t`` overlaps compacted groups
    ``tile_lo[t] <= j < tile_hi[t]``.
    """
    g = group_sizes.shape[0]
    tiles_m = m_pad // tm
    starts, ends = _group_rows(group_sizes, m_pad)
    ne = ends > starts
    rank = jnp.cumsum(ne.astype(jnp.int32)) - 1
    slot = jnp.where(ne, rank, g)
    ids = jnp.arange(g, dtype=jnp.int32)
    ne_ids = jnp.zeros((g,), jnp.int32).at[slot].set(ids, mode="drop")
    big = jnp.int32(m_pad + 1)
    ne_start = jnp.full((g,), big, jnp.int32).at[slot].set(starts, mode="drop")
    ne_end = jnp.full((g,), big, jnp.int32).at[slot].set(ends, mode="drop")
    t = jnp.arange(tiles_m, dtype=jnp.int32)
    tile_lo = jnp.searchsorted(ne_end, t * tm, side="right").astype(jnp.int32)
    tile_hi = jnp.searchsorted(ne_start, (t + 1) * tm, side="left").astype(jnp.int32)
    return ne_ids, ne_start, ne_end, tile_lo, tile_hi


# ----------------------------------------------------------------------------- tiles
def _pick(dim: int, preferred: int, multiple: int) -> int:
    """Largest tile <= preferred, multiple of ``multiple``, dividing ``dim``; else preferred."""
    if dim <= preferred:
        return dim
    t = (preferred // multiple) * multiple
    while t >= multiple:
        if dim % t == 0:
            return t
        t -= multiple
    return preferred


def _pow2_le(x: int) -> int:
    p = 1
    while p * 2 <= x:
        p *= 2
    return p


def default_tiling(m: int, k: int, n: int, *, quant_group: Optional[int], variant: str) -> Tuple[int, int, int]:
    """(tm, tk, tn) defaults per variant (see module docstring for constraints)."""
    if variant == "triton":
        tm = max(16, min(64, 1 << max(0, (m - 1).bit_length())))
        # MXFP4: tn = 32. With tk = 512 and tn = 128 the decoded tiles need 242 KiB of shared memory
        # and an H200 has 227 KiB (measured: the launch fails with RESOURCE_EXHAUSTED). Compiled offline
        # for sm_90 (benchmarks/triton_resources.py, 2 stages), tn = 64 still needs 225 KiB and spills
        # 2136 bytes a thread; tn = 32 needs 184 KiB and spills 160
        tn = max(16, min(32 if quant_group else 128, _pow2_le(max(n, 16))))
        tk_min = max(32, 16 * quant_group) if quant_group else 32
        tk = max(tk_min, min(256 if not quant_group else max(512, tk_min), _pow2_le(max(k, 16))))
        return tm, tk, tn
    tm = min(128, _round_up(m, 8))
    tk_mult = max(256, quant_group or 0) if quant_group else 128
    tk = _pick(k, 512, tk_mult)
    if quant_group and tk % quant_group:
        tk = _round_up(tk, quant_group)
    tn = _pick(n, 256, 128)
    return tm, tk, tn


# ----------------------------------------------------------------------------- tile decode
def _expand_scale(scale_tile_u8, half: int, gh: int):
    """E8M0 ``[tn, ng]`` uint8 -> fp32 ``[tn, half]`` with column j using group j // gh.

    Built from exponent bits and an exact 0/1 expansion matmul (no reshape/repeat,
    which Mosaic and Triton handle poorly on the lane dimension).
    """
    e = scale_tile_u8.astype(jnp.int32)
    bits = jnp.where(e == 0, jnp.int32(0x00400000), e << 23)
    bits = jnp.where(e == 255, jnp.int32(0x7FC00000), bits)
    s = lax.bitcast_convert_type(bits, jnp.float32)  # [tn, ng]
    ng = s.shape[-1]
    gi = lax.broadcasted_iota(jnp.int32, (ng, half), 0)
    ji = lax.broadcasted_iota(jnp.int32, (ng, half), 1)
    expand = ((ji >= gi * gh) & (ji < (gi + 1) * gh)).astype(jnp.float32)
    return lax.dot_general(s, expand, (((1,), (0,)), ((), ())),
                           precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _select_scale_cols(scale_u8, kk, ng: int):
    """Columns ``[kk*ng, (kk+1)*ng)`` of a full-K scale block ``[tn, K/gs]`` -> ``[tn, ng]`` uint8.

    Dynamic lane slicing is not supported by Mosaic, so select with an exact one-hot
    matmul on the (small) byte values instead.
    """
    total = scale_u8.shape[-1]
    ri = lax.broadcasted_iota(jnp.int32, (total, ng), 0)
    ci = lax.broadcasted_iota(jnp.int32, (total, ng), 1)
    sel = (ri == kk * ng + ci).astype(jnp.float32)
    out = lax.dot_general(scale_u8.astype(jnp.int32).astype(jnp.float32), sel, (((1,), (0,)), ((), ())),
                          precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(jnp.int32)


def _decode_tile(packed_tile_u8, scale_tile_u8, group_size: int, dtype):
    """packed ``[tn, tk/2]`` + scale ``[tn, tk/gs]`` -> (even cols, odd cols), each ``[tn, tk/2]``."""
    half = packed_tile_u8.shape[-1]
    p = packed_tile_u8.astype(jnp.int32)
    s = _expand_scale(scale_tile_u8, half, group_size // 2)
    w_even = (decode_e2m1(p & 15) * s).astype(dtype)
    w_odd = (decode_e2m1((p >> 4) & 15) * s).astype(dtype)
    return w_even, w_odd


def _dot_nt(x, w, precision):
    """x [tm, k] . w [tn, k]^T -> [tm, tn] fp32."""
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _permute_lhs_even_odd(lhs, tk: int):
    """Within each tk-wide K tile reorder columns to [even | odd] (matches the nibble split)."""
    m, k = lhs.shape
    x = lhs.reshape(m, k // tk, tk // 2, 2)
    return jnp.swapaxes(x, 2, 3).reshape(m, k)


# ----------------------------------------------------------------------------- mosaic / interpret
def _gmm_mosaic_kernel(work_tile, work_group, work_rhs, gstart, gend, *refs,
                       quant: bool, group_size: int, tm: int, tn: int, precision, scale_full: bool):
    del work_rhs
    if quant:
        lhs_ref, packed_ref, scale_ref, out_ref, acc_ref = refs
    else:
        lhs_ref, rhs_ref, out_ref, acc_ref = refs
    w = pl.program_id(1)
    kk = pl.program_id(2)
    nw = pl.num_programs(1)
    nk = pl.num_programs(2)
    tile = work_tile[w]
    prev_tile = work_tile[jnp.maximum(w - 1, 0)]
    next_tile = work_tile[jnp.minimum(w + 1, nw - 1)]
    first = jnp.logical_or(w == 0, prev_tile != tile)
    last = jnp.logical_or(w == nw - 1, next_tile != tile)
    grp = work_group[w]
    start = gstart[grp]
    end = gend[grp]

    @pl.when(jnp.logical_and(first, kk == 0))
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(start < end)
    def _compute():
        x = lhs_ref[...]
        if quant:
            half = packed_ref.shape[-1]
            sc = scale_ref[...]
            if scale_full:
                sc = _select_scale_cols(sc, kk, (2 * half) // group_size)
            w_even, w_odd = _decode_tile(packed_ref[...], sc, group_size, x.dtype)
            prod = _dot_nt(x[:, :half], w_even, precision) + _dot_nt(x[:, half:], w_odd, precision)
        else:
            prod = _dot_nt(x, rhs_ref[...], precision)
        rows = tile * tm + lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
        mask = jnp.logical_and(rows >= start, rows < end)
        acc_ref[...] += jnp.where(mask, prod, 0.0)

    @pl.when(jnp.logical_and(last, kk == nk - 1))
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _gmm_mosaic(lhs, rhs_args, group_sizes, *, quant, group_size, tm, tk, tn, out_dtype,
                precision, interpret):
    from jax.experimental.pallas import tpu as pltpu

    mp, kp = lhs.shape
    g = group_sizes.shape[0]
    np_ = rhs_args[0].shape[1]
    meta = make_group_metadata(group_sizes, mp, tm)
    nw = mp // tm + g - 1
    grid = (np_ // tn, nw, kp // tk)

    lhs_spec = pl.BlockSpec((tm, tk), lambda n, w, k, wt, wg, wr, gs, ge: (wt[w], k))
    # The scale block's lane dim must be a multiple of 128 or the full extent on TPU;
    # tk/gs (16 for tk=512) is neither, so fetch the full-K scale rows for the expert
    # (re-fetched only when the expert / N tile changes) and select in-kernel.
    scale_full = quant and (tk // max(group_size, 1)) % 128 != 0 and tk != kp
    if quant:
        if scale_full:
            scale_spec = pl.BlockSpec((_SQUEEZED, tn, kp // group_size),
                                      lambda n, w, k, wt, wg, wr, gs, ge: (wr[w], n, 0))
        else:
            scale_spec = pl.BlockSpec((_SQUEEZED, tn, tk // group_size),
                                      lambda n, w, k, wt, wg, wr, gs, ge: (wr[w], n, k))
        rhs_specs = [
            pl.BlockSpec((_SQUEEZED, tn, tk // 2), lambda n, w, k, wt, wg, wr, gs, ge: (wr[w], n, k)),
            scale_spec,
        ]
    else:
        rhs_specs = [pl.BlockSpec((_SQUEEZED, tn, tk), lambda n, w, k, wt, wg, wr, gs, ge: (wr[w], n, k))]
    out_spec = pl.BlockSpec((tm, tn), lambda n, w, k, wt, wg, wr, gs, ge: (wt[w], n))
    kernel = functools.partial(_gmm_mosaic_kernel, quant=quant, group_size=group_size, tm=tm, tn=tn,
                               precision=precision, scale_full=scale_full)
    itemsize = jnp.dtype(lhs.dtype).itemsize
    flops = 2 * mp * kp * np_
    bytes_accessed = mp * kp * itemsize + sum(a.size * a.dtype.itemsize for a in rhs_args) + mp * np_ * 4
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=grid,
            in_specs=[lhs_spec, *rhs_specs],
            out_specs=out_spec,
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=int(bytes_accessed)),
        interpret=interpret,
        name="k3_gmm_mxfp4" if quant else "k3_gmm",
    )(*meta, lhs, *rhs_args)


# ----------------------------------------------------------------------------- triton
def _gmm_triton_kernel(ne_ids_ref, ne_start_ref, ne_end_ref, lo_ref, hi_ref, lhs_ref, *refs,
                       quant: bool, group_size: int, tm: int, tk: int, tn: int, nk: int, precision):
    if quant:
        packed_ref, scale_ref, out_ref = refs
    else:
        rhs_ref, out_ref = refs
    t = pl.program_id(0)
    n = pl.program_id(1)
    r0 = t * tm
    n0 = n * tn
    rows = r0 + lax.broadcasted_iota(jnp.int32, (tm, tn), 0)

    def group_body(j, acc):
        gid = ne_ids_ref[j]
        start = ne_start_ref[j]
        end = ne_end_ref[j]

        def k_body(kk, acc_g):
            if quant:
                half = tk // 2
                x_even = lhs_ref[pl.ds(r0, tm), pl.ds(kk * tk, half)]
                x_odd = lhs_ref[pl.ds(r0, tm), pl.ds(kk * tk + half, half)]
                p = packed_ref[gid, pl.ds(n0, tn), pl.ds(kk * half, half)]
                s = scale_ref[gid, pl.ds(n0, tn), pl.ds(kk * (tk // group_size), tk // group_size)]
                w_even, w_odd = _decode_tile(p, s, group_size, x_even.dtype)
                return acc_g + _dot_nt(x_even, w_even, precision) + _dot_nt(x_odd, w_odd, precision)
            x = lhs_ref[pl.ds(r0, tm), pl.ds(kk * tk, tk)]
            wt = rhs_ref[gid, pl.ds(n0, tn), pl.ds(kk * tk, tk)]
            return acc_g + _dot_nt(x, wt, precision)

        acc_g = lax.fori_loop(0, nk, k_body, jnp.zeros((tm, tn), jnp.float32))
        mask = jnp.logical_and(rows >= start, rows < end)
        return acc + jnp.where(mask, acc_g, 0.0)

    acc = lax.fori_loop(lo_ref[t], hi_ref[t], group_body, jnp.zeros((tm, tn), jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


def _gmm_triton(lhs, rhs_args, group_sizes, *, quant, group_size, tm, tk, tn, out_dtype,
                precision, interpret, num_warps=4, num_stages=2):
    mp, kp = lhs.shape
    np_ = rhs_args[0].shape[1]
    meta = make_tile_group_ranges(group_sizes, mp, tm)
    kernel = functools.partial(_gmm_triton_kernel, quant=quant, group_size=group_size, tm=tm, tk=tk,
                               tn=tn, nk=kp // tk, precision=precision)
    n_in = len(meta) + 1 + len(rhs_args)
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        compiler_params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(mp // tm, np_ // tn),
        in_specs=[any_spec] * n_in,
        out_specs=pl.BlockSpec((tm, tn), lambda t, n: (t, n)),
        compiler_params=compiler_params,
        interpret=interpret,
        name="k3_gmm_mxfp4_triton" if quant else "k3_gmm_triton",
    )(*meta, lhs, *rhs_args)


# ----------------------------------------------------------------------------- wrapper
def gmm_pallas(
    lhs: jax.Array,
    rhs,
    group_sizes: jax.Array,
    *,
    preferred_element_type=jnp.float32,
    tiling: Optional[Tuple[int, int, int]] = None,
    interpret: bool = False,
    variant: str = "auto",
) -> jax.Array:
    """Pallas grouped matmul; see module docstring. ``variant``: auto | mosaic | triton.

    ``auto`` = triton on a GPU backend (when not interpreting), mosaic otherwise.
    """
    group_sizes = jnp.asarray(group_sizes).astype(jnp.int32)
    m, k, g, n = check_gmm_args(lhs, rhs, group_sizes)
    quant = isinstance(rhs, MXFP4Weight)
    gs = rhs.group_size if quant else 0
    if variant == "auto":
        variant = "triton" if (not interpret and jax.default_backend() == "gpu") else "mosaic"
    if variant not in ("mosaic", "triton"):
        raise ValueError(f"variant={variant!r}")
    tm, tk, tn = tiling if tiling is not None else default_tiling(
        m, k, n, quant_group=gs or None, variant=variant)
    if quant and (tk % gs or tk % 2):
        raise ValueError(f"tk={tk} must be a multiple of the MXFP4 group size {gs}")
    if variant == "triton" and not interpret:
        for name, v in (("tm", tm), ("tk", tk), ("tn", tn)):
            if v & (v - 1):
                raise ValueError(f"triton variant needs power-of-two tiles, got {name}={v}")

    dtype = lhs.dtype
    mp, kp, np_ = _round_up(m, tm), _round_up(k, tk), _round_up(n, tn)
    x = lhs
    if (mp, kp) != (m, k):
        x = jnp.pad(x, ((0, mp - m), (0, kp - k)))
    if quant:
        x = _permute_lhs_even_odd(x, tk)
        packed, scale = rhs.packed, rhs.scale
        if (np_, kp) != (n, k):  # costs a copy of the packed weights: prefer dividing tiles
            packed = jnp.pad(packed, ((0, 0), (0, np_ - n), (0, (kp - k) // 2)))
            scale = jnp.pad(scale, ((0, 0), (0, np_ - n), (0, (kp - k) // gs)), constant_values=127)
        rhs_args = (packed, scale)
    else:
        w = rhs if rhs.dtype == dtype else rhs.astype(dtype)
        if (np_, kp) != (n, k):  # costs a copy of the weights: prefer dividing tiles
            w = jnp.pad(w, ((0, 0), (0, np_ - n), (0, kp - k)))
        rhs_args = (w,)
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT
    impl = _gmm_triton if variant == "triton" else _gmm_mosaic
    out_dtype = dtype if preferred_element_type is None else preferred_element_type  # None: lhs's, as ragged_dot
    out = impl(x, rhs_args, group_sizes, quant=quant, group_size=gs, tm=tm, tk=tk, tn=tn,
               out_dtype=out_dtype, precision=precision, interpret=interpret)
    return out[:m, :n]
