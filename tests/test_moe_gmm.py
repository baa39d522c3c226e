"""Grouped matmul (MoE expert GEMM): reference, Pallas kernels (interpret), routing helper."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import (MXFP4Weight, gmm, gmm_blocked, gmm_cpu, gmm_looped, gmm_reference, quantize_mxfp4,
                                route_and_sort)

from pallas_kernels.moe.blocked import _rounds_held, block_rows_for, num_blocks, rounds_for
from pallas_kernels.moe.kernel import gmm_pallas, make_group_metadata, make_tile_group_ranges

from numeric_checks import assert_close

CPU_FORMS = {"blocked": gmm_blocked, "looped": gmm_looped,
             "rounds": lambda *a, **kw: gmm_looped(*a, rounds=2, **kw)}  # 2 all-expert rounds, then the loop

M, K, N = 40, 128, 32
GROUPS = [5, 0, 13, 0, 9, 7]  # empty groups, sizes not multiples of tm=8; sum 34 < M (6 padded rows)
TILING = (8, 64, 16)  # 2 K steps; MXFP4: 2 scale groups per K tile, 4 per row (full-K scale path)


def _naive(x, w_nk, sizes):
    """float64 loop reference: rows sorted by group, rows past the sum are zero."""
    x = np.asarray(x, np.float64)
    out = np.zeros((x.shape[0], w_nk.shape[1]))
    off = 0
    for g, sz in enumerate(sizes):
        out[off:off + sz] = x[off:off + sz] @ np.asarray(w_nk[g], np.float64).T
        off += sz
    return out


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[sum(GROUPS):] = np.nan  # padded rows hold garbage; they must come out as exact zeros
    w = rng.standard_normal((len(GROUPS), N, K)).astype(np.float32)
    # MXFP4: every row spans 4 groups of 32 with distinct E8M0 bytes in 121..126
    codes = rng.integers(0, 256, size=(len(GROUPS), N, K // 2), dtype=np.uint8)
    scale = rng.integers(121, 127, size=(len(GROUPS), N, K // 32), dtype=np.uint8)
    scale[..., 0], scale[..., 1] = 121, 126
    wq = MXFP4Weight(packed=jnp.asarray(codes), scale=jnp.asarray(scale))
    gs = jnp.asarray(GROUPS, jnp.int32)
    ref_dense = np.asarray(gmm_reference(jnp.asarray(x), jnp.asarray(w), gs))
    ref_q = np.asarray(gmm_reference(jnp.asarray(x), wq, gs))
    return dict(x=jnp.asarray(x), w=jnp.asarray(w), wq=wq, gs=gs, ref_dense=ref_dense, ref_q=ref_q)


def test_reference_matches_naive(data):
    n = sum(GROUPS)
    x = np.asarray(data["x"])
    assert_close(data["ref_dense"][:n], _naive(x[:n], np.asarray(data["w"]), GROUPS)[:n])
    wd = np.asarray(data["wq"].dequantize())
    assert_close(data["ref_q"][:n], _naive(x[:n], wd, GROUPS)[:n])
    assert np.all(data["ref_dense"][n:] == 0) and np.all(data["ref_q"][n:] == 0)


def test_metadata_covers_every_row_once():
    for sizes, m_pad, tm in [(GROUPS, 40, 8), ([0, 0, 0], 16, 8), ([16, 0, 0], 16, 8), ([1, 1, 1, 13], 16, 4)]:
        gs = jnp.asarray(sizes, jnp.int32)
        wt, wg, wr, st, en = map(np.asarray, jax.jit(make_group_metadata, static_argnums=(1, 2))(gs, m_pad, tm))
        assert len(wt) == m_pad // tm + len(sizes) - 1
        assert np.all(np.diff(wt) >= 0) and np.all(np.diff(wr) >= 0)
        hits = np.zeros(m_pad, int)
        for t, g in zip(wt, wg):
            rows = np.arange(t * tm, (t + 1) * tm)
            hits[rows[(rows >= st[g]) & (rows < en[g])]] += 1
        np.testing.assert_array_equal(hits, (np.arange(m_pad) < sum(sizes)).astype(int))
        assert set(range(m_pad // tm)) <= set(wt.tolist())  # every tile is written
        ids, s, e, lo, hi = map(np.asarray, jax.jit(make_tile_group_ranges, static_argnums=(1, 2))(gs, m_pad, tm))
        hits = np.zeros(m_pad, int)
        for t in range(m_pad // tm):
            for j in range(lo[t], hi[t]):
                rows = np.arange(t * tm, (t + 1) * tm)
                hits[rows[(rows >= s[j]) & (rows < e[j])]] += 1
        np.testing.assert_array_equal(hits, (np.arange(m_pad) < sum(sizes)).astype(int))


@pytest.mark.parametrize("variant", ["mosaic", "triton"])
@pytest.mark.parametrize("quant", [False, True], ids=["dense", "mxfp4"])
def test_kernel_matches_reference(data, variant, quant):
    rhs = data["wq"] if quant else data["w"]
    ref = data["ref_q"] if quant else data["ref_dense"]
    fn = jax.jit(lambda x, r, g: gmm_pallas(x, r, g, tiling=TILING, interpret=True, variant=variant))
    out = np.asarray(fn(data["x"], rhs, data["gs"]))
    assert out.shape == (M, N) and out.dtype == np.float32
    assert_close(out, ref)
    assert np.all(out[sum(GROUPS):] == 0)


@pytest.mark.parametrize("sizes", [[0, 0, 0], [24, 0, 0], [0, 3, 21]], ids=["all_empty", "one_full", "exact_sum"])
def test_kernel_edge_group_sizes(sizes):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((24, 64)), jnp.float32)
    w = MXFP4Weight.from_float(rng.standard_normal((3, 16, 64)) * 0.05)
    gs = jnp.asarray(sizes, jnp.int32)
    out = gmm_pallas(x, w, gs, tiling=(8, 64, 16), interpret=True, variant="mosaic")
    assert_close(out, gmm_reference(x, w, gs))


def test_bf16_and_default_tiling():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((20, 64)), jnp.bfloat16)
    w = MXFP4Weight.from_float(rng.standard_normal((3, 32, 64)) * 0.05)
    gs = jnp.asarray([7, 0, 11], jnp.int32)
    out = gmm_pallas(x, w, gs, interpret=True)  # default tiles (whole small dims)
    ref = gmm_reference(x, w, gs)  # same bf16 inputs, fp32 accumulation
    assert_close(out, ref, rtol=1e-2)
    out16 = gmm_pallas(x, w, gs, interpret=True, preferred_element_type=jnp.bfloat16)
    assert out16.dtype == jnp.bfloat16
    for backend in ("auto", "reference", "interpret"):  # None: lhs's dtype on every path (the kernel had raised)
        outn = gmm(x, w, gs, backend=backend, preferred_element_type=None)
        assert outn.dtype == jnp.bfloat16
        assert_close(outn.astype(jnp.float32), out16.astype(jnp.float32), rtol=1e-2)


def test_ops_dispatch(data, monkeypatch):
    monkeypatch.delenv("K3JAX_KERNELS", raising=False)
    ref = gmm(data["x"], data["wq"], data["gs"], backend="reference")
    np.testing.assert_array_equal(np.asarray(ref), data["ref_q"])
    out = gmm(data["x"], data["wq"], data["gs"], backend="interpret", tiling=TILING)
    assert_close(out, data["ref_q"])


@pytest.mark.parametrize("form", sorted(CPU_FORMS))
@pytest.mark.parametrize("quant", [False, True], ids=["dense", "mxfp4"])
@pytest.mark.parametrize("tm", [None, 2, 4, 8, 64])
def test_cpu_forms_match_reference(data, form, quant, tm):
    """The CPU paths (block-padded gather-by-expert, loop over experts) == ragged_dot on every row
    (NaN padding rows -> 0)."""
    ref = data["ref_q"] if quant else data["ref_dense"]
    fn = CPU_FORMS[form]
    out = jax.jit(lambda x, w, g: fn(x, w, g, block_rows=tm))(data["x"], data["wq"] if quant else data["w"], data["gs"])
    assert_close(out, ref)
    assert np.all(np.asarray(out)[sum(GROUPS):] == 0)


def test_blocked_random_routings_and_block_bound():
    """Fresh random group splits (empty groups, one group with everything, sum < M): exact block bound, matches."""
    rng = np.random.default_rng(11)
    g, k, n = 8, 64, 24
    w = jnp.asarray(rng.standard_normal((g, n, k)), jnp.float32)
    for m in (1, 3, 17, 64, 130):
        for trial in range(3):
            sizes = rng.multinomial(max(0, m - trial), rng.dirichlet(np.full(g, 0.3)))  # `trial` padding rows
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
            gs = jnp.asarray(sizes, jnp.int32)
            tm = block_rows_for(m, g)
            assert sum(-(-int(s) // tm) for s in sizes) <= num_blocks(m, g, tm)
            want = _naive(x, np.asarray(w), sizes)
            blocked, looped = gmm_blocked(x, w, gs), gmm_looped(x, w, gs)
            assert_close(blocked, want)
            assert_close(looped, want)
            np.testing.assert_array_equal(np.asarray(looped), np.asarray(blocked))  # same bits per row


def test_blocked_rows_do_not_depend_on_batch():
    """A row's result is bit-identical whatever else shares the call and whatever the block size >= 2,
    so a token's MoE output does not depend on its batch (decode buckets, prefill chunk sizes)."""
    rng = np.random.default_rng(12)
    g, k, n = 8, 128, 64
    w = MXFP4Weight.from_float(jnp.asarray(rng.standard_normal((g, n, k)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((96, k)), jnp.float32)
    alone = gmm_blocked(x[:1], w, jnp.zeros(g, jnp.int32).at[3].set(1))[0]
    for m in (2, 5, 96):
        for tm in (None, 2, 64):
            sizes = np.zeros(g, np.int32)
            sizes[3] = m
            for fn in (gmm_blocked, gmm_looped):
                out = fn(x[:m], w, jnp.asarray(sizes), block_rows=tm)
                np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(alone))
    # and with other groups in use: the row's block still sees only its own expert's weight
    sizes = np.array([7, 0, 4, 1, 0, 30, 2, 0], np.int32)
    xs = jnp.concatenate([x[1:8], x[8:12], x[:1], x[12:44]])
    for fn in (gmm_blocked, gmm_looped, gmm_cpu):
        np.testing.assert_array_equal(np.asarray(fn(xs, w, jnp.asarray(sizes))[11]), np.asarray(alone))


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_all_expert_rounds_give_the_loops_bits(layout):
    """Rows multiplied in the all-expert rounds (one batched product over the stacked weights per
    round) get exactly the bits the per-expert loop gives them, for any number of rounds (also more
    than any group needs), skewed and empty groups, padding rows (NaN in, 0 out), dense and MXFP4
    weights: so `rounds_for`'s choice, which depends on the step's shape, never changes a token."""
    rng = np.random.default_rng(21)
    g, k, n = 8, 64, 48
    dense = rng.standard_normal((g, k, n) if layout == "in_out" else (g, n, k)).astype(np.float32)
    weights = [jnp.asarray(dense)]
    if layout == "out_in":
        weights.append(MXFP4Weight.from_float(jnp.asarray(dense)))
    for m in (16, 130, 300):
        sizes = rng.multinomial(m - 3, rng.dirichlet(np.full(g, 0.4)))  # skewed, often empty groups
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[m - 3:] = np.nan
        x, gs = jnp.asarray(x), jnp.asarray(sizes, jnp.int32)
        for w in weights:
            want = np.asarray(gmm_looped(x, w, gs, block_rows=block_rows_for(m, g), rhs_layout=layout))
            assert np.all(np.isfinite(want)) and np.all(want[m - 3:] == 0)
            # 2-row blocks: the held rows call for every round compiled (`_rounds_held`), up to 7
            for tm in (block_rows_for(m, g), 2):
                for rounds in (1, 3, 7):
                    got = gmm_looped(x, w, gs, block_rows=tm, rhs_layout=layout, rounds=rounds)
                    np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"m={m} tm={tm} rounds={rounds}")
            np.testing.assert_array_equal(np.asarray(gmm_cpu(x, w, gs, rhs_layout=layout)), want)
    xb, wb = x.astype(jnp.bfloat16), weights[0].astype(jnp.bfloat16)  # bf16 rows: the loop alone
    np.testing.assert_array_equal(np.asarray(gmm_cpu(xb, wb, gs, rhs_layout=layout), np.float32),
                                  np.asarray(gmm_looped(xb, wb, gs, rhs_layout=layout), np.float32))
    assert rounds_for(15, 8, 2) == 0 and rounds_for(16, 8, 2) == 1  # from two rows per expert
    assert rounds_for(1024, 16, 32) == 2 and rounds_for(130, 8, 32) == 1
    # at run time the rule sees the rows the groups hold (a padded batch's padding is in none), capped
    # at the rounds compiled: no all-expert round for a step that is mostly padding
    held = lambda rows, rounds: int(_rounds_held(jnp.int32(rows), 16, 32, rounds))  # noqa: E731
    assert [held(r, 2) for r in (0, 31, 32, 511, 512, 1024, 4096)] == [0, 0, 1, 1, 1, 2, 2]


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_rows_same_bits_for_every_block_size(layout):
    """Within the block sizes the CPU forms use (2-32, `block_rows_for`), a row's bits do not depend on
    the block size, in either weight layout; the engine's expert parallelism relies on it (a rank
    holding 1/4 of the experts picks larger blocks for the same rows)."""
    rng = np.random.default_rng(14)
    assert {block_rows_for(m, g) for m in (1, 8, 64, 512, 4096) for g in (1, 2, 8, 256)} <= {2, 4, 8, 16, 32}
    for k, n in ((16, 32), (32, 16), (128, 64)):
        w = jnp.asarray(rng.standard_normal((1, k, n) if layout == "in_out" else (1, n, k)), jnp.float32)
        x = jnp.asarray(rng.standard_normal((64, k)), jnp.float32)
        gs = jnp.asarray([64], jnp.int32)
        want = np.asarray(gmm_looped(x, w, gs, block_rows=2, rhs_layout=layout))
        for tm in (4, 8, 16, 32):
            np.testing.assert_array_equal(np.asarray(gmm_looped(x, w, gs, block_rows=tm, rhs_layout=layout)), want)


