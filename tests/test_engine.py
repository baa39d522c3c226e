"""Serving engine: batch/chunk/preemption invariance of greedy outputs, arena accounting, no compiles
after warm-up, request validation."""

import dataclasses
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import k3jax
from serve.engine import Engine, EngineConfig
from serve.beam_search import BeamSearchParams
from serve.types import RequestError, SamplingParams
from step_failures import LoopSurface

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_engine(model, chunk=64, units=450, warmup=True, **kw):
    cfg = dict(max_model_len=512, page_size=16, cache_bytes=units * 2560, max_num_seqs=32, prefill_chunk=chunk,
               max_prefill_seqs=4, max_num_batched_tokens=512, decode_buckets=(4, 32), prefill_buckets=(4,),
               context_buckets=(32,), max_logprobs=3, enable_prefix_caching=False, measure_moe_time=False)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg), warmup=warmup, progress=False)


@pytest.fixture(scope="module", params=["tiny-k3", "tiny-kimi-linear"])
def model(request):
    return k3jax.load_model(request.param, seed=1)


@pytest.fixture(scope="module")
def engine(model):
    # small enough that 32 concurrent requests cannot all fit (forces preemption: no admission look-ahead);
    # with the one-row long prefill program (1 x 256; the `alone` runs use it, the batches rows of 64)
    return make_engine(model, units=450 if model.cfg.num_mla_layers > 1 else 250, measure_moe_time=True,
                       schedule_conservativeness=0.0, compile_threads=2, long_prefill_chunk=None,
                       decode_buckets=(1, 4, 32))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(1, 200, 32)]


def model_greedy(model, prompts, n: int) -> list[list[int]]:
    """The model's own greedy continuation of each prompt, one row at a time (CI time: a batch of rows compiles
    a prefill and a decode program of its own), prefilled in 32-token chunks: for prompts of 17 tokens or more
    (and prompt + n <= 256) it runs only programs `test_alone_matches_model_generate_greedy` compiles, its prefill
    program of one 32-token chunk and its decode program (a 256-position cache). (A 100-token prompt in one
    chunk compiled a 128-token prefill program of its own.)"""
    chunked = dataclasses.replace(model, prefill_chunk=32)
    return [chunked.generate_greedy(np.asarray([p]), n)[0].tolist() for p in prompts]


def run_all(engine, prompts, params=GREEDY):
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def alone(engine, prompts):
    return [run_all(engine, [p])[0].token_ids for p in prompts]


def test_alone_matches_model_generate_greedy(model, engine, alone, prompts):
    # two prompts (the model's own programs compile for them; CI time): one across the engine's chunks, one within
    # a chunk; the model prefills both in 32-token chunks (`model_greedy`: one prefill program for both)
    assert 17 <= len(prompts[1]) < 64 < len(prompts[0]), [len(p) for p in prompts[:2]]
    # alone, a prompt longer than a chunk ran in the long prefill row (the 1 x 256 program), so the batch and
    # tests below (checkpoint and accelerator forms) also check it against rows of 64 and of 16 / 256 tokens
    assert engine.sched_cfg.long_prefill_chunk == 256 and engine.counters["long_prefill_steps"] > 0
    assert alone[:2] == model_greedy(model, prompts[:2], 12)


class _NeverDown(dict):
    """Engine counters that note every key set lower than it was."""

    def __init__(self, *a):
        super().__init__(*a)
        self.decreased = []

    def __setitem__(self, key, value):
        if value < self.get(key, value):
            self.decreased.append(key)
        super().__setitem__(key, value)


def test_a_request_whose_bookkeeping_raises_ends_alone(engine, prompts, alone, monkeypatch):
    """A request whose host-side bookkeeping raises (here: appending its third token) ends alone -- StepFailed
    names it and carries the step's other outputs -- and its memory is freed; the request beside it finishes
    with the tokens it has alone, and the engine goes on. It counts as failed, not aborted, and no counter ever
    goes down meanwhile (a /metrics scrape from another thread would read a drop as a counter reset)."""
    from step_failures import drain_through_failures

    bad = engine.add_request(prompts[1], GREEDY)
    good = engine.add_request(prompts[2], GREEDY)
    real = engine._append

    def append(seq, *args):
        if seq.request_id == bad and len(seq.output_ids) >= 2:
            raise ValueError("boom")
        return real(seq, *args)

    monkeypatch.setattr(engine, "_append", append)
    failed_before, aborted_before = engine.stats()["requests_failed"], engine.stats()["requests_aborted"]
    counters = engine.counters = _NeverDown(engine.counters)
    try:
        failures, done = drain_through_failures(engine)
    finally:
        engine.counters = dict(counters)
    assert [f.request_ids for f in failures] == [[bad]] and "boom" in str(failures[0])
    assert bad not in done and done[good].token_ids == alone[2]
    s = engine.stats()
    assert s["requests_failed"] == failed_before + 1 and s["requests_aborted"] == aborted_before
    assert counters.decreased == []
    assert s["arena_free_units"] == s["arena_baseline_free_units"]
    monkeypatch.undo()
    assert run_all(engine, [prompts[1]])[0].token_ids == alone[1]


def test_latencies_are_bounded_and_each_step_counts_its_tokens(engine, prompts):
    """`engine.latency` keeps the latest `LATENCY_SAMPLES` of each kind (a long-running server's memory stays
    bounded; `total` counts every one and `since(total)` gives those after it, as the benchmarks read them);
    `iteration_tokens` (vLLM's tokens per step) adds a prompt alone's tokens, then one per decode step."""
    from serve.engine import LATENCY_SAMPLES
    from serve.series import Recent

    ring = Recent(3)
    for v in range(5):
        ring.append(v)
    assert (ring.total, list(ring), ring.since(0), ring.since(3), ring.since(5)) == (5, [2, 3, 4], [2, 3, 4], [3, 4], [])
    lat = engine.latency
    assert all(isinstance(v, Recent) and v._values.maxlen == LATENCY_SAMPLES for v in lat.values())
    totals, it, steps = {k: v.total for k, v in lat.items()}, engine.stats()["iteration_tokens"], engine.counters["steps"]
    run_all(engine, [prompts[1]])
    assert len(lat["itl"].since(totals["itl"])) == 11  # 12 tokens: the first from the prefill step
    assert all(lat[k].total == totals[k] + 1 for k in ("ttft", "e2e", "queue"))
    now = engine.stats()["iteration_tokens"]
    assert sum(now["counts"].values()) - sum(it["counts"].values()) == engine.counters["steps"] - steps
    assert now["sum"] - it["sum"] == len(prompts[1]) + 11


def test_prompt_tokens_count_once_prefilled(engine, prompts):
    """vLLM's `vllm:prompt_tokens_total` counts a sequence's prompt when its prefill ends (its first token), once
    (not again when a preempted sequence is recomputed). It was counted when the request was queued: a request
    aborted while waiting counted prompt tokens never processed, and a burst of queued requests showed as
    prompt throughput before any of it ran."""
    before = engine.stats()["prompt_tokens"]
    rid = engine.add_request(prompts[0], GREEDY)
    assert engine.stats()["prompt_tokens"] == before  # queued, not prefilled
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["prompt_tokens"] == before
    run_all(engine, [prompts[1]], SamplingParams(temperature=1.0, n=2, max_tokens=3, ignore_eos=True, seed=1))
    assert engine.stats()["prompt_tokens"] == before + 2 * len(prompts[1])  # each sample's prefill


def test_batch_of_32_mixed_lengths_is_token_identical(engine, prompts, alone):
    outs = run_all(engine, prompts)
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" for o in outs)
    st_ = engine.stats()
    assert st_["arena_free_units"] == st_["arena_baseline_free_units"]
    assert st_["compiles_after_warmup"] == 0


def test_moe_dispatch_time_is_measured_per_step_shape(engine, prompts):
    """Every step program's token count (decode rows 1, 4, 32; prefill 4 x 64 and the long 1 x 256) has a measured MoE time,
    and each step adds the time of its shape."""
    s = engine.stats()
    assert set(s["moe_step_seconds"]) == {1, 4, 32, 256}
    assert all(v > 0 for v in s["moe_step_seconds"].values())
    steps_before, before = s["steps"], s["moe_dispatch_seconds"]
    run_all(engine, prompts[:2])
    s = engine.stats()
    assert s["moe_dispatch_seconds"] > before
    assert s["moe_dispatch_seconds"] - before <= 2 * (s["steps"] - steps_before) * max(s["moe_step_seconds"].values()) + 1e-9
    assert s["inter_rank_bytes"] == 0


def test_preempted_and_recomputed_requests_are_token_identical(model, engine):
    """16 requests admitted together outgrow the arena while decoding: the newest are preempted,
    recomputed later (prompt + tokens so far), and still produce exactly the greedy continuation.
    Then the same requests with the admission look-ahead (SGLang's new-token ratio, the default; an
    engine sharing the module engine's programs): admissions wait for room to grow, fewer preemptions
    (one retraction raises the ratio back), the same tokens."""
    rng = np.random.default_rng(21)
    prompts = rng.integers(0, 256, (16, 100)).astype(np.int32)
    sp = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    before = engine.stats()["preemptions"]
    outs = run_all(engine, prompts.tolist(), sp)
    greedy = engine.stats()["preemptions"] - before
    assert greedy > 0
    ref = model_greedy(model, prompts, 60)
    assert [o.token_ids for o in outs] == ref
    s = engine.stats()
    assert s["arena_free_units"] == s["arena_baseline_free_units"]

    ahead = make_engine(model, units=450 if model.cfg.num_mla_layers > 1 else 250)
    assert ahead.stats()["new_token_ratio"] == pytest.approx(0.7)
    assert [o.token_ids for o in run_all(ahead, prompts.tolist(), sp)] == ref
    s = ahead.stats()
    assert s["preemptions"] < greedy and s["preemptions"] == s["retractions"], (s["preemptions"], greedy)
    assert s["compiles_after_warmup"] == 0 and s["arena_free_units"] == s["arena_baseline_free_units"]


