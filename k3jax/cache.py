"""The per-sequence decode state as explicit arrays, stacked per layer kind.

`ModelCache` is a pytree the jitted steps take (donated) and return. The MLA part is contiguous per
sequence here; the serving engine keeps the same per-token latent layout in pages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclass
class ModelCache:
    kda_conv: jax.Array  # [Lk, B, 3, W-1, P] fp32: last W-1 projected q/k/v inputs
    kda_state: jax.Array  # [Lk, B, N, K, V] fp32: delta-rule recurrent state
    mla_kv: jax.Array  # [Lm, B, S, kv_lora + rope]: normed latent c and shared k_r per token
    lengths: jax.Array  # [B] int32: tokens already absorbed

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.mla_kv.shape[2]


def cache_shapes(cfg: ModelConfig, batch: int, max_len: int, dtype) -> ModelCache:
    """Abstract shapes (jax.ShapeDtypeStruct) of a cache; used for planning and `init_cache`."""
    lk, lm = cfg.num_kda_layers, cfg.num_mla_layers
    n, d, w = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
    sds = jax.ShapeDtypeStruct
    return ModelCache(
        kda_conv=sds((lk, batch, 3, w - 1, n * d), jnp.float32),
        kda_state=sds((lk, batch, n, d, d), jnp.float32),
        mla_kv=sds((lm, batch, max_len, cfg.mla_latent_size), jnp.dtype(dtype)),
        lengths=sds((batch,), jnp.int32),
    )


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype) -> ModelCache:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes(cfg, batch, max_len, dtype))


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype) -> dict[str, int]:
    """Bytes by kind, e.g. K3 at batch 1: kda_state 434,110,464 B (spec §4.1)."""
    s = cache_shapes(cfg, batch, max_len, dtype)
    return {k: math.prod(v.shape) * v.dtype.itemsize
            for k, v in (("kda_conv", s.kda_conv), ("kda_state", s.kda_state), ("mla_kv", s.mla_kv))}
