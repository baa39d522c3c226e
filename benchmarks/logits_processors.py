"""Custom logits processors in the on-device sampler at K3's vocabulary (163,840 ids): what a step pays for
a processor compiled in but off, and for the built-in `no_repeat_ngram` on every row, against HF
transformers' `NoRepeatNGramLogitsProcessor` (torch CPU) on the same logits and histories.

    python benchmarks/logits_processors.py     # ~2 min on the 2-core CPU host; writes results/logits_processors-cpu.json

What is measured (median of 15, interleaved so all forms see the same load), B = 1 / 8 / 32 greedy rows,
each with a history of S = 2048 tokens (prompt 1024 + output 1024, ids drawn from 16 values so trigrams
repeat and the ban changes most rows' argmax):
* `plain`: `serve.sampling.sample` jitted without processors;
* `off`: with `no_repeat_ngram` compiled in, no row using it (the `lax.cond` skips it);
* `on`: every row with `no_repeat_ngram_size` = 3;
* peer: HF's processor on the same [B, S] ids and [B, V] scores (its Python loop over n-grams), then argmax.
Roofline of `on`: the logits read and written once plus the history read 17 times (MAX_NGRAM + 1, the static
n-gram loop): bytes / the bandwidth measured in the same process. Tokens of `on` must equal the peer's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from serve import logits_processors as lp  # noqa: E402
from serve.sampling import SamplingBatch, sample  # noqa: E402
from serve.types import SamplingParams as SP  # noqa: E402
from serving import _loadavg, machine_info, measure_bandwidth, med  # noqa: E402

VOCAB = 163_840
PROMPT, OUTPUT, NGRAM = 1024, 1024, 3


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "logits_processors-cpu.json"))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--batches", default="1,8,32")
    args = ap.parse_args(argv)
    t_start = time.time()
    info = machine_info()
    import torch
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

    bw = measure_bandwidth()
    procs = (lp.NO_REPEAT_NGRAM,)
    s = PROMPT + OUTPUT
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (1, s))

    def make(processors):
        return jax.jit(lambda x, b, ids: sample(x, b, history=lambda: (ids, jnp.broadcast_to(pos, ids.shape)),
                                                processors=processors))
    fns = {"plain": make(()), "off": make(procs), "on": make(procs)}
    hf = NoRepeatNGramLogitsProcessor(NGRAM)
    rng = np.random.default_rng(0)
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        raw = rng.standard_normal((b, VOCAB)).astype(np.float32) * 2.0
        ids = rng.integers(0, 16, (b, s)).astype(np.int32)
        raw[:, :16] += 6.0  # the repeated ids are the likely ones: the ban changes the argmax
        logits, hist = jnp.asarray(raw), jnp.asarray(ids)
        greedy = [SP(temperature=0)] * b
        on = [SP(temperature=0, extra_args={"no_repeat_ngram_size": NGRAM})] * b
        batches = {"plain": SamplingBatch.from_params(greedy, [0] * b, [OUTPUT] * b, b, [PROMPT] * b),
                   "off": SamplingBatch.from_params(greedy, [0] * b, [OUTPUT] * b, b, [PROMPT] * b, processors=procs),
                   "on": SamplingBatch.from_params(on, [0] * b, [OUTPUT] * b, b, [PROMPT] * b, processors=procs)}
        tids, tscores = torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(raw)

        def peer():
            return torch.argmax(hf(tids, tscores.clone()), dim=-1)
        got = {k: np.asarray(fns[k](logits, batches[k], hist).tokens) for k in fns}
        want = peer().numpy()
        times = {k: [] for k in (*fns, "hf")}
        for _ in range(args.reps):
            for k in fns:
                t0 = time.perf_counter()
                fns[k](logits, batches[k], hist).tokens.block_until_ready()
                times[k].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            peer()
            times["hf"].append(time.perf_counter() - t0)
        roof = (2 * b * VOCAB * 4 + (lp.MAX_NGRAM + 1) * b * s * 4) / (bw["GBps"] * 1e9)
        ms = {k: round(med(v) * 1e3, 3) for k, v in times.items()}
        row = dict(batch=b, history=s, ms=ms, on_equals_hf=bool(np.array_equal(got["on"], want)),
                   off_equals_plain=bool(np.array_equal(got["off"], got["plain"])),
                   ban_changed_tokens=int(np.sum(got["on"] != got["plain"])),
                   on_roofline_ms=round(roof * 1e3, 3), on_fraction_of_roofline=round(roof / med(times["on"]), 3),
                   on_speedup_vs_hf=round(med(times["hf"]) / med(times["on"]), 1))
        rows.append(row)
        print(json.dumps(row), flush=True)
    info["loadavg_end"] = _loadavg()
    result = dict(benchmark="custom logits processors in the sampler at K3's vocabulary", machine=info,
                  vocab_size=VOCAB, ngram=NGRAM, bandwidth=bw, rows=rows, wall_s=round(time.time() - t_start, 1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)
    return result


if __name__ == "__main__":
    main()
