"""Block Attention Residuals (K3, spec §2.2): a per-token softmax over depth that replaces the
residual stream. No state crosses tokens, so decode needs no cache for it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers import initializers as init


def attn_res_mix(candidates: list[jax.Array], norm_w: jax.Array, proj_w: jax.Array, eps: float) -> jax.Array:
    """Mix raw candidates [..., H] by softmax_i(<rmsnorm(v_i), norm_w * proj_w>), all in fp32."""
    v = jnp.stack([c.astype(jnp.float32) for c in candidates], axis=0)  # [n, ..., H]
    u = norm_w.astype(jnp.float32) * proj_w.reshape(-1).astype(jnp.float32)  # [H]
    normed = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
    alpha = jax.nn.softmax(jnp.einsum("n...h,h->n...", normed, u), axis=0)  # [n, ...]
    return jnp.einsum("n...,n...h->...h", alpha, v).astype(candidates[-1].dtype)


class AttnResMixer(nnx.Module):
    """The (norm, proj) pair of one depth-mixing point; names match `*_res_norm` / `*_res_proj`."""

    def __init__(self, hidden: int, *, dtype, rngs: nnx.Rngs):
        self.norm = nnx.Param(init.normal(rngs, (hidden,), dtype, 0.1, mean=1.0), axes=("embed",))
        self.proj = nnx.Param(init.normal(rngs, (1, hidden), dtype, hidden ** -0.5), axes=(None, "embed"))

    def __call__(self, candidates: list[jax.Array], eps: float) -> jax.Array:
        return attn_res_mix(candidates, self.norm[...], self.proj[...], eps)
