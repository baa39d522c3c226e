"""MXFP4 format tests (spec §3.3, golden from §5, notes from §8)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe.mxfp4 import (
    E2M1_MAGNITUDES,
    E2M1_VALUES,
    MXFP4Weight,
    decode_e2m1,
    dequantize_mxfp4,
    e8m0_to_float,
    quantize_mxfp4,
)

_MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def naive_dequant(packed, scale, group_size):
    """Element-by-element transcription of spec §3.3 (independent of the implementation)."""
    packed = np.asarray(packed)
    scale = np.asarray(scale)
    lead = packed.shape[:-2]
    r, half = packed.shape[-2:]
    p2 = packed.reshape(-1, r, half)
    s2 = scale.reshape(-1, r, scale.shape[-1])
    out = np.zeros((p2.shape[0], r, 2 * half), np.float64)
    for b in range(p2.shape[0]):
        for i in range(r):
            for c in range(2 * half):
                n = (int(p2[b, i, c // 2]) >> (4 * (c % 2))) & 0xF
                v = _MAGS[n & 7] * (-1.0 if n & 8 else 1.0)
                out[b, i, c] = v * 2.0 ** (int(s2[b, i, c // group_size]) - 127)
    return out.reshape(*lead, r, 2 * half)


def test_golden_group4():
    packed = np.array([[0x10, 0x32, 0x54, 0x76]], np.uint8)
    scale = np.array([[127, 128]], np.uint8)
    out = dequantize_mxfp4(packed, scale, group_size=4)
    np.testing.assert_array_equal(np.asarray(out), [[0, 0.5, 1, 1.5, 4, 6, 8, 12]])


def test_default_group_size_is_32():
    # 32 columns = 16 bytes, one group; repeat the golden bytes.
    packed = np.tile(np.array([0x10, 0x32, 0x54, 0x76], np.uint8), 4)[None]
    out = dequantize_mxfp4(packed, np.array([[126]], np.uint8))
    np.testing.assert_array_equal(np.asarray(out)[0, :8], np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6]) / 2)
    with pytest.raises(ValueError):
        dequantize_mxfp4(packed, np.array([[126, 126]], np.uint8))  # wrong group count for gs=32


def test_all_codes_and_nibble_order():
    np.testing.assert_array_equal(E2M1_VALUES[:8], _MAGS)
    np.testing.assert_array_equal(E2M1_VALUES[8:], -np.array(_MAGS))
    np.testing.assert_array_equal(E2M1_MAGNITUDES, _MAGS)
    np.testing.assert_array_equal(np.asarray(decode_e2m1(jnp.arange(16))), E2M1_VALUES)
    # byte 0xF1: low nibble 1 (+0.5) is column 0, high nibble 0xF (-6) is column 1.
    out = dequantize_mxfp4(np.array([[0xF1, 0x9A]], np.uint8), np.array([[127]], np.uint8), group_size=4)
    np.testing.assert_array_equal(np.asarray(out), [[0.5, -6.0, -1.0, -0.5]])


def test_e8m0_edges():
    s = np.asarray(e8m0_to_float(jnp.array([0, 1, 121, 126, 127, 128, 254, 255], jnp.uint8)))
    np.testing.assert_array_equal(s[:7], [2.0**-127, 2.0**-126, 2.0**-6, 0.5, 1.0, 2.0, 2.0**127])
    assert np.isnan(s[7])


def test_random_matches_naive_multi_group_batched():
    rng = np.random.default_rng(0)
    gs = 32
    packed = rng.integers(0, 256, size=(2, 3, 48), dtype=np.uint8)  # C = 96 -> 3 groups per row
    scale = rng.integers(121, 127, size=(2, 3, 3), dtype=np.uint8)  # 2^-6 .. 2^-1
    # force distinct scales within each row so a wrong group index cannot pass
    scale[..., 0], scale[..., 1], scale[..., 2] = 121, 124, 126
    want = naive_dequant(packed, scale, gs)
    got = dequantize_mxfp4(packed, scale, dtype=jnp.float32, group_size=gs)
    assert got.shape == (2, 3, 96) and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), want)
    got_bf16 = dequantize_mxfp4(packed, scale, dtype=jnp.bfloat16, group_size=gs)
    assert got_bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got_bf16.astype(jnp.float32)), want)  # exact in bf16
    # also under jit with leading dims
    got_jit = jax.jit(lambda p, s: dequantize_mxfp4(p, s, group_size=gs))(packed, scale)
    np.testing.assert_array_equal(np.asarray(got_jit), want)


@pytest.mark.parametrize("gs", [4, 32])
def test_quantize_roundtrip(gs):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 5, 4 * gs)) * np.exp(rng.uniform(-6, 0, size=(2, 5, 1)))
    packed, scale = quantize_mxfp4(w, group_size=gs)
    assert packed.shape == (2, 5, 2 * gs) and packed.dtype == np.uint8
    assert scale.shape == (2, 5, 4) and scale.dtype == np.uint8
    d = np.asarray(dequantize_mxfp4(packed, scale, group_size=gs), np.float64)
    s = np.exp2(scale.astype(np.float64) - 127)
    q = d.reshape(2, 5, 4, gs) / s[..., None]
    # every group's max |q| is in {3, 4, 6} (spec sanity check)
    assert set(np.unique(np.abs(q).max(-1))) <= {3.0, 4.0, 6.0}
    # round-to-nearest: error at most half the widest grid gap (1.0) times the scale
    err = np.abs(d - w).reshape(2, 5, 4, gs)
    assert np.all(err <= 1.0 * s[..., None] + 1e-12)
    np.testing.assert_array_equal(naive_dequant(packed, scale, gs), d)
    # quantising an exactly representable tensor reproduces its values
    p2, s2 = quantize_mxfp4(d, group_size=gs)
    np.testing.assert_array_equal(np.asarray(dequantize_mxfp4(p2, s2, group_size=gs)), d)


def test_quantize_rounding_details():
    # group of 4 with max 6 -> scale 1: values straddling grid points
    w = np.array([[6.0, 2.5, 0.25, -0.74, 5.0, 0.75, -3.5, 1.25]])
    packed, scale = quantize_mxfp4(w, group_size=4)
    d = np.asarray(dequantize_mxfp4(packed, scale, group_size=4))
    # ties go to the even code: 2.5 -> 2 (code 4), 0.25 -> 0 (code 0), 5 -> 4 (code 6),
    # 0.75 -> 1 (code 2), 3.5 -> 4 (code 6), 1.25 -> 1 (code 2)
    np.testing.assert_array_equal(d, [[6.0, 2.0, 0.0, -0.5, 4.0, 1.0, -4.0, 1.0]])
    z, zs = quantize_mxfp4(np.zeros((1, 8)), group_size=4)
    assert np.all(z == 0) and np.all(zs == 127)


def test_pytree():
    rng = np.random.default_rng(2)
    w = MXFP4Weight.from_float(rng.standard_normal((3, 4, 64)) * 0.05)
    assert w.shape == (3, 4, 64) and w.ndim == 3 and w.group_size == 32
    leaves, treedef = jax.tree_util.tree_flatten(w)
    assert len(leaves) == 2 and all(l.dtype == jnp.uint8 for l in leaves)
    w2 = jax.tree_util.tree_unflatten(treedef, leaves)
    assert w2.group_size == 32
    out = jax.jit(lambda t: t.dequantize(jnp.bfloat16))(w)
    assert out.shape == (3, 4, 64) and out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(w[1].dequantize()), np.asarray(w.dequantize())[1])
    w4 = MXFP4Weight(packed=w.packed, scale=jnp.repeat(w.scale, 8, axis=-1), group_size=4)
    assert jax.tree_util.tree_structure(w4) != treedef  # group_size is static metadata