def test_a_decode_finding_no_room_at_allocation_is_a_retraction(model, engine, prompts, monkeypatch):
    """The plan's estimate of what a preemption frees counts units forked beams share (freed only with the last of
    them), so a decode can find no room when its pages are allocated: it is preempted there, and that preemption
    was neither counted in `retractions` nor raised the admission look-ahead as the scheduler's do."""
    import sys

    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, schedule_conservativeness=1.0))
    monkeypatch.setattr(engine, "new_token_ratio", 0.1)
    can_fit, tripped = engine.allocator.can_fit, []

    def no_room_once(units, slots):  # the first growth of a running request this step finds no room
        if not tripped and slots == 0 and units > 0 and sys._getframe(1).f_code.co_name == "_allocate":
            tripped.append(units)
            return False
        return can_fit(units, slots)

    sp = dataclasses.replace(GREEDY, max_tokens=40)  # (its decodes take new pages)
    want = run_all(engine, prompts[2:3], sp)[0].token_ids
    monkeypatch.setattr(engine.allocator, "can_fit", no_room_once)
    before = dict(engine.counters)
    assert run_all(engine, prompts[2:3], sp)[0].token_ids == want and tripped
    assert engine.counters["preemptions"] - before["preemptions"] == 1
    assert engine.counters["retractions"] - before["retractions"] == 1
    assert engine.new_token_ratio > 0.6  # back at its initial 0.7, decaying since


def test_higher_priority_request_preempts_and_everyone_stays_exact(model, engine):
    """With the arena full of low-priority requests, a later high-priority one preempts some of them,
    starts at once and finishes before the low-priority requests that were waiting; every output is still
    exactly the greedy continuation. (Model-independent host logic: run on tiny-k3 only.)"""
    if model.cfg.num_mla_layers < 2:
        pytest.skip("priority scheduling is host logic; tiny-k3 covers it")
    rng = np.random.default_rng(5)
    from serve.scheduler import units_for

    per = engine.layout.slot_units + units_for(150, engine.sched_cfg)  # held once a prompt is in
    n = engine.allocator.baseline_free_units // per + 4  # more than fit: some wait
    prompts = rng.integers(0, 256, (n + 1, 150)).astype(np.int32)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    before = engine.stats()["preemptions"]
    low = [engine.add_request(p, params, priority=5) for p in prompts[:n].tolist()]
    slot = lambda r: engine.seqs[f"{r}#0"].slot if f"{r}#0" in engine.seqs else None
    done, order = {}, []

    def step():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
                order.append(out.request_id)
    for _ in range(3 * n):  # the arena fills: some low-priority requests decode, the rest wait
        step()
        if engine.allocator.free_units < per and any(slot(r) is None for r in low if r not in done):
            break
    waiting = [r for r in low if slot(r) is None and r not in done]
    assert waiting and any(slot(r) is not None for r in low)
    urgent = engine.add_request(prompts[n].tolist(), params, priority=-1)
    step()
    assert slot(urgent) is not None and engine.stats()["preemptions"] > before  # admitted at once
    while engine.has_unfinished():
        step()
    assert order.index(urgent) < min(order.index(r) for r in waiting)
    ref = model_greedy(model, prompts, 16)
    assert [done[r].token_ids for r in low + [urgent]] == ref
    s = engine.stats()
    assert s["arena_free_units"] == s["arena_baseline_free_units"]
    with pytest.raises(RequestError, match="priority"):
        engine.add_request([1, 2], params, priority=1 << 40)
    rid = engine.add_request([1, 2], params, priority=np.array([3, -2])[1])  # a NumPy integer is an integer
    assert type(engine.seqs[f"{rid}#0"].priority) is int and engine.seqs[f"{rid}#0"].priority == -2
    assert engine.abort(rid)
    engine.step()


def test_requests_aborted_while_others_wait_ahead_of_them_are_freed(model, engine):
    """The engine's queue of waiting sequences (`Engine._queue`, in priority order) dropped an aborted request's
    entry only when a step's walk of its head met it: behind a steady stream of higher-priority requests, never, so
    every abort of a starved request (a client's timeout, a retry) kept its sequence (prompt, grammar, embeddings)
    alive. (Host bookkeeping: no step runs.)"""
    import gc
    import weakref

    params = SamplingParams(temperature=0.0, max_tokens=2)
    ahead = [engine.add_request([1, 2, 3], params) for _ in range(8)]
    gone = [engine.add_request([5] * 40, params, priority=1) for _ in range(20)]
    refs = [weakref.ref(engine.requests[r].seqs[0]) for r in gone]
    for r in gone:
        engine.abort(r)
    engine._reap()
    gc.collect()
    assert engine._waiting(2) and len(engine._queue) == len(ahead)
    assert all(r() is None for r in refs)
    for r in ahead:
        engine.abort(r)
    engine._reap()
    assert not engine._queue and not engine.seqs


def test_fcfs_scheduling_policy_refuses_priorities(model, engine, monkeypatch):
    """vLLM's scheduling_policy: "fcfs" schedules by arrival alone and refuses a request with a nonzero priority
    naming `priority` (as vLLM does: the priority would otherwise be silently ignored), taking no memory; priority 0
    is served. The default ("priority") honours priorities (the test above)."""
    if model.cfg.num_mla_layers < 2:
        pytest.skip("request validation is host logic; tiny-k3 covers it")
    assert engine.config.scheduling_policy == "priority"
    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, scheduling_policy="fcfs"))
    free = engine.allocator.free_units
    with pytest.raises(RequestError, match="priority: got -1.*fcfs"):
        engine.add_request([1, 2, 3], GREEDY, priority=-1)
    assert engine.allocator.free_units == free and not engine.has_unfinished()
    out = run_all(engine, [[1, 2, 3]], dataclasses.replace(GREEDY, max_tokens=2))[0]
    assert len(out.outputs[0].token_ids) == 2


def test_accelerator_decode_forms_are_token_identical(model, engine, other_forms, prompts, alone):
    """The accelerator's decode forms (KDA: the batched op on gathered states; MLA: the token's latent
    stored in its page and the paged MLA kernel run over the arena through the page tables) give the
    CPU defaults' greedy tokens (per-row in-place state update; attention over gathered pages) for a
    mixed batch, here with 16-token prefill chunks (the defaults': 64; `other_forms`). As on a GPU, whose
    paged kernel works in proportion to each row's length, one-token decodes compile only at the widest
    context bucket (a short context runs with a wider page table) while prefill chunks compile at each;
    no compile after warm-up, and these forms' step programs never copy the arena either."""
    import serve.engine

    assert not serve.engine.decode_work_follows_length()  # CPU: the reference gathers every table entry
    eng = other_forms
    assert engine.kda_in_place and not eng.kda_in_place
    assert eng.mla_paged and not engine.mla_paged
    assert eng.decode_context_buckets == (32,) and engine.decode_context_buckets == engine.context_buckets
    assert sorted(eng.bucket_shapes()) == [(1, 1, 32), (4, 1, 32), (4, 16, 16), (4, 16, 32)]
    outs = run_all(eng, prompts[20:32])
    assert [o.token_ids for o in outs] == alone[20:32]
    assert eng.stats()["compiles_after_warmup"] == 0
    if model.cfg.family == "kimi_k3":  # the arena's reads and writes are the same code for both models
        _assert_step_never_copies_the_arena(eng, [(1, 1, 32), (4, 1, 32)])


def test_step_form_options_are_checked(model):
    with pytest.raises(ValueError, match="kda_decode"):
        make_engine(model, warmup=False, kda_decode="fast")
    with pytest.raises(ValueError, match="mla_decode"):
        make_engine(model, warmup=False, mla_decode="flash")
    with pytest.raises(ValueError, match="expert_weights"):
        make_engine(model, warmup=False, expert_weights="fp8")
    with pytest.raises(ValueError, match="dense_weights"):
        make_engine(model, warmup=False, dense_weights="column_major")
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="compile_threads"):
            make_engine(model, warmup=False, compile_threads=bad)
    for bad in (-64, 96, 64, 1024, 2.5, True):  # not a multiple of 64, one chunk, over the token budget, not an int
        with pytest.raises(ValueError, match="long_prefill_chunk"):
            make_engine(model, warmup=False, long_prefill_chunk=bad)
    with pytest.raises(ValueError, match="long_prefill_chunk=4 equals the verify rows"):
        make_engine(model, warmup=False, chunk=2, long_prefill_chunk=4,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="decode_context_parallel_size"):
            make_engine(model, warmup=False, decode_context_parallel_size=bad)
    with pytest.raises(ValueError, match="enable_eplb balances routed experts split over a mesh axis"):
        make_engine(model, warmup=False, enable_eplb=True)
    with pytest.raises(ValueError, match="enable_eplb: sharding='ep' does not split the 8 routed experts"):
        make_engine(model, warmup=False, enable_eplb=True, sharding="ep")  # one device
    for key in ("eplb_window_size", "eplb_step_interval"):
        with pytest.raises(ValueError, match=key):
            make_engine(model, warmup=False, **{key: 0})
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match="eplb_num_redundant_experts"):
            make_engine(model, warmup=False, eplb_num_redundant_experts=bad)
    with pytest.raises(ValueError, match="eplb_num_redundant_experts=4: redundant experts are placed by expert-parallel"):
        make_engine(model, warmup=False, sharding="ep", eplb_num_redundant_experts=4)
    with pytest.raises(ValueError, match="enable_eplb: sharding='ep' does not split the 8 routed experts"):
        make_engine(model, warmup=False, enable_eplb=True, sharding="ep", eplb_num_redundant_experts=4)
    with pytest.raises(ValueError, match="decode_context_parallel_size=2 splits the MLA pages over a mesh axis"):
        make_engine(model, warmup=False, decode_context_parallel_size=2)
    with pytest.raises(ValueError, match="decode_context_parallel_size=2: the MLA pages are split over the ranks "
                                         "that split the KDA heads, 1 under sharding='single'"):
        make_engine(model, warmup=False, decode_context_parallel_size=2, sharding="single")


