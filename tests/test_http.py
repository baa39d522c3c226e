"""The HTTP server end to end: the real `k3jax serve` in a subprocess on a free loopback port, driven
with the official `openai` client, raw httpx, schemathesis and a bounded concurrent load.

Two servers per module (tiny-k3, two step programs each, sharing one persistent compilation cache so
the second starts warm): an open one for the API, metrics, schema fuzzing and load; one with API keys,
per-key limits and a one-sequence waiting queue for auth, 429 and 503.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest

from serve.metrics import NAMES

MODEL = "tiny-k3"
MAX_MODEL_LEN = 128
CAPACITY = 8  # largest decode bucket
# Three step programs (decode 8 rows, its speculative verify form, prefill 1 row x 32 tokens; 8 context
# pages): fast warm-up. Every request below goes through an engine with n-gram drafts on (outputs must
# be those of plain decoding; serve/speculative.py), except the `limited` server's. The gate that skips drafts
# when a measured verify step costs more than they gain is off: on a loaded CI host that measurement decides
# whether drafts run at all.
# PLAIN (the `limited` server's options): no drafts and no logits processor, which none of its tests reads; the
# one-device engine tests/test_multihost.py compares with (its `reference`) and tests/test_run_batch.py's batch, so a
# run compiles these step programs once for the three files (CI time).
PLAIN = ["--model", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(CAPACITY),
         "--decode-buckets", str(CAPACITY), "--prefill-buckets", "1", "--context-buckets", "8",
         "--prefill-chunk", "32", "--cache-mb", "32", "--log-level", "warning", "--enable-request-id-headers"]
SMALL = PLAIN + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}',
                 "--logits-processors", "no_repeat_ngram"]
START_TIMEOUT = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, extra: list[str], cache_dir: str, log_path: str, env: dict | None = None,
                 options: list[str] = SMALL):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "k3jax.cli", "serve", *options, "--port", str(self.port),
               "--compile-cache-dir", cache_dir, *extra]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self.health_seen: list[int] = []
        try:
            self.startup_s = self._wait_ready()
        except BaseException:  # not ready in time: stopped, not left warming beside the tests that follow
            self.stop()
            raise

    def _wait_ready(self) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < START_TIMEOUT:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if not self.health_seen or self.health_seen[-1] != r.status_code:
                    self.health_seen.append(r.status_code)
                if r.status_code == 200:
                    return time.monotonic() - t0
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {START_TIMEOUT}s:\n{self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of `name` (exact name) whose labels include `labels`."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        lab = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(lab.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
            found = True
    assert found, f"no sample of {name} {labels}"
    return total


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """The run's shared compilation cache (tests/conftest.py) when there is one."""
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(tmp_path_factory.mktemp("jax_compile_cache"))


