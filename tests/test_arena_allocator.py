"""serve/memory.py `Arena`: the kept free count and low-end hint allocate exactly what a scan of the owners
would (the lowest free units for pages, the highest free slot-aligned run for a slot), under random traffic."""
import numpy as np
import pytest

import k3jax
from serve.memory import Arena, ArenaLayout, OutOfMemory


@pytest.mark.parametrize("seed", range(4))
def test_allocations_equal_a_scan_of_the_owners(seed):
    layout = ArenaLayout.plan(k3jax.get_preset("tiny-k3"), 12000 * 16 * 40 * 4, 16, np.float32)
    assert layout.num_units > 2 * 4096  # allocations scan windows of 4096 units: several here
    a, rng = Arena(layout), np.random.default_rng(seed)
    pages, slots = [], []
    for _ in range(600):
        op = rng.integers(4)
        if op == 0:
            n = int(rng.integers(0, 3000))
            want = np.flatnonzero(a.owner == a.FREE)[:n].tolist()
            if len(want) < n:
                with pytest.raises(OutOfMemory):
                    a.alloc_pages(n)
            else:
                assert a.alloc_pages(n) == want
                pages += want
        elif op == 1 and pages:
            k = rng.permutation(len(pages))[:int(rng.integers(1, 1500))]
            a.free_pages([pages[i] for i in k])
            gone = set(k.tolist())
            pages = [p for i, p in enumerate(pages) if i not in gone]
        elif op == 2:
            su, top = layout.slot_units, layout.scratch_slot
            want = [b for b in range(top - su, 0, -su) if not a.owner[b:b + su].any()][:1]
            if not want:
                with pytest.raises(OutOfMemory):
                    a.alloc_slot()
            else:
                assert a.alloc_slot() == want[0]
                slots.append(want[0])
        elif op == 3 and slots:
            a.free_slot(slots.pop(int(rng.integers(len(slots)))))
        assert a.free_units == np.count_nonzero(a.owner == a.FREE)
        assert not (a.owner[:a._low] == a.FREE).any()
    a.free_pages(pages)
    for b in slots:
        a.free_slot(b)
    assert a.free_units == a.baseline_free_units and a.peak_used_units > 0


def test_a_double_free_is_refused():
    layout = ArenaLayout.plan(k3jax.get_preset("tiny-k3"), 3000 * 16 * 40 * 4, 16, np.float32)
    a = Arena(layout)
    got = a.alloc_pages(3)
    with pytest.raises(AssertionError, match="double free"):
        a.free_pages([got[0], got[0]])
    a.free_pages(got)
    with pytest.raises(AssertionError, match="double free"):
        a.free_pages(got[:1])
    assert a.free_units == a.baseline_free_units


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear"])
def test_cache_tokens_fill_the_arena_beside_one_state_slot(preset):
    """`cache_tokens` (SGLang's max_total_num_tokens) is what the arena's free units hold: one request's state slot
    and a page of every MLA layer per page of tokens, the longest request less its sampled position; a page more
    does not fit."""
    from serve.memory import cache_tokens, longest_request

    cfg = k3jax.get_preset(preset)
    layout = ArenaLayout.plan(cfg, 3000 * 16 * 40 * 4, 16, np.float32)
    arena = Arena(layout)
    tokens = cache_tokens(layout.num_units, layout.slot_units, layout.page_size, cfg.num_mla_layers)
    assert tokens == longest_request(layout, arena.baseline_free_units, cfg.num_mla_layers) - 1
    assert tokens < layout.num_units * layout.page_size  # (units x page size counted a token once per MLA layer)
    arena.alloc_slot()
    arena.alloc_pages(layout.pages_for(tokens))
    assert not arena.can_fit(cfg.num_mla_layers, 0)
