"""Hybrid prefix cache: warm resume equals cold recompute for every checkpoint kind, mid-page and
page-aligned hits, randomized sharing trees with aborts and preemption, immutability, no leaks."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import k3jax
from serve.beam_search import BeamSearchParams
from serve.engine import Engine, EngineConfig, Request, Sequence
from serve.types import SamplingParams

# (page_size, prefill_chunk): checkpoints sit on multiples of min(prefill_chunk, 64)
LAYOUTS = {"mid_page": (64, 16), "page_aligned": (16, 32)}


def config(page, chunk, units, max_model_len=384, **kw):
    """(No MoE timing at warm-up: a program per step shape that only the metrics read; CI time.)"""
    return EngineConfig(max_model_len=max_model_len, page_size=page, cache_bytes=units * page * 40 * 4, max_num_seqs=8,
                        prefill_chunk=chunk, max_prefill_seqs=2, max_num_batched_tokens=256, decode_buckets=(8,),
                        prefill_buckets=(2,), context_buckets=(384 // page,), max_logprobs=4,
                        checkpoint_interval=256, decode_checkpoint_interval=32, measure_moe_time=False, **kw)


@pytest.fixture(scope="module", params=[("tiny-k3", "mid_page"), ("tiny-kimi-linear", "page_aligned"),
                                        ("tiny-k3", "page_aligned")], ids=lambda p: "-".join(p))
def engines(request):
    name, layout = request.param
    model = k3jax.load_model(name, seed=2)
    page, chunk = LAYOUTS[layout]
    units = 6000 // page
    on = Engine(model, config(page, chunk, units), progress=False)
    off = Engine(model, config(page, chunk, units, enable_prefix_caching=False), progress=False)
    return on, off


def run(engine, prompt, n=8, params=None, **extra):
    """Greedy, `n` tokens with top-4 logprobs (`extra`: more SamplingParams; or `params`) -> the finished
    output."""
    rid = engine.add_request(prompt, params or SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                                              logprobs=4, **extra))
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                out = o
    return out


def logprobs(out):
    return [(p.chosen.token_id, p.chosen.logprob, [(t.token_id, t.logprob) for t in p.top])
            for p in out.outputs[0].logprobs]


def hits(engine, kind):
    return engine.stats()["prefix_cache"].get(f"kda_hits_{kind}", 0)


def toks(seed, n):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def emptied(engines):
    """The engines with an empty prefix cache: a test that sets up one checkpoint kind and expects to hit
    it starts from nothing other tests left (in a full cache, eviction may take that checkpoint first)."""
    assert engines[0].reset_prefix_cache()
    return engines


def warm_vs_cold(engines, prompt, kind, exact=True):
    on, off = engines
    before = hits(on, kind)
    warm, cold = run(on, prompt), run(off, prompt)
    assert hits(on, kind) == before + 1, f"expected a {kind} checkpoint hit"
    assert warm.token_ids == cold.token_ids
    if exact:
        assert logprobs(warm) == logprobs(cold)  # bit-identical logits (through their log-softmax)
    else:
        np.testing.assert_allclose([x[1] for x in logprobs(warm)], [x[1] for x in logprobs(cold)], atol=1e-5)


def warm_batch_equals_cold(on, off, base, cached, seed):
    """Run `base` on `on` (checkpointing its prompt end at `cached`), then three requests extending it together:
    each resumes at `cached` and is bit-identical to a lone cold request on `off` (no prefix cache)."""
    run(on, base)
    prompts = [base + toks(seed + i, 9 + 5 * i) for i in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=4)
    ids = [on.add_request(p, sp) for p in prompts]
    outs = {}
    while on.has_unfinished():
        outs.update({o.request_id: o for o in on.step() if o.finished})
    for rid, p in zip(ids, prompts):
        assert outs[rid].num_cached_tokens == cached
        assert logprobs(outs[rid]) == logprobs(run(off, p))


def close_to_exact(exact, lossy, prompts, n=12):
    """A lossy cache storage (`lossy`) against the exact engine on greedy `prompts`: the outputs really differ,
    greedy paths part only where the exact engine nearly ties, and logprobs before that stay close."""
    errs = []
    for p in prompts:
        a, b = run(exact, p, n=n), run(lossy, p, n=n)
        assert logprobs(a) != logprobs(b)  # the storage really is lossy
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), n)
        errs += [abs(x[1] - y[1]) for x, y in zip(logprobs(a)[:same], logprobs(b)[:same])]
        if same < n:
            top = dict(logprobs(a)[same][2])
            assert b.token_ids[same] in top and top[b.token_ids[same]] > max(top.values()) - 0.1, (same, top)
    assert np.median(errs) < 0.01 and max(errs) < 0.05, errs


def test_chunk_end_checkpoint(engines):
    emptied(engines)
    base = toks(1, 300)
    run(engines[0], base)  # captures the chunk-end state at 256 (and the prompt end at 288)
    warm_vs_cold(engines, base[:280] + toks(2, 20), "chunk_end")


def test_an_admission_whose_hit_the_running_requests_evicted_waits(engines, monkeypatch):
    """A step first evicts for its running requests, then pins what its admissions' hits read. When that first
    eviction takes part of a planned hit (here: everything no request holds), the admission must not read the
    freed units: it waits, is matched again next step (now a miss) and gives the cold result. (Found by a
    randomized run with speculative decoding: the engine raised in `acquire` on an evicted entry.)"""
    on, off = emptied(engines)
    pc, base = on.prefix_cache, toks(21, 150)
    run(on, base)  # cached: pages and a prompt-end checkpoint
    calls, evict = [], pc.evict_for

    def first_takes_everything(units, slots, keep=frozenset()):
        calls.append((units, slots))
        if len(calls) == 1:  # the running requests' eviction of the admitting step
            pc.clear()
        return evict(units, slots, keep)

    monkeypatch.setattr(pc, "evict_for", first_takes_everything)
    prompt = base + toks(22, 20)
    warm, cold = run(on, prompt), run(off, prompt)
    assert len(calls) > 2 and warm.num_cached_tokens == 0  # deferred once, then admitted without a hit
    assert warm.token_ids == cold.token_ids and logprobs(warm) == logprobs(cold)
    assert on.allocator.free_units + on._cached_units() == on.allocator.baseline_free_units


def test_prefill_first_decodes_while_an_admission_waits_for_a_slot(engines, monkeypatch):
    """`prefill_first` with the arena's last state slot the checkpoint a waiting request resumes from: the
    scheduler counts that (evictable) slot, the admission pins it and finds no slot, and waits. The running
    requests must decode meanwhile (a step of prompt chunks only would run nothing, forever), and everyone
    ends with the cold tokens. (Found by a randomized cross-feature run: the engine stepped without end.)"""
    import dataclasses

    on, off = emptied(engines)
    monkeypatch.setattr(on, "sched_cfg", dataclasses.replace(on.sched_cfg, prefill_first=True))
    base = toks(31, 70)
    run(on, base)  # cached: pages and a prompt-end checkpoint
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    decoders = [on.add_request(toks(32 + i, 10), sp) for i in range(2)]
    for _ in range(3):
        on.step()
    held = []  # every free slot run taken: the checkpoint is the only slot eviction could give
    try:
        while on.allocator._free_slot_bases(1):
            held.append(on.allocator.alloc_slot())
        waiting = on.add_request(base + toks(34, 5), sp)
        outs = {}
        for _ in range(60):
            outs.update({o.request_id: o for o in on.step() if o.finished})
            if len(outs) == 2:
                break
        assert set(outs) == set(decoders), "the running requests stopped decoding"
    finally:
        for b in held:
            on.allocator.free_slot(b)
    while on.has_unfinished():
        outs.update({o.request_id: o for o in on.step() if o.finished})
    for rid, p in zip(decoders + [waiting], [toks(32, 10), toks(33, 10), base + toks(34, 5)]):
        assert outs[rid].outputs[0].token_ids == run(off, p, params=sp).token_ids
    assert on.allocator.free_units + on._cached_units() == on.allocator.baseline_free_units


@pytest.fixture(scope="module")
def small():
    """tiny-k3 with an arena of 56 units: a state slot is 13 of them, a 160-token context 30 (the longest request
    it holds is 225 tokens: max_model_len 192)."""
    page, chunk = LAYOUTS["page_aligned"]
    return Engine(k3jax.load_model("tiny-k3", seed=2), config(page, chunk, 70, max_model_len=192), progress=False)


def bounded(engine, prompt, n, steps=60):
    """`run` that gives up after `steps` steps (aborting the request) -> the output, or None."""
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    for _ in range(steps):
        done = [o for o in engine.step() if o.request_id == rid and o.finished]
        if done:
            return done[0]
    engine.abort(rid)
    engine.step()
    return None


def test_a_request_that_nearly_fills_the_arena_skips_a_capture_it_has_no_room_for(small):
    """A capture keeps the request's state slot as the checkpoint, pinned until its next row has read it, and
    gives the request a new slot. A 162-token prompt holds 43 of the 56 units when its prompt-end state (160) is
    captured: with the new slot nothing is left for its next row's pages, and that row alone would unpin the
    checkpoint, so it waited forever. It goes on without the capture."""
    assert small.reset_prefix_cache()
    out = bounded(small, toks(50, 162), 2)
    assert out is not None and len(out.outputs[0].token_ids) == 2
    s = small.stats()
    assert s["arena_free_units"] + s["arena_cached_units"] == s["arena_baseline_free_units"]


def test_a_hit_that_can_never_be_admitted_is_not_taken(small):
    """A request resumes from a checkpoint by reading it into its own slot: both slots and its pages up to its
    first row's end must fit at once. A 170-token prompt whose cached prefix ends at 160 needs 59 of the 56
    units that way (46 from scratch): it was matched to that hit step after step and never admitted."""
    assert small.reset_prefix_cache()
    base, tail = toks(60, 160), toks(61, 10)
    bounded(small, base, 1)
    assert [c.pos for c in small.prefix_cache.ckpts.values()] == [160]
    warm = bounded(small, base + tail, 1)
    assert warm is not None and warm.num_cached_tokens == 0
    assert small.reset_prefix_cache()
    assert warm.outputs[0].token_ids == bounded(small, base + tail, 1).outputs[0].token_ids
    s = small.stats()
    assert s["arena_free_units"] + s["arena_cached_units"] == s["arena_baseline_free_units"]


def test_prompt_end_checkpoint(engines):
    emptied(engines)
    base = toks(3, 100)  # prompt end 100 -> aligned checkpoint at 96
    run(engines[0], base)
    warm_vs_cold(engines, base + toks(4, 7), "prompt_end")


def test_a_hit_one_token_short_of_the_end_decodes_that_token_as_a_cold_prefill_does(engines):
    """A prompt one token past an aligned position (resent: its prompt-end checkpoint sits at len - 1) resumes
    there; its last token is computed in a decode row, as a cold prefill whose rows end there computes it (a
    one-token prefill row rounds differently): bit-identical to caching off."""
    emptied(engines)
    prompt = toks(90, 97)
    run(engines[0], prompt)
    warm_vs_cold(engines, prompt, "prompt_end")
    assert run(engines[0], prompt, n=1).num_cached_tokens == 96


def test_outputs_report_the_prompt_tokens_taken_from_the_cache(engines):
    """`RequestOutput.num_cached_tokens` (and so the HTTP usage's cached_tokens) is the position the
    request resumed from: the aligned checkpoint, not the longer run of matching pages."""
    on, off = engines
    base = toks(5, 100)
    assert run(on, base, n=1).num_cached_tokens == 0  # nothing cached yet
    before = {k: on.stats()[k] for k in ("prompt_tokens", "prompt_tokens_cached")}
    assert run(on, base + toks(6, 5), n=1).num_cached_tokens == 96  # prompt-end checkpoint at 96
    assert run(off, base + toks(6, 5), n=1).num_cached_tokens == 0
    # vLLM's vllm:prompt_tokens_total / vllm:prompt_tokens_cached_total: the prompt's tokens, those of them cached
    assert {k: on.stats()[k] - v for k, v in before.items()} == {"prompt_tokens": 105, "prompt_tokens_cached": 96}


def test_a_hit_inside_a_page_takes_the_pages_of_a_cold_start(engines):
    """The private copy of the page a hit ends inside is one of the pages the request's first row needs, not
    one more: after that row the request holds the pages of its positions, as a cold request does."""
    on, _ = emptied(engines)
    base = toks(7, 100)  # prompt-end checkpoint at 96: inside a 64-token page, or page-aligned
    run(on, base)
    rid = on.add_request(base + toks(8, 7), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    seq = on.requests[rid].seqs[0]
    on.step()
    assert (seq.cached_tokens, seq.computed) == (96, 107)
    assert len(seq.pages[0]) == -(-107 // on.config.page_size)
    while on.has_unfinished():
        on.step()
    s = on.stats()
    assert s["arena_free_units"] + s["arena_cached_units"] == s["arena_baseline_free_units"]


def test_branch_point_checkpoint(engines):
    emptied(engines)
    system = toks(5, 150)
    run(engines[0], system + toks(6, 30))  # states only at its own prompt end (176)
    run(engines[0], system + toks(7, 30))  # second sighting: pages reach 128+, no state -> capture at 128
    warm_vs_cold(engines, system + toks(8, 11), "branch_point")


def test_branch_point_seen_by_several_requests_in_one_step(engines):
    """Three requests reach an uncheckpointed shared prefix together: one computes and captures the
    branch point, the other two wait a few steps and resume from it (bit-identical to cold)."""
    emptied(engines)
    on, off = engines
    system = toks(20, 150)
    run(on, system + toks(21, 30))  # pages past 128, a state only at its prompt end
    before = hits(on, "branch_point")
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=4)
    prompts = [system + toks(22 + i, 20) for i in range(3)]
    ids = [on.add_request(p, sp) for p in prompts]
    outs = {}
    while on.has_unfinished():
        for o in on.step():
            if o.finished:
                outs[o.request_id] = o
    assert hits(on, "branch_point") == before + 2, str(on.stats()["prefix_cache"])
    for rid, p in zip(ids, prompts):
        assert logprobs(outs[rid]) == logprobs(run(off, p))


def test_decode_interval_checkpoint(engines):
    """Decode-interval checkpoints come from a canonical re-prefill of the conversation so far, so a
    warm resume from one is bit-identical to a cold prefill (the decode's own states are not shared)."""
    emptied(engines)
    on, _ = engines
    p = toks(10, 40)
    before = on.stats()["canonical_rows"]
    run(on, toks(9, 40), n=40)  # no reuse: decode checkpoints would only cost, none is made
    assert on.stats()["canonical_rows"] == before
    run(on, p[:36], n=1)  # leaves a prompt-end checkpoint at 32
    first = run(on, p, n=40)  # resumes at 32; decode reaches 64: a canonical row re-prefills [32, 64)
    assert on.stats()["canonical_rows"] == before + 1
    assert not any(s.internal for s in on.seqs.values())  # finished and dropped with its memory
    warm_vs_cold(engines, p + first.token_ids + toks(11, 5), "decode_interval")


def test_shared_conversation_tail_is_canonicalised_on_reuse(engines):
    """A first request (no reuse, so no decode checkpoints) finishes; a second one reuses its prefix
    while the conversation continues: the first's whole tail is canonicalised, the continuation waits
    for it and resumes past the response (bit-identical to cold)."""
    on, off = engines
    system = toks(30, 100)
    first = run(on, system + toks(31, 20), n=30)  # ends at 150, prompt-end state at 112 or 96
    before, dec, hit_tokens = on.stats()["canonical_rows"], hits(on, "decode_interval"), \
        on.stats()["prefix_cache"]["hit_tokens"]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=4)
    cont = system + toks(31, 20) + first.token_ids + toks(32, 9)
    ids = [on.add_request(system + toks(33, 12), sp), on.add_request(cont, sp)]
    outs = {}
    while on.has_unfinished():
        for o in on.step():
            if o.finished:
                outs[o.request_id] = o
    assert on.stats()["canonical_rows"] >= before + 1
    assert hits(on, "decode_interval") == dec + 1  # the continuation resumed from the canonical tail
    assert on.stats()["prefix_cache"]["hit_tokens"] - hit_tokens >= 144  # the continuation: (149 // 16) * 16
    assert logprobs(outs[ids[1]]) == logprobs(run(off, cont))


_SHORT = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def _among_arrivals(engine, prompt, others: list, seed: int, priority: int = 0):
    """Run `prompt` (greedy, 4 tokens, logprobs) while two 200-token requests of `priority` arrive every step,
    for up to 40 steps -> its finished output (None if it never finished); then abort `others` and the arrivals
    and drain the engine."""
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=4)
    rid, out = engine.add_request(prompt, sp), None
    for i in range(40):
        others += [engine.add_request(toks(seed + 2 * i + j, 200), _SHORT, priority=priority) for j in range(2)]
        out = next((o for o in engine.step() if o.request_id == rid and o.finished), out)
        if out is not None:
            break
    for r in others:
        engine.abort(r)
    while engine.has_unfinished():
        engine.step()
    return out


