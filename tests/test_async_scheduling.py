"""Async scheduling (`EngineConfig.async_scheduling`): every step is launched before the one in flight is read
back, a running request's next input token passed on the device. Outputs must be the synchronous engine's,
token for token, through preemption, prefix-cache resumes, aborts and failed steps, with the arena back at
its baseline afterwards."""

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import k3jax
from serve.engine import Engine, EngineConfig, StepFailed
from serve.types import SamplingParams, StructuredOutputsParams as SO

UNITS = 140  # small enough that the mixed workload below preempts


def make_engine(model, async_scheduling, **kw):
    cfg = dict(max_model_len=512, page_size=16, cache_bytes=UNITS * 2560, max_num_seqs=8, prefill_chunk=64,
               max_prefill_seqs=4, max_num_batched_tokens=512, decode_buckets=(8,), prefill_buckets=(4,),
               context_buckets=(32,), max_logprobs=3, enable_prefix_caching=False, measure_moe_time=False,
               schedule_conservativeness=0.0, compile_threads=2, async_scheduling=async_scheduling)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg), progress=False)


@pytest.fixture(scope="module")
def model():
    return k3jax.load_model("tiny-k3", seed=1)


@pytest.fixture(scope="module")
def engines(model):
    """(synchronous, async) engines of one layout; each pair shares nothing but the model."""
    return make_engine(model, False), make_engine(model, True)


@pytest.fixture(scope="module")
def cached_engines(model):
    return (make_engine(model, False, enable_prefix_caching=True),
            make_engine(model, True, enable_prefix_caching=True))


