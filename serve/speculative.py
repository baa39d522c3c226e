"""Speculative decoding with n-gram (prompt lookup) drafts, verified in one step over the arena.

K3 ships no draft weights (spec: no MTP / EAGLE layers in the open release), so drafts come from the
sequence itself, as vLLM's `ngram` method does: the longest suffix of the sequence (between
`prompt_lookup_max` and `prompt_lookup_min` tokens) that occurred earlier proposes the tokens that
followed that earlier occurrence. Copying, quoting, code edits and looping outputs accept many.

Verification (serve/step.py) runs a decode row as `1 + d` tokens (the last sampled token, then its
d drafts) and samples a token at every position exactly as plain decoding would sample it there:
same processed logits, same per-request key `fold_in(seed, output index)`. A draft is accepted while
it equals the token sampled before it; the first sample that differs is emitted in its place, and
when all d are accepted the sample after the last is a bonus token. For a draft that is one fixed
token (an n-gram proposal) this is exact rejection sampling: the draft is kept with probability
p(draft), and a rejected position emits a sample of p conditioned on not being the draft, which is
the residual distribution. Because every position uses the key plain decoding would use for that
output index, the emitted tokens are the ones plain decoding produces (greedy and seeded alike),
only several per step.

KDA states are mutable, so the verify pass must not commit tokens that get rejected. It keeps each
layer's recurrence inputs (k, v, gate, beta and the conv inputs, ReplaySSM-style) and, once the
accepted length is known on device, folds only the accepted prefix into the state with the same
token recurrence and masked-out gates for the rest (a gate of 0 and beta of 0 leave a state exactly
unchanged), so the committed state is the one plain decoding would have reached. MLA latents are
append-only: the rejected positions' latents sit past the sequence length and are overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` for the ngram method (its field names)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3  # drafts per step and row (verify rows carry 1 + this many tokens)
    prompt_lookup_max: int = 4  # longest suffix matched
    prompt_lookup_min: int = 1  # shortest suffix matched
    # no drafts while this many requests or more decode (vLLM v0's speculative_disable_by_batch_size):
    # a verify row costs 1 + drafts tokens of compute, which pays where a step is bound by weight reads
    # (small batches) and not where it is bound by FLOPs (large ones). None: always draft.
    disable_by_batch_size: int | None = None
    # draft only when the expected accepted tokens pay for the verify program's extra cost, measured per
    # decode bucket at warm-up (`DraftGate`); False: draft whenever a proposal exists
    adaptive: bool = True

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {sorted(unknown)}; expected "
                             f"{sorted(cls.__dataclass_fields__)}")
        return cls(**d)

    def validate(self, prefill_chunk: int) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative_config.method={self.method!r}: only 'ngram' is available (K3 ships "
                             f"no draft or MTP weights)")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config.num_speculative_tokens={k!r}: expected an integer in [1, 16]")
        if not (isinstance(self.prompt_lookup_min, int) and isinstance(self.prompt_lookup_max, int)
                and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max):
            raise ValueError(f"speculative_config.prompt_lookup_min / prompt_lookup_max: expected integers with "
                             f"1 <= min <= max, got {self.prompt_lookup_min!r}, {self.prompt_lookup_max!r}")
        d = self.disable_by_batch_size
        if d is not None and (not isinstance(d, int) or d < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size={d!r}: expected a positive integer or None")
        if k + 1 == prefill_chunk:
            raise ValueError(f"speculative_config.num_speculative_tokens={k}: verify rows of {k + 1} tokens would "
                             f"share the prefill programs' shape (prefill_chunk={prefill_chunk}); pick another")

    @property
    def verify_tokens(self) -> int:
        return 1 + self.num_speculative_tokens


class NgramIndex:
    """Where each n-gram of one sequence last occurred, kept up to date as tokens arrive.

    `index[n][gram]` is the position just after the latest occurrence of `gram` (n tokens, as int32
    bytes) whose next token is already known, so a lookup of the sequence's own suffix finds an earlier
    occurrence. A long prompt is indexed with numpy in one pass (100k tokens in ~75 ms); each new
    token then costs one dict store per n, a lookup one dict probe per n."""

    VECTOR_MIN = 64  # new tokens from which the numpy path beats the per-token loop

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.index: dict[int, dict[bytes, int]] = {n: {} for n in range(lo, hi + 1)}
        self.seen = 0  # tokens of the sequence indexed so far

    def update(self, ids: list[int]) -> None:
        """Index the n-grams of `ids` (the whole sequence so far) that end before its last token."""
        first, last = max(self.seen, 1), len(ids)  # new grams end at first..last-1, followed by ids[end]
        if first >= last:
            return
        base = max(first - self.hi, 0)
        arr = np.asarray(ids[base:last], np.int32)  # only the tail the new grams touch
        for n, table in self.index.items():
            lo = max(first, n)
            if lo >= last:
                continue
            if last - lo >= self.VECTOR_MIN:
                grams = np.lib.stride_tricks.sliding_window_view(arr[lo - n - base:last - 1 - base], n)
                keys = np.ascontiguousarray(grams).view(np.dtype((np.void, 4 * n))).ravel().tolist()
                table.update(zip(keys, range(lo, last)))  # later occurrences overwrite earlier ones
            else:
                for end in range(lo, last):
                    table[arr[end - n - base:end - base].tobytes()] = end
        self.seen = last

    def propose(self, ids: list[int], k: int) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the longest matching suffix (none if
        no suffix of at least `lo` tokens occurred before). A match close to the end continues
        periodically: the tokens after it are the proposal's own first tokens again."""
        if k <= 0:
            return []
        self.update(ids)
        tail = np.asarray(ids[-self.hi:], np.int32)
        for n in range(min(self.hi, len(ids) - 1), self.lo - 1, -1):
            start = self.index[n].get(tail[len(tail) - n:].tobytes())
            if start is not None:  # copy on from there; past the end, the proposal continues itself
                out: list[int] = []
                for p in range(start, start + k):
                    out.append(ids[p] if p < len(ids) else out[p - len(ids)])
                return out
        return []


