"""KDA reference: chunked form vs. token-by-token scan, varlen, state carry, pool decode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.kda import (
    chunk_kda,
    fused_recurrent_kda,
    fused_recurrent_kda_pool,
    naive_recurrent_kda,
    varlen_chunk_offsets,
)
from pallas_kernels.kda.testing import make_inputs, make_state, rel_err, token_states

TOL = 1e-5
B, H, K, V = 2, 2, 16, 32
REF = "reference"


@pytest.fixture(scope="module")
def naive_jit():
    return jax.jit(naive_recurrent_kda)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("with_init", [False, True])
def test_chunk_matches_token_scan(T, with_init, naive_jit):
    q, k, v, g, beta = make_inputs(T * 7 + with_init, B, T, H, K, V, gate="k3")
    S0 = make_state(T + 1, B, H, K, V) if with_init else None
    o_ref, s_ref = naive_jit(q, k, v, g, beta, None, S0)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, backend=REF)
    assert o.shape == (B, T, H, V) and o.dtype == v.dtype
    assert s.shape == (B, H, K, V) and s.dtype == jnp.float32
    assert rel_err(o, o_ref) <= TOL
    assert rel_err(s, s_ref) <= TOL


def test_long_sequence_small_heads(naive_jit):
    T = 1100
    q, k, v, g, beta = make_inputs(11, 1, T, 1, 16, 16, gate="k3")
    S0 = make_state(12, 1, 1, 16, 16)
    o_ref, s_ref = naive_jit(q, k, v, g, beta, None, S0)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, backend=REF)
    assert rel_err(o, o_ref) <= TOL
    assert rel_err(s, s_ref) <= TOL


@pytest.mark.parametrize("gate", ["k3_floor", "kimi"])
def test_extreme_gates(gate, naive_jit):
    """g == -4.999 for whole chunks (Gamma ~ -320) and Kimi-Linear's unbounded gate."""
    T = 130
    q, k, v, g, beta = make_inputs(21, B, T, H, K, V, gate=gate)
    S0 = make_state(22, B, H, K, V)
    if gate == "kimi":
        assert float(jnp.min(jnp.sum(g[:, :64], axis=1))) < -100.0   # really extreme
    o_ref, s_ref = naive_jit(q, k, v, g, beta, None, S0)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, backend=REF)
    assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(s)))
    assert rel_err(o, o_ref) <= TOL
    assert rel_err(s, s_ref) <= TOL


def test_split_in_halves_equals_whole():
    T = 150
    q, k, v, g, beta = make_inputs(31, B, T, H, K, V, gate="kimi")
    S0 = make_state(32, B, H, K, V)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, backend=REF)
    cut = 77
    a = [x[:, :cut] for x in (q, k, v, g, beta)]
    b = [x[:, cut:] for x in (q, k, v, g, beta)]
    o1, s1 = chunk_kda(*a, initial_state=S0, output_final_state=True, backend=REF)
    o2, s2 = chunk_kda(*b, initial_state=s1, output_final_state=True, backend=REF)
    assert rel_err(jnp.concatenate([o1, o2], axis=1), o) <= TOL
    assert rel_err(s2, s) <= TOL


