"""Disaggregated prefill in one process: a producer engine prefills, a consumer engine decodes.

    python benchmarks/disaggregated.py           # k3-small, ~2 min quiet
    python benchmarks/disaggregated.py --quick   # tiny-k3 (writes to the temp dir)

Two engines with the same model and layout share one host store (`kv_transfer_config`): the producer
runs each prompt with max_tokens = 1 and publishes its resume point (pages below the deepest KDA
checkpoint and that checkpoint); the consumer then runs the prompt with the real max_tokens. Against
a cold consumer (the same prompt, no store entry), measured per prompt length: the consumer's time to
first token (the restore of the published entries plus the tail past the checkpoint, against the
whole prefill), the bytes published, the host copy time of the handoff against a memory roofline (each
byte read once and written once at the copy bandwidth measured in the same process), and whether the
greedy outputs are identical.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.host_cache import HostCache  # noqa: E402
from serve.types import SamplingParams  # noqa: E402
from serving import bench_start, med, write_result  # noqa: E402


def ttft(engine: Engine, prompt: list[int], sp: SamplingParams) -> tuple[float, object]:
    """Wall time from submission to the first token, and the finished output."""
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, sp)
    first, out = None, None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                if first is None and o.outputs and o.outputs[0].token_ids:
                    first = time.perf_counter() - t0
                if o.finished:
                    out = o
    return first, out


def main(argv=None):
    args, out, log, t_start, result = bench_start("disaggregated", __doc__, argv)
    q = args.quick
    name = "tiny-k3" if q else "k3-small"
    lengths = (100, 200) if q else (512, 1024, 2000)
    gen, reps = (4, 1) if q else (16, 3)
    model = k3jax.load_model(name, seed=0)
    store = HostCache((256 if q else 2048) << 20)
    ecfg = dict(max_model_len=2048 + 64, page_size=16, cache_bytes=(64 if q else 512) << 20, max_num_seqs=4,
                prefill_chunk=64 if not q else 16, max_num_batched_tokens=512, decode_buckets=(4,),
                prefill_buckets=(4,), context_buckets=(16, 132), max_prefill_seqs=4)
    t0 = time.perf_counter()
    producer = Engine(model, EngineConfig(**ecfg, kv_transfer_config={"kv_role": "kv_producer", "store": store}),
                      progress=False)
    consumer = Engine(model, EngineConfig(**ecfg, kv_transfer_config={"kv_role": "kv_consumer", "store": store}),
                      progress=False)
    result["startup_s"] = time.perf_counter() - t0
    result.update(model=name, gen=gen, reps=reps, cases=[])
    rng = np.random.default_rng(0)
    copy_bw = result["bandwidth"]["copy_GBps"]
    for n in lengths:
        rows = []
        for _ in range(reps):
            prompt = list(map(int, rng.integers(3, model.cfg.vocab_size - 3, n)))
            sp = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True, logprobs=1)
            cold_s, cold = ttft(consumer, prompt, sp)
            consumer.reset_prefix_cache()
            stored = store.metrics["host_bytes_stored"]
            spill = store.metrics["host_spill_seconds"]
            t0 = time.perf_counter()
            ttft(producer, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            producer_s = time.perf_counter() - t0
            published = store.metrics["host_bytes_stored"] - stored
            restore = store.metrics["host_restore_seconds"]
            warm_s, warm = ttft(consumer, prompt, sp)
            rows.append(dict(cold_ttft_s=cold_s, producer_s=producer_s, consumer_ttft_s=warm_s,
                             published_bytes=published, cached_tokens=warm.num_cached_tokens,
                             spill_s=store.metrics["host_spill_seconds"] - spill,
                             restore_s=store.metrics["host_restore_seconds"] - restore,
                             identical=warm.token_ids == cold.token_ids and
                             [lp.chosen.logprob for lp in warm.outputs[0].logprobs] ==
                             [lp.chosen.logprob for lp in cold.outputs[0].logprobs]))
            consumer.reset_prefix_cache()
            producer.reset_prefix_cache()
        case = dict(prompt_len=n, reps=rows, cold_ttft_s=med([r["cold_ttft_s"] for r in rows]),
                    consumer_ttft_s=med([r["consumer_ttft_s"] for r in rows]),
                    producer_s=med([r["producer_s"] for r in rows]), cached_tokens=rows[0]["cached_tokens"],
                    published_bytes=rows[0]["published_bytes"],
                    handoff_copy_s=med([r["spill_s"] + r["restore_s"] for r in rows]),
                    handoff_roofline_s=2 * 2 * rows[0]["published_bytes"] / (copy_bw * 1e9),
                    identical=all(r["identical"] for r in rows))
        case["ttft_speedup"] = case["cold_ttft_s"] / case["consumer_ttft_s"]
        result["cases"].append(case)
        log(f"prompt {n}: consumer TTFT {case['consumer_ttft_s'] * 1e3:.0f} ms vs cold {case['cold_ttft_s'] * 1e3:.0f} ms "
            f"({case['ttft_speedup']:.1f}x), producer {case['producer_s'] * 1e3:.0f} ms, published "
            f"{case['published_bytes'] / 2**20:.1f} MiB ({case['cached_tokens']} tokens), handoff copies "
            f"{case['handoff_copy_s'] * 1e3:.1f} ms (roofline {case['handoff_roofline_s'] * 1e3:.1f} ms), "
            f"identical {case['identical']}")
    result["compiles_after_warmup"] = producer.compiles_after_warmup + consumer.compiles_after_warmup
    write_result(result, out, t_start, log)


if __name__ == "__main__":
    main()
