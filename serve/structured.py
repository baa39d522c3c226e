"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a choice or a grammar.

vLLM's `structured_outputs` (`StructuredOutputsParams`: exactly one of `json`, `regex`, `choice`,
`grammar`, `json_object`). The host compiles the constraint once per request with llguidance (a
well-kept Rust library: lazy lexer + Earley parser over the token trie, tens of microseconds per mask)
and, before each step that samples a token for the request, writes the set of tokens that keep the
output a prefix of the language into a bitmask row (`int32[ceil(V / 32)]`, bit `t % 32` of word
`t // 32` set when token `t` is allowed). The device sets the other logits to -inf
(`serve/penalties.apply_bitmask`) before greedy or random sampling, and before the logprobs too: as in
vLLM, which masks the logits before its sampler, a constrained request's (raw) logprobs are the model's
renormalised over the tokens the grammar allows. After the step the sampled token advances the request's
matcher; when the grammar cannot continue (complete and nothing may follow), the request finishes with
`finish_reason="stop"`. While the grammar is complete but could continue (a number, `[0-9]+`), the stop
tokens are allowed too. A constraint llguidance gives up on (its limits on Earley rows and lexer states, met lazily)
is refused when compiled if it fails within its first tokens (`probe`) or, for a JSON schema, within the first
tokens of one of its large sub-schemas walked on its own (`probe_sub_schemas`: a too-wide object below the root);
else the request ends with vLLM's `finish_reason="error"`.