@pytest.fixture(scope="module")
def other_forms(model):
    """An engine unlike `engine` in five ways at once (CI time: one engine, five properties): the accelerator's
    decode forms (the batched KDA op on gathered states, paged MLA; they change the decode programs only, the
    prefill programs run the same code either way), the weights as the checkpoint ships them, 16-token prefill
    chunks (`engine`'s: 64), and the prefill-first schedule. Built as on a GPU, whose paged kernel works in
    proportion to each row's length (`decode_work_follows_length`, read when the engine picks its decode
    programs' widths). (CI time, too: decode programs of 1 and 4 rows, no 32-row one: 4 requests at once.)"""
    import serve.engine

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(serve.engine, "decode_work_follows_length", lambda: True)
        return make_engine(model, chunk=16, units=4000, kda_decode="gathered", mla_decode="paged",
                           expert_weights="packed", dense_weights="out_in", prefill_first=True,
                           decode_buckets=(1, 4), context_buckets=(16, 32))


def test_checkpoint_form_weights_are_token_identical(model, engine, other_forms, prompts, alone):
    """On CPU the engine expands MXFP4 experts once at start-up (`expert_weights="auto"`) and holds
    dense weights transposed (`dense_weights="auto"`); the weights as the checkpoint ships them
    (experts packed and dequantised inside every step, projections [out, in]) give the same greedy
    tokens, here with 16-token prefill chunks (and the accelerator's decode forms: `other_forms`)."""
    eng = other_forms
    assert eng.stats()["expert_format"] == model.cfg.expert_format
    assert engine.stats()["expert_format"] == "dense"
    assert (eng.stats()["dense_weight_layout"], engine.stats()["dense_weight_layout"]) == ("out_in", "in_out")
    outs = run_all(eng, prompts[:12])
    assert [o.token_ids for o in outs] == alone[:12]


def test_prefill_first_is_token_identical_and_never_mixes(model, other_forms, prompts, alone):
    """`prefill_first`: no step both prefills and decodes; the greedy tokens are those of the default
    (decode-first) schedule, with no compile after warm-up."""
    with pytest.raises(ValueError, match="prefill_first"):
        make_engine(model, warmup=False, prefill_first="yes")
    eng = other_forms
    outs = run_all(eng, prompts[12:24])
    assert [o.token_ids for o in outs] == alone[12:24]
    c = eng.counters
    assert c["decode_steps"] + c["prefill_steps"] == c["steps"] and c["decode_steps"] > 0
    st_ = eng.stats()
    assert st_["compiles_after_warmup"] == 0 and st_["arena_free_units"] == st_["arena_baseline_free_units"]


def _assert_step_never_copies_the_arena(eng, shapes):
    """The compiled step never copies the arena (it is donated, every read of it precedes the writes
    that replace it, and it is written by scatters or in-place slice updates): one copy would cost a
    pass over the whole cache every step. Checked in the optimised HLO of `eng`'s warmed programs (the
    shared compilation cache hands them back: no compile). Three ways this failed before: a 1-row read
    compiles to a dynamic slice that XLA may fuse into later readers; an in-place state update whose
    output was computed from the state *after* the update made XLA re-read the old state late; and with
    paged MLA decode (which writes the arena mid-model) KDA states read up front and written at the end
    of the step (the batched path now reads and writes each layer when it runs)."""
    lay = eng.layout
    arena_shape = f"f32[{lay.num_units},{lay.unit_elems}]"
    for rows, t, pages in shapes:
        batch = eng._pad_batch(rows, t, pages, [])
        hlo = eng.lower_step(batch).compile().as_text()
        made = [line.split(" = ", 1)[1] for line in hlo.splitlines() if " = " in line]
        copies = [m for m in made if m.startswith(arena_shape) and
                  (" copy(" in m[:80] or m.split("(")[0].endswith("copy"))]
        assert not copies, (rows, t, pages, copies[:2])
        assert sum(m.startswith(arena_shape) for m in made) >= 2  # the arena is in this HLO at all


def test_step_updates_the_arena_in_place(model, engine):
    """The CPU's decode forms (per-row in-place KDA update, MLA over gathered pages): 1-row and 4-row
    decodes, a 4-row prefill chunk and the one-row long prefill (the accelerator's forms: in
    `test_accelerator_decode_forms_are_token_identical`)."""
    if model.cfg.family != "kimi_k3":
        pytest.skip("the arena's reads and writes are the same code for both models; checked on tiny-k3")
    assert engine.sched_cfg.long_prefill_chunk == 256
    _assert_step_never_copies_the_arena(engine, [(1, 1, 32), (4, 1, 32), (4, 64, 32), (1, 256, 32)])