def test_a_continuation_waiting_for_its_canonical_tail_is_not_starved_by_later_requests(engines):
    """The canonical row of a shared tail queues behind every real request, and the continuation waits for it:
    the row moves up to the continuation's place, so requests arriving after it all the time (a prefill row
    always wanted) neither hold it back nor the continuation, which still resumes past the response."""
    on, off = emptied(engines)
    system = toks(34, 100)
    first = run(on, system + toks(35, 20), n=30)  # (no reuse: its tail is canonicalised when reused)
    cont = system + toks(35, 20) + first.token_ids + toks(36, 9)
    others = [on.add_request(toks(900 + i, 200), _SHORT) for i in range(4)]
    out = _among_arrivals(on, cont, others, 1000)
    assert out is not None, "the continuation never ran"
    assert out.num_cached_tokens == 149 // on.align * on.align  # resumed from the canonical tail
    assert logprobs(out) == logprobs(run(off, cont, n=4))


def test_a_request_does_not_wait_for_a_lower_priority_one_to_checkpoint_their_branch(engines):
    """Two requests share a branch point (pages cached deeper than any checkpoint): the higher-priority one does
    not sit out waiting for the earlier, lower-priority one to capture it, which requests of a priority between
    theirs would keep from running."""
    on, off = emptied(engines)
    z = toks(37, 200)
    run(on, z)  # pages to 192, no checkpoint below 150
    others = [on.add_request(toks(910 + i, 200), _SHORT, priority=1) for i in range(4)]
    others.append(on.add_request(z[:150] + toks(38, 5), _SHORT, priority=5))
    high = z[:150] + toks(39, 5)
    out = _among_arrivals(on, high, others, 1100, priority=1)
    assert out is not None, "the higher-priority request never ran"
    assert logprobs(out) == logprobs(run(off, high, n=4))


