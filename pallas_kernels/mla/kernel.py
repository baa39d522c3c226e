"""Pallas paged MLA decode (absorbed form, spec §2.4) with fp32 online softmax.

Semantics are those of :func:`pallas_kernels.mla.reference.paged_mla_decode_reference`:
``ctx[b, h] = softmax_s((q_latent·c̄_s + q_rope·k_r,s) * scale) · c̄`` over the first
``seq_lens[b]`` tokens, gathered through ``page_table``; one latent KV head
(``[c̄ ; k_r]``, width L + R = 576 for K3) is shared by all query heads.

Two variants:

``"mosaic"`` (TPU Mosaic, also the CPU ``interpret=True`` path).
  Grid ``(B, H / block_h, max_pages)``; the page axis is innermost and sequential.
  ``page_table`` and ``seq_lens`` are scalar-prefetched into SMEM; the KV BlockSpec's
  index map reads ``page_table[b, min(p, last_page(b))]`` so the pipeline DMAs one
  ``[page_size, L + R]`` page per step and never fetches a page past the sequence
  (the clamped index repeats, so the copy is skipped). Pages past the sequence skip
  compute. Running max / denominator / ``[block_h, L]`` accumulator live in fp32
  VMEM scratch; the output block is written once at the last page.
  Dimension semantics ``("parallel", "parallel", "arbitrary")``.

``"triton"`` (GPU, Pallas Triton backend).
  Grid ``(B, H / block_h)``; each program loops over its ``cdiv(seq_len, page_size)``
  pages with dynamically indexed loads of ``c̄`` (``[page_size, L]``) and ``k_r``
  (``[page_size, R]``) straight from HBM; fp32 register accumulators. Needs
  power-of-two ``block_h >= 16``, ``page_size >= 16``, ``L`` and ``R``
  (K3: 512 and 64). Lowering checked with ``jax.export(platforms=["cuda"])``.
  Split-K (flash-decoding): a third grid axis of ``num_splits`` programs per (row, head block),
  each over its share of the row's pages, writing a normalised partial context and its
  log-sum-exp; ``combine_splits`` merges them. Used when batch x head blocks leaves the GPU idle
  (``default_num_splits``: B=1 and 16 heads ran at 14 GB/s as one program on an H200).

``return_lse=True`` also returns each row's fp32 log-sum-exp of its scores ``[B, H]`` (-inf for
an empty row), from the running max and denominator: decode context parallelism runs the kernel
over each rank's share of the tokens and combines the ranks' results with it. Triton head counts
that 16 does not divide (K3's 96 heads over 8 ranks: 12) are padded to the next multiple of 16.

Common: page-table entries are clamped to ``[0, num_pages)`` in the wrapper (cheap:
the table is tiny) so garbage entries can never address outside the pool; cache
slots past ``seq_lens[b]`` in the last page are masked with ``where`` on both the
scores and the values (stale NaN/Inf cannot leak). ``seq_lens == 0`` gives zeros.
fp32 inputs use ``Precision.HIGHEST``; bf16 inputs feed bf16 MXU dots with fp32
accumulation (probabilities cast to the cache dtype for the PV product, as in the
reference model).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mla.reference import check_paged_mla_args

__all__ = ["paged_mla_decode_pallas"]

_SQUEEZED = getattr(pl, "squeezed", None)
_NEG_INF = float("-inf")


def _nt(a, b, precision):
    """a [m, k] . b [n, k]^T -> [m, n] fp32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _nn(a, b, precision):
    """a [m, k] . b [k, n] -> [m, n] fp32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _page_update(q_planes, k_planes, qr_planes, kr_planes, pos0, seq_len, m, l, accs, *, scale, page_size,
                 precision, values_masked=False):
    """One online-softmax step over a page -> new (m, l, accs). The latent and its queries come as planes
    (one [bh, L] / [ps, L] plane each for model-dtype pages; fp8 pages: one per scale tile and byte), the
    score summing their products; each plane of values feeds its own accumulator. `values_masked`: the
    value planes' rows past the sequence are zero already."""
    bh = q_planes[0].shape[0]
    s = None
    for q, k in zip(q_planes + qr_planes, k_planes + kr_planes):
        d = _nt(q, k, precision)
        s = d if s is None else s + d
    s = s * scale  # [bh, ps]
    pos = pos0 + lax.broadcasted_iota(jnp.int32, (bh, page_size), 1)
    valid = pos < seq_len
    s = jnp.where(valid, s, _NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))  # finite: page has >= 1 valid slot
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    l_new = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    accs_new = []
    for acc, c in zip(accs, k_planes):
        if not values_masked:
            rows = pos0 + lax.broadcasted_iota(jnp.int32, c.shape, 0)
            c = jnp.where(rows < seq_len, c, jnp.zeros((), c.dtype))
        accs_new.append(alpha * acc + _nn(p.astype(c.dtype), c, precision))
    return m_new, l_new, accs_new


