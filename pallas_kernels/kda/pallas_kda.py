"""Pallas kernels for KDA: chunked prefill, recurrent decode, pooled decode.

One generic kernel scheme serves all three ops: a *segmented scan over blocks of C tokens*.
Tokens are laid out per head as ``[H, NB*C, D]`` (dense batches are flattened row after
row, varlen sequences are packed chunk-aligned, each sequence padded to a multiple of C with
g=0, beta=0, k=v=0, which leaves the state unchanged). Every block belongs to one *row*
(a batch element / sequence / decode request) whose state lives in ``states[state_idx]``;
``states`` ``[S, H, K, V]`` fp32 is aliased input->output (``input_output_aliases``), so
states that no row touches keep their value (empty sequences keep their initial state; pool
slots not named stay untouched).

The per-block math is one of:

* ``_chunk_math`` -- WY/UT chunked form on a ``C x C`` tile (C a power of two, default 64).
  Everything is 2-D matmuls, ``exp``, masks and reductions. Numerically safe for *any*
  ``g <= 0`` (K3's -5 lower bound over 64 tokens gives -320; Kimi-Linear's is unbounded):
  ``exp(Gamma_i - Gamma_j)`` is split at the lowest-common-ancestor split point ``r`` of
  ``i`` and ``j`` in a binary tree over the chunk, ``exp(Gamma_i - Gamma_r) *
  exp(Gamma_r - Gamma_j)``, both factors ``<= 1`` and each exponent computed directly as a
  masked *sum of g over a range* (one ``C x C @ C x K`` matmul per tree level), never as a
  difference of two large cumulative sums and never as ``exp(Gamma_i) * exp(-Gamma_j)``.
  The unit-lower-triangular inverse ``(I + A)^-1`` is built by recursive block doubling
  (``T <- T - T A_off T`` per level), which is blocked forward substitution: every
  intermediate is a sub-block of the exact inverse (no Neumann series cancellation).
* ``_recurrent_math`` -- the token-by-token delta rule over a block of C (default 8) tokens,
  unrolled, written with masked reductions only (no dynamic lane slicing).

Two pallas_call plumbings ("variants") drive the same math:

* ``"tpu"`` (Mosaic TPU; also the default under ``interpret=True`` on CPU): grid
  ``(H, V/block_v, NB)`` with the block axis last and ``arbitrary``; ``q/k/v/g/beta/o``
  tiles are pipelined per block, the state is carried in a VMEM scratch, per-block metadata
  (state index, first-block flag, mode) comes in through scalar prefetch
  (``PrefetchScalarGridSpec``) and drives the state ``BlockSpec`` index maps. Consecutive
  blocks of a row revisit the same state block, so it is written back once per row. Padded
  pool rows (slot < 0) are re-pointed at a neighbouring row's slot and do nothing.
* ``"gpu"`` (Pallas Triton lowering, the default ``pallas_call`` lowering on GPU in JAX
  0.10/0.11; Triton is deprecated in 0.11 and emits a warning; a Mosaic-GPU port is future
  work): grid ``(V/block_v, H, rows)`` (a head's V blocks side by side, sharing its operands in
  L2); each program loops over its row's blocks with
  ``lax.fori_loop`` (dynamic bounds) carrying the state in registers, reads its slot id as
  a regular int32 input and indexes the aliased state array directly (no scalar prefetch on
  Triton). Tiles must be powers of two (C, K, block_v). Compiled, the chunk kernel takes
  three-pass TF32 products and 16-token math tiles inside each chunk (``default_dot_precision``,
  ``default_block_c``), and has two more forms (``FORMS``) whose state-independent chunk terms
  are batched by XLA: ``"split"`` (the kernel does the four state products of each chunk) and
  ``"staged"`` (the kernel does the two products of the next state; all chunks' outputs are
  batched products after it).

Both variants are verified in interpret mode against the jnp reference. The GPU variant was
compiled and timed on an H200 (JAX 0.11.2, 2026-12-04: benchmarks/results/kernels-gpu.json);
the TPU variant has only been lowered (``jax.export``), never run on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda import reference as ref

_HI = lax.Precision.HIGHEST
_F32 = jnp.float32


# ----------------------------------------------------------------------------------------
# in-kernel math (pure functions on values)
# ----------------------------------------------------------------------------------------
# Precision of the chunk form's data products (the gate sums that feed exp() are IEEE fp32 under
# "highest", otherwise one TF32 pass on each of g's two TF32 halves): "highest" = IEEE fp32 (CUDA
# cores on GPU), "tf32x3" = three TF32 tensor-core passes (hi*hi + hi*lo + lo*hi, ~fp32 accuracy),
# "tf32" = one TF32 pass (~1e-3 relative), "bf16" = both operands rounded to bf16, fp32
# accumulation (fla's production inputs; ~1e-2 relative).
DOT_PRECISIONS = ("highest", "tf32x3", "tf32", "bf16")
# How the GPU chunk kernel is organised: "fused" = one kernel doing each chunk's whole WY form
# in the state's loop; "split" = the state-independent terms of every chunk computed at once by
# XLA (batched), the kernel doing only the four state products per chunk; "staged" = as "split", but
# the kernel does only the two products the next state needs, recording each chunk's start state and
# new values, and every chunk's output is then one batched product outside it (fla's organisation).
FORMS = ("fused", "split", "staged")
# Where the split forms' chunk terms are computed: "xla" = batched XLA ops (``_split_prep``);
# "pallas" = three Pallas kernels building them from 16-token tiles on chip (``_call_gpu_prep``: pairs,
# triangular solve, columns), which never write the gate-sum factors to memory.
PREPS = ("xla", "pallas")
_PRESET = {"tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
           "tf32": lax.DotAlgorithmPreset.TF32_TF32_F32}


def _to_tf32(x):
    """Round fp32 to TF32 (10 explicit mantissa bits, nearest) -- the interpret-mode stand-in for
    the tensor cores' input conversion, which XLA:CPU's dot does not offer."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return lax.bitcast_convert_type((bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000), _F32)


def _dot(a, b, dims, prec="highest", emulate=False):
    if prec == "highest":
        return lax.dot_general(a, b, dims, precision=_HI, preferred_element_type=_F32)
    if prec == "bf16":   # exact products of bf16 values, fp32 sums: the same on CPU and tensor cores
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        if emulate:
            a, b = a.astype(_F32), b.astype(_F32)
        return lax.dot_general(a, b, dims, precision=_HI if emulate else None, preferred_element_type=_F32)
    if not emulate:
        return lax.dot_general(a, b, dims, precision=_PRESET[prec], preferred_element_type=_F32)
    hi = lambda x, y: lax.dot_general(x, y, dims, precision=_HI, preferred_element_type=_F32)
    a1, b1 = _to_tf32(a), _to_tf32(b)
    if prec == "tf32":
        return hi(a1, b1)
    a2, b2 = _to_tf32(a - a1), _to_tf32(b - b1)
    return hi(a1, b1) + (hi(a1, b2) + hi(a2, b1))


def _mm(a, b, prec="highest", emulate=False):
    """[m,k] @ [k,n], fp32 accumulation."""
    return _dot(a, b, (((1,), (0,)), ((), ())), prec, emulate)


def _mm_nt(a, b, prec="highest", emulate=False):
    """[m,k] @ [n,k]^T, fp32 accumulation."""
    return _dot(a, b, (((1,), (1,)), ((), ())), prec, emulate)


def default_dot_precision(variant, interpret):
    """"tf32x3" for the compiled GPU (Triton) kernel, else "highest". Triton lowers an IEEE fp32
    dot to an unrolled FMA loop (64x64x128 is 8192 FMAs per thread per product): on an H200
    (JAX 0.11.2, Triton lowering) the all-IEEE chunk kernel had not finished compiling after 5
    minutes. Three TF32 passes run on tensor cores at about fp32 accuracy."""
    return "tf32x3" if variant == "gpu" and not interpret else "highest"


