"""vLLM's gpu_memory_utilization: the arena sized from device memory (serve/memory_budget.py). The CPU keeps
no device-memory statistics, so the engine tests give it a device of a known size whose use is the bytes of
the live arrays on it, as an accelerator's allocator reports."""

import dataclasses
import gc
import re

import jax
import jax.numpy as jnp
import pytest

import k3jax
import serve.engine
from serve.memory_budget import MemoryPlan, largest_programs, plan_cache_bytes, step_temp_bytes
from serve.types import SamplingParams

LIMIT = 48 << 20  # the simulated device
SMALL = dict(max_model_len=48, decode_buckets=(4,), prefill_buckets=(1,), context_buckets=(3,), max_num_seqs=4,
             prefill_chunk=16, max_prefill_seqs=1)


def _live_bytes() -> int:
    return sum(s.data.nbytes for x in jax.live_arrays() for s in x.addressable_shards)


def test_plan_takes_what_weights_and_steps_leave():
    stats = [dict(bytes_limit=1000, bytes_in_use=300), dict(bytes_limit=900, bytes_in_use=250)]
    # 0.8 x 900 (the smallest limit) - (300 - 100 freed; the fullest device) - 40 temporaries = 480 -> 48 units
    plan = plan_cache_bytes(0.8, stats, 100, 40, unit_bytes=9, unit_extra=1, min_units=3)
    assert plan == MemoryPlan(0.8, 900, 200, 40, 48 * 9)
    assert plan_cache_bytes(0.3, stats, 100, 40, unit_bytes=9, unit_extra=1, min_units=3).cache_bytes == 3 * 9
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.29: 29% of .* under the 3 units"):
        plan_cache_bytes(0.29, stats, 100, 40, unit_bytes=9, unit_extra=1, min_units=3)


def test_largest_programs_bound_the_temporaries():
    shapes = [(1, 1, 4), (4, 1, 4), (4, 1, 8), (1, 64, 4), (1, 64, 8), (2, 64, 8), (4, 4, 8)]
    assert largest_programs(shapes) == [(2, 64, 8), (4, 1, 8)]


def test_cpu_devices_report_no_memory():
    with pytest.raises(ValueError, match="gpu_memory_utilization: cpu devices report no memory statistics"):
        k3jax.LLM("tiny-k3", gpu_memory_utilization=0.9, progress=False, **SMALL)


def test_an_explicit_cache_size_wins_over_the_fraction():
    """vLLM's `LLM(kv_cache_memory_bytes=...)` is the arena's bytes (it was refused as an unknown EngineConfig field),
    and an explicit size beside gpu_memory_utilization wins with a note, as vLLM's ignores the fraction (cache_bytes
    beside it was silently ignored)."""
    from serve.llm import cache_options

    assert cache_options({"gpu_memory_utilization": 0.9}, None) == ({"gpu_memory_utilization": 0.9}, [])
    assert cache_options({}, 1 << 30) == ({"cache_bytes": 1 << 30}, [])
    opts, notes = cache_options({"gpu_memory_utilization": 0.9}, 1 << 30)
    assert opts == {"cache_bytes": 1 << 30, "gpu_memory_utilization": None}
    assert notes == ["gpu_memory_utilization=0.9: ignored, kv_cache_memory_bytes sets the cache's size (as vLLM's "
                     "kv_cache_memory_bytes ignores it)"]
    assert cache_options({"cache_bytes": 8 << 20, "gpu_memory_utilization": 0.5}, None)[0]["gpu_memory_utilization"] is None
    with pytest.raises(ValueError, match="kv_cache_memory_bytes and cache_bytes set the same budget"):
        cache_options({"cache_bytes": 8 << 20}, 1 << 30)


def test_an_explicit_cache_bytes_wins_over_the_fraction_in_engine_config_too(caplog):
    """`EngineConfig` could not tell an explicit `cache_bytes` from its default, so built directly (not through `LLM`
    or the CLI) the fraction won over a size given: on CPU the engine failed for want of memory statistics, and on
    a GPU the arena ignored the size. A size given now wins everywhere, said at start-up; unset, the fraction sizes
    the arena, and without either it is 256 MiB (the former default)."""
    cfg = serve.engine.EngineConfig
    assert cfg().cache_bytes is None and cfg().arena_bytes == serve.engine.DEFAULT_CACHE_BYTES == 256 << 20
    fraction = cfg(gpu_memory_utilization=0.5)
    assert fraction.sizes_from_memory and fraction.overridden_budget() is None
    sized = cfg(cache_bytes=8 << 20, gpu_memory_utilization=0.5)
    assert not sized.sizes_from_memory and sized.arena_bytes == 8 << 20
    assert sized.overridden_budget() == "gpu_memory_utilization=0.5: ignored, cache_bytes=8388608 sets the cache's size"
    assert cfg(num_gpu_blocks_override=9, cache_bytes=8 << 20, gpu_memory_utilization=0.5).overridden_budget() == (
        "gpu_memory_utilization=0.5: ignored, num_gpu_blocks_override=9 sets the arena's units")
    with pytest.raises(ValueError, match="cache_bytes=0: expected an integer >= 1"):
        cfg(cache_bytes=0, gpu_memory_utilization=0.5).validate()
    with caplog.at_level("WARNING", logger="serve.engine"):
        eng = serve.engine.Engine(k3jax.load_model("tiny-k3"), dataclasses.replace(
            sized, measure_moe_time=False, **SMALL), warmup=False, progress=False)
    assert eng.memory_plan is None and eng.layout.num_units * eng.layout.unit_bytes <= 8 << 20
    assert eng.cache_config()["gpu_memory_utilization"] is None
    assert "gpu_memory_utilization=0.5: ignored, cache_bytes=8388608" in caplog.text


