"""Expand a model's MXFP4 routed experts to dense weights, once, at load time (the engine: fp32 on CPU).

For backends without a fused dequantise-and-multiply (XLA:CPU): the packed form makes every step
decode each touched expert to fp32 elementwise before its matmul (k3-small on the 2-core CPU host:
decode step at 8 rows 111 ms packed, 32 ms with the experts expanded once; 32 rows 162 -> 86 ms).
The expansion is exact (E2M1 x 2^k is representable in fp32 and bf16), so logits and tokens are
bit-identical to the packed model; the price is memory, 8x the packed bytes at fp32. On GPU/TPU the
Pallas grouped matmul dequantises inside the tile and the experts stay packed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.moe import MoE, MXFP4Params
from pallas_kernels.moe.mxfp4 import dequantize_mxfp4


@functools.partial(jax.jit, static_argnames=("dtype", "group_size"))
def expand_mxfp4(packed: jax.Array, scale: jax.Array, dtype, group_size: int = 32) -> jax.Array:
    """`dequantize_mxfp4` as one fused program: eagerly each of its elementwise steps is a pass over all
    the experts (k3-small's 33 expert weights: ~1.8 s eager, ~0.2 s fused, on the 2-core host)."""
    return dequantize_mxfp4(packed, scale, dtype=dtype, group_size=group_size)


def dequantize_experts(model, dtype=None):
    """-> a `Model` sharing everything with `model` except that its routed experts are dense `nnx.Param`s
    `[E, out, in]` in `dtype` (the same logical weights): MXFP4 experts expanded (to the model dtype when
    `dtype` is None), dense ones of another dtype converted (only when `dtype` is given); `model`
    itself when nothing changes.

    The engine gives the CPU fp32 experts whatever the model dtype: the CPU grouped matmul multiplies
    a few rows per expert in a loop, where XLA:CPU upcasts a bf16 dot and converts the whole stacked
    bf16 weight to fp32 outside the loop (k3-small bf16: 33 such converts, ~60 ms of a 121 ms decode
    step at 1 row; the loop alone at 128 / 1024 routed rows: 3.4 / 7.1 ms in bf16, 2.0 / 5.7 ms in fp32).
    Products of bf16 (or E2M1 x 2^k) weights with bf16 activations are exact in fp32 either way."""
    widen = dtype is not None
    dtype = model.dtype if dtype is None else jnp.dtype(dtype)
    module = nnx.merge(model.graphdef, model.params)
    changed = False
    for path, node in list(nnx.iter_graph(module)):
        if not isinstance(node, MoE):
            continue
        for name in ("w1", "w2", "w3"):
            w = getattr(node, name)
            if isinstance(w, MXFP4Params):
                q = w.value()
                setattr(node, name, nnx.Param(expand_mxfp4(q.packed, q.scale, dtype=jnp.dtype(dtype),
                                                           group_size=q.group_size),
                                              axes=("experts", "expert_mlp", None)))
                changed = True
            elif widen and w[...].dtype != dtype:
                setattr(node, name, nnx.Param(jnp.asarray(w[...], dtype), axes=getattr(w, "axes", None)))
                changed = True
    if not changed:
        return model
    graphdef, params = nnx.split(module)
    cfg = dataclasses.replace(model.cfg, expert_format="dense")
    return dataclasses.replace(model, cfg=cfg, graphdef=graphdef, params=params)
