"""The engine on the Pallas kernels (interpret mode on CPU): the accelerator's whole path, end to end.

With `K3JAX_KERNELS=interpret` every dispatcher resolves to its Pallas kernel, so the engine takes the
settings it takes on a GPU/TPU: chunked KDA prefill and fused KDA decode kernels on gathered states,
MXFP4 experts kept packed for the grouped matmul, projections as stored, and MLA decode through the
paged kernel over the arena. Its greedy tokens must be the model's own (the reference kernels' full
forward over each prompt and its tokens: the model is causal), including for requests that resume from
the prefix cache (a KDA checkpoint read as initial state).

(CI time: the reference is one forward program per model, not a second engine's prefill and decode programs;
the CPU defaults' engine is built without warm-up, for its forms and its prefix-cache hits, which are host
logic: `PROMPTS` and `AGAIN` are cached as `CACHED` says whatever the kernels.)
"""

import numpy as np
import pytest

import k3jax
from serve.engine import Engine, EngineConfig
from serve.types import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [7] * 3, list(range(100, 140))]
AGAIN = [list(range(10, 47)) + [3, 1, 4], list(range(100, 136)) + [9] * 5]  # reuse the first wave's prefixes
CACHED = [32, 32]  # AGAIN's tokens read from the prefix cache: the whole 16-token units they share with PROMPTS
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CONFIG = dict(max_model_len=96, page_size=16, cache_bytes=8 << 20, max_num_seqs=4, prefill_chunk=16,
              max_prefill_seqs=2, decode_buckets=(4,), prefill_buckets=(2,), context_buckets=(6,),
              measure_moe_time=False)


def serve(engine, prompts):
    rids = [engine.add_request(p, GREEDY) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return [done[r] for r in rids]


def forward_greedy(model, prompts, outputs) -> list[list[int]]:
    """Each position's greedy token after each prompt and the output tokens before it: one teacher-forced forward
    of every row at once (right-padded: the model is causal, and rows never mix)."""
    seqs = [p + o for p, o in zip(prompts, outputs, strict=True)]
    ids = np.zeros((len(seqs), max(map(len, seqs))), np.int32)  # [B, T]
    for row, seq in zip(ids, seqs):
        row[:len(seq)] = seq
    logits = model.forward(ids)  # [B, T, V]
    return [logits[i, len(p) - 1:len(p) + len(o) - 1].argmax(-1).tolist()
            for i, (p, o) in enumerate(zip(prompts, outputs))]


@pytest.fixture(scope="module", params=["tiny-k3", "tiny-kimi-linear"])
def runs(request, monkeypatch_module):
    """Each model served on the Pallas kernels (interpret), then its greedy tokens by the reference kernels'
    forward; the CPU defaults' engine (reference kernels) built, not warmed up."""
    model = k3jax.load_model(request.param, seed=4)
    monkeypatch_module.setenv("K3JAX_KERNELS", "reference")
    ref = Engine(model, EngineConfig(**CONFIG), warmup=False, progress=False).stats()
    monkeypatch_module.setenv("K3JAX_KERNELS", "interpret")
    eng = Engine(model, EngineConfig(**CONFIG), progress=False)
    first, again = serve(eng, PROMPTS), serve(eng, AGAIN)
    s = eng.stats()
    tokens = [o.token_ids for o in first + again]
    monkeypatch_module.setenv("K3JAX_KERNELS", "reference")  # (read when the forward is traced)
    want = forward_greedy(model, PROMPTS + AGAIN, tokens)
    monkeypatch_module.delenv("K3JAX_KERNELS")
    pal = dict(tokens=tokens, cached=[o.num_cached_tokens for o in again], forms=s["decode_forms"],
               experts=s["expert_format"], compiles=s["compiles_after_warmup"],
               leaked=s["arena_free_units"] + s["arena_cached_units"] - s["arena_baseline_free_units"])
    return model, ref, pal, want


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_pallas_engine_matches_the_reference(runs):
    model, ref, pal, want = runs
    assert ref["decode_forms"] == {"kda": "in_place", "mla": "gathered"}  # CPU defaults
    assert pal["forms"] == {"kda": "gathered", "mla": "paged"}  # the accelerator's forms
    assert pal["experts"] == model.cfg.expert_format  # MXFP4 stays packed for the grouped matmul
    assert pal["tokens"] == want
    assert pal["cached"] == CACHED
    assert pal["compiles"] == 0 and pal["leaked"] == 0
