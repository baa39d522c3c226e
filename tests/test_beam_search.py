"""Beam search (serve/beam_search.py) against HF transformers' `generate(num_beams=...)`, a reference we
did not write, on a tiny Kimi-Linear checkpoint it saved (KDA + MLA + MoE); EOS handling against vLLM's
rules driven by HF's own logprobs; forks under memory pressure, abort, HTTP and `LLM.beam_search`.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.parity

import hf_fixtures as hfx  # noqa: E402

from k3jax import load_model  # noqa: E402
from serve.beam_search import BeamSearchParams, Hypothesis, best, expand, score  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.types import RequestError, SamplingParams  # noqa: E402

VARIANT = "a4"
WIDTH, GEN = 4, 7


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    path, hf = hfx.make_hf_kimi_linear(str(tmp_path_factory.mktemp("beam") / "ckpt"), VARIANT)
    hf.eval()
    return path, hf


@pytest.fixture(scope="module")
def engine(ref):
    return Engine(load_model(ref[0]), EngineConfig(
        max_model_len=256, page_size=16, cache_bytes=24 << 20, max_num_seqs=8, decode_buckets=(8,),
        prefill_buckets=(2,), context_buckets=(16,), max_num_batched_tokens=256, max_logprobs=2 * WIDTH,
        measure_moe_time=False), progress=False)  # (no MoE timing programs at warm-up: CI time)


@pytest.fixture(scope="module")
def prompts():
    return [[int(x) for x in p] for p in hfx.make_prompt(VARIANT, 3, batch=2, length=37)]


def drain(eng) -> dict:
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return done


def run_beams(eng, prompts, params) -> list:
    rids = [eng.add_request(p, params) for p in prompts]
    done = drain(eng)
    return [done[r] for r in rids]


def assert_idle(eng):
    assert eng.allocator.free_units + eng._cached_units() == eng.allocator.baseline_free_units
    assert not eng._frozen and not eng._beams and not eng.seqs


def test_selection_rules():
    """vLLM's rules on a hand-made round: EOS proposals complete, the rest compete for the places by
    score (prompt length included), ties keep beam then proposal order."""
    a, b = Hypothesis((5,), (-1.0,), -1.0), Hypothesis((6,), (-2.0,), -2.0)
    eos = frozenset({0})
    live, done = expand([(a, [7, 0, 8], [-0.5, -0.1, -0.5]), (b, [9, 3], [-0.1, -3.0])], 2, eos, 10, 1.0)
    assert [(i, h.tokens) for i, h in live] == [(0, (5, 7)), (0, (5, 8))]  # tie: a's order
    assert [h.tokens for h in done] == [(5, 0)] and done[0].eos and done[0].cum_logprob == pytest.approx(-1.1)
    # the EOS hypothesis scores over prompt + 1 tokens, the live ones over prompt + 2
    assert score(done[0], 10, 1.0) == pytest.approx(-1.1 / 11)
    assert score(live[0][1], 10, 2.0) == pytest.approx(-1.5 / 144)
    assert [h.tokens for h in best(done + [h for _, h in live], 2, 10, 1.0)] == [(5, 0), (5, 7)]
    with pytest.raises(RequestError, match="max_logprobs"):
        BeamSearchParams(3, 4).validate(5)
    with pytest.raises(RequestError, match="beam_width"):
        BeamSearchParams(0, 4).validate(5)


def test_matches_hf_beam_search(engine, ref, prompts):
    """Two beam searches and a greedy request in one engine: every hypothesis equals HF's
    `generate(num_beams=4, num_return_sequences=4)`, best first, with its summed logprob (HF's
    length-normalised score x length); the greedy request is undisturbed; nothing leaks, nothing compiles."""
    _, hf = ref
    compiles = engine.compiles_after_warmup
    greedy = engine.add_request(prompts[0][:20], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    rids = [engine.add_request(p, BeamSearchParams(WIDTH, GEN, ignore_eos=True)) for p in prompts]
    forks = engine.counters["beam_forks"]
    done = drain(engine)
    assert engine.counters["beam_forks"] > forks
    for p, rid in zip(prompts, rids):
        ids = torch.tensor([p])
        g = hf.generate(ids, num_beams=WIDTH, num_return_sequences=WIDTH, max_new_tokens=GEN, do_sample=False,
                        eos_token_id=None, pad_token_id=0, length_penalty=1.0, output_scores=True,
                        return_dict_in_generate=True)
        want = g.sequences[:, len(p):].tolist()
        out = done[rid].outputs
        assert [c.token_ids for c in out] == want
        np.testing.assert_allclose([c.cumulative_logprob for c in out], (g.sequences_scores * GEN).tolist(),
                                   rtol=0, atol=2e-4)
        assert all(c.finish_reason == "length" and len(c.logprobs) == GEN for c in out)
    alone = engine.add_request(prompts[0][:20], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    assert drain(engine)[alone].outputs[0].token_ids == done[greedy].outputs[0].token_ids
    assert engine.compiles_after_warmup == compiles
    assert_idle(engine)


def reference_beam_search(hf, prompt, width, steps, eos, length_penalty):
    """vLLM's beam search with HF's full-forward logprobs (every beam recomputed from its tokens)."""
    beams, completed = [Hypothesis()], []
    for _ in range(steps):
        rows = []
        for h in beams:
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + list(h.tokens)])).logits[0, -1].double()
            lp = torch.log_softmax(logits, -1)
            top = torch.topk(lp, 2 * width)
            rows.append((h, top.indices.tolist(), top.values.tolist()))
        live, done = expand(rows, width, eos, len(prompt), length_penalty)
        completed += done
        beams = [h for _, h in live]
        if not beams:
            break
    return best(completed + beams, width, len(prompt), length_penalty)


def test_eos_rules_against_hf_logprobs(engine, ref, prompts):
    """With an end token the model proposes often: hypotheses end early ("stop"), the rest run to
    max_tokens, all ranked with the length penalty, equal to vLLM's rules on HF's logprobs."""
    _, hf = ref
    probe = run_beams(engine, prompts[:1], BeamSearchParams(WIDTH, GEN, ignore_eos=True))[0]
    counts = np.bincount([t for c in probe.outputs for t in c.token_ids[1:]], minlength=hf.config.vocab_size)
    eos = int(np.argmax(counts))  # a token several beams continue with: some proposals end there
    saved = engine.stop_ids
    engine.stop_ids = (eos,)
    try:
        params = BeamSearchParams(WIDTH, GEN, length_penalty=0.5)
        out = run_beams(engine, prompts[:1], params)[0].outputs
    finally:
        engine.stop_ids = saved
    want = reference_beam_search(hf, prompts[0], WIDTH, GEN, frozenset({eos}), 0.5)
    assert [tuple(c.token_ids) for c in out] == [h.tokens for h in want]
    np.testing.assert_allclose([c.cumulative_logprob for c in out], [h.cum_logprob for h in want], atol=2e-4)
    reasons = [c.finish_reason for c in out]
    assert "stop" in reasons, reasons
    assert all((c.token_ids[-1] == eos) == (c.finish_reason == "stop") for c in out)
    assert_idle(engine)


def test_forks_right_after_a_prompt_end_checkpoint(engine, ref):
    """A prompt of a whole KDA checkpoint interval (64 tokens) ends with a checkpoint that takes the parent's state
    slot (its own new slot is written by its next row): its first fork's beams read that checkpoint. They read the
    unwritten new slot (every hypothesis past the first token was wrong, cumulative logprobs ~16 off)."""
    _, hf = ref
    prompt = [int(x) for x in hfx.make_prompt(VARIANT, 5, batch=1, length=64)[0]]
    registered = engine.prefix_cache.metrics["checkpoints_registered"]
    out = run_beams(engine, [prompt], BeamSearchParams(WIDTH, GEN, ignore_eos=True))[0].outputs
    assert engine.prefix_cache.metrics["checkpoints_registered"] > registered  # (the capture at the prompt's end)
    want = reference_beam_search(hf, prompt, WIDTH, GEN, frozenset(), 1.0)
    assert [tuple(c.token_ids) for c in out] == [h.tokens for h in want]
    np.testing.assert_allclose([c.cumulative_logprob for c in out], [h.cum_logprob for h in want], atol=2e-4)
    assert_idle(engine)


def test_forks_under_memory_pressure_and_abort(engine, prompts):
    """Room for about two beams: forks that find no memory wait and recompute their tokens (their
    selected siblings give their memory back meanwhile), and the results still equal the unconstrained
    run's; an abort mid-search frees everything."""
    params = BeamSearchParams(WIDTH, GEN, ignore_eos=True)
    roomy = run_beams(engine, prompts[:1], params)[0]
    lay = engine.layout
    beam_units = lay.slot_units + engine.layout.pages_for(len(prompts[0]) + GEN) * engine.cfg.num_mla_layers
    engine.reset_prefix_cache()
    hog = engine.allocator.alloc_pages(engine.allocator.free_units - 2 * beam_units - 2)
    before = dict(engine.counters)
    try:
        tight = run_beams(engine, prompts[:1], params)[0]
    finally:
        engine.allocator.free_pages(hog)
    assert engine.counters["beam_fork_recomputes"] > before["beam_fork_recomputes"]
    # vLLM's prompt_tokens: the search's prompt once, when its prefill ends (not per beam, fork or recompute)
    assert engine.counters["prompt_tokens"] - before["prompt_tokens"] == len(prompts[0])
    assert [c.token_ids for c in tight.outputs] == [c.token_ids for c in roomy.outputs]
    np.testing.assert_allclose([c.cumulative_logprob for c in tight.outputs],
                               [c.cumulative_logprob for c in roomy.outputs], atol=1e-4)
    rid = engine.add_request(prompts[1], params)
    while engine.requests[rid].beam.rounds < 3:
        engine.step()
    assert engine._frozen or len(engine.requests[rid].seqs) == WIDTH
    assert engine.abort(rid)
    # as an aborted request's samples (README: its last output's finish_reason is "abort"; it had no outputs): the
    # hypotheses so far, ranked as a search of 3 tokens ends with them
    aborted = engine._output(engine.requests[rid]).outputs
    engine._reap()
    assert_idle(engine)
    three = run_beams(engine, prompts[1:2], BeamSearchParams(WIDTH, 3, ignore_eos=True))[0].outputs
    assert [c.token_ids for c in aborted] == [c.token_ids for c in three]
    np.testing.assert_allclose([c.cumulative_logprob for c in aborted], [c.cumulative_logprob for c in three])
    assert [c.finish_reason for c in aborted] == ["abort"] * WIDTH
    rid = engine.add_request(prompts[1], params)  # aborted before its first selection: WIDTH empty outputs
    assert engine.abort(rid)
    assert [(c.token_ids, c.finish_reason) for c in engine._output(engine.requests[rid]).outputs] == [([], "abort")] * WIDTH
    engine._reap()
    assert_idle(engine)


