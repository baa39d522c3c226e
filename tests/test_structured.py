"""Structured outputs on the host and the masking op (serve/structured.py, serve/penalties.apply_bitmask):
grammars from each constraint kind walked with random allowed tokens until complete (the text must be
in the language: checked with Python's json / re, not llguidance), errors that name the field, the
delayed start, and the device op against llguidance's own numpy reference. Engine-level greedy and
sampled runs are in test_sampling_engine.py (they share its compiled engine)."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.tokenizer import ByteTokenizer
from serve.penalties import apply_bitmask
from serve.stop_checker import StopChecker
from serve.structured import GrammarCompiler, mask_words, sub_schemas
from serve.types import RequestError, SamplingParams, StructuredOutputsParams as SO

TOK = ByteTokenizer(320)
V = 352  # the model's vocabulary is padded past the tokenizer's (ids 320.. are never allowed)
STOPS = TOK.eos_token_ids


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(TOK, V, STOPS)


def _allowed(row: np.ndarray) -> np.ndarray:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:V]
    return np.flatnonzero(bits)


def _walk(compiler, params, rng, max_steps=400):
    """Sample uniformly among the allowed tokens until the guide is done; -> (tokens, masks seen)."""
    g = compiler.guide(params)
    row = np.zeros(mask_words(V), np.int32)
    out = []
    for _ in range(max_steps):
        g.fill(row)
        allowed = _allowed(row)
        assert allowed.size and allowed.max() < TOK.vocab_size
        tok = int(rng.choice(allowed))
        assert g.advance(tok)
        out.append(tok)
        if g.done or (g.active and tok in STOPS):
            return out
    raise AssertionError(f"not done after {max_steps} tokens: {TOK.decode(out)!r}")


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"], "additionalProperties": False}


def _check_schema(v):
    assert set(v) >= {"name", "age", "ok"} and set(v) <= {"name", "age", "tags", "ok"}
    assert isinstance(v["name"], str) and len(v["name"]) <= 6
    assert isinstance(v["age"], int) and not isinstance(v["age"], bool) and 0 <= v["age"] <= 150
    assert isinstance(v["ok"], bool)
    assert set(v.get("tags", [])) <= {"a", "b", "c"} and len(v.get("tags", [])) <= 3


@pytest.mark.parametrize("seed", range(6))
def test_random_walks_stay_in_the_language(compiler, seed):
    rng = np.random.default_rng(seed)
    text = TOK.decode(_walk(compiler, SO(json=SCHEMA, disable_any_whitespace=True), rng))
    _check_schema(json.loads(text))
    assert " " not in text.replace('"', "").split(":")[0]  # compact
    text = TOK.decode(_walk(compiler, SO(json=json.dumps(SCHEMA)), rng))  # whitespace allowed, text schema
    _check_schema(json.loads(text))
    regex = r"(ab|cd)[0-9]{2,4}-x+"
    text = TOK.decode(_walk(compiler, SO(regex=regex), rng))
    assert re.fullmatch(regex, text.rstrip()) or re.fullmatch(regex, text), text
    choices = ["yes", "no", "maybe so"]
    assert TOK.decode(_walk(compiler, SO(choice=choices), rng)) in choices
    grammar = 'start: expr\nexpr: NUM | "(" expr "+" expr ")"\nNUM: /[0-9]/'
    text = TOK.decode(_walk(compiler, SO(grammar=grammar), rng))
    assert re.fullmatch(r"[0-9()+]+", text) and text.count("(") == text.count("+") == text.count(")")


def test_json_object_admits_any_object_and_nothing_else(compiler):
    row = np.zeros(mask_words(V), np.int32)
    # disable_additional_properties closes a schema's objects, not json_object's any object (vLLM's; it
    # admitted {} alone)
    for so in (SO(json_object=True), SO(json_object=True, disable_additional_properties=True)):
        g = compiler.guide(so)
        for tok in TOK.encode('{"k": [1, {"z": null}], "s": "\u00e9t\u00e9"}'):
            g.fill(row)
            assert tok in _allowed(row) and g.advance(tok), so
        assert g.done
    g = compiler.guide(SO(json_object=True))
    g.fill(row)
    assert TOK.encode("[")[0] not in _allowed(row) and TOK.encode("{")[0] in _allowed(row)


def test_gbnf_grammar_and_closed_objects(compiler):
    rng = np.random.default_rng(3)
    gbnf = 'root ::= "x" digit digit\ndigit ::= [0-9]'
    assert re.fullmatch(r"x[0-9]{2}", TOK.decode(_walk(compiler, SO(grammar=gbnf), rng)))
    open_schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["a"]}
    for seed in range(5):
        v = json.loads(TOK.decode(_walk(compiler, SO(json=open_schema, disable_any_whitespace=True,
                                                     disable_additional_properties=True),
                                        np.random.default_rng(seed))))
        assert list(v) == ["a"]


def test_the_constraint_starts_after_the_reasoning_and_may_open_with_the_prefix(compiler):
    so = SO(choice=["42"], reasoning_end="</think>", answer_prefix="<ans>")
    row = np.zeros(mask_words(V), np.int32)
    for answer in ("<ans>42", "42"):
        g = compiler.guide(so)
        for tok in TOK.encode("free </thi text </thi"):  # anything goes before the marker
            g.fill(row)
            assert (row == -1).all() and g.advance(tok) and not g.done
        for tok in TOK.encode("nk>"):
            assert g.advance(tok)
        assert g.active
        g.fill(row)
        assert sorted(_allowed(row)) == sorted(TOK.encode("<4"))  # the prefix or the answer
        for i, tok in enumerate(TOK.encode(answer)):
            g.fill(row)
            assert tok in _allowed(row) and g.advance(tok) and g.done == (i == len(answer) - 1)


def test_a_token_outside_the_mask_breaks_the_guide(compiler):
    g = compiler.guide(SO(regex="[0-9]+"))
    assert not g.advance(TOK.encode("z")[0])
    assert g.error


@pytest.mark.parametrize("params, field", [
    (SO(), "structured_outputs: set exactly one"),
    (SO(regex="a", choice=["b"]), "set exactly one"),
    (SO(regex="a(b"), r"structured_outputs\.regex"),
    (SO(json={"type": "foo"}), r"structured_outputs\.json"),
    (SO(json="{not json"), r"structured_outputs\.json: not valid JSON"),
    (SO(json=[1, 2]), r"structured_outputs\.json: a JSON schema must be an object"),
    (SO(choice=[]), r"structured_outputs\.choice"),
    (SO(grammar="start: undefined_rule"), r"structured_outputs\.grammar"),
    # JSON-only options on other kinds, and flags that are not booleans (vLLM ignores / coerces them)
    (SO(regex="a+", whitespace_pattern=" "), r"structured_outputs\.whitespace_pattern: applies to a JSON"),
    (SO(choice=["a"], disable_any_whitespace=True), r"disable_any_whitespace: applies to a JSON constraint, not to"),
    (SO(grammar="start: \"a\"", disable_additional_properties=True), r"disable_additional_properties: applies"),
    (SO(json_object="yes"), r"structured_outputs\.json_object: expected true or false"),
    (SO(json={"type": "object"}, disable_any_whitespace=1), r"disable_any_whitespace: expected true or false"),
    # a pattern llguidance cannot parse: named as itself (it surfaced as an error of structured_outputs.json)
    (SO(json={"type": "object"}, whitespace_pattern="("), r"structured_outputs\.whitespace_pattern: not a valid"),
])
def test_bad_constraints_name_the_field(compiler, params, field):
    with pytest.raises(RequestError, match=field):
        compiler.guide(params)


_LONE = "ok \ud800"  # a lone surrogate: what JSON's "\\ud800" decodes to, or a Python API caller passes


@pytest.mark.parametrize("params, where", [
    (SO(choice=["x"], reasoning_end=_LONE), r"reasoning_end: .*at position 3"),  # (a UnicodeEncodeError)
    (SO(choice=["x"], answer_prefix=_LONE), r"answer_prefix: .*at position 3"),  # (named structured_outputs.choice)
    (SO(choice=["x", _LONE]), r"choice: .*in item 1, at position 3"),
    (SO(regex=_LONE), r"regex: .*at position 3"),
    (SO(grammar=f'start: "{_LONE}"'), r"grammar: .*at position 11"),
    (SO(json={"type": "object"}, whitespace_pattern=_LONE), r"whitespace_pattern: "),  # (named json)
    (SO(json={"type": "object", "properties": {"a": {"const": _LONE}}}), r"json: .* at /properties/a/const\)"),
    (SO(json={"type": "object", "properties": {_LONE: {}}}), r"json: .* at /properties/ok \\ud800\)"),
    (SO(json='{"enum": ["a", "\\udc00"]}'), r"json: .* at /enum/1\)"),  # (llguidance: "unexpected end of hex")
])
def test_text_fields_with_a_lone_surrogate_are_refused_naming_the_field(compiler, params, where):
    """Text the tokenizer or llguidance reads as UTF-8 with a lone surrogate in it: `reasoning_end` raised
    UnicodeEncodeError from the tokenizer (through the Python API: no RequestError), the others llguidance's
    "unexpected end of hex escape at line 1 column 19" or a codec's message, some naming another field. Each is a
    RequestError naming its field and where the surrogate is."""
    with pytest.raises(RequestError, match=rf"^structured_outputs\.{where}.*"):
        compiler.guide(params)


def test_a_prompt_with_a_lone_surrogate_is_refused_naming_it():
    """The engine's text prompt (the Python API's; the HTTP server names its own) raised the tokenizer's
    UnicodeEncodeError from `add_request`."""
    from types import SimpleNamespace as NS

    from serve.engine import Engine

    with pytest.raises(RequestError, match=r"^prompt: not valid Unicode text \(a lone surrogate at position 3\)"):
        Engine._prompt_ids(NS(tokenizer=TOK), _LONE)


def test_an_empty_whitespace_pattern_allows_no_whitespace(compiler):
    """whitespace_pattern="" is a pattern (outlines' reading), not "unset": no whitespace between JSON tokens
    (it fell back to the default, up to 20 whitespace characters per gap)."""
    row = np.zeros(mask_words(V), np.int32)
    for pattern, spaced in (("", False), (" ?", True), (None, True)):
        g = compiler.guide(SO(json={"type": "object"}, whitespace_pattern=pattern))
        assert g.advance(TOK.encode("{")[0])
        g.fill(row)
        assert (TOK.encode(" ")[0] in _allowed(row)) == spaced, pattern


def test_constraints_past_llguidances_limits_are_refused_when_compiled(compiler):
    """llguidance builds its Earley rows and lexer states lazily: a schema of 700 optional properties ("row has 2807
    items; max is 2000") or `a{1000000}` ("too many expressions") compiled, then failed on the first token (output
    `{`, finish_reason "stop"). The compile walks a few tokens: refused there, naming the field; 300 pass."""
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(700)}}
    for so, field in ((SO(json=wide), "json"), (SO(regex="a{1000000}"), "regex")):
        with pytest.raises(RequestError, match=rf"^structured_outputs\.{field}: too complex for the grammar engine"):
            compiler.compile(so)
    narrower = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}}
    text = TOK.decode(_walk(compiler, SO(json=narrower, disable_any_whitespace=True), np.random.default_rng(0)))
    assert set(json.loads(text)) <= set(narrower["properties"])


def test_constraints_past_llguidances_limits_deep_inside_a_schema_are_refused_when_compiled(compiler):
    """A too-wide object (or a lexer-heavy pattern) below the schema's first tokens compiled: the request ran and
    ended with finish_reason "error" once the output reached it (`{"data": {`). Each large sub-schema (and each with a
    pattern) is walked on its own: refused when compiled, naming the field and where (a JSON pointer); a `$ref`'d
    definition is walked at its `$defs` entry. One no `$ref` names, and many small fields, are not refused."""
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(700)}}
    cases = [({"type": "object", "properties": {"id": {"type": "string"}, "data": wide}, "required": ["id", "data"]},
              "/properties/data", "2807 items"),
             ({"type": "array", "items": {"type": "object", "properties": {
                 "a": {"type": "string", "pattern": "^a{1000000}$"}}}}, "/items/properties/a", "lexer error"),
             ({"type": "object", "$defs": {"Big": {"type": "object", "properties": {"in": wide}}},
               "properties": {"x": {"$ref": "#/$defs/Big"}}}, "/$defs/Big/properties/in", "2807 items")]
    for schema, where, why in cases:
        with pytest.raises(RequestError, match=rf"^structured_outputs\.json: too complex for the grammar engine "
                                               rf"\(at {re.escape(where)}: .*{why}"):
            compiler.compile(SO(json=schema))
    unused = {"type": "object", "$defs": {"Big": wide}, "properties": {"x": {"type": "integer"}}}
    many = {"type": "object", "properties": {f"p{i}": {"type": "integer", "description": f"field {i}"}
                                             for i in range(300)}}
    for schema in (unused, many):
        compiler.compile(SO(json=schema))


def test_sub_schema_probes_of_a_chain_of_definitions_stay_linear(compiler):
    """Each probed sub-schema carried the definitions its `$ref`s name, theirs too: in a chain of N OpenAPI-style
    components (each 1 KiB, each naming the next) every probe held the rest of the chain, N^2 in all (300 took 8 s to
    compile, 2,000 over 5 minutes in `sub_schemas` alone). A probe holds the definitions its sub-schema names, their
    own `$ref`s left out (each is walked at its own entry): the probes' text stays within a few times the schema's,
    the schema compiles, and a too-wide object at the chain's end is still refused, named where it is."""
    def chain(n, last):
        defs = {f"D{i}": {"type": "object", "description": "x" * 1000, "properties": {
            "a": {"type": "string", "pattern": "^[a-z]+$"}, "next": {"$ref": f"#/$defs/D{i + 1}"}}} for i in range(n)}
        return {"$defs": {**defs, f"D{n}": last}, "type": "object", "properties": {"x": {"$ref": "#/$defs/D0"}}}

    schema = chain(200, {"type": "string"})
    probes = sub_schemas(schema)
    assert len(probes) >= 200 and all(len(alone.get("$defs", {})) <= 1 for _, alone in probes)
    assert sum(len(json.dumps(alone)) for _, alone in probes) < 4 * len(json.dumps(schema))
    compiler.compile(SO(json=schema))
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(700)}}
    with pytest.raises(RequestError, match=r"too complex for the grammar engine \(at /\$defs/D30: .*2807 items"):
        compiler.compile(SO(json=chain(30, wide)))


