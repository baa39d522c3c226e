"""Function calling (serve/tools.py) through the real HTTP app with a scripted engine: the engine writes a
given answer token by token, and every token must pass the request's constraint (serve/structured.py
masks), so the constraints built for `tool_choice` are checked together with the response shapes
(whole and streamed). Random walks under the `required` constraint always parse as valid calls."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from k3jax.tokenizer import ByteTokenizer
from serve.api import create_app
from serve.structured import GrammarCompiler, mask_words
from serve.tools import CallStream, history_message, parse_calls, plan_tools
from serve.types import CompletionOutput, RequestError, RequestOutput, RequestOutputKind

TOK = ByteTokenizer(320)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather now", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["paris", "rome"]}, "days": {"type": "integer",
                                                                                     "minimum": 1, "maximum": 7}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}},
]


class ScriptedEngine:
    """Answers each request with the next scripted text, token by token, checking each token against the
    request's constraint; records the prompts and params it saw."""

    def __init__(self):
        self.grammars = GrammarCompiler(TOK, 320, TOK.eos_token_ids)
        self.engine = SimpleNamespace(
            tokenizer=TOK, cfg=SimpleNamespace(vocab_size=320, family="byte"),
            config=SimpleNamespace(max_model_len=4096, max_logprobs=5, max_num_seqs=8), decode_buckets=(8,))
        self.script: list[str] = []
        self.seen: list[tuple[list[int], object]] = []
        self.rejected = 0

    def stats(self) -> dict:
        return {}

    async def generate(self, prompt, params, request_id=None, priority=0, on_accept=None):
        self.seen.append((list(prompt), params))
        text = self.script.pop(0)
        guide = self.grammars.guide(params.structured_outputs) if params.structured_outputs else None
        row = np.zeros(mask_words(320), np.int32)
        ids: list[int] = []
        for k, tok in enumerate(TOK.encode(text)):
            if guide is not None:
                guide.fill(row)
                if not (row[tok >> 5] >> (tok & 31)) & 1:
                    self.rejected += 1
                    raise RequestError(f"scripted token {k} ({TOK.decode([tok])!r}) is outside the constraint")
                assert guide.advance(tok)
            ids.append(tok)
            cut = params.max_tokens is not None and len(ids) >= params.max_tokens
            done = k == len(TOK.encode(text)) - 1 or cut
            if done and guide is not None and not cut:
                assert guide.done, "the scripted answer must complete the constraint"
            finish = ("length" if cut else "stop") if done else None
            if params.output_kind == RequestOutputKind.DELTA:  # what the server asks of the engine
                new = TOK.decode(ids)[len(TOK.decode(ids[:-1])):]
                out = CompletionOutput(0, new, [tok], finish)
            else:
                out = CompletionOutput(0, TOK.decode(ids), list(ids), finish)
            yield RequestOutput(request_id, None, list(prompt), [out], finished=done)
            await asyncio.sleep(0)


def _client(engine):
    app = create_app(None, "m")
    app.state.k3.attach(engine)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def _chat(engine, script, **body):
    engine.script = list(script)

    async def go():
        async with _client(engine) as c:
            req = {"messages": [{"role": "user", "content": "weather in paris?"}], "tools": TOOLS, **body}
            if body.get("stream"):
                chunks = []
                async with c.stream("POST", "/v1/chat/completions", json=req) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            chunks.append(json.loads(line[6:]))
                return r.status_code, chunks
            r = await c.post("/v1/chat/completions", json=req)
            return r.status_code, r.json()

    return asyncio.run(go())


def test_required_tool_choice_constrains_and_returns_tool_calls():
    eng = ScriptedEngine()
    answer = '[{"name":"get_weather","parameters":{"city":"paris","days":3}},{"name":"add","parameters":{"a":1,"b":2}}]'
    status, r = _chat(eng, [answer], tool_choice="required")
    assert status == 200, r
    ch = r["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None
    calls = ch["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "paris", "days": 3}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    prompt = TOK.decode(eng.seen[0][0])
    assert "# Tools" in prompt and '"name": "get_weather"' in prompt and "weather in paris?" in prompt
    # answers outside the functions' schemas are rejected token by token
    for bad in ('[{"name":"get_weather","parameters":{"city":"oslo"}}]',  # not in the enum
                '[{"name":"delete_all","parameters":{}}]',  # not a listed function
                '[]', '{"city":"paris"}'):
        status, r = _chat(ScriptedEngine(), [bad], tool_choice="required")
        assert status == 400 and "outside the constraint" in r["error"]["message"], (bad, r)
    status, r = _chat(ScriptedEngine(), [answer], tool_choice="required", parallel_tool_calls=False)
    assert status == 400  # a second call is not allowed


def test_named_tool_choice_streams_one_call():
    eng = ScriptedEngine()
    status, chunks = _chat(eng, ['{"a":5,"b":-2}'], stream=True,
                           tool_choice={"type": "function", "function": {"name": "add"}})
    assert status == 200
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks if c["choices"])
    calls = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert len(calls) > 3 and all(c["index"] == 0 for c in calls)  # the arguments stream as they come
    assert calls[0]["function"]["name"] == "add" and calls[0]["id"].startswith("call_")
    assert all("id" not in c and "name" not in c["function"] for c in calls[1:])
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"a": 5, "b": -2}
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "Call the function add" in TOK.decode(eng.seen[0][0])


def _calls_from(deltas):
    """Streamed tool_call deltas -> [(name, arguments text)], checking each call's first delta carries its
    id and name and no later one does."""
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {})
        if "id" in d:
            assert not c and d["id"].startswith("call_") and d["type"] == "function"
            c.update(name=d["function"]["name"], args="")
        else:
            assert c and "name" not in d["function"], "arguments before the call's header"
        c["args"] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [(c["name"], c["args"]) for _, c in sorted(calls.items())]


def test_required_calls_stream_as_they_are_written():
    answer = '[{"name":"get_weather","parameters":{"city":"paris","days":3}},{"name":"add","parameters":{"a":10,"b":2}}]'
    status, chunks = _chat(ScriptedEngine(), [answer], stream=True, tool_choice="required")
    assert status == 200
    deltas = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert len(deltas) > 6  # not one whole call per chunk at the end
    got = _calls_from(deltas)
    assert [(n, json.loads(a)) for n, a in got] == [("get_weather", {"city": "paris", "days": 3}),
                                                    ("add", {"a": 10, "b": 2})]
    first_args = next(i for i, c in enumerate(chunks) if c["choices"] and any(
        d.get("function", {}).get("arguments") for d in c["choices"][0]["delta"].get("tool_calls", [])))
    assert first_args < len(chunks) - 3, "arguments should start streaming before the answer is complete"
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks if c["choices"])
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    status, whole = _chat(ScriptedEngine(), [answer], tool_choice="required")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in whole["choices"][0]["message"]["tool_calls"]] == [(n, json.loads(a)) for n, a in got]



@pytest.mark.parametrize("choice, answer, want", [
    ({"type": "function", "function": {"name": "add"}}, '{"a":5,"b":-2}', [("add", '{"a":5,"b":-2}')]),
    ("required", '[{"name":"add","parameters":{"a":1, "b":2}},{"name":"get_weather","parameters":{"city":"paris"}}]',
     [("add", '{"a":1, "b":2}'), ("get_weather", '{"city":"paris"}')])])
def test_forced_calls_read_the_same_whole_and_streamed(choice, answer, want):
    """A forced call's arguments are the text the model wrote, whole as streamed (vLLM's named call: the content as
    is); the whole response re-serialised them (`{"a": 5, "b": -2}`), unlike what the stream had sent."""
    status, chunks = _chat(ScriptedEngine(), [answer], stream=True, tool_choice=choice)
    deltas = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert status == 200 and _calls_from(deltas) == want
    status, r = _chat(ScriptedEngine(), [answer], tool_choice=choice)
    assert status == 200, r
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in r["choices"][0]["message"]["tool_calls"]] \
        == want

