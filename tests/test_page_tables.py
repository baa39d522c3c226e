"""The device page tables (serve/page_tables.py) against the sequences' own page lists: after any order of
appends, replaced or cleared lists, releases and batches (with fewer table rows than sequences, so rows are
taken back), every row a batch names holds its sequence's pages, and what is sent is only what a row lacks."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from serve.engine import Sequence
from serve.page_tables import SIZES, PageTables
from serve.types import RequestMetrics, SamplingParams

LAYERS, WIDTH, SCRATCH = 3, 12, 0


def seq(i: int) -> Sequence:
    return Sequence(rid=str(i), request_id=str(i), index=0, order=i, prompt_ids=[1], params=SamplingParams(), seed=0,
                    checker=None, metrics=RequestMetrics(0.0), pages=[[] for _ in range(LAYERS)])


@pytest.fixture(scope="module")
def tables():
    t = PageTables(4, LAYERS, WIDTH, SCRATCH)
    t.warmup()
    return t


def build(tables: PageTables, seqs: list) -> np.ndarray:
    """A batch naming `seqs`: their rows, with the queued entries written -> rows [B]."""
    tables.begin_batch()
    rows = np.array([tables.row_of(s, s.page_table()) for s in seqs], np.int32)
    quads = tables.pending_quads()
    if quads is not None:
        assert tables.apply(quads) == 0  # every size compiled at warm-up
    return rows


def check(tables: PageTables, seqs: list, rows: np.ndarray) -> None:
    got = np.asarray(tables.array)
    assert len(set(rows.tolist())) == len(seqs)  # a row per sequence of the batch
    for s, r in zip(seqs, rows):
        want = np.asarray(s.pages, np.int32).reshape(LAYERS, -1)[:, :WIDTH]
        assert np.array_equal(got[r, :, :want.shape[1]], want), (s.rid, r)
    assert (got[tables.pad_row] == SCRATCH).all()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.tuples(st.sampled_from(["append", "append", "replace", "clear", "release", "batch", "batch"]),
                              st.integers(0, 6), st.integers(1, 20), st.integers(0, 2 ** 16)), min_size=5, max_size=60))
def test_rows_hold_every_batched_sequence_pages_after_any_changes(tables, ops):
    tables.reset()
    rng = np.random.default_rng(0)
    seqs = [seq(i) for i in range(7)]  # more sequences than the 4 table rows
    for op, i, k, r in ops:
        s = seqs[i]
        if op == "append":  # decode adds one page a layer, a prefill chunk or an admission several
            for p in s.pages:
                p.extend(rng.integers(1, 1000, k % 3 + 1).tolist())
        elif op == "replace":  # admission from a prefix-cache hit
            for l in range(LAYERS):
                s.pages[l] = rng.integers(1, 1000, k).tolist()
        elif op == "clear":  # preemption clears in place and announces it; refilled later
            for p in s.pages:
                p.clear()
            s.pages_changed()
            for p in s.pages:
                p.extend(rng.integers(1, 1000, k % 4).tolist())
        elif op == "release":
            tables.release(s)
        else:  # a batch of up to 4 sequences (the rows a batch may name)
            pick = np.random.default_rng(r).permutation(7)[:k % 4 + 1]
            batch = [seqs[j] for j in pick]
            check(tables, batch, build(tables, batch))


def test_a_decode_batch_sends_only_the_new_pages(tables):
    """Rows kept from batch to batch: the first batch writes each table whole, later ones only the pages
    appended since (one a layer when a row crosses a page boundary, none otherwise)."""
    tables.reset()
    seqs = [seq(i) for i in range(3)]
    for s in seqs:
        for p in s.pages:
            p.extend([5, 6, 7])
    sent = lambda: tables.counters["page_table_entries_sent"]  # noqa: E731
    before, written = sent(), tables.counters["page_table_rows_written"]
    rows = build(tables, seqs)
    assert sent() - before == 3 * LAYERS * 3 and tables.counters["page_table_rows_written"] - written == 3
    for step in range(6):
        before = sent()
        grow = seqs[step % 3]
        for p in grow.pages:
            p.append(100 + step)
        again = build(tables, seqs)
        assert (again == rows).all()
        assert sent() - before == LAYERS  # the one new page of the one row that grew
        check(tables, seqs, again)
    before = sent()
    build(tables, seqs)
    assert sent() == before  # nothing new: nothing sent


def test_a_batch_never_takes_back_a_row_it_names(tables):
    tables.reset()
    seqs = [seq(i) for i in range(5)]
    for s in seqs:
        for p in s.pages:
            p.append(1)
    check(tables, seqs[:4], build(tables, seqs[:4]))
    tables.begin_batch()
    for s in seqs[:4]:
        tables.row_of(s, s.page_table())
    with pytest.raises(AssertionError, match="more sequences than the 4 page-table rows"):
        tables.row_of(seqs[4], seqs[4].page_table())
    tables.pending_quads()
    taken = tables.counters["page_table_rows_taken_back"]
    rows = build(tables, seqs[2:])  # the next batch takes back the least recently named rows
    check(tables, seqs[2:], rows)
    assert tables.counters["page_table_rows_taken_back"] == taken + 1 and seqs[0].table_row == -1


def test_writes_larger_than_the_largest_program_are_split(tables):
    tables.reset()
    big = PageTables(2, 2, SIZES[-1], SCRATCH)  # one row's table is twice the largest update program
    s = Sequence(rid="b", request_id="b", index=0, order=0, prompt_ids=[1], params=SamplingParams(), seed=0,
                 checker=None, metrics=RequestMetrics(0.0), pages=[list(range(1, SIZES[-1] + 1)) for _ in range(2)])
    big.begin_batch()
    r = big.row_of(s, s.page_table())
    big.apply(big.pending_quads())
    assert np.array_equal(np.asarray(big.array[r]), np.asarray(s.pages, np.int32))
    assert big.counters["page_table_entries_sent"] == 2 * SIZES[-1]


def test_entries_of_a_batch_that_never_ran_are_not_written_later(tables):
    """A batch built but never launched (an error in between) leaves its entries queued; the next batch starts
    from fresh tables instead, and every row it names is written whole."""
    tables.reset()
    seqs = [seq(i) for i in range(2)]
    for s in seqs:
        for p in s.pages:
            p.extend([3, 4])
    check(tables, seqs, build(tables, seqs))
    for p in seqs[0].pages:
        p.append(9)
    tables.begin_batch()
    tables.row_of(seqs[0], seqs[0].page_table())  # queued, never written
    written = tables.counters["page_table_rows_written"]
    check(tables, seqs, build(tables, seqs))
    assert tables.counters["page_table_rows_written"] == written + 2