def test_a_canonical_row_gives_up_the_priority_of_an_aborted_request_that_waited_for_it(engines):
    """A waiting canonical row takes the place of the request that waits for it; it kept that place after the
    request was aborted, so a cache-only row went on ahead of (and could preempt) the user requests behind it."""
    from serve.engine import INTERNAL_PRIORITY

    on, _ = emptied(engines)
    system = toks(40, 100)
    first = run(on, system + toks(41, 20), n=30)  # (no reuse: its tail is canonicalised when reused)
    blockers = [on.add_request(toks(920 + i, 200), _SHORT, priority=-10) for i in range(2)]  # the prefill rows
    urgent = on.add_request(system + toks(41, 20) + first.token_ids + toks(42, 9), _SHORT, priority=-5)
    on.step()
    rows = [s for s in on.seqs.values() if s.internal and s.slot is None]
    assert rows and {s.priority for s in rows} == {-5}  # waiting, in the urgent request's place
    on.abort(urgent)
    later = on.add_request(toks(43, 50), _SHORT)
    later_order = on.requests[later].seqs[0].order
    on.step()
    assert not any(s.finished for s in rows)
    assert all(s.priority == INTERNAL_PRIORITY and s.order > later_order for s in rows)  # behind every real request
    for r in blockers + [later]:
        on.abort(r)
    while on.has_unfinished():
        on.step()


