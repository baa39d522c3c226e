"""A long prompt alone: time to first token with and without the one-row long prefill program.

    python benchmarks/long_prefill.py           # the recorded run, ~6 min on the 2-core CPU host
    python benchmarks/long_prefill.py --quick   # smoke run on tiny-k3 (writes to the temp dir)

KDA's recurrence keeps one request's prompt chunks in one row, one after another, so with prefill
programs of rows x `prefill_chunk` tokens a prompt with no other prompt beside it advances one chunk
per step, however wide the programs are. `EngineConfig.long_prefill_chunk` (off by default; `None`: max_prefill_seqs x
prefill_chunk) adds a one-row program of that many tokens, which the scheduler takes when it computes
more prompt tokens than the rows of `prefill_chunk` (serve/scheduler.py).

k3-small on CPU, two engines in one process with the same buckets (decode rows 1 / 4, prefill rows 1 / 4
of 64 tokens, one context bucket): "off" (`long_prefill_chunk=0`, the engine before this option, the peer)
and "on" (`long_prefill_chunk=None`, a 1 x 256 program). Measured, alternating the engines, medians of the repetitions:
- TTFT of one prompt alone (512 and 2048 tokens; `max_tokens=1`) and its floor: the prompt's weight
  FLOPs at the fp32 matmul rate measured in this run (attention and the recurrence left out);
- a wave of 16 prompts of 40 tokens and a wave of 4 prompts of 1024 tokens (all to their first token):
  the plan of 64-token rows still serves them, so these should not move.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.types import SamplingParams  # noqa: E402
from serving import active_matmul_params, bench_start, measure_matmul_rate, med, write_result  # noqa: E402

FIRST = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def engine_for(model, long: int | None, max_len: int) -> tuple[Engine, float]:
    cfg = EngineConfig(max_model_len=max_len, page_size=16, cache_bytes=256 << 20, max_num_seqs=4, prefill_chunk=64,
                       max_prefill_seqs=4, decode_buckets=(1, 4), prefill_buckets=(1, 4),
                       context_buckets=(max_len // 16,), enable_prefix_caching=False, measure_moe_time=False,
                       long_prefill_chunk=long)
    t = time.perf_counter()
    eng = Engine(model, cfg, warmup=True, progress=False)
    return eng, time.perf_counter() - t


def first_tokens(eng: Engine, prompts: list[list[int]]) -> dict:
    """Run the prompts to their first token together -> wall time, steps and long-row steps taken."""
    c0 = dict(eng.counters)
    t = time.perf_counter()
    ids = [eng.add_request(p, FIRST) for p in prompts]
    done = set()
    while eng.has_unfinished():
        done.update(o.request_id for o in eng.step() if o.finished)
    dt = time.perf_counter() - t
    assert done == set(ids), (done, ids)
    return dict(s=dt, steps=eng.counters["steps"] - c0["steps"],
                long_steps=eng.counters["long_prefill_steps"] - c0["long_prefill_steps"])


def main(argv=None) -> dict:
    args, out_path, log, t_start, result = bench_start("long_prefill", __doc__, argv)
    preset = "tiny-k3" if args.quick else "k3-small"
    model = k3jax.load_model(preset)
    max_len = 1024 if args.quick else 4096
    lone = (256, 1000) if args.quick else (512, 2048)
    reps = 1 if args.quick else 2
    rate = measure_matmul_rate(1024 if args.quick else 2048)
    engines = {}
    for name, long in (("off", 0), ("on", None)):
        eng, warm = engine_for(model, long, max_len)
        engines[name] = eng
        result.setdefault("engines", {})[name] = dict(
            long_prefill_chunk=eng.sched_cfg.long_prefill_chunk, programs=len(eng.bucket_shapes()), warmup_s=warm)
        log(f"{name}: {len(eng.bucket_shapes())} programs, warm-up {warm:.1f} s")
    rng = np.random.default_rng(0)
    vocab = min(500, model.cfg.vocab_size)
    cases = {f"alone_{n}": [[rng.integers(0, vocab, n).tolist()] for _ in range(reps)] for n in lone}
    cases["wave_16x40"] = [[rng.integers(0, vocab, 40).tolist() for _ in range(16)] for _ in range(reps)]
    cases["wave_4x1024"] = [[rng.integers(0, vocab, min(1024, max_len - 8)).tolist() for _ in range(4)]
                            for _ in range(reps)]
    flops_per_token = 2 * active_matmul_params(model)
    rows = {}
    for case, draws in cases.items():
        runs = {name: [] for name in engines}
        for i, prompts in enumerate(draws):  # alternate which engine goes first
            for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
                runs[name].append(first_tokens(engines[name], prompts))
        tokens = sum(len(p) for p in draws[0])
        row = dict(prompt_tokens=tokens, floor_s=flops_per_token * tokens / rate)
        for name, rs in runs.items():
            row[name] = dict(s=med([r["s"] for r in rs]), runs_s=[r["s"] for r in rs], steps=rs[0]["steps"],
                             long_steps=rs[0]["long_steps"])
        row["speedup_on_over_off"] = row["off"]["s"] / row["on"]["s"]
        row["on_over_floor"] = row["on"]["s"] / row["floor_s"]
        rows[case] = row
        log(f"{case}: off {row['off']['s']:.2f} s ({row['off']['steps']} steps), on {row['on']['s']:.2f} s "
            f"({row['on']['steps']} steps, {row['on']['long_steps']} long), floor {row['floor_s']:.2f} s")
    result.update(model=preset, matmul_flops_per_s=rate, cases=rows,
                  compiles_after_warmup={n: e.stats()["compiles_after_warmup"] for n, e in engines.items()})
    return write_result(result, out_path, t_start, log)


if __name__ == "__main__":
    main()