@pytest.mark.parametrize("choice, answer, max_tokens, want", [
    ({"type": "function", "function": {"name": "add"}}, '{"a":5,"b":-2}', 6, [("add", '{"a":5')]),
    ("required", '[{"name":"add","parameters":{"a":1,"b":2}},{"name":"get_weather","parameters":{}}]', 66,
     [("add", '{"a":1,"b":2}'), ("get_weather", "")]),
    ("required", '[{"name":"add","parameters":{"a":1,"b":2}}]', 5, [])])
def test_forced_calls_cut_by_max_tokens_read_the_same_whole_and_streamed(choice, answer, max_tokens, want):
    """A forced call cut short streams as tool_calls (it cannot take them back): the whole response gives the
    same calls, not the JSON fragment as content; finish_reason "length" both ways."""
    status, chunks = _chat(ScriptedEngine(), [answer], stream=True, tool_choice=choice, max_tokens=max_tokens)
    deltas = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert status == 200 and _calls_from(deltas) == want
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks if c["choices"])
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    status, r = _chat(ScriptedEngine(), [answer], tool_choice=choice, max_tokens=max_tokens)
    m = r["choices"][0]["message"]
    assert status == 200 and r["choices"][0]["finish_reason"] == "length" and m["content"] is None, r
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]] == want


