"""Tokenizers for k3jax (spec §3.4 "Tokenizer and chat format", §1 special ids).

Two implementations behind one small base class:

* :class:`ByteTokenizer` -- the default for the synthetic/preset models: ids
  0..255 are raw bytes, ids 256..263 are named control tokens and every id in
  264..vocab_size-1 is an (untrained) ``<|reserved_token_{id}|>`` special.
* :class:`KimiTokenizer` -- the real Kimi tiktoken BPE shared by K2, Kimi-Linear
  and K3, loaded from a *local* checkpoint directory (``tiktoken.model`` +
  ``tokenizer_config.json``; ``config.json`` / ``generation_config.json`` are
  read for extra stop ids when present). Nothing is ever downloaded.

:func:`load_tokenizer` picks between them, and :class:`IncrementalDetokenizer`
turns a stream of ids into text without emitting half of a multi-byte UTF-8
character.

Conventions shared by both tokenizers:

* ``encode(text, add_special=False, allow_special=False)``: ``add_special``
  prepends ``bos_token_id`` (the Kimi chat formats never do this -- K3 declares
  ``[BOS]`` but does not prepend it). ``allow_special`` controls whether the
  *string form* of a special token inside ``text`` is encoded as that special
  id (``True`` = every special, or a set of allowed special strings); by default
  such strings are ordinary text, which is the injection-safe choice for user
  content.
* ``decode(ids, skip_special=True)``: bytes are joined and decoded as UTF-8 with
  invalid sequences replaced by U+FFFD. With ``skip_special`` the ids flagged
  *special* are dropped; ids outside ``[0, vocab_size)`` raise ``ValueError``.
  For the Kimi tokenizer the flag comes from ``added_tokens_decoder[..].special``
  (K3's XTML markers ``<|open|>``/``<|close|>``/``<|sep|>`` are ``special:false``
  and therefore survive ``skip_special``, as in the reference HF tokenizer);
  unnamed reserved ids are special.
"""

from __future__ import annotations

import abc
import base64
import binascii
import codecs
import json
import logging
import operator
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Set
from typing import Any, Literal

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "KimiTokenizer",
    "IncrementalDetokenizer",
    "load_tokenizer",
    "decode_stream",
    "split_for_encoding",
    "KIMI_PAT_STR",
    "KIMI_PAT_STR_V1",
    "KIMI_NUM_BASE_TOKENS",
    "KIMI_NUM_RESERVED_SPECIAL_TOKENS",
    "MAX_ENCODE_CHARS",
    "MAX_WHITESPACE_RUN_CHARS",
    "BYTE_BOS",
    "BYTE_EOS",
    "BYTE_PAD",
    "BYTE_IM_USER",
    "BYTE_IM_ASSISTANT",
    "BYTE_IM_END",
    "BYTE_IM_SYSTEM",
    "BYTE_IM_MIDDLE",
    "BYTE_NAMED_SPECIALS",
]

log = logging.getLogger(__name__)

AllowSpecial = bool | Set[str]
KimiFamily = Literal["k3", "kimi_linear"]