def test_chunk_states_match_token_scan(naive_jit):
    T, C = 150, 32
    q, k, v, g, beta = make_inputs(41, B, T, H, K, V)
    S0 = make_state(42, B, H, K, V)
    o, s, cs = chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True,
                         chunk_size=C, return_chunk_states=True, backend=REF)
    nc = -(-T // C)
    assert cs.shape == (B, nc, H, K, V)
    states = token_states(q, k, v, g, beta, S0)
    for c in range(nc):
        end = min((c + 1) * C, T)
        assert rel_err(cs[:, c], states[:, end - 1]) <= TOL
    assert rel_err(cs[:, -1], s) <= TOL


@pytest.fixture(scope="module")
def varlen_case():
    lens = [5, 64, 0, 70, 1, 33]
    T = sum(lens)
    N = len(lens)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    q, k, v, g, beta = make_inputs(51, 1, T, H, K, V, gate="k3")
    init = make_state(52, N, H, K, V)
    outs, finals = [], []
    naive = jax.jit(naive_recurrent_kda)
    for n in range(N):
        s, e = int(cu[n]), int(cu[n + 1])
        if e == s:
            finals.append(init[n])
            continue
        o, st = naive(*(x[:, s:e] for x in (q, k, v, g, beta)), None, init[n:n + 1])
        outs.append(o)
        finals.append(st[0])
    return dict(lens=lens, cu=cu, inputs=(q, k, v, g, beta), init=init,
                o=jnp.concatenate(outs, axis=1), final=jnp.stack(finals))


@pytest.mark.parametrize("with_init", [False, True])
def test_varlen_chunk_equals_separate_calls(varlen_case, with_init):
    c = varlen_case
    init = c["init"] if with_init else None
    o, s = chunk_kda(*c["inputs"], initial_state=init, output_final_state=True,
                     cu_seqlens=c["cu"], backend=REF)
    if with_init:
        assert rel_err(o, c["o"]) <= TOL
        assert rel_err(s, c["final"]) <= TOL
    else:   # recompute the expectation from zeros
        N = len(c["lens"])
        o_ref, s_ref = chunk_kda(*c["inputs"], initial_state=jnp.zeros_like(c["init"]),
                                 output_final_state=True, cu_seqlens=c["cu"], backend=REF)
        assert rel_err(o, o_ref) == 0.0 and s.shape == (N, H, K, V)
        q, k, v, g, beta = c["inputs"]
        o1, s1 = naive_recurrent_kda(*(x[:, 5:69] for x in (q, k, v, g, beta)))
        assert rel_err(o[:, 5:69], o1) <= TOL
        assert rel_err(s[1], s1[0]) <= TOL
        assert float(jnp.abs(s[2]).max()) == 0.0   # empty sequence keeps its (zero) state


def test_varlen_chunk_states(varlen_case):
    c = varlen_case
    C = 32
    q, k, v, g, beta = c["inputs"]
    o, s, cs = chunk_kda(q, k, v, g, beta, initial_state=c["init"], output_final_state=True,
                         cu_seqlens=c["cu"], chunk_size=C, return_chunk_states=True,
                         backend=REF)
    assert rel_err(o, c["o"]) <= TOL
    off = np.asarray(varlen_chunk_offsets(c["cu"], C))
    cu = np.asarray(c["cu"])
    for n, L in enumerate(c["lens"]):
        if L == 0:
            continue
        states = token_states(*(x[:, cu[n]:cu[n + 1]] for x in (q, k, v, g, beta)),
                              c["init"][n:n + 1])
        for j in range(off[n + 1] - off[n]):
            end = min((j + 1) * C, L)
            assert rel_err(cs[0, off[n] + j], states[0, end - 1]) <= TOL


def test_fused_recurrent_matches(varlen_case, naive_jit):
    T = 9
    q, k, v, g, beta = make_inputs(61, B, T, H, K, V, gate="kimi")
    S0 = make_state(62, B, H, K, V)
    o_ref, s_ref = naive_jit(q, k, v, g, beta, None, S0)
    o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True,
                               backend=REF)
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL
    _, none = fused_recurrent_kda(q, k, v, g, beta, backend=REF)
    assert none is None
    c = varlen_case
    o, s = fused_recurrent_kda(*c["inputs"], initial_state=c["init"], output_final_state=True,
                               cu_seqlens=c["cu"], backend=REF)
    assert rel_err(o, c["o"]) <= TOL and rel_err(s, c["final"]) <= TOL


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_varlen_tokens_past_the_last_sequence_are_padding(varlen_case, op):
    """A packed batch padded past cu_seqlens[-1] (a static token bucket): the padding gives zero output and
    touches no state, in both forms (the recurrent reference had run it on from the last sequence's state)."""
    c = varlen_case
    pad = 7
    x = [jnp.concatenate([a, a[:, :pad]], axis=1) for a in c["inputs"]]
    fn = chunk_kda if op == "chunk" else fused_recurrent_kda
    o, s = fn(*x, initial_state=c["init"], output_final_state=True, cu_seqlens=c["cu"], backend=REF)
    assert rel_err(o[:, :-pad], c["o"]) <= TOL and rel_err(s, c["final"]) <= TOL
    assert float(jnp.abs(o[:, -pad:]).max()) == 0.0


def test_pool_decode_matches_and_leaves_other_slots():
    Bd, S = 4, 7
    pool = make_state(71, S, H, K, V)
    slot_ids = jnp.asarray([3, 0, -1, 5], jnp.int32)
    q, k, v, g, beta = make_inputs(72, Bd, 1, H, K, V, gate="k3")
    o, new_pool = fused_recurrent_kda_pool(q, k, v, g, beta, pool, slot_ids, backend=REF)
    assert o.shape == (Bd, 1, H, V) and new_pool.shape == pool.shape
    for b, sid in enumerate(np.asarray(slot_ids)):
        if sid < 0:
            assert float(jnp.abs(o[b]).max()) == 0.0
            continue
        o_ref, s_ref = naive_recurrent_kda(*(x[b:b + 1] for x in (q, k, v, g, beta)),
                                           initial_state=pool[sid:sid + 1])
        assert rel_err(o[b:b + 1], o_ref) <= TOL
        assert rel_err(new_pool[sid], s_ref[0]) <= TOL
    for sid in (1, 2, 4, 6):
        np.testing.assert_array_equal(np.asarray(new_pool[sid]), np.asarray(pool[sid]))


