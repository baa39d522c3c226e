"""Token sampling on device: one pure, jit-able function over a bucket-padded batch.

``sample(logits, batch, num_top_logprobs)`` turns a ``[B, V]`` block of next-token logits into
``[B]`` tokens plus logprobs, one row per sequence, with per-row sampling parameters held in a
:class:`SamplingBatch` (built on the host by :meth:`SamplingBatch.from_params`).

Semantics (vLLM's):

* ``temperature`` 0 is greedy: the token is the argmax (first maximum) of the
  raw logits, bit for bit (of the biased / penalised ones when the row has a bias or penalty, see below);
  the row's top-k/top-p/min-p are ignored. A temperature in (0, ``MIN_TEMPERATURE``) samples at
  ``MIN_TEMPERATURE`` (vLLM raises it so, against NaN / inf: 1e-6 is not greedy there).
* Otherwise the logits are divided by the temperature and filtered, in vLLM (v1)'s order:
  min-p (drop tokens with ``p < min_p * p_max``; ``0`` is off), top-k (``top_k <= 0`` or ``>= V``
  is off), then top-p (the nucleus of the distribution the two before leave, renormalised: the
  smallest run of most-likely tokens whose mass reaches ``top_p``, never fewer than one;
  ``top_p >= 1`` is off). Top-k and top-p are applied as value thresholds, so tokens tied with the
  last kept one are kept too. Min-p and top-k both keep a run of most-likely tokens, so their
  relative order does not matter; top-p's nucleus is taken after min-p (vLLM's v0 applied min-p
  last, which keeps more tokens when both are set).
* The token is then drawn with the Gumbel-max trick using the row's own key,
  ``fold_in(key(seed), step)`` (threefry2x32, whatever the global default PRNG is), where
  ``step`` is the index of the token within its request. A request's samples therefore depend only
  on its seed, its step and its logits: not on its batch row, the batch size or the padding.
* ``logprob`` is ``log_softmax`` of the RAW logits (before temperature and filtering) at the chosen
  token, and ``top_ids``/``top_logprobs`` are ``lax.top_k`` of that same ``log_softmax`` (vLLM's default
  "raw logprobs"). A row under an active structured-output constraint (``SamplingBatch.constrained``)
  takes them after its bitmask: vLLM applies the grammar bitmask to the logits before its sampler, so a
  constrained row's logprobs are the model's renormalised over the tokens the grammar allows (the others
  -inf); bias, penalties, bad words and processors stay out. vLLM's other ``logprobs_mode``s (static,
  one per engine) return instead the raw logits (``raw_logits``), or the values the token was drawn from
  (``processed_logits``: after the mask, bias, penalties and processors, then, for a sampled row,
  temperature, min-p, top-k and top-p, a filtered token at -inf) or their ``log_softmax``
  (``processed_logprobs``: the log of the exact distribution sampled; a greedy row's is that of its
  processed logits, whose argmax it took). The top-n are the n largest of the same values, computed only
  when some row of the batch asks for them (``SamplingBatch.num_top``; zeros otherwise): a top-n over a
  163,840-token vocabulary costs as much as the rest of sampling, and most requests ask for none.

Before any of that, ``serve/penalties.py`` masks a structured-output row's disallowed tokens (its
bitmask, ``serve/structured.py``), adds the row's logit bias (``logit_bias`` and the engine's
``min_tokens`` ban) and applies presence / frequency / repetition penalties over the row's tokens;
greedy rows take the argmax of those processed logits, as in vLLM.

Top-k and top-p thresholds are found by bisection over the float bit patterns (no sort of the
vocabulary), each skipped (``lax.cond``) when no sampled row in the batch uses it, and the whole random
path is skipped when every row is greedy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from serve import logits_processors
from serve.logits_processors import LogitsProcessor, ProcessorContext
from serve.penalties import apply_bias, apply_bitmask, apply_penalties
from serve.types import LOGPROBS_MODES, SamplingParams

__all__ = [
    "GREEDY_EPS",
    "KEY_IMPL",
    "SamplingBatch",
    "SampleResult",
    "ban_in_bias",
    "sample",
    "seed_key_data",
    "max_logprobs",
    "LOGPROBS_MODES",
]

#: Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
GREEDY_EPS = 1e-5
#: A request's temperature in (0, this) samples at this one (vLLM's _MAX_TEMP clamp), so only 0 is greedy.
MIN_TEMPERATURE = 1e-2
INT32_MAX = 2 ** 31 - 1
# temperatures are capped here (any higher one samples as uniformly; beyond float32's range one became inf)
MAX_TEMPERATURE = 1e30
#: PRNG implementation of the per-row keys; ``SamplingBatch.seeds`` holds its raw key data.
KEY_IMPL = "threefry2x32"

_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF


def seed_key_data(seed: int) -> np.ndarray:
    """Raw threefry2x32 key data ``[hi32, lo32]`` of an integer seed (up to 64 bits).

    Equals ``jax.random.key_data(jax.random.key(seed, impl="threefry2x32"))`` wherever JAX accepts
    the seed, and also covers 64-bit seeds when JAX's x64 mode is off.
    """
    s = int(seed) & _U64
    return np.array([(s >> 32) & _U32, s & _U32], dtype=np.uint32)


def max_logprobs(params: Sequence[Optional[SamplingParams]]) -> int:
    """The largest ``logprobs`` requested by any row (0 when none asks): the least
    ``num_top_logprobs`` that serves them all (the caller may round it up to a bucket)."""
    return max((p.logprobs or 0 for p in params if p is not None), default=0)


def ban_in_bias(ids: np.ndarray, values: np.ndarray, tokens: Sequence[int]) -> list[int]:
    """Ban `tokens` through one row of a batch's logit bias (`SamplingBatch.bias_ids` / `bias_values` [N], in
    place; -1 an unused entry): a listed token's value becomes -inf, the others take unused entries -> those
    left out (no room). `sample` adds the bias after a constrained row's raw logprobs are taken, so they do not
    see these bans (vLLM bans bad words in its sampler, after its raw logprobs)."""
    free = list(np.flatnonzero(ids < 0))
    left = []
    for t in tokens:
        listed = ids == t
        if listed.any():
            values[listed] = -np.inf
        elif free:
            k = free.pop(0)
            ids[k], values[k] = t, -np.inf
        else:
            left.append(t)
    return left


@jax.tree_util.register_dataclass
@dataclass
class SamplingBatch:
    """Per-row sampling parameters of a padded batch (a pytree of arrays; every leaf has B rows)."""

    temperature: jax.Array  # [B] f32, < GREEDY_EPS means greedy
    top_k: jax.Array  # [B] i32, <= 0 is off
    top_p: jax.Array  # [B] f32, >= 1 is off
    min_p: jax.Array  # [B] f32, <= 0 is off
    seeds: jax.Array  # [B, 2] u32 threefry2x32 key data of the row's seed (see seed_key_data)
    steps: jax.Array  # [B] i32 index of the token being sampled within its request
    presence: jax.Array  # [B] f32 presence penalty (0 off)
    frequency: jax.Array  # [B] f32 frequency penalty (0 off)
    repetition: jax.Array  # [B] f32 repetition penalty (1 off)
    prompt_lens: jax.Array  # [B] i32 prompt length: later positions are output (for the penalties)
    bias_ids: jax.Array  # [B, N] i32 tokens whose logits get bias_values (-1: unused)
    bias_values: jax.Array  # [B, N] f32
    restrict: jax.Array  # [B] bool only the row's bias_ids may be sampled (allowed_token_ids)
    allowed: jax.Array  # [B, W] i32 bitmask of the tokens a structured-output row may take (-1: all)
    constrained: jax.Array  # [B] bool the row's mask is an active constraint's: its raw logprobs see it
    num_top: jax.Array  # [B] i32 top logprobs the row returns (0: none; the top-n is skipped when no row asks)
    proc_args: jax.Array  # [B, A] f32 the custom logits processors' arguments (serve/logits_processors.py)
    proc_on: jax.Array  # [B, P] bool which processors process the row

    @property
    def size(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_params(
        cls,
        params: Sequence[Optional[SamplingParams]],
        seeds: Sequence[Optional[int]],
        steps: Sequence[int],
        bucket: int,
        prompt_lens: Optional[Sequence[int]] = None,
        extra_bias: Optional[Sequence[dict]] = None,
        bias_width: int = 0,
        allowed: Optional[np.ndarray] = None,
        mask_words: int = 0,
        processors: Sequence[LogitsProcessor] = (),
        constrained: Optional[np.ndarray] = None,
    ) -> "SamplingBatch":
        """Host-side (numpy) builder: row ``i`` samples with ``params[i]``, ``seeds[i]`` and
        ``steps[i]``; rows ``len(params)..bucket-1`` and ``None`` params are greedy padding.

        ``seeds[i]`` is the request's seed (``SamplingParams.seed``, or one the engine drew for an
        unseeded request); it may be ``None`` for greedy rows. ``prompt_lens[i]`` marks where row
        ``i``'s output starts (penalties count output tokens); ``extra_bias[i]`` ({token: bias}) is
        added to the request's ``logit_bias`` (the engine's ``min_tokens`` ban); both fit in
        ``bias_width`` entries per row. ``allowed`` ([bucket, mask_words] int32, rows of -1 for
        unconstrained rows) is the structured-output bitmask; without it every row allows all. A
        speculative verify batch gives one mask per row and position ([bucket * T, mask_words]).
        ``processors`` are the engine's custom logits processors: each row's ``extra_args`` fill their
        argument columns and on/off flags. ``constrained`` ([bucket] bool) marks the rows whose mask is a
        structured-output constraint's (not bad words alone): their raw logprobs are taken after it.
        """
        n = len(params)
        if n > bucket:
            raise ValueError(f"{n} rows do not fit in a bucket of {bucket}")
        if len(seeds) != n or len(steps) != n:
            raise ValueError(f"params, seeds and steps must have the same length ({n}, {len(seeds)}, {len(steps)})")
        temperature = np.zeros(bucket, np.float32)
        top_k = np.zeros(bucket, np.int32)
        top_p = np.ones(bucket, np.float32)
        min_p = np.zeros(bucket, np.float32)
        seed_data = np.zeros((bucket, 2), np.uint32)
        step = np.zeros(bucket, np.int32)
        presence = np.zeros(bucket, np.float32)
        frequency = np.zeros(bucket, np.float32)
        repetition = np.ones(bucket, np.float32)
        plen = np.zeros(bucket, np.int32)
        bias_ids = np.full((bucket, bias_width), -1, np.int32)
        bias_values = np.zeros((bucket, bias_width), np.float32)
        restrict = np.zeros(bucket, bool)
        num_top = np.zeros(bucket, np.int32)
        constrained = np.zeros(bucket, bool) if constrained is None else np.asarray(constrained, bool)
        if constrained.shape != (bucket,):
            raise ValueError(f"constrained must be bool [{bucket}], got shape {constrained.shape}")
        if allowed is None:
            allowed = np.full((bucket, mask_words), -1, np.int32)
        elif allowed.shape[0] % bucket or allowed.dtype != np.int32:
            raise ValueError(f"allowed must be int32 [{bucket} x positions, W], got {allowed.dtype} {allowed.shape}")
        for i, (p, seed, st) in enumerate(zip(params, seeds, steps)):
            step[i] = st
            if seed is not None:
                seed_data[i] = seed_key_data(seed)
            if prompt_lens is not None:
                plen[i] = prompt_lens[i]
            bias = dict((p.logit_bias or {}) if p is not None else {})
            for t, b in ((extra_bias[i] or {}) if extra_bias is not None else {}).items():
                bias[t] = bias.get(t, 0.0) + b
            if p is not None and p.allowed_token_ids:  # the list becomes the allowed set (others -inf)
                restrict[i] = True
                bias = {t: bias.get(t, 0.0) for t in p.allowed_token_ids}
            if len(bias) > bias_width:
                raise ValueError(f"row {i}: {len(bias)} biased tokens exceed the batch's {bias_width}")
            if bias:
                bias_ids[i, :len(bias)] = list(bias)
                bias_values[i, :len(bias)] = list(bias.values())
            if p is not None:
                presence[i], frequency[i], repetition[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
                num_top[i] = p.logprobs or 0
            if p is None or p.temperature == 0:
                continue  # greedy: the defaults above
            temperature[i] = min(max(p.temperature, MIN_TEMPERATURE), MAX_TEMPERATURE)
            top_k[i] = min(p.top_k, INT32_MAX) if p.top_k > 0 else 0  # >= the vocabulary is off anyway
            top_p[i] = p.top_p
            min_p[i] = p.min_p
        proc_args, proc_on = logits_processors.batch_columns(
            processors, [p.extra_args if p is not None else None for p in params], bucket)
        return cls(temperature, top_k, top_p, min_p, seed_data, step, presence, frequency, repetition, plen,
                   bias_ids, bias_values, restrict, allowed, constrained, num_top, proc_args, proc_on)


class SampleResult(NamedTuple):
    tokens: jax.Array  # [B] i32
    logprob: jax.Array  # [B] f32 log_softmax(raw logits, a constrained row's masked)[token] (or another mode's value)
    top_ids: jax.Array  # [B, n] i32
    top_logprobs: jax.Array  # [B, n] f32
    rank: jax.Array  # [B] i32 tokens whose value (the `logprobs_mode`'s) is at least the sampled token's (vLLM v1's rank)


def _rank(values: jax.Array, chosen: jax.Array) -> jax.Array:
    """vLLM v1's rank of a token: the entries of `values` [..., V] at least its value `chosen` [..., 1] (ties count
    against it; 1 = the most likely) -> int32 [...]."""
    return jnp.sum(values >= chosen, axis=-1, dtype=jnp.int32)


class PromptLogprobs(NamedTuple):
    """Logprobs of given next tokens at every position of a chunk (zeros where not asked)."""

    logprob: jax.Array  # [B, T] f32 log_softmax(logits at t)[targets[t]]
    rank: jax.Array  # [B, T] i32 tokens at least as likely as the target (itself included: 1 = the most likely)
    top_ids: jax.Array  # [B, T, n] i32
    top_logprobs: jax.Array  # [B, T, n] f32


def check_logprobs_mode(mode: str) -> None:
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode={mode!r}: expected one of {', '.join(LOGPROBS_MODES)}")


def prompt_logprobs(logits_fn: Callable[[jax.Array], jax.Array], hidden: jax.Array, targets: jax.Array,
                    num_top_logprobs: int) -> PromptLogprobs:
    """hidden [B, T, H] -> the raw logprob and rank of targets [B, T] (-1: not asked) and the top-n.
    Prompt positions are scored, not sampled: the log_softmax of the model's logits in every `logprobs_mode`,
    as vLLM's model runners compute them (`Sampler.compute_logprobs`; the mode applies to sampled tokens only).

    The [B, T, V] logits are only computed (`lax.cond`) when some position asks."""
    b, t = targets.shape
    n = int(num_top_logprobs)

    def compute(h):
        lp = jax.nn.log_softmax(logits_fn(h).astype(jnp.float32), axis=-1)  # [B, T, V]
        chosen = jnp.take_along_axis(lp, jnp.maximum(targets, 0)[..., None], axis=-1)  # [B, T, 1]
        rank = _rank(lp, chosen)
        if n:
            top_lps, top_ids = lax.top_k(lp, n)
        else:
            top_lps, top_ids = jnp.zeros((b, t, 0), jnp.float32), jnp.zeros((b, t, 0), jnp.int32)
        return PromptLogprobs(chosen[..., 0], rank, top_ids.astype(jnp.int32), top_lps)

    return lax.cond(jnp.any(targets >= 0), compute, lambda h: no_prompt_logprobs((b, t), n), hidden)


def no_prompt_logprobs(shape: tuple[int, int], num_top_logprobs: int) -> PromptLogprobs:
    """Zeros of `prompt_logprobs`' result for targets of `shape` [B, T] (nothing asked)."""
    b, t, n = *shape, int(num_top_logprobs)
    return PromptLogprobs(jnp.zeros((b, t), jnp.float32), jnp.zeros((b, t), jnp.int32),
                          jnp.zeros((b, t, n), jnp.int32), jnp.zeros((b, t, n), jnp.float32))