def test_call_arguments_stay_strict_json_with_huge_numbers_and_nan():
    """A number past a float's range is valid JSON and the constraint allows it: the arguments must not come
    back re-serialised as `Infinity`; an unconstrained `auto` answer with NaN is not JSON, so not a call."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}}]
    strict = lambda s: json.loads(s, parse_constant=lambda c: pytest.fail(f"{c} in {s}"))
    for choice, answer in (("required", '[{"name":"f","parameters":{"x":1e999}}]'),
                           ({"type": "function", "function": {"name": "f"}}, '{"x":-1E400}')):
        status, r = _chat(ScriptedEngine(), [answer], tools=tools, tool_choice=choice)
        (call,) = r["choices"][0]["message"]["tool_calls"]
        assert status == 200 and call["function"]["name"] == "f" and strict(call["function"]["arguments"])
    status, r = _chat(ScriptedEngine(), ['[{"name": "f", "parameters": {"x": NaN}}]'], tools=tools)
    assert r["choices"][0]["message"]["tool_calls"] == [] and r["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("text", [
    '[{"name":"get_weather","parameters":{"city":"paris","days":3}},{"name":"add","parameters":{"a":1,"b":2}}]',
    '[ { "name" : "a\\"b" , "parameters" : { "x" : "}{,\\"]" , "y" : [1, {"z": "]"}] } } ]',
    '[{"parameters":{"k":[1,2]},"name":"late"},{"name":"n","parameters":{}}]'])
def test_call_stream_reads_calls_split_anywhere(text):
    rng = np.random.default_rng(0)
    for _ in range(25):
        cs, deltas, i = CallStream(), [], 0
        while i < len(text):
            n = int(rng.integers(1, 8))
            deltas += cs.feed(text[i:i + n])
            i += n
        got = _calls_from(deltas)
        assert [(n, json.loads(a)) for n, a in got] == [(c["name"], c["parameters"]) for c in json.loads(text)]


def test_auto_returns_calls_or_text_and_streams_text_at_once():
    eng = ScriptedEngine()
    status, r = _chat(eng, ['[{"name": "add", "parameters": {"a": 1, "b": 1}}]'])
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    assert eng.seen[0][1].structured_outputs is None  # auto does not constrain
    status, r = _chat(eng, ["It is sunny."])
    assert r["choices"][0]["message"]["content"] == "It is sunny." and r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["message"]["tool_calls"] == []
    status, chunks = _chat(eng, ["Sunny [really]."], stream=True, tool_choice="auto")
    texts = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert "".join(t or "" for t in texts) == "Sunny [really]."
    assert sum(1 for t in texts if t) > 3  # streamed as it came, not held to the end
    status, chunks = _chat(eng, ['[{"name": "add", "parameters": {"a": 1, "b": 1}}]'], stream=True)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks if c["choices"])


K2_CALLS = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
            '{"city": "paris"}<|tool_call_end|><|tool_call_begin|> functions.add:1 <|tool_call_argument_begin|>'
            '{"a": 1, "b": 2}<|tool_call_end|><|tool_calls_section_end|>')


def _k2_calls(calls):
    return [(c["id"], c["type"], c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("before", ["", "Let me look it up."])
def test_auto_reads_kimi_k2_format_calls_whole_and_streamed(before):
    """Kimi-Linear is trained to call tools in Kimi-K2's own format (section and call markers, `functions.NAME:IDX`
    ids); with tool_choice auto such an answer is read as vLLM's kimi_k2 parser reads it: the calls (their K2 ids,
    the name after the dot, the arguments as written), the text before the section as content, whole and streamed
    (the markers never reach the content, even split across deltas). It came back as text, markers and all."""
    want = [("functions.get_weather:0", "function", "get_weather", '{"city": "paris"}'),
            ("functions.add:1", "function", "add", '{"a": 1, "b": 2}')]
    status, r = _chat(ScriptedEngine(), [before + K2_CALLS])
    ch = r["choices"][0]
    assert status == 200 and ch["finish_reason"] == "tool_calls", r
    assert ch["message"]["content"] == (before or None) and _k2_calls(ch["message"]["tool_calls"]) == want
    status, chunks = _chat(ScriptedEngine(), [before + K2_CALLS], stream=True)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["delta"].get("content") or "" for c in choices) == before
    if before:
        assert sum(1 for c in choices if c["delta"].get("content")) > 3  # the text streamed as it came
    deltas = [tc for c in choices for tc in c["delta"].get("tool_calls", [])]
    assert [d["index"] for d in deltas] == [0, 1] and _k2_calls(deltas) == want
    assert choices[-1]["finish_reason"] == "tool_calls"
    status, r = _chat(ScriptedEngine(), [before + K2_CALLS], parallel_tool_calls=False)
    assert _k2_calls(r["choices"][0]["message"]["tool_calls"]) == want[:1]


def test_k2_calls_written_as_kimi_linear_special_tokens_are_read(tmp_path):
    """A Kimi-Linear checkpoint's tokenizer_config marks the K2 tool-call markers `special: true`: the answer's text
    kept them only with skip_special_tokens false, so with tools the server asks for that (as vLLM's kimi_k2 parser
    does). The engine dropped them (the default) and the calls came back as content without their markers."""
    from test_tokenizer import KL_SPECIALS, synthetic_ranks, write_tokenizer_dir

    from k3jax.tokenizer import KimiTokenizer

    markers = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
               "<|tool_call_argument_begin|>", "<|tool_call_end|>")
    specials = {**KL_SPECIALS, **{11 + k: (m, True) for k, m in enumerate(markers)}}
    kl = KimiTokenizer.from_dir(write_tokenizer_dir(tmp_path, synthetic_ranks(), specials), family="kimi_linear")
    ids = kl.encode("Let me see." + K2_CALLS, allow_special=True)
    assert all(kl.is_special(kl.token_to_id(m)) for m in markers)

    class Writer(ScriptedEngine):
        async def generate(self, prompt, params, request_id=None, priority=0, on_accept=None):
            text = lambda n: kl.decode(ids[:n], skip_special=params.skip_special_tokens)  # noqa: E731 (the engine's)
            for k, tok in enumerate(ids):
                done = k == len(ids) - 1
                yield RequestOutput(request_id, None, list(prompt), [CompletionOutput(
                    0, text(k + 1)[len(text(k)):], [tok], "stop" if done else None)], done)

    eng = Writer()
    eng.engine.tokenizer = kl
    want = [("functions.get_weather:0", "function", "get_weather", '{"city": "paris"}'),
            ("functions.add:1", "function", "add", '{"a": 1, "b": 2}')]
    status, r = _chat(eng, [])
    assert status == 200 and r["choices"][0]["finish_reason"] == "tool_calls", r
    assert r["choices"][0]["message"]["content"] == "Let me see."
    assert _k2_calls(r["choices"][0]["message"]["tool_calls"]) == want
    status, chunks = _chat(eng, [], stream=True)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["delta"].get("content") or "" for c in choices) == "Let me see."
    assert _k2_calls([tc for c in choices for tc in c["delta"].get("tool_calls", [])]) == want


def test_auto_k2_section_without_a_whole_call_stays_text():
    """A K2 section marker with no complete call after it (cut short, or text that merely names the marker) is no
    call: the whole answer is content, streamed too (a held tail that turns out not to be a marker is sent)."""
    for answer in ("See <|tool_calls_section_begin|><|tool_call_begin|>functions.add:0", "a <|tool_ typo"):
        status, r = _chat(ScriptedEngine(), [answer])
        assert r["choices"][0]["message"] == {"role": "assistant", "content": answer, "tool_calls": []}, r
        status, chunks = _chat(ScriptedEngine(), [answer], stream=True)
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        assert "".join(c["delta"].get("content") or "" for c in choices) == answer
        assert choices[-1]["finish_reason"] == "stop" and not any("tool_calls" in c["delta"] for c in choices)


def test_auto_calls_without_parallel_tool_calls_keep_the_first():
    """parallel_tool_calls false (vLLM's): an unconstrained `auto` answer with several calls returns the first
    only, whole and streamed."""
    answer = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "get_weather", "parameters": {"city": "x"}}]'
    status, r = _chat(ScriptedEngine(), [answer], parallel_tool_calls=False)
    calls = r["choices"][0]["message"]["tool_calls"]
    assert status == 200 and [c["function"]["name"] for c in calls] == ["add"]
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    status, chunks = _chat(ScriptedEngine(), [answer], stream=True, parallel_tool_calls=False)
    deltas = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert _calls_from(deltas) == [("add", '{"a": 1, "b": 2}')]
    status, r = _chat(ScriptedEngine(), [answer])  # (parallel calls by default)
    assert len(r["choices"][0]["message"]["tool_calls"]) == 2


def test_tool_history_and_none():
    eng = ScriptedEngine()
    msgs = [{"role": "user", "content": "add 1 and 2"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    status, r = _chat(eng, ["3."], messages=msgs)
    assert status == 200, r
    prompt = TOK.decode(eng.seen[0][0])
    assert '[{"name": "add", "parameters": {"a": 1, "b": 2}}]' in prompt and "## Return of call_1\n3" in prompt
    status, r = _chat(eng, ["fine"], tool_choice="none")
    assert status == 200 and "# Tools" not in TOK.decode(eng.seen[1][0])


@pytest.mark.parametrize("tools, choice, field", [
    ([{"type": "function", "function": {"name": ""}}], None, "tools"),
    ([{"type": "retrieval"}], None, "tools"),
    (TOOLS + TOOLS[:1], None, "tools"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function", "function": "add"}, "tool_choice"),  # (a 500: str has no .get)
    ([{"type": "function", "function": {"name": "a", "description": 5}}], None, "tools"),  # (vLLM's: a string)
    (None, "required", "tool_choice"),
])
def test_bad_tools_are_400_naming_the_field(tools, choice, field):
    eng = ScriptedEngine()

    async def go():
        async with _client(eng) as c:
            body = {"messages": [{"role": "user", "content": "x"}], "tools": tools}
            if choice is not None:
                body["tool_choice"] = choice
            return await c.post("/v1/chat/completions", json=body)

    r = asyncio.run(go())
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    with pytest.raises(RequestError, match=field):
        plan_tools(tools, choice, None)


def test_tools_with_parameters_missing_empty_or_null():
    """A function's `parameters` may be left out, `{}` or null (vLLM's FunctionDefinition; the Responses API's
    FunctionTool sends null): each takes any object; null was a 400."""
    tools = [{"type": "function", "function": {"name": "a"}},
             {"type": "function", "function": {"name": "b", "parameters": {}}},
             {"type": "function", "function": {"name": "c", "parameters": None, "description": None}}]
    for name in "abc":
        eng = ScriptedEngine()
        status, r = _chat(eng, ['{"x":1}'], tools=tools, tool_choice={"type": "function", "function": {"name": name}})
        assert status == 200, r
        assert r["choices"][0]["message"]["tool_calls"][0]["function"] == {"name": name, "arguments": '{"x":1}'}
    assert TOK.decode(eng.seen[0][0]).count('"parameters": {"type": "object"}') == 3
    eng = ScriptedEngine()
    eng.script = ['[{"name":"c","parameters":{}}]']
    r = _sdk(eng, lambda c: c.responses.create(model="m", input="x", tool_choice="required", tools=[
        {"type": "function", "name": "c", "parameters": None, "strict": None}]))
    assert r.output[0].type == "function_call" and r.output[0].name == "c"


def test_required_constraint_random_walks_parse_as_valid_calls():
    gc = GrammarCompiler(TOK, 320, TOK.eos_token_ids)
    plan = plan_tools(TOOLS, "required", None)
    row = np.zeros(mask_words(320), np.int32)
    for seed in range(8):
        rng = np.random.default_rng(seed)
        g, out = gc.guide(plan.constraint()), []
        while not g.done:
            g.fill(row)
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
            # bias towards closing brackets so the walk ends
            pref = [t for t in allowed if chr(t) in '"]}'] if rng.random() < 0.5 else []
            out.append(int(rng.choice(pref or allowed)))
            assert g.advance(out[-1]) and len(out) < 2000
        calls = parse_calls(plan, TOK.decode(out))
        assert calls, TOK.decode(out)
        for c in calls:
            args = json.loads(c["function"]["arguments"])
            if c["function"]["name"] == "get_weather":
                assert args["city"] in ("paris", "rome") and set(args) <= {"city", "days"}
            else:
                assert set(args) == {"a", "b"} and all(type(v) is int for v in args.values())


def test_required_calls_resolve_each_functions_own_refs():
    """Parameters with local `$ref`s (pydantic's `$defs`, a tree's `"#"`), placed inside the `required` array's
    schema, still point into their own function's schema: the constraint compiled ("Pointer '/$defs/Item' does
    not exist", a 400 naming tools), and two functions may reuse a def name for different schemas."""
    def fn(name, params):
        return {"type": "function", "function": {"name": name, "parameters": params}}
    item = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"],
            "additionalProperties": False}
    tools = [fn("add", {"$defs": {"Item": item}, "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}},
                        "required": ["item"], "additionalProperties": False}),
             fn("tag", {"$defs": {"Item": {"enum": ["x", "y"]}}, "type": "object",
                        "properties": {"item": {"$ref": "#/$defs/Item"}, "sub": {"$ref": "#"},
                                       "const": {"const": {"$ref": "#/literal"}}},
                        "required": ["item"], "additionalProperties": False})]
    gc = GrammarCompiler(TOK, 320, TOK.eos_token_ids)
    row = np.zeros(mask_words(320), np.int32)

    def accepts(text):
        g = gc.guide(plan_tools(tools, "required", None).constraint())
        for tok in TOK.encode(text):
            g.fill(row)
            if not (row.view(np.uint32)[tok >> 5] >> (tok & 31)) & 1 or not g.advance(tok):
                return False
        return g.done
    assert accepts('[{"name":"add","parameters":{"item":{"k":1}}},'
                   '{"name":"tag","parameters":{"item":"x","sub":{"item":"y","const":{"$ref":"#/literal"}}}}]')
    assert not accepts('[{"name":"add","parameters":{"item":"x"}}]')  # tag's Item, not add's
    assert not accepts('[{"name":"tag","parameters":{"item":{"k":1}}}]')