def test_state_bound_and_kv_bound_workloads_fill_the_arena(engine):
    """Same engine, no recompiles: many short requests (slot-bound), then a few long ones (page-bound)."""
    lay = engine.layout
    cap = engine.allocator.baseline_free_units
    rng = np.random.default_rng(9)
    short = [rng.integers(0, 256, 8).tolist() for _ in range(32)]
    engine.allocator.reset_peak()
    run_all(engine, short, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    state_peak = engine.allocator.peak_used_units
    # long requests: prompt + output spanning many pages
    per_req = lay.slot_units + engine.sched_cfg.num_mla_layers * (496 // 16)
    n_long = cap // per_req
    long = [rng.integers(0, 256, 480).tolist() for _ in range(n_long)]
    engine.allocator.reset_peak()
    run_all(engine, long, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    kv_peak = engine.allocator.peak_used_units
    print(f"capacity {cap} units; state-bound peak {state_peak}, kv-bound peak {kv_peak}")
    assert state_peak >= 0.9 * cap
    assert kv_peak >= 0.9 * cap
    assert engine.stats()["compiles_after_warmup"] == 0


def test_mixed_workload_no_compiles(engine):
    rng = np.random.default_rng(11)
    for i in range(200):
        n = int(rng.integers(1, 300))
        engine.add_request(rng.integers(0, 256, n).tolist(),
                           SamplingParams(temperature=float(rng.choice([0.0, 0.8])), top_p=0.9, seed=i,
                                          max_tokens=int(rng.integers(1, 6))))
    while engine.has_unfinished():
        engine.step()
    s = engine.stats()
    assert s["compiles_after_warmup"] == 0
    # step and MoE-timing programs, compiled in 2 threads before their first run
    assert s["programs_compiled_ahead"] == len(engine.bucket_shapes()) + len(engine.moe_step_seconds) > 0
    assert s["arena_free_units"] == s["arena_baseline_free_units"]


def test_seeded_sampling_is_reproducible(engine, prompts):
    sp = SamplingParams(temperature=1.0, top_k=50, seed=123, max_tokens=8, ignore_eos=True)
    a = run_all(engine, [prompts[0]], sp)[0].token_ids
    b = run_all(engine, [prompts[0]] + prompts[1:6], sp)[0].token_ids
    assert a == b


def test_request_metrics_time_every_stage(engine, prompts):
    """RequestOutput.metrics (vLLM's RequestMetrics): arrival <= first scheduled <= first token <= last token <=
    finished, for one sample and for n > 1 (the request's first and last tokens over its samples)."""
    params = [GREEDY, SamplingParams(temperature=1.0, n=2, max_tokens=5, ignore_eos=True, seed=1)]
    for out in run_all(engine, prompts[:2], params[0]) + [run_all(engine, prompts[2:3], params[1])[0]]:
        m = out.metrics
        assert (m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
                <= m.finished_time), m
        assert m.queue_time <= m.ttft <= m.e2e
    # vLLM's arrival_time is a wall-clock time.time(): a request that arrived 5 s ago has waited that long
    import time

    rid = engine.add_request(prompts[0], GREEDY, arrival_time=time.time() - 5.0)
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished and o.request_id == rid]
    out = done[0]
    assert 5.0 <= out.metrics.queue_time <= out.metrics.ttft < 60


def test_logprobs_are_returned(engine, prompts):
    out = run_all(engine, [prompts[1]], SamplingParams(temperature=0.0, max_tokens=3, logprobs=3, ignore_eos=True))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 3 and all(len(pos.top) == 3 for pos in lps)
    for pos, tok in zip(lps, out.token_ids):
        chosen, top = pos[tok], pos.top  # vLLM's: token id -> Logprob, the sampled token first
        assert list(pos) == [t.token_id for t in top]  # (greedy: it is the top-1, once)
        assert chosen.token_id == tok and top[0].token_id == tok  # greedy picks the top-1
        assert chosen.logprob <= 0


@pytest.mark.parametrize("prompt,params,match", [
    ([1] * 600, GREEDY, "context window of 512"),
    ([1] * 512, SamplingParams(max_tokens=None), "no room for a completion"),  # None: what the window leaves
    ([1] * 600, SamplingParams(max_tokens=None), "600 prompt tokens exceed the context window"),
    ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
    ([1, 2], SamplingParams(temperature=-1), "temperature"),
    ([1, 2], SamplingParams(top_p=0), "top_p"),
    ([], GREEDY, "empty prompt"),
    ([10 ** 6], GREEDY, "outside"),
    ({"prompt_token_ids": [1, 2], "multi_modal_data": {}}, GREEDY, "prompt dict"),
    ({"prompt_token_ids": "hi"}, GREEDY, "prompt_token_ids: expected a list of token ids, got str"),  # not text
    ({"prompt": [1, 2]}, GREEDY, "prompt: expected a string, got list"),  # not token ids
    ([1.5, 2], GREEDY, "token ids must be integers"),  # not truncated to 1
    (["a", 2], GREEDY, "token ids must be integers"),
    ([[1, 2]], GREEDY, "token ids must be integers"),
    ([1, 2], SamplingParams(allowed_token_ids=5), "allowed_token_ids"),
    ([1, 2], SamplingParams(stop=5), "stop"),
    ([1, 2], SamplingParams(stop_token_ids=5), "stop_token_ids"),
    ([1, 2], {"max_tokens": 5}, "sampling_params: expected serve.types.SamplingParams .* got builtins.dict"),
])
def test_bad_requests_rejected_before_taking_memory(engine, prompt, params, match):
    free = engine.allocator.free_units
    with pytest.raises(RequestError, match=match):
        engine.add_request(prompt, params)
    assert engine.allocator.free_units == free and not engine.has_unfinished()


def test_generation_ends_at_the_context_window(engine):
    """vLLM's engine (offline `LLM.generate`, `Engine.add_request`): max_tokens past the window is no error, the
    completion ends ("length") where the window does; only the HTTP server refuses it (OpenAI's 400)."""
    free = engine.allocator.free_units
    out = run_all(engine, [[3] * 505], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 512 - 505 and out.outputs[0].finish_reason == "length"
    with pytest.raises(RequestError, match="prompt: 513 prompt tokens exceed the context window of 512 tokens"):
        engine.add_request([3] * 513, SamplingParams(max_tokens=1))
    assert engine.allocator.free_units == free and not engine.has_unfinished()


def test_prompt_text_of_a_special_token_is_that_token(engine):
    """A prompt string is the caller's whole input (often a chat it rendered itself): the text of a special token
    is that token, as the Kimi tokenizers encode it (and vLLM with them)."""
    out = run_all(engine, ["<|im_user|>hi"], SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert out.prompt_token_ids == [engine.tokenizer.encode("<|im_user|>", allow_special=True)[0], 104, 105]


def test_arena_that_cannot_hold_one_max_model_len_request_is_refused_at_start(model):
    """vLLM's start-up check: an arena too small for one request of max_model_len tokens is a configuration error
    naming max_model_len and the longest request it holds (every long prompt would otherwise be refused later)."""
    with pytest.raises(ValueError, match=r"max_model_len=512: .* the longest request it holds is \d+ tokens"):
        make_engine(model, units=30, warmup=False)
    # under the smallest arena at all: named too (it was "cache budget 7680 B holds 3 units ...")
    with pytest.raises(ValueError, match=r"cache_bytes=7680: .* at least \d+ \(\d+ bytes\) are needed"):
        make_engine(model, units=3, warmup=False)


def test_an_arena_that_runs_fewer_than_max_num_seqs_requests_is_said_at_start(model, caplog):
    """vLLM refuses to start when its Mamba state pool holds fewer than max_num_seqs sequences; here slots and pages
    share the arena, so the engine starts, saying how many requests it can run at once (it said nothing: a
    max_num_seqs=32 engine silently ran one request at a time)."""
    with caplog.at_level("WARNING", logger="serve.engine"):
        small = make_engine(model, units=30, warmup=False, max_model_len=16)
    most = small.layout.sequences_at(1)
    assert most < 32
    assert re.search(f"max_num_seqs=32: the arena of cache_bytes={30 * 2560} holds at most {most} request.* lower "
                     f"max_num_seqs", caplog.text)
    caplog.clear()
    with caplog.at_level("WARNING", logger="serve.engine"):
        make_engine(model, units=30, warmup=False, max_model_len=16, max_num_seqs=most, decode_buckets=(most,))
    assert "max_num_seqs" not in caplog.text


def test_num_gpu_blocks_override_sets_the_arena_and_the_start_up_line_counts_concurrency(model, caplog):
    """vLLM's num_gpu_blocks_override (it was refused): the arena has that many units, whatever cache_bytes or
    gpu_memory_utilization would give (the fraction is ignored, said at start-up; on CPU it would be an error),
    and cache_config_info reports it as num_gpu_blocks. The start-up summary gives vLLM's "maximum concurrency":
    free units over one max_model_len request's (a slot and the pages of its positions but the last), exactly 1.0
    for the smallest arena the start-up check accepts."""
    from serve.memory import max_concurrency

    probe = make_engine(model, units=30, warmup=False, max_model_len=16)
    lay = probe.layout
    one = lay.slot_units + lay.pages_for(63)  # a 64-token request
    smallest = 1 + lay.slot_units + one  # the scratch page and slot, and one request
    with caplog.at_level("WARNING", logger="serve.engine"):
        eng = make_engine(model, warmup=False, max_model_len=64, context_buckets=None, max_num_seqs=4,
                          decode_buckets=(4,), num_gpu_blocks_override=smallest, gpu_memory_utilization=0.9)
    assert eng.layout.num_units == eng.cache_config()["num_gpu_blocks"] == smallest
    assert eng.memory_plan is None and eng.cache_config()["gpu_memory_utilization"] is None
    assert "gpu_memory_utilization=0.9: ignored, num_gpu_blocks_override" in caplog.text
    assert max_concurrency(eng.layout, 64) == 1.0
    assert eng.arena_summary().endswith("maximum concurrency for 64 tokens per request: 1.00x")
    assert f"num_gpu_blocks_override={smallest}" in eng.arena_summary()
    with pytest.raises(ValueError, match=f"max_model_len=64: .* the arena of num_gpu_blocks_override={smallest - 1}"):
        make_engine(model, warmup=False, max_model_len=64, context_buckets=None, num_gpu_blocks_override=smallest - 1)
    big = make_engine(model, warmup=False, max_model_len=64, context_buckets=None, num_gpu_blocks_override=10 * smallest)
    assert max_concurrency(big.layout, 64) == (10 * smallest - 1 - lay.slot_units) / one
    auto = make_engine(model, warmup=False, max_model_len="auto", context_buckets=None, num_gpu_blocks_override=smallest,
                       gpu_memory_utilization=0.9)  # (its arena's size is known: "auto" holds)
    assert auto.config.max_model_len >= 64
    with pytest.raises(ValueError, match="num_gpu_blocks_override=0: expected"):
        EngineConfig(num_gpu_blocks_override=0).validate()


def test_max_model_len_auto_and_the_models_position_limit(model, monkeypatch):
    """vLLM's `max_model_len="auto"` (or -1): the longest request the arena holds, at most the model's
    max_position_embeddings; an explicit value past max_position_embeddings is refused unless allowed."""
    small = make_engine(model, units=30, warmup=False, max_model_len="auto", context_buckets=None)
    longest = small.config.max_model_len
    assert small.context_buckets[-1] * 16 >= longest  # buckets follow the resolved length
    make_engine(model, units=30, warmup=False, max_model_len=longest, context_buckets=None)  # it holds that much
    with pytest.raises(ValueError, match=f"longest request it holds is {longest} tokens"):
        make_engine(model, units=30, warmup=False, max_model_len=longest + 16, context_buckets=None)
    big = make_engine(model, units=4000, warmup=False, max_model_len=-1, context_buckets=None)
    assert big.config.max_model_len == model.cfg.max_position_embeddings == 4096
    with pytest.raises(RequestError, match="context window of 4096"):
        big.add_request([1] * 4097, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="max_model_len=8192 exceeds the model's max_position_embeddings"):
        make_engine(model, units=4000, warmup=False, max_model_len=8192, context_buckets=None)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert make_engine(model, units=4000, warmup=False, max_model_len=4200, context_buckets=None).config.max_model_len == 4200
    with pytest.raises(ValueError, match="max_model_len='auto'.*gpu_memory_utilization"):
        EngineConfig(max_model_len="auto", gpu_memory_utilization=0.9).validate()
    with pytest.raises(ValueError, match="max_model_len='big': expected an integer >= 2"):
        EngineConfig(max_model_len="big").validate()


@pytest.mark.parametrize("key,bad", [
    ("max_num_seqs", 0), ("max_num_seqs", None), ("page_size", 1.5), ("page_size", "16"), ("prefill_chunk", None),
    ("max_prefill_seqs", None), ("max_prefill_seqs", 1.5), ("max_num_batched_tokens", "512"), ("cache_bytes", 1.5),
    ("cache_bytes", 0), ("checkpoint_interval", None), ("decode_checkpoint_interval", "x"), ("prefix_hash_unit", "x"),
    ("prefix_hash_unit", 0), ("seed", 1.5), ("seed", -1), ("host_cache_bytes", True),
    ("decode_buckets", (0,)), ("decode_buckets", (-1, 4)), ("decode_buckets", 4), ("decode_buckets", ()),
    ("decode_buckets", (1, 64)), ("prefill_buckets", (0,)), ("prefill_buckets", "1"), ("context_buckets", 8),
    ("context_buckets", (2.5,)), ("scan_layers", "false"), ("enable_prefix_caching", None), ("async_scheduling", []),
    ("enable_return_hidden_states", {}), ("measure_moe_time", 1), ("enable_deterministic_inference", "yes"),
    ("generation_config", 1.5), ("generation_config", 10 ** 30), ("generation_config", 0), ("generation_config", "/nowhere"),
    ("lora_target_modules", 5), ("logits_processors", 5), ("scheduling_policy", "sjf")])
def test_sizes_buckets_and_switches_are_checked_naming_the_option(key, bad):
    """Each was a TypeError / OverflowError at construction, or was accepted: max_num_seqs=0 or a 0-row decode or
    prefill bucket left every request waiting forever, decode buckets past max_num_seqs ran more requests at once
    than it allows, generation_config=0 read stdin's file descriptor as a directory, scan_layers="false" scanned."""
    with pytest.raises(ValueError, match=key):
        EngineConfig(**{key: bad}).validate()


def test_prefill_buckets_past_max_prefill_seqs_are_refused_naming_both():
    """As decode buckets past max_num_seqs are: prefill_buckets=(4,) with max_prefill_seqs=2 prefilled 4 prompts a
    step, silently (the scheduler takes the largest prefill bucket for its limit)."""
    with pytest.raises(ValueError, match=r"prefill_buckets=\(4,\).*max_prefill_seqs=2"):
        EngineConfig(max_prefill_seqs=2, prefill_buckets=(4,)).validate()
    EngineConfig(max_prefill_seqs=4, prefill_buckets=(1, 4)).validate()


def test_max_model_len_takes_a_numpy_integer_as_the_other_sizes():
    """A NumPy integer (what arithmetic on NumPy lengths gives) was refused as "expected an integer" since 'auto'
    came in, while max_num_seqs / page_size of the same kind are taken; it is held as a Python int (JSON-safe)."""
    cfg = EngineConfig(max_model_len=np.int64(512))
    cfg.validate()
    assert cfg.max_model_len == 512 and type(cfg.max_model_len) is int
    assert EngineConfig(max_model_len=np.int32(-1)).max_model_len == "auto"


def test_long_max_model_len_switch_is_read_as_vllm_reads_it(monkeypatch):
    """VLLM_ALLOW_LONG_MAX_MODEL_LEN is on for '1' / 'true' in any case, around spaces too (vLLM's envs.py)."""
    from types import SimpleNamespace

    fake = SimpleNamespace(cfg=SimpleNamespace(max_position_embeddings=4096))
    long = EngineConfig(max_model_len=8192)
    for value in ("TRUE", " 1 ", "True\n"):
        monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", value)
        assert Engine._resolve_max_model_len(fake, long).max_model_len == 8192
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0")
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        Engine._resolve_max_model_len(fake, long)


def test_valid_sizes_and_buckets_still_construct():
    EngineConfig(seed=None, generation_config=None, decode_buckets=[1, 4], prefill_buckets=(4, 1),
                 max_num_seqs=np.int64(4), page_size=np.int32(16), context_buckets=(64,)).validate()
    EngineConfig(gpu_memory_utilization=0.5, cache_bytes=None).validate()  # the budget comes from the fraction
    EngineConfig(cache_bytes=None).validate()  # the default budget (EngineConfig.arena_bytes)


def test_request_that_just_fits_is_accepted_and_runs(model):
    """The cache never holds the last token's position (it is sampled, not fed back), and a request's n samples are
    scheduled apart: a request whose prompt + max_tokens - 1 tokens fill the arena exactly, and one whose samples
    fit one at a time, run to the end (they were refused as never fitting). The scheduler's and allocator's
    accounting, the same for both models: run on tiny-k3 (several MLA layers; CI time: its arena's step programs
    compile for this test alone)."""
    if model.cfg.num_mla_layers < 2:
        pytest.skip("the arena's accounting is host logic; tiny-k3 covers it")
    from serve.scheduler import units_for

    probe = make_engine(model, units=30, warmup=False, max_model_len=16)
    lay, lm = probe.layout, probe.sched_cfg.num_mla_layers
    units = 1 + 2 * lay.slot_units + 2 * lm  # one slot + 2 pages per MLA layer beside the scratch page and slot
    eng = make_engine(model, warmup=False, cache_bytes=units * lay.unit_bytes, max_model_len=33, decode_buckets=(2,), prefill_buckets=(1,),
                      context_buckets=(4,), max_num_seqs=2, max_prefill_seqs=1, max_num_batched_tokens=64,
                      max_logprobs=4)
    k = 2  # pages per MLA layer: 16 * k positions
    assert eng.allocator.baseline_free_units == lay.slot_units + units_for(16 * k, eng.sched_cfg)
    with pytest.raises(RequestError, match="never fit"):  # a beam search's beams must fit together
        eng.add_request([1] * 10, BeamSearchParams(beam_width=2, max_tokens=16 * k - 9))
    with pytest.raises(ValueError, match="longest request it holds is 33 tokens"):  # 16 * k positions + the last
        make_engine(model, warmup=False, cache_bytes=units * lay.unit_bytes, max_model_len=16 * k + 2,
                    decode_buckets=(1,), prefill_buckets=(1,), context_buckets=(4,), max_num_seqs=1,
                    max_prefill_seqs=1, max_num_batched_tokens=64)
    exact = eng.add_request([1] * 10, SamplingParams(temperature=0.0, max_tokens=16 * k - 9, ignore_eos=True))
    twice = eng.add_request([2] * 10, SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=16 * k - 9,
                                                     ignore_eos=True))
    done = {}
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert [len(o.token_ids) for o in done[exact].outputs + done[twice].outputs] == [16 * k - 9] * 3
    assert {o.finish_reason for o in done[exact].outputs + done[twice].outputs} == {"length"}
    assert eng.allocator.free_units == eng.allocator.baseline_free_units


class _FailingStep:
    """Stands in for an engine's compiled step: the first prefill call made in the same engine step as a
    decode call (so the failure comes after part of the step ran) raises, or call number `at` does;
    `consume` deletes the arena first, as a call that fails after taking its donated buffers does."""

    def __init__(self, engine, at: int | None, consume: bool, real=None, exc=RuntimeError):
        self.engine, self.real, self.at, self.consume, self.exc = engine, real or engine._step, at, consume, exc
        self._cache_size = self.real._cache_size
        self.calls, self.decoded_in, self.failed = 0, None, False

    def __call__(self, leaves, arena, token_pages, tables, batch):
        self.calls += 1
        step = self.engine.counters["steps"]
        prefill = batch.tokens.shape[1] > 1
        if not self.failed and (self.calls == self.at or (self.at is None and prefill and self.decoded_in == step)):
            self.failed = True
            if self.consume:
                arena.delete()
            raise self.exc("injected device failure")
        if not prefill:
            self.decoded_in = step
        return self.real(leaves, arena, token_pages, tables, batch)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "abort", "step", "fail"]), st.integers(1, 150),
                              st.integers(1, 6)), min_size=3, max_size=25))