`reasoning_end` delays the constraint until the output contains that text's tokens, so a thinking
model reasons freely and the constraint applies to its answer; `answer_prefix` lets the answer start
with fixed text (the chat API sets them to K3's end of thinking and response-channel opening when the
prompt thinks; vLLM's reasoning-aware structured outputs).

A step with no constrained row carries all-ones rows and skips the masking (`lax.cond`).
"""

from __future__ import annotations

import json
import re
import threading
import urllib.parse
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from serve.types import RequestError, StructuredOutputsParams

__all__ = ["StructuredOutputsParams", "GrammarCompiler", "Guide", "banned_tokens", "clear_bits", "fill_masks",
           "mask_words", "ALLOW_ALL"]

#: A bitmask word with every token allowed.
ALLOW_ALL = -1
_CACHE_SIZE = 256  # compiled grammars kept per engine (repeated schemas skip compiling)
#: Grammar text of the cached ones, in all: their matchers hold lexer states, up to ~300x that (tens of MB for a
#: schema of thousands of properties), so a client sending many such schemas cannot fill the host's memory.
_CACHE_TEXT = 1 << 20
#: JSON whitespace allowed between two tokens of the value (unless disable_any_whitespace). Bounded:
#: with an unbounded pattern a model can loop on whitespace until max_tokens (a known failure of
#: grammar-constrained JSON); 20 still fits a newline and nine levels of two-space indentation.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,20}"


#: Tokens a compiled constraint is walked at compile time (`probe`): llguidance builds its lexer and Earley rows
#: lazily, so a constraint past its limits (a schema of ~700 optional properties: "row has 2807 items; max is 2000";
#: `a{1000000}`: "lexer too complex") compiled, then failed on the first token (output `{`, finish_reason "stop").
PROBE_TOKENS = 4

#: Levels of nested objects and arrays a JSON schema may have: llguidance parses the grammar that holds it with
#: serde_json's limit of 128 levels, 3 of them its own (deeper, it answered "recursion limit exceeded at line 1
#: column N"; a Python dict nested past the interpreter's recursion limit raised RecursionError before that).
MAX_SCHEMA_DEPTH = 124


def schema_depth(value: Any, limit: int = MAX_SCHEMA_DEPTH) -> int:
    """Levels of nested dicts and lists in `value` (0 for a scalar), counted without recursion and at most
    `limit + 1` (so a schema that contains itself ends too)."""
    depth, stack = 0, [(value, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list, tuple)) and depth <= limit:
            depth = max(depth, d)
            stack.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
    return min(depth, limit + 1)


def check_schema_depth(schema: Any, field_: str = "structured_outputs.json") -> None:
    """RequestError naming `field_` when `schema` nests deeper than `MAX_SCHEMA_DEPTH`."""
    if schema_depth(schema) > MAX_SCHEMA_DEPTH:
        raise _too_deep(field_)


#: Levels of nested objects and arrays a JSON schema's compile may recurse through, its `$ref`s followed: llguidance
#: compiles a definition where a `$ref` first names it, recursing into it, and a chain of ~900 definitions each naming
#: the next in one property (60 KB of JSON) overflowed its thread's stack: a segfault, the server gone. 1,000 levels
#: are ~330 such definitions, about a third of the depth that crashed.
MAX_REF_DEPTH = 1000


#: The base URI of a schema without an `$id` of its own (hierarchical, so relative `$id`s and `$ref`s resolve on it).
_ROOT_URI = "http://k3jax.invalid/schema.json"


def _pointer_target(doc: Any, pointer: str) -> Any:
    """The value a JSON pointer (`""`, `"/$defs/A"`, `"/items/0"`; percent-encoded too) names in `doc`; None when
    it names none."""
    x = doc
    for part in pointer[1:].split("/") if pointer else ():
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(x, dict) and part in x:
            x = x[part]
        elif isinstance(x, list) and part.isdigit() and int(part) < len(x):
            x = x[int(part)]
        else:
            return None
    return x


def schema_resources(schema: Any) -> tuple[dict[int, str], dict[str, list]]:
    """(id of each dict -> the base URI its `$ref`s resolve against, URI -> the schemas it names: the root's, each
    `$id`'s resource, each `$anchor`'s `uri#name`) of a JSON schema, URIs resolved as RFC 3986 (and llguidance) do,
    each enclosing `$id` the base of those inside it (walked without recursion)."""
    bases: dict[int, str] = {}
    named: dict[str, list] = {_ROOT_URI: [schema]}
    stack = [(schema, _ROOT_URI)]
    while stack:
        x, base = stack.pop()
        if isinstance(x, list):
            stack.extend((y, base) for y in x)
        if not isinstance(x, dict) or id(x) in bases:
            continue
        sid = x.get("$id")
        if isinstance(sid, str) and not sid.startswith("#"):
            base = urllib.parse.urldefrag(urllib.parse.urljoin(base, sid))[0]
            named.setdefault(base, []).append(x)
        bases[id(x)] = base
        if isinstance(x.get("$anchor"), str):
            named.setdefault(f"{base}#{x['$anchor']}", []).append(x)
        stack.extend((y, base) for y in x.values())
    return bases, named


def ref_targets(ref: str, base: str, named: dict[str, list]) -> list:
    """The schemas a `$ref` found under `base` may name (`schema_resources`): a JSON pointer into a resource, or an
    `$anchor`; [] when it names none here."""
    uri, fragment = urllib.parse.urldefrag(urllib.parse.urljoin(base, ref))
    if fragment and not fragment.startswith("/"):
        return named.get(f"{uri}#{fragment}", [])
    found = (_pointer_target(doc, fragment) for doc in named.get(uri, ()))
    return [x for x in found if isinstance(x, (dict, list))]


def ref_depth(schema: Any, limit: int = MAX_REF_DEPTH) -> int:
    """Levels of nested dicts and lists met walking `schema` from its root as a compiler does: definitions
    (`$defs`, `definitions`) only where a `$ref` first names them (a JSON pointer, an `$id`'s URI, an `$anchor`),
    each value a `$ref` names entered once (counted without recursion, and at most `limit + 1`). A `$ref` is read
    against the `$id` around it, the last `$id` the walk entered (llguidance's reading: a definition reached through
    `uri#/pointer` takes the base it was reached from) and the root, the names of all three followed (a bound).
    llguidance walks a schema's parts in their order (`anyOf` branches, properties): walked in reverse only, a chain
    of definitions named at its start by a first property and in its middle by later ones was entered from its
    middle (a quarter as deep) and crashed the compile. Walked in both orders, the deeper counts (not the longest way
    through the definitions: a compile never goes that deep, and 3,000 OpenAPI components each naming earlier ones
    compile)."""
    resources = schema_resources(schema)
    heights = _plain_heights(schema, limit)
    forward = _ref_walk(schema, limit, True, *resources, heights)
    return forward if forward > limit else max(forward, _ref_walk(schema, limit, False, *resources, heights))


def _plain_items(x: Any) -> list:
    """What `_ref_walk` enters below a dict or list besides `$ref` targets: a list's items, a dict's values but its
    definitions."""
    return list(x) if isinstance(x, list) else [y for k, y in x.items() if k not in ("$defs", "definitions")]


def _plain_heights(schema: Any, limit: int) -> dict[int, tuple[int, bool]]:
    """id -> (levels of nested dicts and lists in it, `$ref`s not followed, at most `limit + 1`; whether a `$ref` is
    in it), both through `_plain_items`, of every dict and list in `schema`, each once (without recursion; a dict that
    contains itself is `limit + 1` levels)."""
    out: dict[int, tuple[int, bool]] = {}
    stack: list[Any] = [schema]
    while stack:
        x = stack.pop()
        if isinstance(x, tuple):  # (x,): its parts are done
            x = x[0]
            height, refs = 1, isinstance(x, dict) and isinstance(x.get("$ref"), str)
            for k, y in x.items() if isinstance(x, dict) else enumerate(x):
                if isinstance(y, (dict, list)) and k != "$defs" and k != "definitions":
                    h, r = out[id(y)]
                    height, refs = max(height, h + 1), refs or r
            out[id(x)] = min(height, limit + 1), refs
        elif id(x) not in out:
            out[id(x)] = (limit + 1, True)  # (until done: what a cycle back to it finds)
            stack.append((x,))
            stack.extend(y for y in (x.values() if isinstance(x, dict) else x)  # (definitions too)
                         if isinstance(y, (dict, list)) and id(y) not in out)
    return out


def _ref_walk(schema: Any, limit: int, in_order: bool, bases: dict, named: dict,
              heights: dict[int, tuple[int, bool]]) -> int:
    """`ref_depth` walking each dict's and list's items in their order (`in_order`) or in reverse. A part with no
    `$ref`, or one walked before from the same base (the last `$id` entered), is not walked (again): each `$ref` in
    it named what it names then, so it adds its own levels only (`heights`). Walked again each time, a part below N
    nested `$ref`s to parts around it was walked N times (a 5 MB schema with 55: 23 s; llguidance refuses it in 0.8)."""
    depth, entered, stack = 0, {id(schema)}, [(schema, 1, _ROOT_URI)]
    walked_once: dict[tuple, bool] = {}  # (id, base) -> whether its walk is complete (False: under way)
    while stack:
        x, d, walked = stack.pop()
        if x is _WALKED:
            walked_once[d] = True
            continue
        if not isinstance(x, (dict, list)) or depth > limit:
            continue
        if isinstance(x, dict) and isinstance(x.get("$id"), str) and not x["$id"].startswith("#"):
            walked = urllib.parse.urldefrag(urllib.parse.urljoin(walked, x["$id"]))[0]
        height, has_refs = heights.get(id(x), (limit + 1, True))
        key = (id(x), walked)
        if not has_refs or walked_once.get(key):
            depth = max(depth, d + height - 1)
            continue
        depth = max(depth, d)
        if key not in walked_once:
            walked_once[key] = False
            stack.append((_WALKED, key, walked))
        items = _plain_items(x)
        if isinstance(x, dict):
            ref, targets = x.get("$ref"), []
            for base in (dict.fromkeys((bases.get(id(x), _ROOT_URI), walked, _ROOT_URI)) if isinstance(ref, str)
                         else ()):
                for target in ref_targets(ref, base, named):
                    if id(target) not in entered:
                        entered.add(id(target))
                        targets.append(target)
            items = [*targets, *items] if in_order else [*items, *targets]
        stack.extend((y, d + 1, walked) for y in (reversed(items) if in_order else items))
    return min(depth, limit + 1)


_WALKED = object()  # (`_ref_walk`'s marker: the part below it on the stack is walked)


def check_ref_depth(schema: Any, field_: str) -> None:
    """RequestError naming `field_` when compiling `schema` would recurse past `MAX_REF_DEPTH` levels."""
    if ref_depth(schema) > MAX_REF_DEPTH:
        raise RequestError(f"{field_}: the schema nests objects and arrays more than {MAX_REF_DEPTH} levels deep "
                           f"through its $refs (a chain of definitions each naming the next); flatten it")


#: Levels llguidance's Lark compile may recurse through: it compiles a rule or terminal where another first names it,
#: recursing into it and into each group (`(...)`, `[...]`) the name stands in, and a chain of ~2,700 rules each
#: naming the next (30 KB of grammar; 250 rules naming the next inside 20 groups) overflowed the compiling thread's
#: stack: a segfault, the server gone. 1,000 levels are about a third of the depth that crashed.
MAX_GRAMMAR_DEPTH = 1000

#: A rule's or terminal's definition (`?name.2[attrs]:`), or a statement (`%ignore`), at a line's start: a new node.
_LARK_HEAD = re.compile(r"[ \t]*(?:[?!]?([A-Za-z_]\w*)(?:\.-?\d+)?(?=[ \t]*(?:\[[^\]\n]*\])?[ \t]*:)"
                        r"|(%\w+)\b(?![ \t]*\{))")
#: The pieces of Lark text told apart: strings, comments and regexes (which may span lines) skipped, a `%` keyword
#: before JSON (`%json`, `%llguidance`, `%regex`), names, brackets and line ends; anything else in runs. An
#: unterminated string or regex runs to its end of line or text (llguidance refuses it; matched again from each of
#: its quotes, a line of `"\` repeated took seconds per 40 KB).
_LARK_PIECE = re.compile(r'"(?:[^"\\\n]|\\.)*"?|//[^\n]*|#[^\n]*|/(?:[^/\\]|\\.)+/?|(%\w+)[ \t]*(?=\{)'
                         r'|[A-Za-z_]\w*|[()\[\]\n]|[^"/#%A-Za-z_()\[\]\n]+|.', re.S)


def lark_parts(text: str) -> tuple[dict[str, int], dict[str, list[str]], list[Any]]:
    """(name -> 1 + the deepest group a name stands in within its definition, name -> the defined names it uses,
    the JSON schemas of its `%json`s) of Lark `text`, read as llguidance reads it where it matters for its compile's
    depth (statements are nodes of their own)."""
    weights: dict[str, int] = {"%": 1}
    uses: dict[str, list[str]] = {}
    schemas: list[Any] = []
    node, depth, pos, line_start = "%", 0, 0, True
    decoder = json.JSONDecoder()
    while pos < len(text):
        if line_start and (head := _LARK_HEAD.match(text, pos)) and (head.group(1) or head.group(2)):
            node, depth, pos = head.group(1) or head.group(2), 0, head.end()
            weights.setdefault(node, 1)
        line_start = False
        piece = _LARK_PIECE.match(text, pos)
        pos, word = piece.end(), piece.group()
        if word == "\n":
            line_start = True
        elif word in ("(", "["):
            depth += 1
        elif word in (")", "]"):
            depth = max(0, depth - 1)
        elif piece.group(1):  # `%json {...}`: its JSON read whole (its schema is checked as a JSON schema's)
            try:
                value, pos = decoder.raw_decode(text, text.index("{", pos))
            except (ValueError, RecursionError):
                continue
            if piece.group(1) == "%json":
                schemas.append(value)
        elif word[0].isalpha() or word[0] == "_":
            weights[node] = max(weights[node], depth + 1)
            uses.setdefault(node, []).append(word)
    return weights, {n: list(dict.fromkeys(u for u in used if u in weights)) for n, used in uses.items()}, schemas


def heaviest_path(weights: dict[str, int], edges: dict[str, list[str]]) -> int:
    """The weight of the heaviest path through a graph (Tarjan's components, without recursion), the nodes of a cycle
    (a strongly connected component) all counted: a bound on any depth-first walk's that enters each node once."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    component: dict[str, int] = {}
    best: list[int] = []
    stack: list[str] = []
    for root in weights:
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        work = [(root, iter(edges.get(root, ())))]
        while work:
            v, rest = work[-1]
            for w in rest:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    work.append((w, iter(edges.get(w, ()))))
                    break
                if w not in component:  # (on the stack)
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:  # v's component is complete: every one it reaches outside is done
                    members, c = [], len(best)
                    while not members or members[-1] != v:
                        members.append(stack.pop())
                        component[members[-1]] = c
                    after = max((best[component[w]] for m in members for w in edges.get(m, ()) if component[w] != c),
                                default=0)
                    best.append(sum(weights[m] for m in members) + after)
    return max(best, default=0)


def check_grammar_depth(text: str, field_: str) -> None:
    """RequestError naming `field_` when compiling Lark `text` could recurse past `MAX_GRAMMAR_DEPTH` levels, or when
    one of its `%json` schemas nests too deep (`check_schema_depth`, `check_ref_depth`)."""
    weights, edges, schemas = lark_parts(text)
    if heaviest_path(weights, edges) > MAX_GRAMMAR_DEPTH:
        raise RequestError(f"{field_}: the grammar's rules and terminals nest more than {MAX_GRAMMAR_DEPTH} levels "
                           f"deep (a chain of rules each naming the next, each group a name stands in one level "
                           f"more); flatten it")
    for schema in schemas:
        check_schema_depth(schema, field_)
        check_ref_depth(schema, field_)


def _too_deep(field_: str) -> RequestError:
    return RequestError(f"{field_}: the schema nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep "
                        f"(or contains itself); flatten it or use $defs and $ref for recursive structures")


def _not_utf8(value: str) -> Optional[UnicodeEncodeError]:
    """The error encoding `value` as UTF-8 raises (it holds a lone surrogate), None when it encodes."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return e
    return None


def check_text(value: str, field_: str, item: Optional[int] = None) -> None:
    """RequestError naming `field_` (and the list's `item`) when `value` is not Unicode text: a lone surrogate, which
    JSON's "\\ud800" decodes to and the Python API takes as it is; neither the tokenizer nor llguidance, which read
    UTF-8, can (a UnicodeEncodeError on the engine's thread, or an error of llguidance's naming no field)."""
    if (e := _not_utf8(value)) is not None:
        where = f"in item {item}, " if item is not None else ""
        raise RequestError(f"{field_}: not valid Unicode text (a lone surrogate {where}at position {e.start})")


def lone_surrogate_at(value: Any) -> Optional[str]:
    """The JSON pointer of the first string (a key or a value) in JSON data `value` that holds a lone surrogate
    (`check_text`), `""` for `value` itself; None when there is none (walked without recursion)."""
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        x, path = stack.pop()
        if isinstance(x, str) and _not_utf8(x) is not None:
            return _pointer(path)
        if isinstance(x, dict):
            bad = next((k for k in x if isinstance(k, str) and _not_utf8(k) is not None), None)
            if bad is not None:
                return _pointer((*path, bad))
            stack.extend((v, (*path, k)) for k, v in reversed(list(x.items())))
        elif isinstance(x, (list, tuple)):
            stack.extend((v, (*path, i)) for i, v in reversed(list(enumerate(x))))
    return None


def mask_words(vocab_size: int) -> int:
    """int32 words in one row of the allowed-token bitmask."""
    return (int(vocab_size) + 31) // 32


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("const", "enum", "default", "examples")


def _close_objects(schema: Any) -> Any:
    """`additionalProperties: false` on every schema that declares `properties` or `patternProperties` and
    does not set it (recursively: nested objects, array items, $defs; the maps of named sub-schemas are
    walked, literal data is left alone). vLLM's rule: a schema that declares no properties, such as a
    free-form `{"type": "object"}` field, stays any object (closing it would admit only `{}`)."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _close_objects(sub) for name, sub in v.items()}
        else:
            out[k] = v if k in _DATA else _close_objects(v)
    declares = isinstance(out.get("properties"), dict) or isinstance(out.get("patternProperties"), dict)
    if declares and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def rebase_refs(schema: Any, base: str) -> Any:
    """`schema` to be placed at JSON pointer `base` (`"#/items/0"`) inside another schema: its local `$ref`s
    (`"#"`, `"#/$defs/X"`) are relative to its own root, so each becomes `base` + the pointer (the maps of named
    sub-schemas are walked, literal data is left alone, as `_close_objects` walks them). A (sub-)schema with an
    `$id` of its own is a resource whose local refs resolve against that `$id` wherever it is placed: it is left
    as it is (rebased, its refs pointed past its own root)."""
    if isinstance(schema, list):
        return [rebase_refs(s, base) for s in schema]
    if not isinstance(schema, dict) or _own_resource(schema):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):  # (not "#name" anchors)
            out[k] = base + v[1:]
        elif k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: rebase_refs(sub, base) for name, sub in v.items()}
        else:
            out[k] = v if k in _DATA else rebase_refs(v, base)
    return out


def _own_resource(schema: dict) -> bool:
    """Whether `schema` sets a base URI of its own (an `$id` that is not a plain-name `#anchor`)."""
    sid = schema.get("$id")
    return isinstance(sid, str) and not sid.startswith("#")


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet validated against a tokenizer); with
    `answer_prefix`, the constraint's grammars become a sub-grammar after that optional text."""
    text = _constraint_grammar(params)
    if not params.answer_prefix:
        return text
    if not isinstance(params.answer_prefix, str):
        raise RequestError("structured_outputs.answer_prefix: must be a string")
    check_text(params.answer_prefix, "structured_outputs.answer_prefix")
    try:
        inner = json.loads(text)
    except json.JSONDecodeError:  # Lark text
        inner = {"grammars": [{"lark_grammar": text}]}
    inner["grammars"][0]["name"] = "constraint"
    wrap = {"name": "answer", "lark_grammar": f"start: PREFIX? @constraint\nPREFIX: {json.dumps(params.answer_prefix)}"}
    return json.dumps({**inner, "grammars": [wrap] + inner["grammars"]})


def _whitespace_pattern(pattern: Optional[str]) -> str:
    """The regex of what may stand between two JSON tokens: the bounded default when `pattern` is None; an
    empty pattern allows no whitespace (outlines' reading: it is not "unset"). A pattern llguidance cannot
    parse is refused naming `whitespace_pattern` (it surfaced later as an error of `json`)."""
    import llguidance as llg

    if pattern is None:
        return JSON_WHITESPACE
    if not isinstance(pattern, str):
        raise RequestError("structured_outputs.whitespace_pattern: must be a regular expression string")
    check_text(pattern, "structured_outputs.whitespace_pattern")
    error = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_regex(pattern))
    if error:
        why = next((line for line in error.splitlines() if line.startswith("error: ")), "error: " + error)
        raise RequestError(f"structured_outputs.whitespace_pattern: not a valid regular expression ({why})")
    return pattern


