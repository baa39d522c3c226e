"""Block Attention Residuals (K3, spec §2.2): a per-token softmax over depth that replaces the
residual stream. No state crosses tokens, so decode needs no cache for it."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers import initializers as init


def attn_res_mix(candidates: list[jax.Array], norm_w: jax.Array, proj_w: jax.Array, eps: float) -> jax.Array:
    """Mix raw candidates [..., H] by softmax_i(<rmsnorm(v_i), norm_w * proj_w>), all in fp32."""
    v = jnp.stack([c.astype(jnp.float32) for c in candidates], axis=0)  # [n, ..., H]
    return _mix(v, None, norm_w, proj_w, eps).astype(candidates[-1].dtype)


@jax.tree_util.register_dataclass
@dataclass
class DepthBank:
    """The closed block sums as a fixed-size array and a count, for a scan over layers (k3jax/layer_scan.py),
    where the unrolled form's growing list cannot be carried: values [NB, ..., H], count int32 []."""

    values: jax.Array
    count: jax.Array

    @classmethod
    def of(cls, bank: list[jax.Array], size: int) -> "DepthBank":
        values = jnp.zeros((size, *bank[0].shape), bank[0].dtype).at[:len(bank)].set(jnp.stack(bank))
        return cls(values, jnp.asarray(len(bank), jnp.int32))

    def push(self, x: jax.Array) -> "DepthBank":
        return DepthBank(jax.lax.dynamic_update_index_in_dim(self.values, x.astype(self.values.dtype), self.count, 0),
                         self.count + 1)

    def entries(self, n: int) -> list[jax.Array]:
        """The first n entries as the unrolled form's list (n static: the count after the scan)."""
        return [self.values[i] for i in range(n)]


def attn_res_mix_bank(bank: DepthBank, last: jax.Array, norm_w: jax.Array, proj_w: jax.Array,
                      eps: float) -> jax.Array:
    """`attn_res_mix(bank entries + [last])` over a DepthBank: entries past its count are masked out."""
    v = jnp.concatenate([bank.values.astype(jnp.float32), last.astype(jnp.float32)[None]], axis=0)
    n = v.shape[0]
    use = (jnp.arange(n) < bank.count) | (jnp.arange(n) == n - 1)
    return _mix(v, use, norm_w, proj_w, eps).astype(last.dtype)


def _mix(v: jax.Array, use: jax.Array | None, norm_w: jax.Array, proj_w: jax.Array, eps: float) -> jax.Array:
    """v [n, ..., H] fp32 (entries where `use` [n] is False take no weight) -> [..., H] fp32."""
    u = norm_w.astype(jnp.float32) * proj_w.reshape(-1).astype(jnp.float32)  # [H]
    normed = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
    score = jnp.einsum("n...h,h->n...", normed, u)  # [n, ...]
    if use is not None:
        score = jnp.where(use.reshape(-1, *(1,) * (score.ndim - 1)), score, -jnp.inf)
    alpha = jax.nn.softmax(score, axis=0)
    return jnp.einsum("n...,n...h->...h", alpha, v)


class AttnResMixer(nnx.Module):
    """The (norm, proj) pair of one depth-mixing point; names match `*_res_norm` / `*_res_proj`."""

    def __init__(self, hidden: int, *, dtype, rngs: nnx.Rngs):
        self.norm = nnx.Param(init.normal(rngs, (hidden,), dtype, 0.1, mean=1.0), axes=("embed",))
        self.proj = nnx.Param(init.normal(rngs, (1, hidden), dtype, hidden ** -0.5), axes=(None, "embed"))

    def __call__(self, candidates: list[jax.Array], eps: float) -> jax.Array:
        return attn_res_mix(candidates, self.norm[...], self.proj[...], eps)

    def mix(self, bank: list[jax.Array] | DepthBank, last: jax.Array, eps: float) -> jax.Array:
        """Mix the bank's entries and `last` (a list bank: unrolled layers; a DepthBank: scanned ones)."""
        if isinstance(bank, DepthBank):
            return attn_res_mix_bank(bank, last, self.norm[...], self.proj[...], eps)
        return self(bank + [last], eps)