def test_auto_on_cpu_is_the_cpu_form(data, monkeypatch):
    monkeypatch.delenv("K3JAX_KERNELS", raising=False)
    if jax.default_backend() != "cpu":
        pytest.skip("CPU dispatch")
    for w in (data["wq"], data["w"]):
        out = gmm(data["x"], w, data["gs"])
        np.testing.assert_array_equal(np.asarray(out), np.asarray(gmm_cpu(data["x"], w, data["gs"])))


@pytest.mark.parametrize("backend,form", [("auto", None), ("reference", None), ("interpret", None),
                                          (None, "blocked"), (None, "looped")])
def test_in_out_layout_matches_out_in(data, backend, form):
    """Experts held transposed (`rhs [G, K, N]`, rhs_layout="in_out") give the rows of the [G, N, K]
    form: same products (XLA may order the sums differently), padded rows exactly zero."""
    w_kn = jnp.swapaxes(data["w"], 1, 2)
    if form is None:
        out = gmm(data["x"], w_kn, data["gs"], backend=backend, rhs_layout="in_out")
    else:
        out = CPU_FORMS[form](data["x"], w_kn, data["gs"], rhs_layout="in_out")
    assert_close(out, data["ref_dense"])
    assert np.all(np.asarray(out)[sum(GROUPS):] == 0)


