"""HTTP pieces that need no engine: rate limiter, key file, metrics export, the app before warm-up."""

import asyncio
import json

import httpx
import pytest

from serve.api import create_app
from serve.auth import KeyStore, Limits, RateLimited, RateLimiter, load_api_keys, parse_key_file
from serve.cli import compile_cache_path
from serve.metrics import NAMES, ServerMetrics
from step_failures import LoopSurface


def test_rate_limiter_requests_per_minute_and_retry_after():
    rl = RateLimiter(Limits(rpm=2))
    rl.admit("a", 1, now=0.0)
    rl.admit("a", 1, now=10.0)
    with pytest.raises(RateLimited) as e:
        rl.admit("a", 1, now=20.0)
    assert e.value.retry_after == 40  # the first request leaves the window at t=60
    rl.admit("b", 1, now=20.0)  # per key
    rl.admit("a", 1, now=60.0)


def test_rate_limiter_tokens_per_minute_reserve_then_settle():
    rl = RateLimiter(Limits(tpm=100))
    t = rl.admit("k", 80, now=0.0)  # reserved prompt + max_tokens
    with pytest.raises(RateLimited):
        rl.admit("k", 30, now=1.0)
    t.settle(20)  # it used 20
    rl.admit("k", 30, now=2.0)
    with pytest.raises(RateLimited) as e:
        rl.admit("k", 60, now=3.0)
    assert e.value.retry_after == 57
    with pytest.raises(RateLimited, match="exceeds"):
        rl.admit("other", 101, now=0.0)


def test_unlimited_by_default_and_per_key_overrides():
    rl = RateLimiter(Limits(), {"slow": Limits(rpm=1)})
    for i in range(100):
        rl.admit("fast", 10 ** 6, now=float(i))
    rl.admit("slow", 1, now=0.0)
    with pytest.raises(RateLimited):
        rl.admit("slow", 1, now=1.0)


