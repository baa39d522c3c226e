"""Tests for serve.sampling: on-device sampling over a padded batch."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serve.sampling import SamplingBatch, SampleResult, max_logprobs, sample, seed_key_data
from serve.types import RequestError, SamplingParams

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


def _run(fn, logits, params, seeds=None, steps=None, bucket=None, n=4, bias_width=0) -> SampleResult:
    rows = len(params)
    seeds = list(range(rows)) if seeds is None else seeds
    steps = [0] * rows if steps is None else steps
    bucket = next(b for b in BUCKETS if b >= rows) if bucket is None else bucket
    if logits.shape[0] < bucket:
        pad = np.zeros((bucket - logits.shape[0], logits.shape[1]), np.float32)
        logits = np.concatenate([logits, pad])
    params = [dataclasses.replace(p, logprobs=n) if n and p.logprobs is None else p for p in params]  # (rows ask)
    batch = SamplingBatch.from_params(params, seeds, steps, bucket, bias_width=bias_width)
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


def test_seeds_as_vllm_takes_them():
    """vLLM's seeds: -1 is no seed; any other 64-bit integer is one (a negative one keys as its two's complement)."""
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-5).seed == -5
    SamplingParams(seed=-2 ** 63).validate(VB)
    np.testing.assert_array_equal(seed_key_data(-5), seed_key_data(2 ** 64 - 5))
    for bad in (2 ** 63, True, 1.5):
        with pytest.raises(RequestError, match="seed: must be a 64-bit integer"):
            SamplingParams(seed=bad).validate(VB)


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
    # vLLM v1's rank counts the tie against the token: 2 for the tied argmax, 1 for the other rows
    assert out.rank[3] == 2 and (np.delete(out.rank, 3) == 1).all()


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


def test_min_p_applies_before_the_top_p_nucleus(sample_fn):
    """vLLM's order: temperature, min-p, then top-k / top-p over what min-p leaves, renormalised."""
    logits_row = _logits_from_probs([0.4, 0.3, 0.2, 0.1, 1e-9, 1e-9, 1e-9, 1e-9])[0]
    # min_p 0.6 keeps p >= 0.24: {0, 1}, renormalised 4/7, 3/7; top_p 0.5 then keeps only token 0 (over the
    # unfiltered distribution the nucleus would be {0, 1}, which min-p keeps whole)
    support, _ = _support(sample_fn, logits_row, SamplingParams(temperature=1.0, top_p=0.5, min_p=0.6), draws=500)
    assert support == {0}
    # top_p 0.6 reaches past 4/7: {0, 1}
    support, _ = _support(sample_fn, logits_row, SamplingParams(temperature=1.0, top_p=0.6, min_p=0.6), draws=500)
    assert support == {0, 1}


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
    # vLLM v1's rank of the sampled token: the tokens at least as likely as it (1 for a greedy row without ties)
    want = (ref[:5] >= ref[np.arange(5), out.tokens[:5]][:, None]).sum(-1)
    np.testing.assert_array_equal(out.rank[:5], want)
    assert out.rank[0] == 1 and out.rank.dtype == np.int32 and want.max() > 1