def default_block_c(C, interpret):
    """Tokens per math tile of the GPU chunk kernel: 16 compiled, C (one tile) interpreted. Each
    C-token chunk runs as C / block_c WY tiles back to back (the same recurrence, exactly; chunk
    states stay every C tokens). On an H200 (tf32x3, H=96, T=8192): C=64 in one tile needs 288 KiB
    of shared memory (227 KiB available) and does not launch; tiles of 32 took 100 ms, 16 took
    41 ms, 8 took 46 ms (register pressure of the [C, K] fp32 tiles)."""
    return C if interpret else min(C, 16)


def _tree_levels(C):
    s = 1
    while s < C:
        yield s
        s *= 2


def _gate_sums(g, prec="highest", emulate=False):
    """``m -> m @ g`` for 0/1 masks ``m`` [., C] over a tile's gates g [C, K]: IEEE fp32 under
    "highest", otherwise g split into two TF32 halves, each multiplied in one TF32 pass (the masks are
    exact in TF32, so this is three-pass TF32 without its zero third pass: ~2^-22 relative per term,
    as close as an fp32 sum gets), and no IEEE dot is left for Triton to unroll into FMA loops. Two
    passes instead of three also cut the compiled kernel's register spills (offline sm_90 compile:
    1432 -> 1208 bytes a thread at 4 warps)."""
    if prec == "highest":
        return lambda m: _mm(m, g, "highest", emulate)
    g_hi = _to_tf32(g)
    g_lo = g - g_hi
    return lambda m: _mm(m, g_hi, "tf32", emulate) + _mm(m, g_lo, "tf32", emulate)


def _tile_wy(q, k, beta, gsum, prec="highest", emulate=False):
    """A_qk [C,C] (lower incl. diagonal) and (I + A)^-1 [C,C], A = Diag(beta) strict_lower(A_kk), of one
    tile: q, k [C,K], beta [C,1], ``gsum`` its ``_gate_sums``. ``exp(Gamma_i - Gamma_j)`` is split at
    the lowest-common-ancestor split point of i and j in a binary tree over the tile into two factors
    <= 1, each exponent a masked sum of g; the inverse by recursive block doubling."""
    C = q.shape[0]
    mm = functools.partial(_mm, prec=prec, emulate=emulate)
    mm_nt = functools.partial(_mm_nt, prec=prec, emulate=emulate)
    row = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    zero = jnp.zeros((C, C), _F32)

    # pair masks per tree level: i in the 2nd half, j in the 1st half of the same 2s-block
    # (iotas are non-negative and s a power of two: shifts instead of // and %, which
    # lower through `sign` on Mosaic)
    pairs = []
    for s in _tree_levels(C):
        lg = s.bit_length() - 1
        same = (row >> (lg + 1)) == (col >> (lg + 1))
        pairs.append((s, same & (((row >> lg) & 1) == 1) & (((col >> lg) & 1) == 0)))

    Akk = zero
    Aqk = zero
    for s, pair in pairs:
        lg = s.bit_length() - 1
        ref_r = ((row >> (lg + 1)) << (lg + 1)) + (s - 1)     # split point of row i's block
        second = ((row >> lg) & 1) == 1
        rng = jnp.where(second, (col > ref_r) & (col <= row), (col > row) & (col <= ref_r))
        F = jnp.exp(gsum(rng.astype(_F32)))                    # exponent = sum of g <= 0
        kF = k * F
        Akk = Akk + jnp.where(pair, mm_nt(kF, kF), zero)
        Aqk = Aqk + jnp.where(pair, mm_nt(q * F, kF), zero)
    Aqk = Aqk + jnp.where(row == col, jnp.sum(q * k, axis=1, keepdims=True), zero)

    # (I + A)^-1 with A = Diag(beta) * strict_lower(Akk), by recursive block doubling
    A = jnp.where(row > col, Akk * beta, zero)
    Tinv = jnp.where(row == col, 1.0, zero)
    for _, pair in pairs:
        Tinv = Tinv - mm(mm(Tinv, jnp.where(pair, A, zero)), Tinv)
    return Aqk, Tinv


def _prefix_masks(C):
    """0/1 [C,C] masks: inclusive prefix (j <= i) and exclusive suffix (j > i) -- with ``_gate_sums``
    the sums of g over [0, i] and (i, C)."""
    row = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    return jnp.where(row >= col, 1.0, 0.0).astype(_F32), jnp.where(col > row, 1.0, 0.0).astype(_F32)


def _chunk_prep(q, k, v, g, beta, prec="highest", emulate=False):
    """The state-independent part of one chunk of the WY form: q,k,g [C,K]; v [C,Vb]; beta [C,1].
    Returns W [C,K], U [C,Vb], Q = q*exp(Gamma) [C,K], Aqk [C,C] (lower incl. diagonal),
    Kd = k*exp(Gamma_C - Gamma) [C,K] and the chunk decay exp(Gamma_C) as [K,1].
    `prec` applies to the data products; the gate sums: ``_gate_sums``."""
    Aqk, Tinv = _tile_wy(q, k, beta, _gate_sums(g, prec, emulate), prec, emulate)
    W, U, Q, Kd, decay = _chunk_columns(q, k, v, g, beta, Tinv, prec, emulate)
    return W, U, Q, Aqk, Kd, decay


def _chunk_columns(q, k, v, g, beta, Tinv, prec="highest", emulate=False):
    """A chunk's terms that follow from its triangular inverse Tinv = (I + A)^-1 [C,C]: W [C,K],
    U [C,Vb], Q [C,K], Kd [C,K], decay [K,1] (see ``_chunk_prep``). The gate acts per channel, so q,
    k, g may be any block of K columns and v of V columns: each term's columns need only their own."""
    mm = functools.partial(_mm, prec=prec, emulate=emulate)
    gsum = _gate_sums(g, prec, emulate)
    incl, excl_suffix = _prefix_masks(q.shape[0])
    eG = jnp.exp(gsum(incl))                                     # exp(Gamma_i), inclusive
    W = mm(Tinv, beta * (k * eG))
    U = mm(Tinv, beta * v)
    kd = k * jnp.exp(gsum(excl_suffix))                          # exp(Gamma_C - Gamma_j)
    decay = jnp.exp(jnp.sum(g.T, axis=1, keepdims=True))         # [K,1] = exp(Gamma_C)
    return W, U, q * eG, kd, decay


def _pair_row(ld, put, i, n, prec="highest", emulate=False):
    """Row tile i (static or traced) of one chunk's pair terms, the chunk cut into n tiles of P tokens:
    ``put(name, j, x)`` receives block (i, j) of "Aqk" ([P, P], A_qk lower incl. diagonal) and of "A"
    (Diag(beta_i) A_kk,ij below the diagonal; at (i, i) the tile's own inverse (I + A_ii)^-1, what
    ``_block_solve`` starts from), and zeros for j > i. ``ld(name, t)`` -> tile t of "q" (scaled),
    "k", "g" [P, K] fp32 or "beta" [P, 1], loaded when called. Nothing larger than [P, K] is formed.

    Within the tile: ``_tile_wy``. A pair (a in tile i, b in tile j < i) decays by the sum of g over
    (b, a] = (b, end of tile j] + the tiles strictly between + (start of tile i, a]: two factors <= 1
    from direct sums, as in the tree. The tiles left of i run in a loop from i - 1 down, carrying the
    sum of g over the tiles passed."""
    mm_nt = functools.partial(_mm_nt, prec=prec, emulate=emulate)
    gsum = lambda t: _gate_sums(ld("g", t), prec, emulate)
    incl, excl_suffix = _prefix_masks(ld("g", 0).shape[0])
    beta = ld("beta", i)
    aqk, own_inverse = _tile_wy(ld("q", i), ld("k", i), beta, gsum(i), prec, emulate)
    put("Aqk", i, aqk)
    put("A", i, own_inverse)
    pre = gsum(i)(incl)                                          # sum of g over (start of tile i, a]

    def left(t, between):                                        # tile j = i - 1 - t
        j = i - 1 - t
        R = jnp.exp(pre + between)                               # rows a of tile i
        kL = ld("k", j) * jnp.exp(gsum(j)(excl_suffix))          # columns b of tile j: (b, end of tile j]
        put("A", j, beta * mm_nt(ld("k", i) * R, kL))
        put("Aqk", j, mm_nt(ld("q", i) * R, kL))
        return between + jnp.sum(ld("g", j), axis=0, keepdims=True)

    def right(j, carry):
        zero = jnp.zeros((beta.shape[0],) * 2, _F32)
        put("A", j, zero)
        put("Aqk", j, zero)
        return carry

    lax.fori_loop(0, i, left, jnp.zeros((1, pre.shape[1]), _F32))
    lax.fori_loop(i + 1, n, right, 0)


