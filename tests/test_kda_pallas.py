"""KDA Pallas kernels in interpret mode vs. the jnp reference (both grid variants)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.kda import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_pool
from pallas_kernels.kda import reference as ref
from pallas_kernels.kda.pallas_kda import (
    chunk_kda_pallas,
    default_block_c,
    default_dot_precision,
    fit_block_t,
    prep_precision,
    fused_recurrent_kda_pallas,
    fused_recurrent_kda_pool_pallas,
)
from pallas_kernels.kda.testing import make_inputs, make_state, rel_err, token_states

TOL = 1e-5
B, H, K, V = 2, 2, 16, 32
VARIANTS = ["tpu", "gpu"]
naive = jax.jit(ref.naive_recurrent_kda)
# the other references jitted too: one program each, not one per primitive of an eager call (same computation; CI time)
chunk_reference = jax.jit(ref.chunk_kda_reference, static_argnames=("scale", "output_final_state", "chunk_size",
                                                                     "return_chunk_states", "state_dtype"))
pool_reference = jax.jit(ref.fused_recurrent_kda_pool_reference, static_argnames="scale")


@pytest.fixture(scope="module")
def dense_case():
    T = 100
    cases = {}
    for gate in ("k3", "kimi", "k3_floor"):
        x = make_inputs(101 + len(gate), B, T, H, K, V, gate=gate)
        S0 = make_state(102, B, H, K, V)
        cases[gate] = (x, S0, naive(*x, None, S0))
    return cases


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("gate", ["k3", "kimi", "k3_floor"])
def test_chunk_dense_gates(dense_case, variant, gate):
    x, S0, (o_ref, s_ref) = dense_case[gate]
    C = 32
    o, s, cs = chunk_kda_pallas(*x, initial_state=S0, output_final_state=True, chunk_size=C,
                                return_chunk_states=True, interpret=True, variant=variant)
    assert o.shape == o_ref.shape and cs.shape == (B, 4, H, K, V)
    assert rel_err(o, o_ref) <= TOL
    assert rel_err(s, s_ref) <= TOL
    if gate == "k3":   # chunk boundary states (T=100 is not a multiple of 32)
        states = token_states(*x, S0)
        for c, end in enumerate([32, 64, 96, 100]):
            assert rel_err(cs[:, c], states[:, end - 1]) <= TOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunk_default_chunk64_no_init_block_v(variant):
    T = 130
    x = make_inputs(111, 1, T, H, K, V)
    o_ref, s_ref = naive(*x)
    o, s = chunk_kda_pallas(*x, output_final_state=True, interpret=True, variant=variant,
                            block_v=16)
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunk_single_token(variant):
    x = make_inputs(121, B, 1, H, K, V, gate="kimi")
    S0 = make_state(122, B, H, K, V)
    o_ref, s_ref = naive(*x, None, S0)
    o, s = chunk_kda_pallas(*x, initial_state=S0, output_final_state=True, chunk_size=16,
                            interpret=True, variant=variant)
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL


@pytest.fixture(scope="module")
def varlen_case():
    lens = [5, 40, 0, 70, 1, 33]
    T = sum(lens)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    x = make_inputs(131, 1, T, H, K, V, gate="kimi")
    init = make_state(132, len(lens), H, K, V)
    expect = chunk_reference(*x, initial_state=init, output_final_state=True,
                             cu_seqlens=cu, chunk_size=16, return_chunk_states=True)
    return cu, x, init, expect


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunk_varlen(varlen_case, variant):
    cu, x, init, (o_ref, s_ref, cs_ref) = varlen_case
    o, s, cs = chunk_kda_pallas(*x, initial_state=init, output_final_state=True,
                                cu_seqlens=cu, chunk_size=16, return_chunk_states=True,
                                interpret=True, variant=variant)
    assert rel_err(o, o_ref) <= TOL
    assert rel_err(s, s_ref) <= TOL
    used = int(ref.varlen_chunk_offsets(cu, 16)[-1])
    assert rel_err(cs[:, :used], cs_ref[:, :used]) <= TOL
    np.testing.assert_array_equal(np.asarray(s[2]), np.asarray(init[2]))   # empty sequence


@pytest.mark.parametrize("variant", VARIANTS)
def test_recurrent_dense_and_varlen(varlen_case, variant):
    T = 11
    x = make_inputs(141, B, T, H, K, V, gate="k3")
    S0 = make_state(142, B, H, K, V)
    o_ref, s_ref = naive(*x, None, S0)
    o, s = fused_recurrent_kda_pallas(*x, initial_state=S0, output_final_state=True,
                                      interpret=True, variant=variant)
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL
    cu, xv, init, (o_ref, s_ref, _) = varlen_case
    o, s = fused_recurrent_kda_pallas(*xv, initial_state=init, output_final_state=True,
                                      cu_seqlens=cu, interpret=True, variant=variant)
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL


POOL_CASES = {
    "mixed": [3, -1, 0, -1, 5],
    "leading_pad": [-1, -1, 2, 6, -1],
    "all_pad": [-1, -1, -1, -1, -1],
    "outside_pool": [7, 2, -2 ** 31, 9, 4],   # S = 7: ids past the pool are padding, not the last slot
}


@pytest.fixture(scope="module")
def pool_inputs():
    S = 7
    pool = make_state(151, S, H, K, V)
    x = make_inputs(152, 5, 1, H, K, V, gate="kimi")
    return pool, x


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", list(POOL_CASES))
def test_pool_decode(pool_inputs, variant, case):
    pool, x = pool_inputs
    slots = jnp.asarray(POOL_CASES[case], jnp.int32)
    o, new_pool = fused_recurrent_kda_pool_pallas(*x, pool, slots, interpret=True,
                                                  variant=variant)
    o_ref, pool_ref = pool_reference(*x, pool, slots)
    assert o.shape == (5, 1, H, V)
    assert rel_err(o, o_ref) <= TOL if float(jnp.abs(o_ref).max()) > 0 else True
    touched = {s for s in POOL_CASES[case] if 0 <= s < pool.shape[0]}
    for sid in range(pool.shape[0]):
        if sid in touched:
            assert rel_err(new_pool[sid], pool_ref[sid]) <= TOL
        else:   # stale / free slots: bit-identical
            np.testing.assert_array_equal(np.asarray(new_pool[sid]), np.asarray(pool[sid]))
    for b, sid in enumerate(POOL_CASES[case]):
        if sid not in touched:
            assert float(jnp.abs(o[b]).max()) == 0.0


@pytest.mark.parametrize("variant", VARIANTS)
def test_pool_multi_token_donated(variant):
    """T=3 speculative-style decode, pool donated through an enclosing jit."""
    S = 4
    pool = make_state(161, S, H, K, V)
    x = make_inputs(162, 3, 3, H, K, V, gate="k3_floor")
    slots = jnp.asarray([2, 0, -1], jnp.int32)
    o_ref, pool_ref = pool_reference(*x, pool, slots)
    step = jax.jit(lambda p, *a: fused_recurrent_kda_pool_pallas(*a, p, slots, interpret=True,
                                                                variant=variant)[::-1],
                   donate_argnums=0)
    new_pool, o = step(jnp.array(pool), *x)
    assert rel_err(o, o_ref) <= TOL
    assert rel_err(new_pool, pool_ref) <= TOL
    np.testing.assert_array_equal(np.asarray(new_pool[1]), np.asarray(pool[1]))
    np.testing.assert_array_equal(np.asarray(new_pool[3]), np.asarray(pool[3]))


def test_ops_dispatch_interpret(monkeypatch, varlen_case):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    cu, x, init, (o_ref, s_ref, _) = varlen_case
    o, s = chunk_kda(*x, initial_state=init, output_final_state=True, cu_seqlens=cu,
                     chunk_size=16, backend="interpret")
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL
    monkeypatch.setenv(dispatch.ENV_VAR, "interpret")
    o, s = fused_recurrent_kda(*x, initial_state=init, output_final_state=True, cu_seqlens=cu,
                               backend="reference")   # env forces the Pallas kernel
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL
    pool = make_state(171, 3, H, K, V)
    xd = [a[:, :2].reshape((2, 1) + a.shape[2:]) for a in x]
    o, p = fused_recurrent_kda_pool(*xd, pool, jnp.asarray([1, -1], jnp.int32))
    o_r, p_r = pool_reference(*xd, pool, jnp.asarray([1, -1]))
    assert rel_err(o, o_r) <= TOL and rel_err(p, p_r) <= TOL


@pytest.mark.parametrize("platform,variant", [("tpu", "tpu"), ("cuda", "gpu")])
def test_kernels_lower_for_accelerators(platform, variant):
    """Cross-platform lowering smoke test (no device needed): the Pallas -> Mosaic TPU and
    Pallas -> Triton lowerings accept the kernels at production tile sizes."""
    from jax import export

    Kp = Vp = 128
    x = make_inputs(181, 1, 70, 1, Kp, Vp)
    S0 = make_state(182, 1, 1, Kp, Vp)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]

    def lower(f, *args):
        export.export(jax.jit(f), platforms=[platform], disabled_checks=checks)(*args)

    lower(lambda *a: chunk_kda_pallas(*a[:5], initial_state=a[5], output_final_state=True,
                                      return_chunk_states=True, variant=variant), *x, S0)
    pool = make_state(183, 3, 1, Kp, Vp)
    xd = [a[:, :1] for a in x]
    lower(lambda *a: fused_recurrent_kda_pool_pallas(*a, jnp.asarray([2], jnp.int32),
                                                     variant=variant), *xd, pool)


@pytest.mark.parametrize("prec,tol", [("tf32x3", 1e-5), ("tf32", 3e-3), ("bf16", 3e-2)])
def test_chunk_tensor_core_precisions_in_interpret_mode(dense_case, prec, tol):
    """The GPU kernel's tensor-core options, with TF32 rounding emulated in interpret mode:
    three-pass TF32 stays within fp32 tolerance of the token scan, one pass is measurably coarser
    (so the emulation is really in effect) but bounded; the gate sums take three TF32 passes
    whenever the data products are not IEEE (the 0/1 masks are exact in TF32)."""
    x, S0, (o_ref, s_ref) = dense_case["k3_floor"]
    run = lambda p: chunk_kda_pallas(*x, initial_state=S0, output_final_state=True, interpret=True,
                                     variant="gpu", dot_precision=p)
    o, s = run(prec)
    assert rel_err(o, o_ref) <= tol and rel_err(s, s_ref) <= tol
    if prec in ("tf32", "bf16"):
        o_hi, _ = run("highest")
        assert rel_err(o, o_ref) > 10 * rel_err(o_hi, o_ref)


def test_chunk_tensor_core_precision_lowers_for_cuda():
    from jax import export

    x = make_inputs(191, 1, 70, 1, 128, 128)
    S0 = make_state(192, 1, 1, 128, 128)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for prec in ("tf32x3", "tf32", "bf16"):
        export.export(jax.jit(lambda *a: chunk_kda_pallas(*a[:5], initial_state=a[5], output_final_state=True,
                                                          variant="gpu", dot_precision=prec)),
                      platforms=["cuda"], disabled_checks=checks)(*x, S0)
    with pytest.raises(ValueError, match="dot_precision"):
        chunk_kda_pallas(*x, initial_state=S0, variant="gpu", interpret=True, dot_precision="fp8")


@pytest.mark.parametrize("block_c,prec", [(8, "highest"), (16, "tf32x3")])
def test_gpu_chunk_runs_each_chunk_as_smaller_tiles(dense_case, varlen_case, block_c, prec):
    """The compiled GPU kernel runs a C-token chunk as C / block_c WY tiles (C = 64 in one tile
    does not fit an H200's shared memory): the same recurrence, so outputs, final states and the
    chunk states every C tokens (not every block_c) match the token scan, dense and varlen."""
    x, S0, (o_ref, s_ref) = dense_case["k3_floor"]
    o, s, cs = chunk_kda_pallas(*x, initial_state=S0, output_final_state=True, chunk_size=32,
                                return_chunk_states=True, interpret=True, variant="gpu",
                                block_c=block_c, dot_precision=prec)
    assert cs.shape == (B, 4, H, K, V)
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL
    states = token_states(*x, S0)
    for c, end in enumerate([32, 64, 96, 100]):
        assert rel_err(cs[:, c], states[:, end - 1]) <= TOL
    cu, xv, init, (ov_ref, sv_ref, _) = varlen_case
    ov, sv = chunk_kda_pallas(*xv, initial_state=init, output_final_state=True, cu_seqlens=cu,
                              chunk_size=32, interpret=True, variant="gpu", block_c=block_c,
                              dot_precision=prec)
    assert rel_err(ov, ov_ref) <= TOL and rel_err(sv, sv_ref) <= TOL
    with pytest.raises(ValueError, match="block_c"):
        chunk_kda_pallas(*x, chunk_size=32, interpret=True, variant="gpu", block_c=12)


def test_compiled_defaults_and_decode_token_blocks():
    """What the compiled GPU kernels default to (tensor-core tf32x3, 16-token tiles) and what the
    interpreted ones keep; a decode row runs a 1-token block, not 1 token + 7 of padding."""
    assert default_dot_precision("gpu", False) == "tf32x3"
    assert default_dot_precision("gpu", True) == default_dot_precision("tpu", False) == "highest"
    assert default_block_c(64, False) == 16 and default_block_c(64, True) == 64
    assert [fit_block_t(8, T) for T in (1, 2, 3, 5, 8, 9, 100)] == [1, 2, 4, 8, 8, 8, 8]
    assert fit_block_t(8, 1, "tpu") == 8     # TPU token tiles need 8 rows
    with pytest.raises(ValueError, match="block_t"):
        fit_block_t(6, 4)


@pytest.mark.parametrize("form,prec,block_k,prep", [
    ("split", "highest", None, "xla"), ("split", "tf32x3", None, "xla"), ("split", "highest", 4, "xla"),
    ("staged", "highest", None, "xla"), ("staged", "tf32x3", 4, "xla"), ("staged", "highest", None, "pallas"),
    ("split", "tf32x3", 4, "pallas")])
def test_split_forms_match_the_token_scan(dense_case, varlen_case, form, prec, block_k, prep):
    """The "split" GPU form (every chunk's state-independent terms batched in XLA, the kernel doing
    only the four state products per chunk, on the state whole or in K-blocks) and the "staged" form
    (the kernel doing only the two products of the next state, every chunk's output batched after it):
    outputs, final and chunk states match the token scan, dense and varlen (with an empty sequence);
    with a bf16 state they round per chunk exactly as the fused form does. Their chunk terms come
    from XLA's batched prep or from the prep kernels (``prep``)."""
    x, S0, (o_ref, s_ref) = dense_case["k3_floor"]
    split_kw = dict(block_k=block_k, prep=prep)
    run = lambda form, **kw: chunk_kda_pallas(*x, initial_state=S0, output_final_state=True, chunk_size=32,
                                              interpret=True, variant="gpu", dot_precision=prec,
                                              form=form, **kw)
    o, s, cs = run(form, return_chunk_states=True, **split_kw)
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL
    states = token_states(*x, S0)
    for c, end in enumerate([32, 64, 96, 100]):
        assert rel_err(cs[:, c], states[:, end - 1]) <= TOL
    (ob, sb), (of, sf) = (run(f, state_dtype="bfloat16", **kw) for f, kw in ((form, split_kw), ("fused", {})))
    assert rel_err(ob, of) <= 1e-3 and rel_err(sb, sf) <= 1e-3
    assert sb.dtype == jnp.float32 and bool(jnp.all(sb.astype(jnp.bfloat16).astype(jnp.float32) == sb))
    cu, xv, init, (ov_ref, sv_ref, cv_ref) = varlen_case
    ov, sv, cv = chunk_kda_pallas(*xv, initial_state=init, output_final_state=True, cu_seqlens=cu,
                                  chunk_size=16, interpret=True, variant="gpu", dot_precision=prec,
                                  form=form, return_chunk_states=True, **split_kw)
    assert rel_err(ov, ov_ref) <= TOL and rel_err(sv, sv_ref) <= TOL
    used = int(ref.varlen_chunk_offsets(cu, 16)[-1])
    assert rel_err(cv[:, :used], cv_ref[:, :used]) <= TOL
    np.testing.assert_array_equal(np.asarray(sv[2]), np.asarray(init[2]))   # empty sequence
    with pytest.raises(ValueError, match="block_k"):
        chunk_kda_pallas(*x, interpret=True, variant="gpu", form="split", block_k=6)
    with pytest.raises(ValueError, match="block_k"):
        chunk_kda_pallas(*x, interpret=True, variant="gpu", block_k=8)
    with pytest.raises(ValueError, match="form"):
        chunk_kda_pallas(*x, interpret=True, variant="tpu", form="split")
    with pytest.raises(ValueError, match="form"):
        chunk_kda_pallas(*x, interpret=True, variant="gpu", form="blocked")
    with pytest.raises(ValueError, match="prep"):
        chunk_kda_pallas(*x, interpret=True, variant="gpu", prep="pallas")      # the fused form has none
    with pytest.raises(ValueError, match="prep"):
        chunk_kda_pallas(*x, interpret=True, variant="gpu", form="staged", prep="triton")


@pytest.mark.parametrize("form,num_stages,prep", [("split", None, "xla"), ("staged", 2, "xla"),
                                                 ("staged", None, "pallas")])
def test_split_forms_lower_for_cuda(form, num_stages, prep):
    """Both forms lower for CUDA; ``num_stages`` (Triton's pipelining of the chunk loop's loads)
    reaches the Triton call, and bad values or the TPU variant are refused."""
    from jax import export

    x = make_inputs(193, 1, 70, 2, 128, 128)
    S0 = make_state(194, 1, 2, 128, 128)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = export.export(jax.jit(lambda *a: chunk_kda_pallas(
        *a[:5], initial_state=a[5], output_final_state=True, return_chunk_states=True, variant="gpu",
        form=form, num_stages=num_stages, prep=prep)), platforms=["cuda"], disabled_checks=checks)(*x, S0).mlir_module()
    assert f"num_stages = {num_stages or 1} : i32" in text
    # the XLA prep's products take the kernel's tensor cores too: three-pass TF32, not CUDA-core fp32
    assert "num_primitive_operations = 3" in text
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == (4 if prep == "pallas" else 1)  # + pairs, solve, columns
    assert prep_precision("tf32x3", True) == prep_precision("highest", False) == "highest"
    for bad, variant in ((0, "gpu"), (5, "gpu"), (2, "tpu")):
        with pytest.raises(ValueError, match="num_stages"):
            chunk_kda_pallas(*x[:5], interpret=True, variant=variant, num_stages=bad)


@pytest.mark.parametrize("block_v,num_warps", [(8, 1), (16, 2), (32, 8)])
def test_gpu_program_shape_options(pool_inputs, block_v, num_warps):
    """The GPU kernels' per-program options (the state tile [K, block_v] and the warps it is spread
    over, swept by the device script): every choice computes the same pooled decode; num_warps
    reaches the Triton call; bad values and the TPU variant are refused."""
    from jax import export

    pool, x = pool_inputs
    slots = jnp.asarray(POOL_CASES[list(POOL_CASES)[0]], jnp.int32)
    o_ref, pool_ref = pool_reference(*x, pool, slots)
    o, new_pool = fused_recurrent_kda_pool_pallas(*x, pool, slots, interpret=True, variant="gpu",
                                                  block_v=block_v, num_warps=num_warps)
    assert rel_err(o, o_ref) <= TOL and rel_err(new_pool, pool_ref) <= TOL
    xd = make_inputs(195, 2, 1, 2, 128, 128)
    pool_d = make_state(196, 3, 2, 128, 128)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = export.export(jax.jit(lambda *a: fused_recurrent_kda_pool_pallas(
        *a, jnp.asarray([2, 0], jnp.int32), variant="gpu", block_v=4 * block_v, num_warps=num_warps)),
        platforms=["cuda"], disabled_checks=checks)(*xd, pool_d).mlir_module()
    # grid (V blocks, heads, rows): a head's V blocks are neighbouring programs (they share its operands in L2)
    assert f"num_warps = {num_warps} : i32" in text
    assert f"grid_x = {128 // (4 * block_v)} : i32, grid_y = 2 : i32, grid_z = 2 : i32" in text
    for bad in (3, 0, 32):
        with pytest.raises(ValueError, match="num_warps"):
            fused_recurrent_kda_pool_pallas(*x, pool, slots, interpret=True, variant="gpu", num_warps=bad)
    with pytest.raises(ValueError, match="num_warps"):
        fused_recurrent_kda_pool_pallas(*x, pool, slots, interpret=True, variant="tpu", num_warps=2)


# The three computations of the test below, each jitted whole and once for every gate: one program apiece, not one
# per primitive of an eager call (CI time).
@functools.partial(jax.jit, static_argnames="C")
def _xla_split_prep(q, k, v, g, beta, C):
    from pallas_kernels.kda import pallas_kda as pk

    return pk._split_prep(q, k, v, g, beta, C)


@functools.partial(jax.jit, static_argnames="C")
def _fused_chunk_prep(q, k, v, g, beta, C):
    """The fused kernel's per-chunk terms, chunk by chunk: [H, NB*C, D] inputs -> [H, NB, ...] terms."""
    from pallas_kernels.kda import pallas_kda as pk

    per_chunk = lambda t: t.reshape((t.shape[0], -1, C) + t.shape[2:])
    return jax.vmap(jax.vmap(functools.partial(pk._chunk_prep, prec="highest")))(
        *map(per_chunk, (q, k, v, g, beta)))


@functools.partial(jax.jit, static_argnames=("C", "cols"))
def _kernel_split_prep(q, k, v, g, beta, C, cols):
    """The prep kernels on the caller's token-major operands (q unscaled: the kernels scale it)."""
    from pallas_kernels.kda import pallas_kda as pk

    return pk._call_gpu_prep(*(jnp.moveaxis(t, 0, 1) for t in (q / K ** -0.5, k, v, g, beta)),
                             C=C, scale=K ** -0.5, prec="highest", interpret=True, cols=cols)


@pytest.mark.parametrize("gate", ["k3", "kimi", "k3_floor"])
def test_split_prep_blocks_match_the_fused_chunk_terms(gate):
    """The split / staged forms' chunk terms -- XLA's batched prep (the reference's block form: A_qk
    and the triangular inverse joined from [s, s] blocks) and the prep kernels (pairs from 16-token
    tiles on chip, the block triangular solve, the columns in one or two K-blocks; from the caller's
    token-major bf16-or-fp32 operands, q scaled inside) -- equal the fused kernel's per-chunk terms
    (full-size masked products) for every chunk and head, the gate at its floor included."""
    from pallas_kernels.kda import pallas_kda as pk

    Hh, C, NB = 2, 64, 2
    x = make_inputs(211, 1, NB * C, Hh, K, V, gate=gate)
    heads = lambda t: jnp.moveaxis(t[0].astype(jnp.float32), 1, 0)      # [H, NB*C, D]
    q, k, v, g = map(heads, x[:4])
    beta = heads(x[4])[..., None]
    got = _xla_split_prep(q, k, v, g, beta, C)
    want = _fused_chunk_prep(q, k, v, g, beta, C)
    kernel = lambda cols: _kernel_split_prep(q, k, v, g, beta, C, cols)
    assert pk.prep_col_blocks(K, V, 8) == 2 and pk.prep_col_blocks(K, V) == 1 and pk.prep_col_blocks(24, 32, 8) == 1
    for name, a, c, c2, b in zip(("W", "U", "Q", "Aqk", "Kd", "decay"), got, kernel(None), kernel(8), want):
        b = b.reshape((Hh, NB * b.shape[2]) + b.shape[3:])
        assert a.shape == c.shape == c2.shape == b.shape, name
        tol = 2e-5 if name == "decay" else TOL
        assert rel_err(a, b) <= TOL and rel_err(c, b) <= tol and rel_err(c2, b) <= tol, name


def test_gpu_kernels_read_the_callers_layout(pool_inputs):
    """The GPU variant's fused / recurrent kernels read the caller's [tokens, H, D] in its dtype (q
    scaled and every operand widened to fp32 in the kernel) and write o in it: bf16 inputs give the
    reference's outputs and pool, skipped rows zeros; the lowered pooled decode step moves no operand
    through an XLA transpose (the head-major TPU layout would)."""
    from jax import export

    pool, x = pool_inputs
    xb = [a.astype(jnp.bfloat16) for a in x]
    slots = jnp.asarray(POOL_CASES["mixed"], jnp.int32)
    o, new_pool = fused_recurrent_kda_pool_pallas(*xb, pool, slots, interpret=True, variant="gpu")
    o_ref, pool_ref = pool_reference(*xb, pool, slots)
    assert o.dtype == jnp.bfloat16 and rel_err(o.astype(jnp.float32), o_ref.astype(jnp.float32)) <= 1e-2
    assert rel_err(new_pool, pool_ref) <= TOL
    assert not bool(jnp.any(o[jnp.asarray(POOL_CASES["mixed"]) < 0].astype(jnp.float32)))
    oc, sc = chunk_kda_pallas(*xb, initial_state=pool[:5], output_final_state=True, chunk_size=16,
                              interpret=True, variant="gpu")
    oc_ref, sc_ref = naive(*xb, None, pool[:5])
    assert oc.dtype == jnp.bfloat16 and rel_err(oc.astype(jnp.float32), oc_ref.astype(jnp.float32)) <= 1e-2
    assert rel_err(sc, sc_ref) <= TOL
    xd = [a.astype(jnp.bfloat16) for a in make_inputs(195, 2, 1, 2, 128, 128)]
    pool_d = make_state(196, 3, 2, 128, 128)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    lowered = lambda variant: export.export(jax.jit(lambda *a: fused_recurrent_kda_pool_pallas(
        *a, jnp.asarray([2, -1], jnp.int32), variant=variant)), platforms=["cuda" if variant == "gpu" else "tpu"],
        disabled_checks=checks)(*xd, pool_d).mlir_module()
    assert "stablehlo.transpose" not in lowered("gpu") and "stablehlo.transpose" in lowered("tpu")
