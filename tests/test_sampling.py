"""Tests for serve.sampling: on-device sampling over a padded batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serve.sampling import SamplingBatch, SampleResult, max_logprobs, sample, seed_key_data
from serve.types import SamplingParams

V = 8
VB = 1000  # the 'big' vocabulary of the tests that want many plausible tokens
# Pad every call to one of a few buckets so the module compiles only a handful of shapes.
BUCKETS = (64, 4096, 40960)


@pytest.fixture(scope="module")
def sample_fn():
    return jax.jit(sample, static_argnames=("num_top_logprobs",))


def _logits_from_probs(probs, rows=1):
    lp = np.log(np.asarray(probs, np.float64)).astype(np.float32)
    return np.tile(lp, (rows, 1))


def _random_logits(rows, vocab=V, seed=0, scale=2.0):
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)


def _run(fn, logits, params, seeds=None, steps=None, bucket=None, n=4) -> SampleResult:
    rows = len(params)
    seeds = list(range(rows)) if seeds is None else seeds
    steps = [0] * rows if steps is None else steps
    bucket = next(b for b in BUCKETS if b >= rows) if bucket is None else bucket
    if logits.shape[0] < bucket:
        pad = np.zeros((bucket - logits.shape[0], logits.shape[1]), np.float32)
        logits = np.concatenate([logits, pad])
    batch = SamplingBatch.from_params(params, seeds, steps, bucket)
    out = jax.device_get(fn(jnp.asarray(logits), batch, num_top_logprobs=n))
    assert out.tokens.shape == (bucket,)
    return SampleResult(*(a[:rows] for a in out))  # drop the padding rows


def _support(fn, logits_row, p: SamplingParams, draws=2000):
    logits = np.tile(logits_row, (draws, 1))
    out = _run(fn, logits, [p] * draws, seeds=list(range(draws)))
    return set(np.unique(out.tokens).tolist()), out.tokens


# ------------------------------------------------------------------------------------------
# builder
# ------------------------------------------------------------------------------------------


def test_from_params_pads_greedy_and_normalises():
    params = [
        SamplingParams(temperature=0.7, top_k=-1, top_p=0.9, min_p=0.05),
        None,
        SamplingParams(temperature=0.0, top_k=5),
        SamplingParams(temperature=1.0, top_k=3),
    ]
    b = SamplingBatch.from_params(params, [11, None, 3, 2**40 + 9], [4, 0, 1, 2], bucket=8)
    assert b.temperature.shape == (8,) and b.seeds.shape == (8, 2) and b.steps.dtype == np.int32
    np.testing.assert_array_equal(b.temperature, np.float32([0.7, 0, 0, 1, 0, 0, 0, 0]))
    np.testing.assert_array_equal(b.top_k, [0, 0, 0, 3, 0, 0, 0, 0])  # -1 -> 0 (off); greedy rows off
    np.testing.assert_array_equal(b.top_p, np.float32([0.9, 1, 1, 1, 1, 1, 1, 1]))
    np.testing.assert_array_equal(b.min_p, np.float32([0.05, 0, 0, 0, 0, 0, 0, 0]))
    np.testing.assert_array_equal(b.steps, [4, 0, 1, 2, 0, 0, 0, 0])
    np.testing.assert_array_equal(b.seeds[3], [256, 9])
    with pytest.raises(ValueError):
        SamplingBatch.from_params(params, [0] * 4, [0] * 4, bucket=3)
    # a top_k beyond int32 (valid: it is >= any vocabulary, so off) must not fail the whole step
    big = SamplingBatch.from_params([SamplingParams(temperature=1.0, top_k=415057277369)], [1], [0], bucket=1)
    assert big.top_k[0] == 2 ** 31 - 1
    assert max_logprobs([None, SamplingParams(logprobs=3), SamplingParams()]) == 3
    assert max_logprobs([]) == 0


def test_seed_key_data_matches_jax():
    for s in (0, 1, 12345, 2**32 - 1):
        np.testing.assert_array_equal(
            seed_key_data(s), jax.random.key_data(jax.random.key(s, impl="threefry2x32"))
        )


# ------------------------------------------------------------------------------------------
# greedy and determinism
# ------------------------------------------------------------------------------------------


def test_greedy_is_argmax(sample_fn):
    logits = _random_logits(16, vocab=VB, seed=1)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1.0  # a tie: argmax takes the first
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.5)] * 16
    out = _run(sample_fn, logits, params)
    np.testing.assert_array_equal(out.tokens, np.asarray(jnp.argmax(jnp.asarray(logits), axis=-1)))
    assert out.tokens[3] == 10
    assert out.tokens.dtype == np.int32


def test_greedy_rows_mixed_with_sampled_rows(sample_fn):
    logits = _random_logits(8, vocab=VB, seed=2)
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=2.0) for i in range(8)]
    out = _run(sample_fn, logits, params)
    np.testing.assert_array_equal(out.tokens[::2], logits[::2].argmax(-1))


def test_same_seed_and_step_same_token_regardless_of_batch(sample_fn):
    vocab = VB
    logits_row = _random_logits(1, vocab=vocab, seed=3, scale=0.5)[0]  # flat-ish: many plausible tokens
    p = SamplingParams(temperature=1.0)
    seed, step = 1234, 7
    ref = _run(sample_fn, logits_row[None], [p], seeds=[seed], steps=[step]).tokens[0]

    # same request at another row, next to other requests, in a bigger padded bucket
    others = _random_logits(5, vocab=vocab, seed=4)
    logits = np.concatenate([others[:3], logits_row[None], others[3:]])
    params = [SamplingParams(temperature=0.8, top_k=50)] * 3 + [p] + [SamplingParams(temperature=0.0)] * 2
    out = _run(sample_fn, logits, params, seeds=[9, 8, 7, seed, 6, 5], steps=[0, 1, 2, step, 3, 4], bucket=64)
    assert out.tokens[3] == ref
    # alone in a bucket of 4
    out = _run(sample_fn, logits_row[None], [p], seeds=[seed], steps=[step], bucket=64)
    assert out.tokens[0] == ref


def test_different_seeds_and_steps_differ(sample_fn):
    vocab = VB
    logits = np.zeros((64, vocab), np.float32)  # uniform: collisions are rare
    p = SamplingParams(temperature=1.0)
    by_seed = _run(sample_fn, logits, [p] * 64, seeds=list(range(64)), steps=[0] * 64).tokens
    by_step = _run(sample_fn, logits, [p] * 64, seeds=[5] * 64, steps=list(range(64))).tokens
    assert len(set(by_seed.tolist())) > 50
    assert len(set(by_step.tolist())) > 50


def test_step_is_folded_into_seed_key(sample_fn):
    """key = fold_in(key(seed), step): a pure function of (seed, step), reproducible across calls."""
    logits = np.zeros((4, VB), np.float32)
    p = SamplingParams(temperature=1.0)
    a = _run(sample_fn, logits, [p] * 4, seeds=[1, 1, 2, 2], steps=[0, 1, 0, 1]).tokens
    b = _run(sample_fn, logits[:2], [p] * 2, seeds=[2, 1], steps=[1, 1]).tokens
    assert a[3] == b[0] and a[1] == b[1]
    # Gumbel-max with the row's key, computed independently
    key = jax.random.fold_in(jax.random.key(2, impl="threefry2x32"), 1)
    expect = int(jnp.argmax(jax.random.gumbel(key, (VB,), jnp.float32)))
    assert a[3] == expect


# ------------------------------------------------------------------------------------------
# distribution and filters
# ------------------------------------------------------------------------------------------


def test_empirical_distribution_matches_softmax(sample_fn):
    temperatures = (1.0, 0.5, 2.0)
    n = 13000  # draws per temperature, all in one batch
    logits_row = np.float32([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    params = [SamplingParams(temperature=t) for t in temperatures for _ in range(n)]
    rows = len(params)
    out = _run(sample_fn, np.tile(logits_row, (rows, 1)), params, seeds=list(range(rows)),
               steps=[s % 17 for s in range(rows)])
    for i, temperature in enumerate(temperatures):
        freq = np.bincount(out.tokens[i * n:(i + 1) * n], minlength=V) / n
        expect = np.exp(logits_row / temperature)
        expect /= expect.sum()
        # sd of a frequency is <= 0.0044 at n = 13000; 0.02 is ~4.5 sd
        assert np.abs(freq - expect).max() < 0.02, (temperature, freq, expect)
        chi2 = n * np.sum((freq - expect) ** 2 / expect)
        assert chi2 < 30, (temperature, chi2)  # 7 dof: p ~ 1e-4


def test_top_k_one_is_greedy(sample_fn):
    logits = _random_logits(32, vocab=VB, seed=5, scale=0.3)
    out = _run(sample_fn, logits, [SamplingParams(temperature=1.5, top_k=1)] * 32)
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))


def test_top_k_restricts_support(sample_fn):
    logits_row = np.float32([0.0, 3.0, 1.0, 2.5, -1.0, 2.0, 0.5, 1.5])
    support, _ = _support(sample_fn, logits_row, SamplingParams(temperature=5.0, top_k=3))
    assert support == {1, 3, 5}
    support, _ = _support(sample_fn, logits_row, SamplingParams(temperature=5.0, top_k=V + 10))
    assert support == set(range(V))


def test_top_p_restricts_to_nucleus(sample_fn):
    probs = [0.05, 0.4, 0.02, 0.3, 0.03, 0.15, 0.01, 0.04]
    logits_row = _logits_from_probs(probs)[0]
    # sorted: 0.4 (1), 0.3 (3), 0.15 (5), 0.05 (0), ... cumulative 0.4, 0.7, 0.85, 0.9
    cases = {0.3: {1}, 0.5: {1, 3}, 0.7: {1, 3}, 0.8: {1, 3, 5}, 0.88: {1, 3, 5, 0}}
    for top_p, expect in cases.items():
        support, tokens = _support(sample_fn, logits_row, SamplingParams(temperature=1.0, top_p=top_p))
        assert support == expect, (top_p, support)
    # renormalised within the nucleus: {1, 3} -> 4/7, 3/7
    _, tokens = _support(sample_fn, logits_row, SamplingParams(temperature=1.0, top_p=0.6), draws=4000)
    assert abs(np.mean(tokens == 1) - 4 / 7) < 0.03


def test_top_p_keeps_at_least_one(sample_fn):
    logits_row = _logits_from_probs([0.9, 0.02, 0.02, 0.02, 0.01, 0.01, 0.01, 0.01])[0]
    support, _ = _support(sample_fn, logits_row, SamplingParams(temperature=1.0, top_p=1e-6), draws=500)
    assert support == {0}


def test_top_k_then_top_p(sample_fn):
    probs = [0.05, 0.4, 0.02, 0.3, 0.03, 0.15, 0.01, 0.04]
    logits_row = _logits_from_probs(probs)[0]
    # top-k=2 keeps {1, 3} renormalised to 4/7, 3/7; top_p=0.5 then keeps only token 1
    support, _ = _support(sample_fn, logits_row, SamplingParams(temperature=1.0, top_k=2, top_p=0.5), draws=500)
    assert support == {1}


def test_min_p_restricts(sample_fn):
    probs = [0.05, 0.4, 0.02, 0.3, 0.03, 0.15, 0.01, 0.04]
    logits_row = _logits_from_probs(probs)[0]
    # threshold 0.3 * 0.4 = 0.12: keeps 0.4, 0.3, 0.15
    support, _ = _support(sample_fn, logits_row, SamplingParams(temperature=1.0, min_p=0.3))
    assert support == {1, 3, 5}
    # min_p applies to the temperature-scaled distribution: T=0.5 squares the ratios,
    # (0.3/0.4)^2 = 0.5625 and (0.15/0.4)^2 = 0.14 -> only {1, 3} clear 0.3
    support, _ = _support(sample_fn, logits_row, SamplingParams(temperature=0.5, min_p=0.3))
    assert support == {1, 3}
    support, _ = _support(sample_fn, logits_row, SamplingParams(temperature=1.0, min_p=1.0), draws=500)
    assert support == {1}


def test_filters_are_per_row(sample_fn):
    probs = [0.05, 0.4, 0.02, 0.3, 0.03, 0.15, 0.01, 0.04]
    logits_row = _logits_from_probs(probs)[0]
    kinds = [
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_p=0.3),
        SamplingParams(temperature=1.0, min_p=0.5),
    ]
    draws = 1000
    params = [kinds[i % 4] for i in range(draws * 4)]
    out = _run(sample_fn, np.tile(logits_row, (draws * 4, 1)), params, seeds=list(range(draws * 4)))
    supports = [set(out.tokens[i::4].tolist()) for i in range(4)]
    assert supports[0] == {1, 3}
    assert supports[1] == set(range(V))
    assert supports[2] == {1}
    assert supports[3] == {1, 3}


# ------------------------------------------------------------------------------------------
# logprobs
# ------------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax(sample_fn):
    vocab = VB
    logits = _random_logits(6, vocab=vocab, seed=6)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.3, top_k=5),
        SamplingParams(temperature=2.0, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=1.0),
    ]
    out = _run(sample_fn, logits[:5], params, n=4)
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    np.testing.assert_allclose(out.logprob[:5], ref[np.arange(5), out.tokens[:5]], rtol=1e-6, atol=1e-6)
    ref_lp, ref_ids = jax.lax.top_k(jnp.asarray(ref), 4)
    np.testing.assert_array_equal(out.top_ids[:5], np.asarray(ref_ids)[:5])
    np.testing.assert_allclose(out.top_logprobs[:5], np.asarray(ref_lp)[:5], rtol=1e-6, atol=1e-6)
    assert out.top_ids.shape == (5, 4) and out.top_ids.dtype == np.int32
    assert out.top_logprobs.dtype == np.float32 and out.logprob.dtype == np.float32


def test_zero_top_logprobs(sample_fn):
    logits = _random_logits(2, vocab=VB, seed=7)
    out = _run(sample_fn, logits, [SamplingParams(temperature=1.0)] * 2, n=0)
    assert out.top_ids.shape == (2, 0) and out.top_logprobs.shape == (2, 0)


def test_bf16_logits_accepted(sample_fn):
    logits = _random_logits(64, vocab=VB, seed=8)
    out = sample_fn(jnp.asarray(logits, jnp.bfloat16), SamplingBatch.from_params([None] * 64, [None] * 64, [0] * 64, 64),
                    num_top_logprobs=4)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(jnp.argmax(jnp.asarray(logits, jnp.bfloat16), -1)))


# ------------------------------------------------------------------------------------------
# the sort-free thresholds and argmax against their sort-based definitions
# ------------------------------------------------------------------------------------------

def _sorted_thresholds(x, top_k, top_p, use_k, use_p):
    """The definition, with a sort (numpy, float64 probabilities): the k-th largest value, then the
    last value of the smallest most-likely run of the top-k-renormalised distribution reaching top_p.
    Also returns the mass before that run's last token (to spot rows on a rounding knife edge)."""
    out, edge = [], []
    for row, k, p, uk, up in zip(x, top_k, top_p, use_k, use_p):
        s = np.sort(row)[::-1]
        thr_k = s[min(max(k, 1), len(s)) - 1] if uk else -np.inf
        s = np.where(s >= thr_k, s, -np.inf).astype(np.float64)
        probs = np.exp(s - s.max())
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        count = min(max(int(np.sum(before < p)), 1), len(s))
        thr_p = s[count - 1] if up else -np.inf
        out.append(max(thr_k, thr_p))
        near = np.abs(before[before > 0] - p)
        edge.append(near.min() if up and near.size else 1.0)
    return np.asarray(out, np.float32), np.asarray(edge)


