"""OpenAI's Responses API (`POST /v1/responses`) on top of the chat machinery.

A Responses request is translated into a chat request (`to_chat`): `instructions` and `input` (a string
or a list of items: messages, `function_call`, `function_call_output`; `reasoning` items are dropped, as
the chat formats drop past reasoning) become messages, flat function tools become chat tools,
`text.format` becomes `response_format`. The chat endpoint's result is then translated back
(`response_object`): reasoning (K3's think channel) becomes a `reasoning` item, the answer a `message`
item with one `output_text` part, calls `function_call` items. Streamed, the chat deltas become
Responses events (`ResponseEvents`): `response.created`, `response.in_progress`, per item
`response.output_item.added` / `.done`, its part's `response.content_part.added` / `.done` (a reasoning item's
`reasoning_text` part too), `response.reasoning_text.delta` / `.done`, `response.output_text.delta` / `.done`,
`response.function_call_arguments.delta` / `.done`, and finally
`response.completed` (or `response.incomplete` when `max_output_tokens` cut the answer, status `incomplete`, or
the request was aborted, status `cancelled`; either way the item being written then is `incomplete`); an engine
failure mid-stream ends it with `error` and `response.failed`. `usage.output_tokens_details.reasoning_tokens`
counts the generated tokens of the think channel.
With `include: ["message.output_text.logprobs"]` (or `top_logprobs`), the chat request asks for logprobs
and the `output_text` part carries the answer's tokens (chat's entries: token, logprob, bytes,
top_logprobs); for K3 the think channel and the markup around the answer are left out
(`text_logprobs`, `AnswerTokens`), and each streamed `output_text.delta` carries the tokens that wrote it.

Stored responses (`ResponseStore`): unless a request says `store: false`, its response object and the
conversation it ends (the previous response's conversation, this request's input items, its output
items) are kept in server memory, per API key, least recently used dropped first beyond a fixed count.
`previous_response_id` continues such a conversation (as OpenAI's API: the earlier `instructions` are
not carried over); `GET /v1/responses/{id}` returns a stored response and `DELETE` forgets it. Nothing
is written to disk: a restarted server has no stored responses. With the prefix cache the continued
conversation's prefix is usually still cached (device or host tier), so continuing costs about the new
input's tokens.
"""

from __future__ import annotations

import codecs
import collections
import json
import uuid
from typing import Any, Optional

from serve.chat import _not_text
from serve.reasoning import ChannelSplitter
from serve.types import RequestError

__all__ = ["to_chat", "response_object", "ResponseEvents", "ResponseStore", "input_items", "flat_tool"]


def _text(content: Any, where: str, field: str = "content") -> str:
    """A string, or a list of text parts joined; `where.field` names it in errors."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
                raise RequestError(f"input: {where}.{field}[{k}] must be a text part (input_text / output_text)")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise RequestError(f"input: {where}.{field} must be a string or a list of text parts")


def flat_tool(tool: Any) -> Any:
    """A chat-style function tool (`{"type": "function", "function": {"name", ...}}`) -> the Responses API's flat
    one (`{"type": "function", "name", ...}`), as vLLM normalizes it; anything else unchanged."""
    if isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict) \
            and "name" not in tool:
        return {"type": "function", **tool["function"]}
    return tool


def input_items(body) -> list[dict]:
    """The request's `input` as a list of items (a string is one user message)."""
    return [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) \
        else list(body.input)


_ENUMS = (("text", "verbosity", ("low", "medium", "high")), ("reasoning", "summary", ("auto", "concise", "detailed")))