def test_required_calls_keep_the_refs_of_a_schema_with_its_own_id():
    """A schema with an `$id` (its own, or a sub-schema's) is a resource: its local refs resolve against that `$id`
    wherever it is placed. Rebased into the `required` array they pointed past its root ("Pointer
    '/items/anyOf/0/properties/parameters/$defs/Item' does not exist", a 400), which named tool_choice and each
    schema alone compiled."""
    item = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"],
            "additionalProperties": False}
    own = {"$id": "https://example.com/add.json", "$defs": {"Item": item}, "type": "object",
           "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"], "additionalProperties": False}
    inner = {"type": "object", "properties": {"item": {**own, "$id": "https://example.com/inner.json"},
                                              "n": {"$ref": "#/$defs/N"}},
             "$defs": {"N": {"type": "integer"}}, "required": ["item", "n"], "additionalProperties": False}
    gc = GrammarCompiler(TOK, 320, TOK.eos_token_ids)
    row = np.zeros(mask_words(320), np.int32)
    for params, text in ((own, '{"item":{"k":1}}'), (inner, '{"item":{"item":{"k":1}},"n":2}')):
        tools = [{"type": "function", "function": {"name": "add", "parameters": params}}]
        g = gc.guide(plan_tools(tools, "required", None).constraint())
        for tok in TOK.encode(f'[{{"name":"add","parameters":{text}}}]'):
            g.fill(row)
            assert (row.view(np.uint32)[tok >> 5] >> (tok & 31)) & 1 and g.advance(tok)
        assert g.done


def test_history_keeps_assistant_text_parts_beside_calls():
    """An assistant message whose content is a list of text parts keeps that text beside its calls, as a string
    content does (the parts were dropped: the model saw only the calls)."""
    eng = ScriptedEngine()
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    for content in ("Let me add.", [{"type": "text", "text": "Let me "}, {"type": "text", "text": "add."}]):
        msgs = [{"role": "user", "content": "add 1 and 2"}, {"role": "assistant", "content": content,
                                                            "tool_calls": [call]}]
        status, r = _chat(eng, ["ok"], messages=msgs)
        assert status == 200, r
        assert 'Let me add.\n[{"name": "add", "parameters": {"a": 1, "b": 2}}]' in TOK.decode(eng.seen[-1][0])


