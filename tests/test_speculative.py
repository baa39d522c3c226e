"""Speculative decoding (serve/speculative.py): n-gram drafts, verify steps, partial commits of KDA state.

The engine test runs the same requests with drafts off, with drafts that are the plain run's own
continuation (all accepted), with such drafts corrupted at one position (accepted up to it, the rest
rejected: the KDA states must be committed part way), and with real n-gram drafts; the outputs must
be the plain run's, token for token, for greedy, seeded and penalised sampling."""

import numpy as np
import pytest

import k3jax
from k3jax import SamplingParams
from serve.engine import Engine, EngineConfig
from serve.scheduler import Memory, SchedulerConfig, SeqView, schedule
from serve.speculative import (DraftGate, NgramIndex, SpeculativeConfig, SuffixIndex, SuffixProposer,
                               accepted_lengths)

K = 3  # drafts per step


def _brute_propose(ids, k, lo, hi):
    """The definition, written out: the longest suffix (hi..lo tokens) that occurred earlier, its latest
    earlier occurrence, the k tokens after it (continuing periodically past the end)."""
    for n in range(min(hi, len(ids) - 1), lo - 1, -1):
        suffix = ids[-n:]
        for start in range(len(ids) - 1, n - 1, -1):  # `start`: position after an occurrence
            if ids[start - n:start] == suffix:
                out = []
                for p in range(start, start + k):
                    out.append(ids[p] if p < len(ids) else out[p - len(ids)])
                return out
    return []


def test_ngram_index_equals_the_definition_as_tokens_arrive():
    rng = np.random.default_rng(1)
    for trial in range(30):
        lo, hi = int(rng.integers(1, 3)), int(rng.integers(3, 5))
        idx = NgramIndex(lo, hi)
        # small alphabets: many repeats; long steps take the index's numpy path
        v = int(rng.integers(3, 40))
        ids = [int(x) for x in rng.integers(0, v, size=int(rng.integers(2, 150)))]
        for _ in range(12):
            assert idx.propose(ids, 4) == _brute_propose(ids, 4, lo, hi), (ids, lo, hi)
            ids = ids + [int(x) for x in rng.integers(0, v, size=int(rng.choice([1, 2, 70])))]


def test_ngram_proposals():
    idx = NgramIndex(1, 3)
    assert idx.propose([5, 6, 7, 8], 3) == []  # nothing repeats
    assert NgramIndex(1, 3).propose([1, 2, 3, 9, 9, 1, 2], 3) == [3, 9, 9]  # suffix [1, 2] seen at the start
    assert NgramIndex(1, 3).propose([4, 7, 4, 7, 4], 5) == [7, 4, 7, 4, 7]  # a period of 2, continued
    assert NgramIndex(2, 3).propose([1, 2, 3, 1], 3) == []  # one-token suffixes are below lo


def _suffix(**kw):
    return SuffixProposer(SpeculativeConfig(method="suffix", num_speculative_tokens=8, **kw))