@pytest.fixture(scope="module")
def server(cache_dir, tmp_path_factory):
    s = Server(["--shutdown-timeout", "30", "--log-stats-interval", "1", "--enable-prompt-embeds",
                "--enable-return-routed-experts", "--enable-return-hidden-states",
                "--max-body-bytes", str(1 << 20)], cache_dir,  # the limit without embeddings (413 test)
               str(tmp_path_factory.mktemp("logs") / "server.log"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def full_forward():
    """seq -> (routed expert ids [T - 1, MoE layers, k], final hidden states after the norm [T - 1, H]) of a full
    forward over every position of `seq` but the last, with the server's weights (same preset and seed).

    One jitted program for every sequence the tests check (padded to a multiple of 32 positions; later positions
    never reach earlier ones): run eagerly, each new length dispatched and compiled the model op by op again
    (28-40 s a length on a loaded 2-core host: 120 s for the routed-experts test; CI time)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from k3jax.cache import FreshView
    from k3jax.runtime import load_model

    model = load_model(MODEL)

    @jax.jit
    def run(params, ids, n):  # ids [1, T] (n real), n [] int32
        m = nnx.merge(model.graphdef, params)
        trace, hidden = [], []
        m.run(ids, FreshView(model.cfg, ids.shape[1]), n[None], False, trace=trace, hidden=hidden)
        return jnp.stack(trace, 1), m.norm(hidden[0])[0]  # [T, layers, k] (tokens flat), [T, H]

    def forward(seq):
        n = len(seq) - 1
        ids = np.zeros((1, -(-n // 32) * 32), np.int32)
        ids[0, :n] = seq[:-1]
        routed, hidden = run(model.params, jnp.asarray(ids), jnp.asarray(n, jnp.int32))
        return np.asarray(routed)[:n], np.asarray(hidden)[:n]

    forward.cfg = model.cfg
    return forward


def n_tokens(http, text: str) -> int:
    return http.post("/tokenize", json={"prompt": text}).json()["count"]


def test_a_server_not_ready_in_time_is_stopped(tmp_path, monkeypatch):
    """A server that misses START_TIMEOUT (a loaded CI host) fails its fixture and is stopped: it was left running,
    still compiling beside the tests that followed (and the next server, started for them, came up slower)."""
    started, popen = [], subprocess.Popen

    def never_ready(cmd, **kw):  # a process that never answers /health (and ends on SIGINT, also where it is ignored)
        code = "import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); time.sleep(120)"
        started.append(popen([sys.executable, "-c", code], **kw))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", never_ready)
    monkeypatch.setattr(sys.modules[__name__], "START_TIMEOUT", 0.5)
    with pytest.raises(RuntimeError, match="not ready after"):
        Server([], str(tmp_path), str(tmp_path / "server.log"))
    assert started and started[0].poll() is not None


# ---- health, models, tokenize ---------------------------------------------------------------------

def test_health_is_503_while_warming_then_200(server, http):
    assert 503 in server.health_seen and server.health_seen[-1] == 200, server.health_seen
    r = http.get("/health")
    assert r.status_code == 200
    assert http.get("/ping").json() == http.post("/ping").json() == r.json()  # SageMaker's route


def test_models(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert http.get(f"/v1/models/{MODEL}").json()["max_model_len"] == MAX_MODEL_LEN
    r = http.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_tokenize_detokenize_roundtrip(http):
    r = http.post("/tokenize", json={"prompt": "Hello, K3"}).json()
    assert r["count"] == len("Hello, K3".encode()) and r["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello, K3"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2 and 259 in chat["tokens"]  # <|im_user|> of the byte presets' template
    # special tokens kept (vLLM's /detokenize decodes as HF's default does): the rendered prompt comes back whole
    rendered = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert rendered.startswith("<|im_user|>")
    # a prompt's text of a special token is that token (the Kimi tokenizers' encode, vLLM's): a chat the client
    # rendered itself goes in as the template's ids
    assert http.post("/tokenize", json={"prompt": rendered}).json()["tokens"] == chat["tokens"]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "hi"}]
    with_tools = http.post("/tokenize", json={"messages": msgs, "tools": tools}).json()["count"]
    asked = http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "tools": tools, "max_tokens": 1})
    # as a chat request renders them (on this 128-token server, too long: its 400 counts the prompt)
    assert with_tools > chat["count"] and f"request has {with_tools} input tokens" in asked.json()["error"]["message"]
    assert http.post("/detokenize", json={"tokens": [1, 99999]}).status_code == 400
    assert http.post("/tokenize", json={"prompt": "a", "messages": []}).status_code == 400
    # what remote-tokenizer clients (lm-evaluation-harness) send and read
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] and info["model_max_length"] == MAX_MODEL_LEN and info["chat_template"] is None
    # vLLM's add_special_tokens adds what the tokenizer adds: the Kimi tokenizers (and the engine) prepend no [BOS]
    plain = http.post("/tokenize", json={"prompt": "hi", "add_special_tokens": True}).json()["tokens"]
    assert plain == http.post("/tokenize", json={"prompt": "hi"}).json()["tokens"] == [104, 105]


def test_openapi_schema_served(http):
    paths = http.get("/openapi.json").json()["paths"]
    for p in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
              "/detokenize", "/reset_prefix_cache", "/v1/responses/{response_id}"):
        assert p in paths


# ---- completions ----------------------------------------------------------------------------------

def test_completion_usage_logprobs_and_greedy_determinism(client, http):
    prompt = "The quick brown fox"
    a = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    b = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert a.object == "text_completion" and a.model == MODEL
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].finish_reason == "length"
    assert a.usage.prompt_tokens == n_tokens(http, prompt) == len(prompt)
    assert a.usage.completion_tokens == 6 and a.usage.total_tokens == a.usage.prompt_tokens + 6
    lp = a.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(x <= 0 for x in lp.token_logprobs) and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    # usage.prompt_tokens_details.cached_tokens: the prompt tokens resumed from the prefix cache
    long = prompt + " jumps over the lazy dog, and back"  # 53 byte tokens: a prompt-end checkpoint at 32
    first = client.completions.create(model=MODEL, prompt=long, max_tokens=1, temperature=0)
    again = client.completions.create(model=MODEL, prompt=long, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    assert http.post("/reset_prefix_cache").json() == {"reset": True}  # (nothing in flight reads it)
    third = client.completions.create(model=MODEL, prompt=long, max_tokens=1, temperature=0)
    assert third.usage.prompt_tokens_details.cached_tokens == 0 and third.choices[0].text == again.choices[0].text
    assert client.completions.create(model=MODEL, prompt=long, max_tokens=1,
                                     temperature=0).usage.prompt_tokens_details.cached_tokens == 32
    assert http.post("/flush_cache").text == "Cache flushed."  # SGLang's name
    assert client.completions.create(model=MODEL, prompt=long, max_tokens=1,
                                     temperature=0).usage.prompt_tokens_details.cached_tokens == 0
    salted = client.completions.create(model=MODEL, prompt=long, max_tokens=1, temperature=0,
                                       extra_body={"cache_salt": "tenant-a"})  # vLLM's: no sharing across salts
    assert salted.usage.prompt_tokens_details.cached_tokens == 0 and salted.choices[0].text == again.choices[0].text


def test_completion_echo_logprobs_score_the_prompt(http):
    """OpenAI's legacy scoring shape (echo + logprobs, what evaluation harnesses send): the prompt's tokens
    come first with their logprobs (the first null), then the generated ones; vLLM's `prompt_logprobs`
    carries the same numbers with ranks."""
    prompt = "The quick brown fox"
    r = http.post("/v1/completions", json=dict(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                               logprobs=2, ignore_eos=True)).json()
    c = r["choices"][0]
    lp = c["logprobs"]
    assert c["text"].startswith(prompt) and len(lp["tokens"]) == len(prompt) + 1
    assert "".join(lp["tokens"][:len(prompt)]) == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x <= 0 for x in lp["token_logprobs"][1:]) and all(1 <= len(t) <= 3 for t in lp["top_logprobs"][1:])
    # OpenAI's legacy shape: each token's top_logprobs hold it (then the 2 most likely)
    assert all(t[tok] == x for tok, x, t in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]))
    assert lp["text_offset"][:3] == [0, 1, 2]
    v = http.post("/v1/completions", json=dict(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                               prompt_logprobs=1, ignore_eos=True)).json()["choices"][0]
    pl = v["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(prompt)
    for k in range(1, len(prompt)):
        entry = pl[k][str(ord(prompt[k]))]  # byte tokenizer: id = byte
        assert entry["logprob"] == pytest.approx(lp["token_logprobs"][k], abs=1e-5) and entry["rank"] >= 1
    # max_tokens 0 with echo (OpenAI's; lm-evaluation-harness's log-likelihood request): the prompt alone, scored
    body = dict(model=MODEL, prompt=prompt, max_tokens=0, temperature=0, echo=True, logprobs=2)
    z = http.post("/v1/completions", json=body).json()["choices"][0]
    assert z["text"] == prompt and z["finish_reason"] == "length"
    assert z["logprobs"]["tokens"] == lp["tokens"][:len(prompt)]
    assert z["logprobs"]["token_logprobs"] == lp["token_logprobs"][:len(prompt)]
    streamed = [json.loads(line[6:]) for line in http.post("/v1/completions", json={**body, "stream": True}).text
                .splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in streamed) == prompt
    assert sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in streamed) == len(prompt)
    r = http.post("/v1/completions", json={**body, "echo": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    err = http.post("/v1/completions", json=dict(model=MODEL, prompt=prompt, prompt_logprobs=21)).json()["error"]
    assert err["param"] == "prompt_logprobs"
    chat = http.post("/v1/chat/completions", json=dict(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=3, prompt_logprobs=0, allowed_token_ids=[65, 66],
                                                       truncate_prompt_tokens=4)).json()
    assert len(chat["prompt_logprobs"]) == 4 and chat["prompt_logprobs"][0] is None
    assert set(chat["choices"][0]["message"]["content"]) <= {"A", "B"} and chat["usage"]["prompt_tokens"] == 4


def test_completion_seed_reproducible_and_n(client):
    kw = dict(model=MODEL, prompt="seeded", max_tokens=5, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    c = client.completions.create(n=3, **kw)
    assert sorted(ch.index for ch in c.choices) == [0, 1, 2]
    assert c.usage.completion_tokens == 15 and c.usage.prompt_tokens == len("seeded")


def test_completion_batch_prompts(client):
    r = client.completions.create(model=MODEL, prompt=["ab", "cde"], max_tokens=3, temperature=0, n=2,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12
    # token-id prompts are accepted too
    t = client.completions.create(model=MODEL, prompt=[72, 105], max_tokens=2, temperature=0)
    assert t.usage.prompt_tokens == 2


def test_completion_prompt_embeds(client, http, limited):
    """vLLM's `prompt_embeds`: the embedding table's rows of a prompt, sent as base64 .npy, answer as the
    token prompt does (greedy); embeddings choices come before `prompt`'s; streamed too; faults are 400s
    naming the field; a server without --enable-prompt-embeds refuses them."""
    from k3jax.runtime import load_model
    from serve.prompt_embeds import encode_b64

    table = np.asarray(load_model(MODEL).params["embed_tokens"][...])  # the server's weights (same seed)
    ids = [72, 105, 33, 44, 90, 101, 7]
    kw = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    want = client.completions.create(prompt=ids, **kw).choices[0].text
    vec = encode_b64(table[ids])
    r = client.completions.create(prompt="", **{**kw, "extra_body": {"ignore_eos": True, "prompt_embeds": vec}})
    assert r.choices[0].text == want and r.usage.prompt_tokens == len(ids)
    other = encode_b64(np.random.default_rng(3).standard_normal((4, table.shape[1])).astype(np.float32))
    r = client.completions.create(prompt=[[72, 105]], **{**kw, "extra_body": {"ignore_eos": True,
                                                                              "prompt_embeds": [vec, other]}})
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(texts) == 3 and texts[0] == want and r.usage.prompt_tokens == len(ids) + 4 + 2
    assert texts[2] == client.completions.create(prompt=[72, 105], **kw).choices[0].text
    stream = client.completions.create(prompt="", stream=True, **{**kw, "extra_body": {"ignore_eos": True,
                                                                                       "prompt_embeds": vec}})
    assert "".join(c.choices[0].text for c in stream if c.choices) == want
    for body, param in [({"prompt_embeds": encode_b64(table[ids][:, :5])}, "prompt_embeds"),
                        ({"prompt_embeds": "%%%"}, "prompt_embeds"),
                        ({"prompt_embeds": vec, "echo": True}, "echo"),
                        ({"prompt_embeds": vec, "prompt_logprobs": 1}, "prompt_logprobs"),
                        ({}, "prompt")]:
        got = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 2, **body})
        assert got.status_code == 400 and got.json()["error"]["param"] == param, (body, got.text)
    got = _post(limited, "k-open", {"model": MODEL, "prompt_embeds": vec, "max_tokens": 2})
    assert got.status_code == 400 and "without --enable-prompt-embeds" in got.json()["error"]["message"]

    # chat (vLLM's `prompt_embeds` content parts): the template is rendered around the vectors
    words = [72, 101, 108, 108, 111, 33]  # "Hello!" in the byte tokenizer: one token per character
    text_chat = client.chat.completions.create(messages=[{"role": "user", "content": "Say: Hello!"}],
                                               **{**kw, "extra_body": {"ignore_eos": True, "return_token_ids": True}})
    parts = [{"type": "text", "text": "Say: "}, {"type": "prompt_embeds", "data": encode_b64(table[words])}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": parts}],
                                                "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                                "return_token_ids": True})
    assert r.status_code == 200, r.text
    emb_chat = r.json()
    assert emb_chat["choices"][0]["message"]["content"] == text_chat.choices[0].message.content
    assert emb_chat["usage"]["prompt_tokens"] == text_chat.usage.prompt_tokens and emb_chat["prompt_token_ids"] == []
    tok = http.post("/tokenize", json={"messages": [{"role": "user", "content": parts}]})
    assert tok.status_code == 400 and "/v1/chat/completions only" in tok.json()["error"]["message"]
    got = _post(limited, "k-open", {"model": MODEL, "messages": [{"role": "user", "content": parts}]},
                "/v1/chat/completions")
    assert got.status_code == 400 and "--enable-prompt-embeds" in got.json()["error"]["message"]


def test_hidden_states_over_generate(http, full_forward):
    """`return_hidden_states` (the server started with --enable-return-hidden-states): SGLang's list in
    `meta_info.hidden_states` once finished -- the prompt positions' rows as one [P, H] list, then one [H] row per
    generated token but the last -- equal to a full forward's final hidden states after the norm; streamed, in
    the finishing object only; absent unless asked."""
    width = full_forward.cfg.hidden_size
    prompt = [72, 105, 33, 7, 90]
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = http.post("/generate", json={"input_ids": prompt, "sampling_params": sp, "return_hidden_states": True})
    assert r.status_code == 200, r.text
    g = r.json()
    hs = g["meta_info"]["hidden_states"]
    assert len(hs) == 1 + len(g["output_ids"]) - 1 and np.shape(hs[0]) == (len(prompt), width)
    got = np.concatenate([np.asarray(hs[0]), np.asarray(hs[1:]).reshape(-1, width)])
    np.testing.assert_allclose(got, full_forward(prompt + g["output_ids"])[1], atol=1e-4)
    assert "hidden_states" not in http.post("/generate", json={"input_ids": prompt, "sampling_params": sp}
                                            ).json()["meta_info"]
    body = {"input_ids": prompt, "stream": True, "sampling_params": sp, "return_hidden_states": True}
    with http.stream("POST", "/generate", json=body) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert [("hidden_states" in c["meta_info"]) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    np.testing.assert_allclose(chunks[-1]["meta_info"]["hidden_states"][0], hs[0], atol=1e-5)


def test_routed_experts_over_generate_completions_and_chat(http, limited, full_forward):
    """`return_routed_experts` (the server started with --enable-return-routed-experts): base64 of the int32 ids
    [positions, MoE layers, k] of each finished sequence, = a full forward's. /generate: `meta_info.routed_experts`;
    /v1/completions and /v1/chat/completions: each finished choice's `sgl_ext.routed_experts` (SGLang's); from
    `routed_experts_start_len`; streamed, in the finishing object or chunk only; 400 naming the field where it is
    off or with beam search."""
    import base64

    cfg = full_forward.cfg
    layers = sum(cfg.is_moe(l) for l in range(cfg.num_hidden_layers))

    def decode(b64):
        return np.frombuffer(base64.b64decode(b64), "<i4").reshape(-1, layers, cfg.num_experts_per_token)

    def forward(seq):  # every position but the last, through a full forward: [T - 1, layers, k]
        return full_forward(seq)[0]

    prompt = [72, 105, 33, 7]
    sp = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    r = http.post("/generate", json={"input_ids": prompt, "sampling_params": sp, "return_routed_experts": True})
    assert r.status_code == 200, r.text
    g = r.json()
    got = decode(g["meta_info"]["routed_experts"])
    np.testing.assert_array_equal(got, forward(prompt + g["output_ids"]))
    tail = http.post("/generate", json={"input_ids": prompt, "sampling_params": sp,
                                        "return_routed_experts": True, "routed_experts_start_len": 3}).json()
    assert base64.b64decode(tail["meta_info"]["routed_experts"]) == got[3:].tobytes()
    assert "routed_experts" not in http.post("/generate", json={"input_ids": [72, 105], "sampling_params": sp}
                                             ).json()["meta_info"]
    body = {"input_ids": prompt, "stream": True, "sampling_params": sp, "return_routed_experts": True}
    with http.stream("POST", "/generate", json=body) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert [("routed_experts" in c["meta_info"]) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1]["meta_info"]["routed_experts"] == g["meta_info"]["routed_experts"]

    # completions: the same greedy sequence (same ids); n = 2 sampled choices, each its own sequence's ids
    c = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                                           "return_routed_experts": True, "routed_experts_start_len": 2}).json()
    np.testing.assert_array_equal(decode(c["choices"][0]["sgl_ext"]["routed_experts"]), got[2:])
    c = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 2,
                                           "return_token_ids": True, "return_routed_experts": True}).json()
    for ch in c["choices"]:
        np.testing.assert_array_equal(decode(ch["sgl_ext"]["routed_experts"]), forward(prompt + ch["token_ids"]))
    assert "sgl_ext" not in http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).json()["choices"][0]
    with http.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                                      "ignore_eos": True, "stream": True,
                                                      "return_routed_experts": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert [("sgl_ext" in ch["choices"][0]) for ch in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"][0]["sgl_ext"]["routed_experts"] == g["meta_info"]["routed_experts"]

    # chat: the rendered prompt and the answer, full and streamed
    msgs = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "return_routed_experts": True}
    ch = http.post("/v1/chat/completions", json=msgs).json()
    want = forward(ch["prompt_token_ids"] + ch["choices"][0]["token_ids"])
    np.testing.assert_array_equal(decode(ch["choices"][0]["sgl_ext"]["routed_experts"]), want)
    with http.stream("POST", "/v1/chat/completions", json={**msgs, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    ext = [ch["choices"][0]["sgl_ext"] for ch in chunks if ch["choices"] and "sgl_ext" in ch["choices"][0]]
    assert len(ext) == 1 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    np.testing.assert_array_equal(decode(ext[0]["routed_experts"]), want)

    beam = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "n": 2, "use_beam_search": True,
                                              "return_routed_experts": True})
    assert beam.status_code == 400 and beam.json()["error"]["param"] == "return_routed_experts"
    for route, extra in (("/generate", {"input_ids": [72, 105]}), ("/v1/completions", {"prompt": [72, 105]})):
        off = _post(limited, "k-open", {**extra, "return_routed_experts": True}, route)
        assert off.status_code == 400 and off.json()["error"]["param"] == "return_routed_experts", route


def test_sglang_generate_matches_the_completions_api(http):
    """SGLang's native /generate (serve/sglang_api.py): the same greedy tokens and logprobs as
    /v1/completions for text, token ids and vectors; a batch is a list with ids per item; finish reasons in
    SGLang's shape; logprob entries [logprob, id, text]; prompt logprobs from logprob_start_len."""
    from k3jax.runtime import load_model

    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    want = http.post("/v1/completions", json={"model": MODEL, "prompt": [72, 105, 33], "max_tokens": 6,
                                               "temperature": 0, "ignore_eos": True, "logprobs": 2,
                                               "return_token_ids": True, "prompt_logprobs": 2}).json()["choices"][0]
    r = http.post("/generate", json={"input_ids": [72, 105, 33], "sampling_params": sp, "return_logprob": True,
                                     "top_logprobs_num": 2, "logprob_start_len": 1, "return_text_in_logprobs": True})
    assert r.status_code == 200, r.text
    g = r.json()
    meta = g["meta_info"]
    assert g["text"] == want["text"] and g["output_ids"] == want["token_ids"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (3, 6) and meta["e2e_latency"] > 0
    assert [e[1] for e in meta["output_token_logprobs"]] == want["token_ids"]
    np.testing.assert_allclose([e[0] for e in meta["output_token_logprobs"]], want["logprobs"]["token_logprobs"],
                               rtol=1e-6)
    assert [e[2] for e in meta["output_token_logprobs"]] == want["logprobs"]["tokens"]
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    # prompt logprobs from position 1: tokens 105 and 33, as vLLM's prompt_logprobs score them
    assert [e[1] for e in meta["input_token_logprobs"]] == [105, 33]
    np.testing.assert_allclose([e[0] for e in meta["input_token_logprobs"]],
                               [want["prompt_logprobs"][k][str(t)]["logprob"] for k, t in ((1, 105), (2, 33))],
                               rtol=1e-6)
    # text, vectors (the embedding table's rows) and a batch
    table = np.asarray(load_model(MODEL).params["embed_tokens"][...])
    one = http.post("/generate", json={"text": "Hi!", "sampling_params": sp}).json()
    vec = http.post("/generate", json={"input_embeds": table[[72, 105, 33]].tolist(), "sampling_params": sp}).json()
    assert one["output_ids"] == vec["output_ids"] == want["token_ids"]
    batch = http.post("/generate", json={"input_ids": [[72, 105, 33], [1, 2]], "rid": "mine",
                                         "sampling_params": {**sp, "n": 2}}).json()
    assert [b["meta_info"]["id"] for b in batch] == ["mine_0", "mine_1", "mine_2", "mine_3"]
    assert batch[0]["output_ids"] == batch[1]["output_ids"] == want["token_ids"]  # greedy: the samples agree
    # a stop token and a stop string, in SGLang's finish shape; the stream's objects are cumulative
    stop_id = want["token_ids"][2]
    stop = {**sp, "stop_token_ids": [stop_id], "ignore_eos": False}
    got = http.post("/generate", json={"input_ids": [72, 105, 33], "sampling_params": stop}).json()
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert http.get("/health_generate").json()["status"] == "ok"
    info = http.get("/get_model_info").json()
    assert info["model_path"] == MODEL and info["is_generation"] and info["model_type"] == "kimi_k3"
    server = http.get("/server_info").json()
    assert server == {**http.get("/get_server_info").json(), "internal_states": server["internal_states"]}
    assert (server["context_length"], server["max_running_requests"]) == (MAX_MODEL_LEN, CAPACITY)
    state = server["internal_states"][0]  # idle: no running request, cached prefixes count as reclaimable
    assert state["num_running_reqs"] == 0 and state["token_usage"] == 0.0 and server["max_total_num_tokens"] > 0
    body = {"input_ids": [72, 105, 33], "stream": True, "sampling_params": sp}
    with http.stream("POST", "/generate", json=body) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and chunks[-1]["output_ids"] == want["token_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1]) and chunks[-1]["text"] == want["text"]
    assert all(len(a["output_ids"]) < len(b["output_ids"]) for a, b in zip(chunks, chunks[1:]))
    for body, param in [({"text": "x", "image_data": "a.png"}, "image_data"),
                        ({"text": "x", "input_ids": [1]}, "input_ids"),
                        ({"text": "x", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
                        ({"text": "x", "sampling_params": {"max_new_tokens": 2, "json_schema": "{}", "regex": "a"}},
                         "sampling_params"),
                        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 500}}, "max_new_tokens")]:
        r = http.post("/generate", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_completion_stream_matches_non_stream(client):
    kw = dict(model=MODEL, prompt="Streaming test", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == len("Streaming test")


def test_streamed_samples_each_carry_the_prompt_logprobs(http):
    """n > 1, streamed: every sample's first chunk has the prompt's logprobs -- vLLM's `prompt_logprobs`, and with
    `echo` + `logprobs` the prompt's tokens ahead of the sample's own -- as the whole answer has them (the engine
    sends them in a request's first output only, which one sample alone receives)."""
    for extra in ({"prompt_logprobs": 1}, {"echo": True, "logprobs": 1}):
        body = {"prompt": ["Hi there", "Yo"], "max_tokens": 3, "n": 2, "seed": 3, "temperature": 1.0, **extra}
        whole = http.post("/v1/completions", json=body).json()["choices"]
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        assert len(whole) == 4
        for c in whole:
            mine = [ch for chunk in chunks for ch in chunk["choices"] if ch["index"] == c["index"]]
            if "prompt_logprobs" in extra:
                assert mine[0]["prompt_logprobs"] == c["prompt_logprobs"] and c["prompt_logprobs"], c["index"]
            else:
                lp = {k: sum((ch["logprobs"][k] for ch in mine if ch["logprobs"]), [])
                      for k in ("tokens", "token_logprobs", "text_offset")}
                echoed = len(c["logprobs"]["tokens"]) - 3
                assert echoed >= 2 and lp["tokens"] == c["logprobs"]["tokens"], c["index"]
                assert lp["token_logprobs"] == c["logprobs"]["token_logprobs"]
                assert lp["text_offset"][:echoed + 1] == c["logprobs"]["text_offset"][:echoed + 1]


def test_a_stream_of_more_prompts_than_rows_starts_at_once(http):
    """A streamed batch of more prompts than the engine runs at once: its first chunk comes as soon as the engine
    has taken every prompt (queued or running), not only once each has output -- prompts waiting for a row to
    free up are still waiting when it arrives."""
    body = {"prompt": [f"p{i}" for i in range(2 * CAPACITY)], "max_tokens": 64, "ignore_eos": True,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(x for x in lines if x.startswith("data: {"))
        waiting = metric(http.get("/metrics").text, "vllm:num_requests_waiting")
        done = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert waiting > 0
    assert sum(1 for c in done for ch in c["choices"] if ch["finish_reason"] == "length") == 2 * CAPACITY


def test_stop_string_ends_text(client):
    kw = dict(model=MODEL, prompt="stop here", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    g = client.completions.create(**kw).choices[0].text
    cands = [ch for ch in g[1:] if ch.isprintable() and ch != "\ufffd"]
    if not cands:
        pytest.skip(f"greedy text {g!r} has no printable character to stop at")
    stop = cands[0]
    r = client.completions.create(stop=[stop], **kw).choices[0]
    assert r.text == g[:g.index(stop)] and r.finish_reason == "stop"


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(http):
    """vLLM's `return_tokens_as_token_ids`: logprob tokens are 'token_id:{id}' (echoed prompt tokens too), the
    ids the choice returns; chat entries' bytes are those of that name; text offsets still count text."""
    prompt = "The quick"
    body = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2, ignore_eos=True,
                return_token_ids=True, return_tokens_as_token_ids=True)
    c = http.post("/v1/completions", json=body).json()["choices"][0]
    lp = c["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in c["prompt_token_ids"] + c["token_ids"]]
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"][1:] for k in top)
    assert lp["text_offset"][:3] == [0, 1, 2]
    plain = http.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()["choices"][0]
    assert "".join(plain["logprobs"]["tokens"][:len(prompt)]) == prompt
    chat = http.post("/v1/chat/completions", json=dict(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0, logprobs=True,
        top_logprobs=2, ignore_eos=True, return_token_ids=True, return_tokens_as_token_ids=True)).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert all(e["bytes"] == list(e["token"].encode()) and e["top_logprobs"][0]["token"].startswith("token_id:")
               for e in content)


# ---- chat -----------------------------------------------------------------------------------------

def test_chat_non_stream_and_stream(client, http):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello!"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True}, logprobs=True, top_logprobs=2)
    assert full.object == "chat.completion"
    ch = full.choices[0]
    assert ch.message.role == "assistant" and ch.finish_reason == "length"
    assert len(ch.logprobs.content) == 6 and len(ch.logprobs.content[0].top_logprobs) == 2
    want_prompt = http.post("/tokenize", json={"messages": msgs}).json()["count"]
    assert full.usage.prompt_tokens == want_prompt and full.usage.completion_tokens == 6
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ch.message.content
    assert chunks[-1].usage.prompt_tokens == want_prompt and chunks[-1].usage.total_tokens == want_prompt + 6


def test_sagemaker_invocations_route_by_body_and_server_load(http):
    """SageMaker's /invocations (vLLM serves it): a chat body answers as /v1/chat/completions, a prompt body as
    /v1/completions (streamed too); anything else is a 400. vLLM's GET /load: HTTP requests in flight."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    want = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    got = http.post("/invocations", json=chat).json()
    assert got["object"] == "chat.completion" and got["choices"][0]["message"]["content"] == want
    comp = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    want = http.post("/v1/completions", json=comp).json()["choices"][0]["text"]
    assert http.post("/invocations", json=comp).json()["choices"][0]["text"] == want
    streamed = http.post("/invocations", json={**comp, "stream": True}).text
    assert streamed.rstrip().endswith("data: [DONE]") and '"text_completion"' in streamed
    assert _err(http.post("/invocations", json={"input": "Hi"}), 400)["param"] == "messages"
    assert _err(http.post("/invocations", json={**chat, "max_tokens": 0}), 400)["param"] == "max_tokens"
    assert _err(http.post("/invocations", content=b"{oops", headers={"content-type": "application/json"}),
                400)["message"].startswith("malformed JSON body")
    assert http.get("/load").json() == {"server_load": 0}


def test_responses_logprobs_whole_and_streamed(http):
    """include=["message.output_text.logprobs"] with top_logprobs: the answer's tokens, as chat gives them for the
    same conversation; streamed, the deltas carry them and the final objects repeat them."""
    lp = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}
    body = {"input": "Hello!", "max_output_tokens": 6, "temperature": 0}
    part = http.post("/v1/responses", json={**body, **lp}).json()["output"][-1]["content"][0]
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 6,
                                                   "temperature": 0, "logprobs": True, "top_logprobs": 2}).json()
    want = chat["choices"][0]["logprobs"]["content"]
    assert part["text"] == chat["choices"][0]["message"]["content"] and len(want) == 6
    assert [(e["token"], e["bytes"]) for e in part["logprobs"]] == [(e["token"], e["bytes"]) for e in want]
    np.testing.assert_allclose([e["logprob"] for e in part["logprobs"]], [e["logprob"] for e in want], atol=1e-5)
    assert all(len(e["top_logprobs"]) == 2 for e in part["logprobs"])
    events = []
    with http.stream("POST", "/v1/responses", json={**body, **lp, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    streamed = [x for e in events if e["type"] == "response.output_text.delta" for x in e["logprobs"]]
    assert [x["token"] for x in streamed] == [x["token"] for x in part["logprobs"]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == streamed == events[-1]["response"]["output"][-1]["content"][0]["logprobs"]
    plain = http.post("/v1/responses", json=body).json()["output"][-1]["content"][0]
    assert plain["logprobs"] == [] and plain["text"] == part["text"]
    r = http.post("/v1/responses", json={**body, "include": ["file_search_call.results"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "include"


def test_chat_continue_final_message(http):
    """vLLM's continue_final_message: the prompt ends with the open assistant message (its text, no end
    marker) and the answer continues it; with add_generation_prompt left on, a 400 naming the field."""
    msgs = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Sure, the"}]
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    ids = http.post("/tokenize", json={"messages": msgs, **cont}).json()["tokens"]
    closed = http.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()["tokens"]
    assert len(closed) > len(ids) and closed[:len(ids)] == ids  # only the end-of-turn marker(s) differ
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"].endswith("Sure, the")
    r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "temperature": 0,
                                                "ignore_eos": True, **cont}).json()
    assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == 4
    bad = http.post("/v1/chat/completions", json={"messages": msgs, "continue_final_message": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"


def test_chat_n_and_max_completion_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2,
                                       max_completion_tokens=3, seed=7, extra_body={"ignore_eos": True})
    assert len(r.choices) == 2 and r.usage.completion_tokens == 6


def test_chat_beam_search_through_the_openai_client(client):
    """vLLM's `use_beam_search` on the real server (the CLI's engine, drafts on): n = 2 hypotheses,
    distinct, best first, each max_tokens long; streamed, the same choices arrive when the search ends."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "beams"}], n=2, max_completion_tokens=4,
              extra_body={"use_beam_search": True, "ignore_eos": True, "skip_special_tokens": False})
    r = client.chat.completions.create(**kw)
    texts = [c.message.content for c in r.choices]
    assert len(texts) == 2 and texts[0] != texts[1] and r.usage.completion_tokens == 8
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    streamed = ["", ""]
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts


# ---- errors -----------------------------------------------------------------------------------------

def _err(r, status):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return body


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 2, "bogus": 1}, "bogus"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -7}, "top_k"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),  # engine allows up to max_logprobs (20)
    ({"prompt": "x", "seed": 2 ** 63}, "seed"),  # (-1 is no seed, as vLLM; any 64-bit integer is one)
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 2, "allowed_token_ids": [65], "stop_token_ids": [65]},
     "allowed_token_ids"),  # (nothing but stop tokens under min_tokens: nothing to sample)
    ({"prompt": "x", "bad_words": [" "]}, "bad_words"),
    ({"prompt": [], "max_tokens": 1}, "prompt"),
    ({"prompt": [5, 100000]}, "prompt"),
    ({"max_tokens": 1}, "prompt"),
    ({"prompt": "x", "vllm_xargs": {"no_repeat_ngram_size": "two"}}, "vllm_xargs"),
    ({"prompt": "x", "vllm_xargs": {"no_repeat_ngram_size": 40}}, "vllm_xargs"),
    ({"prompt": "x", "vllm_xargs": ["no_repeat_ngram_size"]}, "vllm_xargs"),
])
def test_bad_requests_are_400_with_openai_body(http, body, param):
    err = _err(http.post("/v1/completions", json=body), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_vllm_xargs_turn_on_the_servers_logits_processor(http):
    """`--logits-processors no_repeat_ngram`: a request with `vllm_xargs` never repeats a bigram of prompt +
    output (through n-gram drafts and their verify steps on this server); one without is untouched."""
    a = http.post("/tokenize", json={"prompt": "a"}).json()["tokens"][0]
    body = {"prompt": "abcabc", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logit_bias": {str(a): 30},
            "return_token_ids": True}
    plain = http.post("/v1/completions", json=body).json()
    assert plain["choices"][0]["text"].startswith("aaa")  # the bias alone repeats
    r = http.post("/v1/completions", json={**body, "vllm_xargs": {"no_repeat_ngram_size": 2}}).json()
    prompt, out = r["choices"][0]["prompt_token_ids"], r["choices"][0]["token_ids"]
    seq = prompt + out
    assert len(out) == 16
    for j in range(len(prompt), len(seq)):  # no output token completes a bigram seen before it (HF's rule)
        assert (seq[j - 1], seq[j]) not in set(zip(seq[:j - 1], seq[1:j])), (j, seq)


def test_malformed_json_and_wrong_content(http):
    _err(http.post("/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"}),
         400)
    _err(http.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}), 400)
    _err(http.post("/v1/chat/completions", json={"messages": []}), 400)
    _err(http.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}), 400)
    _err(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                "tools": [{"type": "function"}]}), 400)
    _err(http.get("/v1/nothing-here"), 404)
    surrogate = b'{"prompt": "a\\ud800b", "max_tokens": 2}'  # valid JSON, a lone surrogate: no UTF-8 text to tokenize
    assert _err(http.post("/v1/completions", content=surrogate, headers={"content-type": "application/json"}),
                400)["param"] == "prompt"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}  # not a JSON string
    err = _err(http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "c1", "content": "42"}],
        "tools": [{"type": "function", "function": {"name": "f"}}], "max_tokens": 2}), 400)
    assert "arguments must be a JSON string" in err["message"]
    err = _err(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "prompt_logprobs": 1, "stream": True}), 400)
    assert err["param"] == "prompt_logprobs"  # (vLLM's rule; not streamed they come whole)


