"""Host-memory tier of the prefix cache: what the arena evicts is kept in host RAM and restored on a hit.

A K3-class state checkpoint is large (every KDA layer's fp32 state: 434 MB per sequence for the
full model) and the arena holds few of them beside the MLA pages that running requests need, so the
device tier alone forgets a conversation a few turns after it goes idle. With `host_cache_bytes` set,
every prefix-cache entry the arena evicts (a shared MLA page of every MLA layer with its token ids,
a partial page, or a KDA checkpoint slot) is copied to host memory first, under the same key, and
a later lookup walks both tiers: the deepest usable prefix may mix device pages, host pages and a
host checkpoint. Admission then restores the host parts: host pages are written into newly
allocated units and shared again as ordinary device entries, a host partial page is written
straight into the request's private copy-on-write page, and a host checkpoint straight into the
request's own working state slot (so a restore needs no memory beyond what a cold request gets).
The bytes are the ones the arena held, so a warm resume from host memory is bit-identical to a
device hit, which is bit-identical to a cold recompute (serve/prefix_cache.py).

Several engines of one process may share one store (disaggregated prefill: `kv_transfer_config`,
serve/engine.py): a producer engine publishes each finished prompt's pages and deepest checkpoint into
it, and a consumer engine resumes that prompt from it like from its own host tier. Entries are only
meaningful between engines that lay out and compute them identically, so the first engine binds the
store to its fingerprint (model, weights checksum, arena layout, prefix hashing) and any other must match.

Host entries are evicted least recently used first when the host budget is full; entries a request
is about to restore are pinned. Transfers go through two small jitted programs of a fixed row count
(compiled at warm-up): a gather of arena rows and token rows to host, and a donated scatter of
rows back into the arena and token pages.
"""

from __future__ import annotations

import collections
import functools
import itertools
import numbers
import threading
from dataclasses import dataclass
from typing import Optional

import jax
import numpy as np

PAGE, CKPT = "page", "ckpt"


@dataclass(eq=False)
class HostEntry:
    """A prefix-cache entry held in host memory: the arena rows of its units (and their token ids)."""
    key: bytes
    kind: str  # PAGE (full or partial MLA page of every MLA layer) or CKPT (a KDA state slot)
    rows: np.ndarray  # [units, row words] float32: the arena rows, every rank's columns
    tokens: Optional[np.ndarray]  # [units, page_size] int32 token ids (pages only)
    index: int = 0  # pages: page index in the sequence
    valid: int = 0  # pages: tokens of the page that belong to the prefix
    parent: Optional[bytes] = None  # pages: the previous full page's key
    pos: int = 0  # checkpoints: position of the state
    ckpt_kind: str = ""  # checkpoints: prompt_end / chunk_end / decode_interval / branch_point
    pins: int = 0
    uid: int = 0  # names the entry's bytes on every process of a multi-process engine
    origin: str = ""  # the weights it was computed with (`PrefixCache.origin`): engines sharing a store serve
    # only entries of their own weights (one of them may have updated its weights since they bound the store)

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + (self.tokens.nbytes if self.tokens is not None else 0)


def own_rows(a: np.ndarray, start: int, n: int) -> np.ndarray:
    """Rows `start:start + n` of a batch copied to host (`Transfers.read`) as an entry's own array: a view would
    keep the whole batch in host memory as long as the entry lives, beyond the bytes the budget counts."""
    return a if start == 0 and n == len(a) else a[start:start + n].copy()


