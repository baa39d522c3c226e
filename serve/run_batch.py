"""Offline batches in OpenAI's Batch file format (vLLM's `run-batch`): `k3jax run-batch -i IN -o OUT`.

The input and output are local files (or `-`: stdin / stdout); vLLM's http(s) URLs are refused, as there is no
network. Each input line (lines end at newlines only; a leading byte-order mark is skipped) is one request:
`{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}` (also `/v1/completions` and
`/v1/responses`). Every request goes through the same FastAPI app the server runs, in process (no socket), so
validation, chat templates, tools, structured outputs and error bodies are exactly the server's. Requests run
concurrently, so the engine batches them like any other traffic; each answer is written as soon as it finishes
(and flushed), so a batch that stops half-way keeps what it computed.

Each output line: `{"id": "batch_req_...", "custom_id": ..., "response": {"status_code", "request_id",
"body"}, "error": null}`. A request the API rejects keeps its status code and OpenAI error body in
`response`; a line that cannot be sent at all (not JSON, unknown `url`, `stream: true`, a repeated
`custom_id`) gets `response: null` and `error: {"code", "message"}` naming what is wrong. Lines come out
in completion order; `custom_id` ties them to the input.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from dataclasses import dataclass
from typing import IO, Callable, Optional

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


@dataclass
class BatchRequest:
    """One input line, parsed: what to send, or why it cannot be sent."""
    line: int  # 1-based line number in the input
    custom_id: Optional[str]
    url: Optional[str] = None
    body: Optional[dict] = None
    error: Optional[str] = None


def split_lines(text: str) -> list[str]:
    """A JSONL file's lines: split at newlines only (str.splitlines also splits at U+2028, U+0085, ..., which
    JSON strings may hold unescaped), without a leading UTF-8 byte-order mark."""
    return text.removeprefix("\ufeff").split("\n")


def parse_lines(lines) -> list[BatchRequest]:
    """Input lines -> requests; blank lines are skipped, faulty ones carry an error naming the field."""
    out, seen = [], set()
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            out.append(BatchRequest(n, None, error=f"line {n}: not JSON ({e.msg})"))
            continue
        if not isinstance(obj, dict):
            out.append(BatchRequest(n, None, error=f"line {n}: expected a JSON object"))
            continue
        cid = obj.get("custom_id")
        req = BatchRequest(n, cid if isinstance(cid, str) else None, obj.get("url"), obj.get("body"))
        if not isinstance(cid, str) or not cid:
            req.error = f"line {n}: custom_id must be a non-empty string"
        elif cid in seen:
            req.error = f"line {n}: custom_id {cid!r} repeats an earlier line"
        elif obj.get("method", "POST") != "POST":
            req.error = f"line {n}: method must be POST (got {obj.get('method')!r})"
        elif req.url not in URLS:
            req.error = f"line {n}: url must be one of {list(URLS)} (got {req.url!r})"
        elif not isinstance(req.body, dict):
            req.error = f"line {n}: body must be a JSON object"
        elif req.body.get("stream"):
            req.error = f"line {n}: body.stream is not supported in a batch"
        if isinstance(cid, str) and cid:
            seen.add(cid)
        out.append(req)
    return out


def output_line(req: BatchRequest, status: Optional[int] = None, body=None, request_id: Optional[str] = None) -> dict:
    """The output record of one request (OpenAI's batch output shape)."""
    rec = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": req.custom_id, "response": None, "error": None}
    if req.error is not None:
        rec["error"] = {"code": "invalid_request", "message": req.error}
    else:
        rec["response"] = {"status_code": status, "request_id": request_id, "body": body}
    return rec


async def run_requests(app, requests: list[BatchRequest], write: Callable[[dict], None], concurrency: int,
                       api_key: Optional[str] = None) -> dict:
    """Send every valid request through `app` (at most `concurrency` at once) and `write` each record as it
    finishes. -> counts: total, succeeded (2xx), failed (API errors), invalid (not sent)."""
    import httpx

    counts = dict(total=len(requests), succeeded=0, failed=0, invalid=0)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    sent = {**headers, "content-type": "application/json"}
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(client, req: BatchRequest) -> None:
        if req.error is not None:
            counts["invalid"] += 1
            write(output_line(req))
            return
        async with gate:  # (JSON as sent: httpx's `json=` encodes text as UTF-8, which a lone surrogate is not)
            r = await client.post(req.url, content=json.dumps(req.body), headers=sent)
        try:
            body = r.json()
        except ValueError:
            body = {"error": {"message": r.text, "type": "internal_error", "param": None, "code": None}}
        counts["succeeded" if r.status_code < 300 else "failed"] += 1
        rid = body.get("id") if isinstance(body, dict) else None
        write(output_line(req, r.status_code, body, rid or f"req_{uuid.uuid4().hex}"))

    # an app error is answered (500, OpenAI's body) and written as that request's line, not raised into the batch
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://k3jax", timeout=None) as client:
        await asyncio.gather(*(one(client, r) for r in requests))
    return counts


def run_batch(app, lines, out: IO[str], concurrency: int, api_key: Optional[str] = None) -> dict:
    """Parse `lines`, run them through `app`, write JSONL records to `out` -> counts (and wall seconds)."""
    requests = parse_lines(lines)
    t0 = time.monotonic()

    from serve.api import json_text  # (non-ASCII as it is; escaped where a lone surrogate, JSON's "\\ud800" in a
    # custom_id or a body echoed back, would not encode in the UTF-8 output: the batch stopped there)

    def write(rec: dict) -> None:
        out.write(json_text(rec, None) + "\n")
        out.flush()

    counts = asyncio.run(run_requests(app, requests, write, concurrency, api_key))
    counts["wall_s"] = time.monotonic() - t0
    return counts


def _local(path: str, flag: str) -> str:
    if path.startswith(("http://", "https://")):
        raise ValueError(f"{flag} {path}: URLs are not supported (no network); give a local file or '-'")
    return path


def read_input(path: str) -> str:
    """`--input-file`'s text ('-': stdin); ValueError naming the flag for a URL or an unreadable file."""
    if path == "-":
        return sys.stdin.read()
    try:
        with open(_local(path, "--input-file"), encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--input-file {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None


def open_output(path: str) -> IO[str]:
    """`--output-file` opened for writing ('-': stdout); ValueError naming the flag for a URL or an unwritable path."""
    if path == "-":
        return sys.stdout
    try:
        return open(_local(path, "--output-file"), "w", encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--output-file {path}: cannot write it ({e.strerror or e})") from None


def batch_app(aeng, o: dict):
    """The server's app over `aeng` for a batch, with the run-batch options `o` that shape answers and logs
    (--served-model-name, --no-reasoning-parser, --return-tokens-as-token-ids, --enable-log-requests); no queue
    or body limit (the lines are the caller's own file: a long `prompt_embeds` line is no 413) and no stored
    responses."""
    from serve.api import create_app
    from serve.cli import _say, served_names

    return create_app(aeng, served_names(o), max_waiting=None, max_body_bytes=sys.maxsize,
                      reasoning_parser=not o.get("no_reasoning_parser"), max_stored_responses=0,
                      return_tokens_as_token_ids=bool(o.get("return_tokens_as_token_ids")),
                      request_log=_say if o.get("enable_log_requests") else None)


def run_batch_main(args) -> int:
    """`k3jax run-batch`: build and warm the engine with the engine options, then run the input file."""
    from k3jax.runtime import resolve_dtype
    from serve.cli import (DEFAULTS, _say, enable_compile_cache, engine_config, load_served_model, lora_modules,
                           start_engine, vllm_notes)

    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency {args.max_concurrency}: expected an integer >= 1")
    o = {k: getattr(args, k, v) for k, v in DEFAULTS.items()}
    o["dtype"] = resolve_dtype(o["dtype"], o["model"])
    cfg = engine_config(o)
    cfg.validate()
    adapters = lora_modules(o)
    for note in vllm_notes(o):
        _say(note)
    lines = split_lines(read_input(args.input_file))
    dst = open_output(args.output_file)  # before the engine loads: a bad path fails at once
    try:
        if not o["no_compile_cache"]:
            enable_compile_cache(o["compile_cache_dir"])
        _say(f"run-batch: {sum(1 for x in lines if x.strip())} requests; loading {o['model']} ({o['dtype']}) ...")
        aeng = start_engine(load_served_model(o, cfg), cfg, o, adapters)
        try:
            app = batch_app(aeng, o)
            counts = run_batch(app, lines, dst, args.max_concurrency or 4 * cfg.max_num_seqs)
        finally:
            aeng.shutdown()
    finally:
        if dst is not sys.stdout:
            dst.close()
    generated = aeng.stats()["generation_tokens"]
    _say(f"run-batch: {counts['succeeded']} succeeded, {counts['failed']} failed, {counts['invalid']} invalid "
         f"of {counts['total']} in {counts['wall_s']:.1f} s; {generated} tokens generated")
    return 0 if counts["succeeded"] == counts["total"] else 1