def test_arena_returns_to_baseline_after_any_arrival_and_abort_order(engine, ops):
    """Any order of arrivals, aborts, steps and failed steps (`fail`: the b-th next compiled call raises,
    consuming the cache when a is odd) ends with the arena at its baseline."""
    from serve.engine import StepFailed

    ids, real = [], engine._step
    try:
        for op, a, b in ops:
            if op == "add":
                ids.append(engine.add_request([a % 256] * a, SamplingParams(temperature=0.0, max_tokens=b)))
            elif op == "abort" and ids:
                engine.abort(ids[a % len(ids)])
            elif op == "fail":
                engine._step = _FailingStep(engine, at=b, consume=a % 2 == 1, real=real)
            else:
                for _ in range(b):
                    try:
                        engine.step()
                    except StepFailed:
                        pass
    finally:
        engine._step = real
    while engine.has_unfinished():
        engine.step()
    engine.step()
    s = engine.stats()
    assert s["arena_free_units"] == s["arena_baseline_free_units"]
    assert s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0


async def _collect(stream) -> list:
    return [o async for o in stream]


def test_async_engine_streams_and_aborts(model):
    """Streaming, an early leave (abort) and a rejected request through `AsyncEngine`: host logic, the same
    for both models, run on tiny-k3 (CI time)."""
    if model.cfg.num_mla_layers < 2:
        pytest.skip("AsyncEngine is host logic; tiny-k3 covers it")
    import asyncio

    from serve.async_engine import AsyncEngine

    eng = make_engine(model)  # the module engine's layout: its compiled programs are shared
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = run_all(eng, [[5, 6, 7, 8]], sp)[0].token_ids  # the engine's own tokens (test_alone_* ties them to the model)
    aeng = AsyncEngine(eng)

    async def main():
        chunks = [o async for o in aeng.generate([5, 6, 7, 8], sp, "a")]
        lens = [len(c.token_ids) for c in chunks]  # one output per token unless the reader fell behind (coalesced)
        assert lens == sorted(set(lens)) and lens[-1] == 10 and chunks[-1].finished
        got = 0
        async for _ in aeng.generate([9] * 50, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), "b"):
            got += 1
            if got == 3:
                break  # consumer leaves early: the request is aborted and its memory freed
        seen = []

        async def read_aborted():
            async for o in aeng.generate([9] * 40, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), "d"):
                seen.append(o)
                if len(seen) == 2:
                    aeng.abort("d")  # aborted while the consumer still reads: its stream ends

        await asyncio.wait_for(read_aborted(), 60)
        assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
        assert len(seen[-1].outputs[0].token_ids) >= 2
        with pytest.raises(RequestError, match="max_tokens"):
            async for _ in aeng.generate([1], SamplingParams(max_tokens=0), "c"):
                pass
        # a second stream under a request id in use is refused and leaves the first one running to its end
        first = asyncio.ensure_future(_collect(aeng.generate([9] * 8, SamplingParams(temperature=0.0, max_tokens=60,
                                                                                       ignore_eos=True), "e")))
        while not first.done() and "e" not in eng.requests:
            await asyncio.sleep(0.005)
        with pytest.raises(RequestError, match="already in use"):
            await _collect(aeng.generate([1], sp, "e"))
        outs = await asyncio.wait_for(first, 60)
        assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 60
        for _ in range(100):
            await asyncio.sleep(0.05)
            if not eng.has_unfinished():
                break
        return chunks[-1].token_ids

    try:
        tokens = asyncio.run(main())
    finally:
        aeng.shutdown()
    assert tokens == want
    s = eng.stats()
    assert s["requests_aborted"] == 2 and s["arena_free_units"] == s["arena_baseline_free_units"]


def test_an_abort_hands_out_the_text_held_back_for_a_stop_string(model, engine):
    """An aborted request's last output carries all the text its tokens decode to, the text held back as the
    possible start of a stop string included (vLLM's final abort output, what a partial rollout keeps): it was
    dropped, the text "" beside the tokens."""
    if model.cfg.num_mla_layers < 2:
        pytest.skip("host logic, the same for both models; tiny-k3 covers it")
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    full = run_all(engine, [[5, 6, 7, 8]], sp)[0].text
    rid = engine.add_request([5, 6, 7, 8], dataclasses.replace(sp, stop=[full + "\uffff"]))  # all of it is held
    req = engine.requests[rid]
    while len(req.seqs[0].output_ids) < 3:
        engine.step()
    assert req.seqs[0].checker.text == "" and engine.abort(rid)
    out = engine._output(req).outputs[0]  # (what AsyncEngine streams last)
    engine._reap()
    assert out.finish_reason == "abort" and out.text and out.text == engine.tokenizer.decode(out.token_ids)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("consume", [False, True], ids=["cache-kept", "cache-consumed"])
