"""Plain-jnp reference implementations of KDA (Kimi Delta Attention).

Conventions (flash-linear-attention names, k3 spec §2.3):

* layout ``[B, T, H, D]``; ``q``/``k`` are already L2-normalised by the caller;
* ``scale`` (default ``K ** -0.5``) multiplies ``q`` inside the op;
* ``g`` is the per-channel log-decay ``[B, T, H, K]`` (``<= 0``), ``beta`` is ``[B, T, H]``
  (already sigmoided);
* the state is ``[N, H, K, V]`` fp32 (rows = key channels, cols = value channels)::

      S_t = (I - b_t k_t k_t^T) Diag(exp g_t) S_{t-1} + b_t k_t v_t^T
      o_t = S_t^T (scale * q_t)

* all compute is fp32; ``o`` has ``v``'s dtype; states are fp32.

The chunked form (``chunk_kda_reference``) never forms ``exp(Gamma_i) * exp(-Gamma_j)``: it
takes pairwise differences ``Gamma_i - Gamma_j`` masked to ``-inf`` above the diagonal
*before* the exponential, so it stays exact when the cumulative log-decay of a chunk reaches
-320 (K3's gate lower bound of -5 over 64 tokens) or beyond (Kimi-Linear's unbounded gate).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST


def _default_scale(scale, K):
    return float(K) ** -0.5 if scale is None else scale


# ----------------------------------------------------------------------------------------
# token-by-token recurrence (the ground truth)
# ----------------------------------------------------------------------------------------
def _token_step(S, q, k, v, g, b):
    """One KDA step. S [..., K, V]; q,k,g [..., K]; v [..., V]; b [...]. fp32."""
    S = jnp.exp(g)[..., :, None] * S
    kS = jnp.einsum("...k,...kv->...v", k, S, precision=_HI)
    u = b[..., None] * (v - kS)
    S = S + k[..., :, None] * u[..., None, :]
    o = jnp.einsum("...k,...kv->...v", q, S, precision=_HI)
    return S, o


def _as_f32(*xs):
    return tuple(x.astype(jnp.float32) for x in xs)


def naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None):
    """Token-by-token ``lax.scan`` KDA. Returns ``(o [B,T,H,V], final_state [B,H,K,V])``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = _default_scale(scale, K)
    qf, kf, vf, gf, bf = _as_f32(q, k, v, g, beta)
    qf = qf * scale
    S0 = (jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))

    def step(S, xs):
        qt, kt, vt, gt, bt = xs
        S, o = _token_step(S, qt, kt, vt, gt, bt)
        return S, o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (qf, kf, vf, gf, bf))
    S, o = lax.scan(step, S0, xs)
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), S


# ----------------------------------------------------------------------------------------
# varlen (cu_seqlens) helpers
# ----------------------------------------------------------------------------------------
def _seq_ids(cu_seqlens, T):
    """Sequence index of every packed token position ``[T]`` (int32)."""
    t = jnp.arange(T, dtype=jnp.int32)
    return (jnp.searchsorted(cu_seqlens, t, side="right") - 1).astype(jnp.int32)


