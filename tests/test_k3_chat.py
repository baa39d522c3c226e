"""The K3 chat path end to end over HTTP: a tiny K3 checkpoint saved with a K3 tokenizer (synthetic ranks,
the spec's marker and special ids) and loaded from disk, served by the real engine. Checks what only a
K3 tokenizer exercises: the XTML prompt, the response channel opened by a non-thinking prompt, the
reasoning split, structured outputs and forced tool calls inside the response channel (grammar literals
tokenised as the model sees them), K3 tool results in the history, and `reasoning_effort`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import httpx
import pytest

from test_tokenizer import K3_SPECIALS, synthetic_ranks, write_tokenizer_dir

TOOLS = [{"type": "function", "function": {"name": "light", "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"], "additionalProperties": False}}}]
OFF = {"thinking": False}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from k3jax.checkpoint import save_hf_checkpoint
    from k3jax.config import get_preset
    from k3jax.runtime import init_model, load_model
    from serve.api import create_app
    from serve.async_engine import AsyncEngine
    from serve.engine import Engine, EngineConfig

    d = tmp_path_factory.mktemp("k3chat")
    ranks = synthetic_ranks()
    cfg = dataclasses.replace(get_preset("tiny-k3"), vocab_size=640, bos_token_id=len(ranks),
                              eos_token_ids=(len(ranks) + 1, len(ranks) + 2), pad_token_id=len(ranks) + 255)
    graphdef, params = init_model(cfg, "float32", 0)
    save_hf_checkpoint(str(d), cfg, params)
    write_tokenizer_dir(d, ranks, K3_SPECIALS)  # (no config_eos: it would overwrite the model config.json)
    model = load_model(str(d))
    assert model.tokenizer.chat_family == "k3"
    eng = Engine(model, EngineConfig(max_model_len=1024, cache_bytes=32 << 20, max_num_seqs=2, prefill_chunk=64,
                                     max_prefill_seqs=1, decode_buckets=(2,), prefill_buckets=(1,),
                                     context_buckets=(64,), measure_moe_time=False), progress=False)
    aeng = AsyncEngine(eng)
    yield create_app(aeng, "tiny-k3-chat")
    aeng.shutdown()


def _post(app, path, body):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, json=body)
    return asyncio.run(go())


def test_k3_chat_structured_tools_and_reasoning_effort(app):
    msgs = [{"role": "user", "content": "Turn the light on?"}]
    r = _post(app, "/v1/chat/completions", {"messages": msgs, "max_tokens": 24, "temperature": 0,
                                            "chat_template_kwargs": OFF,
                                            "response_format": {"type": "json_schema", "json_schema": {
                                                "name": "s", "schema": {"enum": ["yes", "no"]}}}}).json()
    assert "choices" in r, r
    m = r["choices"][0]["message"]
    assert m["content"] in ('"yes"', '"no"') and not m.get("reasoning_content")  # the response channel only
    assert r["choices"][0]["finish_reason"] == "stop"
    r = _post(app, "/v1/chat/completions", {"messages": msgs, "max_tokens": 80, "temperature": 0, "tools": TOOLS,
                                            "tool_choice": "required", "parallel_tool_calls": False,
                                            "chat_template_kwargs": OFF}).json()
    assert r["choices"][0]["message"]["tool_calls"], r["choices"]
    call = r["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "light" and set(json.loads(call["function"]["arguments"])) == {"on"}
    # the call and a K3 tool result go back into the history (rendered as a system message)
    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": call["id"], "content": "done"}]
    tok = _post(app, "/tokenize", {"messages": history, "chat_template_kwargs": OFF}).json()["tokens"]
    text = _post(app, "/detokenize", {"tokens": tok}).json()["prompt"]
    assert f"## Return of {call['id']}\ndone" in text and '"name": "light"' in text
    r = _post(app, "/v1/chat/completions", {"messages": history, "max_tokens": 4, "temperature": 0,
                                            "chat_template_kwargs": OFF})
    assert r.status_code == 200, r.text
    # reasoning_effort renders K3's effort message; thinking prompts open the think channel
    low = _post(app, "/tokenize", {"messages": msgs, "chat_template_kwargs": {"thinking_effort": "low"}}).json()
    r = _post(app, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "reasoning_effort": "low",
                                            "return_token_ids": True, "temperature": 0}).json()
    assert r["prompt_token_ids"] == low["tokens"]
    text = _post(app, "/detokenize", {"tokens": low["tokens"]}).json()["prompt"]
    assert re.search(r"low", text) and text.endswith("<|open|>think<|sep|>")


def test_k3_continue_final_message_continues_the_response_channel(app):
    """A continued assistant message ends the prompt inside its response channel; the answer is read as
    that channel's content (no reasoning), with the prefilled start not repeated."""
    msgs = [{"role": "user", "content": "Say yes"}, {"role": "assistant", "content": "Well,"}]
    cont = {"add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"thinking": True}}
    tok = _post(app, "/tokenize", {"messages": msgs, **cont}).json()["tokens"]
    text = _post(app, "/detokenize", {"tokens": tok}).json()["prompt"]
    assert text.endswith("<|open|>think<|sep|><|close|>think<|sep|><|open|>response<|sep|>Well,")
    r = _post(app, "/v1/chat/completions", {"messages": msgs, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                            "return_token_ids": True, **cont}).json()
    m = r["choices"][0]["message"]
    assert r["prompt_token_ids"] == tok and not m.get("reasoning_content") and m["content"] is not None
    echoed = _post(app, "/v1/chat/completions", {"messages": msgs, "max_tokens": 6, "temperature": 0,
                                                 "ignore_eos": True, "echo": True, **cont}).json()
    assert echoed["choices"][0]["message"]["content"] == "Well," + m["content"]  # vLLM's chat echo


def test_k3_reasoning_under_both_names_or_left_out(app):
    """The think channel comes back as `reasoning` (vLLM's name) and `reasoning_content` (SGLang's); vLLM's
    `include_reasoning: false` leaves it out, the answer unchanged."""
    body = {"messages": [{"role": "user", "content": "Why?"}], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    m = _post(app, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert m["reasoning"] == m["reasoning_content"] and "reasoning" in m
    hidden = _post(app, "/v1/chat/completions", {**body, "include_reasoning": False}).json()["choices"][0]["message"]
    assert "reasoning" not in hidden and "reasoning_content" not in hidden and hidden["content"] == m["content"]


def test_openai_reasoning_efforts_on_k3(app):
    """OpenAI's reasoning efforts on a K3 model: `medium` (OpenAI's and Codex's default, Codex sends it as the
    Responses API's `reasoning.effort`) renders K3's `high`, `none` the non-thinking prompt; both were a 400."""
    msgs = [{"role": "user", "content": "Turn the light on?"}]
    high = _post(app, "/tokenize", {"messages": msgs, "chat_template_kwargs": {"thinking_effort": "high"}}).json()
    r = _post(app, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "reasoning_effort": "medium",
                                            "return_token_ids": True, "temperature": 0})
    assert r.status_code == 200 and r.json()["prompt_token_ids"] == high["tokens"], r.text
    off = _post(app, "/tokenize", {"messages": msgs, "chat_template_kwargs": OFF}).json()
    r = _post(app, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "reasoning_effort": "none",
                                            "return_token_ids": True, "temperature": 0})
    assert r.status_code == 200 and r.json()["prompt_token_ids"] == off["tokens"], r.text
    # ... and its answer is the response channel's, as with thinking off (not read as reasoning)
    ask = {"messages": msgs, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    plain = _post(app, "/v1/chat/completions", {**ask, "chat_template_kwargs": OFF}).json()["choices"][0]["message"]
    none = _post(app, "/v1/chat/completions", {**ask, "reasoning_effort": "none"}).json()["choices"][0]["message"]
    assert none == plain and plain["content"] and not plain.get("reasoning_content"), (none, plain)
    for effort, want in (("medium", high), ("none", off)):
        r = _post(app, "/v1/responses", {"input": msgs, "max_output_tokens": 2, "reasoning": {"effort": effort},
                                         "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["input_tokens"] == want["count"] and r.json()["reasoning"]["effort"] == effort
    r = _post(app, "/v1/responses", {"input": "x", "reasoning": {"effort": "extreme"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort", r.text
