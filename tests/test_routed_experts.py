"""Routed experts per position (serve/routed_experts.py, EngineConfig.enable_return_routed_experts): the ids an
engine returns equal those of the model's full forward over the finished sequence, whatever computed each
position (prefill chunks, decode, speculative verify rows, a prefix-cache hit's store, a recompute after
preemption), with async scheduling; a hit whose ids are gone is not taken."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from serve.prefix_cache import PrefixHasher
from serve.routed_experts import RoutesStore, SequenceRoutes
from serve.types import SamplingParams as SP

PAD = 256


def test_routes_store_keeps_whole_granules_by_prefix_and_evicts_the_oldest():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 300, 40).tolist()
    h = PrefixHasher(16)
    h.extend(ids)
    routes = rng.integers(0, 8, (40, 3, 2)).astype(np.int16)
    one = routes[:8].nbytes
    store = RoutesStore(8, 3 * one)
    store.put(h, routes, 0, 20)  # granules [0, 8) and [8, 16); [16, 24) is not complete yet
    assert len(store.blocks) == 2 and store.take(h, 16) is not None and store.take(h, 24) is None
    store.put(h, routes, 20, 25)  # completes [16, 24): kept (its first positions came from earlier rows)
    np.testing.assert_array_equal(np.concatenate(store.take(h, 24)), routes[:24])
    assert store.take(h, 12) is None  # inside a granule: not served
    other = PrefixHasher(16)
    other.extend(ids[:10] + [ids[10] + 1] + ids[11:])  # differs at position 10
    assert store.take(other, 8) is not None and store.take(other, 16) is None
    salted = PrefixHasher(16, b"tenant")
    salted.extend(ids)
    assert store.take(salted, 8) is None  # another salt (or adapter) shares nothing
    store.take(h, 8)  # refreshed: [8, 16) is now the oldest
    store.put(h, routes, 24, 40)  # two more granules against a budget of three
    assert store.bytes == 3 * one and store.evicted == 2
    assert store.take(h, 8) is not None and store.take(h, 16) is None
    bad = routes.copy()
    bad[33] = -1  # a position not recorded is never stored
    fresh = RoutesStore(8, 10 * one)
    fresh.put(h, bad, 0, 40)
    assert len(fresh.blocks) == 4 and fresh.take(h, 40) is None
    seq = SequenceRoutes(3, 2, np.int16, capacity=4)
    seq.fill_from(store.take(h, 8))
    seq.write(8, routes[8:30])  # grows
    np.testing.assert_array_equal(seq.first(30), routes[:30])
    assert seq.first(32)[30:].min() == -1 and seq.first(32).dtype == np.int32


@pytest.fixture(scope="module")
def llm():
    """tests/test_hidden_states.py's engine, option for option (hidden states on too): one set of step programs in
    the run's compilation cache for both files (CI time)."""
    import k3jax

    return k3jax.LLM("tiny-k3", max_model_len=PAD, cache_bytes=260_000, max_num_seqs=4, prefill_chunk=16,
                     max_prefill_seqs=2, decode_buckets=(4,), prefill_buckets=(2,), context_buckets=(16,),
                     measure_moe_time=False, progress=False, enable_return_routed_experts=True,
                     enable_return_hidden_states=True, async_scheduling=True,
                     speculative_config={"num_speculative_tokens": 3, "adaptive": False})


@pytest.fixture(scope="module")
def reference():
    """Routed ids of a full forward over a sequence's first len - 1 tokens (no cache; one compile)."""
    import k3jax
    from k3jax.cache import FreshView

    model = k3jax.load_model("tiny-k3")  # the checkpoint's layout, unscanned: not the engine's copy

    @jax.jit
    def routes(ids):
        m = nnx.merge(model.graphdef, model.params)
        trace = []
        m.run(ids, FreshView(m.cfg, PAD), jnp.full((1,), PAD, jnp.int32), False, trace=trace)
        return jnp.stack(trace, 1)  # [PAD, L_moe, k]

    def of(seq):
        padded = np.zeros((1, PAD), np.int32)
        padded[0, :len(seq) - 1] = seq[:-1]
        return np.asarray(routes(jnp.asarray(padded)))[:len(seq) - 1]
    return of


