"""Hybrid prefix cache: shared MLA pages plus immutable KDA state checkpoints.

MLA's latent cache is append-only, so a full page of a prefix can be shared read-only by every
request with that prefix. KDA's state is overwritten at every token, so it can only be reused from
*checkpoints*: immutable snapshots of the whole recurrent state (and conv windows) at a position.

Three separate sizes:
- the MLA page size (arena layout);
- where checkpoints may sit: multiples of `align` (= the KDA chunk alignment of the prefill, so a
  warm resume runs exactly the chunks a cold recompute runs, see below), at an interval during
  prefill, at every prompt end, every `decode_interval` decode tokens, and at a branch point the
  second time it is seen (a prefix whose MLA pages are cached deeper than any checkpoint);
- the hash unit (<= 128 tokens): keys are chained digests, so a boundary names the whole prefix,
  plus the tail tokens past the last unit boundary; every key carries a kind tag (full page,
  partial page, KDA checkpoint) so MLA and KDA entries never collide.

A hit is `min(MLA hit, deepest checkpoint <= MLA hit)` capped at `len - 1`. Copy-on-write happens in
the jitted step: the request reads the checkpoint slot and writes its private working slot. A
partially filled page is copied into a private page. Registering a checkpoint transfers ownership
of the request's working slot to the cache (no bytes move) and gives the request a fresh slot that
the next step fills from the checkpoint.

Bit-exactness: prefill rows start at multiples of `align` and the model's KDA chunking is relative
to the row start, so a resume at a checkpoint runs the same arithmetic as a cold prefill. Only
prefill-computed pages and states are ever shared. Decode runs the token-by-token recurrence, which
rounds differently, so the engine shares nothing a decode wrote; at every `decode_interval` it
queues an internal *canonical* prefill row over the conversation so far (from the deepest shared
checkpoint), whose pages and state are registered as the decode-interval checkpoint. A warm resume
from any checkpoint kind is therefore bit-identical to a cold recompute.

Eviction is LRU with reference counts over checkpoints and the pages nobody else holds together
(a conversation's deeper pages before its shallower ones; checkpoints waiting requests plan to
resume from last), so a fresh checkpoint outlives old pages; evicting a page evicts the checkpoints
and deeper pages that depend on it, and a checkpoint may be evicted without its pages. A state slot
needs a slot-aligned run of units (slots come from the arena's top, pages from its bottom): the
least recently used checkpoint gives one up; with none left, eviction frees the run whose units the
fewest cache entries hold, and only those entries (`_free_cheapest_slot_run`). Which units only the cache
holds is a compare of two arrays over the arena (all holders, `UnitRefs.counts`; page entries,
`cache_refs`), so what the scheduler asks every step stays under a millisecond at K3 arena sizes
(~10^6 units, ~10^4 entries; benchmarks/cache_bookkeeping.py).

With a host tier (`serve/host_cache.py`), what eviction drops is first copied to host memory (one
batched read per eviction round, `spill`), lookups walk both tiers, and a hit's host parts are
restored into the requesting sequence's memory at admission (see `Engine._admit`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from serve.host_cache import CKPT, PAGE, HostCache, HostEntry, own_rows
from serve.memory import Arena, ArenaLayout, UnitRefs

FULL, PARTIAL, KDA = b"M", b"P", b"K"  # kind tags of the keys
PROMPT_END, CHUNK_END, DECODE, BRANCH = "prompt_end", "chunk_end", "decode_interval", "branch_point"


@dataclass(frozen=True)
class PrefixCacheConfig:
    enabled: bool = True
    hash_unit: int = 16
    checkpoint_interval: int = 512  # prefill checkpoints every this many tokens (rounded to align)
    decode_interval: int = 256  # decode checkpoints every this many tokens (rounded to align)


def prefix_salt(cache_salt: Optional[str] = None, adapter_uid: Optional[int] = None,
                embeds_digest: Optional[bytes] = None) -> bytes:
    """The salt seeding a request's prefix hashes (`PrefixHasher`): its `cache_salt`, the load of its LoRA
    adapter and its prompt vectors' digest, each tagged and length-prefixed, so no choice of one part reads
    as another (joined as they were, cache_salt="\\0lora:1" on the base model named adapter 1's cached
    prefixes). b"" for none (an empty cache_salt too): the unsalted chain. (A lone surrogate, which JSON's "\\ud800" decodes to, is
    encoded as such: it raised UnicodeEncodeError.)"""
    parts = ((b"salt", cache_salt.encode("utf-8", "surrogatepass") if cache_salt else None),  # ("": none)
             (b"lora", None if adapter_uid is None else b"%d" % adapter_uid), (b"embd", embeds_digest))
    return b"".join(tag + b"%d:" % len(v) + v for tag, v in parts if v is not None)


class PrefixHasher:
    """Chained digests of a growing token list at every `unit` boundary. A `salt` (a request's
    `cache_salt`) seeds the chain, so only requests with the same salt share cached prefixes."""

    def __init__(self, unit: int, salt: bytes = b""):
        self.unit, self.salt = unit, salt
        self.digests = [hashlib.blake2b(b"salt:" + salt, digest_size=16).digest() if salt else b"\0" * 16]
        self.tokens: list[int] = []

    def fresh(self) -> "PrefixHasher":
        """An empty hasher with the same unit and salt."""
        return PrefixHasher(self.unit, self.salt)

    def copy(self) -> "PrefixHasher":
        """A hasher at the same point (a forked beam continues its parent's chain)."""
        h = self.fresh()
        h.digests, h.tokens = list(self.digests), list(self.tokens)
        return h

    def extend(self, tokens: list[int]) -> None:
        self.tokens = tokens
        while len(self.digests) * self.unit <= len(tokens):
            i = len(self.digests)
            block = np.asarray(tokens[(i - 1) * self.unit:i * self.unit], np.int64).tobytes()
            self.digests.append(hashlib.blake2b(self.digests[-1] + block, digest_size=16).digest())

    def key(self, kind: bytes, n: int) -> bytes:
        """The key naming the prefix tokens[:n] (n <= len(tokens))."""
        i = n // self.unit
        tail = np.asarray(self.tokens[i * self.unit:n], np.int64).tobytes()
        return kind + self.digests[i] + tail


@dataclass
class PageEntry:
    key: bytes
    units: list[int]  # one unit per MLA layer
    index: int  # page index in the sequence
    valid: int  # tokens of the page that belong to the prefix
    last_used: int
    parent: Optional[bytes]
    children: set = field(default_factory=set)
    dependents: set = field(default_factory=set)  # checkpoint keys needing this page


_NEVER = np.iinfo(np.int64).max  # the last use of a free row: after every entry


def _row_view(name: str, what: str) -> property:
    """`EntryRows`' read-only view of its array `name` cut to the rows handed out so far (`len(entries)`, free
    rows included): `add` may grow the array, so the view is valid until then."""
    return property(lambda self: getattr(self, name)[:len(self.entries)],
                    doc=f"{what} (a view: valid until the next `add`).")


class EntryRows:
    """The page entries as rows of arrays (units, one per MLA layer; the slot runs those units fall in; page
    index; order of caching; last use), kept as entries come and go or are used: the slot-run screening and
    the LRU order read them all at each eviction, and rebuilding them from the entries took ~0.1 s a call at
    K3 sizes (10^5 entries at page 16). Rows of removed entries hold -1 units and runs and are reused.

    `runs`: the runs are the arena's fixed slot-aligned runs (`Arena.slot_runs`: run i is units
    [run_base + i * slot_units, ...)); a row lists each run its units fall in once, ascending, -1 after."""

    def __init__(self, layers: int, run_base: int = 0, slot_units: int = 1, num_runs: int = 0):
        self._units = np.full((64, layers), -1, np.int32)
        self._runs = np.full((64, layers), -1, np.int32)
        self._index = np.zeros(64, np.int64)  # the entry's page index (depth in its chain)
        self._added = np.zeros(64, np.int64)  # when it was added (the cache's dict order)
        self._last_used = np.full(64, _NEVER, np.int64)  # the entry's last use (free rows: _NEVER)
        self.run_base, self.slot_units, self.num_runs = run_base, max(1, slot_units), num_runs
        self._count = itertools.count()
        self.entries: list = []  # row -> PageEntry, or None for a free row
        self._free: list[int] = []
        self._row: dict[bytes, int] = {}
        # run -> the rows holding units in it, and how many: what freeing a run costs at least, without a pass
        # over every row per run considered (~3 M (row, run) pairs at K3 sizes, page 16)
        self.in_run: list[set[int]] = [set() for _ in range(num_runs)]
        self.run_rows = np.zeros(num_runs, np.int64)

    units = _row_view("_units", "[rows, layers] int32")
    runs = _row_view("_runs", "[rows, layers] int32")
    index = _row_view("_index", "[rows] int64")
    last_used = _row_view("_last_used", "[rows] int64")
    added = _row_view("_added", "[rows] int64")

    def add(self, e: PageEntry) -> None:
        if self._free:
            r = self._free.pop()
        else:
            r = len(self.entries)
            self.entries.append(None)
            if r == len(self._units):
                self._units, self._runs = (np.concatenate([a, np.full_like(a, -1)]) for a in (self._units, self._runs))
                self._index, self._added = (np.concatenate([a, np.zeros(r, np.int64)])
                                            for a in (self._index, self._added))
                self._last_used = np.concatenate([self._last_used, np.full(r, _NEVER, np.int64)])
        self._units[r] = e.units
        units = np.asarray(e.units, np.int64)
        runs = np.unique((units[units >= self.run_base] - self.run_base) // self.slot_units)
        runs = runs[runs < self.num_runs]
        self._runs[r] = -1
        self._runs[r, :len(runs)] = runs
        for i in runs.tolist():
            self.in_run[i].add(r)
        self.run_rows[runs] += 1
        self._index[r], self._added[r], self._last_used[r] = e.index, next(self._count), e.last_used
        self.entries[r] = e
        self._row[e.key] = r

    def touch(self, e: PageEntry, now: int) -> None:
        """The entry was used at `now`."""
        e.last_used = now
        self._last_used[self._row[e.key]] = now

    def remove(self, key: bytes) -> None:
        r = self._row.pop(key)
        runs = self._runs[r][self._runs[r] >= 0]
        for i in runs.tolist():
            self.in_run[i].discard(r)
        self.run_rows[runs] -= 1
        self._units[r] = self._runs[r] = -1
        self._last_used[r] = _NEVER
        self.entries[r] = None
        self._free.append(r)


@dataclass
class CkptEntry:
    key: bytes
    slot: int
    pos: int
    kind: str
    last_used: int
    pins: int = 0
    pages: list = field(default_factory=list)  # page keys this checkpoint depends on


@dataclass
class Hit:
    pos: int  # logical prefix length reused (0: none)
    ckpt: Optional[CkptEntry | HostEntry]
    pages: list  # full PageEntry objects shared read-only (HostEntry: in host memory, restored at admission)
    partial: Optional[PageEntry | HostEntry]  # page to copy (prefix ends inside it)
    mla_tokens: int  # how deep the MLA pages alone matched
    device_pos: int = 0  # how deep the device tier alone would have resumed

    @property
    def host_entries(self) -> list[HostEntry]:
        return [e for e in [*self.pages, self.partial, self.ckpt] if isinstance(e, HostEntry)]


class PrefixCache(UnitRefs):
    """Requests and cache entries both hold units (`UnitRefs`); a unit is freed with its last holder."""

    def __init__(self, allocator: Arena, layout: ArenaLayout, align: int, cfg: PrefixCacheConfig,
                 host: Optional[HostCache] = None, read_units: Optional[Callable] = None):
        """`host` / `read_units(units, segments) -> (rows, token rows)`: the host tier and how to copy arena
        units to host memory (`segments`: (uid, units) of each entry, in order; both or neither)."""
        if not 1 <= cfg.hash_unit <= 128:
            raise ValueError(f"hash_unit must be in 1..128, got {cfg.hash_unit}")
        UnitRefs.__init__(self, allocator)
        self.layout, self.cfg, self.align = layout, cfg, align
        self.host, self.read_units = host, read_units
        self.origin = ""  # the weights the entries are computed with (a shared store's engines set it; see HostEntry)
        self._spill: list = []  # (entry, units) evicted this round, copied to host by `_flush_spill`
        self._clearing = False
        self.clears = 0  # times `clear` ran (a data-parallel router forgets what it sent a replica since)
        self._released: Optional[list] = None  # while not None, evicted pages' units are collected here
        self.ps = layout.page_size
        self.interval = max(align, cfg.checkpoint_interval // align * align)
        self.decode_interval = max(align, cfg.decode_interval // align * align)
        self.pages: dict[bytes, PageEntry] = {}
        runs, run_base = allocator.slot_runs()
        self._rows = EntryRows(layout.num_mla_layers, run_base, layout.slot_units, len(runs))  # page entries as
        # array rows (eviction)
        self.ckpts: dict[bytes, CkptEntry] = {}
        self.cache_refs = np.zeros(layout.num_units, np.int32)  # [num_units] how many page entries hold each unit
        self._clock = itertools.count()
        self.metrics = dict(queries=0, query_tokens=0, hit_tokens=0, mla_tokens_reused=0, kda_hits=0,
                            kda_misses=0, recomputed_no_checkpoint=0, checkpoints_registered=0,
                            checkpoints_evicted=0, pages_evicted=0, host_hits=0, host_hit_tokens=0)

    # ---- lookup -------------------------------------------------------------------------------
    def match(self, h: PrefixHasher, n_tokens: int) -> Hit:
        """Deepest reusable prefix of the first `n_tokens` tokens (capped at n_tokens - 1), over the
        device tier and, when there is one, the host tier."""
        hit = self._match(h, n_tokens, None)
        if self.host is not None and self.host.entries:
            deeper = self._match(h, n_tokens, self.host)
            if deeper.pos > hit.pos:
                deeper.device_pos = hit.pos
                return deeper
            hit.mla_tokens = max(hit.mla_tokens, deeper.mla_tokens)
        hit.device_pos = hit.pos
        return hit

    def _match(self, h: PrefixHasher, n_tokens: int, host: Optional[HostCache]) -> Hit:
        def get(table, key):
            e = table.get(key)
            if e is None and host is not None:
                e = host.get(key)
                return e if e is not None and e.origin == self.origin else None
            return e

        cap = n_tokens - 1
        full = []
        while (len(full) + 1) * self.ps <= cap:
            e = get(self.pages, h.key(FULL, (len(full) + 1) * self.ps))
            if e is None:
                break
            full.append(e)
        mla = len(full) * self.ps
        # deepest checkpoint at an aligned position whose pages are all present
        pos = (min(cap, mla + self.ps - 1) // self.align) * self.align
        while pos > 0:
            c = get(self.ckpts, h.key(KDA, pos))
            if c is not None:
                partial = None
                if pos % self.ps:
                    partial = get(self.pages, h.key(PARTIAL, pos))
                    if partial is None and pos // self.ps < len(full):
                        partial = full[pos // self.ps]  # a full page holds the partial prefix too
                    if partial is None:
                        pos -= self.align
                        continue
                return Hit(pos, c, full[:pos // self.ps], partial, max(mla, pos))
            pos -= self.align
        return Hit(0, None, [], None, mla)

    def record_query(self, n_tokens: int, hit: Hit, preempted: bool = False) -> None:
        """Count a lookup of `n_tokens` tokens. A preempted sequence's readmission counts its query / hit tokens
        (device and host tier) as `preempted_*`, apart: vLLM's prefix cache queries and hits are new requests'."""
        m = self.metrics
        pre = "preempted_" if preempted else ""
        m["queries"] += 1
        m[pre + "query_tokens"] = m.get(pre + "query_tokens", 0) + n_tokens
        m[pre + "hit_tokens"] = m.get(pre + "hit_tokens", 0) + hit.pos
        m["mla_tokens_reused"] += hit.pos
        if hit.ckpt is not None:
            m["kda_hits"] += 1
            # (a host entry's `kind` is what it holds, page or ckpt; its checkpoint kind is `ckpt_kind`)
            kind = hit.ckpt.ckpt_kind if isinstance(hit.ckpt, HostEntry) else hit.ckpt.kind
            m[f"kda_hits_{kind}"] = m.get(f"kda_hits_{kind}", 0) + 1
        else:
            m["kda_misses"] += 1
        m["recomputed_no_checkpoint"] += max(0, min(hit.mla_tokens, n_tokens - 1) - hit.pos)
        if self.host is not None:
            m[pre + "host_query_tokens"] = m.get(pre + "host_query_tokens", 0) + max(0, n_tokens - 1 - hit.device_pos)
        if hit.pos > hit.device_pos:
            m["host_hits"] += 1
            m[pre + "host_hit_tokens"] = m.get(pre + "host_hit_tokens", 0) + hit.pos - hit.device_pos

    def pin_host(self, hit: Hit) -> None:
        """Keep the hit's host entries in the store until admission has restored them (`unpin_host`)."""
        for e in hit.host_entries:
            self.host.pin(e)

    def holds(self, hit: Hit) -> bool:
        """Whether every device-tier entry `hit` reads is still cached: between planning and admission an
        eviction for the running requests may have taken one (it was not pinned yet)."""
        return (all(self.pages.get(e.key) is e for e in hit.pages if isinstance(e, PageEntry))
                and (not isinstance(hit.ckpt, CkptEntry) or self.ckpts.get(hit.ckpt.key) is hit.ckpt)
                and (not isinstance(hit.partial, PageEntry) or self.pages.get(hit.partial.key) is hit.partial))

    def acquire(self, hit: Hit) -> None:
        """Pin what a newly admitted request will read in its first step (its host entries are pinned
        by `pin_host`)."""
        now = next(self._clock)
        for e in hit.pages:
            if isinstance(e, HostEntry):
                continue
            self._rows.touch(e, now)
            self.ref(e.units)
        if isinstance(hit.ckpt, CkptEntry):
            hit.ckpt.pins += 1
            hit.ckpt.last_used = now
        if isinstance(hit.partial, PageEntry):
            self._rows.touch(hit.partial, now)
            self.ref(hit.partial.units)  # held until the copy has run

    def unpin(self, hit: Hit) -> None:
        if isinstance(hit.ckpt, CkptEntry):
            hit.ckpt.pins -= 1
        if isinstance(hit.partial, PageEntry):
            self.unref(hit.partial.units)

    def unpin_host(self, hit: Hit) -> None:
        """Drop the pins `acquire` put on the hit's host entries; the host copies of pages the device
        tier holds again are dropped (checkpoints and partial pages were restored into private memory,
        so their host copies stay)."""
        for e in hit.host_entries:
            self.host.unpin(e)
            if e.kind == PAGE and e.key in self.pages:
                self.host.discard(e.key)

    def release_hit(self, hit: Hit) -> None:
        """Undo `acquire` for a request that was not admitted after all."""
        self.unpin(hit)
        self.unpin_host(hit)
        for e in hit.pages:
            if isinstance(e, PageEntry):
                self.unref(e.units)

    def adopt_page(self, e: HostEntry, units: list[int]) -> Optional[PageEntry]:
        """Share a full page restored from host memory into `units` again as a device entry (the
        units then have one more holder: the cache). None if the device tier has that page already."""
        if e.key in self.pages:
            return None
        self._hold(units)
        page = PageEntry(e.key, list(units), e.index, e.valid, next(self._clock), e.parent)
        self.pages[e.key] = page
        self._rows.add(page)
        if e.parent in self.pages:
            self.pages[e.parent].children.add(e.key)
        return page

    # ---- registration -------------------------------------------------------------------------
    def register_pages(self, h: PrefixHasher, seq_pages: list[list[int]], upto: int, start_index: int) -> int:
        """Share the request's pages that are full below `upto`; returns the new registered count."""
        n_full = upto // self.ps
        now = next(self._clock)
        for j in range(start_index, n_full):
            key = h.key(FULL, (j + 1) * self.ps)
            if key in self.pages:
                continue  # an identical page is already shared; the request keeps its own copy
            parent = h.key(FULL, j * self.ps) if j else None
            units = [seq_pages[l][j] for l in range(len(seq_pages))]
            self._hold(units)
            self.pages[key] = PageEntry(key, units, j, self.ps, now, parent)
            self._rows.add(self.pages[key])
            if self.host is not None:
                self.host.discard(key)
            if parent in self.pages:
                self.pages[parent].children.add(key)
        return max(start_index, n_full)

    def register_checkpoint(self, h: PrefixHasher, pos: int, slot: int, kind: str,
                            seq_pages: list[list[int]]) -> bool:
        """Take ownership of `slot` as the state at `pos`; False if an identical one exists."""
        key = h.key(KDA, pos)
        if key in self.ckpts or pos % self.align:
            return False
        deps = [h.key(FULL, (j + 1) * self.ps) for j in range(pos // self.ps)]
        if pos % self.ps:
            pkey = h.key(PARTIAL, pos)
            if pkey not in self.pages:
                j = pos // self.ps
                units = [seq_pages[l][j] for l in range(len(seq_pages))]
                self._hold(units)
                parent = h.key(FULL, j * self.ps) if j else None
                self.pages[pkey] = PageEntry(pkey, units, j, pos % self.ps, next(self._clock), parent)
                self._rows.add(self.pages[pkey])
                if parent in self.pages:
                    self.pages[parent].children.add(pkey)
            deps.append(pkey)
        if any(d not in self.pages for d in deps):
            return False  # its pages are gone already
        c = CkptEntry(key, slot, pos, kind, next(self._clock), pages=deps)
        self.ckpts[key] = c
        if self.host is not None:
            self.host.discard(key)
        for d in deps:
            self.pages[d].dependents.add(key)
        self.metrics["checkpoints_registered"] += 1
        return True

    # ---- eviction -----------------------------------------------------------------------------
    def _hold(self, units) -> None:
        """A page entry takes a hold on `units`."""
        self.ref(units)
        np.add.at(self.cache_refs, np.asarray(units, np.int64), 1)

    def _let_go(self, units) -> None:
        units = np.asarray(units, np.int64)
        np.subtract.at(self.cache_refs, units, 1)
        self.unref(units)

    def _only_cached(self) -> np.ndarray:
        """[num_units] bool: units that page entries hold and nothing else (no request shares them).
        Dropping entries keeps it true for the rest (both counts fall together), so one evaluation
        serves a whole eviction round."""
        return (self.cache_refs > 0) & (self.cache_refs == self.counts)

    def evictable(self) -> tuple[int, int]:
        """(units, slots) that eviction could free right now: unpinned checkpoint slots and pages
        that only cache entries hold."""
        slots = sum(1 for c in self.ckpts.values() if c.pins == 0)
        units = int(np.count_nonzero(self._only_cached()))
        return units + slots * self.layout.slot_units, slots

    def evict_for(self, units: int, slots: int, keep: frozenset = frozenset()) -> None:
        """Evict LRU entries until `units` free units and `slots` free slot runs exist (best effort).
        Checkpoints in `keep` (what waiting requests plan to resume from) go last."""
        def short_of_slots():
            return bool(slots) and len(self.alloc._free_slot_bases(slots)) < slots

        def short():
            return self.alloc.free_units < units or short_of_slots()

        if not short():
            return  # the common case, every step: nothing to sort
        try:
            free = [c for c in self.ckpts.values() if c.pins == 0]
            kept = sorted((c for c in free if c.key in keep), key=lambda c: c.last_used)
            ckpts = sorted((c for c in free if c.key not in keep), key=lambda c: c.last_used)
            for c in ckpts + kept:
                if not short_of_slots():
                    break
                self._drop_ckpt(c)
            while short_of_slots() and self._free_cheapest_slot_run():
                pass
            if not short():
                return  # (a slot was all that was short: no page order needed)
            only = self._only_cached()
            lru = self._lru_order(ckpts)
            for entries in (lru(), kept, lru(pages_only=True)):
                for e in entries:
                    if not short():
                        return
                    if isinstance(e, CkptEntry):
                        self._drop_ckpt(e)
                    elif e.key in self.pages and not e.dependents and only[e.units].all():
                        self._drop_page(e)
        finally:
            self._flush_spill()

    def _lru_order(self, ckpts: list[CkptEntry]):
        """-> walk(pages_only=False): a generator of `ckpts` and every page entry, least recently used first (a
        checkpoint before pages of the same use, a conversation's deeper pages before its shallower ones,
        then the order they were cached), skipping pages dropped since. Sorted as arrays over the page rows
        (`EntryRows`): ~10^5 entries at K3 sizes, where building a key tuple for each took ~0.2 s; entries
        are only looked up as far as the walk goes."""
        rows = self._rows.entries
        nc, nr = len(ckpts), len(rows)
        lu = np.concatenate([np.fromiter((c.last_used for c in ckpts), np.int64, count=nc), self._rows.last_used])
        is_page = np.repeat(np.arange(2), [nc, nr])
        depth = np.concatenate([np.zeros(nc, np.int64), self._rows.index])
        added = np.concatenate([np.zeros(nc, np.int64), self._rows.added])
        order = np.lexsort((added, -depth, is_page, lu))[:nc + len(self.pages)].tolist()  # (free rows last)

        def walk(pages_only: bool = False):
            for k in order:
                if k < nc:
                    if not pages_only:
                        yield ckpts[k]
                elif (e := rows[k - nc]) is not None:
                    yield e
        return walk

    def _free_cheapest_slot_run(self) -> bool:
        """Free one slot-aligned run of units (what a state slot needs) by evicting exactly the cache entries
        that hold its units, choosing the run that drops the fewest entries (then the least recently used)
        -> whether a run was freed. Pages come from the arena's low end and slots from its top, so once
        pages reach into the slot region a new slot needs the pages of one particular run gone: evicting
        in LRU / depth order instead would drop most of the cache before that run happened to be free.
        A run is out of reach if a request holds any of its units (a slot, or a page a request shares)
        or a pinned checkpoint depends on one of its pages.

        At K3 sizes an arena has ~10^6 units in ~10^3 runs and ~10^4 page entries, so runs are screened
        with arrays: which are out of reach, and for each the entries holding its units directly (a lower
        bound on what freeing it costs, as (entries, most recent use)); only runs in that order have their
        full cost (deeper pages of the chains, dependent checkpoints) walked, until the bound passes the
        best found."""
        rows, start = self.alloc.slot_runs()  # [runs, su]
        su, n_runs = self.layout.slot_units, len(rows)
        if not n_runs:
            return False
        ckpt_at: dict[int, CkptEntry] = {}
        slot_free, slot_lu = np.zeros(n_runs, bool), np.full(n_runs, -1, np.int64)
        for c in self.ckpts.values():
            i = (c.slot - start) // su  # slots are always allocated at run bases
            if 0 <= i < n_runs and not c.pins:
                ckpt_at[i], slot_free[i], slot_lu[i] = c, True, c.last_used
        only = self._only_cached()[start:start + rows.size].reshape(rows.shape)
        blocked = ((rows == self.alloc.PAGE) & ~only).any(axis=1)  # a page a request holds (or shares)
        blocked |= (rows == self.alloc.SLOT).any(axis=1) & ~slot_free  # a request's state slot
        cand = np.flatnonzero((rows != self.alloc.FREE).any(axis=1) & ~blocked)
        if not len(cand):
            return False
        # a lower bound on each run's cost: (entries holding its units directly, the most recent use among them);
        # runs are taken in that order, a group of equal counts at a time (their uses read only then), and only
        # until the bound passes the best exact cost found (ties: the highest run, as a scan from the top would)
        held = self._rows
        assert (held.run_base, held.num_runs) == (start, n_runs)
        bound_n = held.run_rows + slot_free
        best = None
        for n in np.unique(bound_n[cand]).tolist():
            if best is not None and n > best[0][0]:
                break
            group = cand[bound_n[cand] == n]
            lu = np.array([max(int(slot_lu[i]), int(held.last_used[list(held.in_run[i])].max(initial=-1)))
                           for i in group.tolist()], np.int64)
            for i, bound_lu in sorted(zip(group.tolist(), lu.tolist()), key=lambda x: (x[1], -x[0])):
                if best is not None and (n, bound_lu, -i) >= best[0]:
                    break
                direct = sorted(held.in_run[i])
                run = self._run_entries([held.entries[k] for k in direct], ckpt_at.get(i))
                if run is None:
                    continue
                pages, ckpts = run
                cost = (len(pages) + len(ckpts), max([self.pages[k].last_used for k in pages]
                                                     + [self.ckpts[k].last_used for k in ckpts]), -i)
                if best is None or cost < best[0]:
                    best = (cost, pages, ckpts)
        if best is None:
            return False
        for k in best[2]:
            if k in self.ckpts:
                self._drop_ckpt(self.ckpts[k])
        with self._releasing_at_once():
            for k in sorted(best[1], key=lambda k: -self.pages[k].index):  # deepest first: no cascades
                if k in self.pages:
                    self._drop_page(self.pages[k])
        return True

    def _run_entries(self, direct: list[PageEntry], ckpt: Optional[CkptEntry]):
        """What evicting a run takes, given the page entries holding its units and the checkpoint whose
        slot it is -> (page keys incl. their deeper pages, checkpoint keys), or None when a pinned
        checkpoint needs one of those pages."""
        pages, ckpts = set(), set()
        if ckpt is not None:
            ckpts.add(ckpt.key)
        stack = [e.key for e in direct]
        while stack:
            k = stack.pop()
            if k not in pages:
                pages.add(k)
                stack.extend(c for c in self.pages[k].children if c in self.pages)
        for k in pages:
            for ck in self.pages[k].dependents:
                if ck in self.ckpts:
                    if self.ckpts[ck].pins:
                        return None  # a checkpoint a waiting request is about to read needs the page
                    ckpts.add(ck)
        return pages, ckpts

    def _flush_spill(self) -> None:
        """Copy this round's evicted entries to the host tier: one read of all their units. Their
        units are free in the allocator already, but nothing has written them since (eviction runs
        between steps, before anything is allocated)."""
        spill, self._spill = self._spill, []
        self._to_host(spill)

    def _to_host(self, spill: list) -> None:
        """Copy (entry, units) pairs of the device tier to the host tier (one read of all their units)."""
        if not spill:
            return
        units = [u for _, us in spill for u in us]
        uids = [self.host.new_uid() for _ in spill]
        rows, tokens = self.read_units(units, [(uid, len(us)) for uid, (_, us) in zip(uids, spill)])
        i = 0
        for uid, (e, us) in zip(uids, spill):
            n = len(us)
            r, t = own_rows(rows, i, n), own_rows(tokens, i, n)
            if isinstance(e, CkptEntry):
                # (the token rows of slot units mean nothing; kept so every process writes the same back)
                h = HostEntry(e.key, CKPT, r, t, pos=e.pos, ckpt_kind=e.kind, uid=uid, origin=self.origin)
            else:
                h = HostEntry(e.key, PAGE, r, t, index=e.index, valid=e.valid, parent=e.parent, uid=uid,
                              origin=self.origin)
            self.host.put(h)
            i += n

    def publish(self, h: PrefixHasher, n_tokens: int) -> int:
        """Copy what a request of these first `n_tokens` tokens would resume from (the deepest checkpoint
        and the pages below it) to the host tier, keeping it on the device too (a disaggregated prefill
        producer; serve/engine.py). -> entries copied (those the host tier lacked)."""
        hit = self._match(h, n_tokens, None)
        if self.host is None or hit.ckpt is None:
            return 0
        pairs = [(e, list(e.units)) for e in hit.pages + ([hit.partial] if hit.partial is not None else [])]
        pairs.append((hit.ckpt, list(range(hit.ckpt.slot, hit.ckpt.slot + self.layout.slot_units))))
        pairs = [(e, us) for e, us in pairs if getattr(self.host.get(e.key), "origin", None) != self.origin]
        self._to_host(pairs)
        self.metrics["published_entries"] = self.metrics.get("published_entries", 0) + len(pairs)
        return len(pairs)

    def _drop_ckpt(self, c: CkptEntry) -> None:
        if c.key not in self.ckpts or c.pins:
            return
        del self.ckpts[c.key]
        if self.host is not None and not self._clearing:
            self._spill.append((c, list(range(c.slot, c.slot + self.layout.slot_units))))
        for d in c.pages:
            if d in self.pages:
                self.pages[d].dependents.discard(c.key)
        self.alloc.free_slot(c.slot)
        self.metrics["checkpoints_evicted"] += not self._clearing  # (a reset drops, it does not evict)

    @contextlib.contextmanager
    def _releasing_at_once(self):
        """Pages dropped inside release their units in one call at the end: per page, numpy's call overhead
        took seconds for `clear()` and a fifth of a slot eviction at K3 sizes."""
        if self._released is not None:  # (an outer block releases them)
            yield
            return
        self._released = []
        try:
            yield
        finally:
            released, self._released = self._released, None
            self._let_go(released)

    def _drop_page(self, e: PageEntry) -> None:
        """Evict a page, the deeper pages of its chain and the checkpoints depending on any of them."""
        if e.key not in self.pages:
            return
        for ck in list(e.dependents):
            if ck in self.ckpts:
                self._drop_ckpt(self.ckpts[ck])
        for child in list(e.children):
            if child in self.pages:
                self._drop_page(self.pages[child])
        if any(ck in self.ckpts for ck in e.dependents):
            return  # a pinned checkpoint still needs this page
        del self.pages[e.key]
        self._rows.remove(e.key)
        if e.parent in self.pages:
            self.pages[e.parent].children.discard(e.key)
        if self.host is not None and not self._clearing:
            self._spill.append((e, list(e.units)))
        if self._released is None:
            self._let_go(e.units)
        else:
            self._released.extend(e.units)
        self.metrics["pages_evicted"] += not self._clearing

    def clear(self) -> bool:
        """Drop every entry of both tiers that no request holds (nothing is copied to host memory)
        -> whether the cache is empty now. Checkpoints a request is about to read and pages running
        requests share stay until they are released."""
        self._clearing = True
        self.clears += 1
        try:
            with self._releasing_at_once():
                for c in [c for c in self.ckpts.values() if c.pins == 0]:
                    self._drop_ckpt(c)
                only = self._only_cached()
                for e in sorted(self.pages.values(), key=lambda e: -e.index):
                    if e.key in self.pages and not e.dependents and only[e.units].all():
                        self._drop_page(e)
        finally:
            self._clearing = False
        if self.host is not None:
            self.host.clear()
        return not self.ckpts and not self.pages and (self.host is None or not self.host.entries)

    def stats(self) -> dict:
        m = dict(self.metrics)
        m["hit_rate"] = m["hit_tokens"] / m["query_tokens"] if m["query_tokens"] else 0.0
        m["checkpoints"] = len(self.ckpts)
        m["pages"] = len(self.pages)
        m["kda_checkpoint_bytes"] = len(self.ckpts) * self.layout.slot_units * self.layout.unit_bytes
        if self.host is not None:
            m.update(self.host.stats())
        return m
