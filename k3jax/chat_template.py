"""Chat prompt rendering for K3 (XTML), Kimi-Linear (K2 style) and the byte presets.

Spec §3.4. No Jinja: each format is a few string rules, rendered as a list of
:class:`ChatSegment` so that :func:`encode_chat` can encode the markers as
special ids while encoding user-provided text as *plain text* (a user message
that contains ``"<|im_end|>"`` cannot forge a turn boundary). :func:`render_chat`
joins the segments into the prompt string; encoding that string with
``tokenizer.encode(s, allow_special=True)`` gives the same ids as
:func:`encode_chat` whenever the message text contains no special-token strings
(every segment boundary sits on a special token).

Formats
-------

K3 ("XTML"; markers ``<|open|>``, ``<|sep|>``, ``<|close|>``, ``<|end_of_msg|>``)::

    [thinking-effort preamble, when thinking and thinking_effort is not None]
    <|open|>message role="system"<|sep|>TEXT<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="user"<|sep|>TEXT<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|>[<|open|>think<|sep|><|close|>think<|sep|>]
        <|open|>response<|sep|>TEXT<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>
    generation prompt, thinking:     <|open|>message role="assistant"<|sep|><|open|>think<|sep|>
    generation prompt, not thinking: <|open|>message role="assistant"<|sep|><|open|>response<|sep|>

  Choices (documented because the reference ``encoding_k3.py`` is not in this
  repo; they follow public renderers that were checked against it):

  * ``thinking`` defaults to True (the vendor default). With thinking off the
    generation prompt opens the ``response`` channel directly rather than
    leaving the assistant message body empty -- the model's trained non-thinking
    prefix -- so it is "without the think opener" but *with* the response opener.
  * With thinking on, every past assistant turn carries an *empty* think channel
    (reasoning from history is dropped); with it off there is no think channel.
  * ``thinking_effort`` ("low" | "high" | "max", default "max" like the vendor)
    adds the internal ``role="system" type="thinking-effort"`` message first
    (the ~67-token system message of the spec). ``None`` omits it.
  * ``tool`` messages, assistant ``tool_calls`` and non-text content parts have
    their own XTML encodings that are not implemented: they raise ``ValueError``
    instead of being rendered wrongly. ``name`` is ignored for K3.

Kimi-Linear (K2 style; no separators between turns)::

    <|im_system|>system<|im_middle|>TEXT<|im_end|>
    <|im_user|>{name or "user"}<|im_middle|>TEXT<|im_end|>
    <|im_assistant|>{name or "assistant"}<|im_middle|>TEXT<|im_end|>
    <|im_system|>{name or "tool"}<|im_middle|>## Return of {tool_call_id}\\nTEXT<|im_end|>
    generation prompt: <|im_assistant|>assistant<|im_middle|>

  As in the K2 templates, when the conversation does not start with a system
  message the default system prompt ``"You are Kimi, an AI assistant created by
  Moonshot AI."`` is inserted (``default_system=None`` disables it). The
  ``## Return of`` header is only written when ``tool_call_id`` is given.

Byte presets: the same layout as Kimi-Linear using the byte tokenizer's
specials (``<|im_system|>`` 262, ``<|im_user|>`` 259, ``<|im_assistant|>`` 260,
``<|im_middle|>`` 263, ``<|im_end|>`` 261); no default system prompt.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "ChatFamily",
    "ChatMessage",
    "ChatSegment",
    "CHAT_FAMILIES",
    "ROLES",
    "K3_THINKING_EFFORTS",
    "KIMI_DEFAULT_SYSTEM_PROMPT",
    "chat_markers",
    "validate_messages",
    "render_chat_segments",
    "render_chat",
    "encode_chat",
]

ChatFamily = Literal["k3", "kimi_linear", "byte"]
CHAT_FAMILIES: tuple[str, ...] = ("k3", "kimi_linear", "byte")
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
K3_THINKING_EFFORTS: tuple[str, ...] = ("low", "high", "max")
KIMI_DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

# K3 XTML markers.
_OPEN = "<|open|>"
_CLOSE = "<|close|>"
_SEP = "<|sep|>"
_EOM = "<|end_of_msg|>"
# K2-style markers (Kimi-Linear and the byte tokenizer use the same strings).
_IM_SYSTEM = "<|im_system|>"
_IM_USER = "<|im_user|>"
_IM_ASSISTANT = "<|im_assistant|>"
_IM_MIDDLE = "<|im_middle|>"
_IM_END = "<|im_end|>"

_MARKERS: dict[str, tuple[str, ...]] = {
    "k3": (_OPEN, _CLOSE, _SEP, _EOM),
    "kimi_linear": (_IM_SYSTEM, _IM_USER, _IM_ASSISTANT, _IM_MIDDLE, _IM_END),
    "byte": (_IM_SYSTEM, _IM_USER, _IM_ASSISTANT, _IM_MIDDLE, _IM_END),
}

_K3_EFFORT_TEXT = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including "
    "the response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)


class _FamilyDefault:
    def __repr__(self) -> str:
        return "<family default>"


_FAMILY_DEFAULT: Any = _FamilyDefault()


def family_default_system(family: str) -> str | None:
    """The system prompt a family's format adds to a conversation that starts without one (K2 style's)."""
    return KIMI_DEFAULT_SYSTEM_PROMPT if family == "kimi_linear" else None


@dataclass(frozen=True)
class ChatMessage:
    """A validated message: ``content`` is already flattened to one string."""

    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None


@dataclass(frozen=True)
class ChatSegment:
    """A piece of the rendered prompt.

    ``control`` segments are produced by the renderer (they contain the chat
    markers) and are encoded with special tokens allowed; the others carry
    caller-provided text and are encoded as plain text.
    """

    text: str
    control: bool


def chat_markers(family: str) -> tuple[str, ...]:
    """The special-token strings a tokenizer must define to render ``family``."""
    return _MARKERS[_check_family(family)]


def _check_family(family: Any) -> str:
    if family not in CHAT_FAMILIES:
        raise ValueError(f"family: expected one of {', '.join(map(repr, CHAT_FAMILIES))}, got {family!r}")
    return family


def _type_name(x: Any) -> str:
    return type(x).__name__


def _flatten_content(content: Any, where: str, role: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant":
            return ""
        raise ValueError(f"{where}: missing (only assistant messages may have no content)")
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        texts = []
        for j, part in enumerate(content):
            pw = f"{where}[{j}]"
            if not isinstance(part, Mapping):
                raise ValueError(f"{pw}: expected a dict {{'type': 'text', 'text': str}}, got {_type_name(part)}")
            ptype = part.get("type")
            if ptype != "text":
                raise ValueError(f"{pw}.type: expected 'text', got {ptype!r} (only text content is supported)")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{pw}.text: expected a string, got {_type_name(text)}")
            texts.append(text)
        return "".join(texts)
    raise ValueError(
        f"{where}: expected a string or a list of {{'type': 'text', 'text': str}} parts, "
        f"got {_type_name(content)}"
    )


def validate_messages(messages: Any) -> list[ChatMessage]:
    """Check OpenAI-style messages and normalise them; ``ValueError`` names the bad field.

    Accepted: ``role`` in system/user/assistant/tool; ``content`` a string or a list
    of ``{"type": "text", "text": str}`` parts (``None``/absent only for assistant);
    optional string ``name`` (``""``: none) and ``tool_call_id``. A non-empty ``tool_calls`` is
    rejected (not supported). Other keys are ignored.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages: expected a list of message dicts, got {_type_name(messages)}")
    if len(messages) == 0:
        raise ValueError("messages: must contain at least one message")
    out: list[ChatMessage] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ValueError(f"{where}: expected a dict with 'role' and 'content', got {_type_name(msg)}")
        if "role" not in msg:
            raise ValueError(f"{where}.role: missing")
        role = msg["role"]
        if role not in ROLES:
            raise ValueError(f"{where}.role: expected one of {', '.join(map(repr, ROLES))}, got {role!r}")
        content = _flatten_content(msg.get("content"), f"{where}.content", role)
        name = msg.get("name")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"{where}.name: expected a string, got {name!r}")
        name = name or None  # "" names no one: the role stands, as the K2 templates' `name or role`
        tool_call_id = msg.get("tool_call_id")
        if tool_call_id is not None and not isinstance(tool_call_id, str):
            raise ValueError(f"{where}.tool_call_id: expected a string, got {_type_name(tool_call_id)}")
        if msg.get("tool_calls"):
            raise ValueError(f"{where}.tool_calls: assistant tool calls are not supported by this renderer")
        out.append(ChatMessage(role=role, content=content, name=name, tool_call_id=tool_call_id))
    return out