def test_history_message_rejects_bad_calls():
    with pytest.raises(RequestError, match=r"^messages\.tool_calls\[0\]: function\.arguments is not JSON"):
        history_message({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]})
    # nested past the interpreter's recursion limit: a RecursionError (a 500) from the history, and from an answer
    deep = "[" * 100000 + "]" * 100000
    with pytest.raises(RequestError, match=r"^messages\.tool_calls\[0\]: function\.arguments nests .* too deeply"):
        history_message({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": deep}}]})
    assert parse_calls(plan_tools(TOOLS, "auto", None), deep) is None
    assert history_message({"role": "user", "content": "x"}) == {"role": "user", "content": "x"}


@pytest.mark.parametrize("call, field", [
    ({"function": {"name": "add", "arguments": "{"}}, "messages[2].tool_calls[1]: function.arguments is not JSON"),
    ({"function": {"name": "add", "arguments": {"a": 1}}}, "messages[2].tool_calls[1]: function.arguments must be"),
    ({"function": {"arguments": "{}"}}, "messages[2].tool_calls[1]: must be"),
])
def test_bad_history_tool_calls_are_400_naming_the_message(call, field):
    """A malformed tool call in the history names its message and call by index, as every other message field's
    error does (it said `messages: tool_calls[1]...`, leaving the client to guess which message)."""
    good = {"id": "c0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    msgs = [{"role": "user", "content": "add"}, {"role": "user", "content": "twice"},
            {"role": "assistant", "content": None, "tool_calls": [good, call]}, {"role": "tool", "content": "3"}]
    status, r = _chat(ScriptedEngine(), ["ok"], messages=msgs)
    assert status == 400 and r["error"]["message"].startswith(field), r
    assert r["error"]["param"] == "messages"


def test_k3_tool_results_render_as_system_messages_with_the_k2_header():
    from serve.chat import prepare_messages

    msgs = [{"role": "user", "content": "add"},
            {"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "tool_call_id": "call_7", "content": [{"type": "text", "text": "3"}]},
            {"role": "developer", "content": "be brief"}]
    out = prepare_messages(msgs, "k3", plan_tools(TOOLS, "auto", None))
    assert out[0]["role"] == "system" and out[0]["content"].startswith("# Tools")
    assert out[2] == {"role": "assistant", "content": '[{"name": "add", "parameters": {"a": 1}}]'}
    assert out[3] == {"role": "system", "content": "## Return of call_7\n3"}
    assert out[4]["role"] == "system"
    assert prepare_messages(msgs[2:3], "kimi_linear")[0]["role"] == "tool"  # that format has its own



def test_tools_keep_the_kimi_default_system_prompt(monkeypatch):
    """The tools' system message must not stand in for the K2-style default system prompt."""
    import serve.chat as chat
    from k3jax.chat_template import KIMI_DEFAULT_SYSTEM_PROMPT

    seen = []
    monkeypatch.setattr(chat, "encode_chat", lambda tok, msgs, **kw: seen.append(msgs) or [1])
    plan = plan_tools(TOOLS, "auto", None)
    chat.chat_ids(object(), "kimi_linear", [{"role": "user", "content": "hi"}], tools=plan)
    assert [m["content"][:7] for m in seen[-1]] == [KIMI_DEFAULT_SYSTEM_PROMPT[:7], "# Tools", "hi"]
    chat.chat_ids(object(), "kimi_linear", [{"role": "user", "content": "hi"}], tools=plan,
                  template_kwargs={"default_system": None})
    assert [m["role"] for m in seen[-1]] == ["system", "user"]
    chat.chat_ids(object(), "kimi_linear", [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}],
                  tools=plan)
    assert [m["content"][:7] for m in seen[-1]] == ["S", "# Tools", "hi"]
    chat.chat_ids(object(), "k3", [{"role": "user", "content": "hi"}], tools=plan)  # K3: no default
    assert [m["role"] for m in seen[-1]] == ["system", "user"]

# ---- the Responses API (serve/responses.py), parsed by the OpenAI SDK ----------------------------------

def _sdk(engine, fn):
    import openai

    async def go():
        async with _client(engine) as http:
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http)
            return await fn(client)
    return asyncio.run(go())


def test_responses_text_whole_and_streamed():
    eng = ScriptedEngine()
    eng.script = ["Sunny, 21C.", "Sunny, 21C."]
    r = _sdk(eng, lambda c: c.responses.create(model="m", input="weather?", instructions="be brief"))
    assert r.status == "completed" and r.output_text == "Sunny, 21C." and r.output[0].type == "message"
    assert r.usage.output_tokens == len("Sunny, 21C.") and r.usage.input_tokens == len(eng.seen[0][0])
    prompt = TOK.decode(eng.seen[0][0])
    assert "be brief" in prompt and "weather?" in prompt

    async def stream(c):
        return [e async for e in await c.responses.create(model="m", input="weather?", stream=True)]
    events = _sdk(eng, stream)
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Sunny, 21C."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == "Sunny, 21C."


def test_responses_function_calls_history_and_formats():
    eng = ScriptedEngine()
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    eng.script = ['[{"name":"add","parameters":{"a":2,"b":3}}]']
    r = _sdk(eng, lambda c: c.responses.create(model="m", input="add 2 and 3", tools=flat, tool_choice="required"))
    call = r.output[0]
    assert call.type == "function_call" and call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 3}
    # the call and its result go back as input items
    eng.script = ["5."]
    items = [{"role": "user", "content": "add 2 and 3"},
             {"type": "function_call", "call_id": call.call_id, "name": "add", "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
    r = _sdk(eng, lambda c: c.responses.create(model="m", input=items, tools=flat))
    assert r.output_text == "5."
    prompt = TOK.decode(eng.seen[-1][0])
    assert '"name": "add", "parameters": {"a": 2, "b": 3}' in prompt and f"## Return of {call.call_id}\n5" in prompt

    async def stream(c):
        return [e async for e in await c.responses.create(
            model="m", input="add", tools=flat, tool_choice={"type": "function", "name": "add"}, stream=True)]
    eng.script = ['{"a":1,"b":1}']
    events = _sdk(eng, stream)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(args) == {"a": 1, "b": 1} and done[0].arguments == args
    assert events[-1].response.output[0].name == "add"
    # text.format json_schema is the constraint; max_output_tokens cuts: incomplete
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    eng.script = ['{"x":12}', "a long answer"]
    r = _sdk(eng, lambda c: c.responses.create(model="m", input="j", text={"format": {
        "type": "json_schema", "name": "s", "schema": schema}}))
    assert json.loads(r.output_text) == {"x": 12} and eng.seen[-1][1].structured_outputs.json == schema
    r = _sdk(eng, lambda c: c.responses.create(model="m", input="j", max_output_tokens=4))
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_responses_k2_calls_keep_the_text_before_them_whole_and_streamed():
    """A Kimi-K2-format answer's text before its calls is a message item ahead of the function_call items, in the
    whole response as in the stream (the whole one dropped a message beside calls)."""
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    eng = ScriptedEngine()
    eng.script = ["Adding." + K2_CALLS]
    r = _sdk(eng, lambda c: c.responses.create(model="m", input="add", tools=flat))
    assert [it.type for it in r.output] == ["message", "function_call", "function_call"]
    assert r.output_text == "Adding." and r.output[2].call_id == "functions.add:1"

    async def stream(c):
        return [e async for e in await c.responses.create(model="m", input="add", tools=flat, stream=True)]
    eng.script = ["Adding." + K2_CALLS]
    final = _sdk(eng, stream)[-1].response
    assert [it.type for it in final.output] == [it.type for it in r.output] and final.output_text == "Adding."
    assert [(it.name, it.arguments) for it in final.output[1:]] == [(it.name, it.arguments) for it in r.output[1:]]


def test_responses_echo_the_requests_fields_as_openai_does():
    """The response object (whole, and every lifecycle event's) carries OpenAI's fields for what the request set:
    `truncation`, `user`, `top_logprobs` and `background` were missing, `temperature` / `top_p` were null when the
    request left them to the defaults (OpenAI's and vLLM's objects give the values sampled with), and a `text`
    without a format lost the default one."""
    eng = ScriptedEngine()
    eng.script = ["Hi.", "Hi."]

    async def go(body):
        async with _client(eng) as c:
            whole = (await c.post("/v1/responses", json=body)).json()
            async with c.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
                events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: ")]
            return whole, events
    whole, events = asyncio.run(go({"input": "x", "user": "u1", "top_p": 0.5, "text": {"verbosity": "low"}}))
    for r in [whole] + [e["response"] for e in events if "response" in e]:
        assert {k: r[k] for k in ("truncation", "user", "top_logprobs", "background", "temperature", "top_p")} == {
            "truncation": "disabled", "user": "u1", "top_logprobs": 0, "background": False, "temperature": 1.0,
            "top_p": 0.5}, r
        assert r["text"] == {"format": {"type": "text"}, "verbosity": "low"}  # the format's default filled in


def test_responses_take_openais_and_vllms_request_fields():
    """OpenAI's request fields with nothing to change here (`background: false`, `service_tier`, `prompt_cache_key`,
    `safety_identifier`, `max_tool_calls`, `prompt_cache_retention: in_memory`, `text.verbosity`) are accepted and
    echoed, and vLLM's sampling fields (`top_k`, `seed`, `stop`, ...) reach the sampler: they were refused as
    unknown. Every response object, whole and in the stream's lifecycle events, parses as the SDK's `Response`
    (its usage needs `input_tokens_details.cache_write_tokens`)."""
    from openai.types.responses import Response
    eng = ScriptedEngine()
    eng.script = ["Hi.", "Hi."]
    openai_fields = {"background": False, "service_tier": "flex", "prompt_cache_key": "k1", "safety_identifier": "s1",
                     "max_tool_calls": 2, "prompt_cache_retention": "in_memory", "text": {"verbosity": "low"}}
    vllm_fields = {"top_k": 5, "seed": 7, "stop": ["zz"], "repetition_penalty": 1.1, "logit_bias": {"65": 2.0},
                   "ignore_eos": True, "include_stop_str_in_output": True}

    async def go(body):
        async with _client(eng) as c:
            whole = await c.post("/v1/responses", json=body)
            async with c.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
                events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: ")]
            return whole, events
    whole, events = asyncio.run(go({"input": "x", **openai_fields, **vllm_fields}))
    assert whole.status_code == 200, whole.text
    for r in [whole.json()] + [e["response"] for e in events if "response" in e]:
        got = Response.model_validate(r)
        assert {k: getattr(got, k) for k in openai_fields if k != "text"} == {
            k: v for k, v in openai_fields.items() if k != "text"} and got.text.verbosity == "low"
    for _, params in eng.seen:
        assert (params.top_k, params.seed, params.stop, params.repetition_penalty, params.logit_bias) == (
            5, 7, ["zz"], 1.1, {65: 2.0}) and params.ignore_eos and params.include_stop_str_in_output


def test_responses_take_chat_style_tools_and_echo_them_flat():
    """Chat-style function tools and named tool_choice (`{"type": "function", "function": {...}}`) work as the flat
    ones (vLLM normalizes them; they were a 400), and the response echoes them flat, as the SDK's types parse."""
    from openai.types.responses import Response
    eng = ScriptedEngine()
    eng.script = ['{"a":1,"b":1}']

    async def go():
        async with _client(eng) as c:
            return await c.post("/v1/responses", json={"input": "add", "tools": TOOLS, "tool_choice": {
                "type": "function", "function": {"name": "add"}}})
    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    got = Response.model_validate(r.json())
    assert [t.name for t in got.tools] == ["get_weather", "add"] and got.tool_choice.name == "add"
    assert got.output[0].name == "add" and json.loads(got.output[0].arguments) == {"a": 1, "b": 1}


def test_responses_function_call_output_as_a_list_of_parts():
    """A function_call_output's `output` may be a list of input_text parts (OpenAI's): the model reads their text
    (it read the parts' JSON); a part that is not text is a 400 naming it."""
    eng = ScriptedEngine()
    eng.script = ["5."]
    call = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a":2,"b":3}'}
    parts = [{"type": "input_text", "text": "5"}, {"type": "input_text", "text": " (exact)"}]

    async def go(output):
        async with _client(eng) as c:
            return await c.post("/v1/responses", json={"input": [
                {"role": "user", "content": "add 2 and 3"}, call,
                {"type": "function_call_output", "call_id": "c1", "output": output}]})
    r = asyncio.run(go(parts))
    assert r.status_code == 200, r.text
    prompt = TOK.decode(eng.seen[-1][0])
    assert "## Return of c1\n5 (exact)" in prompt and "input_text" not in prompt
    r = asyncio.run(go([{"type": "input_image", "image_url": "http://x"}]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert "input[2].output[0] must be a text part" in r.json()["error"]["message"]


@pytest.mark.parametrize("extra, field", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "web_search_call"}]}, "input"),
    ({"input": []}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"text": {"format": {"type": "yaml"}}}, "text"),
    ({"truncation": "middle"}, "truncation"),
    ({"top_logprobs": 10}, "top_logprobs"),  # over the server's max_logprobs (the chat request's `logprobs`)
    ({"background": True}, "background"),  # OpenAI's fields that cannot be served: refused, saying why
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    ({"text": {"verbosity": "terse"}}, "text.verbosity"),  # echoed: must be one of OpenAI's
    ({"logit_bias": {"999999": 1}}, "logit_bias"),  # vLLM's sampling fields: the chat request's checks
])
def test_responses_bad_requests_name_the_field(extra, field):
    eng = ScriptedEngine()

    async def go():
        async with _client(eng) as c:
            return await c.post("/v1/responses", json={"input": "x", **extra})
    r = asyncio.run(go())
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_responses_truncation_auto_drops_the_first_turns_until_the_conversation_fits():
    """OpenAI's `truncation: "auto"`: a conversation longer than the context loses whole turns from its beginning
    (never a call without its output) until the prompt leaves max_output_tokens; "disabled" stays a 400, and a
    last turn too long by itself is still refused."""
    eng = ScriptedEngine()
    eng.engine.config.max_model_len = 700
    call = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}'}
    turns = [{"role": "user", "content": "first " + "a" * 200}, {"role": "assistant", "content": "b" * 150},
             {"role": "user", "content": "second " + "c" * 200}, call,
             {"type": "function_call_output", "call_id": "c1", "output": "5"},
             {"role": "user", "content": "third " + "d" * 150}]

    async def go(**extra):
        async with _client(eng) as c:
            return await c.post("/v1/responses", json={"input": turns, "instructions": "be brief", **extra})
    r = asyncio.run(go(max_output_tokens=50))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    eng.script = ["ok"]
    r = asyncio.run(go(max_output_tokens=50, truncation="auto"))
    assert r.status_code == 200 and r.json()["truncation"] == "auto", r.text
    prompt = TOK.decode(eng.seen[-1][0])
    assert len(eng.seen[-1][0]) + 50 <= 700
    assert "be brief" in prompt and "first" not in prompt and "b" * 150 not in prompt
    assert "second" in prompt and "Return of c1" in prompt and "third" in prompt  # the latest turns, whole
    eng.script = ["ok"]
    r = asyncio.run(go(max_output_tokens=300, truncation="auto"))  # room for 300: only the last turn fits
    assert r.status_code == 200, r.text
    prompt = TOK.decode(eng.seen[-1][0])
    assert "second" not in prompt and "c1" not in prompt and "third" in prompt
    r = asyncio.run(go(max_output_tokens=600, truncation="auto"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_responses_parallel_calls_stream_each_item_whole_before_the_next():
    """Streamed parallel calls: each function_call item's arguments .done and output_item.done come before the
    next item's output_item.added (OpenAI's item order)."""
    eng = ScriptedEngine()
    flat = [{"type": "function", **t["function"]} for t in TOOLS]

    async def stream(c):
        return [e async for e in await c.responses.create(model="m", input="x", tools=flat, stream=True)]
    eng.script = ['[{"name":"add","parameters":{"a":2,"b":3}},{"name":"add","parameters":{"a":1,"b":1}}]']
    events = [(e.type, getattr(e, "output_index", None)) for e in _sdk(eng, stream)]
    items = [(t, i) for t, i in events if t.startswith("response.output_item") or t.endswith("arguments.done")]
    assert items == [("response.output_item.added", 0), ("response.function_call_arguments.done", 0),
                     ("response.output_item.done", 0), ("response.output_item.added", 1),
                     ("response.function_call_arguments.done", 1), ("response.output_item.done", 1)]


class _EmptyAnswer(ScriptedEngine):
    """Ends every request with the end-of-sequence token at once: an empty answer."""

    async def generate(self, prompt, params, request_id=None, priority=0, on_accept=None):
        self.seen.append((list(prompt), params))
        out = CompletionOutput(0, "", [TOK.eos_token_ids[0]], "stop")
        yield RequestOutput(request_id, None, list(prompt), [out], finished=True)


def test_responses_empty_answer_has_no_message_whole_or_streamed():
    """An empty answer has no message item (vLLM's), whole as streamed: the response.completed object and the
    whole response list the same items."""
    eng = _EmptyAnswer()
    r = _sdk(eng, lambda c: c.responses.create(model="m", input="x"))

    async def stream(c):
        return [e async for e in await c.responses.create(model="m", input="x", stream=True)]
    events = _sdk(eng, stream)
    assert r.status == "completed" and r.output == [] and r.output_text == ""
    assert events[-1].type == "response.completed" and events[-1].response.output == []


def test_responses_take_vllms_request_id_as_the_response_id():
    """vLLM's `request_id` is the response's id (stored and continued under it); the engine request gets a suffix
    of its own, since a client's id may repeat."""
    eng = ScriptedEngine()
    engine_ids = []
    generate = eng.generate

    def recording(prompt, params, request_id=None, **kw):
        engine_ids.append(request_id)
        return generate(prompt, params, request_id, **kw)
    eng.generate = recording
    eng.script = ["one", "two"]

    async def go():
        async with _client(eng) as c:
            r1 = await c.post("/v1/responses", json={"input": "hi", "request_id": "resp_mine"})
            r2 = await c.post("/v1/responses", json={"input": "again", "previous_response_id": "resp_mine"})
            bad = await c.post("/v1/responses", json={"input": "x", "request_id": ""})
            return r1, r2, bad
    r1, r2, bad = asyncio.run(go())
    assert r1.status_code == 200 and r1.json()["id"] == "resp_mine", r1.text
    assert r2.status_code == 200 and r2.json()["previous_response_id"] == "resp_mine", r2.text
    assert "hi" in TOK.decode(eng.seen[-1][0]) and "one" in TOK.decode(eng.seen[-1][0])
    assert engine_ids[0].startswith("resp_mine-") and engine_ids[0] != "resp_mine"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id", bad.text


def test_stored_responses_continue_conversations_per_key():
    """previous_response_id continues a stored conversation (not its instructions); streamed responses are
    stored too; store=false, delete, another key and the store's bound all leave nothing to continue."""
    import openai

    eng = ScriptedEngine()
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    eng.script = ["It is 21C in Paris.", '[{"name":"add","parameters":{"a":2,"b":3}}]', "Done: 5.", "x", "y", "z"]
    app = create_app(None, "m", api_keys=["ka", "kb"], max_stored_responses=3)
    app.state.k3.attach(eng)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            a = openai.AsyncOpenAI(base_url="http://t/v1", api_key="ka", http_client=http)
            b = openai.AsyncOpenAI(base_url="http://t/v1", api_key="kb", http_client=http)
            r1 = await a.responses.create(model="m", input="weather in paris?", instructions="answer in French")
            assert r1.store is True
            assert (await a.responses.retrieve(r1.id)).output_text == "It is 21C in Paris."
            stream = await a.responses.create(model="m", input="now add 2 and 3", previous_response_id=r1.id,
                                              tools=flat, tool_choice="required", stream=True)
            r2 = [e async for e in stream][-1].response
            assert r2.previous_response_id == r1.id and r2.output[0].type == "function_call"
            p2 = TOK.decode(eng.seen[-1][0])
            assert "weather in paris?" in p2 and "It is 21C in Paris." in p2 and "now add 2 and 3" in p2
            assert "answer in French" not in p2  # instructions are not carried over
            call = r2.output[0]
            r3 = await a.responses.create(model="m", previous_response_id=r2.id, tools=flat, input=[
                {"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
            p3 = TOK.decode(eng.seen[-1][0])
            assert r3.output_text == "Done: 5." and "weather in paris?" in p3
            assert '"name": "add", "parameters": {"a": 2, "b": 3}' in p3 and f"## Return of {call.call_id}\n5" in p3
            with pytest.raises(openai.BadRequestError, match="previous_response_id"):
                await b.responses.create(model="m", input="hi", previous_response_id=r3.id)  # another key's
            with pytest.raises(openai.NotFoundError):
                await b.responses.retrieve(r3.id)
            r4 = await a.responses.create(model="m", input="q", store=False)
            assert r4.store is False
            with pytest.raises(openai.NotFoundError):
                await a.responses.retrieve(r4.id)
            await a.responses.delete(r3.id)
            with pytest.raises(openai.NotFoundError):
                await a.responses.retrieve(r3.id)
            await a.responses.create(model="m", input="q2")  # stored: r1, r2, q2 (3, the bound)
            await a.responses.retrieve(r2.id)  # least recently used first: r1, q2, r2
            await a.responses.create(model="m", input="q3")  # drops r1
            await a.responses.retrieve(r2.id)
            with pytest.raises(openai.BadRequestError, match="previous_response_id"):
                await a.responses.create(model="m", input="again", previous_response_id=r1.id)
    asyncio.run(go())
    assert len(app.state.k3.responses) == 3


def test_responses_stream_adds_reasoning_items_empty():
    """`response.output_item.added` shows the item as it is then: the reasoning text arrives in the deltas only
    (a client that starts from the added item and appends the deltas gets it once). Its reasoning_text part is
    announced and ended with `response.content_part.added` / `.done`, as a message's output_text part (OpenAI's
    order; the reasoning item had none)."""
    from serve.responses import ResponseEvents

    ev = ResponseEvents("r", 0, SimpleNamespace(), "m", channels=True)
    events = [e for d in ({"reasoning_content": "Let me "}, {"reasoning_content": "think"}, {"content": "Yes"})
              for e in ev.chunk({"choices": [{"delta": d, "logprobs": None, "finish_reason": None}]})]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [a["type"] for a in added] == ["reasoning", "message"]
    assert added[0]["content"] == [] and added[1]["content"] == []
    parts = [(e["output_index"], e["part"]) for e in events if e["type"] == "response.content_part.added"]
    assert [(i, p["type"], p["text"]) for i, p in parts] == [(0, "reasoning_text", ""), (1, "output_text", "")]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert parts[0][1]["text"] + deltas == "Let me think"
    assert ev.items[0]["content"][0]["text"] == "Let me think"
    kinds = [e["type"] for e in events]
    assert kinds[kinds.index("response.reasoning_text.done"):kinds.index("response.output_item.added", 1)] == [
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]



class _CutShort(ScriptedEngine):
    """Writes the scripted answer, then after `at` tokens ends it: finish_reason "abort" (the engine's for an aborted
    request: /abort_request, /pause, shutdown) or, with `fail`, an engine failure mid-stream."""

    def __init__(self, at: int, fail: bool = False):
        super().__init__()
        self.at, self.fail = at, fail

    async def generate(self, prompt, params, request_id=None, priority=0, on_accept=None):
        self.seen.append((list(prompt), params))
        ids = TOK.encode(self.script.pop(0))[:self.at]
        for k, tok in enumerate(ids):
            if self.fail and k == len(ids) - 1:
                raise RuntimeError("injected device failure")
            done = k == len(ids) - 1
            yield RequestOutput(request_id, None, list(prompt), [CompletionOutput(0, TOK.decode([tok]), [tok],
                                                                                  "abort" if done else None)], done)
            await asyncio.sleep(0)


def test_responses_aborted_are_cancelled_whole_streamed_and_stored():
    """A request aborted mid-answer (finish_reason "abort") is status `cancelled` with no incomplete_details (vLLM's,
    OpenAI's), not `completed`: whole, stored, and streamed (its last event `response.incomplete`: OpenAI's stream has
    no cancelled event), the stream's events numbered in order."""
    eng = _CutShort(at=4)
    eng.script = ["Sunny, 21C.", "Sunny, 21C."]

    async def go():
        async with _client(eng) as c:
            whole = (await c.post("/v1/responses", json={"input": "x"})).json()
            stored = (await c.get(f"/v1/responses/{whole['id']}")).json()
            async with c.stream("POST", "/v1/responses", json={"input": "x", "stream": True}) as r:
                events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: ")]
            return whole, stored, events
    whole, stored, events = asyncio.run(go())
    assert whole["status"] == stored["status"] == "cancelled" and whole["incomplete_details"] is None
    assert whole["output"][0]["content"][0]["text"] == "Sunn"
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "cancelled"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_responses_cut_short_mark_their_last_item_incomplete():
    """A response cut by max_output_tokens (or aborted) marks the item being written `incomplete` (OpenAI's item
    status; it said `completed`), whole, stored and streamed (its `output_item.done` and the last event's response);
    the items before it and those of a whole answer stay `completed`."""
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    eng = ScriptedEngine()
    calls = '[{"name":"add","parameters":{"a":2,"b":3}},{"name":"add","parameters":{"a":1,"b":1}}]'
    eng.script = ["a long answer", "a long answer", calls, calls, "Hi.", "Hi."]

    async def go(body):
        async with _client(eng) as c:
            whole = (await c.post("/v1/responses", json=body)).json()
            stored = (await c.get(f"/v1/responses/{whole['id']}")).json()
            async with c.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
                events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: ")]
            done = [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"]
            return whole, stored, done, events[-1]["response"]

    def statuses(r):
        return [(it["type"], it["status"]) for it in r["output"]]
    whole, stored, done, last = asyncio.run(go({"input": "x", "max_output_tokens": 4}))
    assert whole["status"] == "incomplete" and statuses(whole) == statuses(stored) == [("message", "incomplete")]
    assert done == ["incomplete"] and statuses(last) == [("message", "incomplete")]
    whole, _, done, last = asyncio.run(go({"input": "x", "tools": flat, "tool_choice": "required",
                                           "max_output_tokens": len(calls) - 8}))  # in the second call's arguments
    want = [("function_call", "completed"), ("function_call", "incomplete")]
    assert whole["status"] == "incomplete" and statuses(whole) == statuses(last) == want
    assert done == ["completed", "incomplete"]
    whole, _, done, last = asyncio.run(go({"input": "x"}))
    assert statuses(whole) == statuses(last) == [("message", "completed")] and done == ["completed"]
    eng = _CutShort(at=4)
    eng.script = ["Sunny, 21C.", "Sunny, 21C."]
    whole, _, done, last = asyncio.run(go({"input": "x"}))
    assert whole["status"] == last["status"] == "cancelled" and statuses(whole) == [("message", "incomplete")]
    assert done == ["incomplete"]


def test_responses_take_openais_stream_options():
    """OpenAI's Responses `stream_options: {"include_obfuscation": false}` (the SDK's way to drop the padding field)
    is accepted with stream: true (it was a 400, unknown field), as is chat's; without stream it is a 400 naming it,
    as chat's."""
    eng = ScriptedEngine()
    eng.script = ["Hi.", "Hi."]

    async def go(path, body):
        async with _client(eng) as c:
            return await c.post(path, json=body)
    opts = {"include_obfuscation": False}
    r = asyncio.run(go("/v1/responses", {"input": "x", "stream": True, "stream_options": opts}))
    assert r.status_code == 200 and "response.completed" in r.text, r.text
    r = asyncio.run(go("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                                                "stream_options": {**opts, "include_usage": True}}))
    assert r.status_code == 200 and '"usage": {"prompt_tokens"' in r.text, r.text
    r = asyncio.run(go("/v1/responses", {"input": "x", "stream_options": opts}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
    r = asyncio.run(go("/v1/responses", {"input": "x", "stream": True, "stream_options": {"include_usage": True}}))
    assert r.status_code == 400 and "stream_options" in r.json()["error"]["param"], r.text


def test_responses_stream_failure_ends_with_typed_numbered_events():
    """An engine failure mid-stream ends a Responses stream with OpenAI's `error` and `response.failed` events, typed
    and numbered after the others (it was a chat-style error object: no `type`, no `sequence_number`, which the SDK
    cannot read as a Responses event); nothing is stored."""
    eng = _CutShort(at=4, fail=True)
    eng.script = ["Sunny, 21C."]

    async def stream(c):
        return [e async for e in await c.responses.create(model="m", input="x", stream=True)]
    events = _sdk(eng, stream)
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-2].message == "injected device failure" and events[-2].code == "server_error"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error" and failed.store is False
    assert failed.output[0].content[0].text == "Sun"


def test_responses_reasoning_tokens_count_the_think_channels_tokens(tmp_path):
    """K3: usage.output_tokens_details.reasoning_tokens counts the tokens generated in the think channel (its end
    marker's included), whole and streamed; it was the reasoning text re-encoded, which a model's own tokenisation
    (here: a byte per token) does not match."""
    from test_tokenizer import K3_SPECIALS, synthetic_ranks, write_tokenizer_dir

    from k3jax.tokenizer import KimiTokenizer
    from serve.reasoning import THINK_END

    k3 = KimiTokenizer.from_dir(write_tokenizer_dir(tmp_path, synthetic_ranks(), K3_SPECIALS), family="k3")
    think, answer = "hello hello world", "<|open|>response<|sep|>hello.<|close|>response<|sep|>"
    marker = k3.encode(THINK_END, allow_special=True)
    ids = [k3.encode(ch)[0] for ch in think] + marker + k3.encode(answer, allow_special=True)
    assert len(k3.encode(think + THINK_END, allow_special=True)) < len(think) + len(marker)  # re-encoding merges

    class Writer(ScriptedEngine):
        async def generate(self, prompt, params, request_id=None, priority=0, on_accept=None):
            for k, tok in enumerate(ids):
                done = k == len(ids) - 1
                yield RequestOutput(request_id, None, list(prompt), [CompletionOutput(
                    0, k3.decode(ids[:k + 1])[len(k3.decode(ids[:k])):], [tok], "stop" if done else None)], done)

    eng = Writer()
    eng.engine.tokenizer = k3

    async def go():
        async with _client(eng) as c:
            whole = (await c.post("/v1/responses", json={"input": "x"})).json()
            async with c.stream("POST", "/v1/responses", json={"input": "x", "stream": True}) as r:
                events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: ")]
            return whole, events[-1]["response"]
    whole, streamed = asyncio.run(go())
    assert whole["output"][0]["content"][0]["text"] == think and whole["output"][1]["content"][0]["text"] == "hello."
    for r in (whole, streamed):
        assert r["usage"]["output_tokens"] == len(ids)
        assert r["usage"]["output_tokens_details"] == {"reasoning_tokens": len(think) + len(marker)}


def test_responses_logprobs_keep_only_the_answer_channels_tokens():
    """K3: the think channel and the markup before the answer are left out of output_text's logprobs,
    whole (located by bytes) and streamed (the trailing tokens that wrote each delta)."""
    from serve.responses import ResponseEvents, text_logprobs, trailing_logprobs

    def entry(s):
        return {"token": s, "logprob": -0.5, "bytes": list(s.encode()), "top_logprobs": []}

    toks = [entry(t) for t in ("I think", " so", "<|/think|>", "<|answer|>", "Yes", ",", " ok")]
    assert [e["token"] for e in text_logprobs(toks, "Yes, ok")] == ["Yes", ",", " ok"]
    assert text_logprobs(toks, "not there") == [] and text_logprobs([], "x") == []
    assert [e["token"] for e in trailing_logprobs(toks[2:5], "Yes")] == ["Yes"]
    ev = ResponseEvents("r", 0, SimpleNamespace(), "m", channels=True)
    chunks = [({"reasoning_content": "I think"}, toks[0:1]), ({"reasoning_content": " so"}, toks[1:2]),
              ({}, toks[2:3]), ({}, toks[3:4]), ({"content": "Yes"}, toks[4:5]), ({"content": ", ok"}, toks[5:7])]
    deltas = []
    for d, lps in chunks:
        for e in ev.chunk({"choices": [{"delta": d, "logprobs": {"content": lps}, "finish_reason": None}]}):
            if e["type"] == "response.output_text.delta":
                deltas.append([x["token"] for x in e["logprobs"]])
    assert deltas == [["Yes"], [",", " ok"]]
    assert [x["token"] for x in ev.items[-1]["content"][0]["logprobs"]] == ["Yes", ",", " ok"]
    # one chunk crossing from the think channel into the answer (several tokens: drafts, a slow client's merged
    # deltas): its answer tokens' logprobs stay (they were dropped with the think channel's)
    ev = ResponseEvents("r", 0, SimpleNamespace(), "m", channels=True)
    chunks = [({"reasoning_content": "I think"}, toks[0:1]),
              ({"reasoning_content": " so", "content": "Yes"}, toks[1:5]), ({"content": ", ok"}, toks[5:7])]
    deltas = [[x["token"] for x in e["logprobs"]] for d, lps in chunks
              for e in ev.chunk({"choices": [{"delta": d, "logprobs": {"content": lps}, "finish_reason": None}]})
              if e["type"] == "response.output_text.delta"]
    assert deltas == [["Yes"], [",", " ok"]]
    assert [x["token"] for x in ev.items[-1]["content"][0]["logprobs"]] == ["Yes", ",", " ok"]


def test_responses_logprobs_are_the_answers_tokens_not_markup_with_the_same_text(tmp_path):
    """K3: an answer whose text the channel markup around it also holds ("on": `<|close|>response`) gets its own
    tokens' logprobs, whole and streamed with the answer and its closing markup in one step (drafts, a slow
    client's merged deltas). The last occurrence of the text was taken whole (the markup's `response` token),
    and the streamed delta got the trailing markup's tokens or none."""
    from test_tokenizer import K3_SPECIALS, synthetic_ranks, write_tokenizer_dir

    from k3jax.tokenizer import KimiTokenizer
    from serve.reasoning import RESPONSE_START, THINK_END
    from serve.types import Logprob, TokenLogprobs

    k3 = KimiTokenizer.from_dir(write_tokenizer_dir(tmp_path, synthetic_ranks(), K3_SPECIALS), family="k3")
    ids = k3.encode("and so on") + k3.encode(THINK_END + RESPONSE_START, allow_special=True)
    first = len(ids)
    ids += k3.encode("on")
    answer = list(range(first, len(ids)))
    ids += k3.encode("<|close|>response<|sep|><|close|>message<|sep|>", allow_special=True)
    steps = [(0, first), (first, len(ids))]  # the answer and its closing markup in one step

    class Writer(ScriptedEngine):
        async def generate(self, prompt, params, request_id=None, priority=0, on_accept=None):
            for a, b in steps:
                lps = [TokenLogprobs(Logprob(t, -k / 100, k3.decode([t], skip_special=False)))
                       for k, t in enumerate(ids[a:b], a)]
                yield RequestOutput(request_id, None, list(prompt), [CompletionOutput(
                    0, k3.decode(ids[:b])[len(k3.decode(ids[:a])):], ids[a:b], "stop" if b == len(ids) else None,
                    logprobs=lps)], b == len(ids))

    eng = Writer()
    eng.engine.tokenizer = k3
    body = {"input": "x", "include": ["message.output_text.logprobs"]}

    async def go():
        async with _client(eng) as c:
            whole = (await c.post("/v1/responses", json=body)).json()
            async with c.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
                events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: ")]
            return whole, events
    whole, events = asyncio.run(go())
    want = [-k / 100 for k in answer]
    assert whole["output"][1]["content"][0]["text"] == "on"
    assert [e["logprob"] for e in whole["output"][1]["content"][0]["logprobs"]] == want
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(e["delta"] for e in deltas) == "on"
    assert [x["logprob"] for e in deltas for x in e["logprobs"]] == want
    assert [x["logprob"] for x in events[-1]["response"]["output"][1]["content"][0]["logprobs"]] == want