def test_beam_search_length_penalty_at_the_float_limits(http):
    """n ** length_penalty beyond a float (overflow) or below it (0): the score takes its limit; the request is
    answered and the engine, which runs the beams' bookkeeping for every request, keeps serving."""
    with http.stream("POST", "/v1/completions", json={"prompt": "other", "max_tokens": 24, "ignore_eos": True,
                                                      "stream": True}) as other:
        for penalty in (1000.0, -1000.0):
            r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "use_beam_search": True, "n": 2,
                                                   "length_penalty": penalty})
            assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
        events = [json.loads(x[6:]) for x in other.iter_lines() if x.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_unknown_model_404(client, http):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert _err(http.post("/v1/chat/completions", json={"model": "x", "messages": [{"role": "user", "content": "a"}]}),
                404)["code"] == "model_not_found"


def test_prompt_over_context_window_names_both_numbers(http):
    err = _err(http.post("/v1/completions", json={"prompt": "a" * 100, "max_tokens": 50}), 400)
    # vLLM's wording, which clients parse to lower max_tokens and retry
    assert err["message"] == (f"'max_tokens' or 'max_completion_tokens' is too large: 50. This model's maximum "
                              f"context length is {MAX_MODEL_LEN} tokens and your request has 100 input tokens "
                              f"(50 > {MAX_MODEL_LEN} - 100).")
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    err = _err(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 300}]}), 400)
    assert str(MAX_MODEL_LEN) in err["message"] and re.search(r"\b3\d\d\b", err["message"])


