"""Dense GLU MLP: layer-0 FFN and the MoE shared experts."""

from __future__ import annotations

import jax
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layers.activations import glu
from k3jax.layers.linear import Linear


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, hidden: int, width: int, *, dtype, rngs: nnx.Rngs):
        self.act, self.beta, self.linear_beta = cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta
        self.gate_proj = Linear(hidden, width, ("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.up_proj = Linear(hidden, width, ("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.down_proj = Linear(width, hidden, ("embed", "mlp"), dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(glu(self.act, self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))