@pytest.mark.parametrize("vocab", [7, 1000, 5003])
def test_bisection_thresholds_equal_the_sorted_definition(vocab):
    from serve.sampling import _topk_topp_threshold

    rng = np.random.default_rng(vocab)
    rows = 48
    x = (rng.standard_normal((rows, vocab)) * rng.uniform(0.1, 6, (rows, 1))).astype(np.float32)
    x[::5] = np.round(x[::5])  # many ties
    x[1::7, : vocab // 3] = -np.inf  # masked tokens (a bitmask or allowed_token_ids)
    x[2] = -3.5  # a flat row
    top_k = rng.integers(-1, vocab + 3, rows).astype(np.int32)
    top_p = rng.choice([1e-6, 0.3, 0.5, 0.9, 0.95, 0.999, 1.0], rows).astype(np.float32)
    use_k, use_p = (top_k > 0) & (top_k < vocab), top_p < 1.0
    got = np.asarray(jax.jit(_topk_topp_threshold)(jnp.asarray(x), jnp.asarray(top_k), jnp.asarray(top_p),
                                                   jnp.asarray(use_k), jnp.asarray(use_p)))
    want, edge = _sorted_thresholds(x, top_k, top_p, use_k, use_p)
    firm = edge > 1e-5  # rows whose mass lands within float rounding of top_p may go either way
    assert firm.sum() > rows * 0.7
    np.testing.assert_array_equal(got[firm], want[firm])


def test_first_argmax_is_argmax():
    from serve.sampling import first_argmax

    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 777)).astype(np.float32)
    x[1, [5, 600]] = 9.0  # a tie: the first wins
    x[2] = -np.inf  # nothing allowed: 0, as jnp.argmax
    x[3, :700] = -np.inf
    x[4] = 0.0
    np.testing.assert_array_equal(np.asarray(jax.jit(first_argmax)(jnp.asarray(x))), np.argmax(x, axis=-1))