def test_suffix_proposals():
    """Suffix decoding (vLLM's `suffix` method): the longest earlier match of the request's own tokens or of a
    finished response (after its prompt's tail), its majority continuation, a length of at most factor x the match
    length, cut where the estimated acceptance falls below min_token_prob; old responses are evicted."""
    sp = _suffix()
    own = SuffixIndex()
    assert sp.propose(own, [1, 2, 3, 4, 5, 1, 2, 3], 8) == [4, 5, 1]  # match "1 2 3": 3 tokens (factor 1)
    assert _suffix(suffix_decoding_max_spec_factor=3.0).propose(SuffixIndex(), [1, 2, 3, 4, 5, 1, 2, 3], 8) == [
        4, 5, 1, 2, 3, 4, 5, 1]  # runs into the present: continues with its own draft (a repeating pattern)
    assert sp.propose(SuffixIndex(), [1, 2, 3, 4], 8) == []  # nothing occurred before
    # a finished response, drafted by a request that ends like its prompt (an RL rollout of the same prompt)
    sp = _suffix(suffix_decoding_max_spec_factor=4.0)
    sp.add_response([9, 9, 7, 8], [10, 11, 12, 13])
    assert sp.propose(SuffixIndex(), [5, 7, 8], 8) == [10, 11, 12, 13]  # (stops at the response's end)
    assert sp.propose(SuffixIndex(), [5, 7, 8, 10, 11], 2) == [12, 13]
    # the majority continuation; the draft stops where its estimated acceptance drops below min_token_prob
    sp = _suffix(suffix_decoding_max_spec_factor=4.0, suffix_decoding_min_token_prob=0.5)
    for out in ([10, 20, 21], [10, 20, 22], [30, 31, 32]):
        sp.add_response([7, 8], out)
    assert sp.propose(SuffixIndex(), [1, 7, 8], 8) == [10, 20]  # 2/3 then 1 (0.67); 1/2 more would give 0.33
    strict = _suffix(suffix_decoding_max_spec_factor=4.0, suffix_decoding_min_token_prob=0.7)
    for out in ([10, 20, 21], [10, 20, 22], [30, 31, 32]):
        strict.add_response([7, 8], out)
    assert strict.propose(SuffixIndex(), [1, 7, 8], 8) == []
    # the longer match wins: own "3 4 5" (3 tokens) over the corpus's "4 5" (2)
    sp = _suffix(suffix_decoding_max_spec_factor=4.0)
    sp.add_response([4, 5], [60, 61])
    assert sp.propose(SuffixIndex(), [3, 4, 5, 50, 51, 3, 4, 5], 2) == [50, 51]
    assert sp.propose(SuffixIndex(), [0, 4, 5], 2) == [60, 61]
    # eviction: with room for one response only the newest is drafted from; compaction keeps it
    sp = _suffix(suffix_decoding_max_cached_requests=1)
    sp.add_response([1, 2], [3, 4])
    sp.add_response([5, 6], [7, 8])
    assert sp.propose(SuffixIndex(), [0, 1, 2], 2) == [] and sp.propose(SuffixIndex(), [0, 5, 6], 2) == [7, 8]
    assert len(sp.corpora[b""].index.tokens) == 5 and sp.corpora[b""].starts == [0]  # the evicted tokens are gone
    none = _suffix(suffix_decoding_max_cached_requests=0)
    none.add_response([1, 2], [3, 4])
    assert none.propose(SuffixIndex(), [0, 1, 2], 2) == []


def test_suffix_responses_stay_with_their_tenant():
    """A cached response drafts only for requests of its tenant (cache_salt and LoRA adapter, as the prefix cache
    partitions): accepted drafts show in a step's token count, so another tenant would learn what it continued
    with. The capacity is engine-wide, oldest first, and a tenant whose responses are all evicted leaves nothing."""
    sp = _suffix(suffix_decoding_max_cached_requests=2)
    sp.add_response([1, 2], [3, 4], b"alice")
    assert sp.propose(SuffixIndex(), [0, 1, 2], 2, b"alice") == [3, 4]
    assert sp.propose(SuffixIndex(), [0, 1, 2], 2, b"bob") == [] and sp.propose(SuffixIndex(), [0, 1, 2], 2) == []
    sp.add_response([1, 2], [5, 6], b"bob")
    assert sp.propose(SuffixIndex(), [0, 1, 2], 2, b"bob") == [5, 6]
    assert sp.propose(SuffixIndex(), [0, 1, 2], 2, b"alice") == [3, 4]
    sp.add_response([7, 8], [9, 9], b"bob")  # a third response: alice's, the oldest, is evicted
    assert sp.propose(SuffixIndex(), [0, 1, 2], 2, b"alice") == [] and set(sp.corpora) == {b"bob"}
    assert sp.propose(SuffixIndex(), [0, 1, 2], 2, b"bob") == [5, 6] and len(sp.order) == 2


def test_accepted_lengths():
    tokens = np.array([[10, 1, 2, 3], [10, 1, 2, 3], [10, 1, 2, 3], [10, 5, 0, 0], [0, 0, 0, 0]], np.int32)
    sampled = np.array([[1, 2, 3, 4], [1, 2, 9, 4], [7, 2, 3, 4], [5, 8, 8, 8], [0, 0, 0, 0]], np.int32)
    valid = np.array([4, 4, 4, 2, 0], np.int32)
    assert accepted_lengths(tokens, sampled, valid).tolist() == [3, 2, 0, 1, 0]