def _page_planes(load, kv_format, pos0, seq_len, page_size, lat, dtype):
    """A page's (latent planes, rotary planes, values masked?) from `load(first, n) -> [ps, n]`: the latent and
    rotary slices of a model-dtype page, or the dequantised planes of an fp8 page."""
    if kv_format is None:
        return [load(0, lat)], [load(lat, None)], False
    valid = pos0 + lax.broadcasted_iota(jnp.int32, (page_size, 1), 0) < seq_len
    c, r = kv_format.planes(load, valid)
    return [x.astype(dtype) for x in c], [x.astype(dtype) for x in r], True


def _query_planes(q_lat, q_rope, kv_format, lat):
    """Split (plane-ordered) queries into the planes `_page_planes` gives."""
    if kv_format is None:
        return [q_lat], [q_rope]
    pw, rw = kv_format.plane, kv_format.rope // kv_format.rope_halves
    return ([q_lat[:, i * pw:(i + 1) * pw] for i in range(lat // pw)],
            [q_rope[:, k * rw:(k + 1) * rw] for k in range(kv_format.rope_halves)])


# ----------------------------------------------------------------------------- mosaic / interpret
def _lse(m, l):
    """Log-sum-exp of a row's scores from its online-softmax max and sum; -inf for an empty row."""
    return jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), _NEG_INF)


