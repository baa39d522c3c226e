"""The engine's logit processing against references: presence / frequency / repetition penalties, logit
bias and min_tokens (serve/penalties.py; the token history in the engine's token pages, serve/step.py)
with vLLM's semantics, on random data and as the engine's greedy tokens against a loop over the model's
full forward; and prompt logprobs (serve/sampling.py `prompt_logprobs`) against that forward."""

from __future__ import annotations

import dataclasses
import signal
import threading
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serve.logits_processors import LogitsProcessor
from serve.penalties import apply_bias, apply_penalties
from serve.sampling import SamplingBatch, sample
from serve.types import RequestError, SamplingParams as SP


def _ref(logits, prompt, out, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """vLLM's order: bias, repetition over prompt + output, then frequency / presence over the output."""
    x = np.array(logits, np.float64)
    for t, b in (bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(out):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t, c in Counter(out).items():
        x[t] -= frequency * c + presence
    return x


def test_penalty_ops_match_reference_on_random_rows():
    rng = np.random.default_rng(0)
    b, v, s = 5, 40, 24
    logits = rng.standard_normal((b, v)).astype(np.float32) * 3
    history = rng.integers(0, v // 3, (b, s)).astype(np.int32)  # many repeats
    plen = rng.integers(1, 10, b)
    length = plen + rng.integers(0, 12, b)
    pres, freq, rep = (rng.uniform(-2, 2, b).astype(np.float32), rng.uniform(-2, 2, b).astype(np.float32),
                       rng.uniform(0.5, 3, b).astype(np.float32))
    pos = np.broadcast_to(np.arange(s), (b, s))
    got = apply_penalties(jnp.asarray(logits), jnp.asarray(history), jnp.asarray(pos < length[:, None]),
                          jnp.asarray(pos >= plen[:, None]), jnp.asarray(pres), jnp.asarray(freq), jnp.asarray(rep))
    for i in range(b):
        want = _ref(logits[i], history[i, :plen[i]], history[i, plen[i]:length[i]], pres[i], freq[i], rep[i])
        np.testing.assert_allclose(np.asarray(got[i]), want, rtol=1e-5, atol=1e-5)

    ids = np.full((b, 6), -1, np.int32)
    vals = np.zeros((b, 6), np.float32)
    for i in range(b):
        k = i + 1 if i < 5 else 0
        ids[i, :k] = rng.choice(v, k, replace=False)
        vals[i, :k] = rng.uniform(-100, 100, k)
    got = np.asarray(apply_bias(jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(vals)))
    for i in range(b):
        want = _ref(logits[i], [], [], bias={int(t): float(x) for t, x in zip(ids[i], vals[i]) if t >= 0})
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-5)


def test_sample_applies_bias_and_penalties_but_logprobs_stay_raw():
    rng = np.random.default_rng(1)
    b, v = 4, 30
    logits = jnp.asarray(rng.standard_normal((b, v)).astype(np.float32))
    hist = jnp.asarray(rng.integers(0, v, (b, 12)).astype(np.int32))
    params = [SP(temperature=0, frequency_penalty=1.5), SP(temperature=0, logit_bias={7: 50.0}),
              SP(temperature=0), SP(temperature=0.7, seed=5, repetition_penalty=2.0)]
    batch = SamplingBatch.from_params(params, [0, 0, 0, 5], [4, 0, 2, 3], b, [6, 3, 5, 2], None, 8)
    pos = jnp.broadcast_to(jnp.arange(12), (b, 12))
    res = jax.jit(lambda lg, bt: sample(lg, bt, 2, history=lambda: (hist, pos)))(logits, batch)
    h = np.asarray(hist)
    want0 = _ref(np.asarray(logits[0]), h[0, :6], h[0, 6:10], frequency=1.5)
    assert int(res.tokens[0]) == int(np.argmax(want0))
    assert int(res.tokens[1]) == 7
    assert int(res.tokens[2]) == int(np.argmax(np.asarray(logits[2])))
    raw = jax.nn.log_softmax(logits, axis=-1)
    np.testing.assert_allclose(np.asarray(res.logprob), np.asarray(raw)[np.arange(b), np.asarray(res.tokens)],
                               rtol=1e-6)


def test_sampling_params_validate_penalties():
    for bad, field in ((dict(presence_penalty=3), "presence_penalty"), (dict(frequency_penalty=-2.5), "frequency_penalty"),
                       (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_tokens=-1), "min_tokens"),
                       (dict(min_tokens=20, max_tokens=4), "min_tokens"), (dict(logit_bias={1000: 1.0}), "logit_bias"),
                       (dict(logit_bias={3: 200.0}), "logit_bias"),
                       (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias")):
        with pytest.raises(RequestError, match=field):
            SP(**bad).validate(512)
    # vLLM takes any finite repetition_penalty > 0 (it was capped at 10); past float32's range it would be inf
    SP(repetition_penalty=50.0).validate(512)
    SP(repetition_penalty=1e38).validate(512)
    for big in (1e39, float("inf")):
        with pytest.raises(RequestError, match="repetition_penalty: must be a number > 0"):
            SP(repetition_penalty=big).validate(512)


# ---- the engine ----------------------------------------------------------------------------------
def _ban_below(logits, args, ctx):
    return jnp.where(jnp.arange(logits.shape[1])[None, :] < args[:, :1], -jnp.inf, logits)


# custom logits processors compiled into every program of the module's engine (off for every request that
# does not name them: those must come out as without them, which the reference loops below check)
PROCESSORS = (LogitsProcessor("ban_below", _ban_below, ("min_id",)), "no_repeat_ngram")
KW = dict(max_model_len=128, cache_bytes=16 << 20, max_num_seqs=4, prefill_chunk=16, max_prefill_seqs=2,
          decode_buckets=(4,), prefill_buckets=(2,), context_buckets=(8,), measure_moe_time=False, progress=False,
          max_logprobs=3, logits_processors=PROCESSORS)
PROMPT = [int(x) for x in np.random.default_rng(7).integers(3, 250, 40)]
# a bias that makes the random model repeat token 5 unless penalised, so the penalties bite
CASES = [SP(temperature=0, max_tokens=10, ignore_eos=True, logit_bias={5: 4.0}, repetition_penalty=1.8),
         SP(temperature=0, max_tokens=10, ignore_eos=True, logit_bias={5: 4.0, 9: 3.5}, frequency_penalty=0.9,
            presence_penalty=0.4),
         SP(temperature=0, max_tokens=10, ignore_eos=True, logit_bias={5: 4.0}, presence_penalty=-0.5,
            frequency_penalty=0.3, repetition_penalty=0.8),
         SP(temperature=0, max_tokens=10, ignore_eos=True)]


@pytest.fixture(scope="module")
def llm():
    import k3jax

    return k3jax.LLM("tiny-k3", **KW)


@pytest.fixture(scope="module")
def forward_logits(llm):
    """Next-token logits of a sequence from the full forward (no cache), one compile: right padding does
    not change a causal model's logits at earlier positions."""
    from k3jax import steps

    model = llm.engine.model  # the engine's (weight layout as served)
    total = len(PROMPT) + 28
    fn = jax.jit(lambda ids: steps.forward(model.graphdef, model.params, ids))

    def logits(ids):  # [len(ids), V]: the logits after each prefix of ids
        padded = np.zeros((1, total), np.int32)
        padded[0, :len(ids)] = ids
        return np.asarray(fn(jnp.asarray(padded)))[0, :len(ids)]
    return logits


def _reference_tokens(logits_of, prompt, p: SP, stop=()):
    out = []
    for _ in range(p.max_tokens):
        x = _ref(logits_of(prompt + out)[-1], prompt, out, p.presence_penalty, p.frequency_penalty,
                 p.repetition_penalty, p.logit_bias)
        if len(out) < p.min_tokens:
            x[list(stop)] = -np.inf
        out.append(int(np.argmax(x)))
        if len(out) >= p.min_tokens and out[-1] in stop:
            break
    return out


def test_engine_penalties_match_a_reference_loop_in_a_batch_and_from_the_prefix_cache(llm, forward_logits):
    want = [_reference_tokens(forward_logits, PROMPT, p) for p in CASES]
    assert want[0] != want[3] and want[1] != want[3]  # the penalties change the output
    got = [r.token_ids for r in llm.generate([PROMPT] * 4, CASES)]
    assert got == want
    # again, resuming from the prefix cache (the prompt's history read from shared pages), one by one
    for p, w in zip(CASES[:2], want[:2]):
        r = llm.generate([PROMPT], p)[0]
        assert r.num_cached_tokens > 0 and r.token_ids == w
    assert llm.stats()["compiles_after_warmup"] == 0


def test_engine_min_tokens_bans_stops_until_reached(llm, forward_logits):
    first = _reference_tokens(forward_logits, PROMPT, SP(temperature=0, max_tokens=1))[0]
    p = SP(temperature=0, max_tokens=8, stop_token_ids=[first], min_tokens=3, logit_bias={first: 2.0})
    r = llm.generate([PROMPT], p)[0]
    stop = {first} | set(llm.engine.stop_ids)
    assert r.token_ids == _reference_tokens(forward_logits, PROMPT, p, stop)
    assert len(r.token_ids) >= 3 and first not in r.token_ids[:3]
    # without min_tokens the same request stops at once
    assert llm.generate([PROMPT], SP(temperature=0, max_tokens=8, stop_token_ids=[first]))[0].token_ids == [first]
    # with ignore_eos too, EOS stays banned until min_tokens are out (vLLM's all_stop_token_ids), then is sampled
    eos = min(llm.engine.stop_ids)
    p = SP(temperature=0, max_tokens=5, ignore_eos=True, min_tokens=3, logit_bias={eos: 100.0})
    r = llm.generate([PROMPT], p)[0]
    assert r.token_ids[:3] == _reference_tokens(forward_logits, PROMPT, dataclasses.replace(p, max_tokens=3),
                                                   set(llm.engine.stop_ids))
    assert r.token_ids[3:] == [eos, eos]
    e = llm.engine
    assert e.allocator.free_units + e._cached_units() == e.allocator.baseline_free_units


def _run_requests(e, requests):
    """Add (prompt, params) requests and step the engine until they finish -> each one's outputs, in order."""
    rids = [e.add_request(p, sp) for p, sp in requests]
    outs = {r: [] for r in rids}
    while any(not outs[r] or not outs[r][-1].finished for r in rids):
        for o in e.step():
            if o.request_id in outs:
                outs[o.request_id].append(o)
    return [outs[r] for r in rids]


def test_generate_takes_any_number_of_stop_strings(llm):
    """`LLM.generate` refused more than 128 stop strings (the HTTP server's bound, serve/types.py MAX_STOP); vLLM's
    offline LLM takes any number. Among 1,000 others, the string that matches ends the completion as alone."""
    base = dict(temperature=0, max_tokens=12, ignore_eos=True)
    text = llm.generate([PROMPT], SP(**base))[0].outputs[0].text
    stop = text[3:5]
    many = [f"never{i}" for i in range(1000)] + [stop]
    want, got = (llm.generate([PROMPT], SP(**base, stop=s))[0].outputs[0] for s in ([stop], many))
    assert (got.text, got.token_ids, got.stop_reason) == (want.text, want.token_ids, stop)
    assert want.finish_reason == "stop" and len(want.token_ids) < 12


def test_output_kinds_delta_and_final_only_carry_the_cumulative_outputs(llm):
    """vLLM's RequestOutputKind: DELTA outputs concatenate to the CUMULATIVE request's last output (text,
    ids, logprobs; with n = 2 sampled and a stop string that holds text back), each one new, the finish
    once at the end and prompt logprobs only in the first; FINAL_ONLY gives one output, the same. Every
    kind carries the cumulative logprob so far (vLLM's: with logprobs, the sampled tokens' sum)."""
    from serve.types import RequestOutputKind as K

    e = llm.engine
    base = dict(temperature=0.8, seed=5, n=2, max_tokens=14, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    (probe,) = _run_requests(e, [(PROMPT[:20], SP(**base))])
    text = probe[-1].outputs[0].text
    stop = [text[4:6]] if len(text) >= 6 and text[4:6].strip() else []
    runs = _run_requests(e, [(PROMPT[:20], SP(**base, stop=stop, output_kind=k)) for k in K])
    cumulative, delta, final = runs
    want = sorted(cumulative[-1].outputs, key=lambda o: o.index)
    assert len(final) == 1 and final[0].finished
    assert [(o.text, o.token_ids, o.finish_reason) for o in sorted(final[0].outputs, key=lambda o: o.index)] == \
        [(o.text, o.token_ids, o.finish_reason) for o in want]
    assert final[0].prompt_logprobs == cumulative[-1].prompt_logprobs
    assert delta[0].prompt_logprobs == cumulative[-1].prompt_logprobs
    assert all(d.prompt_logprobs is None for d in delta[1:])
    assert len(delta) > 2 and delta[-1].finished and not any(d.finished for d in delta[:-1])
    for w in want:
        parts = [c for d in delta for c in d.outputs if c.index == w.index]
        assert all(c.token_ids or c.text or c.finish_reason for c in parts)
        assert "".join(c.text for c in parts) == w.text
        assert [t for c in parts for t in c.token_ids] == w.token_ids
        assert [lp for c in parts for lp in c.logprobs] == w.logprobs
        assert [c.finish_reason for c in parts if c.finish_reason] == [w.finish_reason]
        # vLLM's cumulative_logprob (with logprobs): the sum of the sampled tokens' logprobs so far, in every kind
        assert w.cumulative_logprob == pytest.approx(sum(lp[t].logprob for lp, t in zip(w.logprobs, w.token_ids)))
        assert all(lp.decoded == lp.decoded_token for pos in w.logprobs for lp in pos.values())  # the former name
        (f,) = [c for c in final[0].outputs if c.index == w.index]
        assert f.cumulative_logprob == parts[-1].cumulative_logprob == w.cumulative_logprob
    assert all(c.cumulative_logprob is None for c in llm.generate([PROMPT[:5]], SP(max_tokens=2))[0].outputs)
    with pytest.raises(RequestError, match="output_kind: must be a RequestOutputKind"):
        e.add_request(PROMPT[:5], SP(output_kind=7))


def test_profile_records_the_engine_steps(llm, tmp_path):
    """LLM.start_profile / stop_profile (vLLM's; serve/profiler.py): a jax.profiler trace in which each step
    call is a `k3jax.step` annotation naming its bucket. A second start while recording is refused and
    leaves the recording stoppable (it replaced the LLM's handle: the trace could never be stopped)."""
    import gzip
    import json
    from pathlib import Path

    from serve.profiler import ProfilerError

    assert llm.start_profile(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ProfilerError, match="already being recorded"):
        llm.start_profile(str(tmp_path / "other"))
    llm.generate([PROMPT[:10]], SP(temperature=0, max_tokens=3))
    done = llm.stop_profile()
    with gzip.open(next(Path(done["dir"]).glob("*.trace.json.gz"))) as f:
        events = json.load(f)["traceEvents"]
    steps = [e for e in events if e.get("name") == "k3jax.step"]
    assert len(steps) >= 3 and {e["args"]["tokens"] for e in steps} >= {"1", "16"}, steps[:2]
    with pytest.raises(ProfilerError, match="no profile is being recorded"):
        llm.stop_profile()


def _processed_reference(logits_of, prompt, p: SP):
    """Greedy with the bias, then ban_below and HF's no-repeat-n-gram rule written out over prompt + output."""
    xa, out = p.extra_args or {}, []
    for _ in range(p.max_tokens):
        seq = prompt + out
        x = _ref(logits_of(seq)[-1], [], [], bias=p.logit_bias)
        x[:int(xa.get("min_id", 0))] = -np.inf
        n = xa.get("no_repeat_ngram_size", 0)
        if n and len(seq) >= n - 1:
            tail = tuple(seq[len(seq) - n + 1:])
            for i in range(len(seq) - n + 1):
                if tuple(seq[i:i + n - 1]) == tail:
                    x[seq[i + n - 1]] = -np.inf
        out.append(int(np.argmax(x)))
    return out


def test_custom_logits_processors_match_a_reference_loop_beside_plain_rows(llm, forward_logits):
    """Rows with a processor on follow the processed reference, those beside them the plain one, in one
    batch; then again resuming from the prefix cache (the n-gram history read from shared pages); a sampled
    row keeps to its processors; bad arguments are refused before taking memory; no compiles."""
    g = dict(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={5: 4.0})  # the model would repeat 5
    cases = [SP(**g, extra_args={"no_repeat_ngram_size": 2}), SP(**g),
             SP(**g, extra_args={"min_id": 200, "no_repeat_ngram_size": 1}), SP(**g, extra_args={"min_id": 100})]
    want = [_processed_reference(forward_logits, PROMPT, p) for p in cases]
    assert want[0] != want[1] and want[2] != want[1]  # the processors bite
    got = [r.token_ids for r in llm.generate([PROMPT] * 4, cases)]
    assert got == want
    assert min(got[2]) >= 200 and len(set(got[2])) == len(got[2]) and min(got[3]) >= 100
    r = llm.generate([PROMPT], cases[0])[0]
    assert r.num_cached_tokens > 0 and r.token_ids == want[0]
    sampled = SP(temperature=1.0, seed=4, max_tokens=20, ignore_eos=True)
    two = llm.generate([PROMPT, PROMPT], [sampled, SP(temperature=1.0, seed=4, max_tokens=20, ignore_eos=True,
                                                      extra_args={"min_id": 250, "no_repeat_ngram_size": 1})])
    assert two[0].token_ids == llm.generate([PROMPT], sampled)[0].token_ids  # off: unchanged by its neighbour
    negative = SP(temperature=1.0, seed=-9, max_tokens=6, ignore_eos=True)  # vLLM takes any 64-bit seed
    assert llm.generate([PROMPT], negative)[0].token_ids == llm.generate([PROMPT], negative)[0].token_ids
    assert min(two[1].token_ids) >= 250 and len(set(two[1].token_ids)) == 20
    for xa, match in (({"min_id": "ten"}, r"extra_args\['min_id'\]"), ({"no_repeat_ngram_size": 99}, "no_repeat_ngram")):
        with pytest.raises(RequestError, match=match):
            llm.generate([PROMPT], SP(extra_args=xa))
    e = llm.engine
    assert e.allocator.free_units + e._cached_units() == e.allocator.baseline_free_units
    assert llm.stats()["compiles_after_warmup"] == 0


def test_prompt_logprobs_match_the_full_forward_and_bypass_the_prefix_cache(llm, forward_logits):
    """Every prompt token after the first: logprob, rank and top-3 of the full forward's log-softmax, over
    three prefill chunks, next to a request without them; then again after the prompt is cached (computed
    anew, same values), and with n = 2 (the first sample scores the prompt)."""
    prompt = PROMPT[:37]
    first = llm.generate([prompt, PROMPT[:20]], [SP(temperature=0, max_tokens=2, prompt_logprobs=3),
                                                 SP(temperature=0, max_tokens=2)])
    assert first[1].prompt_logprobs is None
    got = first[0].prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    every = np.asarray(jax.nn.log_softmax(jnp.asarray(forward_logits(prompt)), axis=-1))
    for k in range(1, len(prompt)):
        lp = every[k - 1]
        chosen, alts = got[k][prompt[k]], got[k].top  # vLLM's dict: the prompt token's entry first
        assert chosen is got[k].chosen and next(iter(got[k])) == prompt[k] and chosen.token_id == prompt[k]
        assert chosen.logprob == pytest.approx(float(lp[prompt[k]]), rel=1e-5, abs=2e-5)  # fp32: 2.1e-5 seen
        assert chosen.rank == int(np.sum(lp >= lp[prompt[k]]))
        assert [a.token_id for a in alts] == list(np.argsort(-lp, kind="stable")[:3])
    again = llm.generate([prompt], SP(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    assert again.num_cached_tokens == 0  # the prompt is cached now, but scored anew
    assert [c.chosen.logprob for c in again.prompt_logprobs[1:]] == [c.chosen.logprob for c in got[1:]]
    two = llm.generate([prompt], SP(temperature=0, max_tokens=1, n=2, prompt_logprobs=1))[0]
    assert [c.chosen.logprob for c in two.prompt_logprobs[1:]] == [c.chosen.logprob for c in got[1:]]
    with pytest.raises(RequestError, match="prompt_logprobs"):
        llm.generate([prompt], SP(prompt_logprobs=4))


def test_logprobs_have_vllms_shape(llm):
    """vLLM's shape, as code written for vLLM reads it: per generated token a dict token id -> Logprob(logprob,
    rank, decoded_token), the sampled token's entry first, then the top-N by rank (N entries when the sampled
    token is among them, else N + 1; logprobs=0: the sampled token alone); prompt_logprobs likewise per prompt
    token, None for the first. `.chosen` / `.top` hold the same entries; outputs pickle and copy."""
    import copy
    import pickle

    from serve.types import TokenLogprobs

    prompt, tok = PROMPT[:16], llm.engine.tokenizer
    dec = lambda t: tok.decode([t], skip_special=False)  # noqa: E731
    g = dict(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([prompt] * 3, [SP(**g, logprobs=2, prompt_logprobs=2),
                                       SP(**g, logprobs=2, logit_bias={9: 100.0}),  # sampled; raw logprobs rank it low
                                       SP(**g, logprobs=0)])
    sizes = []
    for o in outs[:2]:
        c = o.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) == 6
        for i, lp in enumerate(c.logprobs):
            t = c.token_ids[i]
            assert isinstance(lp, dict) and next(iter(lp)) == t and lp[t] is lp.chosen
            assert lp[t].logprob <= 0 and lp[t].decoded_token == dec(t) and lp[t].decoded == lp[t].decoded_token
            top = lp.top
            assert [a.rank for a in top] == [1, 2] and all(lp[a.token_id] is a for a in top if a.token_id != t)
            assert len(lp) == (2 if t in [a.token_id for a in top] else 3)
            assert [k for k, _ in lp.items()] == list(dict.fromkeys([t] + [a.token_id for a in top]))
            assert lp[t].rank == 1 if t == top[0].token_id else lp[t].rank > 1
            sizes.append(len(lp))
        assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)))
    assert set(sizes) == {2, 3}  # the greedy row's token is its top-1; the biased row's mostly not in the top 2
    assert all(len(lp) == 1 and list(lp) == [t] for lp, t in zip(outs[2].outputs[0].logprobs, outs[2].token_ids))
    pl = outs[0].prompt_logprobs
    assert len(pl) == len(prompt) and pl[0] is None and outs[1].prompt_logprobs is None
    for j in range(1, len(prompt)):
        assert isinstance(pl[j], TokenLogprobs) and next(iter(pl[j])) == prompt[j]
        assert pl[j][prompt[j]].token_id == prompt[j] and pl[j][prompt[j]].rank >= 1 and len(pl[j]) in (2, 3)
    for o in outs:
        for again in (pickle.loads(pickle.dumps(o)), copy.deepcopy(o)):
            assert again == o and list(again.outputs[0].logprobs[0]) == list(o.outputs[0].logprobs[0])
            assert again.outputs[0].logprobs[0].chosen == o.outputs[0].logprobs[0].chosen


def test_allowed_token_ids_and_prompt_truncation(llm, forward_logits):
    allowed = [7, 11, 13, 40, 41]
    greedy = llm.generate([PROMPT], SP(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed))[0]
    out = []
    for _ in range(6):  # reference: the argmax over the allowed tokens only
        x = forward_logits(PROMPT + out)[-1]
        out.append(allowed[int(np.argmax(x[allowed]))])
    assert greedy.token_ids == out
    sampled = llm.generate([PROMPT], SP(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True,
                                        allowed_token_ids=allowed[:2], logit_bias={11: 5.0, 99: 50.0}))[0]
    assert set(sampled.token_ids) <= {7, 11}  # a bias outside the allowed set does not let a token in
    cut = llm.generate([PROMPT], SP(temperature=0, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=10))[0]
    assert cut.prompt_token_ids == PROMPT[-10:]
    assert cut.token_ids == llm.generate([PROMPT[-10:]], SP(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids
    whole = llm.generate([PROMPT], SP(temperature=0, max_tokens=2, ignore_eos=True, truncate_prompt_tokens=-1))[0]
    assert whole.prompt_token_ids == PROMPT  # vLLM's -1: the context window's worth (all of a short prompt)
    with pytest.raises(RequestError, match="truncate_prompt_tokens: 129 exceeds the context window of 128"):
        llm.generate([PROMPT], SP(max_tokens=2, truncate_prompt_tokens=129))
    with pytest.raises(RequestError, match="truncate_prompt_tokens: must be an integer >= 1 or -1"):
        llm.generate([PROMPT], SP(max_tokens=2, truncate_prompt_tokens=0))
    with pytest.raises(RequestError, match="allowed_token_ids"):
        llm.generate([PROMPT], SP(allowed_token_ids=[]))


# ---- structured outputs (serve/structured.py) ------------------------------------------------------
def _guided_reference(llm, logits_of, prompt, so, max_tokens):
    """Greedy under the constraint: the full forward's logits masked with llguidance's numpy op."""
    from llguidance.numpy import apply_token_bitmask_inplace

    from serve.structured import mask_words

    guide = llm.engine.grammars.guide(so)
    row = np.zeros((1, mask_words(llm.engine.cfg.vocab_size)), np.int32)
    out = []
    while len(out) < max_tokens and not guide.done:
        guide.fill(row[0])
        x = logits_of(prompt + out)[-1:].astype(np.float32).copy()
        apply_token_bitmask_inplace(x, row)
        out.append(int(np.argmax(x[0])))
        assert guide.advance(out[-1])
        if out[-1] in llm.engine.stop_ids:
            break
    return out


def test_structured_outputs_greedy_match_a_masked_reference_and_sampled_rows_stay_in_the_language(
        llm, forward_logits):
    import json
    import re

    from serve.types import StructuredOutputsParams as SO

    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "kind": {"enum": ["cat", "dog"]}},
              "required": ["id", "kind"], "additionalProperties": False}
    regex = r"[a-f]{3}-[0-9]{2,3}"
    cases = [SP(temperature=0, max_tokens=28, structured_outputs=SO(json=schema, disable_any_whitespace=True)),
             SP(temperature=0, max_tokens=12, structured_outputs=SO(regex=regex)),
             SP(temperature=0, max_tokens=6, ignore_eos=True),
             SP(temperature=1.0, seed=4, n=2, max_tokens=12, structured_outputs=SO(regex=regex))]
    prompts = [PROMPT, PROMPT[:25], PROMPT[:30], PROMPT[:33]]
    got = llm.generate(prompts, cases)
    want_json = _guided_reference(llm, forward_logits, PROMPT, cases[0].structured_outputs, 28)
    assert got[0].token_ids == want_json and got[0].finish_reason == "stop"
    v = json.loads(got[0].text)
    assert set(v) == {"id", "kind"} and 0 <= v["id"] <= 999 and v["kind"] in ("cat", "dog")
    assert got[1].token_ids == _guided_reference(llm, forward_logits, PROMPT[:25], cases[1].structured_outputs, 12)
    assert re.fullmatch(regex, got[1].text)
    assert got[2].token_ids == _reference_tokens(forward_logits, PROMPT[:30], cases[2])  # unconstrained row
    texts = [o.text for o in got[3].outputs]
    assert all(re.fullmatch(regex, t) for t in texts) and texts[0] != texts[1]
    e = llm.engine
    assert e.allocator.free_units + e._cached_units() == e.allocator.baseline_free_units
    assert e.stats()["compiles_after_warmup"] == 0 and e.counters["structured_output_errors"] == 0
    with pytest.raises(RequestError, match=r"structured_outputs\.regex"):
        llm.generate([PROMPT], SP(structured_outputs=SO(regex="(")))
    deep = {"type": "integer"}
    for _ in range(3000):  # past Python's recursion limit: a clear error, not a RecursionError
        deep = {"type": "array", "items": deep}
    with pytest.raises(RequestError, match=r"structured_outputs\.json: the schema nests"):
        llm.generate([PROMPT], SP(structured_outputs=SO(json=deep)))


def test_a_constrained_requests_logprobs_are_the_models_renormalised_over_what_the_grammar_allows(
        llm, forward_logits):
    """vLLM applies the grammar bitmask to the logits before its sampler, so its (default, raw) logprobs of a
    structured-output request are the model's log-softmax over the allowed tokens: each sampled token's and
    its alternatives', all allowed by the grammar at that point; the tokens are the masked reference's."""
    from llguidance.numpy import apply_token_bitmask_inplace

    from serve.structured import mask_words
    from serve.types import StructuredOutputsParams as SO

    so = SO(regex=r"[a-f]{2}-[0-9]{2}")
    got = llm.generate([PROMPT], SP(temperature=0, max_tokens=12, logprobs=3, structured_outputs=so))[0]
    assert got.token_ids == _guided_reference(llm, forward_logits, PROMPT, so, 12) and got.finish_reason == "stop"
    guide = llm.engine.grammars.guide(so)
    row = np.zeros((1, mask_words(llm.engine.cfg.vocab_size)), np.int32)
    cum = 0.0
    for i, pos in enumerate(got.outputs[0].logprobs):
        guide.fill(row[0])
        x = forward_logits(PROMPT + got.token_ids[:i])[-1:].astype(np.float64).copy()
        apply_token_bitmask_inplace(x, row)
        want = x[0] - x[0].max() - np.log(np.sum(np.exp(x[0] - x[0].max())))
        tok = got.token_ids[i]
        assert pos.chosen.logprob == pytest.approx(want[tok], abs=1e-4) and pos.chosen.rank == 1
        finite = [t for t in pos.top if np.isfinite(t.logprob)]
        assert all(np.isfinite(want[t.token_id]) for t in finite) and finite[0].token_id == tok
        np.testing.assert_allclose([t.logprob for t in finite], np.sort(want)[::-1][:len(finite)], atol=1e-4)
        cum += want[tok]
        assert guide.advance(tok)
    assert got.outputs[0].cumulative_logprob == pytest.approx(cum, abs=1e-3)


def test_llm_chat_renders_like_the_template_and_a_rejected_prompt_withdraws_the_batch(llm, monkeypatch):
    from k3jax.chat_template import encode_chat

    conv = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    p = SP(temperature=0, max_tokens=4, ignore_eos=True)
    got = llm.chat([conv, conv[1:]], p)
    want_ids = encode_chat(llm.engine.tokenizer, [{"role": "system", "content": "be brief"}, conv[1]])
    assert got[0].prompt_token_ids == want_ids
    assert got[0].token_ids == llm.generate([want_ids], p)[0].token_ids
    assert got[1].prompt_token_ids == encode_chat(llm.engine.tokenizer, conv[1:])
    # vLLM's `tools`: rendered as the HTTP API renders them (tool_choice auto), the answer left raw
    from serve.chat import chat_ids
    from serve.tools import plan_tools

    tools = [{"type": "function", "function": {"name": "light", "parameters": {"type": "object"}}}]
    seen = []  # (the tools' system message is longer than this engine's context: the prompts as generate gets them)
    monkeypatch.setattr(llm, "generate", lambda prompts, *a, **k: seen.extend(prompts) or [])
    llm.chat(conv, tools=tools)
    assert seen == [chat_ids(llm.engine.tokenizer, "byte", conv, tools=plan_tools(tools, None, None))]
    assert len(seen[0]) > len(want_ids) and llm.engine.tokenizer.decode(seen[0]).count("light") == 1
    with pytest.raises(RequestError, match=r"tools: tools\[0\]"):
        llm.chat(conv, tools=[{"type": "retrieval"}])
    monkeypatch.undo()
    with pytest.raises(RequestError, match=r"messages\[0\]\.role"):
        llm.chat([{"role": "wizard", "content": "x"}])
    with pytest.raises(RequestError, match="prompt"):
        llm.generate([PROMPT, PROMPT, []], p)
    assert not llm.engine.has_unfinished()
    llm.engine.step()  # reaps the withdrawn requests
    e = llm.engine
    assert not e.requests and e.allocator.free_units + e._cached_units() == e.allocator.baseline_free_units


def test_llm_generate_owns_its_batch_through_ctrl_c_foreign_requests_and_salted_prompt_dicts(llm, monkeypatch):
    """`LLM.generate`: Ctrl-C while the batch is being queued withdrew nothing (only an Exception did), so the
    queued prompts kept their memory and ran on in later calls; requests queued outside the call finishing first
    counted as its own and it ended early with a KeyError; vLLM's prompt dicts with a `cache_salt` were refused."""
    e = llm.engine
    p = SP(temperature=0, max_tokens=6, ignore_eos=True)
    added, add = [], e.add_request
    monkeypatch.setattr(e, "add_request", lambda *a, **k: (len(added) == 2 and _raise(KeyboardInterrupt()))
                        or added.append(add(*a, **k)) or added[-1])
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT, PROMPT[:30], PROMPT[:20]], p)
    monkeypatch.undo()
    assert len(added) == 2 and not e.requests and not e.has_unfinished()
    assert e.allocator.free_units + e._cached_units() == e.allocator.baseline_free_units
    # requests of someone else's that finish first are not this call's
    others = [e.add_request(PROMPT[:12], SP(temperature=0, max_tokens=1, ignore_eos=True)) for _ in range(2)]
    outs = llm.generate([PROMPT[:30], PROMPT[:20]], p)
    assert [o.prompt_token_ids for o in outs] == [PROMPT[:30], PROMPT[:20]] and not set(others) & {
        o.request_id for o in outs} and all(len(o.token_ids) == 6 for o in outs)
    # vLLM's per-prompt salt: prompts share cached prefixes only under the same salt
    llm.reset_prefix_cache()
    salted = [{"prompt_token_ids": PROMPT, "cache_salt": "a"}, {"prompt": "a salted text prompt, " * 2, "cache_salt": "a"}]
    first = llm.generate(salted, p)
    again = llm.generate(salted + [{"prompt_token_ids": PROMPT, "cache_salt": "b"}, PROMPT], p)
    assert [o.num_cached_tokens > 0 for o in again] == [True, True, False, False]
    assert [o.token_ids for o in again[:2]] == [o.token_ids for o in first] and again[1].prompt == salted[1]["prompt"]
    assert llm.generate(salted[0], p, cache_salt="a")[0].num_cached_tokens > 0
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([PROMPT, salted[0]], p, cache_salt="b")
    assert not e.has_unfinished()


def test_llm_generate_holds_ctrl_c_back_until_the_engine_is_consistent(llm, monkeypatch, request):
    """Ctrl-C raised KeyboardInterrupt at whatever line of the engine ran: one landing while a finished request's
    state slot was being freed leaked that slot's cache for good (the arena never came back to its baseline,
    each interrupt shrinking it), and one inside `add_request` left a sequence without its request, which
    failed every later `generate` (KeyError). The interrupt now comes out between engine calls."""
    import serve.engine as engine_module

    # Python's own Ctrl-C handler, as a terminal or notebook has it (a shell that starts pytest in the background
    # ignores SIGINT, and `LLM` leaves an ignored or custom handler alone)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))

    e = llm.engine
    p = SP(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:20]]
    want = [o.token_ids for o in llm.generate(prompts, p)]

    def settled():
        while e.has_unfinished():  # (the engine's own re-prefills of shared prefixes)
            e.step()
        return not e.requests and e.allocator.free_units + e._cached_units() == e.allocator.baseline_free_units

    free_slot = e.allocator.free_slot

    def ctrl_c_in_free_slot(base):  # Ctrl-C while a finished request's slot is freed
        monkeypatch.setattr(e.allocator, "free_slot", free_slot)
        signal.raise_signal(signal.SIGINT)
        free_slot(base)
    monkeypatch.setattr(e.allocator, "free_slot", ctrl_c_in_free_slot)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, p)
    assert settled()
    checker = engine_module.StopChecker

    def ctrl_c_in_add_request(*a, **k):  # Ctrl-C while the second of a request's two samples is built
        if ctrl_c_in_add_request.calls == 1:
            signal.raise_signal(signal.SIGINT)
        ctrl_c_in_add_request.calls += 1
        return checker(*a, **k)
    ctrl_c_in_add_request.calls = 0
    monkeypatch.setattr(engine_module, "StopChecker", ctrl_c_in_add_request)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, dataclasses.replace(p, n=2))
    monkeypatch.undo()
    assert settled() and not e.seqs
    assert [o.token_ids for o in llm.generate(prompts, p)] == want
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    from serve.llm import interrupts_between_steps

    reached = []
    with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C (a step that never returns) raises at once
        with interrupts_between_steps():
            signal.raise_signal(signal.SIGINT)
            reached.append(1)
            signal.raise_signal(signal.SIGINT)
            reached.append(2)
    assert reached == [1] and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_llm_generate_from_two_threads_runs_the_calls_one_after_another(llm):
    """vLLM's `LLM` is not thread-safe; here two threads calling `generate` at once stepped the engine together:
    donated buffers used twice, KeyErrors, both calls failed and the engine kept a step's debris. The calls now
    take turns; a `generate` from inside one (a progress-bar callback), which would wait forever, raises."""
    e = llm.engine
    p = SP(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:30], PROMPT[:20]]
    want = [o.token_ids for o in llm.generate(prompts, p)]
    got, errors = [], []

    def run():
        try:
            for _ in range(2):
                got.append([o.token_ids for o in llm.generate(prompts, p)])
        except Exception as ex:
            errors.append(ex)
    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and got == [want] * 4

    class Bar:  # a progress bar generating from its callback
        def __init__(self, total, desc):
            pass

        def update(self, k):
            llm.generate(prompts[:1], p)

        def close(self):
            pass
    with pytest.raises(RuntimeError, match="inside a generate call"):
        llm.generate(prompts[:1], p, use_tqdm=Bar)
    assert not e.requests and e.allocator.free_units + e._cached_units() == e.allocator.baseline_free_units