def test_a_laggard_beam_holding_its_slot_gets_its_parked_siblings_memory(engine, prompts):
    """A beam recomputing (preempted) is admitted while its sibling still decodes; the sibling parks (its proposals
    made, its memory held until the selection) and the laggard's next row finds no pages: nothing else frees any.
    Only a laggard without a slot took its parked siblings' memory, so the search (and every request queued
    behind it) stood still forever; the parked beam now gives its memory back, and the result is unchanged."""
    prompt = prompts[0] + prompts[1]  # 74 tokens: a recompute from scratch is two prefill rows
    params = BeamSearchParams(2, GEN, ignore_eos=True)
    roomy = run_beams(engine, [prompt], params)[0]
    engine.reset_prefix_cache()
    rid = engine.add_request(prompt, params)
    while engine.requests[rid].beam.rounds < 2:
        engine.step()
    parked, laggard = engine.requests[rid].seqs
    engine._preempt(laggard)
    engine.reset_prefix_cache()  # (no cached prefix to resume from: it recomputes from its first token)
    engine.step()  # the sibling decodes and parks; the laggard's first row
    assert parked.proposals is not None and parked.slot is not None
    assert laggard.slot is not None and laggard.proposals is None and laggard.computed < len(laggard.all_ids)
    hog = engine.allocator.alloc_pages(engine.allocator.free_units)
    try:
        for _ in range(3):
            engine.step()
        assert engine.requests[rid].beam.rounds > 2  # the laggard computed: the search selected again
    finally:
        engine.allocator.free_pages(hog)
    out = drain(engine)[rid]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in roomy.outputs]
    np.testing.assert_allclose([c.cumulative_logprob for c in out.outputs],
                               [c.cumulative_logprob for c in roomy.outputs], atol=1e-4)
    engine._reap()
    assert_idle(engine)