def _row_keys(batch: SamplingBatch) -> jax.Array:
    keys = jax.random.wrap_key_data(batch.seeds.astype(jnp.uint32), impl=KEY_IMPL)
    return jax.vmap(jax.random.fold_in)(keys, batch.steps.astype(jnp.uint32))


def first_argmax(x: jax.Array) -> jax.Array:
    """[B, V] -> [B] i32: the index of each row's first maximum (`jnp.argmax`'s answer). Two plain
    reductions (max, then the smallest index holding it, as a float max over -index: exact below 2^24)
    instead of XLA's variadic argmax reduce, which XLA:CPU runs ~4x slower at a 163,840-token vocabulary."""
    m = jnp.max(x, axis=-1, keepdims=True)
    iota = lax.broadcasted_iota(jnp.float32, x.shape, x.ndim - 1)
    first = -jnp.max(jnp.where(x == m, -iota, -jnp.inf), axis=-1)
    return jnp.where(jnp.isfinite(first), first, 0.0).astype(jnp.int32)  # all-NaN rows: 0


def _sortable(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same order (-inf < ... < -0 < +0 < ... < inf)."""
    b = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(0x80000000))


def _unsortable(k: jax.Array) -> jax.Array:
    """Inverse of `_sortable`."""
    b = jnp.where((k >> 31) == 1, k & jnp.uint32(0x7FFFFFFF), ~k)
    return lax.bitcast_convert_type(b, jnp.float32)


def _kth_largest(keys: jax.Array, k: jax.Array) -> jax.Array:
    """keys [B, V] uint32, k [B] -> [B]: the largest key with at least k keys >= it (the k-th largest,
    ties counted), by bisection over the 32-bit key range: 32 counting passes, no sort."""
    def body(_, c):
        lo, hi = c
        mid = lo + (hi - lo + 1) // 2
        ok = jnp.sum(keys >= mid[:, None], axis=-1, dtype=jnp.int32) >= k
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)
    lo, _ = lax.fori_loop(0, 32, body, (jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)))
    return lo


def _nucleus_floor(keys: jax.Array, probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """keys [B, V], probs [B, V], top_p [B] -> [B]: the smallest key K with mass(keys > K) < top_p, i.e.
    the last token of the smallest most-likely run whose mass reaches top_p (ties kept), by bisection."""
    def body(_, c):
        lo, hi = c
        mid = lo + (hi - lo) // 2
        ok = jnp.sum(jnp.where(keys > mid[:, None], probs, 0.0), axis=-1) < top_p
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)
    _, hi = lax.fori_loop(0, 32, body, (jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)))
    return hi


def _topk_topp_threshold(x, top_k, top_p, use_k, use_p):
    """Per-row value threshold: tokens with ``x >= thr`` survive top-k then top-p. [B]

    Found by bisection over the values' bit patterns (a few dozen passes over the row) rather than a
    sort of the vocabulary: at 163,840 tokens XLA:CPU sorts 32 rows in ~1.1 s."""
    b, v = x.shape
    keys = _sortable(x)
    k = jnp.clip(top_k, 1, v)
    thr_k = lax.cond(jnp.any(use_k), lambda: jnp.where(use_k, _unsortable(_kth_largest(keys, k)), -jnp.inf),
                     lambda: jnp.full((b,), -jnp.inf, jnp.float32))

    def nucleus():
        probs = jax.nn.softmax(jnp.where(x >= thr_k[:, None], x, -jnp.inf), axis=-1)  # top-k renormalised
        return jnp.where(use_p, _unsortable(_nucleus_floor(keys, probs, top_p)), -jnp.inf)
    thr_p = lax.cond(jnp.any(use_p), nucleus, lambda: jnp.full((b,), -jnp.inf, jnp.float32))
    return jnp.maximum(thr_k, thr_p)


def _sample_random(logits, batch: SamplingBatch, is_greedy, greedy_tokens):
    b, v = logits.shape
    temperature = jnp.where(is_greedy, 1.0, batch.temperature.astype(jnp.float32))
    x = logits / temperature[:, None]

    min_p = batch.min_p.astype(jnp.float32)
    use_min_p = ~is_greedy & (min_p > 0)
    # min-p first, as vLLM: p >= min_p * p_max  <=>  x - x_max >= log(min_p); top-p's nucleus is then taken
    # over the survivors, renormalised
    log_min_p = jnp.log(jnp.where(use_min_p, min_p, 1.0))
    x_max = jnp.max(x, axis=-1, keepdims=True)
    x = jnp.where(use_min_p[:, None] & (x - x_max < log_min_p[:, None]), -jnp.inf, x)

    top_k = batch.top_k.astype(jnp.int32)
    top_p = batch.top_p.astype(jnp.float32)
    use_k = ~is_greedy & (top_k > 0) & (top_k < v)
    use_p = ~is_greedy & (top_p < 1.0)
    thr = lax.cond(
        jnp.any(use_k | use_p),
        partial(_topk_topp_threshold, top_k=top_k, top_p=top_p, use_k=use_k, use_p=use_p),
        lambda x: jnp.full((b,), -jnp.inf, jnp.float32),
        x,
    )
    masked = jnp.where(x >= thr[:, None], x, -jnp.inf)

    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(_row_keys(batch))
    sampled = first_argmax(masked + gumbel)
    return jnp.where(is_greedy, greedy_tokens, sampled), masked  # [B], [B, V] (-inf: filtered)


def _unbanned(logits: jax.Array, masked: jax.Array, batch: SamplingBatch) -> jax.Array:
    """[B, V]: what a row whose processed logits ban every token samples from instead: its constraint (a
    constrained row's masked logits, an other's raw ones) with its finite bias and `allowed_token_ids`, without
    the bans that emptied it (bad words, min_tokens' stop-token ban, -inf biases) or the processors. What may
    come (the constraint, the allowed list) wins over what may not: never the garbage token 0 of an all -inf
    row. vLLM lets a grammar's stop tokens through min_tokens' ban this way (its terminal-grammar fix)."""
    x = jnp.where(batch.constrained[:, None], masked, logits)
    if batch.bias_ids.shape[1]:
        values = jnp.where(batch.bias_values == -jnp.inf, 0.0, batch.bias_values)
        x = apply_bias(x, batch.bias_ids, values, batch.restrict)
    return x


def sample(logits: jax.Array, batch: SamplingBatch, num_top_logprobs: int = 0,
           history: Optional[Callable[[], tuple[jax.Array, jax.Array]]] = None,
           processors: Sequence[LogitsProcessor] = (), logprobs_mode: str = "raw_logprobs") -> SampleResult:
    """Sample one token per row. ``num_top_logprobs``, ``processors`` and ``logprobs_mode`` must be static
    under jit (``jax.jit(sample, static_argnames=("num_top_logprobs", "processors", "logprobs_mode"))``).

    The batch's logit bias applies first, then, when any row has a penalty, the penalties over the
    rows' tokens: ``history()`` -> (ids [B, S], positions [B, S]) (``serve/penalties.py``; only traced
    inside that branch), then the custom logits processors on their rows. A row they leave without a token
    (all -inf) samples from `_unbanned`'s logits instead. Greedy rows take the argmax of the processed logits;
    logprobs are those of the raw logits (a constrained row's after its mask) unless `logprobs_mode` says
    otherwise."""
    check_logprobs_mode(logprobs_mode)
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
    n = int(num_top_logprobs)
    if n < 0:
        raise ValueError(f"num_top_logprobs must be >= 0, got {n}")
    logits = logits.astype(jnp.float32)
    b, v = logits.shape
    if n > v:
        raise ValueError(f"num_top_logprobs {n} exceeds the vocabulary ({v})")

    penalized = (batch.presence != 0) | (batch.frequency != 0) | (batch.repetition != 1)
    if history is None:
        penalized = jnp.zeros_like(penalized)

    guided = jnp.any(batch.allowed != -1) if batch.allowed.shape[1] else jnp.bool_(False)

    def no_history():
        raise ValueError("a logits processor asked for the token history, which this sample() call was not given")

    context = ProcessorContext(batch.steps, batch.prompt_lens, history if history is not None else no_history)
    uses_proc = jnp.any(batch.proc_on) if processors else jnp.bool_(False)

    masked = logits
    if batch.allowed.shape[1]:  # first: a constrained row's raw logprobs are taken after its mask (vLLM's)
        masked = lax.cond(guided, apply_bitmask, lambda x, m: x, logits, batch.allowed)

    def process(x):  # only traced into the branch taken when some row has a bias, a penalty or a processor
        if batch.bias_ids.shape[1]:
            x = apply_bias(x, batch.bias_ids, batch.bias_values, batch.restrict)
        if history is not None:
            def penalize(x):
                ids, pos = history()
                length = (batch.steps + batch.prompt_lens)[:, None]  # tokens before the one being sampled
                return apply_penalties(x, ids, pos < length, pos >= batch.prompt_lens[:, None], batch.presence,
                                       batch.frequency, batch.repetition)
            x = lax.cond(jnp.any(penalized), penalize, lambda x: x, x)
        if processors:
            x = logits_processors.apply(processors, x, batch.proc_args, batch.proc_on, context)
        return x

    x = lax.cond(jnp.any(penalized) | jnp.any(batch.bias_ids >= 0) | jnp.any(batch.restrict) | uses_proc,
                 process, lambda x: x, masked)
    # a row can only be left without a token by a mask, a -inf bias, allowed_token_ids or a processor: only
    # then look for one (a pass over [B, V]), which samples from `_unbanned` instead of the garbage token 0
    can_empty = batch.restrict | jnp.any(batch.bias_values == -jnp.inf, axis=-1)
    if batch.allowed.shape[1]:
        can_empty |= jnp.any(batch.allowed != -1, axis=-1)
    if processors:
        can_empty |= jnp.any(batch.proc_on, axis=-1)

    def rescue(x):
        empty = jnp.max(x, axis=-1) == -jnp.inf  # [B] every token -inf
        return jnp.where(empty[:, None], _unbanned(logits, masked, batch), x)
    x = lax.cond(jnp.any(can_empty), rescue, lambda x: x, x)
    greedy_tokens = first_argmax(x)
    is_greedy = batch.temperature < GREEDY_EPS
    processed = logprobs_mode.startswith("processed")
    if processed:  # the values each row's token was drawn from: a greedy row's processed logits, a sampled row's
        # after temperature and the filters (only materialised in these modes)
        tokens, values = lax.cond(
            jnp.all(is_greedy),
            lambda: (greedy_tokens, x),
            lambda: _sample_random(x, batch, is_greedy, greedy_tokens),
        )
        values = jnp.where(is_greedy[:, None], x, values)
    else:
        tokens = lax.cond(
            jnp.all(is_greedy),
            lambda: greedy_tokens,
            lambda: _sample_random(x, batch, is_greedy, greedy_tokens)[0],
        )
        values = lax.cond(guided & jnp.any(batch.constrained),
                          lambda: jnp.where(batch.constrained[:, None], masked, logits), lambda: logits)

    # log_softmax(x)[t] = x[t] - logsumexp(x): no [B, V] log-softmax is written (the top-n are the top-n logits)
    lse = (jax.nn.logsumexp(values, axis=-1) if logprobs_mode.endswith("_logprobs")
           else jnp.zeros((b,), jnp.float32))  # [B]
    chosen = jnp.take_along_axis(values, tokens[:, None], axis=-1)[:, 0]  # [B]
    logprob = chosen - lse
    rank = _rank(values, chosen[:, None])
    if n > 0:  # (a top-n over the vocabulary costs as much as the rest of sampling: only when some row asks)
        def top(values):
            top_values, top_ids = lax.top_k(values, n)
            return top_values - lse[:, None], top_ids.astype(jnp.int32)
        top_logprobs, top_ids = lax.cond(jnp.any(batch.num_top > 0), top,
                                         lambda v: (jnp.zeros((b, n), jnp.float32), jnp.zeros((b, n), jnp.int32)),
                                         values)
    else:
        top_logprobs = jnp.zeros((b, 0), jnp.float32)
        top_ids = jnp.zeros((b, 0), jnp.int32)
    return SampleResult(tokens, logprob, top_ids, top_logprobs, rank)