def _block_solve(get, put, n, prec="highest", emulate=False):
    """(I + A)^-1 of a chunk of n tiles by block forward substitution, from ``get(i, j)`` -> block
    (i, j) of ``_pair_row``'s "A" (j <= i): X_ii = the tile's own inverse, X_ij = -X_ii
    sum_{j <= m < i} A_im X_mj. ``put(i, j, x)`` receives every block, zeros above the diagonal."""
    mm = functools.partial(_mm, prec=prec, emulate=emulate)
    add = lambda xs: functools.reduce(jnp.add, xs)
    X = {}
    for i in range(n):
        X[i, i] = get(i, i)
        for j in range(i):
            X[i, j] = -mm(X[i, i], add([mm(get(i, m), X[m, j]) for m in range(j, i)]))
        for j in range(n):
            put(i, j, X[i, j] if j <= i else jnp.zeros_like(X[i, i]))


def _chunk_apply(S, W, U, Q, Aqk, Kd, decay, prec="highest", emulate=False):
    """The state-dependent part of one chunk: S [K,Vb] -> (S', o [C,Vb]); four products. With Q and
    Aqk None, only the two products the next state needs: -> (S', Vn [C,Vb]), the chunk's new values
    ``U - W S``, from which the staged form computes o outside the recurrence (``_staged_output``).

    Each term may also be a function returning it, called where the term is first used: a kernel
    then loads each [C, K] operand right before its product instead of all of them at once. With
    S a tuple of K-blocks ``[K/n, Vb]`` (returned the same way), W, Q, Kd and decay are functions
    of the block index i returning block i (columns of W, Q, Kd ``[C, K/n]``; rows of decay): every
    product then contracts or produces K/n rows. Both keep the GPU split form's live values small
    (its [64, 128] fp32 operands held together overflow a thread's registers; see
    benchmarks/results/triton-resources.json)."""
    mm = functools.partial(_mm, prec=prec, emulate=emulate)
    get = lambda x: x() if callable(x) else x
    blocked = isinstance(S, tuple)
    Ss = S if blocked else (S,)
    part = (lambda x, i: x(i)) if blocked else (lambda x, i: get(x))
    add = lambda xs: functools.reduce(jnp.add, xs)
    Vn = get(U) - add([mm(part(W, i), s) for i, s in enumerate(Ss)])
    o = Vn if Q is None else add([mm(part(Q, i), s) for i, s in enumerate(Ss)]) + mm(get(Aqk), Vn)
    Ss = tuple(part(decay, i) * s + mm(part(Kd, i).T, Vn) for i, s in enumerate(Ss))
    return (Ss if blocked else Ss[0]), o


def _chunk_math(S, q, k, v, g, beta, prec="highest", emulate=False):
    """One chunk of the WY form. S [K,Vb]; q,k,g [C,K]; v [C,Vb]; beta [C,1]."""
    return _chunk_apply(S, *_chunk_prep(q, k, v, g, beta, prec, emulate), prec, emulate)


def _recurrent_math(S, q, k, v, g, beta, state_dtype=None):
    """Token-by-token over a block. S [K,Vb]; q,k,g [C,K]; v [C,Vb]; beta [C,1]. With
    `state_dtype`, S is rounded to it after every token (a cache storing it in that dtype)."""
    C, K = q.shape
    Vb = v.shape[1]
    qT, kT, gT = q.T, k.T, g.T                                  # [K, C]
    colK = lax.broadcasted_iota(jnp.int32, (K, C), 1)
    rowV = lax.broadcasted_iota(jnp.int32, (C, Vb), 0)
    rowB = lax.broadcasted_iota(jnp.int32, (C, 1), 0)
    o = jnp.zeros((C, Vb), _F32)
    for t in range(C):
        selK = colK == t
        gt = jnp.sum(jnp.where(selK, gT, 0.0), axis=1, keepdims=True)      # [K,1]
        kt = jnp.sum(jnp.where(selK, kT, 0.0), axis=1, keepdims=True)
        qt = jnp.sum(jnp.where(selK, qT, 0.0), axis=1, keepdims=True)
        vt = jnp.sum(jnp.where(rowV == t, v, 0.0), axis=0, keepdims=True)   # [1,Vb]
        bt = jnp.sum(jnp.where(rowB == t, beta, 0.0), axis=0, keepdims=True)  # [1,1]
        S = S * jnp.exp(gt)
        kS = jnp.sum(kt * S, axis=0, keepdims=True)
        S = S + kt * (bt * (vt - kS))
        ot = jnp.sum(qt * S, axis=0, keepdims=True)
        S = ref.round_state(S, state_dtype)
        o = o + jnp.where(rowV == t, ot, 0.0)
    return S, o


_MATH = {"chunk": _chunk_math, "recurrent": _recurrent_math}


def _rounded(math, state_dtype, S, *xs):
    """A block's math with the state it leaves rounded to `state_dtype` (None: unchanged)."""
    S, o = math(S, *xs)
    return ref.round_state(S, state_dtype), o


# ----------------------------------------------------------------------------------------
# pallas_call plumbing
# ----------------------------------------------------------------------------------------
def _call_tpu(math, q, k, v, g, beta, states, meta, *, C, block_v, chunk_states, interpret):
    H, TT, K = q.shape
    V = v.shape[-1]
    NB = TT // C
    nV = V // block_v
    st, first, mode = meta

    def kernel(st_ref, first_ref, mode_ref, q_ref, k_ref, v_ref, g_ref, b_ref, s_in_ref,
               o_ref, s_out_ref, *rest):
        cs_ref, s_scr = (rest[0], rest[1]) if chunk_states else (None, rest[0])
        c = pl.program_id(2)
        md = mode_ref[c]

        @pl.when((md == 1) & (first_ref[c] == 1))
        def _():
            s_scr[...] = s_in_ref[...]

        @pl.when(md == 1)
        def _():
            S, o = math(s_scr[...], q_ref[...], k_ref[...], v_ref[...], g_ref[...],
                        b_ref[...])
            s_scr[...] = S
            s_out_ref[...] = S
            o_ref[...] = o.astype(o_ref.dtype)
            if cs_ref is not None:
                cs_ref[...] = S

        @pl.when(md != 1)
        def _():
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
            if cs_ref is not None:
                cs_ref[...] = jnp.zeros(cs_ref.shape, cs_ref.dtype)

        @pl.when(md == 2)
        def _():
            s_out_ref[...] = s_in_ref[...]

    tok = lambda D: pl.BlockSpec((None, C, D), lambda h, j, c, *_: (h, c, 0))
    vtok = pl.BlockSpec((None, C, block_v), lambda h, j, c, *_: (h, c, j))
    sspec = pl.BlockSpec((None, None, K, block_v),
                         lambda h, j, c, st_ref, *_: (st_ref[c], h, 0, j))
    out_shape = [jax.ShapeDtypeStruct((H, TT, V), _F32),
                 jax.ShapeDtypeStruct(states.shape, _F32)]
    out_specs = [vtok, sspec]
    if chunk_states:
        out_shape.append(jax.ShapeDtypeStruct((NB, H, K, V), _F32))
        out_specs.append(pl.BlockSpec((None, None, K, block_v),
                                      lambda h, j, c, *_: (c, h, 0, j)))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(H, nV, NB),
        in_specs=[tok(K), tok(K), vtok, tok(K), tok(1), sspec],
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((K, block_v), _F32)],
    )
    return pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid_spec=grid_spec,
        input_output_aliases={3 + 5: 1},          # states (after 3 scalar-prefetch args)
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="kda_scan_tpu",
    )(st, first, mode, q, k, v, g, beta, states)