def test_the_top_n_is_computed_only_when_a_row_asks(sample_fn):
    """A top-n over the vocabulary costs about as much as the rest of sampling (30 ms for 32 rows of K3's 163,840
    tokens on the CPU host): a batch where no row asks for logprobs skips it (zeros); one row asking computes it
    for the batch. Tokens, logprobs and ranks never change."""
    logits = _random_logits(3, vocab=VB, seed=11)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7)]
    asks = [params[0], dataclasses.replace(params[1], logprobs=2), params[2]]
    pad = jnp.asarray(np.concatenate([logits, np.zeros((61, VB), np.float32)]))

    def run(ps):
        batch = SamplingBatch.from_params(ps, [0, 1, 2], [0] * 3, 64)
        return SampleResult(*(a[:3] for a in jax.device_get(sample_fn(pad, batch, num_top_logprobs=4))))
    skipped, asked = run(params), run(asks)
    assert not skipped.top_ids.any() and not skipped.top_logprobs.any()
    ref_lp, ref_ids = jax.lax.top_k(jax.nn.log_softmax(jnp.asarray(logits), axis=-1), 4)
    np.testing.assert_array_equal(asked.top_ids, np.asarray(ref_ids))
    np.testing.assert_allclose(asked.top_logprobs, np.asarray(ref_lp), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(skipped.tokens, asked.tokens)
    np.testing.assert_array_equal(skipped.logprob, asked.logprob)
    np.testing.assert_array_equal(skipped.rank, asked.rank)


def test_a_constrained_rows_raw_logprobs_are_taken_after_its_mask(sample_fn):
    """vLLM applies the grammar bitmask to the logits before its sampler: a row under a structured-output
    constraint (`constrained`) gets log_softmax of its masked logits (the disallowed tokens -inf, never in
    its top-n before the allowed ones); a row masked by bad words alone keeps the raw ones; tokens unchanged."""
    from serve.penalties import apply_bitmask
    from serve.structured import mask_words

    logits = _random_logits(3, vocab=VB, seed=9)
    w = mask_words(VB)
    allowed = np.full((64, w), -1, np.int32)
    rng = np.random.default_rng(3)
    for r in (0, 1, 2):
        allowed[r] = rng.integers(-2 ** 31, 2 ** 31, w, dtype=np.int64).astype(np.int32)  # about half allowed
    params = [SamplingParams(temperature=0.0, logprobs=4), SamplingParams(temperature=1.0, logprobs=4),
              SamplingParams(temperature=0.0, logprobs=4)]
    constrained = np.zeros(64, bool)
    constrained[:2] = True  # row 2: a bad-words mask (vLLM bans bad words after its raw logprobs)
    pad = np.concatenate([logits, np.zeros((61, VB), np.float32)])
    batch = SamplingBatch.from_params(params, [0, 1, 2], [0, 0, 0], 64, allowed=allowed, constrained=constrained)
    out = SampleResult(*(a[:3] for a in jax.device_get(sample_fn(jnp.asarray(pad), batch, num_top_logprobs=4))))
    masked = np.asarray(apply_bitmask(jnp.asarray(logits), jnp.asarray(allowed[:3])))
    bits = np.isfinite(masked)
    assert bits[np.arange(3), out.tokens].all()  # the sampled tokens satisfy the mask
    for r, ref_x in ((0, masked[0]), (1, masked[1]), (2, logits[2])):
        ref = np.asarray(jax.nn.log_softmax(jnp.asarray(ref_x)))
        assert out.logprob[r] == pytest.approx(ref[out.tokens[r]], abs=1e-5)
        np.testing.assert_allclose(out.top_logprobs[r], np.sort(ref)[::-1][:4], rtol=1e-5, atol=1e-5)
        assert out.rank[r] == (ref >= ref[out.tokens[r]]).sum()
    assert bits[0, out.top_ids[0]].all() and bits[1, out.top_ids[1]].all() and not bits[2, out.top_ids[2]].all()
    plain = SamplingBatch.from_params(params, [0, 1, 2], [0, 0, 0], 64, allowed=allowed)
    again = jax.device_get(sample_fn(jnp.asarray(pad), plain, num_top_logprobs=4))
    np.testing.assert_array_equal(again.tokens[:3], out.tokens)



def test_a_row_whose_every_token_is_banned_samples_what_it_allows_not_token_0(sample_fn):
    """A row whose allowed tokens are all banned (allowed_token_ids or a constraint's continuations all under a
    -inf bias: bad words, min_tokens' stop-token ban) was all -inf, and its argmax the garbage token 0: it samples
    from what it allows without those bans (greedy: the best of them); a -inf bias on some tokens still bans
    them, and bans through the bias stay out of a constrained row's raw logprobs (vLLM bans bad words after)."""
    from serve.sampling import ban_in_bias
    from serve.structured import mask_words

    logits = _random_logits(4, vocab=VB, seed=5)
    logits[:, 0] = 9.0  # token 0 is the best of every row: never sampled below, so a garbage 0 shows
    w = mask_words(VB)
    allowed = np.full((64, w), -1, np.int32)
    allowed[1] = allowed[3] = 0
    allowed[1, 0] = allowed[3, 0] = (1 << 6) | (1 << 9)  # constrained rows: tokens 6 and 9 only
    constrained = np.zeros(64, bool)
    constrained[[1, 3]] = True
    params = [SamplingParams(temperature=0.0, allowed_token_ids=[3, 5]), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=1.0, allowed_token_ids=[3, 5]), SamplingParams(temperature=0.0, logprobs=2)]
    bans = [{3: -np.inf, 5: -np.inf}, {6: -np.inf, 9: -np.inf}, {3: -np.inf, 5: -np.inf}, None]
    batch = SamplingBatch.from_params(params, [0, 1, 2, 3], [0, 0, 0, 0], 64, extra_bias=bans, bias_width=4,
                                      allowed=allowed, constrained=constrained)
    assert ban_in_bias(batch.bias_ids[3], batch.bias_values[3], [9, 2, 7, 11, 13]) == [13]  # 4 entries: one left
    pad = np.concatenate([logits, np.zeros((60, VB), np.float32)])
    out = SampleResult(*(a[:4] for a in jax.device_get(sample_fn(jnp.asarray(pad), batch, num_top_logprobs=2))))
    assert out.tokens[0] == (3 if logits[0, 3] > logits[0, 5] else 5)
    assert out.tokens[1] == (6 if logits[1, 6] > logits[1, 9] else 9)
    assert out.tokens[2] in (3, 5)
    assert out.tokens[3] == 6  # 9 banned through the bias, 6 the only token left
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits[3, [6, 9]])))  # the grammar's two, the ban unseen
    assert out.logprob[3] == pytest.approx(ref[0], abs=1e-5)
    np.testing.assert_array_equal(np.sort(out.top_ids[3]), [6, 9])