def _locked(method):
    """Run a `HostCache` method under the store's lock: engines stepping on different threads (a
    disaggregated prefill / decode pair behind the HTTP server) share one store."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


class HostCache:
    """Byte-budgeted LRU store of evicted prefix-cache entries, keyed like the device tier."""

    def __init__(self, budget_bytes: int, track_forgotten: bool = False):
        """`track_forgotten`: list the uids of entries that leave the store in `forgotten` (a multi-process
        engine's followers drop their pieces of them)."""
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, numbers.Integral) or budget_bytes < 0:
            raise ValueError(f"HostCache budget_bytes={budget_bytes!r}: expected an integer >= 0 (the host tier's "
                             f"size, host_cache_bytes, or a kv_transfer_config store's)")
        self.budget = budget_bytes
        self.entries: collections.OrderedDict[bytes, HostEntry] = collections.OrderedDict()  # LRU first
        self.used = 0
        self._uids = itertools.count(1)
        self.track_forgotten = track_forgotten
        self.forgotten: list[int] = []
        self.fingerprint: Optional[dict] = None  # what the engines sharing the store agree on (`bind`)
        self._lock = threading.RLock()
        self.metrics = dict(host_pages_stored=0, host_checkpoints_stored=0, host_pages_restored=0,
                            host_checkpoints_restored=0, host_entries_evicted=0, host_entries_rejected=0,
                            host_bytes_stored=0, host_bytes_restored=0, host_spill_seconds=0.0,
                            host_restore_seconds=0.0)

    @_locked
    def bind(self, fingerprint: dict) -> None:
        """Attach an engine: the first sets the fingerprint, every other must have the same one."""
        if self.fingerprint is None:
            self.fingerprint = dict(fingerprint)
            return
        for k, v in fingerprint.items():
            if self.fingerprint.get(k) != v:
                raise ValueError(f"kv_transfer_config.store: its entries come from engines whose {k} is "
                                 f"{self.fingerprint.get(k)!r}; this engine's is {v!r} (engines sharing a store "
                                 f"need the same model, weights, page size, cache dtypes and prefix hashing)")

    @_locked
    def new_uid(self) -> int:
        return next(self._uids)

    @_locked
    def get(self, key: bytes) -> Optional[HostEntry]:
        return self.entries.get(key)

    @_locked
    def touch(self, e: HostEntry) -> None:
        if e.key in self.entries:
            self.entries.move_to_end(e.key)

    @_locked
    def put(self, e: HostEntry) -> bool:
        """Store `e` (replacing an entry of the same key), evicting LRU entries to make room; False
        when it cannot fit (larger than the budget, or the rest is pinned)."""
        old = self.entries.get(e.key)
        if old is not None:
            if old.pins:
                self.touch(old)
                self._forget(e)
                return True  # identical bytes (same key) are already here and about to be read
            self._remove(old)
        if not self._make_room(e.nbytes):
            self.metrics["host_entries_rejected"] += 1
            self._forget(e)
            return False
        self.entries[e.key] = e
        self.used += e.nbytes
        self.metrics["host_pages_stored" if e.kind == PAGE else "host_checkpoints_stored"] += 1
        self.metrics["host_bytes_stored"] += e.nbytes
        return True

    @_locked
    def pin(self, e: HostEntry) -> None:
        """Keep `e` in the store (most recently used) until `unpin`: a request is about to restore it."""
        e.pins += 1
        self.touch(e)

    @_locked
    def unpin(self, e: HostEntry) -> None:
        e.pins -= 1

    @_locked
    def discard(self, key: bytes) -> None:
        """Drop the host copy of an entry the device tier holds again (unless a request is reading it)."""
        e = self.entries.get(key)
        if e is not None and not e.pins:
            self._remove(e)

    @_locked
    def restored(self, e: HostEntry) -> None:
        self.metrics["host_pages_restored" if e.kind == PAGE else "host_checkpoints_restored"] += 1
        self.metrics["host_bytes_restored"] += e.nbytes

    @_locked
    def clear(self) -> None:
        for e in [e for e in self.entries.values() if not e.pins]:
            self._remove(e)

    def _make_room(self, nbytes: int) -> bool:
        """Evict unpinned entries, least recently used first, until `nbytes` more fit -> whether they do (when
        they cannot fit beside the pinned entries, nothing is evicted for them)."""
        if sum(e.nbytes for e in self.entries.values() if e.pins) + nbytes > self.budget:
            return False
        for e in [e for e in self.entries.values() if not e.pins]:  # least recently used first
            if self.used + nbytes <= self.budget:
                break
            self._remove(e)
            self.metrics["host_entries_evicted"] += 1
        return self.used + nbytes <= self.budget

    def _remove(self, e: HostEntry) -> None:
        del self.entries[e.key]
        self.used -= e.nbytes
        self._forget(e)

    def _forget(self, e: HostEntry) -> None:
        if self.track_forgotten:
            self.forgotten.append(e.uid)

    @_locked
    def stats(self) -> dict:
        m = dict(self.metrics)
        m.update(host_bytes=self.used, host_budget_bytes=self.budget,
                 host_pages=sum(1 for e in self.entries.values() if e.kind == PAGE),
                 host_checkpoints=sum(1 for e in self.entries.values() if e.kind == CKPT))
        return m


# ---- transfers (fixed row count per call; the engine jits and warms them) -----------------------
def read_rows(arena: jax.Array, token_pages: jax.Array, units: jax.Array):
    """units [M] -> (arena rows [M, row words], token rows [M, page_size]): what host entries keep."""
    return arena[units], token_pages[units]