def triton_available() -> bool:
    """Whether this JAX still ships the Pallas Triton lowering (deprecated in 0.11)."""
    try:
        from jax.experimental.pallas import triton as pltriton  # noqa: F401
    except ImportError:
        return False
    return True


# Warps per GPU program (Triton) when the caller does not choose: the state tile [K, block_v] is
# spread over them. Swept by the device script (``kda_decode_pool_sweep_*``).
NUM_WARPS = 4


def check_num_warps(num_warps):
    """``num_warps`` (None: ``NUM_WARPS``) -> an int, a power of two from 1 to 16."""
    nw = NUM_WARPS if num_warps is None else num_warps
    if not isinstance(nw, int) or nw < 1 or nw > 16 or nw & (nw - 1):
        raise ValueError(f"num_warps={num_warps!r} must be a power of two from 1 to 16")
    return nw


def check_num_stages(num_stages):
    """``num_stages`` (None: 1) -> an int from 1 to 4: Triton's software pipelining of the loads in a
    program's chunk loop (the operands of chunk c + 1 fetched into shared memory while chunk c runs;
    each stage holds a copy of them)."""
    ns = 1 if num_stages is None else num_stages
    if not isinstance(ns, int) or not 1 <= ns <= 4:
        raise ValueError(f"num_stages={num_stages!r} must be an int from 1 to 4")
    return ns


def _triton_params(num_warps=NUM_WARPS, num_stages=1):
    """Select the Pallas Triton lowering explicitly (JAX >= 0.10 defaults to Mosaic GPU,
    which stages every block in shared memory -- wrong for this whole-row kernel)."""
    from jax.experimental.pallas import triton as pltriton
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _call_gpu(math, q, k, v, g, beta, states, rows, *, C, block_v, chunk_states, interpret,
              block_c=None, num_warps=NUM_WARPS, num_stages=1, token_major=False, scale=None,
              out_dtype=_F32):
    """The fused chunk / recurrent kernel on the GPU variant. Operands head-major [H, TT, D] fp32
    (scaled q), or with ``token_major`` the caller's [TT, H, D] in its dtype: then q is scaled by
    ``scale`` and every operand widened to fp32 in the kernel, o comes back [TT, H, V] in
    ``out_dtype``, and the step needs no XLA transposes or casts around the kernel."""
    TT = q.shape[0] if token_major else q.shape[1]
    bc = C if block_c is None else block_c      # math tile; chunk states stay every C tokens
    if C % bc or bc & (bc - 1):
        raise ValueError(f"block_c={bc} must be a power of two dividing the chunk size {C}")
    sub = C // bc

    def chunk(c, S, ins, o_ref):                  # one chunk of C tokens = C / bc math tiles
        def tile(i, S):
            sl = pl.ds(pl.multiple_of(i * bc, bc), bc)
            xs = [x[sl, :].astype(_F32) for x in ins]
            if scale is not None:
                xs[0] = xs[0] * scale
            S, o = math(S, *xs)
            o_ref[sl, :] = o.astype(o_ref.dtype)
            return S

        return tile(c, S) if sub == 1 else lax.fori_loop(c * sub, (c + 1) * sub, tile, S)

    return _gpu_rows_call(chunk, "kda_scan_gpu", (q, k, v, g, beta), ("K", "K", "V", "K", 1), states, rows,
                          block_v=block_v, num_chunks=TT // C if chunk_states else 0, interpret=interpret,
                          num_warps=num_warps, num_stages=num_stages, token_major=token_major,
                          out_dtype=out_dtype, zero_rows=C)


def _gpu_rows_call(chunk, name, operands, widths, states, rows, *, block_v, num_chunks, interpret,
                   num_warps=NUM_WARPS, block_k=None, state_before=False, num_stages=1,
                   token_major=False, out_dtype=_F32, zero_rows=None):
    """The GPU variant: grid (V / block_v, H, rows). Each program runs row r's chunks
    ``rs[r] <= c < re[r]`` through ``chunk(c, S, in_refs, o_ref) -> S`` (S [K, block_v] fp32, in
    registers), starting from and writing back ``states[slot[r]]`` (rows with valid 0 do nothing).
    Inputs: the 4 row-metadata vectors, ``operands`` [H, n, width] as whole rows per head (width
    "V": this program's V block; "K" or an int: all of it), the state array (aliased to output 1).
    Outputs: o [H, TT, V] (TT = the first operand's n, V = the states'), the states, and with
    ``num_chunks`` > 0 the state after every chunk [num_chunks, H, K, V] (with ``state_before``: the
    state each chunk starts from). ``num_warps``: per program; ``num_stages``: ``check_num_stages``.
    ``block_k`` < K: S is carried as a tuple of K / block_k blocks [block_k, block_v], each read and
    written as its own rows of the state (a value cannot be sliced or joined along K in Triton).
    ``token_major``: operands and o laid out [n, H, width] instead (the same [n, width] refs in the
    kernel, strided). ``out_dtype``: o's. ``zero_rows`` = C: rows with valid 0 write zeros to their
    chunks' C-token slices of o (else they leave o unwritten)."""
    shape = operands[0].shape
    TT, H, K = shape if token_major else (shape[1], shape[0], shape[2])
    bk = K if block_k is None else block_k
    nk = K // bk

    def read(ref, i):
        S = tuple(ref[i, pl.ds(b * bk, bk), :] for b in range(nk))
        return S if nk > 1 else S[0]

    def write(ref, i, S):
        for b, s in enumerate(S if nk > 1 else (S,)):
            ref[i, pl.ds(b * bk, bk), :] = s

    S_n, V = states.shape[0], states.shape[-1]
    R = rows[0].shape[0]
    n_in = len(operands)

    def kernel(rs_ref, re_ref, st_ref, va_ref, *refs):
        ins, s_in_ref = refs[:n_in], refs[n_in]
        o_ref, s_out_ref = refs[n_in + 1], refs[n_in + 2]
        cs_ref = refs[n_in + 3] if num_chunks else None
        r = pl.program_id(2)
        slot = st_ref[r]

        if zero_rows:
            @pl.when(va_ref[r] != 1)
            def _():
                def zero(c, carry):
                    o_ref[pl.ds(pl.multiple_of(c * zero_rows, zero_rows), zero_rows), :] = jnp.zeros(
                        (zero_rows, block_v), o_ref.dtype)
                    return carry

                lax.fori_loop(rs_ref[r], re_ref[r], zero, 0)

        @pl.when(va_ref[r] == 1)
        def _():
            def body(c, S):
                if cs_ref is not None and state_before:
                    write(cs_ref, c, S)
                S = chunk(c, S, ins, o_ref)
                if cs_ref is not None and not state_before:
                    write(cs_ref, c, S)
                return S

            write(s_out_ref, slot, lax.fori_loop(rs_ref[r], re_ref[r], body, read(s_in_ref, slot)))

    # grid (V / block_v, H, rows): the V blocks of one head are neighbouring programs, which the GPU
    # runs at the same time, so the [n, K] operands they all read come from L2 once fetched
    def tok(width, n=TT):
        w = block_v if width == "V" else K if width == "K" else width
        col = (lambda j: j) if width == "V" else (lambda j: 0)
        if token_major:
            return pl.BlockSpec((n, None, w), lambda j, h, r: (0, h, col(j)))
        return pl.BlockSpec((None, n, w), lambda j, h, r: (h, 0, col(j)))

    sspec = pl.BlockSpec((S_n, None, K, block_v), lambda j, h, r: (0, h, 0, j))
    o_shape = (TT, H, V) if token_major else (H, TT, V)
    out_shape = [jax.ShapeDtypeStruct(o_shape, out_dtype), jax.ShapeDtypeStruct(states.shape, _F32)]
    out_specs = [tok("V"), sspec]
    if num_chunks:
        out_shape.append(jax.ShapeDtypeStruct((num_chunks, H, K, V), _F32))
        out_specs.append(pl.BlockSpec((num_chunks, None, K, block_v), lambda j, h, r: (0, h, 0, j)))
    return pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(V // block_v, H, R),
        in_specs=[pl.BlockSpec((R,), lambda j, h, r: (0,))] * 4
        + [tok(w, x.shape[0 if token_major else 1]) for w, x in zip(widths, operands)] + [sspec],
        out_specs=out_specs,
        input_output_aliases={4 + n_in: 1},
        compiler_params=None if interpret else _triton_params(num_warps, num_stages),
        interpret=interpret,
        name=name,
    )(*rows, *operands, states)