def test_llm_generate_refused_beside_an_async_engine_names_the_replica_it_steps():
    """With data-parallel replicas an AsyncEngine steps one replica: the refusal told the user to call
    `running_driver(llm.engine).shutdown()`, which finds none there (None.shutdown(): AttributeError). It names
    the replica whose driver it found."""
    import weakref
    from types import SimpleNamespace

    from serve.async_engine import running_driver
    from serve.llm import LLM

    class Driver:  # (an AsyncEngine whose thread runs)
        alive = True
    driver = Driver()
    replicas = [SimpleNamespace(), SimpleNamespace(_async_driver=weakref.ref(driver))]
    llm = LLM.__new__(LLM)
    llm.engine, llm.progress = SimpleNamespace(replicas=replicas), False
    with pytest.raises(RuntimeError, match=r"running_driver\(llm\.engine\.replicas\[1\]\)\.shutdown\(\)"):
        llm.generate([[5, 6, 7]], SP(max_tokens=1))
    assert running_driver(llm.engine) is None and running_driver(llm.engine.replicas[1]) is driver
    llm.engine = replicas[1]  # one engine: named llm.engine, as before
    with pytest.raises(RuntimeError, match=r"running_driver\(llm\.engine\)\.shutdown\(\)"):
        llm.generate([[5, 6, 7]], SP(max_tokens=1))


