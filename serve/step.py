"""The engine's jitted step: run the model against the arena (MLA pages read per layer; KDA states
gathered and scattered back, or on decode rewritten in place row by row), write the touched pages,
sample on device. The arena is donated and returned. Each row's MLA page table comes from the device page
tables (serve/page_tables.py), gathered through the row's table row, which the step only reads.

One program serves prefill chunks (T > 1), decode (T == 1) and, with speculative decoding, verify rows
(T == 1 + drafts: a token sampled at every position, only the accepted prefix committed to the KDA
states; serve/speculative.py); shapes are fixed by the bucket (batch rows, tokens per row, MLA pages per
layer), so every program is compiled at start-up. With the
arena split over a mesh axis by KDA heads, every arena access runs on each rank's own part
(`serve/state_split.py`); with decode context parallelism the MLA pages are split by position over the
same ranks, and each MLA layer attends over every rank's share, combining the partial softmaxes
(`PagedView._context_parallel`). With async scheduling, decode programs return their logits and
`bind_sample`'s program samples them (`StepOptions.sample_apart`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from collections import OrderedDict
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax import lora
from k3jax.layer_scan import LayerScan
from k3jax.cache import CacheView, append_latents
from k3jax.layers.linear import matmul
from k3jax.layers.mla import NEG_INF
from pallas_kernels.kda import chunk_kda, fused_recurrent_kda
from pallas_kernels.kda.reference import kda_token_step, round_state
from pallas_kernels.mla import paged_mla_decode
from serve.logits_processors import NO_TOKEN
from serve.memory import (ArenaLayout, gather_states, read_conv, read_layer_states, read_units, scatter_states,
                          update_states_in_place, write_layer_states)
from serve.sampling import (PromptLogprobs, SampleResult, SamplingBatch, no_prompt_logprobs, prompt_logprobs,
                            sample)
from serve.routed_experts import ids_dtype
from serve.speculative import accepted_lengths
from serve.state_split import StateSplit, on_ranks


@jax.tree_util.register_dataclass
@dataclass
class StepBatch:
    tokens: jax.Array  # [B, T] int32 (right-padded)
    valid: jax.Array  # [B] int32 real tokens per row (0 for padding rows)
    lengths: jax.Array  # [B] int32 tokens already in the cache
    read_base: jax.Array  # [B] int32 first unit of the KDA slot to start from; -1: fresh (zero) state
    write_base: jax.Array  # [B] int32 first unit of the row's private working slot
    table_rows: jax.Array  # [B] int32 each row's row of the device page tables (serve/page_tables.py)
    copy_src: jax.Array  # [C] int32 units copied to copy_dst before the step (copy-on-write pages)
    copy_dst: jax.Array  # [C] int32
    sampling: SamplingBatch
    targets: jax.Array  # [B, T] int32 next prompt token at each position whose logprob is asked (-1: none)
    lora_slots: jax.Array  # [B] int32 each row's LoRA adapter slot (0: the base model; k3jax/lora.py)
    # prompt embeddings (engines with enable_prompt_embeds, else None): [B, T, H] vectors that replace
    # the token embeddings at the positions where embed_mask [B, T] is set
    embeds: Optional[jax.Array] = None
    embed_mask: Optional[jax.Array] = None
    # async scheduling (engines with `async_scheduling`, else None): the tokens sampled by the steps before,
    # still on the device, [C] int32 (decode programs' rows at 0.., prefill programs' at `carry_offset`..),
    # and for each row the carry entry that is its first token ([B] int32; -1: `tokens` has it)
    carry: Optional[jax.Array] = None
    splice: Optional[jax.Array] = None
    pages: int = field(default=1, metadata=dict(static=True))  # MLA pages per layer the step reads (the bucket)
    # [B, Lm, P] int32 units holding each row's MLA pages per MLA layer: gathered by the step from the tables
    page_table: Optional[jax.Array] = None


@dataclass(frozen=True)
class StepOptions:
    """How a step touches the arena (static: part of the compiled program)."""
    kda_in_place: bool = True  # decode rewrites KDA states row by row in the arena (reference path)
    mla_paged: bool = False  # decode attends with the paged MLA kernel over the arena's pages
    split: StateSplit | None = None  # the arena split over a mesh axis by KDA heads
    mla_heads: int = 0  # MLA query heads (the paged kernel splits them with the arena when it can)
    verify_tokens: int = 0  # rows of this many tokens are speculative verify rows (0: no speculation)
    state_chunk: int = 64  # a bf16-stored KDA state is rounded at multiples of this in prefill rows
    logits_processors: tuple = ()  # custom LogitsProcessor objects run by the sampler (serve/logits_processors.py)
    logprobs_mode: str = "raw_logprobs"  # what the logprobs hold (vLLM's; serve/sampling.LOGPROBS_MODES)
    # the step also returns each position's routed expert ids [B, T, L_moe, k] (serve/routed_experts.py)
    return_routes: bool = False
    # the step also returns each position's final hidden states [B, T, H] after the final norm (what the LM head
    # reads; SGLang's return_hidden_states), in the model's dtype
    return_hidden: bool = False
    scan: LayerScan | None = None  # the run of layers scanned over (k3jax/layer_scan.py); params = (state, stacked)
    carry_offset: int = 0  # where prefill programs put their samples in the carry (decode programs: at 0)
    # decode programs return their next-token logits [B, V] unsampled, and `bind_sample`'s program samples
    # them (async scheduling: a structured-output row's mask depends on the token the step before sampled,
    # which the host reads back only after this step is launched)
    sample_apart: bool = False
    # decode programs run the model over tiles of this many rows, one after another (0: all rows at once):
    # deterministic inference, where a row's bits must not depend on how many rows its program has
    row_tile: int = 0


class PagedView(CacheView):
    """The model's view of one step's cache, carrying the arena through the layers.

    MLA layer j reads its pages from the arena when it runs and appends the chunk's latents to that
    dense copy; the step writes the touched pages back afterwards (or, with `paged_mla` at decode, it
    stores the token's latent in its page and the paged kernel reads the arena). KDA states are either
    gathered for the whole batch up front and scattered back after the model (`in_place=False`:
    prefill, and decode where the Pallas kernel runs on the dense batch), or, for decode on the
    reference path, updated row by row in the arena itself (`update_states_in_place`). When MLA layers
    write the arena mid-model (paged decode), the batched KDA path reads and writes each layer's
    states when that layer runs instead (`layered`): an up-front read or an end-of-step write would
    not be ordered against those writes, and XLA would copy the arena to keep the old version. Every
    read takes the arena value current at that point of the model, so writes never race an older
    read. `per_layer` (a scan over layers: the arena rides in the scan's carry and the layers there
    have traced indices) makes every layer read and write its own state when it runs: KDA states
    `layered`, and each MLA layer's touched pages written back right after it stored the chunk."""

    def __init__(self, layout: ArenaLayout, batch: StepBatch, arena: jax.Array, in_place: bool,
                 split: StateSplit | None = None, paged_mla: bool = False, mla_heads: int = 0,
                 verify: bool = False, stepwise: bool = True, state_chunk: int = 64, per_layer: bool = False):
        self.layout, self.batch, self.arena = layout, batch, arena
        # a state stored in bf16 is rounded wherever the cache keeps it: every decode token, and every
        # `state_chunk` positions of a prefill row (rows start on multiples of it), so the rounding
        # points depend on the positions alone, not on where a row happened to end
        self.state_dtype = None if layout.state_dtype == "float32" else layout.state_dtype
        self.state_chunk = state_chunk
        self.in_place, self.split, self.paged_mla = in_place, split, paged_mla
        # verify rows: the recurrence runs over all T tokens without committing; `commit` folds the
        # accepted prefix into the states afterwards (`stepwise`: with the token step the in-place
        # decode runs, else with the batched recurrent op, whichever plain decode would use)
        self.verify, self.stepwise, self.pending = verify, stepwise, {}
        # verify rows under a scan over layers: the scanned layers' kept inputs, one tuple per KDA position of the
        # group while it runs (`scan_outputs`), then stacked over the groups [G, ...] once the scan is done
        self.group_pending, self.scanned_pending, self.scale = [], [], None
        # MLA query heads split like the KDA heads when the split divides them (the kernel then runs
        # on each rank's heads against its own copy of the pages), else whole on every rank
        self._q = split.heads(1) if split and mla_heads % split.ranks == 0 else P()
        # specs for `on_ranks` (ignored without a split): arena, head-split dim d, whole on every rank
        self._a = split.arena if split else None
        self.context = split if layout.context_ranks > 1 else None  # MLA pages split by position
        self._h = split.heads if split else (lambda d: None)
        self.fresh = batch.read_base < 0  # [B] rows starting a sequence: zero state
        # Copy-on-write of KDA checkpoints: read from the (immutable) checkpoint slot, write to the
        # row's working slot. A slot being written is never one being read in the same step.
        self.read_base = jnp.where(self.fresh, batch.write_base, batch.read_base)
        self.kv: list = [None] * layout.num_mla_layers  # per MLA layer [B, P * page_size, words]
        self.per_layer = per_layer
        self.layered = (paged_mla or per_layer) and not in_place
        self.conv, self.state = {}, {}  # per KDA layer j (batched path)
        if not in_place and not self.layered:
            lk = layout.num_kda_layers
            gather = on_ranks(split, lambda a, base, fresh: gather_states(a, layout, base, fresh),
                              (self._a, P(), P()), ([self._h(3)] * lk, [self._h(1)] * lk))
            convs, states = gather(arena, self.read_base, self.fresh)
            self.conv, self.state = dict(enumerate(convs)), dict(enumerate(states))

    def _on_ranks_at(self, fn, j, in_specs, out_specs):
        """`on_ranks` of fn(j, *args): j closed over when static, passed whole to every rank when traced
        (a scan over layers)."""
        if isinstance(j, int):
            return on_ranks(self.split, partial(fn, j), in_specs, out_specs)
        run = on_ranks(self.split, fn, (P(), *in_specs), out_specs)
        return partial(run, j)

    def scan_state(self):
        for held in (self.conv, self.state):  # the scanned group's layer-local values go with the group
            held.pop(_TRACED, None)
        return self.arena

    def set_scan_state(self, state) -> None:
        self.arena = state

    def scan_outputs(self):
        out, self.group_pending = self.group_pending, []
        return out

    def set_scan_outputs(self, outputs) -> None:
        self.scanned_pending.extend(outputs)

    def _read_layer(self, j, base):
        read = self._on_ranks_at(lambda j, a, base, fresh: read_layer_states(a, self.layout, j, base, fresh), j,
                                 (self._a, P(), P()), (self._h(3), self._h(1)))
        return read(self.arena, base, self.fresh)

    def _write_layer(self, j, conv, state) -> None:
        write = self._on_ranks_at(lambda j, a, base, c, st: write_layer_states(a, self.layout, j, base, c, st), j,
                                  (self._a, P(), self._h(3), self._h(1)), self._a)
        self.arena = write(self.arena, self.batch.write_base, conv, state)

    def kda(self, j, b):
        if self.in_place:
            read = self._on_ranks_at(lambda j, a, base, fresh: read_conv(a, self.layout, j, base, fresh), j,
                                     (self._a, P(), P()), self._h(3))
            return read(self.arena, self.read_base, self.fresh), None
        k = _key(j)
        if self.layered:
            self.conv[k], self.state[k] = self._read_layer(j, self.read_base)
        return self.conv[k], self.state[k]

    def set_kda(self, j, window, state):
        if self.in_place:
            return
        k = _key(j)
        if state is not None:  # None: a recurrence of this view stored it
            self.conv[k], self.state[k] = window, state
        if self.layered:
            self._write_layer(j, self.conv[k], self.state[k])

    def kda_recurrence(self, j):
        if self.verify:
            return self._verify_recurrence(j)
        if not self.in_place:
            return self._recurrence_per_rank(j) if self.split or self.state_dtype else None

        def run(q, k, v, g, beta, window, scale, inputs):  # [B, 1, N, K] ... -> o [B, 1, N, V]
            def local(j, arena, read_base, write_base, fresh, q, k, v, g, beta, window):  # one rank's heads
                def update(i, state):  # one row: state [N, K, V]; inputs [1, N, .]
                    row = [jax.lax.dynamic_index_in_dim(x, i, keepdims=False)[0] for x in (q, k, v, g, beta)]
                    o, state = kda_token_step(state, *row, scale=scale)
                    return o[None].astype(v.dtype), state

                return update_states_in_place(arena, self.layout, j, read_base, write_base, fresh, window, update)

            h = self._h
            run_local = self._on_ranks_at(local, j, (self._a, P(), P(), P(), h(2), h(2), h(2), h(2), h(2), h(3)),
                                          (self._a, h(2)))
            self.arena, o = run_local(self.arena, self.read_base, self.batch.write_base, self.fresh,
                                      q, k, v, g, beta, window)
            return o

        return run

    def _recurrence_per_rank(self, j):
        """The batched KDA op (the Pallas kernel on GPU/TPU) on the gathered states. On a split arena it
        runs inside `shard_map` on each rank's heads: under GSPMD alone a kernel call would gather every
        head's inputs and states onto every rank. With a bf16 state, prefill chunks are `state_chunk`
        tokens and the state is rounded at each chunk's end."""
        def run(q, k, v, g, beta, window, scale, inputs):  # [B, T, N, .] -> o [B, T, N, V]
            if q.shape[1] == 1:
                op = partial(fused_recurrent_kda, state_dtype=self.state_dtype)
            else:
                op = partial(chunk_kda, state_dtype=self.state_dtype,
                             chunk_size=self.state_chunk if self.state_dtype else 64)

            def local(q, k, v, g, beta, state):
                return op(q, k, v, g, beta, scale=scale, initial_state=state, output_final_state=True)

            h, key = self._h, _key(j)
            o, self.state[key] = on_ranks(self.split, local, (h(2),) * 5 + (h(1),), (h(2), h(1)))(
                q, k, v, g, beta, self.state[key])
            self.conv[key] = window
            return o

        return run

    def _token_recurrence(self, q, k, v, g, beta, state, scale):
        """The decode recurrence over T tokens from `state` [B, N, K, V] -> (o [B, T, N, V], final state),
        on each rank's heads; a bf16 state is rounded after every token, as decoding would store it."""
        def local(q, k, v, g, beta, state):
            if not self.stepwise:
                return fused_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=state,
                                           output_final_state=True, state_dtype=self.state_dtype)
            outs = []
            for i in range(q.shape[1]):
                o, state = kda_token_step(state, q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], scale=scale)
                state = round_state(state, self.state_dtype)
                outs.append(o.astype(v.dtype))
            return jnp.stack(outs, axis=1), state

        h = self._h
        return on_ranks(self.split, local, (h(2),) * 5 + (h(1),), (h(2), h(1)))(q, k, v, g, beta, state)

    def _verify_recurrence(self, j):
        """Verify rows: outputs for all T tokens, the state left as it was; the inputs are kept for
        `commit` (ReplaySSM: the accepted prefix is folded in once the step knows its length)."""
        def run(q, k, v, g, beta, window, scale, inputs):  # [B, T, N, .], inputs [B, 3, T, P]
            key, self.scale = _key(j), scale
            full = jnp.concatenate([self.conv[key], inputs.astype(jnp.float32)], axis=2)  # [B, 3, W-1+T, P]
            if isinstance(j, int):
                self.pending[j] = (q, k, v, g, beta, full)
            else:  # a scanned layer: its inputs leave the group's step as scan outputs, with its index
                self.group_pending.append((j, q, k, v, g, beta, full))
            return self._token_recurrence(q, k, v, g, beta, self.state[key], scale)[0]

        return run

    def _replay(self, pending, state, keep):
        """A verify row's kept tokens folded into KDA state [B, N, K, V] -> (conv window, state)."""
        q, k, v, g, beta, full = pending
        t, w = q.shape[1], full.shape[2] - q.shape[1]
        kept = jnp.arange(t)[None, :] < keep[:, None]  # [B, T]
        g, beta = jnp.where(kept[:, :, None, None], g, 0.0), jnp.where(kept[:, :, None], beta, 0.0)
        state = self._token_recurrence(q, k, v, g, beta, state, self.scale)[1]
        return jax.vmap(lambda f, n: jax.lax.dynamic_slice_in_dim(f, n, w, axis=1))(full, keep), state

    def commit(self, keep: jax.Array) -> None:
        """Verify rows: absorb each row's first `keep` [B] tokens into its KDA states and conv windows.

        The same recurrence replays the kept tokens; the others get a gate of 0 and a beta of 0, which
        leave a state exactly as it is (S * exp(0) + k * 0), so the state is the one decoding the kept
        tokens one per step would have left. Layers whose states went back to the arena as they ran
        (`layered`: a scan over layers) are read from their working slots and written again; a scanned
        run's layers in one scan over its groups."""
        for j, pending in self.pending.items():
            conv, state = self._replay(pending, self.state[j], keep)
            if self.layered:
                self._write_layer(j, conv, state)
            else:
                self.conv[j], self.state[j] = conv, state

        def group(arena, stacked):  # one scanned KDA layer
            j, pending = stacked[0], stacked[1:]
            self.arena = arena
            conv, state = self._replay(pending, self._read_layer(j, self.batch.write_base)[1], keep)
            self._write_layer(j, conv, state)
            return self.arena, None

        for stacked in self.scanned_pending:  # per KDA position of the scanned group: [G, ...] each
            self.arena = jax.lax.scan(group, self.arena, tuple(stacked))[0]

    def mla_attend(self, j, latent, valid):
        if self.paged_mla and latent.shape[1] == 1:
            return self._paged(j, latent, valid)
        if self.context is not None:
            return self._context_parallel(j, latent, valid)
        return None

    def _paged(self, j, latent, valid):
        """Decode: store the token's latent in its page in the arena (in place), then attend with the
        paged MLA kernel over the arena's pages through the page table: no gathered copy.

        With context parallelism the token goes to rank `pos % R` (its row there: `pos // R` of the row's
        share, which is contiguous in the share's pages), each rank runs the kernel over its share with
        the share's length, and the ranks' results are combined through the kernel's log-sum-exp."""
        lay, batch, ctx = self.layout, self.batch, self.context
        ps, lp, lw = lay.page_size, lay.rank_page, lay.latent_words
        ranks = ctx.ranks if ctx is not None else 1
        pt = batch.page_table[:, j]  # [B, P]
        pos = batch.lengths  # [B] the token's position
        unit = jnp.take_along_axis(pt, jnp.minimum(pos // ps, pt.shape[1] - 1)[:, None], axis=1)[:, 0]
        row = jnp.where(valid > 0, unit * lp + pos % ps // ranks, lay.num_units * lp)  # padding rows: dropped
        words = lay.codec.encode(latent[:, 0])  # [B, lw]
        if row.shape[0] == 1:  # see read_blocks: a one-index scatter must not become a dynamic update
            row, words, pos = jnp.tile(row, 2), jnp.tile(words, (2, 1)), jnp.tile(pos, 2)
        rank_ids = jnp.arange(ranks, dtype=jnp.int32)
        rank_spec = P(ctx.axis) if ctx is not None else P()

        def store(a, row, words, pos, rank):  # the arena viewed as token rows [num_units * rank_page, lw]
            row = jnp.where(pos % ranks == rank[0], row, lay.num_units * lp)  # another rank's token: dropped
            return a.reshape(-1, lw).at[row].set(words, mode="drop").reshape(a.shape)

        self.arena = on_ranks(self.split, store, (self._a, P(), P(), P(), rank_spec), self._a)(
            self.arena, row, words, pos, rank_ids)
        seq_lens = batch.lengths + valid

        def attend(q_lat, q_rope, scale):  # [B, 1, nh, r], [B, 1, nh, dr] -> [B, 1, nh, r] fp32
            fmt = lay.codec.kernel_format()  # fp8: the kernel reads the words and dequantises in the tile

            def pages_of(a, rows):  # [U, rows, 576] values (a view of the words), or the fp8 words [U, rows, lw]
                words = a.reshape(lay.num_units, rows, lw)
                return words if fmt is not None else lay.codec.decode(words)

            if ctx is None:
                def local(a, q_lat, q_rope, pt, seq_lens):
                    return paged_mla_decode(q_lat, q_rope, pages_of(a, ps), pt, seq_lens, scale=scale,
                                            out_dtype=jnp.float32, kv_format=fmt)

                run = on_ranks(self.split, local, (self._a, self._q, self._q, P(), P()), self._q)
                return run(self.arena, q_lat[:, 0], q_rope[:, 0], pt, seq_lens)[:, None]
            heads = self._q != P()  # each rank keeps its own heads of the combined result

            def local_share(a, q_lat, q_rope, pt, seq_lens, rank):  # every head, this rank's share
                share = jnp.maximum(seq_lens - rank[0] + ranks - 1, 0) // ranks  # positions r, r + R, ...
                out, lse = paged_mla_decode(q_lat, q_rope, pages_of(a, lp), pt, share, scale=scale,
                                            out_dtype=jnp.float32, return_lse=True, kv_format=fmt)
                return combine_shares(out, lse, ctx.axis, heads)

            run = on_ranks(self.split, local_share, (self._a, P(), P(), P(), P(), rank_spec), self._q if heads else P())
            return run(self.arena, q_lat[:, 0], q_rope[:, 0], pt, seq_lens, rank_ids)[:, None]

        return attend

    def _context_parallel(self, j, latent, valid):
        """Decode context parallelism: each rank holds every R-th token of each page (serve/memory.py).
        Each rank reads its own pages, stores the chunk's tokens that fall to it, and attends over its
        share of the context; the partial softmaxes are combined across ranks (max, then sums of the
        rescaled weights and of the weighted latents), so no rank ever holds the whole context."""
        lay, batch, split = self.layout, self.batch, self.context
        pt = batch.page_table[:, j]  # [B, P]
        b, span = latent.shape[0], pt.shape[1] * lay.rank_page
        ctx_spec = P(None, split.axis)  # [B, R * span, ...]: each rank's share of the context, rank-major

        def store(a, pt, words, lengths, valid, rank):  # one rank: [B, span, w], mask [B, T, span]
            kv = read_units(a, pt).reshape(b, span, lay.latent_words)
            return append_rank_latents(kv, words, lengths, valid, lay.page_size, split.ranks, rank[0])

        run = on_ranks(split, store, (self._a, P(), P(), P(), P(), P(split.axis)), (ctx_spec, P(None, None, split.axis)))
        kv, mask = run(self.arena, pt, lay.codec.encode(latent), batch.lengths, valid,
                       jnp.arange(split.ranks, dtype=jnp.int32))
        if self.per_layer:  # each rank's share of this layer's touched pages goes back now (the scan's carry)
            def write_share(j, ar, kv, batch):
                units, rows = touched_pages(lay, batch, [kv], [j])
                return ar.at[units].set(rows, mode="drop")

            self.arena = self._on_ranks_at(write_share, j, (self._a, ctx_spec, P()), self._a)(self.arena, kv, batch)
        else:
            self.kv[j] = kv

        def attend(q_lat, q_rope, scale):  # [B, T, nh, r], [B, T, nh, dr] -> [B, T, nh, r] fp32
            heads = self._q != P()  # the query heads split like the KDA heads: each rank keeps its own

            def local(kv, mask, q):
                return attend_share(known_keys(lay.codec.decode(kv), mask, lay.codec), mask, q, q_lat.shape[-1], scale,
                                    split.axis, heads)

            q = jnp.concatenate([q_lat, q_rope], -1)  # [B, T, nh, r + dr], whole on every rank
            by_head = P(None, None, split.axis)  # also the mask's spec: [B, T, R * span]
            run = on_ranks(split, local, (ctx_spec, by_head, P()), by_head if heads else P())
            return run(kv, mask, q)

        return attend

    def mla(self, j, latent, valid):
        lay, b = self.layout, latent.shape[0]
        pt = self.batch.page_table[:, j]  # [B, P]
        kv = on_ranks(self.split, read_units, (self._a, P()), P())(self.arena, pt)
        kv = kv.reshape(b, pt.shape[1] * lay.page_size, lay.latent_words)
        kv, mask = append_latents(kv, lay.codec.encode(latent), self.batch.lengths, valid)
        if self.per_layer:  # this layer's touched pages go back now (the arena is the scan's carry)
            units, rows = touched_pages(lay, self.batch, [kv], [j])
            write = on_ranks(self.split, lambda ar, u, r: ar.at[u].set(r, mode="drop"), (self._a, P(), P()), self._a)
            self.arena = write(self.arena, units, rows)
        else:
            self.kv[j] = kv
        return known_keys(lay.codec.decode(kv), mask, lay.codec), mask


_TRACED = "traced"  # the key of a scanned layer's KDA values: its index is a tracer, one layer at a time


def _key(j):
    return j if isinstance(j, int) else _TRACED


def known_keys(latents: jax.Array, mask: jax.Array, codec) -> jax.Array:
    """latents [B, S, w] with the slots no query may see ([B, T, S] `mask` false for every query) zeroed,
    unless the `codec` stores them as finite float32 words (`LatentCodec.as_stored`).

    The gathered context holds whole pages: past a row's last token a page keeps whatever its unit held
    before (another layer's latents, a freed KDA slot's state words, read in the latent format), and so
    does every page past the row's own (the device page tables keep stale entries there). Their scores are
    masked, but their values still enter the context product with a weight of 0, and 0 x NaN is NaN: bf16 or
    fp8 words reinterpreted from other data are NaN or inf often enough to poison every row of a step. With
    fp32 latents stored as they are, every stale word is a finite float32 and the select is skipped: there
    it is a pass of its own over the context (k3-small, 32 rows x 256 tokens: 124 -> 138-150 ms a decode
    step), while a bf16 or fp8 decode fuses it."""
    if codec.as_stored:
        return latents
    return jnp.where(mask.any(axis=1)[:, :, None], latents, jnp.zeros((), latents.dtype))


def append_rank_latents(kv: jax.Array, words: jax.Array, lengths: jax.Array, valid: jax.Array, page_size: int,
                        ranks: int, rank: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One rank's share of a context (decode context parallelism): store the chunk's tokens that fall to
    `rank` into its share kv [B, S, w] (each page's tokens at offsets rank, rank + R, ...) -> (kv, causal
    mask [B, T, S] over the share's slots by the positions they hold)."""
    b, t = words.shape[:2]
    s, lp = kv.shape[1], page_size // ranks
    pos = lengths[:, None] + jnp.arange(t)[None, :]  # [B, T]
    mine = (jnp.arange(t)[None, :] < valid[:, None]) & (pos % ranks == rank)
    write = jnp.where(mine, pos // page_size * lp + pos % page_size // ranks, s)  # others' tokens: dropped
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    kv = kv.at[rows, write].set(words.astype(kv.dtype), mode="drop")
    slot = jnp.arange(s)
    held = slot // lp * page_size + slot % lp * ranks + rank  # [S] position each slot holds
    mask = (held[None, None, :] <= pos[:, :, None]) & (held[None, None, :] < (lengths + valid)[:, None, None])
    return kv, mask


def attend_share(latents: jax.Array, mask: jax.Array, q: jax.Array, r: int, scale: float, axis,
                 scatter_heads: bool = False) -> jax.Array:
    """Absorbed MLA attention over one rank's share of the context, combined over mesh `axis`:
    latents [B, S, r + dr], mask [B, T, S], q [B, T, nh, r + dr] (whole on every rank) -> ctx [B, T, nh, r]
    fp32, the softmax over every rank's keys (the largest score over the ranks, then the sums of the
    rescaled weights and of the weighted latents). With `scatter_heads` the sums are reduce-scattered by
    head and each rank keeps its own nh / R heads' ctx [B, T, nh / R, r] (what tensor parallelism's
    output projection takes), moving 1 / R of an all-reduce's bytes."""
    s = jnp.einsum("bthr,bsr->bhts", q, latents, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, None], s, NEG_INF)
    m = jax.lax.pmax(s.max(-1, keepdims=True), axis)  # [B, nh, T, 1]
    e = jnp.exp(s - m)
    reduce = _rank_sum(axis, scatter_heads)
    total = reduce(e.sum(-1, keepdims=True))
    ctx = reduce(matmul("bhts,bsr->bhtr", e.astype(latents.dtype), latents, jnp.float32)[..., :r])
    return (ctx / total).transpose(0, 2, 1, 3)


def combine_shares(out: jax.Array, lse: jax.Array, axis, scatter_heads: bool = False) -> jax.Array:
    """Attention over disjoint token sets, one per rank of mesh `axis`, combined: out [B, nh, r] (each
    rank's own softmax-weighted context) and lse [B, nh] (its scores' log-sum-exp, -inf for no tokens)
    -> [B, nh, r] over all tokens (with `scatter_heads`, each rank's nh / R heads of it)."""
    lse = jnp.maximum(lse, NEG_INF)  # finite: a row with no tokens anywhere gives zeros, not NaN
    w = jnp.exp(lse - jax.lax.pmax(lse, axis))  # [B, nh]
    reduce = _rank_sum(axis, scatter_heads)
    return reduce(out * w[..., None]) / reduce(w)[..., None]


def _rank_sum(axis, scatter_heads: bool):
    """Sum over the ranks of `axis`: whole on every rank, or reduce-scattered by head (dimension 1)."""
    if scatter_heads:
        return partial(jax.lax.psum_scatter, axis_name=axis, scatter_dimension=1, tiled=True)
    return partial(jax.lax.psum, axis_name=axis)


def touched_pages(layout: ArenaLayout, batch: StepBatch, kv: list, layers=None) -> tuple[jax.Array, jax.Array]:
    """The pages holding this step's new tokens, as (units [N], contents [N, unit_elems]) (with context
    parallelism: one rank's shares of them, from its shares of the contexts).

    A row of T tokens starting at `lengths` touches at most (T - 1) // page + 2 pages; slots beyond
    the row's real tokens get the out-of-range unit `num_units` and are dropped by the scatter.
    Full shared pages are never touched: new tokens always land in pages the row owns. `layers`: the
    MLA layer of each entry of `kv` (default: 0, 1, ...; traced in a scan over layers)."""
    b, t = batch.tokens.shape
    ps, ue = layout.page_size, layout.unit_elems
    p = batch.page_table.shape[2]
    n = min((t - 1) // ps + 2, p)
    idx = batch.lengths[:, None] // ps + jnp.arange(n)[None, :]  # [B, n]
    real = (idx * ps < (batch.lengths + batch.valid)[:, None]) & (idx < p) & (batch.valid[:, None] > 0)
    idx = jnp.minimum(idx, p - 1)
    units, rows = [], []
    for j, kv_j in zip(range(len(kv)) if layers is None else layers, kv):
        pages = kv_j.reshape(b, p, ue)
        rows.append(jnp.take_along_axis(pages, idx[:, :, None], axis=1).reshape(b * n, ue))
        unit = jnp.take_along_axis(batch.page_table[:, j], idx, axis=1)
        units.append(jnp.where(real, unit, layout.num_units).reshape(-1))
    return jnp.concatenate(units), jnp.concatenate(rows)


def bind_step(graphdef, layout: ArenaLayout, params, num_top_logprobs: int, options: StepOptions = StepOptions(),
              arena_sharding=None, compiler_options: dict | None = None):
    """-> (step(leaves, arena, token_pages, tables, batch), leaves): `_engine_step` jitted with the model graph, arena
    layout, logprob width and step options bound once and the parameters passed as flat leaves.
    With `arena_sharding` (a device mesh), the returned arena is pinned to it, so the donated arena
    keeps one sharding from step to step (one program per bucket, updated in place), and the token
    pages, sampled tokens, logprobs and expert counts (and routed ids) are replicated.

    Passing the NNX graph as a static argument costs a Python hash of the whole graph and a
    pytree flatten of the parameter state on every call (~8 ms per step for k3-small on CPU);
    the bound form's per-call work is the C++ dispatch of a flat list of arrays."""
    leaves, treedef = jax.tree.flatten(params)
    key = (graphdef, treedef, layout, num_top_logprobs, options, arena_sharding,
           tuple(sorted((compiler_options or {}).items())))
    if key in _BOUND:  # engines over the same model and layout share their compiled programs
        _BOUND.move_to_end(key)
    else:

        def step(leaves, arena, token_pages, tables, batch):
            arena, token_pages, res, counts = _engine_step(graphdef, layout, jax.tree.unflatten(treedef, leaves),
                                                           arena, token_pages, tables, batch, num_top_logprobs,
                                                           options)
            if arena_sharding is not None:
                arena = jax.lax.with_sharding_constraint(arena, arena_sharding)
                # the rest whole on every device: each process (multi-host: the leader) reads outputs locally
                whole = NamedSharding(arena_sharding.mesh, P())
                token_pages, res, counts = jax.lax.with_sharding_constraint((token_pages, res, counts), whole)
            return arena, token_pages, res, counts

        _remember(key, jax.jit(step, donate_argnums=(1, 2), compiler_options=compiler_options))
    return _BOUND[key], leaves


# Recently bound steps. Bounded so that a process that builds engine after engine (a notebook, a
# test run) does not keep every old engine's compiled programs, and their mapped code, alive.
_BOUND: OrderedDict = OrderedDict()
_BOUND_MAX = 8


def _remember(key, fn) -> None:
    _BOUND[key] = fn
    while len(_BOUND) > _BOUND_MAX:  # an engine keeps its own programs; only sharing is forgotten
        _BOUND.popitem(last=False)


def bind_sample(num_top_logprobs: int, processors: tuple = (), sharding=None, logprobs_mode: str = "raw_logprobs"):
    """-> sample(token_pages, logits, sampling, page_table, carry) -> (SampleResult, carry): the sampling a
    decode program with `StepOptions.sample_apart` left out, as its own small program (one per rows and
    pages bucket). `page_table` [B, 1, P] is the rows' first MLA layer's pages (the penalties' and
    processors' history, as the fused step reads it); the samples go to carry entries 0..B-1. With
    `sharding` (the engine's mesh) the results are whole on every device, as the fused step's are."""
    key = ("sample", num_top_logprobs, processors, sharding, logprobs_mode)
    if key not in _BOUND:

        def run(token_pages, logits, sampling, page_table, carry):
            res = sample(logits, sampling, num_top_logprobs, history=lambda: token_history(token_pages, page_table),
                         processors=processors, logprobs_mode=logprobs_mode)
            carry = carry_samples(carry, res.tokens, 0)
            if sharding is not None:
                res, carry = jax.lax.with_sharding_constraint((res, carry), NamedSharding(sharding.mesh, P()))
            return res, carry

        _remember(key, jax.jit(run))
    return _BOUND[key]


def _engine_step(graphdef, layout: ArenaLayout, params, arena: jax.Array, token_pages: jax.Array,
                 tables: jax.Array, batch: StepBatch, num_top_logprobs: int,
                 options: StepOptions = StepOptions()
                 ) -> tuple[jax.Array, jax.Array, tuple[SampleResult, PromptLogprobs, jax.Array], jax.Array]:
    """One model step over the arena `float32[num_units, state_ranks * unit_elems]` (donated, updated in
    place; split over `split`'s axis by KDA heads, or one rank's whole arena) and the token pages
    `int32[num_units, page_size]` (the token ids at each page position, kept for units holding the first
    MLA layer's pages: the penalties' history; same copies, written with the step's tokens). `tables`
    [R + 1, Lm, P_max] are the device page tables (serve/page_tables.py) the batch's `table_rows` name.

    Order on the arena: copy-on-write page copies; then the model, whose layers read (and, for
    in-place KDA decode, rewrite) the arena value current when they run; then the writes of the
    touched pages (unless decode stored them through the paged MLA path); sampling; for verify rows, the
    commit of each row's accepted tokens to its KDA states; and, unless updated in place, the writes of
    the working slots. The third result is (samples, prompt logprobs, drafts accepted [B], carry); a verify
    step's samples are [B, T] (one per position), the others' [B]; a decode step with
    `options.sample_apart` gives (its logits [B, V] fp32, the rows' first-layer page tables [B, 1, P]: the
    history `bind_sample` reads) in place of samples, and no carry."""
    batch = dataclasses.replace(batch, page_table=tables[:, :, :batch.pages][batch.table_rows])  # [B, Lm, P]
    scan = None
    if options.scan is not None:  # (state with the scanned layers hollow, their stacked weights)
        params, stacked = params
        scan = (options.scan, stacked)
    model = nnx.merge(graphdef, params)
    split = options.split
    src, dst = batch.copy_src, batch.copy_dst
    if src.shape[0] == 1:  # a one-index scatter becomes a dynamic-update-slice that XLA may duplicate
        src, dst = jnp.tile(src, 2), jnp.tile(dst, 2)  # per view of the arena, copying the arena for it
    a = split.arena if split else None
    arena = on_ranks(split, lambda ar, s, d: ar.at[d].set(ar[s]), (a, P(), P()), a)(arena, src, dst)
    b, t = batch.tokens.shape
    decode = t == 1
    verify = options.verify_tokens > 1 and t == options.verify_tokens
    if batch.carry is not None:  # rows whose input token the step before sampled: take it from the carry
        batch = splice_tokens(batch)
    token_pages = write_tokens(token_pages.at[dst].set(token_pages[src]), batch)
    in_place = options.kda_in_place and decode and layout.num_kda_layers > 0
    paged = options.mla_paged and decode
    tiled = decode and options.row_tile > 0

    def run_rows(arena, batch):  # the model over `batch`'s rows, their touched pages written back
        view = PagedView(layout, batch, arena, in_place, split, paged, options.mla_heads, verify,
                         options.kda_in_place, options.state_chunk, per_layer=scan is not None)
        routed, hidden = [], []
        with lora.rows(batch.lora_slots):
            embeds = None if batch.embeds is None else (batch.embeds, batch.embed_mask)
            logits = model.run(batch.tokens, view, batch.valid, last_only=not verify, trace=routed, hidden=hidden,
                               embeds=embeds, scan=scan)
        arena = view.arena
        if layout.num_mla_layers and not paged and view.context is not None and not view.per_layer:  # rank shares
            def write_shares(ar, kv, batch):
                units, rows = touched_pages(layout, batch, kv)
                return ar.at[units].set(rows, mode="drop")

            shares = [P(None, split.axis)] * layout.num_mla_layers
            arena = on_ranks(split, write_shares, (a, shares, P()), a)(arena, view.kv, batch)
        elif layout.num_mla_layers and not paged and not view.per_layer:
            units, rows = touched_pages(layout, batch, view.kv)
            write = on_ranks(split, lambda ar, u, r: ar.at[u].set(r, mode="drop"), (a, P(), P()), a)
            arena = write(arena, units, rows)
        if tiled and layout.num_kda_layers and not in_place and not view.layered:  # (before sampling: same arena)
            arena = _scatter_view_states(arena, layout, split, batch.write_base, view)
        return arena, logits, routed, hidden, view

    if tiled:
        arena, logits, routed, hidden = _row_tiles(run_rows, arena, batch, options.row_tile, options.return_hidden)
        view = None
    else:
        arena, logits, routed, hidden, view = run_rows(arena, batch)
    history = lambda: token_history(token_pages, batch.page_table)
    accepted = jnp.zeros((b,), jnp.int32)
    apart = options.sample_apart and decode
    if apart:  # sampled by the engine's sample program once the rows' masks are known
        res = (logits.astype(jnp.float32), batch.page_table[:, :1])
    elif verify:  # a token sampled at every position, as decoding would sample it at that output index
        rows = jax.tree.map(lambda x: jnp.repeat(x, t, axis=0), batch.sampling)
        rows.steps = rows.steps + jnp.tile(jnp.arange(t, dtype=rows.steps.dtype), b)
        if batch.sampling.allowed.shape[0] == b * t:  # structured outputs: a mask per position
            rows.allowed = batch.sampling.allowed
        flat = sample(logits.reshape(b * t, -1), rows, num_top_logprobs,
                      history=lambda: jax.tree.map(lambda x: jnp.repeat(x, t, axis=0), history()),
                      processors=options.logits_processors, logprobs_mode=options.logprobs_mode)
        res = SampleResult(*(x.reshape(b, t, *x.shape[1:]) for x in flat))
        accepted = accepted_lengths(batch.tokens, res.tokens, batch.valid)
        view.arena = arena  # (layered states are committed in the arena itself)
        view.commit(jnp.minimum(accepted + 1, batch.valid))
        arena = view.arena
    else:
        res = sample(logits, batch.sampling, num_top_logprobs, history=history, processors=options.logits_processors,
                     logprobs_mode=options.logprobs_mode)
    if layout.num_kda_layers and not in_place and not tiled and not view.layered:
        arena = _scatter_view_states(arena, layout, split, batch.write_base, view)
    # decode and verify rows never score prompt tokens (verify logits are the sampled positions' own)
    prompt = (prompt_logprobs(model.logits, hidden[0], batch.targets, num_top_logprobs)
              if not (decode or verify)
              else no_prompt_logprobs(batch.targets.shape, num_top_logprobs))
    carry = None
    if batch.carry is not None and not apart:
        carry = carry_samples(batch.carry, res.tokens if res.tokens.ndim == 1 else res.tokens[:, 0],
                              0 if decode or verify else options.carry_offset)
    counts = expert_counts(routed, batch, model.cfg.num_experts)
    if options.return_routes or options.return_hidden:
        # (counts, the logical expert ids each position's router chose in each MoE layer, the positions' normed
        # final hidden states): each None unless asked for
        counts = (counts, routed_ids(routed, b, t, model.cfg.num_experts) if options.return_routes else None,
                  model.norm(hidden[0]) if options.return_hidden else None)
    return arena, token_pages, (res, prompt, accepted, carry), counts


# StepBatch fields with a leading row dimension: what one row tile of a decode step takes (`_row_tiles`)
_ROW_FIELDS = ("tokens", "valid", "lengths", "read_base", "write_base", "table_rows", "targets", "lora_slots",
               "embeds", "embed_mask", "page_table")


def _row_tiles(run_rows, arena: jax.Array, batch: StepBatch, tile: int, keep_hidden: bool = False):
    """A decode step's model pass as a loop over tiles of `tile` rows (`StepOptions.row_tile`):
    `run_rows(arena, rows)` runs on each tile in turn, the arena carried from tile to tile (rows touch
    disjoint slots and pages, so the order is immaterial). Every program of any row count then computes a
    row with the same `tile`-row operations, so its bits do not depend on the batch it is in (deterministic
    inference). -> (arena, logits [B, V], routed ids per MoE layer [B, k], [the final hidden states [B, 1, H]] if
    `keep_hidden` else [])."""
    b = batch.tokens.shape[0]
    if b % tile or b < 2 * tile:
        # one tile would be the whole batch: XLA drops slices of whole arrays, and that program rounds otherwise
        raise ValueError(f"a row-tiled decode step needs a multiple of {tile} rows, at least {2 * tile}; got {b}")

    def tile_of(i):
        rows = {f: jax.lax.dynamic_slice_in_dim(getattr(batch, f), i * tile, tile, axis=0)
                for f in _ROW_FIELDS if getattr(batch, f) is not None}
        return dataclasses.replace(batch, **rows)

    def outputs(arena, rows):  # (arena, logits, routed ids, kept hidden states) of `rows`
        arena, out, ids, hidden, _ = run_rows(arena, rows)
        return arena, out, ids, hidden[:1] if keep_hidden else []

    def body(i, carry):
        arena, *whole = carry
        arena, *part = outputs(arena, tile_of(i))

        def put(whole, part):  # tile i's rows into the step's [B, ...]
            return jax.lax.dynamic_update_slice_in_dim(whole, part.astype(whole.dtype), i * tile, 0)

        return arena, *jax.tree.map(put, whole, part)

    _, *shapes = jax.eval_shape(lambda ar: outputs(ar, tile_of(0)), arena)
    zeros = lambda x: jnp.zeros((b, *x.shape[1:]), x.dtype)  # noqa: E731
    # tiles up to the last with a real row (tiles of padding rows are skipped: their logits stay 0 and they
    # write nothing); the count comes from the batch, so the loop is the same loop in every program
    last = jnp.max(jnp.where(batch.valid > 0, jnp.arange(b), -1))
    return tuple(jax.lax.fori_loop(0, (last + tile) // tile, body, (arena, *jax.tree.map(zeros, shapes))))


def _scatter_view_states(arena: jax.Array, layout: ArenaLayout, split, write_base: jax.Array, view) -> jax.Array:
    """The batched path's KDA conv windows and states (held by `view`) written to the rows' working slots."""
    lk, h = layout.num_kda_layers, (split.heads if split else lambda d: None)
    a = split.arena if split else None
    scatter = on_ranks(split, lambda ar, base, c, st: scatter_states(ar, layout, base, c, st),
                       (a, P(), [h(3)] * lk, [h(1)] * lk), a)
    convs, states = [view.conv[j] for j in range(lk)], [view.state[j] for j in range(lk)]
    return scatter(arena, write_base, convs, states)


def splice_tokens(batch: StepBatch) -> StepBatch:
    """The batch with each row's first token taken from the carry where `splice` names an entry."""
    take = batch.splice >= 0  # [B]
    first = jnp.where(take, batch.carry[jnp.maximum(batch.splice, 0)], batch.tokens[:, 0])
    return dataclasses.replace(batch, tokens=batch.tokens.at[:, 0].set(first))


def carry_samples(carry: jax.Array, samples: jax.Array, offset: int) -> jax.Array:
    """The carry [C] with this program's samples [B] at entries offset..offset+B-1 (static)."""
    if offset + samples.shape[0] > carry.shape[0]:
        raise ValueError(f"carry of {carry.shape[0]} entries cannot hold {samples.shape[0]} rows at {offset}")
    return jax.lax.dynamic_update_slice(carry, samples.astype(carry.dtype), (offset,))


def write_tokens(token_pages: jax.Array, batch: StepBatch) -> jax.Array:
    """Store the step's tokens at their positions in the rows' first-layer pages: [U, ps] -> [U, ps]. A position
    given as a vector stores `NO_TOKEN`, not its placeholder id 0 (which the penalties' and processors' history
    would count as a real token 0)."""
    b, t = batch.tokens.shape
    tokens = batch.tokens if batch.embed_mask is None else jnp.where(batch.embed_mask, NO_TOKEN, batch.tokens)
    ps, p = token_pages.shape[1], batch.page_table.shape[2]
    pos = batch.lengths[:, None] + jnp.arange(t)[None, :]  # [B, T]
    unit = jnp.take_along_axis(batch.page_table[:, 0], jnp.minimum(pos // ps, p - 1), axis=1)  # [B, T]
    unit = jnp.where(jnp.arange(t)[None, :] < batch.valid[:, None], unit, token_pages.shape[0])  # padding: dropped
    return token_pages.at[unit, pos % ps].set(tokens, mode="drop")


def token_history(token_pages: jax.Array, page_table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's token ids over its first MLA layer's page positions (page_table [B, Lm, P]) and the
    positions: ([B, P * ps], [B, P * ps])."""
    ids = token_pages[page_table[:, 0]].reshape(page_table.shape[0], -1)
    return ids, jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :], ids.shape)


def routed_ids(routed: list, b: int, t: int, num_experts: int) -> jax.Array:
    """Per-layer routed ids [B*T, k] -> [B, T, L_moe, k] in `routed_experts.ids_dtype` (int16 while they fit)."""
    dtype = ids_dtype(num_experts)
    if not routed:
        return jnp.zeros((b, t, 0, 0), dtype)
    return jnp.stack(routed, axis=1).reshape(b, t, len(routed), -1).astype(dtype)


def expert_counts(routed: list, batch: StepBatch, num_experts: int) -> jax.Array:
    """Tokens routed to each expert in each MoE layer this step, real tokens only: [L_moe, E] int32."""
    if not routed:
        return jnp.zeros((0, num_experts), jnp.int32)
    t = batch.tokens.shape[1]
    real = (jnp.arange(t)[None, :] < batch.valid[:, None]).reshape(-1).astype(jnp.int32)  # [B*T]
    return jnp.stack([jnp.zeros(num_experts, jnp.int32).at[ids].add(real[:, None]) for ids in routed])