def test_scheduler_gives_drafts_pages_and_drops_them_first():
    cfg = SchedulerConfig(max_num_seqs=4, max_prefill_seqs=1, prefill_chunk=16, align=16, token_budget=64,
                          page_size=4, num_mla_layers=1, slot_units=2)
    # 7 tokens known, 6 computed, 4 pages held: 3 drafts need positions up to 10 -> 3 pages, 1 more
    seq = SeqView("a", 0, total=7, computed=6, running=True, pages=2, draft=3)
    plan = schedule([seq], Memory(free_units=5, free_slots=1), cfg)
    assert plan.decode == ["a"] and plan.draft == {"a": 3} and plan.grow == {"a": 1}
    plan = schedule([seq], Memory(free_units=0, free_slots=1), cfg)  # no page for the drafts: plain decode
    assert plan.decode == ["a"] and plan.draft == {} and plan.grow == {} and plan.preempt == []
    tight = SchedulerConfig(**{**cfg.__dict__, "token_budget": 5})
    plan = schedule([seq, SeqView("b", 1, 5, 4, True, 2, draft=3)], Memory(10, 1), tight)
    assert plan.draft == {"a": 3}  # 2 decodes + 3 drafts fill the budget of 5


def test_draft_gate_drafts_only_where_drafts_pay():
    gate = DraftGate(3, {1: 2.0, 8: 3.0})
    assert gate.allow(1, 1, [3])  # optimistic start: 1 + 3 expected tokens >= 2x the cost
    assert gate.allow(8, 8, [3] * 8)  # 32 >= 3 x 8
    for _ in range(200):
        gate.observe(3, 1)  # the first draft is always accepted, the second never
    assert gate.p[0] == pytest.approx(1.0) and gate.p[1] < 0.01
    assert gate.allow(1, 1, [3])  # 1 + 1 tokens for 2x the cost: pays (just)
    assert not gate.allow(8, 8, [3] * 8)  # 16 < 3 x 8
    assert not gate.allow(8, 8, [3] * 2)
    probes = [gate.allow(8, 8, [3]) for _ in range(100)]  # skipped, but probed after 16, then 32, then 64 more
    assert [i for i, p in enumerate(probes) if p] == [13, 45]  # 2 failed before this loop
    assert gate.skipped_steps == 2 + 98


def test_draft_gate_counts_each_request_by_its_own_acceptance():
    gate = DraftGate(3, {2: 2.0})
    good, bad = gate.prior(), gate.prior()
    for _ in range(60):  # one request repeats itself, three others never do
        gate.observe(3, 3, good)
        for _ in range(3):
            gate.observe(3, 0, bad)
    assert max(gate.p) < 0.4 and min(good) > 0.99 and max(bad) < 0.01
    assert not gate.allow(2, 2, [3])  # engine-wide: 2 + 3 x p < 2 x 2
    assert gate.allow(2, 2, [3], [good])  # the repeating request alone pays for the verify step
    assert not gate.allow(2, 2, [3], [bad])
    assert gate.prior() == gate.p and gate.prior() is not gate.p


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="speculative_config.method"):
        EngineConfig(speculative_config={"method": "eagle3"}).validate()
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"num_speculative_tokens": 0}).validate()
    with pytest.raises(ValueError, match="prefill_chunk"):
        EngineConfig(prefill_chunk=8, speculative_config={"num_speculative_tokens": 7}).validate()
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(speculative_config={"draft_model": "x"})
    for key, bad in (("suffix_decoding_max_tree_depth", 1), ("suffix_decoding_max_cached_requests", -1),
                     ("suffix_decoding_max_spec_factor", 0), ("suffix_decoding_min_token_prob", 1.5),
                     ("suffix_decoding_max_tree_depth", True)):
        with pytest.raises(ValueError, match=f"speculative_config.{key}={bad!r}"):
            EngineConfig(speculative_config={"method": "suffix", key: bad}).validate()
    for key, bad in (("num_speculative_tokens", True), ("disable_by_batch_size", True), ("adaptive", "false"),
                     ("prompt_lookup_min", True)):  # (booleans are not counts; a string is not a switch)
        with pytest.raises(ValueError, match=f"speculative_config.{key}"):
            EngineConfig(speculative_config={key: bad}).validate()
    # vLLM's reading: a lone bound is both bounds; null is not given
    for given, want in (({"prompt_lookup_min": 5}, (5, 5)), ({"prompt_lookup_min": 2}, (2, 2)),
                        ({"prompt_lookup_max": 3}, (3, 3)), ({"prompt_lookup_max": None, "prompt_lookup_min": 2}, (2, 2)),
                        ({"prompt_lookup_min": None}, (1, 4))):
        cfg = EngineConfig(speculative_config=given)
        cfg.validate()
        assert (cfg.speculative_config.prompt_lookup_min, cfg.speculative_config.prompt_lookup_max) == want, given
    EngineConfig(speculative_config={"method": "suffix", "num_speculative_tokens": 8}).validate()
    assert EngineConfig(speculative_config={"num_speculative_tokens": 2}).speculative_config == SpeculativeConfig(
        num_speculative_tokens=2)