def test_a_chain_of_definitions_too_deep_to_compile_is_refused_naming_the_field(compiler):
    """llguidance compiles a definition where a `$ref` first names it, recursing into it: a chain of 1,000
    definitions each naming the next in a property (60 KB of JSON, nested 3 levels) overflowed the compiling thread's
    stack, a segfault that took the server with it. Past `MAX_REF_DEPTH` levels through its `$refs` a schema is
    refused naming the field; a chain of 300, and recursive schemas (each definition entered once), compile."""
    from serve.structured import MAX_REF_DEPTH, ref_depth

    def chain(n):
        defs = {f"D{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/D{i + 1}"}}} for i in range(n)}
        return {"$defs": {**defs, f"D{n}": {"type": "string"}}, "$ref": "#/$defs/D0"}
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}},
                                             "n": {"$ref": "#/$defs/N"}}, "$defs": {"N": {"$ref": "#/$defs/N2"},
                                                                                  "N2": {"type": "integer"}}}
    assert ref_depth(chain(300)) == 902 and ref_depth(tree) == 5
    for schema in (chain(300), tree):
        compiler.compile(SO(json=schema))
    with pytest.raises(RequestError, match=rf"^structured_outputs\.json: .* more than {MAX_REF_DEPTH} levels deep "
                                           r"through its \$refs"):
        compiler.compile(SO(json=chain(1000)))