def _processed_reference(logits, params):
    """The values each row samples from, by the definition (numpy, a sort for top-k / top-p): a greedy row's
    logits plus its bias; a sampled row's biased logits / temperature with tokens below min-p, then outside
    top-k or the top-p nucleus of what is left, at -inf (vLLM's order)."""
    out = []
    for row, p in zip(logits, params):
        x = row.astype(np.float32).copy()
        for t, b in (p.logit_bias or {}).items():
            x[t] += np.float32(b)
        if p.temperature < 1e-5:
            out.append(x)
            continue
        x = x / np.float32(p.temperature)
        if p.min_p > 0:
            x = np.where(x - x.max() >= np.log(p.min_p), x, -np.inf).astype(np.float32)
        v = len(x)
        use_k, use_p = 0 < p.top_k < v, p.top_p < 1.0
        thr, edge = _sorted_thresholds(x[None], [p.top_k], [p.top_p], [use_k], [use_p])
        assert edge[0] > 1e-5  # not on a rounding knife edge
        out.append(np.where(x >= thr[0], x, -np.inf).astype(np.float32))
    return np.stack(out)


@pytest.fixture(scope="module")
def sample_mode_fn():
    return jax.jit(sample, static_argnames=("num_top_logprobs", "logprobs_mode"))


