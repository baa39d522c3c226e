"""Public KDA ops: dispatch between the jnp reference and the Pallas kernels.

``backend``: ``"auto"`` (Pallas on GPU/TPU, reference on CPU), ``"reference"``, ``"pallas"``
or ``"interpret"``; env ``K3JAX_KERNELS`` overrides (see :mod:`pallas_kernels.dispatch`).
The backend is resolved in Python before the (jitted) implementation is called, so the
env switch is honoured per call; every other non-array argument is static under jit
(``scale``, ``chunk_size``, ``output_final_state``, ``return_chunk_states``, ``state_dtype``,
``backend``, ``interpret``).

Shapes: ``q, k [B,T,H,K]``, ``v [B,T,H,V]``, ``g [B,T,H,K]`` (fp32 log-decay <= 0),
``beta [B,T,H]``, states ``[N,H,K,V]`` fp32; checked up front (``reference.check_kda_args``:
an error naming the argument, not an XLA or Pallas shape error). ``q``/``k`` must be
L2-normalised by the caller; ``scale`` (default ``K**-0.5``) multiplies ``q`` inside the op.
``state_dtype`` (None: fp32 carried exactly) rounds the state to the dtype a cache stores it in,
after every chunk of the chunked op and every token of the recurrent one (see
:mod:`pallas_kernels.kda.reference`).
"""

from __future__ import annotations

import os
import warnings
from functools import partial

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import ENV_VAR, resolve_backend, resolve_interpret
from pallas_kernels.kda import reference as ref
from pallas_kernels.kda.pool_cpu import fused_recurrent_kda_pool_cpu


def _resolve(backend, interpret):
    b = resolve_backend(backend)
    interp = resolve_interpret(backend, interpret) if b == "pallas" else False
    if b == "pallas" and not interp and jax.default_backend() == "gpu":
        from pallas_kernels.kda.pallas_kda import triton_available
        if not triton_available():   # JAX without the (deprecated) Pallas Triton lowering
            warnings.warn("KDA: Pallas Triton lowering unavailable; using the jnp reference",
                          RuntimeWarning, stacklevel=3)
            return "reference", False
    return b, interp


def _state_dtype(state_dtype):
    """None for fp32 (carried exactly), else the dtype's name (a static jit argument)."""
    if state_dtype is None:
        return None
    name = jnp.dtype(state_dtype).name
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"state_dtype={state_dtype!r}: expected float32 or bfloat16")
    return None if name == "float32" else name


@partial(jax.jit, static_argnames=("scale", "output_final_state", "chunk_size",
                                   "return_chunk_states", "state_dtype", "backend", "interpret"))
def _chunk_kda(q, k, v, g, beta, initial_state, cu_seqlens, *, scale, output_final_state,
               chunk_size, return_chunk_states, state_dtype, backend, interpret):
    if backend == "pallas":
        from pallas_kernels.kda.pallas_kda import chunk_kda_pallas
        return chunk_kda_pallas(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state,
                                cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                                return_chunk_states=return_chunk_states,
                                interpret=interpret, state_dtype=state_dtype)
    return ref.chunk_kda_reference(q, k, v, g, beta, scale=scale,
                                   initial_state=initial_state,
                                   output_final_state=output_final_state,
                                   cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                                   return_chunk_states=return_chunk_states,
                                   state_dtype=state_dtype)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, chunk_size=64, return_chunk_states=False, backend="auto",
              interpret=False, state_dtype=None):
    """Chunked KDA (prefill).

    Returns ``(o [B,T,H,V], final_state [N,H,K,V] | None)``, plus ``chunk_states`` when
    ``return_chunk_states``: ``[B, ceil(T/C), H, K, V]`` fp32, the state after every chunk
    (the last one is the state after token T-1 even when T is not a multiple of C). With
    ``cu_seqlens`` (int32 ``[N+1]``, B == 1) each sequence starts from
    ``initial_state[n]`` (zeros if None) and chunk states are laid out per sequence in
    chunks aligned to each sequence's own start (see
    :func:`pallas_kernels.kda.reference.varlen_chunk_offsets`).
    """
    cu_seqlens = None if cu_seqlens is None else jnp.asarray(cu_seqlens)
    ref.check_kda_args(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size=chunk_size)
    b, interp = _resolve(backend, interpret)
    return _chunk_kda(q, k, v, g, beta, initial_state, cu_seqlens, scale=scale,
                      output_final_state=bool(output_final_state),
                      chunk_size=int(chunk_size),
                      return_chunk_states=bool(return_chunk_states),
                      state_dtype=_state_dtype(state_dtype), backend=b, interpret=interp)