def test_a_search_whose_selection_raises_ends_alone(engine, prompts, monkeypatch):
    """A beam search whose selection round raises (here: the third round of the one with length_penalty 3) ends
    alone: StepFailed names it, the other search finishes as it does alone, and every beam's memory is freed."""
    import serve.engine as engine_mod
    from step_failures import drain_through_failures

    ok = BeamSearchParams(WIDTH, GEN, ignore_eos=True)
    alone = run_beams(engine, prompts[:1], ok)[0]
    real = engine_mod.expand

    def expand(beams, width, eos, prompt_len, length_penalty):
        if length_penalty == 3.0 and len(beams[0][0].tokens) >= 2:
            raise OverflowError("boom")
        return real(beams, width, eos, prompt_len, length_penalty)

    monkeypatch.setattr(engine_mod, "expand", expand)
    good = engine.add_request(prompts[0], ok)
    bad = engine.add_request(prompts[1], BeamSearchParams(WIDTH, GEN, ignore_eos=True, length_penalty=3.0))
    failures, done = drain_through_failures(engine)
    assert [f.request_ids for f in failures] == [[bad]] and "boom" in str(failures[0])
    assert [c.token_ids for c in done[good].outputs] == [c.token_ids for c in alone.outputs]
    engine._reap()
    assert_idle(engine)