def _raise(exc):
    raise exc


def test_llm_generate_reads_array_prompts_and_checks_each_sampling_params(llm):
    """Token ids as JAX arrays (as NumPy ones: `[L]` one prompt, `[B, L]` a batch, or in a list) were refused as
    "got ArrayImpl"; a None in the sampling_params list ran with SamplingParams() instead of the model's defaults,
    and an entry of the wrong type failed deep in the engine (AttributeError) instead of naming itself."""
    e = llm.engine
    p = SP(temperature=0, max_tokens=3, ignore_eos=True)
    want = [o.token_ids for o in llm.generate([PROMPT[:10], PROMPT[10:20]], p)]
    batch = jnp.asarray([PROMPT[:10], PROMPT[10:20]], jnp.int32)
    for prompts in (batch, list(batch), batch[0]):
        outs = llm.generate(prompts, p)
        assert [o.token_ids for o in outs] == want[:len(outs)] and outs[0].prompt_token_ids == PROMPT[:10]
    saved = e.generation_defaults
    try:
        e.generation_defaults = {"temperature": 0.0, "max_tokens": 2}  # as read from a generation_config.json
        outs = llm.generate([PROMPT[:10], PROMPT[10:20]], [None, p])
    finally:
        e.generation_defaults = saved
    assert [o.token_ids for o in outs] == [want[0][:2], want[1]]
    with pytest.raises(TypeError, match=r"sampling_params\[1\]: expected SamplingParams"):
        llm.generate([PROMPT, PROMPT], [p, {"temperature": 0}])
    with pytest.raises(TypeError, match="sampling_params: expected"):
        llm.generate([PROMPT], {"temperature": 0})
    assert not e.requests and not e.has_unfinished()


