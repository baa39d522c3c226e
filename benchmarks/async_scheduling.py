"""Async scheduling (`EngineConfig.async_scheduling`): what overlapping the host's work with the device step
gains, against the same waves on the synchronous engine in the same process.

    python benchmarks/async_scheduling.py            # tiny-k3 and k3-small, c = 1 / 8 / 32 (~15 min)
    python benchmarks/async_scheduling.py --quick    # tiny-k3, c = 8, one pair of waves, one constrained round

What is measured
----------------
* Per model, two engines of one layout, the synchronous one and `async_scheduling=True`, warmed up (every
  bucket compiled; `compiles_after_warmup` recorded). A wave of c greedy requests (prompts of 32-96
  tokens, `max_tokens` 32, EOS ignored) is submitted at once and stepped to completion; the two engines take
  turns on the same prompts, `reps` pairs per c, so both see the same load. Their greedy tokens are compared.
* Throughput: generated tokens / wave wall time (medians over the pairs), and the ratio async / sync of
  each pair (median and range).
* Where a synchronous decode step's time goes: a third run of the same waves on the synchronous engine with
  its compiled step wrapped to wait for the device (`jax.block_until_ready`) and time it. Device time = the
  wrapped calls; host time = the rest of `engine.step()` (scheduling, batch building, reading back, output
  processing). Overlap can save at most min(host, device) of each step: the bound on the async speed-up is
  (host + device) / max(host, device).
* Constrained rows (`structured_mix`): tiny-k3 waves of c = 32 greedy requests, every 8th constrained to a
  regex, on the synchronous and the async engine (a decode program's logits sampled by a program launched
  once the step before is read back, with the masks built then); tokens compared, the share of steps
  launched while another was in flight recorded. `--only-structured` runs just this part.
* Speculative decoding (`speculative_mix`): tiny-k3 waves of c = 8 and 32 greedy requests on three engines of one
  layout: synchronous with n-gram drafts, async with drafts (a row whose token is in flight drafts on a guess
  of it, serve/engine.py `_drafts`) and async without. Two proposers: `sparse`, the plain run's own
  continuation offered at every 4th output token (right proposals, sparse as real n-gram hits are), and the
  real `ngram` proposer (these random-weight models repeat little: few proposals, fewer accepted). Tokens
  compared with the plain run; guesses made and right recorded. `--only-speculative` runs just this part.
* Host time against rows (`host_scaling`): the synchronous split above on tiny-k3 at 32, 128 and 256 rows.
* `tiny-k3` stands in for a fast accelerator: its device step is a few ms, so host work is a large share of
  each step, as for K3 on a GPU slice, where a decode step takes milliseconds and the host work of 256 rows
  does not shrink with the device. `k3-small` is device-bound on this CPU host.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from serving import _loadavg, arena_budget, machine_info, med  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.types import SamplingParams, StructuredOutputsParams  # noqa: E402

GEN = 32


def engine_config(model, c: int, mml: int = 256, **kw) -> dict:
    cfg = dict(max_model_len=mml, page_size=16, max_num_seqs=c, prefill_chunk=64, max_prefill_seqs=4,
               max_num_batched_tokens=512, decode_buckets=tuple(b for b in (1, 8, 32) if b <= c), prefill_buckets=(4,),
               context_buckets=(16,), enable_prefix_caching=False, measure_moe_time=False,
               cache_bytes=arena_budget(model, 16, mml, c))
    cfg.update(kw)
    return cfg


def wave(engine: Engine, prompts: list[list[int]], params: list[SamplingParams] | None = None) -> dict:
    params = params or [SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)] * len(prompts)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done, steps = {}, 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
    wall = time.perf_counter() - t0
    toks = [done[i].token_ids for i in ids]
    return dict(wall_s=wall, gen_tok_s=sum(map(len, toks)) / wall, steps=steps, token_ids=toks)


class _TimedStep:
    """The engine's compiled step, waiting for the device and timing each call (host/device split)."""

    def __init__(self, real):
        self.real, self._cache_size, self.lower, self.seconds = real, real._cache_size, real.lower, 0.0

    def __call__(self, *args):
        t0 = time.perf_counter()
        out = jax.block_until_ready(self.real(*args))
        self.seconds += time.perf_counter() - t0
        return out