def test_vllms_ngram_names_and_the_widest_verify_row():
    """vLLM's other names of prompt lookup ("[ngram]" as the method, or as `model` in its older form) are prompt
    lookup here too (they were an error); vLLM's suffix default (24 drafts, its tree depth) may be asked for, and
    the limit's error says what a verify row costs."""
    for given in ({"method": "[ngram]"}, {"model": "[ngram]"}, {"model": "ngram", "method": "[ngram]"}):
        cfg = EngineConfig(speculative_config={**given, "num_speculative_tokens": 2})
        cfg.validate()
        assert cfg.speculative_config == SpeculativeConfig(num_speculative_tokens=2), given
    assert SpeculativeConfig(method="[ngram]").method == "ngram"
    assert SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": None}).num_speculative_tokens == 3
    EngineConfig(speculative_config={"method": "suffix", "num_speculative_tokens": 24}).validate()
    with pytest.raises(ValueError, match=r"num_speculative_tokens=33: expected an integer in \[1, 32\] .*1 \+ this"):
        EngineConfig(speculative_config={"method": "suffix", "num_speculative_tokens": 33}).validate()
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(speculative_config={"model": "some/draft-model"})


@pytest.fixture(scope="module")
def engine():
    model = k3jax.load_model("tiny-k3", dtype="float32", seed=0)
    cfg = EngineConfig(max_model_len=256, cache_bytes=32 << 20, max_num_seqs=8, prefill_chunk=32, page_size=16,
                       decode_buckets=(8,), prefill_buckets=(4,), context_buckets=(16,), measure_moe_time=False,
                       speculative_config={"method": "ngram", "num_speculative_tokens": K, "adaptive": False})
    return Engine(model, cfg, progress=False)


def _run(engine, prompts, params):
    rids = [engine.add_request(p, params[i]) for i, p in enumerate(prompts)]
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
    return [outs[r] for r in rids]


SAMPLING = {
    "greedy": lambda i: SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
    "seeded": lambda i: SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=24, ignore_eos=True,
                                       logprobs=2),
    "penalised": lambda i: SamplingParams(temperature=0.7, min_p=0.05, seed=i, presence_penalty=0.5,
                                          repetition_penalty=1.3, max_tokens=24, ignore_eos=True),
    "restricted": lambda i: SamplingParams(temperature=0.8, top_k=20, seed=i, frequency_penalty=0.6,
                                           logit_bias={5: 3.0}, allowed_token_ids=list(range(3, 60)), max_tokens=24,
                                           ignore_eos=True, logprobs=2),
}