def json_constraint(params: StructuredOutputsParams) -> tuple[Any, dict]:
    """(the JSON schema, llguidance's JSON compile options) of a `json` or `json_object` constraint, the schema
    parsed, checked and closed as `disable_additional_properties` asks."""
    kind = params.kind()
    field_ = f"structured_outputs.{kind}"
    schema = {"type": "object"} if kind == "json_object" else params.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise RequestError(f"{field_}: not valid JSON: {e}") from None
        except RecursionError:  # nested past the interpreter's recursion limit
            raise _too_deep(field_) from None
    if not isinstance(schema, (dict, bool)):
        raise RequestError(f"{field_}: a JSON schema must be an object, got {type(schema).__name__}")
    check_schema_depth(schema, field_)
    check_ref_depth(schema, field_)
    if params.disable_additional_properties and kind == "json":  # json_object stays any object (vLLM's)
        schema = _close_objects(schema)
    options = ({"whitespace_flexible": False} if params.disable_any_whitespace else
               {"whitespace_flexible": True, "whitespace_pattern": _whitespace_pattern(params.whitespace_pattern)})
    options["coerce_one_of"] = True  # `oneOf` read as `anyOf`, as vLLM's default backend (xgrammar) reads it
    return schema, options


def _pointer(parts: Sequence[str]) -> str:
    """A JSON pointer (RFC 6901) of a path of keys and indices."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


#: Keywords whose sub-schemas are merged with the schema that holds them (they mean something else alone).
_MERGED = ("allOf", "not", "if", "then", "else", "dependentSchemas")
#: JSON text from which a sub-schema may hold enough properties or alternatives for llguidance's limit of 2,000
#: items in an Earley row (~500 optional properties, 2,000 `anyOf` branches: many KiB).
PROBE_SUB_SCHEMA_TEXT = 1024
#: Sub-schemas of a JSON schema `probe_sub_schemas` compiles and walks on their own (the largest first): bounds the
#: compile time of a schema of thousands of large distinct sub-schemas.
MAX_SUB_PROBES = 256


def _children(x: Any):
    """(key, sub-schema or list of them) of a schema (`_close_objects`' walk: literal data is left alone)."""
    if isinstance(x, list):
        yield from enumerate(x)
    elif isinstance(x, dict):
        for k, v in x.items():
            if k in _SCHEMA_MAPS and isinstance(v, dict):
                yield from (((k, name), sub) for name, sub in v.items())
            elif k not in _DATA:
                yield k, v


def _text_sizes(schema: Any) -> dict[int, int]:
    """id -> the length of the JSON text of every dict and list in `schema` (about), in one pass."""
    sizes: dict[int, int] = {}
    stack = [(schema, False)]
    while stack:
        x, done = stack.pop()
        if not isinstance(x, (dict, list)) or id(x) in sizes:
            continue
        kids = list(x.values()) if isinstance(x, dict) else x
        if not done:
            stack.append((x, True))
            stack.extend((k, False) for k in kids)
            continue
        keys = sum(len(str(k)) + 4 for k in x) if isinstance(x, dict) else 0
        sizes[id(x)] = 2 + keys + sum(sizes[id(k)] if isinstance(k, (dict, list)) else len(json.dumps(k)) + 2
                                      for k in kids)
    return sizes


def _shallow(x: Any, sizes: dict[int, int], top: bool = True, refs: bool = True) -> Any:
    """`x` with each large sub-schema below it (`PROBE_SUB_SCHEMA_TEXT`) replaced by `{}`: each is walked on its own,
    and where the output enters `x` only `x`'s own alternatives count (every part of a schema is in one probe).
    `refs=False`: its `$ref`s left out too (each then stands for any value)."""
    if isinstance(x, dict) and not top and sizes.get(id(x), 0) >= PROBE_SUB_SCHEMA_TEXT:
        return {}
    if isinstance(x, list):
        return [_shallow(v, sizes, False, refs) for v in x]
    if not isinstance(x, dict):
        return x
    out = {}
    for k, v in x.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _shallow(sub, sizes, False, refs) for name, sub in v.items()}
        elif k != "$ref" or refs:
            out[k] = v if k in _DATA else _shallow(v, sizes, False, refs)
    return out