def test_a_chain_of_definitions_named_in_its_middle_too_is_walked_in_the_schemas_order(compiler):
    """`ref_depth` walked a schema's parts in reverse: properties naming a chain of 1,000 definitions at its start
    and at 250, 500 and 750 entered it from its end, four walks of 250 (754 levels), while llguidance compiles the
    first property first, down the whole chain (3,000 levels): a segfault past the check (78 KB of JSON). Walked in
    the schema's order too, it is refused; 3,000 OpenAPI components each naming earlier ones (no compile goes
    through their longest way) are not."""
    import random

    from serve.structured import MAX_REF_DEPTH, ref_depth

    def entered_at(n, k):
        defs = {f"D{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/D{i + 1}"}}} for i in range(n)}
        return {"$defs": {**defs, f"D{n}": {"type": "string"}}, "type": "object",
                "properties": {f"p{j}": {"$ref": f"#/$defs/D{j * n // k}"} for j in range(k)}}
    assert ref_depth(entered_at(1000, 4)) > MAX_REF_DEPTH  # (checked first: compiling it crashed the process)
    assert ref_depth(entered_at(300, 4)) == 904
    compiler.compile(SO(json=entered_at(300, 4)))
    with pytest.raises(RequestError, match=rf"more than {MAX_REF_DEPTH} levels deep through its \$refs"):
        compiler.compile(SO(json=entered_at(1000, 4)))
    pick = random.Random(0).randrange
    components = {f"C{i}": {"type": "object", "properties": {f"f{j}": {"$ref": f"#/$defs/C{pick(max(i - 50, 0), i)}"}
                                                             for j in range(3)}} for i in range(1, 3000)}
    components["C0"] = {"type": "string"}
    assert ref_depth({"$defs": components, "$ref": "#/$defs/C2999"}) < MAX_REF_DEPTH


