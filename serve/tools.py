"""Function calling in chat completions (OpenAI's `tools` / `tool_choice`), in a model-agnostic format.

K3's native tool-call encoding is not in this repository's spec, so the server uses one plain format
and says so in the prompt: a system message lists the functions (name, description, JSON schema of the
parameters) and asks for calls as a JSON array `[{"name": ..., "parameters": {...}}]`. Then:

* `tool_choice="required"`: the answer is constrained (serve/structured.py) to a non-empty array of
  calls of the listed functions, each with parameters valid under its schema (one call when
  `parallel_tool_calls` is false); `finish_reason` is "tool_calls".
* `tool_choice={"type": "function", "function": {"name": N}}`: the answer is constrained to N's
  parameters object, returned as one call of N; `finish_reason` "stop" (as OpenAI does for a forced
  function).
* `tool_choice="auto"` (the default with tools): the answer is not constrained; when it is exactly a
  JSON array of calls of listed functions it is returned as `tool_calls`, otherwise as `content`. An answer
  in Kimi-K2's own tool-call format (what Kimi-Linear is trained to write whatever the prompt says) is read
  too, as vLLM's kimi_k2 parser reads it (`parse_k2_calls`): the text before its section is the content.
* `tool_choice="none"`: tools are neither shown nor called.

Streamed, a named call's arguments and `required` calls go out as they are generated (`CallStream`
reads the constrained array incrementally: each call's id and name once its name is complete, then its
arguments text piece by piece); a possible `auto` call is held back and sent whole at the end, since
unconstrained text may turn out not to be a call (text streams up to a K2 section's marker, `split_k2_section`).

Assistant messages in the history that carry `tool_calls` are rendered in the same JSON form, so the
model sees its earlier calls as it wrote them; `tool` messages follow the family's chat format.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from serve.structured import rebase_refs
from serve.types import RequestError, StructuredOutputsParams

__all__ = ["ToolPlan", "plan_tools", "tools_system_message", "parse_calls", "parse_k2_calls", "split_k2_section",
           "cut_calls", "history_message", "CallStream"]

_NAMED, _REQUIRED, _AUTO = "named", "required", "auto"
CALL_WHITESPACE = r"[ ]?"  # between two JSON tokens of a forced call


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its prompt, its constraint and its answer."""

    mode: str  # "named" | "required" | "auto"
    functions: tuple[dict, ...]  # {"name", "description", "parameters"} as given
    name: Optional[str] = None  # the forced function (named)
    parallel: bool = True

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}

    def constraint(self) -> Optional[StructuredOutputsParams]:
        """The forced call's constraint; at most one space between JSON tokens (the arguments are
        re-serialised anyway, and a call should not spend tokens on layout)."""
        if self.mode == _NAMED:
            return StructuredOutputsParams(json=_parameters(self._function(self.name)),
                                           whitespace_pattern=CALL_WHITESPACE)
        if self.mode == _REQUIRED:  # (each schema's own "#/$defs/..." refs now point into its call's place)
            calls = [{"type": "object", "properties": {
                "name": {"const": f["name"]},
                "parameters": rebase_refs(_parameters(f), f"#/items/anyOf/{i}/properties/parameters")},
                "required": ["name", "parameters"], "additionalProperties": False}
                for i, f in enumerate(self.functions)]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema, whitespace_pattern=CALL_WHITESPACE)
        return None

    def _function(self, name: str) -> dict:
        return next(f for f in self.functions if f["name"] == name)