def default_split_tiles(K, V, form="split"):
    """``(block_k, block_v)`` of the split and staged forms' programs: the state in 64-row K-blocks;
    16 value columns a program for "split", 32 for "staged". Compiled offline by Triton for sm_90 with
    tf32x3 products and 4 warps (benchmarks/results/triton-resources.json): the split kernel spills
    520 bytes a thread at whole-K products and 32 columns, 312 with 64-row blocks, none with 64-row
    blocks and 16 columns (768 programs at H = 96). The staged kernel holds less (two products a
    chunk) and spills nothing at 32 columns (223 registers; 201 at 16): 384 programs at H = 96, which
    at two resident programs an SM (register-bound) are 2 waves on 132 SMs where 16 columns are 3.
    Not yet timed on hardware."""
    return min(K, 64), min(V, 32 if form == "staged" else 16)


def _call_gpu_split(prep, states, rows, *, C, block_v, chunk_states, interpret, prec,
                    state_dtype, num_warps=NUM_WARPS, block_k=None, staged=False, num_stages=1):
    """The "split" form's recurrence (GPU plumbing): ``prep`` = (W, U, Q, Aqk, Kd, decay) laid out
    [H, NB*C, K|V|C] and decay [H, NB*K, 1], computed for every chunk at once outside the kernel
    (``_split_prep``); each program walks its row's chunks doing only the four state products, on
    the state in K-blocks of ``block_k`` rows (``default_split_tiles``), each operand loaded where used.

    ``staged`` (the "staged" form): the loop does only the two products the next state needs, writing
    each chunk's new values Vn (in o's place) and the state it starts from; the outputs of all chunks
    are then batched products outside the kernel (``_staged_output``)."""
    H, TT, K = prep[0].shape
    bk = default_split_tiles(K, states.shape[-1])[0] if block_k is None else block_k  # same for both forms
    if K % bk or bk & (bk - 1):
        raise ValueError(f"block_k={bk} must be a power of two dividing K={K}")
    apply = functools.partial(_chunk_apply, prec=prec, emulate=interpret)
    operands, widths = prep, ("K", "V", "K", C, "K", 1)
    if staged:
        operands, widths = prep[:2] + prep[4:], widths[:2] + widths[4:]

    def chunk(c, S, ins, o_ref):
        sl = pl.ds(pl.multiple_of(c * C, C), C)
        if staged:
            w_ref, u_ref, kd_ref, d_ref = ins
            q_ref = a_ref = None
        else:
            w_ref, u_ref, q_ref, a_ref, kd_ref, d_ref = ins
        d0 = pl.multiple_of(c * K, K)
        if bk == K:
            load = lambda ref, rows=sl: None if ref is None else (lambda: ref[rows, :])
            W, Q, Kd, decay = load(w_ref), load(q_ref), load(kd_ref), load(d_ref, pl.ds(d0, K))
        else:                           # block i: columns i*bk.. of W, Q, Kd; rows of decay
            cols = lambda ref: None if ref is None else (lambda i: ref[sl, pl.ds(i * bk, bk)])
            W, Q, Kd = cols(w_ref), cols(q_ref), cols(kd_ref)
            decay = lambda i: d_ref[pl.ds(d0 + i * bk, bk), :]
        S, o = apply(S, W, lambda: u_ref[sl, :], Q, None if a_ref is None else (lambda: a_ref[sl, :]), Kd, decay)
        o_ref[sl, :] = o.astype(o_ref.dtype)
        return jax.tree.map(lambda s: ref.round_state(s, state_dtype), S)

    name = "kda_chunk_staged_gpu" if staged else "kda_chunk_split_gpu"
    return _gpu_rows_call(chunk, name, operands, widths, states, rows, block_v=block_v,
                          num_chunks=TT // C if chunk_states or staged else 0, interpret=interpret,
                          num_warps=num_warps, block_k=bk, state_before=staged, num_stages=num_stages)


PREP_TILE = 16   # tokens per tile of the split forms' pair kernel (``_call_gpu_prep``)
PREP_COLS = 32   # K columns per program of their column kernel


def prep_col_blocks(K, V, cols=None):
    """Programs per (chunk, head) of the prep's column kernel: K in blocks of ``cols`` (default
    ``PREP_COLS``) columns, V in as many blocks; one block where the widths do not divide."""
    bk = min(K, cols or PREP_COLS)
    n = K // bk if K % bk == 0 else 1
    return n if V % n == 0 else 1


def _call_gpu_prep(q, k, v, g, beta, *, C, scale, prec, interpret, num_warps=NUM_WARPS, cols=None):
    """The split forms' chunk terms as three Pallas kernels instead of XLA's batched prep (which
    materialises every gate-sum factor, [chunks, 8 C, K] fp32, in memory), organised as fla's are:

    1. pairs, one program per (chunk, head, ``PREP_TILE``-token row tile): the row's blocks of A_qk
       and of Diag(beta) A_kk, with the tile's own triangular inverse on the diagonal (``_pair_row``);
    2. solve, one program per (chunk, head): (I + A)^-1 [C, C] from those blocks (``_block_solve``);
    3. columns, one program per (chunk, head, K-block of ``cols``): W, Q, Kd and the decay of its K
       columns and U of as many V columns, from the inverse (``_chunk_columns``; the gate acts per
       channel, so a column block needs no other).
    Each program's live values stay small: one kernel doing all of it spilled ~1.6 KB a thread at
    sm_90 (benchmarks/results/triton-resources.json). Inputs token-major [NB*C, H, D] in the
    caller's dtype (beta [NB*C, H, 1]; q scaled and all widened in the kernels); outputs the layouts
    ``_call_gpu_split`` reads, as ``_split_prep``."""
    TT, H, K = q.shape
    V = v.shape[-1]
    NB, P = TT // C, min(PREP_TILE, C)
    n = C // P
    params = None if interpret else _triton_params(num_warps)
    shape = lambda w, n=TT: jax.ShapeDtypeStruct((H, n, w), _F32)
    block = lambda ref, i, j: ref.at[pl.ds(i * P, P), pl.ds(j * P, P)]

    def pairs(q_ref, k_ref, g_ref, b_ref, aqk_ref, a_ref):
        i = pl.program_id(2)
        refs = dict(q=q_ref, k=k_ref, g=g_ref, beta=b_ref)
        outs = dict(Aqk=aqk_ref, A=a_ref)

        def ld(name, t):
            x = refs[name][pl.ds(t * P, P), :].astype(_F32)
            return x * scale if name == "q" else x

        def put(name, j, x):
            block(outs[name], 0, j)[...] = x

        _pair_row(ld, put, i, n, prec, interpret)

    tok = lambda w: pl.BlockSpec((C, None, w), lambda c, h, i: (c, h, 0))
    rows = pl.BlockSpec((None, P, C), lambda c, h, i: (h, c * n + i, 0))
    Aqk, A = pl.pallas_call(
        pairs, out_shape=(shape(C), shape(C)), grid=(NB, H, n),
        in_specs=[tok(K), tok(K), tok(K), tok(1)], out_specs=(rows, rows),
        compiler_params=params, interpret=interpret, name="kda_chunk_prep_pairs_gpu",
    )(q, k, g, beta)

    def solve(a_ref, t_ref):
        def put(i, j, x):
            block(t_ref, i, j)[...] = x

        _block_solve(lambda i, j: block(a_ref, i, j)[...], put, n, prec, interpret)

    chunk = pl.BlockSpec((None, C, C), lambda c, h: (h, c, 0))
    Tinv = pl.pallas_call(
        solve, out_shape=shape(C), grid=(NB, H), in_specs=[chunk], out_specs=chunk,
        compiler_params=params, interpret=interpret, name="kda_chunk_prep_solve_gpu",
    )(A)

    nc = prep_col_blocks(K, V, cols)
    bk, bv = K // nc, V // nc

    def columns(q_ref, k_ref, v_ref, g_ref, b_ref, t_ref, w_ref, u_ref, qo_ref, kd_ref, d_ref):
        f32 = lambda ref: ref[...].astype(_F32)
        W, U, Q, Kd, decay = _chunk_columns(f32(q_ref) * scale, f32(k_ref), f32(v_ref), f32(g_ref), f32(b_ref),
                                            t_ref[...], prec, interpret)
        w_ref[...], u_ref[...], qo_ref[...], kd_ref[...], d_ref[...] = W, U, Q, Kd, decay

    tok = lambda w: pl.BlockSpec((C, None, w), lambda c, h, b: (c, h, b))
    head = lambda w: pl.BlockSpec((None, C, w), lambda c, h, b: (h, c, b))
    W, U, Q, Kd, decay = pl.pallas_call(
        columns, out_shape=(shape(K), shape(V), shape(K), shape(K), shape(1, NB * K)), grid=(NB, H, nc),
        in_specs=[tok(bk), tok(bk), tok(bv), tok(bk), pl.BlockSpec((C, None, 1), lambda c, h, b: (c, h, 0)),
                  pl.BlockSpec((None, C, C), lambda c, h, b: (h, c, 0))],
        out_specs=(head(bk), head(bv), head(bk), head(bk),
                   pl.BlockSpec((None, bk, 1), lambda c, h, b: (h, c * nc + b, 0))),
        compiler_params=params, interpret=interpret, name="kda_chunk_prep_columns_gpu",
    )(q, k, v, g, beta, Tinv)
    return W, U, Q, Aqk, Kd, decay


