"""Custom logits processors (serve/logits_processors.py) without an engine: the sampler runs them on their
rows only, the built-in no_repeat_ngram against HF transformers' own processor, import paths, validation
and the CLI flag. The engine and HTTP paths: tests/test_sampling_engine.py and tests/test_http.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serve import logits_processors as lp
from serve.logits_processors import LogitsProcessor, ProcessorContext
from serve.sampling import SamplingBatch, sample
from serve.types import RequestError, SamplingParams as SP


def ban_below(logits, args, ctx):
    """Tokens below `min_id` are never sampled."""
    return jnp.where(jnp.arange(logits.shape[1])[None, :] < args[:, :1], -jnp.inf, logits)


BAN_BELOW = LogitsProcessor("ban_below", ban_below, ("min_id",))


def make_ban_below():  # a factory, as an import path may name
    return BAN_BELOW


def test_sample_runs_processors_on_their_rows_only_and_logprobs_stay_raw():
    rng = np.random.default_rng(0)
    b, v, s = 6, 48, 20
    logits = jnp.asarray(rng.standard_normal((b, v)).astype(np.float32) * 2)
    hist = jnp.asarray(rng.integers(0, 6, (b, s)).astype(np.int32))  # few distinct tokens: n-grams repeat
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    params = [SP(temperature=0), SP(temperature=0, extra_args={"min_id": 40}),
              SP(temperature=0.9, seed=3), SP(temperature=0.9, seed=3, extra_args={"min_id": 30, "other": "x"}),
              SP(temperature=0, extra_args={"no_repeat_ngram_size": 1})]
    procs = (BAN_BELOW, lp.NO_REPEAT_NGRAM)
    seeds, steps, plens = [0, 0, 3, 3, 0], [2, 2, 2, 2, 4], [5, 5, 5, 5, 6]
    fn = jax.jit(lambda lg, bt, procs: sample(lg, bt, 2, history=lambda: (hist, pos), processors=procs),
                 static_argnums=2)
    with_p = fn(logits, SamplingBatch.from_params(params, seeds, steps, b, plens, None, 0, processors=procs), procs)
    without = fn(logits, SamplingBatch.from_params(params, seeds, steps, b, plens, None, 0), ())
    tok, ref = np.asarray(with_p.tokens), np.asarray(without.tokens)
    for i in (0, 2, 5):  # off (and padding): bit for bit the plain sampler's
        assert tok[i] == ref[i] and np.asarray(with_p.logprob)[i] == np.asarray(without.logprob)[i]
    assert tok[1] == 40 + int(np.argmax(np.asarray(logits)[1, 40:]))  # greedy among the allowed
    assert tok[3] >= 30
    seen = set(np.asarray(hist)[4, :10].tolist())  # n = 1: no token of the first 10 positions again
    assert tok[4] not in seen and tok[4] == max(set(range(v)) - seen, key=lambda t: float(logits[4, t]))
    raw = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(np.asarray(with_p.logprob), raw[np.arange(b), tok], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(with_p.top_ids), np.asarray(without.top_ids))


def test_no_repeat_ngram_matches_hf_transformers():
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

    rng = np.random.default_rng(1)
    b, v, s = 8, 12, 40
    ids = rng.integers(0, 5, (b, s)).astype(np.int32)  # small alphabet: many repeated n-grams
    n = np.array([1, 2, 3, 4, 2, 3, 0, 16], np.int32)
    length = rng.integers(1, s, b).astype(np.int32)
    plen = np.minimum(length, rng.integers(1, 10, b)).astype(np.int32)
    logits = rng.standard_normal((b, v)).astype(np.float32)
    ctx = ProcessorContext(jnp.asarray(length - plen), jnp.asarray(plen),
                           lambda: (jnp.asarray(ids), jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))))
    got = np.asarray(jax.jit(lambda x, a: lp.NO_REPEAT_NGRAM.fn(x, a, ctx))(jnp.asarray(logits),
                                                                         jnp.asarray(n[:, None], jnp.float32)))
    banned_rows = 0
    for i in range(b):
        want = logits[i:i + 1].copy()
        if n[i] > 0:
            want = NoRepeatNGramLogitsProcessor(int(n[i]))(torch.tensor(ids[i:i + 1, :length[i]], dtype=torch.long),
                                                          torch.tensor(want)).numpy()
        np.testing.assert_array_equal(np.isinf(got[i]), np.isinf(want[0]), err_msg=f"row {i}, n={n[i]}")
        banned_rows += bool(np.isinf(want[0]).any())
    assert banned_rows >= 4  # the rule bites on most rows


def test_a_failing_processor_is_named():
    def wants_history(logits, args, ctx):
        ids, _ = ctx.history()
        return logits

    def wrong_shape(logits, args, ctx):
        return logits[:, :3]

    for fn, why in ((wants_history, "'h' failed while tracing.*token history"), (wrong_shape, "'h' returned shape")):
        procs = (LogitsProcessor("h", fn),)
        batch = SamplingBatch.from_params([SP(temperature=0)], [0], [0], 1, processors=procs)
        with pytest.raises(ValueError, match=why):
            sample(jnp.zeros((1, 8)), batch, processors=procs)


def test_resolve_builtin_names_import_paths_and_factories(tmp_path, monkeypatch):
    assert lp.resolve(["no_repeat_ngram"]) == (lp.NO_REPEAT_NGRAM,)
    (tmp_path / "my_procs.py").write_text(
        "from serve.logits_processors import LogitsProcessor\n"
        "P = LogitsProcessor('keep', lambda x, a, c: x, ('k',))\n"
        "class Holder:\n    Q = LogitsProcessor('keep2', lambda x, a, c: x)\n"
        "def factory():\n    return LogitsProcessor('made', lambda x, a, c: x)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    got = lp.resolve(["my_procs:P", "my_procs.Holder.Q", "my_procs:factory", BAN_BELOW])
    assert [p.name for p in got] == ["keep", "keep2", "made", "ban_below"]
    for bad, why in ((["nowhere_module:P"], "cannot import"), (["my_procs:missing"], "cannot import"),
                     (["plain"], "import path"), ([3], "not a LogitsProcessor"),
                     (["my_procs:P", "my_procs:P"], "distinct")):
        with pytest.raises(ValueError, match=f"logits_processors.*{why}"):
            lp.resolve(bad)
    for kw, why in ((dict(name="", fn=ban_below), "name"), (dict(name="x", fn=3), "callable"),
                    (dict(name="x", fn=ban_below, arg_names=("a", "a")), "distinct"),
                    (dict(name="x", fn=ban_below, arg_names=("a",), defaults=(1, 2)), "defaults")):
        with pytest.raises(ValueError, match=why):
            LogitsProcessor(**kw)


def test_batch_columns_defaults_and_padding():
    p = LogitsProcessor("two", ban_below, ("a", "b"), defaults=(7.0,))
    args, on = lp.batch_columns((BAN_BELOW, p), [{"b": 2}, None, {"min_id": 5, "zzz": "ignored"}], 4)
    np.testing.assert_array_equal(args, [[0, 7, 2], [0, 7, 0], [5, 7, 0], [0, 0, 0]])
    np.testing.assert_array_equal(on, [[False, True], [False, False], [True, False], [False, False]])


def test_requests_with_bad_arguments_are_refused_naming_them():
    procs = (BAN_BELOW, lp.NO_REPEAT_NGRAM)
    lp.check_request(procs, None)
    lp.check_request(procs, {"min_id": 3, "unrelated": "text"})  # other keys pass through
    for xa, match in (({"min_id": "3"}, r"extra_args\['min_id'\].*finite number"),
                      ({"min_id": True}, r"extra_args\['min_id'\]"), ({"min_id": float("nan")}, r"extra_args\['min_id'\]"),
                      ({"min_id": 10 ** 400}, r"extra_args\['min_id'\].*finite number"),  # (JSON's big ints)
                      ({"no_repeat_ngram_size": 2.5}, "no_repeat_ngram.*integer"),
                      ({"no_repeat_ngram_size": 17}, "no_repeat_ngram_size must be")):
        with pytest.raises(RequestError, match=match):
            lp.check_request(procs, xa)
    with pytest.raises(RequestError, match="extra_args: must be a mapping"):
        SP(extra_args=["min_id"]).validate(512)


def test_cli_flag_and_engine_config_name_them(monkeypatch):
    import argparse

    from serve.cli import DEFAULTS, add_serve_arguments, engine_config
    from serve.engine import EngineConfig

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    o = {**DEFAULTS, **vars(parser.parse_args(["--logits-processors", "no_repeat_ngram",
                                               "test_logits_processors:make_ban_below"]))}
    cfg = engine_config(o)
    assert cfg.logits_processors == ("no_repeat_ngram", "test_logits_processors:make_ban_below")
    cfg.validate()
    with pytest.raises(ValueError, match="logits_processors"):
        EngineConfig(logits_processors="no_repeat_ngram").validate()
    with pytest.raises(ValueError, match="logits_processors.*cannot import"):
        EngineConfig(logits_processors=("no_such_module:P",)).validate()
