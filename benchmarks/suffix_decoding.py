"""Suffix decoding (`speculative_config.method = "suffix"`, serve/speculative.py) on RL-style rollouts.

    python benchmarks/suffix_decoding.py           # k3-small, ~3 min on the 2-core host
    python benchmarks/suffix_decoding.py --quick   # tiny-k3 (temp dir)

One `Engine` (k3-small, 3 drafts per verify row, the draft gate off so every proposal is verified: the raw
effect), waves of c = 8 / 32 prompts (64-192 random tokens, 48 generated), each prompt rolled out twice, as an RL
loop samples a prompt several times. Modes, on the same prompts: `plain` (no drafts), `ngram` (prompt lookup),
and `suffix` twice: `suffix, 1st rollout` (the proposer's corpus empty of these prompts: only the request's own
tokens to draft from) and `suffix, 2nd rollout` (the first rollouts' answers in the corpus). Greedy (the second
rollout repeats the first: the best case) and seeded sampling at temperature 0.8 (each rollout its own seed:
on these random-weight models the answers diverge at once, so this measures what drafts that miss cost).
Every mode's tokens are compared with `plain`'s with the same sampling (`requests_differing_from_plain`, which
must be 0: see benchmarks/README.md for the one case found where it is not). Reported: generated tok/s over the
wave, decode steps, drafts and accepted drafts, and the proposer's host time per decode step (the suffix
matching is Python on the step's critical path).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.speculative import SuffixProposer  # noqa: E402
from serve.types import SamplingParams  # noqa: E402
from serving import machine_info, prompts_for, trace_bench_start, write_result  # noqa: E402

K = 3


def wave(engine: Engine, prompts, params) -> dict:
    t0 = time.perf_counter()
    c0 = dict(engine.counters)
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    wall = time.perf_counter() - t0
    c = {k: engine.counters[k] - c0[k] for k in engine.counters}
    gen = sum(len(done[r]) for r in rids)
    return dict(wall_s=wall, gen_tok_s=gen / wall, decode_steps=c["decode_steps"],
                drafts=c["spec_decode_num_draft_tokens"], accepted=c["spec_decode_num_accepted_tokens"],
                tokens=[list(done[r]) for r in rids])


def main(argv=None) -> dict:
    args, preset, out, log, t_start = trace_bench_start("suffix_decoding", __doc__, argv)
    model = k3jax.load_model(preset, seed=0)
    waves = (8,) if args.quick else (8, 32)
    spec = dict(method="suffix", num_speculative_tokens=K, adaptive=False, suffix_decoding_max_spec_factor=4.0)
    engine = Engine(model, EngineConfig(max_model_len=512, cache_bytes=(64 if args.quick else 192) << 20,
                                        max_num_seqs=max(waves), prefill_chunk=64, max_prefill_seqs=4,
                                        decode_buckets=waves, prefill_buckets=(4,), context_buckets=(512 // 16,),
                                        enable_prefix_caching=False, measure_moe_time=False,
                                        speculative_config=spec), progress=False)
    log(f"{preset}: engine warm")
    suffix_spec, ngram_spec = engine.spec, dataclasses.replace(engine.spec, method="ngram")
    own = Engine._propose.__get__(engine)
    host = []

    def timed_propose(s, k):
        t0 = time.perf_counter()
        d = own(s, k)
        host.append(time.perf_counter() - t0)
        return d

    results = []
    for c in waves:
        prompts = prompts_for(np.random.default_rng(c), c, 64, 192, min(model.cfg.vocab_size, 256))
        for kind in ("greedy", "sampled"):
            def params(rollout):
                if kind == "greedy":
                    return [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)] * c
                return [SamplingParams(temperature=0.8, seed=1000 * rollout + i, max_tokens=48, ignore_eos=True)
                        for i in range(c)]
            engine.spec, engine.suffix = suffix_spec, None
            engine._propose = lambda s, k: []
            plain = [wave(engine, prompts, params(r)) for r in (0, 1)]
            row = {}
            for mode in ("plain", "ngram", "suffix"):
                engine.spec = ngram_spec if mode == "ngram" else suffix_spec
                engine.suffix = SuffixProposer(suffix_spec) if mode == "suffix" else None
                engine._propose = (lambda s, k: []) if mode == "plain" else timed_propose
                for r in (0, 1):
                    host.clear()
                    res = wave(engine, prompts, params(r))
                    # speculation must not change a token; recorded (not asserted) so a miss is measured and kept
                    res["requests_differing_from_plain"] = sum(a != b for a, b in zip(res["tokens"], plain[r]["tokens"]))
                    name = mode if mode != "suffix" else f"suffix, {('1st', '2nd')[r]} rollout"
                    if mode != "suffix" and r == 0:
                        continue  # (plain / ngram: the second rollout is the one reported, caches warm)
                    res.pop("tokens")
                    res["proposer_ms_per_decode_step"] = 1e3 * sum(host) / max(1, res["decode_steps"])
                    row[name] = res
                    log(f"c={c} {kind:7s} {name:20s} {res['gen_tok_s']:7.1f} tok/s, {res['decode_steps']:3d} decode "
                        f"steps, accepted {res['accepted']}/{res['drafts']}, proposer "
                        f"{res['proposer_ms_per_decode_step']:.2f} ms/step, differing from plain "
                        f"{res['requests_differing_from_plain']}")
            results.append(dict(c=c, sampling=kind, modes=row))
    del engine._propose
    st = engine.stats()
    return write_result(dict(benchmark="suffix_decoding", preset=preset, machine=machine_info(), K=K,
                             speculative_config=spec, waves=results, compiles_after_warmup=st["compiles_after_warmup"]),
                        out, t_start, log)


if __name__ == "__main__":
    main()
