"""Probe: does speculative decoding give plain decoding's outputs when a few rows' drafts are all rejected?

    python benchmarks/spec_exactness_probe.py [--model k3-small] [-c 24]   # ~1.5 min on the 2-core host

Found with benchmarks/suffix_decoding.py (benchmarks/README.md, "Suffix decoding on rollouts"): on k3-small with
24-32 requests, drafts that are always wrong given to every 5th request on every 4th output make a request that
never drafts get other logits (logprob off by up to 0.13; at c = 32 one greedy token flips), while the other
modes agree to ~3e-5 (`--mode`: `rare_wrong`; `rare_right`, `all_wrong`, `plain_again`). The cause: the verify
program sums a row's products in another order than the decode program, and at a MoE router near-tie that
rounding picks another expert (the routed experts of that position differ). Prints, per mode, the requests
whose tokens differ from plain decoding and the largest logprob difference on equal tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.types import SamplingParams  # noqa: E402
from serving import prompts_for  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="k3-small")
    ap.add_argument("-c", type=int, default=24)
    ap.add_argument("--mode", action="append", default=None)
    args = ap.parse_args(argv)
    modes = args.mode or ["plain_again", "rare_right", "all_wrong", "rare_wrong"]
    model = k3jax.load_model(args.model, seed=0)
    eng = Engine(model, EngineConfig(max_model_len=512, cache_bytes=192 << 20, max_num_seqs=32, prefill_chunk=64,
                                     max_prefill_seqs=4, decode_buckets=(8, 32), prefill_buckets=(4,),
                                     context_buckets=(32,), enable_prefix_caching=False, measure_moe_time=False,
                                     speculative_config=dict(method="ngram", num_speculative_tokens=3,
                                                             adaptive=False)), progress=False)
    c = args.c
    prompts = prompts_for(np.random.default_rng(c), c, 64, 192, min(model.cfg.vocab_size, 256))
    params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=1)] * c

    def wave():
        rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o.outputs[0] for o in eng.step() if o.finished})
        return [done[r] for r in rids]

    eng._propose = lambda s, k: []
    plain = wave()
    want = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    for mode in modes:
        def propose(s, k, mode=mode):
            i = prompts.index(list(s.prompt_ids))
            if mode == "plain_again" or (mode.startswith("rare") and not (i % 5 == 0 and len(s.output_ids) % 4 == 1)):
                return []
            d = list(want[tuple(s.prompt_ids)][len(s.output_ids):][:k])
            return d if mode == "rare_right" else [(x + 1) % 200 for x in d]
        eng._propose = propose
        outs = wave()
        differ = [i for i, (o, p) in enumerate(zip(outs, plain)) if o.token_ids != p.token_ids]
        lp = max(abs(a.chosen.logprob - b.chosen.logprob) for o, p in zip(outs, plain)
                 for a, b in zip(o.logprobs, p.logprobs) if a.chosen.token_id == b.chosen.token_id)
        print(f"{args.model} c={c} {mode:12s} requests differing {differ}  max |logprob diff| {lp:.2e}", flush=True)


if __name__ == "__main__":
    main()
