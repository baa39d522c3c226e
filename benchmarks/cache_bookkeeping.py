"""Host bookkeeping of the cache arena and prefix cache at K3 arena sizes (no model, no device work).

    python benchmarks/cache_bookkeeping.py          # the recorded run, ~1 min on the 2-core CPU host
    python benchmarks/cache_bookkeeping.py --quick  # one small layout (~5 s)

The scheduler asks the prefix cache every step what eviction could free (`evictable`) and asks it to make
room (`evict_for`); admission may need a new KDA state slot, which with no checkpoint slot to give up means
freeing one slot-aligned run of units (`_free_cheapest_slot_run`). All of it is Python and numpy on the
host, between device steps, so its cost adds to every step's latency. At K3 sizes an arena has 10^5 - 10^6
units and 10^4 - 10^5 cached page entries (`ArenaLayout.plan` of the `k3` preset: 24 MLA layers, a 576-wide
bf16 latent, 70 KDA layers of 96 heads split over `--ranks` ranks).

Each layout is filled the way a prefix-caching engine fills it: prompts of 1000 - 8000 tokens, each with
a state slot and its pages, the pages shared as cache entries and a prompt-end checkpoint registered, the
request's holds then released, until the next prompt does not fit. Then all checkpoints are dropped and
the remaining units handed to a running request, so that a new slot can only come from freeing pages.
Measured (median of `--repeats`): `evictable()`; `evict_for(0, 0)` (nothing short: every step);
`evict_for(one page group, 0)`; `evict_for(0, 1)` (one state slot: the slot-run choice); 256 `can_fit`
checks (one per running request a step) against as many counts of the owner array (what each was); then, with the
running request's holds released, one `clear()` (weight updates, sleep, /reset_prefix_cache).

Also the page tables of a K3 decode step (256 requests x 24 MLA layers x 64 / 512 / 2048 pages): every
request's page lists converted each step (the engine at first), `Sequence.page_table` arrays copied into the
step's [rows, layers, pages] table (the engine until the tables moved to the device), and the device page
tables (serve/page_tables.py: each row's new entries written on the device, the batch naming rows), for a
step where every row crossed a page boundary (one new page a layer each: the worst case, timed for all three)
and for one where none did (what `page_size - 1` of every `page_size` decode steps are).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k3jax.config import get_preset  # noqa: E402
from serve.memory import Arena, ArenaLayout  # noqa: E402
from serve.engine import Sequence  # noqa: E402
from serve.page_tables import PageTables  # noqa: E402
from serve.prefix_cache import PROMPT_END, PrefixCache, PrefixCacheConfig, PrefixHasher  # noqa: E402
from serve.types import RequestMetrics, SamplingParams  # noqa: E402
from serving import machine_info, write_result  # noqa: E402


def filled_cache(layout: ArenaLayout, seed: int = 0) -> tuple[Arena, PrefixCache, int]:
    """An arena filled with cached prompts (pages + a prompt-end checkpoint each) -> (allocator, cache,
    prompts cached)."""
    alloc = Arena(layout)
    pc = PrefixCache(alloc, layout, align=64, cfg=PrefixCacheConfig(hash_unit=64))
    rng, ps, lm, n = random.Random(seed), layout.page_size, layout.num_mla_layers, 0
    while True:
        tokens = max(ps, rng.randrange(1000, 8000) // ps * ps)
        npg = tokens // ps
        if not alloc.can_fit(npg * lm, 1):
            return alloc, pc, n
        slot, units = alloc.alloc_slot(), alloc.alloc_pages(npg * lm)
        pc.ref(units)
        pages = [units[l * npg:(l + 1) * npg] for l in range(lm)]
        h = PrefixHasher(64, salt=str(n).encode())
        h.extend([rng.randrange(163840) for _ in range(tokens)])
        pc.register_pages(h, pages, tokens, 0)
        if not pc.register_checkpoint(h, tokens - 64, slot, PROMPT_END, pages):
            alloc.free_slot(slot)
        pc.unref(units)
        n += 1


def timed(fn, repeats: int) -> dict:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return dict(median_ms=statistics.median(ts), all_ms=ts)


def measure(page_size: int, ranks: int, budget_gb: float, repeats: int) -> dict:
    layout = ArenaLayout.plan(get_preset("k3"), int(budget_gb * 1e9), page_size, jnp.bfloat16, state_ranks=ranks)
    t = time.perf_counter()
    alloc, pc, prompts = filled_cache(layout)
    fill_s = time.perf_counter() - t
    for c in list(pc.ckpts.values()):
        pc._drop_ckpt(c)
    pc._flush_spill()
    pc.ref(alloc.alloc_pages(alloc.free_units))  # a running request holds the rest: no free slot run
    lm = layout.num_mla_layers
    row = dict(page_size=page_size, ranks=ranks, budget_gb=budget_gb, units=layout.num_units,
               slot_units=layout.slot_units, slot_runs=(layout.scratch_slot - 1) // layout.slot_units,
               prompts=prompts, page_entries=len(pc.pages), fill_s=fill_s)
    # the scheduler checks every running request's growth against the free count (`Arena.can_fit`)
    row["can_fit_x256"] = timed(lambda: [alloc.can_fit(lm, 0) for _ in range(256)], repeats)
    row["owner_count_x256"] = timed(lambda: [np.count_nonzero(alloc.owner == alloc.FREE) for _ in range(256)],
                                    repeats)  # what each of those cost before
    row["evictable"] = timed(pc.evictable, repeats)
    row["evict_for_nothing_short"] = timed(lambda: pc.evict_for(0, 0), repeats)

    def one_page_group():
        pc.evict_for(alloc.free_units + lm, 0)
        pc.ref(alloc.alloc_pages(lm))

    def one_slot():
        pc.evict_for(0, 1)
        alloc.alloc_slot()

    row["evict_for_one_page_group"] = timed(one_page_group, repeats)
    row["evict_for_one_slot"] = timed(one_slot, repeats)
    row["page_entries_after"] = len(pc.pages)
    pc.unref(np.flatnonzero(pc.counts > pc.cache_refs))  # the running request's pages
    t = time.perf_counter()
    emptied = pc.clear()  # what a weight update, sleep or /reset_prefix_cache runs
    row["clear_ms"] = (time.perf_counter() - t) * 1e3
    slots = repeats * layout.slot_units  # the slots `one_slot` took stay
    assert emptied and alloc.free_units == alloc.baseline_free_units - slots, "clear left units held"
    return row


def page_tables(rows: int, layers: int, pages: int, repeats: int) -> dict:
    """A decode step's page tables [rows, layers, pages] from the requests' page lists: every list converted
    each step (the engine at first) against `Sequence.page_table` (an array kept across steps, extended by the
    one page a layer the step added) copied into the step's table (the engine before the device tables), both
    checked equal; then the device tables (`PageTables`: rows named, new entries written on the device, timed
    to the end of the device write), checked against the same table, with one new page a layer for every row
    and with none."""
    rng = np.random.default_rng(0)
    seqs = [Sequence(rid=str(i), request_id=str(i), index=0, order=i, prompt_ids=[0], params=SamplingParams(),
                     seed=0, checker=None, metrics=RequestMetrics(0.0),
                     pages=rng.integers(1, 10 ** 6, (layers, pages - 2 * repeats)).tolist()) for i in range(rows)]
    for s in seqs:
        s.page_table()  # read by the steps before
    device = PageTables(rows, layers, pages, 0)
    device.warmup()

    def device_step() -> tuple[float, np.ndarray, int]:
        t = time.perf_counter()
        device.begin_batch()
        named = np.array([device.row_of(s, s.page_table()) for s in seqs], np.int32)
        quads = device.pending_quads()
        if quads is not None:
            device.apply(quads)
        device.array.block_until_ready()
        return (time.perf_counter() - t) * 1e3, named, 0 if quads is None else quads.shape[1]

    device_step()  # every row written whole once (the steps before)
    table = np.zeros((rows, layers, pages), np.int32)
    lists, cached, on_device, unchanged, sent = [], [], [], [], []
    for _ in range(repeats):
        for s in seqs:
            for p in s.pages:
                p.append(int(rng.integers(1, 10 ** 6)))  # the page this decode step added
        t = time.perf_counter()
        for i, s in enumerate(seqs):
            for j in range(layers):
                held = s.pages[j][:pages]
                table[i, j, :len(held)] = held
        lists.append((time.perf_counter() - t) * 1e3)
        want, table[:] = table.copy(), 0
        t = time.perf_counter()
        for i, s in enumerate(seqs):
            held = s.page_table()[:, :pages]
            table[i, :, :held.shape[1]] = held
        cached.append((time.perf_counter() - t) * 1e3)
        assert np.array_equal(table, want)
        ms, named, n = device_step()
        on_device.append(ms)
        sent.append(n)
        assert np.array_equal(np.asarray(device.array)[named], want)
        ms, named, n = device_step()  # the next step: no row crossed a page boundary
        assert n == 0
        unchanged.append(ms)
    med = statistics.median
    return dict(rows=rows, layers=layers, pages=pages, table_mb=table.nbytes / 1e6,
                lists=dict(median_ms=med(lists), all_ms=lists), page_table=dict(median_ms=med(cached), all_ms=cached),
                device_tables=dict(median_ms=med(on_device), all_ms=on_device, sent_mb=med(sent) * 16 / 1e6,
                                   no_new_page_median_ms=med(unchanged), no_new_page_all_ms=unchanged))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    t_start, log = time.perf_counter(), (lambda m: print(m, flush=True))
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "cache_bookkeeping-quick.json"
                                           if args.quick else REPO / "benchmarks" / "results" / "cache_bookkeeping-cpu.json")
    # (page size, ranks the KDA heads are split over, arena bytes of one rank in GB)
    layouts = [(256, 8, 4.0)] if args.quick else [(256, 8, 60.0), (64, 8, 60.0), (64, 1, 100.0), (16, 8, 60.0)]
    result = dict(benchmark="cache_bookkeeping", machine=machine_info(), cases=[])
    for ps, ranks, gb in layouts:
        row = measure(ps, ranks, gb, 2 if args.quick else args.repeats)
        result["cases"].append(row)
        log(f"page {ps:4d} ranks {ranks} {gb:5.0f} GB: {row['units']:8d} units, {row['page_entries']:6d} entries | "
            + " | ".join(f"{k} {row[k]['median_ms']:.1f} ms" for k in
                         ("evictable", "evict_for_nothing_short", "evict_for_one_page_group", "evict_for_one_slot"))
            + f" | clear {row['clear_ms']:.0f} ms | can_fit x256 {row['can_fit_x256']['median_ms']:.2f} ms"
            + f" (owner counts {row['owner_count_x256']['median_ms']:.1f} ms)")
    # a K3 decode step: 24 MLA layers, page 64, contexts of 4k / 32k / 128k tokens
    result["page_tables"] = []
    for rows, pages in ([(16, 64)] if args.quick else [(256, 64), (256, 512), (256, 2048)]):
        row = page_tables(rows, 24, pages, 2 if args.quick else args.repeats)
        result["page_tables"].append(row)
        d = row["device_tables"]
        log(f"page table {rows} rows x 24 layers x {pages} pages ({row['table_mb']:.0f} MB): lists "
            f"{row['lists']['median_ms']:.1f} ms, page_table {row['page_table']['median_ms']:.1f} ms, device tables "
            f"{d['median_ms']:.2f} ms ({d['sent_mb']:.2f} MB sent; no new page {d['no_new_page_median_ms']:.2f} ms)")
    return write_result(result, out, t_start, log)


if __name__ == "__main__":
    main()