def split_step_time(engine: Engine, prompts: list[list[int]]) -> dict:
    """Per decode-only step of a synchronous wave: wall, device (the step call waited for) and host ms."""
    timed = _TimedStep(engine._step)
    real, engine._step = engine._step, timed
    sp = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    walls, devs = [], []
    try:
        for p in prompts:
            engine.add_request(p, sp)
        while engine.has_unfinished():
            c = dict(engine.counters)
            timed.seconds = 0.0
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            if engine.counters["decode_steps"] > c["decode_steps"] and engine.counters["prefill_steps"] == c["prefill_steps"]:
                walls.append(dt)
                devs.append(timed.seconds)
    finally:
        engine._step = real
    wall, dev = med(walls), med(devs)
    host = wall - dev
    return dict(decode_steps=len(walls), step_ms=1e3 * wall, device_ms=1e3 * dev, host_ms=1e3 * host,
                host_share=host / wall, overlap_bound=wall / max(host, dev))


def run_model(name: str, concurrency: list[int], reps: int, seed: int) -> dict:
    model = k3jax.load_model(name, seed=1)
    rng = np.random.default_rng(seed)
    out = dict(model=name, results=[])
    for c in concurrency:
        t0 = time.perf_counter()
        sync = Engine(model, EngineConfig(**engine_config(model, c)), progress=False)
        asyn = Engine(model, EngineConfig(**engine_config(model, c, async_scheduling=True)), progress=False)
        startup = time.perf_counter() - t0
        pairs = []
        for r in range(reps + 1):  # the first pair warms caches and is not recorded
            prompts = [rng.integers(0, model.cfg.vocab_size, int(n)).tolist() for n in rng.integers(32, 97, c)]
            order = (sync, asyn) if r % 2 == 0 else (asyn, sync)
            got = {id(e): wave(e, prompts) for e in order}
            s, a = got[id(sync)], got[id(asyn)]
            if r:
                pairs.append(dict(sync_tok_s=s["gen_tok_s"], async_tok_s=a["gen_tok_s"],
                                  ratio=a["gen_tok_s"] / s["gen_tok_s"], sync_steps=s["steps"],
                                  async_steps=a["steps"], same_tokens=s["token_ids"] == a["token_ids"]))
        prompts = [rng.integers(0, model.cfg.vocab_size, int(n)).tolist() for n in rng.integers(32, 97, c)]
        split = split_step_time(sync, prompts)
        ratios = [p["ratio"] for p in pairs]
        res = dict(concurrency=c, reps=reps, startup_s=startup,
                   sync_gen_tok_s=med([p["sync_tok_s"] for p in pairs]),
                   async_gen_tok_s=med([p["async_tok_s"] for p in pairs]),
                   speedup_median=med(ratios), speedup_min=min(ratios), speedup_max=max(ratios),
                   same_tokens=all(p["same_tokens"] for p in pairs),
                   steps_launched_ahead=asyn.counters["steps_launched_ahead"], steps=asyn.counters["steps"],
                   compiles_after_warmup=dict(sync=sync.compiles_after_warmup, async_=asyn.compiles_after_warmup),
                   sync_decode_step=split, pairs=pairs)
        out["results"].append(res)
        print(f"{name} c={c}: sync {res['sync_gen_tok_s']:.1f} tok/s, async {res['async_gen_tok_s']:.1f} tok/s, "
              f"x{res['speedup_median']:.3f} ({res['speedup_min']:.3f}-{res['speedup_max']:.3f}); sync decode step "
              f"{split['step_ms']:.2f} ms = device {split['device_ms']:.2f} + host {split['host_ms']:.2f} "
              f"(bound x{split['overlap_bound']:.2f}); same tokens {res['same_tokens']}", flush=True)
    return out


