"""Host-memory tier of the prefix cache: evicted pages and KDA checkpoints come back bit-exactly.

A small arena forces eviction; every output is compared with an engine that has no prefix cache at
all (greedy tokens and logprobs bit-identical, with penalties so the restored token rows matter too),
and the arena and host pins return to their baselines."""

import numpy as np
import pytest

import k3jax
from serve.cli import engine_config
from serve.engine import Engine, EngineConfig
from serve.host_cache import CKPT, PAGE, HostCache, HostEntry
from serve.types import SamplingParams
from test_prefix_cache import logprobs, toks
from test_prefix_cache import run as prefix_run

PAGE_SIZE, CHUNK, UNITS = 64, 16, 93  # checkpoints every 16 tokens sit inside 64-token pages


def config(**kw):
    """test_prefix_cache's "mid_page" engine options (shared step programs), no MoE timing at warm-up either
    (a program per step shape that only the metrics read; CI time)."""
    return EngineConfig(max_model_len=384, page_size=PAGE_SIZE, cache_bytes=UNITS * PAGE_SIZE * 40 * 4,
                        max_num_seqs=8, prefill_chunk=CHUNK, max_prefill_seqs=2, max_num_batched_tokens=256,
                        decode_buckets=(8,), prefill_buckets=(2,), context_buckets=(384 // PAGE_SIZE,),
                        max_logprobs=4, checkpoint_interval=256, decode_checkpoint_interval=32,
                        measure_moe_time=False, **kw)


@pytest.fixture(scope="module")
def engines():
    model = k3jax.load_model("tiny-k3", seed=2)
    on = Engine(model, config(host_cache_bytes=32 << 20), progress=False)
    off = Engine(model, config(enable_prefix_caching=False), progress=False)
    return on, off


PENALTIES = dict(repetition_penalty=1.3, presence_penalty=0.5)
PARAMS = dict(temperature=0.0, ignore_eos=True, logprobs=4, **PENALTIES)


def run(engine, prompt, n=8):
    return prefix_run(engine, prompt, n, **PENALTIES)


def host(engine):
    return {k: v for k, v in engine.stats()["prefix_cache"].items() if k.startswith("host")}


def flood(engine, seed, n=6):
    """Unrelated prompts whose pages and checkpoints push everything older out of the arena."""
    for i in range(n):
        run(engine, toks(seed + i, 300), n=2)


def settled(engine):
    pc = engine.prefix_cache
    assert engine.allocator.free_units + engine._cached_units() == engine.allocator.baseline_free_units
    assert all(e.pins == 0 for e in pc.host.entries.values())
    assert all(c.pins == 0 for c in pc.ckpts.values())
    assert pc.host.used <= pc.host.budget


def test_host_store_is_lru_by_bytes_and_keeps_pinned_entries():
    entry = lambda k, n: HostEntry(k, PAGE, np.zeros((n, 4), np.float32), np.zeros((n, 2), np.int32))
    h = HostCache(3 * 24)  # three one-unit entries (16 + 8 bytes each)
    for k in (b"a", b"b", b"c"):
        assert h.put(entry(k, 1))
    h.touch(h.get(b"a"))  # b is now the least recently used
    h.get(b"c").pins = 1
    assert h.put(entry(b"d", 1))
    assert set(h.entries) == {b"a", b"c", b"d"} and h.used == 72
    assert not h.put(entry(b"e", 4))  # larger than the budget
    h.get(b"a").pins = h.get(b"d").pins = 1
    assert not h.put(entry(b"f", 1))  # everything else is pinned
    h.discard(b"c")  # pinned: a request is about to read it
    assert b"c" in h.entries
    for e in h.entries.values():
        e.pins = 0
    h.discard(b"c")
    s = h.stats()
    assert (s["host_pages"], s["host_bytes"], s["host_entries_evicted"], s["host_entries_rejected"]) == (2, 48, 1, 2)
    h.put(HostEntry(b"k", CKPT, np.zeros((2, 4), np.float32), None, pos=16))
    assert h.stats()["host_checkpoints"] == 1 and h.get(b"k").nbytes == 32
    # an entry that cannot fit beside the pinned ones evicts nothing for it (the LRU entry was dropped for nothing)
    h = HostCache(4 * 24)
    for k in (b"a", b"b", b"c"):
        assert h.put(entry(k, 1))
    h.get(b"b").pins = h.get(b"c").pins = 1  # a restore is about to read them
    assert not h.put(entry(b"big", 3))
    assert set(h.entries) == {b"a", b"b", b"c"} and h.stats()["host_entries_evicted"] == 0
    assert h.put(entry(b"d", 2)) and set(h.entries) == {b"b", b"c", b"d"}
    for bad in (-1, float("nan"), 1.5, "64MB", None, True):  # (nan made a store that silently refused everything)
        with pytest.raises(ValueError, match="budget_bytes.*host_cache_bytes"):
            HostCache(bad)


def test_conversation_evicted_from_the_arena_resumes_from_host_memory(engines):
    on, off = engines
    base = toks(1, 200)  # prompt-end checkpoint at 192: three full pages
    first = run(on, base)
    before = host(on)
    flood(on, 100)
    after = host(on)
    assert after["host_checkpoints_stored"] > before["host_checkpoints_stored"]
    assert after["host_pages_stored"] > before["host_pages_stored"]
    turn = base + first.outputs[0].token_ids + toks(2, 30)
    prompt_end = on.stats()["prefix_cache"].get("kda_hits_prompt_end", 0)
    warm, cold = run(on, turn), run(off, turn)
    got = host(on)
    assert got["host_hits"] == after["host_hits"] + 1 and got["host_hit_tokens"] - after["host_hit_tokens"] == 192
    assert got["host_checkpoints_restored"] == after["host_checkpoints_restored"] + 1
    assert warm.num_cached_tokens == 192
    # counted by the kind of checkpoint it resumed from, as a device hit is
    assert (on.stats()["prefix_cache"].get("kda_hits_prompt_end", 0) == prompt_end + 1
            and "kda_hits_ckpt" not in on.stats()["prefix_cache"])
    assert warm.token_ids == cold.token_ids
    assert logprobs(warm) == logprobs(cold)  # bit-identical: the restored bytes are the arena's
    assert on.stats()["compiles_after_warmup"] == 0
    settled(on)


def test_mid_page_checkpoint_and_partial_page_come_back_from_host(engines):
    on, off = engines
    base = toks(3, 100)  # prompt-end checkpoint at 96, inside the second 64-token page
    run(on, base)
    flood(on, 200)
    pc = on.prefix_cache
    assert not any(c.pos == 96 for c in pc.ckpts.values()), "the flood should have evicted it"
    before = host(on)
    prompt = base + toks(4, 7)
    warm, cold = run(on, prompt), run(off, prompt)
    got = host(on)
    assert got["host_hit_tokens"] - before["host_hit_tokens"] == 96
    assert warm.num_cached_tokens == 96
    assert got["host_bytes_restored"] > before["host_bytes_restored"]
    assert warm.token_ids == cold.token_ids and logprobs(warm) == logprobs(cold)
    settled(on)


def test_a_failed_restore_ends_its_request_alone_and_the_engine_serves_on(engines):
    """The device copy that restores a host hit fails after taking the donated arena (a device error): as a failed
    step, the request it admitted ends (StepFailed naming it), a fresh arena takes the old one's place and the
    request running beside it finishes with its cold tokens; the engine then serves the same hit again (the failure
    escaped `step()` unnamed, the arena stayed deleted and through AsyncEngine every later request failed)."""
    from step_failures import drain_through_failures

    on, off = engines
    base = toks(5, 200)
    run(on, base)
    flood(on, 300)
    turn, other = base + toks(6, 20), toks(7, 40)
    params = SamplingParams(max_tokens=8, **PARAMS)
    real, resets = on.host_transfers.write, on.counters["cache_resets"]

    def write(arena, *args):
        arena.delete()
        raise RuntimeError("injected restore failure")

    on.host_transfers.write = write
    try:
        good = on.add_request(other, params)
        on.step()  # running (its state lost with the arena: recomputed)
        bad = on.add_request(turn, params)
        failures, done = drain_through_failures(on, max_steps=200)
    finally:
        on.host_transfers.write = real
    assert [f.request_ids for f in failures] == [[bad]] and "injected restore failure" in str(failures[0])
    assert on.counters["cache_resets"] == resets + 1 and not on.arena.is_deleted()
    assert done[good].outputs[0].token_ids == run(off, other).outputs[0].token_ids
    on.step()
    settled(on)
    run(on, base)
    flood(on, 400)
    warm, cold = run(on, turn), run(off, turn)
    assert warm.num_cached_tokens > 0 and warm.token_ids == cold.token_ids
    settled(on)


def test_restored_pages_are_shared_again_and_a_small_host_budget_degrades_to_recompute(engines):
    on, off = engines
    pc = on.prefix_cache
    base = toks(5, 250)
    run(on, base)
    flood(on, 300)
    prompt = base + toks(6, 20)
    warm = run(on, prompt)
    assert warm.num_cached_tokens == 240
    keys = [k for k in pc.pages if pc.pages[k].index < 3]
    assert keys, "restored full pages are device entries again"
    assert not any(k in pc.host.entries for k in keys), "one copy: the host tier drops what the device holds again"
    again = run(on, base + toks(7, 20))  # the same prefix now hits the device pages
    assert again.token_ids == run(off, base + toks(7, 20)).token_ids
    # a budget too small for any checkpoint: evictions are dropped, lookups fall back to recompute
    budget = pc.host.budget
    pc.host.clear()
    pc.host.budget = pc.layout.slot_units * pc.layout.unit_bytes - 1
    try:
        rejected = host(on)["host_entries_rejected"]
        run(on, toks(8, 120))
        flood(on, 400)
        assert host(on)["host_entries_rejected"] > rejected
        assert host(on)["host_checkpoints"] == 0
        prompt = toks(8, 120) + toks(9, 5)
        warm, cold = run(on, prompt), run(off, prompt)
        assert warm.token_ids == cold.token_ids and logprobs(warm) == logprobs(cold)
    finally:
        pc.host.budget = budget
    settled(on)


def test_interleaved_conversations_under_eviction_match_no_cache(engines):
    """Five multi-turn conversations advanced in a random order, several requests in flight per step,
    an abort among them; the arena holds two or three conversations, the host tier the rest."""
    on, off = engines
    rng = np.random.default_rng(11)
    convs = [toks(500 + i, int(rng.integers(40, 140))) for i in range(5)]
    hits_before = host(on)["host_hits"]
    for rnd in range(3):
        order = rng.permutation(len(convs))
        batch = {}
        for i in order:
            p = SamplingParams(max_tokens=6, **PARAMS)
            batch[on.add_request(convs[i], p)] = i
        victim = next(iter(batch))
        on.step()
        on.abort(victim) if rnd == 1 else None
        outs = {}
        while on.has_unfinished():
            for o in on.step():
                if o.finished:
                    outs[o.request_id] = o
        for rid, i in batch.items():
            if rnd == 1 and rid == victim:
                continue
            cold = run(off, convs[i], n=6)
            assert outs[rid].outputs[0].token_ids == cold.token_ids, (rnd, i)
            assert logprobs(outs[rid]) == logprobs(cold)
            convs[i] = convs[i] + cold.token_ids + toks(600 + 10 * rnd + i, 9)
    assert host(on)["host_hits"] > hits_before
    assert on.stats()["compiles_after_warmup"] == 0
    settled(on)


def test_disaggregated_prefill_through_a_shared_store(engines):
    """A producer engine (its own arena and programs) prefills a prompt and publishes its pages and
    deepest KDA checkpoint into the host store that `on` reads; `on` then resumes that prompt from the
    store and decodes tokens and logprobs bit-identical to an engine without any cache. Engines with
    other weights or another arena layout are refused the store, naming what differs."""
    on, off = engines
    store = on.prefix_cache.host
    model = k3jax.load_model("tiny-k3", seed=2)
    producer = Engine(model, config(kv_transfer_config={"kv_role": "kv_producer", "store": store}), progress=False)
    for i, n in enumerate((150, 160)):  # 160: the prompt ends on an aligned position (16)
        prompt = toks(11 + i, n)
        first = run(producer, prompt, n=1)
        assert producer.counters["kv_transfer_published"] == i + 1
        before = host(on)
        warm, cold = run(on, prompt), run(off, prompt)
        assert warm.num_cached_tokens == 144  # the deepest checkpoint below the prompt's last token
        assert host(on)["host_hits"] == before["host_hits"] + 1
        assert warm.token_ids == cold.token_ids and logprobs(warm) == logprobs(cold)
        assert warm.token_ids[0] == first.token_ids[0]
    assert producer.stats()["arena_free_units"] + producer.stats()["arena_cached_units"] == \
        producer.stats()["arena_baseline_free_units"]
    settled(on)
    # `on` updates its weights; the producer, still on the old ones, publishes into the store they share: `on`
    # must not resume from those entries (they came from other weights), and serves again once its weights match
    old = on.model
    on.update_weights(k3jax.load_model("tiny-k3", seed=5))
    prompt = toks(31, 150)
    run(producer, prompt, n=1)
    hits = host(on)["host_hits"]
    assert run(on, prompt).num_cached_tokens == 0 and host(on)["host_hits"] == hits
    on.update_weights(old)
    run(producer, prompt, n=1)
    assert run(on, prompt).num_cached_tokens == 144
    # the same by name: a write of one tensor moves `on` off the producer's entries too; once the producer makes the
    # same write they share again
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    changed = [(name, on.get_weights_by_name(name, None) * 2)]
    on.update_weights_from_tensor(changed)
    run(producer, toks(32, 150), n=1)
    assert run(on, toks(32, 150)).num_cached_tokens == 0
    producer.update_weights_from_tensor(changed)
    run(producer, toks(33, 150), n=1)
    assert run(on, toks(33, 150)).num_cached_tokens == 144
    on.update_weights(old)
    settled(on)
    kv = {"kv_role": "kv_consumer", "store": store}
    with pytest.raises(ValueError, match=r"kv_transfer_config.store: .* weights \(checksum\)"):
        Engine(k3jax.load_model("tiny-k3", seed=3), config(kv_transfer_config=kv), warmup=False)
    with pytest.raises(ValueError, match=r"kv_transfer_config.store: .* arena layout"):
        Engine(model, config(kv_transfer_config=kv, kv_cache_dtype="fp8"), warmup=False)
    with pytest.raises(ValueError, match="host_cache_bytes at 0"):
        config(kv_transfer_config=kv, host_cache_bytes=1 << 20).validate()
    with pytest.raises(ValueError, match="kv_role"):
        config(kv_transfer_config={"kv_role": "prefill", "store": store}).validate()


def test_engines_differing_only_in_adapter_slots_or_layer_scan_share_a_store():
    """The store's fingerprint sums the model's weights, not the step programs' leaves: an engine with LoRA slots
    (extra leaves) or a layer scan (stacked leaves) holds the same weights and arena entries, and was refused the
    store of an engine without them, named as other weights. Other weights are still refused."""
    model, store = k3jax.load_model("tiny-k3", seed=2), HostCache(1 << 20)
    producer = Engine(model, config(kv_transfer_config={"kv_role": "kv_producer", "store": store}, max_loras=1,
                                    max_lora_rank=4), warmup=False)
    consumer = Engine(model, config(kv_transfer_config={"kv_role": "kv_consumer", "store": store}, scan_layers=True),
                      warmup=False)
    assert producer.prefix_cache.origin == consumer.prefix_cache.origin  # each serves the other's entries
    with pytest.raises(ValueError, match=r"kv_transfer_config.store: .* weights \(checksum\)"):
        Engine(k3jax.load_model("tiny-k3", seed=3), config(kv_transfer_config={"kv_role": "kv_consumer",
                                                                               "store": store}, max_loras=1),
               warmup=False)


def test_any_weight_change_moves_a_shared_store_origin():
    """A whole `update_weights` tagged a shared store's entries (`PrefixCache.origin`) by a sample of three arrays'
    first 64 values, and engines bound the store by it: new weights that differ elsewhere kept the tag, so an engine
    sharing the store would resume from KV computed under other weights (and one started from them was given the
    store). The tag is a checksum of every weight now: one element changed, in any weight, moves it (and refuses
    the store to an engine started from those weights); the old weights bring it back."""
    import dataclasses

    import jax

    model, store = k3jax.load_model("tiny-k3", seed=2), HostCache(1 << 20)
    kv = lambda role: config(kv_transfer_config={"kv_role": role, "store": store})  # noqa: E731
    producer = Engine(model, kv("kv_producer"), warmup=False, progress=False)
    consumer = Engine(model, kv("kv_consumer"), warmup=False, progress=False)
    origin = producer.prefix_cache.origin
    assert consumer.prefix_cache.origin == origin
    flat, treedef = jax.tree.flatten(model.params)
    big = [k for k, a in enumerate(flat) if a.size > 1000]
    for k in (big[0], big[len(big) // 2], big[-1]):
        changed = np.array(flat[k])
        changed.flat[changed.size // 2 + 1] += 1  # one element mid-weight
        leaves = flat[:k] + [jax.numpy.asarray(changed)] + flat[k + 1:]
        other = dataclasses.replace(model, params=jax.tree.unflatten(treedef, leaves))
        consumer.update_weights(other)
        assert consumer.prefix_cache.origin != origin, k
        with pytest.raises(ValueError, match=r"kv_transfer_config.store: .* weights \(checksum\)"):
            Engine(other, kv("kv_consumer"), warmup=False, progress=False)
        consumer.update_weights(model)
        assert consumer.prefix_cache.origin == origin


@pytest.mark.parametrize("dtype", ["bfloat16", "uint8", "bool", "float32"])
def test_the_weights_checksum_is_the_same_row_by_row_and_for_a_stacked_slice(dtype):
    """`named_weights.checksum` row by row (XLA:CPU: it held the whole weight as uint32 beside it otherwise) and of
    a layer scan's stacked slice equals the one-pass sum of the weight alone, and one element moves it."""
    import jax.numpy as jnp

    from serve.named_weights import checksum

    x = np.random.default_rng(3).normal(size=(5, 7, 3)) * 4
    x = jnp.asarray(x > 0 if dtype == "bool" else x.astype(np.float32)).astype(dtype)
    other = jnp.logical_not(x) if dtype == "bool" else x + 1
    want = int(checksum(x))
    assert int(checksum(x, by_rows=True)) == want
    stacked = jnp.stack([other, x])
    assert int(checksum(stacked, np.int32(1), by_rows=True)) == int(checksum(stacked, np.int32(1))) == want
    moved = x.at[3, 6, 2].set(other[3, 6, 2])
    assert int(checksum(moved, by_rows=True)) == int(checksum(moved)) != want


@pytest.mark.parametrize("shape", [(), (1, 4), (0, 4), (3, 0), (2, 0, 4)])
def test_the_weights_checksum_row_by_row_of_odd_shapes(shape):
    """Row by row, a weight with no rows divided by zero (`ZeroDivisionError` tracing it, a stacked leaf's
    empty slice too): every shape sums as in one pass."""
    import jax.numpy as jnp

    from serve.named_weights import checksum

    x = jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape) + 1
    assert int(checksum(x, by_rows=True)) == int(checksum(x))
    stacked = jnp.stack([x, x])
    assert int(checksum(stacked, np.int32(1), by_rows=True)) == int(checksum(stacked, np.int32(1)))


def test_a_host_entry_holds_only_its_own_bytes():
    """An eviction round copies every entry it drops to host memory in one read. The entries were views of that
    one copy, so an entry left in the store (the rest evicted by the host tier or restored) kept the whole round's
    bytes alive: host memory beyond what the budget counts (20 % over in a probe of interleaved conversations)."""
    from serve.memory import Arena, ArenaLayout
    from serve.prefix_cache import PrefixCache, PrefixCacheConfig
    from test_prefix_cache import cache_prompt

    layout = ArenaLayout.plan(k3jax.get_preset("tiny-k3"), 900 * 16 * 40 * 4, 16, np.float32)
    alloc = Arena(layout)
    read = lambda units, segments: (np.zeros((len(units), layout.unit_elems), np.float32),
                                    np.zeros((len(units), 16), np.int32))
    pc = PrefixCache(alloc, layout, 16, PrefixCacheConfig(hash_unit=8), HostCache(1 << 30), read)
    for seed in (1, 2):
        cache_prompt(alloc, pc, toks(seed, 64), ckpt_at=48)
    pc.evict_for(alloc.baseline_free_units, 0)  # one round: both prompts' pages and checkpoints
    store = pc.host
    assert not pc.pages and len(store.entries) > 2
    for key in list(store.entries)[:-1]:
        store.discard(key)
    arrays = [a if a.base is None else a.base for e in store.entries.values() for a in (e.rows, e.tokens)]
    assert sum({id(a): a.nbytes for a in arrays}.values()) == store.used


def test_adapters_of_engines_sharing_a_store_are_salted_apart():
    """An adapter's requests salt their prefix hashes with its load's uid. Each engine's registry numbered its
    loads from 1, so a consumer engine's first adapter resumed from a prefix a producer's first adapter (another
    adapter) had put into their shared store: other states, wrong tokens. Loads are numbered per process now."""
    from serve.lora import Registry

    producer, consumer = Registry(1, 4).add("a", "/a", 4, {}), Registry(1, 4).add("b", "/b", 4, {})
    assert producer.uid != consumer.uid


def test_config_and_cli():
    with pytest.raises(ValueError, match="host_cache_bytes"):
        config(host_cache_bytes=-1).validate()
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        config(host_cache_bytes=1 << 20, enable_prefix_caching=False).validate()
    from serve.cli import DEFAULTS
    assert engine_config({**DEFAULTS, "host_cache_mb": 64}).host_cache_bytes == 64 << 20
    assert engine_config({**DEFAULTS, "kv_offloading_size": 0.5}).host_cache_bytes == 1 << 29
    assert engine_config(dict(DEFAULTS)).host_cache_bytes == 0
    assert not engine_config(dict(DEFAULTS)).prefill_first
    assert engine_config({**DEFAULTS, "prefill_first": True}).prefill_first
    assert engine_config(dict(DEFAULTS)).compile_threads is None
    assert engine_config({**DEFAULTS, "compile_threads": 3}).compile_threads == 3
    with pytest.raises(ValueError, match="give one"):
        engine_config({**DEFAULTS, "host_cache_mb": 1, "kv_offloading_size": 1.0})


def test_reset_prefix_cache_keeps_what_requests_in_flight_read(engines):
    on, off = engines
    base = toks(20, 150)
    run(on, base)
    flood(on, 700, n=2)
    prompt = base + toks(21, 100)
    rid = on.add_request(prompt, SamplingParams(max_tokens=6, **PARAMS))
    on.step()  # admitted: it shares the prefix's pages (from either tier) while it runs
    assert not on.reset_prefix_cache()
    out = None
    while on.has_unfinished():
        for o in on.step():
            if o.request_id == rid and o.finished:
                out = o
    cold = run(off, prompt, n=6)
    assert out.num_cached_tokens == 144 and out.token_ids == cold.token_ids and logprobs(out) == logprobs(cold)
    assert on.reset_prefix_cache()
    st = on.stats()
    assert st["prefix_cache"]["pages"] == st["prefix_cache"]["checkpoints"] == st["prefix_cache"]["host_bytes"] == 0
    assert st["arena_free_units"] == st["arena_baseline_free_units"]
    assert run(on, prompt, n=6).num_cached_tokens == 0


def test_two_requests_restoring_the_same_host_prefix_in_one_step(engines):
    on, off = engines
    base = toks(30, 200)
    run(on, base)
    flood(on, 800)
    before = host(on)
    prompts = [base + toks(31, 12), base + toks(32, 20)]
    rids = [on.add_request(p, SamplingParams(max_tokens=5, **PARAMS)) for p in prompts]
    outs = {}
    while on.has_unfinished():
        for o in on.step():
            if o.finished:
                outs[o.request_id] = o
    assert host(on)["host_hits"] - before["host_hits"] == 2
    for rid, p in zip(rids, prompts):
        cold = run(off, p, n=5)
        assert outs[rid].num_cached_tokens == 192
        assert outs[rid].token_ids == cold.token_ids and logprobs(outs[rid]) == logprobs(cold)
    settled(on)



PROMPTS = [toks(50, 130), toks(51, 70)]


def generate_all(engine, prompts):
    """All prompts at once, 5 tokens each -> their finished outputs in order."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=5, **PARAMS)) for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids]


def test_update_weights_swaps_in_place_and_forgets_both_tiers(engines):
    """Engine.update_weights: new weights of the same model are swapped in without a compile, answer as an
    engine built on them does, and nothing cached (device or host tier) under the old weights is reused."""
    import dataclasses

    on, _ = engines
    old, new = on.model, k3jax.load_model("tiny-k3", seed=5)
    generate = lambda engine: generate_all(engine, PROMPTS)

    updates = on.stats()["weight_updates"]  # (other tests load weights too)
    before = generate(on)
    flood(on, 900, n=2)  # part of what the prompts left is in the host tier now
    on.update_weights(new)
    assert host(on)["host_bytes"] == 0 and on.stats()["prefix_cache"]["checkpoints"] == 0
    after = generate(on)  # the same prompts: a stale hit would answer with the old weights' states
    fresh = generate(Engine(new, config(host_cache_bytes=32 << 20), progress=False))  # shares the programs
    assert [o.token_ids for o in after] == [o.token_ids for o in fresh] != [o.token_ids for o in before]
    assert [logprobs(o) for o in after] == [logprobs(o) for o in fresh]
    assert all(o.num_cached_tokens == 0 for o in after)
    assert on.stats()["compiles_after_warmup"] == 0 and on.stats()["weight_updates"] == updates + 1
    on.update_weights(old)  # the engine's own (already transformed) weights go back in as well
    assert [logprobs(o) for o in generate(on)] == [logprobs(o) for o in before]

    rid = on.add_request(PROMPTS[0], SamplingParams(max_tokens=4))
    on.step()
    with pytest.raises(RuntimeError, match="in flight"):
        on.update_weights(new)
    on.abort(rid)
    on.step()
    bad = dataclasses.replace(new, cfg=dataclasses.replace(new.cfg, rms_norm_eps=1e-3))
    with pytest.raises(ValueError, match="rms_norm_eps"):
        on.update_weights(bad)
    settled(on)


def test_committed_weights_compile_nothing_after_warm_up(engines, tmp_path):
    """An Orbax checkpoint (`k3jax convert`'s) restores committed arrays where a preset's are not: an engine
    built on one, back from sleep, or given one by `update_weights` runs the programs its warm-up compiled (an
    uncommitted arena compiled the first bucket again once a step with committed weights had committed it)."""
    import jax

    from k3jax.checkpoint import save_orbax

    on, _ = engines
    base = k3jax.load_model("tiny-k3", seed=2)  # the fixture's weights
    save_orbax(str(tmp_path), base.cfg, base.params, base.dtype)
    restored = k3jax.load_model(str(tmp_path))
    assert all(x.committed for x in jax.tree.leaves(restored.params))
    eng = Engine(restored, config(host_cache_bytes=32 << 20), progress=False)
    want = [logprobs(o) for o in generate_all(on, PROMPTS)]
    assert [logprobs(o) for o in generate_all(eng, PROMPTS)] == want
    eng.sleep(1)
    eng.wake_up()
    assert [logprobs(o) for o in generate_all(eng, PROMPTS)] == want
    assert eng.stats()["compiles_after_warmup"] == 0
    on.update_weights(restored)
    assert [logprobs(o) for o in generate_all(on, PROMPTS)] == want
    assert on.stats()["compiles_after_warmup"] == 0
    settled(on)


def test_update_weights_from_tensor_answers_as_update_weights(engines):
    """SGLang's update_weights_from_tensor: the checkpoint tensors of other weights, pushed in two buckets by
    name (MXFP4 pairs split between them), answer exactly as `update_weights` with the whole model; no
    compile; the prefix cache is forgotten unless `flush_cache=False` keeps it."""
    from k3jax.checkpoint import hf_tensors

    on, _ = engines
    base, new = k3jax.load_model("tiny-k3", seed=2), k3jax.load_model("tiny-k3", seed=5)  # the fixture's, others
    on.update_weights(new)
    want = generate_all(on, PROMPTS)
    on.update_weights(base)
    before = generate_all(on, PROMPTS)
    tensors = list(hf_tensors(new.cfg, new.params))
    on.update_weights_from_tensor(tensors[:len(tensors) // 2 + 1])
    on.update_weights_from_tensor(tensors[len(tensors) // 2 + 1:])
    got = generate_all(on, PROMPTS)
    assert [logprobs(o) for o in got] == [logprobs(o) for o in want] != [logprobs(o) for o in before]
    assert all(o.num_cached_tokens == 0 for o in got)
    on.update_weights_from_tensor(tensors[:3], flush_cache=False)  # (the same values): cached prefixes stay
    again = generate_all(on, PROMPTS)
    assert [logprobs(o) for o in again] == [logprobs(o) for o in want] and again[0].num_cached_tokens > 0
    on.update_weights_from_tensor(list(hf_tensors(base.cfg, base.params)))
    assert [logprobs(o) for o in generate_all(on, PROMPTS)] == [logprobs(o) for o in before]
    assert on.stats()["compiles_after_warmup"] == 0
    settled(on)


def live_bytes():
    import gc

    import jax
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays())


def test_sleep_releases_device_memory_and_wake_up_answers_the_same(engines):
    """vLLM's sleep mode: level 1 frees the arena and the engine's weights (kept in host memory), level 2
    discards the weights (update_weights loads them, asleep or after waking the weights); requests are
    refused while asleep, and afterwards the engine answers exactly as before, with no compile."""
    import jax

    from serve.engine import EngineSleeping

    on, off = engines
    sleeps = on.stats()["sleeps"]  # (the sleep routes' test may run first)
    before = [logprobs(o) for o in generate_all(on, PROMPTS)]
    rid = on.add_request(PROMPTS[0], SamplingParams(max_tokens=4))
    on.step()
    with pytest.raises(RuntimeError, match="in flight"):
        on.sleep()
    on.abort(rid)
    on.step()
    # buffers only this engine holds: the arena, token pages and the weights its start-up transforms made
    # (the model's untransformed weights are `off`'s too)
    shared = {x.unsafe_buffer_pointer() for x in off._leaves}
    own = {x.unsafe_buffer_pointer(): x.nbytes for x in [on.arena, on.token_pages, *on._leaves]
           if x.unsafe_buffer_pointer() not in shared}
    live = live_bytes()
    on.sleep(1)
    assert not own.keys() & {x.unsafe_buffer_pointer() for x in jax.live_arrays()}  # all freed
    assert live - live_bytes() > 0.9 * sum(own.values()) > 2 << 20
    assert on.is_sleeping and on.stats()["sleep_level"] == 1
    assert host(on)["host_bytes"] == 0  # cached prefixes forgotten, both tiers
    with pytest.raises(EngineSleeping, match="weights and kv_cache.*wake_up"):
        on.add_request(PROMPTS[0])
    on.wake_up(["kv_cache"])
    with pytest.raises(EngineSleeping, match="weights released"):
        on.add_request(PROMPTS[0])
    on.wake_up()
    assert not on.is_sleeping and [logprobs(o) for o in generate_all(on, PROMPTS)] == before

    weights = on.model  # the engine's (transformed) weights, to load back after level 2
    on.sleep(2)
    on.wake_up()  # weights as zeros: nothing may run on them
    with pytest.raises(EngineSleeping, match="update_weights"):
        on.add_request(PROMPTS[0])
    on.update_weights(weights)
    assert [logprobs(o) for o in generate_all(on, PROMPTS)] == before
    on.sleep(2)
    on.update_weights(weights)  # loading while asleep: the weights are back, the cache still released
    assert on.is_sleeping
    on.wake_up(["kv_cache"])
    assert not on.is_sleeping and [logprobs(o) for o in generate_all(on, PROMPTS)] == before
    # one part at a time (SGLang's release tags): the cache alone (the weights stay on the device), then the
    # weights alone at level 2 (the arena stays; new weights wake the engine)
    kept = [x.unsafe_buffer_pointer() for x in on._leaves]
    on.sleep(1, ["kv_cache"])
    assert on.arena is None and [x.unsafe_buffer_pointer() for x in on._leaves] == kept
    with pytest.raises(EngineSleeping, match=r"\(kv_cache released"):
        on.add_request(PROMPTS[0])
    on.wake_up(["kv_cache"])
    assert not on.is_sleeping and [logprobs(o) for o in generate_all(on, PROMPTS)] == before
    on.sleep(2, ["weights"])
    assert on._leaves is None and on.arena is not None
    with pytest.raises(EngineSleeping, match=r"\(weights released"):
        on.add_request(PROMPTS[0])
    on.update_weights(weights)
    assert not on.is_sleeping and [logprobs(o) for o in generate_all(on, PROMPTS)] == before
    with pytest.raises(ValueError, match="level"):
        on.sleep(3)
    with pytest.raises(ValueError, match="tags"):
        on.wake_up(["kv"])
    with pytest.raises(ValueError, match=r"tags.*'cuda_graph'"):
        on.sleep(1, ["weights", "cuda_graph"])
    assert on.stats()["compiles_after_warmup"] == 0 and on.stats()["sleeps"] == sleeps + 5
    settled(on)


def test_retract_frees_a_forked_beam_search_and_counts_each_request_once(engines):
    """Engine.retract (SGLang's retract pause) with a beam search in flight whose beams just forked: the parent's
    frozen state slot and pages are freed with the rest (they pinned prefix-cache pages: sleep and weight updates
    raised "the prefix cache could not be cleared"), so the engine sleeps meanwhile and the requests then end as
    uninterrupted ones; a second retract counts none again, and none counts as a preemption."""
    from serve.beam_search import BeamSearchParams

    on, _ = engines
    reqs = [(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True)),
            (PROMPTS[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]

    def run(pause=False):
        ids = [on.add_request(p, sp) for p, sp in reqs]
        done = {}
        while on.has_unfinished():
            if pause and on._frozen:
                pause = False
                retracted, preempted = on.stats()["requests_retracted"], on.stats()["preemptions"]
                assert on.retract() == 2 and on.retract() == 0
                assert on.stats()["requests_retracted"] == retracted + 2 and not on._frozen
                assert on.stats()["preemptions"] == preempted  # a retract is not a preemption for memory
                st = on.stats()
                assert st["arena_free_units"] + st["arena_cached_units"] == st["arena_baseline_free_units"]
                on.sleep(1)
                on.wake_up()
                on.continue_generation()
            done.update({o.request_id: o for o in on.step() if o.finished})
        assert not pause  # (the beams forked)
        return [[c.token_ids for c in done[i].outputs] for i in ids]

    assert run(pause=True) == run()
    settled(on)


def _weight_sync_app(engines, tmp_path):
    """The prefix-caching engine behind an app with the weight-sync routes, and its weights saved as a
    checkpoint in `tmp_path` (what /update_weights_from_disk loads) -> (engine, async engine, app)."""
    from k3jax.checkpoint import save_hf_checkpoint
    from serve.api import create_app
    from serve.async_engine import AsyncEngine

    on, _ = engines
    fresh = k3jax.load_model("tiny-k3", seed=2)  # the fixture's weights
    save_hf_checkpoint(str(tmp_path), fresh.cfg, fresh.params)
    aeng = AsyncEngine(on)
    return on, aeng, create_app(aeng, "tiny-k3", enable_sleep_mode=True)


def _serve_weight_sync(go, aeng, on, routes: set) -> None:
    """Run the client coroutine `go` against the weight-sync app; afterwards the engine compiled nothing and
    holds nothing, and an app without enable_sleep_mode has none of `routes`."""
    import asyncio

    from serve.api import create_app

    try:
        asyncio.run(go())
    finally:
        aeng.shutdown()
    assert on.stats()["compiles_after_warmup"] == 0
    settled(on)
    assert not routes & {r.path for r in create_app(None, "m").routes}


def test_sleep_endpoints(engines, tmp_path):
    """POST /sleep, /wake_up, GET /is_sleeping (vLLM's) and /update_weights_from_disk (SGLang's), served
    with enable_sleep_mode; completions answer 503 while asleep and the same text after waking."""
    import asyncio
    import re

    import httpx

    from serve.api import create_app

    on, aeng, app = _weight_sync_app(engines, tmp_path)
    body = dict(prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            first = (await c.post("/v1/completions", json=body)).json()["choices"][0]
            assert (await c.post("/sleep", params={"level": 2})).json() == {"is_sleeping": True, "level": 2}
            assert (await c.get("/is_sleeping")).json() == {"is_sleeping": True}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_sleeping"
            assert (await c.get("/health")).status_code == 200
            assert re.search(r"k3jax:engine_sleep_level(\{[^}]*\})? 2\.0", (await c.get("/metrics")).text)
            r = await c.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model_path"
            r = (await c.post("/update_weights_from_disk", json={"model_path": str(tmp_path)})).json()
            assert r["success"] and r["is_sleeping"]  # weights back, the cache still released
            assert (await c.post("/wake_up", params={"tags": ["kv_cache"]})).json() == {"is_sleeping": False}
            again = (await c.post("/v1/completions", json=body)).json()["choices"][0]
            assert again["text"] == first["text"] and again["logprobs"] == first["logprobs"]
            assert (await c.post("/wake_up", params={"tags": ["nope"]})).status_code == 400

    try:
        asyncio.run(go())
    finally:
        aeng.shutdown()
    assert on.stats()["compiles_after_warmup"] == 0
    plain = create_app(None, "m")  # without enable_sleep_mode the routes do not exist
    assert "/sleep" not in {r.path for r in plain.routes}


def test_sglang_memory_and_pause_endpoints(engines, tmp_path):
    """SGLang's names for the weight-sync routes (served with enable_sleep_mode): /release_memory_occupation and
    /resume_memory_occupation by `tags` (one part or all; "cuda_graph" accepted, nothing to do), the weights
    discarded unless the server keeps a host copy (weights_cpu_backup), /pause_generation (abort mode: the
    running request ends, new ones wait; retract mode: it waits without memory while other weights load, then
    goes on under them) and /continue_generation; the answers afterwards are the same; SGLang's weight version
    (set by a weight update or /update_weight_version, read in /get_model_info and /generate's meta_info)."""
    import asyncio

    import httpx

    from serve.api import create_app

    on, aeng, app = _weight_sync_app(engines, tmp_path)
    backup = create_app(aeng, "tiny-k3", enable_sleep_mode=True, weights_cpu_backup=True)
    other = k3jax.load_model("tiny-k3", seed=3)  # other weights, loaded while requests are retracted
    __import__("k3jax.checkpoint", fromlist=["x"]).save_hf_checkpoint(str(tmp_path / "other"), other.cfg, other.params)
    body = dict(prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2)
    long = dict(prompt=PROMPTS[1], max_tokens=300, temperature=0, ignore_eos=True)

    async def answer(c):
        r = await c.post("/v1/completions", json=body)
        return r.json()["choices"][0] if r.status_code == 200 else r.status_code

    async def go():
        t = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=t, base_url="http://t", timeout=120) as c, \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=backup), base_url="http://t", timeout=120) as b:
            first = await answer(c)
            r = (await c.post("/release_memory_occupation", json={"tags": ["kv_cache"]})).json()
            assert r == {"success": True, "released": ["kv_cache"], "is_sleeping": True}
            assert on.arena is None and on._leaves is not None and await answer(c) == 503
            assert on.stats()["sleep_level"] == 1  # (the weights are all there: level 2 discards only weights)
            r = (await c.post("/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]})).json()
            assert r == {"success": True, "is_sleeping": False} and await answer(c) == first
            # all parts, no body (SGLang's default): the weights are discarded -> loaded from disk
            assert (await c.post("/release_memory_occupation")).json()["released"] == ["weights", "kv_cache"]
            assert on.stats()["sleep_level"] == 2
            assert (await c.post("/resume_memory_occupation", json={"tags": ["weights"]})).json()["is_sleeping"]
            assert await answer(c) == 503
            assert (await c.post("/update_weights_from_disk", json={"model_path": str(tmp_path)})).json()["success"]
            assert not (await c.get("/resume_memory_occupation")).json()["is_sleeping"]  # (GET, as SGLang's)
            assert await answer(c) == first
            # with a host copy of the weights: all released and taken back, no reload
            assert (await b.post("/release_memory_occupation", json={})).json()["success"]
            assert on.stats()["sleep_level"] == 1
            assert not (await b.post("/resume_memory_occupation", json={})).json()["is_sleeping"]
            assert await answer(b) == first
            r = (await c.post("/release_memory_occupation", json={"tags": ["cuda_graph"]})).json()
            assert r["released"] == [] and not r["is_sleeping"]
            r = await c.post("/release_memory_occupation", json={"tags": ["nope"]})
            assert r.status_code == 400 and "tags" in r.json()["error"]["message"], r.text

            running = asyncio.ensure_future(c.post("/v1/completions", json=long))
            while not on.stats()["num_requests_running"]:
                await asyncio.sleep(0.01)
            r = (await c.post("/pause_generation", json={"mode": "abort"})).json()
            assert r == {"message": "Generation paused successfully.", "status": "ok"}
            assert (await running).json()["choices"][0]["finish_reason"] == "abort"
            held = asyncio.ensure_future(answer(c))
            await asyncio.sleep(0.3)
            assert not held.done() and on.stats()["num_requests_waiting"] == 0
            r = await c.post("/pause_generation", json={"mode": "in_place"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
            assert (await c.post("/continue_generation")).json()["status"] == "ok"
            assert await held == first

            # retract: the running request keeps its tokens, frees its cache and waits while new weights load;
            # on /continue_generation it recomputes under them and goes on: its tokens from the retract point
            # are the new weights' greedy continuation of the prompt and the tokens before it
            r40 = dict(prompt=PROMPTS[1], max_tokens=40, temperature=0, ignore_eos=True, return_token_ids=True)
            running = asyncio.ensure_future(c.post("/v1/completions", json=r40))
            seq = None
            while seq is None or len(seq.output_ids) < 8:
                await asyncio.sleep(0.01)
                seq = next((s for s in on.seqs.values() if not s.finished and not s.internal), None)
            assert (await c.post("/pause_generation", json={"mode": "retract"})).json()["status"] == "ok"
            k = len(seq.output_ids)
            st = on.stats()
            assert on.held and st["requests_retracted"] >= 1 and 8 <= k < 40 and not running.done()
            assert st["arena_free_units"] + st["arena_cached_units"] == st["arena_baseline_free_units"]
            r = (await c.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "other")})).json()
            assert r["success"], r
            await asyncio.sleep(0.2)
            assert not running.done() and len(seq.output_ids) == k  # held: nothing ran
            assert (await c.post("/continue_generation")).json()["status"] == "ok"
            done = (await running).json()["choices"][0]
            assert done["finish_reason"] == "length" and len(done["token_ids"]) == 40
            rest = (await c.post("/v1/completions", json=dict(r40, prompt=PROMPTS[1] + done["token_ids"][:k],
                                                               max_tokens=40 - k))).json()["choices"][0]
            assert rest["token_ids"] == done["token_ids"][k:]
            # the same under the fixture's weights again (as other tests expect them), with SGLang's weight version
            assert (await c.get("/get_model_info")).json()["weight_version"] == "default"
            r = (await c.post("/update_weights_from_disk", json={"model_path": str(tmp_path),
                                                                 "weight_version": "v2"})).json()
            assert r["success"] and "v2" in r["message"] and await answer(c) == first
            assert (await c.get("/get_model_info")).json()["weight_version"] == "v2"
            g = (await c.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}))
            assert g.json()["meta_info"]["weight_version"] == "v2"
            r = (await c.post("/update_weight_version", json={"new_version": "v3"})).json()
            assert r == {"success": True, "message": "weight version updated to v3", "new_version": "v3"}
            assert (await c.get("/get_model_info")).json()["weight_version"] == "v3"
            r = await c.post("/update_weight_version", json={"new_version": ""})
            assert r.status_code == 400 and r.json()["error"]["param"] == "new_version", r.text

    _serve_weight_sync(go, aeng, on, {"/release_memory_occupation", "/pause_generation", "/continue_generation",
                                      "/update_weight_version"})


def test_weights_by_name_endpoints(engines, tmp_path):
    """SGLang's /get_weights_by_name (GET or POST: a checkpoint tensor's first rows as nested lists) and
    /update_weights_from_tensor (served with enable_sleep_mode; here the tensors come as base64 safetensors
    files, `load_format` "safetensors"): pushed tensors read back and change the answers, the originals
    pushed back answer as before; bad names, formats and files are 400s naming the field, weights unchanged."""
    import base64

    import httpx
    from safetensors.numpy import save

    from k3jax.checkpoint import hf_tensors

    on, aeng, app = _weight_sync_app(engines, tmp_path)
    base, other = (dict(hf_tensors(m.cfg, m.params)) for m in (k3jax.load_model("tiny-k3", seed=s) for s in (2, 3)))
    names = sorted(n for n in base if ".layers.0." in n or "embed" in n)  # (under the 1 MiB body limit)
    files = lambda ts: [base64.b64encode(save({n: ts[n] for n in part})).decode() for part in (names[::2], names[1::2])]
    body = dict(prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2)
    embed = "language_model.model.embed_tokens.weight"

    async def answer(c):
        return (await c.post("/v1/completions", json=body)).json()["choices"][0]

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            first = await answer(c)
            r = await c.request("GET", "/get_weights_by_name", json={"name": embed, "truncate_size": 2})
            assert r.status_code == 200 and r.json() == base[embed][:2].tolist(), r.text
            r = (await c.post("/get_weights_by_name", json={"name": names[0], "truncate_size": None})).json()
            assert np.array_equal(np.asarray(r, np.float32), base[names[0]])
            r = await c.post("/get_weights_by_name", json={"name": "model.nope"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "name" and "model.nope" in r.text

            push = lambda ts, **kw: c.post("/update_weights_from_tensor", json=dict(
                serialized_named_tensors=files(ts), load_format="safetensors", **kw))
            updates = on.stats()["weight_updates"]
            for bad, param in ((dict(load_format=None), "load_format"),
                               (dict(serialized_named_tensors=["%%%"]), "serialized_named_tensors"),
                               (dict(serialized_named_tensors=[base64.b64encode(b"x" * 16).decode()]),
                                "serialized_named_tensors"),
                               (dict(serialized_named_tensors=[base64.b64encode(save(
                                   {embed: np.zeros((3, 64), np.float32)})).decode()]), "serialized_named_tensors")):
                r = await c.post("/update_weights_from_tensor", json={**dict(
                    serialized_named_tensors=files(other), load_format="safetensors"), **bad})
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert "does not match the model's [320, 64]" in r.text and on.stats()["weight_updates"] == updates
            r = (await push(other, weight_version="pushed")).json()
            assert r == {"success": True, "message": f"{len(names)} tensors written; weight version pushed",
                         "is_sleeping": False}
            got = (await c.post("/get_weights_by_name", json={"name": embed, "truncate_size": 1})).json()
            assert got == other[embed][:1].tolist() and (await answer(c))["logprobs"] != first["logprobs"]
            assert (await c.get("/get_model_info")).json()["weight_version"] == "pushed"
            assert (await push(base)).json()["success"] and await answer(c) == first
            assert on.stats()["weight_updates"] == updates + 2

    _serve_weight_sync(go, aeng, on, {"/get_weights_by_name", "/update_weights_from_tensor"})


def test_pause_endpoints(engines, tmp_path):
    """POST /pause (vLLM's, served with enable_sleep_mode): `abort` (the default) ends the request in flight
    (finish_reason "abort", its cache freed) and holds new ones, unadmitted, until POST /resume, so new
    weights load meanwhile (a held request is not in flight); the held request then answers as before the
    pause. `wait` lets the running request finish first; `keep` keeps it open without its cache until /resume
    (the same tokens as uninterrupted); unknown modes are refused."""
    import asyncio
    import re

    import httpx

    on, aeng, app = _weight_sync_app(engines, tmp_path)
    body = dict(prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2)
    long = dict(prompt=PROMPTS[1], max_tokens=300, temperature=0, ignore_eos=True)  # max_model_len 384

    async def started(c, payload):
        task = asyncio.ensure_future(c.post("/v1/completions", json=payload))
        while not on.stats()["num_requests_running"]:
            await asyncio.sleep(0.01)
        return task

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            first = (await c.post("/v1/completions", json=body)).json()["choices"][0]
            running = await started(c, long)
            assert (await c.post("/pause")).json() == {"status": "paused", "mode": "abort", "aborted": 1,
                                                       "prefix_cache_reset": True}
            cut = (await running).json()
            assert cut["choices"][0]["finish_reason"] == "abort" and cut["usage"]["completion_tokens"] < 300
            assert (await c.get("/is_paused")).json() == {"is_paused": True}
            held = asyncio.ensure_future(c.post("/v1/completions", json=body))
            await asyncio.sleep(0.3)
            assert not held.done() and on.stats()["num_requests_waiting"] == 0  # not admitted
            metrics = (await c.get("/metrics")).text
            assert re.search(r"k3jax:api_paused(\{[^}]*\})? 1\.0", metrics)
            assert re.search(r"k3jax:api_requests_held(\{[^}]*\})? 1\.0", metrics)
            r = (await c.post("/update_weights_from_disk", json={"model_path": str(tmp_path)})).json()
            assert r["success"]
            assert (await c.post("/resume")).json() == {"status": "resumed"}
            again = (await held).json()["choices"][0]
            assert again["text"] == first["text"] and again["logprobs"] == first["logprobs"]

            running = await started(c, dict(long, max_tokens=24))
            assert (await c.post("/pause", params={"mode": "wait", "clear_cache": "false"})).json() == {
                "status": "paused", "mode": "wait", "aborted": 0, "prefix_cache_reset": False}
            assert not on.has_unfinished()  # answered once the running request had finished
            done = (await running).json()
            assert done["choices"][0]["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 24
            for bad in ("retract", "drain"):
                r = await c.post("/pause", params={"mode": bad})
                assert r.status_code == 400 and r.json()["error"]["param"] == "mode", r.text
            assert (await c.post("/resume")).json() == {"status": "resumed"}
            assert (await c.get("/is_paused")).json() == {"is_paused": False}
            assert (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"] == first["text"]

            # keep: the running request stays open without its cache and goes on after /resume, as uninterrupted
            whole = (await c.post("/v1/completions", json=dict(long, return_token_ids=True))).json()["choices"][0]
            running = await started(c, dict(long, return_token_ids=True))
            assert (await c.post("/pause", params={"mode": "keep", "clear_cache": "false"})).json() == {
                "status": "paused", "mode": "keep", "aborted": 0, "prefix_cache_reset": False, "retracted": 1}
            assert not running.done() and on.held
            assert re.search(r"k3jax:requests_retracted_total(\{[^}]*\})? [1-9]", (await c.get("/metrics")).text)
            assert (await c.post("/resume")).json() == {"status": "resumed"}
            kept = (await running).json()["choices"][0]
            assert kept["finish_reason"] == "length" and kept["token_ids"] == whole["token_ids"]

    _serve_weight_sync(go, aeng, on, {"/pause", "/resume", "/is_paused"})