def _staged_output(Q, Aqk, Vn, h, *, C, prec, emulate):
    """The staged form's outputs, every chunk at once: o_c = Q_c h_c + Aqk_c Vn_c (h_c: the state
    chunk c starts from). Q [H, NB*C, K], Aqk [H, NB*C, C], Vn [H, NB*C, V], h [NB, H, K, V] ->
    o [H, NB*C, V]: two batched products over heads x chunks, with the kernel's precision."""
    H, TT, K = Q.shape
    NB = TT // C
    per_chunk = lambda x: x.reshape(H, NB, C, x.shape[-1])
    mm = jax.vmap(jax.vmap(functools.partial(_mm, prec=prec, emulate=emulate)))
    o = mm(per_chunk(Q), jnp.swapaxes(h, 0, 1)) + mm(per_chunk(Aqk), per_chunk(Vn))  # [H, NB, C, V]
    return o.reshape(H, TT, -1)


def _states_after(h, final, rows):
    """Chunk-end states from chunk-start states: chunk c ends in the state chunk c + 1 starts from,
    except a row's last chunk, which ends in the row's final state. h [NB, H, K, V], final [S, H, K, V]."""
    rs, re, st, _ = rows
    last = jnp.where(re > rs, re - 1, h.shape[0])            # rows without chunks write nothing
    return jnp.roll(h, -1, axis=0).at[last].set(final[st], mode="drop")


def prep_precision(dot_precision, interpret):
    """Precision ("highest" or "tf32x3") of the split forms' prep products: IEEE fp32, except on a
    GPU whose kernel takes tensor-core products ("tf32x3", "tf32", "bf16"), where the prep takes
    three-pass TF32 -- about fp32 accuracy (the triangular inverse and the gate sums need it) at
    tensor-core rates; IEEE fp32 runs on the CUDA cores, ~67 TFLOP/s on an H200, against 1.2 GFLOP a
    64-token chunk of 96 heads (160 GFLOP at T = 8192: ~2.4 ms at that peak). Interpreted (CPU): IEEE
    fp32, which the TF32 emulation of the kernel's products is checked against."""
    return "highest" if interpret or dot_precision == "highest" else "tf32x3"


def _split_prep(q, k, v, g, beta, C, prec="highest"):
    """Every chunk's state-independent terms at once (plain XLA, batched over heads and chunks;
    products at ``prec``, see ``prep_precision``): [H, NB*C, D] inputs -> the layouts
    ``_call_gpu_split`` reads: W, U, Q, Kd [H, NB*C, K|V], Aqk [H, NB*C, C], decay [H, NB*K, 1]. The
    same terms as ``_chunk_prep`` (the fused kernel's, which must stay 2-D products of [C, C] masks
    inside Triton), here from the reference's block form (``reference._chunk_local``: A_qk and the
    triangular inverse joined level by level from [s, s] blocks, every gate sum from one product with
    a constant range-sum matrix): a 64-token chunk of one head (K = V = 128) costs 12.9 MFLOP instead
    of 30 (XLA's cost analysis)."""
    H, TT, K = q.shape
    NB = TT // C
    q, k, v, g, beta = (x.reshape(H, NB, C, x.shape[-1]) for x in (q, k, v, g, beta))
    precision = _HI if prec == "highest" else _PRESET[prec]
    Aqk, Tinv, eG, eS = ref._chunk_local(q, k, g, beta[..., 0], precision)
    mm = functools.partial(jnp.matmul, precision=precision)
    W = mm(Tinv, beta * (k * eG))
    U = mm(Tinv, beta * v)
    decay = jnp.swapaxes(eG[..., -1:, :], -1, -2)                      # exp(Gamma_C) [H, NB, K, 1]
    flat = lambda x: x.reshape(H, NB * x.shape[2], x.shape[3])
    return flat(W), flat(U), flat(q * eG), flat(Aqk), flat(k * eS), flat(decay)


def _block_meta(rows, NB):
    """Per-block (state index, first flag, mode) for the TPU variant from per-row data."""
    r_start, r_end, r_state, r_valid = rows
    R = r_start.shape[0]
    ridx = jnp.arange(R, dtype=jnp.int32)
    valid = r_valid == 1
    any_valid = jnp.any(valid)
    # invalid rows point at the previous valid row's state (else the next one's, else 0),
    # so that on TPU the state block is revisited, not written back with stale contents
    prev = lax.cummax(jnp.where(valid, ridx, -1), axis=0)
    nxt = lax.cummin(jnp.where(valid, ridx, R), axis=0, reverse=True)
    nb = jnp.where(prev >= 0, prev, jnp.where(nxt < R, nxt, 0))
    mapped = jnp.where(valid, r_state, jnp.where(any_valid, r_state[jnp.clip(nb, 0, R - 1)], 0))
    blk = jnp.arange(NB, dtype=jnp.int32)
    row_of = jnp.clip(jnp.searchsorted(r_end, blk, side="right"), 0, R - 1).astype(jnp.int32)
    st = mapped[row_of].astype(jnp.int32)
    first = (blk == r_start[row_of]).astype(jnp.int32)
    mode = jnp.where(valid[row_of], 1, jnp.where(any_valid, 0, 2)).astype(jnp.int32)
    return st, first, mode


def _default_variant():
    return "gpu" if jax.default_backend() == "gpu" else "tpu"


def _pick_block_v(V, block_v, variant):
    if block_v is None:
        # TPU: one lane-dense 128-wide tile; GPU (Triton): the state lives in registers, so
        # keep it at K x 32 per program and get parallelism from more programs instead.
        block_v = min(V, 128 if variant == "tpu" else 32)
    if V % block_v:
        raise ValueError(f"block_v={block_v} must divide V={V}")
    return block_v