@partial(jax.jit, static_argnames=("scale", "output_final_state", "state_dtype", "backend",
                                   "interpret"))
def _fused_recurrent_kda(q, k, v, g, beta, initial_state, cu_seqlens, *, scale,
                         output_final_state, state_dtype, backend, interpret):
    if backend == "pallas":
        from pallas_kernels.kda.pallas_kda import fused_recurrent_kda_pallas
        return fused_recurrent_kda_pallas(q, k, v, g, beta, scale=scale,
                                          initial_state=initial_state,
                                          output_final_state=output_final_state,
                                          cu_seqlens=cu_seqlens, interpret=interpret,
                                          state_dtype=state_dtype)
    return ref.fused_recurrent_kda_reference(q, k, v, g, beta, scale=scale,
                                             initial_state=initial_state,
                                             output_final_state=output_final_state,
                                             cu_seqlens=cu_seqlens, state_dtype=state_dtype)


def fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None,
                        output_final_state=False, cu_seqlens=None, backend="auto",
                        interpret=False, state_dtype=None):
    """Recurrent KDA (decode / short T). Returns ``(o, final_state | None)``; the state is rounded
    to ``state_dtype`` after every token."""
    cu_seqlens = None if cu_seqlens is None else jnp.asarray(cu_seqlens)
    ref.check_kda_args(q, k, v, g, beta, initial_state, cu_seqlens)
    b, interp = _resolve(backend, interpret)
    return _fused_recurrent_kda(q, k, v, g, beta, initial_state, cu_seqlens, scale=scale,
                                output_final_state=bool(output_final_state),
                                state_dtype=_state_dtype(state_dtype), backend=b,
                                interpret=interp)


@partial(jax.jit, static_argnames=("scale", "backend", "interpret"))
def _fused_recurrent_kda_pool(q, k, v, g, beta, state_pool, slot_ids, *, scale, backend,
                              interpret):
    if backend == "pallas":
        from pallas_kernels.kda.pallas_kda import fused_recurrent_kda_pool_pallas
        return fused_recurrent_kda_pool_pallas(q, k, v, g, beta, state_pool, slot_ids,
                                               scale=scale, interpret=interpret)
    if backend == "cpu":
        return fused_recurrent_kda_pool_cpu(q, k, v, g, beta, state_pool, slot_ids, scale=scale)
    return ref.fused_recurrent_kda_pool_reference(q, k, v, g, beta, state_pool, slot_ids,
                                                  scale=scale)


def fused_recurrent_kda_pool(q, k, v, g, beta, state_pool, slot_ids, scale=None,
                             backend="auto", interpret=False):
    """Decode against a state pool: ``state_pool [S,H,K,V]`` fp32, ``slot_ids [B]`` int32.

    ``q,k,g [B,T,H,K]`` (T is usually 1), ``v [B,T,H,V]``, ``beta [B,T,H]``. Returns
    ``(o [B,T,H,V], new_pool)``. Row ``b`` reads and writes ``state_pool[slot_ids[b]]``;
    rows with ``slot_ids[b]`` outside ``[0, S)`` (``-1`` by convention) are padding (skipped:
    nothing written, output zero); slots not named are untouched. Duplicate valid ids in one
    call are undefined. To update the pool in place, donate it in the enclosing jit (the Pallas
    kernel aliases it to its output via ``input_output_aliases``; on CPU ``"auto"`` runs the row
    loop of :mod:`pallas_kernels.kda.pool_cpu`, which updates the donated pool in place).
    """
    slot_ids = jnp.asarray(slot_ids)
    ref.check_kda_args(q, k, v, g, beta, state_pool=state_pool, slot_ids=slot_ids)
    b, interp = _resolve(backend, interpret)
    if b == "reference" and backend == "auto" and not os.environ.get(ENV_VAR, "").strip():
        b = "cpu"  # auto on CPU: the in-place row loop (pool_cpu.py), same results as the reference
    return _fused_recurrent_kda_pool(q, k, v, g, beta, state_pool, slot_ids, scale=scale,
                                     backend=b, interpret=interp)


naive_recurrent_kda = ref.naive_recurrent_kda