def structured_mix(name: str, c: int, reps: int, seed: int, every: int = 8) -> dict:
    """A wave of c greedy requests of which every `every`-th is constrained to a regex (structured outputs): the
    synchronous and the async engine of one layout taking turns (the async engine's decode logits sampled by a
    program launched once the step before is read back, with the masks built then)."""
    model = k3jax.load_model(name, seed=1)
    rng = np.random.default_rng(seed)
    engines = dict(sync=Engine(model, EngineConfig(**engine_config(model, c)), progress=False),
                   async_=Engine(model, EngineConfig(**engine_config(model, c, async_scheduling=True)), progress=False))
    regex = r"[a-z][a-z ]{0,200}"  # longer than the wave's tokens: every constrained row runs to max_tokens
    params = [SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(regex=regex) if i % every == 0 else None)
              for i in range(c)]
    rounds = []
    for r in range(reps + 1):  # the first round warms caches and is not recorded
        prompts = [rng.integers(0, model.cfg.vocab_size, int(n)).tolist() for n in rng.integers(32, 97, c)]
        got = {}
        for k in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            e = engines[k]
            before = dict(e.counters)
            got[k] = wave(e, prompts, params)
            got[k]["launched_ahead"] = ((e.counters["steps_launched_ahead"] - before["steps_launched_ahead"])
                                        / (e.counters["steps"] - before["steps"]))
        if r:
            rounds.append({k: dict(gen_tok_s=v["gen_tok_s"], launched_ahead=v["launched_ahead"],
                                   same_tokens=v["token_ids"] == got["sync"]["token_ids"]) for k, v in got.items()})
    out = dict(model=name, concurrency=c, constrained_every=every, regex=regex, reps=reps, rounds=rounds,
               compiles_after_warmup={k: e.compiles_after_warmup for k, e in engines.items()})
    for k in engines:
        out[k] = dict(gen_tok_s=med([x[k]["gen_tok_s"] for x in rounds]),
                      launched_ahead=med([x[k]["launched_ahead"] for x in rounds]),
                      same_tokens=all(x[k]["same_tokens"] for x in rounds))
    ratios = [x["async_"]["gen_tok_s"] / x["sync"]["gen_tok_s"] for x in rounds]
    out.update(speedup_median=med(ratios), speedup_min=min(ratios), speedup_max=max(ratios))
    print(f"{name} c={c}, every {every}th constrained: sync {out['sync']['gen_tok_s']:.1f} tok/s, async "
          f"{out['async_']['gen_tok_s']:.1f} tok/s, x{out['speedup_median']:.3f} ({out['speedup_min']:.3f}-"
          f"{out['speedup_max']:.3f}), {100 * out['async_']['launched_ahead']:.0f} % of async steps launched ahead, "
          f"same tokens {out['async_']['same_tokens']}", flush=True)
    return out


def speculative_mix(name: str, c: int, reps: int, seed: int, every: int = 4) -> dict:
    """Synchronous and async engines with n-gram speculative decoding (and async without) on one wave shape."""
    model = k3jax.load_model(name, seed=1)
    rng = np.random.default_rng(seed)
    spec = dict(method="ngram", num_speculative_tokens=3, adaptive=False)
    engines = dict(sync_spec=Engine(model, EngineConfig(**engine_config(model, c, speculative_config=spec)),
                                    progress=False),
                   async_spec=Engine(model, EngineConfig(**engine_config(model, c, speculative_config=spec,
                                                                         async_scheduling=True)), progress=False),
                   async_plain=Engine(model, EngineConfig(**engine_config(model, c, async_scheduling=True)),
                                      progress=False))
    ngram = {k: e._propose for k, e in engines.items()}
    keys = ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_guessed_drafts",
            "spec_decode_num_guesses_right", "steps_launched_ahead", "steps")
    out = dict(model=name, concurrency=c, sparse_every=every, reps=reps, modes={})
    for mode in ("sparse", "ngram"):
        rounds = []
        for r in range(reps + 1):  # the first round warms caches and is not recorded
            prompts = [rng.integers(0, model.cfg.vocab_size, int(n)).tolist() for n in rng.integers(32, 97, c)]
            engines["sync_spec"]._propose = lambda q, k: []
            plain = wave(engines["sync_spec"], prompts)["token_ids"]
            want = {tuple(p): t for p, t in zip(prompts, plain)}
            got = {}
            for k in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                e = engines[k]
                if k != "async_plain":
                    e._propose = ngram[k] if mode == "ngram" else (
                        lambda q, n: [] if len(q.output_ids) % every else list(want[tuple(q.prompt_ids)][
                            len(q.output_ids):][:n]))
                before = dict(e.counters)
                w = wave(e, prompts)
                got[k] = dict(gen_tok_s=w["gen_tok_s"], same_tokens=w["token_ids"] == plain,
                              **{x: e.counters[x] - before[x] for x in keys})
            if r:
                rounds.append(got)
        res = {k: dict(gen_tok_s=med([x[k]["gen_tok_s"] for x in rounds]),
                       same_tokens=all(x[k]["same_tokens"] for x in rounds),
                       **{x: int(sum(y[k][x] for y in rounds)) for x in keys}) for k in engines}
        for k, v in res.items():
            v["launched_ahead"] = v["steps_launched_ahead"] / max(v["steps"], 1)
        res["async_spec_over_sync_spec"] = med([x["async_spec"]["gen_tok_s"] / x["sync_spec"]["gen_tok_s"]
                                                for x in rounds])
        res["async_spec_over_async_plain"] = med([x["async_spec"]["gen_tok_s"] / x["async_plain"]["gen_tok_s"]
                                                  for x in rounds])
        res["rounds"] = rounds
        out["modes"][mode] = res
        print(f"{name} c={c} {mode}: sync+spec {res['sync_spec']['gen_tok_s']:.1f}, async+spec "
              f"{res['async_spec']['gen_tok_s']:.1f}, async {res['async_plain']['gen_tok_s']:.1f} tok/s; async+spec / "
              f"sync+spec x{res['async_spec_over_sync_spec']:.3f}, / async x{res['async_spec_over_async_plain']:.3f}; "
              f"guesses {res['async_spec']['spec_decode_num_guesses_right']}/"
              f"{res['async_spec']['spec_decode_num_guessed_drafts']} right; same tokens "
              f"{all(res[k]['same_tokens'] for k in engines)}", flush=True)
    out["compiles_after_warmup"] = {k: e.compiles_after_warmup for k, e in engines.items()}
    return out


