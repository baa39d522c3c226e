"""The scheduler as the pure function it is (serve/scheduler.py): decode-first, FCFS among equals,
aligned chunks, no overtaking, preemption of the newest on memory shortage, and priorities (order,
victims, preempting lower priorities to admit a higher one, never an equal or higher one)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from serve.scheduler import Memory, SchedulerConfig, SeqView, schedule, units_for, waiting_cut

CFG = SchedulerConfig(max_num_seqs=4, max_prefill_seqs=2, prefill_chunk=16, align=16, token_budget=64,
                      page_size=16, num_mla_layers=2, slot_units=3)


def run(rid, order, total=40, pages=6, priority=0):  # decoding: one token left
    return SeqView(rid, order, total, total - 1, True, pages, priority=priority)


def wait(rid, order, total=40, priority=0):
    return SeqView(rid, order, total, 0, False, 0, priority=priority)


def test_decode_first_then_fcfs_chunks_on_aligned_ends():
    seqs = [wait("w2", 5, 50), run("r1", 1), SeqView("p", 2, 40, 20, True, 4), wait("w1", 3, 10)]
    plan = schedule(seqs, Memory(100, 4), CFG)
    assert plan.decode == ["r1"]
    # the partial prefill resumes to the next multiple of 16, then the oldest waiting request
    assert plan.prefill == [("p", 20, 12), ("w1", 0, 10)] and plan.admit == ["w1"]
    assert plan.grow == {"w1": units_for(10, CFG)}  # "p" holds the pages of positions < 32 already


def test_prefill_first_runs_prompt_chunks_alone_and_decodes_between():
    """`prefill_first`: a step with prompt chunks to run leaves the decodes out (and preempts nobody for
    them); a step with none decodes as usual; admission still needs a free decode row."""
    pf = replace(CFG, prefill_first=True)
    seqs = [wait("w2", 5, 50), run("r1", 1), SeqView("p", 2, 40, 20, True, 4), wait("w1", 3, 10)]
    plan = schedule(seqs, Memory(100, 4), pf)
    assert plan.decode == [] and plan.grow.get("r1") is None
    assert plan.prefill == [("p", 20, 12), ("w1", 0, 10)] and plan.admit == ["w1"]
    # the same requests under the default policy decode too (same chunks)
    assert schedule(seqs, Memory(100, 4), CFG).decode == ["r1"]
    # nothing to prefill: decodes run
    plan = schedule([run("a", 1), run("b", 2)], Memory(100, 4), pf)
    assert plan.decode == ["a", "b"] and plan.prefill == []
    # the running requests hold every decode row: the waiting one cannot start, so the step decodes
    full = [run(f"r{i}", i) for i in range(4)] + [wait("w", 9, 10)]
    plan = schedule(full, Memory(100, 4), pf)
    assert plan.prefill == [] and plan.decode == ["r0", "r1", "r2", "r3"]
    # decodes short of pages while a prompt chunk fits: the chunk runs and nobody is preempted (decode first
    # preempts the newest, the prefilling one, to let the decodes grow)
    seqs = [run("a", 1, 49), run("b", 2, 49), SeqView("p", 3, 40, 16, True, 2)]
    plan = schedule(seqs, Memory(2, 0), pf)
    assert plan.preempt == [] and plan.decode == [] and plan.prefill == [("p", 16, 16)]
    plan = schedule(seqs, Memory(2, 0), CFG)
    assert plan.preempt == ["p"] and plan.decode == ["a", "b"]


def test_no_overtaking_and_newest_preempted_when_decodes_run_short():
    plan = schedule([wait("big", 1, 200), wait("small", 2, 8)], Memory(4, 4), CFG)
    assert plan.prefill == []  # "big" does not fit, "small" may not overtake it
    # decodes that need a page per layer each (total 49 -> 4 pages per layer, 3 held) with one unit
    # free: the newest goes, and its 6 units let the other two grow
    seqs = [run("a", 1, 49), run("b", 2, 49), run("c", 3, 49)]
    plan = schedule(seqs, Memory(1, 0), CFG)
    assert plan.preempt == ["c"] and plan.decode == ["a", "b"] and plan.grow == {"a": 2, "b": 2}


def test_a_decode_victim_frees_its_slot_units_too():
    """Pages may take any free unit: a victim preempted for the decodes gives back its state slot's units as well as
    its pages, so one victim whose pages and slot cover the need is enough (a second was preempted for nothing)."""
    seqs = [run("a", 1, 33, 4), run("b", 2, 33, 4), run("c", 3, 17, 2)]  # each needs a page per layer (2 units)
    plan = schedule(seqs, Memory(0, 0), CFG)  # c frees 2 pages + 3 slot units >= the 4 that a and b need
    assert plan.preempt == ["c"] and plan.decode == ["a", "b"] and plan.grow == {"a": 2, "b": 2}
    assert plan.retracted == 1


def test_priority_orders_decodes_prefills_and_victims():
    seqs = [run(f"r{i}", i, priority=p) for i, p in enumerate([2, 0, 1, 0, 3])]
    plan = schedule(seqs, Memory(100, 4), CFG)
    assert plan.decode == ["r1", "r3", "r2", "r0"]  # max_num_seqs = 4: the lowest priority waits
    plan = schedule([wait("a", 1, priority=1), wait("b", 2, priority=0), wait("c", 3, priority=1)],
                    Memory(100, 4), CFG)
    assert [r for r, _, _ in plan.prefill] == ["b", "a"]
    seqs = [run("x", 1, 49, priority=0), run("y", 2, 49, priority=5), run("z", 3, 49, priority=5)]
    plan = schedule(seqs, Memory(2, 0), CFG)
    assert plan.preempt == ["z"] and plan.decode == ["x", "y"]  # lowest priority, newest first


def test_a_higher_priority_request_preempts_lower_ones_to_start():
    full = [run("low1", 1, pages=6, priority=3), run("low2", 2, pages=6, priority=3), run("mid", 3, pages=6)]
    urgent = wait("urgent", 9, 30, priority=-1)  # needs 3 slot units + 4 page units
    plan = schedule(full + [urgent], Memory(0, 0), CFG)
    assert plan.preempt == ["low2"]  # one victim frees enough (6 pages + 3 slot units)
    assert plan.prefill == [("urgent", 0, 16)] and plan.admit == ["urgent"]
    assert plan.decode == ["mid", "low1"]
    # equal or lower priority never preempts a running request
    for p in (3, 5):
        plan = schedule(full + [wait("w", 9, 30, priority=p)], Memory(0, 0), CFG)
        assert plan.preempt == [] and plan.prefill == []


def test_a_request_that_cannot_start_even_so_preempts_nobody():
    """A higher-priority waiting request preempts lower ones only when that lets it start: when even all of them
    would not make room (a higher-priority running request holds the rest), the lower one keeps decoding instead of
    being preempted for nothing (and recomputed later)."""
    cfg = replace(CFG, prefill_chunk=64, align=64, token_budget=128)
    seqs = [run("high", 1, 200, 26), run("low", 2, 10, 2, priority=5), wait("w", 3, 100, priority=1)]
    plan = schedule(seqs, Memory(0, 0), cfg)  # w needs 3 slot units + 8 page units; low frees 5
    assert plan.preempt == [] and plan.decode == ["high", "low"] and plan.prefill == []
    plan = schedule(seqs, Memory(6, 1), cfg)  # with 6 free, low's 5 make room: it goes, w starts
    assert plan.preempt == ["low"] and plan.admit == ["w"] and plan.decode == ["high"]


def test_a_request_that_would_not_start_this_step_preempts_nobody():
    """Step 0's preemptions for a higher-priority waiting request stand only when it starts in that step: held
    back by the admission look-ahead (the running high-priority request's expected growth), or finding no
    prefill row (a higher-priority prompt under way takes the only one), it preempts nobody; the low-priority
    request decodes on. Before, it was preempted (recomputed later) while the arena stayed idle."""
    high = SeqView("h", 1, 40, 39, True, 6, limit=440)  # 400 more tokens expected to come
    low = run("l", 2, priority=5)
    w = SeqView("w", 3, 30, 0, False, 0, priority=1, limit=230)
    plan = schedule([high, low, w], Memory(0, 0), CFG, new_token_ratio=0.7)
    assert plan.preempt == [] and plan.admit == [] and plan.decode == ["h", "l"]
    plan = schedule([high, low, w], Memory(0, 0), CFG)  # no look-ahead: it preempts and starts, as before
    assert plan.preempt == ["l"] and plan.admit == ["w"]
    prompt = SeqView("p", 1, 100, 16, True, 2)
    plan = schedule([prompt, low, wait("w", 3, 30, priority=1)], Memory(2, 0), replace(CFG, max_prefill_seqs=1))
    assert plan.preempt == [] and plan.prefill == [("p", 16, 16)] and plan.decode == ["l"]


def test_a_waiting_requests_reservation_never_stalls_a_higher_priority_prompt_under_way():
    """Step 0 holds memory for a waiting request while a lower-priority one runs; a running prompt of a higher
    priority, served before it, takes that memory back for its next chunk (as decodes do). Before, neither ran:
    the prompt stalled for as long as the low-priority request decoded (a priority inversion)."""
    p = SeqView("p", 1, 100, 32, True, 4)  # its next chunk: 2 units
    seqs = [p, run("l", 2, priority=5), wait("w", 3, 16, priority=1)]  # w: 3 slot units + 2
    plan = schedule(seqs, Memory(6, 2), CFG)
    assert plan.prefill == [("p", 32, 16)] and plan.decode == ["l"] and plan.admit == [] and plan.preempt == []
    assert schedule(seqs, Memory(7, 2), CFG).admit == ["w"]  # room for both: both run


def test_at_most_max_num_seqs_requests_run():
    """vLLM's max_num_seqs: with 3 of 4 decode rows taken, one waiting request is admitted and the next waits
    in the queue (holding nothing) although memory is plentiful; a partially prefilled running request
    keeps its row; prefill-only rows (canonical re-prefills) take none, a beam search its width. A higher-priority request finding
    every row taken preempts a lower-priority one for its row, never an equal one."""
    three = [run("a", 1), run("b", 2), SeqView("p", 3, 40, 20, True, 4)]
    plan = schedule(three + [wait("w1", 4), wait("w2", 5), wait("w3", 6)], Memory(1000, 10), CFG)
    assert plan.decode == ["a", "b"] and plan.admit == ["w1"] and plan.preempt == []
    assert [r for r, _, _ in plan.prefill] == ["p", "w1"]
    canon = SeqView("c", 7, 32, 0, False, 0, rows=0)
    plan = schedule(three + [run("d", 4), canon], Memory(1000, 10), CFG)
    assert plan.admit == ["c"]
    beams = SeqView("bs", 4, 32, 0, False, 0, rows=2)  # a beam search of width 2 needs both free rows
    assert schedule(three + [beams], Memory(1000, 10), CFG).admit == []
    assert schedule(three[:2] + [beams], Memory(1000, 10), CFG).admit == ["bs"]
    full = [run("a", 1), run("b", 2), run("c", 3, priority=2), run("d", 4)]
    plan = schedule(full + [wait("urgent", 5, priority=-1)], Memory(1000, 10), CFG)
    assert plan.preempt == ["c"] and plan.admit == ["urgent"] and plan.decode == ["a", "b", "d"]
    plan = schedule(full + [wait("w", 5, priority=2)], Memory(1000, 10), CFG)
    assert plan.preempt == [] and plan.admit == [] and len(plan.decode) == 4


def test_a_request_short_of_a_decode_row_preempts_no_row_that_never_decodes():
    """A higher-priority request that finds every decode row taken (memory plentiful) preempts a lower-priority
    request that holds a row, never a canonical re-prefill row (the lowest priority, holding no decode row): that
    freed nothing it lacked, and its work was lost. Short of memory too, the canonical row may still go first."""
    full = [run("a", 1, priority=2), run("b", 2, priority=2), run("c", 3, priority=2), run("d", 4, priority=2)]
    canon = SeqView("k", 5, 112, 64, True, 8, priority=1 << 30, rows=0)
    plan = schedule(full + [canon, wait("urgent", 6, priority=-1)], Memory(1000, 10), CFG)
    assert plan.preempt == ["d"] and plan.admit == ["urgent"] and ("k", 64, 16) in plan.prefill
    plan = schedule(full + [canon, wait("urgent", 6, priority=-1)], Memory(0, 0), CFG)
    assert plan.preempt == ["k", "d"] and plan.admit == ["urgent"]


def test_admission_looks_ahead_at_the_running_requests_growth():
    """SGLang's new-token ratio: a waiting request that fits now is held back while the running ones are
    expected to need the pages (their remaining max_tokens x ratio); ratio 0 admits it; with nothing
    running the first request is admitted whatever its own projection."""
    r = SeqView("r", 1, 40, 39, True, 6, limit=40 + 160)  # 160 more tokens: 10 pages x 2 layers
    w = SeqView("w", 2, 16, 0, False, 0, limit=16 + 64)
    # w's first chunk takes 2 units + its 3-unit slot; r is expected to reach 40 + 80 tokens (8 pages x 2
    # layers: 10 units more than its 6), w 16 + 32 (6 units: 4 more than its first chunk's)
    assert schedule([r, w], Memory(18, 2), CFG).admit == ["w"]  # ratio 0: what fits now
    plan = schedule([r, w], Memory(18, 2), CFG, new_token_ratio=0.5)
    assert plan.decode == ["r"] and plan.admit == [] and plan.retracted == 0
    assert schedule([r, w], Memory(19, 2), CFG, new_token_ratio=0.5).admit == ["w"]  # 2 + 3 + 10 + 4 = 19
    lone = SeqView("x", 1, 16, 0, False, 0, limit=10_000)
    assert schedule([lone], Memory(5, 1), CFG, new_token_ratio=1.0).admit == ["x"]  # nothing running
    # decodes that run short preempt (and count as retractions, which raise the engine's ratio)
    seqs = [run("a", 1, 49), run("b", 2, 49), run("c", 3, 49)]
    plan = schedule(seqs, Memory(1, 0), CFG, new_token_ratio=0.5)
    assert plan.preempt == ["c"] and plan.retracted == 1


def test_running_adapters_stay_within_the_lora_slots():
    """With two LoRA slots and adapter 1 running, the oldest waiting request of adapter 2 is admitted;
    one of adapter 3 is then skipped (not blocking the base-model request behind it), and adapter 2's
    next request joins. A third adapter never preempts for memory it could not use."""
    cfg = SchedulerConfig(**{**CFG.__dict__, "max_prefill_seqs": 4, "max_loras": 2})
    seqs = [SeqView("r", 1, 40, 39, True, 6, adapter=1), SeqView("w2", 2, 10, 0, False, 0, adapter=2),
            SeqView("w3", 3, 10, 0, False, 0, adapter=3), SeqView("wb", 4, 10, 0, False, 0),
            SeqView("w2b", 5, 10, 0, False, 0, adapter=2)]
    plan = schedule(seqs, Memory(100, 4), cfg)
    assert plan.decode == ["r"] and plan.admit == ["w2", "wb", "w2b"]
    # a higher-priority request of a third adapter may not preempt for memory while both slots are busy
    busy = [SeqView("r1", 1, 40, 39, True, 6, adapter=1), SeqView("r2", 2, 40, 39, True, 6, adapter=2, priority=5),
            SeqView("hi", 3, 10, 0, False, 0, adapter=3, priority=-1)]
    plan = schedule(busy, Memory(0, 0), cfg)
    assert plan.preempt == [] and plan.admit == []
    plan = schedule(busy, Memory(100, 4), cfg)
    assert plan.admit == []  # memory is there, an adapter slot is not


def test_a_long_prompt_alone_takes_the_long_row():
    """With a long prefill program (one row of 48 tokens), a step with one prefill row gives it up to 48
    tokens (to the last multiple of 16 within reach, stopping at a capture point, within the token budget
    and the memory) instead of 16; two prompts keep rows of 16 unless the first alone computes more."""
    cfg = replace(CFG, long_prefill_chunk=48)
    plan = schedule([run("r", 1), wait("w", 2, 100)], Memory(100, 4), cfg)
    assert plan.decode == ["r"] and plan.prefill == [("w", 0, 48)] and plan.row_tokens == 48
    assert plan.admit == ["w"] and plan.grow == {"w": units_for(48, cfg)}
    # resuming off a row boundary (a prefix-cache hit at 8): the row ends at the last multiple of 16
    assert schedule([SeqView("p", 1, 100, 8, True, 2)], Memory(100, 4), cfg).prefill == [("p", 8, 40)]
    # a capture point ends the row early; the prompt's end does too
    assert schedule([SeqView("p", 1, 100, 16, True, 2, stop=40)], Memory(100, 4), cfg).prefill == [("p", 16, 24)]
    assert schedule([SeqView("p", 1, 100, 64, True, 8)], Memory(100, 4), cfg).prefill == [("p", 64, 36)]
    # the token budget cuts the long row on an aligned boundary (41 - 1 decode = 40 -> 32 tokens)
    assert schedule([run("r", 1), wait("w", 2, 100)], Memory(100, 4), replace(cfg, token_budget=41)
                    ).prefill == [("w", 0, 32)]
    # memory for the pages of 16 tokens but not of 48: the long row is cut to 16
    plan = schedule([wait("w", 1, 100)], Memory(units_for(16, cfg) + cfg.slot_units, 1), cfg)
    assert plan.prefill == [("w", 0, 16)] and plan.row_tokens == 48
    # a short prompt alone: the one-row program too (so a prompt alone runs every row in one program)
    plan = schedule([wait("s", 1, 12)], Memory(100, 4), cfg)
    assert plan.prefill == [("s", 0, 12)] and plan.row_tokens == 48
    # two long prompts: 48 tokens of the first beat 16 + 16 of both; the first goes alone (FCFS, as vLLM
    # gives the oldest prompt the token budget)...
    plan = schedule([wait("a", 1, 100), wait("b", 2, 100)], Memory(100, 4), cfg)
    assert plan.prefill == [("a", 0, 48)] and plan.row_tokens == 48
    # ...unless the first is nearly done: 10 + 16 of both beat its 10 alone
    plan = schedule([SeqView("a", 1, 42, 32, True, 4), wait("b", 2, 100)], Memory(100, 4), cfg)
    assert plan.prefill == [("a", 32, 10), ("b", 0, 16)] and plan.row_tokens == 0
    assert schedule([wait("w", 1, 100)], Memory(100, 4), CFG).row_tokens == 0  # no long program: rows of 16


def test_prompts_under_way_that_do_not_fit_preempt_newer_idle_ones():
    """Partly prefilled requests that each hold part of the arena, none of whose next rows fits: the oldest
    takes the memory of the newest ones nothing in the step uses (before, nobody moved, forever)."""
    seqs = [SeqView("p1", 1, 100, 16, True, 2), SeqView("p2", 2, 100, 32, True, 4),
            SeqView("p3", 3, 100, 32, True, 4)]
    plan = schedule(seqs, Memory(0, 0), CFG)
    assert plan.preempt == ["p3"] and plan.retracted == 1
    assert plan.prefill[0] == ("p1", 16, 16) and "p3" not in [r for r, _, _ in plan.prefill]
    # a newer request that decodes in this step keeps its memory; nobody yields where it would not be enough
    busy = [SeqView("p1", 1, 100, 16, True, 2), run("d", 2, 49, pages=8)]
    assert schedule(busy, Memory(0, 0), CFG).preempt == []
    assert schedule(seqs[:1] + [SeqView("p2", 2, 100, 16, True, 2)], Memory(0, 0),
                    replace(CFG, slot_units=0)).preempt == ["p2"]
    big = SeqView("p1", 1, 200, 0, True, 0, stop=None)
    assert schedule([replace(big, computed=16, pages=2), SeqView("q", 2, 40, 16, True, 0)], Memory(0, 0),
                    replace(CFG, slot_units=0)).preempt == []  # "q" holds nothing to give


@settings(max_examples=60, deadline=None)
@given(arena=st.integers(12, 40), reqs=st.lists(st.tuples(st.integers(1, 90), st.integers(1, 30), st.integers(0, 2)),
                                                min_size=1, max_size=10))
def test_every_request_finishes_whatever_the_arena(arena, reqs):
    """Liveness: the engine's cycle (plan, preempt, admit, grow, advance) over a random workload in an arena
    that fits each request alone, but not all at once, ends every request; memory never runs negative."""
    cfg = replace(CFG, max_num_seqs=3, max_prefill_seqs=2)
    total = {f"r{i}": p for i, (p, _, _) in enumerate(reqs)}
    limit = {f"r{i}": p + g for i, (p, g, _) in enumerate(reqs)}
    prio = {f"r{i}": pr for i, (_, _, pr) in enumerate(reqs)}
    if any(units_for(n, cfg) + cfg.slot_units > arena for n in limit.values()):
        return  # (the engine rejects those before they take memory)
    computed, held, running, done = dict.fromkeys(total, 0), dict.fromkeys(total, 0), set(), set()
    for _ in range(3000):
        live = [r for r in total if r not in done]
        if not live:
            return
        used = sum(held.values()) + cfg.slot_units * len(running)
        assert used <= arena
        views = [SeqView(r, int(r[1:]), total[r], computed[r], r in running, held[r], priority=prio[r],
                         limit=limit[r]) for r in live]
        plan = schedule(views, Memory(arena - used, (arena - used) // cfg.slot_units), cfg)
        for r in plan.preempt:
            running.discard(r)
            computed[r], held[r] = 0, 0
        running.update(plan.admit)
        for r, n in plan.grow.items():
            held[r] += n
        for r, start, n in plan.prefill:
            assert start == computed[r]
            computed[r] = start + n
        for r in plan.decode:
            computed[r] = total[r]
        for r in plan.decode + [r for r, _, _ in plan.prefill]:
            if computed[r] == total[r]:  # a row that ends the known tokens samples the next one
                total[r] += 1
                if total[r] >= limit[r]:
                    done.add(r)
                    running.discard(r)
                    held[r] = 0
    raise AssertionError(f"not finished: {[(r, computed[r], total[r], r in running) for r in total if r not in done]}")


def test_a_waiting_request_held_back_never_stalls_the_running_prompts_behind_it():
    """A waiting request that fits but is held back by the admission look-ahead (or does not fit) stops the
    admissions after it, not the running prompts of lower priority behind it (a canonical re-prefill row, a
    low-priority request): they hold memory that only their progress gives back. Before, the FCFS stop left
    such a step with nothing to run, and the engine stalled for good (found with a small arena)."""
    canonical = SeqView("c", 1, 112, 64, True, 8, priority=1 << 30, rows=0)
    low = SeqView("l", 2, 112, 64, True, 8, priority=5)
    for running in (canonical, low):
        seqs = [running, wait("w", 3, 110), wait("w2", 4, 20)]
        plan = schedule(seqs, Memory(10, 2), CFG, new_token_ratio=0.7)
        assert plan.prefill == [(running.rid, 64, 16)] and plan.admit == [] and plan.preempt == []
        # without the look-ahead both waiting requests are admitted (their reservations taken)
        plan = schedule(seqs, Memory(10, 2), CFG)
        assert plan.admit == ["w", "w2"] and plan.preempt == []
    # a waiting request that does not fit at all preempts the lower priorities (step 0), as before
    plan = schedule([low, wait("w", 3, 110)], Memory(2, 0), CFG)
    assert plan.preempt == ["l"] and plan.admit == ["w"]


def test_a_budget_under_one_aligned_row_beside_the_decodes_starts_prompts_in_waves():
    """max_num_batched_tokens 64 with max_num_seqs 4: beside three decodes 61 tokens are left, under one aligned
    row of 16 * 4, so a longer prompt starts only once a running request finishes (EngineConfig.starved_prompts says
    so at start-up); a budget of max_num_seqs - 1 + align starts it beside them."""
    cfg = replace(CFG, align=64, prefill_chunk=64)
    seqs = [run(f"r{i}", i) for i in range(3)] + [wait("w", 9, 100)]
    assert schedule(seqs, Memory(100, 4), cfg).prefill == []
    assert schedule(seqs, Memory(100, 4), replace(cfg, token_budget=3 + 64)).prefill == [("w", 0, 64)]


@settings(max_examples=25, deadline=None)
@given(done=st.integers(0, 6), left=st.integers(2, 120), free=st.integers(6, 40), canonical=st.booleans())
def test_a_prompt_going_on_past_a_held_back_request_takes_the_long_row(done, left, free, canonical):
    """A running prompt of a lower priority that goes on while a waiting request is held back (the look-ahead,
    or memory) gets the long row, as it would alone. Before, the long plan was made without that rule, found
    nothing to run and the prompt kept rows of prefill_chunk (in the long program: a third of its tokens)."""
    cfg = replace(CFG, long_prefill_chunk=48)
    p = SeqView("p", 1, done * 16 + left, done * 16, True, units_for(done * 16, cfg), priority=1 << 30 if canonical
                else 5, rows=0 if canonical else 1)
    w = SeqView("w", 2, 110, 0, False, 0, limit=10_000)
    plan = schedule([p, w], Memory(free, 2), cfg, new_token_ratio=0.7)
    if plan.admit or plan.preempt:
        return
    assert plan.prefill == schedule([p], Memory(free, 2), cfg, new_token_ratio=0.7).prefill


@settings(max_examples=25, deadline=None)
@given(prompt=st.integers(17, 120), free=st.integers(5, 30))
def test_memory_held_for_a_higher_priority_request_counts_for_its_long_row(prompt, free):
    """Step 0 holds memory for a waiting request that has lower priorities to preempt; its long row may use that
    memory as a request with no one to preempt would. Before, the row was cut to fit what was left beside the
    memory held for it, so a higher priority got a shorter long row (32 tokens of 48 with 12 units free here)."""
    cfg = replace(CFG, long_prefill_chunk=48)
    w = wait("w", 2, prompt)
    plans = [schedule([run("r", 1, priority=p), w], Memory(free, 2), cfg) for p in (5, 0)]
    if not plans[0].preempt:
        assert plans[0].prefill == plans[1].prefill


_RUNNING = st.tuples(st.integers(1, 90), st.integers(0, 89), st.integers(0, 2), st.integers(0, 2), st.booleans(),
                     st.integers(0, 3))  # (total, computed, priority, adapter, canonical, drafts)
_WAITING = st.tuples(st.integers(1, 90), st.integers(0, 2), st.integers(0, 2), st.integers(0, 200))


@settings(max_examples=300, deadline=None)
@given(running=st.lists(_RUNNING, max_size=5), waiting=st.lists(_WAITING, max_size=40),
       free=st.integers(0, 200), slots=st.integers(0, 12), ratio=st.sampled_from([0.0, 0.6]),
       form=st.sampled_from(["plain", "lora", "lora2", "long", "prefill_first"]))
def test_the_waiting_requests_behind_waiting_cut_change_no_plan(running, waiting, free, slots, ratio, form):
    """The engine shows the scheduler only the waiting requests up to `waiting_cut`: with thousands queued, viewing
    and matching every one every step made an offline batch's host time quadratic in its size. The plan over them is
    the plan over all: priorities, preemptions, look-ahead, LoRA slots, the long row and prefill-first included."""
    cfg = {"plain": CFG, "lora": replace(CFG, max_loras=1), "lora2": replace(CFG, max_loras=2),
           "long": replace(CFG, long_prefill_chunk=48), "prefill_first": replace(CFG, prefill_first=True)}[form]
    adapters = form.startswith("lora")
    seqs = [SeqView(f"r{i}", i, t, min(c, t - 1), True, units_for(min(c, t - 1), cfg), priority=1 << 30 if canon else p,
                    adapter=a if adapters and not canon else 0, rows=0 if canon else 1, draft=d, limit=t + 20)
            for i, (t, c, p, a, canon, d) in enumerate(running[:cfg.max_num_seqs])]
    queue = sorted((SeqView(f"w{i}", 10 + i, t, 0, False, 0, priority=p, adapter=a if adapters else 0, limit=t + g)
                    for i, (t, p, a, g) in enumerate(waiting)), key=lambda s: (s.priority, s.order))
    cut = waiting_cut(cfg, slots, [(s.priority, s.adapter) for s in seqs],
                      [(s.priority, s.adapter, True) for s in queue])
    mem = Memory(free, slots)
    plan = schedule(seqs + queue, mem, cfg, ratio)
    assert schedule(seqs + queue[:cut], mem, cfg, ratio) == plan


_MANY = st.integers(0, 5)  # adapters, 0: the base model
_RUNNING_MANY = st.tuples(st.integers(1, 90), st.integers(0, 89), st.integers(0, 2), _MANY, st.booleans(),
                          st.integers(0, 3))  # (total, computed, priority, adapter, canonical, drafts)
_WAITING_MANY = st.tuples(st.integers(1, 90), st.integers(0, 2), _MANY, st.integers(0, 200))


@settings(max_examples=200, deadline=None)
@given(running=st.lists(_RUNNING_MANY, max_size=5), waiting=st.lists(_WAITING_MANY, max_size=40),
       free=st.integers(0, 200), slots=st.integers(0, 12), ratio=st.sampled_from([0.0, 0.6]),
       loras=st.integers(1, 3), extra=st.dictionaries(_MANY, st.integers(0, 3)), hidden=st.sets(st.integers(0, 39)),
       long=st.booleans())
def test_a_queue_of_more_adapters_than_lora_slots_is_cut_without_changing_plans(running, waiting, free, slots, ratio,
                                                                                  loras, extra, hidden, long):
    """A queue whose requests use more adapters than `max_loras` made `waiting_cut` see the whole queue (its requests
    of adapters past the slots never count). Given how many requests of each adapter the queue holds (`queued`, an
    upper bound: the engine's count keeps entries it has not dropped yet), it stops once the adapters that can take
    a slot are settled: the plan over the cut is still the plan over all, those sitting out (`shown` False) too."""
    cfg = replace(CFG, max_loras=loras, long_prefill_chunk=48 if long else 0)
    seqs = [SeqView(f"r{i}", i, t, min(c, t - 1), True, units_for(min(c, t - 1), cfg), priority=1 << 30 if canon else p,
                    adapter=0 if canon else a, rows=0 if canon else 1, draft=d, limit=t + 20)
            for i, (t, c, p, a, canon, d) in enumerate(running[:cfg.max_num_seqs])]
    active = {s.adapter for s in seqs if s.adapter}
    while len(active) > loras:  # (the scheduler keeps the running requests within the slots)
        gone = active.pop()
        seqs = [replace(s, adapter=0) if s.adapter == gone else s for s in seqs]
    queue = sorted((SeqView(f"w{i}", 10 + i, t, 0, False, 0, priority=p, adapter=a, limit=t + g)
                    for i, (t, p, a, g) in enumerate(waiting)), key=lambda s: (s.priority, s.order))
    queued = {}
    for s in queue:
        queued[s.adapter] = queued.get(s.adapter, 0) + 1
    for a, k in extra.items():
        queued[a] = queued.get(a, 0) + k
    cut = waiting_cut(cfg, slots, [(s.priority, s.adapter) for s in seqs],
                      [(s.priority, s.adapter, i not in hidden) for i, s in enumerate(queue)], queued)
    shown = [s for i, s in enumerate(queue) if i not in hidden]
    mem = Memory(free, slots)
    plan = schedule(seqs + shown, mem, cfg, ratio)
    assert schedule(seqs + [s for s in queue[:cut] if s in shown], mem, cfg, ratio) == plan


def test_waiting_cut_of_a_queue_cycling_through_more_adapters_than_slots():
    """3,000 waiting requests cycling through 6 adapters, 2 LoRA slots held by two running requests: without the
    queue's counts each step saw all of them; with them, as many as it takes each adapter that may get a slot to show
    the requests that stop the scheduler."""
    cfg = replace(CFG, max_loras=2)
    running = [(0, 1), (0, 2)]
    waiting = [(0, 1 + i % 6, True) for i in range(3000)]
    queued = {a: 500 for a in range(1, 7)}
    assert waiting_cut(cfg, 4, running, waiting) is None
    cut = waiting_cut(cfg, 4, running, waiting, queued)
    assert cut is not None and cut <= 6 * (cfg.max_prefill_seqs + 1)
    # a base-model request at the very end may still be admitted: the whole queue
    assert waiting_cut(cfg, 4, running, waiting + [(0, 0, True)], {**queued, 0: 1}) == 3001
    # one running adapter leaves a slot free: an adapter met after the base model's last request may take it
    assert waiting_cut(cfg, 4, [(0, 1)], [(0, 0, True), (0, 2, True), (0, 2, True)], {0: 1, 2: 2}) == 3
    # only requests of an adapter not running: it takes a slot if a running request is preempted
    assert waiting_cut(cfg, 4, running, [(0, 3, True)] * 10, {3: 10}) == cfg.max_prefill_seqs + 1


def test_waiting_cut_counts_the_adapters_of_pending_canonical_rows():
    """A canonical row not admitted yet (the prefix cache's, at a place it borrows) is a waiting row the scheduler
    admits ahead of the queue, and its adapter takes a LoRA slot. Left out of the cut, requests of that adapter behind
    it were not admitted with it: the queue's counts cut [A, B, C, C] after [A, B] (both settled), the requests'
    takers cut [A, B, B, B, C] after the Bs (counted as taking the second slot, the canonical row's)."""
    canon = SeqView("c", 9, 32, 0, False, 0, adapter=3, rows=0)
    mem = Memory(200, 8)
    for adapters, rows in (([1, 2, 3, 3], 4), ([1, 2, 2, 2, 3], 3)):
        cfg = replace(CFG, max_num_seqs=6, max_prefill_seqs=rows, max_loras=2)
        queue = [SeqView(f"w{i}", 10 + i, 16, 0, False, 0, adapter=a) for i, a in enumerate(adapters)]
        queued = {a: adapters.count(a) for a in adapters}
        cut = waiting_cut(cfg, 8, [], [(0, a, True) for a in adapters], queued, pending=[3])
        plan = schedule([canon] + queue, mem, cfg)
        assert f"w{adapters.index(3)}" in plan.admit  # (a request of the row's adapter goes with it)
        assert schedule([canon] + queue[:cut], mem, cfg) == plan


def test_a_request_skipped_for_its_adapter_holds_back_no_one_at_the_token_budget():
    """A waiting request whose adapter is one too many is skipped; met when the token budget left cuts its row to
    nothing, it stopped the prefill rows there, holding back a prompt under way behind it whose row still fits. The
    plan then depended on such a request (the waiting cut leaves those behind it out: the plan over the cut ran the
    prompt, the plan over the whole queue did not); it is skipped before the budget is looked at."""
    cfg = replace(CFG, max_num_seqs=6, max_prefill_seqs=5, max_loras=1)
    decoding = SeqView("d", 0, 11, 10, True, units_for(10, cfg), adapter=1)
    prompt = SeqView("p", 1, 40, 32, True, units_for(32, cfg), priority=5)  # 8 tokens left
    queue = [SeqView(f"w{i}", 10 + i, t, 0, False, 0, adapter=a) for i, (a, t) in
             enumerate([(1, 16), (1, 16), (1, 16), (3, 8), (2, 16)])]  # (adapters 3 and 2 skipped; 2: 16 > 15 left)
    cut = waiting_cut(cfg, 8, [(0, 1), (5, 0)], [(0, s.adapter, True) for s in queue], {1: 3, 2: 1, 3: 1})
    mem = Memory(200, 8)
    plan = schedule([decoding, prompt] + queue, mem, cfg)
    assert ("p", 32, 8) in plan.prefill
    assert cut == 4 and schedule([decoding, prompt] + queue[:cut], mem, cfg) == plan