def check_fields(body) -> None:
    """OpenAI's request fields this server cannot serve, refused naming the field and why (rather than ignored:
    the client would wait on a background run, or miss its prompt template or conversation), and the echoed
    enums checked (the response object must parse)."""
    if body.background:
        raise RequestError("background: background responses are not supported (each response is served within "
                           "its request; give background: false or leave it out)")
    if body.prompt is not None:
        raise RequestError("prompt: stored prompt templates are not supported (give `instructions` and `input`)")
    if body.conversation is not None:
        raise RequestError("conversation: there is no Conversations API here (continue a conversation with "
                           "`previous_response_id`)")
    if body.prompt_cache_retention not in (None, "in_memory"):
        raise RequestError(f"prompt_cache_retention: only 'in_memory' (cached prefixes stay in device / host "
                           f"memory while room allows), got {body.prompt_cache_retention!r}")
    for field, key, allowed in _ENUMS:
        got = (getattr(body, field) or {}).get(key)
        if got is not None and got not in allowed:
            raise RequestError(f"{field}.{key}: expected one of {', '.join(allowed)}, got {got!r}")


def turn_starts(body, previous: Optional[list[dict]] = None) -> list[int]:
    """Where the conversation (`previous` items, then `input`) may be cut for `truncation: "auto"`: 0 and each
    later user message, so what is dropped is whole turns from the beginning (OpenAI's rule), never a function
    call without its output or an output without its call."""
    items = list(previous or []) + input_items(body)
    return [0] + [i for i, it in enumerate(items) if i and isinstance(it, dict)
                  and it.get("type", "message") == "message" and it.get("role") == "user"]


def to_chat(body, previous: Optional[list[dict]] = None, skip: int = 0) -> dict:
    """-> {"messages", "tools", "tool_choice", "response_format", "reasoning_effort"} of the chat request;
    `previous`: the conversation of the response named by `previous_response_id` (its items come first);
    `skip`: how many of the conversation's first items to leave out (a `turn_starts` index)."""
    check_fields(body)
    if body.instructions and _not_text(body.instructions, "instructions"):  # (its system message would name `input`)
        raise RequestError("instructions: not valid Unicode text (a lone surrogate)")
    msgs: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if not input_items(body):
        raise RequestError("input: must not be empty")
    items = list(previous or []) + input_items(body)
    for i, it in enumerate(items):
        if i < skip:
            continue
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise RequestError(f"input: {where} must be an object")
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"input: {where}.role must be user, assistant, system or developer")
            msgs.append({"role": role, "content": _text(it.get("content"), where)})
        elif kind == "function_call":
            if not isinstance(it.get("name"), str) or not isinstance(it.get("call_id"), str):
                raise RequestError(f"input: {where} needs name and call_id")
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it.get("arguments") or "{}"}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls") is not None:
                msgs[-1]["tool_calls"].append(call)  # parallel calls of one turn
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise RequestError(f"input: {where} needs call_id")
            out = it.get("output")  # a string or a list of parts (OpenAI's): the parts' text, not their JSON
            msgs.append({"role": "tool", "tool_call_id": it["call_id"],
                         "content": _text(out, where, "output") if isinstance(out, (str, list)) else json.dumps(out)})
        elif kind == "reasoning":
            continue
        else:
            raise RequestError(f"input: {where}.type {kind!r} is not supported (message, function_call, "
                               f"function_call_output, reasoning)")
    tools = None
    if body.tools:
        tools = []
        for i, t in enumerate(body.tools):
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise RequestError(f"tools: tools[{i}] must be {{'type': 'function', 'name', 'parameters'}} "
                                   f"(built-in tools are not available here)")
            tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                           if k in t}})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise RequestError("tool_choice: expected 'none', 'auto', 'required' or {'type': 'function', 'name'}")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    fmt = (body.text or {}).get("format") if isinstance(body.text, dict) else None
    response_format = None
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise RequestError("text: format.type must be text, json_object or json_schema")
        if fmt["type"] == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise RequestError("text: format.schema must be a JSON schema object")
            response_format = {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"]}}
        elif fmt["type"] == "json_object":
            response_format = {"type": "json_object"}
    effort = (body.reasoning or {}).get("effort") if isinstance(body.reasoning, dict) else None
    return dict(messages=msgs, tools=tools, tool_choice=choice, response_format=response_format,
                reasoning_effort=effort)


def _ids() -> str:
    return uuid.uuid4().hex[:24]


def _envelope(rid: str, created: int, body, model: str, status: str, output: list, usage: Optional[dict] = None,
               incomplete: Optional[str] = None, stored: bool = False, error: Optional[dict] = None) -> dict:
    """The response object: every field of OpenAI's that the request sets, echoed (defaults filled in)."""
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature, "top_p": body.top_p,
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [], "text": {"format": {"type": "text"}, **(body.text or {})},
            "reasoning": body.reasoning, "store": stored, "previous_response_id": body.previous_response_id,
            "truncation": body.truncation or "disabled", "user": body.user, "top_logprobs": body.top_logprobs or 0,
            "background": False, "metadata": body.metadata or {}, "service_tier": body.service_tier or "auto",
            "safety_identifier": body.safety_identifier, "prompt_cache_key": body.prompt_cache_key,
            "prompt_cache_retention": body.prompt_cache_retention, "max_tool_calls": body.max_tool_calls,
            "usage": usage}