_COMPILE_EACH = r"""
import json, sys
from k3jax.tokenizer import ByteTokenizer
from serve.structured import GrammarCompiler
from serve.types import RequestError, StructuredOutputsParams as SO

tok = ByteTokenizer(320)
compiler = GrammarCompiler(tok, 352, tok.eos_token_ids)
for params in json.load(sys.stdin):
    try:
        compiler.compile(SO(**params))
        print("compiled")
    except RequestError as e:
        print(str(e).replace("\n", " "))
"""


def _compile_in_a_subprocess(cases: list[dict]) -> list[str]:
    """What compiling each constraint (`StructuredOutputsParams` fields) says, "compiled" or its RequestError, in a
    process of its own: a case that crashes llguidance ends it, not the tests."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _COMPILE_EACH], input=json.dumps(cases), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    return run.stdout.splitlines()


def test_grammars_too_deep_to_compile_are_refused_naming_the_field(compiler):
    """llguidance compiles a Lark rule or terminal where another first names it, recursing into it (and into each
    group the name stands in): a chain of 3,000 rules each naming the next (33 KB), or 250 naming the next inside 20
    groups, overflowed the compiling thread's stack, a segfault that took the server with it; so did a `%json` schema
    whose `$ref` chain `MAX_REF_DEPTH` refuses in `json` (it was not checked inside a grammar). Refused naming the
    field (compiled in a subprocess: without the bound it crashes); a chain of 900 rules and real grammars compile."""
    from serve.structured import MAX_GRAMMAR_DEPTH, heaviest_path, lark_parts

    chain = "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(3000)), 'r3000: "a"'])
    grouped = "\n".join(["start: r0", *(f'r{i}: "x" ' + "(" * 20 + f"r{i + 1}" + ")" * 20 for i in range(250)),
                         'r250: "a"'])
    defs = {f"D{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/D{i + 1}"}}} for i in range(1000)}
    embedded = "start: %json " + json.dumps({"$defs": {**defs, "D1000": {"type": "string"}}, "$ref": "#/$defs/D0"})
    lines = _compile_in_a_subprocess([{"grammar": g} for g in (chain, grouped, embedded)])
    assert len(lines) == 3 and all(line.startswith("structured_outputs.grammar: ") for line in lines), lines
    assert all(f"more than {MAX_GRAMMAR_DEPTH} levels deep" in line for line in lines[:2])
    assert "through its $refs" in lines[2]
    compiler.compile(SO(grammar="\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(900)), 'r900: "a"'])))
    # strings, regexes (across lines too) and comments name nothing; a cycle counts each of its rules once
    text = ('start: expr\n?expr: term (("+" | "-") (term))*  // expr "term"\nterm: NUMBER | "(" expr ")" # factor\n'
            'NUMBER: /[0-9]+\nfactor/\nfactor: term\n%ignore " "')
    weights, edges, _ = lark_parts(text)
    assert edges == {"start": ["expr"], "expr": ["term"], "term": ["NUMBER", "expr"], "factor": ["term"]}
    assert weights["expr"] == 3 and heaviest_path(weights, edges) == 1 + 3 + 1 + 1  # start, (expr, term), NUMBER
    compiler.compile(SO(grammar=text))


def test_a_chain_of_definitions_named_by_anchor_or_id_is_bounded_too(compiler):
    """`MAX_REF_DEPTH` followed only `#/pointer` refs: a chain of 1,000 definitions each naming the next by an
    `$anchor` (`"#A1"`) or an `$id` URI (absolute or relative) compiled past it and segfaulted the server as the
    pointer chain had. Such `$ref`s are followed too (each read against the `$id` around it, the one the walk came
    through and the root): refused naming the field (compiled in a subprocess: without the bound it crashes), and a
    chain of 300 of each compiles."""
    from serve.structured import ref_depth

    def chain(n, how):
        names = {"anchor": ("$anchor", "A{}", "#A{}"), "uri": ("$id", "http://x.test/d{}", "http://x.test/d{}"),
                 "relative": ("$id", "d{}.json", "d{}.json")}[how]
        defs = {f"D{i}": {names[0]: names[1].format(i), "type": "object",
                          "properties": {"next": {"$ref": names[2].format(i + 1)}}} for i in range(n)}
        defs[f"D{n}"] = {names[0]: names[1].format(n), "type": "string"}
        return {"$defs": defs, "$ref": names[2].format(0)}

    hows = ("anchor", "uri", "relative")
    assert [ref_depth(chain(300, how)) for how in hows] == [902] * 3
    lines = _compile_in_a_subprocess([{"json": chain(1000, how)} for how in hows])
    assert len(lines) == 3 and all(re.match(r"structured_outputs\.json: .* through its \$refs", line) for line in lines)
    for how in hows:
        compiler.compile(SO(json=chain(300, how)))
    # a pointer inside an `$id` resource is read in it; one reached through `uri#/pointer` is read from the root too
    inner = {"$defs": {"R": {"$id": "http://y.test/r", "$defs": chain(400, "anchor")["$defs"]}},
             "$ref": "http://y.test/r#A0"}
    through = {"$defs": {"D1": chain(400, "uri"), "R": {"$id": "http://y.test/r", "$defs": {
        "D0": {"type": "object", "properties": {"a": {"$ref": "#/$defs/D1"}}}}}}, "$ref": "http://y.test/r#/$defs/D0"}
    assert ref_depth(inner) > 1000 and ref_depth(through) > 1000


def test_ref_depth_walks_each_part_once_below_nested_refs_into_sub_paths(monkeypatch):
    """`ref_depth` walked a part again below every `$ref` that named a part around it: 55 nested properties each
    naming the next by its JSON pointer, over 60,000 small schemas (5 MB), took 23 s (llguidance refuses it in 0.8 s).
    A part walked once from the same base adds its own levels only; one with no `$ref` is not walked: the `$ref`s
    read stay about as many as the schema has (counted, not timed), and the depth is the one walked the long way."""
    import serve.structured as st

    levels, leaves = 55, 1000
    node = {"type": "object", "properties": {"rows": {"anyOf": [{"$ref": "#/$defs/S"} for _ in range(leaves)]}}}
    for i in range(levels, 0, -1):
        node = {"type": "object", "properties": {"next": node, "again": {"$ref": "#" + "/properties/next" * i}}}
    schema = {**node, "$defs": {"S": {"type": "string"}}}
    reads = []
    real = st.ref_targets
    monkeypatch.setattr(st, "ref_targets", lambda *a: reads.append(1) or real(*a))
    assert st.ref_depth(schema) == 3 * levels + 6  # (each level entered through its `$ref` first: 3 levels down)
    assert len(reads) <= 2 * (levels + leaves), len(reads)  # once per `$ref` in each order (it was 115,080)


def test_thousands_of_choices_compile_and_each_output_is_one_of_them(compiler):
    """Each choice was one string rule, all of them items of one Earley row: past 2,000 (3,000 country names) the
    choice was refused as "too complex for the grammar engine". One lexer terminal holds them all: 3,000 compile, an
    output is exactly one of them (one a prefix of another ends there or goes on), quotes and escapes kept."""
    choices = [f'Country "{i}" \\ of {i % 7}' for i in range(3000)] + ["a", "ab", "b\n\u00e9"]
    compiler.compile(SO(choice=choices))
    rng = np.random.default_rng(0)
    for _ in range(4):
        assert TOK.decode([t for t in _walk(compiler, SO(choice=choices), rng) if t not in STOPS]) in choices
    row = np.zeros(mask_words(V), np.int32)
    g = compiler.guide(SO(choice=choices))
    assert g.advance(TOK.encode("a")[0])
    g.fill(row)
    assert set(_allowed(row)) == {TOK.encode("b")[0], *STOPS}  # "a" ends here, or "ab" goes on


def test_one_of_with_overlapping_branches_is_read_as_any_of(compiler):
    """`oneOf` whose branches overlap (an integer is a number too) was refused with llguidance's "Enable
    'coerce_one_of'", an option the API does not have; vLLM's default backend (xgrammar) reads it as `anyOf`."""
    schema = {"type": "object", "properties": {
        "v": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
        "w": {"oneOf": [{"type": "integer"}, {"type": "number"}]}},
        "required": ["v", "w"], "additionalProperties": False}
    for seed in range(3):
        v = json.loads(TOK.decode(_walk(compiler, SO(json=schema, disable_any_whitespace=True),
                                        np.random.default_rng(seed))))
        assert isinstance(v["v"], int) or (isinstance(v["v"], str) and len(v["v"]) <= 3), v
        assert isinstance(v["w"], (int, float)) and not isinstance(v["w"], bool), v


