"""Public MoE ops: grouped matmul dispatch and token routing helpers."""
from __future__ import annotations

import os
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import ENV_VAR, resolve_backend, resolve_interpret
from pallas_kernels.moe.blocked import gmm_cpu
from pallas_kernels.moe.mxfp4 import MXFP4Weight
from pallas_kernels.moe.reference import RhsLike, check_gmm_args, expert_window, gmm_reference

__all__ = ["gmm", "route_and_sort"]


def gmm(
    lhs: jax.Array,
    rhs: RhsLike,
    group_sizes: jax.Array,
    *,
    preferred_element_type=jnp.float32,
    backend: str = "auto",
    interpret: bool = False,
    tiling: Optional[Tuple[int, int, int]] = None,
    rhs_layout: str = "out_in",
    group_offset: Optional[jax.Array] = None,
) -> jax.Array:
    """Grouped matmul ``lhs [M, K] x rhs [G, N, K] -> [M, N]``.

    Rows of ``lhs`` are sorted by group: rows ``[off[g], off[g] + group_sizes[g])``
    use expert ``g``. Rows at or past ``sum(group_sizes)`` produce zeros.
    ``rhs`` is a dense ``[G, N, K]`` array (HF/PyTorch ``[out, in]`` per expert) or an
    :class:`~pallas_kernels.moe.mxfp4.MXFP4Weight` (packed ``[G, N, K/2]``, scale ``[G, N, K/32]``), which the
    Pallas kernel dequantises per tile without materialising the bf16 weight.

    ``backend``: ``"auto"`` | ``"reference"`` | ``"pallas"`` | ``"interpret"`` (see
    :mod:`pallas_kernels.dispatch`). On CPU ``"auto"`` runs :func:`~pallas_kernels.moe.blocked.gmm_cpu`
    (plain jnp, only the routed experts computed); ``"reference"`` is ``ragged_dot`` on every expert. ``tiling=(tm, tk, tn)`` overrides the kernel tiles.
    ``rhs_layout="in_out"`` takes a dense ``rhs [G, K, N]`` (each expert transposed, the layout
    XLA:CPU multiplies fastest; see ``k3jax/weight_layout.py``); the Pallas kernel reads the
    ``[G, N, K]`` form and is handed a transposed copy.
    ``group_offset`` (traced int): ``rhs`` holds more experts than ``group_sizes`` counts and group ``g``
    uses expert ``group_offset + g`` (a layer's experts inside every layer's stack, k3jax/layer_scan.py).
    The CPU form reads the used experts out of the stack; the other paths take the window first.
    """
    group_sizes = jnp.asarray(group_sizes).astype(jnp.int32)
    resolved = resolve_backend(backend)
    cpu = resolved == "reference" and backend == "auto" and os.environ.get(ENV_VAR, "").strip() == ""
    if group_offset is not None and not (cpu and not isinstance(rhs, MXFP4Weight)):
        rhs, group_offset = expert_window(rhs, group_offset, group_sizes.shape[0]), None
    check_gmm_args(lhs, rhs, group_sizes, rhs_layout, windowed=group_offset is not None)
    if cpu:
        # CPU: a jnp form that computes only the routed experts (same per-row math).
        return gmm_cpu(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type, rhs_layout=rhs_layout,
                       group_offset=group_offset)
    if resolved == "reference":
        return gmm_reference(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type,
                             rhs_layout=rhs_layout)
    if rhs_layout == "in_out":
        rhs = jnp.swapaxes(rhs, 1, 2)
    from pallas_kernels.moe import kernel  # local import: keeps the reference path light

    return kernel.gmm_pallas(
        lhs, rhs, group_sizes,
        preferred_element_type=preferred_element_type,
        tiling=tiling,
        interpret=resolve_interpret(backend, interpret),
    )


def route_and_sort(expert_ids: jax.Array, num_experts: int) -> Tuple[jax.Array, jax.Array]:
    """Sort the ``T*k`` (token, slot) assignments by expert for :func:`gmm`.

    Args:
      expert_ids: ``[T, k]`` int expert index per token and slot. Ids outside
        ``[0, num_experts)`` (e.g. -1 for dropped/padded slots, or experts owned by
        another shard) are sorted to the end and not counted, so gmm returns zeros
        for them.
      num_experts: G, the length of ``group_sizes``.

    Returns:
      ``sort_idx [T*k]`` int32: positions into the flattened ``[T*k]`` assignments,
      grouped by expert (stable: token order kept inside an expert); the token of
      sorted row ``i`` is ``sort_idx[i] // k``.
      ``group_sizes [num_experts]`` int32.

    Usage::

        sort_idx, gs = route_and_sort(ids, E)
        y = gmm(x[sort_idx // k], w, gs)                       # [T*k, N]
        y = jnp.zeros_like(y).at[sort_idx].set(y).reshape(T, k, N)
    """
    expert_ids = jnp.asarray(expert_ids)
    if expert_ids.ndim != 2:
        raise ValueError(f"expert_ids must be [T, k], got {expert_ids.shape}")
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    valid = (flat >= 0) & (flat < num_experts)
    key = jnp.where(valid, flat, num_experts)
    sort_idx = jnp.argsort(key, stable=True).astype(jnp.int32)
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[jnp.where(valid, flat, num_experts)].add(
        1, mode="drop")
    return sort_idx, group_sizes