def write_rows(arena: jax.Array, token_pages: jax.Array, units: jax.Array, rows: jax.Array, tokens: jax.Array):
    """Write arena rows [M, row words] and token rows [M, page_size] over `units` [M] (donated buffers,
    updated in place). Padding entries all name the scratch page, which nobody reads."""
    return arena.at[units].set(rows), token_pages.at[units].set(tokens)


def _column_ranges(sharding, shape: tuple[int, int]) -> list[tuple[int, int]]:
    """The distinct column blocks this process's devices hold of a [rows, cols] array split (at most) by
    columns, in column order."""
    out = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        cols = index[1] if len(index) > 1 else slice(None)
        out.add((cols.start or 0, shape[1] if cols.stop is None else cols.stop))
    return sorted(out)


class Transfers:
    """The two jitted transfer programs of an engine's arena, at a fixed row count `chunk`.

    Host copies are *process-local*: a process keeps the columns of the arena rows its own devices hold
    (every column on one process; on a mesh over several processes, each keeps its ranks' KDA heads,
    and every process every MLA page and token row, which are replicated). All processes run the same
    programs in the same order (serve/multihost.py replays the leader's), so each one's pieces stay
    in step with the leader's bookkeeping."""

    def __init__(self, chunk: int, pad_unit: int, shardings=None):
        """`shardings`: the (arena, token pages) shardings on a mesh; None on one device (no mesh: outputs
        then stay uncommitted like the step's, so neither program sees a new signature)."""
        self.chunk, self.pad, self.shardings = chunk, pad_unit, shardings
        self._read = jax.jit(read_rows, out_shardings=shardings)
        self._write = jax.jit(write_rows, donate_argnums=(0, 1), out_shardings=shardings)

    def cache_size(self) -> int:
        return self._read._cache_size() + self._write._cache_size()

    @staticmethod
    def _local(x: jax.Array) -> np.ndarray:
        """This process's columns of a [rows, cols] array, in column order."""
        pieces = {}
        for sh in x.addressable_shards:
            cols = sh.index[1] if len(sh.index) > 1 else slice(None)
            pieces.setdefault(cols.start or 0, sh.data)
        return np.concatenate([np.asarray(pieces[k]) for k in sorted(pieces)], axis=1)

    def _global(self, local: np.ndarray, sharding, width: int):
        """A [chunk, width] array of `sharding` from this process's columns (numpy itself with no mesh)."""
        if sharding is None:
            return local
        ranges = _column_ranges(sharding, (self.chunk, width))
        offset, at = {}, 0
        for a, b in ranges:
            offset[a] = at
            at += b - a

        def piece(index):
            cols = index[1] if len(index) > 1 else slice(None)
            a = cols.start or 0
            b = width if cols.stop is None else cols.stop
            return local[:, offset[a]:offset[a] + b - a]
        return jax.make_array_from_callback((self.chunk, width), sharding, piece)

    def read(self, arena, token_pages, units: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """-> this process's host copies (rows [n, local words], tokens [n, page_size]) of `units`, in order."""
        rows, toks = [], []
        for i in range(0, max(1, len(units)), self.chunk):
            part = units[i:i + self.chunk]
            idx = np.full(self.chunk, self.pad, np.int32)
            idx[:len(part)] = part
            r, t = self._read(arena, token_pages, idx)
            rows.append(self._local(r)[:len(part)])
            toks.append(self._local(t)[:len(part)])
        return np.concatenate(rows), np.concatenate(toks)

    def write(self, arena, token_pages, units: list[int], rows: np.ndarray, tokens: np.ndarray):
        """-> (arena, token_pages) with this process's `rows` / `tokens` [n, ...] written over `units` [n]."""
        width, ps = arena.shape[1], token_pages.shape[1]
        sa, st = self.shardings or (None, None)
        for i in range(0, len(units), self.chunk):
            n = min(self.chunk, len(units) - i)
            idx = np.full(self.chunk, self.pad, np.int32)
            idx[:n] = units[i:i + n]
            r = np.zeros((self.chunk, rows.shape[1]), np.float32)
            r[:n] = rows[i:i + n]
            t = np.zeros((self.chunk, ps), np.int32)
            t[:n] = tokens[i:i + n]
            arena, token_pages = self._write(arena, token_pages, idx, self._global(r, sa, width),
                                             self._global(t, st, ps))
        return arena, token_pages