def test_structured_rows_survive_preemption(llm, forward_logits):
    """A constrained request preempted mid-answer is recomputed (prompt + outputs so far) and goes on
    under the same matcher: the same tokens as without the preemption."""
    from serve.types import StructuredOutputsParams as SO

    so = SO(regex=r"[a-f]{3}-[0-9]{2,3}")
    p = SP(temperature=0, max_tokens=12, structured_outputs=so)
    want = _guided_reference(llm, forward_logits, PROMPT[:30], so, 12)
    e = llm.engine
    rid = e.add_request(PROMPT[:30], p)
    seq = e.requests[rid].seqs[0]
    while len(seq.output_ids) < 3:
        e.step()
    e._preempt(seq)
    assert seq.slot is None and seq.computed == 0 and len(seq.output_ids) == 3
    done = None
    while done is None:
        done = next((o for o in e.step() if o.request_id == rid and o.finished), None)
    assert done.token_ids == want and e.counters["structured_output_errors"] == 0


class _FailsOnSecondToken:
    """A matcher that takes one token, then fails as llguidance does past its limits (an error state)."""

    def __init__(self, matcher):
        self.m, self.taken, self.failed = matcher, 0, False

    def consume_token(self, tok):
        self.taken += 1
        self.failed = self.failed or self.taken > 1
        return not self.failed and self.m.consume_token(tok)

    def is_error(self):
        return self.failed

    def get_error(self):
        return "Parser Error: Current row has 2807 items; max is 2000\n<state>\n{...}"

    def __getattr__(self, name):
        return getattr(self.m, name)


