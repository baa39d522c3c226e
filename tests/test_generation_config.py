"""A model's generation_config.json as the default sampling (serve/generation_config.py): reading and
checking the file, `--generation-config auto|vllm|DIR`, the engine and `LLM`, and the server's unset fields."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from serve import generation_config as gc
from serve.types import SamplingParams


def _write(path, **fields):
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 3], **fields}))
    return path


def test_read_keeps_vllms_sampling_fields_and_checks_them(tmp_path):
    assert gc.read(str(tmp_path)) == {}  # no file
    _write(tmp_path, temperature=1.0, top_p=0.95, top_k=20, max_new_tokens=512, do_sample=True)
    assert gc.read(str(tmp_path)) == {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "max_tokens": 512}
    for bad, key in ((dict(temperature="hot"), "temperature"), (dict(top_k=2.5), "top_k"),
                     (dict(top_p=1.5), "top_p"), (dict(repetition_penalty=0), "repetition_penalty"),
                     (dict(temperature=True), "temperature")):
        _write(tmp_path, **bad)
        with pytest.raises(ValueError, match=f"generation_config.json: {key}"):
            gc.read(str(tmp_path))
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        gc.read(str(tmp_path))


def test_resolve_auto_vllm_and_a_directory(tmp_path):
    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir(), other.mkdir()
    _write(model, top_p=0.95)
    _write(other, temperature=0.6)
    assert gc.resolve("auto", str(model)) == gc.resolve(None, str(model)) == {"top_p": 0.95}
    assert gc.resolve("auto", "tiny-k3") == {}  # a preset has no directory
    assert gc.resolve("vllm", str(model)) == {}
    assert gc.resolve(str(other), str(model)) == {"temperature": 0.6}
    with pytest.raises(ValueError, match="generation_config: 'nowhere'"):
        gc.resolve("nowhere", str(model))
    assert gc.default_params({"top_p": 0.95}) == SamplingParams(top_p=0.95)


def test_engine_reads_the_checkpoint_directory_before_anything_else(tmp_path):
    import k3jax
    from serve.engine import Engine, EngineConfig

    _write(tmp_path, temperature=0.7, top_p=0.9)
    model = dataclasses.replace(k3jax.load_model("tiny-k3"), source=str(tmp_path))  # as a checkpoint dir would be
    kw = dict(max_model_len=64, cache_bytes=4 << 20, max_num_seqs=2, prefill_chunk=16, max_prefill_seqs=1)
    eng = Engine(model, EngineConfig(**kw), warmup=False, progress=False)
    assert eng.generation_defaults == {"temperature": 0.7, "top_p": 0.9}
    assert Engine(model, EngineConfig(**kw, generation_config="vllm"), warmup=False,
                  progress=False).generation_defaults == {}
    _write(tmp_path, top_k="x")
    with pytest.raises(ValueError, match="top_k"):
        Engine(model, EngineConfig(**kw), warmup=False, progress=False)


def test_server_fills_only_the_fields_a_request_leaves_unset():
    from serve.api import ChatCompletionRequest, CompletionRequest, _sampling

    st = SimpleNamespace(generation_defaults={"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 9},
                         vocab_size=512, max_logprobs=5)
    p = _sampling(st, CompletionRequest(prompt="x"), 16, None)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (0.6, 0.95, 20, 0.0, 16)
    p = _sampling(st, CompletionRequest(prompt="x", temperature=1.0, top_p=1.0), 16, None)  # explicit wins
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 20)
    p = _sampling(st, ChatCompletionRequest(messages=[{"role": "user", "content": "a"}], top_k=-1), None, None)
    assert (p.temperature, p.top_k) == (0.6, -1)
    p = _sampling(SimpleNamespace(generation_defaults={}, vocab_size=512, max_logprobs=5), CompletionRequest(prompt="x"),
                  16, None)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (1.0, 1.0, -1, 1.0)  # OpenAI's defaults


def test_server_takes_max_new_tokens_for_an_unset_max_tokens_cut_to_the_context():
    """vLLM's get_max_tokens: a request without max_tokens generates the generation config's max_new_tokens (as
    `LLM.generate` without sampling parameters does), or what the context leaves if less; a given one wins."""
    import asyncio

    import httpx

    from k3jax.tokenizer import ByteTokenizer
    from recording_engine import Recorder
    from serve.api import create_app

    eng = Recorder(64, ByteTokenizer(320), {"max_tokens": 5, "temperature": 0.0}, vocab_size=320, token=97, text="a")
    app = create_app(eng, "m", max_waiting=None)

    def post(url, body):
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                return await c.post(url, json=body)
        r = asyncio.run(go())
        assert r.status_code == 200, r.text
        return eng.params[-1].max_tokens

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert post("/v1/chat/completions", chat) == 5
    assert post("/v1/chat/completions", {**chat, "max_tokens": 9}) == 9
    assert post("/v1/chat/completions", {**chat, "max_completion_tokens": 7}) == 7
    assert post("/v1/responses", {"input": "hi"}) == 5
    assert post("/v1/completions", {"prompt": "hi"}) == 16  # OpenAI's default max_tokens is a given value
    assert post("/v1/completions", {"prompt": "hi", "max_tokens": None}) == 5
    assert post("/v1/completions", {"prompt": "x" * 62, "max_tokens": None}) == 2  # what the context leaves
    long = {"messages": [{"role": "user", "content": "x" * 200}], "truncate_prompt_tokens": 60}
    assert post("/v1/chat/completions", long) == 4
    assert eng.params[-1].temperature == 0.0
    # vLLM's override_max_tokens: a generation config given as a directory caps a given max_tokens as well
    eng = Recorder(64, ByteTokenizer(320), {"max_tokens": 5}, vocab_size=320, token=97, text="a", setting="/gc")
    app = create_app(eng, "m", max_waiting=None)
    assert post("/v1/chat/completions", {**chat, "max_tokens": 9}) == 5
    assert post("/v1/completions", {"prompt": "hi", "max_tokens": 3}) == 3
    assert post("/v1/chat/completions", chat) == 5


def test_server_cuts_an_unset_max_tokens_per_prompt_of_a_batch():
    """vLLM's get_max_tokens runs per prompt: in a completions batch without max_tokens, each prompt generates the
    generation config's max_new_tokens or what its own context leaves; the longest prompt's room cut them all."""
    import asyncio

    import httpx

    from k3jax.tokenizer import ByteTokenizer
    from recording_engine import Recorder
    from serve.api import create_app

    eng = Recorder(64, ByteTokenizer(320), {"max_tokens": 5}, vocab_size=320, token=97, text="a")
    app = create_app(eng, "m", max_waiting=None)

    def asked(body, route="/v1/completions"):
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                return await c.post(route, json=body)
        eng.params.clear()
        r = asyncio.run(go())
        assert r.status_code == 200, r.text
        return sorted(p.max_tokens for p in eng.params)

    for stream in (False, True):
        assert asked({"prompt": ["x" * 62, "hi"], "max_tokens": None, "stream": stream}) == [2, 5]
    assert asked({"prompt": ["x" * 200, "hi"], "max_tokens": None, "truncate_prompt_tokens": 60}) == [4, 5]
    assert asked({"prompt": ["x" * 62, "hi"], "max_tokens": 2}) == [2, 2]  # a given one is every prompt's
    # SGLang's /generate: its default 128, cut per prompt likewise
    assert asked({"text": ["x" * 62, "hi"]}, "/generate") == [2, 62]
    assert asked({"text": ["x" * 62, "hi"], "sampling_params": {"max_new_tokens": 2}}, "/generate") == [2, 2]
    # a beam search too (vLLM's sets each prompt's beams' max_tokens): it ran every prompt with the least
    beam = {"prompt": ["x" * 62, "hi"], "use_beam_search": True, "n": 2}
    assert asked({**beam, "max_tokens": None}) == [2, 5]
    assert asked({**beam, "max_tokens": 2}) == [2, 2]
    eng.engine.generation_defaults = {}
    app = create_app(eng, "m", max_waiting=None)  # (no max_new_tokens: the rest of each prompt's context)
    assert asked({**beam, "max_tokens": None}) == [2, 62]