def _k3_open(tag: str, **attrs: str) -> str:
    parts = [_OPEN, tag]
    for key, value in attrs.items():
        escaped = value.replace("&", "&amp;").replace('"', "&quot;")
        parts.append(f' {key}="{escaped}"')
    parts.append(_SEP)
    return "".join(parts)


def _k3_close(tag: str) -> str:
    return f"{_CLOSE}{tag}{_SEP}"


def _render_k3(
    msgs: list[ChatMessage],
    add_generation_prompt: bool,
    thinking: bool,
    thinking_effort: str | None,
    default_system: str | None,
    continue_final_message: bool = False,
) -> list[ChatSegment]:
    C = lambda s: ChatSegment(s, True)  # noqa: E731
    P = lambda s: ChatSegment(s, False)  # noqa: E731
    seg: list[ChatSegment] = []
    if thinking and thinking_effort is not None:
        seg.append(C(_k3_open("message", role="system", type="thinking-effort")))
        seg.append(C(_K3_EFFORT_TEXT.format(effort=thinking_effort)))
        seg.append(C(_k3_close("message") + _EOM))
    for i, m in enumerate(msgs):
        if m.role == "tool":
            raise ValueError(
                f"messages[{i}].role: 'tool' messages are not supported for family 'k3' "
                "(K3 tool results use a dedicated XTML encoding that is not implemented)"
            )
    if default_system is not None and msgs[0].role != "system":
        msgs = [ChatMessage("system", default_system), *msgs]
    for k, m in enumerate(msgs):
        seg.append(C(_k3_open("message", role=m.role)))
        if m.role == "assistant":
            if thinking:
                seg.append(C(_k3_open("think") + _k3_close("think")))
            seg.append(C(_k3_open("response")))
            seg.append(P(m.content))
            if not (continue_final_message and k == len(msgs) - 1):  # left open: the model continues it
                seg.append(C(_k3_close("response") + _k3_close("message") + _EOM))
        else:
            seg.append(P(m.content))
            seg.append(C(_k3_close("message") + _EOM))
    if add_generation_prompt:
        seg.append(C(_k3_open("message", role="assistant") + _k3_open("think" if thinking else "response")))
    return seg