def _usage(chat: dict, reasoning_tokens: int) -> dict:
    """Responses usage; `reasoning_tokens`: the generated tokens the think channel took (its end marker's
    included; `serve.reasoning.reasoning_token_count`), never more than the output tokens. `cache_write_tokens`
    (OpenAI's, required by its SDK's type) is 0: no write is billed here (the prefix cache fills as a side
    effect of serving)."""
    u = chat["usage"]
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                                     "cache_write_tokens": 0},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, u["completion_tokens"])},
            "total_tokens": u["total_tokens"]}


def _status(finish_reason: Optional[str]) -> tuple[str, Optional[str]]:
    """-> (status, incomplete_details.reason): cut by max_output_tokens ("length") is OpenAI's `incomplete`; an
    aborted request ("abort": /abort_request, /pause, shutdown) is `cancelled` (vLLM's, OpenAI's status of a
    cancelled response), with no incomplete_details."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


# a stream's last event per status: OpenAI's stream events have no `response.cancelled`; a cancelled response
# ends like one cut short (its status says which)
_TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete",
             "cancelled": "response.incomplete", "failed": "response.failed"}


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _nbytes(entry: dict) -> int:
    return len(entry.get("bytes") or [])


def text_logprobs(entries: Optional[list], text: str, start: Optional[str] = None) -> list:
    """K3's answers: the chat logprob entries of the tokens that wrote `text`, the answer channel. With `start`
    (the channel the prompt opened) the entries' text is split into channels as the chat splits it
    (`AnswerTokens`), so the markup on either side is left out even where it holds the same text (an answer "on":
    `<|close|>response`); else, or when that split does not give `text`, the last occurrence of `text` in what was
    generated, located by bytes, else by the tokens' decoded strings; [] when neither holds it."""
    if not entries or not text:
        return []
    if start is not None:
        answer = AnswerTokens(start)
        answer.add(entries, final=True)
        found = answer.take(text)
        if found is not None:
            return found
    for pieces, target in (([bytes(e.get("bytes") or []) for e in entries], text.encode()),
                           ([e["token"] for e in entries], text)):
        start = pieces[0][:0].join(pieces).rfind(target)
        if start < 0:
            continue
        out, pos = [], 0
        for e, piece in zip(entries, pieces):
            end = pos + len(piece)
            if end > start and pos < start + len(target):
                out.append(e)
            pos = end
        return out
    return []