def test_oversized_body_413(http):
    err = _err(http.post("/v1/completions", json={"prompt": "a" * (2 << 20)}), 413)
    assert err["code"] == "request_too_large"


# ---- metrics --------------------------------------------------------------------------------------

def test_metrics_has_every_metric(server, client):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3)
    text = server.metrics()
    missing = [n for n in NAMES if n not in text]
    assert not missing, missing
    for n in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds",
              "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens_total",
              "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
              "vllm:kv_cache_usage_perc", "k3jax:expert_tokens_total", "k3jax:moe_dispatch_seconds_total",
              "k3jax:inter_rank_bytes_total", "k3jax:kda_slot_usage_perc", "k3jax:mla_page_usage_perc",
              "k3jax:kda_checkpoint_hits_total", "k3jax:kda_checkpoint_misses_total",
              "k3jax:compiles_after_warmup"):
        assert f"# TYPE {n} " in text or f"# TYPE {n.removesuffix('_total')} " in text, n
    assert metric(text, "vllm:time_to_first_token_seconds_count") >= 1
    assert metric(text, "vllm:generation_tokens_total") >= 3
    # vLLM's cache_config_info: the cache as built, in labels (a 32 MiB arena of 16-token pages, byte tokens)
    info = metric(text, "vllm:cache_config_info", block_size="16", cache_dtype="auto", kda_state_dtype="float32",
                  enable_prefix_caching="True", gpu_memory_utilization="")
    line = next(l for l in text.splitlines() if l.startswith("vllm:cache_config_info{"))
    units, unit_bytes = (int(re.search(f'{k}="([0-9]+)"', line).group(1)) for k in ("num_gpu_blocks", "unit_bytes"))
    assert info == 1 and 0.9 * (32 << 20) < units * unit_bytes <= 32 << 20
    # the statistics line (serve/stats_logger.py, every second here) while requests ran: its next tick may still be
    # due when this file's first request was this one (run alone), so wait for it (up to 30 s)
    line = r"generation [0-9.]+ tokens/s, running [0-9]+ reqs, waiting [0-9]+ reqs, cache [0-9.]+% used"
    for _ in range(300):
        if re.search(line, server.tail()):
            break
        time.sleep(0.1)
    assert re.search(line, server.tail()), server.tail()
    assert metric(text, "k3jax:inter_rank_bytes_total") == 0
    assert metric(text, "k3jax:eplb_rebalances_total") == 0 and metric(text, "k3jax:expert_load_imbalance") == 1
    assert metric(text, "k3jax:moe_dispatch_seconds_total") > 0  # measured per step shape at warm-up
    if "k3jax:expert_tokens_total{" in text:  # per-expert counts, once the engine reports them
        assert metric(text, "k3jax:expert_tokens_total") > 0
    assert metric(text, "k3jax:compiles_after_warmup") == 0