def fused_recurrent_kda_reference(q, k, v, g, beta, scale=None, initial_state=None,
                                  output_final_state=False, cu_seqlens=None):
    """Recurrent KDA (token scan), with optional ``cu_seqlens`` packing (B must be 1).

    Returns ``(o, final_state)``; ``final_state`` is ``None`` unless ``output_final_state``.
    """
    if cu_seqlens is None:
        o, S = naive_recurrent_kda(q, k, v, g, beta, scale, initial_state)
        return o, (S if output_final_state else None)

    B, T, H, K = q.shape
    V = v.shape[-1]
    if B != 1:
        raise ValueError("cu_seqlens requires B == 1 (packed sequences)")
    N = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    scale = _default_scale(scale, K)
    qf, kf, vf, gf, bf = (x[0] for x in _as_f32(q, k, v, g, beta))
    qf = qf * scale
    init = (jnp.zeros((N, H, K, V), jnp.float32) if initial_state is None
            else initial_state.astype(jnp.float32))
    seq = _seq_ids(cu, T)
    t = jnp.arange(T, dtype=jnp.int32)
    safe_seq = jnp.clip(seq, 0, N - 1)
    is_first = (t == cu[safe_seq]) & (seq < N)
    is_last = (t == cu[jnp.clip(seq + 1, 0, N)] - 1) & (seq < N)

    def step(carry, xs):
        S, finals = carry
        qt, kt, vt, gt, bt, first, last, n = xs
        S = jnp.where(first, init[n], S)
        S, o = _token_step(S, qt, kt, vt, gt, bt)
        finals = finals.at[n].set(jnp.where(last, S, finals[n]))
        return (S, finals), o

    S0 = jnp.zeros((H, K, V), jnp.float32)
    (_, finals), o = lax.scan(step, (S0, init),
                              (qf, kf, vf, gf, bf, is_first, is_last, safe_seq))
    o = o[None].astype(v.dtype)
    return o, (finals if output_final_state else None)


class VarlenLayout(NamedTuple):
    """Chunk-aligned layout of packed sequences (all traced int32 arrays, static shapes).

    Every sequence ``n`` occupies ``ceil(L_n / C)`` consecutive chunks starting at chunk
    ``chunk_offsets[n]``; the tail of its last chunk is padding (g=0, beta=0, k=v=0), which
    leaves the state unchanged. ``num_chunks`` (static) bounds the total chunk count.
    """

    src: jax.Array            # [num_chunks*C] packed source token of each slot, or -1 (pad)
    dst: jax.Array            # [T] slot of each packed token
    chunk_seq: jax.Array      # [num_chunks] sequence of each chunk (N for unused chunks)
    chunk_first: jax.Array    # [num_chunks] bool: first chunk of its sequence
    chunk_offsets: jax.Array  # [N+1] first chunk of each sequence (exclusive cumsum)
    last_chunk: jax.Array     # [N] last chunk of each sequence (-1 for empty sequences)


def varlen_num_chunks(T: int, N: int, chunk_size: int) -> int:
    """Static upper bound on ``sum_n ceil(L_n / C)`` given ``sum_n L_n = T``."""
    return max(1, (T + N * (chunk_size - 1)) // chunk_size)


def varlen_chunk_offsets(cu_seqlens, chunk_size: int = 64):
    """``[N+1]`` chunk offsets: sequence ``n``'s chunks are ``offsets[n] .. offsets[n+1]-1``.

    With ``return_chunk_states=True`` and ``cu_seqlens``, ``chunk_states[0, offsets[n] + j]``
    is sequence ``n``'s state after ``min((j+1)*C, L_n)`` of its own tokens.
    """
    cu = cu_seqlens.astype(jnp.int32)
    lens = cu[1:] - cu[:-1]
    nch = (lens + chunk_size - 1) // chunk_size
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nch).astype(jnp.int32)])


def varlen_layout(cu_seqlens, T: int, chunk_size: int) -> VarlenLayout:
    C = chunk_size
    N = cu_seqlens.shape[0] - 1
    NC = varlen_num_chunks(T, N, C)
    cu = cu_seqlens.astype(jnp.int32)
    lens = cu[1:] - cu[:-1]
    off = varlen_chunk_offsets(cu, C)
    c = jnp.arange(NC, dtype=jnp.int32)
    chunk_seq = (jnp.searchsorted(off[1:], c, side="right")).astype(jnp.int32)  # N if unused
    safe = jnp.clip(chunk_seq, 0, N - 1)
    chunk_first = (c == off[safe]) & (chunk_seq < N)
    P = jnp.arange(NC * C, dtype=jnp.int32)
    pc = P // C
    pseq = chunk_seq[pc]
    psafe = jnp.clip(pseq, 0, N - 1)
    local = (pc - off[psafe]) * C + P % C
    valid = (pseq < N) & (local < lens[psafe])
    src = jnp.where(valid, cu[psafe] + local, -1)
    tseq = jnp.clip(_seq_ids(cu, T), 0, N - 1)
    t = jnp.arange(T, dtype=jnp.int32)
    dst = off[tseq] * C + (t - cu[tseq])
    last_chunk = jnp.where(lens > 0, off[1:] - 1, -1)
    return VarlenLayout(src, dst, chunk_seq, chunk_first, off, last_chunk)