def test_key_file_and_env(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\nalpha\n\nbeta rpm=5 tpm=1000  # team b\n")
    assert parse_key_file(str(f)) == {"alpha": Limits(), "beta": Limits(5, 1000)}
    keys = load_api_keys(str(f), env={"K3JAX_API_KEYS": "x, y"})
    assert set(keys) == {"alpha", "beta", "x", "y"}
    assert load_api_keys(None, env={}) is None
    # --api-key (vLLM's flag, repeatable) adds keys; a key-file entry keeps its limits
    keys = load_api_keys(str(f), env={}, given=["cli", "beta"])
    assert set(keys) == {"alpha", "beta", "cli"} and keys["beta"] == Limits(5, 1000)
    assert set(load_api_keys(None, env={}, given=["k"])) == {"k"}
    with pytest.raises(ValueError, match="--api-key"):
        load_api_keys(None, env={}, given=[" "])
    f.write_text("gamma rpm=abc\n")
    with pytest.raises(ValueError, match="rpm"):
        parse_key_file(str(f))


def test_keystore():
    ks = KeyStore(["k1", "k2"])
    assert ks.check("Bearer k2") == "k2" and ks.check("bearer k1") == "k1"
    assert ks.check(None) is None and ks.check("Bearer k3") is None and ks.check("Basic k1") is None
    assert KeyStore(None).check(None) == ""  # open server


def test_key_file_hash_inside_a_key_is_the_keys(tmp_path):
    """A `#` starts a comment only at a line's start or after whitespace: `sk-a#b rpm=3` was read as the key
    `sk-a` without its limit (a shorter key let in, unlimited; the real key refused)."""
    f = tmp_path / "keys"
    f.write_text("sk-a#b rpm=3  # team a\n")
    assert parse_key_file(str(f)) == {"sk-a#b": Limits(rpm=3)}


def test_key_file_skips_a_utf8_byte_order_mark(tmp_path):
    """A key file saved with a BOM (Windows editors, CRLF lines): its first key works (it was `\\ufeffalpha`)."""
    f = tmp_path / "keys"
    f.write_bytes(b"\xef\xbb\xbfalpha\r\nbeta tpm=5\r\n")
    assert parse_key_file(str(f)) == {"alpha": Limits(), "beta": Limits(tpm=5)}
    from serve.auth import load_api_keys

    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00")
    for bad in (tmp_path, tmp_path / "bin"):  # a directory, not text: named (was a traceback)
        with pytest.raises(ValueError, match=f"--api-key-file {bad}: cannot read it"):
            load_api_keys(str(bad), env={})


def test_api_keys_given_as_one_string_is_one_key():
    """`create_app(api_keys="secret")` requires that key (each of its characters was a key: `Bearer s` got in)."""
    app = create_app(None, "m", api_keys="secret")
    assert app.state.k3.keys.check("Bearer secret") == "secret"
    assert app.state.k3.keys.check("Bearer s") is None
    from fastapi.testclient import TestClient

    with TestClient(app) as c:  # vLLM's /load is open (its keys guard /v1/*): a load balancer polls it keyless
        assert c.get("/load").json() == {"server_load": 0}
        assert c.get("/v1/models").status_code == 401


def test_metrics_export_expert_counts_and_arena_split():
    stats = {"expert_counts": [[3, 0, 5], [1, 1, 1]], "arena_bytes": {"total": 1000, "kda_slots": 250, "mla_pages": 100},
             "prefix_cache": {"query_tokens": 40, "hit_tokens": 16, "kda_hits": 2, "kda_misses": 3},
             "inter_rank_bytes": 0, "moe_dispatch_seconds": 0.5}
    text = ServerMetrics("m", lambda: stats, lambda: {"ready": 1}).exposition().decode()
    assert 'k3jax:expert_tokens_total{engine="0",expert="2",layer="0",model_name="m"} 5.0' in text
    named = ServerMetrics("m", lambda: {**stats, "moe_layers": [1, 3]}, dict).exposition().decode()
    assert 'k3jax:expert_tokens_total{engine="0",expert="2",layer="1",model_name="m"} 5.0' in named
    assert 'layer="3"' in named and 'layer="0"' not in named
    assert 'k3jax:kda_slot_usage_perc{engine="0",model_name="m"} 0.25' in text
    assert 'k3jax:mla_page_usage_perc{engine="0",model_name="m"} 0.1' in text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 16.0' in text
    assert 'k3jax:kda_checkpoint_misses_total{engine="0",model_name="m"} 3.0' in text
    assert 'k3jax:moe_dispatch_seconds_total{engine="0",model_name="m"} 0.5' in text
    spec = ServerMetrics("m", lambda: {**stats, "spec_decode_num_draft_tokens": 9, "spec_decode_num_accepted_tokens": 5,
                                       "spec_decode_accepted_per_pos": [3, 2, 0]}, dict).exposition().decode()
    assert 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 5.0' in spec
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0' in spec
    balanced = ServerMetrics("m", lambda: {**stats, "eplb_rebalances": 4, "eplb": {"last": {"imbalance_after": 1.25}}},
                             dict).exposition().decode()
    assert 'k3jax:eplb_rebalances_total{engine="0",model_name="m"} 4.0' in balanced
    assert 'k3jax:expert_load_imbalance{engine="0",model_name="m"} 1.25' in balanced
    empty = ServerMetrics("m", lambda: {}, lambda: {}).exposition().decode()
    assert all(n in empty for n in NAMES)  # every family is listed even with no engine statistics


def test_app_before_warmup_answers_503_everywhere_but_metrics():
    app = create_app(None, "m", max_model_len=64)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            h = await c.get("/health")
            r = await c.post("/v1/completions", json={"prompt": "x"})
            m = await c.get("/metrics")
            s = await c.get("/openapi.json")
            pings = [await c.get("/ping"), await c.post("/ping")]
            v = await c.get("/version")
            return h, r, m, s, pings, v

    h, r, m, s, pings, v = asyncio.run(go())
    assert h.status_code == 503 and [p.status_code for p in pings] == [503, 503]
    assert v.status_code == 200 and v.json() == {"version": __import__("k3jax").__version__}
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready" and "Retry-After" in r.headers
    assert m.status_code == 200 and 'k3jax:engine_ready{engine="0",model_name="m"} 0.0' in m.text
    assert s.status_code == 200 and "/v1/chat/completions" in s.json()["paths"]


def test_openapi_operation_ids_are_unique_with_every_optional_route_group(tmp_path):
    """Routes served under GET and POST (/release_memory_occupation, /resume_memory_occupation,
    /get_weights_by_name) shared one operation id, which FastAPI warned about and OpenAPI client generators
    refuse: each method has its own, as /ping's and /flush_cache's."""
    import collections
    import warnings

    app = create_app(None, "m", enable_sleep_mode=True, allow_runtime_lora_updating=True,
                     profiler_dir=str(tmp_path), enable_request_id_headers=True, allowed_origins=["*"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        schema = app.openapi()
    ids = [op["operationId"] for ops in schema["paths"].values() for op in ops.values()]
    assert not [k for k, n in collections.Counter(ids).items() if n > 1]
    assert not [w for w in caught if "Operation ID" in str(w.message)]
    assert {"get", "post"} <= set(schema["paths"]["/release_memory_occupation"])


def test_reasoning_effort_maps_to_k3_thinking_effort():
    from types import SimpleNamespace

    from serve.api import APIError, _template_kwargs

    k3, byte = SimpleNamespace(chat_family="k3"), SimpleNamespace(chat_family="byte")
    body = lambda effort, kw=None: SimpleNamespace(reasoning_effort=effort, chat_template_kwargs=kw)  # noqa: E731
    assert _template_kwargs(k3, body(None, {"thinking": True})) == {"thinking": True}
    assert _template_kwargs(k3, body("low", {"thinking": True})) == {"thinking": True, "thinking_effort": "low"}
    assert _template_kwargs(k3, body("max", {"thinking_effort": "max"})) == {"thinking_effort": "max"}
    for st, b in ((k3, body("extreme")), (k3, body("low", {"thinking_effort": "high"})), (byte, body("low")),
                  (byte, body("medium")), (k3, body("medium", {"thinking_effort": "max"})),
                  (k3, body("none", {"thinking": True})), (k3, body(["low"]))):
        with pytest.raises(APIError) as e:
            _template_kwargs(st, b)
        assert e.value.status == 400 and e.value.param == "reasoning_effort"


def test_openai_reasoning_efforts_map_onto_k3s():
    """OpenAI's reasoning efforts (Codex and OpenAI default to medium; Responses' `reasoning.effort` comes here as
    `reasoning_effort`) on K3's low < high < max: each to the K3 level in its place, none to thinking off. Every
    one but K3's own three was a 400, so Codex's default request failed on K3."""
    from types import SimpleNamespace

    from serve.api import _template_kwargs

    k3 = SimpleNamespace(chat_family="k3")
    body = lambda effort, kw=None: SimpleNamespace(reasoning_effort=effort, chat_template_kwargs=kw)  # noqa: E731
    for effort, want in (("minimal", "low"), ("low", "low"), ("medium", "high"), ("high", "high"), ("xhigh", "max"),
                         ("max", "max")):
        assert _template_kwargs(k3, body(effort)) == {"thinking_effort": want}, effort
    assert _template_kwargs(k3, body("medium", {"thinking_effort": "high"})) == {"thinking_effort": "high"}
    assert _template_kwargs(k3, body("none")) == {"thinking": False}
    assert _template_kwargs(k3, body("none", {"thinking": False})) == {"thinking": False}


def test_compile_cache_dir_flag_then_jax_env_then_home():
    assert compile_cache_path("/srv/xla", {"JAX_COMPILATION_CACHE_DIR": "/run/jax"}) == "/srv/xla"
    assert compile_cache_path(None, {"JAX_COMPILATION_CACHE_DIR": "/run/jax"}) == "/run/jax"
    assert compile_cache_path(None, {}).endswith("/.cache/k3jax/jax") and not compile_cache_path(None, {}).startswith("~")


def test_return_tokens_as_token_ids_server_default_and_request_override():
    from types import SimpleNamespace

    from serve.api import _Format
    from serve.types import Logprob

    lp = Logprob(104, -0.5, "h")
    for server, request, want in ((False, None, "h"), (True, None, "token_id:104"), (True, False, "h"),
                                  (False, True, "token_id:104")):
        st = SimpleNamespace(return_tokens_as_token_ids=server, tokenizer=None)
        fmt = _Format(st, "id", 1, 1, 0, tokens_as_ids=request)
        assert fmt.token_text(lp) == want
        assert fmt.logprob_bytes(lp) == (list(want.encode()) if want != "h" else [])
    app = create_app(None, "m", return_tokens_as_token_ids=True)
    assert app.state.k3.return_tokens_as_token_ids is True


def test_completion_top_logprobs_hold_the_chosen_token_and_the_top_n():
    """Completions' legacy logprobs (OpenAI's, vLLM's): each top_logprobs has the chosen token, then the
    `logprobs` most likely ones (up to logprobs + 1 entries; an echoed prompt's alternatives are cut to
    `logprobs` though prompt_logprobs asked for more); the first prompt token's is null."""
    from types import SimpleNamespace

    from serve.api import _CompletionFormat
    from serve.types import Logprob, TokenLogprobs

    st = SimpleNamespace(model_name="m", tokenizer=None, return_tokens_as_token_ids=False)
    a, b, c = Logprob(97, -2.0, "a"), Logprob(98, -0.5, "b"), Logprob(99, -1.0, "c")
    entries = [(Logprob(120, None, "x"), None), TokenLogprobs(a, [b, c]), TokenLogprobs(b, [b, c])]
    for n, want in ((1, [None, {"a": -2.0, "b": -0.5}, {"b": -0.5}]),
                    (0, [None, {"a": -2.0}, {"b": -0.5}]),
                    (2, [None, {"a": -2.0, "b": -0.5, "c": -1.0}, {"b": -0.5, "c": -1.0}])):
        got = _CompletionFormat(st, "id", 1, n, 0, echo_texts=[""])._logprobs(entries, 0)
        assert got["top_logprobs"] == want and list(got["top_logprobs"][1])[0] == "a"  # the chosen token first
        assert got["tokens"] == ["x", "a", "b"] and got["token_logprobs"] == [None, -2.0, -0.5]


def test_completion_echo_of_token_ids_shows_their_special_tokens():
    """`echo` of a prompt given as token ids shows its special tokens' text, as vLLM decodes a token prompt and as
    the same prompt sent as a string echoes (truncated too); the echo dropped them ("a<|eos|>b" echoed "ab")."""
    from k3jax.tokenizer import ByteTokenizer
    from recording_engine import Recorder

    tok = ByteTokenizer(320)
    text = "a" + tok.decode([257], skip_special=False) + "b"
    ids = tok.encode(text, allow_special=True)
    assert len(ids) == 3 and tok.is_special(ids[1])
    app = create_app(Recorder(64, tok, vocab_size=320, token=97, text="z"), "m")

    async def echoed(body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/completions", json={"max_tokens": 1, "echo": True, **body})
        assert r.status_code == 200, r.text
        return [c["text"] for c in r.json()["choices"]]

    for prompt in (text, ids, [ids, ids[1:]]):
        assert asyncio.run(echoed({"prompt": prompt}))[0] == text + "z", prompt
        assert asyncio.run(echoed({"prompt": prompt, "truncate_prompt_tokens": 2}))[0] == text[1:] + "z", prompt


def test_long_prompts_are_tokenized_off_the_event_loop():
    """A long prompt's tokenizing (and chat rendering) ran on the event loop: a 1 MiB prompt stalled every stream
    for ~0.4 s. As vLLM tokenizes off its loop, a body past 32 KiB is tokenized on a worker thread on every route
    that takes text (a short one stays on the loop: no thread hop)."""
    import threading

    from k3jax.tokenizer import ByteTokenizer
    from recording_engine import Recorder

    class Tok(ByteTokenizer):
        threads: list = []

        def encode(self, text, *args, **kwargs):
            self.threads.append(threading.current_thread() is threading.main_thread())  # (asyncio.run's loop)
            return super().encode(text, *args, **kwargs)

    tok = Tok(320)
    app = create_app(Recorder(1 << 17, tok, vocab_size=320, token=97, text="z"), "m")
    long = "word " * 20_000

    async def go(path, body):
        tok.threads.clear()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post(path, json=body)
        assert r.status_code == 200, (path, r.text)
        return set(tok.threads)

    chat = {"max_tokens": 1, "messages": [{"role": "user", "content": long}]}
    for path, body in (("/v1/completions", {"prompt": long, "max_tokens": 1}), ("/v1/chat/completions", chat),
                       ("/v1/responses", {"input": long, "max_output_tokens": 1}),
                       ("/generate", {"text": long, "sampling_params": {"max_new_tokens": 1}}),
                       ("/tokenize", {"prompt": long}), ("/tokenize", {"messages": chat["messages"]})):
        assert asyncio.run(go(path, body)) == {False}, path  # only ever on a worker thread
    assert asyncio.run(go("/v1/completions", {"prompt": "short", "max_tokens": 1})) == {True}


def _beam_refusal(extra: dict) -> dict:
    """A completions beam search (width 2) with `extra` fields, which must be a 400 -> its error object."""
    from recording_engine import Recorder

    body = {"prompt": [5, 6], "max_tokens": 2, "n": 2, "use_beam_search": True, **extra}

    async def go():
        app = create_app(Recorder(64), "m")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/v1/completions", json=body)

    r = asyncio.run(go())
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_beam_search_refusing_echo_logprobs_names_echo():
    """`use_beam_search` scores no prompt: completions' echo with logprobs is refused naming `echo` (the 400 named
    `prompt_logprobs`, a field the request did not send); echo alone and vLLM's prompt_logprobs as before."""
    refusal = lambda extra: _beam_refusal(extra)["param"]
    assert refusal({"echo": True, "logprobs": 1}) == "echo"
    assert refusal({"echo": True, "logprobs": 1, "prompt_logprobs": 1}) == "prompt_logprobs"
    assert refusal({"prompt_logprobs": 1}) == "prompt_logprobs"


def test_beam_search_refusing_a_constraint_names_the_field_that_asked_for_it():
    """An output constraint with `use_beam_search` is refused naming the field the request sent (the 400 named
    `structured_outputs` for a `response_format` or `guided_choice`, a field the request did not send)."""
    def refusal(extra):
        error = _beam_refusal(extra)
        assert error["message"].startswith(error["param"] + ": "), error
        return error["param"]

    assert refusal({"response_format": {"type": "json_object"}}) == "response_format"
    assert refusal({"guided_choice": ["a", "b"]}) == "guided_choice"
    assert refusal({"structured_outputs": {"choice": ["a", "b"]}}) == "structured_outputs"


def test_every_serve_option_reaches_the_server():
    """`k3jax serve` reads its options through `DEFAULTS` (serve_main), so a flag without an entry there would
    be parsed and then silently dropped (as --return-tokens-as-token-ids was)."""
    import argparse

    from serve.cli import DEFAULTS, add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert {a.dest for a in parser._actions if a.dest != "help"} == set(DEFAULTS)
    args = parser.parse_args(["--return-tokens-as-token-ids", "--enable-request-id-headers",
                              "--gpu-memory-utilization", "0.8", "--logprobs-mode", "processed_logprobs"])
    o = {k: getattr(args, k, v) for k, v in DEFAULTS.items()}
    assert o["return_tokens_as_token_ids"] and o["enable_request_id_headers"]
    from serve.cli import engine_config

    cfg = engine_config(o)
    assert cfg.gpu_memory_utilization == 0.8 and cfg.logprobs_mode == "processed_logprobs"
    assert engine_config(dict(DEFAULTS)).logprobs_mode == "raw_logprobs"
    with pytest.raises(SystemExit):
        parser.parse_args(["--logprobs-mode", "processed"])


def test_vllm_cache_size_flags_and_their_precedence_over_gpu_memory_utilization():
    """vLLM's --kv-cache-memory-bytes (--kv-cache-memory) and --num-gpu-blocks-override were refused as unknown; they
    size the arena (bytes per device; its units). An explicit size beside --gpu-memory-utilization wins, as vLLM's
    --kv-cache-memory-bytes ignores the fraction, said at start-up (--cache-mb beside it was silently ignored)."""
    from serve.cli import engine_config, vllm_notes

    def sized(*argv):
        cfg = engine_config(o := _serve_options(*argv))
        return (cfg.cache_bytes, cfg.gpu_memory_utilization, cfg.num_gpu_blocks_override), vllm_notes(o)

    assert sized() == ((128 << 20, None, None), [])
    assert sized("--kv-cache-memory-bytes", "64M") == ((64 << 20, None, None), [])
    assert sized("--kv-cache-memory", "1G")[0] == (1 << 30, None, None)
    assert sized("--gpu-memory-utilization", "0.8") == ((None, 0.8, None), [])  # (a cache_bytes given would win)
    for flag, value, bytes_ in (("--cache-mb", "32", 32 << 20), ("--kv-cache-memory-bytes", "2G", 2 << 30)):
        got, notes = sized(flag, value, "--gpu-memory-utilization", "0.9")
        assert got == (bytes_, None, None)
        assert notes == [f"--gpu-memory-utilization 0.9: ignored, {flag} sets the cache's size (as vLLM's "
                         f"--kv-cache-memory-bytes ignores it)"]
    got, notes = sized("--num-gpu-blocks-override", "400", "--cache-mb", "16", "--gpu-memory-utilization", "0.9")
    assert got == (16 << 20, None, 400) and len(notes) == 2
    assert notes[1].startswith("--num-gpu-blocks-override 400: the arena has that many units, whatever --cache-mb")
    with pytest.raises(ValueError, match="--cache-mb and --kv-cache-memory-bytes set the same budget"):
        sized("--cache-mb", "32", "--kv-cache-memory-bytes", "1G")
    for flag in ("--kv-cache-memory-bytes", "--num-gpu-blocks-override"):
        with pytest.raises(ValueError, match=f"{flag}: expected an integer >= 1"):
            sized(flag, "0")


def _serve_options(*argv):
    import argparse

    from serve.cli import DEFAULTS, add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(list(argv))
    return {k: getattr(args, k, v) for k, v in DEFAULTS.items()}


def test_cors_answers_the_allowed_origins_preflight_only():
    """--allowed-origins (vLLM's CORS options): a browser page from an allowed origin may call the API, with its
    preflight answered before the API key check; other origins get no CORS headers; no option, no headers."""
    from serve.cli import cors_options

    o = _serve_options("--allowed-origins", '["http://notebook.example"]', "--allowed-methods", "GET,POST")
    app = create_app(None, "m", api_keys=["k"], **cors_options(o))

    async def go(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            pre = await c.options("/v1/completions", headers={
                "Origin": "http://notebook.example", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type"})
            other = await c.options("/v1/completions", headers={
                "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
            put = await c.options("/v1/completions", headers={
                "Origin": "http://notebook.example", "Access-Control-Request-Method": "PUT"})
            get = await c.get("/v1/models", headers={"Origin": "http://notebook.example"})
            return pre, other, put, get

    pre, other, put, get = asyncio.run(go(app))
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://notebook.example"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-origin" not in other.headers and put.status_code == 400
    # the answer itself still needs the key; the browser may read it (and its X-Request-Id / Retry-After)
    assert get.status_code == 401 and get.headers["access-control-allow-origin"] == "http://notebook.example"
    assert "x-request-id" in get.headers["access-control-expose-headers"].lower()
    _, _, _, plain = asyncio.run(go(create_app(None, "m", api_keys=["k"])))
    assert "access-control-allow-origin" not in plain.headers
    assert cors_options(_serve_options("--allowed-origins", "http://a.example, http://b.example"))[
        "allowed_origins"] == ["http://a.example", "http://b.example"]
    for argv, flag in [(("--allow-credentials",), "--allow-credentials"),
                       (("--allowed-methods", "GET"), "--allowed-methods"),
                       (("--allowed-origins", "*", "--allow-credentials"), "--allow-credentials"),
                       (("--allowed-origins", "[1]"), "--allowed-origins"),
                       (("--allowed-origins", "[oops"), "--allowed-origins")]:
        with pytest.raises(ValueError, match=flag):
            cors_options(_serve_options(*argv))


def test_https_serves_with_the_given_certificate(tmp_path):
    """--ssl-keyfile / --ssl-certfile: uvicorn serves the app over TLS (a real socket, a certificate made for the
    test), optionally asking clients for certificates (--ssl-ca-certs, --ssl-cert-reqs 2); bad or half-given TLS
    options are errors naming them before anything loads; --root-path is the proxy's prefix."""
    import socket
    import threading

    import trustme
    import uvicorn

    from serve.cli import server_url, uvicorn_config

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    key_pem, cert_pem, ca_pem = tmp_path / "key.pem", tmp_path / "cert.pem", tmp_path / "ca.pem"
    cert.private_key_pem.write_to_path(str(key_pem))
    cert.cert_chain_pems[0].write_to_path(str(cert_pem))
    ca.cert_pem.write_to_path(str(ca_pem))
    client = ca.issue_cert("client.example")
    client_pem = tmp_path / "client.pem"
    client_pem.write_bytes(client.private_key_pem.bytes() + b"".join(p.bytes() for p in client.cert_chain_pems))

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def serve(*argv):
        o = _serve_options("--port", str(free_port()), "--log-level", "warning", *argv)
        server = uvicorn.Server(uvicorn_config(create_app(None, "m"), o))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        for _ in range(500):
            if server.started:
                break
            threading.Event().wait(0.01)
        return server, thread, server_url(o)

    import ssl

    trusting = ssl.create_default_context(cafile=str(ca_pem))
    server, thread, url = serve("--ssl-keyfile", str(key_pem), "--ssl-certfile", str(cert_pem), "--root-path", "/k3")
    try:
        assert url.startswith("https://127.0.0.1:") and url.endswith("/k3")
        r = httpx.get(url.removesuffix("/k3") + "/health", verify=trusting)
        assert r.status_code == 503  # no engine attached yet: the app answers over TLS
        assert httpx.get(url.removesuffix("/k3") + "/openapi.json", verify=trusting).json()["servers"] == [
            {"url": "/k3"}]
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate
            httpx.get(url.removesuffix("/k3") + "/health")
    finally:
        server.should_exit = True
        thread.join(10)
    server, thread, url = serve("--ssl-keyfile", str(key_pem), "--ssl-certfile", str(cert_pem),
                                "--ssl-ca-certs", str(ca_pem), "--ssl-cert-reqs", "2")
    try:
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            httpx.get(url + "/health", verify=trusting)  # no client certificate
        ctx = ssl.create_default_context(cafile=str(ca_pem))
        ctx.load_cert_chain(str(client_pem))
        assert httpx.get(url + "/health", verify=ctx).status_code == 503
    finally:
        server.should_exit = True
        thread.join(10)
    for argv, flags in [(("--ssl-keyfile", str(key_pem)), "--ssl-keyfile, --ssl-certfile"),
                        (("--ssl-keyfile", str(key_pem), "--ssl-certfile", str(tmp_path / "none.pem")),
                         "--ssl-keyfile, --ssl-certfile: FileNotFoundError"),
                        (("--ssl-keyfile", str(cert_pem), "--ssl-certfile", str(cert_pem)),
                         "--ssl-keyfile, --ssl-certfile: SSLError"),
                        (("--ssl-ca-certs", str(ca_pem)), "--ssl-ca-certs, --ssl-cert-reqs"),
                        (("--ssl-keyfile", str(key_pem), "--ssl-certfile", str(cert_pem), "--ssl-cert-reqs", "2"),
                         "--ssl-cert-reqs"),
                        (("--root-path", "k3/"), "--root-path")]:
        with pytest.raises(ValueError, match=flags):
            uvicorn_config(create_app(None, "m"), _serve_options(*argv))


def test_vllm_logging_flags_of_a_launch_line():
    """vLLM's `--max-log-len N` (beside --enable-log-requests) was refused as unknown, failing a vLLM launch line:
    accepted (request lines hold no text to cut); `--disable-uvicorn-access-log` turns uvicorn's access lines off."""
    from serve.cli import uvicorn_config

    o = _serve_options("--enable-log-requests", "--max-log-len", "100", "--disable-uvicorn-access-log")
    assert (o["enable_log_requests"], o["max_log_len"]) == (True, 100)
    assert uvicorn_config(create_app(None, "m"), o).access_log is False
    assert uvicorn_config(create_app(None, "m"), _serve_options()).access_log is True


def test_a_dead_engine_fails_health_and_refuses_requests_naming_why():
    """An engine marked dead (serve/async_engine.py DEAD_AFTER_FAILURES failed steps in a row; its thread ended):
    /health answers 503 naming why, new requests 503. /health answered 200 while every request failed."""
    from recording_engine import Recorder

    from serve.async_engine import EngineDead

    eng = Recorder(max_model_len=64)
    app = create_app(eng, "m")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get("/health"), await c.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})

    health, r = asyncio.run(go())
    assert health.status_code == r.status_code == 200
    eng.alive, eng.errored, eng.dead_error = False, True, EngineDead("the engine is dead: 3 steps failed in a row")
    health, r = asyncio.run(go())
    assert health.status_code == 503 and "3 steps failed in a row" in health.json()["detail"]
    assert r.status_code == 503 and "3 steps failed in a row" in r.json()["error"]["message"]


def test_shutting_down_refuses_new_requests_and_fails_health():
    app = create_app(None, "m", max_model_len=64)
    assert app.state.k3.start_shutdown() == 0  # nothing in flight

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get("/health"), await c.post("/v1/completions", json={"prompt": "x"})

    h, r = asyncio.run(go())
    assert h.status_code == 503 and h.json()["detail"] == "shutting down"
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"


def test_body_limit_default_grows_with_prompt_embeddings():
    from serve.cli import BODY_BYTES, EMBEDS_BODY_BYTES, body_limit

    assert body_limit({}) == BODY_BYTES == 1 << 20
    assert body_limit({"enable_prompt_embeds": True}) == EMBEDS_BODY_BYTES
    assert body_limit({"enable_prompt_embeds": True, "max_body_bytes": 4096}) == 4096  # given: it wins
    # routes that take base64 tensors: weights by name (sleep mode) and LoRA adapters pushed as tensors
    assert body_limit({"enable_sleep_mode": True}) == EMBEDS_BODY_BYTES
    assert body_limit({"allow_runtime_lora_updating": True}) == EMBEDS_BODY_BYTES
    with pytest.raises(ValueError, match="--max-body-bytes 0"):
        body_limit({"max_body_bytes": 0})


class _OneToken:
    """A stand-in AsyncEngine: `generate` yields one output after `delay` seconds, or raises `error`."""

    def __init__(self, delay: float = 0.0, error: Exception = None):
        from types import SimpleNamespace as NS

        self.engine = NS(tokenizer=None, cfg=NS(vocab_size=8, family="kimi_k3", hidden_size=4), decode_buckets=[1],
                         config=NS(max_model_len=64, max_logprobs=5), generation_defaults={})
        self.capacity, self.alive, self.delay, self.error, self.calls = 1, True, delay, error, []

    async def generate(self, prompt, params, request_id):
        self.calls.append((prompt, params.max_tokens))
        await asyncio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        yield object()


@pytest.mark.parametrize("engine, status, detail", [
    (_OneToken(), 200, None),
    (_OneToken(delay=5.0), 503, "no token generated within 0.2 s"),
    (_OneToken(error=RuntimeError("device lost")), 503, "generation failed: RuntimeError: device lost"),
])
def test_health_generate_runs_one_token_unless_output_is_recent(monkeypatch, engine, status, detail):
    """SGLang's /health_generate: a one-token generation within the timeout, skipped while output streams."""
    import time

    from serve import api

    monkeypatch.setattr(api, "HEALTH_GENERATE_TIMEOUT_S", 0.2)
    app = create_app(engine, "m")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get("/health_generate")

    r = asyncio.run(go())
    assert r.status_code == status and engine.calls == [([0], 1)]
    assert (r.json().get("detail") if status != 200 else None) == detail
    app.state.k3.last_output = time.monotonic()  # a request just received output: no probe
    assert asyncio.run(go()).status_code == 200 and len(engine.calls) == 1
    app.state.k3.start_shutdown()
    assert asyncio.run(go()).status_code == 503


@pytest.mark.parametrize("error, status, message", [
    (RuntimeError("engine step failed (RuntimeError: injected device failure); ended 1 request(s) it ran"), 500,
     "engine step failed (RuntimeError: injected device failure)"),
    (__import__("serve.async_engine").async_engine.EngineDead("the engine failed 3 steps in a row"), 503,
     "the engine failed 3 steps in a row"),
])
def test_a_failed_step_answers_a_request_that_does_not_stream_naming_what_failed(caplog, error, status, message):
    """A request the engine accepted, then failed (a failed step, the engine stopping): not the app's bare 500
    "internal error: RuntimeError" with its traceback logged twice (the handler's, then the server's: Starlette
    raises the error on), but what failed, as a stream's error event says it, in one log line."""
    from recording_engine import Recorder

    class Failing(Recorder):
        async def generate(self, prompt, params, request_id, priority=0, on_accept=None, **kw):
            on_accept()
            raise error
            yield

    app = create_app(Failing(max_model_len=64), "m")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            body = {"prompt": [1, 2], "max_tokens": 2}
            plain = await c.post("/v1/completions", json=body)
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                events = [json.loads(line[6:]) for line in [x async for x in s.aiter_lines()]
                          if line.startswith("data: {")]
            return plain, events

    with caplog.at_level("WARNING"):
        plain, events = asyncio.run(go())
    assert plain.status_code == status and message in plain.json()["error"]["message"], plain.text
    assert events[-1]["status"] == status and events[-1]["error"]["message"] == plain.json()["error"]["message"]
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


class _FailsItsStep(LoopSurface):
    """A stand-in engine for a real AsyncEngine: once two requests are in, their step fails (a `StepFailed` ending
    both, as a device failure does)."""

    decode_buckets, generation_defaults = [4], {}

    def __init__(self):
        from types import SimpleNamespace as NS

        self.cfg = NS(vocab_size=512, family="byte", hidden_size=4)
        self.config = NS(max_model_len=64, max_logprobs=5, generation_config="auto")
        self.sched_cfg, self.requests = NS(max_num_seqs=4), {}

    def stats(self):
        return {}

    def add_request(self, prompt, params, request_id, **kw):
        self.requests[request_id] = prompt

    def has_unfinished(self):
        return len(self.requests) >= 2

    def step(self):
        from serve.engine import StepFailed

        ids, self.requests = sorted(self.requests), {}
        raise StepFailed(ids, RuntimeError("injected device failure"))


def test_a_failed_step_tells_each_client_its_own_failure_without_the_others_ids(caplog):
    """A step that failed two clients' requests: each client gets what failed, not the step's list of ended
    requests (it named the other client's X-Request-Id, in the 500's body and the stream's error event); the
    server log keeps the ids."""
    from serve.async_engine import AsyncEngine

    aeng = AsyncEngine(_FailsItsStep())
    app = create_app(aeng, "m")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            body = {"prompt": [1, 2], "max_tokens": 2}

            async def streamed():
                async with c.stream("POST", "/v1/completions", json={**body, "stream": True},
                                    headers={"X-Request-Id": "bob-id"}) as s:
                    return [json.loads(line[6:]) for line in [x async for x in s.aiter_lines()]
                            if line.startswith("data: {")]
            plain = c.post("/v1/completions", json=body, headers={"X-Request-Id": "alice-id"})
            return await asyncio.wait_for(asyncio.gather(plain, streamed()), 60)

    try:
        with caplog.at_level("WARNING"):
            plain, events = asyncio.run(go())
    finally:
        aeng.shutdown()
    said = "engine step failed (RuntimeError: injected device failure)"
    assert plain.status_code == 500 and plain.json()["error"]["message"] == said, plain.text
    assert events[-1]["status"] == 500 and events[-1]["error"]["message"] == said, events
    assert any("alice-id" in r.getMessage() and "bob-id" in r.getMessage() for r in caplog.records)
    from serve.api import engine_failure
    from serve.engine import StepFailed

    assert engine_failure(StepFailed(["alice-id"], RuntimeError("injected device failure"))).message == said


def test_abort_request_takes_sglangs_empty_rid_with_abort_all():
    """SGLang's clients send /abort_request {"rid": "", "abort_all": true} (AbortReq's default rid): every request
    of the caller is aborted (was a 400 on the empty rid); an empty rid alone names nothing (400 naming rid)."""
    app = create_app(_OneToken(), "m")
    calls = []
    app.state.k3.abort_runs = lambda key, rid: calls.append(rid) or 2

    async def go(body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/abort_request", json=body)

    r = asyncio.run(go({"rid": "", "abort_all": True}))
    assert r.status_code == 200 and r.json() == {"aborted": 2} and calls == [None], r.text
    r = asyncio.run(go({"rid": ""}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid" and calls == [None], r.text
    assert asyncio.run(go({"rid": "x"})).json() == {"aborted": 2} and calls == [None, "x"]


class _Streams:
    """A stand-in for the API's ServerState: requests that stream a tick every 20 ms until done or aborted."""

    def __init__(self):
        import threading

        self.stop = threading.Event()
        self.in_flight = 0
        self.shutting_down = False

    def start_shutdown(self):
        self.shutting_down = True
        return self.in_flight

    def abort_runs(self, key, rid):
        assert key is None and rid is None  # the shutdown aborts every caller's requests
        self.stop.set()
        return self.in_flight

    async def app(self, scope, receive, send):
        assert scope["type"] == "http"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        self.in_flight += 1
        try:
            for _ in range(int(scope["path"].strip("/"))):
                if self.stop.is_set():
                    await send({"type": "http.response.body", "body": b"abort\n", "more_body": True})
                    break
                await send({"type": "http.response.body", "body": b"tick\n", "more_body": True})
                await asyncio.sleep(0.02)
            else:
                await send({"type": "http.response.body", "body": b"done\n", "more_body": True})
        finally:
            self.in_flight -= 1
        await send({"type": "http.response.body", "body": b""})


@pytest.mark.parametrize("timeout_s,ticks,ends", [(0.0, 500, "abort"), (0.3, 500, "abort"), (5.0, 25, "done")])
def test_shutdown_drains_or_aborts_the_requests_in_flight(timeout_s, ticks, ends):
    """--shutdown-timeout (vLLM's), serve/shutdown.py: told to stop (what SIGTERM does), the server refuses new
    connections; the request in flight is aborted at once (0), after the timeout (0.3 s of a 10 s stream), or
    finishes (0.5 s of 5 s); each answer is whole either way."""
    import socket
    import threading
    import time

    import uvicorn

    from serve.shutdown import DrainingServer, graceful_timeout

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    streams = _Streams()
    config = uvicorn.Config(streams.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                            interface="asgi3", timeout_graceful_shutdown=graceful_timeout(timeout_s))
    server = DrainingServer(config, streams, timeout_s)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    lines, t0 = [], time.monotonic()
    with httpx.stream("GET", f"http://127.0.0.1:{port}/{ticks}", timeout=30) as r:
        for line in r.iter_lines():
            lines.append(line)
            if len(lines) == 2:
                server.should_exit = True  # uvicorn's SIGTERM / SIGINT handler does this
                t0 = time.monotonic()
    thread.join(30)
    took = time.monotonic() - t0
    assert not thread.is_alive() and server.drained_requests == 1
    assert lines[-1] == ends and lines[:-1] == ["tick"] * (len(lines) - 1)
    if timeout_s == 0:
        assert took < 2.0
    elif ends == "abort":
        assert took >= timeout_s - 0.1
    if ends == "done":
        assert len(lines) == ticks + 1
    else:
        assert len(lines) < ticks
    with pytest.raises(httpx.ConnectError):  # no longer listening
        httpx.get(f"http://127.0.0.1:{port}/1", timeout=5)


def test_profiler_routes_record_a_trace(tmp_path):
    """--profiler-dir (vLLM's profiler routes): start, something runs, stop -> a run directory with the
    trace, a new one for each recording; a second start while recording and a stop with none are 400s;
    without the flag, no routes."""
    import jax.numpy as jnp

    app = create_app(None, "m", profiler_dir=str(tmp_path / "prof"))

    async def go(path):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path)

    assert asyncio.run(go("/stop_profile")).json()["error"]["message"] == "stop_profile: no profile is being recorded"
    r = asyncio.run(go("/start_profile"))
    assert r.status_code == 200 and r.json()["dir"] == str(tmp_path / "prof")
    assert "already being recorded" in asyncio.run(go("/start_profile")).json()["error"]["message"]
    (jnp.ones((64, 64)) @ jnp.ones((64, 64))).block_until_ready()
    done = asyncio.run(go("/stop_profile")).json()
    files = [p.name for p in __import__("pathlib").Path(done["dir"]).iterdir()]
    assert done["status"] == "written" and any(f.endswith(".xplane.pb") for f in files), files
    assert any(f.endswith(".trace.json.gz") for f in files), files
    # recordings stopped within one second went to one run directory (the last overwrote the one before it,
    # and stop_profile answered the profile directory itself): each has its own now
    again = []
    for _ in range(2):
        asyncio.run(go("/start_profile"))
        again.append(asyncio.run(go("/stop_profile")).json()["dir"])
    assert len({done["dir"], *again}) == 3, (done, again)
    assert all(any(f.name.endswith(".xplane.pb") for f in __import__("pathlib").Path(d).iterdir()) for d in again)
    plain = create_app(None, "m")
    assert "/start_profile" not in {r.path for r in plain.routes}
    # a --profiler-dir that cannot be a directory was a 500 "internal error: FileExistsError"
    (tmp_path / "file").write_text("x")
    for d in (tmp_path / "file", tmp_path / "file" / "sub"):
        app = create_app(None, "m", profiler_dir=str(d))
        r = asyncio.run(go("/start_profile"))
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(
            f"start_profile: cannot create the profile directory {d} ("), r.text


def test_a_request_id_cannot_forge_request_log_lines():
    """--enable-log-requests: a client's request id (the `request_id` field, SGLang's `rid`) with a newline
    started a line of its own in the server log, so a client could forge request lines; it is escaped."""
    from recording_engine import Recorder

    lines = []
    app = create_app(Recorder(64), "m", request_log=lines.append)
    forged = "x\nrequest cmpl-y finished (stop): 1 tokens"

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "request_id": forged})
            g = await c.post("/generate", json={"input_ids": [1, 2], "rid": "r\u2028\u0085forged"})
            return r, g

    r, g = asyncio.run(go())
    assert r.status_code == 200 and r.json()["id"] == "cmpl-" + forged  # (the answer keeps the id as given)
    assert g.status_code == 200 and len(lines) == 4, lines
    assert not any(c in line for line in lines for c in "\n\r\u2028\u0085"), lines
    assert lines[0].startswith("request cmpl-x\\nrequest cmpl-y finished (stop): 1 tokens: 1 prompt(s)"), lines
    assert lines[3].startswith("request r\\u2028\\x85forged finished (length)"), lines


def test_serve_rejects_bad_sizes_and_models_before_listening(tmp_path):
    """--page-size 0 was a ZeroDivisionError; --max-num-seqs 0 or -4 silently became 1; a missing or unreadable
    --model failed only after the server listened."""
    from serve.cli import check_model, check_server_flags, engine_config

    for flag in ("--page-size", "--max-num-seqs", "--cache-mb"):
        with pytest.raises(ValueError, match=flag):
            engine_config(_serve_options(flag, "0"))
    with pytest.raises(ValueError, match="--max-num-seqs"):
        engine_config(_serve_options("--max-num-seqs", "-4"))
    # a decode bucket past --max-num-seqs ran that many requests at once (LLM(...) refuses it too)
    with pytest.raises(ValueError, match="--decode-buckets 1,16: .* at most --max-num-seqs 8"):
        engine_config(_serve_options("--max-num-seqs", "8", "--decode-buckets", "1,16"))
    assert engine_config(_serve_options("--max-num-seqs", "8", "--decode-buckets", "1,4")).decode_buckets == (1, 4)
    with pytest.raises(ValueError, match="--model .*neither a preset"):
        check_model(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text('{"model_type": "kimi_linear"}')
    with pytest.raises(ValueError, match="--model .*num_hidden_layers"):
        check_model(str(tmp_path))
    unreadable = tmp_path / "unreadable"
    (unreadable / "config.json").mkdir(parents=True)  # an OSError reading it (as a file without read permission)
    with pytest.raises(ValueError, match="--model .*unreadable.*config.json"):  # was an IsADirectoryError traceback
        check_model(str(unreadable))
    check_model("k3-small")
    for flag, value in (("--port", "70000"), ("--max-waiting", "-1"), ("--rpm", "0"), ("--tpm", "-5")):
        with pytest.raises(ValueError, match=flag):
            check_server_flags(_serve_options(flag, value))
    check_server_flags(_serve_options("--port", "0"))
    with pytest.raises(ValueError, match="max_logprobs"):
        engine_config(_serve_options("--max-logprobs", "-1")).validate()


def test_serve_says_listening_only_once_bound_and_a_port_in_use_exits_3():
    """`k3jax serve` said "listening on ..." before uvicorn bound its port: on a port in use it said so, then failed.
    It says so once bound; a port in use exits with uvicorn's start-up failure code 3, the line never said."""
    import socket
    import subprocess
    import sys

    def serve(port: int) -> subprocess.Popen:
        argv = ["serve", "--model", "tiny-k3", "--host", "127.0.0.1", "--port", str(port)]
        return subprocess.Popen([sys.executable, "-m", "k3jax.cli", *argv],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = serve(taken.getsockname()[1])
        _, err = busy.communicate(timeout=300)
    assert busy.returncode == 3 and "address already in use" in err and "listening on" not in err, err
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    bound = serve(port)
    try:
        for line in bound.stderr:  # (the line comes before the model loads)
            if "listening on" in line or "loading" in line:
                break
        with socket.create_connection(("127.0.0.1", port), timeout=10):  # it listens when it says so
            pass
    finally:
        bound.kill()
        bound.communicate(timeout=60)
    assert f"listening on http://127.0.0.1:{port}" in line, line


def test_serve_rejects_bad_process_ids_and_offloading_sizes_before_listening():
    """--process-id 1 without a multi-host mesh loaded the model, compiled every program, then raised a
    RuntimeError out of `follow()` (a traceback); --kv-offloading-size nan / inf raised "cannot convert float NaN
    to integer" / an OverflowError naming no flag."""
    from serve.cli import check_server_flags, engine_config

    for argv, flag in ((("--process-id", "1"), "--process-id"), (("--process-id", "-1"), "--process-id"),
                       (("--num-processes", "2", "--process-id", "2"), "--process-id"),
                       (("--num-processes", "0"), "--num-processes")):
        with pytest.raises(ValueError, match=flag):
            check_server_flags(_serve_options(*argv))
    check_server_flags(_serve_options("--num-processes", "2", "--process-id", "1"))
    for value in ("nan", "inf", "-1"):
        with pytest.raises(ValueError, match="--kv-offloading-size"):
            engine_config(_serve_options("--kv-offloading-size", value))


def test_generate_refuses_hidden_states_unless_the_server_returns_them():
    """/generate's `return_hidden_states` on a server started without --enable-return-hidden-states: 400 naming
    the field (the engine would refuse it too, naming the engine option)."""
    from types import SimpleNamespace

    from serve.api import APIError
    from serve.sglang_api import GenerateRequest, sampling_of

    body = GenerateRequest(input_ids=[1, 2, 3], return_hidden_states=True)
    st = SimpleNamespace(vocab_size=512, max_logprobs=5, hidden_states=False, max_model_len=64)
    with pytest.raises(APIError) as e:
        sampling_of(st, body, [[1, 2, 3]])
    assert e.value.status == 400 and e.value.param == "return_hidden_states"
    st.hidden_states = True
    assert sampling_of(st, body, [[1, 2, 3]]).return_hidden_states
    # SGLang's greedy threshold: below 1e-6 is greedy (the engine would sample a tiny temperature at 0.01)
    for t, want in ((1e-7, 0.0), (1e-6, 1e-6), (0.5, 0.5)):
        body = GenerateRequest(input_ids=[1, 2, 3], sampling_params={"temperature": t})
        assert sampling_of(st, body, [[1, 2, 3]]).temperature == want


def test_generate_default_max_new_tokens_shrinks_to_the_context():
    """/generate (SGLang's): an unset max_new_tokens is 128, or what the context leaves after the (longest)
    prompt if less; a given one that does not fit is refused."""
    from recording_engine import Recorder

    eng = Recorder(max_model_len=160)
    app = create_app(eng, "m")

    async def go(body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/generate", json=body)

    for body, want in (({"input_ids": [1] * 10}, 128), ({"input_ids": [1] * 100}, 60),
                       ({"input_ids": [[1] * 4, [1] * 150], "sampling_params": {"temperature": 0}}, 10),
                       ({"input_ids": [1] * 100, "sampling_params": {"max_new_tokens": 60}}, 60),
                       ({"input_ids": [1] * 100, "sampling_params": {"max_new_tokens": None}}, None)):
        r = asyncio.run(go(body))
        assert r.status_code == 200, r.text
        assert eng.params[-1].max_tokens == want, (body, want)
    r = asyncio.run(go({"input_ids": [1] * 100, "sampling_params": {"max_new_tokens": 61}}))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["message"].startswith("'max_new_tokens' is too large: 61.")


def test_generate_takes_sglangs_per_prompt_sampling_params_list():
    """SGLang's /generate batch may give one `sampling_params` object per prompt (a list, one `n` for all): each
    prompt runs under its own (it was a 400); a list of the wrong length, differing `n`s, or a bad entry are 400s
    naming it; one object still serves every prompt, its errors named as before."""
    from recording_engine import Recorder

    eng = Recorder(max_model_len=160)
    app = create_app(eng, "m")

    async def go(body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/generate", json=body)

    each = [{"max_new_tokens": 2, "sampling_seed": 5, "n": 2}, {"temperature": 0, "stop": ["x"], "n": 2}]
    r = asyncio.run(go({"input_ids": [[1, 2], [3] * 100], "sampling_params": each}))
    assert r.status_code == 200, r.text
    assert len(r.json()) == 4 and [o["meta_info"]["prompt_tokens"] for o in r.json()] == [2, 2, 100, 100]
    got = [(p.max_tokens, p.seed, p.temperature, p.stop, p.n) for p in eng.params[-2:]]
    assert got == [(2, 5, 1.0, [], 2), (60, None, 0.0, ["x"], 2)]  # (the second's default cut to its context)
    for sp, param in (([{}], "sampling_params"), ([{"n": 2}, {}], "sampling_params.n"),
                      ([{}, {"temperature": -1}], "sampling_params.1.temperature"),
                      ([{}, {"max_new_tokens": 100}], "max_new_tokens"),
                      ({"temperature": -1}, "sampling_params.temperature"), (3, "sampling_params")):
        r = asyncio.run(go({"input_ids": [[1, 2], [3] * 100], "sampling_params": sp}))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (sp, r.text)
    r = asyncio.run(go({"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 3}}))
    assert r.status_code == 200 and [p.max_tokens for p in eng.params[-2:]] == [3, 3]


class _Scored(_OneToken):
    """A stand-in AsyncEngine answering one token (7) with the logprobs its params ask for: the output token's
    (its top `logprobs` alternatives) and every prompt position's but the first (with `prompt_logprobs`)."""

    def stats(self):
        return {}

    async def generate(self, prompt, params, request_id, priority=0, on_accept=None, **extra):
        from serve.types import CompletionOutput, Logprob, RequestOutput, TokenLogprobs

        on_accept()
        self.calls.append((list(prompt), params))

        def scored(tid, k):
            return TokenLogprobs(Logprob(tid, -1.0, "", 1), [Logprob(1, -0.5, "", 1)] * k)
        lps = None if params.logprobs is None else [scored(7, params.logprobs)]
        prompt_lps = None if params.prompt_logprobs is None else [None] + [scored(t, params.prompt_logprobs)
                                                                           for t in prompt[1:]]
        outs = [CompletionOutput(j, "", [7], "length", logprobs=lps) for j in range(params.n)]
        yield RequestOutput(request_id, None, list(prompt), outs, finished=True, prompt_logprobs=prompt_lps)


def test_generate_takes_sglangs_per_prompt_rid_and_logprob_lists():
    """SGLang's /generate batch may give `rid`, `return_logprob`, `logprob_start_len` and `top_logprobs_num` as lists
    of one per prompt (GenerateReqInput's normalisation); each was a 400 ("Input should be a valid string"). Each
    prompt gets its own id and the logprobs it asked for; a list of another length, a repeated rid, or a bad entry
    are 400s naming it. A logprob_start_len past its prompt's end is a 400 (SGLang refuses it; it was cut to the
    prompt's end, answering no prompt logprobs)."""
    eng = _Scored()
    app = create_app(eng, "m")

    async def go(body):
        eng.calls.clear()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/generate", json={"input_ids": [[1, 2, 3], [4, 5]], **body})

    r = asyncio.run(go({"rid": ["a", "b"], "return_logprob": [True, False], "logprob_start_len": [1, 0],
                        "top_logprobs_num": [2, 3]}))
    assert r.status_code == 200, r.text
    a, b = [o["meta_info"] for o in r.json()]
    assert a["id"] == "a" and b["id"] == "b"
    assert a["output_token_logprobs"] == [[-1.0, 7, None]] and len(a["output_top_logprobs"][0]) == 2
    assert [e[1] for e in a["input_token_logprobs"]] == [2, 3] and len(a["input_top_logprobs"]) == 2
    assert not any(k.endswith("logprobs") for k in b)
    asked = {p[0]: (params.logprobs, params.prompt_logprobs) for p, params in eng.calls}
    assert asked == {1: (2, 2), 4: (None, None)}
    r = asyncio.run(go({"rid": ["a", "b"], "return_logprob": True, "logprob_start_len": [-1, 2],
                        "top_logprobs_num": [0, 1], "sampling_params": {"n": 2}}))
    assert r.status_code == 200, r.text
    metas = [o["meta_info"] for o in r.json()]
    assert [m["id"] for m in metas] == ["a_0", "a_1", "b_0", "b_1"]
    assert ["input_token_logprobs" in m for m in metas] == [False, False, True, True]
    assert ["output_top_logprobs" in m for m in metas] == [False, False, True, True]
    for body, param in (({"rid": ["a"]}, "rid"), ({"rid": ["a", "a"]}, "rid"),
                        ({"return_logprob": [True, True, False]}, "return_logprob"),
                        ({"return_logprob": True, "logprob_start_len": [0, -2]}, "logprob_start_len.1"),
                        ({"return_logprob": True, "top_logprobs_num": [1, 21]}, "top_logprobs_num.1"),
                        ({"return_logprob": True, "logprob_start_len": [0, 3]}, "logprob_start_len"),
                        ({"return_logprob": True, "logprob_start_len": 4}, "logprob_start_len")):
        r = asyncio.run(go(body))
        assert r.status_code == 400 and r.json()["error"]["param"] == param and not eng.calls, (body, r.text)
    r = asyncio.run(go({"return_logprob": True, "logprob_start_len": 2}))  # the shorter prompt's end: none of it
    assert r.status_code == 200 and r.json()[1]["meta_info"]["input_token_logprobs"] == [], r.text


class _UntilAborted(_OneToken):
    """A stand-in AsyncEngine: each request streams token 7 every 10 ms until aborted (finish_reason "abort")."""

    def __init__(self):
        super().__init__()
        self.capacity, self.aborted, self.started = 8, [], []

    def stats(self):
        return {}

    def abort(self, request_id):
        self.aborted.append(request_id)

    async def generate(self, prompt, params, request_id, priority=0, on_accept=None, **extra):
        from serve.types import CompletionOutput, RequestOutput

        on_accept()
        self.started.append(request_id)
        while request_id not in self.aborted:
            yield RequestOutput(request_id, None, list(prompt), [CompletionOutput(0, "", [7], None)], finished=False)
            await asyncio.sleep(0.01)
        yield RequestOutput(request_id, None, list(prompt), [CompletionOutput(0, "", [], "abort")], finished=True)


def test_abort_request_by_one_of_a_batchs_per_prompt_rids():
    """/abort_request with one id of SGLang's per-prompt `rid` list ends that prompt's request only (SGLang's
    requests are one per rid); the batch's other prompts run on until aborted by their own ids."""
    eng = _UntilAborted()
    app = create_app(eng, "m")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            run = asyncio.ensure_future(c.post("/generate", json={"input_ids": [[1], [2], [3]],
                                                                  "rid": ["p", "q", "r"]}))
            while len(eng.started) < 3 and not run.done():
                await asyncio.sleep(0.01)
            assert not run.done(), (await run).text
            one = (await c.post("/abort_request", json={"rid": "q"})).json()
            await asyncio.sleep(0.05)
            assert not run.done()
            rest = [(await c.post("/abort_request", json={"rid": rid})).json() for rid in ("p", "r")]
            return one, rest, await run

    one, rest, r = asyncio.run(go())
    assert one == {"aborted": 1} and rest == [{"aborted": 1}, {"aborted": 1}]
    assert [rid.rsplit("-", 1)[1] for rid in eng.aborted] == ["1", "0", "2"]
    assert r.status_code == 200 and [o["meta_info"]["id"] for o in r.json()] == ["p", "q", "r"]
    assert {o["meta_info"]["finish_reason"]["type"] for o in r.json()} == {"abort"}
    assert not app.state.k3.runs  # untracked under every id


class _LateAdd(_UntilAborted):
    """As `_UntilAborted`, but a request reaches the engine only once `gate` opens, and an abort of an id the engine
    does not hold yet is ignored (AsyncEngine's rule: ids not in flight)."""

    def __init__(self):
        super().__init__()
        self.gate, self.called = asyncio.Event(), []

    def abort(self, request_id):
        if request_id in self.started:
            self.aborted.append(request_id)

    async def generate(self, prompt, params, request_id, priority=0, on_accept=None, **extra):
        from serve.types import CompletionOutput, RequestOutput

        self.called.append(request_id)
        await self.gate.wait()
        self.started.append(request_id)  # queued: then the caller hears of it (as AsyncEngine's on_accept)
        on_accept()
        while request_id not in self.aborted:
            yield RequestOutput(request_id, None, list(prompt), [CompletionOutput(0, "", [7], None)], finished=False)
            await asyncio.sleep(0.01)
        yield RequestOutput(request_id, None, list(prompt), [CompletionOutput(0, "", [], "abort")], finished=True)


def test_an_abort_that_comes_before_the_engine_holds_the_request_still_ends_it():
    """/abort_request for a request the engine has not queued yet (its add still on the way) was lost: the engine
    ignores ids not in flight, and the request then ran to its end. The run aborts it again once the engine has it."""
    eng = _LateAdd()
    app = create_app(eng, "m")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            run = asyncio.ensure_future(c.post("/generate", json={"input_ids": [1, 2], "rid": "p"}))
            while not eng.called:
                await asyncio.sleep(0.01)
            aborted = (await c.post("/abort_request", json={"rid": "p"})).json()
            eng.gate.set()
            return aborted, await asyncio.wait_for(run, 5)

    aborted, r = asyncio.run(go())
    assert aborted == {"aborted": 1} and len(eng.aborted) == 1
    assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_sglang_weight_version_and_model_info_routes():
    """SGLang's GET /get_weight_version ({"weight_version"}) and /get_model_info's newer name /model_info (slime reads
    the version from one or the other; both were 404s)."""
    from recording_engine import Recorder

    app = create_app(Recorder(max_model_len=64), "m")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return [await c.get(p) for p in ("/get_weight_version", "/model_info", "/get_model_info")]

    version, info, old = asyncio.run(go())
    assert version.status_code == 200 and version.json() == {"weight_version": "default"}
    assert info.status_code == 200 and info.json() == old.json() and info.json()["weight_version"] == "default"


def test_sglang_server_info_max_total_num_tokens_counts_each_token_once():
    """/get_server_info's `max_total_num_tokens` is the tokens the arena holds: a unit is one MLA layer's page, so
    units x page size counted each token once per MLA layer (4x here); the scratch page and slot and a request's
    KDA state slot hold no token."""
    from recording_engine import Recorder

    class Arena(Recorder):
        replicas = 1

        def stats(self):  # (data-parallel replicas' units are summed, as their running rows are)
            return {"cache_config": {"num_gpu_blocks": 1000 * self.replicas, "block_size": 16, "kda_slot_units": 10},
                    **({"data_parallel_size": self.replicas} if self.replicas > 1 else {})}

    eng = Arena(max_model_len=64)
    eng.engine.cfg.num_mla_layers = 4
    app = create_app(eng, "m")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.get("/get_server_info")).json()

    assert asyncio.run(go())["max_total_num_tokens"] == (1000 - 1 - 2 * 10) // 4 * 16
    eng.replicas = 2
    assert asyncio.run(go())["max_total_num_tokens"] == 2 * ((1000 - 1 - 2 * 10) // 4 * 16)


def _unread(state) -> bool:
    """Whether a request of the server `state` holds outputs its client has not read yet."""
    return any(run.q.items for runs in state.runs.values() for run in runs)


class _TwoSamples(_OneToken):
    """A stand-in AsyncEngine streaming deltas of an n = 2 request: both samples' first tokens, then sample 0
    ends at its length, then sample 1 at a stop; with `server` (the app's state) set, each step waits until the
    client read the one before."""

    server = None

    def stats(self):
        return {}

    async def generate(self, prompt, params, request_id, priority=0, on_accept=None, **extra):
        from serve.types import CompletionOutput, RequestMetrics, RequestOutput

        on_accept()
        m = RequestMetrics(arrival_time=0.0)
        steps = [[(0, [1], None), (1, [2], None)], [(0, [3], "length")], [(1, [4], "stop")]]
        for k, step in enumerate(steps):
            while k and self.server is not None and _unread(self.server):
                await asyncio.sleep(0.001)  # a step apart, once the client read the last (unread outputs coalesce)
            outs = [CompletionOutput(j, "", ids, reason) for j, ids, reason in step]
            yield RequestOutput(request_id, None, list(prompt), outs, finished=k == len(steps) - 1, metrics=m)


class _AbortedMidPrefill(_OneToken):
    """A stand-in AsyncEngine whose request is aborted mid-prefill: its one output ends ("abort", no token) with
    prompt logprobs for the positions computed so far only (the rest None, as the engine hands them out)."""

    def stats(self):
        return {}

    async def generate(self, prompt, params, request_id, priority=0, on_accept=None, **extra):
        from serve.types import CompletionOutput, Logprob, RequestOutput, TokenLogprobs

        on_accept()
        scored = TokenLogprobs(Logprob(prompt[1], -0.5, "i", 2), [Logprob(1, -0.25, "", 1)])
        lps = [None, scored] + [None] * (len(prompt) - 2)
        yield RequestOutput(request_id, None, list(prompt), [CompletionOutput(0, "", [], "abort", logprobs=[])],
                            finished=True, prompt_logprobs=lps)


def test_prompt_logprobs_of_a_request_aborted_mid_prefill():
    """A request with prompt logprobs aborted before its prefill scored the whole prompt (/abort_request, a pause)
    is answered, its unscored positions null (it was a 500: their None entries were read as logprobs), in
    prompt_logprobs, echo's logprobs (streamed too) and /generate's input_token_logprobs."""
    from k3jax.tokenizer import ByteTokenizer

    eng = _AbortedMidPrefill()
    eng.engine.tokenizer, eng.engine.cfg.vocab_size = ByteTokenizer(), 512
    app = create_app(eng, "m")
    prompt = [104, 105, 33, 63]  # "hi!?"

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            a = await c.post("/v1/completions", json={"prompt": prompt, "prompt_logprobs": 1})
            b = await c.post("/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 1})
            s = await c.post("/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 1, "stream": True})
            g = await c.post("/generate", json={"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                                                "top_logprobs_num": 1})
            return a, b, s, g

    a, b, s, g = asyncio.run(go())
    assert a.status_code == 200, a.text
    choice = a.json()["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert choice["prompt_logprobs"] == [None, {"105": {"logprob": -0.5, "rank": 2, "decoded_token": "i"},
                                                "1": {"logprob": -0.25, "rank": 1, "decoded_token": ""}}, None, None]
    assert b.status_code == 200, b.text
    echoed = b.json()["choices"][0]
    assert echoed["text"] == "hi!?" and echoed["logprobs"]["tokens"] == ["h", "i", "!", "?"]
    assert echoed["logprobs"]["token_logprobs"] == [None, -0.5, None, None]
    chunk = json.loads(s.text.split("\n\n")[0][len("data: "):])
    assert chunk["choices"][0]["logprobs"]["token_logprobs"] == [None, -0.5, None, None], s.text
    assert g.status_code == 200, g.text
    meta = g.json()["meta_info"]
    assert [e[0] for e in meta["input_token_logprobs"]] == [None, -0.5, None, None]
    assert meta["input_top_logprobs"] == [None, [[-0.25, 1, None]], None, None]
    assert [e[1] for e in meta["input_token_logprobs"]] == prompt


def _complete_then_scrape(engine, body: dict) -> tuple:
    """POST `body` to /v1/completions of an app over `engine`, then GET /metrics -> (response, metrics text)."""
    from recording_engine import post_then_scrape

    r, text = post_then_scrape(engine, body)
    assert r.status_code == 200, r.text
    return r, text


def test_request_histograms_observe_each_of_n_samples():
    """vLLM observes each of a request's n samples as a request (its output processor's child requests): with
    n = 2, two first tokens, two end-to-end latencies, two prompt-token and generation-token observations of
    each sample's own tokens, as `vllm:request_success` counts two."""
    from prometheus_client.parser import text_string_to_metric_families

    _, text = _complete_then_scrape(_TwoSamples(), {"prompt": [5, 6, 7], "n": 2, "max_tokens": 2})
    samples = {(s.name, s.labels.get("finished_reason")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prompt_tokens",
              "request_generation_tokens"):
        assert samples[(f"vllm:{h}_count", None)] == 2, h
    assert samples[("vllm:request_prompt_tokens_sum", None)] == 6
    assert samples[("vllm:request_generation_tokens_sum", None)] == 4
    assert samples[("vllm:request_success_total", "length")] == samples[("vllm:request_success_total", "stop")] == 1


class _ConstraintFails(_OneToken):
    """A stand-in AsyncEngine whose request's constraint fails after one token (the engine's finish reason "error",
    stop_reason llguidance's message)."""

    def stats(self):
        return {}

    async def generate(self, prompt, params, request_id, priority=0, on_accept=None, **extra):
        from serve.types import CompletionOutput, RequestMetrics, RequestOutput

        on_accept()
        out = CompletionOutput(0, "{", [1], "error", "Parser Error: Current row has 2807 items; max is 2000")
        yield RequestOutput(request_id, None, list(prompt), [out], finished=True,
                            metrics=RequestMetrics(arrival_time=0.0))


def test_a_constraint_that_fails_mid_generation_is_an_error_not_a_stop():
    """vLLM ends a request whose grammar rejects a token with finish reason "error" and answers an error: the output
    (`{`) is not in the constraint's language, so never a 200 with finish_reason "stop" (it was); streamed, the
    error is the stream's last event; `vllm:request_success` counts it as "error"."""
    from prometheus_client.parser import text_string_to_metric_families

    from recording_engine import post_then_scrape

    body = {"prompt": [5, 6], "max_tokens": 4, "response_format": {"type": "json_object"}}
    r, text = post_then_scrape(_ConstraintFails(), body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "response_format", r.text  # the field the client sent
    assert "failed during generation" in err["message"] and "2807 items" in err["message"], err
    assert next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "vllm:request_success_total" and s.labels.get("finished_reason") == "error") == 1
    r, _ = post_then_scrape(_ConstraintFails(), {**body, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["message"].startswith("response_format: the constraint failed"), events
    assert events[-1]["error"]["param"] == "response_format", events  # (as the 400 of a request that does not stream)
    assert not any(c.get("finish_reason") == "stop" for e in events for c in e.get("choices", ())), events


def test_a_schema_past_llguidances_limits_deep_inside_is_a_400_before_it_runs():
    """A schema whose too-wide object sits below its first tokens compiled, ran, and ended mid-generation (a 400 after
    the tokens were spent, or a stream's error event after its chunks): refused before it runs, naming the field the
    client sent and where in the schema."""
    from k3jax.tokenizer import ByteTokenizer
    from recording_engine import Recorder
    from serve.structured import GrammarCompiler

    tok = ByteTokenizer(320)
    eng = Recorder(max_model_len=64, tokenizer=tok)
    eng.engine.grammars = GrammarCompiler(tok, 512, tok.eos_token_ids)
    app = create_app(eng, "m")
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(700)}}
    schema = {"type": "object", "properties": {"id": {"type": "string"}, "data": wide}, "required": ["id", "data"]}
    cases = [("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema":
                                                                                           schema}}}, "response_format"),
             ("/v1/completions", {"guided_json": schema}, "guided_json"),
             ("/v1/completions", {"structured_outputs": {"json": schema}, "stream": True}, "structured_outputs.json"),
             ("/generate", {"sampling_params": {"json_schema": json.dumps(schema)}}, "sampling_params.json_schema")]

    async def go(path, body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, json={"prompt": [5, 6], "max_tokens": 4, **body} if path == "/v1/completions"
                                else {"input_ids": [5, 6], **body})

    for path, body, param in cases:
        r = asyncio.run(go(path, body))
        assert r.status_code == 400, (param, r.text)
        err = r.json()["error"]
        assert err["param"] == param and "too complex for the grammar engine (at /properties/data: " in err["message"], err
    assert eng.params == []  # none ran


def test_a_constraint_with_a_lone_surrogate_is_a_400_naming_the_clients_field():
    """JSON's "\\ud800" in a constraint's text (a choice, a schema's string) is no UTF-8 text for llguidance: the 400
    said "unexpected end of hex escape at line 1 column N" (or a codec's message); it names the field the client sent
    and where the surrogate is."""
    from k3jax.tokenizer import ByteTokenizer
    from recording_engine import Recorder
    from serve.structured import GrammarCompiler

    tok = ByteTokenizer(320)
    eng = Recorder(max_model_len=64, tokenizer=tok)
    eng.engine.grammars = GrammarCompiler(tok, 512, tok.eos_token_ids)
    app = create_app(eng, "m")

    async def go(body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/v1/completions", content=json.dumps({"prompt": [5], "max_tokens": 2, **body}),
                                headers={"content-type": "application/json"})

    for body, param, where in (({"guided_choice": ["a", "b\ud800"]}, "guided_choice", "in item 1, at position 1"),
                               ({"guided_json": {"enum": ["\udc00"]}}, "guided_json", "at /enum/0")):
        r = asyncio.run(go(body))
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param, r.text
        assert err["message"] == f"{param}: not valid Unicode text (a lone surrogate {where})", err
    assert eng.params == []  # none ran


@pytest.mark.parametrize("key, field", [("json_schema", "sampling_params.json_schema"),
                                        ("regex", "sampling_params.regex"), ("ebnf", "sampling_params.ebnf")])
@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_that_fails_mid_generation_names_sglangs_field(key, field, stream):
    """On SGLang's /generate, a constraint failing mid-generation names the client's field, streamed or not: the 400
    named `sampling_params` (which of json_schema, regex, ebnf?), the stream's error event the engine's
    `structured_outputs` and no `param`."""
    value = {"json_schema": '{"type": "object"}', "regex": "a+", "ebnf": 'root ::= "a"'}[key]
    app = create_app(_ConstraintFails(), "m")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/generate", json={"input_ids": [5, 6], "stream": stream,
                                                   "sampling_params": {"max_new_tokens": 4, key: value}})

    r = asyncio.run(go())
    err = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")][-1] if stream \
        else r.json()
    assert (r.status_code, err.get("status", 400)) == ((200, 400) if stream else (400, 400)), r.text
    assert err["error"]["param"] == field and err["error"]["message"].startswith(f"{field}: the constraint failed")


class _TimedSamples(_OneToken):
    """A stand-in AsyncEngine streaming deltas of an n = 2 request with the engine's timings: scheduled at 1 s,
    both samples' first tokens from the step at 2 s, sample 0's last at 3 s (it ends), sample 1's at 5 s."""

    def stats(self):
        return {}

    async def generate(self, prompt, params, request_id, priority=0, on_accept=None, **extra):
        from serve.types import CompletionOutput, RequestMetrics, RequestOutput

        on_accept()
        steps = [(2.0, [(0, [1], None), (1, [2], None)]), (3.0, [(0, [3], "length"), (1, [4], None)]),
                 (5.0, [(1, [5], "stop")])]
        for k, (t, step) in enumerate(steps):
            m = RequestMetrics(arrival_time=0.0, first_scheduled_time=1.0, first_token_time=2.0, last_token_time=t)
            outs = [CompletionOutput(j, "", ids, reason) for j, ids, reason in step]
            yield RequestOutput(request_id, None, list(prompt), outs, finished=k == len(steps) - 1, metrics=m)


def test_request_phase_histograms_observe_each_sample():
    """vLLM's request_prefill_time (first scheduled -> first token), request_decode_time (first -> last token)
    and request_inference_time (first scheduled -> last token), one observation per sample from the engine's
    times: sample 0 1 + 1 + 2 s, sample 1 1 + 3 + 4 s."""
    from prometheus_client.parser import text_string_to_metric_families

    _, text = _complete_then_scrape(_TimedSamples(), {"prompt": [5, 6, 7], "n": 2, "max_tokens": 3})
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
               if not s.labels.get("le")}
    for h, total in (("prefill", 2.0), ("decode", 4.0), ("inference", 6.0)):
        assert samples[f"vllm:request_{h}_time_seconds_count"] == 2, h
        assert samples[f"vllm:request_{h}_time_seconds_sum"] == pytest.approx(total), h


def test_iteration_tokens_histogram_from_the_engine_counts():
    """vLLM's `vllm:iteration_tokens_total` (tokens per engine step), from the per-bucket counts the engine keeps
    (`serve/series.py: BucketCounts`; cumulative buckets built at scrape time; counts of data-parallel replicas
    add key by key)."""
    from prometheus_client.parser import text_string_to_metric_families

    from serve.series import ITERATION_TOKEN_BUCKETS, BucketCounts

    counts = BucketCounts(ITERATION_TOKEN_BUCKETS)
    for n in (1, 5, 8, 9, 64, 20000):
        counts.observe(n)
    text = ServerMetrics("m", lambda: {"iteration_tokens": counts.as_dict()}, dict).exposition().decode()
    fam = next(f for f in text_string_to_metric_families(text) if f.name == "vllm:iteration_tokens_total")
    assert fam.type == "histogram"
    got = {s.labels.get("le") or s.name: s.value for s in fam.samples}
    assert (got["1.0"], got["8.0"], got["16.0"], got["64.0"], got["16384.0"], got["+Inf"]) == (1, 3, 4, 5, 5, 6)
    assert got["vllm:iteration_tokens_total_count"] == 6 and got["vllm:iteration_tokens_total_sum"] == 20087


def test_continuous_usage_is_each_choices_own():
    """vLLM's continuous_usage_stats: a streamed chunk's usage is its choice's prompt tokens and the tokens streamed
    for that choice so far, not the whole request's."""
    eng = _TwoSamples()
    app = create_app(eng, "m")
    eng.server = app.state.k3

    async def go():
        body = {"prompt": [5, 6, 7], "n": 2, "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.post("/v1/completions", json=body)).text

    events = [json.loads(line[6:]) for line in asyncio.run(go()).splitlines() if line.startswith("data: {")]
    per_choice = [(e["choices"][0]["index"], e["usage"]["prompt_tokens"], e["usage"]["completion_tokens"])
                  for e in events if len(e["choices"]) == 1]
    assert per_choice == [(0, 3, 1), (1, 3, 1), (0, 3, 2), (1, 3, 2)], per_choice
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4



class _Burst(_TwoSamples):
    """A stand-in AsyncEngine far faster than its client: `steps` one-token deltas of both of an n = 2 request's
    samples ("a" and "b"), none awaited."""

    steps = 500

    async def generate(self, prompt, params, request_id, priority=0, on_accept=None, **extra):
        from serve.types import CompletionOutput, RequestOutput

        on_accept()
        for k in range(self.steps):
            end = "length" if k == self.steps - 1 else None
            outs = [CompletionOutput(0, "a", [97], end), CompletionOutput(1, "b", [98], end)]
            yield RequestOutput(request_id, None, list(prompt), outs, finished=end is not None)


def test_stream_outputs_a_slow_client_has_not_read_coalesce():
    """Outputs a streaming client has not read yet merge into one per prompt (vLLM's RequestOutputCollector), so a
    client slower than the engine gets fewer, larger chunks, every token in them: the server queued one output per
    step for it (500 steps, 1000 chunks), a backlog without bound."""
    from k3jax.tokenizer import ByteTokenizer

    eng = _Burst()
    eng.engine.tokenizer, eng.engine.cfg.vocab_size = ByteTokenizer(), 512
    eng.engine.config.max_model_len = 1024
    app = create_app(eng, "m")

    async def go():
        body = {"prompt": [5, 6, 7], "n": 2, "max_tokens": 500, "stream": True,
                "stream_options": {"include_usage": True}}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/v1/completions", json=body)

    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert len(chunks) <= 4, len(chunks)
    assert {i: "".join(c["text"] for c in chunks if c["index"] == i) for i in (0, 1)} == {0: "a" * 500, 1: "b" * 500}
    assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["length", "length"]
    assert events[-1]["usage"]["completion_tokens"] == 1000


def test_continuous_usage_on_chat_role_and_echo_chunks():
    """vLLM's continuous_usage_stats in chat: the role chunk and the echo chunk of each choice carry usage too (the
    prompt's tokens, 0 completion tokens); they carried `usage: null`."""
    from k3jax.tokenizer import ByteTokenizer

    eng = _TwoSamples()
    eng.engine.tokenizer, eng.engine.cfg.vocab_size = ByteTokenizer(), 512
    app = create_app(eng, "m")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "So"}]

    async def go():
        body = {"messages": messages, "add_generation_prompt": False, "echo": True, "n": 2, "max_tokens": 2,
                "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            tokens = (await c.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})).json()
            return tokens["count"], (await c.post("/v1/chat/completions", json=body)).text

    count, text = asyncio.run(go())
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert all(e["usage"] is not None for e in events), events
    opening = [(e["choices"][0]["index"], e["choices"][0]["delta"], e["usage"]["completion_tokens"])
               for e in events[:4]]
    assert opening == [(0, {"role": "assistant", "content": ""}, 0), (1, {"role": "assistant", "content": ""}, 0),
                       (0, {"content": "So"}, 0), (1, {"content": "So"}, 0)], opening
    assert {e["usage"]["prompt_tokens"] for e in events} == {count}

def test_tokenize_adds_no_bos_and_returns_token_strs():
    """vLLM's /tokenize: `add_special_tokens` (default true for a prompt) adds what the tokenizer's encode adds, which
    for the Kimi tokenizers is nothing (their HF encode prepends no [BOS]; the engine never does either), so the ids
    are the prompt generation sees (it prepended the BOS id); `return_token_strs` gives each id as HF's
    convert_ids_to_tokens writes it (it was a 400)."""
    from k3jax.tokenizer import ByteTokenizer

    eng = _TwoSamples()
    eng.engine.tokenizer, eng.engine.cfg.vocab_size = ByteTokenizer(), 512
    app = create_app(eng, "m")
    prompt = "a é<|im_end|>"
    msgs = [{"role": "user", "content": "hi"}]

    async def go(body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.post("/tokenize", json=body)).json()

    want = ByteTokenizer().encode(prompt, allow_special=True)  # what a completion's prompt becomes
    for extra in ({}, {"add_special_tokens": True}, {"add_special_tokens": False}):
        r = asyncio.run(go({"prompt": prompt, **extra}))
        assert r["tokens"] == want and r["count"] == len(want) and r["token_strs"] is None, (extra, r)
    r = asyncio.run(go({"prompt": prompt, "return_token_strs": True}))
    assert r["token_strs"] == ["a", "Ġ", "Ã", "©", "<|im_end|>"], r  # (HF's byte-level alphabet: " " is "Ġ")
    chat = asyncio.run(go({"messages": msgs, "add_special_tokens": True, "return_token_strs": True}))
    assert chat["tokens"] == asyncio.run(go({"messages": msgs}))["tokens"]
    assert chat["token_strs"][:2] == ["<|im_user|>", "u"] and len(chat["token_strs"]) == chat["count"]


class _KeepsParams(_TwoSamples):
    """`_TwoSamples` that keeps each request's sampling parameters."""

    def __init__(self):
        super().__init__()
        self.params = []

    async def generate(self, prompt, params, request_id, priority=0, on_accept=None, **extra):
        self.params.append(params)
        async for out in super().generate(prompt, params, request_id, priority, on_accept, **extra):
            yield out


def test_spaces_between_special_tokens_is_taken_on_every_route():
    """vLLM's and SGLang's `spaces_between_special_tokens` is a request field (a sampling parameter): it was a 400
    naming it as unknown (and a TypeError in `SamplingParams`). It changes nothing here: the text is the tokenizer's
    own decode, no space added around special or added tokens."""
    from k3jax.tokenizer import ByteTokenizer
    from serve.types import RequestError, SamplingParams

    eng = _KeepsParams()
    eng.engine.tokenizer, eng.engine.cfg.vocab_size = ByteTokenizer(), 512
    app = create_app(eng, "m")
    off = {"spaces_between_special_tokens": False}  # (the stand-in streams two samples)
    bodies = [("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "n": 2, **off}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2, **off}),
              ("/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "n": 2, **off}})]

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return [await c.post(path, json=body) for path, body in bodies]

    for r in asyncio.run(go()):
        assert r.status_code == 200, r.text
    assert [p.spaces_between_special_tokens for p in eng.params] == [False] * 3
    assert SamplingParams().spaces_between_special_tokens is True
    with pytest.raises(RequestError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens="no").validate(512)


def test_chat_takes_openais_store_metadata_service_tier_prediction_and_refuses_audio():
    """OpenAI SDK fields of a chat request that change nothing here (`store`, `metadata`, `service_tier`,
    `prediction`, `modalities: ["text"]`) are accepted, as vLLM ignores them: they were 400s calling them unknown
    ("not part of this API"). Audio output (`audio`, `modalities` with "audio") is a 400 naming the field, and
    OpenAI's deprecated `functions` / `function_call` say what replaces them."""
    from openai.types.chat import ChatCompletion

    from k3jax.tokenizer import ByteTokenizer

    eng = _KeepsParams()
    eng.engine.tokenizer, eng.engine.cfg.vocab_size = ByteTokenizer(), 512
    app = create_app(eng, "m")
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2}
    ignored = {"store": False, "metadata": {"team": "a"}, "service_tier": "auto", "modalities": ["text"],
               "prediction": {"type": "content", "content": "hello"}}
    refused = [("audio", {"audio": {"voice": "alloy", "format": "wav"}}),
               ("modalities", {"modalities": ["text", "audio"]}),
               # OpenAI's deprecated function fields: refused saying what replaces them
               ("functions", {"functions": [{"name": "f", "parameters": {}}]}),
               ("function_call", {"function_call": "auto"})]

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            ok = await c.post("/v1/chat/completions", json={**base, **ignored})
            return ok, [await c.post("/v1/chat/completions", json={**base, **extra}) for _, extra in refused]

    ok, bad = asyncio.run(go())
    assert ok.status_code == 200, ok.text
    assert len(ChatCompletion.model_validate(ok.json()).choices) == 2
    for (field, _), r in zip(refused, bad):
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert "unknown field" not in r.json()["error"]["message"]


def test_truncate_prompt_tokens_minus_one_is_the_context_window():
    """vLLM's `truncate_prompt_tokens: -1` keeps the context window's worth; 0 or more than the window is a 400
    naming the field (it was refused / accepted unbounded)."""
    from types import SimpleNamespace

    from serve.api import APIError, _truncation

    st = SimpleNamespace(max_model_len=128)
    assert _truncation(st, None) is None and _truncation(st, -1) == 128 and _truncation(st, 5) == 5
    for bad in (0, 129, 10 ** 400):
        with pytest.raises(APIError) as e:
            _truncation(st, bad)
        assert e.value.param == "truncate_prompt_tokens"


def test_max_model_len_auto_from_the_command_line():
    """`--max-model-len auto` (or vLLM's -1) reaches the engine as "auto", with the engine's context buckets
    (the command line's one bucket of max_model_len / page_size pages needs the length); 0 stays refused."""
    from k3jax.cli import build_parser
    from serve.cli import DEFAULTS, engine_config

    for text in ("auto", "-1"):
        args = build_parser().parse_args(["serve", "--max-model-len", text])
        cfg = engine_config({k: getattr(args, k, v) for k, v in DEFAULTS.items()})
        assert cfg.max_model_len == "auto" and cfg.context_buckets is None
    args = build_parser().parse_args(["serve", "--max-model-len", "0"])
    with pytest.raises(ValueError, match="--max-model-len: expected an integer >= 1"):
        engine_config({k: getattr(args, k, v) for k, v in DEFAULTS.items()})


class _Adapters(_TwoSamples):
    """`_TwoSamples` serving a LoRA adapter named `ad`."""

    def __init__(self):
        from types import SimpleNamespace as NS

        super().__init__()
        self.engine.loras = NS(by_name={"ad": NS(name="ad", path="/ad")})


def test_adapter_unloaded_while_a_request_waits_releases_its_admission():
    """A request for an adapter held by /pause, the adapter unloaded meanwhile: 404 after /resume, and nothing stays
    admitted (it stayed in flight for ever: /load 1, shutdown drains and /sleep waited on it)."""
    eng = _Adapters()
    app = create_app(eng, "m")
    st = app.state.k3

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            st.pause()
            held = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": [1], "max_tokens": 2,
                                                                         "model": "ad"}))
            while not st.requests_held:
                await asyncio.sleep(0.01)
            eng.engine.loras.by_name = {}
            st.resume()
            return await held, (await c.get("/load")).json()

    r, load = asyncio.run(go())
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    assert load == {"server_load": 0} and st.seqs_in_flight == 0


def test_generate_takes_sglangs_per_prompt_lora_path_list():
    """SGLang's /generate batch names one adapter per prompt (`"lora_path": ["ad", null]`, null: the base model), as
    SGLang's LoRA docs do; it was a 400 ("lora_path: Input should be a valid string"). A list of another length is
    a 400 naming lora_path; one name still serves every prompt."""
    class Recording(_Adapters):
        async def generate(self, prompt, params, request_id, priority=0, on_accept=None, **extra):
            self.calls.append((prompt[0], extra.get("lora_request")))
            async for out in super().generate(prompt, params, request_id, priority, on_accept, **extra):
                yield out

    eng = Recording()
    app = create_app(eng, "m")
    sp = {"max_new_tokens": 2, "n": 2}

    async def go(lora_path, prompts=((1,), (2,), (3,))):
        eng.calls.clear()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/generate", json={"input_ids": [list(p) for p in prompts], "sampling_params": sp,
                                                "lora_path": lora_path})
        return r, sorted(eng.calls)

    r, calls = asyncio.run(go(["ad", None, "ad"]))
    assert r.status_code == 200 and len(r.json()) == 6, r.text
    assert calls == [(1, "ad"), (2, None), (3, "ad")]
    r, calls = asyncio.run(go("ad"))
    assert r.status_code == 200 and calls == [(1, "ad"), (2, "ad"), (3, "ad")]
    r, calls = asyncio.run(go(["ad", None]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path" and not calls
    r, calls = asyncio.run(go(["ad", "zz", None]))
    assert r.status_code == 404 and "`zz` does not exist" in r.json()["error"]["message"] and not calls


def test_serve_options_are_never_abbreviated():
    """A vLLM / SGLang flag we lack is refused, never taken as an abbreviation of one of ours: SGLang's `--tp 8`
    was `--tpm 8` (8 tokens a minute: every request answered 429)."""
    from k3jax.cli import build_parser

    for argv in (["serve", "--tp", "2"], ["serve", "--max-model", "100"], ["run-batch", "-i", "x", "-o", "y", "--tp",
                                                                          "2"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
    assert build_parser().parse_args(["serve", "-tp", "2"]).tensor_parallel_size == 2


def test_vllm_api_key_environment_variable():
    """vLLM's VLLM_API_KEY guards the server when no --api-key is given (it was ignored: the server ran open)."""
    assert set(load_api_keys(None, env={"VLLM_API_KEY": "v"})) == {"v"}
    assert set(load_api_keys(None, env={"VLLM_API_KEY": "v"}, given=["cli"])) == {"cli"}  # --api-key wins
    assert set(load_api_keys(None, env={"VLLM_API_KEY": "v", "K3JAX_API_KEYS": "a,b"})) == {"a", "b", "v"}
    assert load_api_keys(None, env={"VLLM_API_KEY": ""}) is None


def test_max_model_len_takes_vllms_human_readable_sizes():
    """vLLM's --max-model-len 32k (32,000), 32K (32,768), 25.6k; decimals with a binary suffix are refused."""
    from k3jax.cli import build_parser

    for text, want in (("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("1m", 10 ** 6), ("1M", 1 << 20),
                       ("4096", 4096), ("AUTO", "auto")):
        assert build_parser().parse_args(["serve", "--max-model-len", text]).max_model_len == want, text
    for bad in ("1.5K", "32q", "k"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--max-model-len", bad])


def test_serve_takes_the_model_as_vllms_positional():
    """`k3jax serve MODEL` (vLLM's form) is `--model MODEL`, before or after the options; two different models,
    or a model swallowed by --served-model-name's list, are refused naming them."""
    from k3jax.cli import build_parser
    from serve.cli import served_model_path

    for argv in (["serve", "tiny-k3"], ["serve", "--port", "9", "tiny-k3", "--seed", "1"],
                 ["serve", "--model", "tiny-k3"], ["serve", "tiny-k3", "--model", "tiny-k3"]):
        assert served_model_path(build_parser().parse_args(argv)) == "tiny-k3", argv
    assert served_model_path(build_parser().parse_args(["serve"])) == "k3-small"
    with pytest.raises(ValueError, match="name the model once"):
        served_model_path(build_parser().parse_args(["serve", "tiny-k3", "--model", "tiny-kimi-linear"]))
    with pytest.raises(ValueError, match="name the model first"):
        served_model_path(build_parser().parse_args(["serve", "--served-model-name", "kimi", "tiny-k3"]))


def test_served_model_name_takes_several_names():
    """vLLM's --served-model-name A B: requests may name either, responses carry the first, /v1/models lists
    both; a LoRA adapter may not take either name."""
    from k3jax.cli import build_parser
    from recording_engine import Recorder
    from serve.cli import DEFAULTS, lora_modules, served_names

    args = build_parser().parse_args(["serve", "tiny-k3", "--served-model-name", "kimi", "moonshot/kimi"])
    o = {k: getattr(args, k, v) for k, v in DEFAULTS.items()}
    assert served_names(o) == ["kimi", "moonshot/kimi"] and served_names(dict(DEFAULTS)) == ["k3-small"]
    with pytest.raises(ValueError, match="served model's id"):
        lora_modules(dict(o, enable_lora=True, lora_modules=["moonshot/kimi=/x"]))
    app = create_app(Recorder(max_model_len=64), served_names(o), model_path="tiny-k3")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return ([await c.post("/v1/completions", json={"model": m, "prompt": [1, 2], "max_tokens": 1})
                     for m in ("moonshot/kimi", "kimi", "other")], (await c.get("/v1/models")).json())

    (alias, first, other), models = asyncio.run(go())
    assert alias.status_code == first.status_code == 200 and alias.json()["model"] == "kimi"
    assert other.status_code == 404
    assert [m["id"] for m in models["data"]] == ["kimi", "moonshot/kimi"]
    # vLLM's cards: each name's `root` is the model served (it was the first name)
    assert [m["root"] for m in models["data"]] == ["tiny-k3", "tiny-k3"]


def test_vllm_config_file_and_underscored_flags(tmp_path):
    """vLLM's `--config FILE.yaml` (its keys as flags; true / false / lists / mappings; the command line's own
    options win) and `--flag_name` spellings; vLLM's flag names for ours (--no-enable-prefix-caching,
    --uvicorn-log-level, --disable-log-requests); --no-enable-chunked-prefill refused naming it."""
    from k3jax.cli import build_parser, main
    from serve.cli import DEFAULTS, engine_config, served_model_path, vllm_argv

    cfg = tmp_path / "c.yaml"
    cfg.write_text("port: 9001\nmax_model_len: 32k\nenable-prefix-caching: false\nserved-model-name: [a, b]\n"
                   "api-key: [k1, k2]\nspeculative-config: {method: ngram, num_speculative_tokens: 2}\n"
                   "trust-remote-code: true\n")
    parser = build_parser()
    options = parser._subparsers._group_actions[0].choices["serve"]._option_string_actions
    argv = vllm_argv(["tiny-k3", "--config", str(cfg), "--port", "9002", "--max_num_seqs=4"], options)
    args = parser.parse_args(["serve", *argv])
    assert (args.port, args.max_model_len, args.no_prefix_caching, args.served_model_name, args.api_key,
            args.max_num_seqs) == (9002, 32000, True, ["a", "b"], ["k1", "k2"], 4)
    assert json.loads(args.speculative_config) == {"method": "ngram", "num_speculative_tokens": 2}
    assert served_model_path(args) == "tiny-k3"
    args = parser.parse_args(["serve", "--uvicorn-log-level", "trace", "--enable-log-requests",
                              "--disable-log-requests", "--no-enable-prefix-caching", "--enable-prefix-caching"])
    assert (args.log_level, args.enable_log_requests, args.no_prefix_caching) == ("trace", False, False)
    o = {k: getattr(args, k, v) for k, v in DEFAULTS.items()}
    with pytest.raises(ValueError, match="--no-enable-chunked-prefill"):
        engine_config(dict(o, enable_chunked_prefill=False))
    # vLLM's Kimi launch line: the tool / reasoning parser flags are accepted for Kimi names, others refused
    args = parser.parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2",
                              "--reasoning-parser", "kimi_k2"])
    o = {k: getattr(args, k, v) for k, v in DEFAULTS.items()}
    assert o["enable_auto_tool_choice"] and engine_config(o) is not None
    with pytest.raises(ValueError, match="--tool-call-parser hermes: "):
        engine_config(dict(o, tool_call_parser="hermes"))
    with pytest.raises(ValueError, match="--reasoning-parser and --no-reasoning-parser"):
        engine_config(dict(o, no_reasoning_parser=True))
    cfg.write_text("- not a mapping\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    assert main(["serve", "--config", str(tmp_path / "c.json")]) == 2


def test_dtype_takes_vllms_names_and_auto_is_the_checkpoints(tmp_path, capsys):
    """vLLM's --dtype auto (the checkpoint's), float (float32), half / float16 (refused, saying so): all were
    "invalid choice" (a launch line's `--dtype auto` did not start)."""
    from k3jax.cli import build_parser, main
    from k3jax.runtime import load_model, resolve_dtype

    for text, want in (("auto", "auto"), ("float", "float32"), ("float32", "float32"), ("bfloat16", "bfloat16")):
        for sub in (["serve"], ["run-batch", "-i", "x", "-o", "y"], ["generate", "--prompt", "x"], ["convert", "a", "b"]):
            assert build_parser().parse_args([*sub, "--dtype", text]).dtype == want, (sub, text)
    for text in ("half", "float16"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--dtype", text])
        assert "float16 is not supported; use bfloat16" in capsys.readouterr().err
    # auto: config.json's torch_dtype (or dtype; a multimodal config's text_config), an Orbax directory's
    for name, config, want in (("bf16", {"torch_dtype": "bfloat16"}, "bfloat16"), ("new", {"dtype": "bfloat16"},
                               "bfloat16"), ("vl", {"text_config": {"torch_dtype": "bfloat16"}}, "bfloat16"),
                               ("fp16", {"torch_dtype": "float16"}, "float32"), ("none", {}, "float32")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        assert resolve_dtype("auto", str(tmp_path / name)) == want, name
        assert resolve_dtype("float32", str(tmp_path / name)) == "float32"
    assert resolve_dtype("auto", "tiny-k3") == "float32" and load_model("tiny-k3", dtype="auto").dtype == "float32"
    assert main(["convert", "tiny-k3", str(tmp_path / "orbax"), "--dtype", "bfloat16"]) == 0
    assert load_model(str(tmp_path / "orbax"), dtype="auto").dtype == "bfloat16"


def test_dtype_defaults_to_vllms_auto():
    """vLLM's --dtype (and LLM's dtype) default is auto, the checkpoint's torch_dtype: ours was float32 for serve,
    run-batch, generate, LLM and load_model, so a released bf16 Kimi checkpoint loaded at twice its size. Presets
    still load in float32."""
    import inspect

    from k3jax.cli import build_parser
    from k3jax.runtime import load_model
    from serve.cli import DEFAULTS
    from serve.llm import LLM

    for sub in (["serve"], ["run-batch", "-i", "x", "-o", "y"], ["generate", "--prompt", "x"], ["convert", "a", "b"]):
        assert build_parser().parse_args(sub).dtype == "auto", sub
    assert DEFAULTS["dtype"] == "auto"
    for fn in (LLM, load_model):
        assert inspect.signature(fn).parameters["dtype"].default == "auto", fn
    assert load_model("tiny-k3").dtype == "float32"


def test_enforce_eager_and_swap_space_are_accepted_and_noted(tmp_path):
    """vLLM launch lines carry --enforce-eager and --swap-space N by habit (vLLM V1 ignores --swap-space too): both
    were "unrecognized arguments" and the server did not start. Accepted (a --config file's keys too), changing
    nothing, each said at start-up; a negative swap space is refused naming the flag."""
    from k3jax.cli import build_parser
    from serve.cli import DEFAULTS, engine_config, vllm_argv, vllm_notes

    o = _serve_options("--enforce-eager", "--swap-space", "4")
    assert engine_config(o) == engine_config(_serve_options())
    assert [n.split(":")[0] for n in vllm_notes(o)] == ["--enforce-eager", "--swap-space 4"]
    assert vllm_notes(_serve_options("--no-enforce-eager")) == [] == vllm_notes(dict(DEFAULTS))
    with pytest.raises(ValueError, match="--swap-space: expected GiB >= 0"):
        engine_config(_serve_options("--swap-space", "-1"))
    args = build_parser().parse_args(["run-batch", "-i", "x", "-o", "y", "--enforce-eager", "--swap-space", "0"])
    assert (args.enforce_eager, args.swap_space) == (True, 0.0)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("enforce-eager: true\nswap_space: 16\n")
    parser = build_parser()
    options = parser._subparsers._group_actions[0].choices["serve"]._option_string_actions
    args = parser.parse_args(["serve", *vllm_argv(["--config", str(cfg)], options)])
    assert (args.enforce_eager, args.swap_space) == (True, 16.0)


def test_scheduling_policy_is_read_as_vllm_reads_it():
    """vLLM's --scheduling-policy (a launch line enabling priorities carries `--scheduling-policy priority`) was
    "unrecognized arguments": 'priority' is this server's default, 'fcfs' refuses nonzero priorities (vLLM's)."""
    from serve.cli import engine_config

    assert engine_config(_serve_options()).scheduling_policy == "priority"
    assert engine_config(_serve_options("--scheduling-policy", "priority")) == engine_config(_serve_options())
    assert engine_config(_serve_options("--scheduling-policy", "fcfs")).scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        _serve_options("--scheduling-policy", "sjf")


def test_max_num_batched_tokens_block_size_and_chat_template():
    """vLLM's --max-num-batched-tokens is the scheduler's token budget per step and --block-size the page size
    (both were "unrecognized arguments"); --chat-template is refused saying why (chat is rendered by the model
    family's built-in format, no Jinja); the default budget covers --long-prefill-chunk."""
    from serve.cli import engine_config

    assert engine_config(_serve_options()).max_num_batched_tokens == 512
    cfg = engine_config(_serve_options("--max-num-batched-tokens", "2k", "--block-size", "32"))
    assert (cfg.max_num_batched_tokens, cfg.page_size) == (2000, 32)
    with pytest.raises(ValueError, match="--max-num-batched-tokens: expected an integer >= 1"):
        engine_config(_serve_options("--max-num-batched-tokens", "0"))
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=4: expected at least max_num_seqs \(8\)"):
        engine_config(_serve_options("--max-num-batched-tokens", "4")).validate()
    with pytest.raises(ValueError, match="--chat-template: chat is rendered by the model family's built-in format"):
        engine_config(_serve_options("--chat-template", "template.jinja"))
    # the default budget holds the long prefill row beside the decodes (--long-prefill-chunk 1024 was refused:
    # "to max_num_batched_tokens (512)", which no option could raise)
    cfg = engine_config(_serve_options("--long-prefill-chunk", "1024"))
    cfg.validate()
    assert cfg.max_num_batched_tokens == 8 + 1024


def test_completions_and_chat_carry_vllms_system_fingerprint():
    """OpenAI's `system_fingerprint` (vLLM's default: `vllm-<version>-<hash8>` of its configuration) was missing
    from every completion and chat completion: it is `k3jax-<version>-<hash8>`, the same on every response of a
    server, in a whole response and, streamed, on the final chunks only (a choice's finishing chunk, or the usage
    chunk when `stream_options.include_usage` asks for one)."""
    import re

    from k3jax import __version__
    from k3jax.tokenizer import ByteTokenizer
    from recording_engine import Recorder

    app = create_app(Recorder(max_model_len=64, tokenizer=ByteTokenizer(320)), "m")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    comp = {"prompt": [1, 2], "max_tokens": 1}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            whole = [(await c.post(path, json=body)).json() for path, body in
                     (("/v1/completions", comp), ("/v1/chat/completions", chat))]
            streams = [(await c.post(path, json={**body, "stream": True, **extra})).text
                       for path, body in (("/v1/completions", comp), ("/v1/chat/completions", chat))
                       for extra in ({}, {"stream_options": {"include_usage": True}})]
            return whole, streams

    whole, streams = asyncio.run(go())
    fp = whole[0]["system_fingerprint"]
    assert re.fullmatch(rf"k3jax-{re.escape(__version__)}-[0-9a-f]{{8}}", fp) and whole[1]["system_fingerprint"] == fp
    for k, text in enumerate(streams):
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        final = [c for c in chunks if c.get("usage")] if k % 2 else [
            c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
        assert len(final) == 1 and final[0]["system_fingerprint"] == fp, text
        assert all("system_fingerprint" not in c for c in chunks if c is not final[0]), text


def test_a_lone_surrogate_echoed_back_is_escaped_not_a_500():
    """JSON may carry a lone surrogate ("\\ud800"), which UTF-8 cannot encode: echoed back (a 404's model name, an
    SGLang `rid`, a Responses `user`) it made the response's encode fail, a 500 or a stream cut off before [DONE];
    it is escaped in the JSON instead (the same value)."""
    from recording_engine import Recorder

    app = create_app(Recorder(64), "m")
    lone = "\ud800"

    async def go(path, body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, content=json.dumps(body), headers={"content-type": "application/json"})

    bad = asyncio.run(go("/v1/completions", {"model": lone, "prompt": [5], "max_tokens": 1}))
    assert bad.status_code == 404 and lone in bad.json()["error"]["message"], bad.text
    gen = asyncio.run(go("/generate", {"input_ids": [5], "rid": lone}))
    assert gen.status_code == 200 and gen.json()["meta_info"]["id"] == lone, gen.text
    streamed = asyncio.run(go("/generate", {"input_ids": [5], "rid": lone, "stream": True}))
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n"), streamed.text
    assert json.loads(streamed.text.split("\n\n")[0][len("data: "):])["meta_info"]["id"] == lone


def test_a_value_of_no_member_of_a_union_field_names_the_field():
    """A field that takes one of several shapes (`prompt`: text, ids, a list of either) given none of them is a 400
    naming the field and the shapes (it named pydantic's label of the first shape, `prompt.str`, not a field)."""
    from recording_engine import Recorder

    app = create_app(Recorder(64), "m")

    async def error(path, body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post(path, json=body)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    for path, body, param in (("/v1/completions", {"prompt": 5}, "prompt"),
                              ("/v1/completions", {"prompt": [1], "stop": 5}, "stop"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
                               "messages.0.content"),
                              ("/generate", {"input_ids": [1, "a"]}, "input_ids")):
        err = asyncio.run(error(path, body))
        assert err["param"] == param and err["message"].startswith(f"{param}: expected "), (body, err)
    err = asyncio.run(error("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}))
    assert err["message"].endswith("(messages.0.content.0.text: Field required)"), err
    err = asyncio.run(error("/v1/completions", {"prompt": [1], "logit_bias": {"str": "a"}}))  # (a key, not a label)
    assert err["param"] == "logit_bias.str", err


def test_chat_text_that_is_not_unicode_names_where_it_is():
    """A lone surrogate in a chat message, a tool or `chat_template_kwargs` (valid JSON, no UTF-8 text to tokenize) is
    a 400 naming where it is, as in a completion's prompt (the message was the codec's, naming no field; a tool's
    named `messages`)."""
    from k3jax.tokenizer import ByteTokenizer

    eng = _TwoSamples()
    eng.engine.tokenizer, eng.engine.cfg.vocab_size = ByteTokenizer(), 512
    app = create_app(eng, "m")
    user, lone = {"role": "user", "content": "hi"}, "a\ud800"
    tool = {"type": "function", "function": {"name": "f", "description": lone, "parameters": {"type": "object"}}}

    async def error(path, body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        return r.json()["error"]

    for body, param, where in (
            ({"messages": [user, {"role": "user", "content": [{"type": "text", "text": lone}]}]}, "messages",
             "messages.1.content.0.text"),
            ({"messages": [user], "tools": [tool]}, "tools", "tools"),
            ({"messages": [user], "chat_template_kwargs": {"default_system": lone}}, "chat_template_kwargs",
             "chat_template_kwargs.default_system")):
        for path in ("/v1/chat/completions", "/tokenize"):
            err = asyncio.run(error(path, {**body, "max_tokens": 2} if path != "/tokenize" else body))
            assert err["param"] == param and err["message"].startswith(f"{where}: not valid Unicode text"), (path, err)
    # a Responses request's `instructions` (its system message) was reported as `input`, a field sent as text
    for body, param in (({"input": "hi", "instructions": lone}, "instructions"), ({"input": lone}, "input")):
        err = asyncio.run(error("/v1/responses", {**body, "max_output_tokens": 2}))
        assert err["param"] == param and err["message"].startswith(f"{param}: not valid Unicode text"), err


def test_a_bad_query_parameter_is_named_as_sent():
    """A query parameter's 400 names it as the client sent it (`level`, as the route's own check does), not pydantic's
    `query.level`."""
    from recording_engine import Recorder

    app = create_app(Recorder(64), "m", enable_sleep_mode=True)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/sleep", params={"level": "deep"})

    r = asyncio.run(go())
    assert r.status_code == 400 and r.json()["error"]["param"] == "level", r.text
    assert r.json()["error"]["message"].startswith("level: "), r.text


def test_a_lone_surrogate_escaped_in_tool_call_arguments_names_the_call():
    """A history tool call's `arguments` is JSON text: `"{\\"\\\\ud800\\": 1}"` is ASCII, and its lone surrogate appears
    only once parsed; the render failed and the 400 named `tools`, a field the request did not send. It names the
    call's arguments in `messages`."""
    from k3jax.tokenizer import ByteTokenizer

    eng = _TwoSamples()
    eng.engine.tokenizer, eng.engine.cfg.vocab_size = ByteTokenizer(), 512
    app = create_app(eng, "m")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a\ud800": 1})}}
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}

    async def error(path):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post(path, json=body)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    for path in ("/v1/chat/completions", "/tokenize"):
        err = asyncio.run(error(path))
        assert err["param"] == "messages", (path, err)
        assert err["message"].startswith("messages[1].tool_calls[0]: function.arguments is not valid Unicode"), err


def test_stop_lists_are_bounded_before_the_engine_searches_them():
    """Each stop string is searched for after every token, on the engine's thread: 50,000 of them (a 700 KB body,
    accepted) took 90 ms a token, every other request's steps waiting. More than 128 are a 400 naming `stop`, on
    every route that takes them (SGLang's /generate too; the Python API takes any number, as vLLM's)."""
    from k3jax.tokenizer import ByteTokenizer
    from recording_engine import Recorder
    from serve.types import MAX_STOP

    eng = Recorder(max_model_len=64, tokenizer=ByteTokenizer(320))
    app = create_app(eng, "m")
    many = [f"s{i}" for i in range(50000)]
    bodies = [("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
              ("/v1/responses", {"input": "hi", "max_output_tokens": 1})]

    async def go(stop):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return [await c.post(path, json={**body, "stop": stop}) for path, body in bodies] + [
                await c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1, "stop": stop}})]

    for r in asyncio.run(go(many)) + asyncio.run(go(many[:MAX_STOP + 1])):
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
        assert f"at most {MAX_STOP} stop strings" in r.json()["error"]["message"]
    for r in asyncio.run(go(many[:MAX_STOP])):
        assert r.status_code == 200, r.text
    assert eng.params[-1].stop == many[:MAX_STOP]


def test_a_key_over_its_rate_limit_is_refused_before_its_prompt_is_tokenized():
    """A key whose window is full got its 429 only after its prompt was tokenized, its chat rendered and its
    constraint compiled (seconds of CPU for a large schema): a burst from a limited key made the server do all of
    that work anyway. The generation routes refuse such a request first; a full queue's 503 alike."""
    from k3jax.tokenizer import ByteTokenizer
    from recording_engine import Recorder

    class Counting(ByteTokenizer):
        calls = 0

        def encode(self, *a, **kw):
            Counting.calls += 1
            return super().encode(*a, **kw)

    eng = Recorder(max_model_len=64, tokenizer=Counting(320))
    app = create_app(eng, "m", api_keys={"k": Limits(rpm=1)}, max_waiting=0)
    auth = {"Authorization": "Bearer k"}
    bodies = [("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
              ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
              ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}}),
              ("/invocations", {"prompt": "hi", "max_tokens": 1})]

    async def go(path, body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, json=body, headers=auth)

    assert asyncio.run(go(*bodies[0])).status_code == 200
    seen = Counting.calls
    for path, body in bodies:
        r = asyncio.run(go(path, body))
        assert r.status_code == 429 and r.headers["retry-after"], (path, r.text)
    assert Counting.calls == seen
    st = app.state.k3  # a full queue (4 running, none waiting): a 503, before tokenizing too
    st.limiter.per_key.clear()
    st.seqs_in_flight = 4
    for path, body in bodies:
        r = asyncio.run(go(path, body))
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", (path, r.text)
    assert Counting.calls == seen


def test_json_nested_past_the_recursion_limit_is_a_400_not_a_500():
    """JSON text the server parses itself, nested past the interpreter's recursion limit, raised RecursionError (a 500):
    a history tool call's `arguments` (chat, /tokenize, a Responses `function_call` item) and SageMaker's /invocations
    body. Each is a 400 naming its field."""
    from k3jax.tokenizer import ByteTokenizer
    from recording_engine import Recorder

    app = create_app(Recorder(max_model_len=64, tokenizer=ByteTokenizer(320)), "m")
    deep = "[" * 100000 + "]" * 100000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    items = [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": deep},
             {"type": "function_call_output", "call_id": "c1", "output": "ok"}]
    cases = [("/v1/chat/completions", {"messages": history, "max_tokens": 1}, "messages"),
             ("/tokenize", {"messages": history}, "messages"),
             ("/v1/responses", {"input": items, "max_output_tokens": 1}, "input"),
             ("/invocations", '{"prompt": "hi", "vllm_xargs": {"a": ' + deep + "}}", None)]

    async def go(path, body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                     base_url="http://t") as c:
            if isinstance(body, str):
                return await c.post(path, content=body, headers={"content-type": "application/json"})
            return await c.post(path, json=body)

    for path, body, param in cases:
        r = asyncio.run(go(path, body))
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == param and "too deeply" in err["message"], (path, err)


def test_constraints_compile_on_a_pool_of_half_the_cpus(monkeypatch):
    """A request's constraint compiles off the engine's thread, on vLLM's pool of (CPUs + 1) // 2 threads: on
    asyncio's default pool (CPUs + 4 threads) a flood of schemas that take seconds each (thousands of properties)
    held every CPU, starving the engine's thread. Here one thread (2 CPUs): three requests compile one at a time."""
    import threading
    import time as _time

    from recording_engine import Recorder

    monkeypatch.setattr("serve.api.os.cpu_count", lambda: 2)

    class Grammars:
        active = most = calls = 0
        lock = threading.Lock()

        def compile(self, constraint):
            with self.lock:
                Grammars.active += 1
                Grammars.calls += 1
                Grammars.most = max(Grammars.most, Grammars.active)
            _time.sleep(0.05)  # (long enough for the others to overlap it, on a pool that lets them)
            with self.lock:
                Grammars.active -= 1

    eng = Recorder(max_model_len=64)
    eng.engine.grammars = Grammars()
    app = create_app(eng, "m")
    body = {"prompt": [1, 2], "max_tokens": 1, "response_format": {"type": "json_object"}}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(3)])

    assert [r.status_code for r in asyncio.run(go())] == [200] * 3
    assert Grammars.calls == 3 and Grammars.most == 1