def test_routed_experts_are_the_full_forwards_whatever_computed_them(llm, reference):
    """Two waves of a shared-prefix batch with n = 2, sampled, on a small arena (preemptions), async scheduling and
    n-gram drafts: every finished sequence's ids = the full forward's, position by position, including the
    positions a prefix-cache hit skipped, and verify rows whose drafts are all accepted; with the store emptied a
    hit is dropped, the ids still whole."""
    eng = llm.engine
    rng = np.random.default_rng(0)
    base = rng.integers(3, 300, 70).tolist()
    prompts = [base + rng.integers(3, 300, k).tolist() for k in (5, 20, 40)] + [rng.integers(3, 300, 12).tolist() * 3]
    params = [SP(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True, n=2 if i == 1 else 1) for i in range(4)]
    # a row whose drafts are all accepted (the bias makes the model repeat 5): verify rows cross granules
    prompts.append(list(range(10, 40)) + [5] * 8)
    params.append(SP(temperature=0, logit_bias={5: 100.0}, max_tokens=40, ignore_eos=True))
    cached = 0
    for wave in range(2):
        for out in llm.generate(prompts, params):
            cached += out.num_cached_tokens
            for c in out.outputs:
                seq = out.prompt_token_ids + c.token_ids
                assert c.routed_experts.dtype == np.int32
                np.testing.assert_array_equal(c.routed_experts, reference(seq), err_msg=f"{out.request_id}#{c.index}")
    n = eng.counters
    assert cached > 0 and n["preemptions"] > 0 and n["spec_decode_num_accepted_tokens"] > 30
    assert n["routed_experts_hits_dropped"] == 0 and n["routed_experts_incomplete"] == 0
    # the store emptied (as eviction would): the cached prefix is not taken, and taken again once its ids are back
    # (a prompt of its own: a hit on the waves' prefixes has their finished conversations canonicalised, and on this
    # small arena those rows' deeper checkpoints may evict its state before the store is emptied)
    p, sp = rng.integers(3, 300, 36).tolist(), SP(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([p], sp)
    eng.routes_store.clear()
    cold, warm = llm.generate([p], sp)[0], llm.generate([p], sp)[0]
    assert cold.num_cached_tokens == 0 and n["routed_experts_hits_dropped"] > 0 and warm.num_cached_tokens > 0
    for out in (cold, warm):
        np.testing.assert_array_equal(out.outputs[0].routed_experts, reference(p + out.token_ids))
    assert llm.stats()["compiles_after_warmup"] == 0
    assert eng.allocator.free_units + eng._cached_units() == eng.allocator.baseline_free_units
    # beam search runs beside (its hypotheses carry no ids)
    from serve.beam_search import BeamSearchParams

    beams = llm.beam_search([prompts[0]], BeamSearchParams(beam_width=2, max_tokens=3))
    assert len(beams[0].sequences) == 2
    rid = eng.add_request(prompts[0], SP(max_tokens=30, ignore_eos=True))
    eng.step()
    eng.abort(rid)  # mid-prompt: nothing to return, nothing left behind
    while eng.has_unfinished():
        eng.step()
    assert eng.allocator.free_units + eng._cached_units() == eng.allocator.baseline_free_units


def test_benchmark_wave_times_the_engines_own_recording(llm):
    """benchmarks/routed_experts.py wraps the engine's recording of the ids (its host time per step)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import routed_experts as bench

    eng, rng = llm.engine, np.random.default_rng(1)
    prompts = [rng.integers(3, 300, 20).tolist() for _ in range(2)]
    w = bench.run_wave(eng, prompts, SP(temperature=0, max_tokens=6, ignore_eos=True), 2)
    assert w["record"] > 0 and len(w["outs"]) == 2 and "_record_positions" not in vars(eng)
    for o in w["outs"].values():
        assert o.outputs[0].routed_experts.shape[0] == len(o.prompt_token_ids) + 5


def test_routed_experts_config_is_checked():
    from serve.engine import EngineConfig
    from serve.host_cache import HostCache

    with pytest.raises(ValueError, match="enable_return_routed_experts with kv_transfer_config"):
        EngineConfig(enable_return_routed_experts=True,
                     kv_transfer_config={"kv_role": "kv_consumer", "store": HostCache(1 << 20)}).validate()
    with pytest.raises(ValueError, match="routed_experts_cache_bytes"):
        EngineConfig(enable_return_routed_experts=True, routed_experts_cache_bytes=-1).validate()
