"""RMSNorm variants and the L2-norm of the spec (§2.1), all normalising in fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# The reference builds q_a_layernorm / kv_a_layernorm without an eps argument: class default 1e-6.
LORA_NORM_EPS = 1e-6
L2_NORM_EPS = 1e-6


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """`w * cast(x_f32 * rsqrt(mean(x_f32^2) + eps))`: normalise in fp32, cast, then scale (no 1+w)."""
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return y if weight is None else weight.astype(x.dtype) * y


def gated_rms_norm(o: jax.Array, weight: jax.Array, gate: jax.Array, eps: float) -> jax.Array:
    """KDA output norm: `RMSNorm_noweight(o) * w * sigmoid(gate)`, in fp32, cast to o's dtype."""
    of = o.astype(jnp.float32)
    y = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + eps)
    y = y * weight.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))
    return y.astype(o.dtype)


def l2_norm(x: jax.Array, eps: float = L2_NORM_EPS) -> jax.Array:
    """`x * rsqrt(sum(x^2) + eps)` over the last axis, in fp32."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype, axis: str = "embed"):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype), axes=(axis,))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)
