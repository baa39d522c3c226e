"""benchmarks/cache_bookkeeping.py: the state it times is the one it claims (a full arena with no free slot
run, evictions that really happen)."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cache_bookkeeping  # noqa: E402


def test_quick_run_times_real_evictions(tmp_path):
    out = tmp_path / "cb.json"
    cache_bookkeeping.main(["--quick", "--out", str(out)])
    result = json.loads(out.read_text())
    (row,) = result["cases"]
    (tables,) = result["page_tables"]  # (the run checks the cached table equals the lists' table)
    assert tables["rows"] == 16 and len(tables["page_table"]["all_ms"]) == 2
    # (and the device tables' rows against the same table; one new page a layer per row: 16 x 24 entries)
    assert tables["device_tables"]["sent_mb"] == 16 * 24 * 16 / 1e6 and len(tables["device_tables"]["all_ms"]) == 2
    assert row["prompts"] > 10 and row["page_entries"] > 100
    assert row["page_entries_after"] < row["page_entries"]  # the page-group and slot evictions dropped entries
    for k in ("evictable", "evict_for_nothing_short", "evict_for_one_page_group", "evict_for_one_slot", "can_fit_x256"):
        assert len(row[k]["all_ms"]) == 2 and row[k]["median_ms"] >= 0
    assert row["clear_ms"] > 0  # (the run asserts the clear emptied the arena)


def test_filled_cache_leaves_no_room_and_no_free_slot_run():
    from serve.memory import ArenaLayout
    import jax.numpy as jnp
    from k3jax.config import get_preset
    layout = ArenaLayout.plan(get_preset("k3"), int(2e9), 256, jnp.bfloat16, state_ranks=8)
    alloc, pc, n = cache_bookkeeping.filled_cache(layout)
    assert n == len(pc.ckpts) > 0 and not alloc.can_fit(8000 // 256 * layout.num_mla_layers, 1)
    assert pc.evictable()[0] == alloc.baseline_free_units - alloc.free_units  # every unit is the cache's