class AnswerTokens:
    """Which logprob entries wrote a K3 answer's text: their bytes are split into channels as the chat splits its
    text (`ChannelSplitter`), and the answer's characters, in the order the chat shows them, name their tokens; so
    markup beside the answer in the same delta (several tokens a step: drafts, a slow client's merged deltas) or
    holding the same text is left out. `take` gives None once the entries' answer is not the text shown (a special
    token's name the chat skipped, `token_id:N` names): the caller falls back to locating the text."""

    def __init__(self, start: str):
        self.split = ChannelSplitter(start)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.fed = 0  # characters fed to the splitter
        self.queue: list[tuple[dict, int, int]] = []  # (entry, [begin, end) of its text) not given out yet
        self.answer = ""  # the answer's text as the entries write it
        self.shown = 0  # of which the caller took this many characters
        self.span, self.before = 0, 0  # the splitter's content span holding the next of them; the characters before it
        self.broken = False

    def add(self, entries: list, final: bool = False) -> None:
        """The next entries; `final`: the last ones (text held as a possible marker is the answer's)."""
        for e in entries:
            piece = self.decoder.decode(bytes(e.get("bytes") or []))
            partial = bool(self.decoder.getstate()[0])  # (a token holding part of a character writes that character)
            self.queue.append((e, self.fed, self.fed + len(piece) + partial))
            self.fed += len(piece)
            self.answer += self.split.feed(piece)[1]
        if final:
            self.answer += self.split.finish()[1]
        elif self.split.state == "think" and len(self.answer) == self.shown:
            self.queue = []  # (nothing fed so far can still be answer text: a long think channel is not kept)

    def take(self, text: str) -> Optional[list]:
        """The entries that wrote the next `text` of the answer (None: the entries' answer is not that text)."""
        if self.broken or self.answer[self.shown:self.shown + len(text)] != text:
            self.broken = True
            return None
        segments, left, skip, spans = [], len(text), self.shown - self.before, self.split.spans
        for k in range(self.span, len(spans)):  # the answer's characters -> offsets in the entries' text
            begin, end = spans[k]
            if skip >= end - begin:
                skip -= end - begin
                if k < len(spans) - 1:  # (the last span may still grow)
                    self.span, self.before = k + 1, self.before + end - begin
                continue
            segments.append((begin + skip, min(end, begin + skip + left)))
            left -= segments[-1][1] - segments[-1][0]
            skip = 0
            if not left:
                break
        self.shown += len(text)
        last = segments[-1][1] if segments else 0
        out = [e for e, lo, hi in self.queue if any(lo < b and hi > a for a, b in segments)]
        given = {id(e) for e in out}
        self.queue = [q for q in self.queue if id(q[0]) not in given and q[2] > last]
        return out


def trailing_logprobs(entries: list, text: str) -> list:
    """Streaming K3 answers: of the entries generated since the last text delta, the trailing ones whose
    bytes make up the delta `text` (channel markup before it is left out)."""
    room, k = len(text.encode()), len(entries)
    while k > 0 and _nbytes(entries[k - 1]) <= room:
        room -= _nbytes(entries[k - 1])
        k -= 1
    return entries[k:]


