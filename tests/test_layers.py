"""Layer-level goldens from the spec formulas (float64 NumPy written from spec §2), and equivalences."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import get_preset
from k3jax.layers.activations import situ_glu
from k3jax.layers.attn_res import attn_res_mix
from k3jax.layers.kda import causal_conv, kda_decay_gate
from k3jax.cache import causal_mask
from k3jax.layers.mla import MLA
from k3jax.layers.moe import route
from k3jax.layers.norms import l2_norm, rms_norm


def test_situ_golden():
    g = np.array([-30.0, -4.0, -0.5, 0.0, 0.7, 4.0, 30.0])
    u = np.array([100.0, 25.0, -3.0, 5.0, -50.0, 1.0, 0.2])
    sig = 1 / (1 + np.exp(-g))
    want = (4 * np.tanh(g / 4) * sig) * (25 * np.tanh(u / 25))
    got = situ_glu(jnp.asarray(g, jnp.float32), jnp.asarray(u, jnp.float32))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=1e-6)
    # hand values: SiTU(4, 25) = 4 tanh(1) sigma(4) * 25 tanh(1)
    assert abs(float(situ_glu(jnp.float32(4.0), jnp.float32(25.0))) - 100 * np.tanh(1) ** 2 / (1 + np.exp(-4))) < 1e-4


def test_decay_gates_golden():
    rng = np.random.default_rng(0)
    f = rng.normal(size=(5, 3, 4)) * 3
    a_log = np.array([-1.0, 0.0, 1.5])
    dt = rng.normal(size=(3, 4))
    z = f + dt
    a = np.exp(a_log)[:, None]
    k3 = -5.0 / (1 + np.exp(-(a * z)))
    kl = -a * np.log1p(np.exp(z))
    got_k3 = kda_decay_gate(jnp.asarray(f, jnp.float32), jnp.asarray(a_log), jnp.asarray(dt), -5.0)
    got_kl = kda_decay_gate(jnp.asarray(f, jnp.float32), jnp.asarray(a_log), jnp.asarray(dt), None)
    np.testing.assert_allclose(np.asarray(got_k3), k3, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got_kl), kl, rtol=1e-5)
    assert np.all(np.asarray(got_k3) >= -5.0) and np.all(np.asarray(got_k3) <= 0)


def test_attn_res_mix_golden():
    rng = np.random.default_rng(1)
    cands = [rng.normal(size=(2, 8)) * s for s in (1.0, 3.0, 0.2)]
    gamma, u = rng.normal(size=8), rng.normal(size=(1, 8))
    s = np.stack([(c / np.sqrt(np.mean(c * c, -1, keepdims=True) + 1e-5)) @ (gamma * u[0]) for c in cands])
    alpha = np.exp(s - s.max(0)) / np.exp(s - s.max(0)).sum(0)
    want = sum(alpha[i][:, None] * cands[i] for i in range(3))  # mixes the RAW candidates
    got = attn_res_mix([jnp.asarray(c, jnp.float32) for c in cands], jnp.asarray(gamma), jnp.asarray(u), 1e-5)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_norm_eps_traps():
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 16)) * 1e-3, jnp.float32)
    a, b = rms_norm(x, None, 1e-6), rms_norm(x, None, 1e-5)
    assert float(jnp.max(jnp.abs(a - b))) > 1e-3  # the eps is visible at small activations
    xn = np.asarray(x, np.float64)
    np.testing.assert_allclose(np.asarray(l2_norm(x)), xn / np.sqrt((xn ** 2).sum(-1, keepdims=True) + 1e-6), rtol=1e-5)


def test_router_uses_bias_for_selection_only():
    x = jnp.asarray(np.random.default_rng(3).normal(size=(6, 8)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(4).normal(size=(5, 8)), jnp.float32)
    bias = jnp.array([0.0, 10.0, 0.0, 0.0, -10.0])  # forces expert 1 in, expert 4 out
    ids, weights = route(x, w, bias, 2, True, 2.5)
    assert np.all(np.any(np.asarray(ids) == 1, axis=1)) and not np.any(np.asarray(ids) == 4)
    s = 1 / (1 + np.exp(-(np.asarray(x) @ np.asarray(w).T)))
    raw = np.take_along_axis(s, np.asarray(ids), 1)
    np.testing.assert_allclose(np.asarray(weights), 2.5 * raw / raw.sum(1, keepdims=True), rtol=1e-6)


def test_conv_window_continues_across_chunks():
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(2, 10, 6)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(6, 1, 4)), jnp.float32)
    zero = jnp.zeros((2, 3, 6))
    full, _ = causal_conv(x, zero, w, jnp.array([10, 10]))
    a, win = causal_conv(x[:, :4], zero, w, jnp.array([4, 4]))
    b, _ = causal_conv(x[:, 4:], win, w, jnp.array([6, 6]))
    np.testing.assert_allclose(np.asarray(jnp.concatenate([a, b], 1)), np.asarray(full), rtol=1e-6)
    # padding: a row with 2 real tokens keeps the window of its real tokens only
    _, w2 = causal_conv(x[:, :4], zero, w, jnp.array([2, 4]))
    np.testing.assert_allclose(np.asarray(w2[0, 1:]), np.asarray(x[0, :2]))
    np.testing.assert_allclose(np.asarray(w2[1]), np.asarray(x[1, 1:4]))


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear"])
def test_mla_absorbed_equals_expanded(preset):
    cfg = get_preset(preset)
    mla = MLA(cfg, dtype=jnp.float32, rngs=nnx.Rngs(7))
    x = jnp.asarray(np.random.default_rng(6).normal(size=(2, 12, cfg.hidden_size)), jnp.float32)
    lat = mla.latent(x)
    mask = causal_mask(jnp.broadcast_to(jnp.arange(12), (2, 12)), jnp.array([12, 9]), 12)
    a, b = mla.expanded(x, lat, mask), mla.absorbed(x, lat, mask)
    assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a)) < 1e-5
    assert lat.shape[-1] == cfg.kv_lora_rank + cfg.qk_rope_head_dim


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear"])
def test_moe_padding_goes_to_no_expert(preset):
    """Padding tokens (past a row's `valid`) are routed to no expert: their routed part is exactly 0 (only
    the shared experts remain), so a padded step's grouped matmuls hold only its real rows; real tokens
    get the bits they get with nothing masked."""
    from k3jax.layers.moe import MoE

    cfg = get_preset(preset)
    moe = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    x = jnp.asarray(np.random.default_rng(5).normal(size=(3, 8, cfg.hidden_size)), jnp.float32)  # [B, T, H]
    valid = jnp.asarray([8, 5, 0], jnp.int32)
    masked, whole = np.asarray(moe(x, valid=valid)), np.asarray(moe(x))
    real = np.arange(8)[None, :] < np.asarray(valid)[:, None]  # [B, T]
    np.testing.assert_array_equal(masked[real], whole[real])
    shared = np.asarray(moe.shared_experts(x.reshape(-1, cfg.hidden_size))).reshape(masked.shape)
    np.testing.assert_array_equal(masked[~real], shared[~real])
    assert not np.array_equal(whole[~real], shared[~real])  # unmasked, the experts add to the padding
