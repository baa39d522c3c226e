"""The on-device sampler at K3's vocabulary (163,840 ids): k3jax's sort-free sampler against its previous
sort-based form and against a torch peer (vLLM's CPU recipe), on the same logits.

    python benchmarks/sampling.py          # ~3 min on the 2-core CPU host; writes results/sampling-cpu.json

What is measured
----------------
* `serve.sampling.sample`, jitted, B = 1 / 8 / 32 / 64 rows of random fp32 logits (scaled so the
  distribution is peaked like a trained model's: top-1 mass ~0.3-0.5), for: greedy; greedy with the top-5
  logprobs; temperature 1; temperature 1 with top-p 0.95 (K3's vendor default); temperature 1 with top-k 50.
* "previous": the same function with the top-k / top-p thresholds from a full sort of each row and XLA's
  argmax (what the sampler did before this change; kept here, and in tests/test_sampling.py as the
  definition the new thresholds must equal).
* Peer: torch (CPU, same threads) doing what vLLM's CPU sampler does for the same settings: argmax;
  softmax + `torch.multinomial`; top-k via `torch.topk`; top-p via `torch.sort` + cumsum mask. Plus
  log_softmax for the sampled token's logprob on both sides.
* Roofline: the logits must be read once: B x V x 4 bytes / the bandwidth measured in the same process.
* Timing: interleaved (new, previous, peer) per repeat so all see the same load; median of 9.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import serve.sampling as sampling  # noqa: E402
from serving import _loadavg, machine_info, measure_bandwidth, med  # noqa: E402
from serve.sampling import SamplingBatch  # noqa: E402
from serve.types import SamplingParams as SP  # noqa: E402

VOCAB = 163840
SETTINGS = {
    "greedy": (SP(temperature=0), 0),
    "greedy + top-5 logprobs": (SP(temperature=0, logprobs=5), 5),
    "T=1": (SP(temperature=1.0), 0),
    "T=1 top_p=0.95": (SP(temperature=1.0, top_p=0.95), 0),
    "T=1 top_k=50": (SP(temperature=1.0, top_k=50), 0),
}


def sorted_threshold(x, top_k, top_p, use_k, use_p):
    """The previous thresholds: a descending sort of every row."""
    v = x.shape[-1]
    s = jnp.flip(jnp.sort(x, axis=-1), axis=-1)
    k_idx = (jnp.clip(top_k, 1, v) - 1)[:, None]
    thr_k = jnp.where(use_k, jnp.take_along_axis(s, k_idx, axis=-1)[:, 0], -jnp.inf)
    s = jnp.where(s >= thr_k[:, None], s, -jnp.inf)
    probs = jax.nn.softmax(s, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    count = jnp.clip(jnp.sum(mass_before < top_p[:, None], axis=-1), 1, v)
    thr_p = jnp.where(use_p, jnp.take_along_axis(s, (count - 1)[:, None], axis=-1)[:, 0], -jnp.inf)
    return jnp.maximum(thr_k, thr_p)


def previous_sample(logits, batch, n):
    """`sample` with the previous thresholds and XLA's argmax (patched in while tracing)."""
    saved = sampling._topk_topp_threshold, sampling.first_argmax
    sampling._topk_topp_threshold = sorted_threshold
    sampling.first_argmax = lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32)
    try:
        return sampling.sample(logits, batch, n)
    finally:
        sampling._topk_topp_threshold, sampling.first_argmax = saved


def torch_peer(torch, logits, p: SP, n: int, gen):
    x = logits
    if p.temperature == 0:
        tok = torch.argmax(x, dim=-1)
    else:
        x = x / p.temperature
        if p.top_k > 0:
            kth = torch.topk(x, p.top_k, dim=-1).values[:, -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            s, idx = torch.sort(x, dim=-1, descending=False)
            cum = torch.softmax(s, dim=-1).cumsum(dim=-1)
            drop = cum <= 1 - p.top_p
            drop[:, -1] = False
            x = x.scatter(-1, idx, s.masked_fill(drop, float("-inf")))
        tok = torch.multinomial(torch.softmax(x, dim=-1), 1, generator=gen)[:, 0]
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp.gather(-1, tok[:, None])
    if n:
        torch.topk(lp, n, dim=-1)
    return tok, chosen


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "sampling-cpu.json"))
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--batches", default="1,8,32,64")
    args = ap.parse_args(argv)
    t_start = time.time()
    info = machine_info()
    try:
        import torch
        torch.set_num_threads(max(1, len(jax.devices("cpu")) and __import__("os").cpu_count()))
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        torch = None
    bw = measure_bandwidth()
    new_fns = {n: jax.jit(partial(sampling.sample, num_top_logprobs=n)) for n in (0, 5)}
    old_fns = {n: jax.jit(partial(previous_sample, n=n)) for n in (0, 5)}
    rng = np.random.default_rng(0)
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        # peaked rows: a few strong candidates over a long tail, like a trained LM's next-token logits
        raw = rng.standard_normal((b, VOCAB)).astype(np.float32) * 2.0
        raw[:, :8] += rng.uniform(8, 12, (b, 8)).astype(np.float32)
        logits = jnp.asarray(raw)
        tlogits = torch.from_numpy(raw) if torch is not None else None
        for name, (p, n) in SETTINGS.items():
            batch = SamplingBatch.from_params([p] * b, list(range(b)), [0] * b, b)
            new, old = new_fns[n], old_fns[n]
            a, c = new(logits, batch), old(logits, batch)
            same = bool(np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens)))
            gen = torch.Generator().manual_seed(0) if torch is not None else None
            times = {"new": [], "previous": [], "torch": []}
            for _ in range(args.reps):
                t0 = time.perf_counter()
                new(logits, batch).tokens.block_until_ready()
                times["new"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                old(logits, batch).tokens.block_until_ready()
                times["previous"].append(time.perf_counter() - t0)
                if torch is not None:
                    t0 = time.perf_counter()
                    torch_peer(torch, tlogits, p, n, gen)
                    times["torch"].append(time.perf_counter() - t0)
            roof = b * VOCAB * 4 / (bw["GBps"] * 1e9)
            ms = {k: round(med(v) * 1e3, 3) for k, v in times.items() if v}
            row = dict(batch=b, setting=name, ms=ms, same_tokens_as_previous=same,
                       roofline_ms=round(roof * 1e3, 3), new_fraction_of_roofline=round(roof / med(times["new"]), 3),
                       speedup_vs_previous=round(med(times["previous"]) / med(times["new"]), 2))
            if times["torch"]:
                row["speedup_vs_torch"] = round(med(times["torch"]) / med(times["new"]), 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    info["loadavg_end"] = _loadavg()
    result = dict(benchmark="sampler at K3's vocabulary", machine=info, vocab_size=VOCAB, bandwidth=bw, rows=rows,
                  wall_s=round(time.time() - t_start, 1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)
    return result


if __name__ == "__main__":
    main()
