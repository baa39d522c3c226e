"""`k3jax run-batch`: OpenAI Batch-format JSONL through the server's own app, in process."""

from __future__ import annotations

import json

import pytest

from k3jax.cli import main
from serve.run_batch import parse_lines, split_lines


def test_lines_that_cannot_be_sent_name_what_is_wrong():
    ok = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    lines = [json.dumps(ok), "", "{nope", json.dumps([1]), json.dumps({**ok, "custom_id": ""}),
             json.dumps(ok), json.dumps({**ok, "custom_id": "b", "url": "/v1/embeddings"}),
             json.dumps({**ok, "custom_id": "c", "method": "GET"}),
             json.dumps({**ok, "custom_id": "d", "body": {"prompt": "x", "stream": True}}),
             json.dumps({**ok, "custom_id": "e", "body": "x"})]
    reqs = parse_lines(lines)
    assert [r.line for r in reqs] == [1, 3, 4, 5, 6, 7, 8, 9, 10]  # the blank line is skipped
    assert reqs[0].error is None and reqs[0].body == {"prompt": "x"}
    errors = [r.error for r in reqs[1:]]
    for err, want in zip(errors, ["not JSON", "JSON object", "custom_id must be", "repeats an earlier",
                                  "url must be", "method must be POST", "stream", "body must be"]):
        assert want in err, (want, err)
    assert errors[0].startswith("line 3:")


def test_lines_split_at_newlines_only():
    """JSON strings may hold U+2028, U+2029 or U+0085 unescaped: they do not end a line (str.splitlines cut
    such a line in pieces); a leading byte-order mark and CRLF endings are read as well."""
    ok = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x\u2028y\x85z\u2029"}}
    text = "\ufeff" + json.dumps(ok, ensure_ascii=False) + "\r\n\r\n" + json.dumps({**ok, "custom_id": "b"}) + "\r\n"
    reqs = parse_lines(split_lines(text))
    assert [(r.line, r.custom_id, r.error) for r in reqs] == [(1, "a", None), (3, "b", None)]
    assert reqs[0].body == ok["body"]


@pytest.mark.parametrize("flags, want", [
    (["-i", "https://example.com/in.jsonl", "-o", "OUT"], "--input-file https://example.com/in.jsonl: URLs are not"),
    (["-i", "IN", "-o", "http://example.com/out.jsonl"], "--output-file http://example.com/out.jsonl: URLs are not"),
    (["-i", "DIR", "-o", "OUT"], "--input-file DIR: cannot read it"),
    (["-i", "IN", "-o", "DIR"], "--output-file DIR: cannot write it"),
    (["-i", "IN", "-o", "DIR/missing/out.jsonl"], "--output-file DIR/missing/out.jsonl: cannot write it"),
])
def test_paths_that_cannot_be_used_are_refused_before_the_engine_loads(tmp_path, capsys, flags, want):
    """vLLM fetches and uploads http(s) URLs; without a network they are refused, naming the flag, as are
    unreadable inputs and unwritable outputs: at once, not after the model has loaded (and without a traceback)."""
    (tmp_path / "in.jsonl").write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                                   "body": {"prompt": "x"}}) + "\n")
    names = {"IN": str(tmp_path / "in.jsonl"), "OUT": str(tmp_path / "out.jsonl"), "DIR": str(tmp_path)}
    flags = [names.get(f, f.replace("DIR", str(tmp_path))) for f in flags]
    want = want.replace("DIR", str(tmp_path))
    assert main(["run-batch", *flags, "--model", "no-such-model", "--no-compile-cache"]) == 2
    assert want in capsys.readouterr().err


