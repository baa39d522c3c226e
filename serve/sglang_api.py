"""SGLang's native API: `POST /generate`, `GET /get_model_info` (and its newer name `/model_info`),
`GET /get_weight_version`, `GET /get_server_info` (and its newer name `/server_info`) -- what SGLang's own
clients speak: RL rollout workers that send token ids and read back `output_ids` with their logprobs,
`sglang.bench_serving --backend sglang`, routers that ask a worker what it serves, scripts written against SGLang.
(`/flush_cache`, `/abort_request`, `/health_generate` and `/update_weights_from_disk` live with their vLLM twins
in serve/api.py.)

Request: `text` or `input_ids` (one prompt or a batch) or `input_embeds` (vectors [L, H], with
`--enable-prompt-embeds`), a `sampling_params` object, or for a batch a list of one per prompt (one `n` for
all) (SGLang's names: `max_new_tokens` (default 128, or what the context leaves when less), `min_new_tokens`,
`stop`, `stop_token_ids`, `temperature`, `top_p`, `top_k`, `min_p`, the penalties, `n`, `ignore_eos`,
`skip_special_tokens`, `spaces_between_special_tokens` (accepted; the text is the tokenizer's own decode either way),
`no_stop_trim`, `json_schema` / `regex` / `ebnf`, `sampling_seed`, `logit_bias`), `return_logprob` with
`top_logprobs_num`, `logprob_start_len` (>= 0: the prompt's logprobs from that position, at most its length) and
`return_text_in_logprobs`, `stream`, `rid`, `lora_path` (a loaded adapter's name, or a batch's list of one per
prompt, null for the base model), `priority`; `rid`, `return_logprob`, `logprob_start_len` and `top_logprobs_num`
may be a batch's lists of one per prompt too (SGLang's `GenerateReqInput`: a listed rid is that prompt's id,
`/abort_request` ends that prompt's request alone),
`return_routed_experts` (with `--enable-return-routed-experts`; from `routed_experts_start_len`),
`return_hidden_states` (with `--enable-return-hidden-states`).

Response: `{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
"completion_tokens", "cached_tokens", "e2e_latency", "weight_version", logprobs, "routed_experts" (once finished: base64 of the
int32 ids [positions, MoE layers, experts per token]), "hidden_states" (once finished: SGLang's list, the prompt
positions' final hidden states [prompt_tokens, hidden_size] first, then one [hidden_size] per generated token
but the last)}}` -- a list of them (prompt-major, then the
`n` samples) for a batch or n > 1. `finish_reason` is null while running, else `{"type": "length",
"length": N}`, `{"type": "stop", "matched": <token id or string>}` or `{"type": "abort", "message"}`.
Logprob entries are `[logprob, token_id, text or null]`. Streams send the whole object so far (cumulative
`text` and `output_ids`, SGLang's default) per update, with `index` for a batch, then `data: [DONE]`.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Annotated, Any, NamedTuple, Optional, Union

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from serve import api, prompt_embeds
from serve.memory import cache_tokens
from serve.routed_experts import to_base64
from serve.types import MAX_STOP, RequestError, RequestOutput, SamplingParams, StructuredOutputsParams

# the engine's (vLLM's) names of SGLang's fields, for error messages
_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "seed": "sampling_seed",
          "include_stop_str_in_output": "no_stop_trim", "logprobs": "top_logprobs_num",
          "prompt_logprobs": "top_logprobs_num", "structured_outputs": "sampling_params",
          "structured_outputs.json": "sampling_params.json_schema", "structured_outputs.regex": "sampling_params.regex",
          "structured_outputs.grammar": "sampling_params.ebnf"}


DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's


class GenerateSamplingParams(BaseModel):
    """SGLang's `sampling_params` (the fields this server serves; any other is refused, named)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    max_new_tokens: Optional[int] = Field(DEFAULT_MAX_NEW_TOKENS, ge=1,
                                          description="default: 128, or what the context leaves when less")
    min_new_tokens: int = Field(0, ge=0)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = None
    min_p: Optional[float] = Field(None, ge=0, le=1)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    n: int = Field(1, ge=1, le=16)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # (accepted; the text is the tokenizer's own decode either way)
    no_stop_trim: bool = False
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    sampling_seed: Optional[int] = Field(None, ge=0)
    logit_bias: Optional[dict[str, float]] = None


