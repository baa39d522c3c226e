"""Plain-jnp reference for the MoE grouped matmul (runs on every backend)."""
from __future__ import annotations

from typing import Union

import jax
import jax.numpy as jnp

from pallas_kernels.moe.mxfp4 import MXFP4Weight

__all__ = ["gmm_reference", "check_gmm_args"]

RhsLike = Union[jax.Array, MXFP4Weight]


RHS_LAYOUTS = ("out_in", "in_out")


def expert_window(rhs: RhsLike, offset, count: int) -> RhsLike:
    """Experts ``[offset, offset + count)`` of a larger stack (dense or MXFP4), as one dynamic slice."""
    if isinstance(rhs, MXFP4Weight):
        return MXFP4Weight(jax.lax.dynamic_slice_in_dim(rhs.packed, offset, count),
                           jax.lax.dynamic_slice_in_dim(rhs.scale, offset, count), rhs.group_size)
    return jax.lax.dynamic_slice_in_dim(rhs, offset, count)


def check_gmm_args(lhs, rhs, group_sizes, rhs_layout: str = "out_in", windowed: bool = False):
    """Static shape validation shared by the reference and the kernels. Returns (M, K, G, N).

    ``rhs_layout``: ``"out_in"`` for ``rhs [G, N, K]`` (PyTorch ``[out, in]`` per expert, the
    checkpoint form) or ``"in_out"`` for a dense ``rhs [G, K, N]`` (each expert transposed).
    ``windowed``: ``rhs`` may hold more experts than the G groups (``gmm``'s ``group_offset``)."""
    if rhs_layout not in RHS_LAYOUTS:
        raise ValueError(f"rhs_layout={rhs_layout!r}: expected one of {RHS_LAYOUTS}")
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be [M, K], got {lhs.shape}")
    m, k = lhs.shape
    form = "[G, N, K]" if rhs_layout == "out_in" else "[G, K, N]"
    if len(rhs.shape) != 3:
        raise ValueError(f"rhs must be {form} (logical), got {rhs.shape}")
    if rhs_layout == "in_out" and isinstance(rhs, MXFP4Weight):
        raise ValueError("rhs_layout='in_out' is for dense weights; MXFP4 weights are packed along K ([G, N, K/2])")
    g, n, k2 = rhs.shape if rhs_layout == "out_in" else (rhs.shape[0], rhs.shape[2], rhs.shape[1])
    if windowed and group_sizes.ndim == 1 and group_sizes.shape[0] <= g:
        g = group_sizes.shape[0]
    if k2 != k:
        raise ValueError(f"contracting dims differ: lhs {lhs.shape} vs rhs {form} {rhs.shape}")
    if group_sizes.shape != (g,):
        raise ValueError(f"group_sizes must be [{g}], got {group_sizes.shape}")
    if isinstance(rhs, MXFP4Weight):
        if rhs.packed.dtype != jnp.uint8 or rhs.scale.dtype != jnp.uint8:
            raise TypeError("MXFP4Weight packed/scale must be uint8")
        if rhs.scale.shape != (g, n, k // rhs.group_size):
            raise ValueError(f"scale shape {rhs.scale.shape} != {(g, n, k // rhs.group_size)}")
    return m, k, g, n


def gmm_reference(
    lhs: jax.Array,
    rhs: RhsLike,
    group_sizes: jax.Array,
    *,
    preferred_element_type=jnp.float32,
    precision=jax.lax.Precision.HIGHEST,
    rhs_layout: str = "out_in",
) -> jax.Array:
    """``out[i] = lhs[i] @ rhs[g(i)].T`` for rows sorted by group; rows past sum(group_sizes) are 0.
    (``lhs[i] @ rhs[g(i)]`` for ``rhs_layout="in_out"``, a dense ``[G, K, N]``.)

    ``rhs`` is ``[G, N, K]`` (PyTorch ``[out, in]`` per expert) or an
    :class:`MXFP4Weight` with packed ``[G, N, K/2]`` / scale ``[G, N, K/gs]``
    (dequantised exactly to ``lhs.dtype`` first). Uses ``jax.lax.ragged_dot``.
    """
    group_sizes = jnp.asarray(group_sizes).astype(jnp.int32)
    m, _, _, _ = check_gmm_args(lhs, rhs, group_sizes, rhs_layout)
    if isinstance(rhs, MXFP4Weight):
        w = rhs.dequantize(dtype=lhs.dtype)
    else:
        w = rhs.astype(lhs.dtype) if rhs.dtype != lhs.dtype else rhs
    out = jax.lax.ragged_dot(
        lhs, w if rhs_layout == "in_out" else jnp.swapaxes(w, 1, 2), group_sizes,
        precision=precision, preferred_element_type=preferred_element_type)
    # ragged_dot leaves rows past sum(group_sizes) at zero on CPU; make it explicit.
    valid = jnp.arange(m, dtype=jnp.int32) < jnp.sum(group_sizes)
    return jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))