@pytest.fixture(scope="module")
def batch_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    greedy = {"max_tokens": 6, "temperature": 0}
    lines = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Hello"}], **greedy}},
        {"custom_id": "chat-2", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Hello"}], **greedy}},
        {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "The sky is", "logprobs": 1, **greedy}},
        {"custom_id": "resp-1", "method": "POST", "url": "/v1/responses",
         "body": {"input": "Hi", "max_output_tokens": 5, "temperature": 0}},
        {"custom_id": "bad-param", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "x", "max_tokens": -1}},
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "cmpl-sep", "method": "POST", "url": "/v1/completions",  # a line separator inside a string
         "body": {"prompt": "a\u2028b", **greedy}},
    ]
    src, dst = d / "in.jsonl", d / "out.jsonl"
    # as an editor may save it: a byte-order mark, CRLF endings, non-ASCII text unescaped
    src.write_text("\ufeff" + "\r\n".join(json.dumps(x, ensure_ascii=False) for x in lines) + "\r\n",
                   encoding="utf-8", newline="")
    # the engine options of tests/test_http.py's `limited` server (PLAIN) and tests/test_multihost.py's `reference`:
    # two step programs (decode 8 rows, prefill 1 row x 32 tokens; 8 context pages), compiled once in a run for the
    # three files (the run's shared compilation cache, tests/conftest.py; CI time)
    rc = main(["run-batch", "-i", str(src), "-o", str(dst), "--model", "tiny-k3", "--max-model-len", "128",
               "--max-num-seqs", "8", "--decode-buckets", "8", "--prefill-buckets", "1", "--context-buckets", "8",
               "--prefill-chunk", "32", "--cache-mb", "32", "--no-compile-cache", "--max-concurrency", "3"])
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    return rc, {o["custom_id"]: o for o in out}, out


def test_every_line_answered_once_in_the_servers_shapes(batch_run):
    rc, by_id, out = batch_run
    assert rc == 1  # not every request succeeded
    assert len(out) == 7 and set(by_id) == {"chat-1", "chat-2", "cmpl-1", "resp-1", "bad-param", "bad-url",
                                            "cmpl-sep"}
    assert len({o["id"] for o in out}) == 7 and all(o["id"].startswith("batch_req_") for o in out)
    chat = by_id["chat-1"]["response"]
    assert chat["status_code"] == 200 and by_id["chat-1"]["error"] is None
    assert chat["body"]["object"] == "chat.completion" and chat["request_id"] == chat["body"]["id"]
    assert chat["body"]["usage"]["completion_tokens"] == 6
    # the same greedy request gives the same answer, whatever it was batched with
    assert (by_id["chat-2"]["response"]["body"]["choices"][0]["message"]
            == chat["body"]["choices"][0]["message"])
    assert by_id["cmpl-sep"]["response"]["body"]["usage"]["completion_tokens"] == 6
    cmpl = by_id["cmpl-1"]["response"]["body"]
    assert cmpl["object"] == "text_completion" and len(cmpl["choices"][0]["logprobs"]["tokens"]) == 6
    resp = by_id["resp-1"]["response"]["body"]
    assert resp["object"] == "response" and resp["output"][-1]["type"] == "message"
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}


