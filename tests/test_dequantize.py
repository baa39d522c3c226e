"""`dequantize_experts`: MXFP4 routed experts expanded once to dense weights, exactly."""

from __future__ import annotations

import numpy as np

import k3jax
from k3jax.dequantize import dequantize_experts
from pallas_kernels.moe.mxfp4 import dequantize_mxfp4


def test_expanded_experts_hold_the_packed_values_and_give_the_same_logits():
    m = k3jax.load_model("tiny-k3", seed=4)
    assert m.cfg.expert_format == "mxfp4"
    d = dequantize_experts(m)
    assert d.cfg.expert_format == "dense" and m.cfg.expert_format == "mxfp4"  # the input is left as it was
    moe = next(l for l in range(m.cfg.num_hidden_layers) if m.cfg.is_moe(l))
    packed = m.params["layers"][moe]["block_sparse_moe"]["w2"]
    dense = d.params["layers"][moe]["block_sparse_moe"]["w2"][...]
    want = dequantize_mxfp4(packed["weight_packed"][...], packed["weight_scale"][...], m.dtype,
                            m.cfg.mxfp4_group_size)
    assert dense.dtype == m.dtype and dense.shape == want.shape
    np.testing.assert_array_equal(np.asarray(dense), np.asarray(want))
    ids = np.random.default_rng(0).integers(0, 256, (2, 40))
    np.testing.assert_array_equal(d.forward(ids), m.forward(ids))


def test_dense_experts_are_left_alone():
    m = k3jax.load_model("tiny-kimi-linear", seed=4)
    assert m.cfg.expert_format == "dense" and dequantize_experts(m) is m