class DraftGate:
    """Whether a decode step should carry drafts: only when they are expected to pay.

    A verify step of a decode bucket costs `cost[bucket]` plain decode steps (measured at warm-up: on a
    CPU host, where a step's dots are compute-bound at a few rows, 2-3x for 4 tokens a row; near 1x where
    the weight reads dominate). A step of n decoding rows with drafts yields n + (expected accepted)
    tokens, so drafts pay when (n + sum over rows and positions j < d of p[j]) / n >= cost, where p[j] is
    a running estimate of P(the draft is accepted through position j) over recent drafts (starting
    optimistic, so a new engine tries). Each request also keeps its own estimates (`prior()` when it
    starts drafting, then updated by its own rows at a faster rate), so a batch that mixes text that
    repeats itself (code edits, quoting) with text that does not counts each row's real prospects. While
    drafts do not pay, a probe step still drafts now and then (after 16 skipped steps, doubling up to 256
    while probes keep failing), so the estimates follow the traffic."""

    def __init__(self, k: int, cost: dict[int, float], rate: float = 0.05, probe_min: int = 16,
                 probe_max: int = 256, row_rate: float = 0.3):
        self.p = [1.0] * k
        self.cost, self.rate, self.probe_min, self.probe_max = dict(cost), rate, probe_min, probe_max
        self.row_rate = row_rate
        self.interval, self.skipped, self.skipped_steps = probe_min, 0, 0

    def prior(self) -> list[float]:
        """A new request's estimates: the engine-wide ones."""
        return list(self.p)

    def allow(self, bucket: int, rows: int, drafts: list[int], estimates: Optional[list[list[float]]] = None) -> bool:
        """rows: requests decoding this step; drafts: draft lengths of those that have proposals;
        estimates: those requests' own acceptance estimates (default: the engine-wide ones)."""
        est = estimates if estimates is not None else [self.p] * len(drafts)
        gain = sum(e[j] for d, e in zip(drafts, est) for j in range(d))
        if rows and (rows + gain) / rows >= self.cost.get(bucket, 1.0):
            self.interval, self.skipped = self.probe_min, 0
            return True
        self.skipped += 1
        if self.skipped >= self.interval:  # probe: refresh the estimates
            self.skipped, self.interval = 0, min(2 * self.interval, self.probe_max)
            return True
        self.skipped_steps += 1
        return False

    def observe(self, drafted: int, accepted: int, row: Optional[list[float]] = None) -> None:
        """One verified row: `accepted` of its `drafted` drafts (`row`: its request's estimates, updated
        in place)."""
        for j in range(drafted):
            hit = 1.0 if j < accepted else 0.0
            self.p[j] += self.rate * (hit - self.p[j])
            if row is not None:
                row[j] += self.row_rate * (hit - row[j])


def accepted_lengths(tokens: jax.Array, sampled: jax.Array, valid: jax.Array) -> jax.Array:
    """Drafts accepted per verify row: tokens [B, T] (input token, then drafts), sampled [B, T] (the
    token sampled at each position), valid [B] (1 + drafts) -> [B] int32 in [0, valid - 1]: the
    longest run of drafts each equal to the sample at the position before it."""
    t = tokens.shape[1]
    match = (sampled[:, :-1] == tokens[:, 1:]) & (jnp.arange(1, t)[None, :] < valid[:, None])  # [B, T-1]
    return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