@pytest.mark.parametrize("kind", list(SAMPLING))
def test_outputs_equal_plain_decoding(engine, monkeypatch, kind):
    rng = np.random.default_rng(7)
    prompts = [[int(x) for x in rng.integers(3, 200, size=int(rng.integers(5, 60)))] for _ in range(6)]
    params = [SAMPLING[kind](i) for i in range(len(prompts))]
    ngram = engine._propose
    monkeypatch.setattr(engine, "_propose", lambda s, k: [])
    steps = engine.counters["decode_steps"]
    plain = _run(engine, prompts, params)
    plain_steps = engine.counters["decode_steps"] - steps
    want = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}

    def oracle(seq, k, corrupt):  # the plain continuation, optionally wrong at its second draft
        d = list(want[tuple(seq.prompt_ids)][len(seq.output_ids):][:k])
        if corrupt and len(d) > 1:
            d[1] = (d[1] + 1) % 200
        return d

    for mode in ("oracle", "corrupt", "ngram"):
        monkeypatch.setattr(engine, "_propose",
                            ngram if mode == "ngram" else lambda s, k, c=mode == "corrupt": oracle(s, k, c))
        before = dict(engine.counters)
        outs = _run(engine, prompts, params)
        d = {k: engine.counters[k] - before[k] for k in before}
        for o, p in zip(outs, plain):
            assert o.token_ids == p.token_ids, (kind, mode)
            if p.logprobs is not None:
                np.testing.assert_allclose([lp.chosen.logprob for lp in o.logprobs],
                                           [lp.chosen.logprob for lp in p.logprobs], rtol=1e-4, atol=1e-4)
                assert [[t.token_id for t in lp.top] for lp in o.logprobs] == [[t.token_id for t in lp.top]
                                                                               for lp in p.logprobs]
        if mode == "oracle":  # every draft accepted: about 1 + K tokens per step
            assert d["spec_decode_num_accepted_tokens"] == d["spec_decode_num_draft_tokens"] > 0
            assert d["decode_steps"] < plain_steps / 2
        if mode == "corrupt":  # the first draft of each row accepted, the second rejected
            assert 0 < d["spec_decode_num_accepted_tokens"] < d["spec_decode_num_draft_tokens"]
    st = engine.stats()
    assert st["compiles_after_warmup"] == 0
    assert st["arena_free_units"] + st["arena_cached_units"] == st["arena_baseline_free_units"]


def test_suffix_decoding_drafts_rollouts_from_earlier_answers(engine, monkeypatch):
    """`method: suffix` on the same compiled engine (the proposer is host code): GRPO-style rollouts, each prompt
    answered greedily twice. The second answers are drafted from the first (kept with their prompt's tail): most
    drafts are accepted and the steps drop, while every output stays the plain decoding's, token for token."""
    import dataclasses

    rng = np.random.default_rng(11)
    prompts = [[int(x) for x in rng.integers(3, 200, size=int(rng.integers(5, 40)))] for _ in range(4)]
    greedy = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts)
    monkeypatch.setattr(engine, "_propose", lambda s, k: [])
    plain = _run(engine, prompts, greedy)
    monkeypatch.undo()
    spec = dataclasses.replace(engine.spec, method="suffix", suffix_decoding_max_spec_factor=4.0)
    monkeypatch.setattr(engine, "spec", spec)
    monkeypatch.setattr(engine, "suffix", SuffixProposer(spec))
    rounds = []
    for _ in range(2):
        before = dict(engine.counters)
        outs = _run(engine, prompts, greedy)
        assert [o.token_ids for o in outs] == [p.token_ids for p in plain]
        rounds.append({k: engine.counters[k] - before[k] for k in before})
    first, second = rounds
    assert second["spec_decode_num_accepted_tokens"] >= 0.9 * second["spec_decode_num_draft_tokens"] > 40, second
    assert second["decode_steps"] < first["decode_steps"] / 2, rounds
    assert len(engine.suffix.order) == 2 * len(prompts)
    # another cache_salt drafts none of those answers: its round drafts as the first did
    rids = [engine.add_request(p, greedy[0], cache_salt="other tenant") for p in prompts]
    before, outs = dict(engine.counters), {}
    while engine.has_unfinished():
        outs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    salted = {k: engine.counters[k] - before[k] for k in before}
    assert [outs[r] for r in rids] == [p.token_ids for p in plain]
    for k in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
        assert salted[k] == first[k], (k, salted, first)
    st = engine.stats()
    assert st["compiles_after_warmup"] == 0
    assert st["arena_free_units"] + st["arena_cached_units"] == st["arena_baseline_free_units"]