def _local_refs(x: Any) -> Optional[set[str]]:
    """The `$defs` / `definitions` entries (`"#/$defs/X"`) the local `$ref`s of `x` name; None when one points
    elsewhere (`"#"`, `"#/properties/a"`: `x` would mean something else as a root)."""
    refs, stack = set(), [x]
    while stack:
        y = stack.pop()
        if isinstance(y, dict):
            ref = y.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                parts = ref[2:].split("/")
                if len(parts) != 2 or parts[0] not in ("$defs", "definitions"):
                    return None
                refs.add(ref)
        stack.extend(v for _, v in _children(y))
    return refs


def _ref_targets(schema: Any) -> set[str]:
    """The last two segments of every `$ref` in `schema` (`"$defs/X"` of `"#/$defs/X"`): the definitions in use."""
    found, stack = set(), [schema]
    while stack:
        y = stack.pop()
        if isinstance(y, dict) and isinstance(y.get("$ref"), str):
            found.add("/".join(y["$ref"].rsplit("/", 2)[-2:]))
        stack.extend(v for _, v in _children(y))
    return found


def _alone(x: dict, sizes: dict[int, int], defs: dict[str, Any]) -> Optional[dict]:
    """`x` as a root schema of its own: `_shallow`, next to the root's definitions its `$ref`s name, shallow with
    their own `$ref`s left out (each definition is walked at its own entry: following their `$ref`s on made each of
    a chain of N definitions carry the rest, N^2 in all: 300 OpenAPI components took 8 s to compile). None when a
    `$ref` points elsewhere than the root's definitions (an `$id` resource is taken as it is)."""
    alone = _shallow(x, sizes)
    if _own_resource(x):  # (its refs are its own)
        return alone
    refs = _local_refs(alone)
    if refs is None or not refs <= defs.keys():
        return None
    for ref in refs:
        kind, name = ref[2:].split("/")
        alone.setdefault(kind, {})[name.replace("~1", "/").replace("~0", "~")] = _shallow(defs[ref], sizes, refs=False)
    return alone