def _render_k2_style(
    msgs: list[ChatMessage], add_generation_prompt: bool, default_system: str | None,
    continue_final_message: bool = False,
) -> list[ChatSegment]:
    C = lambda s: ChatSegment(s, True)  # noqa: E731
    P = lambda s: ChatSegment(s, False)  # noqa: E731
    seg: list[ChatSegment] = []
    if default_system is not None and msgs[0].role != "system":
        msgs = [ChatMessage("system", default_system), *msgs]
    opener = {"system": _IM_SYSTEM, "user": _IM_USER, "assistant": _IM_ASSISTANT, "tool": _IM_SYSTEM}
    for k, m in enumerate(msgs):
        seg.append(C(opener[m.role]))
        seg.append(P(m.name or m.role))
        seg.append(C(_IM_MIDDLE))
        if m.role == "tool" and m.tool_call_id is not None:
            seg.append(P(f"## Return of {m.tool_call_id}\n{m.content}"))
        else:
            seg.append(P(m.content))
        if not (continue_final_message and k == len(msgs) - 1):  # left open: the model continues it
            seg.append(C(_IM_END))
    if add_generation_prompt:
        seg.append(C(_IM_ASSISTANT))
        seg.append(P("assistant"))
        seg.append(C(_IM_MIDDLE))
    return seg


def render_chat_segments(
    messages: Any,
    family: ChatFamily = "k3",
    add_generation_prompt: bool = True,
    thinking: bool | None = None,
    thinking_effort: str | None = "max",
    default_system: Any = _FAMILY_DEFAULT,
    continue_final_message: bool = False,
) -> list[ChatSegment]:
    """Render to segments (see module docstring). Arguments as in :func:`render_chat`."""
    family = _check_family(family)
    msgs = validate_messages(messages)
    if not isinstance(add_generation_prompt, bool):
        raise ValueError(f"add_generation_prompt: expected a bool, got {_type_name(add_generation_prompt)}")
    if not isinstance(continue_final_message, bool):
        raise ValueError(f"continue_final_message: expected a bool, got {_type_name(continue_final_message)}")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message: cannot be combined with add_generation_prompt (set it false)")
    if continue_final_message and msgs[-1].role != "assistant":
        raise ValueError(f"continue_final_message: the last message must be an assistant message "
                         f"(got {msgs[-1].role!r})")
    if thinking is not None and not isinstance(thinking, bool):
        raise ValueError(f"thinking: expected a bool or None, got {thinking!r}")
    if default_system is _FAMILY_DEFAULT:
        default_system = family_default_system(family)
    elif default_system is not None and not isinstance(default_system, str):
        raise ValueError(f"default_system: expected a string or None, got {_type_name(default_system)}")
    if family == "k3":
        thinking = True if thinking is None else thinking
        if thinking_effort is not None and thinking_effort not in K3_THINKING_EFFORTS:
            raise ValueError(
                f"thinking_effort: expected one of {', '.join(map(repr, K3_THINKING_EFFORTS))} "
                f"or None, got {thinking_effort!r}"
            )
        return _render_k3(msgs, add_generation_prompt, thinking, thinking_effort, default_system,
                          continue_final_message)
    if thinking:
        raise ValueError(f"thinking: family {family!r} has no thinking mode")
    return _render_k2_style(msgs, add_generation_prompt, default_system, continue_final_message)