def test_logprobs_modes_return_what_vllm_names(sample_mode_fn):
    """raw_logits / processed_logits / processed_logprobs (vLLM's logprobs_mode) against the definition:
    the raw logits, or the values the row's token was drawn from (after bias, temperature, top-k, top-p,
    min-p) and their log_softmax; the tokens never depend on the mode."""
    from functools import partial

    def log_softmax(x, axis):
        m = np.max(x, axis=axis, keepdims=True)
        return x - m - np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))

    n = 6
    logits = _random_logits(7, vocab=VB, seed=21)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={3: 4.0, 17: -2.5}),
        SamplingParams(temperature=0.3, top_k=5),
        SamplingParams(temperature=2.0, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, logit_bias={5: 1.5}),
        SamplingParams(temperature=1.3, top_k=3),  # fewer survivors than n: -inf in the top-n
    ]
    runs = {m: _run(partial(sample_mode_fn, logprobs_mode=m), logits, params, n=n, seeds=list(range(50, 57)),
                 bias_width=2)
            for m in ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")}
    for m, out in runs.items():
        np.testing.assert_array_equal(out.tokens, runs["raw_logprobs"].tokens, err_msg=m)
    tok = runs["raw_logprobs"].tokens
    rows = np.arange(len(params))
    proc = _processed_reference(logits, params)
    for m, values in (("raw_logits", logits.astype(np.float64)), ("processed_logits", proc.astype(np.float64)),
                      ("processed_logprobs", log_softmax(proc.astype(np.float64), axis=-1))):
        out = runs[m]
        np.testing.assert_allclose(out.logprob, values[rows, tok], rtol=1e-5, atol=1e-5, err_msg=m)
        want = -np.sort(-values, axis=-1)[:, :n]
        np.testing.assert_allclose(out.top_logprobs, want, rtol=1e-5, atol=1e-5, err_msg=m)
        finite = np.isfinite(want)
        np.testing.assert_array_equal(np.take_along_axis(values, out.top_ids, -1)[finite], want[finite], err_msg=m)
    assert np.isfinite(runs["processed_logprobs"].logprob).all()  # the sampled token always survives
    assert np.isneginf(runs["processed_logprobs"].top_logprobs[6, 3:]).all()  # top_k=3 keeps 3
    # a greedy row's processed logprobs are those of its (biased) logits
    np.testing.assert_allclose(runs["processed_logprobs"].logprob[0], runs["raw_logprobs"].logprob[0], rtol=1e-6)


def test_tiny_temperatures_sample_at_vllms_floor(sample_mode_fn):
    """vLLM raises a temperature in (0, 0.01) to 0.01: such rows sample (not greedy) from logits / 0.01, finite."""
    from functools import partial

    logits = np.tile(_random_logits(1, vocab=VB, seed=23, scale=0.02), (3, 1))  # flat: 0.01 still spreads
    params = [SamplingParams(temperature=t) for t in (1e-6, 0.005, 0.01)]
    out = _run(partial(sample_mode_fn, logprobs_mode="processed_logprobs"), logits, params, seeds=[4, 4, 4], n=6)
    x = logits[0].astype(np.float64) / 0.01
    want = x - x.max() - np.log(np.sum(np.exp(x - x.max())))
    assert len(set(out.tokens.tolist())) == 1 and np.isfinite(out.logprob).all()
    np.testing.assert_allclose(out.logprob, want[out.tokens], rtol=1e-4, atol=1e-4)
    picks = _run(sample_mode_fn, np.tile(logits[:1], (64, 1)), [params[0]] * 64, seeds=list(range(64)), n=6).tokens
    assert len(set(picks.tolist())) > 1  # sampled, not the argmax


def test_processed_logprobs_are_the_sampling_distribution(sample_mode_fn):
    """exp(processed logprob) of a token = how often it is drawn (4000 seeds, within 4.5 sigma)."""
    from functools import partial

    draws = 4000
    row = _random_logits(1, vocab=VB, seed=22)[0]
    p = SamplingParams(temperature=1.5, top_k=12, top_p=0.8, min_p=0.03)
    out = _run(partial(sample_mode_fn, logprobs_mode="processed_logprobs"), np.tile(row, (draws, 1)), [p] * draws,
               seeds=list(range(draws)), n=12)
    probs = np.exp(out.top_logprobs[0].astype(np.float64))
    assert 2 <= np.sum(probs > 0) < 12 and abs(probs.sum() - 1) < 1e-5  # filtered, renormalised
    counts = np.array([np.sum(out.tokens == t) for t in out.top_ids[0]])
    assert counts.sum() == draws  # nothing outside the support
    sigma = np.sqrt(draws * probs * (1 - probs)) + 1e-9
    assert np.all(np.abs(counts - draws * probs) <= 4.5 * sigma + 1), (counts, draws * probs)
    np.testing.assert_allclose(out.logprob, out.top_logprobs[0][np.argmax(out.top_ids[0][None] == out.tokens[:, None], 1)],
                               rtol=1e-6)


def test_logprobs_mode_is_checked():
    logits = jnp.asarray(_random_logits(2, vocab=V))
    batch = SamplingBatch.from_params([SamplingParams()] * 2, [0, 1], [0, 0], 2)
    with pytest.raises(ValueError, match="logprobs_mode='raw'"):
        sample(logits, batch, 2, logprobs_mode="raw")


def test_prompt_positions_are_scored_raw_in_every_mode():
    """Prompt logprobs are the log_softmax of the model's logits whatever the engine's logprobs_mode: vLLM's model
    runner scores prompt tokens with `Sampler.compute_logprobs` (log_softmax) in every mode; the `*_logits`
    modes returned the raw logits here. Ranks and the top-n are those of the same values."""
    from serve.sampling import prompt_logprobs

    x = _random_logits(6, vocab=VB, seed=23).reshape(2, 3, VB)
    targets = np.array([[4, -1, 900], [17, 3, 0]], np.int32)
    got = jax.device_get(prompt_logprobs(lambda h: h, jnp.asarray(x), jnp.asarray(targets), 3))
    want = x.astype(np.float64)
    want = want - np.log(np.sum(np.exp(want), axis=-1, keepdims=True))
    safe = np.maximum(targets, 0)
    np.testing.assert_allclose(got.logprob, np.take_along_axis(want, safe[..., None], -1)[..., 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.rank, np.sum(x >= np.take_along_axis(x, safe[..., None], -1), -1))
    np.testing.assert_array_equal(got.top_ids, np.argsort(-x, -1, kind="stable")[..., :3])
    np.testing.assert_allclose(got.top_logprobs, -np.sort(-want, -1)[..., :3], rtol=1e-5, atol=1e-5)


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