def test_a_constraint_that_fails_mid_generation_finishes_with_error(llm):
    """A constraint llguidance gives up on mid-way (its row and lexer limits) ended the request with finish_reason
    "stop" and an output outside the language; as vLLM's FINISHED_ERROR it is "error", stop_reason the reason."""
    from serve.types import StructuredOutputsParams as SO

    e = llm.engine
    before = e.counters["structured_output_errors"]
    rid = e.add_request(PROMPT[:20], SP(temperature=0, max_tokens=8, structured_outputs=SO(regex=r"[a-f]{6}")))
    seq = e.requests[rid].seqs[0]
    seq.guide.matcher = _FailsOnSecondToken(seq.guide.matcher)
    done = None
    while done is None:
        done = next((o for o in e.step() if o.request_id == rid and o.finished), None)
    o = done.outputs[0]
    assert (o.finish_reason, o.stop_reason, len(o.token_ids)) == (
        "error", "Parser Error: Current row has 2807 items; max is 2000", 2)
    assert e.counters["structured_output_errors"] == before + 1 and not e.has_unfinished()
    e.counters["structured_output_errors"] = before  # (the shared engine's later tests count their own: none)
    # a schema too wide where the output enters an inner object (`{"id": "...", "data": {`) ran and ended so: refused
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(700)}}
    schema = {"type": "object", "properties": {"id": {"type": "string"}, "data": wide}, "required": ["id", "data"]}
    with pytest.raises(RequestError, match=r"^structured_outputs\.json: too complex .* \(at /properties/data: "):
        llm.generate([PROMPT], SP(max_tokens=64, structured_outputs=SO(json=schema)))
    assert not e.has_unfinished() and e.counters["structured_output_errors"] == before