def response_object(chat: dict, rid: str, created: int, body, model: str, reasoning_tokens: int = 0,
                    stored: bool = False, start: Optional[str] = None) -> dict:
    """A chat completion (one choice) -> the Responses object; `reasoning_tokens`: the think channel's tokens;
    `start`: the K3 channel the prompt opened (the answer's logprobs are its tokens, `text_logprobs`)."""
    ch = chat["choices"][0]
    m = ch["message"]
    output = []
    reasoning = m.get("reasoning_content") or ""
    if reasoning:
        output.append({"type": "reasoning", "id": f"rs_{_ids()}", "summary": [],
                       "content": [{"type": "reasoning_text", "text": reasoning}], "status": "completed"})
    if m.get("content"):  # no empty message (vLLM's; the stream opens none); text beside calls came before them
        lps = (ch.get("logprobs") or {}).get("content") or []
        if "reasoning_content" in m:  # K3's channels were split: the answer channel's tokens only
            lps = text_logprobs(lps, m["content"], start)
        output.append({"type": "message", "id": f"msg_{_ids()}", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": m["content"], "annotations": [], "logprobs": lps}]})
    for c in m.get("tool_calls") or []:
        output.append({"type": "function_call", "id": f"fc_{_ids()}", "call_id": c["id"],
                       "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"})
    status, reason = _status(ch["finish_reason"])
    if status != "completed" and output:  # the item being written when the answer was cut (OpenAI's)
        output[-1]["status"] = "incomplete"
    return _envelope(rid, created, body, model, status, output,
                     _usage(chat, reasoning_tokens), reason, stored)


class ResponseEvents:
    """Chat completion chunks (one choice) -> Responses streaming events."""

    def __init__(self, rid: str, created: int, body, model: str, stored: bool = False, channels: bool = False,
                 start: Optional[str] = None):
        """`channels`: K3's think / answer channels are split (the answer's logprobs exclude the markup); `start`:
        the channel the prompt opened, which lets the answer's tokens be told from the markup (`AnswerTokens`)."""
        self.rid, self.created, self.body, self.model, self.stored = rid, created, body, model, stored
        self.seq = 0
        self.items: list[dict] = []  # output items, in order
        self.open: Optional[dict] = None  # the item receiving deltas
        self.finish: Optional[str] = None
        self.pending: list = []  # logprob entries of tokens not yet shown as text (held, or channel markup)
        self.split = channels  # answer deltas take only the tokens that wrote them
        self.answer = AnswerTokens(start) if channels and start is not None else None
        self.cut: Optional[dict] = None  # the item being written when the answer was cut short (status incomplete)

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict]:
        r = _envelope(self.rid, self.created, self.body, self.model, "in_progress", [], stored=self.stored)
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        i = self.items.index(item)
        part = item["content"][0]
        if item["type"] == "reasoning":
            ev = [self._event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                              text=part["text"])]
        else:
            ev = [self._event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                              text=part["text"], logprobs=part["logprobs"])]
        ev.append(self._event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                              part=part))
        item["status"] = self._done_status(item)
        return ev + [self._event("response.output_item.done", output_index=i, item=item)]

    def _done_status(self, item: dict) -> str:
        return "incomplete" if item is self.cut else "completed"

    def _open(self, kind: str) -> list[dict]:
        if self.open is not None and self.open["type"] == kind:
            return []
        ev = self._close()
        if kind == "reasoning":
            item = {"type": "reasoning", "id": f"rs_{_ids()}", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": f"msg_{_ids()}", "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.items.append(item)
        self.open = item
        i = len(self.items) - 1
        # the item as it is now (no part yet), then its one part (OpenAI's order, reasoning_text parts as output_text)
        ev.append(self._event("response.output_item.added", output_index=i, item={**item, "content": []}))
        item["content"].append(part)
        ev.append(self._event("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                              part=dict(part)))
        return ev

    def chunk(self, chunk: dict) -> list[dict]:
        ev = []
        for ch in chunk.get("choices", []):
            d = ch.get("delta", {})
            new = (ch.get("logprobs") or {}).get("content") or []
            self.pending += new
            if self.answer is not None:
                self.answer.add(new, final=ch.get("finish_reason") is not None)
            if d.get("reasoning_content"):
                if not d.get("content"):  # think-channel tokens; a chunk that crosses into the answer (several
                    self.pending = []  # tokens: drafts, a slow client's merged deltas) keeps the answer's, trailing
                ev += self._open("reasoning")
                self.open["content"][0]["text"] += d["reasoning_content"]
                ev.append(self._event("response.reasoning_text.delta", item_id=self.open["id"],
                                      output_index=len(self.items) - 1, content_index=0, delta=d["reasoning_content"]))
            if d.get("content"):
                ev += self._open("message")
                lps = self._answer_logprobs(d["content"])
                self.pending = []
                self.open["content"][0]["text"] += d["content"]
                self.open["content"][0]["logprobs"] += lps
                ev.append(self._event("response.output_text.delta", item_id=self.open["id"],
                                      output_index=len(self.items) - 1, content_index=0, delta=d["content"],
                                      logprobs=lps))
            for c in d.get("tool_calls") or []:
                ev += self._call(c)
            if ch.get("finish_reason") is not None:
                self.finish = ch["finish_reason"]
        return ev

    def _answer_logprobs(self, text: str) -> list:
        """The logprob entries of the tokens that wrote the answer delta `text`."""
        if not self.split:
            return self.pending
        found = self.answer.take(text) if self.answer is not None else None
        return found if found is not None else trailing_logprobs(self.pending, text)

    def _call(self, c: dict) -> list[dict]:
        """A tool-call delta: a new call opens a function_call item; later deltas extend its arguments."""
        if "id" in c:
            ev = self._close() + self._done_calls()  # the previous call is whole: each item ends before the next
            item = {"type": "function_call", "id": f"fc_{_ids()}", "call_id": c["id"],
                    "name": c["function"]["name"], "arguments": "", "status": "in_progress"}
            self.items.append(item)
            ev.append(self._event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
        else:
            ev = []
            item = next(it for it in reversed(self.items) if it["type"] == "function_call")
        args = c["function"].get("arguments", "")
        item["arguments"] += args
        if args:
            ev.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=self.items.index(item), delta=args))
        return ev

    def _done_calls(self) -> list[dict]:
        """`.function_call_arguments.done` and `.output_item.done` of the function calls not yet ended."""
        ev = []
        for i, item in enumerate(self.items):
            if item["type"] == "function_call" and item["status"] == "in_progress":
                item["status"] = self._done_status(item)
                ev.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                      arguments=item["arguments"]))
                ev.append(self._event("response.output_item.done", output_index=i, item=item))
        return ev

    def end(self, chat_usage: dict, reasoning_tokens: int = 0) -> list[dict]:
        """The items' done events, then the last event (`response.completed`, or `response.incomplete` for a response
        cut short or cancelled: its last item `incomplete`) with the whole response."""
        status, reason = _status(self.finish)
        if status != "completed" and self.items:
            self.cut = self.items[-1]
        ev = self._close() + self._done_calls()
        r = _envelope(self.rid, self.created, self.body, self.model, status, self.items,
                      _usage({"usage": chat_usage}, reasoning_tokens), reason, self.stored)
        return ev + [self._event(_TERMINAL[status], response=r)]

    def fail(self, message: str, code: str = "server_error", param: Optional[str] = None) -> list[dict]:
        """The engine failed mid-stream: OpenAI's `error` event (`param`: the request field it is about), then
        `response.failed` with the items so far (each event typed and numbered in the stream's sequence)."""
        r = _envelope(self.rid, self.created, self.body, self.model, "failed", self.items, stored=False,
                      error={"code": code, "message": message})
        return [self._event("error", code=code, message=message, param=param),
                self._event(_TERMINAL["failed"], response=r)]


class ResponseStore:
    """Responses kept for `previous_response_id` and `GET` / `DELETE /v1/responses/{id}`: per owner (the API
    key), the response object and the conversation it ends; at most `max_entries`, least recently used
    dropped first. In memory only."""

    def __init__(self, max_entries: int = 1024):
        if max_entries < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[tuple[str, str], tuple[dict, list[dict]]] = collections.OrderedDict()

    def put(self, owner: str, response: dict, conversation: list[dict]) -> None:
        if not self.max_entries:
            return
        k = (owner, response["id"])
        self._entries[k] = (response, conversation)
        self._entries.move_to_end(k)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, owner: str, rid: str) -> Optional[tuple[dict, list[dict]]]:
        """(response, conversation) or None (unknown, dropped, or another key's)."""
        got = self._entries.get((owner, rid))
        if got is not None:
            self._entries.move_to_end((owner, rid))
        return got

    def delete(self, owner: str, rid: str) -> bool:
        return self._entries.pop((owner, rid), None) is not None

    def __len__(self) -> int:
        return len(self._entries)