def _byte_level_alphabet() -> tuple[str, ...]:
    """GPT-2's bytes -> printable characters (``transformers.convert_slow_tokenizer.bytes_to_unicode``): the
    printable Latin-1 bytes stand for themselves, the others for U+0100 onwards in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return tuple(out[b] for b in range(256))


_BYTE_LEVEL = _byte_level_alphabet()


# --------------------------------------------------------------------------------------
# Base class and incremental detokenization
# --------------------------------------------------------------------------------------


class Tokenizer(abc.ABC):
    """Minimal tokenizer interface used by the serving stack.

    Subclasses provide the abstract members; everything else (special lookups,
    streaming decode) is derived from them.
    """

    #: Which chat renderer matches this tokenizer's markers ("k3" | "kimi_linear" | "byte").
    chat_family: str

    # -- abstract surface -------------------------------------------------------------
    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids (ordinary + special); valid ids are ``0..vocab_size-1``."""

    @property
    @abc.abstractmethod
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (sorted, non-empty)."""

    @property
    @abc.abstractmethod
    def bos_token_id(self) -> int | None: ...

    @property
    @abc.abstractmethod
    def pad_token_id(self) -> int: ...

    @abc.abstractmethod
    def encode(
        self, text: str, add_special: bool = False, allow_special: AllowSpecial = False
    ) -> list[int]: ...

    @abc.abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one id (a special yields the UTF-8 of its string form)."""

    @abc.abstractmethod
    def is_special(self, token_id: int) -> bool:
        """True when ``decode(..., skip_special=True)`` drops this id."""

    @abc.abstractmethod
    def id_to_token(self, token_id: int) -> str | None:
        """String form of a special/added token id, ``None`` for ordinary ids."""

    @abc.abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """Id of a special/added token string, ``None`` if it is not one."""

    # -- derived ------------------------------------------------------------------
    @property
    def eos_token_id(self) -> int:
        """The primary stop id (first of :attr:`eos_token_ids`)."""
        return self.eos_token_ids[0]

    def _check_id(self, token_id: Any) -> int:
        try:
            tid = operator.index(token_id)
        except TypeError:
            raise ValueError(f"token id must be an integer, got {type(token_id).__name__}") from None
        if not 0 <= tid < self.vocab_size:
            raise ValueError(f"token id {tid} out of range [0, {self.vocab_size})")
        return tid

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = True) -> bytes:
        out = []
        for t in ids:
            tid = self._check_id(t)
            if skip_special and self.is_special(tid):
                continue
            out.append(self.token_bytes(tid))
        return b"".join(out)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", errors="replace")

    def token_str(self, token_id: int) -> str:
        """One id as HF's ``convert_ids_to_tokens`` writes it (vLLM's /tokenize ``token_strs``): a special or
        added token's string form, else its bytes in the GPT-2 byte-level alphabet (the HF Kimi tokenizer's
        vocabulary strings: ``" world"`` is ``"Ġworld"``), which shows a token's part of a character too."""
        name = self.id_to_token(token_id)
        if name is not None:
            return name
        return "".join(_BYTE_LEVEL[b] for b in self.token_bytes(token_id))

    def incremental_detokenizer(self, skip_special: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special=skip_special)

    def decode_stream(self, ids: Iterable[int], skip_special: bool = True) -> Iterator[str]:
        """Yield text increments for a stream of ids (see :func:`decode_stream`)."""
        return decode_stream(self, ids, skip_special=skip_special)