def render_chat(
    messages: Any,
    family: ChatFamily = "k3",
    add_generation_prompt: bool = True,
    thinking: bool | None = None,
    thinking_effort: str | None = "max",
    default_system: Any = _FAMILY_DEFAULT,
    continue_final_message: bool = False,
) -> str:
    """Render an OpenAI-style message list to a prompt string.

    Args:
      messages: list of ``{"role", "content", ["name"], ["tool_call_id"]}`` dicts.
      family: ``"k3"`` (XTML), ``"kimi_linear"`` (K2 style) or ``"byte"``.
      add_generation_prompt: append the opener of the assistant turn.
      thinking: K3 only; ``None`` means the family default (True for K3, off for
        the others). ``True`` for a non-K3 family raises ``ValueError``.
      thinking_effort: K3 with thinking only; "low" | "high" | "max" | None.
      default_system: system prompt inserted when the first message is not a
        system message; family default: the Kimi prompt for ``kimi_linear``,
        none for ``k3`` and ``byte``. ``None`` disables it.
      continue_final_message: leave the final message, an assistant's, open (no closing markers), so the
        model continues it: a prefilled start of the answer (vLLM's option; needs
        ``add_generation_prompt=False``).

    The string contains the markers literally; encode it with
    ``allow_special=True``, or use :func:`encode_chat`, which does not let
    message text produce special ids.
    """
    return "".join(
        s.text
        for s in render_chat_segments(
            messages,
            family=family,
            add_generation_prompt=add_generation_prompt,
            thinking=thinking,
            thinking_effort=thinking_effort,
            default_system=default_system,
            continue_final_message=continue_final_message,
        )
    )


def encode_chat(tokenizer: Any, messages: Any, family: ChatFamily | None = None, holes: tuple[str, ...] = (),
                **kwargs: Any) -> list[int]:
    """Render and encode in one step: markers become special ids, message text is plain.

    ``family`` defaults to ``tokenizer.chat_family``. Raises ``ValueError`` if the
    tokenizer does not define the family's markers (e.g. a K3 tokenizer asked for
    the Kimi-Linear format), instead of silently shattering them into bytes.
    ``holes``: strings standing in message text for content given otherwise (prompt embeddings); each
    occurrence of ``holes[k]`` becomes the id ``-1 - k`` and the text around it is encoded on its own.
    """
    if family is None:
        family = getattr(tokenizer, "chat_family", None)
    family = _check_family(family)
    missing = [m for m in _MARKERS[family] if tokenizer.token_to_id(m) is None]
    if missing:
        raise ValueError(f"tokenizer {tokenizer!r} does not define the {family!r} chat markers {missing}")
    ids: list[int] = []
    pending: list[str] = []
    pending_control: bool | None = None
    split = re.compile("(" + "|".join(map(re.escape, holes)) + ")") if holes else None

    def run(text: str, control: bool) -> None:
        parts = [text] if split is None or control else split.split(text)
        for k, part in enumerate(parts):
            if k % 2:  # a hole (re.split puts the separators at odd places)
                ids.append(-1 - holes.index(part))
            elif part:
                ids.extend(tokenizer.encode(part, allow_special=control))

    for seg in render_chat_segments(messages, family=family, **kwargs):
        if pending_control is not None and seg.control != pending_control:
            run("".join(pending), pending_control)
            pending = []
        pending.append(seg.text)
        pending_control = seg.control
    if pending:
        run("".join(pending), bool(pending_control))
    return ids