def test_speculative_drafts_are_verified_and_counted(server, http):
    """A prompt that repeats itself gives the n-gram proposer matches: drafts are verified (counted in
    vLLM's metrics), and the streamed text equals the whole answer."""
    before = server.metrics()
    drafted0 = metric(before, "vllm:spec_decode_num_draft_tokens_total")
    body = {"model": MODEL, "prompt": "abc abc abc abc abc abc abc", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole
    after = server.metrics()
    assert metric(after, "vllm:spec_decode_num_draft_tokens_total") > drafted0
    assert metric(after, "vllm:spec_decode_num_accepted_tokens_total") <= metric(
        after, "vllm:spec_decode_num_draft_tokens_total")
    assert metric(after, "k3jax:compiles_after_warmup") == 0


# ---- schemathesis -----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_finds_no_server_errors(server, mode):
    """Every operation of the served schema, 15 generated requests each (positive: valid by the
    schema; negative: violating it). Sizes are clamped so generation stays CPU-cheap."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures, statuses = [], []

    def clamp(body):
        if not isinstance(body, dict):
            return
        if mode == "positive":
            body.pop("model", None)  # a random model id is a 404; let the rest reach the engine
        for k in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(k), int) and not isinstance(body.get(k), bool) and body[k] > 4:
                body[k] = 4
        if "messages" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 4
        if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 2:
            body["n"] = 2

    for result in schema.get_all_operations():
        op = result.ok()

        @settings(max_examples=15, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=GenerationMode(mode)))
        def run(case):
            clamp(case.body)
            resp = case.call(base_url=server.url, timeout=60)
            statuses.append(resp.status_code)
            if resp.status_code >= 500:
                failures.append((case.method, case.path, case.body, resp.status_code, resp.text[:300]))

        try:
            run()
        except Unsatisfiable:  # nothing to violate (e.g. GET without parameters in negative mode)
            pass
    assert not failures, failures[:3]
    assert len(statuses) >= 60
    if mode == "positive":
        assert any(s == 200 for s in statuses)
    else:
        assert all(400 <= s < 500 for s in statuses), sorted(set(statuses))
    assert httpx.get(server.url + "/health").status_code == 200
    assert metric(server.metrics(), "k3jax:compiles_after_warmup") == 0


# ---- load with disconnects ----------------------------------------------------------------------------

def test_load_with_disconnects_leaves_server_healthy_and_arena_at_baseline(server):
    rng = random.Random(0)
    n_req, n_drop = 64, 16
    drop = set(rng.sample(range(n_req), n_drop))

    async def one(c: httpx.AsyncClient, i: int):
        body = {"model": MODEL, "prompt": f"load test {i} " * rng.randint(1, 4), "max_tokens": rng.randint(4, 10),
                "stream": True, "temperature": 0.8, "seed": i, "ignore_eos": True}
        if i in drop and i % 4 == 0:  # disconnect before the response starts (while queued / prefilling)
            task = asyncio.ensure_future(c.post("/v1/completions", json=body))
            await asyncio.sleep(rng.uniform(0.0, 0.5))
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, httpx.HTTPError):
                pass
            return "dropped"
        stop_after = rng.randint(0, 4) if i in drop else None
        finish, events = None, 0
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if stop_after is not None and events >= stop_after:
                    return "dropped"  # leaving the block closes the connection mid-stream
                events += 1
                if line == "data: [DONE]":
                    break
                ch = json.loads(line[6:])["choices"]
                if ch and ch[0]["finish_reason"]:
                    finish = ch[0]["finish_reason"]
        return finish

    async def main():
        limits = httpx.Limits(max_connections=n_req + 8, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(n_req)))

    before = server.metrics()
    aborted0 = metric(before, "k3jax:requests_aborted_total")
    results = asyncio.run(main())
    kept = [r for i, r in enumerate(results) if i not in drop]
    assert kept == ["length"] * (n_req - n_drop), results

    # Healthy, nothing in flight, the arena back at its baseline (units the prefix cache keeps are
    # reclaimable and count as free), no compiles.
    deadline = time.monotonic() + 30
    while True:
        text = server.metrics()
        free = metric(text, "k3jax:arena_free_units") + metric(text, "k3jax:arena_cached_units")
        idle = (metric(text, "k3jax:api_requests_in_flight") == 0
                and metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:num_requests_waiting") == 0)
        if idle and free == metric(text, "k3jax:arena_baseline_free_units") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, text
    assert free == metric(text, "k3jax:arena_baseline_free_units")
    assert metric(text, "k3jax:compiles_after_warmup") == 0
    assert metric(text, "k3jax:requests_aborted_total") - aborted0 >= 1
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "after", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


# ---- keys, limits, queue ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def limited(server, cache_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    keys = d / "keys.txt"
    keys.write_text("# team keys\nk-open\nk-rpm rpm=2\nk-tpm tpm=60\n")
    s = Server(["--api-key-file", str(keys), "--max-waiting", "1", "--enable-log-requests"], cache_dir,
               str(d / "limited.log"),
               env={"K3JAX_API_KEYS": "k-env1,k-env2"}, options=PLAIN)
    yield s
    s.stop()


def _post(s, key, body, path="/v1/completions"):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(s.url + path, json=body, headers=headers, timeout=60)


def test_api_keys_401(limited):
    _err(httpx.get(limited.url + "/v1/models"), 401)
    _err(httpx.get(limited.url + "/v1/models", headers={"Authorization": "Bearer nope"}), 401)
    _err(httpx.get(limited.url + "/v1/models", headers={"Authorization": "Basic k-open"}), 401)
    assert _post(limited, None, {"prompt": "x", "max_tokens": 1}).status_code == 401
    assert httpx.get(limited.url + "/v1/models", headers={"Authorization": "Bearer k-env2"}).status_code == 200
    assert httpx.get(limited.url + "/health").status_code == 200  # health and metrics stay open
    assert httpx.get(limited.url + "/metrics").status_code == 200
    bad = openai.OpenAI(base_url=limited.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=1)
    good = openai.OpenAI(base_url=limited.url + "/v1", api_key="k-open", max_retries=0)
    assert good.completions.create(model=MODEL, prompt="x", max_tokens=1).usage.completion_tokens == 1


def test_abort_request_reaches_only_the_callers_requests(limited):
    """With API keys, /abort_request ends only the calling key's requests: another key's abort of the same id
    (or abort_all) finds nothing; the owner's ends it."""
    body = dict(model=MODEL, prompt="abc", max_tokens=MAX_MODEL_LEN - 8, temperature=0, ignore_eos=True, stream=True)
    own, other = {"Authorization": "Bearer k-env1"}, {"Authorization": "Bearer k-env2"}
    answers, last = [], None
    with httpx.stream("POST", limited.url + "/v1/completions", json=body, headers={**own, "X-Request-Id": "mine"},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                last = json.loads(line[6:])
                if not answers:
                    for who, req in ((other, {"rid": "mine"}), (other, {"abort_all": True}), (own, {"rid": "mine"})):
                        answers.append(httpx.post(limited.url + "/abort_request", json=req, headers=who,
                                                  timeout=60).json())
    assert answers == [{"aborted": 0}, {"aborted": 0}, {"aborted": 1}]
    assert last["choices"][0]["finish_reason"] == "abort"


def test_requests_per_minute_429(limited):
    for _ in range(2):
        assert _post(limited, "k-rpm", {"prompt": "x", "max_tokens": 1}).status_code == 200
    r = _post(limited, "k-rpm", {"prompt": "x", "max_tokens": 1})
    err = _err(r, 429)
    assert err["code"] == "rate_limit_exceeded" and 1 <= int(r.headers["Retry-After"]) <= 60
    assert _post(limited, "k-open", {"prompt": "x", "max_tokens": 1}).status_code == 200  # other keys unaffected


def test_tokens_per_minute_429(limited):
    err = _err(_post(limited, "k-tpm", {"prompt": "x", "max_tokens": 100}), 429)  # 101 > 60 on its own
    assert "60" in err["message"]
    assert _post(limited, "k-tpm", {"prompt": "xy", "max_tokens": 30, "ignore_eos": True}).status_code == 200
    r = _post(limited, "k-tpm", {"prompt": "xy", "max_tokens": 30})  # 32 used + 32 > 60
    _err(r, 429)
    assert int(r.headers["Retry-After"]) >= 1


def test_full_queue_503_and_recovery(limited):
    """A full queue answers 503 and the server recovers; each refusal counts once in
    `k3jax:http_requests_rejected_total` under its reason (the test sends its own 401 and 429: the counts it read
    came from the tests before it, 0 when it ran alone)."""
    def rejected() -> dict:
        text = limited.metrics()
        return {reason: metric(text, "k3jax:http_requests_rejected_total", reason=reason)
                for reason in ("queue_full", "rate_limit", "auth")}

    before = rejected()
    _err(_post(limited, "wrong", {"prompt": "x", "max_tokens": 1}), 401)
    _err(_post(limited, "k-tpm", {"prompt": "x", "max_tokens": 100}), 429)  # over tpm on its own: charges nothing
    capacity = CAPACITY + 1  # 8 decode rows + max_waiting 1
    err = _err(_post(limited, "k-open", {"prompt": "x", "max_tokens": 1, "n": capacity + 1}), 400)
    assert "n" == err["param"]

    async def main():
        async with httpx.AsyncClient(base_url=limited.url, timeout=120,
                                     headers={"Authorization": "Bearer k-open"}) as c:
            body = {"prompt": "hold the queue", "max_tokens": 100, "n": capacity, "stream": True, "ignore_eos": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                await lines.__anext__()
                full = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                # the long stream is closed here (client disconnect -> abort)
            return full

    full = asyncio.run(main())
    err = _err(full, 503)
    assert err["code"] == "queue_full" and int(full.headers["Retry-After"]) >= 1
    deadline = time.monotonic() + 20
    while metric(limited.metrics(), "k3jax:api_sequences_in_flight") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _post(limited, "k-open", {"prompt": "x", "max_tokens": 1}).status_code == 200
    after = rejected()
    assert {reason: after[reason] - before[reason] for reason in after} == {"queue_full": 1, "rate_limit": 1, "auth": 1}


# ---- structured outputs -------------------------------------------------------------------------------

def test_structured_outputs_over_http(client, http):
    import json as _json
    import re

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    # at most 20 whitespace characters between two JSON tokens: the (deterministic, greedy) value ends
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 126, "temperature": 0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}).json()
    assert "choices" in r, r
    v = _json.loads(r["choices"][0]["text"])
    assert set(v) == {"n", "ok"} and 0 <= v["n"] <= 99 and isinstance(v["ok"], bool)
    assert r["choices"][0]["finish_reason"] == "stop", r
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "json please"}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["on", "off"]}}})
    assert r.choices[0].message.content in ('"on"', '"off"') and r.choices[0].finish_reason == "stop"
    regex = r"[xyz]{2}-[0-9]{3}"
    r = client.completions.create(model=MODEL, prompt="id:", max_tokens=12, temperature=0.9, seed=2, n=2,
                                  extra_body={"structured_outputs": {"regex": regex}})
    assert all(re.fullmatch(regex, c.text) for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="pick", max_tokens=12, temperature=0,
                                  extra_body={"guided_choice": ["left", "right"]})
    assert r.choices[0].text in ("left", "right")
    other = "right" if r.choices[0].text == "left" else "left"
    r = client.completions.create(model=MODEL, prompt="pick", max_tokens=12, temperature=0,
                                  extra_body={"guided_choice": ["left", "right"], "bad_words": [r.choices[0].text[0]]})
    assert r.choices[0].text == other  # vLLM's bad_words (a one-token word: always banned), same mask
    chunks = list(client.completions.create(model=MODEL, prompt="id:", max_tokens=12, temperature=0, stream=True,
                                            extra_body={"guided_regex": regex}))
    assert re.fullmatch(regex, "".join(c.choices[0].text for c in chunks if c.choices))
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 30, "temperature": 0}
    got = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 100, "temperature": 0,
                                             "structured_outputs": {"json_object": True,
                                                                    "disable_any_whitespace": True}}).json()
    assert got["choices"][0]["text"].startswith("{")
    if got["choices"][0]["finish_reason"] == "stop":  # a random model may nest objects past max_tokens
        assert isinstance(_json.loads(got["choices"][0]["text"]), dict)
    for bad, param in (({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
                       ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
                       ({"structured_outputs": {"pattern": "a"}}, "structured_outputs"),
                       ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
                       ({"response_format": {"type": "yaml"}}, "response_format"),
                       ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
                       ({"guided_json": {"type": "nonsense"}}, "guided_json"),  # the field the client sent
                       ({"guided_choice": []}, "guided_choice"),
                       ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                           "type": "nonsense"}}}}, "response_format")):
        err = _err(http.post("/v1/chat/completions", json={**body, **bad}), 400)
        assert err["param"] == param and err["message"].startswith(param), (bad, err)
    err = _err(http.post("/generate", json={"text": "x", "sampling_params": {"json_schema": '{"type": "nonsense"}',
                                                                   "max_new_tokens": 4}}),
               400)
    assert err["param"] == "sampling_params.json_schema", err  # SGLang's name
    err = _err(http.post("/v1/responses", json={"input": "x", "reasoning": {"effort": "extreme"}}), 400)
    assert err["param"] == "reasoning.effort" and err["message"].startswith("reasoning.effort: "), err
    surrogate = b'{"prompt": "x", "max_tokens": 2, "bad_words": ["a\\ud800"]}'
    assert _err(http.post("/v1/completions", content=surrogate, headers={"content-type": "application/json"}),
                400)["param"] == "bad_words"
    text = http.get("/metrics").text
    assert metric(text, "k3jax:compiles_after_warmup") == 0
    assert metric(text, "k3jax:structured_output_requests_total") >= 6
    assert metric(text, "k3jax:structured_output_errors_total") == 0
    assert metric(text, "k3jax:structured_output_mask_seconds_total") > 0


