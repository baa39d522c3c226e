"""Online serving: requests arriving over time at the HTTP server (`k3jax serve`), against the same
engine driven in process (vLLM's `bench serve` shape).

    python benchmarks/online_serving.py            # k3-small with the `k3jax serve` defaults, ~5 min
    python benchmarks/online_serving.py --quick    # tiny-k3, ~2 min (writes to the temp dir)

What is measured
----------------
* Server: `python -m k3jax.cli serve` in its own process, the defaults of the README's first command
  (k3-small, 8 decode rows, one 64-token prefill row, 512-token context) unless `--server-args` says
  otherwise. The client (httpx, asyncio) streams `/v1/completions` with token-id prompts, greedy,
  `ignore_eos`, `return_token_ids` (so every SSE chunk says which tokens it carries) and
  `stream_options.include_usage`.
* Peer, in the same run: the same engine configuration (`serve.cli.engine_config` of the same options)
  built in this process and driven through `serve.async_engine.AsyncEngine` (the server's own engine
  thread), without HTTP, JSON or SSE. The difference between the two is what the front end costs.
* Workload: N requests, prompt lengths uniform in [lo, hi] (random token ids), a fixed number of
  generated tokens. Arrivals are a Poisson process at each rate (exponential gaps, fixed seed; `inf`:
  all at once), the same offsets and prompts for both sides; both sides run each rate back to back
  (server first, then the peer), so they see the same machine load.
* Per request: TTFT (send -> first token), TPOT ((E2E - TTFT) / (tokens - 1)), ITL (gaps between
  token arrivals; a chunk of k tokens counts as k gaps of 1/k its wait), E2E. Per rate: completed
  requests, request and output-token throughput over the wall from the first send to the last token,
  p50 / p90 / p99 of each latency, and how many requests got the same greedy tokens on both sides.
* Step times of the in-process engine (engine.step wall, host work included) by kind: decode only (the
  least an ITL can be), prefill only, and mixed (a decode program and a prefill chunk in one step, which
  is what running requests wait for while others are admitted).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from serving import machine_info, med, pct, write_result  # noqa: E402

PRESETS = {
    # the README's `k3jax serve` (serve/cli.py DEFAULTS); rates around its capacity (~2.5 requests/s here)
    "full": dict(model="k3-small", requests=32, prompt=(64, 192), gen=32, rates=(0.5, 1.0, 2.0, 4.0, math.inf),
                 server_args=[]),
    "quick": dict(model="tiny-k3", requests=8, prompt=(16, 48), gen=8, rates=(4.0, math.inf),
                  server_args=["--max-model-len", "128", "--cache-mb", "16"]),
}


# ---- workload --------------------------------------------------------------------------------

def arrivals(n: int, rate: float, rng: np.random.Generator) -> list[float]:
    """Send offsets (s) of n requests: a Poisson process at `rate` per second; all at 0 for inf."""
    if math.isinf(rate):
        return [0.0] * n
    return np.cumsum(rng.exponential(1.0 / rate, n)).tolist()


def make_prompts(n: int, lo: int, hi: int, vocab_hi: int, rng: np.random.Generator) -> list[list[int]]:
    return [rng.integers(3, vocab_hi, int(k)).tolist() for k in rng.integers(lo, hi + 1, n)]


@dataclass
class Trace:
    """One request as the client saw it (perf_counter seconds)."""

    sent: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in that chunk)
    tokens: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self):
        return self.arrivals[0][0] - self.sent if self.arrivals else None

    @property
    def e2e(self):
        return self.arrivals[-1][0] - self.sent if self.arrivals else None

    @property
    def tpot(self):
        n = len(self.tokens)
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    def itl(self) -> list[float]:
        out = []
        for (t0, _), (t1, k) in zip(self.arrivals, self.arrivals[1:]):
            out += [(t1 - t0) / k] * k
        return out


def summarize(traces: list[Trace], gen: int) -> dict:
    ok = [t for t in traces if t.error is None and len(t.tokens) == gen]
    wall = (max(t.arrivals[-1][0] for t in ok) - min(t.sent for t in traces)) if ok else None

    def dist(xs):
        xs = [x for x in xs if x is not None]
        return {"mean": float(np.mean(xs)) if xs else None, "p50": med(xs), "p90": pct(xs, 90), "p99": pct(xs, 99)}

    return dict(completed=len(ok), failed=len(traces) - len(ok),
                errors=sorted({t.error for t in traces if t.error})[:3], wall_s=wall,
                request_throughput=len(ok) / wall if wall else None,
                output_throughput=sum(len(t.tokens) for t in ok) / wall if wall else None,
                ttft_s=dist([t.ttft for t in ok]), tpot_s=dist([t.tpot for t in ok]),
                itl_s=dist([x for t in ok for x in t.itl()]), e2e_s=dist([t.e2e for t in ok]))


async def _paced(offsets: list[float], one) -> list[Trace]:
    """Start `one(i, trace)` for each request at its offset from now; wait for all."""
    t0 = time.perf_counter()
    traces = [Trace(sent=0.0) for _ in offsets]

    async def later(i):
        await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
        traces[i].sent = time.perf_counter()
        try:
            await one(i, traces[i])
        except Exception as e:  # recorded, never fatal: a failed request is a result too
            traces[i].error = f"{type(e).__name__}: {e}"[:200]

    await asyncio.gather(*(later(i) for i in range(len(offsets))))
    return traces


# ---- the two sides ----------------------------------------------------------------------------

async def run_http(url: str, model: str, prompts, gen: int, offsets) -> list[Trace]:
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def one(i, tr: Trace):
            body = dict(model=model, prompt=prompts[i], max_tokens=gen, temperature=0.0, ignore_eos=True,
                        stream=True, return_token_ids=True, stream_options={"include_usage": True})
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        raise RuntimeError(ev["error"].get("message"))
                    ids = [t for c in ev.get("choices") or () for t in c.get("token_ids") or ()]
                    if ids:
                        tr.arrivals.append((time.perf_counter(), len(ids)))
                        tr.tokens += ids

        return await _paced(offsets, one)


async def run_inprocess(aeng, prompts, gen: int, offsets, tag: str) -> list[Trace]:
    from serve.types import SamplingParams

    sp = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)

    async def one(i, tr: Trace):
        async for out in aeng.generate(prompts[i], sp, f"{tag}-{i}"):
            ids = out.outputs[0].token_ids
            if len(ids) > len(tr.tokens):
                tr.arrivals.append((time.perf_counter(), len(ids) - len(tr.tokens)))
                tr.tokens = list(ids)

    return await _paced(offsets, one)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, extra: list[str], port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "k3jax.cli", "serve", "--model", model, "--port", str(port),
           "--log-level", "warning", *extra]
    log("server: " + " ".join(shlex.quote(c) for c in cmd[1:]))
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become ready within 900 s")


def in_process_engine(model: str, server_args: list[str]):
    """The engine the server builds from the same options (serve/cli.py), with its AsyncEngine."""
    from k3jax.cli import build_parser
    from k3jax.runtime import load_model
    from serve.async_engine import AsyncEngine
    from serve.cli import DEFAULTS, enable_compile_cache, engine_config
    from serve.engine import Engine

    args = build_parser().parse_args(["serve", "--model", model, *server_args])
    o = {k: getattr(args, k, v) for k, v in DEFAULTS.items()}
    enable_compile_cache(o["compile_cache_dir"])  # the server's cache: its programs, not compiled again
    eng = Engine(load_model(o["model"], dtype=o["dtype"], seed=o["seed"]), engine_config(o), progress=False)
    return eng, AsyncEngine(eng)


def timed_steps(eng) -> dict[str, list[float]]:
    """Wrap `eng.step` to record the wall time of every step by kind: decode only, prefill only, or
    both (a decode program and a prefill program in one step: what the running requests wait for)."""
    walls = {"decode": [], "prefill": [], "mixed": []}
    step = eng.step

    def wrapped():
        d, p, t0 = eng.counters["decode_steps"], eng.counters["prefill_steps"], time.perf_counter()
        out = step()
        dd, dp = eng.counters["decode_steps"] > d, eng.counters["prefill_steps"] > p
        if dd or dp:
            walls["mixed" if dd and dp else "decode" if dd else "prefill"].append(time.perf_counter() - t0)
        return out

    eng.step = wrapped
    return walls


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default=None, help="extra `k3jax serve` options, one string")
    args = ap.parse_args(argv)
    P = dict(PRESETS["quick" if args.quick else "full"])
    if args.server_args:
        P["server_args"] = P["server_args"] + shlex.split(args.server_args)
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "online_serving-quick.json" if args.quick
                                           else REPO / "benchmarks" / "results" / "online_serving-cpu.json")
    log = lambda m: print(m, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    result = dict(benchmark="online_serving", machine=machine_info(),
                  workload=dict(model=P["model"], requests=P["requests"], prompt_len=list(P["prompt"]),
                                gen_tokens=P["gen"], server_args=P["server_args"], seed=args.seed),
                  rates={})
    port = free_port()
    server = start_server(P["model"], P["server_args"], port, log)
    url = f"http://127.0.0.1:{port}"
    try:
        result["server_ready_s"] = time.perf_counter() - t_start
        eng, aeng = in_process_engine(P["model"], P["server_args"])
        vocab_hi = min(256, eng.cfg.vocab_size)
        walls = timed_steps(eng)
        rng = np.random.default_rng(args.seed)
        warm = make_prompts(2, *P["prompt"], vocab_hi, rng)  # first requests pay one-off host costs
        asyncio.run(run_http(url, P["model"], warm, P["gen"], [0.0, 0.0]))
        asyncio.run(run_inprocess(aeng, warm, P["gen"], [0.0, 0.0], "warm"))
        compiles0 = eng.stats()["compiles_after_warmup"]
        for rate in P["rates"]:
            prompts = make_prompts(P["requests"], *P["prompt"], vocab_hi, rng)
            offsets = arrivals(P["requests"], rate, rng)
            for w in walls.values():
                del w[:]
            http = asyncio.run(run_http(url, P["model"], prompts, P["gen"], offsets))
            inproc = asyncio.run(run_inprocess(aeng, prompts, P["gen"], offsets, f"r{rate}"))
            same = sum(a.tokens == b.tokens for a, b in zip(http, inproc) if a.error is None and b.error is None)
            key = "inf" if math.isinf(rate) else f"{rate:g}"
            result["rates"][key] = dict(http=summarize(http, P["gen"]), in_process=summarize(inproc, P["gen"]),
                                        greedy_equal=same,
                                        steps_s={k: dict(p50=med(w), n=len(w)) for k, w in walls.items()})
            h, i = result["rates"][key]["http"], result["rates"][key]["in_process"]
            log(f"rate {key:>4}: http {h['completed']}/{P['requests']} ok, {h['output_throughput']:.1f} tok/s, "
                f"TTFT p50 {h['ttft_s']['p50'] * 1e3:.0f} ms, ITL p50 {h['itl_s']['p50'] * 1e3:.1f} ms | "
                f"in-process {i['output_throughput']:.1f} tok/s, TTFT p50 {i['ttft_s']['p50'] * 1e3:.0f} ms, "
                f"ITL p50 {i['itl_s']['p50'] * 1e3:.1f} ms | steps p50 (n) "
                f"{', '.join(f'{k} {med(w) * 1e3:.0f} ms ({len(w)})' for k, w in walls.items() if w)} | "
                f"greedy equal {same}/{P['requests']}")
        result["in_process_compiles_after_warmup"] = eng.stats()["compiles_after_warmup"] - compiles0
        aeng.shutdown()
        with httpx.Client(base_url=url) as c:  # the server's own view: its Prometheus counters
            result["server_metrics_excerpt"] = [ln for ln in c.get("/metrics").text.splitlines()
                                                if ln.startswith(("k3jax:compiles_after_warmup", "vllm:num_preemptions_total"))]
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
    return write_result(result, out, t_start, log)


if __name__ == "__main__":
    main()
