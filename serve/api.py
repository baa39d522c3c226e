"""OpenAI-compatible HTTP API on FastAPI: `create_app(async_engine, model_name, ...)`.

Endpoints
  POST /v1/completions        text completion (prompt: string, token ids, or a batch of either)
  POST /v1/chat/completions   chat (the model family's chat template: K3, Kimi-Linear, or the byte presets')
  POST /v1/responses          OpenAI's Responses API, translated to and from chat (serve/responses.py)
  GET, DELETE /v1/responses/{id}   a stored response (kept in memory for previous_response_id)
  GET  /v1/models, /v1/models/{id}
  GET  /health                503 until the engine is warmed up, 200 after (503 again if the engine died);
                              GET|POST /ping the same (SageMaker's); GET /health_generate also generates (SGLang's)
  GET  /version               {"version"} (vLLM's)
  POST /invocations, GET /load   SageMaker's route (a chat or a completion body), vLLM's server load
  GET  /metrics               Prometheus text (serve/metrics.py)
  POST /tokenize, /detokenize, GET /tokenizer_info (vLLM's shapes)
  POST /reset_prefix_cache    forget every cached prefix (vLLM's; GET|POST /flush_cache: SGLang's name)
  POST /generate, GET /get_model_info, GET /get_server_info (/server_info)   SGLang's (serve/sglang_api.py)
  POST /abort_request         {"rid"} or {"abort_all": true}: end requests in flight (SGLang's)
  with --enable-sleep-mode: POST /sleep?level=1|2, POST /wake_up[?tags=weights|kv_cache], GET /is_sleeping
                              (vLLM's), POST /update_weights_from_disk {"model_path"} (SGLang's),
                              POST /pause?mode=abort|wait|keep[&clear_cache=false], POST /resume, GET /is_paused (vLLM's),
                              SGLang's memory, pause and weight-version routes, GET|POST /get_weights_by_name,
                              POST /update_weights_from_tensor (serve/named_weights.py)
  with --allow-runtime-lora-updating: POST /v1/load_lora_adapter, /v1/unload_lora_adapter (vLLM's),
                              POST /load_lora_adapter, /load_lora_adapter_from_tensors, /unload_lora_adapter (SGLang's)
  with --profiler-dir: POST /start_profile, /stop_profile (vLLM's; serve/profiler.py)
  GET  /openapi.json          the schema (FastAPI; GET /docs, /redoc: its pages)

Both generation endpoints stream with SSE (`stream: true`): `data: {json}` events ending with
`data: [DONE]`, plus a final usage chunk with `stream_options.include_usage`. A client that disconnects
(mid-stream or while waiting for a non-streamed answer) has its engine requests aborted at once, which
frees their cache memory.

Structured outputs (both endpoints, serve/structured.py): OpenAI's `response_format` (`json_object`,
`json_schema`), vLLM's `structured_outputs` ({json | regex | choice | grammar | json_object}) and its
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`; one per request. On a K3 chat
prompt that thinks, the constraint applies to the answer after the reasoning.

Errors always use OpenAI's body `{"error": {"message", "type", "param", "code"}}` with a 4xx status for
every client fault: malformed JSON, unknown or mistyped fields, bad sampling values (400), unknown
model (404), a prompt over the context window (400; the message gives both numbers), oversized body
(413), missing/wrong API key (401), per-key rate limit (429 + Retry-After), full queue (503 +
Retry-After).

Admission control: a request is admitted when the sequences in flight (requests x n x prompts) stay
within the engine's decode capacity (`max_num_seqs`) plus `max_waiting`; otherwise 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import os
import time
import uuid
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Literal, Mapping, Optional, Sequence, Union

import jax.numpy as jnp
import numpy as np
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse as _JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.auth import KeyStore, Limits, RateLimited, RateLimiter
from serve.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from serve.reasoning import RESPONSE_START, THINK_END, ChannelSplitter, reasoning_token_count, split_reasoning
from serve.beam_search import BeamSearchParams
from serve.chat import chat_ids
from serve import prompt_embeds
from serve.async_engine import EngineDead, merge_delta
from serve.engine import EngineSleeping, StepFailed
from serve.named_weights import WeightNameError
from serve.profiler import Profiler, ProfilerError
from serve.lora import LoRAError, LoRARequest
from serve.routed_experts import to_base64
from serve.responses import (LOGPROBS_INCLUDE, ResponseEvents, ResponseStore, flat_tool, input_items,
                             response_object, to_chat, turn_starts)
from serve.tools import CallStream, ToolPlan, cut_calls, parse_calls, parse_k2_calls, plan_tools, split_k2_section
from serve.types import (MAX_STOP, CompletionOutput, Logprob, RequestError, RequestOutput, RequestOutputKind,
                         SamplingParams, StructuredOutputsParams, TokenLogprobs, loggable)

log = logging.getLogger(__name__)

__all__ = ["create_app", "ServerState", "APIError"]

MAX_N = 16  # choices per prompt
MAX_BATCH = 16  # prompts per completion request
# GET /health_generate (SGLang's): a server that streamed output this recently is healthy without a probe;
# else a one-token generation must finish within the timeout
HEALTH_RECENT_S = 5.0
HEALTH_GENERATE_TIMEOUT_S = 20.0
DEFAULT_MAX_BODY = 1 << 20
LOGPROB_FLOOR = -9999.0  # JSON has no -inf


# ---- errors ------------------------------------------------------------------------------------

class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}


def json_text(obj, separators=(",", ":")) -> str:
    """`obj` as JSON text, non-ASCII characters as they are; a lone surrogate a request sent (JSON's "\\ud800", not
    encodable as UTF-8) echoed back in an error message, a `rid`, a `user` or `metadata` made the response's encode
    fail (a 500, or a stream cut off): then every non-ASCII character is escaped (the same JSON value)."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=separators)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return json.dumps(obj, allow_nan=False, separators=separators)
    return text


class JSONResponse(_JSONResponse):
    """Starlette's JSONResponse rendered by `json_text` (lone surrogates escaped)."""

    def render(self, content) -> bytes:
        return json_text(content).encode("utf-8")


def _error_body(message: str, type: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(_error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                 415: "invalid_request_error", 429: "rate_limit_error", 503: "server_overloaded"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


_ERRORS = {s: {"model": ErrorResponse} for s in (400, 401, 404, 413, 429, 503)}


# ---- request models -----------------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool = Field(True, description="OpenAI's; accepted: the chunks carry no `obfuscation` "
                                                        "padding either way")


class ResponsesStreamOptions(_Strict):
    """OpenAI's Responses `stream_options`."""

    include_obfuscation: bool = Field(True, description="accepted: the events carry no `obfuscation` padding either "
                                                        "way")


class _GenerationFields(_Strict):
    model: Optional[str] = Field(None, description="must be the served model's id when given")
    request_id: Optional[str] = Field(None, min_length=1, max_length=256,
                                      description="vLLM's: the response id's base (cmpl-/chatcmpl-{request_id}); "
                                                  "an X-Request-Id header wins")
    temperature: Optional[float] = Field(None, ge=0, description="0 = greedy; default 1")
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1, description="-1 or 0 disable top-k")
    min_p: Optional[float] = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: Optional[int] = Field(None, ge=-2 ** 63, lt=2 ** 63, description="-1: none (vLLM's)")
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2, description="minus this once per token already generated")
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2, description="minus this per occurrence in the output")
    logit_bias: Optional[dict[str, float]] = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    user: Optional[str] = None
    # vLLM extensions
    repetition_penalty: Optional[float] = Field(None, gt=0, description="1 = off; >1 discourages repeats "
                                                                                "of prompt and output tokens")
    min_tokens: int = Field(0, ge=0, description="no EOS / stop before this many tokens")
    allowed_token_ids: Optional[list[int]] = Field(None, description="sample only among these tokens")
    priority: int = Field(0, gt=-(1 << 30), lt=1 << 30, description="lower is scheduled first (and may preempt "
                                                                      "higher values)")
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=256,
                                      description="only requests with the same salt share cached prefixes (vLLM's)")
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1, description="keep the prompt's last N tokens (-1: "
                                                                       "the context window's worth, vLLM's)")
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=20, description="logprobs of the prompt tokens "
                                                                          "(choices[].prompt_logprobs; chat: top level)")
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = Field(True, description="vLLM's; accepted, changes nothing: the text is the "
                                                                  "tokenizer's own decode (no space added around "
                                                                  "special or added tokens)")
    # structured outputs (serve/structured.py): at most one of these
    response_format: Optional[dict[str, Any]] = Field(
        None, description="{'type': 'text' | 'json_object' | 'json_schema', 'json_schema': {'name', 'schema'}}")
    structured_outputs: Optional[dict[str, Any]] = Field(
        None, description="vLLM's: one of json, regex, choice, grammar, json_object; disable_any_whitespace, "
                          "disable_additional_properties")
    guided_json: Optional[Union[str, dict[str, Any]]] = Field(None, description="vLLM's older name of "
                                                                                  "structured_outputs.json")
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = Field(None, description="vLLM's older name of "
                                                                      "structured_outputs.whitespace_pattern")
    bad_words: Optional[list[str]] = Field(None, description="words never to generate (vLLM's)")
    vllm_xargs: Optional[dict[str, Any]] = Field(
        None, description="vLLM's: SamplingParams.extra_args, the arguments of the server's custom logits "
                          "processors (--logits-processors); a request setting one of a processor's names uses it")
    return_tokens_as_token_ids: Optional[bool] = Field(
        None, description="vLLM's: logprobs name tokens as 'token_id:{id}' instead of their text (tokens that are "
                          "not whole UTF-8 characters stay identifiable); default: the server's "
                          "--return-tokens-as-token-ids")
    return_token_ids: bool = Field(False, description="vLLM's: the prompt's and each choice's token ids in the "
                                                      "response (per delta when streamed)")
    use_beam_search: bool = Field(False, description="vLLM's: a beam search of width n; the choices are its n best "
                                                     "hypotheses, best first (sent when the search ends)")
    length_penalty: float = Field(1.0, description="beam search: scores are cumulative logprob / length ** this")
    # SGLang extension (rollout routing replay)
    return_routed_experts: bool = Field(
        False, description="SGLang's: each choice's `sgl_ext.routed_experts` (once finished): base64 of the int32 "
                           "logical expert ids [positions, MoE layers, experts per token] every position fed through "
                           "the model was routed to (needs --enable-return-routed-experts)")
    routed_experts_start_len: int = Field(0, ge=0, description="SGLang's: routed experts from this position on")


class CompletionRequest(_GenerationFields):
    prompt: Optional[Union[str, list[int], list[str], list[list[int]]]] = Field(
        None, description="text or token ids, one prompt or a list (needed unless prompt_embeds is given)")
    prompt_embeds: Optional[Union[str, list[str]]] = Field(
        None, description="vLLM's (--enable-prompt-embeds): prompts as vectors [length, hidden_size], each one "
                          "base64 string of a torch.save'd tensor, a NumPy .npy or a one-tensor safetensors file; "
                          "their choices come before those of `prompt`")
    max_tokens: Optional[int] = Field(16, ge=0, description="0 only with echo: the prompt alone is answered, scored "
                                                            "with logprobs (OpenAI's and vLLM's; how evaluation "
                                                            "harnesses ask for log-likelihoods)")
    logprobs: Optional[int] = Field(None, ge=0, le=20, description="with echo: also the prompt tokens' logprobs")
    echo: bool = False
    suffix: Optional[str] = Field(None, description="not supported (must be empty)")
    best_of: Optional[int] = Field(None, ge=1, description="only best_of == n is supported")


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class EmbedsContentPart(BaseModel):
    """vLLM's: content given as vectors [length, hidden_size] (base64, as `prompt_embeds` in completions);
    the chat template is rendered around them (--enable-prompt-embeds)."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["prompt_embeds"]
    data: str


class ChatMessage(BaseModel):
    # Clients echo assistant messages back with fields such as `refusal`: ignore unknown keys here.
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[Union[TextContentPart, EmbedsContentPart]]]] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1, description="default: the generation config's max_new_tokens (cut to the context left), else the rest of the context window")
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[dict[str, Any]]] = Field(None, description="functions the model may call "
                                                                     "(serve/tools.py: JSON call format)")
    tool_choice: Optional[Union[str, dict[str, Any]]] = Field(
        None, description="'none' | 'auto' (default with tools) | 'required' | {'type': 'function', 'function': "
                          "{'name'}}; required and named calls are constrained to the functions' schemas")
    parallel_tool_calls: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="the last message (an assistant's) is left open and "
                                                            "continued: a prefilled answer start (vLLM's; needs "
                                                            "add_generation_prompt false)")
    reasoning_effort: Optional[str] = Field(None, description="K3: low | high | max (the thinking effort; "
                                                              "chat_template_kwargs.thinking_effort); OpenAI's "
                                                              "minimal | medium | xhigh are low | high | max, none "
                                                              "turns thinking off")
    chat_template_kwargs: Optional[dict[str, Any]] = Field(
        None, description="thinking (K3), thinking_effort (K3), default_system; other keys (and K3's for other "
                          "families) are left out (vLLM's)")
    include_reasoning: bool = Field(True, description="vLLM's: false leaves K3's reasoning (the think channel) out "
                                                      "of the answer")
    echo: bool = Field(False, description="vLLM's: each answer starts with the last message's content when that "
                                          "message has the answer's role (the assistant's; any with "
                                          "add_generation_prompt false)")
    # OpenAI's fields with nothing to change here: accepted and ignored (as vLLM ignores them), not refused as unknown
    store: Optional[bool] = Field(None, description="OpenAI's; accepted, nothing is stored (no chat completion "
                                                    "retrieval here)")
    metadata: Optional[dict[str, str]] = Field(None, description="OpenAI's tags of a stored completion; accepted, "
                                                                 "ignored")
    service_tier: Optional[Literal["auto", "default", "flex", "scale", "priority"]] = Field(
        None, description="OpenAI's; accepted, every request is served alike")
    prediction: Optional[dict[str, Any]] = Field(None, description="OpenAI's predicted output (a latency hint: the "
                                                                   "answer is the same); accepted, ignored")
    modalities: Optional[list[str]] = Field(None, description="OpenAI's; only [\"text\"]: audio output is refused")
    audio: Optional[dict[str, Any]] = Field(None, description="OpenAI's audio output: refused (text only)")


class ResponsesRequest(_Strict):
    """OpenAI's Responses API request (the fields this server serves; serve/responses.py)."""

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    stream: bool = False
    stream_options: Optional[ResponsesStreamOptions] = Field(None, description="only with stream: true")
    tools: Optional[list[dict[str, Any]]] = Field(None, description="function tools (flat: type, name, parameters)")
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = Field(None, description="{'format': {'type': 'text' | 'json_object' | "
                                                             "'json_schema', 'name', 'schema'}}")
    reasoning: Optional[dict[str, Any]] = Field(None, description="{'effort': K3's low | high | max, or OpenAI's "
                                                                   "minimal | medium | xhigh | none (as reasoning_effort)}")
    previous_response_id: Optional[str] = Field(None, description="continue the conversation of a stored response "
                                                                   "(its instructions are not carried over)")
    store: Optional[bool] = Field(None, description="default true: keep the response in server memory (per API key, "
                                                    "LRU) for previous_response_id and GET /v1/responses/{id}")
    request_id: Optional[str] = Field(None, min_length=1, max_length=256,
                                      description="vLLM's: the response's id, as given (default resp_<random>); "
                                                  "a repeated id replaces the stored response of that id")
    truncation: Optional[Literal["disabled", "auto"]] = Field(
        None, description="'disabled' (the default): a conversation longer than the context is a 400; 'auto': its "
                          "first turns are dropped until it fits (with max_output_tokens when given)")
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    # OpenAI's fields with nothing to change here: accepted and echoed (as vLLM's), or refused naming why
    background: Optional[bool] = Field(None, description="only false: a response is served within its request "
                                                         "(no background runs to poll)")
    service_tier: Optional[Literal["auto", "default", "flex", "scale", "priority"]] = Field(
        None, description="accepted, echoed: every request is served alike")
    prompt_cache_key: Optional[str] = Field(None, description="accepted, echoed: the prefix cache is shared by "
                                                              "every request with the same cache_salt anyway "
                                                              "(vLLM ignores it too)")
    prompt_cache_retention: Optional[str] = Field(None, description="only 'in_memory' (cached prefixes live in "
                                                                    "device / host memory, evicted as needed)")
    safety_identifier: Optional[str] = Field(None, description="accepted, echoed (as `user`)")
    max_tool_calls: Optional[int] = Field(None, ge=1, description="accepted, echoed: it caps built-in tool calls, "
                                                                  "and there are none here (vLLM's)")
    prompt: Optional[dict[str, Any]] = Field(None, description="refused: no stored prompt templates (vLLM's)")
    conversation: Optional[Union[str, dict[str, Any]]] = Field(None, description="refused: no Conversations API "
                                                                                 "(use previous_response_id)")
    priority: int = Field(0, gt=-(1 << 30), lt=1 << 30, description="lower is scheduled first (vLLM's)")
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=256,
                                      description="only requests with the same salt share cached prefixes (vLLM's)")
    include: Optional[list[str]] = Field(None, description="'message.output_text.logprobs': the answer's token "
                                                           "logprobs in its output_text part (and streamed deltas)")
    top_logprobs: Optional[int] = Field(None, ge=0, le=20, description="alternatives per token with the logprobs "
                                                                       "(implies them)")
    # vLLM's ResponsesRequest extensions: sampling fields, as the chat request's
    top_k: Optional[int] = Field(None, ge=-1, description="-1 or 0 disable top-k")
    seed: Optional[int] = Field(None, ge=-2 ** 63, lt=2 ** 63)
    stop: Optional[Union[str, list[str]]] = None
    repetition_penalty: Optional[float] = Field(None, gt=0)
    logit_bias: Optional[dict[str, float]] = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @field_validator("tools", mode="before")
    @classmethod
    def _flat_tools(cls, tools):
        """Chat-style function tools taken as the flat ones (vLLM's); echoed flat (OpenAI's shape)."""
        return [flat_tool(t) for t in tools] if isinstance(tools, list) else tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _flat_choice(cls, choice):
        """A chat-style named choice (`{"type": "function", "function": {"name"}}`) taken as the flat one."""
        return flat_tool(choice)


class UpdateWeightsRequest(_Strict):
    model_path: str
    weight_version: Optional[str] = Field(None, min_length=1, max_length=256,
                                          description="SGLang's: the served weights' version from now on "
                                                      "(/get_model_info, /generate's meta_info)")
    abort_all_requests: bool = Field(False, description="SGLang's: abort the requests in flight first")
    flush_cache: bool = Field(True, description="SGLang's; the prefix cache is cleared whatever it says (its "
                                                "states came from the old weights)")


class UpdateWeightVersionRequest(_Strict):
    new_version: str = Field(min_length=1, max_length=256)
    abort_all_requests: bool = False


class WeightsByNameRequest(_Strict):
    """SGLang's /get_weights_by_name body."""
    name: str = Field(min_length=1, max_length=1024, description="a checkpoint tensor name, as the model's "
                                                                 "safetensors files name it")
    truncate_size: Optional[int] = Field(100, ge=0, description="its first rows only (null: all of it)")


