"""Grouped matmul in plain jnp: the CPU path for ``gmm``.

``jax.lax.ragged_dot`` (the reference) lowers on XLA:CPU to a product of every row with every
group's weight, so a step routing a handful of tokens pays for all G experts (and, for MXFP4, for
dequantising all of them). Here the sorted rows are cut into blocks of ``tm`` rows that never
straddle a group boundary (each group padded to a multiple of ``tm``, megablocks-style); each block
gathers only its own expert's weight -- dequantising just that expert when it is MXFP4 -- and the
blocks run as one batched matmul. Work is ``num_blocks * tm`` rows instead of ``G * M``, and
``num_blocks <= (M + min(G, M) * (tm - 1)) // tm`` is static, so the shapes do not depend on the
routing. Every output row is the same dot product the reference computes (same dtype, precision).

When there are at least as many blocks as experts (most experts touched) or the weights are dense,
``gmm_looped`` does the same block products in a loop over the non-empty experts instead: each
expert's weight is sliced out once (XLA:CPU copies it; MXFP4: all experts dequantised once, before
the loop) and only real blocks run, so neither per-block weight copies nor padding blocks are paid
for (measured on the 2-core CPU host: 2-3.5x faster for dense fp32 experts at 8-2048 rows, 1.3-2x
for MXFP4 once blocks > experts; the block form stays ahead for MXFP4 with few rows, where it
dequantises only the touched experts). Blocks of 2-32 rows (``block_rows_for``) give every row the
same bits in either form, whatever else shares the call.

When the rows outnumber the experts (prefill, large decode batches) most experts are touched, and
``gmm_looped`` first runs ``rounds`` products over *all* experts at once: round ``r`` takes rows
``[r * tm, (r + 1) * tm)`` of every group (zeros where a group is shorter) into one batched matmul
``[G, tm, K] x [G, K, N]`` that reads the stacked weights in place -- no per-expert weight copies, and
one large call instead of a block per expert. Only the rows past ``rounds * tm`` of a group go
through the loop. ``rounds`` is chosen from the static row count; at run time only as many run as the
rows the groups hold call for (``_rounds_held``: a padded batch's padding is in no group, and a step
that is mostly padding reads only its touched experts in the loop). With ``tm <= 32`` a batched row gets the same bits as in a loop block (XLA:CPU
runs both as the same small-matrix product), so the choice of ``rounds`` never changes a result.
Measured on the 2-core Xeon host (interleaved A/B in one process): the Kimi-Linear benchmark
checkpoint's three MoE blocks (16 x [512, 256] fp32 experts, top-4) at 32 tokens 15.7-19.0 ->
10.4-12.6 ms, at 256 tokens 1.1-1.2x; its decode steps 39.1 -> 33.2 ms at 32 rows, 18.6 -> 17.3 ms at
8. k3-small's smaller experts (32 x [256, 256]) gain little (decode at 32 rows 130 vs 131 ms).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.moe.mxfp4 import MXFP4Weight
from pallas_kernels.moe.reference import RhsLike, check_gmm_args, expert_window

__all__ = ["gmm_cpu", "gmm_blocked", "gmm_looped", "block_rows_for", "num_blocks", "rounds_for"]

MAX_BLOCK_ROWS = 32


def block_rows_for(m: int, g: int) -> int:
    """Rows per block: about 2M / G (so ~G / 2 + G blocks in all), a power of two in [2, 32].

    Never 1: XLA:CPU runs a one-row block as a matrix-vector product whose rounding differs from
    the matrix-matrix path. Never 64: XLA:CPU multiplies a 64-row block by a transposed (``[K, N]``)
    expert with another rounding too (seen from 16 x 32 experts up; 32-row blocks and the ``[N, K]``
    layout were bit-identical to 2-row ones in every shape tried). Within [2, 32] a row gets the
    same bits whatever the block size, so a token's result does not depend on how many other tokens
    share the step, or on how many experts a rank holds (expert parallelism)."""
    tm = 2
    while tm * 2 <= min(MAX_BLOCK_ROWS, 2 * m // max(g, 1)):
        tm *= 2
    return tm


def num_blocks(m: int, g: int, tm: int) -> int:
    """Upper bound on sum_g ceil(size_g / tm) over any split of M rows into G groups."""
    return max(1, (m + min(g, m) * (tm - 1)) // tm)


def gmm_cpu(lhs: jax.Array, rhs: RhsLike, group_sizes: jax.Array, *, preferred_element_type=jnp.float32,
            precision=jax.lax.Precision.HIGHEST, rhs_layout: str = "out_in", group_offset=None) -> jax.Array:
    """``gmm`` on CPU: the looped form for dense weights or when blocks > experts, else blocks.
    ``group_offset`` (dense ``rhs`` only): group g uses expert ``group_offset + g`` of the stack."""
    group_sizes = jnp.asarray(group_sizes).astype(jnp.int32)
    if group_offset is not None and isinstance(rhs, MXFP4Weight):
        rhs, group_offset = expert_window(rhs, group_offset, group_sizes.shape[0]), None
    m, _, g, _ = check_gmm_args(lhs, rhs, group_sizes, rhs_layout, windowed=group_offset is not None)
    tm = block_rows_for(m, g)
    kw = dict(preferred_element_type=preferred_element_type, block_rows=tm, precision=precision,
              rhs_layout=rhs_layout, group_offset=group_offset)
    if not isinstance(rhs, MXFP4Weight) or num_blocks(m, g, tm) > g:
        # fp32 only: XLA:CPU widens a batched bf16 product to fp32 (another summation than the loop's
        # native bf16 dot, and a conversion of every expert per call)
        fp32 = lhs.dtype == jnp.float32 and (isinstance(rhs, MXFP4Weight) or rhs.dtype == jnp.float32)
        rounds = rounds_for(m, g, tm) if fp32 else 0
        return gmm_looped(lhs, rhs, group_sizes, rounds=rounds, **kw)
    return gmm_blocked(lhs, rhs, group_sizes, **kw)


def rounds_for(m: int, g: int, tm: int) -> int:
    """All-expert rounds for ``gmm_looped``: none below two rows per expert (many experts idle: the
    loop reads only the touched ones; measured slower at one row per expert), else the number of
    full ``tm``-row blocks an average group fills (at least 1), so skewed groups' extra rows, not
    every expert's padding, go through the loop."""
    return 0 if m < 2 * g else max(1, m // (g * tm))


def gmm_looped(lhs: jax.Array, rhs: RhsLike, group_sizes: jax.Array, *, preferred_element_type=jnp.float32,
               block_rows: int | None = None, precision=jax.lax.Precision.HIGHEST,
               rhs_layout: str = "out_in", rounds: int = 0, group_offset=None) -> jax.Array:
    """``lhs [M, K]`` rows sorted by group x ``rhs [G, N, K]`` (``[G, K, N]`` if ``rhs_layout="in_out"``)
    -> ``[M, N]``: the first ``rounds * tm`` rows of every group in ``rounds`` batched products over all
    groups, the rest one ``tm``-row block at a time in a loop over the groups that still have rows;
    rows past the groups are 0. ``group_offset``: see ``gmm_cpu`` (a loop block reads its expert out
    of the stack; the all-expert rounds take the window)."""
    group_sizes = jnp.asarray(group_sizes).astype(jnp.int32)
    if group_offset is not None and isinstance(rhs, MXFP4Weight):
        rhs, group_offset = expert_window(rhs, group_offset, group_sizes.shape[0]), None
    m, k, g, n = check_gmm_args(lhs, rhs, group_sizes, rhs_layout, windowed=group_offset is not None)
    spec = "mk,kn->mn" if rhs_layout == "in_out" else "mk,nk->mn"
    tm = block_rows or block_rows_for(m, g)
    w_all = rhs.dequantize(dtype=lhs.dtype) if isinstance(rhs, MXFP4Weight) else rhs  # [G, N, K]
    offset = 0 if group_offset is None else group_offset
    starts = jnp.cumsum(group_sizes) - group_sizes  # [G]
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    if rounds:
        window = w_all if group_offset is None else expert_window(w_all, group_offset, g)
        # `rounds` is for M rows; the groups may hold fewer (a padded batch's padding is in no group)
        ran = _rounds_held(jnp.sum(group_sizes), g, tm, rounds)
        out = _all_groups_rounds(lhs, window, starts, group_sizes, rounds, ran, tm, rhs_layout, precision,
                                 preferred_element_type)
    else:
        ran, out = 0, jnp.zeros((m, n), out_dtype)
    out = jnp.concatenate([out.astype(out_dtype), jnp.zeros((tm, n), out_dtype)])  # [M + tm, N]: room for a last block
    skip = ran * tm  # rows of each group already done
    left = jnp.maximum(group_sizes - skip, 0)  # [G]
    order = jnp.argsort(left == 0, stable=True)  # groups with rows left first, in group order
    x = jnp.concatenate([lhs, jnp.zeros((tm, k), lhs.dtype)])  # [M + tm, K]: a last block never reads past the end

    def group(i, out):
        e = order[i]
        w = jax.lax.dynamic_index_in_dim(w_all, e + offset, keepdims=False)  # [N, K] or [K, N]
        w = w.astype(lhs.dtype) if w.dtype != lhs.dtype else w
        first, size = starts[e] + skip, left[e]

        def block(j, out):
            r0 = first + j * tm
            real = (jnp.arange(tm) < size - j * tm)[:, None]  # [tm, 1]
            xb = jnp.where(real, jax.lax.dynamic_slice_in_dim(x, r0, tm), jnp.zeros((), x.dtype))
            y = jnp.einsum(spec, xb, w, precision=precision, preferred_element_type=preferred_element_type)
            keep = jax.lax.dynamic_slice_in_dim(out, r0, tm)
            return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(real, y.astype(out.dtype), keep), r0, 0)

        return jax.lax.fori_loop(0, (size + tm - 1) // tm, block, out)

    out = jax.lax.fori_loop(0, jnp.sum(left > 0), group, out)
    return out[:m]


def _rounds_held(rows: jax.Array, g: int, tm: int, rounds: int) -> jax.Array:
    """``rounds_for`` on the rows the groups hold (traced), capped at the ``rounds`` compiled."""
    return jnp.where(rows < 2 * g, 0, jnp.clip(rows // (g * tm), 1, rounds)).astype(jnp.int32)


def _all_groups_rounds(lhs, w_all, starts, group_sizes, rounds: int, ran: jax.Array, tm: int, rhs_layout: str,
                       precision, preferred_element_type) -> jax.Array:
    """The first ``ran * tm`` rows of every group -> ``[M, N]`` (other rows 0); of the ``rounds`` compiled,
    only the first ``ran`` (traced) run. Round ``r`` multiplies rows ``[r * tm, (r + 1) * tm)`` of every
    group (zeros past a group's end) by its expert in one batched product over the stacked weights
    ``w_all [G, ...]``, read in place; each round is its own dot of ``tm`` rows per group, like a loop
    block. Rows are moved by gathers (XLA:CPU runs a scatter row by row)."""
    m, g = lhs.shape[0], group_sizes.shape[0]
    p = jnp.arange(rounds * tm, dtype=jnp.int32)  # [R * tm] positions within a group
    real = p[None, :] < group_sizes[:, None]  # [G, R * tm]
    rows = jnp.minimum(starts[:, None] + p[None, :], m - 1)
    x = jnp.where(real[..., None], lhs[rows], jnp.zeros((), lhs.dtype))  # [G, R * tm, K]
    spec = "gmk,gkn->gmn" if rhs_layout == "in_out" else "gmk,gnk->gmn"
    n = w_all.shape[2] if rhs_layout == "in_out" else w_all.shape[1]
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)

    def one(r):  # round r's [G, tm, N], or zeros when it does not run (no weight is read)
        return jax.lax.cond(r < ran, lambda: jnp.einsum(spec, x[:, r * tm:(r + 1) * tm], w_all, precision=precision,
                                                        preferred_element_type=preferred_element_type),
                            lambda: jnp.zeros((g, tm, n), out_dtype))

    y = jnp.concatenate([one(r) for r in range(rounds)], axis=1)  # [G, R * tm, N]
    row = jnp.arange(m, dtype=jnp.int32)
    ends = starts + group_sizes
    grp = jnp.minimum(jnp.searchsorted(ends, row, side="right"), g - 1).astype(jnp.int32)  # [M] each row's group
    pos = row - starts[grp]  # [M] its position in the group
    mine = (row < ends[-1]) & (pos < ran * tm)
    return jnp.where(mine[:, None], y[grp, jnp.minimum(pos, rounds * tm - 1)], jnp.zeros((), y.dtype))


def gmm_blocked(lhs: jax.Array, rhs: RhsLike, group_sizes: jax.Array, *, preferred_element_type=jnp.float32,
                block_rows: int | None = None, precision=jax.lax.Precision.HIGHEST,
                rhs_layout: str = "out_in", group_offset=None) -> jax.Array:
    """``lhs [M, K]`` rows sorted by group x ``rhs [G, N, K]`` (``[G, K, N]`` if ``rhs_layout="in_out"``)
    -> ``[M, N]``; rows past the groups are 0. ``group_offset``: see ``gmm_cpu``."""
    group_sizes = jnp.asarray(group_sizes).astype(jnp.int32)
    if group_offset is not None and isinstance(rhs, MXFP4Weight):
        rhs, group_offset = expert_window(rhs, group_offset, group_sizes.shape[0]), None
    m, k, g, n = check_gmm_args(lhs, rhs, group_sizes, rhs_layout, windowed=group_offset is not None)
    tm = block_rows or block_rows_for(m, g)
    nb = num_blocks(m, g, tm)

    starts = jnp.cumsum(group_sizes) - group_sizes  # [G] first sorted row of each group
    blocks = (group_sizes + tm - 1) // tm  # [G]
    ends = jnp.cumsum(blocks)  # [G] one past each group's last block
    b = jnp.arange(nb, dtype=jnp.int32)
    expert = jnp.minimum(jnp.searchsorted(ends, b, side="right"), g - 1).astype(jnp.int32)  # [NB]
    used = b < ends[-1]
    first = starts[expert] + (b - (ends[expert] - blocks[expert])) * tm  # [NB]
    rows = first[:, None] + jnp.arange(tm, dtype=jnp.int32)[None, :]  # [NB, tm]
    real = used[:, None] & (rows < (starts + group_sizes)[expert][:, None])

    x = jnp.where(real[..., None], lhs[jnp.minimum(rows, m - 1)], jnp.zeros((), lhs.dtype))  # [NB, tm, K]
    if isinstance(rhs, MXFP4Weight) and nb < g:  # dequantise only the blocks' experts
        w = MXFP4Weight(rhs.packed[expert], rhs.scale[expert], rhs.group_size).dequantize(dtype=lhs.dtype)
    elif isinstance(rhs, MXFP4Weight):  # more blocks than experts: dequantise each expert once
        w = rhs.dequantize(dtype=lhs.dtype)[expert]
    else:
        w = rhs[expert if group_offset is None else expert + group_offset]
        w = w.astype(lhs.dtype) if w.dtype != lhs.dtype else w  # [NB, N, K] or [NB, K, N]
    spec = "bmk,bkn->bmn" if rhs_layout == "in_out" else "bmk,bnk->bmn"
    y = jnp.einsum(spec, x, w, precision=precision, preferred_element_type=preferred_element_type)
    out = jnp.zeros((m, n), y.dtype)
    return out.at[jnp.where(real, rows, m).reshape(-1)].set(y.reshape(-1, n), mode="drop")
