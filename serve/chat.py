"""OpenAI chat messages -> prompt token ids, shared by the HTTP chat endpoint and `LLM.chat`.

On top of `k3jax.chat_template.encode_chat` (the family's format) it maps what OpenAI clients send onto
what the renderers take: `developer` is `system`; assistant `tool_calls` become their JSON text and the
function listing becomes a system message (serve/tools.py's call format); on K3, whose own tool-result
encoding is not in spec/, a `tool` message becomes a system message with Kimi-K2's `## Return of {id}`
header (what the Kimi-Linear format writes for tool results), so an agent loop can continue.
"""

from __future__ import annotations

from typing import Any, Optional

from k3jax.chat_template import encode_chat, family_default_system, validate_messages
from serve.tools import ToolPlan, history_message, tools_system_message
from serve.types import RequestError

__all__ = ["prepare_messages", "chat_ids"]


def prepare_messages(messages: list[dict], family: str, tools: Optional[ToolPlan] = None,
                     default_system: Any = None) -> list[dict]:
    """Normalised copies of `messages`; RequestError naming the bad field of a message (a malformed tool call
    too) by its index in `messages` (checked before anything is converted or inserted).
    `default_system`: the family's default system prompt, which the tools' system message must not
    displace (the renderer only adds it to a conversation that does not start with a system message)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages: [{i}] must be a message object")
        d = history_message(dict(m), f"messages[{i}]")
        if d.get("role") == "developer":
            d["role"] = "system"
        out.append(d)
    _validate(out)  # before any message is converted or inserted: errors name the caller's indices
    if family == "k3":
        out = [_k3_tool_result(d) if d["role"] == "tool" else d for d in out]
    if tools is not None:  # after the leading system messages (a K2-style default system still comes first)
        at = next((i for i, m in enumerate(out) if m.get("role") != "system"), len(out))
        if at == 0 and isinstance(default_system, str):
            out.insert(0, {"role": "system", "content": default_system})
            at = 1
        out.insert(at, {"role": "system", "content": tools_system_message(tools)})
    return out


def _validate(messages: list[dict]) -> None:
    try:
        validate_messages(messages)
    except ValueError as e:
        raise RequestError(str(e)) from None


def _k3_tool_result(d: dict) -> dict:
    """A tool result as K3 sees it: a system message with Kimi-K2's `## Return of {id}` header."""
    header = f"## Return of {d['tool_call_id']}\n" if d.get("tool_call_id") else ""
    return {"role": "system", "content": header + _text(d.get("content"))}


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _not_text(value: Any, where: str) -> Optional[str]:
    """Where in `value` (JSON data at `where`) the first string that is not Unicode text is: a lone surrogate, which
    JSON's "\\ud800" carries and the tokenizer cannot encode; else None."""
    if isinstance(value, str):
        return None if value.isascii() or not any("\ud800" <= c <= "\udfff" for c in value) else where
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return next((w for k, v in items if (w := _not_text(v, f"{where}.{k}")) is not None), None)


def chat_ids(tokenizer, family: str, messages: list[dict], add_generation_prompt: bool = True,
             template_kwargs: Optional[dict] = None, tools: Optional[ToolPlan] = None,
             continue_final_message: bool = False, holes: tuple[str, ...] = ()) -> list[int]:
    """The prompt ids of a conversation; RequestError naming the field on bad input. `holes`: texts that
    stand for content given as vectors, each becoming the id -1 - k (k3jax.chat_template.encode_chat)."""
    if tokenizer is None:
        raise RequestError("messages: this model has no tokenizer; use token ids")
    # vLLM's: keys the template does not take are left out (clients send other models' switches, such as Qwen's
    # enable_thinking or DeepSeek's / K3's thinking, to every server); only K3's template has a thinking mode
    takes = ("thinking", "thinking_effort", "default_system") if family == "k3" else ("default_system",)
    kwargs = {k: v for k, v in (template_kwargs or {}).items() if k in takes}
    default_system = kwargs.get("default_system", family_default_system(family))
    msgs = prepare_messages(messages, family, tools, default_system)
    try:
        ids = encode_chat(tokenizer, msgs, family=family, add_generation_prompt=add_generation_prompt,
                          continue_final_message=continue_final_message, holes=holes, **kwargs)
    except UnicodeEncodeError as e:  # (before ValueError, its base: the 400 named no field)
        where = (_not_text(messages, "messages") or _not_text(kwargs, "chat_template_kwargs")
                 or ("tools" if tools is not None else "messages"))
        raise RequestError(f"{where}: not valid Unicode text ({e.reason})") from None
    except (ValueError, TypeError) as e:
        raise RequestError(str(e)) from None
    if not ids:
        raise RequestError("messages: the rendered prompt is empty")
    return ids
