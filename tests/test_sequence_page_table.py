"""`Sequence.page_table`: the cached array of a request's MLA pages equals its lists after every kind of
change the engine makes (appends, lists replaced, lists cleared and refilled in place)."""
import numpy as np
import pytest

from serve.engine import Sequence
from serve.types import RequestMetrics, SamplingParams


def seq(layers=3):
    return Sequence(rid="r", request_id="r", index=0, order=0, prompt_ids=[1], params=SamplingParams(), seed=0,
                    checker=None, metrics=RequestMetrics(0.0), pages=[[] for _ in range(layers)])


def check(s):
    want = np.asarray(s.pages, np.int32).reshape(len(s.pages), -1)
    got = s.page_table()
    assert got.dtype == np.int32 and np.array_equal(got, want)


def test_page_table_follows_every_change():
    rng = np.random.default_rng(0)
    s = seq()
    check(s)
    for step in range(60):
        k = int(rng.integers(1, 40 if step % 7 == 0 else 2))  # mostly one page a layer (decode), sometimes many
        units = rng.integers(1, 10 ** 6, (3, k)).tolist()
        for p, u in zip(s.pages, units):
            p.extend(u)
        check(s)
        if step % 11 == 5:  # admission from a prefix-cache hit: the lists are replaced
            for l in range(3):
                s.pages[l] = rng.integers(1, 10 ** 6, 5 + step).tolist()
            check(s)
        if step % 13 == 7:  # a beam fork hands its pages on: the outer list is replaced
            s.pages = [[] for _ in range(3)]
            check(s)
        if step % 17 == 3:  # preemption clears in place; refilled before the table is read again
            for p in s.pages:
                p.clear()
            s.pages_changed()
            for p, u in zip(s.pages, rng.integers(1, 10 ** 6, (3, 4)).tolist()):
                p.extend(u)
            check(s)


def test_cleared_lists_read_again_even_unannounced_when_shorter():
    s = seq(2)
    s.pages[0].extend([1, 2, 3]), s.pages[1].extend([4, 5, 6])
    check(s)
    for p in s.pages:
        p.clear()
    s.pages[0].append(7), s.pages[1].append(8)
    check(s)  # shorter than what was read: read again


def test_layers_with_different_page_counts_are_refused():
    s = seq(2)
    s.pages[0].extend([1, 2]), s.pages[1].append(3)
    with pytest.raises(AssertionError, match="different page counts"):
        s.page_table()
