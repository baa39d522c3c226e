"""Speculative decoding with model-free drafts (n-gram prompt lookup, suffix decoding), verified in one step
over the arena.

K3 ships no draft weights (spec: no MTP / EAGLE layers in the open release), so drafts come from the
sequence itself, as vLLM's `ngram` method does: the longest suffix of the sequence (between
`prompt_lookup_max` and `prompt_lookup_min` tokens) that occurred earlier proposes the tokens that
followed that earlier occurrence. Copying, quoting, code edits and looping outputs accept many. vLLM's
`suffix` method (`SuffixProposer`) also matches against the responses of finished requests, so a request
on a prompt answered before drafts that answer.

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

from collections import deque
from dataclasses import dataclass

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np


NGRAM_NAMES = ("ngram", "[ngram]")  # vLLM's names of prompt lookup (as `method`, or as `model` in its older form)
# the widest verify row: 1 + this many tokens (vLLM's suffix default, suffix_decoding_max_tree_depth = 24, fits)
MAX_DRAFTS = 32


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` for its model-free methods (its field names): `ngram` (prompt lookup) and
    `suffix` (Suffix Decoding: the request's own tokens and the responses of finished requests, `SuffixProposer`)."""

    method: str = "ngram"  # also vLLM's alias "[ngram]"
    # the most drafts per step and row: verify rows carry 1 + this many tokens, whatever a draft's length (a
    # shorter one pads its row). 3 for `suffix` too, where vLLM defaults to suffix_decoding_max_tree_depth (24):
    # its rows are ragged, ours a fixed-width program (tiny-k3 on 2 CPU cores, 8 rows: a verify step cost 1.9
    # decode steps at 3, 7.1 at 24, which the draft gate then takes only for near-whole repeated answers)
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4  # longest suffix matched
    prompt_lookup_min: int = 1  # shortest suffix matched
    # no drafts while this many requests or more decode (vLLM v0's speculative_disable_by_batch_size):
    # a verify row costs 1 + drafts tokens of compute, which pays where a step is bound by weight reads
    # (small batches) and not where it is bound by FLOPs (large ones). None: always draft.
    disable_by_batch_size: int | None = None
    # draft only when the expected accepted tokens pay for the verify program's extra cost, measured per
    # decode bucket at warm-up (`DraftGate`); False: draft whenever a proposal exists
    adaptive: bool = True
    # `suffix`: the longest match considered (tokens), finished requests whose responses are kept to draft from
    # (0: the request's own tokens only), drafts of at most this factor times the match length, and a draft
    # continued only while the estimated probability that all of it is accepted stays at or above this
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        d = dict(d)
        if d.get("model") in NGRAM_NAMES and d.get("method") in (None, *NGRAM_NAMES):  # vLLM's older form
            d.pop("model")
            d["method"] = "ngram"
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {sorted(unknown)}; expected "
                             f"{sorted(cls.__dataclass_fields__)}")
        # vLLM's reading: a bound or a draft count given as null is not given (vLLM's defaults are null); a lone
        # bound is both (no default above a lone min, none below a lone max)
        d = {k: v for k, v in d.items()
             if v is not None or k not in ("prompt_lookup_min", "prompt_lookup_max", "num_speculative_tokens")}
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if hi is None and lo is not None:
            d["prompt_lookup_max"] = lo
        elif lo is None and hi is not None:
            d["prompt_lookup_min"] = hi
        return cls(**d)

    def __post_init__(self):
        if self.method in NGRAM_NAMES:  # vLLM's alias
            object.__setattr__(self, "method", "ngram")

    def validate(self, prefill_chunk: int) -> None:
        if self.method not in ("ngram", "suffix"):
            raise ValueError(f"speculative_config.method={self.method!r}: 'ngram' or 'suffix' (model-free; K3 ships "
                             f"no draft or MTP weights)")
        if self.method == "suffix":
            for key, ok in (("suffix_decoding_max_tree_depth", lambda x: isinstance(x, int) and x >= 2),
                            ("suffix_decoding_max_cached_requests", lambda x: isinstance(x, int) and x >= 0),
                            ("suffix_decoding_max_spec_factor", lambda x: isinstance(x, (int, float)) and x > 0),
                            ("suffix_decoding_min_token_prob", lambda x: isinstance(x, (int, float)) and 0 <= x <= 1)):
                x = getattr(self, key)
                if isinstance(x, bool) or not ok(x):
                    raise ValueError(f"speculative_config.{key}={x!r}: out of range (depth >= 2, cached requests >= 0, "
                                     f"spec factor > 0, min token prob in [0, 1])")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_DRAFTS:
            raise ValueError(f"speculative_config.num_speculative_tokens={k!r}: expected an integer in [1, {MAX_DRAFTS}] "
                             f"(the most drafts a step verifies per row; each verify row computes 1 + this many "
                             f"tokens whatever its draft's length)")
        if not (_is_int(self.prompt_lookup_min) and _is_int(self.prompt_lookup_max)
                and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max):
            raise ValueError(f"speculative_config.prompt_lookup_min / prompt_lookup_max: expected integers with "
                             f"1 <= min <= max, got {self.prompt_lookup_min!r}, {self.prompt_lookup_max!r}")
        d = self.disable_by_batch_size
        if d is not None and (not _is_int(d) or d < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size={d!r}: expected a positive integer or None")
        if not isinstance(self.adaptive, bool):  # (a string "false" would be truthy: drafts gated after all)
            raise ValueError(f"speculative_config.adaptive={self.adaptive!r}: expected true or false")
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


class SuffixIndex:
    """Tokens and where each `KEY`-token pattern occurred in them (the positions just after it, whose next token is
    known), for longest-suffix matching: a request's own prompt and output, or the corpus of finished responses.
    Appending a token costs one dict store; a match looks at the most recent `SCAN` occurrences of the context's
    last `KEY` tokens and extends each backwards."""

    KEY = 2  # shortest match (tokens)
    SCAN = 64  # occurrences of a pattern examined per match (the most recent)

    def __init__(self):
        self.tokens: list[int] = []
        self.index: dict[tuple, list[int]] = {}
        self.indexed = 0  # positions p < this have their pattern ending at p indexed (when tokens[p] is known)

    def extend(self, ids) -> None:
        self.tokens.extend(int(t) for t in ids)
        toks, k = self.tokens, self.KEY
        for p in range(max(self.indexed, k), len(toks)):  # the pattern before p, followed by tokens[p]
            if min(toks[p - k:p]) >= 0:  # (no pattern across a separator)
                self.index.setdefault(tuple(toks[p - k:p]), []).append(p)
        self.indexed = max(self.indexed, len(toks))

    def match(self, ctx: list[int], depth: int, start: int = 0) -> tuple[int, list[int]]:
        """The longest suffix of `ctx` (up to `depth` tokens, at least KEY) that occurs in the tokens at or after
        `start` -> (its length, the positions just after its occurrences, most recent first); (0, []) if none."""
        if len(ctx) < self.KEY:
            return 0, []
        found = self.index.get(tuple(ctx[-self.KEY:]))
        if not found:
            return 0, []
        toks, best, where = self.tokens, 0, []
        for p in reversed(found[-self.SCAN:]):
            if p < start:
                break
            n = self.KEY
            limit = min(depth, len(ctx), p)
            while n < limit and toks[p - n - 1] == ctx[-n - 1] and toks[p - n - 1] >= 0:
                n += 1
            if n > best:
                best, where = n, [p]
            elif n == best:
                where.append(p)
        return best, where


def continue_matches(tokens: list[int], where: list[int], k: int, min_prob: float, own: bool = False) -> list[int]:
    """Up to k tokens continuing the match occurrences `where`: at each position the token most of the remaining
    occurrences continue with (ties: the most recent occurrence's); those that continue otherwise drop out, and the
    draft stops once the product of the chosen tokens' shares falls below `min_prob` (an estimate of the chance
    the whole draft is accepted) or no occurrence continues. `own`: the tokens are the request's own, so an
    occurrence that runs into the present continues with the draft itself (a repeating pattern)."""
    out: list[int] = []
    prob = 1.0
    alive = list(where)
    end = len(tokens)
    for j in range(k):
        counts: dict[int, int] = {}
        nxt = []
        for p in alive:
            q = p + j
            t = tokens[q] if q < end else (out[q - end] if own and q - end < len(out) else -1)
            if t >= 0:
                counts[t] = counts.get(t, 0) + 1
                nxt.append((p, t))
        if not counts:
            break
        best = max(counts, key=lambda t: counts[t])  # (dicts keep insertion order: the most recent wins ties)
        prob *= counts[best] / len(alive)
        if prob < min_prob:
            break
        out.append(best)
        alive = [p for p, t in nxt if t == best]
    return out


class ResponseCorpus:
    """The cached responses of one tenant (each after its prompt's tail, ended by a separator), oldest first, in one
    `SuffixIndex`. Evicted responses' tokens stay until as many are dead as live, then the index is rebuilt without
    them (matches skip them meanwhile), so memory stays within twice the live tokens."""

    def __init__(self):
        self.index = SuffixIndex()
        self.starts: list[int] = []  # where each cached response starts in the index's tokens, oldest first

    def add(self, tokens: list[int]) -> None:
        self.starts.append(len(self.index.tokens))
        self.index.extend(list(tokens) + [-1])

    def evict_oldest(self) -> None:
        self.starts.pop(0)
        live = self.starts[0] if self.starts else len(self.index.tokens)
        if live >= len(self.index.tokens) - live:  # as many dead tokens as live ones: rebuild without them
            keep = self.index.tokens[live:]
            self.index = SuffixIndex()
            self.index.extend(keep)
            self.starts = [s - live for s in self.starts]

    def match(self, ctx: list[int], depth: int) -> tuple[int, list[int]]:
        return self.index.match(ctx, depth, self.starts[0] if self.starts else len(self.index.tokens))


class SuffixProposer:
    """vLLM's `suffix` speculation (Suffix Decoding, arXiv 2411.04975), model-free: drafts continue the longest
    suffix of a request's tokens that occurred before, in its own prompt and output or in the responses of the last
    `suffix_decoding_max_cached_requests` finished requests (each kept with the last `depth` tokens of its prompt, so
    a new request on the same prompt drafts a previous answer from its first token: RL rollouts, agent loops,
    self-consistency). The longer match wins; among a match's occurrences the draft follows the majority
    continuation; its length adapts: at most `max_spec_factor` x the match length, and only while the estimated
    acceptance probability stays >= `min_token_prob`. Exactness is the verify step's (serve/step.py): drafts only
    change how many tokens a step emits.

    Responses are kept per `tenant` (the engine passes the request's cache_salt and LoRA adapter, the prefix
    cache's partition) and drafted only for requests of the same tenant: how many tokens a step emits (streamed
    chunk sizes, latency) would otherwise tell one tenant what another's responses continued with. The capacity
    is engine-wide: the oldest response, whatever its tenant, is evicted first."""

    def __init__(self, cfg: SpeculativeConfig):
        self.depth, self.capacity = cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_cached_requests
        self.factor, self.min_prob = cfg.suffix_decoding_max_spec_factor, cfg.suffix_decoding_min_token_prob
        self.corpora: dict[bytes, ResponseCorpus] = {}  # tenant -> its cached responses
        self.order: deque[bytes] = deque()  # the tenant of each cached response, oldest first

    def propose(self, own: SuffixIndex, ids: list[int], k: int, tenant: bytes = b"") -> list[int]:
        """Up to k drafts for a request of `tenant` whose tokens so far are `ids` (`own` indexes them, kept by the
        caller)."""
        if k <= 0:
            return []
        own.extend(ids[len(own.tokens):])
        ctx = ids[-self.depth:]
        n_own, at_own = own.match(ctx, self.depth)
        corpus = self.corpora.get(tenant)
        n_glob, at_glob = corpus.match(ctx, self.depth) if corpus is not None else (0, [])
        if max(n_own, n_glob) < SuffixIndex.KEY:
            return []
        if n_own >= n_glob:
            n, tokens, where, mine = n_own, own.tokens, at_own, True
        else:
            n, tokens, where, mine = n_glob, corpus.index.tokens, at_glob, False
        return continue_matches(tokens, where, min(k, max(1, int(self.factor * n))), self.min_prob, own=mine)

    def add_response(self, prompt: list[int], output: list[int], tenant: bytes = b"") -> None:
        """Keep a finished request's response (after the tail of its prompt) for `tenant`'s requests to draft from."""
        if not self.capacity or not output:
            return
        self.corpora.setdefault(tenant, ResponseCorpus()).add(list(prompt[-self.depth:]) + list(output))
        self.order.append(tenant)
        if len(self.order) > self.capacity:
            old = self.order.popleft()
            self.corpora[old].evict_oldest()
            if not self.corpora[old].starts:
                del self.corpora[old]


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