def test_the_waiting_cut_counts_a_running_canonical_row_back_in_its_own_place(engines, monkeypatch):
    """A running canonical row holding the place of a request that waited for it goes back to its own (behind every
    request) once that request is gone (`_deferred`). How far the scheduler may look into the queue (`waiting_cut`)
    was counted with the place it held before: the scheduler, which may then preempt the row and hold memory for as
    many waiting requests as there are free slots, saw only `max_prefill_seqs + 1` of them, and its plan could
    differ from the plan over the whole queue (those reservations weigh on the admission look-ahead, the long row)."""
    import serve.engine as engine_module
    from serve.engine import INTERNAL_PRIORITY

    on, _ = emptied(engines)
    system = toks(40, 100)
    first = run(on, system + toks(41, 20), n=100)  # (no reuse: its tail is canonicalised when reused)
    blocker = on.add_request(toks(920, 200), _SHORT, priority=-10)  # a prefill row: the canonical one's are short
    urgent = on.add_request(system + toks(41, 20) + first.token_ids + toks(42, 9), _SHORT, priority=-5)
    on.step()
    rows = [s for s in on.seqs.values() if s.internal and s.slot is not None]
    assert rows and {s.priority for s in rows} == {-5}  # running, in the urgent request's place
    on.abort(urgent)
    later = [on.add_request(toks(50 + i, 40), _SHORT) for i in range(6)]
    later += [on.add_request(toks(60 + i, 40), _SHORT, priority=1) for i in range(60)]
    cuts, views, walks = [], [], []
    cut, schedule, waiting = engine_module.waiting_cut, engine_module.schedule, on._waiting
    # (nor was the queue walked whole every step while the row ran, to find whether its place was still lent)
    monkeypatch.setattr(on, "_waiting", lambda n: (walks.append(n >= len(on._queue)), waiting(n))[1])
    monkeypatch.setattr(engine_module, "waiting_cut", lambda cfg, slots, running, waiting, *queued: (
        cuts.append(sorted(running)), cut(cfg, slots, running, waiting, *queued))[1])
    monkeypatch.setattr(engine_module, "schedule", lambda seqs, *a: (
        views.append(sorted((s.priority, s.adapter) for s in seqs if s.running)), schedule(seqs, *a))[1])
    on.step()
    monkeypatch.undo()
    assert (INTERNAL_PRIORITY, 0) in views[-1]  # back in its own place
    assert cuts[-1] == views[-1]  # the running requests the cut counted are the scheduler's
    assert walks and not any(walks)
    for r in later + [blocker]:
        on.abort(r)
    while on.has_unfinished():
        on.step()


def _one_slot_run_and(alloc, slot_units, units):
    """Take the arena but one slot run and at least `units` more free units in runs a page of each breaks: one
    request's slot and pages fit, no second slot does -> (the slots, the pages) taken."""
    held = []
    while alloc._free_slot_bases(1):
        held.append(alloc.alloc_slot())
    pages = alloc.alloc_pages(alloc.free_units)
    runs = -(-units // (slot_units - 1))
    for b in held[:runs + 1]:  # (the highest: pages are taken from the lowest free units)
        alloc.free_slot(b)
    broken = alloc.alloc_pages(runs * slot_units)
    alloc.free_pages([u for i, u in enumerate(broken) if i % slot_units])
    return held[runs + 1:], pages + broken[::slot_units]


def test_canonical_rows_that_lose_their_capture_do_not_preempt_each_other_forever(engines, monkeypatch):
    """Two canonical rows past a branch point of cached pages both plan its checkpoint, and a request waits for it:
    the running row takes that request's place, reaches the point with no slot to keep the checkpoint in and drops
    it; the waiting row then planned it and took the place. It preempted the running one, which did the same when
    readmitted: the rows preempted each other forever and the request never ran. (Found by a randomized run
    with `prefill_first`, priorities and a tight arena.)"""
    from serve.prefix_cache import DECODE, PrefixHasher
    from serve.scheduler import units_for

    on, off = emptied(engines)
    monkeypatch.setattr(on, "_room_to_capture", lambda seq: False)  # no slot to keep a checkpoint in, ever
    a, shared = on.align, toks(44, 128)
    run(on, shared + toks(45, 8), n=1)  # pages of the shared prefix, no checkpoint
    on._tails.clear()  # (its own tail is no canonical row here)
    for i, n in enumerate((40, 56)):  # both rows plan the branch-point capture at 128
        ids = shared + toks(46 + i, n)
        h = PrefixHasher(on.config.prefix_hash_unit)
        h.extend(ids)
        on._spawn_canonical_ids(ids, h, len(ids) // a * a, DECODE, f"tail{i}")
    held, pages = _one_slot_run_and(on.allocator, on.layout.slot_units, units_for(176, on.sched_cfg))
    try:
        prompt = shared + toks(48, 9)
        rid, out = on.add_request(prompt, _SHORT), None
        for _ in range(100):
            out = next((o for o in on.step() if o.request_id == rid and o.finished), out)
            if out is not None:
                break
        assert out is not None, f"the request never ran ({on.counters['preemptions']} preemptions)"
    finally:
        on.allocator.free_pages(pages)
        for b in held:
            on.allocator.free_slot(b)
    while on.has_unfinished():
        on.step()
    assert out.outputs[0].token_ids == run(off, prompt, params=_SHORT).outputs[0].token_ids
    assert on.allocator.free_units + on._cached_units() == on.allocator.baseline_free_units


def test_single_token_request_shares_its_prompt(engines):
    """A request that finishes on its first token (max_tokens=1) still leaves its prompt pages and
    prompt-end state for the next one."""
    base = toks(42, 100)  # prompt end 100 -> aligned checkpoint at 96
    run(engines[0], base, n=1)
    warm_vs_cold(engines, base + toks(43, 9), "prompt_end")


def test_reuse_of_a_conversation_shorter_than_the_alignment(engines):
    """A reused conversation too short to hold an aligned checkpoint gets no canonical row."""
    on, off = engines
    short = toks(40, 18)
    run(on, short, n=1)  # 19 tokens: one full 16-token page at most, no aligned state past 0 (align >= 16)
    before = on.stats()["canonical_rows"]
    p = short[:16] + toks(41, 30)
    assert run(on, p).token_ids == run(off, p).token_ids
    assert on.stats()["canonical_rows"] == before


def test_cache_salt_keeps_prefixes_apart(engines):
    """vLLM's cache_salt: only requests with the same salt share cached prefixes (their own decode
    checkpoints and canonical rows included); outputs never depend on it."""
    on, off = engines
    base = toks(41, 100)  # prompt-end checkpoint at 96

    def go(prompt, salt):
        rid = on.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), cache_salt=salt)
        out = None
        while on.has_unfinished():
            for o in on.step():
                if o.request_id == rid and o.finished:
                    out = o
        return out

    go(base, "tenant-a")
    cold = run(off, base + [7, 8, 9], n=4)
    for salt, cached in (("tenant-b", 0), (None, 0), ("tenant-a", 96)):
        out = go(base + [7, 8, 9], salt)
        assert out.num_cached_tokens == cached, salt
        assert out.outputs[0].token_ids == cold.token_ids
    go(base + [1], None)  # unsalted now cached too: salted requests still do not see it
    assert go(base + [2], "tenant-c").num_cached_tokens == 0
    surrogate = go(base + [7, 8, 9], "\ud800")  # (JSON's "\\ud800": it raised UnicodeEncodeError)
    assert surrogate.num_cached_tokens == 0 and surrogate.outputs[0].token_ids == cold.token_ids
    with pytest.raises(Exception, match="cache_salt"):
        on.add_request(base, SamplingParams(max_tokens=1), cache_salt="")


