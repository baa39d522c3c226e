"""What returning routed experts costs (EngineConfig.enable_return_routed_experts, serve/routed_experts.py): the
same waves on two k3-small engines, one with the option and one without, taking turns.

    python benchmarks/routed_experts.py          # ~4 min on the 2-core CPU host; writes results/routed_experts-cpu.json
    python benchmarks/routed_experts.py --quick  # tiny-k3, one round (writes to the temp dir)

What is measured, per concurrency c (8 and 32 greedy requests of 96-160 random tokens, 32 generated, prefix
caching on; rounds alternate the engines so both see the same load; medians):
* wave time and generated tokens/s of each engine, and their ratio;
* the decode step (`engine.step()` wall time over decode-only steps with all c rows), and the host time
  spent keeping the ids (`Engine._record_positions`: the copy into each sequence and the store's granules) per step;
* a resumed wave: the same prompts again, so each request's prompt comes from the prefix cache and its ids from
  the store (`RoutesStore.take`, filled at admission);
* bytes the ids add to a decode step's read-back (c x MoE layers x k x 2) against the bandwidth measured here.
Every request's ids must cover its whole sequence (none left at -1) and the tokens must equal the plain engine's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.types import SamplingParams  # noqa: E402
from serving import _loadavg, arena_budget, machine_info, measure_bandwidth, med  # noqa: E402


def run_wave(eng: Engine, prompts: list, sp: SamplingParams, c: int) -> dict:
    """Submit the wave, step it to the end -> wall time, decode-step times with all c rows, outputs."""
    record = [0.0]
    real = eng._record_positions

    def timed(*a, **kw):
        t0 = time.perf_counter()
        real(*a, **kw)
        record[0] += time.perf_counter() - t0
    eng._record_positions = timed
    try:
        t0 = time.perf_counter()
        for p in prompts:
            eng.add_request(p, sp)
        outs, steps, decode = {}, 0, []
        while eng.has_unfinished():
            full = sum(1 for s in eng.seqs.values() if not s.finished and s.slot is not None) == c
            prefills, t = eng.counters["prefill_steps"], time.perf_counter()
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o
            if full and eng.counters["prefill_steps"] == prefills:  # a decode-only step with every row
                decode.append(time.perf_counter() - t)
            steps += 1
        wall = time.perf_counter() - t0
    finally:
        del eng._record_positions
    return dict(wall=wall, decode=decode, steps=steps, record=record[0], outs=outs)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t_start = time.time()
    out_path = Path(args.out) if args.out else (
        Path(tempfile.gettempdir()) / "routed_experts-cpu.json" if args.quick
        else REPO / "benchmarks" / "results" / "routed_experts-cpu.json")
    name = "tiny-k3" if args.quick else "k3-small"
    conc = (8,) if args.quick else (8, 32)
    rounds = 1 if args.quick else args.rounds
    gen, mml = 32, 256
    info = machine_info()
    bw = measure_bandwidth()
    model = k3jax.load_model(name, seed=0)
    cfg = model.cfg
    moe = sum(cfg.is_moe(layer) for layer in range(cfg.num_hidden_layers))
    ecfg = dict(max_model_len=mml, page_size=16, max_num_seqs=conc[-1], prefill_chunk=64, max_prefill_seqs=4,
                max_num_batched_tokens=512, decode_buckets=conc, prefill_buckets=(4,), context_buckets=(mml // 16,),
                cache_bytes=2 * arena_budget(model, 16, mml, conc[-1]), measure_moe_time=False)
    engines = {}
    for flag in (False, True):
        t0 = time.perf_counter()
        engines[flag] = Engine(model, EngineConfig(**ecfg, enable_return_routed_experts=flag), progress=False)
        print(f"engine routes={flag}: start-up {time.perf_counter() - t0:.1f} s", flush=True)
    sp = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    rng = np.random.default_rng(0)
    rows = []
    for c in conc:
        runs = {False: [], True: []}
        resumed = {False: [], True: []}
        for r in range(rounds):
            prompts = [rng.integers(3, cfg.vocab_size, int(rng.integers(96, 161))).tolist() for _ in range(c)]
            order = (False, True) if r % 2 == 0 else (True, False)
            got = {}
            for flag in order:
                got[flag] = run_wave(engines[flag], prompts, sp, c)
                runs[flag].append(got[flag])
            for flag in order:  # the same prompts again: prompts from the prefix cache, ids from the store
                resumed[flag].append(run_wave(engines[flag], prompts, sp, c))
            for w in (got, {f: resumed[f][-1] for f in resumed}):
                plain = {o.prompt_token_ids.__repr__(): o.token_ids for o in w[False]["outs"].values()}
                for o in w[True]["outs"].values():
                    assert o.token_ids == plain[o.prompt_token_ids.__repr__()]
                    ids = o.outputs[0].routed_experts
                    assert ids.shape == (len(o.prompt_token_ids) + gen - 1, moe, cfg.num_experts_per_token)
                    assert ids.min() >= 0
        row = dict(c=c)
        for key, series in (("cold", runs), ("resumed", resumed)):
            for flag, label in ((False, "plain"), (True, "routes")):
                ws = series[flag]
                row[f"{key}_{label}_wave_s"] = med([w["wall"] for w in ws])
                row[f"{key}_{label}_gen_tok_s"] = med([c * gen / w["wall"] for w in ws])
                row[f"{key}_{label}_decode_step_ms"] = med([1e3 * med(w["decode"]) for w in ws if w["decode"]])
                if flag:
                    row[f"{key}_record_ms_per_step"] = med([1e3 * w["record"] / w["steps"] for w in ws])
            row[f"{key}_routes_over_plain"] = row[f"{key}_routes_wave_s"] / row[f"{key}_plain_wave_s"]
        row["readback_bytes_per_decode_step"] = c * moe * cfg.num_experts_per_token * 2
        row["readback_us_at_measured_bandwidth"] = 1e6 * row["readback_bytes_per_decode_step"] / (bw["GBps"] * 1e9)
        st = engines[True].stats()
        row["store"] = st["routed_experts_store"]
        row["hits_dropped"] = engines[True].counters["routed_experts_hits_dropped"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = dict(benchmark="routed_experts", model=name, moe_layers=moe, experts_per_token=cfg.num_experts_per_token,
                  machine=info, bandwidth=bw, loadavg=_loadavg(), rounds=rounds, max_tokens=gen, rows=rows,
                  seconds=round(time.time() - t_start, 1))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out_path} ({result['seconds']} s)")
    return result


if __name__ == "__main__":
    main()