def test_return_token_ids_whole_and_streamed(http):
    """vLLM's `return_token_ids`: the prompt's ids and each choice's sampled ids; streamed, per delta
    (their concatenation is the whole). The ids are the model's: they detokenize to the text."""
    body = {"prompt": "abc", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    full = http.post("/v1/completions", json=body).json()
    ch = full["choices"][0]
    assert ch["prompt_token_ids"] == http.post("/tokenize", json={"prompt": "abc"}).json()["tokens"]
    assert len(ch["token_ids"]) == 6
    text_ids = [t for t in ch["token_ids"] if t < 256]  # (the text leaves special tokens out, /detokenize keeps them)
    assert http.post("/detokenize", json={"tokens": text_ids}).json()["prompt"] == ch["text"]
    events = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    assert events[0]["choices"][0]["prompt_token_ids"] == ch["prompt_token_ids"]
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == ch["token_ids"]
    msgs = [{"role": "user", "content": "hi"}]
    chat = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 5, "temperature": 0,
                                                   "ignore_eos": True, "return_token_ids": True}).json()
    assert chat["prompt_token_ids"] == http.post("/tokenize", json={"messages": msgs}).json()["tokens"]
    assert len(chat["choices"][0]["token_ids"]) == 5
    events = []
    with http.stream("POST", "/v1/chat/completions", json={"messages": msgs, "max_tokens": 5, "temperature": 0,
                                                           "ignore_eos": True, "return_token_ids": True,
                                                           "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    assert events[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert [t for e in events[1:] for t in e["choices"][0]["token_ids"]] == chat["choices"][0]["token_ids"]
    plain = http.post("/v1/completions", json={**body, "return_token_ids": False}).json()["choices"][0]
    assert "token_ids" not in plain


def test_continuous_usage_stats(http):
    body = {"prompt": "abc", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = []
    with http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert all(e["usage"] is not None for e in events) and counts == sorted(counts) and counts[-1] == 5
    assert events[-1]["choices"] == [] and counts[0] < 5


def test_request_ids_follow_the_header_or_field(http):
    """vLLM's request ids: a completion's id is cmpl-{X-Request-Id} (the header wins over the `request_id`
    field), a chat's chatcmpl-{...}; two requests in flight with one id both answer (their engine requests get
    ids of their own); with --enable-request-id-headers every response carries X-Request-Id, the request's
    or a fresh one."""
    import concurrent.futures

    body = dict(model=MODEL, prompt="abc", max_tokens=3, temperature=0, ignore_eos=True)
    r = http.post("/v1/completions", json=body, headers={"X-Request-Id": "trace-1"})
    assert r.json()["id"] == "cmpl-trace-1" and r.headers["x-request-id"] == "trace-1"
    r = http.post("/v1/completions", json={**body, "request_id": "field-1"}, headers={"X-Request-Id": "hdr-1"})
    assert r.json()["id"] == "cmpl-hdr-1"
    r = http.post("/v1/chat/completions", json=dict(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2, request_id="field-2"))
    assert r.json()["id"] == "chatcmpl-field-2" and len(r.headers["x-request-id"]) == 32  # a fresh one
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        same = list(pool.map(lambda _: http.post("/v1/completions", json={**body, "max_tokens": 8},
                                                 headers={"X-Request-Id": "dup"}), range(2)))
    assert [x.status_code for x in same] == [200, 200] and {x.json()["id"] for x in same} == {"cmpl-dup"}
    assert same[0].json()["choices"][0]["text"] == same[1].json()["choices"][0]["text"]
    r = http.post("/v1/completions", json={**body, "request_id": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
    assert http.get("/health").headers["x-request-id"]


def test_abort_request_ends_requests_by_id(http):
    """SGLang's /abort_request: a streamed request aborted by the id its client gave (X-Request-Id) ends at
    once with finish_reason "abort", well before its max_tokens; aborting it again (finished) or an unknown
    id aborts nothing; neither rid nor abort_all is a 400 naming rid."""
    body = dict(model=MODEL, prompt="abc", max_tokens=MAX_MODEL_LEN - 8, temperature=0, ignore_eos=True, stream=True)
    got, answers = [], []
    with http.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": "to-abort"}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            got.append(json.loads(line[6:]))
            if len(got) == 1:  # the request is running: abort it by the client's id
                answers.append(http.post("/abort_request", json={"rid": "to-abort"}).json())
    assert answers == [{"aborted": 1}]
    assert got[-1]["choices"][0]["finish_reason"] == "abort" and got[-1]["id"] == "cmpl-to-abort"
    assert len("".join(e["choices"][0]["text"] for e in got)) < body["max_tokens"] // 2
    assert http.post("/abort_request", json={"rid": "cmpl-to-abort"}).json() == {"aborted": 0}
    assert http.post("/abort_request", json={"rid": "nobody"}).json() == {"aborted": 0}
    assert http.post("/abort_request", json={"abort_all": True}).json() == {"aborted": 0}
    r = http.post("/abort_request", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
    assert http.post("/abort_request", json={"rid": "x", "other": 1}).status_code == 400
    assert http.get("/health").status_code == 200


# ---- shutdown (last in this file: these stop the module's servers) ------------------------------------------

def _stream_then_signal(s, headers=None):
    """Stream a long completion and send SIGTERM to server `s` once its first chunk arrived -> (the chunks,
    the server's exit code)."""
    body = dict(model=MODEL, prompt="abc", max_tokens=MAX_MODEL_LEN - 8, temperature=0, ignore_eos=True, stream=True,
                stream_options={"include_usage": True})
    got = []
    with httpx.stream("POST", s.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got.append(json.loads(line[6:]))
                if len(got) == 1:
                    s.proc.send_signal(signal.SIGTERM)
    return got, s.proc.wait(60)


def test_sigterm_lets_the_request_in_flight_finish(server):
    """--shutdown-timeout 30 (vLLM's drain): on SIGTERM the server stops listening, and the request in flight
    runs to its max_tokens before the process exits (0)."""
    got, rc = _stream_then_signal(server)
    assert rc == 0, server.tail()
    assert "1 requests in flight get up to 30s to finish" in server.tail()
    assert [e["choices"][0]["finish_reason"] for e in got if e["choices"] and e["choices"][0]["finish_reason"]] == [
        "length"]
    assert got[-1]["usage"]["completion_tokens"] == MAX_MODEL_LEN - 8
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health")


def test_sigterm_aborts_the_request_in_flight_by_default(limited):
    """Without --shutdown-timeout, SIGTERM aborts the request in flight: its stream still ends properly, with
    finish_reason "abort", well before its max_tokens; the process exits (0)."""
    got, rc = _stream_then_signal(limited, headers={"Authorization": "Bearer k-open"})
    assert rc == 0, limited.tail()
    tail = limited.tail()
    assert "aborting 1 requests in flight" in tail
    # --enable-log-requests (vLLM's): a line as each request starts and ends, without its text
    rid = got[0]["id"]
    assert re.search(rf"request {rid}: 1 prompt\(s\), [0-9]+ prompt tokens, n=1 max_tokens={MAX_MODEL_LEN - 8} "
                     r"temperature=0 ", tail), tail
    assert re.search(rf"request {rid} finished \(abort\): [0-9]+ tokens, 0 prompt tokens cached, [0-9.]+s", tail), tail
    assert [e["choices"][0]["finish_reason"] for e in got if e["choices"] and e["choices"][0]["finish_reason"]] == [
        "abort"]
    assert got[-1]["usage"]["completion_tokens"] < (MAX_MODEL_LEN - 8) // 2


def test_sigterm_during_warm_up_exits_at_once(tmp_path):
    """SIGTERM while the engine still compiles (a pod stopped during its start-up): the process exits 0 at once,
    saying so. It used to die of SIGABRT inside XLA, or finish compiling first and then say "ready: serving" for
    a server no longer listening."""
    log_path = tmp_path / "warm.log"
    cmd = [sys.executable, "-m", "k3jax.cli", "serve", *PLAIN, "--port", str(_free_port()),
           "--compile-cache-dir", str(tmp_path / "cold")]  # a cold cache: the programs take a while to compile
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            while "compiling" not in log_path.read_text():
                assert proc.poll() is None, log_path.read_text()
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(START_TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    tail = log_path.read_text()[-4000:]
    assert rc == 0, tail
    assert "start-up interrupted" in tail and "ready: serving" not in tail, tail
