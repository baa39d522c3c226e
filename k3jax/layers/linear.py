"""Bias-free linear layer storing its weight PyTorch-style `[out, in]`, as checkpoints ship it, or
transposed `[in, out]` once at start-up for backends that multiply that form faster
(see `k3jax/weight_layout.py`), optionally with per-row low-rank adapters (`k3jax/lora.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import lora
from k3jax.layers import initializers as init


class Linear(nnx.Module):
    """`y = x W^T` with `W [out, in]`; `axes` names the logical sharding axes of (out, in).

    `in_out` (static) says the weight is held as `[in, out]` = W^T (axes swapped with it); the
    layer computes the same product either way. Code that reads the weight itself uses `out_in()`.
    `lora_a` / `lora_b` (set by `k3jax.lora.attach`) hold adapter slots; inside a `lora.rows(...)`
    context each row adds its slot's `(x A^T) B^T`."""

    def __init__(self, in_features: int, out_features: int, axes: tuple[str | None, str | None], *,
                 dtype, rngs: nnx.Rngs, std: float | None = None):
        std = in_features ** -0.5 if std is None else std
        self.weight = nnx.Param(init.normal(rngs, (out_features, in_features), dtype, std), axes=axes)
        self.in_out = False

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...]
        y = jnp.einsum("...i,io->...o" if self.in_out else "...i,oi->...o", x.astype(w.dtype), w)
        if not hasattr(self, "lora_a"):
            return y
        d = lora.apply(x, self.lora_a[...], self.lora_b[...])
        return y if d is None else y + d.astype(y.dtype)

    def out_in(self) -> jax.Array:
        """The weight as `[out, in]`, however it is held."""
        w = self.weight[...]
        return w.T if self.in_out else w

    def lora_factors(self) -> tuple[jax.Array, jax.Array] | None:
        """This step's rows' adapter factors (A [B, R, in], B [B, out, R]), or None (no adapters here)."""
        if not hasattr(self, "lora_a"):
            return None
        return lora.gather(self.lora_a[...], self.lora_b[...])