@pytest.mark.parametrize("t", [1, 3])
def test_pool_decode_cpu_row_loop_matches_the_reference(t):
    """`auto` on CPU runs the in-place row loop: same outputs and pool as the reference (padding rows
    give zeros and leave the pool alone; unnamed slots untouched), and under donation the compiled
    loop updates the pool without copying it."""
    from pallas_kernels.kda.pool_cpu import fused_recurrent_kda_pool_cpu
    Bd, S = 5, 9
    pool = make_state(73, S, H, K, V)
    slot_ids = jnp.asarray([6, -1, 0, 3, -1], jnp.int32)
    q, k, v, g, beta = make_inputs(74, Bd, t, H, K, V, gate="k3")
    o_ref, p_ref = fused_recurrent_kda_pool(q, k, v, g, beta, pool, slot_ids, backend=REF)
    o, p = fused_recurrent_kda_pool(q, k, v, g, beta, pool, slot_ids)  # auto -> row loop on CPU
    assert rel_err(o, o_ref) <= TOL and rel_err(p, p_ref) <= TOL
    assert float(jnp.abs(p[6] - pool[6]).max()) > 1e-3
    assert float(jnp.abs(o[1]).max()) == 0.0 and float(jnp.abs(o[4]).max()) == 0.0
    for sid in (1, 2, 4, 5, 7, 8):
        np.testing.assert_array_equal(np.asarray(p[sid]), np.asarray(pool[sid]))
    f = jax.jit(fused_recurrent_kda_pool_cpu, donate_argnums=(5,))
    hlo = f.lower(q, k, v, g, beta, pool, slot_ids).compile().as_text()
    pool_shape = f"f32[{S},{H},{K},{V}]"
    assert not [l for l in hlo.splitlines() if " copy(" in l and l.split("=", 1)[1].strip().startswith(pool_shape)]


@pytest.mark.parametrize("backend", [REF, "auto"])
def test_pool_decode_ids_outside_the_pool_are_padding(backend):
    """A slot id past the pool, or a very negative one, is a padding row like -1: output zero, no slot
    written (an id >= S had been clamped onto the last slot, overwriting another sequence's state), and
    the rows after it still run (an id below -2**30 had shortened the CPU row loop, dropping the last row)."""
    Bd, S = 5, 9
    pool = make_state(75, S, H, K, V)
    slot_ids = jnp.asarray([-2 ** 31, 4, S, S + 3, 1], jnp.int32)
    q, k, v, g, beta = make_inputs(76, Bd, 2, H, K, V, gate="k3")
    o, p = fused_recurrent_kda_pool(q, k, v, g, beta, pool, slot_ids, backend=backend)
    for b, sid in ((1, 4), (4, 1)):
        o_ref, s_ref = naive_recurrent_kda(*(x[b:b + 1] for x in (q, k, v, g, beta)),
                                           initial_state=pool[sid:sid + 1])
        assert rel_err(o[b:b + 1], o_ref) <= TOL and rel_err(p[sid], s_ref[0]) <= TOL
    for b in (0, 2, 3):
        assert float(jnp.abs(o[b]).max()) == 0.0
    for sid in (0, 2, 3, 5, 6, 7, 8):
        np.testing.assert_array_equal(np.asarray(p[sid]), np.asarray(pool[sid]))