def test_failed_step_ends_only_its_requests_and_the_rest_stay_exact(model, engine, prompts, alone, consume):
    """A step that raises ends the requests it ran (`StepFailed.request_ids`, memory freed); the other
    requests keep their place and finish with the tokens they get alone -- recomputed from their tokens when
    the failure consumed the donated cache, which the engine replaces by a fresh arena."""
    if model.cfg.num_mla_layers < 2:
        pytest.skip("host logic, the same for both models; tiny-k3 covers it")
    from serve.engine import StepFailed

    before = dict(engine.counters)
    ids = [engine.add_request(p, GREEDY) for p in prompts[:6]]
    real = engine._step
    engine._step = _FailingStep(engine, at=None, consume=consume)
    done, failed, carried = {}, None, []
    try:
        while engine.has_unfinished():
            try:
                outs = engine.step()
            except StepFailed as e:
                assert failed is None and e.request_ids and "injected device failure" in str(e)
                failed, outs = e.request_ids, e.outputs
                carried = [o.request_id for o in outs]
            for o in outs:  # every output, also those a failed step carries, extends what it had alone
                assert o.outputs[0].token_ids == alone[ids.index(o.request_id)][:len(o.outputs[0].token_ids)]
            done.update({o.request_id: o for o in outs if o.finished})
    finally:
        engine._step = real
    assert carried and not set(carried) & set(failed)  # the decode that ran before the failed prefill
    assert failed is not None and set(failed) <= set(ids) and not set(failed) & set(done)
    rest = [i for i, rid in enumerate(ids) if rid not in failed]
    assert rest and all(done[ids[i]].token_ids == alone[i] for i in rest)
    c = engine.counters
    assert c["failed_steps"] - before["failed_steps"] == 1
    assert c["requests_failed"] - before["requests_failed"] == len(failed)
    assert c["cache_resets"] - before["cache_resets"] == int(consume)
    assert (c["preemptions"] > before["preemptions"]) == consume  # lost cache state is recomputed
    engine.step()
    s = engine.stats()
    assert s["arena_free_units"] == s["arena_baseline_free_units"] and not engine.requests


def test_interrupted_step_leaves_the_engine_usable(model, engine, prompts, alone):
    """Ctrl-C (KeyboardInterrupt) while the device call holds the donated cache: the interrupt propagates,
    the step's requests end, the cache is renewed, and the next requests run exactly (a notebook user
    interrupting a long generate can generate again)."""
    if model.cfg.num_mla_layers < 2:
        pytest.skip("host logic, the same for both models; tiny-k3 covers it")
    real = engine._step
    engine._step = _FailingStep(engine, at=2, consume=True, exc=KeyboardInterrupt)
    try:
        engine.add_request(prompts[0], GREEDY)
        with pytest.raises(KeyboardInterrupt):
            while engine.has_unfinished():
                engine.step()
    finally:
        engine._step = real
    assert not engine.has_unfinished() and not engine.arena.is_deleted()
    assert [o.token_ids for o in run_all(engine, prompts[:2])] == alone[:2]
    s = engine.stats()
    assert s["arena_free_units"] == s["arena_baseline_free_units"]


def test_async_engine_survives_a_failed_step(model, engine):
    """Through `AsyncEngine`: the failed step's stream raises, the engine serves the next request."""
    if model.cfg.num_mla_layers < 2:
        pytest.skip("host logic, the same for both models; tiny-k3 covers it")
    import asyncio

    from serve.async_engine import AsyncEngine

    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = run_all(engine, [[5, 6, 7, 8]], sp)[0].token_ids  # the engine's own tokens (test_alone_* ties them to the model)
    real = engine._step
    engine._step = _FailingStep(engine, at=1, consume=True)
    aeng = AsyncEngine(engine)

    async def main():
        with pytest.raises(RuntimeError, match="injected device failure"):
            async for _ in aeng.generate([5, 6, 7, 8], sp, "x"):
                pass
        return [o async for o in aeng.generate([5, 6, 7, 8], sp, "y")][-1]

    try:
        last = asyncio.run(main())
    finally:
        aeng.shutdown()
        engine._step = real
    assert last.finished and last.token_ids == want
    assert aeng.errors == 1 and not engine.requests


def test_async_engine_a_retry_under_the_id_of_a_left_request_gets_its_own_outputs(model, engine):
    """A consumer that leaves (cancelled: a client's time-out) and a retry under the same request id: the retry's
    stream carries its own request's outputs only (it got the first one's abort output, ended at once, and its
    own request ran on unread), and nothing stays mapped once both ended."""
    if model.cfg.num_mla_layers < 2:
        pytest.skip("host logic, the same for both models; tiny-k3 covers it")
    import asyncio
    import time

    from serve.async_engine import AsyncEngine

    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = run_all(engine, [[6] * 30], sp)[0].token_ids
    aeng = AsyncEngine(engine)

    async def main():
        busy = asyncio.ensure_future(aeng.call(lambda e: time.sleep(0.5)))  # what follows queues behind it
        await asyncio.sleep(0.05)
        first = asyncio.ensure_future(_collect(aeng.generate([5] * 30, sp, "retried")))
        await asyncio.sleep(0.05)
        first.cancel()  # its add is still queued: then its abort, then the retry's add
        await asyncio.sleep(0.05)
        outs = await asyncio.wait_for(_collect(aeng.generate([6] * 30, sp, "retried")), 60)
        await busy
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        aeng.shutdown()
    assert all(o.prompt_token_ids == [6] * 30 for o in outs)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length" and outs[-1].token_ids == want
    assert not aeng._owners and not aeng._streams and not engine.requests


def test_async_engine_survives_a_failed_abort(model, engine):
    """An abort that fails in the engine thread (bookkeeping between steps) fails the requests in flight, as a
    step's bookkeeping failure does, and the thread serves on: it used to end, hanging every stream."""
    if model.cfg.num_mla_layers < 2:
        pytest.skip("host logic, the same for both models; tiny-k3 covers it")
    import asyncio

    from serve.async_engine import AsyncEngine

    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    real = engine.abort
    calls = []

    def failing_abort(rid):
        calls.append(rid)
        if len(calls) == 1:
            raise RuntimeError("injected abort failure")
        return real(rid)

    engine.abort = failing_abort
    aeng = AsyncEngine(engine)

    async def main():
        stream = aeng.generate([5, 6, 7, 8], sp, "x")
        await stream.__anext__()
        aeng.abort("x")
        with pytest.raises(RuntimeError, match="injected abort failure"):
            async for _ in stream:
                pass
        short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        return [o async for o in aeng.generate([5, 6, 7, 8], short, "y")][-1]

    try:
        last = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        aeng.shutdown()
        engine.abort = real
    assert last.finished and len(last.token_ids) == 3 and aeng.errors == 1 and not engine.requests
    s = engine.stats()
    assert s["arena_free_units"] == s["arena_baseline_free_units"]


def test_async_engine_shutdown_ends_the_requests_in_flight(model, engine):
    """`shutdown()` with a request in flight: its stream raises `EngineDead` (it used to wait forever), as do a
    call waiting and later requests (they used to hang); the thread joins and the cache is free."""
    if model.cfg.num_mla_layers < 2:
        pytest.skip("host logic, the same for both models; tiny-k3 covers it")
    import asyncio
    import time

    from serve.async_engine import AsyncEngine, EngineDead

    aeng = AsyncEngine(engine)
    long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)

    async def main():
        stream = asyncio.ensure_future(_collect(aeng.generate([5, 6, 7, 8], long, "x")))
        while "x" not in engine.requests:
            await asyncio.sleep(0.01)
        slow = asyncio.ensure_future(aeng.call(lambda e: time.sleep(0.3)))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(aeng.shutdown)
        assert not aeng.alive
        with pytest.raises(EngineDead):
            await asyncio.wait_for(stream, 10)
        ended = (await asyncio.wait_for(asyncio.gather(slow, return_exceptions=True), 10))[0]
        assert ended is None or isinstance(ended, EngineDead)  # ran before the thread stopped, or refused
        with pytest.raises(EngineDead):
            await asyncio.wait_for(_collect(aeng.generate([1, 2], GREEDY, "y")), 10)
        with pytest.raises(EngineDead):
            await asyncio.wait_for(aeng.abort_all(), 10)

    asyncio.run(main())
    s = engine.stats()
    assert not engine.requests and s["arena_free_units"] == s["arena_baseline_free_units"]


def test_async_engine_survives_a_closed_consumer_loop(model, engine):
    """A stream left unread when its event loop closed (a consumer gone without closing it): delivering to it
    raised in the engine thread, which ended and every other stream hung; now its request is aborted, its
    cache freed, and the engine serves on."""
    if model.cfg.num_mla_layers < 2:
        pytest.skip("host logic, the same for both models; tiny-k3 covers it")
    import asyncio

    from serve.async_engine import AsyncEngine

    aeng = AsyncEngine(engine)
    try:
        loop = asyncio.new_event_loop()
        orphan = aeng.generate([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True), "x")
        loop.run_until_complete(orphan.__anext__())
        loop.close()
        outs = asyncio.run(asyncio.wait_for(_collect(aeng.generate([5, 6, 7, 8], GREEDY, "y")), 60))
        assert aeng.alive and outs[-1].finished and len(outs[-1].token_ids) == GREEDY.max_tokens
    finally:
        aeng.shutdown()
    assert not engine.requests and engine.counters["requests_aborted"] >= 1
    s = engine.stats()
    assert s["arena_free_units"] == s["arena_baseline_free_units"]


def test_a_second_async_engine_over_an_engine_still_stepped_is_refused(model, engine):
    """An `AsyncEngine` built over an engine another AsyncEngine's thread still steps (a notebook cell run twice):
    both threads stepped it and a stream's outputs could go to the other's thread, its consumer waiting forever.
    Refused now, as is `LLM.generate` on that engine; once the first is shut down, a new one serves."""
    if model.cfg.num_mla_layers < 2:
        pytest.skip("host logic, the same for both models; tiny-k3 covers it")
    import asyncio

    from serve.async_engine import AsyncEngine, running_driver
    from serve.llm import LLM

    first = AsyncEngine(engine)
    try:
        with pytest.raises(RuntimeError, match="shutdown"):
            AsyncEngine(engine)
        assert running_driver(engine) is first  # (how to reach one whose name was rebound)
        llm = LLM.__new__(LLM)
        llm.engine, llm.progress = engine, False
        with pytest.raises(RuntimeError, match="AsyncEngine"):
            llm.generate([[5, 6, 7, 8]], GREEDY)
    finally:
        first.shutdown()
    assert running_driver(engine) is None
    second = AsyncEngine(engine)
    try:
        outs = asyncio.run(asyncio.wait_for(_collect(second.generate([5, 6, 7, 8], GREEDY)), 60))
        assert outs[-1].finished and len(outs[-1].token_ids) == GREEDY.max_tokens
    finally:
        second.shutdown()
    assert not engine.requests


