"""The engine's jitted step: gather KDA states from the arena, run the model against paged MLA
storage, scatter states back, sample on device. The arena is donated and returned.

One program serves prefill chunks (T > 1) and decode (T == 1); shapes are fixed by the bucket
(batch rows, tokens per row, MLA pages per layer), so every program is compiled at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.cache import CacheView, causal_mask
from serve.memory import ArenaLayout, gather_states, pack_latent, scatter_states, unpack_latent
from serve.sampling import SampleResult, SamplingBatch, sample


@jax.tree_util.register_dataclass
@dataclass
class StepBatch:
    tokens: jax.Array  # [B, T] int32 (right-padded)
    valid: jax.Array  # [B] int32 real tokens per row (0 for padding rows)
    lengths: jax.Array  # [B] int32 tokens already in the cache
    read_base: jax.Array  # [B] int32 first unit of the KDA slot to start from; -1: fresh (zero) state
    write_base: jax.Array  # [B] int32 first unit of the row's private working slot
    page_table: jax.Array  # [B, Lm, P] int32 units holding the row's MLA pages, per MLA layer
    copy_src: jax.Array  # [C] int32 units copied to copy_dst before the step (copy-on-write pages)
    copy_dst: jax.Array  # [C] int32
    sampling: SamplingBatch


class PagedView(CacheView):
    """The model's view of the arena: dense per-batch KDA states, MLA latents in pages."""

    def __init__(self, layout: ArenaLayout, arena: jax.Array, batch: StepBatch, conv, state):
        self.layout, self.batch = layout, batch
        self.pages = arena.reshape(layout.num_units, layout.page_size, layout.latent_words)
        self.conv, self.state = conv, state

    def kda(self, j, b):
        return self.conv[j], self.state[j]

    def set_kda(self, j, window, state):
        self.conv = self.conv.at[j].set(window)
        self.state = self.state.at[j].set(state)

    def mla(self, j, latent, valid):
        lay, bt = self.layout, self.batch
        b, t = latent.shape[:2]
        table = bt.page_table[:, j]  # [B, P]
        pos = bt.lengths[:, None] + jnp.arange(t)[None, :]  # [B, T]
        real = jnp.arange(t)[None, :] < valid[:, None]
        page = jnp.take_along_axis(table, jnp.minimum(pos // lay.page_size, table.shape[1] - 1), axis=1)
        unit = jnp.where(real, page, lay.num_units)  # padding writes are dropped
        self.pages = self.pages.at[unit, pos % lay.page_size].set(pack_latent(latent.astype(lay.latent_dtype)),
                                                                   mode="drop")
        kv = self.pages[table].reshape(b, -1, lay.latent_words)  # [B, P * page_size, words]
        kv = unpack_latent(kv, lay.latent_dtype)
        return kv, causal_mask(pos, bt.lengths + valid, kv.shape[1])


@partial(jax.jit, static_argnums=(0, 1, 5), donate_argnums=(3,))
def engine_step(graphdef, layout: ArenaLayout, params, arena: jax.Array, batch: StepBatch,
                num_top_logprobs: int) -> tuple[jax.Array, SampleResult, jax.Array]:
    model = nnx.merge(graphdef, params)
    arena = arena.at[batch.copy_dst].set(arena[batch.copy_src])
    # Copy-on-write of KDA checkpoints: read from the (immutable) checkpoint slot, write to the
    # row's working slot. A slot being written is never one being read in the same step.
    fresh = batch.read_base < 0
    conv, state = gather_states(arena, layout, jnp.where(fresh, batch.write_base, batch.read_base), fresh)
    view = PagedView(layout, arena, batch, conv, state)
    routed: list = []
    logits = model.run(batch.tokens, view, batch.valid, last_only=True, trace=routed)
    arena = view.pages.reshape(arena.shape)
    arena = scatter_states(arena, layout, batch.write_base, view.conv, view.state)
    return arena, sample(logits, batch.sampling, num_top_logprobs), expert_counts(routed, batch, model.cfg.num_experts)


def expert_counts(routed: list, batch: StepBatch, num_experts: int) -> jax.Array:
    """Tokens routed to each expert in each MoE layer this step, real tokens only: [L_moe, E] int32."""
    if not routed:
        return jnp.zeros((0, num_experts), jnp.int32)
    t = batch.tokens.shape[1]
    real = (jnp.arange(t)[None, :] < batch.valid[:, None]).reshape(-1).astype(jnp.int32)  # [B*T]
    return jnp.stack([jnp.zeros(num_experts, jnp.int32).at[ids].add(real[:, None]) for ids in routed])