def sub_schemas(schema: Any, limit: Optional[int] = None) -> list[tuple[str, dict]]:
    """(JSON pointer, a root schema of it) of each distinct sub-schema of `schema` that may meet one of llguidance's
    lazy limits where the output enters it: large ones (`PROBE_SUB_SCHEMA_TEXT`), or ones with a regular
    expression of their own (`pattern`, `patternProperties`), largest first (the first `limit`). Each is `_alone`
    (about linear in all). Not those merged with their parent (`_MERGED`), definitions no `$ref` names, or ones
    whose `$ref`s point elsewhere than the root's definitions."""
    if not isinstance(schema, dict):
        return []
    sizes, used = _text_sizes(schema), _ref_targets(schema)
    defs = {f"#/{k}/{_pointer([name])[1:]}": sub for k in ("$defs", "definitions")
            if isinstance(schema.get(k), dict) for name, sub in schema[k].items()}
    candidates: list[tuple[int, str, dict]] = []
    stack: list[tuple[tuple, Any]] = [((), schema)]
    while stack:
        path, x = stack.pop()
        for k, v in _children(x):
            sub = path + (k if isinstance(k, tuple) else (k,))
            if isinstance(k, tuple) and k[0] in ("$defs", "definitions") and _pointer(k)[1:] not in used:
                continue  # (a definition no $ref names: unused)
            stack.append((sub, v))
        merged = len(path) > 1 and (path[-1] in _MERGED or path[-2] in _MERGED)
        if path and not merged and isinstance(x, dict) and (
                sizes.get(id(x), 0) >= PROBE_SUB_SCHEMA_TEXT or "pattern" in x or "patternProperties" in x):
            candidates.append((sizes[id(x)], _pointer(path), x))
    found: dict[str, tuple[str, dict]] = {}
    for _, where, x in sorted(candidates, key=lambda c: -c[0]):
        if limit is not None and len(found) >= limit:
            break
        alone = _alone(x, sizes, defs)
        if alone is not None:
            found.setdefault(json.dumps(alone, sort_keys=True), (where, alone))
    return list(found.values())