def _bad_kda_call(case):
    """(op, args, kwargs, the argument the error must name) of a malformed call."""
    x = q, k, v, g, beta = make_inputs(77, B, 5, H, K, V)
    pool, s0 = make_state(78, 3, H, K, V), make_state(79, B, H, K, V)
    one, cu = tuple(a[:1] for a in x), jnp.asarray([0, 1, 2, 5], jnp.int32)  # 3 sequences, B = 2 states
    return {
        "g without K": (chunk_kda, (q, k, v, g[..., 0], beta), {}, "g"),
        "k of another K": (chunk_kda, (q, k[..., :8], v, g, beta), {}, "k"),
        "v of another T": (chunk_kda, (q, k, v[:, :3], g, beta), {}, "v"),
        "beta [B,T,H,1]": (fused_recurrent_kda, (q, k, v, g, beta[..., None]), {}, "beta"),
        "state of another N": (chunk_kda, x, dict(initial_state=s0[:1]), "initial_state"),
        "state [N,H,V,K]": (fused_recurrent_kda, x, dict(initial_state=jnp.swapaxes(s0, -1, -2)), "initial_state"),
        "state vs cu_seqlens": (chunk_kda, one, dict(initial_state=s0, cu_seqlens=cu), "initial_state"),
        "float cu_seqlens": (chunk_kda, one, dict(cu_seqlens=cu.astype(jnp.float32)), "cu_seqlens"),
        "chunk_size 0": (chunk_kda, x, dict(chunk_size=0), "chunk_size"),
        "slot_ids too short": (fused_recurrent_kda_pool, x + (pool, jnp.asarray([0], jnp.int32)), {}, "slot_ids"),
        "pool [H,K,V]": (fused_recurrent_kda_pool, x + (pool[0], jnp.asarray([0, 1], jnp.int32)), {}, "state_pool"),
    }[case]


@pytest.mark.parametrize("backend", [REF, "interpret", "auto"])
@pytest.mark.parametrize("case", ["g without K", "k of another K", "v of another T", "beta [B,T,H,1]",
                                  "state of another N", "state [N,H,V,K]", "state vs cu_seqlens",
                                  "float cu_seqlens", "chunk_size 0", "slot_ids too short", "pool [H,K,V]"])
def test_malformed_arguments_raise_naming_the_argument(case, backend):
    """Wrong shapes / dtypes raise a ValueError or TypeError naming the argument before anything is
    traced; several (a state of the wrong N or transposed, v shorter than q, a short slot_ids) had run
    and returned garbage silently, the others failed deep inside XLA or Pallas."""
    op, args, kw, arg = _bad_kda_call(case)
    with pytest.raises((ValueError, TypeError), match=rf"^{arg}\b"):
        op(*args, backend=backend, **kw)


@pytest.mark.parametrize("gate", ["k3", "kimi"])
def test_token_step_reading_the_state_once_matches_the_scan(gate):
    """`kda_token_step` (both state projections from one product, used by the in-place serving
    decode) equals one step of the token scan on random data, with the default and a given scale."""
    from pallas_kernels.kda.reference import kda_token_step
    Bd = 3
    s0 = make_state(91, Bd, H, K, V)
    q, k, v, g, beta = make_inputs(92, Bd, 1, H, K, V, gate=gate)
    for scale in (None, 0.3):
        o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=s0)
        o, s = kda_token_step(s0, *(x[:, 0] for x in (q, k, v, g, beta)), scale=scale)
        assert rel_err(o, o_ref[:, 0]) <= TOL and rel_err(s, s_ref) <= TOL
        assert float(jnp.abs(s - s0).max()) > 1e-3  # the step changed the state


def test_jit_and_dtypes():
    T = 70
    q, k, v, g, beta = make_inputs(81, 1, T, H, K, V, v_dtype=jnp.bfloat16)
    f = jax.jit(chunk_kda, static_argnames=("scale", "output_final_state", "chunk_size",
                                            "return_chunk_states", "backend", "interpret"))
    o, s = f(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v, g, beta,
             output_final_state=True, backend=REF)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    o_ref, s_ref = naive_recurrent_kda(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v, g,
                                       beta)
    assert rel_err(s, s_ref) <= TOL
    assert rel_err(o, o_ref) <= 1e-2    # bf16 output rounding only


def test_dispatch(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    expect = "pallas" if jax.default_backend() in ("gpu", "tpu") else "reference"
    assert dispatch.resolve_backend("auto") == expect
    assert dispatch.resolve_backend("reference") == "reference"
    assert dispatch.resolve_backend("interpret") == "pallas"
    assert dispatch.resolve_interpret("interpret", False)
    assert dispatch.resolve_interpret("pallas", True)
    monkeypatch.setenv(dispatch.ENV_VAR, "interpret")
    assert dispatch.resolve_backend("reference") == "pallas"
    assert dispatch.resolve_interpret("reference", False)
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    assert dispatch.resolve_backend("pallas") == "reference"
    monkeypatch.setenv(dispatch.ENV_VAR, "bogus")
    with pytest.raises(ValueError):
        dispatch.resolve_backend("auto")
    monkeypatch.delenv(dispatch.ENV_VAR)
    with pytest.raises(ValueError):
        dispatch.resolve_backend("cuda")
