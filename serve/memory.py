"""One cache arena for both kinds of sequence state, carved from a single byte budget.

Mechanism: the arena is one device array `float32[num_units, unit_elems]`. A *unit* is one MLA page
of one MLA layer (`page_size` tokens x the 576-wide latent in the words of its `kv_cache_dtype`
format, serve/latent_codec.py: bf16 latents packed two per float32 word, or fp8 with per-tile
scales). A KDA *state slot* (every KDA layer's recurrent state, fp32 or, with `kda_state_dtype`
bfloat16, packed two values per word, and its fp32 conv windows for one sequence) spans `slot_units`
consecutive units and holds, layer after layer, each KDA layer's state then its conv windows, so one
layer's part is a contiguous run that the step reads as a block of
whole units and slices, with no repacking. The host allocator hands out pages from the low end
and state slots from the high end (a two-ended arena), so there is no ratio flag: many short requests
fill the arena with slots, a few long ones fill it with pages, and the same arrays and compiled
steps serve both. Unit 0 is a scratch page and the top slot is a scratch slot that padded batch rows
read and write.

Device-side helpers gather each KDA layer's states of a batch into dense `[B, ...]` arrays for the
model and scatter them back (prefill), or rewrite one layer's part of each row's slot in place, row
by row (decode on the reference path: `update_states_in_place`); MLA pages are gathered through
per-layer page tables and the pages a step touched are written back. Reads and writes go through
whole units (single MLA pages, or blocks of consecutive units for KDA slots), except the in-place
update, which addresses a layer's run of words as rows of the arena viewed `[words / w, w]`.

On a device mesh whose `heads` rule splits the KDA heads over R ranks (`state_ranks`), the arena is
`float32[num_units, R * unit_elems]` split by columns: each rank holds a `[num_units, unit_elems]`
arena of its own in which a unit is still one whole MLA page (the latent has one KV head, so every
rank keeps every page, as tensor-parallel MLA engines do) and a state slot holds only that rank's
N / R heads and their conv channels, so a slot spans about 1 / R of the units it would on one
device. The same unit ids, slots and host bookkeeping serve every rank; the step runs the functions
below on each rank's local arena (`serve/state_split.py`). `cache_bytes` is the budget of one rank.

Decode context parallelism (`context_ranks` = R > 1, vLLM's DCP) also splits the MLA pages over those
ranks, by position: rank r holds the tokens at offsets r, r + R, r + 2R, ... of every page, at local
offset `offset // R`, so a unit is `page_size / R` tokens of one layer on each rank and the same
per-rank budget holds R times the MLA tokens. Unit ids, page tables and every host structure are
unchanged (a page is still `page_size` tokens); only what a unit's words mean on each rank differs.
Interleaving by token, not by block, keeps every rank's share of a sequence equal at any length.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from serve.latent_codec import LatentCodec, pack_words, unpack_words

WORD = 4  # bytes per arena element (float32)
STATE_DTYPES = {"auto": "float32", "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16",
                "bf16": "bfloat16"}


def state_dtype_name(kda_state_dtype) -> str:
    """`kda_state_dtype` -> "float32" | "bfloat16" (vLLM's `mamba_ssm_cache_dtype` for the KDA states).

    "auto" is float32, the spec's state dtype. bfloat16 halves a state slot; the state is then
    rounded wherever it is stored: after every decode token and at every prefill chunk boundary."""
    name = STATE_DTYPES.get(kda_state_dtype) if isinstance(kda_state_dtype, str) else None
    if name is None:
        raise ValueError(f"kda_state_dtype={kda_state_dtype!r}: expected one of {sorted(STATE_DTYPES)}")
    return name


@dataclass(frozen=True)
class ArenaLayout:
    num_units: int
    unit_elems: int  # float32 words per unit on one rank (= one page of one MLA layer, or its rank's share)
    page_size: int  # tokens per MLA page
    latent_width: int  # kv_lora + rope values per token
    codec: LatentCodec  # how a token's latent is stored in the arena's words (kv_cache_dtype)
    num_mla_layers: int
    num_kda_layers: int
    state_shape: tuple[int, ...]  # [Lk, N, K, V]
    conv_shape: tuple[int, ...]  # [Lk, 3, W-1, P]  (one rank's heads and channels)
    slot_units: int
    state_ranks: int = 1  # ranks the KDA heads are split over (each holds N / state_ranks heads)
    state_dtype: str = "float32"  # how KDA recurrent states are stored ("float32" | "bfloat16")
    context_ranks: int = 1  # ranks the MLA pages are split over by position (decode context parallelism)

    @classmethod
    def plan(cls, cfg: ModelConfig, budget_bytes: int, page_size: int, dtype, state_ranks: int = 1,
             kv_cache_dtype: str = "auto", kda_state_dtype: str = "float32",
             context_ranks: int = 1, budget_name: str | None = None) -> "ArenaLayout":
        """`budget_bytes` is one rank's arena; with `state_ranks` R > 1 a slot holds N / R KDA heads;
        `kv_cache_dtype` picks the latents' storage format (serve/latent_codec.py), `kda_state_dtype`
        the recurrent states' (`state_dtype_name`); with `context_ranks` C > 1 (the same ranks as the
        state split) each rank holds every C-th token of each page. `budget_name`: the option that set the
        budget, as a too-small arena's error names it (default `cache_bytes=<budget_bytes>`)."""
        state_dtype = state_dtype_name(kda_state_dtype)
        lw = cfg.mla_latent_size
        codec = LatentCodec.make(kv_cache_dtype, dtype, lw, cfg.qk_rope_head_dim)
        if context_ranks > 1 and (context_ranks != state_ranks or page_size % context_ranks):
            raise ValueError(f"decode_context_parallel_size={context_ranks} needs the arena split over that many "
                             f"ranks (it is split over {state_ranks}) and a page_size ({page_size}) it divides")
        unit_elems = page_size // context_ranks * codec.words
        n, d, w, p = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size, cfg.kda_proj_size
        lk = cfg.num_kda_layers
        if state_ranks < 1 or (lk and n % state_ranks):
            raise ValueError(f"state_ranks {state_ranks} does not divide the {n} KDA heads")
        n, p = n // state_ranks, p // state_ranks
        state_shape, conv_shape = (lk, n, d, d), (lk, 3, w - 1, p)
        slot_words = (math.prod(state_shape) * jnp.dtype(state_dtype).itemsize // WORD
                      + math.prod(conv_shape))
        slot_units = max(1, -(-slot_words // unit_elems)) if lk else 0
        num_units = budget_bytes // (unit_elems * WORD)
        need = min_units(slot_units)
        if num_units < need:
            where = budget_name or f"cache_bytes={budget_bytes}"
            raise ValueError(f"{where}: the cache budget holds {num_units} units of "
                             f"{unit_elems * WORD} B; at least {need} ({need * unit_elems * WORD} bytes) are needed "
                             f"(the scratch page and slot, one page and one state slot of {slot_units} units): "
                             f"give the cache more memory")
        return cls(num_units, unit_elems, page_size, lw, codec, cfg.num_mla_layers, lk,
                   state_shape, conv_shape, slot_units, state_ranks, state_dtype, context_ranks)

    @property
    def rank_page(self) -> int:
        """Tokens of a page one rank holds (all of them without context parallelism)."""
        return self.page_size // self.context_ranks

    @property
    def latent_words(self) -> int:
        """float32 words per token of one MLA layer."""
        return self.codec.words

    @property
    def unit_bytes(self) -> int:
        return self.unit_elems * WORD

    @property
    def slot_words(self) -> int:
        """float32 words of state and conv windows in one slot (padding excluded)."""
        return self.layer_words * self.num_kda_layers

    @property
    def layer_words(self) -> int:
        """float32 words of one KDA layer's state and conv windows."""
        return self.state_words + self.conv_words

    @property
    def state_word_shape(self) -> tuple[int, ...]:
        """One layer's state as stored: [N, K, V * itemsize / 4] words (bf16 pairs along V)."""
        n, k, v = self.state_shape[1:]
        return n, k, v * jnp.dtype(self.state_dtype).itemsize // WORD

    @property
    def state_words(self) -> int:
        return math.prod(self.state_word_shape) if self.num_kda_layers else 0

    @property
    def conv_words(self) -> int:
        return math.prod(self.conv_shape[1:])

    def encode_state(self, state: jax.Array) -> jax.Array:
        """[..., N, K, V] fp32 -> [..., N, K, Vw] words in `state_dtype` (rounded to nearest even)."""
        return pack_words(state.astype(self.state_dtype))

    def decode_state(self, words: jax.Array) -> jax.Array:
        """Inverse of `encode_state` (exact): [..., N, K, Vw] words -> [..., N, K, V] fp32."""
        return unpack_words(words, self.state_dtype).astype(jnp.float32)

    @property
    def row_width(self) -> int:
        """Words per row when the arena is viewed as rows `[num_units * unit_elems / w, w]`: the largest
        width dividing a unit and the stored state's last axis (so also every layer's offset in a slot).
        Writing a state through this view keeps its minor axis contiguous and vectorised; the same
        update through flat words recomputes indices per word (measured 4x slower on the 2-core CPU
        host)."""
        return math.gcd(self.unit_elems, self.state_word_shape[-1]) if self.num_kda_layers else 1

    @property
    def scratch_page(self) -> int:
        return 0

    @property
    def scratch_slot(self) -> int:
        return self.num_units - self.slot_units

    def pages_for(self, tokens: int) -> int:
        """Units needed to hold `tokens` tokens of MLA cache (every MLA layer)."""
        return -(-tokens // self.page_size) * self.num_mla_layers

    @property
    def usable_units(self) -> int:
        """Units requests may hold: all but the scratch page and the scratch slot."""
        return self.num_units - 1 - self.slot_units

    def request_units(self, tokens: int) -> int:
        """Units one request holds with `tokens` tokens cached: its state slot and every MLA layer's pages."""
        return self.slot_units + self.pages_for(tokens)

    def sequences_at(self, tokens: int) -> int:
        """Requests of `tokens` cached tokens the arena holds at once (`usable_units` over `request_units`)."""
        return self.usable_units // self.request_units(tokens)

    @property
    def shape(self) -> tuple[int, int]:
        """The whole arena's shape: every rank's `[num_units, unit_elems]` side by side."""
        return self.num_units, self.state_ranks * self.unit_elems

    def empty(self, sharding=None) -> jax.Array:
        """A zeroed arena; with a sharding, made in place on the devices (no host copy of the whole)."""
        zeros = lambda: jnp.zeros(self.shape, jnp.float32)
        return zeros() if sharding is None else jax.jit(zeros, out_shardings=sharding)()


def longest_request(layout: ArenaLayout, free_units: int, num_mla_layers: int) -> int:
    """Tokens of the longest request `free_units` of `layout` hold: its state slot and one page per MLA layer for
    each `page_size` positions but the last (sampled, never cached). Without MLA layers: any length."""
    if free_units < layout.slot_units:
        return 0
    if not num_mla_layers:
        return sys.maxsize
    return (free_units - layout.slot_units) // num_mla_layers * layout.page_size + 1


def cache_tokens(num_units: int, slot_units: int, page_size: int, num_mla_layers: int) -> int | None:
    """Tokens an arena of `num_units` holds in its MLA cache (SGLang's `max_total_num_tokens`): a unit is a page of
    one MLA layer, so a token takes a unit's share in every MLA layer; the scratch page and slot and one request's
    KDA state slot are set aside (`longest_request`'s count, less the sampled position). None without MLA layers
    (no token takes cache)."""
    if not num_mla_layers:
        return None
    return max(0, num_units - 1 - 2 * slot_units) // num_mla_layers * page_size


def max_concurrency(layout: ArenaLayout, tokens: int) -> float:
    """Requests of `tokens` tokens the arena holds at once (vLLM's start-up "Maximum concurrency for N tokens per
    request: X.XXx"): its free units (all but the scratch page and slot) over one request's, a state slot and the
    pages of every position but the last (sampled, never cached), as the start-up check counts them."""
    return layout.usable_units / layout.request_units(max(0, tokens - 1))  # (`sequences_at(tokens - 1)`, unrounded)


def arena_summary(layout: ArenaLayout, max_model_len: int, budget: str) -> str:
    """The start-up line that says what the arena holds (vLLM's KV cache size and maximum concurrency lines)."""
    return (f"cache arena of {budget}: {layout.num_units} units of {layout.unit_bytes} B "
            f"({layout.num_units * layout.unit_bytes / 2**20:.1f} MiB; a KDA state slot is {layout.slot_units} units, "
            f"a page {layout.page_size} tokens of one MLA layer); maximum concurrency for {max_model_len:,} tokens per "
            f"request: {max_concurrency(layout, max_model_len):.2f}x")


def concurrency_note(layout: ArenaLayout, max_num_seqs: int, budget: str) -> str | None:
    """A start-up warning when the arena can never run `max_num_seqs` requests at once (each needs a state slot and
    a page per MLA layer), else None. vLLM refuses to start when its Mamba state pool holds fewer than max_num_seqs;
    here slots and pages share one arena, so the engine runs, with fewer requests at once than asked for."""
    most = layout.sequences_at(1)
    if most >= max_num_seqs:
        return None
    return (f"max_num_seqs={max_num_seqs}: the arena of {budget} holds at most {most} request(s) at once (each a KDA "
            f"state slot of {layout.slot_units * layout.unit_bytes} bytes and an MLA page per layer); the rest wait: give "
            f"the cache more memory or lower max_num_seqs")


def min_units(slot_units: int) -> int:
    """The smallest arena: the scratch page and slot, and one real page and slot."""
    return 2 + 2 * slot_units


class OutOfMemory(Exception):
    """Not enough free units; the scheduler preempts or waits."""


class UnitRefs:
    """Reference counts of arena units held by several owners (requests sharing prefix pages, forked
    beams, cache entries); a unit goes back to the arena with its last holder. The counts are one array
    over the arena, so what the scheduler asks every step (which units only the cache holds) is a
    vector compare, not a walk over a dict of a million units."""

    def __init__(self, alloc: "Arena"):
        self.alloc = alloc
        self.counts = np.zeros(alloc.layout.num_units, np.int32)  # [num_units] holders of each unit

    @property
    def unit_refs(self) -> dict[int, int]:
        """{unit: holders} of every held unit (for inspection; the engine uses `counts`)."""
        held = np.flatnonzero(self.counts)
        return dict(zip(held.tolist(), self.counts[held].tolist()))

    def ref(self, units) -> None:
        np.add.at(self.counts, np.asarray(units, np.int64), 1)

    def unref(self, units) -> None:
        units = np.asarray(units, np.int64)
        if not len(units):
            return
        np.subtract.at(self.counts, units, 1)
        if np.any(self.counts[units] < 0):
            np.add.at(self.counts, units, 1)
            raise KeyError(f"unref of units nobody holds: {sorted(set(units[self.counts[units] <= 0].tolist()))}")
        last = np.sort(units[self.counts[units] == 0])  # (np.unique hashes: ~10x slower at 10^5 units)
        self.alloc.free_pages(last[np.r_[True, last[1:] != last[:-1]]] if len(last) else last)


class Arena:
    """Host-side bookkeeping of which units hold pages, slots, or are free. The free count and the lowest
    unit that may be free are kept as they change: the scheduler asks for the count per request each step,
    and a count or a scan over a K3 arena (~10^6 units) each time added up to tens of milliseconds a step."""

    FREE, PAGE, SLOT = 0, 1, 2

    def __init__(self, layout: ArenaLayout):
        self.layout = layout
        self.owner = np.zeros(layout.num_units, np.int8)
        self.owner[layout.scratch_page] = self.PAGE
        self.owner[layout.scratch_slot:layout.scratch_slot + layout.slot_units] = self.SLOT
        self._free = int(np.count_nonzero(self.owner == self.FREE))
        self._low = 0  # no free unit below this one (pages are taken from the low end)
        self._baseline = self._free
        self.peak_used_units = 0

    # ---- queries ------------------------------------------------------------------------------
    @property
    def free_units(self) -> int:
        return self._free

    @property
    def baseline_free_units(self) -> int:
        return self._baseline

    def bytes_by_kind(self) -> dict[str, int]:
        ub = self.layout.unit_bytes
        return {"mla_pages": int(np.count_nonzero(self.owner == self.PAGE) - 1) * ub,
                "kda_slots": int(np.count_nonzero(self.owner == self.SLOT) - self.layout.slot_units) * ub,
                "free": self.free_units * ub, "total": self.layout.num_units * ub}

    def can_fit(self, pages: int, slots: int) -> bool:
        """Whether `pages` more pages and `slots` more slots can be allocated right now."""
        if slots and len(self._free_slot_bases(slots)) < slots:
            return False
        return self.free_units - slots * self.layout.slot_units >= pages

    # ---- allocation ---------------------------------------------------------------------------
    def alloc_pages(self, n: int) -> list[int]:
        """The `n` lowest free units, as pages."""
        if self._free < n:
            raise OutOfMemory(f"need {n} pages, {self._free} units free")
        got, start, window = [], self._low, max(4096, 4 * n)
        while len(got) < n:  # windows up from the lowest unit that may be free, not the whole arena
            assert start < len(self.owner), "the free count is out of step with the owners"
            free = np.flatnonzero(self.owner[start:start + window] == self.FREE)[:n - len(got)]
            got.extend((free + start).tolist())
            start += window
        if got:
            self.owner[got] = self.PAGE
            self._free -= n
            self._low = got[-1] + 1
        self._track()
        return got

    def alloc_slot(self) -> int:
        bases = self._free_slot_bases(1)
        if not bases:
            raise OutOfMemory("no contiguous run of units for a state slot")
        b = bases[0]
        self.owner[b:b + self.layout.slot_units] = self.SLOT
        self._free -= self.layout.slot_units
        self._track()
        return b

    def free_pages(self, units) -> None:
        units = units if isinstance(units, np.ndarray) else np.asarray(list(units), np.int64)
        if len(units):
            units = np.sort(units)
            assert np.all(self.owner[units] == self.PAGE) and np.all(units[1:] != units[:-1]), "double free of a page"
            self.owner[units] = self.FREE
            self._free += len(units)
            self._low = min(self._low, int(units[0]))

    def free_slot(self, base: int) -> None:
        if not self.layout.slot_units:  # no KDA layers: every slot is the empty scratch one (`alloc_slot`)
            return
        s = slice(base, base + self.layout.slot_units)
        assert base != self.layout.scratch_slot and np.all(self.owner[s] == self.SLOT), "bad slot free"
        self.owner[s] = self.FREE
        self._free += self.layout.slot_units
        self._low = min(self._low, base)

    def _track(self) -> None:
        self.peak_used_units = max(self.peak_used_units, self._baseline - self._free)

    def reset_peak(self) -> None:
        self.peak_used_units = self._baseline - self.free_units

    def _free_slot_bases(self, want: int) -> list[int]:
        """Slot-aligned runs (counted down from the top) whose units are all free, highest first."""
        if not self.layout.slot_units:  # no KDA layers: a slot is empty and any number fit
            return [self.layout.scratch_slot] * want
        rows, start = self.slot_runs()
        free = np.flatnonzero(~rows.any(axis=1))[::-1][:want]
        return (start + free * self.layout.slot_units).tolist()

    def slot_runs(self) -> tuple[np.ndarray, int]:
        """The owners of every slot-aligned run below the scratch slot as rows -> ([runs, slot_units] view,
        first row's base); run i is units [base + i * slot_units, base + (i + 1) * slot_units). The scratch
        page (unit 0) is in none."""
        su, top = self.layout.slot_units, self.layout.scratch_slot
        n = (top - 1) // su if su else 0
        start = top - n * su
        return self.owner[start:top].reshape(n, su), start


# ---- device-side reads and writes -----------------------------------------------------------
# The arena is only ever indexed by whole units (rows of the 2-D array): row gathers for reads and
# row scatters or dynamic-update-slices of unit blocks for writes. Taking the donated buffer under a
# single shape and making every read of one version of it an input of the write that replaces that
# version (the writes' values depend on the reads through the model) lets XLA update it in place; a
# read that can run after the write, mixed reshapes, or chained block scatters make it copy the
# whole arena (tests/test_engine.py checks the compiled steps).

_BLOCKS = jax.lax.GatherScatterMode.CLIP


def read_blocks(arena: jax.Array, first: jax.Array, n: int) -> jax.Array:
    """[B] first units -> [B, n * unit_elems]: each row's n consecutive units.

    One gather whose slices are whole n-unit blocks: XLA:CPU copies each block as a run instead of
    computing an index per unit (4-8x faster than a gather of the same units one by one). A
    one-row read is issued as two identical rows: a single-index gather becomes a dynamic slice
    that XLA fuses into every consumer, which then read the arena late in the step and force a
    copy of the whole arena before the first write (tests/test_engine.py checks the HLO)."""
    b, ue = first.shape[0], arena.shape[1]
    dn = jax.lax.GatherDimensionNumbers(offset_dims=(1, 2), collapsed_slice_dims=(), start_index_map=(0,))
    return jax.lax.gather(arena, jnp.tile(first, 2)[:, None] if b == 1 else first[:, None], dn, (n, ue),
                          mode=_BLOCKS)[:b].reshape(b, n * ue)


def read_units(arena: jax.Array, units: jax.Array) -> jax.Array:
    """units [...] -> [..., unit_elems]: single units (MLA pages), duplicated into two rows when
    there is only one, for the reason given in `read_blocks`."""
    flat = units.reshape(-1)
    rows = arena[jnp.tile(flat, 2) if flat.shape[0] == 1 else flat][:flat.shape[0]]
    return rows.reshape(*units.shape, arena.shape[1])


def write_blocks(arena: jax.Array, first: jax.Array, rows: jax.Array) -> jax.Array:
    """Write rows [B, n * unit_elems] into each row's n consecutive units from `first` [B].

    Rows whose blocks coincide (padding rows on the scratch slot) may land in any order."""
    b, ue = first.shape[0], arena.shape[1]
    dn = jax.lax.ScatterDimensionNumbers(update_window_dims=(1, 2), inserted_window_dims=(),
                                         scatter_dims_to_operand_dims=(0,))
    return jax.lax.scatter(arena, first[:, None], rows.reshape(b, -1, ue), dn, mode=_BLOCKS)


def gather_states(arena: jax.Array, layout: ArenaLayout, slot_base: jax.Array, fresh: jax.Array):
    """Read the KDA slots of a batch -> (conv [Lk] x [B, 3, W-1, P], state [Lk] x [B, N, K, V]) fp32.

    One block read per layer of the units its part of the slot overlaps; the state and conv
    windows are static slices of the block, so the model consumes them without a repacking copy.
    Rows with `fresh` set start a sequence: their state is zeros whatever the slot held before."""
    layers = [read_layer_states(arena, layout, j, slot_base, fresh) for j in range(layout.num_kda_layers)]
    return [c for c, _ in layers], [s for _, s in layers]


def read_layer_states(arena: jax.Array, layout: ArenaLayout, j: int, slot_base: jax.Array, fresh: jax.Array):
    """KDA layer j's part of a batch's slots -> (conv [B, 3, W-1, P], state [B, N, K, V]): one block read
    of the units it overlaps (zeros where `fresh`)."""
    b, ue, le = slot_base.shape[0], layout.unit_elems, layout.layer_words
    if isinstance(j, int):
        first, end = j * le // ue, -(-(j + 1) * le // ue)  # units of the slot that layer j overlaps
        off = j * le - first * ue
        rows = read_blocks(arena, slot_base + first, end - first)[:, off:off + le]  # [B, layer_words]
    else:  # traced j (a scan over layers): the same words as one rectangle of the row view
        rows = read_slot_rows(arena, layout, slot_base, j * le, le)
    rows = jnp.where(fresh[:, None], 0.0, rows)
    ns = layout.state_words
    state = layout.decode_state(rows[:, :ns].reshape(b, *layout.state_word_shape))
    return rows[:, ns:].reshape(b, *layout.conv_shape[1:]), state


def read_slot_rows(arena: jax.Array, layout: ArenaLayout, slot_base: jax.Array, start, words: int) -> jax.Array:
    """`words` words of each row's slot from word `start` (a multiple of `row_width`, may be traced) ->
    [B, words]: one block read of the arena viewed as rows of `row_width` words, so the offset needs no
    static unit arithmetic (a layer's run may start mid-unit)."""
    rw = layout.row_width
    first = slot_base * (layout.unit_elems // rw) + start // rw
    return read_blocks(arena.reshape(-1, rw), first, words // rw)


def write_layer_states(arena: jax.Array, layout: ArenaLayout, j: int, slot_base: jax.Array, conv: jax.Array,
                       state: jax.Array) -> jax.Array:
    """Write KDA layer j's new states and conv windows of a batch over its words of each row's slot: one
    scatter of [layer_words / w, w] rectangles into the arena viewed as rows of `row_width` words (a
    layer's run may start mid-unit). Rows sharing a slot (padding rows) write the same words."""
    b, rw = slot_base.shape[0], layout.row_width
    per_unit, le = layout.unit_elems // rw, layout.layer_words // rw
    new = jnp.concatenate([layout.encode_state(state).reshape(b, -1, rw), conv.reshape(b, -1, rw)], 1)  # [B, le, rw]
    start = slot_base * per_unit + j * le
    if b == 1:  # see read_blocks: a one-index scatter would become a dynamic update XLA may duplicate
        start, new = jnp.tile(start, 2), jnp.tile(new, (2, 1, 1))
    dn = jax.lax.ScatterDimensionNumbers(update_window_dims=(1, 2), inserted_window_dims=(),
                                         scatter_dims_to_operand_dims=(0,))
    rows = jax.lax.scatter(arena.reshape(-1, rw), start[:, None], new, dn, mode=_BLOCKS)
    return rows.reshape(arena.shape)


def scatter_states(arena: jax.Array, layout: ArenaLayout, slot_base: jax.Array, convs, states) -> jax.Array:
    """Write the KDA layers' dense per-batch states and conv windows back into their slots: one block
    write of whole slots (layers share boundary units, so they are written together).

    Rows that share a slot (padding rows all use the scratch slot) write the same units; which one
    wins does not matter because nobody reads the scratch slot."""
    b = slot_base.shape[0]
    parts = [x.reshape(b, -1) for conv, state in zip(convs, states) for x in (layout.encode_state(state), conv)]
    rows = jnp.concatenate(parts, 1)
    rows = jnp.pad(rows, ((0, 0), (0, layout.slot_units * layout.unit_elems - rows.shape[1])))
    return write_blocks(arena, slot_base, rows)


def read_conv(arena: jax.Array, layout: ArenaLayout, j: int, slot_base: jax.Array, fresh: jax.Array) -> jax.Array:
    """KDA layer j's conv windows of a batch -> [B, 3, W-1, P] (zeros where `fresh`): a block read
    of only the units that hold them."""
    b, ue, le = slot_base.shape[0], layout.unit_elems, layout.layer_words
    start = j * le + layout.state_words  # words into the slot
    if isinstance(j, int):
        u0, u1 = start // ue, -(-(j + 1) * le // ue)
        rows = read_blocks(arena, slot_base + u0, u1 - u0)[:, start - u0 * ue:start - u0 * ue + layout.conv_words]
    else:  # traced j (a scan over layers)
        rows = read_slot_rows(arena, layout, slot_base, start, layout.conv_words)
    return jnp.where(fresh[:, None], 0.0, rows).reshape(b, *layout.conv_shape[1:])


def update_states_in_place(arena: jax.Array, layout: ArenaLayout, j: int, read_base: jax.Array,
                           write_base: jax.Array, fresh: jax.Array, windows: jax.Array, update):
    """Run KDA layer j's state update row by row on the arena itself -> (arena, out [B, ...]).

    For row i in turn: read the layer's state from slot `read_base[i]` (zeros where `fresh[i]`),
    `(out_i, new_state) = update(i, state [N, K, V])`, and write the new state and `windows[i]` over
    the layer's words of slot `write_base[i]` with one dynamic-update-slice, which XLA performs in
    place on the loop-carried arena. Each row's state is read once and written once while it sits
    in cache, instead of the gather / batched update / concatenate / scatter round trips of the
    dense path, and a row's arithmetic does not depend on the batch size. The arena is addressed as
    rows of `row_width` words, so a layer's run (which may start mid-unit) is one rectangle. A row
    reads its own slot before any row writes it: a slot being written is never another row's read
    slot in the same step."""
    b, rw = read_base.shape[0], layout.row_width
    per_unit, ns, le = layout.unit_elems // rw, layout.state_words // rw, layout.layer_words // rw
    zero = jnp.zeros(layout.state_shape[1:], jnp.float32)
    out_shape = jax.eval_shape(update, 0, zero)[0]

    def row(i, carry):
        rows, out = carry
        # one copy of the slot's words (zeros for a fresh row): a select on the slice instead would be
        # fused into both the product and the update, two passes over the arena's words per row
        words = jax.lax.cond(fresh[i], lambda: jnp.zeros((ns, rw), rows.dtype),
                             lambda: jax.lax.dynamic_slice_in_dim(rows, read_base[i] * per_unit + j * le, ns))
        state = layout.decode_state(words.reshape(layout.state_word_shape))
        o, state = update(i, state)
        new = jnp.concatenate([layout.encode_state(state).reshape(-1, rw), windows[i].reshape(-1, rw)])  # [le, rw]
        rows = jax.lax.dynamic_update_slice_in_dim(rows, new, write_base[i] * per_unit + j * le, 0)
        return rows, jax.lax.dynamic_update_index_in_dim(out, o.astype(out.dtype), i, 0)

    out = jnp.zeros((b, *out_shape.shape), out_shape.dtype)
    # A trip count XLA cannot fold (write_base is never negative): with a constant 1 it would inline
    # the loop body, and the inlined reads and writes through the row view copy the whole arena.
    n = b - jnp.sum(write_base < 0, dtype=jnp.int32)
    rows, out = jax.lax.fori_loop(0, n, row, (arena.reshape(-1, rw), out))
    return rows.reshape(arena.shape), out
