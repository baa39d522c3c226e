"""The engine's jitted step: run the model against the arena (MLA pages read per layer; KDA states
gathered and scattered back, or on decode rewritten in place row by row), write the touched pages,
sample on device. The arena is donated and returned.

One program serves prefill chunks (T > 1) and decode (T == 1); shapes are fixed by the bucket
(batch rows, tokens per row, MLA pages per layer), so every program is compiled at start-up. With the
arena split over a mesh axis by KDA heads, every arena access runs on each rank's own part
(`serve/state_split.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections import OrderedDict

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.cache import CacheView, append_latents
from pallas_kernels.kda.reference import kda_token_step
from serve.memory import (ArenaLayout, gather_states, pack_latent, read_conv, read_units, scatter_states, unpack_latent,
                          update_states_in_place)
from serve.sampling import SampleResult, SamplingBatch, sample
from serve.state_split import StateSplit, on_ranks
from jax.sharding import PartitionSpec as P


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
    """The model's view of one step's cache, carrying the arena through the layers.

    MLA layer j reads its pages from the arena when it runs and appends the chunk's latents to that
    dense copy; the step writes the touched pages back afterwards. KDA states are either gathered
    for the whole batch up front and scattered back after the model (`in_place=False`: prefill,
    and decode where the Pallas kernel runs on the dense batch), or, for decode on the reference
    path, updated row by row in the arena itself (`update_states_in_place`). Every read takes the
    arena value current at that point of the model, so in-place writes never race an older read."""

    def __init__(self, layout: ArenaLayout, batch: StepBatch, arena: jax.Array, in_place: bool,
                 split: StateSplit | None = None):
        self.layout, self.batch, self.arena = layout, batch, arena
        self.in_place, self.split = in_place, split
        # specs for `on_ranks` (ignored without a split): arena, head-split dim d, whole on every rank
        self._a = split.arena if split else None
        self._h = split.heads if split else (lambda d: None)
        self.fresh = batch.read_base < 0  # [B] rows starting a sequence: zero state
        # Copy-on-write of KDA checkpoints: read from the (immutable) checkpoint slot, write to the
        # row's working slot. A slot being written is never one being read in the same step.
        self.read_base = jnp.where(self.fresh, batch.write_base, batch.read_base)
        self.kv: list = [None] * layout.num_mla_layers  # per MLA layer [B, P * page_size, words]
        self.conv, self.state = [], []
        if not in_place:
            lk = layout.num_kda_layers
            gather = on_ranks(split, lambda a, base, fresh: gather_states(a, layout, base, fresh),
                              (self._a, P(), P()), ([self._h(3)] * lk, [self._h(1)] * lk))
            self.conv, self.state = gather(arena, self.read_base, self.fresh)

    def kda(self, j, b):
        if self.in_place:
            read = on_ranks(self.split, lambda a, base, fresh: read_conv(a, self.layout, j, base, fresh),
                            (self._a, P(), P()), self._h(3))
            return read(self.arena, self.read_base, self.fresh), None
        return self.conv[j], self.state[j]

    def set_kda(self, j, window, state):
        if not self.in_place:
            self.conv[j], self.state[j] = window, state

    def kda_recurrence(self, j):
        if not self.in_place:
            return None

        def run(q, k, v, g, beta, window, scale):  # [B, 1, N, K] ... -> o [B, 1, N, V]
            def local(arena, read_base, write_base, fresh, q, k, v, g, beta, window):  # one rank's heads
                def update(i, state):  # one row: state [N, K, V]; inputs [1, N, .]
                    row = [jax.lax.dynamic_index_in_dim(x, i, keepdims=False)[0] for x in (q, k, v, g, beta)]
                    o, state = kda_token_step(state, *row, scale=scale)
                    return o[None].astype(v.dtype), state

                return update_states_in_place(arena, self.layout, j, read_base, write_base, fresh, window, update)

            h = self._h
            run_local = on_ranks(self.split, local, (self._a, P(), P(), P(), h(2), h(2), h(2), h(2), h(2), h(3)),
                                 (self._a, h(2)))
            self.arena, o = run_local(self.arena, self.read_base, self.batch.write_base, self.fresh,
                                      q, k, v, g, beta, window)
            return o

        return run

    def mla(self, j, latent, valid):
        lay, b = self.layout, latent.shape[0]
        pt = self.batch.page_table[:, j]  # [B, P]
        kv = on_ranks(self.split, read_units, (self._a, P()), P())(self.arena, pt)
        kv = kv.reshape(b, pt.shape[1] * lay.page_size, lay.latent_words)
        self.kv[j], mask = append_latents(kv, pack_latent(latent.astype(lay.latent_dtype)), self.batch.lengths, valid)
        return unpack_latent(self.kv[j], lay.latent_dtype), mask


def touched_pages(layout: ArenaLayout, batch: StepBatch, kv: list) -> tuple[jax.Array, jax.Array]:
    """The pages holding this step's new tokens, as (units [N], contents [N, unit_elems]).

    A row of T tokens starting at `lengths` touches at most (T - 1) // page + 2 pages; slots beyond
    the row's real tokens get the out-of-range unit `num_units` and are dropped by the scatter.
    Full shared pages are never touched: new tokens always land in pages the row owns."""
    b, t = batch.tokens.shape
    ps, ue = layout.page_size, layout.unit_elems
    p = batch.page_table.shape[2]
    n = min((t - 1) // ps + 2, p)
    idx = batch.lengths[:, None] // ps + jnp.arange(n)[None, :]  # [B, n]
    real = (idx * ps < (batch.lengths + batch.valid)[:, None]) & (idx < p) & (batch.valid[:, None] > 0)
    idx = jnp.minimum(idx, p - 1)
    units, rows = [], []
    for j, kv_j in enumerate(kv):
        pages = kv_j.reshape(b, p, ue)
        rows.append(jnp.take_along_axis(pages, idx[:, :, None], axis=1).reshape(b * n, ue))
        unit = jnp.take_along_axis(batch.page_table[:, j], idx, axis=1)
        units.append(jnp.where(real, unit, layout.num_units).reshape(-1))
    return jnp.concatenate(units), jnp.concatenate(rows)


def bind_step(graphdef, layout: ArenaLayout, params, num_top_logprobs: int, kda_in_place: bool = True,
              arena_sharding=None, split: StateSplit | None = None):
    """-> (step(leaves, arena, batch), leaves): `engine_step` jitted with the model graph, arena
    layout, logprob width and KDA decode form bound once and the parameters passed as flat leaves.
    With `arena_sharding` (a device mesh), the returned arena is pinned to it, so the donated arena
    keeps one sharding from step to step (one program per bucket, updated in place). With `split`, the
    arena is split by KDA heads and its accesses run per rank.

    Passing the NNX graph as a static argument costs a Python hash of the whole graph and a
    pytree flatten of the parameter state on every call (~8 ms per step for k3-small on CPU);
    the bound form's per-call work is the C++ dispatch of a flat list of arrays."""
    leaves, treedef = jax.tree.flatten(params)
    key = (graphdef, treedef, layout, num_top_logprobs, kda_in_place, arena_sharding, split)
    if key in _BOUND:  # engines over the same model and layout share their compiled programs
        _BOUND.move_to_end(key)
    else:

        def step(leaves, arena, batch):
            arena, res, counts = _engine_step(graphdef, layout, jax.tree.unflatten(treedef, leaves), arena, batch,
                                              num_top_logprobs, kda_in_place, split)
            if arena_sharding is not None:
                arena = jax.lax.with_sharding_constraint(arena, arena_sharding)
            return arena, res, counts

        _BOUND[key] = jax.jit(step, donate_argnums=(1,))
        while len(_BOUND) > _BOUND_MAX:  # an engine keeps its own step; only sharing is forgotten
            _BOUND.popitem(last=False)
    return _BOUND[key], leaves