def test_bad_words_follow_vllms_rule_against_a_reference_loop(llm, forward_logits):
    """Greedy with bad words equals the full forward's argmax with vLLM's ban applied on the host: a
    one-token word never appears; a two-token word's last token is banned right after its first. A bias
    towards 'q' and 'z' makes both bite."""
    from serve.structured import banned_tokens, clear_bits

    tok = llm.engine.tokenizer
    q, z = tok.encode("q")[0], tok.encode("z")[0]
    bias = {q: 10.0, z: 9.0}
    words = ["q", "zz"]
    ids = [(q,), (z, z)]  # " q" / " zz" are longer in bytes: vLLM's rule keeps only same-length variants
    out = []
    for _ in range(10):
        x = _ref(forward_logits(PROMPT + out)[-1], [], [], bias=bias)
        for w in ids:  # the rule, written out independently of banned_tokens
            if len(w) == 1 or (len(out) >= len(w) - 1 and tuple(out[len(out) - len(w) + 1:]) == w[:-1]):
                x[w[-1]] = -np.inf
        out.append(int(np.argmax(x)))
    got = llm.generate([PROMPT], SP(temperature=0, max_tokens=10, ignore_eos=True, logit_bias=bias,
                                    bad_words=words))[0].token_ids
    assert got == out
    assert q not in got and z in got and all(a != z or b != z for a, b in zip(got, got[1:]))
    row = np.full(2, -1, np.int32)
    clear_bits(row, banned_tokens([(33,), (1, 40)], [5, 1]))
    assert row.view(np.uint32)[1] == 0xFFFFFFFF & ~(1 << 1) & ~(1 << 8)
    with pytest.raises(RequestError, match="bad_words"):
        llm.generate([PROMPT], SP(bad_words=["  "]))
    # a constraint whose only continuation is banned keeps it: the output stays valid, nothing breaks
    from serve.types import StructuredOutputsParams as SO
    r = llm.generate([PROMPT], SP(temperature=0, max_tokens=8, structured_outputs=SO(choice=["ab"]),
                                  bad_words=["ab"]))[0]
    assert r.text == "ab" and llm.engine.counters["structured_output_errors"] == 0