class UpdateWeightsFromTensorRequest(_Strict):
    """SGLang's /update_weights_from_tensor body, with tensors this server can read: safetensors files."""
    serialized_named_tensors: list[str] = Field(min_length=1, description="base64 safetensors files of named "
                                                                          "checkpoint tensors, applied together")
    load_format: Optional[str] = Field(None, description="'safetensors' (SGLang's torch IPC handles cannot reach "
                                                         "a JAX server)")
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = Field(None, min_length=1, max_length=256)


class MemoryOccupationRequest(_Strict):
    """SGLang's /release_memory_occupation and /resume_memory_occupation body."""
    tags: Optional[list[Literal["weights", "kv_cache", "cuda_graph"]]] = Field(
        None, description="the parts to release or take back (default all; cuda_graph: nothing to do here)")


class PauseGenerationRequest(_Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


def _safetensors_items(text: str, field: str) -> list[tuple[str, Any]]:
    """A base64 safetensors file -> its (name, array) pairs (bfloat16 kept: read with JAX's numpy types)."""
    import base64
    import binascii

    from safetensors.flax import load

    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{field}: not base64 ({e})") from None
    try:
        return [(name, np.asarray(a)) for name, a in load(data).items()]
    except Exception as e:  # noqa: BLE001 - any parse failure is the request's fault
        raise ValueError(f"{field}: not a safetensors file ({type(e).__name__}: {e})") from None


def _memory_tags(body: Optional[MemoryOccupationRequest]) -> Optional[list[str]]:
    """The engine's tags of an SGLang memory request: None for all; "cuda_graph" dropped (compiled programs
    stay where they are)."""
    if body is None or not body.tags:
        return None
    return sorted({t for t in body.tags if t != "cuda_graph"}) or []


class AbortRequestBody(_Strict):
    """SGLang's /abort_request body."""
    rid: Optional[str] = Field(None, description="the request's id: its response id (cmpl-..., chatcmpl-..., "
                                                 "resp_...) or the X-Request-Id / request_id the client gave; \"\" "
                                                 "(SGLang's default, sent with abort_all) is none")
    abort_all: bool = Field(False, description="every request in flight of this API key")


class LoadLoRARequest(_Strict):
    """vLLM's /v1/load_lora_adapter body."""
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = Field(False, description="replace the adapter loaded under lora_name (vLLM's)")


class SGLangLoadLoRARequest(_Strict):
    """SGLang's /load_lora_adapter body (`pinned`: accepted; this engine's slots are taken by use, LRU)."""
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)
    pinned: bool = False


class LoadLoRAFromTensorsRequest(_Strict):
    """SGLang's /load_lora_adapter_from_tensors body: the adapter's tensors as base64 safetensors files named
    as PEFT saves them (one or a list), its PEFT config as `config_dict`."""
    lora_name: str = Field(min_length=1, max_length=256)
    config_dict: dict
    serialized_tensors: Union[str, list[str]]
    load_format: Optional[str] = None
    pinned: bool = False
    added_tokens_config: Optional[dict] = None


class UnloadLoRARequest(_Strict):
    """vLLM's /v1/unload_lora_adapter body (`lora_int_id` is accepted and ignored: names identify adapters)."""
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: Optional[int] = None


class TokenizeRequest(_Strict):
    model: Optional[str] = None
    prompt: Optional[str] = None
    add_special_tokens: bool = Field(True, description="vLLM's; adds nothing: the Kimi tokenizers' encode adds no "
                                                       "special token ([BOS] is never prepended), as prompts are "
                                                       "encoded for generation")
    return_token_strs: bool = Field(False, description="vLLM's: `token_strs`, each id as HF's convert_ids_to_tokens "
                                                       "writes it")
    messages: Optional[list[ChatMessage]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = Field(None, description="vLLM's: the functions rendered as a chat "
                                                                   "request with tool_choice auto renders them")


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]


# ---- server state -------------------------------------------------------------------------------

def system_fingerprint(eng) -> str:
    """The `system_fingerprint` of completions and chat completions: vLLM's (its default `--fingerprint-mode full`,
    `vllm-<version>-<hash8>`), `k3jax-<version>-<hash8>`, hash8 the start of a SHA-256 of the served model's
    configuration, its dtype and the engine's plain-valued settings (KV-cache dtype, logprobs mode, ...): what
    OpenAI's field is for, telling a client when the backend that answers changed."""
    from k3jax import __version__

    plain = (str, int, float, bool, type(None))  # (not callables: their repr changes from run to run)
    factors = {"model": vars(eng.cfg), "dtype": str(getattr(getattr(eng, "model", None), "dtype", None)),
               "engine": {k: v for k, v in vars(eng.config).items() if isinstance(v, plain)}}
    digest = hashlib.sha256(json.dumps(factors, sort_keys=True, default=str).encode()).hexdigest()
    return f"k3jax-{__version__}-{digest[:8]}"