def test_stop_and_max_tokens_inside_accepted_drafts(engine, monkeypatch):
    rng = np.random.default_rng(3)
    prompts = [[int(x) for x in rng.integers(3, 200, size=20)] for _ in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    monkeypatch.setattr(engine, "_propose", lambda s, k: [])
    plain = _run(engine, prompts, [greedy] * 3)
    want = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    # stop at the 7th token (a stop token id) or after 6 tokens: both fall inside accepted drafts
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[plain[0].token_ids[6]]),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), greedy]
    monkeypatch.setattr(engine, "_propose", lambda s, k: list(want[tuple(s.prompt_ids)][len(s.output_ids):][:K]))
    outs = _run(engine, prompts, params)
    first_stop = plain[0].token_ids.index(plain[0].token_ids[6])
    assert outs[0].token_ids == plain[0].token_ids[:first_stop + 1] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == plain[1].token_ids[:6] and outs[1].finish_reason == "length"
    assert outs[2].token_ids == plain[2].token_ids
    st = engine.stats()
    assert st["arena_free_units"] + st["arena_cached_units"] == st["arena_baseline_free_units"]


def test_disable_by_batch_size(engine, monkeypatch):
    rng = np.random.default_rng(5)
    prompts = [[int(x) for x in rng.integers(3, 200, size=12)] for _ in range(3)]
    monkeypatch.setattr(engine, "_propose", lambda s, k: [7] * k)
    greedy = [SamplingParams(temperature=0.0, max_tokens=4 + 4 * i, ignore_eos=True) for i in range(3)]
    for cap, drafted in ((3, True), (4, True), (1, False)):
        monkeypatch.setattr(engine, "spec", SpeculativeConfig(num_speculative_tokens=K, disable_by_batch_size=cap,
                                                              adaptive=False))
        before = engine.counters["spec_decode_num_drafts"]
        _run(engine, prompts, greedy)
        n = engine.counters["spec_decode_num_drafts"] - before
        # cap 3: the first steps (3 decoding) carry none, the tails (2, then 1 decoding) do
        assert (n > 0) == drafted, (cap, n)
        if cap == 3:
            assert n < sum(p.max_tokens for p in greedy) - 3


def test_cli_speculative_config():
    from serve.cli import DEFAULTS, engine_config

    cfg = engine_config(dict(DEFAULTS, speculative_config='{"method": "ngram", "num_speculative_tokens": 4}'))
    assert cfg.speculative_config == SpeculativeConfig(num_speculative_tokens=4)
    assert cfg.max_num_batched_tokens >= cfg.max_num_seqs * 5 + cfg.prefill_chunk
    wide = dict(DEFAULTS, max_num_seqs=256)  # (the token budget then follows the verify rows: 256 x (1 + 3) + ...)
    null = engine_config(dict(wide, speculative_config='{"method": "[ngram]", "num_speculative_tokens": null}'))
    assert null.speculative_config == SpeculativeConfig() and null.max_num_batched_tokens == engine_config(
        dict(wide, speculative_config='{"method": "ngram"}')).max_num_batched_tokens > 256 * 4  # (null: default 3)
    with pytest.raises(ValueError, match="--speculative-config"):
        engine_config(dict(DEFAULTS, speculative_config="{ngram"))