class IncrementalDetokenizer:
    """Turns ids into text one at a time, never splitting a UTF-8 character.

    ``add(id)`` returns only the text that became complete with this id (often
    ``""`` while a multi-byte character is still partial). Invalid byte
    sequences become U+FFFD exactly as in :meth:`Tokenizer.decode`, so
    ``"".join(adds) + flush()`` always equals ``tokenizer.decode(ids, skip_special)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []
        self._chunks: list[str] = []

    @property
    def ids(self) -> list[int]:
        return list(self._ids)

    @property
    def text(self) -> str:
        """All text emitted so far (excluding bytes still pending)."""
        return "".join(self._chunks)

    @property
    def has_pending(self) -> bool:
        """True while an incomplete UTF-8 sequence is buffered."""
        return bool(self._decoder.getstate()[0])

    def add(self, token_id: int) -> str:
        tid = self.tokenizer._check_id(token_id)
        self._ids.append(tid)
        if self.skip_special and self.tokenizer.is_special(tid):
            return ""
        piece = self._decoder.decode(self.tokenizer.token_bytes(tid), final=False)
        if piece:
            self._chunks.append(piece)
        return piece

    def add_many(self, ids: Iterable[int]) -> str:
        return "".join(self.add(t) for t in ids)

    def flush(self) -> str:
        """End of stream: emit U+FFFD for any dangling partial character."""
        piece = self._decoder.decode(b"", final=True)
        if piece:
            self._chunks.append(piece)
        return piece


def decode_stream(tokenizer: Tokenizer, ids: Iterable[int], skip_special: bool = True) -> Iterator[str]:
    """Generator over non-empty text increments for ``ids``, flushed at the end."""
    detok = IncrementalDetokenizer(tokenizer, skip_special=skip_special)
    for t in ids:
        piece = detok.add(t)
        if piece:
            yield piece
    tail = detok.flush()
    if tail:
        yield tail


def _normalize_allow(allow_special: AllowSpecial) -> bool | frozenset[str]:
    if allow_special is True or allow_special is False:
        return allow_special
    if isinstance(allow_special, (str, bytes)) or not isinstance(allow_special, (Set, list, tuple)):
        raise ValueError(
            f"allow_special must be a bool or a set of special-token strings, got {allow_special!r}"
        )
    return frozenset(allow_special)


# --------------------------------------------------------------------------------------
# Byte tokenizer (presets)
# --------------------------------------------------------------------------------------

BYTE_BOS = 256
BYTE_EOS = 257
BYTE_PAD = 258
BYTE_IM_USER = 259
BYTE_IM_ASSISTANT = 260
BYTE_IM_END = 261
BYTE_IM_SYSTEM = 262
BYTE_IM_MIDDLE = 263

#: Named specials of the byte tokenizer (id -> string). K2-style chat markers so the
#: "byte" chat format can mirror the Kimi-Linear layout.
BYTE_NAMED_SPECIALS: dict[int, str] = {
    BYTE_BOS: "<|bos|>",
    BYTE_EOS: "<|eos|>",
    BYTE_PAD: "<|pad|>",
    BYTE_IM_USER: "<|im_user|>",
    BYTE_IM_ASSISTANT: "<|im_assistant|>",
    BYTE_IM_END: "<|im_end|>",
    BYTE_IM_SYSTEM: "<|im_system|>",
    BYTE_IM_MIDDLE: "<|im_middle|>",
}
_BYTE_NAME_TO_ID = {v: k for k, v in BYTE_NAMED_SPECIALS.items()}
_BYTE_MIN_VOCAB = 256 + len(BYTE_NAMED_SPECIALS)  # 264
_RESERVED_RE = re.compile(r"<\|reserved_token_([1-9][0-9]*)\|>")
_ANGLE_SPECIAL_RE = re.compile(r"<\|[A-Za-z0-9_]+\|>")


class ByteTokenizer(Tokenizer):
    """Byte-level tokenizer for presets and tests.

    ======================  =====================================================
    id                      meaning
    ======================  =====================================================
    0..255                  the byte with that value
    256 / 257 / 258         ``<|bos|>`` / ``<|eos|>`` / ``<|pad|>``
    259 / 260 / 261         ``<|im_user|>`` / ``<|im_assistant|>`` / ``<|im_end|>``
    262 / 263               ``<|im_system|>`` / ``<|im_middle|>``
    264..vocab_size-1       ``<|reserved_token_{id}|>`` (untrained, special)
    ======================  =====================================================

    Every id >= 256 is special (dropped by ``decode(skip_special=True)``).
    Stop ids: ``<|eos|>`` and ``<|im_end|>`` (the end of an assistant turn in the
    "byte" chat format), or ``eos_token_ids`` when given: a checkpoint without
    tokenizer files stops on its own eos ids, as HF does (there 257 / 261 may be
    ordinary tokens).
    """

    chat_family = "byte"

    def __init__(self, vocab_size: int = _BYTE_MIN_VOCAB, eos_token_ids: Iterable[int] | None = None):
        vocab_size = operator.index(vocab_size)
        if vocab_size < _BYTE_MIN_VOCAB:
            raise ValueError(
                f"ByteTokenizer needs vocab_size >= {_BYTE_MIN_VOCAB} "
                f"(256 bytes + {len(BYTE_NAMED_SPECIALS)} specials), got {vocab_size}"
            )
        self._vocab_size = vocab_size
        self._byte_table = [bytes([i]) for i in range(256)]
        self._eos = ((BYTE_EOS, BYTE_IM_END) if eos_token_ids is None
                     else tuple(sorted(set(self._check_id(e) for e in eos_token_ids))))
        if not self._eos:
            raise ValueError("ByteTokenizer: eos_token_ids must name at least one id")

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self._vocab_size})"

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def bos_token_id(self) -> int:
        return BYTE_BOS

    @property
    def pad_token_id(self) -> int:
        return BYTE_PAD

    def id_to_token(self, token_id: int) -> str | None:
        tid = self._check_id(token_id)
        if tid < 256:
            return None
        return BYTE_NAMED_SPECIALS.get(tid) or f"<|reserved_token_{tid}|>"

    def token_to_id(self, token: str) -> int | None:
        if token in _BYTE_NAME_TO_ID:
            return _BYTE_NAME_TO_ID[token]
        m = _RESERVED_RE.fullmatch(token)
        if m:
            tid = int(m.group(1))
            if _BYTE_MIN_VOCAB <= tid < self._vocab_size:
                return tid
        return None

    def is_special(self, token_id: int) -> bool:
        return token_id >= 256

    def token_bytes(self, token_id: int) -> bytes:
        tid = self._check_id(token_id)
        if tid < 256:
            return self._byte_table[tid]
        return self.id_to_token(tid).encode("utf-8")  # type: ignore[union-attr]

    def encode(
        self, text: str, add_special: bool = False, allow_special: AllowSpecial = False
    ) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be str, got {type(text).__name__}")
        allow = _normalize_allow(allow_special)
        if isinstance(allow, frozenset):
            unknown = sorted(s for s in allow if self.token_to_id(s) is None)
            if unknown:
                raise ValueError(f"allow_special names unknown special tokens: {unknown}")
        ids: list[int] = [BYTE_BOS] if add_special else []
        if allow is False or (isinstance(allow, frozenset) and not allow):
            ids.extend(text.encode("utf-8"))
            return ids
        pos = 0
        for m in _ANGLE_SPECIAL_RE.finditer(text):
            name = m.group(0)
            if allow is not True and name not in allow:
                continue
            tid = self.token_to_id(name)
            if tid is None:
                continue
            ids.extend(text[pos : m.start()].encode("utf-8"))
            ids.append(tid)
            pos = m.end()
        ids.extend(text[pos:].encode("utf-8"))
        return ids


# --------------------------------------------------------------------------------------
# Kimi tiktoken tokenizer
# --------------------------------------------------------------------------------------

KIMI_NUM_BASE_TOKENS = 163_584
KIMI_NUM_RESERVED_SPECIAL_TOKENS = 256
#: Long-input guards (spec §3.4): encode at most this many chars per call into the
#: regex engine, and never hand it a whitespace / non-whitespace run longer than this.
MAX_ENCODE_CHARS = 400_000
MAX_WHITESPACE_RUN_CHARS = 25_000

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"

#: The pre-tokenizer exactly as written in the spec (uses class intersection ``&&``;
#: Python's ``regex`` module needs the ``(?V1)`` flag to read it as intersection).
KIMI_PAT_STR_V1 = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+" + _CONTRACTIONS,
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*" + _CONTRACTIONS,
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# Intersection-free equivalents of the two intersected classes. Unicode general
# categories partition the code space into L{u,l,t,m,o}, M, N, P, S, Z, C (C includes
# unassigned Cn), so
#   (Lu|Lt|Lm|Lo|M) \ Han  ==  complement of (Han | Ll | N | P | S | Z | C)
#   (Ll|Lm|Lo|M)    \ Han  ==  complement of (Han | Lu | Lt | N | P | S | Z | C)
# A plain negated class needs no set operations and no look-around, so any
# Unicode-aware engine (tiktoken's fancy-regex, Python `regex` V0) evaluates it.
_UPPERISH = r"[^\p{Han}\p{Ll}\p{N}\p{P}\p{S}\p{Z}\p{C}]"
_LOWERISH = r"[^\p{Han}\p{Lu}\p{Lt}\p{N}\p{P}\p{S}\p{Z}\p{C}]"

#: The pre-tokenizer handed to tiktoken (same alternatives, same order; leftmost-first
#: alternation order is part of the semantics).
KIMI_PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?" + _UPPERISH + "*" + _LOWERISH + "+" + _CONTRACTIONS,
        r"[^\r\n\p{L}\p{N}]?" + _UPPERISH + "+" + _LOWERISH + "*" + _CONTRACTIONS,
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

_RUN_RE = re.compile(r"\s+|\S+")

# Markers whose presence identifies which tokenizer_config.json we were given; the two
# families disagree at ids 163586..163591, and loading the wrong one silently shatters
# the chat markers (spec §3.4).
_FAMILY_MARKERS: dict[str, tuple[str, ...]] = {
    "k3": ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"),
    "kimi_linear": ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"),
}
# Stop markers per family (in addition to eos ids named by the config files).
_FAMILY_STOP_NAMES: dict[str, tuple[str, ...]] = {
    "k3": ("[EOS]", "<|end_of_msg|>"),
    "kimi_linear": ("[EOS]", "<|im_end|>"),
}


def split_for_encoding(
    text: str,
    max_chars: int | None = None,
    max_run: int | None = None,
) -> Iterator[str]:
    """Split ``text`` into pieces that are safe to feed to the regex engine.

    Pieces are at most ``max_chars`` (default :data:`MAX_ENCODE_CHARS`) long, and a
    run of consecutive whitespace (or of consecutive non-whitespace) characters
    is cut every ``max_run`` (default :data:`MAX_WHITESPACE_RUN_CHARS`) characters.
    Joining the pieces gives back ``text``. Inputs without such long runs are
    returned whole, so tokenization of ordinary text is unaffected.
    """
    max_chars = MAX_ENCODE_CHARS if max_chars is None else max_chars
    max_run = MAX_WHITESPACE_RUN_CHARS if max_run is None else max_run
    for start in range(0, len(text), max_chars):
        chunk = text[start : start + max_chars]
        if len(chunk) <= max_run:
            yield chunk
            continue
        piece_start = 0
        for m in _RUN_RE.finditer(chunk):
            if m.end() - m.start() > max_run:
                for cut in range(m.start() + max_run, m.end(), max_run):
                    yield chunk[piece_start:cut]
                    piece_start = cut
        yield chunk[piece_start:]


def _read_tiktoken_model(path: str) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{lineno}: expected '<base64 token> <rank>', got {line[:80]!r}")
            try:
                token = base64.b64decode(parts[0], validate=True)
                rank = int(parts[1])
            except (binascii.Error, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: malformed entry ({e})") from None
            if token in ranks:
                raise ValueError(f"{path}:{lineno}: duplicate token {token!r}")
            ranks[token] = rank
    if not ranks:
        raise ValueError(f"{path}: no tokens")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be exactly 0..{len(ranks) - 1} with no gaps or repeats")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path}: byte-level BPE needs every single byte as a token; missing {missing[:8]}")
    return ranks


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """tokenizer_config fields are either a string or {"content": str, ...}."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _eos_ids_from(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return []