def _parameters(function: dict) -> dict:
    params = function.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def plan_tools(tools: Optional[list], tool_choice: Any, parallel_tool_calls: Optional[bool]) -> Optional[ToolPlan]:
    """Validate `tools` / `tool_choice` (RequestError naming the field); None when no tool can be called."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise RequestError("tool_choice: given without tools")
    if not tools or tool_choice == "none":
        return None
    functions = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise RequestError(f"tools: {where} must be {{'type': 'function', 'function': {{'name', ...}}}}")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise RequestError(f"tools: {where}.function.name must be a non-empty string of at most 64 characters")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):  # (null: none, as vLLM's)
            raise RequestError(f"tools: {where}.function.parameters must be a JSON schema object")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise RequestError(f"tools: {where}.function.description must be a string")
        if any(g["name"] == name for g in functions):
            raise RequestError(f"tools: function name {name!r} is given twice")
        functions.append({"name": name, "description": f.get("description") or "",
                          "parameters": f.get("parameters") or {"type": "object"}})
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if tool_choice in (None, _AUTO):
        return ToolPlan(_AUTO, tuple(functions), parallel=parallel)
    if tool_choice == _REQUIRED:
        return ToolPlan(_REQUIRED, tuple(functions), parallel=parallel)
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function") if tool_choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise RequestError("tool_choice: expected {'type': 'function', 'function': {'name': ...}}")
        if name not in {f["name"] for f in functions}:
            raise RequestError(f"tool_choice: function {name!r} is not among the tools")
        return ToolPlan(_NAMED, tuple(functions), name=name, parallel=parallel)
    raise RequestError(f"tool_choice: expected 'none', 'auto', 'required' or a function, got {tool_choice!r}")


def tools_system_message(plan: ToolPlan) -> str:
    """The system text that shows the functions and the call format."""
    listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in plan.functions)
    if plan.mode == _NAMED:
        how = (f"Call the function {plan.name}: answer with only its parameters, one JSON object valid under "
               f"its parameters schema.")
    else:
        how = ('To call functions, answer with only a JSON array of calls, [{"name": <function name>, '
               '"parameters": <JSON object valid under its parameters schema>}]'
               + ("" if plan.parallel else " with exactly one call") + ".")
        if plan.mode == _AUTO:
            how += " Otherwise answer normally."
    return f"# Tools\nYou can call these functions (JSON, one per line):\n{listing}\n\n{how}"


def _not_json(token: str):
    raise ValueError(f"{token} is not JSON")


def _finite(token: str) -> float:
    """A JSON number as a float; ValueError when it overflows (1e999 would re-serialise as `Infinity`)."""
    x = float(token)
    if x in (float("inf"), float("-inf")):
        raise ValueError(f"{token} overflows a float")
    return x


def parse_calls(plan: ToolPlan, text: str) -> Optional[list[dict]]:
    """The answer as OpenAI `tool_calls`, or None when it is not a call (auto) or is cut short. Strict JSON:
    NaN / Infinity are not, and a number too large for a float is not taken (the arguments are
    re-serialised, which would write it as `Infinity`; a forced call keeps its text as written, `cut_calls`)."""
    try:
        value = json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except (ValueError, TypeError, RecursionError):  # (an answer nested past the recursion limit is no call either)
        return None
    if plan.mode == _NAMED:
        calls = [{"name": plan.name, "parameters": value}] if isinstance(value, dict) else None
    else:
        ok = (isinstance(value, list) and value and all(
            isinstance(c, dict) and set(c) == {"name", "parameters"} and c["name"] in plan.names
            and isinstance(c["parameters"], dict) for c in value))
        calls = value if ok else None
    if calls is None:
        return None
    if not plan.parallel:  # (vLLM's: the first call only; `auto` answers are not constrained to one)
        calls = calls[:1]
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["parameters"], ensure_ascii=False)}}
            for c in calls]


# Kimi-K2's own tool-call format, which Kimi-Linear (K2's chat format) is trained to write:
#   <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>
#   ...<|tool_calls_section_end|>
K2_SECTION_BEGINS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")  # (vLLM reads both spellings)
_K2_CALL = re.compile(r"<\|tool_call_begin\|>\s*(?P<id>[^<]+:\d+)\s*<\|tool_call_argument_begin\|>\s*"
                      r"(?P<arguments>(?:(?!<\|tool_call_begin\|>).)*?)\s*<\|tool_call_end\|>", re.DOTALL)


def k2_section_start(text: str) -> Optional[int]:
    """Where a K2 tool-call section opens in `text`, or None."""
    found = [i for i in (text.find(m) for m in K2_SECTION_BEGINS) if i >= 0]
    return min(found) if found else None


def split_k2_section(text: str) -> tuple[str, str]:
    """Streamed text -> (what can be sent as content now, what to hold): the hold starts at a K2 tool-call section's
    marker, or at a tail that may be the start of one (the marker can arrive split across deltas)."""
    at = k2_section_start(text)
    if at is None:
        at = next((i for i in range(max(0, len(text) - len(K2_SECTION_BEGINS[0])), len(text))
                   if any(m.startswith(text[i:]) for m in K2_SECTION_BEGINS)), len(text))
    return text[:at], text[at:]


def parse_k2_calls(plan: ToolPlan, text: str) -> Optional[tuple[str, list[dict]]]:
    """An answer in Kimi-K2's own tool-call format -> (the text before the calls, OpenAI `tool_calls`), as vLLM's
    kimi_k2 parser reads it: each call's id is its `functions.NAME:IDX` as written (the K2 format's own id, which
    its tool results name), its name the part after the last dot, its arguments as written. None when there is
    no section with a whole call (then the answer is text)."""
    at = k2_section_start(text)
    if at is None:
        return None
    calls = [{"id": m["id"].strip(), "type": "function",
              "function": {"name": m["id"].split(":")[0].split(".")[-1].strip(), "arguments": m["arguments"]}}
             for m in _K2_CALL.finditer(text, at)]
    if not calls:
        return None
    return text[:at], calls if plan.parallel else calls[:1]


def cut_calls(plan: ToolPlan, text: str) -> list[dict]:
    """A forced answer, whole or cut short (max_tokens, a stop string), as OpenAI `tool_calls`: what streaming
    sent of it (a named call's arguments as written; `required` calls as far as `CallStream` read them), so the
    whole response says what the stream did."""
    if plan.mode == _NAMED:
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": plan.name, "arguments": text}}] if text else []
    calls: dict[int, dict] = {}
    for d in CallStream().feed(text):
        if "id" in d:
            calls[d["index"]] = {"id": d["id"], "type": "function", "function": dict(d["function"])}
        else:
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def _is_text(text: str) -> bool:
    """Whether `text` is Unicode text the tokenizer can encode (no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def history_message(message: dict, where: str = "messages") -> dict:
    """An assistant message with `tool_calls` -> the same message with the calls as its JSON text. `where`: the
    message's place in the request (`messages[2]`), which a malformed call's RequestError names."""
    calls = message.get("tool_calls")
    if not calls:
        return {k: v for k, v in message.items() if k != "tool_calls"}
    out = []
    for i, c in enumerate(calls):
        at = f"{where}.tool_calls[{i}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise RequestError(f"{at}: must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}")
        raw = f.get("arguments")
        if raw is not None and not isinstance(raw, str):
            raise RequestError(f"{at}: function.arguments must be a JSON string")
        try:
            args = json.loads(raw or "{}")
            text = json.dumps(args, ensure_ascii=False)
        except json.JSONDecodeError:
            raise RequestError(f"{at}: function.arguments is not JSON") from None
        except RecursionError:  # ("[[[...]]]" past the interpreter's recursion limit: it was a 500)
            raise RequestError(f"{at}: function.arguments nests arrays and objects too deeply") from None
        if not _is_text(text):  # an escaped lone surrogate ("\\ud800"), decoded
            raise RequestError(f"{at}: function.arguments is not valid Unicode text (a lone surrogate)")
        out.append({"name": f["name"], "parameters": args})
    text = json.dumps(out, ensure_ascii=False)
    content = message.get("content")
    if isinstance(content, list) and content:  # text parts (kept as parts: the renderer checks and joins them)
        body: Any = [*content, {"type": "text", "text": f"\n{text}"}]
    else:
        body = f"{content}\n{text}" if isinstance(content, str) and content else text
    return {**{k: v for k, v in message.items() if k != "tool_calls"}, "content": body}


class CallStream:
    """Incremental reader of a `[{"name": ..., "parameters": {...}}, ...]` answer as it is generated ->
    OpenAI streaming `tool_calls` deltas: a call's first delta carries its index, id, type and name
    (sent once the name string is complete), the next ones pieces of its `arguments` (the parameters
    object's text as written; the pieces concatenate to valid JSON). Arguments written before the name
    (the keys in the other order) wait for it. Only the JSON's lexical structure is tracked (strings,
    escapes, nesting), which is all the constrained format needs."""

    def __init__(self):
        self.depth = 0  # nesting: 1 inside the array, 2 inside a call object, more inside its values
        self.in_string = self.escape = False
        self.key = ""  # the call object's key being read or last read
        self.reading_key = False
        self.value_of: Optional[str] = None  # the call key whose value is being read
        self.value_depth = 0  # depth at which that value started
        self.text = ""  # the value's text so far (name string, or arguments)
        self.index = -1  # current call
        self.named: set[int] = set()  # calls whose header was sent
        self.pending: dict[int, str] = {}  # arguments written before the call's name
        self.args_open = False  # inside a parameters value

    def feed(self, text: str) -> list[dict]:
        out: list[dict] = []
        args = []  # pieces of the current call's arguments in this feed

        def flush_args():
            if args:
                self._arguments("".join(args), out)
                args.clear()

        for ch in text:
            if self.args_open:
                if self._end_of_value(ch):
                    self.args_open = False
                    flush_args()
                else:
                    if self.in_string or self.depth != self.value_depth or not ch.isspace():
                        args.append(ch)  # (layout around the object is not part of the arguments)
                    self._lex(ch)
                    continue
            if self.value_of == "name":
                if not self.in_string:
                    if ch == '"':
                        self.in_string, self.text = True, ""
                elif self._string(ch):
                    self.value_of = None
                    self._header(json.loads('"' + self.text + '"'), out)
                else:
                    self.text += ch
                continue
            self._structure(ch)
        flush_args()
        return out

    # ---- lexing -----------------------------------------------------------------------------------
    def _string(self, ch: str) -> bool:
        """One character inside a string: track escapes; -> True when it closes the string."""
        if self.escape:
            self.escape = False
        elif ch == "\\":
            self.escape = True
        elif ch == '"':
            self.in_string = False
            return True
        return False

    def _lex(self, ch: str) -> None:
        """Track strings and nesting inside a parameters value."""
        if self.in_string:
            self._string(ch)
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1

    def _end_of_value(self, ch: str) -> bool:
        """Whether `ch` ends the parameters value (a `,` or `}` back at the call object's level)."""
        return not self.in_string and self.depth == self.value_depth and ch in ",}"

    def _structure(self, ch: str) -> None:
        """Outside values the tool format reads: array, call objects, their keys."""
        if self.in_string:
            if self._string(ch):
                self.reading_key = False
            elif self.reading_key:
                self.key += ch
            return
        if ch == '"':
            self.in_string = True
            if self.depth == 2 and self.value_of is None:
                self.reading_key, self.key = True, ""
        elif ch == ":" and self.depth == 2:
            if self.key == "name":
                self.value_of = "name"
            elif self.key == "parameters":
                self.args_open, self.value_depth = True, self.depth
        elif ch in "{[":
            self.depth += 1
            if self.depth == 2 and ch == "{":
                self.index += 1
        elif ch in "}]":
            self.depth -= 1

    # ---- deltas -------------------------------------------------------------------------------------
    def _header(self, name: str, out: list[dict]) -> None:
        i = self.index
        out.append({"index": i, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": name, "arguments": self.pending.pop(i, "")}})
        self.named.add(i)

    def _arguments(self, piece: str, out: list[dict]) -> None:
        i = self.index
        if i not in self.named:
            self.pending[i] = self.pending.get(i, "") + piece
        elif out and out[-1]["index"] == i and "id" not in out[-1]:
            out[-1]["function"]["arguments"] += piece
        else:
            out.append({"index": i, "function": {"arguments": piece}})
