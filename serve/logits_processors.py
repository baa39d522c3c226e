"""Custom logits processors, compiled into the step programs (vLLM's custom logits processors, on device).

A `LogitsProcessor` is a pure JAX function over the whole padded batch's next-token logits. The engine
traces every configured processor into each step program at start-up, so a processor costs no compile
later and no host round trip per token: the batch never leaves the device between the model and the
sampler. A request turns a processor on by setting one of its argument names in
`SamplingParams.extra_args` (HTTP: `vllm_xargs`); the values become one float column per argument.

    def ban_below(logits, args, ctx):          # logits [B, V] f32, args [B, 1] f32
        ids = jnp.arange(logits.shape[1])[None, :]
        return jnp.where(ids < args[:, :1], -jnp.inf, logits)

    llm = k3jax.LLM("tiny-k3", logits_processors=[LogitsProcessor("ban_below", ban_below, ("min_id",))])
    llm.generate("...", SamplingParams(extra_args={"min_id": 100}))

Semantics, in the order the sampler applies them (serve/sampling.py): structured-output masks, logit
bias, penalties, then the processors in the configured order, each on the rows it is on for; then greedy
argmax or temperature / top-k / top-p / min-p sampling. Rows a processor is off for keep their logits bit
for bit, and a step in which no row uses a processor skips it (`lax.cond`). Reported logprobs stay those of
the raw logits, as for bias and penalties (vLLM's default `raw_logprobs`). A processor must keep at least
one finite logit in each row it changes (an all -inf row samples token 0).

Processors are named in `EngineConfig.logits_processors` as objects, as built-in names (`BUILTIN`:
`no_repeat_ngram`, HF transformers' `no_repeat_ngram_size`), or as import paths
(`"package.module:attribute"` or `"package.module.attribute"`, naming a processor or a factory of
one), which is what the CLI's `--logits-processors` takes. A processor that reads the token history needs
a model with MLA layers (their first layer's pages hold it, as for the penalties).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from serve.types import RequestError, finite_number


#: The history's id at a prompt position given as a vector (`{"prompt_embeds": ...}`): no token, so no penalty or
#: n-gram counts it (HF's `generate(inputs_embeds=...)` gives its processors the generated tokens alone). Past every
#: vocabulary, so a scatter at it is dropped, not wrapped onto a real token as -1 would be.
NO_TOKEN = 2 ** 31 - 1


class ProcessorContext(NamedTuple):
    """What a processor may read besides the logits and its arguments (all [B] rows of the batch)."""

    steps: jax.Array  # [B] i32 index of the token being sampled within its request's output
    prompt_lens: jax.Array  # [B] i32
    # () -> (ids [B, S] i32, positions [B, S] i32): the row's tokens by position; position p holds a prompt
    # token when p < prompt_lens (`NO_TOKEN` where the prompt was given as embeddings), an output token when
    # prompt_lens <= p < prompt_lens + steps, and nothing meaningful beyond (traced only when called)
    history: Callable[[], tuple[jax.Array, jax.Array]]


@dataclass(frozen=True)
class LogitsProcessor:
    """`fn(logits [B, V] f32, args [B, len(arg_names)] f32, ctx: ProcessorContext) -> logits [B, V]`.

    `arg_names`: the `SamplingParams.extra_args` keys the processor reads, in column order; a request is
    processed when it sets any of them (missing ones take `defaults`, else 0). With no `arg_names` the
    processor runs on every row. `validate(extra_args) -> None` may raise ValueError to refuse a request
    before it takes any memory (vLLM's `validate_params`); values of `arg_names` must be real numbers.
    """

    name: str
    fn: Callable[[jax.Array, jax.Array, ProcessorContext], jax.Array]
    arg_names: tuple[str, ...] = ()
    defaults: tuple[float, ...] = ()
    validate: Optional[Callable[[dict], None]] = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"logits_processors: a processor needs a non-empty name, got {self.name!r}")
        if not callable(self.fn):
            raise ValueError(f"logits_processors[{self.name!r}]: fn must be callable, got {type(self.fn).__name__}")
        object.__setattr__(self, "arg_names", tuple(self.arg_names))
        object.__setattr__(self, "defaults", tuple(float(d) for d in self.defaults))
        if not all(isinstance(a, str) and a for a in self.arg_names) or len(set(self.arg_names)) != len(self.arg_names):
            raise ValueError(f"logits_processors[{self.name!r}]: arg_names must be distinct non-empty strings, "
                             f"got {self.arg_names!r}")
        if len(self.defaults) > len(self.arg_names):
            raise ValueError(f"logits_processors[{self.name!r}]: {len(self.defaults)} defaults for "
                             f"{len(self.arg_names)} arg_names")

    def default(self, i: int) -> float:
        return self.defaults[i] if i < len(self.defaults) else 0.0

    def is_on(self, extra_args: Optional[dict]) -> bool:
        return not self.arg_names or any(a in (extra_args or {}) for a in self.arg_names)


Spec = Union[LogitsProcessor, str]


def resolve(specs: Sequence[Spec]) -> tuple[LogitsProcessor, ...]:
    """Processors from objects, built-in names or import paths; ValueError naming `logits_processors`."""
    out = []
    for spec in specs or ():
        proc = (BUILTIN[spec] if spec in BUILTIN else _import(spec)) if isinstance(spec, str) else spec
        if callable(proc) and not isinstance(proc, LogitsProcessor):  # a factory
            proc = proc()
        if not isinstance(proc, LogitsProcessor):
            raise ValueError(f"logits_processors: {spec!r} is not a LogitsProcessor (serve.logits_processors), "
                             f"got {type(proc).__name__}")
        out.append(proc)
    names = [p.name for p in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"logits_processors: names must be distinct, {dup} repeat")
    return tuple(out)


def _import(path: str):
    """`package.module:attr.attr` or `package.module.attr.attr` (the longest importable module prefix)."""
    module, sep, attr = path.partition(":")
    if sep:
        splits = [(module, attr)] if module and attr else []
    else:
        parts = path.split(".")
        splits = [(".".join(parts[:i]), ".".join(parts[i:])) for i in range(len(parts) - 1, 0, -1)]
    if not splits:
        raise ValueError(f"logits_processors: {path!r} is not an import path ('package.module:attribute')")
    error = None
    for module, attr in splits:
        try:
            obj = importlib.import_module(module)
        except ImportError as e:
            error = error or e
            continue
        try:
            for part in attr.split("."):
                obj = getattr(obj, part)
            return obj
        except AttributeError as e:
            raise ValueError(f"logits_processors: cannot import {path!r}: {e}") from None
    raise ValueError(f"logits_processors: cannot import {path!r}: {error}")


def num_args(processors: Sequence[LogitsProcessor]) -> int:
    return sum(len(p.arg_names) for p in processors)


def check_request(processors: Sequence[LogitsProcessor], extra_args: Optional[dict]) -> None:
    """RequestError naming `extra_args[...]` when a processor's argument is not a real number or its
    own `validate` refuses the request."""
    if extra_args is None:
        return
    if not isinstance(extra_args, dict) or not all(isinstance(k, str) for k in extra_args):
        raise RequestError("extra_args: must be a mapping of string keys to values")
    for proc in processors:
        for a in proc.arg_names:
            if a in extra_args:
                v = extra_args[a]
                if not finite_number(v):
                    raise RequestError(f"extra_args[{a!r}]: logits processor {proc.name!r} takes a finite "
                                       f"number, got {v!r}")
        if proc.validate is not None and proc.is_on(extra_args):
            try:
                proc.validate(extra_args)
            except ValueError as e:
                raise RequestError(f"extra_args: logits processor {proc.name!r}: {e}") from None


def batch_columns(processors: Sequence[LogitsProcessor], extra_args: Sequence[Optional[dict]],
                  bucket: int) -> tuple[np.ndarray, np.ndarray]:
    """Host arrays of a batch: (args [bucket, A] f32, on [bucket, P] bool); padding rows are off."""
    args = np.zeros((bucket, num_args(processors)), np.float32)
    on = np.zeros((bucket, len(processors)), bool)
    for i, xa in enumerate(extra_args):
        col = 0
        for j, proc in enumerate(processors):
            on[i, j] = proc.is_on(xa)
            for k, a in enumerate(proc.arg_names):
                args[i, col + k] = float((xa or {}).get(a, proc.default(k)))
            col += len(proc.arg_names)
    return args, on


def apply(processors: Sequence[LogitsProcessor], logits: jax.Array, args: jax.Array, on: jax.Array,
          ctx: ProcessorContext) -> jax.Array:
    """Run each processor on its rows (others unchanged bit for bit); skipped when no row has it on."""

    col = 0
    for j, proc in enumerate(processors):
        cols = args[:, col:col + len(proc.arg_names)]
        col += len(proc.arg_names)

        def run(x, proc=proc, cols=cols, j=j):
            try:
                y = proc.fn(x, cols, ctx)
            except Exception as e:  # traced when the engine compiles its programs: say whose code failed
                raise ValueError(f"logits processor {proc.name!r} failed while tracing: "
                                 f"{type(e).__name__}: {e}") from e
            if not hasattr(y, "shape") or y.shape != x.shape:
                raise ValueError(f"logits processor {proc.name!r} returned shape {getattr(y, 'shape', type(y).__name__)}, "
                                 f"expected {x.shape}")
            return jnp.where(on[:, j:j + 1], y.astype(x.dtype), x)
        logits = lax.cond(jnp.any(on[:, j]), run, lambda x: x, logits)
    return logits


# ---- built-in processors ------------------------------------------------------------------------------
MAX_NGRAM = 16


def _no_repeat_ngram(logits: jax.Array, args: jax.Array, ctx: ProcessorContext) -> jax.Array:
    """Ban every token that would complete an n-gram already in the row's prompt + output (HF's rule)."""

    n = args[:, 0].astype(jnp.int32)  # [B]
    ids, pos = ctx.history()  # [B, S]
    s = ids.shape[1]
    length = ctx.prompt_lens + ctx.steps  # [B] tokens before the one being sampled
    match = pos + n[:, None] <= length[:, None]  # the n-gram starting at p lies in them
    for k in range(MAX_NGRAM - 1):  # its first n - 1 tokens equal the last n - 1 tokens
        at = jnp.take_along_axis(ids, jnp.minimum(pos + k, s - 1), axis=1)
        tail = jnp.take_along_axis(ids, jnp.clip(length - n + 1 + k, 0, s - 1)[:, None], axis=1)
        match &= (k >= n - 1)[:, None] | (at == tail)
    completes = jnp.take_along_axis(ids, jnp.clip(pos + n[:, None] - 1, 0, s - 1), axis=1)  # [B, S]
    rows = jnp.arange(ids.shape[0])[:, None]
    banned = jnp.zeros(logits.shape, bool).at[rows, completes].max(match & (n[:, None] > 0))
    return jnp.where(banned, -jnp.inf, logits)


def _check_ngram(extra_args: dict) -> None:
    n = extra_args.get("no_repeat_ngram_size")
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_NGRAM:
        raise ValueError(f"no_repeat_ngram_size must be an integer in [0, {MAX_NGRAM}] (0 is off), got {n!r}")


#: `extra_args={"no_repeat_ngram_size": n}`: no n-gram of the prompt + output occurs twice (n <= 16; HF's).
NO_REPEAT_NGRAM = LogitsProcessor("no_repeat_ngram", _no_repeat_ngram, ("no_repeat_ngram_size",),
                                  validate=_check_ngram)
BUILTIN = {"no_repeat_ngram": NO_REPEAT_NGRAM}