def host_scaling(name: str, rows: list[int], seed: int) -> list[dict]:
    """Host time of a synchronous decode step as the rows grow (the per-row and the fixed part)."""
    model = k3jax.load_model(name, seed=1)
    rng = np.random.default_rng(seed)
    out = []
    for c in rows:
        eng = Engine(model, EngineConfig(**engine_config(model, c, decode_buckets=tuple(sorted({1, 8, c})))),
                     progress=False)
        runs = [split_step_time(eng, [rng.integers(0, model.cfg.vocab_size, int(n)).tolist()
                                      for n in rng.integers(32, 97, c)]) for _ in range(3)]
        res = dict(rows=c, **{k: med([x[k] for x in runs]) for k in ("step_ms", "device_ms", "host_ms")})
        res["host_us_per_row"] = 1e3 * res["host_ms"] / c
        out.append(res)
        print(f"{name} {c} rows: host {res['host_ms']:.2f} ms a decode step ({res['host_us_per_row']:.1f} us a row), "
              f"device {res['device_ms']:.2f} ms", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only-structured", action="store_true", help="only the constrained-rows waves")
    ap.add_argument("--only-speculative", action="store_true", help="only the speculative-decoding waves")
    a = ap.parse_args()
    part = a.only_structured or a.only_speculative
    models = [("tiny-k3", [8])] if a.quick else [("tiny-k3", [1, 8, 32]), ("k3-small", [1, 8, 32])]
    models = [] if part else models
    reps = 1 if a.quick else a.reps
    res = dict(benchmark="async_scheduling", machine=machine_info(), gen_tokens=GEN, models=[])
    for name, conc in models:
        res["models"].append(run_model(name, conc, reps, a.seed))
    if not a.only_speculative:
        res["structured_mix"] = [structured_mix("tiny-k3", 8 if a.quick else 32, reps, a.seed)]
    if not a.only_structured:
        res["speculative_mix"] = [speculative_mix("tiny-k3", c, reps, a.seed) for c in ([8] if a.quick else [8, 32])]
    if not (a.quick or part):
        res["host_scaling"] = host_scaling("tiny-k3", [32, 128, 256], a.seed)
    res["machine"]["loadavg_end"] = _loadavg()
    path = Path(a.out) if a.out else REPO / "benchmarks" / "results" / (
        "async_scheduling-cpu-quick.json" if a.quick else
        "async_scheduling-cpu-structured.json" if a.only_structured else
        "async_scheduling-cpu-speculative.json" if a.only_speculative else "async_scheduling-cpu.json")
    if a.quick and not a.out:  # quick runs do not replace the recorded results
        path = Path("/tmp") / path.name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