def _reachable_eos(ids: list[int], n_vocab: int, where: str) -> list[int]:
    """The `eos_token_id`s of a config file that are ids of this vocabulary. One past it (HF's KimiLinearConfig
    defaults to 163586 whatever the vocabulary, and its save writes that to both config files) can never be
    generated: it is dropped with a warning naming the file, as config.json's reader drops it for the model."""
    out = []
    for i in ids:
        if 0 <= i < n_vocab:
            out.append(i)
        else:
            log.warning("%s: eos_token_id %d is outside the tokenizer's %d ids: it cannot be generated, it is not "
                        "used as a stop token", where, i, n_vocab)
    return out


class KimiTokenizer(Tokenizer):
    """The Kimi tiktoken BPE (K2 / Kimi-Linear / K3 share the 163,584 base ranks).

    Build with :meth:`from_dir`. Special ids are ``base .. base+255`` where
    ``base`` is the number of BPE ranks (163584 for the real files); names come
    from ``tokenizer_config.json`` ``added_tokens_decoder`` and unnamed ids are
    ``<|reserved_token_{id}|>``.
    """

    def __init__(
        self,
        mergeable_ranks: dict[bytes, int],
        specials: Mapping[int, tuple[str, bool]],
        *,
        family: KimiFamily,
        eos_token_ids: Iterable[int],
        bos_token_id: int | None,
        pad_token_id: int,
        num_reserved_special_tokens: int = KIMI_NUM_RESERVED_SPECIAL_TOKENS,
        name: str | None = None,
    ):
        import tiktoken  # local import keeps the byte path dependency-free

        if family not in _FAMILY_MARKERS:
            raise ValueError(f"family must be one of {sorted(_FAMILY_MARKERS)}, got {family!r}")
        base = len(mergeable_ranks)
        n_vocab = base + num_reserved_special_tokens
        names: dict[int, str] = {}
        flags: dict[int, bool] = {}
        for tid in range(base, n_vocab):
            nm, special = specials.get(tid, (f"<|reserved_token_{tid}|>", True))
            names[tid] = nm
            flags[tid] = bool(special)
        extra = sorted(set(specials) - set(names))
        if extra:
            raise ValueError(
                f"special ids {extra[:8]} lie outside the special range [{base}, {n_vocab}) "
                f"(base = number of BPE ranks)"
            )
        name_to_id: dict[str, int] = {}
        for tid, nm in names.items():
            if nm in name_to_id:
                raise ValueError(f"special token {nm!r} is named twice (ids {name_to_id[nm]} and {tid})")
            name_to_id[nm] = tid
        self.family: KimiFamily = family
        self.chat_family = family
        self._base = base
        self._n_vocab = n_vocab
        self._special_names = names
        self._special_flags = flags
        self._name_to_id = name_to_id
        self._enc = tiktoken.Encoding(
            name=name or f"kimi_{family}",
            pat_str=KIMI_PAT_STR,
            mergeable_ranks=mergeable_ranks,
            special_tokens=name_to_id,
            explicit_n_vocab=n_vocab,
        )
        eos = sorted(set(self._check_id(e) for e in eos_token_ids))
        if not eos:
            raise ValueError("KimiTokenizer needs at least one eos token id")
        self._eos = tuple(eos)
        self._bos = None if bos_token_id is None else self._check_id(bos_token_id)
        self._pad = self._check_id(pad_token_id)

    # -- construction from a checkpoint directory --------------------------------
    @classmethod
    def from_dir(
        cls,
        path: str | os.PathLike,
        family: KimiFamily = "k3",
        num_reserved_special_tokens: int = KIMI_NUM_RESERVED_SPECIAL_TOKENS,
        vocab_size: int | None = None,
    ) -> "KimiTokenizer":
        """Load ``tiktoken.model`` + ``tokenizer_config.json`` from a local directory.

        ``vocab_size``: the model's, when its embedding has more rows than the tokenizer has ids
        (padded for sharding): the extra ids become reserved specials too (no text; dropped by
        ``skip_special``), so every id the model can emit decodes.

        Stop ids are the union of: the family's stop markers (K3: ``[EOS]``,
        ``<|end_of_msg|>``; Kimi-Linear: ``[EOS]``, ``<|im_end|>``), the config's
        ``eos_token``, and ``eos_token_id`` from ``config.json`` (top level and
        ``text_config``) / ``generation_config.json`` when those files exist.
        For the real files this gives (163585, 163586) for both families. An id of those files past the
        vocabulary is dropped with a warning (it cannot be generated).
        """
        path = os.fspath(path)
        if family not in _FAMILY_MARKERS:
            raise ValueError(f"family must be one of {sorted(_FAMILY_MARKERS)}, got {family!r}")
        model_path = os.path.join(path, "tiktoken.model")
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"{model_path} not found")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"{cfg_path} not found")
        ranks = _read_tiktoken_model(model_path)
        cfg = _read_json(cfg_path)

        decoder = cfg.get("added_tokens_decoder") or {}
        if not isinstance(decoder, Mapping):
            raise ValueError(f"{cfg_path}: added_tokens_decoder must be an object")
        specials: dict[int, tuple[str, bool]] = {}
        for key, entry in decoder.items():
            try:
                tid = int(key)
            except ValueError:
                raise ValueError(f"{cfg_path}: added_tokens_decoder key {key!r} is not an integer id") from None
            content = _token_content(entry)
            if content is None:
                raise ValueError(f"{cfg_path}: added_tokens_decoder[{key}] has no string 'content'")
            special = entry.get("special", True) if isinstance(entry, Mapping) else True
            specials[tid] = (content, bool(special))

        names = {nm for nm, _ in specials.values()}
        missing = [m for m in _FAMILY_MARKERS[family] if m not in names]
        if missing:
            other = next(f for f in _FAMILY_MARKERS if f != family)
            hint = ""
            if all(m in names for m in _FAMILY_MARKERS[other]):
                hint = f"; it looks like a {other!r} tokenizer -- pass family={other!r}"
            raise ValueError(
                f"{cfg_path} does not name the {family!r} chat markers {missing}{hint}"
            )

        tmp_name_to_id = {nm: tid for tid, (nm, _) in specials.items()}

        def lookup(field: str, value: Any) -> int | None:
            content = _token_content(value)
            if content is None:
                return None
            if content not in tmp_name_to_id:
                raise ValueError(f"{cfg_path}: {field} {content!r} is not in added_tokens_decoder")
            return tmp_name_to_id[content]

        eos: set[int] = {tmp_name_to_id[n] for n in _FAMILY_STOP_NAMES[family] if n in tmp_name_to_id}
        cfg_eos = lookup("eos_token", cfg.get("eos_token"))
        if cfg_eos is not None:
            eos.add(cfg_eos)
        pad_id = len(ranks) + num_reserved_special_tokens - 1
        if vocab_size is not None:
            num_reserved_special_tokens = max(num_reserved_special_tokens, vocab_size - len(ranks))
        for extra_name in ("config.json", "generation_config.json"):
            extra_path = os.path.join(path, extra_name)
            if os.path.isfile(extra_path):
                extra = _read_json(extra_path)
                text_cfg = extra.get("text_config")
                ids = _eos_ids_from(extra.get("eos_token_id")) + _eos_ids_from(
                    text_cfg.get("eos_token_id") if isinstance(text_cfg, Mapping) else None)
                eos.update(_reachable_eos(ids, len(ranks) + num_reserved_special_tokens, extra_path))

        bos = lookup("bos_token", cfg.get("bos_token"))
        if bos is None:
            bos = tmp_name_to_id.get("[BOS]")
        pad = lookup("pad_token", cfg.get("pad_token"))
        if pad is None:
            pad = tmp_name_to_id.get("[PAD]", pad_id)

        return cls(
            ranks,
            specials,
            family=family,
            eos_token_ids=eos,
            bos_token_id=bos,
            pad_token_id=pad,
            num_reserved_special_tokens=num_reserved_special_tokens,
            name=f"kimi_{family}:{os.path.basename(os.path.abspath(path))}",
        )

    def __repr__(self) -> str:
        return f"KimiTokenizer(family={self.family!r}, vocab_size={self._n_vocab}, eos={self._eos})"

    # -- properties -----------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    @property
    def num_base_tokens(self) -> int:
        """Number of BPE ranks == id of the first special."""
        return self._base

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def pad_token_id(self) -> int:
        return self._pad

    @property
    def special_tokens(self) -> dict[str, int]:
        """All special/added token strings (named and reserved) -> id."""
        return dict(self._name_to_id)

    @property
    def encoding(self):
        """The underlying ``tiktoken.Encoding``."""
        return self._enc

    # -- lookups ----------------------------------------------------------------------
    def id_to_token(self, token_id: int) -> str | None:
        tid = self._check_id(token_id)
        return self._special_names.get(tid)

    def token_to_id(self, token: str) -> int | None:
        return self._name_to_id.get(token)

    def is_special(self, token_id: int) -> bool:
        return self._special_flags.get(token_id, False)

    def token_bytes(self, token_id: int) -> bytes:
        tid = self._check_id(token_id)
        if tid >= self._base:
            return self._special_names[tid].encode("utf-8")
        return self._enc.decode_single_token_bytes(tid)

    # -- encode / decode --------------------------------------------------------------
    def encode(
        self, text: str, add_special: bool = False, allow_special: AllowSpecial = False
    ) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be str, got {type(text).__name__}")
        allow = _normalize_allow(allow_special)
        if allow is True:
            allowed: str | frozenset[str] = "all"
        elif allow is False:
            allowed = frozenset()
        else:
            unknown = sorted(s for s in allow if s not in self._name_to_id)
            if unknown:
                raise ValueError(f"allow_special names unknown special tokens: {unknown}")
            allowed = allow
        ids: list[int] = []
        if add_special:
            if self._bos is None:
                raise ValueError("add_special=True but this tokenizer has no bos token")
            ids.append(self._bos)
        for piece in split_for_encoding(text):
            ids.extend(self._enc.encode(piece, allowed_special=allowed, disallowed_special=()))
        return ids

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = True) -> bytes:
        checked = [self._check_id(t) for t in ids]
        if skip_special:
            flags = self._special_flags
            checked = [t for t in checked if not flags.get(t, False)]
        return self._enc.decode_bytes(checked)