def test_accelerator_decode_forms_on_kimi_linear(monkeypatch):
    """The accelerators' forms (batched KDA op on gathered states, paged MLA decode) on the other model
    family: part-accepted drafts give the plain decoder's tokens."""
    model = k3jax.load_model("tiny-kimi-linear", dtype="float32", seed=0)
    cfg = EngineConfig(max_model_len=128, cache_bytes=16 << 20, max_num_seqs=4, prefill_chunk=32, page_size=16,
                       decode_buckets=(4,), prefill_buckets=(4,), context_buckets=(8,), measure_moe_time=False,
                       kda_decode="gathered", mla_decode="paged", speculative_config={"num_speculative_tokens": K})
    engine = Engine(model, cfg, progress=False)
    st = engine.stats()
    assert st["decode_forms"] == {"kda": "gathered", "mla": "paged"}
    assert set(st["spec_decode_cost_ratio"]) == {4} and st["spec_decode_cost_ratio"][4] > 0  # measured at warm-up
    monkeypatch.setattr(engine, "gate", None)  # draft whatever it costs here
    rng = np.random.default_rng(11)
    prompts = [[int(x) for x in rng.integers(3, 200, size=int(rng.integers(5, 40)))] for _ in range(4)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=16, ignore_eos=True) for i in range(4)]
    monkeypatch.setattr(engine, "_propose", lambda s, k: [])
    plain = [o.token_ids for o in _run(engine, prompts, params)]
    want = {tuple(p): o for p, o in zip(prompts, plain)}

    def corrupt(s, k):  # the plain continuation, wrong at the third draft
        d = list(want[tuple(s.prompt_ids)][len(s.output_ids):][:k])
        if len(d) > 2:
            d[2] = (d[2] + 1) % 200
        return d

    monkeypatch.setattr(engine, "_propose", corrupt)
    assert [o.token_ids for o in _run(engine, prompts, params)] == plain
    assert 0 < engine.counters["spec_decode_num_accepted_tokens"] < engine.counters["spec_decode_num_draft_tokens"]
    st = engine.stats()
    assert st["compiles_after_warmup"] == 0
    assert st["arena_free_units"] + st["arena_cached_units"] == st["arena_baseline_free_units"]


def test_structured_outputs_draft_within_their_grammar(engine, monkeypatch):
    """Constrained requests draft too: drafts the grammar rejects are cut off before the step, and each
    verify position gets the mask that follows the drafts before it; drafts running past the grammar's end (a stop
    token after the token that completes it) leave the constraint where it was."""
    import re

    from serve.types import StructuredOutputsParams as SO

    regex = r"([a-f]{2}-){2,6}[0-9]{2}"
    schema = {"type": "object", "properties": {"id": {"type": "integer"}, "tag": {"enum": ["ab", "cd", "ef"]}},
              "required": ["id", "tag"]}
    params = [SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=SO(regex=regex), logprobs=3),
              SamplingParams(temperature=0.9, seed=3, max_tokens=30, structured_outputs=SO(regex=regex), logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=SO(json=schema, disable_any_whitespace=True)),
              SamplingParams(temperature=0.0, max_tokens=30)]
    prompts = [[int(x) for x in np.random.default_rng(i).integers(3, 200, size=20)] for i in range(4)]
    monkeypatch.setattr(engine, "_propose", lambda s, k: [])
    plain = _run(engine, prompts, params)
    assert re.fullmatch(regex, plain[0].text) and re.fullmatch(regex, plain[1].text)
    want = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    bang = engine.tokenizer.encode("!")[0]  # never allowed by either grammar
    eos = engine.stop_ids[0]  # after the token that completes a grammar: taken, not recorded, by its matcher

    def propose(s, k, mode):
        if mode == "invalid":
            return [bang] * k
        rest = list(want[tuple(s.prompt_ids)][len(s.output_ids):])
        return (rest + [eos] * k)[:k] if mode == "past the end" else rest[:k]

    for mode in ("oracle", "invalid", "past the end"):
        before = dict(engine.counters)
        monkeypatch.setattr(engine, "_propose", lambda s, k, m=mode: propose(s, k, m))
        outs = _run(engine, prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain], mode
        for o, q in zip(outs[:2], plain[:2]):  # a verify position's logprobs are taken after its own mask too
            for x, y in zip(o.logprobs, q.logprobs):
                assert [t.token_id for t in x.top] == [t.token_id for t in y.top], mode
                np.testing.assert_allclose([t.logprob for t in x.top], [t.logprob for t in y.top], atol=1e-4)
        d = {k: engine.counters[k] - before[k] for k in before}
        assert d["structured_output_errors"] == 0
        if mode == "oracle":
            assert d["spec_decode_num_accepted_tokens"] == d["spec_decode_num_draft_tokens"] > 40
        elif mode == "invalid":  # only the unconstrained request drafts its invalid tokens
            assert d["spec_decode_num_accepted_tokens"] == 0 < d["spec_decode_num_draft_tokens"] <= K * 30