def _mla_mosaic_kernel(pt_ref, sl_ref, ql_ref, qr_ref, kv_ref, out_ref, *refs, scale, page_size, lat, precision,
                       return_lse, kv_format=None):
    del pt_ref
    lse_ref, (m_ref, l_ref, acc_ref) = (refs[0], refs[1:]) if return_lse else (None, refs)
    b = pl.program_id(0)
    p = pl.program_id(2)
    np_ = pl.num_programs(2)
    seq_len = sl_ref[b]

    @pl.when(p == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(p * page_size < seq_len)
    def _compute():
        kv = kv_ref[...]
        q_lat, q_rope = ql_ref[...], qr_ref[...]
        load = lambda a, n: kv[:, a:] if n is None else kv[:, a:a + n]  # noqa: E731
        c, kr, masked = _page_planes(load, kv_format, p * page_size, seq_len, page_size, lat, q_lat.dtype)
        qc, qr = _query_planes(q_lat, q_rope, kv_format, lat)
        w = lat // len(c)
        acc = acc_ref[...]
        m, l, accs = _page_update(qc, c, qr, kr, p * page_size, seq_len, m_ref[...], l_ref[...],
                                  [acc[:, i * w:(i + 1) * w] for i in range(len(c))], scale=scale,
                                  page_size=page_size, precision=precision, values_masked=masked)
        m_ref[...] = m
        l_ref[...] = l
        acc_ref[...] = accs[0] if len(accs) == 1 else jnp.concatenate(accs, axis=1)

    @pl.when(p == np_ - 1)
    def _store():
        l = l_ref[...]
        out_ref[...] = (acc_ref[...] / jnp.where(l > 0, l, 1.0)).astype(out_ref.dtype)
        if lse_ref is not None:
            lse_ref[...] = _lse(m_ref[...], l)


def _mla_mosaic(q_latent, q_rope, kv_pages, page_table, seq_lens, *, scale, block_h, out_dtype,
                precision, interpret, return_lse=False, kv_format=None):
    from jax.experimental.pallas import tpu as pltpu

    b, h, lat = q_latent.shape
    r = q_rope.shape[-1]
    _, page_size, width = kv_pages.shape
    max_pages = page_table.shape[1]

    def kv_map(bi, hi, p, pt, sl):
        last = jnp.maximum(lax.div(sl[bi] + page_size - 1, page_size) - 1, 0)  # lax.div: no sign op
        return (pt[bi, jnp.minimum(p, last)], 0, 0)

    kernel = functools.partial(_mla_mosaic_kernel, scale=float(scale), page_size=page_size, lat=lat,
                               precision=precision, return_lse=return_lse, kv_format=kv_format)
    out_shape = jax.ShapeDtypeStruct((b, h, lat), out_dtype)
    out_spec = pl.BlockSpec((_SQUEEZED, block_h, lat), lambda bi, hi, p, pt, sl: (bi, hi, 0))
    if return_lse:  # [B, H, 1]: a trailing unit axis keeps the block's minor dims TPU-tileable
        out_shape = (out_shape, jax.ShapeDtypeStruct((b, h, 1), jnp.float32))
        out_spec = (out_spec, pl.BlockSpec((_SQUEEZED, block_h, 1), lambda bi, hi, p, pt, sl: (bi, hi, 0)))
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, h // block_h, max_pages),
            in_specs=[
                pl.BlockSpec((_SQUEEZED, block_h, lat), lambda bi, hi, p, pt, sl: (bi, hi, 0)),
                pl.BlockSpec((_SQUEEZED, block_h, r), lambda bi, hi, p, pt, sl: (bi, hi, 0)),
                pl.BlockSpec((_SQUEEZED, page_size, width), kv_map),
            ],
            out_specs=out_spec,
            scratch_shapes=[
                pltpu.VMEM((block_h, 1), jnp.float32),
                pltpu.VMEM((block_h, 1), jnp.float32),
                pltpu.VMEM((block_h, lat), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="k3_paged_mla_decode",
    )(page_table, seq_lens, q_latent, q_rope, kv_pages)
    return (out[0], out[1][..., 0]) if return_lse else out


# ----------------------------------------------------------------------------- triton
def _mla_triton_kernel(pt_ref, sl_ref, ql_ref, qr_ref, kv_ref, out_ref, lse_ref, *, scale, page_size, lat, rope,
                       block_h, precision, num_splits, kv_format=None):
    """One program = (row, head block, split): the split's share of the row's pages, written as its
    normalised partial context and log-sum-exp (one split: the final context)."""
    b = pl.program_id(0)
    hb = pl.program_id(1)
    sp = pl.program_id(2)
    seq_len = sl_ref[b]
    h0 = hb * block_h
    n_pages = lax.div(seq_len + page_size - 1, page_size)
    per_split = lax.div(n_pages + num_splits - 1, num_splits)
    first = jnp.minimum(sp * per_split, n_pages)
    last = jnp.minimum(first + per_split, n_pages)

    planes = 1 if kv_format is None else lat // kv_format.plane
    w = lat // planes
    if kv_format is None:
        qc, qr = [ql_ref[b, pl.ds(h0, block_h), :]], [qr_ref[b, pl.ds(h0, block_h), :]]
    else:  # query planes read straight from the (plane-ordered) queries: no slicing of loaded values
        rw = rope // kv_format.rope_halves
        qc = [ql_ref[b, pl.ds(h0, block_h), pl.ds(i * w, w)] for i in range(planes)]
        qr = [qr_ref[b, pl.ds(h0, block_h), pl.ds(k * rw, rw)] for k in range(kv_format.rope_halves)]

    def body(p, carry):
        m, l, accs = carry
        page = pt_ref[b, p]
        load = lambda a, n: kv_ref[page, :, pl.ds(a, rope if n is None else n)]  # noqa: E731
        c, kr, masked = _page_planes(load, kv_format, p * page_size, seq_len, page_size, lat, qc[0].dtype)
        m, l, accs = _page_update(qc, c, qr, kr, p * page_size, seq_len, m, l, list(accs), scale=scale,
                                  page_size=page_size, precision=precision, values_masked=masked)
        return m, l, tuple(accs)

    init = (jnp.full((block_h, 1), _NEG_INF, jnp.float32), jnp.zeros((block_h, 1), jnp.float32),
            tuple(jnp.zeros((block_h, w), jnp.float32) for _ in range(planes)))
    m, l, accs = lax.fori_loop(first, last, body, init)
    norm = jnp.where(l > 0, l, 1.0)
    for i, acc in enumerate(accs):
        out_ref[:, pl.ds(i * w, w)] = (acc / norm).astype(out_ref.dtype)
    lse_ref[...] = _lse(m, l)[:, 0]


def combine_splits(parts, lses):
    """Merge per-split softmax results: ``parts [S, B, H, L]`` (each normalised over its own keys),
    ``lses [S, B, H]`` (-inf for a split with no keys) -> (ctx [B, H, L] fp32, lse [B, H]). Rows no
    split saw (``seq_len == 0``) give zeros and -inf, as the one-split kernel does."""
    lse = jax.nn.logsumexp(lses, axis=0)                         # [B, H]; -inf if all empty
    seen = jnp.isfinite(lse)
    w = jnp.where(seen[None], jnp.exp(lses - jnp.where(seen, lse, 0.0)[None]), 0.0)  # [S, B, H]
    ctx = jnp.einsum("sbh,sbhl->bhl", w, parts.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return ctx, jnp.where(seen, lse, _NEG_INF)


def default_num_splits(b: int, head_blocks: int, max_pages: int, *, programs: int = 264,
                       min_pages: int = 4) -> int:
    """Splits of each row's pages (flash-decoding) for the Triton kernel: enough programs to fill
    the GPU (``programs`` ~ two per SM of an H100/H200) when batch x head blocks alone do not,
    each split keeping at least ``min_pages`` pages of the table. On an H200 one row of 8192
    tokens, 16 heads, ran at 14 GB/s as one program (measured, 2026-12-04)."""
    n = max(1, b * head_blocks)
    if n >= programs // 2:                                       # already one program per SM
        return 1
    return int(max(1, min(-(-programs // n), max_pages // min_pages)))


def _mla_triton(q_latent, q_rope, kv_pages, page_table, seq_lens, *, scale, block_h, out_dtype,
                precision, interpret, num_warps=4, num_stages=2, return_lse=False, num_splits=1, kv_format=None):
    b, h, lat = q_latent.shape
    r = q_rope.shape[-1]
    page_size = kv_pages.shape[1]
    kernel = functools.partial(_mla_triton_kernel, scale=float(scale), page_size=page_size, lat=lat, rope=r,
                               block_h=block_h, precision=precision, num_splits=num_splits, kv_format=kv_format)
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        compiler_params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    part_dtype = out_dtype if num_splits == 1 else jnp.float32
    parts, lses = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((num_splits, b, h, lat), part_dtype),
                   jax.ShapeDtypeStruct((num_splits, b, h), jnp.float32)),
        grid=(b, h // block_h, num_splits),
        in_specs=[any_spec] * 5,
        out_specs=(pl.BlockSpec((_SQUEEZED, _SQUEEZED, block_h, lat), lambda bi, hi, si: (si, bi, hi, 0)),
                   pl.BlockSpec((_SQUEEZED, _SQUEEZED, block_h), lambda bi, hi, si: (si, bi, hi))),
        compiler_params=compiler_params,
        interpret=interpret,
        name="k3_paged_mla_decode_triton",
    )(page_table, seq_lens, q_latent, q_rope, kv_pages)
    if num_splits == 1:
        out, lse = parts[0], lses[0]
    else:
        out, lse = combine_splits(parts, lses)
        out = out.astype(out_dtype)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- wrapper
def _default_block_h(h: int, variant: str) -> int:
    if variant == "triton":
        for cand in (32, 16):
            if h % cand == 0:
                return cand
        return h
    if h <= 128:
        return h
    for cand in range(128, 7, -8):
        if h % cand == 0:
            return cand
    return h


def auto_variant(interpret: bool) -> str:
    """The variant ``variant="auto"`` runs: Triton on a GPU unless interpreted, else Mosaic."""
    return "triton" if (not interpret and jax.default_backend() == "gpu") else "mosaic"


def paged_mla_decode_pallas(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float,
    out_dtype=None,
    block_h: Optional[int] = None,
    interpret: bool = False,
    variant: str = "auto",
    return_lse: bool = False,
    num_splits: Optional[int] = None,
    kv_format=None,
):
    """Pallas paged MLA decode; ``variant``: auto | mosaic | triton (auto = triton on GPU). With
    ``return_lse`` also each row's fp32 log-sum-exp ``[B, H]`` (see the reference).
    ``num_splits`` (Triton): programs per row and head block, each over a share of the row's pages,
    merged by log-sum-exp (None: ``default_num_splits``; the Mosaic form walks every page itself).
    ``kv_format`` (:class:`~pallas_kernels.mla.fp8_latents.Fp8Latents`): ``kv_pages`` are fp8 latent words,
    dequantised in the tile plane by plane; the queries are permuted to plane order here and the context
    back after."""
    b, h, lat, r, num_pages, page_size, max_pages = check_paged_mla_args(
        q_latent, q_rope, kv_pages, page_table, seq_lens, kv_format)
    out_dtype = q_latent.dtype if out_dtype is None else out_dtype
    if variant == "auto":
        variant = auto_variant(interpret)
    if variant not in ("mosaic", "triton"):
        raise ValueError(f"variant={variant!r}")
    dt = kv_pages.dtype if kv_format is None else q_latent.dtype  # fp8 values are exact in the query dtype
    q_latent = q_latent.astype(dt)
    q_rope = q_rope.astype(dt)
    if kv_format is not None:
        q_latent, q_rope = kv_format.permute(q_latent, q_rope)
    pad = 0
    if variant == "triton" and block_h is None and h % 16:
        # Triton blocks are powers of two: a head count no 16 divides (K3's 96 heads over 8 tensor-parallel
        # ranks: 12) runs as the next multiple of 16, the extra heads' zero queries sliced off after
        pad = -h % 16
        q_latent, q_rope = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (q_latent, q_rope))
    block_h = block_h or _default_block_h(h + pad, variant)
    if (h + pad) % block_h:
        raise ValueError(f"block_h={block_h} must divide H={h}")
    page_table = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1)
    seq_lens = jnp.clip(seq_lens.astype(jnp.int32), 0, max_pages * page_size)
    precision = lax.Precision.HIGHEST if dt == jnp.float32 else lax.Precision.DEFAULT
    kw = dict(scale=scale, block_h=block_h, out_dtype=out_dtype, precision=precision, interpret=interpret,
              return_lse=return_lse, kv_format=kv_format)
    if variant == "triton":
        if num_splits is None:
            num_splits = default_num_splits(b, (h + pad) // block_h, max_pages)
        if int(num_splits) < 1:
            raise ValueError(f"num_splits={num_splits} must be >= 1")
        out = _mla_triton(q_latent, q_rope, kv_pages, page_table, seq_lens, num_splits=int(num_splits), **kw)
    else:
        out = _mla_mosaic(q_latent, q_rope, kv_pages, page_table, seq_lens, **kw)
    if pad:
        out = tuple(x[:, :h] for x in out) if return_lse else out[:, :h]
    if kv_format is not None:
        out = (kv_format.unpermute(out[0]), out[1]) if return_lse else kv_format.unpermute(out)
    return out