def workload(seed: int, n: int = 16):
    """Prompts of 1-200 tokens, each with its own sampling: greedy, seeded random with top-k / top-p, penalties
    (their history includes the token passed on the device), min_tokens, stop token ids, logprobs."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 256, int(k)).tolist() for k in rng.integers(1, 200, n)]
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.9, top_k=20, top_p=0.9, seed=11),
        dict(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, seed=5),
        dict(temperature=1.0, min_p=0.05, logprobs=2),
        dict(temperature=0.0, min_tokens=4, stop_token_ids=[7, 9, 11]),
        dict(temperature=1.0, seed=3, stop_token_ids=[1, 2, 3, 4, 5]),
    ]
    params = [SamplingParams(max_tokens=int(rng.integers(5 if "min_tokens" in kinds[i % len(kinds)] else 1, 24)),
                             ignore_eos=i % 2 == 0, **kinds[i % len(kinds)]) for i in range(n)]
    return prompts, params


def run(engine, prompts, params):
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def same_outputs(a, b):
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert [o.outputs[0].finish_reason for o in a] == [o.outputs[0].finish_reason for o in b]
    for x, y in zip(a, b):
        lx, ly = x.outputs[0].logprobs, y.outputs[0].logprobs
        assert (lx is None) == (ly is None)
        for px, py in zip(lx or [], ly or []):
            (sx, tx), (sy, ty) = (px.chosen, px.top), (py.chosen, py.top)
            # the async engine samples decode logits in a program of their own: XLA may round the
            # log-softmax of the same logits differently there (fp32: a few ulp)
            assert sx.token_id == sy.token_id and sx.logprob == pytest.approx(sy.logprob, rel=1e-6, abs=1e-6)
            assert [t.token_id for t in tx] == [t.token_id for t in ty]


def at_baseline(engine):
    s = engine.stats()
    assert s["arena_free_units"] == s["arena_baseline_free_units"]
    assert not engine._flight and all(q.pending == 0 for q in engine.seqs.values())


def test_outputs_match_the_synchronous_engine(engines):
    sync, asyn = engines
    prompts, params = workload(0)
    before = dict(asyn.counters)
    want, got = run(sync, prompts, params), run(asyn, prompts, params)
    same_outputs(want, got)
    c = asyn.counters
    assert c["steps_launched_ahead"] - before["steps_launched_ahead"] > 0.5 * (c["steps"] - before["steps"])
    assert c["preemptions"] > before["preemptions"]  # the workload also covers recompute after preemption
    assert asyn.compiles_after_warmup == 0
    at_baseline(sync)
    at_baseline(asyn)


def test_structured_outputs_and_bad_words_stay_in_flight(engines):
    """Rows whose mask depends on the token sampled in flight (structured outputs, bad words) no longer make a
    step wait for the host: the decode program's logits are sampled by a program launched once the step before
    is read back. Sampled (seeded) rows, so a mask built from the constraint one token behind would let
    tokens through that the synchronous engine bans."""
    sync, asyn = engines
    rng = np.random.default_rng(7)
    regex = r"(ab|cd)[0-9]{2,5}-x+"
    kinds = [dict(structured_outputs=SO(regex=regex), logprobs=3),  # (logprobs after the mask: `_complete` marks it)
             dict(structured_outputs=SO(choice=["alpha", "beta", "gamma delta"])),
             dict(structured_outputs=SO(json={"type": "object", "properties": {"n": {"type": "integer"}},
                                              "required": ["n"]}, disable_any_whitespace=True)),
             dict(bad_words=["a", "bc", "zz"]), dict(),
             # a constrained row's bad words go into its bias, built before the deferred sample: `_complete` adds them
             dict(structured_outputs=SO(regex=regex), bad_words=["5", "9"], logprobs=3)]
    prompts = [rng.integers(0, 256, int(k)).tolist() for k in rng.integers(1, 120, 12)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=int(rng.integers(4, 20)), **kinds[i % len(kinds)])
              for i in range(len(prompts))]
    before = dict(asyn.counters)
    want, got = run(sync, prompts, params), run(asyn, prompts, params)
    same_outputs(want, got)
    for p, o in zip(params, got):
        text = o.outputs[0].text
        if p.structured_outputs is not None and p.structured_outputs.regex and o.outputs[0].finish_reason == "stop":
            assert re.fullmatch(regex, text), text
        if p.bad_words:
            assert not any(w in text for w in p.bad_words), text
    c = asyn.counters
    assert c["steps_launched_ahead"] - before["steps_launched_ahead"] > 0.5 * (c["steps"] - before["steps"])
    assert asyn.compiles_after_warmup == 0
    at_baseline(sync)
    at_baseline(asyn)


def test_outputs_lag_one_step_and_the_last_step_is_read_back(engines):
    """A step's outputs come with the next call; a request that finished while its next row was in flight gets
    no token from that row, and the step is read back by the call that finds nothing else to run."""
    _, asyn = engines
    rid = asyn.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    seen = []
    while asyn.has_unfinished():
        seen.append([len(o.outputs[0].token_ids) for o in asyn.step() if o.request_id == rid])
    assert seen[0] == [] and [n for s in seen for n in s] == [1, 2, 3]
    at_baseline(asyn)


def test_a_request_a_call_between_steps_finishes_keeps_its_output(engines):
    """`AsyncEngine` runs calls (`reset_prefix_cache`, ...) and aborts between steps. A call that reads back the
    step in flight can finish a request there; an abort of another request (which reaps finished ones) must not
    forget it before the next `step()` returns its last output (its stream would wait forever), and the engine must
    still report work (`has_unfinished`): an AsyncEngine steps only then, so with no other request left the stream
    waited forever for that output."""
    _, asyn = engines
    sp = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
    rid, other = asyn.add_request([5, 6, 7], sp(3)), asyn.add_request([8, 9], sp(30))
    seq = asyn.seqs[f"{rid}#0"]
    while not (seq.pending and len(seq.output_ids) + seq.pending == 3):  # its last token in flight
        asyn.step()
    asyn.reset_prefix_cache()  # (AsyncEngine's "call"): reads the step back, the request finishes there
    asyn.abort(other)
    asyn._reap()  # (AsyncEngine's "abort")
    assert asyn.has_unfinished()  # its last output is owed
    outs = {o.request_id: o for o in asyn.step()}
    assert outs[rid].finished and len(outs[rid].outputs[0].token_ids) == 3
    while asyn.has_unfinished():
        asyn.step()
    at_baseline(asyn)


def test_prefix_cache_resumes_match(cached_engines):
    """Shared prefixes: KDA checkpoints captured at row ends (those rows are read back before the next step is
    planned) and pages registered while the next step is in flight; the second wave resumes from them."""
    sync, asyn = cached_engines
    rng = np.random.default_rng(1)
    system = rng.integers(0, 256, 150).tolist()
    prompts = [system + rng.integers(0, 256, int(k)).tolist() for k in rng.integers(1, 80, 8)]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)] * len(prompts)
    for wave in range(2):
        same_outputs(run(sync, prompts, params), run(asyn, prompts, params))
    pc = asyn.stats()["prefix_cache"]
    assert pc["hit_tokens"] > 0 and pc["checkpoints"] > 0  # captured, then resumed from, under async scheduling
    for e in (sync, asyn):
        e.reset_prefix_cache()
        at_baseline(e)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "add", "abort", "step", "step"]), st.integers(1, 150),
                              st.integers(1, 5)), min_size=4, max_size=20))
def test_aborts_at_any_point_leave_the_arena_at_baseline(engines, ops):
    """Aborts land between a step's launch and its read-back: the aborted request's row in flight is dropped, its
    memory freed once, and the requests left finish with exactly the synchronous engine's tokens."""
    sync, asyn = engines
    ids, prompts = [], {}
    for op, a, b in ops:
        if op == "add":
            prompt = [a % 256] * a
            ids.append(asyn.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=b + 3, ignore_eos=True)))
            prompts[ids[-1]] = (prompt, b + 3)
        elif op == "abort" and ids:
            asyn.abort(ids[a % len(ids)])
        else:
            for _ in range(b):
                asyn.step()
    done = {}
    while asyn.has_unfinished():
        for out in asyn.step():
            if out.finished and out.outputs[0].finish_reason != "abort":
                done[out.request_id] = out.outputs[0].token_ids
    at_baseline(asyn)
    for rid, toks in done.items():
        prompt, n = prompts[rid]
        want = run(sync, [prompt], [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)])[0]
        assert toks == want.outputs[0].token_ids