def test_failures_keep_the_api_error_or_name_the_line(batch_run):
    _, by_id, _ = batch_run
    bad = by_id["bad-param"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "max_tokens"
    assert by_id["bad-url"]["response"] is None
    assert "url must be one of" in by_id["bad-url"]["error"]["message"]


class _FailingEngine:
    """A stand-in AsyncEngine: answers "ok", except that a prompt "bad" fails as a failed engine step does."""

    def __init__(self):
        from types import SimpleNamespace as NS

        from k3jax.tokenizer import ByteTokenizer

        self.engine = NS(tokenizer=ByteTokenizer(320), cfg=NS(vocab_size=320, family="byte", hidden_size=4),
                         decode_buckets=[4], config=NS(max_model_len=64, max_logprobs=5), generation_defaults={})
        self.capacity, self.alive = 4, True

    def stats(self) -> dict:
        return {}

    async def generate(self, prompt, params, request_id, priority=0, on_accept=None, **kw):
        from serve.types import CompletionOutput, RequestOutput

        on_accept()
        if bytes(prompt) == b"bad":
            raise RuntimeError("device lost")
        yield RequestOutput(request_id, None, list(prompt), [CompletionOutput(0, "ok", [111, 107], "stop")],
                            finished=True)


def test_a_request_the_server_fails_is_a_500_line_and_the_batch_goes_on():
    """An engine failure is a 500 answer for that line (the server's body); the other lines still run."""
    import io

    from serve.api import create_app
    from serve.run_batch import run_batch

    app = create_app(_FailingEngine(), "m", max_waiting=None)
    lines = [json.dumps({"custom_id": c, "method": "POST", "url": "/v1/completions", "body": {"prompt": p}})
             for c, p in (("a", "good"), ("b", "bad"), ("c", "ok"))]
    out = io.StringIO()
    counts = run_batch(app, lines, out, 1)
    assert (counts["succeeded"], counts["failed"], counts["invalid"]) == (2, 1, 0)
    by_id = {r["custom_id"]: r for r in map(json.loads, out.getvalue().splitlines())}
    assert set(by_id) == {"a", "b", "c"}
    failed = by_id["b"]["response"]
    assert failed["status_code"] == 500 and failed["body"]["error"]["type"] == "internal_error"
    assert by_id["c"]["response"]["body"]["choices"][0]["text"] == "ok"


def test_run_batch_takes_the_engine_options_and_none_of_the_servers(capsys):
    """As vLLM's run-batch: the server's own options (--host, --api-key, TLS, CORS, ...) are refused, where they were
    taken and ignored; the options that shape answers and logs are honoured; --max-concurrency 0 (the default
    taken) or -1 (one at a time) is refused."""
    import io

    from k3jax.cli import build_parser
    from recording_engine import Recorder
    from serve.cli import SERVER_ONLY
    from serve.run_batch import batch_app, run_batch

    parser = build_parser()
    subs = parser._subparsers._group_actions[0].choices
    assert set(SERVER_ONLY) <= {a.dest for a in subs["serve"]._actions}
    assert not set(SERVER_ONLY) & {a.dest for a in subs["run-batch"]._actions}
    for argv in (["--host", "0.0.0.0"], ["--port", "9"], ["--api-key", "k"], ["--ssl-keyfile", "k.pem"],
                 ["--root-path", "/k3"], ["--process-id", "1"], ["--enable-sleep-mode"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["run-batch", "-i", "x", "-o", "y", *argv])
    args = parser.parse_args(["run-batch", "-i", "x", "-o", "y", "--return-tokens-as-token-ids", "--disable-log-stats",
                              "--max-num-batched-tokens", "1024", "--served-model-name", "kimi"])
    assert args.return_tokens_as_token_ids and args.max_num_batched_tokens == 1024
    # --return-tokens-as-token-ids was dropped; a line over the server's 1 MiB body limit was a 413
    app = batch_app(Recorder(max_model_len=64), vars(args))
    assert app.state.k3.return_tokens_as_token_ids
    big = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
           "body": {"model": "kimi", "prompt": [1, 2], "max_tokens": 1, "user": "u" * (2 << 20)}}
    out = io.StringIO()
    assert run_batch(app, [json.dumps(big)], out, 1)["succeeded"] == 1
    assert json.loads(out.getvalue())["response"]["status_code"] == 200
    for n in ("0", "-1"):
        assert main(["run-batch", "-i", "x", "-o", "y", "--max-concurrency", n]) == 2
        assert f"--max-concurrency {n}: expected an integer >= 1" in capsys.readouterr().err


def test_a_lone_surrogate_in_a_line_is_answered_not_the_end_of_the_batch():
    """JSON may carry a lone surrogate ("\\ud800"), which UTF-8 cannot encode: in a line's body, httpx's `json=`
    raised before sending, and in a `custom_id` (or a body's text echoed back) the UTF-8 output raised: either ended
    the whole batch with a traceback. The line is sent as its JSON and answered, its record written escaped."""
    import io

    from recording_engine import Recorder

    from serve.api import create_app
    from serve.run_batch import run_batch

    lone, body = "a\ud800", {"prompt": [5], "max_tokens": 1}
    lines = [json.dumps({"custom_id": c, "method": "POST", "url": "/v1/completions", "body": b})
             for c, b in ((lone, body), ("b", {**body, "model": lone}), ("c", body))]
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="utf-8")  # (a file's encoding: io.StringIO takes any str)
    counts = run_batch(create_app(Recorder(64), "m"), lines, out, 1)
    out.flush()
    assert (counts["succeeded"], counts["failed"], counts["invalid"]) == (2, 1, 0)
    by_id = {r["custom_id"]: r for r in map(json.loads, raw.getvalue().decode("utf-8").splitlines())}
    assert set(by_id) == {lone, "b", "c"}
    assert by_id[lone]["response"]["status_code"] == 200
    assert by_id["b"]["response"]["status_code"] == 404 and lone in by_id["b"]["response"]["body"]["error"]["message"]
