"""Engine.update_weights: new weights of the same model are swapped in without a compile, answer as an
engine built on them does, and nothing cached under the old weights is reused."""

import dataclasses

import numpy as np
import pytest

import k3jax
from serve.engine import Engine, EngineConfig
from serve.types import SamplingParams

CFG = EngineConfig(max_model_len=128, page_size=16, cache_bytes=4 << 20, max_num_seqs=4, prefill_chunk=32,
                   max_prefill_seqs=2, max_num_batched_tokens=128, decode_buckets=(4,), prefill_buckets=(2,),
                   context_buckets=(8,), measure_moe_time=False)
PROMPTS = [np.random.default_rng(i).integers(0, 256, n).tolist() for i, n in ((0, 70), (1, 40))]


def generate(engine, prompts):
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2))
           for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids]


def lps(out):
    return [(c.token_id, c.logprob) for c, _ in out.outputs[0].logprobs]


def test_update_weights_swaps_in_place_and_forgets_the_cache():
    old, new = k3jax.load_model("tiny-k3", seed=0), k3jax.load_model("tiny-k3", seed=5)
    engine = Engine(old, CFG, progress=False)
    before = generate(engine, PROMPTS)
    engine.update_weights(new)
    after = generate(engine, PROMPTS)  # the same prompts: a stale cache hit would answer with old states
    fresh = generate(Engine(new, CFG, progress=False), PROMPTS)
    assert [o.token_ids for o in after] == [o.token_ids for o in fresh] != [o.token_ids for o in before]
    assert [lps(o) for o in after] == [lps(o) for o in fresh]
    assert all(o.num_cached_tokens == 0 for o in after)
    st = engine.stats()
    assert st["compiles_after_warmup"] == 0 and st["weight_updates"] == 1
    engine.update_weights(old)  # and back
    assert [lps(o) for o in generate(engine, PROMPTS)] == [lps(o) for o in before]

    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4))
    engine.step()
    with pytest.raises(RuntimeError, match="in flight"):
        engine.update_weights(new)
    engine.abort(rid)
    other = k3jax.load_model("tiny-k3", seed=0)
    bad = dataclasses.replace(other, cfg=dataclasses.replace(other.cfg, rms_norm_eps=1e-3))
    with pytest.raises(ValueError, match="rms_norm_eps"):
        engine.update_weights(bad)