def probe_sub_schemas(params: StructuredOutputsParams, ll_tokenizer, stop_ids: Sequence[int]) -> Optional[str]:
    """`probe` each `sub_schemas` of a JSON constraint on its own -> "at POINTER: llguidance's error" of the first
    that fails at its first tokens. llguidance meets its limits lazily, where the output enters a part of the
    grammar: a too-wide object (or `anyOf`, or a lexer-heavy `pattern`) below the root's first tokens compiled, and
    the request ran, then ended with finish_reason "error" mid-generation. One that does not compile alone is
    skipped (the whole schema compiled)."""
    import llguidance as llg

    schema, options = json_constraint(params)
    for where, alone in sub_schemas(schema, MAX_SUB_PROBES):
        try:
            m = llg.LLMatcher(ll_tokenizer, llg.LLMatcher.grammar_from_json_schema(json.dumps(alone),
                                                                                   overrides=options), log_level=0)
        except Exception:  # noqa: BLE001 - (llguidance's own errors on odd input) not this probe's to report
            continue
        if m.is_error():
            continue
        m.compute_bitmask()
        failed = first_line(m.get_error()) if m.is_error() else probe(m, stop_ids)
        if failed:
            return f"at {where}: {failed}"
    return None


def _constraint_grammar(params: StructuredOutputsParams) -> str:
    import llguidance as llg

    kind = params.kind()
    field_ = f"structured_outputs.{kind}"
    for flag in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
        if not isinstance(getattr(params, flag), bool):
            raise RequestError(f"structured_outputs.{flag}: expected true or false, got {getattr(params, flag)!r}")
    json_only = [f for f in ("disable_any_whitespace", "disable_additional_properties") if getattr(params, f)]
    json_only += ["whitespace_pattern"] if params.whitespace_pattern is not None else []
    if kind not in ("json", "json_object") and json_only:  # (vLLM ignores them there)
        raise RequestError(f"structured_outputs.{json_only[0]}: applies to a JSON constraint, not to {kind}")
    if kind in ("json", "json_object"):
        schema, options = json_constraint(params)
        try:
            return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
        except (ValueError, TypeError) as e:
            where = lone_surrogate_at(schema)  # (llguidance said "unexpected end of hex escape at line 1 column N")
            if where is not None:  # (named escaped: the message is text too)
                where = where.encode("utf-8", "backslashreplace").decode("utf-8")
                raise RequestError(f"{field_}: not valid Unicode text (a lone surrogate at {where})") from None
            raise RequestError(f"{field_}: {e}") from None
    if kind == "regex":
        if not isinstance(params.regex, str) or not params.regex:
            raise RequestError(f"{field_}: must be a non-empty string")
        check_text(params.regex, field_)
        return llg.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        choices = params.choice
        if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise RequestError(f"{field_}: must be a non-empty list of non-empty strings")
        for i, c in enumerate(choices):
            check_text(c, field_, i)
        return llg.LLMatcher.grammar_from_lark(choice_lark(choices))
    if not isinstance(params.grammar, str) or not params.grammar.strip():
        raise RequestError(f"{field_}: must be a non-empty grammar (Lark or GBNF)")
    check_text(params.grammar, field_)
    try:
        text = llg.grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise RequestError(f"{field_}: {e}") from None
    check_grammar_depth(text, field_)
    return text