def test_cache_salt_never_reads_as_an_adapter_or_prompt_vectors():
    """The salt of a request's prefix hashes keeps its parts apart (tagged, length-prefixed), as vLLM keeps
    cache_salt, the LoRA adapter and multimodal hashes apart as extra keys: joined as they were, a base-model
    request with cache_salt="\\0lora:1" (or "t\\0lora:1") resumed from adapter 1's cached prefixes (of salt
    "t"), and one spelling the prompt-vectors part could read a prompt_embeds request's."""
    from serve.prefix_cache import prefix_salt
    salts = [(s, a, d) for s in (None, "t", "t\0lora:1", "\0lora:1", "\0embeds:x", "lora1:1", "\ud800")
             for a in (None, 1) for d in (None, b"x")]
    assert len({prefix_salt(*x) for x in salts}) == len(salts)
    assert prefix_salt() == b""  # unsalted requests share one chain


def test_metrics_and_clear(engines):
    on, _ = engines
    pc = on.stats()["prefix_cache"]
    assert pc["mla_tokens_reused"] > 0 and pc["kda_hits"] > 0 and pc["kda_misses"] > 0
    assert 0 < pc["hit_rate"] < 1
    s = on.stats()
    assert s["arena_free_units"] + s["arena_cached_units"] == s["arena_baseline_free_units"]
    assert on.reset_prefix_cache()
    after = on.stats()["prefix_cache"]  # what a reset drops is not counted as evicted
    assert (after["checkpoints_evicted"], after["pages_evicted"]) == (pc["checkpoints_evicted"], pc["pages_evicted"])
    assert on.stats()["arena_free_units"] == on.stats()["arena_baseline_free_units"]
    assert on.stats()["prefix_cache"]["pages"] == on.stats()["prefix_cache"]["checkpoints"] == 0


def test_kv_cache_usage_counts_units_only_the_cache_holds_as_free(engines):
    """vLLM's kv_cache_usage_perc: cached blocks no request holds are free (evicted on demand), so an idle
    engine reports 0 whatever its prefix cache keeps."""
    on, _ = engines
    run(on, toks(70, 100))
    s = on.stats()
    assert s["num_requests_running"] == s["num_requests_waiting"] == 0
    assert s["arena_cached_units"] > 0 and s["kv_cache_usage"] == 0.0


