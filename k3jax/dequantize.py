"""Expand a model's MXFP4 routed experts to dense weights of the model dtype, once, at load time.

For backends without a fused dequantise-and-multiply (XLA:CPU): the packed form makes every step
decode each touched expert to fp32 elementwise before its matmul (k3-small on the 2-core CPU host:
decode step at 8 rows 111 ms packed, 32 ms with the experts expanded once; 32 rows 162 -> 86 ms).
The expansion is exact (E2M1 x 2^k is representable in fp32 and bf16), so logits and tokens are
bit-identical to the packed model; the price is memory, 8x the packed bytes at fp32. On GPU/TPU the
Pallas grouped matmul dequantises inside the tile and the experts stay packed.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from k3jax.layers.moe import MoE, MXFP4Params


def dequantize_experts(model, dtype=None):
    """-> a `Model` sharing everything with `model` except that its MXFP4 routed experts are dense
    `nnx.Param`s `[E, out, in]` in `dtype` (default: the model dtype; the same logical weights);
    `model` itself is returned when it has no MXFP4 experts.

    The engine expands them to fp32 on CPU whatever the model dtype: the CPU grouped matmul multiplies
    a few rows per expert in a loop, where XLA:CPU upcasts a bf16 dot and converts the whole stacked
    bf16 weight to fp32 outside the loop (k3-small bf16: 33 such converts, ~60 ms of a 121 ms decode
    step at 1 row). Products of E2M1 x 2^k weights with bf16 activations are exact in fp32 either way."""
    dtype = model.dtype if dtype is None else dtype
    if model.cfg.expert_format != "mxfp4":
        return model
    module = nnx.merge(model.graphdef, model.params)
    for path, node in list(nnx.iter_graph(module)):
        if not isinstance(node, MoE):
            continue
        for name in ("w1", "w2", "w3"):
            w = getattr(node, name)
            if isinstance(w, MXFP4Params):
                setattr(node, name, nnx.Param(w.value().dequantize(dtype=dtype),
                                              axes=("experts", "expert_mlp", None)))
    graphdef, params = nnx.split(module)
    cfg = dataclasses.replace(model.cfg, expert_format="dense")
    return dataclasses.replace(model, cfg=cfg, graphdef=graphdef, params=params)