def choice_lark(choices: Sequence[str]) -> str:
    """The Lark grammar whose language is exactly `choices`: one terminal, their alternation, matched by the lexer
    (as a rule of one string each, every choice was an item of one Earley row: past 2,000 choices, 3,000 country
    names, it was refused as too complex)."""
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices)


class _TokenTable:
    """What llguidance's tokenizer wrapper reads: each id's bytes (special ids marked with 0xFF, so no
    text can produce them), the stop ids, and the tokenizer for strings inside grammars, which must
    tokenize text as the model sees it: added tokens that are not special (K3's `<|open|>`, `<|sep|>`,
    `<|close|>`) are matched in the text (llguidance follows this tokenization for fixed strings)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int]):
        self._tokenizer = tokenizer
        n = min(tokenizer.vocab_size, vocab_size)
        self.tokens = [(b"\xff" + tokenizer.token_bytes(i)) if tokenizer.is_special(i) else tokenizer.token_bytes(i)
                       for i in range(n)] + [b""] * (vocab_size - n)  # ids past the tokenizer: never allowed
        self.special_token_ids = [i for i in range(n) if tokenizer.is_special(i)]
        self.eos_token_id = int(stop_ids[0])
        self.bos_token_id = tokenizer.bos_token_id
        self._added = frozenset(name for i in range(n) if not tokenizer.is_special(i)
                                and (name := tokenizer.id_to_token(i)) is not None)

    def __call__(self, text):
        if isinstance(text, bytes):
            raise TypeError("strings only")  # tells the wrapper to pass str
        return self._tokenizer.encode(text, allow_special=self._added)


class GrammarCompiler:
    """Per-engine: the llguidance tokenizer (built at warm-up) and a cache of compiled grammars (their matchers).

    Thread-safe: the HTTP server compiles a request's constraint on a worker thread before handing the
    request to the engine thread, which copies the matcher the request carries (a complex schema never stalls
    a step)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_ids = [int(t) for t in stop_ids]
        self._ll = None
        self._cache: OrderedDict[str, tuple[str, Any]] = OrderedDict()  # key -> (grammar, template)
        self._lock = threading.Lock()

    def prepare(self) -> bool:
        """Build the llguidance tokenizer now (engine warm-up), not on the first constrained request;
        False when structured outputs are unavailable (no tokenizer, or llguidance not installed)."""
        if self.tokenizer is None:
            return False
        try:
            self.ll_tokenizer  # noqa: B018
        except ImportError:
            return False
        return True

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll is None:
                import llguidance as llg

                table = _TokenTable(self.tokenizer, self.vocab_size, self.stop_ids)
                self._ll = llg.LLTokenizer(llg.TokenizerWrapper(table), eos_token=self.stop_ids)
            return self._ll

    def compile(self, params: StructuredOutputsParams) -> str:
        """The validated grammar of `params`; RequestError naming the field when it is invalid. `params` keeps
        the compiled matcher, which `guide` copies: building it is the expensive part (seconds for a schema of
        thousands of properties or a long choice list), and the HTTP server compiles on a worker thread, while
        `guide` runs on the engine thread, where a build would stall every request's steps."""
        grammar, params._compiled = self._compiled(params)
        return grammar

    def _compiled(self, params: StructuredOutputsParams) -> tuple[str, Any]:
        """(grammar, template matcher with its first mask computed) of `params`, cached."""
        if not isinstance(params, StructuredOutputsParams):
            raise RequestError(f"structured_outputs: expected StructuredOutputsParams, got {type(params).__name__}")
        if self.tokenizer is None:
            raise RequestError("structured_outputs: this model has no tokenizer to match text constraints against")
        try:
            import llguidance  # noqa: F401
        except ImportError:
            raise RequestError("structured_outputs: unavailable on this server (pip install llguidance)") from None
        if params.kind() == "json" and not isinstance(params.json, str):  # before anything recurses through it
            check_schema_depth(params.json)
        key = params.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        import llguidance as llg

        try:
            grammar = grammar_text(params)
            template = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
            if not template.is_error():
                template.compute_bitmask()  # (its lexer states: copies start with them)
                failed = probe(template, self.stop_ids)
                if not failed and params.kind() == "json":
                    failed = probe_sub_schemas(params, self.ll_tokenizer, self.stop_ids)
                if failed:
                    raise RequestError(f"structured_outputs.{params.kind()}: too complex for the grammar engine "
                                       f"({failed}); simplify it (fewer optional properties or alternatives, "
                                       f"smaller repetition counts)")
        except RequestError:
            raise
        except Exception as e:  # llguidance's own errors on odd input: still the request's fault
            raise RequestError(f"structured_outputs.{params.kind()}: {e}") from None
        if template.is_error():
            raise RequestError(f"structured_outputs.{params.kind()}: {first_line(template.get_error()) or 'invalid'}")
        with self._lock:
            self._cache[key] = grammar, template
            # (the newest stays, even past the text cap: evicted at once, each guide of its n samples rebuilt it)
            while len(self._cache) > 1 and (len(self._cache) > _CACHE_SIZE
                                            or sum(len(g) for g, _ in self._cache.values()) > _CACHE_TEXT):
                self._cache.popitem(last=False)
        return grammar, template

    def guide(self, params: StructuredOutputsParams) -> "Guide":
        """A fresh matcher for one sequence (each of a request's n samples has its own): a copy of the one
        `compile` left on `params` (or of the cached one, compiled now if it is not)."""
        template = getattr(params, "_compiled", None)
        if template is None:
            template = self._compiled(params)[1]
        after = ()
        if params.reasoning_end is not None:
            if not isinstance(params.reasoning_end, str) or not params.reasoning_end:
                raise RequestError("structured_outputs.reasoning_end: must be a non-empty string")
            check_text(params.reasoning_end, "structured_outputs.reasoning_end")
            after = self.tokenizer.encode(params.reasoning_end, allow_special=True)
        return Guide(template.deep_copy(), tuple(int(t) for t in after))