_EACH = TypeAdapter(list[GenerateSamplingParams])

StartLen = Annotated[int, Field(ge=-1)]
TopNum = Annotated[int, Field(ge=0, le=20)]
# SGLang's fields that take one value for every prompt or a batch's list of one per prompt: (one, list) readings
_PER_PROMPT = {"rid": (TypeAdapter(str), TypeAdapter(list[str])),
               "return_logprob": (TypeAdapter(bool), TypeAdapter(list[bool])),
               "logprob_start_len": (TypeAdapter(StartLen), TypeAdapter(list[StartLen])),
               "top_logprobs_num": (TypeAdapter(TopNum), TypeAdapter(list[TopNum]))}


class LogprobAsk(NamedTuple):
    """One prompt's logprob settings (SGLang's `return_logprob`, `logprob_start_len`, `top_logprobs_num`)."""

    want: bool = False
    start: int = -1
    top: int = 0


class GenerateRequest(BaseModel):
    """SGLang's `GenerateReqInput` (the fields this server serves)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    input_embeds: Optional[Union[list[list[float]], list[list[list[float]]]]] = Field(
        None, description="prompt vectors [L, H] (or a batch of them); needs --enable-prompt-embeds")
    sampling_params: Optional[Union[GenerateSamplingParams, list[GenerateSamplingParams]]] = Field(
        None, description="one object for every prompt, or a batch's list of one per prompt (one n for all)")
    rid: Optional[Union[str, list[str]]] = Field(None, description="the request's id, or a batch's list of one "
                                                                   "per prompt")
    return_logprob: Union[bool, list[bool]] = Field(False, description="or a batch's list of one per prompt")
    logprob_start_len: Union[StartLen, list[StartLen]] = Field(
        -1, description="-1: output logprobs only; N: the prompt's from N (or a batch's list of one per prompt)")
    top_logprobs_num: Union[TopNum, list[TopNum]] = Field(0, description="or a batch's list of one per prompt")
    return_text_in_logprobs: bool = False
    stream: bool = False
    lora_path: Optional[Union[str, list[Optional[str]]]] = Field(
        None, description="a loaded LoRA adapter's name, or a batch's list of one per prompt (null: the base model)")
    priority: int = Field(0, gt=-(1 << 30), lt=1 << 30)
    return_routed_experts: bool = Field(False, description="the experts every position was routed to (needs "
                                                           "--enable-return-routed-experts)")
    routed_experts_start_len: int = Field(0, ge=0, description="routed experts from this position on")
    return_hidden_states: bool = Field(False, description="every position's final hidden states (needs "
                                                          "--enable-return-hidden-states)")

    @field_validator("sampling_params", mode="wrap")
    @classmethod
    def _one_or_each(cls, value, handler):
        """One object or a list of them, an error located in what was given (not reported for both readings)."""
        if value is None:
            return None
        return _EACH.validate_python(value) if isinstance(value, list) else GenerateSamplingParams.model_validate(value)

    @field_validator("rid", "return_logprob", "logprob_start_len", "top_logprobs_num", mode="wrap")
    @classmethod
    def _one_or_list(cls, value, handler, info):
        """One value for every prompt or a list of one per prompt, an error located in what was given."""
        if value is None:
            return handler(value)
        one, each = _PER_PROMPT[info.field_name]
        return each.validate_python(value) if isinstance(value, list) else one.validate_python(value)

    @property
    def model(self) -> Optional[str]:  # what the shared path reads to pick a LoRA adapter
        return self.lora_path if isinstance(self.lora_path, str) else None

    @property
    def model_of_each(self) -> Optional[list[Optional[str]]]:
        """SGLang's per-prompt `lora_path` list (its length checked by `generate`), which the shared path reads
        before `model`; None when one name (or none) serves every prompt."""
        return self.lora_path if isinstance(self.lora_path, list) else None


def prompts_of(st: "api.ServerState", body: GenerateRequest) -> tuple[list, bool, str]:
    """-> (engine prompts, whether the request was a batch, the field that held them)."""
    given = [k for k in ("text", "input_ids", "input_embeds") if getattr(body, k) is not None]
    if len(given) != 1:
        raise api.APIError(400, f"give exactly one of text, input_ids, input_embeds (got {', '.join(given) or 'none'})",
                           param=given[1] if len(given) > 1 else "text")
    if body.text is not None:
        batch = isinstance(body.text, list)
        prompts = [api._encode(st, t, "text") for t in (body.text if batch else [body.text])]
    elif body.input_ids is not None:
        batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
        prompts = [list(p) for p in (body.input_ids if batch else [body.input_ids])]
        for p in prompts:
            api._check_ids(st, p, "input_ids")
    else:
        if st.embeds_dtype is None:
            raise api.APIError(400, "input_embeds: this server was started without --enable-prompt-embeds",
                               param="input_embeds")
        batch = bool(body.input_embeds) and bool(body.input_embeds[0]) and isinstance(body.input_embeds[0][0], list)
        items = body.input_embeds if batch else [body.input_embeds]
        try:
            prompts = [{"prompt_embeds": prompt_embeds.as_prompt_embeds(
                x, int(st.cfg.hidden_size), st.embeds_dtype, "input_embeds")} for x in items]
        except RequestError as e:
            raise api.APIError(400, str(e), param="input_embeds") from None
    if not prompts or any(api._prompt_len(p) == 0 for p in prompts):
        raise api.APIError(400, f"{given[0]}: empty prompt", param=given[0])
    if len(prompts) > api.MAX_BATCH:
        raise api.APIError(400, f"{given[0]}: at most {api.MAX_BATCH} prompts per request, got {len(prompts)}",
                           param=given[0])
    return prompts, batch, given[0]


def max_new_tokens_of(st: "api.ServerState", sp: GenerateSamplingParams, prompts: list) -> list[Optional[int]]:
    """Each prompt's `max_new_tokens`: as given, else SGLang's default 128 cut to what the context leaves after that
    prompt, so a long prompt of a batch does not shorten the others' (SGLang refuses only a given value that does
    not fit)."""
    if "max_new_tokens" in sp.model_fields_set:
        return [sp.max_new_tokens] * len(prompts)
    rooms = ((st.max_model_len or 0) - api._prompt_len(p) for p in prompts)
    return [min(DEFAULT_MAX_NEW_TOKENS, room) if room >= 1 else DEFAULT_MAX_NEW_TOKENS for room in rooms]


#: SGLang's greedy threshold: a temperature below it is greedy there (the engine, as vLLM, samples it at 0.01).
SAMPLING_EPS = 1e-6


def sampling_params_of(body: GenerateRequest, prompts: list) -> list[GenerateSamplingParams]:
    """Each prompt's `sampling_params`: one object (or none: the defaults) for all, or SGLang's list of one per
    prompt, which must agree on `n` (SGLang's rule: a batch's samples are indexed prompt-major)."""
    sp = [s or GenerateSamplingParams() for s in each_of(body, "sampling_params", len(prompts))]
    if len({s.n for s in sp}) > 1:
        raise api.APIError(400, "sampling_params: every prompt's n must be the same", param="sampling_params.n")
    return sp


def each_of(body: GenerateRequest, name: str, nprompts: int) -> list:
    """Field `name`'s value per prompt: one value for all, or SGLang's list of one per prompt (its length checked)."""
    value = getattr(body, name)
    if not isinstance(value, list):
        return [value] * nprompts
    if len(value) != nprompts:
        raise api.APIError(400, f"{name}: a list of {len(value)} for {nprompts} prompts; give one per prompt, or one "
                                f"value for all", param=name)
    return value


def logprob_asks(body: GenerateRequest, prompts: list) -> list[LogprobAsk]:
    """Each prompt's logprob settings. A `logprob_start_len` past its prompt's end is a 400 (SGLang aborts such a
    request, "higher than the number of input tokens"; here it was cut silently to the prompt's end)."""
    asks = [LogprobAsk(*x) for x in zip(*(each_of(body, k, len(prompts))
                                          for k in ("return_logprob", "logprob_start_len", "top_logprobs_num")))]
    for k, (ask, p) in enumerate(zip(asks, prompts)):
        length = api._prompt_len(p)
        if ask.want and ask.start > length:
            where = f"logprob_start_len[{k}]" if isinstance(body.logprob_start_len, list) else "logprob_start_len"
            raise api.APIError(400, f"{where}: {ask.start} is past the end of the prompt ({length} tokens); give at "
                                    f"most {length}", param="logprob_start_len")
    return asks


def rids_of(body: GenerateRequest, nprompts: int) -> Optional[list[str]]:
    """SGLang's per-prompt `rid` list (one id per prompt, none repeated), else None."""
    if not isinstance(body.rid, list):
        return None
    rids = each_of(body, "rid", nprompts)
    if len(set(rids)) != len(rids):
        raise api.APIError(400, "rid: the list repeats an id; give each prompt its own", param="rid")
    return rids


def sampling_of(st: "api.ServerState", body: GenerateRequest, prompts: list,
                sp: Optional[GenerateSamplingParams] = None, ask: Optional[LogprobAsk] = None) -> SamplingParams:
    """The engine's params of `prompts` under `sp` (default: the request's one `sampling_params` object) and `ask`
    (default: the request's logprob settings, one for all)."""
    sp = sp or body.sampling_params or GenerateSamplingParams()
    ask = ask or logprob_asks(body, prompts)[0]
    constraints = [(k, v) for k, v in (("json", sp.json_schema), ("regex", sp.regex), ("grammar", sp.ebnf))
                   if v is not None]
    if len(constraints) > 1:
        raise api.APIError(400, "sampling_params: give one of json_schema, regex, ebnf", param="sampling_params")
    try:
        bias = {int(k): float(v) for k, v in sp.logit_bias.items()} if sp.logit_bias else None
    except ValueError:
        raise api.APIError(400, "sampling_params.logit_bias: keys must be token ids", param="logit_bias") from None
    defaults = getattr(st, "generation_defaults", {})

    def unset(value, name: str, fallback):
        return defaults.get(name, fallback) if value is None else value
    logprobs = ask.top if ask.want else None
    temperature = unset(sp.temperature, "temperature", 1.0)
    temperature = 0.0 if temperature < SAMPLING_EPS else temperature  # (the engine raises (0, 0.01) to 0.01)
    params = SamplingParams(
        n=sp.n, temperature=temperature, top_p=unset(sp.top_p, "top_p", 1.0),
        top_k=unset(sp.top_k, "top_k", -1), min_p=unset(sp.min_p, "min_p", 0.0), seed=sp.sampling_seed,
        max_tokens=api._run_max_tokens(max_new_tokens_of(st, sp, prompts)), min_tokens=sp.min_new_tokens, stop=sp.stop or [],
        stop_token_ids=sp.stop_token_ids or [], ignore_eos=sp.ignore_eos, logprobs=logprobs,
        include_stop_str_in_output=sp.no_stop_trim, skip_special_tokens=sp.skip_special_tokens,
        spaces_between_special_tokens=sp.spaces_between_special_tokens,
        presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
        repetition_penalty=unset(sp.repetition_penalty, "repetition_penalty", 1.0), logit_bias=bias,
        prompt_logprobs=ask.top if ask.want and ask.start >= 0 else None,
        structured_outputs=StructuredOutputsParams(**dict(constraints)) if constraints else None,
        return_hidden_states=body.return_hidden_states)
    if body.return_hidden_states and not getattr(st, "hidden_states", False):
        raise api.APIError(400, "return_hidden_states: this server was started without --enable-return-hidden-states",
                           param="return_hidden_states")
    try:
        params.validate(st.vocab_size, st.max_logprobs, max_stop=MAX_STOP)
    except RequestError as e:
        raise _error(e) from None
    return params


def hidden_lists(hidden, prompt_len: int) -> list:
    """SGLang's wire form of a sequence's hidden states [positions, H]: the prompt positions' rows as one
    [prompt_len, H] list, then each later position's row [H] on its own (one per decode step)."""
    return [hidden[:prompt_len].tolist()] + [row.tolist() for row in hidden[prompt_len:]]


def _error(e: RequestError) -> "api.APIError":
    """An engine validation error under SGLang's field name."""
    field, _, why = str(e).partition(": ")
    name = _NAMES.get(field, field)
    return api.APIError(400, f"{name}: {why}" if why else str(e), param=name)


def _named(e: "api.APIError") -> "api.APIError":
    """A 400 naming an engine's (vLLM's) field -> the same naming SGLang's (others: `e`)."""
    return _error(RequestError(e.message)) if e.status == 400 and e.param in _NAMES else e


class GenerateFormat(api._Format):
    """SGLang's objects, whole and streamed (see the module docstring)."""

    budget_field = "max_new_tokens"  # (what a context error names)
    named = staticmethod(_named)  # (a stream's error event names SGLang's fields, as a 400 does)

    def __init__(self, st, rid: str, run_id: str, params: SamplingParams, body: GenerateRequest, prompts: list,
                 batch: bool, arrival: float, asks: list[LogprobAsk], rids: Optional[list[str]] = None):
        """`asks`: each prompt's logprob settings; `rids`: SGLang's per-prompt ids (None: `rid` and its suffixes)."""
        super().__init__(st, rid, params.n, params.logprobs, int(time.time()), run_id=run_id)
        self.body, self.batch, self.arrival, self.asks, self.rids = body, batch, arrival, asks, rids
        self.prompt_lens = [api._prompt_len(p) for p in prompts]
        self.with_text = body.return_text_in_logprobs
        self.sent_at: dict[int, int] = {}  # stream: output tokens already sent per index (nothing new: no chunk)

    def _entry(self, lp) -> list:
        return [api._finite_lp(lp.logprob) if lp.logprob is not None else None, lp.token_id,
                lp.decoded_token if self.with_text else None]

    def _finish(self, o) -> Optional[dict]:
        if o.finish_reason is None:
            return None
        if o.finish_reason == "length":
            return {"type": "length", "length": len(o.token_ids)}
        if o.finish_reason == "abort":
            return {"type": "abort", "message": "aborted"}
        return {"type": "stop", "matched": o.stop_reason}

    def item(self, i: int, out: RequestOutput, o) -> dict:
        """One (prompt, sample)'s object as it stands."""
        prompt_len, ask = self.prompt_lens[i], self.asks[i]
        if self.rids is not None:
            rid = self.rids[i] if self.n == 1 else f"{self.rids[i]}_{o.index}"
        else:
            rid = self.id if not self.batch and self.n == 1 else f"{self.id}_{self.index(i, o.index)}"
        meta: dict[str, Any] = {"id": rid,
                                "finish_reason": self._finish(o), "prompt_tokens": prompt_len,
                                "completion_tokens": len(o.token_ids), "cached_tokens": out.num_cached_tokens,
                                "e2e_latency": round(time.monotonic() - self.arrival, 6),
                                "weight_version": self.st.weight_version}
        if ask.want:
            entries = o.logprobs or []
            meta["output_token_logprobs"] = [self._entry(e.chosen) for e in entries]
            if ask.top:
                meta["output_top_logprobs"] = [[self._entry(a) for a in e.top] for e in entries]
            if ask.start >= 0 and out.prompt_logprobs is not None:
                start = min(ask.start, prompt_len)
                ids = out.prompt_token_ids
                # (no logprob: the first token, and any a request aborted mid-prefill never scored)
                scored = [out.prompt_logprobs[k] for k in range(start, prompt_len)]
                meta["input_token_logprobs"] = [self._entry(e.chosen) if e is not None else
                                                [None, ids[k], self._token(ids[k])]
                                                for k, e in zip(range(start, prompt_len), scored)]
                if ask.top:
                    meta["input_top_logprobs"] = [[self._entry(a) for a in e.top] if e is not None else None
                                                  for e in scored]
        if self.routes_from is not None and o.routed_experts is not None:  # asked (see api._serve), once finished
            meta["routed_experts"] = to_base64(o.routed_experts, self.routes_from)
        if o.hidden_states is not None:  # asked (return_hidden_states), once finished
            meta["hidden_states"] = hidden_lists(o.hidden_states, prompt_len)
        return {"text": o.text, "output_ids": list(o.token_ids), "meta_info": meta}

    def _token(self, tid: int) -> Optional[str]:
        tok = self.st.tokenizer
        return (tok.decode([tid], skip_special=False) if tok is not None else "") if self.with_text else None

    def full(self, run: "api._Run"):
        items = [self.item(i, run.output(i), o) for i in range(len(run.prompts)) for o in run.output(i).outputs]
        return items if self.batch or self.n > 1 else items[0]

    def start(self, nprompts: int, usage_field: bool) -> list[dict]:
        return []

    def deltas(self, i: int, out: RequestOutput, usage_field: bool) -> list[dict]:
        """`out` is a delta; SGLang streams each changed sample's whole object so far."""
        chunks = []
        whole = self.run.output(i)
        for o in whole.outputs:
            idx = self.index(i, o.index)
            if idx in self.finished or (self.sent_at.get(idx) == len(o.token_ids) and o.finish_reason is None):
                continue
            self.sent_at[idx] = len(o.token_ids)
            if o.finish_reason is not None:
                self.finished.add(idx)
            chunk = self.item(i, whole, o)
            if self.batch or self.n > 1:
                chunk["index"] = idx
            chunks.append(chunk)
        return chunks

    def end(self, run: "api._Run", include_usage: bool) -> list[dict]:
        return []


async def generate(st: "api.ServerState", request: Request, key: str, body: GenerateRequest):
    """The route's work: the shared admission, engine run and streaming path with SGLang's shapes."""
    arrival = time.monotonic()
    st.admit(key, 1, 1, charge=False)  # a full rate window or queue: refused before tokenizing
    prompts, batch, field = await api._off_loop(request, prompts_of, st, body)
    if body.model_of_each is not None and len(body.model_of_each) != len(prompts):
        raise api.APIError(400, f"lora_path: a list of {len(body.model_of_each)} adapters for {len(prompts)} "
                                f"prompts; give one per prompt (null: the base model), or one name for all",
                           param="lora_path")
    rids = rids_of(body, len(prompts))
    asks = logprob_asks(body, prompts)
    each = sampling_params_of(body, prompts)
    max_tokens = [m for sp, p in zip(each, prompts) for m in max_new_tokens_of(st, sp, [p])]
    params_each = None
    if isinstance(body.sampling_params, list) or len(set(asks)) > 1:  # SGLang's per-prompt lists: each its own
        params_each = [sampling_of(st, body, [p], sp, ask) for sp, p, ask in zip(each, prompts, asks)]
        params = dataclasses.replace(params_each[0], max_tokens=api._run_max_tokens(max_tokens))
    else:
        params = sampling_of(st, body, prompts, ask=asks[0])
    if any(ask.want and ask.start >= 0 and isinstance(p, dict) for ask, p in zip(asks, prompts)):
        raise api.APIError(400, "logprob_start_len: a prompt given as embeddings has no tokens to score",
                           param="logprob_start_len")
    given = body.rid if isinstance(body.rid, str) else None
    rid = given or f"gen-{uuid.uuid4().hex}"
    run_id = rid if given is None else f"{rid}-{uuid.uuid4().hex[:8]}"  # a client's rid may repeat
    fmt = GenerateFormat(st, rid, run_id, params, body, prompts, batch, arrival, asks, rids)
    try:
        return await api._serve(st, request, key, prompts, params, body, fmt, arrival, field,
                                max_tokens=max_tokens, params_each=params_each)
    except api.APIError as e:  # the engine's refusals name its fields: say SGLang's
        raise _named(e) from None


def model_info(st: "api.ServerState") -> dict:
    """SGLang's `/get_model_info`."""
    return {"model_path": st.model_path, "tokenizer_path": st.model_path, "is_generation": True,
            "preferred_sampling_params": dict(st.generation_defaults) or None, "weight_version": st.weight_version,
            "has_image_understanding": False, "has_audio_understanding": False, "model_type": st.cfg.family,
            "served_model_name": st.model_name}


def max_total_num_tokens(cache: dict, num_mla_layers: int, replicas: int = 1) -> Optional[int]:
    """The tokens the engine's arenas hold (`cache`: its `cache_config()`, units summed over `replicas` data-parallel
    replicas, as `max_running_requests`' rows are): not units x page size -- a unit is one MLA layer's page, so that
    counted each token once per MLA layer. None before the engine reports, or without MLA layers."""
    if not cache.get("num_gpu_blocks"):
        return None
    each = cache_tokens(cache["num_gpu_blocks"] // replicas, cache.get("kda_slot_units", 0), cache["block_size"],
                        num_mla_layers)
    return None if each is None else each * replicas


def server_info(st: "api.ServerState") -> dict:
    """SGLang's `/get_server_info`: the serving limits and the scheduler's state now (`internal_states`)."""
    from k3jax import __version__

    stats = st.engine_stats()
    cache = stats.get("cache_config", {})
    base = stats.get("arena_baseline_free_units") or 0
    reclaimable = stats.get("arena_free_units", 0) + stats.get("arena_cached_units", 0)  # cached pages: evictable
    return {"version": __version__, "model_path": st.model_path, "served_model_name": st.model_name,
            "context_length": st.max_model_len, "max_running_requests": st.capacity,
            "page_size": cache.get("block_size"),
            "max_total_num_tokens": max_total_num_tokens(cache, getattr(st.cfg, "num_mla_layers", 0),
                                                         stats.get("data_parallel_size", 1)),
            "internal_states": [{"num_running_reqs": stats.get("num_requests_running", 0),
                                 "num_waiting_reqs": stats.get("num_requests_waiting", 0),
                                 "token_usage": round(1.0 - reclaimable / base, 4) if base else 0.0,
                                 "cache_hit_tokens": stats.get("prefix_cache", {}).get("hit_tokens"),
                                 "requests_in_flight": st.requests_in_flight}]}


def register(app: FastAPI, st: "api.ServerState", authenticate, ready, responses: dict) -> None:
    """Add SGLang's routes to the app: generation behind its key check and readiness, the info routes behind
    readiness."""

    async def get_model_info(_r: None = Depends(ready)):
        return model_info(st)

    for path in ("/get_model_info", "/model_info"):  # (newer SGLang's name; slime reads it first)
        app.add_api_route(path, get_model_info, methods=["GET"], responses=responses, operation_id=path.strip("/"))

    @app.get("/get_weight_version", responses=responses)
    async def get_weight_version():
        """SGLang's: the weights' version now (RL loops check a weight sync with it)."""
        return {"weight_version": st.weight_version}

    async def get_server_info(_r: None = Depends(ready)):
        return server_info(st)

    for path in ("/get_server_info", "/server_info"):
        app.add_api_route(path, get_server_info, methods=["GET"], responses=responses,
                          operation_id=path.strip("/"))

    @app.post("/generate", responses=responses)
    async def generate_route(body: GenerateRequest, request: Request, key: str = Depends(authenticate),
                             _r: None = Depends(ready)):
        """SGLang's native generation API: text, token ids or vectors in; text, `output_ids` and `meta_info`
        (finish reason, token counts, logprobs) out; streamed as SSE."""
        return await generate(st, request, key, body)