# Recently bound steps. Bounded so that a process that builds engine after engine (a notebook, a
# test run) does not keep every old engine's compiled programs, and their mapped code, alive.
_BOUND: OrderedDict = OrderedDict()
_BOUND_MAX = 8


def _engine_step(graphdef, layout: ArenaLayout, params, arena: jax.Array, batch: StepBatch,
                 num_top_logprobs: int, kda_in_place: bool = True,
                 split: StateSplit | None = None) -> tuple[jax.Array, SampleResult, jax.Array]:
    """One model step over the arena `float32[num_units, state_ranks * unit_elems]` (donated, updated in
    place; split over `split`'s axis by KDA heads, or one rank's whole arena).

    Order on the arena: copy-on-write page copies; then the model, whose layers read (and, for
    in-place KDA decode, rewrite) the arena value current when they run; then the writes of the
    touched pages and, unless updated in place, of the working slots."""
    model = nnx.merge(graphdef, params)
    src, dst = batch.copy_src, batch.copy_dst
    if src.shape[0] == 1:  # a one-index scatter becomes a dynamic-update-slice that XLA may duplicate
        src, dst = jnp.tile(src, 2), jnp.tile(dst, 2)  # per view of the arena, copying the arena for it
    a = split.arena if split else None
    arena = on_ranks(split, lambda ar, s, d: ar.at[d].set(ar[s]), (a, P(), P()), a)(arena, src, dst)
    in_place = kda_in_place and batch.tokens.shape[1] == 1 and layout.num_kda_layers > 0
    view = PagedView(layout, batch, arena, in_place, split)
    routed: list = []
    logits = model.run(batch.tokens, view, batch.valid, last_only=True, trace=routed)
    arena = view.arena
    if layout.num_mla_layers:
        units, rows = touched_pages(layout, batch, view.kv)
        write = on_ranks(split, lambda ar, u, r: ar.at[u].set(r, mode="drop"), (a, P(), P()), a)
        arena = write(arena, units, rows)
    if layout.num_kda_layers and not in_place:
        lk, h = layout.num_kda_layers, (split.heads if split else lambda d: None)
        scatter = on_ranks(split, lambda ar, base, c, st: scatter_states(ar, layout, base, c, st),
                           (a, P(), [h(3)] * lk, [h(1)] * lk), a)
        arena = scatter(arena, batch.write_base, view.conv, view.state)
    return arena, sample(logits, batch.sampling, num_top_logprobs), expert_counts(routed, batch, model.cfg.num_experts)


engine_step = jax.jit(_engine_step, static_argnums=(0, 1, 5, 6, 7), donate_argnums=(3,))


def expert_counts(routed: list, batch: StepBatch, num_experts: int) -> jax.Array:
    """Tokens routed to each expert in each MoE layer this step, real tokens only: [L_moe, E] int32."""
    if not routed:
        return jnp.zeros((0, num_experts), jnp.int32)
    t = batch.tokens.shape[1]
    real = (jnp.arange(t)[None, :] < batch.valid[:, None]).reshape(-1).astype(jnp.int32)  # [B*T]
    return jnp.stack([jnp.zeros(num_experts, jnp.int32).at[ids].add(real[:, None]) for ids in routed])
