"""The scheduler: a pure function from the scheduler's view of the requests and the free memory to
one step plan. It never touches device arrays or the allocator; the engine carries the plan out.

Policy (requests ordered by (priority, arrival): a lower priority value goes first, equal priorities
are first come, first served):
- decode first: every running request with one token left to compute decodes (up to max_num_seqs);
  with `prefill_first` (SGLang's schedule without mixed chunks) a step that has prompt chunks to run
  runs only those and the decodes wait for the next step without any. Admission needs a free decode
  row, so at most max_num_seqs prompts prefill in a row before the decodes run again. An offline
  wave finishes sooner (the decodes a mixed step would add are work the full-batch decode steps do
  anyway), at the price of a gap in the running requests' streams whenever prompts arrive;
- at most max_num_seqs requests run at once (vLLM's meaning of the option): a request is admitted only
  while a decode row is free for it, so nobody admitted finishes its prompt to wait for a row (FCFS
  decode rows would stall the newest running requests for whole generations); prefill-only rows (the
  prefix cache's canonical re-prefills) take no decode row, a beam search takes its width;
- then prefill chunks in that order, partially prefilled running requests before waiting ones of
  the same priority;
  a waiting request that does not fit blocks the ones behind it (no overtaking);
- a waiting request that does not fit may preempt running requests of a strictly lower priority
  (the lowest first, newest first among equals; for a decode row alone, only ones that hold a row) until
  its first chunk fits, only when it then starts
  in this step (not held back by the look-ahead below, a prefill row and the token budget left for it);
- chunk ends sit on multiples of `prefill_chunk` in absolute positions, which is where the prefix
  cache keeps KDA checkpoints; a prefill row also stops at `align_stop` points (prompt ends);
- a long prompt alone: KDA's recurrence keeps a request's chunks in one row, one after another, so a
  prompt with no other prompt to share the step would advance one `prefill_chunk` per step in the
  widest program. With a `long_prefill_chunk` program (the engine's one-row program) a step with one
  prefill row gives it up to that many tokens (ending on a multiple of `prefill_chunk`, at a stop point
  or where memory runs out), and a step whose rows of `prefill_chunk` would compute fewer prompt tokens
  than that takes the one long row instead;
- memory: a request needs a state slot once and MLA pages as its context grows; when decodes cannot
  get their next pages, the newest running requests are preempted (their memory is freed and they
  are recomputed later, never corrupted); so are running requests newer than a partly prefilled one
  whose next row does not fit, when nothing else in the step uses them and their memory makes it fit
  (else prompts admitted together could each hold part of the arena and wait on each other forever);
- admission looks ahead (SGLang's new-token ratio): a waiting request is admitted only if, after its
  first chunk, the free pages still cover the growth every running request (and it) is expected to
  need: the rest of its prompt plus `new_token_ratio` of its remaining max_tokens. The engine keeps
  the ratio adaptive (high after a preemption, decaying while none happens), so a burst of long
  generations does not fill the arena with requests that would preempt each other (each preemption
  recomputes). With nothing running, the first request is admitted regardless;
- LoRA adapters (serve/lora.py): the running requests use at most `max_loras` distinct adapters (the
  device slots); a waiting request whose adapter would be one too many is skipped, holding back no one
  (others of loaded adapters may go ahead of it, as in vLLM) until a running adapter's requests finish;
- speculative drafts (serve/speculative.py) ride on decodes: a decode with d drafts computes 1 + d
  tokens and needs pages for them; drafts are optional and are the first thing dropped when pages or
  the token budget run short.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int  # rows of the largest decode bucket
    max_prefill_seqs: int  # rows of the largest prefill bucket
    prefill_chunk: int  # tokens per prefill row
    align: int  # prefill rows start on multiples of this (the KDA chunk alignment)
    token_budget: int  # tokens computed per step (decode + prefill)
    page_size: int
    num_mla_layers: int
    slot_units: int
    max_loras: int = 0  # distinct LoRA adapters the running requests may use at once (0: no adapters)
    prefill_first: bool = False  # steps with prompt chunks to run do not decode (module docstring)
    long_prefill_chunk: int = 0  # tokens of the one-row long prefill program (module docstring); 0: none


@dataclass(frozen=True)
class SeqView:
    """What the scheduler needs to know about one request."""

    rid: str
    order: int  # arrival order (FCFS)
    total: int  # tokens known (prompt + generated)
    computed: int  # tokens whose state is in the cache
    running: bool  # holds a state slot
    pages: int  # MLA units held (all layers)
    stop: int | None = None  # a position the next prefill row must end at (KDA checkpoint capture)
    priority: int = 0  # lower runs first (vLLM's convention)
    draft: int = 0  # speculative tokens proposed for its next decode
    limit: int | None = None  # the most tokens it can reach (prompt + max_tokens); None: `total`
    adapter: int = 0  # its LoRA adapter (a nonzero id), 0: the base model
    rows: int = 1  # decode rows it takes while running: 0 for a row that never decodes (a canonical
    #                re-prefill), a beam search's width for its first sequence (its beams fork from it)


@dataclass(frozen=True)
class Memory:
    free_units: int
    free_slots: int  # slot-aligned free runs available for new state slots


@dataclass
class StepPlan:
    decode: list[str] = field(default_factory=list)
    prefill: list[tuple[str, int, int]] = field(default_factory=list)  # (rid, start, length)
    admit: list[str] = field(default_factory=list)  # need a state slot before this step
    grow: dict[str, int] = field(default_factory=dict)  # rid -> MLA units to add
    draft: dict[str, int] = field(default_factory=dict)  # rid -> drafts its decode verifies
    preempt: list[str] = field(default_factory=list)
    retracted: int = 0  # of `preempt`: running requests preempted because decodes or prompts ran out of pages
    row_tokens: int = 0  # the prefill program's tokens per row: 0 prefill_chunk, else the long row's

    @property
    def empty(self) -> bool:
        return not (self.decode or self.prefill)


def units_for(tokens: int, cfg: SchedulerConfig) -> int:
    return -(-tokens // cfg.page_size) * cfg.num_mla_layers


def chunk_end(computed: int, total: int, cfg: SchedulerConfig) -> int:
    """Where the prefill row starting at `computed` ends (chunk-aligned, at most `total`)."""
    return min(total, (computed // cfg.prefill_chunk + 1) * cfg.prefill_chunk)


def _first_chunk(s: SeqView, cfg: SchedulerConfig) -> int:
    """Units a waiting request needs for its slot and first prefill row."""
    return cfg.slot_units + max(0, units_for(chunk_end(s.computed, s.total, cfg), cfg) - s.pages)


def expected_growth(s: SeqView, held: int, ratio: float, cfg: SchedulerConfig) -> int:
    """MLA units `s` is expected to need beyond the `held` ones: its whole prompt, then `ratio` of the
    tokens it may still generate."""
    limit = max(s.total, s.limit if s.limit is not None else s.total)
    return max(0, units_for(s.total + math.ceil(ratio * (limit - s.total)), cfg) - held)


def waiting_cut(cfg: SchedulerConfig, free_slots: int, running: list[tuple[int, int]],
                waiting: Iterable[tuple[int, int, bool]], queued: Optional[dict] = None,
                pending: Iterable[int] = ()) -> Optional[int]:
    """How many of the waiting requests `schedule` may look at -> that many of `waiting` (their (priority, adapter,
    shown) in (priority, arrival) order; shown False: left out of the plan), None: all. `running`: the running
    requests' (priority, adapter). A shown request whose adapter cannot be one too many (all the adapters up to it
    fit the LoRA slots) is one the scheduler, meeting it, admits into a prefill row, holds a state slot for by
    preempting (step 0 of `_plan`, only while a running request has a lower priority), or stops the admissions at;
    once that many met every one, those behind change nothing. So the engine views (and matches against the prefix
    cache) only those: a step's host work must not grow with a queue of thousands.

    `queued` (adapter -> requests of it in the whole queue, `waiting` included; more is fine) bounds a queue of
    more adapters than `max_loras` too (`_adapters_settled`), where the requests counted above run out.

    `pending`: the adapters of waiting rows the scheduler sees beside `waiting` (the prefix cache's canonical rows
    not admitted yet, at places they borrow): admitted ahead of requests of `waiting`, each may take a LoRA slot, so
    they count as taken (left out, a request of such an adapter behind the cut was not admitted with it)."""
    adapters, want, takers = {a for _, a in running if a}, 0, 0
    free_lora = len(adapters) < cfg.max_loras  # (step 0 checks the running requests' adapters alone)
    adapters |= {a for a in pending if a}
    fixed = frozenset(adapters | {0})  # (the running requests' and pending rows' adapters, and the base model)
    seen: dict[int, int] = {}  # adapter -> requests of it in `waiting` so far
    met: dict[int, int] = {}  # adapter -> shown requests of it so far
    first: list[int] = []  # the shown requests' adapters not in `fixed`, in the order they first come
    step0 = False
    for i, (priority, adapter, shown) in enumerate(waiting):
        if not want:
            want = cfg.max_prefill_seqs + 1
            step0 = any(p > priority for p, _ in running)  # (the first request's priority: the highest)
            if step0:
                want += free_slots + len(running)
        seen[adapter] = seen.get(adapter, 0) + 1
        if not shown:
            continue
        met[adapter] = met.get(adapter, 0) + 1
        if adapter not in fixed and adapter not in first:
            first.append(adapter)
        if adapter:
            adapters.add(adapter)
        takers += not adapter or len(adapters) <= cfg.max_loras
        if takers >= want:
            return i + 1
        if queued is not None and _adapters_settled(cfg, fixed, first, seen, met, queued, want, i + 1,
                                                   step0 and free_lora):
            return i + 1
    return None


def _adapters_settled(cfg: SchedulerConfig, fixed: frozenset, first: list[int], seen: dict, met: dict,
                      queued: dict, want: int, n: int, open_step0: bool) -> bool:
    """Whether the requests behind the first `n` of the queue change no plan, however many adapters it holds.
    The adapters that can pass `_plan`'s LoRA check in its prefill rows are the running and pending rows' (`fixed`)
    and the first `max_loras` others in queue order (`first`): the check admits new ones in that order while a slot
    is free and never again once none is (a running adapter whose requests are preempted becomes a new one). An
    adapter that passes it passes it for every request of it met. So once each such adapter has `want` requests
    shown (its requests alone stop the scheduler) or none left behind (`queued`: those of the whole queue), the
    requests behind are all skipped; and unless every adapter fills the slots (`first` is short), none of them may
    be of an adapter not seen yet. Step 0 (preemption) takes every adapter while the running ones leave a slot
    free (`open_step0`): then `want` requests shown, or none left, bound it too."""
    left = lambda a: queued.get(a, 0) - seen.get(a, 0)  # noqa: E731
    if open_step0 and sum(met.values()) < want and sum(queued.values()) > n:
        return False
    possible = list(fixed) + first[:cfg.max_loras]
    if any(left(a) > 0 and met.get(a, 0) < want for a in possible):
        return False
    if len(first) < cfg.max_loras:  # an adapter not met yet may take a slot: only those met may be left
        if sum(queued.values()) - n > sum(max(0, left(a)) for a in possible):
            return False
    return True


def schedule(seqs: list[SeqView], mem: Memory, cfg: SchedulerConfig, new_token_ratio: float = 0.0) -> StepPlan:
    """`new_token_ratio` > 0 turns on the admission look-ahead (module docstring)."""
    if cfg.prefill_first:
        plan = _plan_rows(seqs, mem, cfg, new_token_ratio, decode=False)
        if plan.prefill:
            return plan
    return _plan_rows(seqs, mem, cfg, new_token_ratio, decode=True)


def _prompt_tokens(plan: StepPlan) -> int:
    return sum(n for _, _, n in plan.prefill)


def _plan_rows(seqs: list[SeqView], mem: Memory, cfg: SchedulerConfig, new_token_ratio: float, decode: bool) -> StepPlan:
    """The plan with prefill rows of `prefill_chunk` tokens, or the plan whose one prefill row is the long
    program's: always when the first plan has a single row (the long program is the one-row program, so a
    prompt alone computes all its rows in one program and a prefix-cache resume of it runs the same
    program as its cold prefill), else when it computes more prompt tokens."""
    plan = _plan(seqs, mem, cfg, new_token_ratio, decode)
    past_held = not plan.decode and not plan.prefill and not plan.preempt and any(s.running for s in seqs)
    if past_held:  # nothing would run: the running prompts behind a waiting request held back go on (see `_plan`)
        plan = _plan(seqs, mem, cfg, new_token_ratio, decode, past_held=True)
    if cfg.long_prefill_chunk and plan.prefill and (len(plan.prefill) == 1
                                                     or _prompt_tokens(plan) < cfg.long_prefill_chunk):
        # (the same rule as the plan it may replace: else a prompt going on past a held-back request kept rows
        # of prefill_chunk in the long program)
        long = _plan(seqs, mem, cfg, new_token_ratio, decode, row_tokens=cfg.long_prefill_chunk, past_held=past_held)
        if _prompt_tokens(long) > _prompt_tokens(plan) or (len(plan.prefill) == 1 and long.prefill):
            return long
    return plan


def _plan(seqs: list[SeqView], mem: Memory, cfg: SchedulerConfig, new_token_ratio: float, decode: bool,
          row_tokens: int = 0, past_held: bool = False, no_preempt: frozenset = frozenset()) -> StepPlan:
    """One step plan; `decode=False` leaves the decodes out (nobody is preempted to make room for them).
    `row_tokens`: one prefill row of up to that many tokens (the long program) instead of `max_prefill_seqs`
    rows of up to `prefill_chunk`. `past_held`: a waiting request held back (not fitting, or the admission
    look-ahead) stops the admissions after it but not the running prompts of lower priority behind it
    (canonical re-prefill rows, low-priority requests): the plan when the first one would run nothing, since
    such rows hold memory that only their progress (or a preemption) gives back. `no_preempt`: waiting requests
    that preempt nobody (step 0 preempted for them, yet they would not start: see the end)."""
    plan = StepPlan(row_tokens=row_tokens)
    max_rows = 1 if row_tokens else cfg.max_prefill_seqs
    free_units, free_slots = mem.free_units, mem.free_slots
    key = lambda s: (s.priority, s.order)
    running = sorted((s for s in seqs if s.running), key=key)
    waiting = sorted((s for s in seqs if not s.running), key=key)
    victims = sorted(running, key=key, reverse=True)  # lowest priority, newest first

    # adapters of the running requests; a waiting request may add one while fewer than max_loras are
    active = {s.adapter for s in running if s.adapter}
    fits_adapter = lambda s: not s.adapter or s.adapter in active or len(active) < cfg.max_loras  # noqa: E731
    rows = cfg.max_num_seqs - sum(s.rows for s in running)  # decode rows free for admissions

    # 0. a waiting request that does not fit (memory or a decode row) preempts running ones of a strictly
    #    lower priority; what it needs is held for it until step 2 (released first if decodes, or prompts
    #    under way served before it, run short)
    reserved: dict[str, int] = {}  # rid -> units held (and one slot and its row each)
    starters = set()  # those that preempted someone
    for w in waiting:
        lower = [v for v in victims if v.priority > w.priority]
        if not lower or w.rid in no_preempt:
            break
        if not fits_adapter(w):
            continue  # preempting would not give it an adapter slot
        need, taken = _first_chunk(w, cfg), []
        units, slots, free_rows = free_units, free_slots, rows
        while (need > units or slots < 1 or free_rows < w.rows) and lower:
            v = lower.pop(0)
            if not v.rows and need <= units and slots >= 1:
                continue  # only a decode row is short: a row that never decodes (a canonical re-prefill) frees none
            taken.append(v)
            units, slots, free_rows = units + v.pages + cfg.slot_units, slots + 1, free_rows + v.rows
        if need > units or slots < 1 or free_rows < w.rows:
            break  # it cannot fit even so: it waits (and blocks those behind it), preempting nobody
        for v in taken:
            victims.remove(v)
            plan.preempt.append(v.rid)
        if taken:
            starters.add(w.rid)
        reserved[w.rid] = need
        free_units, free_slots, rows = units - need, slots - 1, free_rows - w.rows
    running = [s for s in running if s.rid not in set(plan.preempt)]

    # 1. decodes, in order; when memory is short, release reservations (lowest priority first), then
    #    preempt the lowest-priority, newest running requests
    decoders = [s for s in running if s.total - s.computed == 1][:cfg.max_num_seqs] if decode else []
    drafts, spent = {}, len(decoders)
    for s in decoders:  # within the token budget, in order
        if s.draft and spent + s.draft <= cfg.token_budget:
            drafts[s.rid], spent = s.draft, spent + s.draft
    need = {s.rid: max(0, units_for(s.total + drafts.get(s.rid, 0), cfg) - s.pages) for s in decoders}
    if drafts and sum(need.values()) > free_units:  # drafts go before anything else does
        drafts = {}
        need = {s.rid: max(0, units_for(s.total, cfg) - s.pages) for s in decoders}
    while sum(need.values()) > free_units and reserved:
        rid = next(reversed(reserved))
        free_units += reserved.pop(rid)
        free_slots += 1
        rows += next(w.rows for w in waiting if w.rid == rid)
    while sum(need.values()) > free_units and victims:
        v = victims.pop(0)
        plan.preempt.append(v.rid)
        free_units += v.pages + cfg.slot_units  # (pages may take any free unit, its slot's too)
        free_slots += 1  # its slot run comes back (approximation: slots are slot-aligned)
        rows += v.rows
        need.pop(v.rid, None)
        plan.retracted += 1
    preempted = set(plan.preempt)
    for s in decoders:
        if s.rid in need:
            plan.decode.append(s.rid)
            if s.rid in drafts:
                plan.draft[s.rid] = drafts[s.rid]
            if need[s.rid]:
                plan.grow[s.rid] = need[s.rid]
            free_units -= need[s.rid]
    budget = cfg.token_budget - len(plan.decode) - sum(plan.draft.values())

    # 2. prefill chunks: running partial prefills first, then admissions, in (priority, arrival) order;
    #    with a new-token ratio, an admission must leave room for the expected growth of everyone running
    live = [s for s in running if s.rid not in preempted]
    active.clear()
    active.update(s.adapter for s in live if s.adapter)  # preempted requests gave theirs up
    ahead = sum(expected_growth(s, s.pages + plan.grow.get(s.rid, 0), new_token_ratio, cfg) for s in live) \
        if new_token_ratio > 0 else 0
    candidates = [s for s in running if s.total - s.computed > 1 and s.rid not in preempted] + waiting
    candidates.sort(key=lambda s: (s.priority, not s.running, s.order))  # stable among equals
    admitting = True  # (past_held: until a waiting request is held back)
    for s in candidates:
        if len(plan.prefill) >= max_rows or budget <= 0:
            break
        if s.rid in preempted:  # (yielded its memory to an older prompt below)
            continue
        if not s.running and not admitting:
            if s.rid in reserved:  # (step 0 held memory for it: the running ones may use it this step)
                free_units, free_slots, rows = free_units + reserved.pop(s.rid), free_slots + 1, rows + s.rows
            continue
        if not s.running and not fits_adapter(s):  # (before the token budget: one it cut short stopped those behind)
            continue  # its adapter would be one too many: skipped until a running adapter frees its slot
        start = s.computed
        # rows end on multiples of prefill_chunk: the next one, or the last within the long row
        aligned_end = ((start + row_tokens) // cfg.prefill_chunk if row_tokens else start // cfg.prefill_chunk + 1
                       ) * cfg.prefill_chunk
        length = min(s.total - start, aligned_end - start)
        if s.stop is not None and start < s.stop:
            length = min(length, s.stop - start)
        if length > budget:  # keep rows on aligned boundaries when the token budget cuts one short
            length = budget // cfg.align * cfg.align
            if length == 0:
                break
        units = max(0, units_for(start + length, cfg) - s.pages)
        slots = 0 if s.running else 1
        held = reserved.get(s.rid, 0)  # (step 0 held memory for it, given back to it below: the long row may use it)
        while row_tokens and length > cfg.prefill_chunk and units + slots * cfg.slot_units > free_units + held:
            length = (start + length - 1) // cfg.prefill_chunk * cfg.prefill_chunk - start  # the long row, shorter
            units = max(0, units_for(start + length, cfg) - s.pages)
        if s.rid in reserved:  # step 0 held its memory and row
            free_units, free_slots, rows = free_units + reserved.pop(s.rid), free_slots + 1, rows + s.rows
        # a prompt under way goes before the waiting requests behind it: it takes their reservations first
        while s.running and units > free_units and reserved:
            rid = next(reversed(reserved))
            free_units += reserved.pop(rid)
            free_slots += 1
            rows += next(w.rows for w in waiting if w.rid == rid)
        if s.running and units > free_units:  # a prompt under way: newer running requests idle this step yield
            planned = set(plan.decode) | {r for r, _, _ in plan.prefill}
            spare = [v for v in victims if key(v) > key(s) and v.rid not in planned]
            if units <= free_units + sum(v.pages + cfg.slot_units for v in spare):
                while units > free_units:
                    v = spare.pop(0)
                    victims.remove(v)
                    plan.preempt.append(v.rid)
                    preempted.add(v.rid)
                    free_units += v.pages + cfg.slot_units
                    free_slots += 1
                    rows += v.rows
                    plan.retracted += 1
        if units + slots * cfg.slot_units > free_units or slots > free_slots or slots * s.rows > rows:
            if s.running or not past_held:
                break  # FCFS: nobody overtakes a request that does not fit
            admitting = False
            continue
        if slots and new_token_ratio > 0:
            own = expected_growth(s, s.pages + units, new_token_ratio, cfg)
            if (live or plan.admit) and units + cfg.slot_units + ahead + own > free_units:
                if not past_held:
                    break  # it fits now, but the running requests' expected growth would preempt someone
                admitting = False
                continue
            ahead += own
        elif s.running and new_token_ratio > 0:
            ahead -= min(units, expected_growth(s, s.pages, new_token_ratio, cfg))  # now held, not ahead
        plan.prefill.append((s.rid, start, length))
        if slots:
            plan.admit.append(s.rid)
            if s.adapter:
                active.add(s.adapter)
        if units:
            plan.grow[s.rid] = units
        free_units -= units + slots * cfg.slot_units
        free_slots -= slots
        rows -= slots * s.rows
        budget -= length
    unstarted = starters - set(plan.admit)
    if unstarted:  # preempted for, but not starting this step (look-ahead, rows, token budget): nobody is
        return _plan(seqs, mem, cfg, new_token_ratio, decode, row_tokens, past_held, no_preempt | unstarted)
    return plan
