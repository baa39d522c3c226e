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
* ``state_dtype`` (None: fp32 carried exactly): the dtype a cache stores states in between steps.
  The state is rounded to it (round to nearest even) after every token of the recurrent forms and
  at the end of every chunk of ``chunk_size`` tokens of the chunked form, so a sequence run in one
  call equals the same sequence run chunk by chunk through a cache of that dtype.

The chunked form (``chunk_kda_reference``, what ``chunk_kda`` runs on CPU) never forms
``exp(Gamma_i) * exp(-Gamma_j)``: every exponent is a same-sign sum of ``g`` over a token range
(a binary tree inside 16-token sub-chunks, factors <= 1 across them), so it is exact when the
cumulative log-decay of a chunk reaches -320 (K3's gate lower bound of -5 over 64 tokens) or
beyond (Kimi-Linear's unbounded gate). It is a few small batched matmuls per 16 tokens plus
a state-only loop; see the section comment below for the layout and cost.
"""

from __future__ import annotations

import functools

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
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


def kda_token_step(S, q, k, v, g, beta, scale=None):
    """One decode token from state ``S [..., K, V]`` -> ``(o [..., V], S_new)``, fp32, reading ``S``
    through a single product. q, k, g ``[..., K]``; v ``[..., V]``; beta ``[...]``.

    The same recurrence as the token scan, with the output taken as
    ``o = ((q * a)^T S) + (q . k) u`` (``a = exp(g)``, ``u = beta (v - (k * a)^T S)``) instead of
    ``q^T S_new``: both projections of the old state come from one product, so nothing reads the
    state after it is updated. The serving step relies on that to overwrite a state in place
    (a later read of the old state would make XLA copy the buffer holding it). Agrees with
    ``_token_step`` to fp32 rounding."""
    K = q.shape[-1]
    q, k, v, g, beta = _as_f32(q, k, v, g, beta)
    q = q * _default_scale(scale, K)
    a = jnp.exp(g)
    S = S.astype(jnp.float32)
    r = jnp.einsum("...ck,...kv->...cv", jnp.stack([k * a, q * a], -2), S, precision=_HI)  # [..., 2, V]
    u = beta[..., None] * (v - r[..., 0, :])
    S = a[..., :, None] * S + k[..., :, None] * u[..., None, :]
    o = r[..., 1, :] + jnp.sum(q * k, -1, keepdims=True) * u
    return o, S


def round_state(S, state_dtype=None):
    """``S`` as a cache storing states in ``state_dtype`` gives it back: fp32 values rounded to the
    nearest ``state_dtype`` value (even on ties). None or float32: ``S`` unchanged."""
    if state_dtype is None or jnp.dtype(state_dtype) == jnp.float32:
        return S
    return S.astype(state_dtype).astype(jnp.float32)


def _as_f32(*xs):
    return tuple(x.astype(jnp.float32) for x in xs)


def _shape_error(name, want, x):
    return ValueError(f"{name} must be {want}, got shape {tuple(x.shape)}")


def check_kda_args(q, k, v, g, beta, initial_state=None, cu_seqlens=None, state_pool=None,
                   slot_ids=None, chunk_size=None):
    """Static shape / dtype checks shared by the public KDA ops, naming the argument at fault.

    Without them a mismatch fails deep inside (an XLA broadcast or a Pallas block-shape error) or,
    for some (a state pool or ``initial_state`` of the wrong length, ``v`` shorter than ``q``),
    silently returns garbage. ``initial_state`` is ``[N, H, K, V]`` with N = B, or the number of
    ``cu_seqlens`` sequences; ``state_pool`` is ``[S, H, K, V]`` with ``slot_ids [B]`` integer."""
    if q.ndim != 4:
        raise _shape_error("q", "[B, T, H, K]", q)
    B, T, H, K = q.shape
    for name, x in (("k", k), ("g", g)):
        if tuple(x.shape) != (B, T, H, K):
            raise _shape_error(name, f"[B, T, H, K] = {[B, T, H, K]} like q", x)
    if v.ndim != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise _shape_error("v", f"[B, T, H, V] with [B, T, H] = {[B, T, H]} like q", v)
    if tuple(beta.shape) != (B, T, H):
        raise _shape_error("beta", f"[B, T, H] = {[B, T, H]}", beta)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a float array, got {x.dtype}")
    V = v.shape[3]
    N = B
    if cu_seqlens is not None:
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise _shape_error("cu_seqlens", "[N + 1] with N >= 1 sequences", cu_seqlens)
        if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
            raise TypeError(f"cu_seqlens must be an integer array, got {cu_seqlens.dtype}")
        if B != 1:
            raise ValueError(f"cu_seqlens requires B == 1 (packed sequences), got q of shape {tuple(q.shape)}")
        N = cu_seqlens.shape[0] - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, V):
        raise _shape_error("initial_state", f"[N, H, K, V] = {[N, H, K, V]}", initial_state)
    if state_pool is not None:
        if state_pool.ndim != 4 or tuple(state_pool.shape[1:]) != (H, K, V):
            raise _shape_error("state_pool", f"[S, H, K, V] with [H, K, V] = {[H, K, V]}", state_pool)
        if tuple(slot_ids.shape) != (B,):
            raise _shape_error("slot_ids", f"[B] = [{B}]", slot_ids)
        if not jnp.issubdtype(slot_ids.dtype, jnp.integer):
            raise TypeError(f"slot_ids must be an integer array, got {slot_ids.dtype}")
    if chunk_size is not None and (int(chunk_size) != chunk_size or chunk_size < 1):
        raise ValueError(f"chunk_size={chunk_size!r} must be an integer >= 1")


def naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, state_dtype=None):
    """Token-by-token ``lax.scan`` KDA. Returns ``(o [B,T,H,V], final_state [B,H,K,V])``; the state
    is rounded to ``state_dtype`` after every token."""
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
        return round_state(S, state_dtype), o

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
                                  output_final_state=False, cu_seqlens=None, state_dtype=None):
    """Recurrent KDA (token scan), with optional ``cu_seqlens`` packing (B must be 1); the state is
    rounded to ``state_dtype`` after every token. Tokens past ``cu_seqlens[-1]`` are padding: zero
    output, no state touched (as in the chunked form and the kernels).

    Returns ``(o, final_state)``; ``final_state`` is ``None`` unless ``output_final_state``.
    """
    if cu_seqlens is None:
        o, S = naive_recurrent_kda(q, k, v, g, beta, scale, initial_state, state_dtype)
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
        S = round_state(S, state_dtype)
        finals = finals.at[n].set(jnp.where(last, S, finals[n]))
        return (S, finals), o

    S0 = jnp.zeros((H, K, V), jnp.float32)
    (_, finals), o = lax.scan(step, (S0, init),
                              (qf, kf, vf, gf, bf, is_first, is_last, safe_seq))
    o = jnp.where((seq < N)[:, None, None], o, 0.0)   # tokens past cu_seqlens[-1]: padding, zeros
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
# Internally the WY recurrence runs over *sub-chunks* of P = 16 tokens (P = the next power of
# two >= max(16, C) when chunk_size C is not a multiple of 16); ``chunk_size`` only sets which
# states ``return_chunk_states`` / varlen report. A loop step takes G sub-chunks (64 tokens)
# and computes their state-independent part batched over [G, B, H] with a few small matmuls
# -- every exponent as an exact range sum of g (one matmul with a constant 0/1 matrix), the
# causal A_qk[i,j] = sum_c q_i[c] k_j[c] exp(Gamma_i[c] - Gamma_j[c]), A_kk, the inverse
# (I + Diag(beta) A_kk)^-1 by block doubling and the W/U factors -- then an inner scan over
# the G sub-chunks carries the state through three matmuls each ([W; q e^Gamma] S,
# A_qk V_new, k_d^T V_new). Inside a sub-chunk a pair (i, j) is split at the node of a binary
# tree that separates them, exp(Gamma_i - Gamma_r) * exp(Gamma_r - Gamma_j), both factors
# <= 1 (the Pallas kernel's scheme); across sub-chunks only factors <= 1 occur
# (q_i e^Gamma_i, k_j e^(Gamma_P - Gamma_j), e^Gamma_P). Nothing overflows, no exponent is a
# difference of two large cumulative sums, exp(Gamma_i) * exp(-Gamma_j) is never formed:
# exact for any g <= 0 (K3's floor -5 for whole chunks, Kimi-Linear's unbounded gate).
# Cost: ~9 K*V FLOPs per token at K = V = 128 (6.25 of them the three state matmuls,
# independent of P) against the token scan's ~7 K*V -- the chunked form wins only through
# matmul efficiency, so on CPU it is ~2x the token scan at K = V = 128, not 10x
# (benchmarks/README.md). P = 16 measured fastest (or tied with 32) on CPU among 16/32/64:
# a larger P adds intra-chunk FLOPs faster than it saves passes over the state.
_SUB = 16
_STEP_TOKENS = 64           # tokens per loop step (G = sub-chunks per step, a multiple of R)


def _mm(spec, a, b, precision=_HI):
    return jnp.einsum(spec, a, b, precision=precision)


def _range_sum_matrix(P):
    """Constant 0/1 ``[(2 + log2 P) * P, P]`` matrix whose product with ``g [P, K]`` gives,
    exactly (sums of same-sign terms), every exponent the sub-chunk needs: rows ``[0, P)``
    the inclusive prefix sums Gamma_i, rows ``[P, 2P)`` the exclusive suffix sums
    Gamma_P - Gamma_i, then per tree level s = 1, 2, 4, ...: for i in the 2nd half of its
    2s-block the prefix sum from that half's start to i, for i in the 1st half the sum from
    i+1 to that half's end."""
    i, t = np.arange(P)[:, None], np.arange(P)[None, :]
    rows = [t <= i, t > i]
    s = 1
    while s < P:
        start = (i // s) * s                      # start of i's s-block (= its half)
        second = (i // s) % 2 == 1
        rows.append(np.where(second, (t >= start) & (t <= i), (t > i) & (t < start + s)))
        s *= 2
    return np.concatenate(rows, 0).astype(np.float32)


def _chunk_local(q, k, g, beta, precision=_HI):
    """State-independent part of a sub-chunk, exact for any ``g <= 0``.

    ``q, k, g [..., P, K]``, ``beta [..., P]`` (P a power of two). Returns ``(A_qk [..., P, P]
    causal, T [..., P, P] = (I + Diag(beta) A_kk)^-1, exp(Gamma) [..., P, K],
    exp(Gamma_P - Gamma) [..., P, K])``. Binary tree over the sub-chunk: at level s the pairs
    (i in the 2nd half, j in the 1st half of a 2s-block) get exp(Gamma_i - Gamma_r) *
    exp(Gamma_r - Gamma_j) (r = last token of the 1st half), both exponents range sums from
    :func:`_range_sum_matrix` (one matmul); the inverse is assembled level by level by block
    doubling ([[T0, 0], [Y, T1]], Y = -T1 A10 T0: blocked forward substitution, every
    intermediate a sub-block of the exact inverse). ``precision``: of every product (IEEE fp32 here;
    the Pallas split forms pass three-pass TF32 on a GPU, see ``pallas_kda._split_prep``).
    """
    mm = functools.partial(_mm, precision=precision)
    *lead, P, K = q.shape
    lead = tuple(lead)
    F = jnp.exp(mm("rp,...pk->...rk", jnp.asarray(_range_sum_matrix(P)), g))   # [..., nP, K]
    KQ = jnp.stack([k, q], axis=-3)             # [..., 2, P, K]
    Aqk = jnp.zeros(lead + (P, 1, 1), jnp.float32)
    Tinv = jnp.ones(lead + (P, 1, 1), jnp.float32)
    s, lvl = 1, 2
    while s < P:
        nb = P // (2 * s)
        Fr = F[..., lvl * P:(lvl + 1) * P, :].reshape(lead + (nb, 2, s, K))
        KQr = KQ.reshape(lead + (2, nb, 2, s, K))
        lhs = KQr[..., 1, :, :] * Fr[..., None, :, 1, :, :]     # i in the 2nd half
        kb = KQr[..., 0, :, 0, :, :] * Fr[..., 0, :, :]          # j in the 1st half
        X = mm("...xnik,...njk->...xnij", lhs, kb)             # [..., 2, nb, s, s]
        Xkk, Xqk = X[..., 0, :, :, :], X[..., 1, :, :, :]
        z = jnp.zeros(lead + (nb, s, s), jnp.float32)
        Aq = Aqk.reshape(lead + (nb, 2, s, s))
        Aqk = jnp.concatenate([jnp.concatenate([Aq[..., 0, :, :], z], -1),
                               jnp.concatenate([Xqk, Aq[..., 1, :, :]], -1)], -2)
        Tb = Tinv.reshape(lead + (nb, 2, s, s))
        T0, T1 = Tb[..., 0, :, :], Tb[..., 1, :, :]
        Y = -mm("...ij,...jk->...ik",
                mm("...ij,...jk->...ik", T1,
                    beta.reshape(lead + (nb, 2, s))[..., 1, :, None] * Xkk), T0)
        Tinv = jnp.concatenate([jnp.concatenate([T0, z], -1),
                                jnp.concatenate([Y, T1], -1)], -2)
        s, lvl = 2 * s, lvl + 1
    i = np.arange(P)
    qk = mm("...ik,...jk->...ij", q, k)                        # diagonal: q_i . k_i
    Aqk = Aqk.reshape(lead + (P, P)) + jnp.where(jnp.asarray(i[:, None] == i[None, :]), qk, 0.0)
    return Aqk, Tinv.reshape(lead + (P, P)), F[..., :P, :], F[..., P:2 * P, :]


def _scan_chunks(q, k, v, g, beta, S0, scale, *, P, G, R, resets=None, want_states=False,
                 state_dtype=None):
    """Loop over steps of G sub-chunks of P tokens (R sub-chunks per reported chunk).

    ``q, k, g [Bx, NG, G*P, H, K]``, ``v [Bx, NG, G*P, H, V]``, ``beta [Bx, NG, G*P, H]``
    (plain reshapes of the ``[B, T, H, D]`` inputs when nothing is padded, so the loop reads
    the caller's buffers in place), any float dtype. ``S0 [Bx, H, K, V]`` fp32. ``resets``:
    ``(first [NG, G] bool, seq [NG, G] int32, init [N, H, K, V])`` -- the state is reset to
    ``init[seq]`` before every sub-chunk flagged ``first`` (varlen). Returns ``(o [Bx, NG,
    G*P, H, V] in v's dtype, S_final [Bx, H, K, V], states [Bx, NG, G//R, H, K, V] after
    every R-th sub-chunk, or None)``. With ``state_dtype`` the state is rounded to it after every
    R-th sub-chunk (the end of each reported chunk).

    Each step computes the state-independent part of its G sub-chunks batched over
    [G, Bx, H], then runs an inner ``lax.scan`` over the G sub-chunks carrying the state
    (transposed, ``[V, K]``, so every matmul in it is a plain or rhs-transposed one; a
    Python-unrolled inner loop lets XLA fuse the chain of state updates into each consumer
    and recompute it, O(G^2) passes over the state).
    """
    Bx, NG, _, H, K = q.shape
    V = v.shape[-1]
    f32 = jnp.float32
    xs = (q, k, v, g, beta)

    def heads(y):                      # [Bx, G*P, H, D] -> [G, Bx, H, P, D]
        return jnp.transpose(y.reshape((Bx, G, P) + y.shape[2:]), (1, 0, 3, 2, 4))

    def sub_chunk(ST, x):
        WQ, UT, Aqk, kd, eC, chunk_end = x[:6]
        if resets is not None:
            first, seq = x[6:]
            ST = jnp.where(first, jnp.swapaxes(resets[2][seq], -1, -2)[None], ST)
        ZT = _mm("...vk,...ck->...vc", ST, WQ)                  # S^T [W; q e^Gamma]^T
        VnT = UT - ZT[..., :P]                                   # (U - W S)^T
        oT = ZT[..., P:] + _mm("...vj,...ij->...vi", VnT, Aqk)
        ST = eC * ST + _mm("...vc,...ck->...vk", VnT, kd)
        if state_dtype is not None:                              # stored at each chunk's end
            ST = jnp.where(chunk_end, round_state(ST, state_dtype), ST)
        return ST, ((oT, ST) if want_states else oT)

    def body(n, carry):
        ST, o_all, cs_all = carry
        x = [lax.dynamic_index_in_dim(y, n, 1, keepdims=False).astype(f32) for y in xs]
        qc, kc, gc = (heads(y) for y in (x[0], x[1], x[3]))
        vT = jnp.transpose(x[2].reshape(Bx, G, P, H, V), (1, 0, 3, 4, 2))   # [G,Bx,H,V,P]
        bc = heads(x[4][..., None])[..., 0]                                 # [G,Bx,H,P]
        Aqk, Tinv, eG, eS = _chunk_local(qc * scale, kc, gc, bc)
        W = _mm("...ij,...jk->...ik", Tinv, kc * eG * bc[..., None])   # (I+A)^-1 D(b) k e^G
        UT = _mm("...vj,...ij->...vi", vT * bc[..., None, :], Tinv)    # ((I+A)^-1 D(b) v)^T
        WQ = jnp.concatenate([W, qc * scale * eG], -2)          # [G, Bx, H, 2P, K]
        kd = kc * eS                                             # k_j exp(Gamma_P - Gamma_j)
        eC = eG[..., -1:, :]                                     # exp(Gamma_P) [..., 1, K]
        ins = (WQ, UT, Aqk, kd, eC, jnp.arange(G) % R == R - 1)
        if resets is not None:
            ins = ins + (resets[0][n], resets[1][n])
        ST, ys = lax.scan(sub_chunk, ST, ins)
        oT, states = ys if want_states else (ys, None)           # oT [G, Bx, H, V, P]
        o = jnp.transpose(oT, (1, 0, 4, 2, 3)).reshape(Bx, 1, G * P, H, V)
        o_all = lax.dynamic_update_slice_in_dim(o_all, o.astype(o_all.dtype), n, 1)
        if want_states:                                          # [G, Bx, H, V, K]
            cs = jnp.moveaxis(jnp.swapaxes(states[R - 1::R], -1, -2), 0, 1)[:, None]
            cs_all = lax.dynamic_update_slice_in_dim(cs_all, cs, n, 1)
        return ST, o_all, cs_all

    o_all = jnp.zeros((Bx, NG, G * P, H, V), v.dtype)
    cs_all = jnp.zeros((Bx, NG, G // R, H, K, V) if want_states else (0,), f32)
    ST, o_all, cs_all = lax.fori_loop(0, NG, body, (jnp.swapaxes(S0, -1, -2), o_all, cs_all))
    return o_all, jnp.swapaxes(ST, -1, -2), (cs_all if want_states else None)


def _sub_chunking(C):
    """``(P, R, G)``: sub-chunk length, sub-chunks per chunk of C tokens, per loop step."""
    if C % _SUB == 0:
        P, R = _SUB, C // _SUB
    else:
        P, R = max(_SUB, 1 << (C - 1).bit_length()), 1
    return P, R, R * max(1, _STEP_TOKENS // (P * R))


def _to_groups(x, n_chunks, C, P, R, G):
    """``[Bx, T, ...]`` (``T <= n_chunks*C``) -> ``[Bx, NG, G*P, ...]``: the last chunk
    completed, chunks padded to ``R*P`` tokens and the sub-chunk count to a multiple of G,
    all with zeros (identity tokens: g=0, beta=0, k=v=0 leave the state unchanged). A pure
    reshape when nothing needs padding."""
    Bx, T, tail = x.shape[0], x.shape[1], x.shape[2:]
    n_sub = n_chunks * R
    NG = -(-n_sub // G)
    rest = [(0, 0)] * len(tail)
    if P * R != C:
        x = jnp.pad(x, [(0, 0), (0, n_chunks * C - T)] + rest)
        x = x.reshape((Bx, n_chunks, C) + tail)
        x = jnp.pad(x, [(0, 0), (0, 0), (0, P * R - C)] + rest)
        x = x.reshape((Bx, n_sub * P) + tail)
        T = n_sub * P
    if NG * G * P != T:
        x = jnp.pad(x, [(0, 0), (0, NG * G * P - T)] + rest)
    return x.reshape((Bx, NG, G * P) + tail)


def _from_groups(o, n_chunks, C, P, R):
    """Inverse of :func:`_to_groups` for the output: -> ``[Bx, n_chunks*C, ...]``."""
    Bx, tail = o.shape[0], o.shape[3:]
    o = o.reshape((Bx, -1, R * P) + tail)[:, :n_chunks, :C]
    return o.reshape((Bx, n_chunks * C) + tail)


def chunk_kda_reference(q, k, v, g, beta, scale=None, initial_state=None,
                        output_final_state=False, cu_seqlens=None, chunk_size=64,
                        return_chunk_states=False, state_dtype=None):
    """Chunked KDA (WY form over 16-token sub-chunks; the loop carries only the state).

    Returns ``(o, final_state)`` or ``(o, final_state, chunk_states)`` when
    ``return_chunk_states``. ``final_state`` is ``None`` unless ``output_final_state``.
    ``chunk_states`` is ``[B, num_chunks, H, K, V]`` fp32 (state after each chunk); with
    ``cu_seqlens`` it is ``[1, num_chunks_bound, H, K, V]`` in the chunk-aligned varlen layout
    (see :func:`varlen_chunk_offsets`; entries past the last used chunk are unspecified).
    Any ``chunk_size >= 1`` works. With ``state_dtype`` the state is rounded to it at the end of
    every chunk (what a cache of that dtype storing the state between chunk-sized steps would do).
    """
    state_dtype = None if state_dtype is None or jnp.dtype(state_dtype) == jnp.float32 else state_dtype
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = int(chunk_size)
    P, R, G = _sub_chunking(C)
    scale = _default_scale(scale, K)

    if cu_seqlens is None:
        NC = max(1, -(-T // C))
        G = min(G, R * NC)
        xs = [_to_groups(x, NC, C, P, R, G) for x in (q, k, v, g, beta)]
        S0 = (jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None
              else initial_state.astype(jnp.float32))
        o, S, cs = _scan_chunks(*xs, S0, scale, P=P, G=G, R=R,
                                want_states=return_chunk_states, state_dtype=state_dtype)
        o = _from_groups(o, NC, C, P, R)[:, :T]
        out = (o, S if output_final_state else None)
        if return_chunk_states:
            out = out + (cs.reshape((B, -1, H, K, V))[:, :NC],)
        return out

    # ---- varlen: chunk-aligned layout, state reset at each sequence's first chunk ----
    if B != 1:
        raise ValueError("cu_seqlens requires B == 1 (packed sequences)")
    N = cu_seqlens.shape[0] - 1
    lay = varlen_layout(cu_seqlens, T, C)
    NC = lay.chunk_seq.shape[0]
    G = min(G, R * NC)
    NG = -(-(NC * R) // G)
    xs = [_to_groups(pack_varlen(x[0], lay, C).reshape((1, NC * C) + x.shape[2:]),
                     NC, C, P, R, G)
          for x in (q, k, v, g, beta)]
    init = (jnp.zeros((N, H, K, V), jnp.float32) if initial_state is None
            else initial_state.astype(jnp.float32))
    sub_first = (lay.chunk_first[:, None] & (jnp.arange(R) == 0)[None, :]).reshape(-1)
    sub_seq = jnp.repeat(jnp.clip(lay.chunk_seq, 0, N - 1), R)
    first = jnp.pad(sub_first, (0, NG * G - NC * R)).reshape(NG, G)
    seq = jnp.pad(sub_seq, (0, NG * G - NC * R)).reshape(NG, G)
    S0 = jnp.zeros((1, H, K, V), jnp.float32)
    o, _, cs = _scan_chunks(*xs, S0, scale, P=P, G=G, R=R, resets=(first, seq, init),
                            want_states=True, state_dtype=state_dtype)
    o = _from_groups(o, NC, C, P, R)[0]                             # [NC*C, H, V]
    o = jnp.take(o, lay.dst, axis=0)[None]
    cs = cs.reshape((-1, H, K, V))[:NC]                             # [NC, H, K, V]
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
def pool_rows(slot_ids, num_slots):
    """``[B]`` bool: the rows of a pooled decode that name a slot of the pool (``0 <= id < S``); the
    others are padding. An id past the pool is padding too, not a clamp onto the last slot (that
    would overwrite another sequence's state, or on a GPU write past the pool)."""
    return (slot_ids >= 0) & (slot_ids < num_slots)


def fused_recurrent_kda_pool_reference(q, k, v, g, beta, state_pool, slot_ids, scale=None):
    """Decode ``T`` (usually 1) tokens for each of ``B`` sequences whose state is
    ``state_pool[slot_ids[b]]``. Returns ``(o [B,T,H,V], new_pool)``.

    Rows whose ``slot_ids[b]`` is outside ``[0, S)`` (``-1``: the usual padding id) are padding:
    they read nothing, write nothing, and their output is zero. Slots not named in ``slot_ids``
    are untouched. Duplicate valid slot ids in one call are undefined behaviour.
    """
    S_pool = state_pool.shape[0]
    slot_ids = slot_ids.astype(jnp.int32)
    valid = pool_rows(slot_ids, S_pool)
    S0 = jnp.take(state_pool, jnp.clip(slot_ids, 0, S_pool - 1), axis=0).astype(jnp.float32)
    o, S1 = naive_recurrent_kda(q, k, v, g, beta, scale, S0)
    o = jnp.where(valid[:, None, None, None], o, jnp.zeros_like(o))
    idx = jnp.where(valid, slot_ids, S_pool)   # padding -> dropped
    new_pool = state_pool.at[idx].set(S1.astype(state_pool.dtype), mode="drop")
    return o, new_pool
