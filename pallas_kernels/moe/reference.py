"""Plain-jnp reference for the MoE grouped matmul (runs on every backend)."""
from __future__ import annotations

from typing import Union

import jax
import jax.numpy as jnp

from pallas_kernels.moe.mxfp4 import MXFP4Weight

__all__ = ["gmm_reference", "check_gmm_args"]

RhsLike = Union[jax.Array, MXFP4Weight]


def check_gmm_args(lhs, rhs, group_sizes):
    """Static shape validation shared by the reference and the kernels. Returns (M, K, G, N)."""
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be [M, K], got {lhs.shape}")
    m, k = lhs.shape
    if len(rhs.shape) != 3:
        raise ValueError(f"rhs must be [G, N, K] (logical), got {rhs.shape}")
    g, n, k2 = rhs.shape
    if k2 != k:
        raise ValueError(f"contracting dims differ: lhs {lhs.shape} vs rhs [G, N, K] {rhs.shape}")
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
) -> jax.Array:
    """``out[i] = lhs[i] @ rhs[g(i)].T`` for rows sorted by group; rows past sum(group_sizes) are 0.

    ``rhs`` is ``[G, N, K]`` (PyTorch ``[out, in]`` per expert) or an
    :class:`MXFP4Weight` with packed ``[G, N, K/2]`` / scale ``[G, N, K/gs]``
    (dequantised exactly to ``lhs.dtype`` first). Uses ``jax.lax.ragged_dot``.
    """
    group_sizes = jnp.asarray(group_sizes).astype(jnp.int32)
    m, _, _, _ = check_gmm_args(lhs, rhs, group_sizes)
    if isinstance(rhs, MXFP4Weight):
        w = rhs.dequantize(dtype=lhs.dtype)
    else:
        w = rhs.astype(lhs.dtype) if rhs.dtype != lhs.dtype else rhs
    out = jax.lax.ragged_dot(
        lhs, jnp.swapaxes(w, 1, 2), group_sizes,
        precision=precision, preferred_element_type=preferred_element_type)
    # ragged_dot leaves rows past sum(group_sizes) at zero on CPU; make it explicit.
    valid = jnp.arange(m, dtype=jnp.int32) < jnp.sum(group_sizes)
    return jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))