def test_bad_words_stay_out_of_a_constrained_requests_logprobs_and_all_banned_rows_sample_what_they_allow(
        llm, forward_logits):
    """vLLM takes its raw logprobs after the grammar's bitmask but before bad words: a constrained request's
    logprobs are the model's renormalised over what the grammar allows, banned tokens included (the ban was
    written into the grammar's mask, so bad words changed them), while its tokens obey both. A request whose
    allowed tokens are all banned (allowed_token_ids all bad words) sampled the garbage token 0 of an all -inf row:
    it samples what it allows (the ban gives way); allowed tokens that are all stop tokens under min_tokens are
    refused (EOS came min_tokens times, a stop that did not stop)."""
    from llguidance.numpy import apply_token_bitmask_inplace

    from serve.structured import mask_words
    from serve.types import StructuredOutputsParams as SO

    tok = llm.engine.tokenizer
    so = SO(regex=r"[a-f]{2}-[0-9]{2}")
    banned = [tok.encode(w)[0] for w in ("d", "b")]
    got = llm.generate([PROMPT], SP(temperature=0, max_tokens=12, logprobs=3, structured_outputs=so,
                                    bad_words=["d", "b"]))[0]
    guide = llm.engine.grammars.guide(so)
    row = np.zeros((1, mask_words(llm.engine.cfg.vocab_size)), np.int32)
    out, seen = [], set()
    for pos in got.outputs[0].logprobs:
        guide.fill(row[0])
        x = forward_logits(PROMPT + out)[-1:].astype(np.float64).copy()
        apply_token_bitmask_inplace(x, row)
        want = x[0] - x[0].max() - np.log(np.sum(np.exp(x[0] - x[0].max())))  # the grammar's alone
        y = x[0].copy()
        y[banned] = -np.inf
        out.append(int(np.argmax(y)))
        assert got.token_ids[len(out) - 1] == out[-1]
        assert pos.chosen.logprob == pytest.approx(want[out[-1]], abs=1e-4)
        finite = [t for t in pos.top if np.isfinite(t.logprob)]
        np.testing.assert_allclose([t.logprob for t in finite], np.sort(want)[::-1][:len(finite)], atol=1e-4)
        seen |= {t.token_id for t in finite}
        assert guide.advance(out[-1])
    assert not set(banned) & set(got.token_ids) and set(banned) & seen and got.finish_reason == "stop"
    a, eos = tok.encode("a")[0], llm.engine.stop_ids[0]
    for t in (0.0, 1.0):
        r = llm.generate([PROMPT], SP(temperature=t, seed=3, max_tokens=3, allowed_token_ids=[a], bad_words=["a"]))[0]
        assert r.token_ids == [a] * 3
    # allowed tokens that are all stop tokens under min_tokens: nothing may come before min_tokens are out (the
    # fallback sampled EOS three times, a stop token that did not stop): refused up front, naming both fields
    for kw in (dict(allowed_token_ids=[eos]), dict(allowed_token_ids=[eos, a], stop_token_ids=[a], ignore_eos=True)):
        with pytest.raises(RequestError, match="allowed_token_ids: every allowed token is a stop token .* min_tokens=3"):
            llm.generate([PROMPT], SP(temperature=0, max_tokens=6, min_tokens=3, **kw))
    r = llm.generate([PROMPT], SP(temperature=0, max_tokens=6, min_tokens=3, allowed_token_ids=[eos, a]))[0]
    assert r.token_ids[:3] == [a] * 3 and eos not in r.token_ids[:3]
    e = llm.engine
    assert e.counters["structured_output_errors"] == 0 and e.stats()["compiles_after_warmup"] == 0

def test_llm_uses_the_models_default_sampling_and_reports_progress(llm, forward_logits):
    """vLLM's `LLM` conveniences: `generate` without sampling parameters samples with the model's generation
    config (`get_default_sampling_params`), `use_tqdm` takes a tqdm-like factory, `get_tokenizer`."""
    class Bar:
        made = []

        def __init__(self, total, desc):
            self.total, self.n = total, 0
            Bar.made.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            self.closed = True

    e = llm.engine
    saved = e.generation_defaults
    try:
        e.generation_defaults = {"temperature": 0.0, "max_tokens": 3}  # as read from a generation_config.json
        assert llm.get_default_sampling_params() == SP(temperature=0.0, max_tokens=3)
        outs = llm.generate([PROMPT, PROMPT[:20]], use_tqdm=Bar)
    finally:
        e.generation_defaults = saved
    assert [o.token_ids for o in outs] == [_reference_tokens(forward_logits, p, SP(temperature=0, max_tokens=3))
                                           for p in (PROMPT, PROMPT[:20])]
    assert [(b.total, b.n, b.closed) for b in Bar.made] == [(2, 2, True)]
    assert llm.get_default_sampling_params() == SP() and llm.get_tokenizer() is e.tokenizer