@pytest.mark.parametrize("bad", [0, -1, 2.5, "8G", True])
def test_a_bad_kv_cache_memory_bytes_is_named_as_given(bad):
    """`LLM(kv_cache_memory_bytes=0)` (or "8G", vLLM's CLI spelling) was refused as `cache_bytes=0`, an option the
    caller never gave; the error names kv_cache_memory_bytes."""
    from serve.llm import cache_options

    with pytest.raises(ValueError, match=r"^kv_cache_memory_bytes="):
        cache_options({}, bad)


@pytest.mark.parametrize("bad", [0, 1.5, "0.9", True])
def test_bad_fraction_is_named(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization="):
        serve.engine.EngineConfig(gpu_memory_utilization=bad).validate()


@pytest.mark.parametrize("chunk,budget", [(64, 32), (16, 8), (128, 48)])
def test_a_token_budget_under_one_aligned_row_is_refused(chunk, budget):
    """Prompt rows are cut to multiples of min(prefill_chunk, 64): a smaller max_num_batched_tokens left every prompt
    longer than it waiting forever (the engine stepped without running anything)."""
    with pytest.raises(ValueError, match=f"max_num_batched_tokens={budget}: .* expected at least {min(chunk, 64)}"):
        serve.engine.EngineConfig(max_num_seqs=4, max_num_batched_tokens=budget, prefill_chunk=chunk).validate()
    serve.engine.EngineConfig(max_num_seqs=4, max_num_batched_tokens=min(chunk, 64), prefill_chunk=chunk).validate()


def test_a_token_budget_that_starts_prompts_in_waves_is_said_naming_both_options():
    """A budget of at least max_num_seqs but under max_num_seqs - 1 + min(prefill_chunk, 64): while the other running
    requests decode, a longer prompt waits for one of them to finish (tests/test_scheduler.py). Accepted, as vLLM
    takes any budget >= max_num_seqs, and said at start-up naming both options."""
    cfg = serve.engine.EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk=64)
    cfg.validate()
    assert re.search(r"max_num_batched_tokens=64 leaves 61 tokens .* max_num_batched_tokens >= 67 or lower "
                     r"max_num_seqs", cfg.starved_prompts())
    assert dataclasses.replace(cfg, max_num_batched_tokens=67).starved_prompts() is None
    assert serve.engine.EngineConfig().starved_prompts() is None  # the defaults


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_arena_fills_the_device(monkeypatch, async_scheduling):
    """The arena takes what is left of half the device after the weights and the measured step temporaries:
    everything on the device then fits that half with less than a unit to spare beside the temporaries; the
    engine serves from that arena with no compile after warm-up and frees it all. With async scheduling the
    decode programs' temporaries include their separate sample program's."""
    gc.collect()
    before = _live_bytes()  # other tests' arrays in this process are not on the simulated device
    on_device = lambda: _live_bytes() - before  # noqa: E731
    monkeypatch.setattr(serve.engine, "device_memory", lambda devices: [
        dict(bytes_limit=LIMIT, bytes_in_use=on_device()) for _ in devices])
    # synchronous: tiny-k3 (its MXFP4 experts, expanded on CPU, counted in what is on the device); async:
    # tiny-kimi-linear, half tiny-k3's layers, so its four step programs (two measured against the provisional
    # arena, two warmed up for the final one) compile in half the time (CI time)
    llm = k3jax.LLM("tiny-kimi-linear" if async_scheduling else "tiny-k3", gpu_memory_utilization=0.5,
                    progress=False, async_scheduling=async_scheduling, measure_moe_time=False, **SMALL)
    eng = llm.engine
    plan = eng.memory_plan
    if async_scheduling:  # a decode program's sample program's temporaries count beside the logits it leaves
        shape = (eng.decode_buckets[-1], 1, eng.decode_context_buckets[-1])
        b = eng._pad_batch(*shape, [])
        logits = jax.ShapeDtypeStruct((shape[0], eng.cfg.vocab_size), jnp.float32)
        table = jax.ShapeDtypeStruct((shape[0], 1, shape[2]), jnp.int32)  # the rows' first-layer page tables
        sample = step_temp_bytes(eng._sample.lower(eng.token_pages, logits, b.sampling, table, eng._carry).compile())
        decode = step_temp_bytes(eng.lower_step(b).compile())
        assert decode >= logits.size * 4 and sample > 0
        assert eng._program_temp_bytes(*shape) == decode + sample
    assert plan.bytes_limit == LIMIT and plan.step_temp_bytes > 0 and plan.cache_bytes == eng.layout.num_units * \
        eng.layout.unit_bytes
    # what was on the device: the engine's weights and (on CPU, whose engine holds the dense weights transposed
    # and any MXFP4 experts expanded) the loaded model's own
    assert sum(x.nbytes for x in eng._leaves) <= plan.bytes_in_use
    unit = eng.layout.unit_bytes + eng.layout.page_size * 4  # an arena unit and its token ids
    assert 0 <= LIMIT // 2 - plan.bytes_in_use - plan.step_temp_bytes - eng.layout.num_units * unit < unit
    # everything now on the device and the temporaries of the largest step: within half of it, by under a unit
    assert 0 <= LIMIT // 2 - on_device() - plan.step_temp_bytes < unit
    assert eng.stats()["memory_plan"] == plan.as_dict()
    out = llm.generate([list(range(1, 40)), list(range(5, 20))], SamplingParams(max_tokens=8, temperature=0))
    assert [len(o.token_ids) for o in out] == [8, 8]
    st = llm.stats()
    assert st["compiles_after_warmup"] == 0
    assert st["arena_free_units"] + st["arena_cached_units"] == st["arena_baseline_free_units"]
