"""Each sequence's MLA page table kept on the device, written by what changed (vLLM's block table).

A step reads every row's page table: the unit holding each page of each MLA layer, `[rows, Lm, P]`.
Built on the host from every row's table and sent whole, that is `rows x Lm x P` int32 on every step
(K3: 256 rows x 24 MLA layers x 2048 pages of 16 tokens at a 32k context = 50 MB to copy and transfer),
though a decode step adds at most one page a layer to a row, and only once every `page_size` tokens.

Here the tables live on the device, `int32[R + 1, Lm, P]` (P: the widest context bucket): one table row
for each of the R sequences that ran most recently, and a last row of scratch pages that padding rows
read. A batch names each row's table row (`StepBatch.table_rows` [B]) and the step gathers the
`[B, Lm, P']` it reads (P': its bucket) on the device. What the host sends is the entries a row lacks,
as (table row, layer, page index, unit) quads, scattered into the tables by a small program before the
step (`pending_quads`, then `apply`; a multi-process leader names them to the followers in between): the
pages a sequence appended since its row was last written (`Sequence.page_table`
counts them), or its whole table when it takes a row or its page lists were replaced or changed
(`Sequence.pages_changed`). The program is compiled at start-up for a few quad counts (padded up,
split above the largest), so no step of any mix compiles.

Rows are handed out when a sequence enters a batch, given back when its memory is released, and
otherwise taken back least recently used; a row named by the batch being built is never taken, and R
is at least the rows of the largest batch. A sequence whose row was taken gets another one and writes
its whole table there.

Entries past a row's page count are never cleared: they name units of whatever sequence held the row
before, or units of its own since freed. A step reads them only into context slots past the row's last
token, whose scores are masked and whose values are zeroed (`serve/step.py: known_keys`, which guards
the same case inside a row's last page), and writes only positions below `lengths + valid`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

# quads per update program call: a decode step of 256 rows x 24 layers adds at most 6 K; a row's whole table
# (a sequence starting to run, or one after a prefix-cache hit) up to Lm x P
SIZES = (1 << 10, 1 << 14, 1 << 18)


def tables_bytes(rows: int, layers: int, width: int) -> int:
    """Device bytes of the tables: `rows` sequences' and the padding rows' [layers, width] int32."""
    return (rows + 1) * layers * width * 4


def _apply(tables: jax.Array, quads: jax.Array) -> jax.Array:
    """tables [R + 1, Lm, P] with quads [4, K] (row, layer, index, unit) written; out-of-range rows dropped."""
    return tables.at[quads[0], quads[1], quads[2]].set(quads[3], mode="drop")


class PageTables:
    """The device tables, their rows' owners and the entries waiting to be written (see the module doc)."""

    def __init__(self, rows: int, layers: int, width: int, scratch_page: int, sharding=None):
        if rows < 1 or layers < 1 or width < 1:
            raise ValueError(f"page tables of {rows} rows x {layers} layers x {width} pages")
        self.rows, self.layers, self.width = rows, layers, width
        self.pad_row = rows  # the padding rows' table: scratch pages only
        self.scratch_page, self.sharding = scratch_page, sharding
        self.array = self._fresh()
        self._update = jax.jit(_apply, donate_argnums=0)
        self.owner: list = [None] * rows
        self.used = np.zeros(rows, np.int64)  # the batch that last named each row
        self.free = list(range(rows - 1, -1, -1))
        self.batches = 0
        self._pending: list[tuple] = []  # (row, first index, units [Lm, k]) not on the device yet
        self.counters = dict(page_table_entries_sent=0, page_table_rows_written=0, page_table_rows_taken_back=0)

    def _fresh(self) -> jax.Array:
        make = lambda: jnp.full((self.rows + 1, self.layers, self.width), self.scratch_page, jnp.int32)  # noqa: E731
        return make() if self.sharding is None else jax.jit(make, out_shardings=self.sharding)()

    @property
    def nbytes(self) -> int:
        return tables_bytes(self.rows, self.layers, self.width)

    def begin_batch(self) -> None:
        """A new batch is being built: the rows it names from now on are kept from being taken. Entries still
        queued belong to a batch that never ran (an error between building and launching it): written now, they
        could land after, or in one scatter with, the next owner's of a row taken back, so every sequence
        writes its table again instead."""
        if self._pending:
            self.reset()
        self.batches += 1

    def row_of(self, seq, table: np.ndarray) -> int:
        """`seq`'s table row for the batch being built, with the entries of `table` [Lm, n] (its
        `page_table()`) that the row lacks queued for `pending_quads`."""
        r, n = seq.table_row, min(table.shape[1], self.width)
        if r < 0 or self.owner[r] is not seq:
            r, start = self._take(seq), 0
        elif seq.table_sent_gen != seq.table_gen or seq.table_sent > n:
            start = 0  # its lists were replaced or changed: all of them again
        else:
            start = seq.table_sent
        if start == 0:
            self.counters["page_table_rows_written"] += 1
        if n > start:
            self._pending.append((r, start, table[:, start:n].copy()))
        seq.table_sent, seq.table_sent_gen = n, seq.table_gen
        self.used[r] = self.batches
        return r

    def _take(self, seq) -> int:
        if self.free:
            r = self.free.pop()
        else:  # the least recently named row not in the batch being built
            r = int(np.argmin(self.used))
            if self.used[r] == self.batches:
                raise AssertionError(f"a batch names more sequences than the {self.rows} page-table rows")
            self.owner[r].table_row = -1
            self.counters["page_table_rows_taken_back"] += 1
        self.owner[r], seq.table_row = seq, r
        return r

    def release(self, seq) -> None:
        """`seq` released its memory: its row goes back (a step in flight still reads the old entries: the
        writes of the next owner are ordered after it on the device)."""
        r = seq.table_row
        if r >= 0 and self.owner[r] is seq:
            self.owner[r] = None
            self.used[r] = 0
            self.free.append(r)
        seq.table_row = -1

    def pending_quads(self) -> Optional[np.ndarray]:
        """The queued quads [4, k] (None: nothing queued), taken off the queue."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        lm = self.layers
        ones = [p for p in pending if p[2].shape[1] == 1]  # a decode step's rows: one new page a layer
        parts = []
        if ones:
            rows, starts = np.array([p[0] for p in ones], np.int32), np.array([p[1] for p in ones], np.int32)
            parts.append(np.stack([np.repeat(rows, lm), np.tile(np.arange(lm, dtype=np.int32), len(ones)),
                                   np.repeat(starts, lm), np.concatenate([p[2][:, 0] for p in ones])]))
        for r, start, units in pending:
            if units.shape[1] > 1:
                k = units.shape[1]
                parts.append(np.stack([np.full(lm * k, r, np.int32), np.repeat(np.arange(lm, dtype=np.int32), k),
                                       np.tile(np.arange(start, start + k, dtype=np.int32), lm), units.reshape(-1)]))
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)

    def apply(self, quads: np.ndarray) -> int:
        """Write quads [4, k] into the device tables, in calls of the compiled sizes -> how many calls compiled
        a new program (0 after warm-up). A failed call leaves fresh tables that no sequence owns."""
        grew, at, k = 0, 0, quads.shape[1]
        try:
            while at < k:
                size = next((s for s in SIZES if s >= k - at), SIZES[-1])
                part = np.full((4, size), self.rows + 1, np.int32)  # padding: a row out of range, dropped
                n = min(size, k - at)
                part[:, :n] = quads[:, at:at + n]
                before = self._update._cache_size()
                self.array = self._update(self.array, part)
                grew += self._update._cache_size() > before
                at += n
        except Exception:
            self.reset()
            raise
        self.counters["page_table_entries_sent"] += k
        return grew

    def warmup(self) -> None:
        """Compile the update program at every size (writing padding only)."""
        for size in SIZES:
            self.array = self._update(self.array, np.full((4, size), self.rows + 1, np.int32))

    def reset(self) -> None:
        """Fresh tables (scratch pages): every sequence writes its whole table again."""
        for seq in self.owner:
            if seq is not None:
                seq.table_row = -1
        self.owner = [None] * self.rows
        self.used[:] = 0
        self.free = list(range(self.rows - 1, -1, -1))
        self._pending = []
        self.array = self._fresh()
