"""Hold a model's dense projection weights transposed, `[in, out]`, once, at load time.

Checkpoints store a projection PyTorch-style, `W [out, in]`, and the layers compute `x W^T`. XLA:CPU
multiplies a few rows by a weight it reads along its minor axis (`[in, out]`, the form `x W`
contracts) faster than by one it must read across rows: on the 2-core CPU host, decode-sized
projections (1-32 rows) ran 1.2-2x faster with the weight pre-transposed, because the CPU matmul
otherwise re-packs the transposed operand on every call (decode step, 2-core host: Kimi-Linear test
checkpoint 1 / 8 rows 5.4-6.8 -> 4.5-4.7 / 9.4-9.8 -> 8.1-8.3 ms; see benchmarks/README.md). The
transposition is exact; the products are the same, though XLA may sum them in another order, so
logits agree to fp32 rounding. It costs one pass over the weights at start-up and no memory once the
original is dropped. GPU/TPU matmuls take either form at full speed, so the engine only does this
on the reference (CPU) backend.

Dense routed experts (as stored, or expanded from MXFP4 by `k3jax/dequantize.py`) are held
`[E, in, out]` the same way, and the CPU grouped matmul multiplies by them in that form
(`gmm(..., rhs_layout="in_out")`): 1.4-1.9x faster at 32-128 routed rows on the same host. MXFP4
experts stay packed along their input axis.

Left as stored: weights read other than through `Linear.__call__` (`kv_b_proj`, which MLA reshapes
into per-head absorption matrices; it reads it through `Linear.out_in()`), the router and a tied
embedding.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from k3jax.layers.linear import Linear
from k3jax.layers.moe import MoE, MXFP4Params

KEEP_OUT_IN = ("kv_b_proj",)  # reshaped by name into per-head matrices; transposing would cost a copy per step


def transpose_dense_weights(model):
    """-> a `Model` sharing everything with `model` except that its dense projections, dense routed
    experts and untied lm_head are held transposed (`[in, out]`); the same function. Idempotent."""
    module = nnx.merge(model.graphdef, model.params)
    for path, node in list(nnx.iter_graph(module)):
        if not isinstance(node, Linear) or node.in_out or (path and path[-1] in KEEP_OUT_IN):
            continue
        w = node.weight
        node.weight = nnx.Param(jnp.asarray(w[...]).T, axes=_swapped(w))
        node.in_out = True
    for _, node in list(nnx.iter_graph(module)):
        if not isinstance(node, MoE) or node.experts_in_out or isinstance(node.w1, MXFP4Params):
            continue
        for name in ("w1", "w2", "w3"):
            w = getattr(node, name)
            setattr(node, name, nnx.Param(jnp.swapaxes(jnp.asarray(w[...]), 1, 2), axes=_swapped(w)))
        node.experts_in_out = True
    if not model.cfg.tie_word_embeddings and not module.head_in_out:
        module.lm_head = nnx.Param(jnp.asarray(module.lm_head[...]).T, axes=_swapped(module.lm_head))
        module.head_in_out = True
    graphdef, params = nnx.split(module)
    return dataclasses.replace(model, graphdef=graphdef, params=params)


def _swapped(param) -> tuple:
    """Logical axes with the last two swapped, as the data is."""
    axes = tuple(getattr(param, "axes", None) or (None,) * param[...].ndim)
    return axes[:-2] + (axes[-1], axes[-2])