def test_sampling_params_validation():
    with pytest.raises(RequestError, match="temperature"):  # an int past float's range: an error naming it, not
        SamplingParams(temperature=10 ** 400).validate(V)  # math.isfinite's OverflowError
    with pytest.raises(RequestError, match="allowed_token_ids"):
        SamplingParams(structured_outputs=SO(regex="a"), allowed_token_ids=[1]).validate(V)
    with pytest.raises(RequestError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"}).validate(V)
    SamplingParams(structured_outputs=SO(regex="a")).validate(V)
    with pytest.raises(RequestError, match="tokenizer"):
        GrammarCompiler(None, V, STOPS).guide(SO(regex="a"))


def test_bad_words_are_bounded_in_characters_then_tokens():
    """1,000 bad words of ~900 tokens were taken (0.3 s tokenizing on the engine's thread, then ~18 ms a step matching
    them): at most 16,384 characters (checked before tokenizing) and 4,096 tokens in all, 400s naming bad_words;
    a list of 1,000 short words still passes."""
    from types import SimpleNamespace as NS

    from serve.engine import Engine

    with pytest.raises(RequestError, match=r"^bad_words: at most 16384 characters in all, got 18000"):
        SamplingParams(bad_words=["x" * 9000, "y" * 9000]).validate(V)
    words = [f"w{i:04d}" * 2 for i in range(500)]  # 5,000 characters, one byte token each
    SamplingParams(bad_words=words).validate(V)
    with pytest.raises(RequestError, match=r"^bad_words: at most 4096 tokens in all .* got 5000"):
        Engine._bad_word_ids(NS(tokenizer=TOK), words)
    short = [f"{i:03d}" for i in range(1000)]
    SamplingParams(bad_words=short).validate(V)
    assert len(Engine._bad_word_ids(NS(tokenizer=TOK), short)) == 1000


def test_grammars_are_cached(compiler):
    a = compiler.compile(SO(json={"type": "integer"}))
    assert compiler.compile(SO(json={"type": "integer"})) is a
    assert compiler.compile(SO(json={"type": "integer"}, disable_any_whitespace=True)) is not a


def test_a_grammar_past_the_caches_text_cap_stays_cached_until_the_next(compiler, monkeypatch):
    """The cache's text cap evicts the oldest grammars; one grammar longer than the cap alone evicted itself, so
    each guide of an offline request's n samples built its matcher again, on the engine's thread."""
    monkeypatch.setattr("serve.structured._CACHE_TEXT", 0)  # every grammar is past the cap
    big = SO(json={"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(20)}})
    assert compiler.compile(big) is compiler.compile(SO(json=big.json))
    x = compiler.compile(SO(regex="x"))  # the next evicts it
    assert len(compiler._cache) == 1 and compiler.compile(SO(regex="x")) is x


def test_guide_copies_the_matcher_compile_built_instead_of_building_one(monkeypatch):
    """The HTTP server compiles a constraint on a worker thread, then the engine thread takes its guides: building
    a matcher is the expensive part (seconds for a schema of thousands of properties, which stalled every request's
    steps), so the engine's guides copy the one compile built, even once the cache evicted it (a client sending
    many large schemas), and only a constraint never compiled is built there."""
    import llguidance

    built = []

    class Counting:
        def __call__(self, *a, **kw):
            built.append(1)
            return real(*a, **kw)

        def __getattr__(self, name):
            return getattr(real, name)

    real = llguidance.LLMatcher
    monkeypatch.setattr(llguidance, "LLMatcher", Counting())
    gc = GrammarCompiler(TOK, V, STOPS)
    big = SO(json={"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(60)}},
             disable_any_whitespace=True)
    gc.compile(big)
    assert len(built) == 1
    monkeypatch.setattr("serve.structured._CACHE_TEXT", 0)  # every later compile evicts everything
    gc.compile(SO(regex="x"))
    rng = np.random.default_rng(0)
    outs = [TOK.decode([t for t in _walk(gc, big, rng, 2000) if t not in STOPS]) for _ in range(3)]  # (n = 3)
    assert len(built) == 2 and all(json.loads(o).keys() <= {f"p{i}" for i in range(60)} for o in outs)
    _walk(gc, SO(choice=["on"]), rng)
    assert len(built) == 3


def test_cached_grammars_keep_each_schemas_property_order(compiler):
    """Properties are generated in the schema's order (what a chain-of-thought field first relies on): a
    schema listing the same properties in another order must not reuse the first one's cached grammar."""
    props = {"why": {"const": "w"}, "answer": {"const": "a"}}
    for order in (["why", "answer"], ["answer", "why"]):
        schema = {"type": "object", "properties": {k: props[k] for k in order}, "required": ["why", "answer"]}
        out = TOK.decode([t for t in _walk(compiler, SO(json=schema, disable_any_whitespace=True),
                                           np.random.default_rng(0)) if t not in STOPS])
        assert list(json.loads(out)) == order, out


def test_stop_checker_last_flushes_held_text():
    chk = StopChecker(SamplingParams(stop=["ab"]), TOK, STOPS, 100)
    assert chk.append(TOK.encode("x")[0]).text_delta == "x"
    r = chk.append(TOK.encode("a")[0])  # held back: it may start "ab"
    assert r.text_delta == "" and not r.finished
    r = chk.append(TOK.encode("c")[0], last=True)
    assert r.finished and r.finish_reason == "stop" and r.stop_reason is None and chk.text == "xac"


def test_apply_bitmask_matches_llguidance_numpy_reference():
    from llguidance.numpy import apply_token_bitmask_inplace

    rng = np.random.default_rng(0)
    b, v = 5, 333
    logits = rng.standard_normal((b, v)).astype(np.float32)
    mask = rng.integers(-(2 ** 31), 2 ** 31, (b, mask_words(v)), dtype=np.int64).astype(np.int32)
    mask[2] = -1  # an unconstrained row
    want = logits.copy()
    apply_token_bitmask_inplace(want, mask)
    got = np.asarray(jax.jit(apply_bitmask)(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[2], logits[2])


def test_k3_thinking_answer_is_constrained_after_the_markers(tmp_path):
    """A K3 tokenizer (synthetic ranks, the spec's marker ids): the constraint the chat API sets for a
    thinking prompt leaves the reasoning free, lets the model open the response channel with its marker
    tokens, then holds the answer to the choice."""
    from test_tokenizer import K3_SPECIALS, synthetic_ranks, write_tokenizer_dir

    from k3jax.tokenizer import KimiTokenizer
    from serve.reasoning import RESPONSE_START, THINK_END

    tok = KimiTokenizer.from_dir(write_tokenizer_dir(tmp_path, synthetic_ranks(), K3_SPECIALS), family="k3")
    v = tok.vocab_size
    gc = GrammarCompiler(tok, v, tok.eos_token_ids)
    so = SO(choice=["on", "off"], reasoning_end=THINK_END, answer_prefix=RESPONSE_START)
    row = np.zeros(mask_words(v), np.int32)
    allowed = lambda: set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:v]).tolist())
    opener = tok.encode(RESPONSE_START, allow_special=True)
    assert opener[0] == tok.token_to_id("<|open|>")  # the marker is one token
    for answer in ("on", "off"):
        for prefix in (RESPONSE_START, ""):
            g = gc.guide(so)
            for t in tok.encode("the user wants a switch state " + THINK_END, allow_special=True):
                g.fill(row)
                assert (row == -1).all() and g.advance(t)
            g.fill(row)
            assert opener[0] in allowed() and tok.encode("o")[0] in allowed()
            ids = tok.encode(prefix + answer, allow_special=True)
            for k, t in enumerate(ids):
                g.fill(row)
                assert t in allowed() and g.advance(t)
            assert g.done


def test_api_constraint_sources():
    from types import SimpleNamespace

    from serve.api import APIError, _structured
    from serve.reasoning import RESPONSE_START, THINK_END

    def body(**kw):
        base = dict(response_format=None, structured_outputs=None, guided_json=None, guided_regex=None,
                    guided_choice=None, guided_grammar=None, guided_whitespace_pattern=None)
        return SimpleNamespace(**{**base, **kw})

    assert _structured(body(), thinks=True) is None
    so = _structured(body(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}),
                     thinks=True)
    assert so.json == {"type": "integer"} and (so.reasoning_end, so.answer_prefix) == (THINK_END, RESPONSE_START)
    so = _structured(body(guided_regex="a+"), thinks=False)
    assert so.regex == "a+" and so.reasoning_end is None
    assert _structured(body(response_format={"type": "text"}), thinks=False) is None
    assert _structured(body(guided_json={"type": "object"}, guided_whitespace_pattern=" "),
                       thinks=False).whitespace_pattern == " "
    with pytest.raises(APIError, match="guided_whitespace_pattern: applies to a JSON constraint, not to guided_regex"):
        _structured(body(guided_regex="a+", guided_whitespace_pattern=" "), thinks=False)
    # a compile error of the whitespace pattern names the field the client sent
    from serve.api import _constraint_param
    assert _constraint_param(body(guided_json={}, guided_whitespace_pattern="("),
                             "structured_outputs.whitespace_pattern") == "guided_whitespace_pattern"
    assert _constraint_param(body(guided_json={}), "structured_outputs.json") == "guided_json"


def test_schemas_nested_too_deep_are_refused_naming_the_field(compiler):
    """A schema nested past llguidance's parser (124 levels; its message named a line and column) or past
    Python's recursion limit (a dict built by the Python API; it raised RecursionError from the cache key) or
    containing itself: a RequestError naming structured_outputs.json. 124 levels, objects or arrays, compile."""
    from serve.structured import MAX_SCHEMA_DEPTH, schema_depth

    def nested(levels):
        s = {"type": "integer"}
        for _ in range(levels - 1):
            s = {"type": "array", "items": s}
        return s
    assert schema_depth(nested(MAX_SCHEMA_DEPTH)) == MAX_SCHEMA_DEPTH and schema_depth(3) == 0
    compiler.compile(SO(json=nested(MAX_SCHEMA_DEPTH)))
    obj = {"type": "integer"}
    for _ in range((MAX_SCHEMA_DEPTH - 1) // 2):  # two levels each: the schema and its properties map
        obj = {"type": "object", "properties": {"a": obj}, "required": ["a"]}
    compiler.compile(SO(json=obj, answer_prefix="x"))
    looped = {"type": "object", "properties": {}}
    looped["properties"]["self"] = looped
    for schema in (nested(MAX_SCHEMA_DEPTH + 1), nested(5000), json.dumps(nested(MAX_SCHEMA_DEPTH + 1)),
                   "[" * 100000 + "]" * 100000, looped):
        for flag in (False, True):
            with pytest.raises(RequestError, match=r"structured_outputs\.json: the schema nests .* more than 124"):
                compiler.guide(SO(json=schema, disable_additional_properties=flag))


def test_closing_objects_walks_schemas_not_data():
    from serve.structured import _close_objects

    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {}}},
                                               "cfg": {"const": {"properties": 1}},
                                               "rows": {"type": "array", "items": {"properties": {"y": {}}}}},
              "$defs": {"node": {"type": "object", "properties": {"k": {}}}, "free": {"type": "object"},
                        "keyed": {"patternProperties": {"^a": {}}}},
              "additionalProperties": True}
    out = _close_objects(schema)
    assert out["additionalProperties"] is True  # kept as given
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]  # a map of names, not a schema
    assert out["properties"]["cfg"]["const"] == {"properties": 1}  # data
    assert out["properties"]["rows"]["items"]["additionalProperties"] is False
    assert out["$defs"]["node"]["additionalProperties"] is False
    assert out["$defs"]["keyed"]["additionalProperties"] is False
    # vLLM's rule: a schema that declares no properties stays any object (closed, it admitted {} alone)
    assert "additionalProperties" not in out["$defs"]["free"]