def first_line(error: Optional[str]) -> str:
    """llguidance's error without the parser state it appends (lines of JSON after the message)."""
    return (error or "").split("\n<state>", 1)[0].strip()


def probe(template, stop_ids: Sequence[int], tokens: int = PROBE_TOKENS) -> Optional[str]:
    """Walk a copy of `template` (a matcher, its first mask computed) a few tokens, each the lowest allowed id that
    is not a stop token -> llguidance's error when one fails: a constraint that compiles but fails at its first
    tokens (its limits on Earley rows and lexer states are hit lazily) is then refused, not failed mid-generation."""
    m = template.deep_copy()
    stops = set(stop_ids)
    for _ in range(tokens):
        if m.is_stopped():
            return None
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")
        tok = next((int(t) for t in np.flatnonzero(bits) if int(t) not in stops), None)
        if tok is None:
            return None
        if not m.consume_token(tok):
            return first_line(m.get_error()) or "invalid"
    return None


def banned_tokens(words: Sequence[tuple[int, ...]], output: Sequence[int]) -> list[int]:
    """The last token of every word whose other tokens end the output (a one-token word always): what
    `bad_words` bans next, vLLM's rule, over the generated tokens (each token once, in the words' order)."""
    out = {}
    for w in words:
        if len(w) == 1 or (len(output) >= len(w) - 1 and tuple(output[len(output) - len(w) + 1:]) == w[:-1]):
            out[w[-1]] = None
    return list(out)


def clear_bits(row: np.ndarray, tokens: Sequence[int]) -> None:
    """Clear the bits of `tokens` in a bitmask row (int32 [W], bit t % 32 of word t // 32 is token t)."""
    bits = row.view(np.uint32)
    for t in tokens:
        bits[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)


def allowed_tokens(row: np.ndarray, tokens: Sequence[int]) -> list[int]:
    """Those of `tokens` whose bit is set in a bitmask row (int32 [W])."""
    bits = row.view(np.uint32)
    return [t for t in tokens if t >> 5 < bits.size and (int(bits[t >> 5]) >> (t & 31)) & 1]


def count_allowed(row: np.ndarray) -> int:
    """How many tokens a bitmask row (int32 [W]) allows."""
    return int(np.unpackbits(row.view(np.uint8)).sum())


_executor = None


def fill_masks(rows: Sequence[tuple["Guide", int]], mask: np.ndarray) -> None:
    """Write the next-token bitmask of each (guide, row) into `mask` [B, W] int32 (C-contiguous); rows
    not listed are left alone. Several active guides are filled in parallel on llguidance's thread pool
    (it drops the GIL), one alone on this thread."""
    active = [(g, i) for g, i in rows if g.active]
    for g, i in rows:
        if not g.active:
            mask[i] = ALLOW_ALL
    if len(active) == 1:
        g, i = active[0]
        g.fill(mask[i])
    elif active:
        global _executor
        if _executor is None:
            import llguidance as llg

            _executor = llg.LLExecutor()
        if not mask.flags["C_CONTIGUOUS"] or mask.dtype != np.int32:
            raise ValueError("mask must be a C-contiguous int32 array")
        _executor.unsafe_compute_mask_ptr([(g.matcher, i) for g, i in active], mask.ctypes.data,
                                          mask.shape[1] * 4, mask.shape[0])


@dataclass
class Guide:
    """One sequence's constraint state: the llguidance matcher, advanced by every token sampled once
    the output has shown `after` (empty: from the first token)."""

    matcher: Any
    after: tuple[int, ...] = ()
    active: bool = field(default=False)
    recent: list = field(default_factory=list)  # the last len(after) tokens while waiting

    def __post_init__(self):
        self.active = not self.after

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed-token bitmask of the next token into `row` (int32 [W], C-contiguous)."""
        if not self.active:
            row[:] = ALLOW_ALL
            return
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)

    def fill_drafts(self, drafts: list[int], rows: np.ndarray) -> None:
        """Speculative decoding: write into rows[j] the mask that follows drafts[:j + 1] (rows [d, W]),
        then return the matcher to where it was. The drafts must be valid (`validate_tokens`).

        Drafts after the one that completes the grammar (nothing may follow: the request stops there) are
        not consumed and their rows are left as they are: a stopped matcher takes a stop token without
        recording it, so rolling it back too would undo a token before the drafts."""
        consumed = 0
        for j, tok in enumerate(drafts):
            if self.matcher.is_stopped():
                break
            if not self.matcher.consume_token(int(tok)):
                raise ValueError(f"draft token {tok} breaks the constraint: {self.matcher.get_error()}")
            consumed += 1
            self.fill(rows[j])
        self.matcher.rollback(consumed)

    def advance(self, token: int) -> bool:
        """Account for a sampled token; False when it broke the constraint (never, with the mask)."""
        if not self.active:
            self.recent = (self.recent + [int(token)])[-len(self.after):]
            self.active = tuple(self.recent) == self.after
            return True
        return bool(self.matcher.consume_token(int(token)))

    @property
    def done(self) -> bool:
        """The constraint is satisfied and allows nothing more (the request stops here)."""
        return self.active and self.matcher.is_stopped()

    @property
    def error(self) -> Optional[str]:
        return self.matcher.get_error() if self.matcher.is_error() else None