class _FailingStep:
    """The engine's compiled step, raising at call number `at` (deleting the arena first when `consume`)."""

    def __init__(self, engine, at, consume):
        self.engine, self.real, self.at, self.consume, self.calls = engine, engine._step, at, consume, 0
        self._cache_size = self.real._cache_size

    def __call__(self, leaves, arena, token_pages, tables, batch):
        self.calls += 1
        if self.calls == self.at:
            if self.consume:
                arena.delete()
            raise RuntimeError("injected device failure")
        return self.real(leaves, arena, token_pages, tables, batch)


@pytest.mark.parametrize("consume", [False, True], ids=["cache-kept", "cache-consumed"])
def test_failed_launch_ends_only_its_requests(engines, consume):
    """A launch that raises while the step before it is in flight: that step is read back first (its outputs
    carried by the error), the failed step's requests end, the rest finish with the synchronous tokens."""
    sync, asyn = engines
    prompts, params = workload(2, 8)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * len(prompts)
    want = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, run(sync, prompts, params))}
    ids = [asyn.add_request(p, sp) for p, sp in zip(prompts, params)]
    real, failing = asyn._step, _FailingStep(asyn, at=6, consume=consume)
    asyn._step = failing
    done, failed = {}, None
    try:
        while asyn.has_unfinished():
            try:
                outs = asyn.step()
            except StepFailed as e:
                assert failed is None and "injected device failure" in str(e)
                failed, outs = set(e.request_ids), e.outputs
            done.update({o.request_id: o for o in outs if o.finished})
    finally:
        asyn._step = real
    assert failed and not failed & set(done)
    for rid, p in zip(ids, prompts):
        if rid not in failed:
            assert done[rid].outputs[0].token_ids == want[tuple(p)]
    assert asyn.counters["cache_resets"] >= int(consume)
    asyn.step()
    at_baseline(asyn)


def test_async_scheduling_options():
    from serve.cli import DEFAULTS, engine_config

    o = dict(DEFAULTS, async_scheduling=True, speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    cfg = engine_config(o)  # with speculative decoding too (tests/test_speculative.py)
    assert cfg.async_scheduling and cfg.speculative_config.num_speculative_tokens == 2
    assert not engine_config(DEFAULTS).async_scheduling