def test_a_prompt_failing_beside_a_search_leaves_it_running(engine, prompts):
    """A prompt whose prefill fails in a step that first decoded a beam search's beams (read back, their
    proposals kept for the selection) ends alone; the search still selects and finishes with the hypotheses it
    has alone (it hung: nothing else ran, and no step selected the beams the failed step had read back)."""
    from step_failures import FailingPrefill, drain_through_failures

    params = BeamSearchParams(WIDTH, GEN, ignore_eos=True)
    alone = run_beams(engine, prompts[:1], params)[0]
    search = engine.add_request(prompts[0], params)
    while not engine.requests[search].beam.rounds:  # its beams decode
        engine.step()
    engine._step = failing = FailingPrefill(engine)
    try:
        bad = engine.add_request(prompts[1], SamplingParams(max_tokens=2))
        failures, done = drain_through_failures(engine, max_steps=50)
    finally:
        engine._step = failing.real
    assert [f.request_ids for f in failures] == [[bad]]
    assert [c.token_ids for c in done[search].outputs] == [c.token_ids for c in alone.outputs]
    engine._reap()
    assert_idle(engine)


def test_rejections(engine, prompts):
    with pytest.raises(RequestError, match="max_logprobs"):
        engine.add_request(prompts[0], BeamSearchParams(WIDTH + 1, 4))
    with pytest.raises(RequestError, match="context window"):
        engine.add_request(prompts[0], BeamSearchParams(2, 250))
    assert_idle(engine)


