"""Bias-free linear layer storing its weight PyTorch-style `[out, in]`, as checkpoints ship it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers import initializers as init


class Linear(nnx.Module):
    """`y = x W^T` with `W [out, in]`; `axes` names the logical sharding axes of (out, in)."""

    def __init__(self, in_features: int, out_features: int, axes: tuple[str | None, str | None], *,
                 dtype, rngs: nnx.Rngs, std: float | None = None):
        std = in_features ** -0.5 if std is None else std
        self.weight = nnx.Param(init.normal(rngs, (out_features, in_features), dtype, std), axes=axes)

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...]
        return jnp.einsum("...i,oi->...o", x.astype(w.dtype), w)
