"""Beam search: vLLM's `BeamSearchParams` semantics, run inside the engine with forked cache state.

vLLM v1 runs beam search outside its engine: every step it submits each beam as a fresh one-token
request and counts on the prefix cache to find the beam's history again. On a hybrid model that
history is a recurrent KDA state as well as pages, and a prefix cache can only resume a recurrent
state at the checkpoints it stored, so each beam would recompute up to a checkpoint interval of
tokens per generated token. Here a beam is an engine `Sequence` that forks: a child shares its
parent's full MLA pages (reference counts), copies the partial last page (copy-on-write, as a
prefix-cache hit does) and reads the parent's KDA state slot in its next step while writing its
own (the step's read/write slot split, as a checkpoint resume does). Nothing is recomputed.

This module holds the pure parts: the parameters, the hypotheses and one round of selection.
The engine (serve/engine.py) does the memory: `_select_beams` and `_fork_beam`.

Selection is vLLM's: every beam proposes its top 2 x beam_width next tokens by raw logprob; a
proposal ending in an EOS token (unless `ignore_eos`) joins the completed hypotheses, the others
compete, ranked by `score`, for the `beam_width` places; after `max_tokens` rounds (or when no beam
is left) the completed hypotheses and the surviving beams are ranked together and the best
`beam_width` returned. `score` is vLLM's: cumulative logprob / (tokens incl. the prompt, minus a
final EOS) ** length_penalty. Without EOS within max_tokens this equals HF transformers'
`generate(num_beams=...)` (every hypothesis then has the same length), which the tests check.
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Optional

from serve.types import RequestError, SamplingParams, TokenLogprobs


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters. `temperature` is accepted for compatibility only: beams are
    ranked by the raw logprobs (vLLM v1's default logprobs mode), which temperature does not change."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    @property
    def proposals(self) -> int:
        """Next tokens each beam proposes per round."""
        return 2 * self.beam_width

    def validate(self, max_logprobs: int) -> None:
        def bad(name, why):
            raise RequestError(f"{name}: {why}")

        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool) or self.beam_width < 1:
            bad("beam_width", f"must be an integer >= 1, got {self.beam_width!r}")
        if self.proposals > max_logprobs:
            bad("beam_width", f"{self.beam_width} needs the top {self.proposals} logprobs of every beam, but the "
                              f"engine returns at most max_logprobs={max_logprobs} (start it with max_logprobs >= "
                              f"{self.proposals})")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < float("inf"):
            bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.length_penalty, (int, float)) or not abs(self.length_penalty) < float("inf"):
            bad("length_penalty", f"must be a finite number, got {self.length_penalty!r}")

    def step_params(self) -> SamplingParams:
        """What each beam's sequence runs with: its sampled token is never used, only the top
        `proposals` raw logprobs; EOS is handled by the selection, not the stop checker."""
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True,
                              logprobs=self.proposals, skip_special_tokens=not self.include_stop_str_in_output)


@dataclass(frozen=True)
class Hypothesis:
    """A beam's generated tokens, their logprobs and their sum; `eos`: it ended with an EOS token;
    `proposals`: per token, what its beam proposed at that step, (token id, logprob) best first (the
    token's logprob alternatives, as vLLM's beam search returns them)."""

    tokens: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    cum_logprob: float = 0.0
    eos: bool = False
    proposals: tuple[tuple[tuple[int, float], ...], ...] = ()

    def extend(self, token: int, logprob: float, eos: bool,
               proposals: tuple[tuple[int, float], ...] = ()) -> "Hypothesis":
        return Hypothesis(self.tokens + (token,), self.logprobs + (logprob,), self.cum_logprob + logprob, eos,
                          self.proposals + (proposals,))


def score(h: Hypothesis, prompt_len: int, length_penalty: float) -> float:
    """vLLM's beam score: the cumulative logprob over the length (prompt included, a final EOS not)
    raised to `length_penalty`."""
    n = prompt_len + len(h.tokens) - int(h.eos)
    try:
        return h.cum_logprob / (max(n, 1) ** length_penalty)
    except OverflowError:  # n ** length_penalty beyond a float: the quotient's limit is 0
        return math.copysign(0.0, h.cum_logprob)
    except ZeroDivisionError:  # n ** length_penalty underflowed to 0 (a large negative penalty)
        return -math.inf if h.cum_logprob < 0 else 0.0


def expand(beams: list[tuple[Hypothesis, list[int], list[float]]], width: int, eos_ids: frozenset[int],
           prompt_len: int, length_penalty: float) -> tuple[list[tuple[int, Hypothesis]], list[Hypothesis]]:
    """One round: `beams` as (hypothesis, proposed token ids, their logprobs) -> the `width` best
    continuations as (index of the parent in `beams`, hypothesis), best first, and the proposals that
    ended in EOS (completed). Ties keep the order of the beams and of each beam's proposals."""
    live, done = [], []
    for i, (h, ids, lps) in enumerate(beams):
        proposed = tuple((int(t), float(x)) for t, x in zip(ids, lps))
        for tok, lp in proposed:
            child = h.extend(tok, lp, tok in eos_ids, proposed)
            (done.append(child) if child.eos else live.append((i, child)))
    live.sort(key=lambda c: -score(c[1], prompt_len, length_penalty))
    return live[:width], done


def best(hyps: list[Hypothesis], width: int, prompt_len: int, length_penalty: float) -> list[Hypothesis]:
    """The final ranking of completed and surviving hypotheses."""
    return sorted(hyps, key=lambda h: -score(h, prompt_len, length_penalty))[:width]


@dataclass
class BeamSearchSequence:
    """One returned hypothesis (vLLM's): `tokens` include the prompt; `logprobs` are the generated tokens', as
    vLLM's: per token a dict token id -> Logprob, the token's own first, then what its beam proposed at that step
    by rank (TokenLogprobs: `.chosen.logprob` is the token's logprob; they sum to `cum_logprob`)."""

    tokens: list[int]
    logprobs: list[TokenLogprobs]
    cum_logprob: float
    text: str
    finish_reason: str  # "stop": it ended with EOS; "length": max_tokens
    stop_reason: Optional[int] = None


@dataclass
class BeamSearchOutput:
    """A prompt's best hypotheses, best first (`LLM.beam_search`)."""

    sequences: list[BeamSearchSequence]


@dataclass
class BeamGroup:
    """A beam-search request's state between rounds (the live beams are its engine sequences)."""

    params: BeamSearchParams
    prompt_len: int
    eos_ids: frozenset[int]
    completed: list[Hypothesis]
    rounds: int = 0  # selections made (= tokens in every live beam)
    final: Optional[list[Hypothesis]] = None  # set when the search ends
    cached_tokens: int = 0  # prompt tokens its first admission took from the prefix cache
    aborted: bool = False  # it was aborted: `final` holds the hypotheses it had (finish_reason "abort")

    @property
    def done(self) -> bool:
        return self.final is not None


def aborted_hypotheses(g: BeamGroup, live: list[Hypothesis]) -> list[Hypothesis]:
    """What an aborted search reports: its best hypotheses so far (completed and live, ranked as at the
    end), padded with empty ones to `beam_width`, so each of its outputs ends (finish_reason "abort") as
    an aborted request's `n` samples do."""
    p = g.params
    hyps = best(g.completed + live, p.beam_width, g.prompt_len, p.length_penalty)
    return hyps + [Hypothesis()] * (p.beam_width - len(hyps))