def test_prefix_cache_queries_are_new_requests_not_readmissions(engines):
    """vLLM's vllm:prefix_cache_queries / _hits count the tokens new requests look up; a preempted request's
    readmission is counted apart (`preempted_*`). Each readmission added its prompt and tokens so far again."""
    on, _ = engines
    before = dict(on.stats()["prefix_cache"])
    p = toks(4242, 50)
    on.add_request(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while not any(o.outputs and o.outputs[0].token_ids for o in on.step()):
        pass
    assert on.retract() == 1  # (a preemption)
    on.continue_generation()
    while on.has_unfinished():
        on.step()
    after = on.stats()["prefix_cache"]
    assert after["query_tokens"] - before["query_tokens"] == len(p)
    assert after["preempted_query_tokens"] - before.get("preempted_query_tokens", 0) > len(p)


def test_a_long_queue_is_matched_and_reaped_at_its_head_only(engines, monkeypatch):
    """An offline batch of thousands of prompts: every step walked every waiting request (matched it against the
    cache, viewed it for the scheduler) and every request (to forget the finished ones), so a batch's host time grew
    with the square of its size (`LLM.generate` of tiny-kimi-linear, 2 tokens each: 5.0 ms a prompt at 250 prompts,
    18.3 at 4000). A step now reads the head of a queue kept in order (`Engine._waiting`) as far as the scheduler
    may look (`waiting_cut`), and the requests that ended; the queue is always the waiting requests in the
    scheduler's order, and every request runs as without the cache."""
    on, off = emptied(engines)
    prompts = [toks(5000 + i, 20) for i in range(40)]
    matched, looked = [], []
    match, finished = on._match, Request.finished
    monkeypatch.setattr(on, "_match", lambda s: (matched.append(s.rid), match(s))[1])
    monkeypatch.setattr(Request, "finished", property(lambda r: (looked.append(r.request_id), finished.fget(r))[1]))
    ids = [on.add_request(p, _SHORT, priority=i % 3) for i, p in enumerate(prompts)]
    on.step()
    assert len(set(matched)) == on.sched_cfg.max_prefill_seqs + 1  # nothing running: the rows and one more
    looked.clear()
    on._reap()
    assert looked == []  # nothing ended since the step's own reap
    outs = {}
    while on.has_unfinished():
        outs.update((o.request_id, o.outputs[0].token_ids) for o in on.step() if o.finished)
        waiting = sorted((s.priority, s.order, s.rid) for s in on.seqs.values()
                         if s.slot is None and not s.finished and s.internal is None)
        assert [(p, o, s.rid) for p, o, _, s in on._waiting(len(on._queue))] == waiting
        assert set(on._running) == {s.rid for s in on.seqs.values() if s.slot is not None}
    assert not on.requests and not on.seqs and not on._queue
    monkeypatch.undo()
    assert [outs[i] for i in ids] == [run(off, p, n=2).outputs[0].token_ids for p in prompts]


def test_steps_do_not_copy_a_sequences_tokens(engines, monkeypatch):
    """`Sequence.all_ids` builds prompt + output anew on every read; the step paths read it for every row of every
    step (lengths, the row's tokens, the prefix hasher's list: O(context) host work per row per step). They read
    `num_ids`, `id_at` and the list `ids()` keeps, so a request's reads do not grow with the tokens it generates
    (one is left: its tail's hasher when it finishes); the outputs are those without the cache."""
    on, off = emptied(engines)
    reads = []
    all_ids = Sequence.all_ids
    monkeypatch.setattr(Sequence, "all_ids", property(lambda s: (reads.append(s.rid), all_ids.fget(s))[1]))
    counts, outs = [], []
    for n in (3, 40):
        reads.clear()
        outs.append(run(on, toks(7100 + n, 37), n=n).outputs[0].token_ids)
        counts.append(len(reads))
    assert counts[0] == counts[1] <= 1
    monkeypatch.undo()
    assert outs == [run(off, toks(7100 + n, 37), n=n).outputs[0].token_ids for n in (3, 40)]


def test_sequence_ids_grow_with_the_outputs_and_follow_replaced_lists():
    """`Sequence.ids()`: the list holders (a prefix hasher) keep grows in place as tokens are appended; lists
    replaced or shorter than what was read are read into a new list (the old one left as it was)."""
    seq = Sequence(rid="r", request_id="r", index=0, order=0, prompt_ids=[1, 2, 3], params=_SHORT, seed=0,
                   checker=None, metrics=None)
    ids = seq.ids()
    assert ids == [1, 2, 3] and seq.num_ids == 3
    seq.output_ids += [4, 5]
    assert seq.ids() is ids and ids == [1, 2, 3, 4, 5] and seq.id_at(3) == 4 and seq.id_at(0) == 1
    seq.output_ids = [9]
    fresh = seq.ids()
    assert fresh == [1, 2, 3, 9] and ids == [1, 2, 3, 4, 5] and fresh == seq.all_ids
    seq.output_ids.clear()
    assert seq.ids() == [1, 2, 3] and fresh == [1, 2, 3, 9]


def test_beam_search_forks_with_and_without_the_cache(engines):
    """Beam searches fork KDA state slots and share MLA pages: without the prefix cache (pages shared by
    reference counts alone), cold with it, and warm (the prompt resumed from the cache) they find the
    same hypotheses; the arena returns to its baseline."""
    on, off = engines
    prompt, params = toks(77, 90), BeamSearchParams(2, 10, ignore_eos=True)

    def go(engine):
        return run(engine, prompt, params=params)

    forks = off.counters["beam_forks"]
    want = go(off).outputs
    assert off.counters["beam_forks"] > forks and len({tuple(c.token_ids) for c in want}) == 2
    assert off.stats()["arena_free_units"] == off.stats()["arena_baseline_free_units"]
    for cached in (False, True):
        out = go(on)
        got = out.outputs
        assert (out.num_cached_tokens > 0) == cached
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        np.testing.assert_allclose([c.cumulative_logprob for c in got], [c.cumulative_logprob for c in want],
                                   atol=1e-4)
    assert got and on.requests == {} and not on._frozen
    s = on.stats()
    assert s["arena_free_units"] + s["arena_cached_units"] == s["arena_baseline_free_units"]


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_sharing_trees_match_caching_off(engines, data):
    """Concurrent requests on random prefix trees, with aborts; a small arena forces eviction and
    preemption. Outputs equal caching off; checkpoints never change; the arena returns to baseline."""
    on, off = engines
    seed = data.draw(st.integers(0, 10 ** 6))
    rng = np.random.default_rng(seed)
    roots = [toks(seed + i, int(rng.integers(20, 120))) for i in range(2)]
    prompts = []
    for _ in range(data.draw(st.integers(4, 10))):
        base = roots[int(rng.integers(0, 2))]
        cut = int(rng.integers(1, len(base) + 1))
        prompts.append(base[:cut] + toks(int(rng.integers(0, 10 ** 6)), int(rng.integers(1, 60))))
    aborts = set(data.draw(st.lists(st.integers(0, len(prompts) - 1), max_size=2)))
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ids = [on.add_request(p, sp) for p in prompts]
    seen: dict[int, bytes] = {}
    outs, steps = {}, 0
    while on.has_unfinished():
        for o in on.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
        steps += 1
        if steps == 2:
            for a in aborts:
                on.abort(ids[a])
        for c in on.prefix_cache.ckpts.values():
            digest = on.slot_bytes(c.slot).tobytes()
            key = (c.slot, c.key)
            assert seen.setdefault(key, digest) == digest, "a checkpoint changed after registration"
    for i, p in enumerate(prompts):
        if ids[i] in outs and i not in aborts:
            assert outs[ids[i]] == run(off, p, 6).token_ids
    s = on.stats()
    assert s["arena_free_units"] + s["arena_cached_units"] == s["arena_baseline_free_units"]
    on.prefix_cache.clear()
    assert on.stats()["arena_free_units"] == on.stats()["arena_baseline_free_units"]


@pytest.fixture(scope="module")
def full_arena():
    """tiny-k3 (page-aligned layout) whose prefix cache holds the pages of 40 unrelated 200-token prompts: a
    full arena, and an engine without caching beside it. Shared by the two tests below (one fill, one engine
    pair; CI time); the first leaves it still full of old pages (it drops the checkpoints and one run's entries)."""
    model = k3jax.load_model("tiny-k3", seed=2)
    page, chunk = LAYOUTS["page_aligned"]
    on = Engine(model, config(page, chunk, 6000 // page), progress=False)
    for i in range(40):  # unrelated prompts fill the arena with cached pages
        run(on, toks(1000 + i, 200), n=4)
    return on, Engine(model, config(page, chunk, 6000 // page, enable_prefix_caching=False), progress=False)


def test_a_state_slot_evicts_only_the_entries_of_one_run(full_arena):
    """A new state slot needs one slot-aligned run of units, and pages (from the arena's low end) reach
    into the slot region once the cache is full: eviction then drops exactly the cache entries holding
    the units of the cheapest run (and the deeper pages of their chains), not whatever the LRU / depth
    order reaches first until some run happens to be free (when a branch point's capture needed the slot,
    that dropped 82 entries, the shared prefix's pages with them), and the engine answers as before."""
    on, off = full_arena
    pc, alloc, su = on.prefix_cache, on.allocator, on.layout.slot_units
    for c in list(pc.ckpts.values()):  # no checkpoint slot to give up: pages must go
        pc._drop_ckpt(c)
    free_runs = set(alloc._free_slot_bases(len(alloc.owner)))
    before = {k: (list(e.units), e.parent) for k, e in pc.pages.items()}
    pc.evict_for(0, len(free_runs) + 1)
    (freed,) = set(alloc._free_slot_bases(len(alloc.owner))) - free_runs
    gone = set(before) - set(pc.pages)
    in_run = {k for k in gone if any(freed <= u < freed + su for u in before[k][0])}
    assert in_run and len(gone) <= su < len(before) // 4  # 7 of 109 here (29 before the change)

    def below(k):  # an evicted page is in the run or deeper in a chain through one that is
        while k is not None:
            if k in in_run:
                return True
            k = before[k][1]
        return False

    assert all(below(k) for k in gone)
    p = toks(1000, 200) + toks(7, 9)
    assert logprobs(run(on, p)) == logprobs(run(off, p))


def test_a_fresh_checkpoint_outlives_old_pages_in_a_full_arena(full_arena):
    """Eviction is least recently used over checkpoints and pages together: in an arena full of old
    prompts' pages, a branch point seen twice is captured and then hit (evicting checkpoints before any
    page, it was dropped by the next admission and the third request missed)."""
    on, off = full_arena
    system = toks(5, 150)
    run(on, system + toks(6, 30))
    run(on, system + toks(7, 30))  # the second sighting captures the branch point at 128
    assert on.allocator.free_units < on.allocator.baseline_free_units // 4  # still full
    warm_vs_cold((on, off), system + toks(8, 11), "branch_point")


# ---- host bookkeeping alone (no model): arena units, reference counts, eviction choices ------------

def host_cache(page=16, align=16, units=900):
    """A prefix cache over a bare arena laid out for tiny-k3 (no engine, no device work)."""
    from serve.memory import Arena, ArenaLayout
    from serve.prefix_cache import PrefixCache, PrefixCacheConfig
    layout = ArenaLayout.plan(k3jax.get_preset("tiny-k3"), units * page * 40 * 4, page, np.float32)
    alloc = Arena(layout)
    return alloc, PrefixCache(alloc, layout, align=align, cfg=PrefixCacheConfig(hash_unit=8))


def cache_prompt(alloc, pc, ids, ckpt_at=None, keep=False):
    """What an engine does for a prompt: a slot and pages, the pages shared, a checkpoint at `ckpt_at`,
    the request's holds released (unless `keep`) -> its units."""
    from serve.prefix_cache import PROMPT_END, PrefixHasher
    lm, npg = alloc.layout.num_mla_layers, -(-len(ids) // pc.ps)
    slot, units = alloc.alloc_slot() if ckpt_at else None, alloc.alloc_pages(npg * lm)
    pc.ref(units)
    pages = [units[l * npg:(l + 1) * npg] for l in range(lm)]
    h = PrefixHasher(8)
    h.extend(list(ids))
    pc.register_pages(h, pages, len(ids), 0)
    if ckpt_at and not pc.register_checkpoint(h, ckpt_at, slot, PROMPT_END, pages):
        alloc.free_slot(slot)
    if not keep:
        pc.unref(units)
    return units


def test_a_hit_renews_the_pages_it_reads():
    """A prefix read again moves to the back of the eviction order: with A cached before B and then read,
    the units the arena is short of come from B's pages (after A's last page, which the hit did not read),
    and the pages read stay."""
    from serve.prefix_cache import FULL, PrefixHasher
    alloc, pc = host_cache()
    a, b = toks(1, 64), toks(2, 64)
    cache_prompt(alloc, pc, a, ckpt_at=48)
    cache_prompt(alloc, pc, b)
    keys = {}
    for name, ids in (("a", a), ("b", b)):
        h = PrefixHasher(8)
        h.extend(ids)
        keys[name] = [h.key(FULL, j * pc.ps) for j in range(1, 5)]
    assert all(k in pc.pages for ks in keys.values() for k in ks)
    h = PrefixHasher(8)
    h.extend(a)
    hit = pc.match(h, len(a))
    assert hit.pos == 48 and len(hit.pages) == 3
    pc.acquire(hit)  # a request admitted on A's prefix ...
    pc.unpin(hit)
    pc.unref([u for e in hit.pages for u in e.units])  # ... and finished
    pc._drop_ckpt(hit.ckpt)  # (its pages no longer kept for it: only their use orders them)
    lm = alloc.layout.num_mla_layers
    pc.ref(alloc.alloc_pages(alloc.free_units))  # a running request holds the rest
    pc.evict_for(2 * lm, 0)
    read = [e.key for e in hit.pages]
    assert read == keys["a"][:3]  # (A's last page, past the hit, was not read: it is older than B's)
    assert all(k in pc.pages for k in read) and not all(k in pc.pages for k in keys["b"])


def test_unit_refs_refuse_a_release_nobody_holds():
    alloc, pc = host_cache()
    units = alloc.alloc_pages(3)
    pc.ref(units)
    pc.ref(units[:1])
    with pytest.raises(KeyError, match="nobody holds"):
        pc.unref([units[1], units[1]])
    assert pc.unit_refs == {units[0]: 2, units[1]: 1, units[2]: 1}  # unchanged by the refused release
    pc.unref(units)
    pc.unref(units[:1])
    assert pc.unit_refs == {} and alloc.free_units == alloc.baseline_free_units


def test_entries_sharing_units_are_evicted_in_one_round():
    """A checkpoint mid-page registers a partial-page entry on the request's page, and the full page later
    registers another entry on the same units: one eviction round frees both (it once compared each
    unit's holders with counts taken before the round, so the second looked shared and stayed)."""
    alloc, pc = host_cache(page=16, align=8)
    cache_prompt(alloc, pc, toks(3, 16), ckpt_at=8)  # page 0 full, and partial at 8 (the same units)
    assert len(pc.pages) == 2 and len({tuple(e.units) for e in pc.pages.values()}) == 1
    assert pc.evictable()[0] == alloc.layout.num_mla_layers + alloc.layout.slot_units
    pc.evict_for(alloc.baseline_free_units, 0)
    assert not pc.pages and not pc.ckpts and alloc.free_units == alloc.baseline_free_units


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_slot_eviction_takes_the_cheapest_run(data):
    """With no checkpoint slot to give up, a new slot frees the slot-aligned run whose eviction drops the
    fewest entries (its pages' holders, their deeper pages, the checkpoints on them), least recently used
    on ties, skipping runs a request holds -- compared with every run's cost counted unit by unit."""
    alloc, pc = host_cache(page=16, align=16, units=700)
    su, rng = alloc.layout.slot_units, np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    base = toks(1, 200)
    while True:
        ids = base[:int(rng.integers(0, 200))] + toks(int(rng.integers(10 ** 6)), int(rng.integers(8, 120)))
        if not alloc.can_fit(-(-len(ids) // 16) * alloc.layout.num_mla_layers, 1):
            break
        pos = (len(ids) - 1) // 16 * 16
        cache_prompt(alloc, pc, ids, ckpt_at=pos if rng.random() < 0.5 else None, keep=rng.random() < 0.15)
    for c in list(pc.ckpts.values())[::3]:
        c.pins += 1  # a waiting request is about to read it
    for c in list(pc.ckpts.values()):  # some or all of the others gone: their slots are cheap runs
        if rng.random() < data.draw(st.sampled_from([0.5, 1.0])):
            pc._drop_ckpt(c)
    while alloc.free_units >= alloc.layout.num_mla_layers:  # fill what is left with one-page prompts
        cache_prompt(alloc, pc, toks(int(rng.integers(10 ** 6)), 16))
    for e in pc.pages.values():  # uses (plenty of ties)
        pc._rows.touch(e, int(rng.integers(0, 8)))
    for c in pc.ckpts.values():
        c.last_used = int(rng.integers(0, 8))

    def cost(b):  # the entries freeing units [b, b + su) evicts, counted unit by unit; None: out of reach
        pages, ckpts, slots = set(), set(), {c.slot: c for c in pc.ckpts.values()}
        for u in range(b, b + su):
            if alloc.owner[u] == alloc.SLOT:
                if b not in slots or slots[b].pins:
                    return None
                ckpts.add(slots[b].key)
            elif alloc.owner[u] == alloc.PAGE:
                holders = [e for e in pc.pages.values() if u in e.units]
                if not holders or pc.counts[u] != len(holders):
                    return None
                stack = [e.key for e in holders]
                while stack:
                    k = stack.pop()
                    if k not in pages:
                        pages.add(k)
                        stack.extend(c for c in pc.pages[k].children if c in pc.pages)
        for k in pages:
            for ck in pc.pages[k].dependents:
                if ck in pc.ckpts and pc.ckpts[ck].pins:
                    return None
                ckpts.add(ck)
        if not pages and not ckpts:
            return None
        lu = [pc.pages[k].last_used for k in pages] + [pc.ckpts[k].last_used for k in ckpts]
        return len(pages) + len(ckpts), max(lu), -b, pages, ckpts

    runs = [c for b in range(alloc.layout.scratch_slot - su, 0, -su) if (c := cost(b)) is not None]
    assert runs and not alloc._free_slot_bases(1)
    want = min(runs, key=lambda c: c[:3])
    before_pages, before_ckpts = set(pc.pages), set(pc.ckpts)
    assert pc._free_cheapest_slot_run()
    assert alloc._free_slot_bases(2) == [-want[2]]
    assert before_pages - set(pc.pages) == want[3] and before_ckpts - set(pc.ckpts) == want[4]
    # the units array the screening reads holds exactly the entries left, one row each
    rows = {e.key: list(u) for e, u in zip(pc._rows.entries, pc._rows.units.tolist()) if e is not None}
    assert rows == {k: list(e.units) for k, e in pc.pages.items()}
    assert all(u == [-1] * len(u) for e, u in zip(pc._rows.entries, pc._rows.units.tolist()) if e is None)
    # and each slot run's index of the rows holding its units is that of the units left
    held = pc._rows
    for i in range(held.num_runs):
        lo = held.run_base + i * held.slot_units
        want_rows = {r for r, e in enumerate(held.entries) if e is not None
                     and any(lo <= u < lo + held.slot_units for u in e.units)}
        assert held.in_run[i] == want_rows and held.run_rows[i] == len(want_rows)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2 ** 16))
def test_lru_walk_is_the_sorted_order_of_the_entries_left(seed):
    """Eviction walks checkpoints and pages least recently used first (a checkpoint before pages of the same
    use, deeper pages first, then the order they were cached), over page rows kept as entries come and go:
    after drops and re-registrations it is the order of sorting the entries themselves."""
    from serve.prefix_cache import PageEntry
    alloc, pc = host_cache(page=16, align=16, units=900)
    rng = np.random.default_rng(seed)
    base = toks(2, 120)
    for round_ in range(3):
        while True:
            ids = base[:int(rng.integers(0, 120))] + toks(int(rng.integers(10 ** 6)), int(rng.integers(8, 90)))
            if not alloc.can_fit(-(-len(ids) // 16) * alloc.layout.num_mla_layers, 1):
                break
            pos = (len(ids) - 1) // 16 * 16
            cache_prompt(alloc, pc, ids, ckpt_at=pos if rng.random() < 0.5 else None)
        for e in pc.pages.values():  # uses (plenty of ties)
            pc._rows.touch(e, int(rng.integers(0, 6)))
        for c in pc.ckpts.values():
            c.last_used = int(rng.integers(0, 6))
        for e in list(pc.pages.values()):  # drop some (and what hangs on them): free rows to reuse
            if e.key in pc.pages and rng.random() < 0.3:
                pc._drop_page(e)
        pc._flush_spill()
    ckpts = sorted((c for c in pc.ckpts.values() if c.pins == 0), key=lambda c: c.last_used)
    entries = ckpts + list(pc.pages.values())
    want = [e for _, e in sorted(enumerate(entries), key=lambda ie: (
        ie[1].last_used, isinstance(ie[1], PageEntry), -getattr(ie[1], "index", 0), ie[0]))]
    walk = pc._lru_order(ckpts)
    assert [e.key for e in walk()] == [e.key for e in want]
    assert [e.key for e in walk(pages_only=True)] == [e.key for e in want if isinstance(e, PageEntry)]