def test_an_async_engine_dropped_without_shutdown_is_collected(model):
    """An `AsyncEngine` dropped without `shutdown()` (a notebook cell run again): its thread held it, polled on
    and kept the engine and its device memory for good; now it is collected, its thread ends and the engine
    goes too. A request left in flight is freed; a new AsyncEngine over a still-held engine serves, and an open
    stream keeps its AsyncEngine alive while read."""
    if model.cfg.num_mla_layers < 2:
        pytest.skip("host logic, the same for both models; tiny-k3 covers it")
    import asyncio
    import gc
    import weakref

    from serve.async_engine import AsyncEngine, running_driver

    eng = make_engine(model)  # the module engine's layout: its compiled programs are shared
    aeng = AsyncEngine(eng)
    long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)

    outs = asyncio.run(asyncio.wait_for(_collect(aeng.generate([5, 6, 7, 8], GREEDY, "a")), 60))
    assert outs[-1].finished
    asyncio.run(aeng.call(lambda e: e.add_request([5, 6, 7, 8], long, "left")))  # in flight, read by no stream
    thread, dropped = aeng._thread, weakref.ref(aeng)
    del aeng, outs
    gc.collect()
    thread.join(10)
    assert dropped() is None and not thread.is_alive() and running_driver(eng) is None
    s = eng.stats()
    assert not eng.requests and s["arena_free_units"] == s["arena_baseline_free_units"]
    again = AsyncEngine(eng)  # the engine kept: a new one steps it, a stream keeping it alive while read
    stream, thread, engine_ref = again.generate([5, 6, 7, 8], GREEDY), again._thread, weakref.ref(eng)
    del again, eng
    gc.collect()
    outs = asyncio.run(asyncio.wait_for(_collect(stream), 60))
    assert outs[-1].finished and len(outs[-1].token_ids) == GREEDY.max_tokens
    del stream
    gc.collect()
    thread.join(10)
    gc.collect()
    assert not thread.is_alive() and engine_ref() is None


def test_shared_step_cache_is_bounded(model):
    """Engines over the same model and layout share a bound step, but the process-wide table is
    an LRU: a process that builds engine after engine does not keep every old one's compiled
    programs alive (binding is lazy; nothing compiles here)."""
    from serve import step as step_mod
    from serve.memory import ArenaLayout

    lay = ArenaLayout.plan(model.cfg, 2 << 20, 16, model.dtype)
    first, _ = step_mod.bind_step(model.graphdef, lay, model.params, 0)
    again, _ = step_mod.bind_step(model.graphdef, lay, model.params, 0)
    assert again is first  # shared while recent
    for n in range(1, step_mod._BOUND_MAX + 3):
        step_mod.bind_step(model.graphdef, lay, model.params, n)
        assert len(step_mod._BOUND) <= step_mod._BOUND_MAX
    fresh, _ = step_mod.bind_step(model.graphdef, lay, model.params, 0)
    assert fresh is not first  # evicted, rebound


def test_async_engine_aborts_a_list_of_ids(model, engine):
    """`abort` takes one request id or several (vLLM's `abort(request_id: str | Iterable[str])`): the listed
    requests end with finish_reason "abort", the others go on. A list used to reach the engine thread, whose
    lookup raised there and failed every request in flight."""
    if model.cfg.num_mla_layers < 2:
        pytest.skip("host logic, the same for both models; tiny-k3 covers it")
    import asyncio

    from serve.async_engine import AsyncEngine

    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    aeng = AsyncEngine(engine)

    async def main():
        streams = {rid: aeng.generate([5, 6, 7, 8], long, rid) for rid in ("a", "b", "c")}
        for s in streams.values():  # each one running
            await s.__anext__()
        aeng.abort(["a", "b", "unknown"])
        aeng.abort(iter(()))
        return {rid: [o async for o in s][-1] for rid, s in streams.items()}

    try:
        last = asyncio.run(asyncio.wait_for(main(), 120))
        with pytest.raises(TypeError, match="request_id"):  # refused in the caller, not in the engine thread
            aeng.abort([["a"]])
    finally:
        aeng.shutdown()
    assert [last[r].outputs[0].finish_reason for r in "abc"] == ["abort", "abort", "length"]
    assert len(last["c"].outputs[0].token_ids) == 60 and aeng.errors == 0 and not engine.requests
    s = engine.stats()
    assert s["arena_free_units"] == s["arena_baseline_free_units"]


@pytest.mark.parametrize("kind", ["cumulative", "delta"])
def test_async_engine_coalesces_what_a_slow_consumer_has_not_read(model, engine, kind):
    """A consumer slower than the engine finds one output waiting, not one per step (vLLM's
    `RequestOutputCollector`): the newest cumulative output, or the deltas merged -- tokens, text, logprobs and
    each sample's finish, prompt logprobs once. Every step's output used to queue up (cumulative ones each held
    the whole answer so far: memory quadratic in its length)."""
    if model.cfg.num_mla_layers < 2:
        pytest.skip("host logic, the same for both models; tiny-k3 covers it")
    import asyncio

    from serve.async_engine import AsyncEngine
    from serve.types import RequestOutputKind

    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=1, n=2)
    want = run_all(engine, [[5, 6, 7, 8]], sp)[0]
    sp = dataclasses.replace(sp, output_kind=RequestOutputKind[kind.upper()])
    aeng = AsyncEngine(engine)

    async def main():
        stream = aeng.generate([5, 6, 7, 8], sp, "slow")
        outs = [await stream.__anext__()]
        while "slow" in engine.requests:  # the engine runs it to its end, unread
            await asyncio.sleep(0.01)
        await aeng.call(lambda engine: None)  # (posted after the request's last output: that one has arrived)
        return outs + [o async for o in stream]

    try:
        outs = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        aeng.shutdown()
    assert len(outs) == 2 and outs[-1].finished and not engine.requests
    if kind == "delta":  # the deltas joined
        assert outs[0].prompt_logprobs is not None and outs[1].prompt_logprobs is None
        parts = [[c for o in outs for c in o.outputs if c.index == i] for i in range(2)]
        got = [dataclasses.replace(cs[-1], token_ids=sum((c.token_ids for c in cs), []),
                                   text="".join(c.text for c in cs), logprobs=sum((c.logprobs for c in cs), []))
               for cs in parts]
    else:
        got = outs[1].outputs
    assert outs[1].prompt_logprobs == want.prompt_logprobs or kind == "delta"
    for c, w in zip(got, want.outputs, strict=True):
        assert (c.index, c.token_ids, c.text, c.finish_reason) == (w.index, w.token_ids, w.text, "length")
        assert [list(d.items()) for d in c.logprobs] == [list(d.items()) for d in w.logprobs]


def test_a_request_id_cannot_forge_engine_log_lines(caplog):
    """The engine's log lines naming a request (its bookkeeping failed) print a client's id (an X-Request-Id, SGLang's
    rid) with its line breaks escaped, as the server's request lines do: a newline in it forged a log line."""
    from types import SimpleNamespace

    with caplog.at_level("ERROR"):
        Engine._host_failed(SimpleNamespace(_host_failures=[]), "r\nINFO forged\u2028", ValueError("boom"))
    line = caplog.records[-1].getMessage()
    assert line == "request r\\nINFO forged\\u2028 failed in the engine's bookkeeping", line


def test_async_engine_request_to_a_sleeping_engine_raises_engine_sleeping():
    """A request reaching an engine asleep (sleep mode) raises the engine's `EngineSleeping` through the async
    engine, as through `Engine.add_request` (it came back as a RequestError, a client's bad request)."""
    import asyncio

    from serve.async_engine import AsyncEngine
    from serve.engine import EngineSleeping
    from serve.types import SamplingParams

    class Asleep(LoopSurface):  # every request refused as asleep
        def add_request(self, *args, **kwargs):
            raise EngineSleeping("add_request: the engine is asleep (weights and kv_cache released): wake_up first")

    aeng = AsyncEngine(Asleep())

    async def main():
        with pytest.raises(EngineSleeping, match="asleep"):
            async for _ in aeng.generate([1, 2], SamplingParams(max_tokens=2), "z"):
                pass

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        aeng.shutdown()


class _Unreachable(LoopSurface):
    """Every idle ping fails (a multi-process leader pinging followers it lost)."""

    pings = 0

    def idle(self):
        self.pings += 1
        raise RuntimeError("injected: the followers are unreachable")


def test_async_engine_waits_between_idle_tasks_that_fail_every_pass(monkeypatch):
    """An engine whose idle task raises on every pass: the engine thread waits between passes as when idle
    (until DEAD_AFTER_FAILURES of them, raised here). It went round without waiting, tens of thousands of passes a
    second, each logging its traceback."""
    import time

    from serve import async_engine
    from serve.async_engine import IDLE_WAIT_S, AsyncEngine

    monkeypatch.setattr(async_engine, "DEAD_AFTER_FAILURES", 1000)
    engine = _Unreachable()
    aeng = AsyncEngine(engine)
    try:
        time.sleep(10 * IDLE_WAIT_S)
        assert aeng.alive
    finally:
        aeng.shutdown()
    assert 1 <= engine.pings <= 20 and aeng.errors == engine.pings


def test_async_engine_whose_idle_task_fails_pass_after_pass_is_dead():
    """DEAD_AFTER_FAILURES failed idle passes in a row (a leader whose followers are gone): the engine is dead, as
    vLLM's once its engine core dies (`errored`, `dead_error` naming why, requests refused with `EngineDead`). It
    stayed "running" (/health 200) while it could never serve again."""
    import asyncio
    import time

    from serve.async_engine import DEAD_AFTER_FAILURES, AsyncEngine, EngineDead

    engine = _Unreachable()
    aeng = AsyncEngine(engine)
    try:
        deadline = time.monotonic() + 30
        while aeng.alive and time.monotonic() < deadline:  # (the thread ends once the engine is dead)
            time.sleep(0.01)
        assert aeng.errored and not aeng.alive and engine.pings == DEAD_AFTER_FAILURES
        assert re.search(r"idle .* failed in a row.*followers are unreachable", str(aeng.dead_error))
        with pytest.raises(EngineDead, match="followers are unreachable"):
            asyncio.run(aeng.check_health())
        with pytest.raises(EngineDead):
            asyncio.run(_collect(aeng.generate([1], GREEDY, "late")))
    finally:
        aeng.shutdown()