def test_closed_objects_keep_free_form_object_fields_open(compiler):
    """disable_additional_properties (vLLM's): declared objects, nested ones included, take no other key; a
    free-form `{"type": "object"}` field takes any object, as without the flag."""
    schema = {"type": "object", "properties": {"meta": {"type": "object"},
                                               "pos": {"type": "object", "properties": {"x": {"type": "integer"}}}},
              "required": ["meta", "pos"]}
    row = np.zeros(mask_words(V), np.int32)

    def accepts(text):
        g = compiler.guide(SO(json=schema, disable_any_whitespace=True, disable_additional_properties=True))
        for tok in TOK.encode(text):
            g.fill(row)
            if tok not in _allowed(row) or not g.advance(tok):
                return False
        return g.done or (g.fill(row), STOPS[0] in _allowed(row))[1]
    assert accepts('{"meta":{"k":[1,2],"z":null},"pos":{"x":3}}')
    assert not accepts('{"meta":{},"pos":{"x":3,"y":4}}')
    assert not accepts('{"meta":{},"pos":{"x":3},"extra":1}')


def test_fill_masks_in_parallel_equals_one_by_one(compiler):
    from serve.structured import fill_masks

    rng = np.random.default_rng(5)
    guides = [compiler.guide(SO(json=SCHEMA)) for _ in range(5)] + [compiler.guide(SO(regex="[a-z]+"))]
    for g in guides:  # advance each to a different point of its language
        row = np.zeros(mask_words(V), np.int32)
        for _ in range(int(rng.integers(0, 12))):
            g.fill(row)
            if g.done:
                break
            assert g.advance(int(rng.choice(_allowed(row))))
    waiting = compiler.guide(SO(choice=["a"], reasoning_end="</think>"))
    batch = np.zeros((9, mask_words(V)), np.int32)
    fill_masks([(g, i + 1) for i, g in enumerate(guides)] + [(waiting, 8)], batch)
    for i, g in enumerate(guides):
        one = np.zeros(mask_words(V), np.int32)
        g.fill(one)
        np.testing.assert_array_equal(batch[i + 1], one)
    assert (batch[0] == 0).all() and (batch[7] == 0).all() and (batch[8] == -1).all()


