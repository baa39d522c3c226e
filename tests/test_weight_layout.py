"""`transpose_dense_weights`: dense projections held [in, out], the same function."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import k3jax
from k3jax.weight_layout import transpose_dense_weights


@pytest.fixture(scope="module", params=["tiny-k3", "tiny-kimi-linear"])
def pair(request):
    m = k3jax.load_model(request.param, seed=5)
    before = [np.asarray(x) for x in jax.tree.leaves(m.params)]
    t = transpose_dense_weights(m)
    # the input model is left as it was
    for a, b in zip(before, jax.tree.leaves(m.params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    return m, t


def _layer(params, cfg, pred):
    return params["layers"][next(l for l in range(cfg.num_hidden_layers) if pred(l))]


def test_weights_are_transposed_except_the_ones_read_by_name(pair):
    m, t = pair
    cfg = m.cfg
    mla_m, mla_t = _layer(m.params, cfg, cfg.is_mla)["self_attn"], _layer(t.params, cfg, cfg.is_mla)["self_attn"]
    kda_m, kda_t = (_layer(p, cfg, lambda l: not cfg.is_mla(l))["self_attn"] for p in (m.params, t.params))
    for a, b in ((mla_m["o_proj"], mla_t["o_proj"]), (kda_m["q_proj"], kda_t["q_proj"]),
                 (kda_m["o_proj"], kda_t["o_proj"])):
        wa, wb = np.asarray(a["weight"][...]), np.asarray(b["weight"][...])
        assert wb.shape == wa.shape[::-1]
        np.testing.assert_array_equal(wb, wa.T)
        assert tuple(b["weight"].axes) == tuple(a["weight"].axes)[::-1]
    # kv_b_proj is reshaped into per-head matrices by name: kept [out, in]
    np.testing.assert_array_equal(np.asarray(mla_t["kv_b_proj"]["weight"][...]),
                                  np.asarray(mla_m["kv_b_proj"]["weight"][...]))
    if not cfg.tie_word_embeddings:
        np.testing.assert_array_equal(np.asarray(t.params["lm_head"][...]), np.asarray(m.params["lm_head"][...]).T)
    # a second pass changes nothing
    again = transpose_dense_weights(t)
    for a, b in zip(jax.tree.leaves(t.params), jax.tree.leaves(again.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_same_logits_and_greedy_tokens(pair):
    m, t = pair
    ids = np.random.default_rng(1).integers(0, 256, (2, 40))
    a, b = m.forward(ids), t.forward(ids)
    # the same products over the same values; XLA may order the sum differently for the two layouts
    assert float(np.abs(a - b).max() / np.abs(a).max()) < 1e-5
    np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))  # the same greedy choice at every position


def test_dense_experts_are_transposed_and_packed_ones_kept():
    from k3jax.dequantize import dequantize_experts

    kl = k3jax.load_model("tiny-kimi-linear", seed=5)
    k3 = k3jax.load_model("tiny-k3", seed=5)
    for m, dense in ((kl, True), (k3, False), (dequantize_experts(k3), True)):
        t = transpose_dense_weights(m)
        moe = next(l for l in range(m.cfg.num_hidden_layers) if m.cfg.is_moe(l))
        a, b = m.params["layers"][moe]["block_sparse_moe"], t.params["layers"][moe]["block_sparse_moe"]
        if dense:
            for name in ("w1", "w2", "w3"):
                np.testing.assert_array_equal(np.asarray(b[name][...]), np.swapaxes(np.asarray(a[name][...]), 1, 2))
        else:
            np.testing.assert_array_equal(np.asarray(b["w2"]["weight_packed"][...]),
                                          np.asarray(a["w2"]["weight_packed"][...]))
        # the shape of test_same_logits_and_greedy_tokens' ids: the forwards of the first two models (the same
        # as `pair`'s) are the programs that test compiled
        ids = np.random.default_rng(2).integers(0, 256, (2, 40))
        x, y = m.forward(ids), t.forward(ids)
        # the same products summed in another order, through every layer: fp32 rounding (1.01e-5 seen on
        # an AMD EPYC host, below 1e-5 on the hosts of earlier runs)
        assert float(np.abs(x - y).max() / np.abs(x).max()) < 3e-5
