"""Host cost of a step's outputs: cumulative outputs (every output carries everything generated so far)
against deltas (vLLM's RequestOutputKind.DELTA: only what is new), at long outputs.

    python benchmarks/output_kinds.py           # ~1 min on the 2-core CPU host; writes results/output_kinds-cpu.json

What is measured
----------------
An `Engine` over tiny-k3 (no step program is compiled: the work measured is host bookkeeping) holds R
running requests whose outputs are L tokens long, appended through `Engine._append` as decoding does
(detokenization, stop checking, logprob entries with the top-2). Then `Engine._outputs` -- what every
`engine.step()` returns -- is timed for the R requests as if each had just produced one token:
* cumulative (the Python API's default before this change, and what the HTTP server asked for): each
  output copies the token ids and logprobs so far and joins the text;
* delta (what the HTTP server asks for now): each output carries the new token, its text and logprob.
The "bound" is the delta's work at L = 1 (nothing but one token's output per request). Median of 15 calls,
the two kinds interleaved. R = 8 and 64, L = 256 / 1024 / 4096, with and without logprobs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from k3jax.runtime import load_model  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.types import RequestOutputKind, SamplingParams  # noqa: E402
from serving import machine_info, med  # noqa: E402


def engine_with(rows: int, length: int, logprobs, model) -> tuple[Engine, set[str]]:
    """An engine (not warmed up) with `rows` requests of `length` generated tokens each. No step runs, so its
    `max_model_len` may pass the model's max_position_embeddings (tiny-k3: 4096, the longest L here): the
    engine's refusal of that is lifted while it is built, as K3JAX_ALLOW_LONG_MAX_MODEL_LEN=1 lifts it."""
    key, before = "K3JAX_ALLOW_LONG_MAX_MODEL_LEN", os.environ.get("K3JAX_ALLOW_LONG_MAX_MODEL_LEN")
    os.environ[key] = "1"
    try:
        e = Engine(model, EngineConfig(max_model_len=length + 64, cache_bytes=64 << 20, max_num_seqs=max(rows, 8),
                                       measure_moe_time=False, max_logprobs=2), warmup=False, progress=False)
    finally:
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before
    rng = np.random.default_rng(0)
    rids = set()
    for r in range(rows):
        rid = e.add_request([5, 6, 7], SamplingParams(max_tokens=length + 8, ignore_eos=True, logprobs=logprobs,
                                                       temperature=0))
        seq = e.requests[rid].seqs[0]
        for tok in rng.integers(32, 127, length):  # printable bytes: text grows with every token
            e._append(seq, int(tok), -0.5, 1, np.array([int(tok), 40]), np.array([-0.5, -1.5]), time.monotonic())
        rids.add(rid)
    return e, rids


def time_outputs(e: Engine, rids: set[str], kind: RequestOutputKind, reps: int) -> list[float]:
    seqs = [s for rid in rids for s in e.requests[rid].seqs]
    out = []
    for _ in range(reps):
        for s in seqs:
            s.params.output_kind = kind
            s.checker._text_cache = None  # a new token invalidates the joined text
            s.sent = (len(s.output_ids) - 1, s.checker.chunks - 1)  # one token new since the last delta
        for rid in rids:
            e.requests[rid].reported = True
        t0 = time.perf_counter()
        outs = e._outputs(rids)
        out.append(time.perf_counter() - t0)
        assert len(outs) == len(rids)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "output_kinds-cpu.json"))
    args = ap.parse_args()
    model = load_model("tiny-k3")
    cases = []
    t_start = time.time()
    for logprobs in (None, 2):
        for rows in (8, 64):
            bound = None
            for length in (1, 256, 1024, 4096):
                e, rids = engine_with(rows, length, logprobs, model)
                cum, dlt = [], []
                for _ in range(args.reps):  # interleaved
                    cum += time_outputs(e, rids, RequestOutputKind.CUMULATIVE, 1)
                    dlt += time_outputs(e, rids, RequestOutputKind.DELTA, 1)
                c, d = med(cum) * 1e3, med(dlt) * 1e3
                bound = d if length == 1 else bound
                row = {"rows": rows, "output_tokens": length, "logprobs": logprobs, "cumulative_ms": round(c, 4),
                       "delta_ms": round(d, 4), "speedup": round(c / d, 2), "bound_ms": round(bound, 4)}
                cases.append(row)
                print(json.dumps(row), flush=True)
    result = {"benchmark": "output_kinds", "machine": machine_info(), "reps": args.reps, "cases": cases,
              "wall_s": round(time.time() - t_start, 1)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