def test_llm_and_http(engine, prompts, monkeypatch):
    """`LLM.beam_search` and `use_beam_search` over HTTP give the engine's hypotheses; fields a beam
    search cannot honour are refused with 400 naming them."""
    import httpx

    from serve.api import create_app
    from serve.async_engine import AsyncEngine
    from serve.llm import LLM

    params = BeamSearchParams(2, 5, ignore_eos=True)
    want = run_beams(engine, prompts[:1], params)[0].outputs
    llm = LLM.__new__(LLM)
    llm.engine, llm.model = engine, None
    got = llm.beam_search({"prompt_token_ids": prompts[0]}, params)[0].sequences  # vLLM's TokensPrompt form
    assert [s.tokens for s in got] == [prompts[0] + c.token_ids for c in want]
    assert [s.cum_logprob for s in got] == pytest.approx([c.cumulative_logprob for c in want])
    assert got[0].cum_logprob == pytest.approx(sum(lp[t].logprob for lp, t in zip(got[0].logprobs, want[0].token_ids)))
    assert [s.logprobs for s in got] == [c.logprobs for c in want]  # vLLM's: a dict token id -> Logprob per token
    for c in want:  # each token's alternatives: what its beam proposed (2 x width, best first), the token among them
        for pos, tok in zip(c.logprobs, c.token_ids):
            chosen, alts = pos.chosen, pos.top
            assert next(iter(pos)) == tok and pos[tok] is chosen and len(pos) == 4
            assert len(alts) == 4 and [a.rank for a in alts] == [1, 2, 3, 4]
            assert [a.logprob for a in alts] == sorted((a.logprob for a in alts), reverse=True)
            assert {a.token_id: a.logprob for a in alts}[chosen.token_id] == chosen.logprob
            assert alts[chosen.rank - 1].token_id == chosen.token_id

    aeng = AsyncEngine(engine)
    app = create_app(aeng, "kimi")
    body = {"prompt": prompts[0], "max_tokens": 5, "n": 2, "use_beam_search": True, "ignore_eos": True,
            "return_token_ids": True}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert [ch["token_ids"] for ch in r.json()["choices"]] == [c.token_ids for c in want]
            lp = (await c.post("/v1/completions", json=body | {"logprobs": 2})).json()["choices"][0]["logprobs"]
            assert all(len(t) >= 2 and t[tok] == x for tok, x, t in  # the chosen token, then the 2 best proposed
                       zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
            r = await c.post("/v1/completions", json=body | {"stop": ["x"]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
            r = await c.post("/v1/completions", json=body | {"n": 5})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
            # the engine's refusal of a width past max_num_seqs names the request's field (it named beam_width)
            monkeypatch.setattr(engine, "sched_cfg", dataclasses.replace(engine.sched_cfg, max_num_seqs=1))
            for stream in (False, True):
                r = await c.post("/v1/completions", json=body | {"stream": stream})
                assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
                assert r.json()["error"]["message"].startswith("n: 2 beams exceed max_num_seqs=1"), r.text
            monkeypatch.undo()

    try:
        asyncio.run(go())
    finally:
        aeng.shutdown()
    assert_idle(engine)


def test_random_mixes_with_aborts_and_pressure(engine, prompts):
    """Random beam searches (widths 1-4, lengths 1-19, an end token or not) beside greedy requests, some
    aborted at random steps, in an arena squeezed to a random size: nothing fails, every search that
    finishes equals itself run alone in a roomy arena, and the arena, frozen slots and reference counts
    come back to their baseline."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    alone: dict = {}

    def solo(key):
        if key not in alone:
            p, w, n, eos = key
            out = run_beams(engine, [list(p)], BeamSearchParams(w, n, ignore_eos=not eos))[0]
            alone[key] = [c.token_ids for c in out.outputs]
        return alone[key]

    @settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def check(data):
        rng = np.random.default_rng(data.draw(st.integers(0, 10 ** 6)))
        reqs = []
        for _ in range(data.draw(st.integers(2, 5))):
            p = tuple(prompts[int(rng.integers(0, 2))][:int(rng.integers(5, 38))])
            if rng.random() < 0.7:
                reqs.append((p, int(rng.integers(1, 5)), int(rng.integers(1, 20)), bool(rng.random() < 0.5)))
            else:
                reqs.append((p, 0, int(rng.integers(1, 20)), False))  # a greedy request
        want = {i: solo(k) for i, k in enumerate(reqs) if k[1]}
        lay = engine.layout
        one = lay.slot_units + lay.pages_for(64) * engine.cfg.num_mla_layers
        hog = engine.allocator.alloc_pages(max(0, engine.allocator.free_units - int(rng.integers(2, 8)) * one))
        try:
            ids = [engine.add_request(list(p), BeamSearchParams(w, n, ignore_eos=not eos) if w else
                                      SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
                   for p, w, n, eos in reqs]
            aborts = {ids[i]: int(rng.integers(0, 6)) for i in range(len(ids)) if rng.random() < 0.3}
            done, steps = {}, 0
            while engine.has_unfinished():
                for o in engine.step():
                    if o.finished:
                        done[o.request_id] = o
                steps += 1
                for rid, at in aborts.items():
                    if at == steps:
                        engine.abort(rid)
            engine._reap()
        finally:
            engine.allocator.free_pages(hog)
        for i, rid in enumerate(ids):
            if i in want and rid in done and done[rid].outputs:
                assert [c.token_ids for c in done[rid].outputs] == want[i], reqs[i]
        engine.reset_prefix_cache()
        assert_idle(engine)
        assert not engine.refs.unit_refs

    before = dict(engine.counters)
    check()
    for k in ("beam_forks", "beam_fork_recomputes", "requests_aborted"):  # the cases happened
        assert engine.counters[k] > before[k], k