@pytest.fixture(scope="module")
def async_engine():
    """The `engine` fixture's layout with async scheduling: a step is launched before the one in flight is read."""
    model = k3jax.load_model("tiny-k3", dtype="float32", seed=0)
    cfg = EngineConfig(max_model_len=256, cache_bytes=32 << 20, max_num_seqs=8, prefill_chunk=32, page_size=16,
                       decode_buckets=(8,), prefill_buckets=(4,), context_buckets=(16,), measure_moe_time=False,
                       async_scheduling=True,
                       speculative_config={"method": "ngram", "num_speculative_tokens": K, "adaptive": False})
    return Engine(model, cfg, progress=False)


def test_async_scheduling_drafts_on_a_guess_of_the_token_in_flight(engine, async_engine, monkeypatch):
    """With async scheduling a decoding request's input token is usually still on the device when the next
    step is planned: it drafts on a guess of that token (its proposal's first token) and the verify row takes
    the real one from the device. Outputs must be the plain synchronous engine's for guesses that are right,
    wrong, and the real n-gram's. With structured-output and bad-words rows in flight (a verify step builds
    masks at launch) the steps are read back before one that drafts."""
    from serve.types import StructuredOutputsParams as SO

    rng = np.random.default_rng(17)
    prompts = [[int(x) for x in rng.integers(3, 200, size=int(rng.integers(5, 50)))] for _ in range(8)]
    prompts = [p + p[:10] for p in prompts]  # something for the real n-gram to find
    params = [SAMPLING[kind](i) for i, kind in enumerate(["greedy", "seeded", "penalised"] * 2)]
    masked = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=SO(regex=r"([a-f]{2}-){2,6}[0-9]{2}")),
               SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True, bad_words=["a", "zz"])]
    monkeypatch.setattr(engine, "_propose", lambda s, k: [])
    plain = _run(engine, prompts, params + masked)
    want = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}

    def oracle(s, k, mode):  # the plain continuation (its first token is the guess of a token in flight)
        if (not s.pending) if mode in ("right", "wrong") else len(s.output_ids) % 3:
            return []  # only on a guess / only every third token
        d = list(want[tuple(s.prompt_ids)][len(s.output_ids):][:k])
        if mode == "wrong" and d:
            d[0] = (d[0] + 1) % 200
        return d

    ngram = async_engine._propose
    for mode, extra in (("right", []), ("wrong", []), ("ngram", masked), ("every third", masked)):
        monkeypatch.setattr(async_engine, "_propose", ngram if mode == "ngram" else
                            lambda s, k, m=mode: oracle(s, k, m))
        before = dict(async_engine.counters)
        outs = _run(async_engine, prompts[:len(params + extra)], params + extra)
        d = {k: async_engine.counters[k] - before[k] for k in before}
        for o, p in zip(outs, plain):
            assert o.token_ids == p.token_ids, mode
            if p.logprobs is not None:
                np.testing.assert_allclose([lp.chosen.logprob for lp in o.logprobs],
                                           [lp.chosen.logprob for lp in p.logprobs], rtol=1e-4, atol=1e-4)
        assert d["steps_launched_ahead"] > 0, (mode, d)
        if mode in ("right", "every third"):  # drafts after a right guess are the plain continuation: all accepted
            assert d["spec_decode_num_accepted_tokens"] == d["spec_decode_num_draft_tokens"] > 20, d
        if mode == "right":
            assert d["spec_decode_num_guesses_right"] == d["spec_decode_num_guessed_drafts"] > 5, d
        if mode == "wrong":
            assert d["spec_decode_num_guessed_drafts"] > 5 and d["spec_decode_num_guesses_right"] == 0, d
        assert all(q.pending == 0 and q.guess is None for q in async_engine.seqs.values())
        assert not async_engine._flight
    st = async_engine.stats()
    assert st["compiles_after_warmup"] == 0
    assert st["arena_free_units"] + st["arena_cached_units"] == st["arena_baseline_free_units"]
