"""Request-level types of the serving API: sampling parameters and outputs (vLLM's field names)."""

from __future__ import annotations

import enum
import json as _json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    import numpy as np

FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32 (penalties are applied in float32)
#: vLLM's `logprobs_mode`s, what an engine's logprobs hold (serve/sampling.py says what each means).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


class RequestError(ValueError):
    """A request is invalid (bad field, too long, can never fit); raised before it takes any memory."""


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` of a request holds (vLLM's values).

    CUMULATIVE: everything so far (tokens, text, logprobs), every step that produced something;
    DELTA: only what is new since the request's previous output (a completion appears only when it has new
    tokens or has just finished; prompt logprobs only in the first output): streaming without re-sending;
    FINAL_ONLY: one output, when the request finishes (`LLM.generate` runs every request this way)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's names). Exactly one of:

    * `json`: a JSON schema (dict or JSON text): the output is one JSON value valid under it;
    * `regex`: the whole output matches this regular expression (Rust `regex` syntax);
    * `choice`: the output is exactly one of these strings;
    * `grammar`: a context-free grammar, Lark (llguidance's dialect) or GBNF (llama.cpp's);
    * `json_object=True`: any JSON object (OpenAI's `response_format: json_object`).

    `disable_any_whitespace` forbids whitespace between JSON tokens (compact JSON; default: up to 20
    whitespace characters between two JSON tokens); `whitespace_pattern` (a regex) sets what may stand
    between two JSON tokens instead. `disable_additional_properties` adds
    `"additionalProperties": false` to every schema of `json`, nested ones included, that declares
    `properties` or `patternProperties` and does not say otherwise; one that declares none (a free-form
    `{"type": "object"}`) and `json_object` stay any object, as vLLM's.

    For thinking models (k3jax's addition; vLLM ties this to its reasoning parser): `reasoning_end`
    delays the constraint until the output contains that text (the end of the reasoning block, as the
    tokenizer encodes it), and `answer_prefix` is text the model may write before the constrained
    answer (K3's response-channel opening). The chat API sets both for K3 prompts that think.
    """

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None
    reasoning_end: Optional[str] = None
    answer_prefix: Optional[str] = None
    # the matcher GrammarCompiler.compile built (a worker thread's work): the engine's thread copies it
    _compiled: Any = field(default=None, init=False, repr=False, compare=False)

    def kind(self) -> str:
        """Which constraint is set; RequestError unless exactly one."""
        set_ = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            set_.append("json_object")
        if len(set_) != 1:
            raise RequestError(f"structured_outputs: set exactly one of json, regex, choice, grammar, json_object "
                               f"(got {', '.join(set_) or 'none'})")
        return set_[0]

    def key(self) -> str:
        """A canonical text of the constraint (the compiler's cache key). Key order is kept: a schema's
        properties are generated in the order it lists them, so two orders are two grammars."""
        kind = self.kind()
        value = getattr(self, kind)
        return _json.dumps([kind, value, self.disable_any_whitespace, self.disable_additional_properties,
                            self.whitespace_pattern, self.answer_prefix], default=str)


@dataclass
class SamplingParams:
    """How to sample one request. Field names and defaults follow vLLM.

    temperature 0 means greedy (one in (0, 0.01) samples at 0.01, vLLM's clamp). top_k <= 0 (or -1)
    disables top-k; top_p 1 and min_p 0 disable theirs.
    `seed` makes a request's samples reproducible regardless of batch composition.
    `logprobs=N` returns the sampled token's logprob and the top-N alternatives per step (vLLM's shape: a dict
    token id -> Logprob per step, the sampled token first; see TokenLogprobs).
    `prompt_logprobs=N` returns, for every prompt token after the first, its logprob given the tokens
    before it and the top-N alternatives (the whole prompt is computed: no prefix-cache reuse).
    `allowed_token_ids` restricts sampling (greedy too) to those tokens; `truncate_prompt_tokens=K`
    keeps only the prompt's last K tokens (-1: the context window's worth, vLLM's). `structured_outputs` constrains the output to a JSON
    schema, regex, choice or grammar (`StructuredOutputsParams`; serve/structured.py). `bad_words`
    (vLLM's) are never generated: a word's last token is banned whenever the output ends with the rest
    of it (each word as written and with a leading space).
    Penalties (vLLM's): `presence_penalty` / `frequency_penalty` subtract from the logit of each token
    already generated (once / per occurrence); `repetition_penalty` divides positive (multiplies
    negative) logits of tokens in the prompt or the output (1 is off). `logit_bias` adds to chosen
    tokens' logits ({token id: bias in [-100, 100]}). `min_tokens` forbids EOS and `stop_token_ids` (and
    ignores stop strings) until that many tokens are out. They shape the sampled (or greedy) token;
    logprobs stay those of the raw logits. `extra_args` (vLLM's) carries values for the engine's custom
    logits processors (serve/logits_processors.py): a request setting one of a processor's argument names
    is processed by it. `detokenize=False` (vLLM's) skips the text: outputs carry token ids only (and logprobs
    with empty `decoded`), which saves the host's detokenization for callers that work on ids (RL loops);
    stop strings need the text, so they are refused then. `spaces_between_special_tokens` (vLLM's) is accepted
    and changes nothing: the text is the tokenizer's own decode, which puts no space around special or added
    tokens (as HF's Kimi tokenizer decodes, and vLLM's fast-tokenizer path either way). `output_kind` (vLLM's
    `RequestOutputKind`): whether the request's outputs are cumulative (default), deltas, or only the final one.
    `return_hidden_states`
    (SGLang's): the finished output carries every position's final hidden states (engine option
    enable_return_hidden_states; the whole prompt is computed, as with prompt_logprobs).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: Optional[dict[int, float]] = None
    prompt_logprobs: Optional[int] = None
    allowed_token_ids: Optional[list[int]] = None
    truncate_prompt_tokens: Optional[int] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    bad_words: Optional[list[str]] = None
    extra_args: Optional[dict] = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    return_hidden_states: bool = False

    def __post_init__(self):
        if self.seed == -1 and not isinstance(self.seed, bool):  # vLLM's: -1 is no seed
            self.seed = None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None or isinstance(self.stop, (list, tuple)):  # (anything else: validate names it)
            self.stop = list(self.stop or [])
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise RequestError(f"logit_bias: must be a mapping of token id to bias, got {type(self.logit_bias).__name__}")

    def validate(self, vocab_size: int, max_logprobs: int = 20, max_stop: Optional[int] = None) -> None:
        """Raise RequestError naming the first invalid field. `max_stop`: the most stop strings taken (the HTTP
        server passes MAX_STOP to bound a client's work per request; None: any number, as vLLM's offline LLM)."""
        def bad(name, why):
            raise RequestError(f"{name}: {why}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not finite_number(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not finite_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if not finite_number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2 ** 63 <= self.seed < 2 ** 63):
            bad("seed", f"must be a 64-bit integer (-1: none), got {self.seed!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of them")
        if max_stop is not None and len(self.stop) > max_stop:
            bad("stop", f"at most {max_stop} stop strings, got {len(self.stop)}")
        if not isinstance(self.stop_token_ids, list):
            bad("stop_token_ids", f"must be a list of token ids, got {type(self.stop_token_ids).__name__}")
        if not isinstance(self.spaces_between_special_tokens, bool):
            bad("spaces_between_special_tokens", f"must be true or false, got {self.spaces_between_special_tokens!r}")
        if not isinstance(self.detokenize, bool):
            bad("detokenize", f"must be true or false, got {self.detokenize!r}")
        if not isinstance(self.return_hidden_states, bool):
            bad("return_hidden_states", f"must be true or false, got {self.return_hidden_states!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                bad("output_kind", f"must be a RequestOutputKind (0 cumulative, 1 delta, 2 final only), got "
                                   f"{self.output_kind!r}")
        if self.stop and not self.detokenize:
            bad("stop", "stop strings match the text, which detokenize=False skips (use stop_token_ids)")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not 0 <= t < vocab_size:
                bad("stop_token_ids", f"{t!r} is not a token id in [0, {vocab_size})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= max_logprobs):
            bad("logprobs", f"must be an integer in [0, {max_logprobs}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= max_logprobs):
            bad("prompt_logprobs", f"must be an integer in [0, {max_logprobs}], got {self.prompt_logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not finite_number(v) or not -2 <= v <= 2:
                bad(name, f"must be in [-2, 2], got {v!r}")
        # vLLM takes any finite penalty > 0; past float32's largest the penalty would be inf where it is applied (a
        # zero logit times inf: NaN)
        if not finite_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= FLOAT32_MAX:
            bad("repetition_penalty", f"must be a number > 0 (1 is off) that float32 holds, got "
                                      f"{self.repetition_penalty!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0 or (
                self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", f"must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)):
                bad("allowed_token_ids", f"must be a list of token ids, got {type(self.allowed_token_ids).__name__}")
            if not 1 <= len(self.allowed_token_ids) <= MAX_LOGIT_BIAS:
                bad("allowed_token_ids", f"must list 1 to {MAX_LOGIT_BIAS} tokens, got {len(self.allowed_token_ids)}")
            for t in self.allowed_token_ids:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                    bad("allowed_token_ids", f"{t!r} is not a token id in [0, {vocab_size})")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not (k >= 1 or k == -1)):
            bad("truncate_prompt_tokens", f"must be an integer >= 1 or -1 (the context window), got {k!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", f"expected StructuredOutputsParams, got "
                                          f"{type(self.structured_outputs).__name__}")
            self.structured_outputs.kind()
            if self.allowed_token_ids is not None:
                bad("allowed_token_ids", "cannot be combined with structured_outputs (the constraint decides "
                                         "which tokens may come next)")
        if self.bad_words is not None:
            if (not isinstance(self.bad_words, (list, tuple)) or len(self.bad_words) > MAX_BAD_WORDS
                    or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
                bad("bad_words", f"must be a list of at most {MAX_BAD_WORDS} non-blank strings")
            chars = sum(map(len, self.bad_words))
            if chars > MAX_BAD_WORDS_CHARS:  # (before the engine's thread tokenizes them)
                bad("bad_words", f"at most {MAX_BAD_WORDS_CHARS} characters in all, got {chars}")
        if self.extra_args is not None and (not isinstance(self.extra_args, dict)
                                            or not all(isinstance(k, str) for k in self.extra_args)):
            bad("extra_args", "must be a mapping of string keys to values")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
            for t, b in self.logit_bias.items():
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                    bad("logit_bias", f"{t!r} is not a token id in [0, {vocab_size})")
                if not finite_number(b) or not -100 <= b <= 100:
                    bad("logit_bias", f"bias of token {t} must be in [-100, 100], got {b!r}")

    @property
    def penalized(self) -> bool:
        """Whether any penalty needs the row's token history."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


MAX_LOGIT_BIAS = 300  # tokens per request (OpenAI's limit)
MAX_BAD_WORDS = 1000
#: Characters and tokens of a request's bad words, in all: they are tokenized on the engine's thread and every word is
#: matched against the output after every token (1,000 words of ~900 tokens took 0.3 s, then ~18 ms a step); the
#: tokens count each word's leading-space variant too (vLLM's model runner takes 1,024 tokens of at most 128 words).
MAX_BAD_WORDS_CHARS = 1 << 14
MAX_BAD_WORD_TOKENS = 4096
#: Stop strings per HTTP request (`validate(max_stop=...)`): a client's list is matched on the engine's thread, every
#: other request's steps waiting, so the server bounds it (OpenAI takes 4). The Python API takes any number, as vLLM's
#: SamplingParams does: serve/stop_checker.py's cost per token follows the distinct lengths of the strings, not their
#: number (50,000 cost 90 ms a token when each was searched for in turn).
MAX_STOP = 128


def loggable(text: str) -> str:
    """A client's text (its request id) for a log line: characters that are not printable (newlines, other
    controls, lone surrogates) escaped, so a request id cannot end the line and forge the next one."""
    return text if text.isprintable() else "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def finite_number(x) -> bool:
    """A real number (not a bool) that is finite; False for an int beyond float's range (on which
    `math.isfinite` raises OverflowError)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


@dataclass
class Logprob:
    token_id: int
    logprob: float
    decoded_token: str = ""  # the token's text (vLLM's name; "" without a tokenizer or with detokenize=False)
    rank: Optional[int] = None  # 1 = the most likely (vLLM v1's: the tokens with a value >= its; top-n: their place)

    @property
    def decoded(self) -> str:
        """The former name of `decoded_token` (read-only)."""
        return self.decoded_token


class TokenLogprobs(dict):
    """One position's logprobs, as vLLM's: a dict token id -> Logprob, the sampled (or prompt) token's entry
    first, then the top-N alternatives in rank order; a token that is both appears once, as the chosen one
    (so there are N or N + 1 entries). `chosen` is the sampled / prompt token's Logprob and `top` the
    alternatives in rank order (as vLLM's top-N, it may hold the chosen token too)."""

    __slots__ = ("chosen", "top")

    def __init__(self, chosen: Logprob, top=()):
        super().__init__()
        self.chosen = chosen
        self.top = list(top)
        self[chosen.token_id] = chosen
        for a in self.top:
            self.setdefault(a.token_id, a)

    def __reduce__(self):  # pickle / copy: rebuilt from (chosen, top), then any entry added since
        return (type(self), (self.chosen, self.top), None, None, iter(self.items()))

    def __eq__(self, other):
        if isinstance(other, TokenLogprobs):
            return self.chosen == other.chosen and self.top == other.top and dict.__eq__(self, other)
        return dict.__eq__(self, other)

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None  # (a dict's)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop" | "length" | "abort" | None while running; "error" (vLLM's): its structured-output constraint failed
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None  # the stop token id or stop string that ended it (with "error": why)
    # per generated token (vLLM's shape): token id -> Logprob, the sampled token first, then the top-N
    # alternatives by rank (TokenLogprobs; `.chosen` / `.top` for convenience)
    logprobs: Optional[list[TokenLogprobs]] = None
    # with SamplingParams.logprobs (vLLM's) and a beam search's hypotheses: the sum of the generated tokens' logprobs
    cumulative_logprob: Optional[float] = None
    # enable_return_routed_experts, once finished: the logical expert ids each position fed through the model was
    # routed to, int32 [len(prompt) + len(output) - 1, MoE layers, experts per token] (serve/routed_experts.py)
    routed_experts: Optional["np.ndarray"] = None
    # SamplingParams.return_hidden_states, once finished: each position's final hidden states after the final norm
    # (the LM head's input), float32 [len(prompt) + len(output) - 1, hidden_size]: row p is the model's state
    # having read tokens 0..p, from which it sampled token p + 1
    hidden_states: Optional["np.ndarray"] = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None

    @property
    def queue_time(self) -> Optional[float]:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> Optional[float]:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: Optional[RequestMetrics] = None
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs (vLLM's shape): per prompt token, None for the first, else a
    # TokenLogprobs (token id -> Logprob: the prompt token first, then its top-N alternatives by rank);
    # Logprob.rank is the token's rank (1 = most likely)
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None

    # convenience accessors for the common n == 1 case
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> Optional[str]:
        return self.outputs[0].finish_reason
