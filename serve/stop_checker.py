"""Host-side, per-sequence incremental detokenization and stop handling.

One :class:`StopChecker` per generated sequence. Feed it every sampled token with
:meth:`StopChecker.append`; it returns the text that is now safe to emit (``text_delta``) and
whether the sequence finished. The same deltas serve streaming and final outputs: their
concatenation is always :attr:`StopChecker.text`.

Rules (vLLM's, with the differences noted):

* A token in ``stop_token_ids``, or in ``eos_token_ids`` unless ``ignore_eos``, finishes with
  ``finish_reason="stop"`` and ``stop_reason=<that id>`` (vLLM reports ``None`` for the model's
  primary EOS; here every stop id is reported). The id stays in :attr:`token_ids` but is not
  rendered into the text, except with ``include_stop_str_in_output`` (as vLLM does), where it is
  rendered like any other token (a special one is still dropped by ``skip_special_tokens``).
* A stop string finishes with ``"stop"`` and ``stop_reason=<the string>``. The text ends just
  before it, or just after it with ``include_stop_str_in_output``; whatever the same token decoded
  past that point is discarded. Matching runs on decoded text, so a stop string may span tokens
  and split multi-byte characters. When several stop strings complete in the same step, the one
  that completes first in the character stream wins (then the one starting first), which is what
  feeding the text one character at a time would give, whatever the tokenization.
* A suffix of the text that could still grow into a stop string is held back (not in any delta,
  not in :attr:`text`) until it either becomes one or can no longer, and is flushed when the
  sequence finishes for another reason.
* Reaching ``max_tokens`` generated tokens finishes with ``"length"`` (``stop_reason=None``),
  unless that last token also ended it by a stop token or a stop string.
* A finish flushes the detokenizer: a dangling partial UTF-8 character becomes U+FFFD, exactly as
  ``Tokenizer.decode`` renders it. An abort (:meth:`StopChecker.abort`) flushes the same way, held-back
  text included (vLLM's final abort output carries all the text decoded so far).

With ``tokenizer=None`` no text is produced (``text`` stays ``""``, stop strings are ignored) and
only the token-id rules and ``max_tokens`` apply.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Optional

from k3jax.tokenizer import IncrementalDetokenizer, Tokenizer
from serve.types import SamplingParams

__all__ = ["StepResult", "StopChecker"]


@dataclass(frozen=True)
class StepResult:
    text_delta: str
    finished: bool
    finish_reason: Optional[str] = None  # "stop" | "length" | None while running
    stop_reason: Optional[int | str] = None  # the stop token id or stop string


class StopChecker:
    """Incremental detokenizer + stop conditions of one sequence.

    ``max_tokens`` is the number of tokens this sequence may generate (the engine passes
    ``params.max_tokens`` capped by the room left in the context); ``None`` means no limit.
    """

    def __init__(
        self,
        params: SamplingParams,
        tokenizer: Tokenizer | None,
        eos_token_ids: Iterable[int],
        max_tokens: Optional[int],
    ):
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (or None), got {max_tokens}")
        self.params = params
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.include_stop = bool(params.include_stop_str_in_output)
        stop_ids = set(int(t) for t in params.stop_token_ids)
        # vLLM's `all_stop_token_ids`: min_tokens bans EOS too, even with ignore_eos
        self._ban_ids = frozenset(stop_ids | set(int(t) for t in eos_token_ids))
        if not params.ignore_eos:
            stop_ids.update(int(t) for t in eos_token_ids)
        self._stop_ids = frozenset(stop_ids)
        self._stops: tuple[str, ...] = tuple(s for s in params.stop if s) if tokenizer is not None else ()
        # the stop strings indexed so a token's checks cost the distinct lengths, not the number of strings (the
        # Python API takes any number, as vLLM's): by length, longest first; sorted, for the prefix search
        self._by_length = by_length(self._stops)
        self._sorted = tuple(sorted(set(self._stops)))
        self._firsts = frozenset(s[0] for s in self._stops)
        self._longest = self._by_length[0][0] if self._by_length else 0
        self._detok = (
            IncrementalDetokenizer(tokenizer, skip_special=params.skip_special_tokens)
            if tokenizer is not None
            else None
        )

        self.token_ids: list[int] = []
        self.finished = False
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[int | str] = None
        self._emitted: list[str] = []  # chunks of text already handed out
        self._text_cache: Optional[str] = ""
        self._pending = ""  # decoded but not emitted: held back as a possible stop-string start

    # -- public --------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every ``text_delta``)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._emitted)
        return self._text_cache

    @property
    def chunks(self) -> int:
        """Text deltas emitted so far (append-only: `text_from(k)` is what came after the first k)."""
        return len(self._emitted)

    def text_from(self, chunk: int) -> str:
        """The text emitted after the first `chunk` deltas: O(new text), where `text` is O(all of it)."""
        return "".join(self._emitted[chunk:])

    @property
    def held_text(self) -> str:
        """Decoded text held back because it may be the start of a stop string."""
        return self._pending

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append(self, token_id: int, last: bool = False) -> StepResult:
        """Account for one generated token; return the newly emittable text and the finish state.

        `last`: nothing may follow this token (a structured-output constraint is complete): the
        sequence finishes with "stop" (stop_reason None) unless a stop condition applies first."""
        if self.finished:
            raise RuntimeError("append() after the sequence finished")
        tid = int(token_id)
        self.token_ids.append(tid)
        # vLLM's rules: no stop string may end in the text of the first `min_tokens` tokens, and a stop token
        # counts from the `min_tokens`-th on (the sampler bans the stop tokens until `min_tokens` are out)
        early = len(self.token_ids) <= self.params.min_tokens
        stop_token = tid in self._stop_ids and len(self.token_ids) >= self.params.min_tokens
        at_length = self.max_tokens is not None and len(self.token_ids) >= self.max_tokens
        ends = at_length or last
        end_reason = "stop" if last else "length"

        if self._detok is None:
            if stop_token:
                return self._finish("", "stop", tid)
            if ends:
                return self._finish("", end_reason, None)
            return StepResult("", False)

        new = ""
        if not stop_token or self.include_stop:
            new = self._detok.add(tid)
        if stop_token or ends:
            new += self._detok.flush()

        checked = len(self._pending)  # everything before this was checked in earlier steps
        self._pending += new
        match = self._find_stop(checked) if new and not early else None
        if match is not None:
            start, end, stop = match
            return self._finish(self._pending[: end if self.include_stop else start], "stop", stop)
        if stop_token:
            return self._finish(self._pending, "stop", tid)
        if ends:
            return self._finish(self._pending, end_reason, None)

        hold = self._held_back_len()
        cut = len(self._pending) - hold
        delta = self._pending[:cut]
        self._pending = self._pending[cut:]
        self._emit(delta)
        return StepResult(delta, False)

    def abort(self) -> StepResult:
        """The sequence ends from outside (an abort): the text held back, and a dangling partial character, are
        flushed as at any other finish (vLLM's final abort output carries the whole text decoded so far)."""
        if self.finished:
            return StepResult("", True, self.finish_reason, self.stop_reason)
        tail = self._detok.flush() if self._detok is not None else ""
        return self._finish(self._pending + tail, "abort", None)

    def min_tokens_ban(self) -> dict[int, float]:
        """Logit bias that keeps the stop tokens and EOS (with ignore_eos too, as vLLM) out while fewer than
        `min_tokens` are out."""
        return {t: float("-inf") for t in self._ban_ids}

    # -- internals -------------------------------------------------------------------------
    def _emit(self, delta: str) -> None:
        if delta:
            self._emitted.append(delta)
            self._text_cache = None

    def _finish(self, delta: str, reason: str, stop_reason) -> StepResult:
        self._pending = ""
        self._emit(delta)
        self.finished = True
        self.finish_reason = reason
        self.stop_reason = stop_reason
        return StepResult(delta, True, reason, stop_reason)

    def _find_stop(self, checked: int) -> Optional[tuple[int, int, str]]:
        """Earliest-completing stop string that ends in ``_pending[checked:]`` (it cannot start
        before ``_pending``: a possible start is always held back); of those ending at the same
        place, the longest (the one starting first)."""
        text = self._pending
        for end in range(checked + 1, len(text) + 1):
            for n, strings in self._by_length:
                if n <= end and text[end - n:end] in strings:
                    return end - n, end, text[end - n:end]
        return None

    def _held_back_len(self) -> int:
        """Length of the longest suffix of ``_pending`` that is a proper prefix of a stop string: the first
        string sorted after a suffix starts with it if any longer string does."""
        text, strings = self._pending, self._sorted
        for start in range(max(0, len(text) - self._longest + 1), len(text)):
            if text[start] not in self._firsts:
                continue
            tail = text[start:]
            i = bisect.bisect_right(strings, tail)
            if i < len(strings) and strings[i].startswith(tail):
                return len(text) - start
        return 0


def by_length(stops) -> tuple[tuple[int, frozenset], ...]:
    """Stop strings grouped by length, longest first."""
    groups: dict[int, set] = {}
    for s in stops:
        groups.setdefault(len(s), set()).add(s)
    return tuple((n, frozenset(g)) for n, g in sorted(groups.items(), reverse=True))