def test_in_out_layout_is_for_dense_weights(data):
    with pytest.raises(ValueError, match="MXFP4"):
        gmm(data["x"], data["wq"], data["gs"], rhs_layout="in_out")
    with pytest.raises(ValueError, match="rhs_layout"):
        gmm(data["x"], data["w"], data["gs"], rhs_layout="kn")
    with pytest.raises(ValueError, match="contracting"):  # [G, N, K] passed as in_out: K=128 != N=32
        gmm(data["x"], data["w"], data["gs"], rhs_layout="in_out")


def test_route_and_sort_moe_roundtrip():
    rng = np.random.default_rng(3)
    t, k, e, d, n = 9, 2, 5, 32, 16
    ids = np.stack([rng.choice(e, size=k, replace=False) for _ in range(t)])
    ids[4, 1] = -1  # dropped slot
    x = rng.standard_normal((t, d)).astype(np.float32)
    w = rng.standard_normal((e, n, d)).astype(np.float32)
    sort_idx, gs = route_and_sort(jnp.asarray(ids), e)
    np.testing.assert_array_equal(np.asarray(gs), np.bincount(ids[ids >= 0], minlength=e))
    sorted_ids = ids.reshape(-1)[np.asarray(sort_idx)]
    assert np.all(np.diff(sorted_ids[: int(gs.sum())]) >= 0) and sorted_ids[-1] == -1
    xs = jnp.asarray(x)[sort_idx // k]
    y = gmm(xs, jnp.asarray(w), gs, backend="reference")
    y = jnp.zeros_like(y).at[sort_idx].set(y).reshape(t, k, n)
    want = np.stack([[x[i] @ w[j].T if j >= 0 else np.zeros(n) for j in ids[i]] for i in range(t)])
    assert_close(y, want)


def test_quantized_weights_from_quantizer_match_dense(data):
    # gmm on an MXFP4Weight == gmm on its exact dequantisation
    w = np.asarray(data["w"]) * 0.02
    p, s = quantize_mxfp4(w)
    wq = MXFP4Weight(packed=jnp.asarray(p), scale=jnp.asarray(s))
    a = gmm_reference(data["x"], wq, data["gs"])
    b = gmm_reference(data["x"], wq.dequantize(), data["gs"])
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------- lowering / device
_TRITON_CHECKS = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


@pytest.mark.parametrize("platform,variant", [("tpu", "mosaic"), ("cuda", "triton")])
@pytest.mark.parametrize("quant", [False, True], ids=["dense", "mxfp4"])
def test_kernel_lowers_at_k3_shapes(platform, variant, quant):
    """Lower (not run) the compiled kernels for TPU Mosaic / GPU Triton at K3 expert shapes.

    Catches block-shape / unsupported-op errors of the jax-side lowering on a CPU-only
    host; the backend compilers (libtpu Mosaic, Triton->PTX) only run on a device.
    """
    m, k, n, g = 128, 3584, 3072, 8
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    if quant:
        w = MXFP4Weight(jax.ShapeDtypeStruct((g, n, k // 2), jnp.uint8), jax.ShapeDtypeStruct((g, n, k // 32), jnp.uint8))
    else:
        w = jax.ShapeDtypeStruct((g, n, k), jnp.bfloat16)
    fn = jax.jit(lambda a, b, c: gmm_pallas(a, b, c, variant=variant))
    exp = jax.export.export(fn, platforms=[platform], disabled_checks=_TRITON_CHECKS)(
        x, w, jax.ShapeDtypeStruct((g,), jnp.int32))
    text = exp.mlir_module()
    assert ("tpu_custom_call" in text) if platform == "tpu" else ("xla.gpu.triton" in text)


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "tpu"), reason="needs a GPU/TPU")
@pytest.mark.parametrize("quant", [False, True], ids=["dense", "mxfp4"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_device_compiled_kernel(quant, dtype):
    """Device check: compiled (non-interpret) kernel vs reference at a mid-size MoE shape."""
    rng = np.random.default_rng(5)
    m, k, n, g = 256, 1024, 512, 8
    sizes = [40, 0, 77, 13, 0, 64, 31, 11]  # sum 236 < 256
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    if quant:
        w = MXFP4Weight.from_float(rng.standard_normal((g, n, k)) * 0.05)
    else:
        w = jnp.asarray(rng.standard_normal((g, n, k)) * 0.05, dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    out = jax.jit(lambda a, b, c: gmm_pallas(a, b, c))(x, w, gs)
    ref = gmm_reference(x, w, gs)
    assert_close(out, ref, rtol=1e-5 if dtype == jnp.float32 else 2e-2)
    assert np.all(np.asarray(out)[sum(sizes):] == 0)


@pytest.mark.parametrize("form", ["auto", "looped", "rounds", "blocked", "reference", "interpret"])
@pytest.mark.parametrize("quant", [False, True], ids=["dense", "mxfp4"])
def test_group_offset_reads_a_window_of_a_larger_stack(data, form, quant):
    """`group_offset` (a layer's experts inside every scanned layer's stack, k3jax/layer_scan.py): the
    same bits as the window alone, for every form, with the offset traced; other experts never read."""
    w = data["wq"] if quant else data["w"]
    g = len(GROUPS)
    rng = np.random.default_rng(4)
    if quant:  # a stack of 3 layers' experts, this one in the middle
        other = lambda a: jnp.asarray(rng.integers(0, 256, a.shape, dtype=np.uint8))  # noqa: E731
        stack = MXFP4Weight(jnp.concatenate([other(w.packed), w.packed, other(w.packed)]),
                            jnp.concatenate([other(w.scale) * 0 + 127, w.scale, other(w.scale) * 0 + 127]))
    else:
        other = jnp.asarray(rng.standard_normal(w.shape).astype(np.float32))
        stack = jnp.concatenate([other, w, jnp.full_like(w, jnp.nan)])  # a neighbour read would show as NaN
    kw = dict(preferred_element_type=jnp.float32)
    call = {"auto": lambda x, s, gs, o: gmm(x, s, gs, group_offset=o, **kw),
            "looped": lambda x, s, gs, o: gmm_looped(x, s, gs, group_offset=o, **kw),
            "rounds": lambda x, s, gs, o: gmm_looped(x, s, gs, group_offset=o, rounds=1, block_rows=2, **kw),
            "blocked": lambda x, s, gs, o: gmm_blocked(x, s, gs, group_offset=o, **kw),
            "reference": lambda x, s, gs, o: gmm(x, s, gs, group_offset=o, backend="reference", **kw),
            "interpret": lambda x, s, gs, o: gmm(x, s, gs, group_offset=o, backend="interpret", **kw)}[form]
    out = np.asarray(jax.jit(call)(data["x"], stack, data["gs"], jnp.int32(g)))
    alone = {"rounds": lambda x, s, gs: gmm_looped(x, s, gs, rounds=1, block_rows=2, **kw)}.get(
        form, lambda x, s, gs: call(x, s, gs, None))
    want = np.asarray(jax.jit(alone)(data["x"], w, data["gs"]))
    np.testing.assert_array_equal(out, want)
    assert_close(out, data["ref_q"] if quant else data["ref_dense"])
