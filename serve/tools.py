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
  JSON array of calls of listed functions it is returned as `tool_calls`, otherwise as `content`.
* `tool_choice="none"`: tools are neither shown nor called.

Assistant messages in the history that carry `tool_calls` are rendered in the same JSON form, so the
model sees its earlier calls as it wrote them; `tool` messages follow the family's chat format.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from serve.types import RequestError, StructuredOutputsParams

__all__ = ["ToolPlan", "plan_tools", "tools_system_message", "parse_calls", "history_message"]

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
        if self.mode == _REQUIRED:
            calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "parameters": _parameters(f)},
                      "required": ["name", "parameters"], "additionalProperties": False} for f in self.functions]
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
        if "parameters" in f and not isinstance(f["parameters"], dict):
            raise RequestError(f"tools: {where}.function.parameters must be a JSON schema object")
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
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
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


def parse_calls(plan: ToolPlan, text: str) -> Optional[list[dict]]:
    """The answer as OpenAI `tool_calls`, or None when it is not a call (auto) or is cut short."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError):
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
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["parameters"], ensure_ascii=False)}}
            for c in calls]


def history_message(message: dict) -> dict:
    """An assistant message with `tool_calls` -> the same message with the calls as its JSON text."""
    calls = message.get("tool_calls")
    if not calls:
        return {k: v for k, v in message.items() if k != "tool_calls"}
    out = []
    for i, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise RequestError(f"messages: tool_calls[{i}] must be {{'type': 'function', 'function': {{'name', "
                               f"'arguments'}}}}")
        try:
            args = json.loads(f.get("arguments") or "{}")
        except json.JSONDecodeError:
            raise RequestError(f"messages: tool_calls[{i}].function.arguments is not JSON") from None
        out.append({"name": f["name"], "parameters": args})
    text = json.dumps(out, ensure_ascii=False)
    content = message.get("content")
    body = f"{content}\n{text}" if isinstance(content, str) and content else text
    return {**{k: v for k, v in message.items() if k != "tool_calls"}, "content": body}
