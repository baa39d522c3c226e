"""The per-sequence decode state as explicit arrays, stacked per layer kind.

`ModelCache` is a pytree the jitted steps take (donated) and return. The MLA part is contiguous per
sequence here; the serving engine keeps the same per-token latent layout in pages.
"""

from __future__ import annotations

import abc
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


# ---- cache views: how the model reads and writes state, independent of storage ----------------

class CacheView(abc.ABC):
    """What one forward pass needs from the cache, whatever stores it.

    `kda(j, b)` / `set_kda(j, window, state)` read and replace the j-th KDA layer's conv windows
    [B, 3, W-1, P] and recurrent state [B, N, K, V]; `mla(j, latent, valid)` stores the chunk's latents
    for the j-th MLA layer and returns (keys/values to attend over [B, S, 576], mask [B, T, S]).
    Views are trace-time objects: the arrays they hold are functional values inside one jit.
    """

    mla_form = "absorbed"

    @abc.abstractmethod
    def kda(self, j: int, b: int):
        """-> (conv windows [B, 3, W-1, P], recurrent state [B, N, K, V]) of the j-th KDA layer."""

    @abc.abstractmethod
    def set_kda(self, j: int, window: jax.Array, state: jax.Array) -> None:
        """Replace the j-th KDA layer's state after the chunk."""

    @abc.abstractmethod
    def mla(self, j: int, latent: jax.Array, valid: jax.Array):
        """Store the chunk's latents; -> (latents to attend over [B, S, W], mask [B, T, S])."""

    def mla_attend(self, j: int, latent: jax.Array, valid: jax.Array):
        """None: the j-th MLA layer attends over what `mla()` returns. A view may instead store the
        chunk's latents [B, T, W] itself and return `attend(q_lat [B, T, nh, r], q_rope [B, T, nh, dr],
        scale) -> ctx [B, T, nh, r]`, which attends in absorbed form where the cache lives: the paged
        kernel over the arena's pages at decode (no gathered copy of the context), or each rank over
        its own share of the context with the partial softmaxes combined (context parallelism)."""
        return None

    def scan_state(self):
        """The arrays this view carries from layer to layer, as a pytree: inside a scan over layers
        (k3jax/layer_scan.py) they ride in the loop carry, and the layers there pass traced indices j.
        Called at the end of each scanned group: a view drops what it held for that group's layers."""
        return ()

    def set_scan_state(self, state) -> None:
        """Take the carried arrays back (at the start of a scanned group, and after the scan)."""

    def scan_outputs(self):
        """What this view keeps of a scanned group's layers beyond the carry (a pytree, stacked over the
        groups by the scan and handed back through `set_scan_outputs`). Called at the end of each group."""
        return ()

    def set_scan_outputs(self, outputs) -> None:
        """Take the stacked `scan_outputs` back after the scan."""

    def kda_recurrence(self, j: int):
        """None: the j-th KDA layer runs its delta rule on the state `kda()` returned and hands the
        result to `set_kda`. A view that updates states where they are stored instead returns
        `fn(q, k, v, g, beta, window, scale, inputs) -> o`, which runs the recurrence, stores the new state
        and conv `window` itself, and leaves `set_kda` nothing to do."""
        return None


def causal_mask(q_pos: jax.Array, kv_len: jax.Array, num_keys: int) -> jax.Array:
    """q_pos: [B, T] absolute query positions; kv_len: [B] keys that exist. -> [B, T, S] bool."""
    s = jnp.arange(num_keys)[None, None, :]
    return (s <= q_pos[:, :, None]) & (s < kv_len[:, None, None])


def append_latents(kv: jax.Array, latent: jax.Array, lengths: jax.Array, valid: jax.Array):
    """Write a chunk's latents [B, T, W] into per-row storage kv [B, S, W] at positions
    lengths + t (padding tokens are dropped) -> (kv, causal mask [B, T, S])."""
    b, t = latent.shape[:2]
    s = kv.shape[1]
    pos = lengths[:, None] + jnp.arange(t)[None, :]  # [B, T]
    write = jnp.where(jnp.arange(t)[None, :] < valid[:, None], pos, s)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    kv = kv.at[rows, write].set(latent.astype(kv.dtype), mode="drop")
    return kv, causal_mask(pos, lengths + valid, s)


class FreshView(CacheView):
    """Whole sequences from empty state, nothing kept: MLA attends over the chunk itself (expanded)."""

    mla_form = "expanded"

    def __init__(self, cfg: ModelConfig, t: int):
        self.cfg, self.t = cfg, t

    def kda(self, j, b):
        cfg = self.cfg
        return (jnp.zeros((b, 3, cfg.short_conv_kernel_size - 1, cfg.kda_proj_size), jnp.float32),
                jnp.zeros((b, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim), jnp.float32))

    def set_kda(self, j, window, state):
        pass

    def mla(self, j, latent, valid):
        b, t = latent.shape[:2]
        return latent, causal_mask(jnp.broadcast_to(jnp.arange(t)[None], (b, t)), valid, t)


class ContiguousView(CacheView):
    """A `ModelCache`: per-sequence contiguous latents, each row continuing from `lengths`."""

    def __init__(self, cache: ModelCache):
        self.cache = cache
        self.kda_conv, self.kda_state, self.mla_kv = cache.kda_conv, cache.kda_state, cache.mla_kv

    def kda(self, j, b):
        return self.kda_conv[j], self.kda_state[j]

    def set_kda(self, j, window, state):
        self.kda_conv = self.kda_conv.at[j].set(window)
        self.kda_state = self.kda_state.at[j].set(state)

    def mla(self, j, latent, valid):
        kv, mask = append_latents(self.mla_kv[j], latent, self.cache.lengths, valid)
        self.mla_kv = self.mla_kv.at[j].set(kv)
        return kv, mask

    def scan_state(self):
        return self.kda_conv, self.kda_state, self.mla_kv

    def set_scan_state(self, state) -> None:
        self.kda_conv, self.kda_state, self.mla_kv = state

    def result(self, valid: jax.Array) -> ModelCache:
        return ModelCache(self.kda_conv, self.kda_state, self.mla_kv, self.cache.lengths + valid)