def _split_forms(form, q, k, v, g, beta, states, rows, *, C, block_v, chunk_states, interpret, prec,
                 state_dtype, num_warps, block_k, num_stages, prep, scale):
    """The "split" and "staged" forms: the chunk terms (XLA's ``_split_prep`` on head-major fp32
    operands, or with ``prep="pallas"`` the ``_call_gpu_prep`` kernel on the caller's token-major
    ones), the Pallas state loop, and for "staged" the batched outputs. o comes back in the
    operands' layout."""
    V = v.shape[-1]
    bv = _pick_block_v(V, default_split_tiles(q.shape[-1], V, form)[1] if block_v is None else block_v, "gpu")
    if prep == "pallas":
        terms = _call_gpu_prep(q, k, v, g, beta, C=C, scale=scale, prec=prep_precision(prec, interpret),
                               interpret=interpret, num_warps=num_warps)
    else:
        terms = _split_prep(q, k, v, g, beta, C, prep_precision(prec, interpret))
    staged = form == "staged"
    res = _call_gpu_split(terms, states, rows, C=C, block_v=bv, chunk_states=chunk_states,
                          interpret=interpret, prec=prec, state_dtype=state_dtype,
                          num_warps=num_warps, block_k=block_k, staged=staged, num_stages=num_stages)
    if staged:
        vn, final, h = res
        o = _staged_output(terms[2], terms[3], vn, h, C=C, prec=prec, emulate=interpret)
        res = (o, final) + ((_states_after(h, final, rows),) if chunk_states else ())
    if prep == "pallas":     # head-major o [H, NB*C, V] -> the caller's [NB*C, H, V]
        res = (jnp.swapaxes(res[0], 0, 1),) + tuple(res[1:])
    return res


def _scan(kind, q, k, v, g, beta, states, rows, *, C, block_v, chunk_states, interpret,
          variant, dot_precision="highest", state_dtype=None, block_c=None, form="fused",
          num_warps=None, block_k=None, num_stages=None, token_major=False, scale=None, out_dtype=_F32,
          prep="xla"):
    """q,k,g [H,NB*C,K] fp32, v [H,NB*C,V], beta [H,NB*C,1], states [S,H,K,V] fp32 (with
    `token_major`, the GPU fused / recurrent kernels: [NB*C, H, D] in any float dtype, q unscaled, see
    ``_call_gpu``). With `state_dtype` the state is rounded to it after every chunk ("chunk") or token
    ("recurrent").
    `num_warps` / `num_stages` (GPU variant): warps per program (None: ``NUM_WARPS``) and load
    pipelining stages of its loop (None: 1). `prep` (split forms): ``PREPS``."""
    variant = variant or _default_variant()
    for name, val in (("num_warps", num_warps), ("num_stages", num_stages)):
        if val is not None and variant != "gpu":
            raise ValueError(f"{name}={val!r} is an option of the GPU (Triton) variant, not {variant!r}")
    num_warps, num_stages = check_num_warps(num_warps), check_num_stages(num_stages)
    if dot_precision not in DOT_PRECISIONS:
        raise ValueError(f"dot_precision={dot_precision!r}; expected one of {DOT_PRECISIONS}")
    if dot_precision != "highest" and variant == "tpu" and not interpret:
        raise ValueError("dot_precision other than 'highest' is a GPU (tensor-core) option")
    math = _MATH[kind]
    if kind == "chunk":
        math = functools.partial(_rounded, functools.partial(math, prec=dot_precision, emulate=interpret),
                                 state_dtype)
    elif state_dtype is not None:
        math = functools.partial(math, state_dtype=state_dtype)
    if prep not in PREPS:
        raise ValueError(f"prep={prep!r}; expected one of {PREPS}")
    if prep != "xla" and form == "fused":
        raise ValueError(f"prep={prep!r} is an option of form='split' or 'staged'")
    if token_major and (variant != "gpu" or (form != "fused" and prep != "pallas")):
        raise ValueError("token-major operands are the GPU variant's layout for the fused / recurrent "
                         "kernels and the prep kernels")
    NB = q.shape[0 if token_major else 1] // C
    kw = dict(C=C, block_v=_pick_block_v(v.shape[-1], block_v, variant),
              chunk_states=chunk_states,
              interpret=interpret)
    if form not in FORMS:
        raise ValueError(f"form={form!r}; expected one of {FORMS}")
    if variant == "gpu" and not interpret and not triton_available():
        raise NotImplementedError("KDA Pallas GPU kernel needs the Pallas Triton lowering")
    if block_k is not None and form == "fused":
        raise ValueError(f"block_k={block_k!r} is an option of form='split' or 'staged'")
    if form != "fused":
        if kind != "chunk" or variant != "gpu":
            raise ValueError(f"form={form!r} is a form of the chunk kernel's GPU variant")
        return _split_forms(form, q, k, v, g, beta, states, rows, C=C, block_v=block_v,
                            chunk_states=chunk_states, interpret=interpret, prec=dot_precision,
                            state_dtype=state_dtype, num_warps=num_warps, block_k=block_k,
                            num_stages=num_stages, prep=prep, scale=scale)
    if variant == "tpu":
        return _call_tpu(math, q, k, v, g, beta, states, _block_meta(rows, NB), **kw)
    if variant == "gpu":
        if kind == "chunk":
            kw["block_c"] = default_block_c(C, interpret) if block_c is None else block_c
        return _call_gpu(math, q, k, v, g, beta, states, rows, num_warps=num_warps, num_stages=num_stages,
                         token_major=token_major, scale=scale, out_dtype=out_dtype, **kw)
    raise ValueError(f"variant={variant!r}")