class _Scripted(LoopSurface):
    """Each step either fails, ending the first request (StepFailed), or finishes every request, as `script` says
    in turn ("ok" once it runs out)."""

    def __init__(self, script: list[str]):
        super().__init__()
        self.script = list(script)

    def has_unfinished(self):
        return bool(self.requests)

    def add_request(self, prompt, params, rid, **kw):
        self.requests[rid] = prompt

    def step(self):
        from serve.engine import StepFailed
        from serve.types import CompletionOutput, RequestOutput

        if (self.script.pop(0) if self.script else "ok") == "fail":
            first = sorted(self.requests)[0]
            del self.requests[first]
            raise StepFailed([first], RuntimeError("injected device failure"))
        done, self.requests = sorted(self.requests), {}
        return [RequestOutput(r, None, [1], [CompletionOutput(0, "", [2], "length")], finished=True) for r in done]


def test_async_engine_that_fails_step_after_step_is_dead():
    """A failed step ends only its requests; DEAD_AFTER_FAILURES in a row with no step that ran between mark the
    engine dead: the failing step's request gets its error, the other streams open end with `EngineDead` naming
    why, later requests are refused with it (an HTTP server: 503, /health too). A step that ran resets the count.
    Every request used to fail while the engine stayed "running" (/health 200)."""
    import asyncio
    import time

    from serve.async_engine import DEAD_AFTER_FAILURES, AsyncEngine, EngineDead

    assert DEAD_AFTER_FAILURES == 3
    engine = _Scripted(["fail", "fail", "ok", "fail", "fail", "fail"])
    aeng = AsyncEngine(engine)

    async def fails(rid):
        with pytest.raises(RuntimeError, match="injected device failure") as e:
            await _collect(aeng.generate([1], GREEDY, rid))
        assert not isinstance(e.value, EngineDead)

    async def main():
        await fails("a")
        await fails("b")
        assert (await _collect(aeng.generate([1], GREEDY, "ran")))[-1].finished  # resets the count
        await fails("c")
        await fails("d")
        assert aeng.is_running
        busy = asyncio.ensure_future(aeng.call(lambda e: time.sleep(0.2)))  # x and y queue behind it: one step
        await asyncio.sleep(0.05)
        x = asyncio.ensure_future(_collect(aeng.generate([1], GREEDY, "x")))
        y = asyncio.ensure_future(_collect(aeng.generate([1], GREEDY, "y")))
        await busy
        with pytest.raises(RuntimeError, match="injected device failure"):
            await asyncio.wait_for(x, 10)
        with pytest.raises(EngineDead, match="3 steps failed in a row, the last with RuntimeError: injected device"):
            await asyncio.wait_for(y, 10)
        assert aeng.errored and not aeng.is_running
        with pytest.raises(EngineDead, match="steps failed in a row"):
            await _collect(aeng.generate([1], GREEDY, "late"))

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        aeng.shutdown()
    assert not engine.requests and aeng.errors == 5


def test_an_async_engine_shut_down_mid_step_still_steps_its_engine_until_the_step_returns():
    """`shutdown` waits 10 s for the engine thread; a step still running then (a compile) goes on in that thread.
    `running_driver` said None at once, so a new AsyncEngine (or `LLM.generate`) stepped the engine beside it: two
    threads in one engine's step. It names the old driver until its step returns."""
    import threading

    from serve.async_engine import AsyncEngine, running_driver

    class Slow(LoopSurface):  # one request in flight whose step takes until `release`
        def __init__(self):
            self.release, self.entered, self.inside, self.most = threading.Event(), threading.Event(), 0, 0
            self.requests = {"left": object()}  # (what the timed-out shutdown could not free)

        def has_unfinished(self):
            return not self.release.is_set()

        def step(self):
            self.inside += 1
            self.most = max(self.most, self.inside)
            self.entered.set()
            self.release.wait(60)
            self.inside -= 1
            return []

    engine = Slow()
    first = AsyncEngine(engine)
    assert engine.entered.wait(30)
    first._thread.join = lambda timeout=None: threading.Thread.join(first._thread, 0.1)  # (shutdown gives up)
    first.shutdown()
    try:
        assert first.alive and running_driver(engine) is first
        with pytest.raises(RuntimeError, match="still in a step"):
            AsyncEngine(engine)
    finally:
        engine.release.set()
        threading.Thread.join(first._thread, 30)
    assert running_driver(engine) is None and engine.most == 1
    assert not engine.requests  # its thread freed them at its end (a new driver stepped them to completion)
    AsyncEngine(engine).shutdown()


def test_requests_failing_alone_in_their_own_bookkeeping_leave_the_engine_alive(model, engine, monkeypatch):
    """Requests that each fail alone in their own host-side work (here their token's bookkeeping; an adapter that
    cannot be read again ends its request the same way) while the step itself ran (`StepFailed.own`) say nothing of
    the engine: DEAD_AFTER_FAILURES of them in a row, one at a time, leave it serving. They marked it dead (every
    later request refused, /health 503): three bad requests in a row on an idle server sufficed."""
    if model.cfg.num_mla_layers < 2:
        pytest.skip("host logic, the same for both models; tiny-k3 covers it")
    import asyncio

    from serve.async_engine import DEAD_AFTER_FAILURES, AsyncEngine

    real = engine._append

    def append(seq, *args):
        if seq.request_id.startswith("bad"):
            raise ValueError("injected bookkeeping failure")
        return real(seq, *args)

    monkeypatch.setattr(engine, "_append", append)
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    aeng = AsyncEngine(engine)

    async def main():
        for i in range(DEAD_AFTER_FAILURES + 1):
            with pytest.raises(RuntimeError, match="injected bookkeeping failure"):
                await _collect(aeng.generate([5, 6, 7, i], sp, f"bad{i}"))
        assert aeng.is_running and not aeng.errored
        return (await _collect(aeng.generate([5, 6, 7, 8], sp, "good")))[-1]

    try:
        last = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        aeng.shutdown()
    assert last.finished and len(last.outputs[0].token_ids) == 3 and not engine.requests


def test_requests_failing_in_one_step_each_get_their_own_error(model, engine, monkeypatch):
    """Two requests failing their own bookkeeping differently in one step each end with their own error (an HTTP
    client's 500 names it), and the request beside them runs on to its end. Every failing request of the step got
    the first one's error."""
    if model.cfg.num_mla_layers < 2:
        pytest.skip("host logic, the same for both models; tiny-k3 covers it")
    import asyncio
    import time

    from serve.async_engine import AsyncEngine

    real = engine._append
    errors = {"bad-a": ValueError("bad-a's own failure"), "bad-b": KeyError("bad-b's own failure")}

    def append(seq, *args):
        if seq.request_id in errors and seq.output_ids:  # their second tokens, in one decode step
            raise errors[seq.request_id]
        return real(seq, *args)

    monkeypatch.setattr(engine, "_append", append)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    aeng = AsyncEngine(engine)

    async def fails(rid):
        with pytest.raises(RuntimeError) as e:
            await _collect(aeng.generate([5, 6, 7], sp, rid))
        return str(e.value)

    async def main():
        busy = asyncio.ensure_future(aeng.call(lambda e: time.sleep(0.2)))  # the three queue behind it: one step
        await asyncio.sleep(0.05)
        runs = [asyncio.ensure_future(fails("bad-a")), asyncio.ensure_future(fails("bad-b")),
                asyncio.ensure_future(_collect(aeng.generate([5, 6, 8], sp, "good")))]
        await busy
        return await asyncio.gather(*runs)

    failed_steps = engine.counters["failed_steps"]
    try:
        a, b, good = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        aeng.shutdown()
    assert engine.counters["failed_steps"] == failed_steps + 1  # (one step failed them both)
    assert "ValueError: bad-a's own failure" in a and "bad-b" not in a, a
    assert "KeyError" in b and "bad-b's own failure" in b and "bad-a" not in b, b
    assert good[-1].finished and len(good[-1].outputs[0].token_ids) == 4 and not engine.requests


def test_async_engine_call_raising_system_exit_fails_only_that_call(model, engine):
    """A `call` whose function raises a BaseException (SystemExit) raises it to its caller; the engine thread
    serves on. It used to end the thread: the call and every later request hung."""
    if model.cfg.num_mla_layers < 2:
        pytest.skip("host logic, the same for both models; tiny-k3 covers it")
    import asyncio

    from serve.async_engine import AsyncEngine

    def leave(engine):
        raise SystemExit("leaving")

    aeng = AsyncEngine(engine)

    async def main():
        with pytest.raises(SystemExit, match="leaving"):
            await aeng.call(leave)
        assert aeng.is_running and not aeng.errored and await aeng.get_tokenizer() is engine.tokenizer
        await aeng.check_health()
        sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        return [o async for o in aeng.generate([5, 6, 7, 8], sp, "after")][-1]

    try:
        last = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        aeng.shutdown()
    assert last.finished and len(last.token_ids) == 3 and not engine.requests


def test_async_engine_thread_that_dies_ends_its_streams(model, engine):
    """If the engine thread ends anyway (here: an abort failing again while a failed abort is handled), the
    streams in flight raise `EngineDead` naming the error and later requests raise it at once, as vLLM's
    `EngineDeadError`; they used to wait forever."""
    if model.cfg.num_mla_layers < 2:
        pytest.skip("host logic, the same for both models; tiny-k3 covers it")
    import asyncio

    from serve.async_engine import AsyncEngine, EngineDead

    sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    real = engine.abort

    def failing_abort(rid):
        raise RuntimeError("injected abort failure")

    aeng = AsyncEngine(engine)

    async def main():
        stream = aeng.generate([5, 6, 7, 8], sp, "x")
        await stream.__anext__()
        engine.abort = failing_abort
        aeng.abort("x")
        with pytest.raises(EngineDead, match="engine thread died: RuntimeError: injected abort failure"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDead):
            await aeng.reset_prefix_cache()
        with pytest.raises(EngineDead, match="engine thread died"):
            await _collect(aeng.generate([1], sp, "y"))
        with pytest.raises(EngineDead, match="engine thread died"):
            await aeng.check_health()
        assert aeng.errored and not aeng.is_running

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        engine.abort = real
        aeng.shutdown()
    assert not aeng.alive and not engine.requests
    s = engine.stats()
    assert s["arena_free_units"] == s["arena_baseline_free_units"]