# --------------------------------------------------------------------------------------
# Factory
# --------------------------------------------------------------------------------------


def load_tokenizer(
    path: str | os.PathLike | None,
    family: str = "k3",
    vocab_size: int | None = None,
) -> Tokenizer:
    """Pick the tokenizer for a model.

    * ``path`` is a directory containing ``tiktoken.model`` and ``family`` is
      ``"k3"`` or ``"kimi_linear"`` -> :meth:`KimiTokenizer.from_dir`; its vocab
      must fit in the model's ``vocab_size`` (when given), and is extended to it with
      reserved specials when smaller (ids the model can emit without a text).
    * otherwise (no path, a directory without ``tiktoken.model``, or
      ``family="byte"``) -> ``ByteTokenizer(vocab_size)``.

    A ``path`` that does not exist raises ``FileNotFoundError``.
    """
    if family not in ("k3", "kimi_linear", "byte"):
        raise ValueError(f"family must be 'k3', 'kimi_linear' or 'byte', got {family!r}")
    if path is not None:
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
        if family != "byte" and os.path.isfile(os.path.join(path, "tiktoken.model")):
            tok = KimiTokenizer.from_dir(path, family=family, vocab_size=vocab_size)  # type: ignore[arg-type]
            if vocab_size is not None and tok.vocab_size > vocab_size:
                raise ValueError(
                    f"tokenizer at {path!r} has {tok.vocab_size} ids but the model vocab_size is {vocab_size}"
                )
            return tok
    if vocab_size is None:
        raise ValueError("vocab_size is required for the byte tokenizer")
    return ByteTokenizer(vocab_size)