def pack_varlen(x, layout: VarlenLayout, chunk_size: int):
    """[T, ...] packed tokens -> [NC, C, ...] chunk-aligned (zeros in the padding)."""
    src = layout.src
    y = jnp.take(x, jnp.clip(src, 0), axis=0)
    y = jnp.where((src >= 0).reshape((-1,) + (1,) * (x.ndim - 1)), y, jnp.zeros_like(y))
    return y.reshape((-1, chunk_size) + x.shape[1:])


# ----------------------------------------------------------------------------------------
# chunked (WY / UT) form
# ----------------------------------------------------------------------------------------
def _chunk_step(S, qc, kc, vc, gc, bc):
    """One chunk. S [..., K, V]; qc,kc,gc [..., C, K]; vc [..., C, V]; bc [..., C].

    Returns (S_next, o [..., C, V]). Numerically safe for any g <= 0.
    """
    C = qc.shape[-2]
    G = jnp.cumsum(gc, axis=-2)                                   # Gamma [..., C, K]
    i = jnp.arange(C)
    causal = i[:, None] >= i[None, :]
    strict = i[:, None] > i[None, :]
    diff = G[..., :, None, :] - G[..., None, :, :]                # [..., C(i), C(j), K]
    E = jnp.exp(jnp.where(causal[:, :, None], diff, -jnp.inf))    # mask BEFORE exp
    kE = kc[..., None, :, :] * E                                  # k_j[c] exp(G_i - G_j)
    Akk = jnp.einsum("...ic,...ijc->...ij", kc, kE, precision=_HI)
    Akk = jnp.where(strict, Akk * bc[..., :, None], 0.0)
    Aqk = jnp.einsum("...ic,...ijc->...ij", qc, kE, precision=_HI)
    eG = jnp.exp(G)
    rhs = jnp.concatenate([kc * eG, vc], axis=-1) * bc[..., None]
    X = lax.linalg.triangular_solve(Akk, rhs, left_side=True, lower=True,
                                    unit_diagonal=True)          # (I + Akk)^-1 Diag(b) [.]
    K = kc.shape[-1]
    W, U = X[..., :K], X[..., K:]
    Vn = U - jnp.einsum("...ck,...kv->...cv", W, S, precision=_HI)
    o = (jnp.einsum("...ck,...kv->...cv", qc * eG, S, precision=_HI)
         + jnp.einsum("...ij,...jv->...iv", Aqk, Vn, precision=_HI))
    gl = G[..., -1:, :]                                            # [..., 1, K]
    kd = kc * jnp.exp(gl - G)
    S = (jnp.exp(gl[..., 0, :])[..., :, None] * S
         + jnp.einsum("...jk,...jv->...kv", kd, Vn, precision=_HI))
    return S, o