@pytest.mark.parametrize("params, prefix, drafts", [
    (SO(regex="ab"), "a", "b"),  # "b" completes the grammar: nothing may follow
    (SO(choice=["alpha", "beta"]), "be", "ta"),
    (SO(json={"type": "object"}, disable_any_whitespace=True), "{", "}"),
])
def test_drafts_past_the_end_of_the_grammar_leave_the_guide_where_it_was(compiler, params, prefix, drafts):
    """Speculative decoding drafts what followed earlier (an n-gram of the prompt, a finished response): the drafts
    that complete the grammar may be followed by a stop token, which the matcher accepts without recording. The
    masks must leave the guide where it was, or the tokens landing next break the constraint."""
    g = compiler.guide(params)
    for tok in TOK.encode(prefix):
        assert g.advance(tok)
    before = np.zeros(mask_words(V), np.int32)
    g.fill(before)
    draft = TOK.encode(drafts) + [STOPS[0]]
    n = g.matcher.validate_tokens(draft)
    assert n >= len(draft) - 1
    rows = np.zeros((len(draft), mask_words(V)), np.int32)
    g.fill_drafts(draft[:n], rows[:n])
    after = np.zeros(mask_words(V), np.int32)
    g.fill(after)
    np.testing.assert_array_equal(after, before)
    for tok in TOK.encode(drafts):
        assert g.advance(tok), g.error
    assert g.done