class ServerState:
    """What the routes share: the engine (attached once warm), admission counters, limits, metrics."""

    def __init__(self, model_name, api_keys=None, limits: Optional[Limits] = None,
                 max_waiting: Optional[int] = 256, max_model_len: Optional[int] = None):
        # vLLM's --served-model-name takes several names: requests may name any, responses carry the first
        self.model_names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
        self.model_name = self.model_names[0]
        if isinstance(api_keys, str):  # one key (vLLM's `api_key`), not its characters
            api_keys = [api_keys]
        keys = dict(api_keys) if isinstance(api_keys, dict) else {k: Limits() for k in (api_keys or [])}
        self.keys = KeyStore(keys)
        self.limiter = RateLimiter(limits or Limits(), keys)
        self.max_waiting = max_waiting
        self.max_model_len = max_model_len
        self.engine = None
        self.embeds_dtype = None  # set by `attach` when the engine takes prompt embeddings
        # set by `attach` for a mesh over several processes, whose embedding table no process holds whole
        self.multi_process = False
        self.ready = False
        self.sleeping = False  # POST /sleep released the engine's device memory; /wake_up takes it back
        # POST /pause: new generation requests wait (not admitted, so not in flight) until POST /resume
        self.paused = False
        self.requests_held = 0  # waiting for /resume
        # /pause_generation mode=retract: the engine holds the requests in flight without memory (weights may change)
        self.retracted = False
        self.weight_version = "default"  # SGLang's: names the weights served (set with a weight update)
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.error: Optional[str] = None
        self.system_fingerprint: Optional[str] = None  # set by `attach` (see system_fingerprint)
        self.created = int(time.time())
        self.requests_in_flight = 0
        self.seqs_in_flight = 0
        self.runs: dict[str, list] = {}  # response id -> the _Runs in flight under it (ids may repeat)
        self.grammar_pool: Optional[ThreadPoolExecutor] = None  # (`compile_constraint`)
        self.last_output = -math.inf  # monotonic time of the latest engine output a request received
        self.shutting_down = False  # SIGTERM / SIGINT: no new requests; those in flight drain or are aborted
        self.request_log: Optional[Callable[[str], None]] = None  # vLLM's --enable-log-requests: says a line
        self.metrics = ServerMetrics(self.model_name, self.engine_stats, self._frontend, max_model_len,
                                     each=self.replica_stats)

    # ---- engine ----
    def attach(self, async_engine) -> None:
        """Attach a warmed-up AsyncEngine; from now on /health answers 200."""
        eng = async_engine.engine
        self.engine = async_engine
        self.tokenizer = getattr(eng, "tokenizer", None)
        self.cfg = eng.cfg
        self.max_model_len = eng.config.max_model_len
        self.metrics.size_token_buckets(self.max_model_len)
        for i in range(getattr(async_engine, "data_parallel_size", 1)):
            self.metrics.engine(i)  # every data-parallel replica's request series, from the start (vLLM's)
        self.max_logprobs = eng.config.max_logprobs
        self.routed_experts = bool(getattr(eng.config, "enable_return_routed_experts", False))
        self.hidden_states = bool(getattr(eng.config, "enable_return_hidden_states", False))
        # rows that run at once (summed over data-parallel replicas)
        self.capacity = int(getattr(async_engine, "capacity", None) or eng.decode_buckets[-1])
        self.vocab_size = int(self.cfg.vocab_size)
        # prompts given as vectors are decoded into this dtype (None: the engine does not take them)
        self.embeds_dtype = eng.model.dtype if getattr(eng.config, "enable_prompt_embeds", False) else None
        self.multi_process = getattr(eng, "channel", None) is not None
        self.generation_defaults = dict(getattr(eng, "generation_defaults", None) or {})
        # vLLM's override_max_tokens: a generation config given as a directory (not the model's own, "auto") caps
        # every request's max_tokens at its max_new_tokens, a given one too
        setting = getattr(eng.config, "generation_config", None)
        self.max_tokens_cap = (self.generation_defaults.get("max_tokens")
                               if isinstance(setting, str) and setting not in ("auto", "vllm") else None)
        self.system_fingerprint = system_fingerprint(eng)
        fam = getattr(self.tokenizer, "chat_family", None)
        self.chat_family = fam or {"kimi_k3": "k3", "kimi_linear": "kimi_linear"}.get(self.cfg.family, "byte")
        self.ready = True

    def fail(self, message: str) -> None:
        self.error = message
        self.ready = False

    @property
    def healthy(self) -> bool:
        if not self.ready or self.engine is None or self.shutting_down:
            return False
        return bool(getattr(self.engine, "alive", True)) and not getattr(self.engine, "errored", False)

    def engine_stopped(self) -> str:
        """Why an attached engine serves no more (its `dead_error`: shut down, or dead after failing step after
        step), for /health and the 503s."""
        dead = getattr(self.engine, "dead_error", None) if getattr(self.engine, "errored", False) else None
        return str(dead) if dead is not None else "the engine stopped"

    def token_embeddings(self, ids: list[int]) -> "np.ndarray":
        """Rows of the served model's embedding table [len(ids), H] in the prompt-embeddings dtype."""
        table = self.engine.engine.model.params["embed_tokens"][...]
        return np.asarray(jnp.take(table, jnp.asarray(ids, jnp.int32), axis=0)).astype(self.embeds_dtype)

    def engine_stats(self) -> dict:
        eng = self.engine
        return {} if eng is None else _read_stats(lambda: dict(eng.stats()), {})

    def replica_stats(self) -> list | dict:
        """Each data-parallel replica's own statistics (its /metrics series carry its index as `engine`), or a
        disaggregated pair's by engine label ({"0": decode, "prefill": prefill}); [] for one engine."""
        each = getattr(self.engine, "replica_stats", None)
        if each is None:
            return []
        return _read_stats(lambda: _copied_stats(each()), [])

    def _frontend(self) -> dict:
        return {"ready": 1 if self.healthy else 0, "requests_in_flight": self.requests_in_flight,
                "sequences_in_flight": self.seqs_in_flight, "paused": int(self.paused),
                "requests_held": self.requests_held}

    # ---- checks ----
    def check_ready(self) -> None:
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", "server_unavailable", code="shutting_down")
        if not self.healthy:
            msg = self.error or (self.engine_stopped() if self.ready else "the model is still loading/compiling")
            raise APIError(503, f"server not ready: {msg}", "server_unavailable", code="not_ready",
                           headers={"Retry-After": "5"})

    def lora_adapters(self) -> dict:
        """Loaded LoRA adapters by name (serve/lora.py), each served as a model of its own name."""
        registry = getattr(getattr(self.engine, "engine", None), "loras", None)
        for _ in range(5):  # the engine thread may load or unload one while we copy
            try:
                return dict(registry.by_name) if registry is not None else {}
            except RuntimeError:
                continue
        return {}

    def check_model(self, model: Optional[str]) -> Optional[str]:
        """-> the LoRA adapter that `model` names, or None for the base model (or no `model`); 404 else."""
        if model is None or model in self.model_names:
            return None
        adapters = self.lora_adapters()
        if model in adapters:
            return model
        also = f" and the LoRA adapters {', '.join(f'`{a}`' for a in sorted(adapters))}" if adapters else ""
        raise APIError(404, f"The model `{model}` does not exist. This server serves `{self.model_name}`{also}.",
                       "not_found_error", "model", "model_not_found")

    def pause(self) -> None:
        self.paused = True
        self._resumed.clear()

    def resume(self) -> None:
        self.paused = False
        self._resumed.set()

    async def unpaused(self) -> None:
        """Return at once, or when POST /resume ends a pause (a request arriving while paused waits here)."""
        self.requests_held += 1
        try:
            while self.paused and not self.shutting_down:
                await self._resumed.wait()
        finally:
            self.requests_held -= 1
        if self.shutting_down:  # held by a pause when the shutdown began: never admitted
            self.check_ready()

    def start_shutdown(self) -> int:
        """Refuse new requests from now on (503, /health too) and release those a pause holds -> the requests
        in flight, which the caller lets finish or aborts (`abort_runs(None, None)`)."""
        self.shutting_down = True
        self._resumed.set()
        return self.requests_in_flight

    async def drained(self) -> None:
        """Return when no admitted request is in flight (each has finished, or ended by an abort)."""
        while self.requests_in_flight:
            await asyncio.sleep(0.02)

    def admit(self, key: str, seqs: int, tokens: int, charge: bool = True):
        """Admit a request of `seqs` sequences reserving `tokens` (a rate-limit ticket), or raise 429 / 503; `charge`
        False: only refuse one that admission would refuse whatever it asks (the key's window or the queue is
        full), which the generation routes check first, before the costly work of tokenizing its prompt or
        compiling its constraint (seconds of CPU a refused burst made the server do anyway)."""
        if self.shutting_down:
            self.check_ready()
        if self.sleeping:
            raise APIError(503, "the engine is sleeping (POST /wake_up first)", "server_unavailable",
                           code="engine_sleeping", headers={"Retry-After": "5"})
        cap = self.capacity + (self.max_waiting if self.max_waiting is not None else math.inf)
        if seqs > cap:
            raise APIError(400, f"the request needs {seqs} sequences but this server runs at most {cap} "
                                f"at once (running + waiting)", param="n")
        if self.seqs_in_flight + seqs > cap:
            self.metrics.rejected("queue_full")
            raise APIError(503, f"server busy: {self.seqs_in_flight} sequences in flight, the queue is full "
                                f"({self.capacity} running + {self.max_waiting} waiting); retry later",
                           "server_overloaded", code="queue_full", headers={"Retry-After": "1"})
        try:
            ticket = self.limiter.admit(key, tokens, charge=charge)
        except RateLimited as e:
            self.metrics.rejected("rate_limit")
            raise APIError(429, e.message, "rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(e.retry_after)}) from None
        if charge:
            self.seqs_in_flight += seqs
            self.requests_in_flight += 1
        return ticket

    async def compile_constraint(self, grammars, constraint: StructuredOutputsParams) -> None:
        """Compile a request's output constraint off the engine's thread, on vLLM's pool of (CPUs + 1) // 2
        threads: a flood of schemas that take seconds each (thousands of properties) then holds half the host's
        CPUs at most, not every thread of asyncio's default pool (CPUs + 4), which starved the engine's."""
        if self.grammar_pool is None:
            self.grammar_pool = ThreadPoolExecutor(max(1, ((os.cpu_count() or 1) + 1) // 2),
                                                   thread_name_prefix="k3jax-grammar")
        await asyncio.get_running_loop().run_in_executor(self.grammar_pool, grammars.compile, constraint)

    def release(self, seqs: int) -> None:
        self.seqs_in_flight -= seqs
        self.requests_in_flight -= 1

    def track(self, run: "_Run") -> None:
        for rid in run.ids():
            self.runs.setdefault(rid, []).append(run)

    def untrack(self, run: "_Run") -> None:
        for rid in run.ids():
            held = self.runs.get(rid, [])
            if run in held:
                held.remove(run)
            if not held:
                self.runs.pop(rid, None)

    def abort_runs(self, key: Optional[str], rid: Optional[str]) -> int:
        """End the requests in flight of API key `key` (None: whoever sent them) whose response id is `rid` (or
        `cmpl-` / `chatcmpl-` + `rid`: the id the client gave; or one prompt's id of SGLang's per-prompt `rid`
        list: that prompt only), or all of them when `rid` is None -> how many had work left."""
        ids = list(self.runs) if rid is None else [rid, f"cmpl-{rid}", f"chatcmpl-{rid}"]
        runs = {id(run): run for i in ids for run in self.runs.get(i, ()) if key is None or run.key == key}
        return sum(run.abort(rid) for run in runs.values())


# ---- helpers ------------------------------------------------------------------------------------

def _finite_lp(x: float) -> float:
    x = float(x)
    return x if math.isfinite(x) and x > LOGPROB_FLOOR else LOGPROB_FLOOR


# OpenAI's deprecated chat fields, refused with what replaces them (clients written for the old API send them)
_DEPRECATED = {"functions": "OpenAI's deprecated field; give the functions as `tools`",
               "function_call": "OpenAI's deprecated field; use `tool_choice`"}


# pydantic's labels of union members in an error's location, besides the generic ones ("list[int]", "dict[str,any]")
_UNION_TAGS = {"str", "int", "float", "bool", "TextContentPart", "EmbedsContentPart"}


def _union_tag(part) -> bool:
    """Whether a part of an error's location is pydantic's label of a union member, not a field."""
    return isinstance(part, str) and ("[" in part or part in _UNION_TAGS)


def _field_loc(e: dict) -> list:
    """A validation error's location in the request's body, query or path, without that part's name (a `/sleep?level=x`
    was a 400 naming `query.level`)."""
    loc = list(e.get("loc", ()))
    return loc[1:] if loc and loc[0] in ("body", "query", "path") else loc


def _union_at(errs: list[dict], loc: list) -> Optional[list]:
    """The location of the union field an error (at `loc`) is about, when the error is one of its members': pydantic
    reports one error per member, labelled at the same place (a dict key such as "str" is not a label); else None."""
    for at, part in enumerate(loc):
        if _union_tag(part):
            labels = {x[at] for x in map(_field_loc, errs) if len(x) > at and x[:at] == loc[:at] and _union_tag(x[at])}
            if len(labels) > 1:
                return loc[:at + 1]
    return None


def _union_message(errs: list[dict], loc: list) -> tuple[str, str]:
    """A value that fits no member of a union field (`loc`: the field's location, then a member's label): the 400
    names the field, the members it may be, and the most specific error (the field was named "prompt.str" for a
    `{"prompt": 5}`, and the error was the first member's)."""
    at = len(loc) - 1
    field = loc[:at]
    mine = [(x, e) for x, e in zip(map(_field_loc, errs), errs)
            if len(x) > at and x[:at] == field and _union_tag(x[at])]
    kinds = " or ".join(dict.fromkeys(x[at] for x, _ in mine))
    param = ".".join(map(str, field))
    where, e = max(mine, key=lambda m: len(m[0]))
    detail = ".".join(str(p) for p in where if not _union_tag(p))
    more = f" ({detail}: {e.get('msg', 'invalid value')})" if detail != param else ""
    return f"{param}: expected {kinds}{more}", param


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    loc = [str(p) for p in _field_loc(e)]
    if e.get("type") == "json_invalid":
        ctx = e.get("ctx") or {}
        return f"malformed JSON body: {ctx.get('error', e.get('msg', ''))}", None
    if e.get("type") == "missing" and not loc:
        return "a JSON request body is required", None
    union = _union_at(errs, _field_loc(e))
    if union is not None:
        return _union_message(errs, union)
    param = ".".join(loc) or None
    msg = e.get("msg", "invalid value")
    if e.get("type") == "extra_forbidden":
        msg = _DEPRECATED.get(param, "unknown field (not part of this API)")
    more = f" (and {len(errs) - 1} more errors)" if len(errs) > 1 else ""
    return (f"{param}: {msg}" if param else msg) + more, param


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


class _ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, coro):
    """Run `coro`; if the client disconnects first, cancel it and raise `_ClientGone`."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:
        pass
    raise _ClientGone()


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator and runs `on_close`, however it ends
    (normal end, client disconnect, send error): the engine requests are aborted at once."""

    media_type = "text/event-stream"

    def __init__(self, content, on_close=None, **kw):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            try:
                if aclose is not None:
                    await aclose()
            finally:
                if self._on_close is not None:
                    self._on_close()


def _sse(obj) -> str:
    return f"data: {json_text(obj, None)}\n\n"


# ---- one API request's engine runs -----------------------------------------------------------------

_ACCEPTED = object()  # a _Run queue item: the engine queued that prompt's request


class _Unread:
    """A `_Run`'s (prompt index, item) pairs its consumer has not read yet, in order. A prompt's unread outputs
    coalesce into one (deltas merged by `merge_delta`, a newer cumulative output replacing the older), as the
    engine's own streams do (vLLM's `RequestOutputCollector`): the run's pumps read the engine at once, so a client
    slower than the engine (a slow reader, a stalled socket) otherwise left one output per step queued, unbounded."""

    def __init__(self, delta: bool):
        self.delta = delta
        self.items: deque = deque()  # [prompt index, item] cells
        self.open: dict[int, tuple[list, dict]] = {}  # prompt -> (its unread output's cell, its text pieces)
        self.ready = asyncio.Event()

    def put_nowait(self, pair: tuple) -> None:
        i, item = pair
        held = self.open.get(i)
        if held is not None and isinstance(item, RequestOutput):
            if self.delta:
                merge_delta(held[0][1], item, held[1])
            else:
                held[0][1] = item
        else:
            cell = [i, item]
            self.items.append(cell)
            if isinstance(item, RequestOutput):
                held = self.open[i] = (cell, {})
        if held is not None and held[0][1].finished:  # (a prompt's last output: nothing merges into it)
            self.open.pop(i, None)
            self._join(held)
        self.ready.set()

    async def get(self) -> tuple:
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        cell = self.items.popleft()
        held = self.open.get(cell[0])
        if held is not None and held[0] is cell:
            del self.open[cell[0]]
            self._join(held)
        return cell[0], cell[1]

    @staticmethod
    def _join(held: tuple) -> None:
        """The text pieces merged into an output, joined into its completions' text."""
        (_, out), text = held
        for c in out.outputs:
            if c.index in text:
                c.text += "".join(text[c.index])
        text.clear()


def constraint_failed(why, field: str = "structured_outputs") -> str:
    """The error a request gets when its output constraint failed mid-generation (the engine's finish reason
    "error", `why` llguidance's message): the output so far is not in the constraint's language. `field`: the
    constraint's (`constraint_field`), which the routes turn into the request's own field."""
    return (f"{field}: the constraint failed during generation ({why}); it is too complex for the "
            f"grammar engine: simplify it (fewer optional properties or alternatives, smaller repetition counts)")


def constraint_field(constraint: Optional[StructuredOutputsParams]) -> str:
    """`structured_outputs.<kind>` of a request's constraint (`structured_outputs` without one): what the routes map
    to the client's field (`_constraint_param`; SGLang's `sampling_params.json_schema`, `.regex`, `.ebnf`)."""
    try:
        return f"structured_outputs.{constraint.kind()}" if constraint is not None else "structured_outputs"
    except RequestError:
        return "structured_outputs"


class _Run:
    """The engine requests of one API request (one per prompt), merged into one stream of
    (prompt index, RequestOutput); `close()` cancels them (aborting unfinished ones) and releases the
    admission exactly once.

    The engine sends deltas (`RequestOutputKind.DELTA`: each output holds only the new tokens, text and
    logprobs, a completion only when it has some), so a step's host work does not grow with the length of
    what was generated; the stream formats forward them, and `output(i)` merges them into the whole answer
    (text joined once, when asked). Outputs the consumer has not read yet coalesce (`_Unread`)."""

    def __init__(self, st: ServerState, prompts: list[list[int]], params: SamplingParams, base_id: str,
                 ticket, arrival: float, priority: int = 0, cache_salt: Optional[str] = None,
                 lora: Union[None, str, list[Optional[str]]] = None, engine_params: Optional[BeamSearchParams] = None,
                 response_id: Optional[str] = None, key: Optional[str] = None,
                 max_tokens: Optional[list[Optional[int]]] = None, params_each: Optional[list[SamplingParams]] = None,
                 prompt_ids: Optional[list[str]] = None):
        self.st, self.prompts, self.params, self.base_id = st, prompts, params, base_id
        self.params_each = params_each  # each prompt's own sampling (SGLang's per-prompt list), else `params`
        self.response_id, self.key = response_id or base_id, key  # for /abort_request
        self.prompt_ids = prompt_ids  # each prompt's own id (SGLang's per-prompt `rid` list), also for /abort_request
        # what the engine runs: a beam search (one output, at its end), or `params` sending deltas, each prompt with
        # its own max_tokens when given (an unset one's default, cut to what that prompt's context leaves)
        self.engine_params = engine_params or dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        self.max_tokens = [params.max_tokens] * len(prompts) if max_tokens is None else max_tokens
        self.priority = priority
        self.extra = {"cache_salt": cache_salt} if cache_salt is not None else {}
        # each prompt's LoRA adapter (None: the base model): one for all, or SGLang's per-prompt `lora_path` list
        self.loras = list(lora) if isinstance(lora, list) else [lora] * len(prompts)
        self.ticket, self.arrival = ticket, arrival
        self.nseqs = len(prompts) * params.n
        self.q = _Unread(getattr(self.engine_params, "output_kind", None) == RequestOutputKind.DELTA)
        self.pending: deque = deque()
        self.tasks: list[asyncio.Task] = []
        self._whole: dict[int, RequestOutput] = {}  # prompt -> its deltas merged (text as pieces until asked)
        self._pieces: dict[tuple[int, int], list[str]] = {}  # (prompt, sample) -> text deltas not yet joined
        self.unfinished = set(range(len(prompts)))
        self.accepted: set[int] = set()  # prompts the engine queued (passed its validation)
        self.failed: set[int] = set()  # accepted prompts the engine ended with an error (a failed step)
        self.refused: set[int] = set()  # prompts the engine refused (a RequestError before accepting them)
        self.closed = False
        # per prompt, the samples whose first token / finish the request histograms have seen: vLLM observes each
        # of a request's n samples as a request of its own (as `vllm:request_success` counts them)
        self._started: list[set[int]] = [set() for _ in prompts]
        self._ended: list[set[int]] = [set() for _ in prompts]
        self._token_times: dict[tuple[int, int], list[float]] = {}  # (prompt, sample) -> [first, last] token time
        self.engines = [0] * len(prompts)  # the engine (data-parallel replica) each prompt runs on: its metrics' label
        self._timed: set[int] = set()  # prompts with a sample in `_token_times`
        self._aborted: set[int] = set()  # prompts `abort` was asked to end
        self._finished_at: dict[tuple[int, int], float] = {}  # (prompt, sample) -> when its finishing output arrived

    def start(self) -> None:
        self.st.track(self)
        if self.st.request_log is not None:
            self.st.request_log(_request_line(self))
        for i, ids in enumerate(self.prompts):
            self.tasks.append(asyncio.ensure_future(self._pump(i, ids)))

    def ids(self) -> set[str]:
        """The ids /abort_request finds it by: its response id, and each prompt's own id when it has them."""
        return {self.response_id, *(self.prompt_ids or ())}

    def abort(self, rid: Optional[str] = None) -> bool:
        """End the unfinished engine requests (finish_reason "abort"; their last outputs reach the client as
        usual), only the prompt's when `rid` is one prompt's own id -> whether there were any."""
        left = sorted(self.unfinished)
        if rid is not None and rid != self.response_id and rid in (self.prompt_ids or ()):
            left = [i for i in left if self.prompt_ids[i] == rid]
        self._aborted.update(left)  # (one the engine has not queued yet is aborted again once it has: `_pump`)
        for i in left:
            self.st.engine.abort(f"{self.base_id}-{i}")
        return bool(left)

    async def _pump(self, i: int, ids: list[int]) -> None:
        rid = f"{self.base_id}-{i}"

        def accept() -> None:
            self.engines[i] = _engine_index(self.st.engine, rid)
            self.accepted.add(i)
            self.q.put_nowait((i, _ACCEPTED))
            if i in self._aborted:  # aborted before the engine had it (the engine ignores ids not in flight): now
                self.st.engine.abort(rid)

        params = self.engine_params
        if self.params_each is not None:  # (SGLang's per-prompt sampling_params)
            params = dataclasses.replace(self.params_each[i], output_kind=RequestOutputKind.DELTA,
                                         max_tokens=self.max_tokens[i])
        want = _prompt_max_tokens(params, self.max_tokens[i], self.st.max_model_len, _prompt_len(ids))
        if want != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=want)
        extra = self.extra if self.loras[i] is None else {**self.extra, "lora_request": self.loras[i]}
        gen = self.st.engine.generate(ids, params, rid, priority=self.priority,
                                      on_accept=accept, **extra)
        try:
            async for out in gen:
                self._stamp(i, out)
                self.q.put_nowait((i, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.q.put_nowait((i, e))
        finally:
            await gen.aclose()  # aborts the engine request if it is not finished

    async def _get(self):
        i, item = self.pending.popleft() if self.pending else await self.q.get()
        while item is _ACCEPTED:
            i, item = self.pending.popleft() if self.pending else await self.q.get()
        if isinstance(item, BaseException):
            raise self._failed(i, item)
        self._observe(i, item)
        failed = next((o for o in item.outputs if o.finish_reason == "error"), None)
        if failed is not None:  # vLLM answers its finish reason "error" with an error, never a 200 "stop"
            params = self.params_each[i] if self.params_each is not None else self.params
            raise RequestError(constraint_failed(failed.stop_reason, constraint_field(params.structured_outputs)))
        return i, item

    async def prime(self) -> None:
        """Wait until the engine accepted every prompt (or produced its first output) or one was rejected."""
        seen: set[int] = set()
        while len(seen) < len(self.prompts):
            i, item = await self.q.get()
            if isinstance(item, BaseException):
                raise self._failed(i, item)
            seen.add(i)
            if item is not _ACCEPTED:
                self.pending.append((i, item))

    def _failed(self, i: int, err: BaseException) -> BaseException:
        """Note that prompt i ended with `err` -> err. An error after the engine accepted the prompt (a failed step)
        ends its unfinished samples with vLLM's finish reason "error", not "abort"."""
        if i in self.accepted and not isinstance(err, RequestError):
            self.failed.add(i)
        elif i not in self.accepted and isinstance(err, RequestError):
            self.refused.add(i)
        return err

    async def items(self):
        while self.unfinished:
            yield await self._get()

    def _merge(self, i: int, out: RequestOutput) -> None:
        """Add a delta to prompt i's whole answer (lists extended in place; text kept as pieces)."""
        whole = self._whole.get(i)
        if whole is None:  # the first output: prompt fields, prompt logprobs
            whole = self._whole[i] = dataclasses.replace(out, outputs=[])
        whole.finished, whole.metrics, whole.num_cached_tokens = out.finished, out.metrics, out.num_cached_tokens
        for o in out.outputs:
            c = next((c for c in whole.outputs if c.index == o.index), None)
            if c is None:
                c = dataclasses.replace(o, text="", token_ids=[], logprobs=None if o.logprobs is None else [])
                whole.outputs.append(c)
                whole.outputs.sort(key=lambda c: c.index)
            c.token_ids.extend(o.token_ids)
            if o.logprobs is not None:
                c.logprobs.extend(o.logprobs)
            self._pieces.setdefault((i, o.index), []).append(o.text)
            c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
            c.cumulative_logprob = o.cumulative_logprob
            if o.routed_experts is not None:  # (the finishing delta's: the whole sequence's)
                c.routed_experts = o.routed_experts
            if o.hidden_states is not None:  # (likewise)
                c.hidden_states = o.hidden_states

    def output(self, i: int) -> RequestOutput:
        """Prompt i's whole answer so far (every delta merged)."""
        whole = self._whole[i]
        for c in whole.outputs:
            pieces = self._pieces.get((i, c.index))
            if pieces:
                c.text += "".join(pieces)
                pieces.clear()
        return whole

    def _stamp(self, i: int, out: RequestOutput) -> None:
        """Note each sample's first and last token times as prompt i's outputs arrive, and observe the gap since the
        sample's last output (vLLM's inter-token latency: once per output, a step's tokens, drafts accepted, being
        one gap), before unread ones coalesce (`_Unread`: the newest's times would stand for every token merged
        into it, and a slow client's merged outputs would hide their gaps)."""
        now = time.monotonic()
        # the engine's first token time is the prompt's first sample's: later samples' first tokens are timed here
        ft = getattr(out.metrics, "first_token_time", None) if out.metrics else None
        ft = ft if i not in self._timed else None
        # when the engine made this output's newest tokens (its step's time.monotonic(), the clock used here)
        lt = (getattr(out.metrics, "last_token_time", None) if out.metrics else None) or now
        for o in out.outputs:
            if o.finish_reason is not None:  # vLLM's end-to-end latency ends when the engine's last output arrives
                self._finished_at.setdefault((i, o.index), now)  # (not when a slow client reads it)
            if o.token_ids:
                times = self._token_times.get((i, o.index))
                if times is None:
                    self._token_times[i, o.index] = [ft or lt, lt]
                else:
                    self.st.metrics.engine(self.engines[i]).itl.observe(max(0.0, lt - times[1]))
                    times[1] = lt
                self._timed.add(i)

    def _observe(self, i: int, out: RequestOutput) -> None:
        m, now = self.st.metrics.engine(self.engines[i]), time.monotonic()
        self.st.last_output = now
        self.accepted.add(i)
        self._merge(i, out)
        qs = getattr(out.metrics, "first_scheduled_time", None) if out.metrics else None
        for o in out.outputs:
            j, k = o.index, len(o.token_ids)
            if k > 0:
                if j not in self._started[i]:
                    self._started[i].add(j)
                    m.ttft.observe(max(0.0, self._token_times[i, j][0] - self.arrival))
                    if qs is not None:
                        m.queue.observe(max(0.0, qs - self.arrival))
            if o.finish_reason is not None and j not in self._ended[i]:
                self._ended[i].add(j)
                m.e2e.observe(self._finished_at.get((i, j), now) - self.arrival)
                times = self._token_times.get((i, j))
                if times is not None and qs is not None:  # vLLM's phases: scheduled -> first token -> last
                    first, last = times
                    m.prefill.observe(max(0.0, first - qs))
                    m.decode.observe(max(0.0, last - first))
                    m.inference.observe(max(0.0, last - qs))
                generated = len(next(c for c in self._whole[i].outputs if c.index == j).token_ids)
                if times is not None:
                    m.tpot.observe(max(0.0, times[1] - times[0]) / (generated - 1) if generated > 1 else 0.0)
                prompt_len = _prompt_len(self.prompts[i])
                m.req_prompt.observe(prompt_len)
                m.req_prefill_computed.observe(max(0, prompt_len - (self._whole[i].num_cached_tokens or 0)))
                m.req_gen.observe(generated)
                max_tokens = _max_tokens_param(self.max_tokens[i], self.st.max_model_len, prompt_len)
                if max_tokens:
                    m.req_max_tokens.observe(max_tokens)
                self.st.metrics.finished(o.finish_reason, self.engines[i])
                if len(self._ended[i]) == self.params.n:  # the prompt's last sample: its n, its longest sample
                    m.req_n.observe(self.params.n)
                    m.req_max_gen.observe(max(len(c.token_ids) for c in self._whole[i].outputs))
        if out.finished:
            self.unfinished.discard(i)

    def usage(self) -> dict:
        p = sum(map(_prompt_len, self.prompts))
        c = sum(len(o.token_ids) for out in self._whole.values() for o in out.outputs)
        cached = sum(out.num_cached_tokens for out in self._whole.values())
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def choice_usage(self, chunk: dict, sent: Mapping) -> dict:
        """vLLM's continuous usage stats: the chunk's choice's prompt tokens and the tokens streamed for it so far
        (`sent`, by (prompt, sample)); the whole run's for a chunk without one choice."""
        choices = chunk.get("choices") or ()
        if len(choices) != 1:
            return self.usage()
        i, j = divmod(choices[0]["index"], self.params.n)
        p, c = _prompt_len(self.prompts[i]), sent[i, j]
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.st.untrack(self)
        for t in self.tasks:
            if not t.done():
                t.cancel()
        # the samples the engine ran and did not finish were aborted, or failed with the step running them (a prompt
        # it refused never ran: as vLLM, it is no finished request)
        for i in self.unfinished & self.accepted:
            for _ in range(self.params.n - len(self._ended[i])):
                self.st.metrics.finished("error" if i in self.failed else "abort", self.engines[i])
        self.ticket.settle(self.usage()["total_tokens"])
        self.st.release(self.nseqs)
        if self.st.request_log is not None:
            self.st.request_log(_finished_line(self))


def _copied_stats(each):
    """`replica_stats()`'s list, or mapping by engine label, with each engine's statistics copied."""
    if isinstance(each, Mapping):
        return {label: dict(s) for label, s in each.items()}
    return [dict(s) for s in each]


def _engine_index(engine, request_id: str) -> int:
    """Which data-parallel replica runs the request (`DataParallelAsyncEngine.engine_index`); 0 for one engine."""
    index = getattr(engine, "engine_index", None)
    return 0 if index is None else index(request_id)


def _prompt_max_tokens(params, max_tokens: Optional[int], max_model_len: Optional[int],
                       prompt_len: int) -> Optional[int]:
    """What one prompt of a run generates at most: its own `max_tokens`; unset, for a beam search (whose
    `max_tokens` must be a number) the rest of that prompt's context, as vLLM's beam search sets it per prompt
    (not the run's one value, the least: it cut every prompt's beams to the longest prompt's room)."""
    if max_tokens is None and isinstance(params, BeamSearchParams) and max_model_len:
        return max(1, max_model_len - prompt_len)
    return max_tokens


def _max_tokens_param(max_tokens: Optional[int], max_model_len: Optional[int], prompt_len: int) -> Optional[int]:
    """A request's max_tokens as vLLM's `vllm:request_params_max_tokens` observes it: unset, the rest of the context
    window (what vLLM's server resolves it to and what the engine allows)."""
    if max_tokens is not None or not max_model_len:
        return max_tokens
    return max(0, max_model_len - prompt_len)


def _request_line(run: _Run) -> str:
    """A request as `--enable-log-requests` reports it: ids, sizes and sampling, never the prompt's contents."""
    p = run.params
    sampling = (f"n={p.n} max_tokens={p.max_tokens} temperature={p.temperature:g} top_p={p.top_p:g} top_k={p.top_k}"
                + (f" seed={p.seed}" if p.seed is not None else "")
                + (" structured" if p.structured_outputs is not None else "")
                + (f" lora={','.join(sorted(set(run.loras) - {None}))}" if any(run.loras) else ""))
    tokens = sum(map(_prompt_len, run.prompts))
    return f"request {loggable(run.response_id)}: {len(run.prompts)} prompt(s), {tokens} prompt tokens, {sampling}"


def _read_stats(read: Callable, default):
    """`read()`, retried while the engine thread mutates the dicts it reads; `default` if it keeps failing or
    raises otherwise (never break a scrape)."""
    for _ in range(5):
        try:
            return read()
        except (RuntimeError, ValueError, KeyError):
            continue
        except Exception:
            log.exception("engine.stats() failed")
            return default
    return default


def _finished_line(run: _Run) -> str:
    u = run.usage()
    reasons = sorted({o.finish_reason or ("error" if i in run.failed else "abort")
                      for i, out in run._whole.items() for o in out.outputs}
                     | ({"error"} if run.failed else set()) | ({"rejected"} if run.refused else set())
                     | ({"abort"} if run.unfinished - run.failed - run.refused and run.tasks else set()))
    return (f"request {loggable(run.response_id)} finished ({', '.join(reasons) or 'rejected'}): "
            f"{u['completion_tokens']} tokens, {u['prompt_tokens_details']['cached_tokens']} prompt tokens cached, "
            f"{time.monotonic() - run.arrival:.2f}s")


# ---- response formatting -------------------------------------------------------------------------

class _Format:
    """Shapes of one endpoint's objects (completion or chat), full and streamed."""

    def __init__(self, st: ServerState, rid: str, n: int, logprobs: Optional[int], created: int,
                 prompt_field: bool = False, token_ids: bool = False, tokens_as_ids: Optional[bool] = None,
                 run_id: Optional[str] = None):
        self.st, self.id, self.n, self.logprobs, self.created = st, rid, n, logprobs, created
        self.run_id = run_id or rid  # the base of its engine requests' ids (see _response_id)
        # vLLM's return_tokens_as_token_ids: the request's choice, else the server's
        self.tokens_as_ids = getattr(st, "return_tokens_as_token_ids", False) if tokens_as_ids is None else tokens_as_ids
        self.prompt_field = prompt_field  # return vLLM's `prompt_logprobs`
        self.token_ids = token_ids  # return vLLM's `prompt_token_ids` / `token_ids`
        self.sent_text: dict[int, int] = {}  # characters of text streamed per choice
        self.finished: set[int] = set()
        self.run: Optional[_Run] = None  # the engine run it formats (set by _serve)
        self.routes_from: Optional[int] = None  # return routed experts from this position (set by _serve)

    done_marker = True  # streams end with `data: [DONE]`
    chunk_object: str  # the `object` of its streamed chunks

    def index(self, i: int, j: int) -> int:
        return i * self.n + j

    def end(self, run: "_Run", include_usage: bool) -> list[dict]:
        """The stream's last chunks: the usage chunk when asked."""
        return [self.usage_chunk(run)] if include_usage else []

    @staticmethod
    def failure(message: str, status: int, param: Optional[str] = None) -> list[dict]:
        """The stream's last chunk when the engine failed mid-stream: an error object with its HTTP status (and
        the request field it is about, as the 400 of a request that does not stream names it)."""
        return [_error_body(message, _STATUS_TYPES.get(status, "internal_error"), param) | {"status": status}]

    @staticmethod
    def named(e: APIError) -> APIError:
        """A 400 under this API's field names (the engine's and vLLM's here; SGLang's format renames them)."""
        return e

    @staticmethod
    def sse(obj) -> str:
        return _sse(obj)

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created,
                "model": getattr(self, "model", None) or self.st.model_name}

    def deltas(self, i: int, out: RequestOutput, usage_field: bool) -> list[dict]:
        """The streamed chunks of what is new in prompt `i`'s output: one per unfinished sample with news (its
        choice from the endpoint's `_delta_choice`), `stop_reason` once the sample finishes."""
        chunks = []
        for o in out.outputs:  # each a delta: what is new for sample o.index
            idx = self.index(i, o.index)
            if idx in self.finished:
                continue
            new_lps = (o.logprobs or []) if self.logprobs is not None else None
            new_ids = list(o.token_ids) if self.token_ids else []
            choice = self._delta_choice(i, out, o, idx, new_lps, new_ids)
            if choice is None:
                continue
            if o.finish_reason is not None:
                choice["stop_reason"] = o.stop_reason
                self._add_ext(choice, o)  # (the finishing delta carries the whole sequence's routes)
                self.finished.add(idx)
            chunk = {**self.head(self.chunk_object), "choices": [choice]}
            if usage_field:
                chunk["usage"] = None
            elif o.finish_reason is not None:  # vLLM's: on the final chunks (the usage chunk when there is one)
                chunk["system_fingerprint"] = self.st.system_fingerprint
            chunks.append(chunk)
        return chunks

    def _add_ext(self, choice: dict, o: CompletionOutput) -> None:
        """SGLang's `sgl_ext` of a finished choice: its routed experts, when the request asked."""
        if self.routes_from is not None and o.routed_experts is not None:
            choice["sgl_ext"] = {"routed_experts": to_base64(o.routed_experts, self.routes_from)}

    def usage_chunk(self, run: _Run) -> dict:
        return {**self.head(self.chunk_object), "choices": [], "system_fingerprint": self.st.system_fingerprint,
                "usage": run.usage()}

    def _prompt_field(self, out: RequestOutput) -> Optional[list]:
        """vLLM's `prompt_logprobs`: per prompt token None (the first, and any a request aborted mid-prefill never
        scored) or {token id: logprob, rank, text}."""
        if out.prompt_logprobs is None:
            return None
        rows = [None]
        for pos in out.prompt_logprobs[1:]:
            if pos is None:
                rows.append(None)
                continue
            chosen = pos.chosen
            row = {str(chosen.token_id): {"logprob": _finite_lp(chosen.logprob), "rank": chosen.rank,
                                          "decoded_token": chosen.decoded_token}}
            for r, a in enumerate(pos.top, 1):
                row.setdefault(str(a.token_id), {"logprob": _finite_lp(a.logprob), "rank": r,
                                                 "decoded_token": a.decoded_token})
            rows.append(row)
        return rows

    def _with_prompt(self, i: int, out: RequestOutput) -> RequestOutput:
        """`out`, or (a delta after the request's first output, which alone carries the prompt's logprobs)
        the merged answer that kept them."""
        if out.prompt_logprobs is None and self.run is not None and i in self.run._whole:
            return self.run._whole[i]
        return out

    def token_text(self, lp: Logprob) -> str:
        """A logprob entry's `token`: its text, or vLLM's 'token_id:{id}' under return_tokens_as_token_ids."""
        return f"token_id:{lp.token_id}" if self.tokens_as_ids else lp.decoded_token

    def logprob_bytes(self, lp: Logprob) -> list[int]:
        """`bytes` of a chat logprob entry: the token's bytes, or those of its 'token_id:{id}' name (vLLM's)."""
        return list(self.token_text(lp).encode()) if self.tokens_as_ids else self.token_bytes(lp.token_id)

    def token_bytes(self, tid: int) -> list[int]:
        tok = self.st.tokenizer
        try:
            return list(tok.token_bytes(tid)) if tok is not None else []
        except Exception:
            return []


class _CompletionFormat(_Format):
    """`echo` with `logprobs` puts the prompt tokens' logprobs first (the first token's is null: OpenAI's
    legacy shape, which evaluation harnesses read); `prompt_logprobs` (vLLM) adds
    `choices[].prompt_logprobs`."""

    chunk_object = "text_completion"

    def __init__(self, *a, echo_texts: list[str], echo_only: bool = False, **kw):
        super().__init__(*a, **kw)
        self.echo_texts = echo_texts
        self.echo_only = echo_only  # max_tokens 0 with echo: each choice shows the prompt alone

    def _shown(self, out: RequestOutput) -> RequestOutput:
        """`out` as the choices show it: with `echo_only`, no generated token (the one the engine sampled is
        hidden; the choice ends at its length, 0)."""
        if not self.echo_only:
            return out
        hide = lambda o: dataclasses.replace(  # noqa: E731
            o, text="", token_ids=[], logprobs=None if o.logprobs is None else [],
            finish_reason=None if o.finish_reason is None else "length", stop_reason=None)
        return dataclasses.replace(out, outputs=[hide(o) for o in out.outputs])

    def deltas(self, i: int, out: RequestOutput, usage_field: bool) -> list[dict]:
        return super().deltas(i, self._shown(out), usage_field)

    def _logprobs(self, entries, offset: int) -> Optional[dict]:
        if self.logprobs is None or entries is None:
            return None
        tokens, lps, tops, offs = [], [], [], []
        for e in entries:  # TokenLogprobs, or the echoed prompt's first token: (its Logprob, None)
            chosen, alts = (e.chosen, e.top) if isinstance(e, TokenLogprobs) else e
            tokens.append(self.token_text(chosen))
            lps.append(None if chosen.logprob is None else _finite_lp(chosen.logprob))
            # OpenAI's legacy shape (vLLM's too): the chosen token, then the `logprobs` most likely (up to
            # logprobs + 1 entries; the prompt's alternatives may be more, for prompt_logprobs)
            top: Optional[dict[str, float]] = None if alts is None else {
                self.token_text(chosen): _finite_lp(chosen.logprob)}
            for a in (alts or ())[:self.logprobs]:
                top.setdefault(self.token_text(a), _finite_lp(a.logprob))
            tops.append(top)
            offs.append(offset)
            offset += len(chosen.decoded_token)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

    def _echoed(self, i: int, out: RequestOutput, entries):
        """The generated entries, preceded by the prompt's when echoing with logprobs (a prompt token without
        a logprob, the first or one a request aborted mid-prefill never scored: its token, logprob null)."""
        out = self._with_prompt(i, out)
        if not self.echo_texts[i] or out.prompt_logprobs is None or entries is None:
            return entries
        return [e if e is not None else (Logprob(t, None, self._decode(t)), None)
                for t, e in zip(out.prompt_token_ids, out.prompt_logprobs)] + list(entries)

    def _decode(self, tid: int) -> str:
        tok = self.st.tokenizer
        return tok.decode([tid], skip_special=False) if tok is not None else ""

    def full(self, run: _Run) -> dict:
        choices = []
        for i in range(len(run.prompts)):
            out = self._shown(run.output(i))
            for o in out.outputs:
                j, echo = o.index, self.echo_texts[i]
                entries = self._echoed(i, out, o.logprobs)
                choice = {"index": self.index(i, j), "text": echo + o.text,
                          "logprobs": self._logprobs(entries, 0 if entries is not o.logprobs else len(echo)),
                          "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
                if self.prompt_field:
                    choice["prompt_logprobs"] = self._prompt_field(out)
                if self.token_ids:
                    choice["prompt_token_ids"], choice["token_ids"] = list(out.prompt_token_ids), list(o.token_ids)
                self._add_ext(choice, o)
                choices.append(choice)
        return {**self.head("text_completion"), "choices": choices, "system_fingerprint": self.st.system_fingerprint,
                "usage": run.usage()}

    def start(self, nprompts: int, usage_field: bool) -> list[dict]:
        return []

    def _delta_choice(self, i: int, out: RequestOutput, o: CompletionOutput, idx: int, new_lps,
                      new_ids: list[int]) -> Optional[dict]:
        """Choice `idx` of a streamed chunk: sample `o`'s new text (the echo first), None when nothing is new."""
        first = idx not in self.sent_text
        t0 = self.sent_text.get(idx, 0)
        text = o.text
        if first and self.echo_texts[i]:
            text = self.echo_texts[i] + text
        if not text and not new_lps and not new_ids and o.finish_reason is None and not first:
            return None
        self.sent_text[idx] = t0 + len(o.text)
        entries = self._echoed(i, out, new_lps) if first else new_lps
        choice = {"index": idx, "text": text,
                  "logprobs": self._logprobs(entries, 0 if entries is not new_lps else len(self.echo_texts[i]) + t0)
                  if self.logprobs is not None else None,
                  "finish_reason": o.finish_reason}
        if first and self.prompt_field:
            choice["prompt_logprobs"] = self._prompt_field(self._with_prompt(i, out))
        if self.token_ids:
            choice["token_ids"] = new_ids
            if first:
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
        return choice


def _reasoning_fields(reasoning: Optional[str]) -> dict:
    """A chat message's (or delta's) reasoning under both names clients read: `reasoning` (vLLM's since it
    dropped the other) and `reasoning_content` (SGLang's, DeepSeek's, older vLLM's)."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


class _ChatFormat(_Format):
    """With `reasoning` (the channel a K3 prompt opened), text is split into `reasoning` and `content`
    (serve/reasoning.py); `include_reasoning` false drops the reasoning. With `tools`, an answer that is
    a call becomes `tool_calls` (serve/tools.py); streamed, named and `required` calls stream as they are
    written, and a possible `auto` call is held back and sent whole when the choice finishes. `echo`
    (vLLM's chat `echo`) starts every answer's content."""

    chunk_object = "chat.completion.chunk"

    def __init__(self, *a, reasoning: Optional[str] = None, tools: Optional[ToolPlan] = None,
                 prompt_ids: Optional[list[int]] = None, include_reasoning: bool = True, echo: str = "", **kw):
        super().__init__(*a, **kw)
        self.prompt_ids = prompt_ids
        self.reasoning = reasoning
        self.include_reasoning = include_reasoning
        self.echo = echo
        self.tools = tools
        self.splitters: dict[int, ChannelSplitter] = {}
        self.held: dict[int, str] = {}  # streamed content held back as a possible tool call
        self.streaming: set[int] = set()  # choices whose content turned out not to be a call
        self.call_streams: dict[int, CallStream] = {}  # `required` calls read as they stream

    def _calls(self, content: str, finish_reason: Optional[str]) -> tuple[Optional[str], Optional[list], Optional[str]]:
        """(content, tool_calls, finish_reason): when the answer is a call, the text beside it (None unless an
        `auto` answer wrote text before a call in Kimi-K2's own format) and the calls, else (content, None,
        finish_reason). A forced call (named, `required`) gives its arguments as written, what streaming sent
        (`cut_calls`; vLLM's named call too), not re-serialised; cut short, its finish_reason is kept ("length";
        a stop string's "stop" reads as the stream's)."""
        if self.tools is None:
            return content, None, finish_reason
        text = None
        if self.tools.mode != "auto":
            calls = cut_calls(self.tools, content)
        elif finish_reason not in ("stop", None):
            calls = None
        else:  # this server's JSON calls, or the K2 format a Kimi-Linear model writes (vLLM's kimi_k2 parser)
            calls = parse_calls(self.tools, content.strip())
            k2 = parse_k2_calls(self.tools, content) if calls is None else None
            if k2 is not None:
                text, calls = k2[0] or None, k2[1]
        if calls is None:
            return content, None, finish_reason
        if finish_reason not in ("stop", None):
            return text, calls, finish_reason
        return text, calls, ("stop" if self.tools.mode == "named" else "tool_calls")

    def _hold(self, idx: int, content: str, finish_reason: Optional[str]) -> tuple[str, Optional[list], Optional[str]]:
        """Streaming: -> (content to send now, tool_call deltas to send now, finish_reason). A named
        call streams its arguments as they come (the answer is the arguments), `required` calls stream
        as they are written (each call's name once complete, then its arguments; `CallStream`); a
        possible `auto` call is held back and sent whole when the choice finishes (text streams as it comes, up
        to a Kimi-K2-format call section, held from its marker on)."""
        if self.tools is None:
            return content, None, finish_reason
        if self.tools.mode == "named":
            finish = "stop" if finish_reason == "stop" else finish_reason
            if not content:
                return "", None, finish
            if idx in self.held:
                return "", [{"index": 0, "function": {"arguments": content}}], finish
            self.held[idx] = ""
            return "", [{"index": 0, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                         "function": {"name": self.tools.name, "arguments": content}}], finish
        if self.tools.mode == "required":  # constrained to calls: stream them as they are written
            calls = self.call_streams.setdefault(idx, CallStream()).feed(content)
            return "", calls or None, ("tool_calls" if finish_reason == "stop" else finish_reason)
        held = self.held.pop(idx, "") + content
        if held.strip() and not held.lstrip().startswith("["):
            self.streaming.add(idx)  # plain text: send what was held and stream the rest
        if idx in self.streaming:  # ... up to a K2-format call section (Kimi-Linear's), held from its marker on
            text, held = split_k2_section(held)
            if finish_reason is None:
                if held:
                    self.held[idx] = held
                return text, None, None
        else:
            text = ""
        if finish_reason is None:
            self.held[idx] = held
            return "", None, None
        before, calls, finish_reason = self._calls(held, finish_reason)
        if not calls:
            return text + held, None, finish_reason
        return text + (before or ""), [{"index": k, **c} for k, c in enumerate(calls)], finish_reason

    def _logprobs(self, entries) -> Optional[dict]:
        if self.logprobs is None or entries is None:
            return None
        content = []
        for e in entries:
            chosen, alts = e.chosen, e.top
            content.append({"token": self.token_text(chosen), "logprob": _finite_lp(chosen.logprob),
                            "bytes": self.logprob_bytes(chosen),
                            "top_logprobs": [{"token": self.token_text(a), "logprob": _finite_lp(a.logprob),
                                              "bytes": self.logprob_bytes(a)} for a in alts]})
        return {"content": content}

    def full(self, run: _Run) -> dict:
        choices = []
        for i in range(len(run.prompts)):
            for o in run.output(i).outputs:
                j = o.index
                message = {"role": "assistant", "content": o.text, "tool_calls": []}
                if self.reasoning:
                    reasoning, message["content"] = split_reasoning(o.text, self.reasoning)
                    if self.include_reasoning:
                        message.update(_reasoning_fields(reasoning or None))
                text, calls, finish = self._calls(message["content"], o.finish_reason)
                if calls is not None:
                    message["content"], message["tool_calls"] = text, calls
                if self.echo:
                    message["content"] = self.echo + (message["content"] or "")
                choices.append({"index": self.index(i, j), "message": message,
                                "logprobs": self._logprobs(o.logprobs),
                                "finish_reason": finish, "stop_reason": o.stop_reason})
                if self.token_ids:
                    choices[-1]["token_ids"] = list(o.token_ids)
                self._add_ext(choices[-1], o)
        out = {**self.head("chat.completion"), "choices": choices, "system_fingerprint": self.st.system_fingerprint,
               "usage": run.usage()}
        if self.token_ids:
            out["prompt_token_ids"] = list(self.prompt_ids or [])
        if self.prompt_field:
            out["prompt_logprobs"] = self._prompt_field(run.output(0))
        return out

    def start(self, nprompts: int, usage_field: bool) -> list[dict]:
        chunks = []
        for i in range(nprompts):
            for j in range(self.n):
                chunk = {**self.head("chat.completion.chunk"),
                         "choices": [{"index": self.index(i, j), "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]}
                if usage_field:
                    chunk["usage"] = None
                if self.token_ids and not chunks:
                    chunk["prompt_token_ids"] = list(self.prompt_ids or [])
                chunks.append(chunk)
        if self.echo:  # then the echoed text, a chunk per choice (vLLM's)
            chunks += [{**c, "choices": [{**c["choices"][0], "delta": {"content": self.echo}}]} for c in
                       [{k: v for k, v in c.items() if k != "prompt_token_ids"} for c in chunks]]
        return chunks

    def _delta_choice(self, i: int, out: RequestOutput, o: CompletionOutput, idx: int, new_lps,
                      new_ids: list[int]) -> Optional[dict]:
        """Choice `idx` of a streamed chunk: sample `o`'s new text as a `delta` (reasoning split off, tool calls
        held or streamed), None when nothing is new."""
        text = o.text
        if not text and not new_lps and not new_ids and o.finish_reason is None:
            return None
        delta = {"content": text} if text else {}
        if self.reasoning:
            split = self.splitters.setdefault(idx, ChannelSplitter(self.reasoning))
            reasoning, content = split.feed(text)
            if o.finish_reason is not None:
                r2, c2 = split.finish()
                reasoning, content = reasoning + r2, content + c2
            delta = {"content": content} if content else {}
            if reasoning and self.include_reasoning:
                delta.update(_reasoning_fields(reasoning))
        content, calls, finish = self._hold(idx, delta.pop("content", ""), o.finish_reason)
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        if not delta and not new_lps and not new_ids and finish is None:
            return None
        choice = {"index": idx, "delta": delta,
                  "logprobs": self._logprobs(new_lps), "finish_reason": finish}
        if self.token_ids:
            choice["token_ids"] = new_ids
        return choice


class _ResponsesFormat:
    """The Responses API's shapes, translated from the chat format's (serve/responses.py)."""

    done_marker = False  # Responses streams end with response.completed, no [DONE]

    def __init__(self, chat: _ChatFormat, body, model: str, keep=None):
        """`keep(response)`: stores the finished response (None: not stored)."""
        self.chat, self.body, self.model, self.keep = chat, body, model, keep
        self.id, self.run_id = chat.id, chat.run_id
        self.events = ResponseEvents(chat.id, chat.created, body, model, stored=keep is not None,
                                     channels=chat.reasoning is not None, start=chat.reasoning)

    def reasoning_tokens(self, run: _Run) -> int:
        """The generated tokens of K3's think channel (0 without one)."""
        tok = self.chat.st.tokenizer
        if self.chat.reasoning is None or tok is None:
            return 0
        return sum(reasoning_token_count(tok, o.token_ids, self.chat.reasoning) for o in run.output(0).outputs)

    def full(self, run: _Run) -> dict:
        r = response_object(self.chat.full(run), self.id, self.chat.created, self.body, self.model,
                            self.reasoning_tokens(run), stored=self.keep is not None, start=self.chat.reasoning)
        if self.keep is not None:
            self.keep(r)
        return r

    def start(self, nprompts: int, usage_field: bool) -> list[dict]:
        return self.events.start()

    def deltas(self, i: int, out: RequestOutput, usage_field: bool) -> list[dict]:
        return [e for chunk in self.chat.deltas(i, out, False) for e in self.events.chunk(chunk)]

    def end(self, run: _Run, include_usage: bool) -> list[dict]:
        events = self.events.end(run.usage(), self.reasoning_tokens(run))
        if self.keep is not None:
            self.keep(events[-1]["response"])  # response.completed / .incomplete
        return events

    def failure(self, message: str, status: int, param: Optional[str] = None) -> list[dict]:
        """OpenAI's `error` and `response.failed` events (typed, numbered in the stream's sequence)."""
        return self.events.fail(message, "invalid_prompt" if status == 400 else "server_error", param)

    @staticmethod
    def named(e: APIError) -> APIError:
        """A 400 naming a chat request's field under the Responses request's name (`response_format`: `text.format`)."""
        return _responses_named(e)

    @staticmethod
    def sse(obj) -> str:
        return f"event: {obj['type']}\n" + _sse(obj) if "type" in obj else _sse(obj)


# ---- the app ------------------------------------------------------------------------------------

class _RequestIdHeader:
    """ASGI middleware (vLLM's --enable-request-id-headers): every HTTP response carries `X-Request-Id`, the
    request's own header when it sent one, else a fresh id."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = dict(scope.get("headers", ())).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(msg):
            if msg["type"] == "http.response.start":
                msg = dict(msg, headers=[*msg.get("headers", ()), (b"x-request-id", rid)])
            await send(msg)
        return await self.app(scope, receive, send_with_id)


def _response_id(request: Request, body: "_GenerationFields", prefix: str):
    """-> (the response's id, the base of its engine requests' ids): `prefix` + the request's X-Request-Id
    header, else its `request_id` field (vLLM's order), else a fresh id. A client's id may repeat, so its
    engine requests get a suffix of their own."""
    given = request.headers.get("x-request-id") or body.request_id
    if not given:
        rid = f"{prefix}{uuid.uuid4().hex}"
        return rid, rid
    rid = f"{prefix}{given}"
    return rid, f"{rid}-{uuid.uuid4().hex[:8]}"


class _BodyLimit:
    """ASGI middleware: bodies over `max_bytes` get 413 (by Content-Length, or counted as they arrive)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def _reject(self, send, size_note: str) -> None:
        body = json.dumps(_error_body(f"request body {size_note} exceeds the limit of {self.max_bytes} bytes",
                                      "invalid_request_error", None, "request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    n = int(value)
                except ValueError:
                    n = -1
                if n > self.max_bytes:
                    return await self._reject(send, f"of {n} bytes")
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        buffered, total = [], 0
        while True:
            msg = await receive()
            buffered.append(msg)
            if msg["type"] != "http.request":
                break
            total += len(msg.get("body", b""))
            if total > self.max_bytes:
                return await self._reject(send, f"of more than {self.max_bytes} bytes")
            if not msg.get("more_body", False):
                break

        async def replay():
            return buffered.pop(0) if buffered else await receive()

        return await self.app(scope, replay, send)


def create_app(async_engine=None, model_name: Union[str, Sequence[str]] = "k3jax", *, api_keys=None,
               limits: Optional[Limits] = None, max_waiting: Optional[int] = 256,
               max_body_bytes: int = DEFAULT_MAX_BODY, max_model_len: Optional[int] = None,
               reasoning_parser: bool = True, max_stored_responses: int = 1024, enable_sleep_mode: bool = False,
               allow_runtime_lora_updating: bool = False, return_tokens_as_token_ids: bool = False,
               enable_request_id_headers: bool = False, allowed_origins: Optional[list[str]] = None,
               allowed_methods: tuple[str, ...] = ("*",), allowed_headers: tuple[str, ...] = ("*",),
               allow_credentials: bool = False, request_log: Optional[Callable[[str], None]] = None,
               profiler_dir: Optional[str] = None, model_path: Optional[str] = None,
               weights_cpu_backup: bool = False) -> FastAPI:
    """The OpenAI-compatible app.

    async_engine: a warmed-up `AsyncEngine`, or None to attach one later with
      `app.state.k3.attach(async_engine)` (until then /health and the API answer 503).
    model_name: the model's id in the API, or several (vLLM's --served-model-name: requests may name any,
      responses carry the first).
    api_keys: None (open server), a key, an iterable of keys, or {key: Limits} (per-key limits).
    limits: default per-key `Limits(rpm, tpm)` (None: unlimited).
    max_waiting: sequences allowed to wait beyond the engine's decode capacity; more get 503.
    max_model_len: the context window shown before the engine is attached.
    reasoning_parser: K3 chat answers split into `reasoning_content` and `content` (serve/reasoning.py);
      False returns the raw XTML text as `content`.
    max_stored_responses: Responses API objects kept in memory for `previous_response_id` (0: none).
    enable_sleep_mode: serve POST /sleep, POST /wake_up, GET /is_sleeping (vLLM's), POST
      /update_weights_from_disk (SGLang's) and POST /pause, POST /resume, GET /is_paused (vLLM's), and SGLang's
      names for the same: /release_memory_occupation, /resume_memory_occupation, /pause_generation,
      /continue_generation, with /update_weight_version, /get_weights_by_name and /update_weights_from_tensor:
      what an RL loop sharing the device with training, or swapping in new policy weights, calls.
    weights_cpu_backup: /release_memory_occupation keeps the weights in host memory (SGLang's
      --enable-weights-cpu-backup; without it they are discarded: load new ones before generating again).
    allow_runtime_lora_updating: serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's;
      they read adapter directories from the server's disk, so they are off by default), and SGLang's
      /load_lora_adapter, /load_lora_adapter_from_tensors and /unload_lora_adapter.
    return_tokens_as_token_ids: logprobs name tokens 'token_id:{id}' unless a request says otherwise (vLLM's).
    enable_request_id_headers: every response carries an `X-Request-Id` header (vLLM's): the request's, else a
      fresh one. Completions and chat ids always follow a request's X-Request-Id (or `request_id` field).
    allowed_origins: origins whose browser pages may call the API (CORS; `["*"]`: any); None (the default) sends
      no CORS headers, so browsers keep other sites' pages from reading the answers. `allowed_methods`,
      `allowed_headers` and `allow_credentials` refine it (vLLM's four options).
    request_log: called with a line when a generation request starts and when it ends (vLLM's
      --enable-log-requests: ids, sizes, sampling, finish reasons, time; never the prompt or answer text).
    profiler_dir: serve POST /start_profile and /stop_profile, recording `jax.profiler` traces there (vLLM's
      profiler routes; off without it).
    model_path: the checkpoint directory or preset served (SGLang's /get_model_info; default: model_name).
    """
    st = ServerState(model_name, api_keys, limits, max_waiting, max_model_len)
    st.reasoning_parser = reasoning_parser
    st.request_log = request_log
    st.model_path = model_path or st.model_name
    st.return_tokens_as_token_ids = return_tokens_as_token_ids
    st.responses = ResponseStore(max_stored_responses)
    if async_engine is not None:
        st.attach(async_engine)

    app = FastAPI(title="k3jax", version="0.1.0", default_response_class=JSONResponse,
                  description="OpenAI-compatible server for Kimi-K3-class hybrid models (k3jax).")
    app.state.k3 = st
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    if enable_request_id_headers:
        app.add_middleware(_RequestIdHeader)
    if allowed_origins:  # outermost: a browser's preflight OPTIONS is answered before the body limit or the keys
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=list(allowed_methods),
                           allow_headers=list(allowed_headers), allow_credentials=allow_credentials,
                           expose_headers=["X-Request-Id", "Retry-After"])

    # ---- error mapping ----
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        st.metrics.rejected("invalid")
        msg, param = _validation_message(e)
        return _error_response(APIError(400, msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(_error_body(str(e.detail), _STATUS_TYPES.get(e.status_code, "invalid_request_error")),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        # (no log here: Starlette raises `e` on to the server after this answer, and the server logs its traceback)
        return JSONResponse(_error_body(f"internal error: {type(e).__name__}", "internal_error"), status_code=500)

    # ---- dependencies ----
    def authenticate(request: Request) -> str:
        key = st.keys.check(request.headers.get("authorization"))
        if key is None:
            st.metrics.rejected("auth")
            given = request.headers.get("authorization")
            raise APIError(401, "Incorrect API key provided." if given else
                           "Missing API key: send 'Authorization: Bearer <key>'.",
                           "authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        return key

    def ready() -> None:
        st.check_ready()

    # ---- routes ----
    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        if st.healthy:
            return {"status": "ok", "model": st.model_name}
        msg = "shutting down" if st.shutting_down else st.error or (st.engine_stopped() if st.ready else "loading")
        return JSONResponse({"status": "unavailable", "detail": msg}, status_code=503)

    @app.get("/health_generate", responses={503: {"model": ErrorResponse}})
    async def health_generate():
        """SGLang's deep check: /health's answer, and the engine really generates -- it streamed output in
        the last HEALTH_RECENT_S seconds, or a one-token request (greedy, token id 0) finishes within
        HEALTH_GENERATE_TIMEOUT_S (503 naming what failed otherwise)."""
        answer = await health()
        if not st.healthy or time.monotonic() - st.last_output < HEALTH_RECENT_S:
            return answer
        probe = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False,
                               output_kind=RequestOutputKind.FINAL_ONLY)

        async def one_token() -> None:
            async for _ in st.engine.generate([0], probe, f"health-{uuid.uuid4().hex}"):
                pass
        try:
            await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            detail = f"no token generated within {HEALTH_GENERATE_TIMEOUT_S:g} s"
        except Exception as e:
            detail = f"generation failed: {type(e).__name__}: {e}"
        else:
            return answer
        return JSONResponse({"status": "unavailable", "detail": detail}, status_code=503)

    async def ping():
        """SageMaker's liveness route (vLLM serves it too): /health's answer."""
        return await health()

    for method in ("GET", "POST"):
        app.add_api_route("/ping", ping, methods=[method], operation_id=f"ping_{method.lower()}",
                          responses={503: {"model": ErrorResponse}})

    @app.get("/version")
    async def version():
        """The server's version (vLLM's route)."""
        from k3jax import __version__

        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(st.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    def _model_card(adapter=None, name: Optional[str] = None) -> dict:
        """The base model's card (under one of its names; vLLM's `root`: the model path served), or a LoRA
        adapter's (vLLM's: `root` its path, `parent` the base model)."""
        if adapter is None:
            return {"id": name or st.model_name, "object": "model", "created": st.created, "owned_by": "k3jax",
                    "root": st.model_path, "parent": None, "max_model_len": st.max_model_len}
        return {"id": adapter.name, "object": "model", "created": st.created, "owned_by": "k3jax",
                "root": adapter.path, "parent": st.model_name, "max_model_len": st.max_model_len}

    @app.get("/v1/models", responses=_ERRORS)
    async def models(key: str = Depends(authenticate)):
        adapters = st.lora_adapters()
        return {"object": "list", "data": [_model_card(name=n) for n in st.model_names]
                + [_model_card(adapters[n]) for n in sorted(adapters)]}

    @app.get("/v1/models/{model_id:path}", responses=_ERRORS)
    async def model(model_id: str, key: str = Depends(authenticate)):
        lora = st.check_model(model_id)
        return _model_card(st.lora_adapters().get(lora) if lora else None, model_id)

    if allow_runtime_lora_updating:  # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: loads adapters from server paths
        @app.post("/v1/load_lora_adapter", responses=_ERRORS)
        async def load_lora_adapter(body: LoadLoRARequest, key: str = Depends(authenticate),
                                    _r: None = Depends(ready)):
            """Load a PEFT adapter directory into a free slot; it is then served as model `lora_name`."""
            if body.lora_name in st.model_names:
                raise APIError(400, f"lora_name {body.lora_name!r} is the base model's name", param="lora_name")
            try:  # (room on every data-parallel replica first: each drops its own least recently used adapter)
                await st.engine.call(lambda e: e._lora_room(body.lora_name, body.lora_path, replace=body.load_inplace))
                await st.engine.call(lambda e: e.add_lora(LoRARequest(body.lora_name, 0, body.lora_path,
                                                                      load_inplace=body.load_inplace)))
            except LoRAError as e:
                hint = " (load_inplace: true replaces it)" if "loaded already" in str(e) else ""
                raise APIError(400, str(e) + hint, param=_lora_param(str(e))) from None
            except EngineSleeping as e:  # (its memory released: /wake_up first)
                raise APIError(503, str(e), "server_unavailable", code="engine_sleeping") from None
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter", responses=_ERRORS)
        async def unload_lora_adapter(body: UnloadLoRARequest, key: str = Depends(authenticate),
                                      _r: None = Depends(ready)):
            """Unload an adapter; refused (400) while requests in flight use it."""
            if body.lora_name not in st.lora_adapters():
                raise APIError(404, f"lora_name {body.lora_name!r}: no adapter of that name is loaded",
                               "not_found_error", param="lora_name")
            try:
                await st.engine.call(lambda e: e.remove_lora(body.lora_name))
            except LoRAError as e:
                raise APIError(400, str(e), param="lora_name") from None
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

        # SGLang's routes for the same (RL trainers on SGLang call these): JSON verdicts
        # {"success", "error_message", "loaded_adapters"}, 400 on failure
        def lora_verdict(error: Optional[str] = None, status: int = 400):
            loaded = {n: a.path for n, a in st.lora_adapters().items()}
            return JSONResponse({"success": error is None, "error_message": error or "", "loaded_adapters": loaded},
                                status_code=200 if error is None else status)

        async def load(body, fn):
            if body.lora_name in st.model_names:
                return lora_verdict(f"lora_name {body.lora_name!r} is the base model's name")
            try:
                await st.engine.call(lambda e: e._lora_room(body.lora_name, getattr(body, "lora_path", "")))
                await st.engine.call(fn)
            except LoRAError as e:
                return lora_verdict(str(e))
            except EngineSleeping as e:  # (its memory released: /resume_memory_occupation first)
                return lora_verdict(str(e), 503)
            return lora_verdict()

        @app.post("/load_lora_adapter", responses=_ERRORS)
        async def sglang_load_lora_adapter(body: SGLangLoadLoRARequest, key: str = Depends(authenticate),
                                           _r: None = Depends(ready)):
            """SGLang's: load a PEFT adapter directory (as /v1/load_lora_adapter)."""
            return await load(body, lambda e: e.add_lora(LoRARequest(body.lora_name, 0, body.lora_path)))

        @app.post("/load_lora_adapter_from_tensors", responses=_ERRORS)
        async def load_lora_adapter_from_tensors(body: LoadLoRAFromTensorsRequest, key: str = Depends(authenticate),
                                                 _r: None = Depends(ready)):
            """SGLang's: an adapter from tensors sent in the request (base64 safetensors files, `load_format`
            "safetensors") and its PEFT `config_dict`: the RL loop's adapter sync, no files on the server."""
            if body.load_format != "safetensors":
                return lora_verdict(f"load_format: {body.load_format!r} is not readable here; send the tensors as "
                                    f"base64 safetensors files with load_format 'safetensors' (SGLang's pickled torch "
                                    f"payloads point into another process's memory)")
            if body.added_tokens_config:
                return lora_verdict("added_tokens_config: adapters that add tokens are not supported")
            texts = [body.serialized_tensors] if isinstance(body.serialized_tensors, str) else body.serialized_tensors
            try:
                named = [item for i, t in enumerate(texts) for item in _safetensors_items(t, f"serialized_tensors[{i}]")]
            except ValueError as e:
                return lora_verdict(str(e))
            return await load(body, lambda e: e.load_lora_adapter_from_tensors(body.lora_name, named, body.config_dict))

        @app.post("/unload_lora_adapter", responses=_ERRORS)
        async def sglang_unload_lora_adapter(body: UnloadLoRARequest, key: str = Depends(authenticate),
                                             _r: None = Depends(ready)):
            """SGLang's: unload an adapter (refused while requests in flight use it)."""
            if body.lora_name not in st.lora_adapters():
                return lora_verdict(f"lora_name {body.lora_name!r}: no adapter of that name is loaded")
            try:
                await st.engine.call(lambda e: e.remove_lora(body.lora_name))
            except LoRAError as e:
                return lora_verdict(str(e))
            return lora_verdict()

    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request, key: str = Depends(authenticate),
                          _r: None = Depends(ready)):
        arrival = time.monotonic()
        st.check_model(body.model)
        st.admit(key, 1, 1, charge=False)  # a full rate window or queue: refused before tokenizing
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of other than n is not supported", param="best_of")
        echo_only = body.max_tokens == 0  # OpenAI's echo without generation: the engine samples one, not shown
        if echo_only and not body.echo:
            raise APIError(400, "max_tokens: must be at least 1 (0 only with echo)", param="max_tokens")
        texts, prompts = await _completion_inputs(st, body, request)
        each = [1] * len(prompts) if echo_only else _default_max_tokens(
            st, prompts, body.max_tokens, _truncation(st, body.truncate_prompt_tokens))
        params = _sampling(st, body, _run_max_tokens(each), body.logprobs)
        k = params.truncate_prompt_tokens
        if k is not None:  # the echo shows what the model saw
            texts = [t if _prompt_len(p) <= k or isinstance(p, dict) else _prompt_text(st, p[-k:])
                     for t, p in zip(texts, prompts)]
            prompts = [{"prompt_embeds": p["prompt_embeds"][-k:]} if isinstance(p, dict) else p[-k:] for p in prompts]
        if body.prompt_embeds is not None and (body.echo or body.prompt_logprobs is not None):
            name = "echo" if body.echo else "prompt_logprobs"
            raise APIError(400, f"{name}: a prompt given as embeddings has no tokens to show or score", param=name)
        if body.prompt_logprobs is not None or (body.echo and body.logprobs is not None):
            params.prompt_logprobs = max(body.prompt_logprobs or 0, body.logprobs or 0 if body.echo else 0)
            try:
                params.validate(st.vocab_size, st.max_logprobs)
            except RequestError as e:
                raise APIError(400, str(e), param="prompt_logprobs") from None
        echo = texts if body.echo else [""] * len(texts)
        rid, run_id = _response_id(request, body, "cmpl-")
        fmt = _CompletionFormat(st, rid, params.n, params.logprobs, int(time.time()),
                                echo_texts=echo, prompt_field=body.prompt_logprobs is not None,
                                token_ids=body.return_token_ids, tokens_as_ids=body.return_tokens_as_token_ids,
                                run_id=run_id, echo_only=echo_only)
        return await _serve(st, request, key, prompts, params, body, fmt, arrival, "prompt", max_tokens=each)

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request, key: str = Depends(authenticate),
                               _r: None = Depends(ready)):
        arrival = time.monotonic()
        st.check_model(body.model)
        st.admit(key, 1, 1, charge=False)  # a full rate window or queue: refused before rendering the chat
        rid, run_id = _response_id(request, body, "chatcmpl-")
        ids, params, fmt = await _off_loop(request, _chat_request, st, body, rid, run_id)
        return await _serve(st, request, key, [ids], params, body, fmt, arrival, "messages")

    @app.post("/invocations", responses=_ERRORS)
    async def invocations(request: Request, key: str = Depends(authenticate), _r: None = Depends(ready)):
        """SageMaker's inference route (vLLM serves it): a body with `messages` is a chat completion, one with
        `prompt` (or `prompt_embeds`) a completion; answered (and streamed) as those routes answer."""
        try:
            raw = json.loads(await request.body())
        except ValueError as e:
            raise APIError(400, f"malformed JSON body: {e}") from None
        except RecursionError:  # (nested past the interpreter's recursion limit: it was a 500)
            raise APIError(400, "malformed JSON body: arrays and objects nested too deeply") from None
        if not isinstance(raw, dict) or not ({"messages", "prompt", "prompt_embeds"} & set(raw)):
            raise APIError(400, "invocations: expected a chat completion (with messages) or a completion (with "
                                "prompt) request body", param="messages")
        kind = ChatCompletionRequest if "messages" in raw else CompletionRequest
        try:
            body = kind.model_validate(raw)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        handler = chat_completions if kind is ChatCompletionRequest else completions
        return await handler(body, request, key, None)

    @app.get("/load")
    async def server_load():
        """vLLM's server load (a load balancer's signal): the HTTP requests in flight. Open, as vLLM's (its keys
        guard /v1/* only) and as /health: a balancer polls it without a key."""
        return {"server_load": st.requests_in_flight}

    @app.post("/v1/responses", responses=_ERRORS)
    async def responses(body: ResponsesRequest, request: Request, key: str = Depends(authenticate),
                        _r: None = Depends(ready)):
        """OpenAI's Responses API over the chat machinery (serve/responses.py)."""
        arrival = time.monotonic()
        st.check_model(body.model)
        st.admit(key, 1, 1, charge=False)  # a full rate window or queue: refused before rendering the chat
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        previous: list[dict] = []
        if body.previous_response_id is not None:
            got = st.responses.get(key, body.previous_response_id)
            if got is None:
                raise APIError(400, f"previous_response_id: no stored response {body.previous_response_id!r} "
                                    f"(unknown, deleted, or dropped from the store)", param="previous_response_id")
            previous = got[1]
        unknown = [x for x in body.include or [] if x != LOGPROBS_INCLUDE]
        if unknown:
            raise APIError(400, f"include: {unknown[0]!r} is not supported (supported: {LOGPROBS_INCLUDE!r})",
                           param="include")
        logprobs = LOGPROBS_INCLUDE in (body.include or []) or body.top_logprobs is not None

        def chat_of(skip: int) -> ChatCompletionRequest:
            """The chat request of the conversation without its first `skip` items."""
            try:
                spec = to_chat(body, previous, skip)
                return ChatCompletionRequest(
                    messages=spec["messages"], max_tokens=body.max_output_tokens, temperature=body.temperature,
                    top_p=body.top_p, tools=spec["tools"], tool_choice=spec["tool_choice"],
                    parallel_tool_calls=body.parallel_tool_calls, response_format=spec["response_format"],
                    reasoning_effort=spec["reasoning_effort"], stream=body.stream, priority=body.priority,
                    cache_salt=body.cache_salt, logprobs=logprobs, model=body.model,
                    top_logprobs=(body.top_logprobs or 0) if logprobs else None,
                    **body.model_dump(include=set(_RESPONSES_SAMPLING)))
            except RequestError as e:
                raise APIError(400, str(e), param=_param_of(str(e))) from None
            except ValidationError as e:
                raise APIError(400, f"input: {e.errors()[0].get('msg', 'invalid')}", param="input") from None

        chat = chat_of(0)
        rid = body.request_id or f"resp_{uuid.uuid4().hex}"
        run_id = f"{rid}-{uuid.uuid4().hex[:8]}" if body.request_id else rid  # (a client's id may repeat)
        try:
            ids, params, chat_fmt = await _off_loop(request, _chat_request, st, chat, rid, run_id)
            if body.truncation == "auto" and not _fits(st, ids, body.max_output_tokens):
                chat, (ids, params, chat_fmt) = await _off_loop(
                    request, _drop_turns, st, turn_starts(body, previous), chat_of,
                    lambda c: _chat_request(st, c, rid, run_id), body.max_output_tokens)
            body = body.model_copy(update={"temperature": params.temperature, "top_p": params.top_p})  # as sampled
            keep = None
            if body.store is not False and st.responses.max_entries:
                conversation = previous + input_items(body)
                keep = lambda r: st.responses.put(key, r, conversation + r["output"])  # noqa: E731
            fmt = _ResponsesFormat(chat_fmt, body, st.check_model(body.model) or st.model_name, keep)
            return await _serve(st, request, key, [ids], params, chat, fmt, arrival, "input")
        except APIError as e:  # the chat request's field names -> the Responses request's
            raise _responses_named(e) from None

    @app.get("/v1/responses/{response_id}", responses=_ERRORS)
    async def get_response(response_id: str, key: str = Depends(authenticate)):
        """A stored response (OpenAI's retrieve)."""
        got = st.responses.get(key, response_id)
        if got is None:
            raise APIError(404, f"no stored response {response_id!r}", "not_found_error", param="response_id")
        return got[0]

    @app.delete("/v1/responses/{response_id}", responses=_ERRORS)
    async def delete_response(response_id: str, key: str = Depends(authenticate)):
        """Forget a stored response (OpenAI's delete)."""
        if not st.responses.delete(key, response_id):
            raise APIError(404, f"no stored response {response_id!r}", "not_found_error", param="response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/reset_prefix_cache", responses=_ERRORS)
    async def reset_prefix_cache(key: str = Depends(authenticate), _r: None = Depends(ready)):
        """Forget every cached prefix, device and host tier (vLLM's endpoint); `reset` is false while
        requests in flight still read some of it (call again once they finish)."""
        return {"reset": bool(await st.engine.reset_prefix_cache())}

    async def flush_cache(key: str = Depends(authenticate), _r: None = Depends(ready)):
        """SGLang's name for the same (its benchmark scripts call it between runs): 200 once the cache is empty,
        400 while requests in flight still read some of it."""
        if await st.engine.reset_prefix_cache():
            return PlainTextResponse("Cache flushed.")
        raise APIError(400, "requests in flight still read the prefix cache; flush again once they finish")

    for method in ("GET", "POST"):
        app.add_api_route("/flush_cache", flush_cache, methods=[method], responses=_ERRORS,
                          operation_id=f"flush_cache_{method.lower()}")

    from serve import sglang_api  # (it imports this module)

    sglang_api.register(app, st, authenticate, ready, _ERRORS)

    @app.post("/abort_request", responses=_ERRORS)
    async def abort_request(body: AbortRequestBody, key: str = Depends(authenticate), _r: None = Depends(ready)):
        """SGLang's endpoint: end requests in flight, by id (`rid`: a response id, or the X-Request-Id /
        request_id / rid the client gave; one of a /generate batch's per-prompt rids: that prompt) or all of them (`abort_all`); only the caller's own (its API key's). They
        finish with finish_reason "abort" (a stream gets its last chunks) and free their cache at once.
        `aborted`: how many requests had work left (0 for an unknown or finished id)."""
        if not body.rid and not body.abort_all:
            raise APIError(400, "give rid, or abort_all: true", param="rid")
        return {"aborted": st.abort_runs(key, None if body.abort_all else body.rid)}

    if profiler_dir is not None:  # vLLM's profiler routes (its VLLM_TORCH_PROFILER_DIR; here --profiler-dir)
        profiler = Profiler(profiler_dir)

        @app.post("/start_profile", responses=_ERRORS)
        async def start_profile(key: str = Depends(authenticate)):
            """Start a `jax.profiler` trace of the server (serve/profiler.py) into --profiler-dir; 400 while
            one is recording."""
            try:
                return {"status": "recording", "dir": await asyncio.to_thread(profiler.start)}
            except ProfilerError as e:
                raise APIError(400, str(e)) from None

        @app.post("/stop_profile", responses=_ERRORS)
        async def stop_profile(key: str = Depends(authenticate)):
            """Stop the trace and write it -> {"dir": its run directory, "seconds"}; 400 when none records."""
            try:
                return {"status": "written", **await asyncio.to_thread(profiler.stop)}
            except ProfilerError as e:
                raise APIError(400, str(e)) from None

    if enable_sleep_mode:  # vLLM's --enable-sleep-mode: the RL weight-sync endpoints (off by default)
        @app.post("/sleep", responses=_ERRORS)
        async def sleep(level: int = 1, key: str = Depends(authenticate), _r: None = Depends(ready)):
            """vLLM's sleep mode: release the engine's device memory (level 1: weights kept in host memory;
            level 2: discarded, load new ones before waking). Generation answers 503 until /wake_up. 400
            while requests are in flight."""
            if level not in (1, 2):
                raise APIError(400, f"level must be 1 or 2, got {level}", param="level")
            await release(level, None, "level")
            return {"is_sleeping": True, "level": level}

        async def release(level: int, tags: Optional[list[str]], param: str) -> None:
            if st.requests_in_flight and not st.retracted:
                raise APIError(400, f"{st.requests_in_flight} requests in flight; sleep when idle", param=param)
            st.sleeping = True  # before the engine call: no request is admitted while it runs
            try:
                await st.engine.sleep(level, tags)
            except (RuntimeError, ValueError) as e:
                st.sleeping = await st.engine.is_sleeping()
                raise APIError(400, str(e), param=param) from None

        async def release_memory_occupation(body: Optional[MemoryOccupationRequest] = None,
                                            key: str = Depends(authenticate), _r: None = Depends(ready)):
            """SGLang's sleep: release the `tags` ("weights", "kv_cache"; SGLang's "cuda_graph" is accepted: the
            compiled programs stay, nothing to release; default all). The weights are discarded (load new ones
            with /update_weights_from_disk) unless the server keeps a host copy (--enable-weights-cpu-backup)."""
            tags = _memory_tags(body)
            if tags != []:  # (only cuda_graph: nothing to release)
                await release(1 if weights_cpu_backup else 2, tags, "tags")
            return {"success": True, "released": ["weights", "kv_cache"] if tags is None else tags,
                    "is_sleeping": st.sleeping}

        async def resume_memory_occupation(body: Optional[MemoryOccupationRequest] = None,
                                           key: str = Depends(authenticate), _r: None = Depends(ready)):
            """SGLang's wake-up: take back the `tags` (default all)."""
            tags = _memory_tags(body)
            try:
                if tags != []:
                    st.sleeping = await st.engine.wake_up(tags)
            except ValueError as e:
                raise APIError(400, str(e), param="tags") from None
            return {"success": True, "is_sleeping": st.sleeping}

        for path, route in (("/release_memory_occupation", release_memory_occupation),
                            ("/resume_memory_occupation", resume_memory_occupation)):
            for method in ("GET", "POST"):  # (one route per method: unique OpenAPI operation ids, as /ping's)
                app.add_api_route(path, route, methods=[method], responses=_ERRORS,
                                  operation_id=f"{path.strip('/')}_{method.lower()}")

        @app.post("/wake_up", responses=_ERRORS)
        async def wake_up(tags: Optional[list[str]] = Query(None), key: str = Depends(authenticate),
                          _r: None = Depends(ready)):
            """Take back what /sleep released (`tags`: weights, kv_cache; default both)."""
            try:
                st.sleeping = await st.engine.wake_up(tags)
            except ValueError as e:
                raise APIError(400, str(e), param="tags") from None
            return {"is_sleeping": st.sleeping}

        @app.post("/update_weights_from_disk", responses=_ERRORS)
        async def update_weights_from_disk(body: UpdateWeightsRequest, key: str = Depends(authenticate),
                                           _r: None = Depends(ready)):
            """SGLang's endpoint: load new weights of the served model from a local checkpoint directory
            (`model_path`) and swap them in (Engine.update_weights: same config and shapes, no compile, prefix
            cache cleared). Also how weights come back after /sleep?level=2. 400 while requests are in flight
            (unless retracted or `abort_all_requests`)."""
            if body.abort_all_requests:
                await st.engine.abort_all()
                await st.drained()
            if st.requests_in_flight and not st.retracted:
                raise APIError(400, f"{st.requests_in_flight} requests in flight; update when idle (or retract them: "
                                    f"/pause_generation with mode retract)", param="model_path")
            path = body.model_path
            if not os.path.isdir(path):
                raise APIError(400, f"model_path: {path!r} is not a checkpoint directory on the server", param="model_path")

            def update(engine):
                engine.update_weights_from_disk(path)
                return engine.is_sleeping

            try:
                st.sleeping = await st.engine.call(update)
            except Exception as e:  # noqa: BLE001 - a checkpoint that does not load is the request's fault
                raise APIError(400, f"model_path: {type(e).__name__}: {e}", param="model_path") from None
            message = f"weights loaded from {path}"
            if body.weight_version is not None:
                st.weight_version = body.weight_version
                message += f"; weight version {body.weight_version}"
            return {"success": True, "message": message, "is_sleeping": st.sleeping}

        async def get_weights_by_name(body: WeightsByNameRequest, key: str = Depends(authenticate),
                                      _r: None = Depends(ready)):
            """SGLang's: a checkpoint tensor as the engine serves it now (its first `truncate_size` rows), as nested
            lists; with data-parallel replicas a list of each replica's (an RL loop checks a weight sync)."""
            def read(engine):
                return engine.get_weights_by_name(body.name, body.truncate_size)

            try:
                values = await st.engine.call_each(read)
            except WeightNameError as e:
                raise APIError(400, str(e), param="name") from None
            except EngineSleeping as e:
                raise APIError(503, str(e), "server_unavailable", code="engine_sleeping") from None
            lists = [(v.astype(np.float32) if v.dtype.kind == "V" or v.dtype == jnp.bfloat16 else v).tolist()
                     for v in values]
            return lists[0] if len(lists) == 1 else lists

        for method in ("GET", "POST"):
            app.add_api_route("/get_weights_by_name", get_weights_by_name, methods=[method], responses=_ERRORS,
                              operation_id=f"get_weights_by_name_{method.lower()}")

        @app.post("/update_weights_from_tensor", responses=_ERRORS)
        async def update_weights_from_tensor(body: UpdateWeightsFromTensorRequest, key: str = Depends(authenticate),
                                             _r: None = Depends(ready)):
            """SGLang's: write the named checkpoint tensors of `serialized_named_tensors` (base64 safetensors files,
            `load_format` "safetensors"), the other weights unchanged, no compile; `flush_cache` forgets the prefix
            cache. 400 while requests are in flight (unless retracted or `abort_all_requests`)."""
            if body.load_format != "safetensors":
                raise APIError(400, f"load_format: {body.load_format!r} is not readable here; send each bucket as a "
                                    f"base64 safetensors file with load_format 'safetensors' (torch IPC handles, "
                                    f"SGLang's default, point into another process's memory)", param="load_format")
            if body.abort_all_requests:
                await st.engine.abort_all()
                await st.drained()
            if st.requests_in_flight and not st.retracted:
                raise APIError(400, f"{st.requests_in_flight} requests in flight; update when idle (or retract them: "
                                    f"/pause_generation with mode retract)", param="serialized_named_tensors")
            try:
                named = [item for i, text in enumerate(body.serialized_named_tensors)
                         for item in _safetensors_items(text, f"serialized_named_tensors[{i}]")]
            except ValueError as e:
                raise APIError(400, str(e), param="serialized_named_tensors") from None

            def update(engine):
                engine.update_weights_from_tensor(named, body.flush_cache)
                return engine.is_sleeping

            try:
                st.sleeping = await st.engine.call(update)
            except EngineSleeping as e:
                raise APIError(503, str(e), "server_unavailable", code="engine_sleeping") from None
            except (WeightNameError, ValueError, RuntimeError) as e:
                raise APIError(400, str(e), param="serialized_named_tensors") from None
            message = f"{len(named)} tensors written"
            if body.weight_version is not None:
                st.weight_version = body.weight_version
                message += f"; weight version {body.weight_version}"
            return {"success": True, "message": message, "is_sleeping": st.sleeping}

        @app.post("/update_weight_version", responses=_ERRORS)
        async def update_weight_version(body: UpdateWeightVersionRequest, key: str = Depends(authenticate),
                                        _r: None = Depends(ready)):
            """SGLang's: name the weights served (RL loops that load weights their own way tag rollouts with it);
            `abort_all_requests` first ends the requests in flight."""
            if body.abort_all_requests:
                await st.engine.abort_all()
            st.weight_version = body.new_version
            return {"success": True, "message": f"weight version updated to {body.new_version}",
                    "new_version": body.new_version}

        @app.get("/is_sleeping", responses=_ERRORS)
        async def is_sleeping(key: str = Depends(authenticate)):
            return {"is_sleeping": st.sleeping}

        @app.post("/pause", responses=_ERRORS)
        async def pause(mode: str = "abort", wait_for_inflight_requests: bool = False, clear_cache: bool = True,
                        key: str = Depends(authenticate), _r: None = Depends(ready)):
            """vLLM's pause for a weight update: from now on new generation requests wait (unadmitted) until
            POST /resume. `mode=abort` (default) aborts the requests in flight (their answers end with
            finish_reason "abort", their cache is freed); `mode=wait` (or vLLM's older
            `wait_for_inflight_requests=true`) lets them finish. Answers once none is in flight, so
            /update_weights_from_disk or /sleep may follow; `clear_cache` then forgets the prefix cache.
            `mode=keep` keeps the requests in flight open without their cache (`Engine.retract`): the weights may
            change meanwhile and each recomputes its cache under the new ones on /resume (vLLM keeps the old
            weights' cache instead)."""
            mode = "wait" if wait_for_inflight_requests else mode
            if mode not in ("abort", "wait", "keep"):
                raise APIError(400, f"mode must be 'abort', 'wait' or 'keep', got {mode!r}", param="mode")
            aborted, retracted = await hold(mode, f"mode={mode}")
            reset = bool(await st.engine.reset_prefix_cache()) if clear_cache else False
            out = {"status": "paused", "mode": mode, "aborted": aborted, "prefix_cache_reset": reset}
            return {**out, "retracted": retracted} if mode == "keep" else out

        @app.post("/resume", responses=_ERRORS)
        async def resume(key: str = Depends(authenticate)):
            """End a pause: the requests that waited go on (retracted ones recompute under the weights now served)."""
            await unretract()
            st.resume()
            return {"status": "resumed"}

        async def hold(mode: str, name: str) -> tuple[int, int]:
            """A pause: new requests wait (until /resume or /continue_generation); those in flight are retracted
            ("keep": open, without memory, see `Engine.retract`), aborted ("abort") or finished ("wait") ->
            (aborted, retracted)."""
            if mode == "keep" and not hasattr(st.engine, "retract"):
                raise APIError(400, f"{name} is not available with disaggregated prefill", param="mode")
            st.pause()
            if mode == "keep":
                retracted = await st.engine.retract()
                st.retracted = True
                return 0, retracted
            aborted = await st.engine.abort_all() if mode == "abort" else 0
            await st.drained()
            return aborted, 0

        async def unretract() -> None:
            if st.retracted:
                try:
                    await st.engine.continue_generation()
                except EngineSleeping as e:
                    raise APIError(400, f"the retracted requests cannot go on: {e}") from None
                st.retracted = False

        @app.post("/pause_generation", responses=_ERRORS)
        async def pause_generation(body: Optional[PauseGenerationRequest] = None, key: str = Depends(authenticate),
                                   _r: None = Depends(ready)):
            """SGLang's pause: new requests wait until /continue_generation. `mode` "abort" (default) aborts the
            requests in flight; "retract" keeps them, freeing their cache (prompt and tokens so far kept), so the
            weights may change (/update_weights_from_disk, /release_memory_occupation) and each recomputes its
            cache under the new weights when generation continues (partial rollouts). The prefix cache is kept
            (a weight update clears it)."""
            mode = body.mode if body is not None else "abort"
            if mode == "in_place":
                raise APIError(400, "mode='in_place' (requests kept with their cache from the old weights) is not "
                                    "available; 'retract' keeps them and recomputes their cache", param="mode")
            await hold("keep" if mode == "retract" else "abort", f"mode={mode!r}")
            return {"message": "Generation paused successfully.", "status": "ok"}

        @app.post("/continue_generation", responses=_ERRORS)
        async def continue_generation(key: str = Depends(authenticate)):
            """SGLang's end of a pause: retracted requests recompute under the weights now served and go on."""
            await unretract()
            st.resume()
            return {"message": "Generation continued successfully.", "status": "ok"}

        @app.get("/is_paused", responses=_ERRORS)
        async def is_paused(key: str = Depends(authenticate)):
            return {"is_paused": st.paused}

    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize(body: TokenizeRequest, request: Request, key: str = Depends(authenticate),
                       _r: None = Depends(ready)):
        st.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.prompt is not None:  # (`add_special_tokens` adds nothing: no Kimi tokenizer prepends [BOS])
            ids = await _off_loop(request, _encode, st, body.prompt, "prompt")
        else:
            ids = await _off_loop(request, lambda: _chat_ids(
                st, body.messages, body.add_generation_prompt, body.chat_template_kwargs, _tool_plan(body.tools),
                continue_final_message=body.continue_final_message))
        strs = [st.tokenizer.token_str(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids, "token_strs": strs}

    @app.get("/tokenizer_info", responses=_ERRORS)
    async def tokenizer_info(key: str = Depends(authenticate), _r: None = Depends(ready)):
        """vLLM's tokenizer description (what remote-tokenizer clients such as lm-evaluation-harness read).
        The chat formats are Python renderers, not Jinja: no `chat_template` (use /tokenize with messages)."""
        tok = st.tokenizer
        if tok is None:
            raise APIError(404, "this model has no tokenizer")
        name = lambda i: None if i is None else (tok.id_to_token(i) or tok.decode([i], skip_special=False))
        return {"tokenizer_class": type(tok).__name__, "vocab_size": tok.vocab_size,
                "model_max_length": st.max_model_len, "eos_token": name(tok.eos_token_id),
                "eos_token_ids": list(tok.eos_token_ids), "bos_token": name(tok.bos_token_id),
                "pad_token": name(tok.pad_token_id), "chat_template": None, "chat_family": st.chat_family}

    @app.post("/detokenize", responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest, key: str = Depends(authenticate), _r: None = Depends(ready)):
        st.check_model(body.model)
        _check_ids(st, body.tokens, "tokens")
        if st.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="tokens")
        # special tokens kept (vLLM's: HF's decode default), so /tokenize -> /detokenize gives a chat prompt back whole
        return {"prompt": st.tokenizer.decode(body.tokens, skip_special=False)}

    return app


# ---- request handling -------------------------------------------------------------------------------

def _lora_param(message: str) -> str:
    """The field a `LoRAError` is about: the name (in use, not loaded, no free slot) or else the path."""
    return "lora_name" if message.startswith(("lora_name", "max_loras", "max_cpu_loras")) else "lora_path"


# a Responses request's fields under the names of the chat request it becomes (serve/responses.py), for errors
# vLLM's sampling fields of a Responses request, passed to its chat request as they are
_RESPONSES_SAMPLING = ("top_k", "seed", "stop", "repetition_penalty", "logit_bias", "ignore_eos", "skip_special_tokens",
                       "include_stop_str_in_output")
_RESPONSES_NAMES = {"reasoning_effort": "reasoning.effort", "response_format": "text.format",
                    "max_tokens": "max_output_tokens", "messages": "input", "prompt": "input",
                    "logprobs": "top_logprobs"}


def _responses_named(e: APIError) -> APIError:
    """A 400 naming a chat request's field -> the same under the Responses request's name (others: `e`)."""
    name = _RESPONSES_NAMES.get((e.param or "").split(".")[0])
    if e.status != 400 or name is None:
        return e
    why = e.message.partition(": ")[2] or e.message
    return APIError(400, f"{name}: {why}", param=name, code=e.code)


def _constraint_param(body, param: Optional[str]) -> Optional[str]:
    """The request field an output constraint's error (`structured_outputs.<key>`: what `_structured` made of
    it) came from: `response_format`, a `guided_*` field, or the tools of a forced call."""
    if param == "structured_outputs.whitespace_pattern" and getattr(body, "guided_whitespace_pattern", None):
        return "guided_whitespace_pattern"  # (it replaces structured_outputs' own: _structured)
    if not param or not param.startswith("structured_outputs") or getattr(body, "structured_outputs", None):
        return param
    rf = getattr(body, "response_format", None)
    if isinstance(rf, dict) and rf.get("type") in ("json_object", "json_schema"):
        return "response_format"
    for name in ("json", "regex", "choice", "grammar"):
        if getattr(body, f"guided_{name}", None) is not None:
            return f"guided_{name}"
    return "tools" if getattr(body, "tools", None) else param


def _refusal(body, beam: bool, e: RequestError) -> APIError:
    """The 400 of a request the engine refused or ended (`e`: "field: why"), naming the request's field: vllm_xargs
    for the engine's extra_args, n for a beam search's (`beam`) beam_width, a constraint's own field (one that failed
    mid-generation too: `_constraint_param`)."""
    msg = str(e)
    if msg.startswith("extra_args"):  # the engine's name of the request's vllm_xargs
        return APIError(400, "vllm_xargs" + msg[len("extra_args"):], param="vllm_xargs")
    if beam and msg.startswith("beam_width"):  # the engine's name of use_beam_search's n
        return APIError(400, "n" + msg[len("beam_width"):], param="n")
    if msg.startswith("structured_outputs"):
        name = _constraint_param(body, _param_of(msg))
        return APIError(400, f"{name}:{msg.partition(':')[2]}", param=name)
    return APIError(400, msg, param=_param_of(msg))


def engine_failure(e: Exception) -> APIError:
    """What answers a request the engine ended with `e` after accepting it (a failed step: 500; the engine asleep or
    stopped: 503), naming what failed, as a stream's error event does. (Raised as an APIError, the app's handler for
    unexpected errors does not answer it with a bare "internal error: RuntimeError" and a traceback logged twice.)
    A `StepFailed` is named by its `summary`: its message lists the step's requests, other clients' ids among them."""
    if isinstance(e, StepFailed):
        return APIError(500, e.summary, "internal_error")
    if isinstance(e, EngineSleeping):
        return APIError(503, str(e), "server_unavailable", code="engine_sleeping", headers={"Retry-After": "5"})
    if isinstance(e, EngineDead):
        return APIError(503, str(e), "server_unavailable", code="engine_dead")
    return APIError(500, str(e), "internal_error")


def _param_of(message: str) -> Optional[str]:
    """`"field: why"` -> "field" (the engine's and SamplingParams' message convention; "a.b" names a
    nested field)."""
    head, sep, _ = message.partition(":")
    return head if sep and all(p.isidentifier() for p in head.split(".")) else None


def _check_ids(st: ServerState, ids: list[int], param: str) -> None:
    for t in ids:
        if not 0 <= t < st.vocab_size:
            raise APIError(400, f"{param}: token id {t} is outside [0, {st.vocab_size})", param=param)


#: Request bodies at most this long (bytes) are tokenized (the chat rendered) on the event loop; a longer one on a
#: worker thread, as vLLM tokenizes off its loop: a 1 MiB prompt took ~0.4 s, every stream stalled meanwhile.
OFF_LOOP_BYTES = 1 << 15


async def _off_loop(request: Request, fn, *args):
    """`fn(*args)` (tokenizing or rendering a request's prompt): on a worker thread when the request's body is longer
    than `OFF_LOOP_BYTES` or of unknown length, so it never stalls the other requests' streams; inline otherwise."""
    try:
        size = int(request.headers.get("content-length", ""))
    except ValueError:
        size = None
    if size is not None and size <= OFF_LOOP_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def _encode(st: ServerState, text: str, param: str) -> list[int]:
    if st.tokenizer is None:
        raise APIError(400, f"{param}: this model has no tokenizer; pass token ids", param=param)
    try:
        return list(st.tokenizer.encode(text, allow_special=True))  # (see Engine._prompt_ids)
    except UnicodeEncodeError as e:  # a lone surrogate ("\\ud800" in the JSON): not encodable text
        raise APIError(400, f"{param}: not valid Unicode text ({e.reason} at position {e.start})",
                       param=param) from None


async def _completion_inputs(st: ServerState, body: "CompletionRequest",
                             request: Request) -> tuple[list[str], list]:
    """The request's prompts -> (texts for the echo, engine prompts): first each of `prompt_embeds`
    ({"prompt_embeds": [L, H]}, decoded off the event loop), then each of `prompt` (token ids); with
    embeddings an empty `prompt` ("" or omitted) adds nothing (OpenAI's client needs the field)."""
    if body.prompt_embeds is None:
        if body.prompt is None:
            raise APIError(400, "prompt: required (or prompt_embeds)", param="prompt")
        return await _off_loop(request, _completion_prompts, st, body.prompt)
    if st.embeds_dtype is None:
        raise APIError(400, "prompt_embeds: this server was started without --enable-prompt-embeds",
                       param="prompt_embeds")
    items = [body.prompt_embeds] if isinstance(body.prompt_embeds, str) else list(body.prompt_embeds)
    if not items or len(items) > MAX_BATCH:
        raise APIError(400, f"prompt_embeds: 1 to {MAX_BATCH} prompts per request, got {len(items)}",
                       param="prompt_embeds")
    hidden = int(st.cfg.hidden_size)
    try:
        vectors = await asyncio.to_thread(lambda: [prompt_embeds.decode_b64(x, hidden, st.embeds_dtype) for x in items])
    except RequestError as e:
        raise APIError(400, str(e), param="prompt_embeds") from None
    texts, prompts = [""] * len(vectors), [{"prompt_embeds": v} for v in vectors]
    if body.prompt not in (None, "", [], [""]):
        more_texts, more = await _off_loop(request, _completion_prompts, st, body.prompt)
        texts, prompts = texts + more_texts, prompts + more
        if len(prompts) > MAX_BATCH:
            raise APIError(400, f"prompt: at most {MAX_BATCH} prompts per request with prompt_embeds, got "
                                f"{len(prompts)}", param="prompt")
    return texts, prompts


def _prompt_len(prompt) -> int:
    """Positions of an engine prompt: token ids, or {"prompt_embeds": [L, H]}."""
    return len(prompt["prompt_embeds"]) if isinstance(prompt, dict) else len(prompt)


def _prompt_text(st: ServerState, ids: list[int]) -> str:
    """The text `echo` shows for a prompt of token ids: special tokens as their text, as vLLM decodes a token
    prompt and as the same prompt sent as a string echoes ("" without a tokenizer)."""
    return st.tokenizer.decode(ids, skip_special=False) if st.tokenizer is not None else ""


def _completion_prompts(st: ServerState, prompt) -> tuple[list[str], list[list[int]]]:
    if isinstance(prompt, str):
        items = [prompt]
    elif not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    elif isinstance(prompt[0], int):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if len(items) > MAX_BATCH:
        raise APIError(400, f"prompt: at most {MAX_BATCH} prompts per request, got {len(items)}", param="prompt")
    texts, ids = [], []
    for p in items:
        if isinstance(p, str):
            t, x = p, _encode(st, p, "prompt")
        else:
            _check_ids(st, p, "prompt")
            x = list(p)
            t = _prompt_text(st, x)
        if not x:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        texts.append(t)
        ids.append(x)
    return texts, ids


# OpenAI's reasoning efforts that K3 has no level of, on K3's scale (low < high < max): the K3 level in the same place
# (medium, OpenAI's and Codex's default: K3's middle, high); none: no thinking (K3's non-thinking prompt)
OPENAI_EFFORTS = {"minimal": "low", "medium": "high", "xhigh": "max", "none": None}


def k3_effort(effort: str) -> Optional[str]:
    """A request's `reasoning_effort` -> K3's `thinking_effort` (None: thinking off); a ValueError for a name neither
    K3's (low, high, max) nor OpenAI's (`OPENAI_EFFORTS`)."""
    from k3jax.chat_template import K3_THINKING_EFFORTS

    if effort in K3_THINKING_EFFORTS:
        return effort
    if isinstance(effort, str) and effort in OPENAI_EFFORTS:
        return OPENAI_EFFORTS[effort]
    raise ValueError(f"expected one of {', '.join(K3_THINKING_EFFORTS)} (K3's) or {', '.join(OPENAI_EFFORTS)} (OpenAI's: "
                     f"minimal is low, medium high, xhigh max, none no thinking), got {effort!r}")


def _template_kwargs(st: ServerState, body) -> Optional[dict]:
    """`chat_template_kwargs` with `reasoning_effort` (K3's thinking effort, as vLLM and SGLang take it; OpenAI's
    names mapped by `k3_effort`)."""
    kwargs = body.chat_template_kwargs
    effort = getattr(body, "reasoning_effort", None)
    if effort is None:
        return kwargs
    if st.chat_family != "k3":
        raise APIError(400, f"reasoning_effort: the {st.chat_family!r} chat format has no thinking effort",
                       param="reasoning_effort")
    try:
        mapped = k3_effort(effort)
    except ValueError as e:
        raise APIError(400, f"reasoning_effort: {e}", param="reasoning_effort") from None
    kwargs = kwargs or {}
    if mapped is None:  # "none": thinking off
        if kwargs.get("thinking") not in (None, False):  # (null: not given)
            raise APIError(400, f"reasoning_effort: {effort!r} turns thinking off; chat_template_kwargs.thinking is "
                                f"{kwargs['thinking']!r}", param="reasoning_effort")
        return {**kwargs, "thinking": False}
    given = kwargs.get("thinking_effort", mapped)
    if given != mapped:
        raise APIError(400, f"reasoning_effort: {effort!r} (K3's {mapped!r}) differs from "
                            f"chat_template_kwargs.thinking_effort {given!r}", param="reasoning_effort")
    return {**kwargs, "thinking_effort": mapped}


def _tool_plan(tools, tool_choice=None, parallel_tool_calls=None) -> Optional[ToolPlan]:
    """`plan_tools`, a bad field a 400 naming it."""
    try:
        return plan_tools(tools, tool_choice, parallel_tool_calls)
    except RequestError as e:
        raise APIError(400, str(e), param=_param_of(str(e))) from None


def _chat_request(st: ServerState, body: "ChatCompletionRequest", rid: str, run_id: Optional[str] = None):
    """A chat request's prompt ids, sampling parameters and response format."""
    _text_only(body)
    plan = _tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls)
    messages, vectors = _embedded_parts(st, body.messages)
    ids = _chat_ids(st, messages, body.add_generation_prompt, _template_kwargs(st, body), plan,
                    body.continue_final_message, holes=tuple(vectors))
    if vectors:  # the template's tokens as their embeddings, the parts' vectors in their places
        ids = {"prompt_embeds": prompt_embeds.splice(ids, list(vectors.values()), st.token_embeddings)}
    keep = _truncation(st, body.truncate_prompt_tokens)
    if keep is not None:
        ids = {"prompt_embeds": ids["prompt_embeds"][-keep:]} if vectors else ids[-keep:]
    max_tokens = _default_max_tokens(st, [ids], body.max_completion_tokens if body.max_completion_tokens is not None
                                     else body.max_tokens)[0]
    n_lp = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    if body.prompt_logprobs is not None and body.stream:  # (vLLM's rule: a chat chunk has no place for them)
        raise APIError(400, "prompt_logprobs: not available with stream: true in chat completions",
                       param="prompt_logprobs")
    params = _sampling(st, body, max_tokens, n_lp, thinks=_thinks(st, body),
                       constraint=plan.constraint() if plan else None)
    if plan is not None:  # the answer's text keeps the K2 tool-call markers the calls are read from
        params = dataclasses.replace(params, skip_special_tokens=False)
    fmt = _ChatFormat(st, rid, params.n, params.logprobs, int(time.time()),
                      prompt_field=body.prompt_logprobs is not None, reasoning=_reasoning_start(st, body),
                      tools=plan, token_ids=body.return_token_ids, prompt_ids=[] if vectors else ids,
                      tokens_as_ids=body.return_tokens_as_token_ids, run_id=run_id,
                      include_reasoning=body.include_reasoning, echo=_echo(body) if body.echo else "")
    return ids, params, fmt


def _fits(st: ServerState, ids, max_tokens: Optional[int]) -> bool:
    """Whether a prompt leaves a token (`max_tokens` when given) of the context window for the answer."""
    n = _prompt_len(ids)
    return n < st.max_model_len and (max_tokens is None or n + max_tokens <= st.max_model_len)


def _drop_turns(st: ServerState, cuts: list[int], chat_of, request_of, max_tokens: Optional[int]):
    """Responses' `truncation: "auto"`: the chat request (and its `request_of` result) of the conversation without
    the fewest first turns that makes it fit (`cuts`: `turn_starts`; fewer items never make a longer prompt, so a
    bisection); when even the last turn alone does not fit, that one, which the context check then refuses."""
    lo, hi = 1, len(cuts) - 1  # cuts[0] (nothing dropped) did not fit
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        chat = chat_of(cuts[mid])
        got = request_of(chat)
        if _fits(st, got[0], max_tokens):
            best, hi = (chat, got), mid - 1
        else:
            lo = mid + 1
    if best is None:
        chat = chat_of(cuts[-1])
        best = (chat, request_of(chat))
    return best


def _text_only(body: "ChatCompletionRequest") -> None:
    """OpenAI's audio output (`audio`, `modalities` naming "audio"): a 400 naming the field, since this model writes
    text only (rather than an answer without the audio asked for)."""
    if body.modalities is not None and set(body.modalities) != {"text"}:
        raise APIError(400, f"modalities: only [\"text\"] is served (this model writes text), got "
                            f"{json.dumps(body.modalities)}", param="modalities")
    if body.audio is not None:
        raise APIError(400, "audio: audio output is not served (this model writes text)", param="audio")


def _default_max_tokens(st: ServerState, prompts: list, max_tokens: Optional[int],
                        keep: Optional[int] = None) -> list[Optional[int]]:
    """Each prompt's `max_tokens`: as given; unset, the generation config's max_new_tokens (vLLM's) cut to what the
    context leaves after that prompt (its last `keep` tokens when truncated), so a long prompt of a batch does not
    shorten the others' (vLLM's get_max_tokens, per prompt); else None (the rest of the context)."""
    default = getattr(st, "generation_defaults", {}).get("max_tokens")
    if max_tokens is not None or default is None or not st.max_model_len:
        return [max_tokens if max_tokens is not None else default] * len(prompts)
    rooms = (st.max_model_len - min(_prompt_len(p), keep or _prompt_len(p)) for p in prompts)
    return [min(default, room) if room >= 1 else None for room in rooms]  # no room: the context error names it


def _run_max_tokens(each: list[Optional[int]]) -> Optional[int]:
    """The request's one max_tokens of per-prompt ones (`_default_max_tokens`): the least, which fits every prompt
    (what the request log and the checks that take one value use; each prompt runs with its own)."""
    given = [m for m in each if m is not None]
    return min(given) if given else None


def _truncation(st: ServerState, keep: Optional[int]) -> Optional[int]:
    """`truncate_prompt_tokens` as a count of tokens kept: -1 is the context window (vLLM's); 0 or more than the
    context window is a 400 naming it."""
    if keep is None:
        return None
    window = st.max_model_len
    keep = window if keep == -1 and window else keep
    if keep == 0 or keep == -1 or (window and keep > window):
        raise APIError(400, f"truncate_prompt_tokens: expected 1 to the context window of {window} tokens, or -1 "
                            f"for all of it; got {keep}", param="truncate_prompt_tokens")
    return keep


def _echo(body: "ChatCompletionRequest") -> str:
    """vLLM's chat `echo`: the last message's text when its role is the answer's (the assistant's, or with
    add_generation_prompt false the last message's own), text parts joined by newlines; else ""."""
    last = body.messages[-1]
    if body.add_generation_prompt and last.role != "assistant":
        return ""
    if isinstance(last.content, list):
        return "\n".join(p.text for p in last.content if isinstance(p, TextContentPart))
    return last.content or ""


def _thinks(st: ServerState, body) -> bool:
    """The K3 generation prompt opens the think channel (the answer comes after the reasoning)."""
    return st.chat_family == "k3" and body.add_generation_prompt and _thinking(body)


def _thinking(body) -> bool:
    """K3's `chat_template_kwargs.thinking`; unset or null is the renderer's default, on; off with a
    `reasoning_effort` that means no thinking (OpenAI's "none", `k3_effort`)."""
    effort = getattr(body, "reasoning_effort", None)
    if isinstance(effort, str) and effort in OPENAI_EFFORTS and OPENAI_EFFORTS[effort] is None:
        return False
    return (body.chat_template_kwargs or {}).get("thinking") is not False


_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
            "disable_additional_properties", "whitespace_pattern")


def _structured(body: _GenerationFields, thinks: bool,
                constraint: Optional[StructuredOutputsParams] = None) -> Optional[StructuredOutputsParams]:
    """The request's output constraint from `response_format`, `structured_outputs` or `guided_*`, or
    `constraint` (a forced tool call's)."""
    given = [("tool_choice", constraint)] if constraint is not None else []
    rf = body.response_format
    if rf is not None:
        kind = rf.get("type", "text")
        if kind == "json_object":
            given.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise APIError(400, "response_format.json_schema.schema: a JSON schema object is required",
                               param="response_format")
            given.append(("response_format", StructuredOutputsParams(json=spec["schema"])))
        elif kind != "text":
            raise APIError(400, f"response_format.type: must be text, json_object or json_schema, got {kind!r}",
                           param="response_format")
    if body.structured_outputs is not None:
        unknown = sorted(set(body.structured_outputs) - set(_SO_KEYS))
        if unknown:
            raise APIError(400, f"structured_outputs: unknown keys {unknown} (known: {', '.join(_SO_KEYS)})",
                           param="structured_outputs")
        given.append(("structured_outputs", StructuredOutputsParams(**body.structured_outputs)))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{name}")
        if value is not None:
            given.append((f"guided_{name}", StructuredOutputsParams(**{name: value})))
    if len(given) > 1:
        raise APIError(400, f"{given[1][0]}: give one output constraint (also set: {given[0][0]})", param=given[1][0])
    if not given:
        if body.guided_whitespace_pattern is not None:
            raise APIError(400, "guided_whitespace_pattern: applies to a JSON constraint; none is given",
                           param="guided_whitespace_pattern")
        return None
    name, so = given[0]
    if body.guided_whitespace_pattern is not None:
        if so.regex is not None or so.choice is not None or so.grammar is not None:
            raise APIError(400, f"guided_whitespace_pattern: applies to a JSON constraint, not to {name}",
                           param="guided_whitespace_pattern")
        so.whitespace_pattern = body.guided_whitespace_pattern
    try:
        so.kind()
    except RequestError as e:
        raise APIError(400, f"{name}: {str(e).partition(': ')[2]}", param=name) from None
    if thinks:  # constrain the answer, not the reasoning
        so.reasoning_end, so.answer_prefix = THINK_END, RESPONSE_START
    return so


def _reasoning_start(st: ServerState, body) -> Optional[str]:
    """The XTML channel a K3 generation prompt opens ("think" / "response"), None: no reasoning split. A
    continued assistant message continues its response channel."""
    if st.chat_family != "k3" or not getattr(st, "reasoning_parser", True):
        return None
    if getattr(body, "continue_final_message", False):
        return "response"
    if not body.add_generation_prompt:
        return None
    return "think" if _thinking(body) else "response"


def _embedded_parts(st: ServerState, messages: list[ChatMessage]) -> tuple[list[dict], dict[str, "np.ndarray"]]:
    """Chat messages as dicts, each `prompt_embeds` content part replaced by a text that stands for it ->
    (messages, {that text: its vectors [L, H]})."""
    out, vectors = [], {}
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list) and any(isinstance(p, EmbedsContentPart) for p in m.content):
            if st.embeds_dtype is None:
                raise APIError(400, "messages: prompt_embeds content parts need a server started with "
                                    "--enable-prompt-embeds", param="messages")
            if st.multi_process:  # (process 0 alone reading the split table runs a program the others never join)
                raise APIError(400, "messages: prompt_embeds content parts are not served on a multi-process mesh: "
                                    "the template's tokens would take rows of an embedding table split over the "
                                    "processes; send the whole prompt as vectors (/v1/completions prompt_embeds)",
                               param="messages")
            parts = []
            for p in m.content:
                if isinstance(p, EmbedsContentPart):
                    hole = f"\x00prompt-embeds-{uuid.uuid4().hex}\x00"
                    try:
                        vectors[hole] = prompt_embeds.decode_b64(p.data, int(st.cfg.hidden_size), st.embeds_dtype,
                                                                 "messages")
                    except RequestError as e:
                        raise APIError(400, str(e), param="messages") from None
                    parts.append({"type": "text", "text": hole})
                else:
                    parts.append(p.model_dump())
            d["content"] = parts
        out.append(d)
    return out, vectors


def _chat_ids(st: ServerState, messages: list, add_generation_prompt: bool, kwargs: Optional[dict],
              tools: Optional[ToolPlan] = None, continue_final_message: bool = False,
              holes: tuple[str, ...] = ()) -> list[int]:
    """The rendered prompt's ids (`messages`: ChatMessage objects or their dicts); with `holes`, the ids
    -1 - k where holes[k] stood (content given as vectors)."""
    if st.tokenizer is None:
        raise APIError(400, "messages: this model has no tokenizer; use /v1/completions with token ids",
                       param="messages")
    dicts = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]
    if not holes and any(isinstance(p, dict) and p.get("type") == "prompt_embeds"
                         for d in dicts for p in (d.get("content") if isinstance(d.get("content"), list) else ())):
        raise APIError(400, "messages: prompt_embeds content parts are taken by /v1/chat/completions only",
                       param="messages")
    try:
        return chat_ids(st.tokenizer, st.chat_family, dicts, add_generation_prompt, kwargs, tools,
                        continue_final_message, holes)
    except RequestError as e:
        param = next((p for p in ("chat_template_kwargs", "continue_final_message", "tools") if str(e).startswith(p)),
                     "messages")
        raise APIError(400, str(e), param=param) from None


def _sampling(st: ServerState, body: _GenerationFields, max_tokens: Optional[int], logprobs: Optional[int],
              thinks: bool = False, constraint: Optional[StructuredOutputsParams] = None):
    bias = None
    if body.logit_bias:
        try:
            bias = {int(k): float(v) for k, v in body.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias: keys must be token ids (integers as strings)", param="logit_bias") from None
    model = getattr(st, "generation_defaults", {})  # the checkpoint's generation_config.json (vLLM's)

    def unset(value, field: str, default):
        return model.get(field, default) if value is None else value
    params = SamplingParams(
        n=body.n, temperature=unset(body.temperature, "temperature", 1.0),
        top_p=unset(body.top_p, "top_p", 1.0), top_k=unset(body.top_k, "top_k", -1),
        min_p=unset(body.min_p, "min_p", 0.0), seed=body.seed, max_tokens=max_tokens,
        stop=body.stop or [], stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos,
        logprobs=logprobs, include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens, spaces_between_special_tokens=body.spaces_between_special_tokens,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=unset(body.repetition_penalty, "repetition_penalty", 1.0),
        min_tokens=body.min_tokens, logit_bias=bias, allowed_token_ids=body.allowed_token_ids,
        truncate_prompt_tokens=_truncation(st, body.truncate_prompt_tokens), prompt_logprobs=body.prompt_logprobs,
        structured_outputs=_structured(body, thinks, constraint), bad_words=body.bad_words,
        extra_args=body.vllm_xargs)
    try:  # (a client's stop list bounded here: the Python API takes any number)
        params.validate(st.vocab_size, st.max_logprobs, max_stop=MAX_STOP)
    except RequestError as e:
        raise APIError(400, str(e), param=_param_of(str(e))) from None
    return params


def _beam_params(st: ServerState, body: _GenerationFields, params: SamplingParams,
                 prompts: list[list[int]]) -> BeamSearchParams:
    """vLLM's `use_beam_search`: a beam search of width `n` (serve/beam_search.py). Fields that would
    change which tokens a sampler draws have no meaning for it and are refused rather than ignored."""
    unsupported = [("stop", params.stop), ("stop_token_ids", params.stop_token_ids),
                   ("structured_outputs", params.structured_outputs is not None), ("logit_bias", params.logit_bias),
                   ("allowed_token_ids", params.allowed_token_ids), ("bad_words", params.bad_words),
                   ("min_tokens", params.min_tokens), ("presence_penalty", params.presence_penalty),
                   ("frequency_penalty", params.frequency_penalty),
                   ("repetition_penalty", body.repetition_penalty not in (None, 1.0)),  # not the model's default
                   ("prompt_logprobs", params.prompt_logprobs is not None), ("vllm_xargs", params.extra_args)]
    if params.prompt_logprobs is not None and body.prompt_logprobs is None:  # (asked by completions' echo)
        raise APIError(400, "echo: with logprobs (the prompt's scores) not supported with use_beam_search",
                       param="echo")
    for name, value in unsupported:
        if value:  # (a constraint named by the field that asked for it: response_format, guided_*, tools)
            name = _constraint_param(body, name)
            raise APIError(400, f"{name}: not supported with use_beam_search", param=name)
    longest = max(map(_prompt_len, prompts))
    max_tokens = params.max_tokens if params.max_tokens is not None else st.max_model_len - longest
    beam = BeamSearchParams(params.n, max_tokens, params.ignore_eos, params.temperature, body.length_penalty,
                            params.include_stop_str_in_output)
    try:
        beam.validate(st.max_logprobs)
    except RequestError as e:
        raise APIError(400, str(e).replace("beam_width", "n", 1), param="n") from None
    return beam


def _check_context(st: ServerState, prompts: list[list[int]], params: SamplingParams, param: str,
                   budget: str = "max_tokens", each: Optional[list[Optional[int]]] = None) -> int:
    """Raise 400 naming both numbers when a prompt does not fit (vLLM's messages, which clients parse to lower
    their max_tokens); return the tokens to reserve. `budget`: the request's name for max_tokens; `each`: the
    prompts' own max_tokens (else params.max_tokens for all)."""
    L, reserve = st.max_model_len, 0
    for k, ids in enumerate(map(_prompt_len, prompts)):
        if ids >= L:
            raise APIError(400, f"This model's maximum context length is {L} tokens. However, your request has "
                                f"{ids} input tokens. Please reduce the length of the {param} (at least one token "
                                f"must be left for the completion).", param=param, code="context_length_exceeded")
        asked = params.max_tokens if each is None else each[k]
        if asked is not None and ids + asked > L:
            names = "'max_tokens' or 'max_completion_tokens'" if budget == "max_tokens" else f"'{budget}'"
            raise APIError(400, f"{names} is too large: {asked}. This model's maximum context length is {L} tokens "
                                f"and your request has {ids} input tokens ({asked} > {L} - {ids}).",
                           param=budget, code="context_length_exceeded")
        reserve += ids + (L - ids if asked is None else asked) * params.n
    return reserve


async def _serve(st: ServerState, request: Request, key: str, prompts: list[list[int]], params: SamplingParams,
                 body: _GenerationFields, fmt, arrival: float, param: str,
                 max_tokens: Optional[list[Optional[int]]] = None, params_each: Optional[list[SamplingParams]] = None):
    """Run `prompts` and answer in `fmt`; `max_tokens`: each prompt's own (completions' unset max_tokens, cut to what
    each prompt's context leaves), else params.max_tokens for all; `params_each`: each prompt's own sampling (SGLang's
    per-prompt `sampling_params` list, with `max_tokens` given and one `n`), else `params` for all."""
    stream_options = getattr(body, "stream_options", None)
    if stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    include_usage = bool(stream_options and stream_options.include_usage)
    if getattr(body, "return_routed_experts", False):
        if not st.routed_experts:
            raise APIError(400, "return_routed_experts: this server was started without "
                                "--enable-return-routed-experts", param="return_routed_experts")
        if getattr(body, "use_beam_search", False):
            raise APIError(400, "return_routed_experts: beam search hypotheses carry no routed experts",
                           param="return_routed_experts")
        fmt.routes_from = body.routed_experts_start_len
    continuous = include_usage and stream_options.continuous_usage_stats  # usage on every chunk (vLLM)
    budget = getattr(fmt, "budget_field", "max_tokens")
    reserve = _check_context(st, prompts, params, param, budget, max_tokens)
    cap = getattr(st, "max_tokens_cap", None) if budget == "max_tokens" else None  # (vLLM's; not SGLang's route)
    if cap is not None and any(m is not None and m > cap for m in (max_tokens or [params.max_tokens])):
        params.max_tokens = min(params.max_tokens, cap)  # (after vLLM's check; the least of `max_tokens`, if given)
        max_tokens = None if max_tokens is None else [None if m is None else min(m, cap) for m in max_tokens]
        reserve = _check_context(st, prompts, params, param, budget, max_tokens)
    beam = _beam_params(st, body, params, prompts) if getattr(body, "use_beam_search", False) else None
    grammars = getattr(getattr(st.engine, "engine", None), "grammars", None)
    for constraint in (p.structured_outputs for p in params_each or [params]):
        if constraint is None or grammars is None:
            continue
        try:  # compile here, off the engine thread, which copies the matcher the constraint now carries
            await st.compile_constraint(grammars, constraint)
        except RequestError as e:
            field = _param_of(str(e))
            name = _constraint_param(body, field)
            why = str(e).partition(": ")[2] if field else str(e)
            raise APIError(400, f"{name}: {why}" if name else str(e), param=name) from None
    if st.paused:  # POST /pause: wait for /resume (a client that leaves meanwhile is gone: 499)
        try:
            await _unless_disconnected(request, st.unpaused())
        except _ClientGone:
            return Response(status_code=499)
    # checked again after the waits above (an adapter may have been unloaded meanwhile), before admission: a 404
    # raised after it would never release the request's admission
    each = getattr(body, "model_of_each", None)  # (SGLang's per-prompt `lora_path` list)
    lora = [st.check_model(m) for m in each] if each is not None else st.check_model(getattr(body, "model", None))
    if isinstance(lora, str):
        fmt.model = lora  # responses name the adapter that answered (vLLM's)
    ticket = st.admit(key, len(prompts) * params.n, reserve)
    run = _Run(st, prompts, params, fmt.run_id, ticket, arrival, body.priority, getattr(body, "cache_salt", None), lora,
               beam, response_id=fmt.id, key=key, max_tokens=max_tokens, params_each=params_each,
               prompt_ids=getattr(fmt, "rids", None))
    fmt.run = run  # formats that stream whole objects read the merged answer
    handed_off = False
    try:
        run.start()
        if not body.stream:
            async def collect():
                async for _ in run.items():
                    pass
            await _unless_disconnected(request, collect())
            return JSONResponse(fmt.full(run))
        await _unless_disconnected(request, run.prime())  # every prompt accepted (or a 400 below)
        handed_off = True
    except _ClientGone:
        return Response(status_code=499)
    except RequestError as e:
        raise _refusal(body, beam is not None, e) from None
    except APIError:
        raise
    except Exception as e:
        if not (run.failed or isinstance(e, (EngineDead, EngineSleeping))):
            raise  # a bug of ours: the app's handler answers it, the server logs its traceback
        # the engine failed a request it accepted (a failed step; its traceback is logged there), or stopped
        log.warning("request %s failed: %s", loggable(fmt.id), e)
        raise engine_failure(e) from None
    finally:
        if not handed_off:
            run.close()

    async def events():
        try:
            sent: Counter = Counter()  # (prompt, sample) -> its tokens streamed
            for chunk in fmt.start(len(prompts), include_usage):  # (chat's role and echo chunks: 0 tokens yet)
                if continuous:
                    chunk["usage"] = run.choice_usage(chunk, sent)
                yield fmt.sse(chunk)
            async for i, out in run.items():
                for o in out.outputs:
                    sent[i, o.index] += len(o.token_ids)
                for chunk in fmt.deltas(i, out, include_usage):
                    if continuous:
                        chunk["usage"] = run.choice_usage(chunk, sent)
                    yield fmt.sse(chunk)
            for chunk in fmt.end(run, include_usage):
                yield fmt.sse(chunk)
        except Exception as e:  # an engine failure mid-stream: report it in the stream
            log.warning("stream %s failed: %s", loggable(fmt.id), e)
            failure = fmt.named(_refusal(body, beam is not None, e)) if isinstance(e, RequestError) \
                else engine_failure(e)
            for chunk in fmt.failure(failure.message, failure.status, failure.param):
                yield fmt.sse(chunk)
        if fmt.done_marker:
            yield "data: [DONE]\n\n"

    return SSEResponse(events(), on_close=run.close,
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