def chunk_kda_reference(q, k, v, g, beta, scale=None, initial_state=None,
                        output_final_state=False, cu_seqlens=None, chunk_size=64,
                        return_chunk_states=False):
    """Chunked KDA (``lax.scan`` over chunks, unit-lower-triangular solve per chunk).

    Returns ``(o, final_state)`` or ``(o, final_state, chunk_states)`` when
    ``return_chunk_states``. ``final_state`` is ``None`` unless ``output_final_state``.
    ``chunk_states`` is ``[B, num_chunks, H, K, V]`` fp32 (state after each chunk); with
    ``cu_seqlens`` it is ``[1, num_chunks_bound, H, K, V]`` in the chunk-aligned varlen layout
    (see :func:`varlen_chunk_offsets`; entries past the last used chunk are unspecified).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = int(chunk_size)
    scale = _default_scale(scale, K)
    qf, kf, vf, gf, bf = _as_f32(q, k, v, g, beta)
    qf = qf * scale

    if cu_seqlens is None:
        NC = max(1, -(-T // C))
        pad = NC * C - T

        def prep(x):  # [B,T,H,...] -> [NC, B, H, C, ...]
            x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
            x = x.reshape((B, NC, C) + x.shape[2:])
            x = jnp.moveaxis(x, 2, 3)          # [B, NC, H, C, ...]
            return jnp.moveaxis(x, 1, 0)       # [NC, B, H, C, ...]

        xs = tuple(prep(x) for x in (qf, kf, vf, gf, bf))
        S0 = (jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None
              else initial_state.astype(jnp.float32))

        def step(S, x):
            S, o = _chunk_step(S, *x)
            return S, ((o, S) if return_chunk_states else o)

        S, ys = lax.scan(step, S0, xs)
        o = ys[0] if return_chunk_states else ys          # [NC, B, H, C, V]
        o = jnp.moveaxis(o, 0, 1)                          # [B, NC, H, C, V]
        o = jnp.moveaxis(o, 2, 3).reshape(B, NC * C, H, V)[:, :T].astype(v.dtype)
        out = (o, S if output_final_state else None)
        if return_chunk_states:
            out = out + (jnp.moveaxis(ys[1], 0, 1),)
        return out

    # ---- varlen: chunk-aligned layout, state reset at each sequence's first chunk ----
    if B != 1:
        raise ValueError("cu_seqlens requires B == 1 (packed sequences)")
    N = cu_seqlens.shape[0] - 1
    lay = varlen_layout(cu_seqlens, T, C)
    xs = tuple(jnp.moveaxis(pack_varlen(x[0], lay, C), 2, 1)      # [NC, H, C, ...]
               for x in (qf, kf, vf, gf, bf))
    init = (jnp.zeros((N, H, K, V), jnp.float32) if initial_state is None
            else initial_state.astype(jnp.float32))

    def vstep(S, x):
        first, n, *rest = x
        S = jnp.where(first, init[jnp.clip(n, 0, N - 1)], S)
        S, o = _chunk_step(S, *rest)
        return S, (o, S)

    S0 = jnp.zeros((H, K, V), jnp.float32)
    _, (o, cs) = lax.scan(vstep, S0, (lay.chunk_first, lay.chunk_seq) + xs)
    # o [NC, H, C, V] -> [NC*C, H, V] -> gather back to packed tokens
    o = jnp.moveaxis(o, 1, 2).reshape(-1, H, V)
    o = jnp.take(o, lay.dst, axis=0)[None].astype(v.dtype)
    final = None
    if output_final_state:
        final = jnp.where((lay.last_chunk >= 0)[:, None, None, None],
                          jnp.take(cs, jnp.clip(lay.last_chunk, 0), axis=0), init)
    out = (o, final)
    if return_chunk_states:
        out = out + (cs[None],)
    return out


# ----------------------------------------------------------------------------------------
# pooled decode
# ----------------------------------------------------------------------------------------
def fused_recurrent_kda_pool_reference(q, k, v, g, beta, state_pool, slot_ids, scale=None):
    """Decode ``T`` (usually 1) tokens for each of ``B`` sequences whose state is
    ``state_pool[slot_ids[b]]``. Returns ``(o [B,T,H,V], new_pool)``.

    Rows with ``slot_ids[b] < 0`` are padding: they read nothing, write nothing, and their
    output is zero. Slots not named in ``slot_ids`` are untouched. Duplicate non-negative slot
    ids in one call are undefined behaviour.
    """
    S_pool = state_pool.shape[0]
    slot_ids = slot_ids.astype(jnp.int32)
    valid = slot_ids >= 0
    S0 = jnp.take(state_pool, jnp.clip(slot_ids, 0, S_pool - 1), axis=0).astype(jnp.float32)
    o, S1 = naive_recurrent_kda(q, k, v, g, beta, scale, S0)
    o = jnp.where(valid[:, None, None, None], o, jnp.zeros_like(o))
    idx = jnp.where(valid, slot_ids, S_pool)   # out of range -> dropped
    new_pool = state_pool.at[idx].set(S1.astype(state_pool.dtype), mode="drop")
    return o, new_pool