def test_detokenize_false_gives_the_same_ids_without_text(llm):
    """vLLM's `detokenize=False`: the same tokens and logprobs, no text (output or logprob tokens); stop strings,
    which match the text, are refused, stop token ids still stop."""
    p = SP(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    with_text = llm.generate([PROMPT[:20], "The quick"], p)
    ids_only = llm.generate([PROMPT[:20], "The quick"], dataclasses.replace(p, detokenize=False))
    assert [o.token_ids for o in ids_only] == [o.token_ids for o in with_text]
    assert all(o.outputs[0].text == "" for o in ids_only) and all(o.outputs[0].text for o in with_text)
    for a, b in zip(ids_only, with_text):
        assert [[(x.token_id, x.logprob) for x in pos.values()] for pos in a.outputs[0].logprobs] == [
            [(x.token_id, x.logprob) for x in pos.values()] for pos in b.outputs[0].logprobs]
        assert all(x.decoded_token == "" for pos in a.outputs[0].logprobs for x in pos.values())
    assert any(pos.chosen.decoded_token for pos in with_text[0].outputs[0].logprobs)
    first = with_text[0].token_ids[2]
    stopped = llm.generate([PROMPT[:20]], SP(temperature=0, max_tokens=6, detokenize=False, stop_token_ids=[first]))
    assert stopped[0].token_ids == with_text[0].token_ids[:with_text[0].token_ids.index(first) + 1]
    assert stopped[0].outputs[0].finish_reason == "stop"
    with pytest.raises(RequestError, match="stop"):
        llm.generate(["x"], SP(max_tokens=2, stop=["a"], detokenize=False))
    assert not llm.engine.has_unfinished()


def _sampled_from(x, p: SP):
    """float64 values a row of (biased, penalised) logits `x` is sampled from, by the definition (a sort):
    greedy rows as they are; sampled rows over the temperature with min-p, then top-k and the top-p nucleus of
    what is left, at -inf (vLLM's order)."""
    if p.temperature < 1e-5:
        return x
    x = x / p.temperature
    keep = np.ones(x.shape, bool)
    if p.min_p > 0:
        keep &= x - x.max() >= np.log(p.min_p)
    if 0 < p.top_k < len(x):
        keep &= x >= np.sort(x)[::-1][p.top_k - 1]
    if p.top_p < 1:
        s = np.sort(np.where(keep, x, -np.inf))[::-1]
        probs = np.exp(s - s[0]) / np.sum(np.exp(s - s[0]))
        before = np.cumsum(probs) - probs
        assert np.min(np.abs(before - p.top_p)) > 2e-5  # not on a rounding knife edge
        keep &= x >= s[max(int(np.sum(before < p.top_p)), 1) - 1]
    return np.where(keep, x, -np.inf)


def test_processed_logprobs_follow_every_sampling_path(llm, forward_logits):
    """`logprobs_mode="processed_logprobs"` on an engine with async scheduling and n-gram drafts, so tokens are
    sampled by prefill programs, by the separate sample program of async decode steps and by verify steps: each
    token's logprob and the top-3 are the log-softmax of the values it was drawn from, computed from the full
    forward (bias, penalty, temperature, top-k / top-p / min-p); tokens = the raw-mode engine's; prompt logprobs
    stay raw (prompts are scored, not sampled)."""
    import k3jax

    def log_softmax(x):
        return x - x.max() - np.log(np.sum(np.exp(x - x.max())))

    e = k3jax.LLM("tiny-k3", **{**KW, "logprobs_mode": "processed_logprobs", "async_scheduling": True,
                                "speculative_config": {"num_speculative_tokens": 2, "adaptive": False}})
    g = dict(max_tokens=8, ignore_eos=True, logprobs=3)
    cases = [SP(temperature=0, logit_bias={5: 4.0}, repetition_penalty=1.3, **g),
             SP(temperature=0.8, top_k=20, seed=3, **g),
             SP(temperature=0.3, top_p=0.7, min_p=0.02, seed=4, **g),
             SP(temperature=0, prompt_logprobs=2, **g)]
    prompts = [PROMPT[:12] * 3, PROMPT[5:17] * 3, PROMPT[:30], PROMPT[10:40]]  # repeats: the drafts find n-grams
    got = e.generate(prompts, cases)
    raw = llm.generate(prompts, cases)
    assert [o.token_ids for o in got] == [o.token_ids for o in raw]
    stats = e.engine.counters
    assert stats["spec_decode_num_drafts"] > 0 and stats["steps_launched_ahead"] > 0
    assert e.stats()["compiles_after_warmup"] == 0
    for prompt, p, o, r in zip(prompts, cases, got, raw):
        out = o.token_ids
        for i, pos in enumerate(o.outputs[0].logprobs):
            chosen, top = pos.chosen, pos.top
            x = _ref(forward_logits(prompt + out[:i])[-1], prompt, out[:i], repetition=p.repetition_penalty,
                     bias=p.logit_bias)
            want = log_softmax(_sampled_from(x, p))
            assert chosen.token_id == out[i] and chosen.logprob == pytest.approx(want[out[i]], rel=1e-4, abs=1e-4)
            order = np.argsort(-want, kind="stable")[:3]
            np.testing.assert_allclose([t.logprob for t in top], want[order], rtol=1e-4, atol=1e-4)
            # vLLM's ranks: the sampled token's the tokens at or above it (within rounding), the top-n's their place
            above = lambda eps: 1 + int(np.sum(want > want[out[i]] + eps))  # noqa: E731
            assert above(1e-4) <= chosen.rank <= above(-1e-4) and [t.rank for t in top] == [1, 2, 3]
        sampled = p.temperature > 0
        differs = [a.chosen.logprob != pytest.approx(b.chosen.logprob, abs=1e-3) for a, b in
                   zip(o.outputs[0].logprobs, r.outputs[0].logprobs)]
        assert all(differs) if sampled or p.repetition_penalty != 1 else not any(differs)
    np.testing.assert_allclose([c.chosen.logprob for c in got[3].prompt_logprobs[1:]],
                               [c.chosen.logprob for c in raw[3].prompt_logprobs[1:]], rtol=1e-5, atol=1e-5)
    from serve.beam_search import BeamSearchParams
    from serve.engine import Engine

    logits = Engine(llm.engine.model, dataclasses.replace(llm.engine.config, logprobs_mode="raw_logits"),
                    warmup=False, progress=False)  # (refused before anything compiles)
    with pytest.raises(RequestError, match="logprobs_mode"):
        logits.add_request(PROMPT[:10], BeamSearchParams(beam_width=1, max_tokens=2))


def test_prompt_logprobs_are_logprobs_under_a_logits_mode(llm):
    """vLLM's model runner scores prompt tokens with log_softmax whatever `logprobs_mode` says (the mode applies to
    sampled tokens): an engine in raw_logits mode answered prompt_logprobs with raw logits. Its prompt logprobs
    (values, ranks, top-n) are the raw_logprobs engine's; its sampled token's value is still a logit."""
    from serve.engine import Engine

    e = Engine(llm.engine.model, dataclasses.replace(llm.engine.config, logprobs_mode="raw_logits"), warmup=False,
               progress=False)  # (not warmed: compiles only the programs this request runs)
    # one token: sampled by the prefill program that scores the prompt, so no decode program compiles (the
    # modes' values out of the sample function: tests/test_sampling.py)
    p = SP(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=2)
    rid = e.add_request(PROMPT[:20], p)
    got = [o for _ in range(64) if e.has_unfinished() for o in e.step() if o.finished and o.request_id == rid][0]
    raw = llm.generate([PROMPT[:20]], p)[0]
    assert got.token_ids == raw.token_ids
    for g, r in zip(got.prompt_logprobs[1:], raw.prompt_logprobs[1:]):
        assert g.chosen.logprob == pytest.approx(r.chosen.logprob, abs=1e-5) and g.chosen.rank == r.chosen.rank
        assert [(t.token_id, t.rank) for t in g.top] == [(t.token_id, t.rank) for t in r.top]
        np.testing.assert_allclose([t.logprob for t in g.top], [t.logprob for t in r.top], atol=1e-5)
    assert max(c.chosen.logprob for c in got.prompt_logprobs[1:]) <= 0
    assert got.outputs[0].logprobs[0].chosen.logprob != pytest.approx(raw.outputs[0].logprobs[0].chosen.logprob)


def test_beam_search_text_leaves_out_the_eos_that_ended_a_hypothesis(llm):
    """vLLM's beam search: a hypothesis that ended with EOS keeps the id in its token ids, its text leaves it out
    (with include_stop_str_in_output too) and its stop_reason is that id. The end token here is the first token
    the model proposes, a plain byte: a search of width 1 completes on it at once."""
    from serve.beam_search import BeamSearchParams

    e = llm.engine
    prompt = PROMPT[:12]
    (probe,) = _run_requests(e, [(prompt, SP(temperature=0, max_tokens=1, ignore_eos=True))])
    eos = probe[-1].outputs[0].token_ids[0]
    assert eos < 256  # a byte: rendered unless left out
    saved = e.stop_ids
    e.stop_ids = (eos,)
    try:
        for include in (False, True):
            seqs = llm.beam_search([prompt], BeamSearchParams(1, 3, length_penalty=0.0,
                                                             include_stop_str_in_output=include))[0].sequences
            (s,) = seqs
            assert s.finish_reason == "stop" and s.tokens == prompt + [eos]
            assert s.text == "" and s.stop_reason == eos
    finally:
        e.stop_ids = saved


def test_llm_seed_seeds_the_engines_sampling(monkeypatch):
    """vLLM's `LLM(seed=...)` seeds the sampling of requests without a seed of their own (it was taken for the
    preset's weights only, and the engine's `seed` option could not be given at all)."""
    import types

    import k3jax
    import serve.llm

    built = []
    monkeypatch.setattr(serve.llm, "Engine", lambda model, config, progress: built.append(config) or
                        types.SimpleNamespace(layer_scan=None))
    for seed, want in ((5, 5), (None, None)):
        k3jax.LLM("tiny-k3", seed=seed, **KW)
        assert built[-1].seed == want


def test_llm_takes_vllms_enforce_eager_and_swap_space_as_noted_no_ops(monkeypatch, caplog):
    """vLLM's `LLM(..., enforce_eager=True, swap_space=4, disable_log_stats=...)` raised TypeError (EngineConfig has
    no such fields) while `k3jax serve` takes both flags as no-ops with a note: the Python API takes them alike,
    the engine's config unchanged, a note logged for each; a swap space that is no size is refused naming it."""
    import logging
    import types

    import k3jax
    import serve.llm

    built = []
    monkeypatch.setattr(serve.llm, "Engine", lambda model, config, progress: built.append(config) or
                        types.SimpleNamespace(layer_scan=None))
    k3jax.LLM("tiny-k3", **KW)
    with caplog.at_level(logging.WARNING, logger="serve.llm"):
        k3jax.LLM("tiny-k3", enforce_eager=True, swap_space=4, **KW)
    assert built[0] == built[1]
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["enforce_eager=True", "swap_space=4"]
    # vLLM's disable_log_stats (a TypeError too): True, vLLM's LLM default, is what this LLM does; False is noted
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="serve.llm"):
        k3jax.LLM("tiny-k3", disable_log_stats=True, **KW)
        k3jax.LLM("tiny-k3", disable_log_stats=False, **KW)
    assert built[0] == built[2] == built[3]
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["disable_log_stats=False"]
    for bad in (-1, float("inf"), "4", True):
        with pytest.raises(ValueError, match="swap_space: expected GiB >= 0"):
            k3jax.LLM("tiny-k3", swap_space=bad, **KW)


def test_llm_is_sleeping_as_its_engine_says(monkeypatch):
    """After a level-2 sleep and wake_up the engine stays asleep until new weights are loaded (its sleep level is
    back to 0): `LLM.is_sleeping` read the level and said False while generate was refused."""
    import types

    import k3jax
    import serve.llm

    engine = types.SimpleNamespace(layer_scan=None, sleep_level=0, is_sleeping=True)
    monkeypatch.setattr(serve.llm, "Engine", lambda model, config, progress: engine)
    llm = k3jax.LLM("tiny-k3", **KW)
    assert llm.is_sleeping
    engine.is_sleeping = False
    assert not llm.is_sleeping