# ----------------------------------------------------------------------------------------
# layouts
# ----------------------------------------------------------------------------------------
def _prep_dense(q, k, v, g, beta, scale, C, token_major=False):
    """[B,T,H,D] -> [H, B*NCb*C, D] fp32 with q scaled (T padded to a multiple of C with zeros); with
    ``token_major``, [B*NCb*C, H, D] as given (a reshape unless T needs padding; the kernel scales
    and widens)."""
    B, T, H, K = q.shape
    NCb = max(1, -(-T // C))
    pad = NCb * C - T

    def f(x):
        if pad:
            x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        if token_major:
            return x.reshape((B * NCb * C,) + x.shape[2:])
        x = jnp.moveaxis(x.astype(_F32), 2, 0)    # [H, B, Tp, ...]
        return x.reshape((H, B * NCb * C) + x.shape[3:])

    out = [f(q) if token_major else f(q) * scale, f(k), f(v), f(g), f(beta)[..., None]]
    rows = (jnp.arange(B, dtype=jnp.int32) * NCb,
            jnp.arange(1, B + 1, dtype=jnp.int32) * NCb,
            jnp.arange(B, dtype=jnp.int32),
            jnp.ones((B,), jnp.int32))
    return out, rows, NCb


def _unprep_dense(o, B, T, NCb, C, token_major=False):
    """The kernel's o ([H, B*NCb*C, V], or token-major [B*NCb*C, H, V]) -> [B, T, H, V]."""
    if token_major:
        return o.reshape((B, NCb * C) + o.shape[1:])[:, :T]
    H, _, V = o.shape
    o = o.reshape(H, B, NCb * C, V)[:, :, :T]
    return jnp.moveaxis(o, 0, 2)                  # [B, T, H, V]


def _token_major(variant, form, prep="xla"):
    """Whether the kernel reads the caller's [tokens, H, D] layout: the GPU variant's fused chunk and
    recurrent kernels and the split forms' prep kernels (strided rows cost a Triton program nothing;
    XLA transposes cost a pass over every operand and the output). The TPU variant tiles heads-major;
    the split forms' XLA prep lays its terms out itself."""
    return (variant or _default_variant()) == "gpu" and (form == "fused" or prep == "pallas")


def _run(kind, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, C,
         return_chunk_states, interpret, block_v, variant, dot_precision="highest", state_dtype=None,
         block_c=None, form="fused", num_warps=None, block_k=None, num_stages=None, prep="xla"):
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = float(K) ** -0.5 if scale is None else scale
    if C & (C - 1):
        raise ValueError(f"chunk size {C} must be a power of two for the Pallas kernels")
    tm = _token_major(variant, form, prep)
    scan = functools.partial(_scan, kind, C=C, block_v=block_v, chunk_states=return_chunk_states,
                             interpret=interpret, variant=variant, dot_precision=dot_precision,
                             state_dtype=state_dtype, block_c=block_c, form=form, num_warps=num_warps,
                             num_stages=num_stages, block_k=block_k, token_major=tm,
                             scale=scale if tm else None, out_dtype=v.dtype if tm else _F32, prep=prep)
    if cu_seqlens is None:
        xs, rows, NCb = _prep_dense(q, k, v, g, beta, scale, C, tm)
        states = (jnp.zeros((B, H, K, V), _F32) if initial_state is None
                  else initial_state.astype(_F32))
        res = scan(*xs, states, rows)
        o = _unprep_dense(res[0], B, T, NCb, C, tm).astype(v.dtype)
        out = (o, res[1] if output_final_state else None)
        if return_chunk_states:
            out = out + (res[2].reshape(B, NCb, H, K, V),)
        return out

    if B != 1:
        raise ValueError("cu_seqlens requires B == 1 (packed sequences)")
    N = cu_seqlens.shape[0] - 1
    lay = ref.varlen_layout(cu_seqlens, T, C)

    def f(x):   # [T, H, ...] -> [NC*C, H, ...], head-major: [H, NC*C, ...] fp32
        x = ref.pack_varlen(x, lay, C)
        x = x.reshape((-1,) + x.shape[2:])
        return x if tm else jnp.moveaxis(x.astype(_F32), 1, 0)

    xs = [f(q[0]) if tm else f(q[0]) * scale, f(k[0]), f(v[0]), f(g[0]), f(beta[0])[..., None]]
    off = lay.chunk_offsets
    rows = (off[:-1], off[1:], jnp.arange(N, dtype=jnp.int32), jnp.ones((N,), jnp.int32))
    states = (jnp.zeros((N, H, K, V), _F32) if initial_state is None
              else initial_state.astype(_F32))
    res = scan(*xs, states, rows)
    o = res[0] if tm else jnp.moveaxis(res[0], 0, 1)             # [NC*C, H, V]
    o = jnp.take(o, lay.dst, axis=0)[None].astype(v.dtype)
    out = (o, res[1] if output_final_state else None)
    if return_chunk_states:
        out = out + (res[2][None],)
    return out


def fit_block_t(block_t, T, variant="gpu"):
    """The recurrent kernel's token block for rows of T tokens: ``block_t``, or on the GPU variant
    the smallest power of two >= T when that is less. A GPU decode row (T = 1) then runs one token,
    not one token and ``block_t - 1`` padding tokens of the same unrolled state update. The TPU
    variant keeps ``block_t``: its token tiles need 8 rows (sublanes) to lower."""
    block_t = int(block_t)
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"block_t={block_t} must be a power of two")
    if (variant or _default_variant()) != "gpu":
        return block_t
    return min(block_t, 1 << max(0, int(T) - 1).bit_length())


# ----------------------------------------------------------------------------------------
# public entry points (called by ops.py)
# ----------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "chunk_size",
                                             "return_chunk_states", "interpret", "block_v",
                                             "variant", "dot_precision", "state_dtype", "block_c",
                                             "form", "num_warps", "block_k", "num_stages", "prep"))
def chunk_kda_pallas(q, k, v, g, beta, scale=None, initial_state=None,
                     output_final_state=False, cu_seqlens=None, chunk_size=64,
                     return_chunk_states=False, interpret=False, block_v=None,
                     variant=None, dot_precision=None, state_dtype=None, block_c=None,
                     form="fused", num_warps=None, block_k=None, num_stages=None, prep="xla"):
    """Pallas chunked KDA; same contract as :func:`ops.chunk_kda` (chunk_size: power of 2).

    ``dot_precision``: "highest" (IEEE fp32), "tf32x3" or "tf32" tensor-core products for the
    chunk's matmuls (see ``DOT_PRECISIONS``); interpret mode emulates TF32 rounding. None picks
    ``default_dot_precision``: "tf32x3" for the compiled GPU kernel, "highest" elsewhere.
    ``block_c`` (GPU variant): tokens per math tile inside a chunk (``default_block_c``).
    ``form`` (GPU variant): "fused", "split" or "staged" (see ``FORMS``).
    ``num_warps`` (GPU variant): warps per program (None: ``NUM_WARPS``).
    ``num_stages`` (GPU variant): Triton pipelining stages of each program's chunk loop (None: 1;
    ``check_num_stages``).
    ``block_k`` (split and staged forms): state rows per K-block of their products; it and
    ``block_v`` default to ``default_split_tiles``.
    ``prep`` (split and staged forms): where their chunk terms are computed, "xla" or "pallas"
    (``PREPS``)."""
    if dot_precision is None:
        dot_precision = default_dot_precision(variant or _default_variant(), interpret)
    return _run("chunk", q, k, v, g, beta, scale, initial_state, output_final_state,
                cu_seqlens, int(chunk_size), return_chunk_states, interpret, block_v,
                variant, dot_precision, state_dtype, block_c, form, num_warps, block_k, num_stages, prep)


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "interpret",
                                             "block_t", "block_v", "variant", "state_dtype",
                                             "num_warps"))
def fused_recurrent_kda_pallas(q, k, v, g, beta, scale=None, initial_state=None,
                               output_final_state=False, cu_seqlens=None, interpret=False,
                               block_t=8, block_v=None, variant=None, state_dtype=None,
                               num_warps=None):
    """Pallas recurrent KDA (token loop in blocks of ``block_t`` tokens, fewer when dense T is
    shorter: see ``fit_block_t``; ``num_warps`` as :func:`chunk_kda_pallas`)."""
    if cu_seqlens is None:
        block_t = fit_block_t(block_t, q.shape[1], variant)
    return _run("recurrent", q, k, v, g, beta, scale, initial_state, output_final_state,
                cu_seqlens, int(block_t), False, interpret, block_v, variant, state_dtype=state_dtype,
                num_warps=num_warps)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_t", "block_v",
                                             "variant", "num_warps"))
def fused_recurrent_kda_pool_pallas(q, k, v, g, beta, state_pool, slot_ids, scale=None,
                                    interpret=False, block_t=8, block_v=None, variant=None,
                                    num_warps=None):
    """Pallas pooled decode. ``state_pool`` [S,H,K,V] fp32 is aliased to the new pool
    (donate it in the enclosing jit for a true in-place update). Rows whose ``slot_ids`` fall
    outside ``[0, S)`` are skipped (nothing written, output zero). ``block_v`` / ``num_warps`` (GPU
    variant): the state tile [K, block_v] each program carries and the warps it is spread over."""
    B, T, H, K = q.shape
    scale = float(K) ** -0.5 if scale is None else scale
    C = fit_block_t(block_t, T, variant)
    tm = _token_major(variant, "fused")
    xs, rows, NCb = _prep_dense(q, k, v, g, beta, scale, C, tm)
    slot_ids = slot_ids.astype(jnp.int32)
    valid = ref.pool_rows(slot_ids, state_pool.shape[0])
    rows = (rows[0], rows[1], jnp.where(valid, slot_ids, 0), valid.astype(jnp.int32))
    res = _scan("recurrent", *xs, state_pool.astype(_F32), rows, C=C, block_v=block_v,
                chunk_states=False, interpret=interpret, variant=variant, num_warps=num_warps,
                token_major=tm, scale=scale if tm else None, out_dtype=v.dtype if tm else _F32)
    o = _unprep_dense(res[0], B, T, NCb, C, tm)
    if not tm:   # the GPU kernel writes zeros for skipped rows itself
        o = jnp.where(valid[:, None, None, None], o, 0.0)
    return o.astype(v.dtype), res[1].astype(state_pool.dtype)
