"""The engine on the Pallas kernels (interpret mode on CPU): the accelerator's whole path, end to end.

With `K3JAX_KERNELS=interpret` every dispatcher resolves to its Pallas kernel, so the engine takes the
settings it takes on a GPU/TPU: chunked KDA prefill and fused KDA decode kernels on gathered states,
MXFP4 experts kept packed for the grouped matmul, projections as stored, and MLA decode through the
paged kernel over the arena. Its greedy tokens must equal the reference engine's (the CPU defaults),
including for requests that resume from the prefix cache (a KDA checkpoint read as initial state).
"""

import pytest

import k3jax
from serve.engine import Engine, EngineConfig
from serve.types import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [7] * 3, list(range(100, 140))]
AGAIN = [list(range(10, 47)) + [3, 1, 4], list(range(100, 136)) + [9] * 5]  # reuse the first wave's prefixes
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def serve(engine, prompts):
    rids = [engine.add_request(p, GREEDY) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return [done[r] for r in rids]


@pytest.fixture(scope="module", params=["tiny-k3", "tiny-kimi-linear"])
def runs(request, monkeypatch_module):
    """Each model served twice on the same prompts: reference kernels, then Pallas (interpret)."""
    model = k3jax.load_model(request.param, seed=4)
    kw = dict(max_model_len=96, page_size=16, cache_bytes=8 << 20, max_num_seqs=4, prefill_chunk=16,
              max_prefill_seqs=2, decode_buckets=(4,), prefill_buckets=(2,), context_buckets=(6,),
              measure_moe_time=False)
    out = {}
    for kernels in ("reference", "interpret"):
        monkeypatch_module.setenv("K3JAX_KERNELS", kernels)
        eng = Engine(model, EngineConfig(**kw), progress=False)
        first, again = serve(eng, PROMPTS), serve(eng, AGAIN)
        s = eng.stats()
        out[kernels] = dict(tokens=[o.token_ids for o in first + again], cached=[o.num_cached_tokens for o in again],
                            forms=s["decode_forms"], experts=s["expert_format"],
                            compiles=s["compiles_after_warmup"],
                            leaked=s["arena_free_units"] + s["arena_cached_units"] - s["arena_baseline_free_units"])
    monkeypatch_module.delenv("K3JAX_KERNELS")
    return model, out


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_pallas_engine_matches_the_reference_engine(runs):
    model, out = runs
    ref, pal = out["reference"], out["interpret"]
    assert ref["forms"] == {"kda": "in_place", "mla": "gathered"}  # CPU defaults
    assert pal["forms"] == {"kda": "gathered", "mla": "paged"}  # the accelerator's forms
    assert pal["experts"] == model.cfg.expert_format  # MXFP4 stays packed for the grouped matmul
    assert pal["tokens"] == ref["tokens"]
    assert pal["cached"] == ref["cached"] and all(c > 0 for c in pal["cached"])
    assert pal["compiles"] == ref["compiles"] == 0 and pal["leaked"] == ref["leaked"] == 0
