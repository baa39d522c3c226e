"""The scan over a model's repeating layers (k3jax/layer_scan.py): the plans found for the presets, the
scanned forward against the unrolled one (cache views, AttnRes and classic residuals, routed experts),
and engines whose step programs scan (both arena paths: in-place KDA decode with gathered MLA, and
layered KDA with the paged MLA kernel) against the unrolled model's full forward, with prefix-cache
resumes, weight updates, sleep, LoRA adapters and speculative verify rows."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import layer_scan
from k3jax.cache import ContiguousView, init_cache
from k3jax.config import get_preset
from k3jax.layer_scan import LayerScan
from k3jax.model import KimiModel
from serve.engine import Engine, EngineConfig, scan_plan
from serve.moe_timing import moe_blocks, moe_input
from serve.speculative import SpeculativeConfig
from serve.types import SamplingParams as SP


def test_plans_of_the_presets():
    k3 = layer_scan.plan(get_preset("k3"))  # AttnRes blocks of 12 = 3 x [KDA, KDA, KDA, MLA]; layer 0 dense
    assert k3 == LayerScan(start=1, period=12, groups=7) and k3.stop == 85 and k3.compiled_layers_saved == 72
    assert layer_scan.plan(get_preset("kimi-linear-48b-a3b")) == LayerScan(1, 4, 6)  # MLA at 3, 7, ..., 23, 26
    assert layer_scan.plan(get_preset("tiny-k3")) == LayerScan(1, 3, 2)
    cfg = get_preset("k3")
    for i in range(12):  # every group has the same layer kinds at each position
        assert len({layer_scan.layer_signature(cfg, l) for l in k3.layers_at(i)}) == 1
    assert layer_scan.cache_strides(cfg, k3) == (9, 3)
    odd = dataclasses.replace(get_preset("tiny-kimi-linear"), num_hidden_layers=3, mla_layers=(1,))
    assert layer_scan.plan(odd) is None  # dense KDA, MoE MLA, MoE KDA: nothing repeats


def test_engine_scan_choice():
    k3, tiny = get_preset("k3"), get_preset("tiny-k3")
    assert scan_plan(EngineConfig(), k3) is None  # off by default (each step pays for it)
    assert scan_plan(EngineConfig(scan_layers=True), k3) == layer_scan.plan(k3)
    assert scan_plan(EngineConfig(scan_layers=True), tiny) == LayerScan(1, 3, 2)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2)  # what the scanned step covers too
    assert scan_plan(EngineConfig(scan_layers=True, max_loras=2, speculative_config=spec), k3) == layer_scan.plan(k3)
    odd = dataclasses.replace(get_preset("tiny-kimi-linear"), num_hidden_layers=3, mla_layers=(1,))
    with pytest.raises(ValueError, match="no group of this model's 3 layers repeats"):
        scan_plan(EngineConfig(scan_layers=True), odd)


def _close(a, b, tol):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.max(np.abs(a - b)) <= tol * max(1.0, float(np.max(np.abs(a)))), np.max(np.abs(a - b))


@pytest.mark.parametrize("name", ["tiny-k3", "tiny-kimi-linear"])  # AttnRes residuals; classic ones
def test_scanned_forward_matches_unrolled(name):
    """Two prefill chunks (ragged) and a decode token through a contiguous cache: logits, the cache, and
    the routed experts of every MoE layer (in layer order) agree."""
    cfg = get_preset(name)
    plan = layer_scan.plan(cfg)
    assert plan is not None
    graph, params = nnx.split(KimiModel(cfg, rngs=nnx.Rngs(3)))
    hollow, stacked = layer_scan.split_params(params, plan)
    assert all(x.shape == () for l in range(plan.start, plan.stop) for x in jax.tree.leaves(hollow["layers"][l]))
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 12)), jnp.int32)

    @jax.jit
    def step(params, stacked, cache, chunk, valid):  # one compile per (shape, form)
        trace = []
        view = ContiguousView(cache)
        scan = None if stacked is None else (plan, stacked)
        logits = nnx.merge(graph, params).run(chunk, view, valid, chunk.shape[1] == 1, trace=trace, scan=scan)
        return logits, view.result(valid), trace

    def run(params, stacked):
        cache, out = init_cache(cfg, 2, 32, jnp.float32), []
        for chunk, valid in ((tokens[:, :6], [6, 4]), (tokens[:, 6:], [6, 6]), (tokens[:, :1], [1, 1])):
            logits, cache, trace = step(params, stacked, cache, chunk, jnp.asarray(valid, jnp.int32))
            out.append((logits, trace))
        return out, cache

    (want, cache_a), (got, cache_b) = run(params, None), run(hollow, stacked)
    for (a, trace_a), (b, trace_b) in zip(want, got):
        _close(a, b, 2e-5)
        assert len(trace_a) == len(trace_b) == sum(cfg.is_moe(l) for l in range(cfg.num_hidden_layers))
        assert all(np.array_equal(x, y) for x, y in zip(trace_a, trace_b))
    for a, b in zip(jax.tree.leaves(cache_a), jax.tree.leaves(cache_b)):
        _close(a, b, 2e-5)


def test_moe_timing_program_runs_the_stacked_blocks():
    cfg = get_preset("tiny-k3")
    plan = layer_scan.plan(cfg)
    graph, params = nnx.split(KimiModel(cfg, rngs=nnx.Rngs(3)))
    x = moe_input(cfg.hidden_size, jnp.float32, 6)
    want = np.asarray(moe_blocks(graph, params, x))
    got = np.asarray(moe_blocks(graph, layer_scan.split_params(params, plan), x, scan=plan))
    moe = [l for l in range(cfg.num_hidden_layers) if cfg.is_moe(l)]
    outside = [k for k, l in enumerate(moe) if not plan.covers(l)]
    inside = [moe.index(l) for g in range(plan.groups) for i in range(plan.period)
              for l in [plan.start + g * plan.period + i] if cfg.is_moe(l)]
    _close(want[outside + inside], got, 1e-5)


# ---- engines whose step programs scan ------------------------------------------------------------
KW = dict(max_model_len=128, cache_bytes=16 << 20, max_num_seqs=4, prefill_chunk=16, max_prefill_seqs=2,
          decode_buckets=(4,), prefill_buckets=(2,), context_buckets=(8,), measure_moe_time=False, max_logprobs=2,
          scan_layers=True)
GREEDY = SP(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
RNG = np.random.default_rng(17)
PROMPTS = [[int(x) for x in RNG.integers(3, 300, n)] for n in (5, 23, 40)]  # one to three prefill chunks


@pytest.fixture(scope="module")
def unrolled():
    from k3jax.runtime import load_model

    return load_model("tiny-k3")


@pytest.fixture(scope="module")
def reference(unrolled):
    """Greedy tokens and their logprobs from the unrolled model's full forward (one compile: right padding
    leaves a causal model's earlier logits as they are)."""
    total = 64
    fn = jax.jit(lambda params, ids: jax.nn.log_softmax(nnx.merge(unrolled.graphdef, params)(ids)[0], -1))

    def run(prompt: list[int], n: int, params=None):
        seq, lps = list(prompt), []
        for _ in range(n):
            ids = np.zeros((1, total), np.int32)
            ids[0, :len(seq)] = seq
            row = np.asarray(fn(params if params is not None else unrolled.params, jnp.asarray(ids)))[0, len(seq) - 1]
            seq.append(int(np.argmax(row)))
            lps.append(float(row[seq[-1]]))
        return seq[len(prompt):], lps
    return run


@pytest.fixture(scope="module", params=[dict(), dict(kda_decode="gathered", mla_decode="paged")],
            ids=["in_place-gathered", "layered-paged"])
def engine(request, unrolled):
    e = Engine(unrolled, EngineConfig(**KW, **request.param), progress=False)
    assert e.layer_scan == LayerScan(1, 3, 2)
    return e


def _generate(e, prompts, params=GREEDY):
    for i, p in enumerate(prompts):
        e.add_request(p, params, request_id=f"q{i}")
    done = {}
    while e.has_unfinished():
        for o in e.step():
            if o.finished:
                done[o.request_id] = o
    return [done[f"q{i}"] for i in range(len(prompts))]


def _arena_back(e) -> bool:
    return e.allocator.free_units + e._cached_units() == e.allocator.baseline_free_units


def _check(outs, prompts, reference, params=None):
    for p, o in zip(prompts, outs):
        tokens, lps = reference(p, GREEDY.max_tokens, params)
        c = o.outputs[0]
        assert c.token_ids == tokens
        _close([lp.chosen.logprob for lp in c.logprobs], lps, 1e-4)


def test_scanning_engine_matches_the_unrolled_forward(engine, reference, unrolled):
    """Prompts of one to three chunks in one batch, then the same prompts again (prefix-cache resumes,
    warm = cold); the engine holds the stacked weights and no per-layer copy of the scanned layers."""
    outs = _generate(engine, PROMPTS)
    _check(outs, PROMPTS, reference)
    again = _generate(engine, PROMPTS)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    assert again[2].num_cached_tokens > 0
    assert engine.compiles_after_warmup == 0
    assert _arena_back(engine)
    params = engine.model.params
    assert all(x.shape == () for x in jax.tree.leaves(params["layers"][1]))
    stacked = engine._step_params()[1]
    assert jax.tree.leaves(stacked[0])[0].shape[0] == 2


def test_update_weights_and_sleep_keep_the_stacked_form(engine, reference, unrolled):
    """New weights (given per layer, as a checkpoint loads them) are stacked for the scan; a level-1 sleep
    brings the stacked weights back."""
    if engine.config.kda_decode == "gathered":
        pytest.skip("one arena path is enough for the weight plumbing")
    from k3jax.runtime import load_model

    new = load_model("tiny-k3", seed=1)
    engine.update_weights(new)
    _check(_generate(engine, PROMPTS[:2]), PROMPTS[:2], reference, new.params)
    engine.sleep(1)
    engine.wake_up()
    _check(_generate(engine, PROMPTS[:1]), PROMPTS[:1], reference, new.params)
    engine.update_weights(unrolled)
    _check(_generate(engine, PROMPTS[1:2]), PROMPTS[1:2], reference)
    assert engine.compiles_after_warmup == 0 and _arena_back(engine)


def test_scan_with_the_arena_codecs_matches_the_unrolled_engine(unrolled):
    """The arena's other storage forms under the scan, in one engine form: KDA states kept in bf16 (the batched
    op rounds per chunk, per rank) with the gathered KDA and paged MLA decode, fp8 latents, and a host tier
    beside a 2 MiB arena (1927 units, a state slot 20 of them: these prompts evict nothing, so the tier runs
    only its warm-up copies, as it did in the fp8 form of its own that this replaces). Scanned and
    unrolled engines give the same tokens, also for resumed prompts.

    (One form, not one per codec: CI time. fp8 latents under the other decode ops, the in-place KDA decode
    and the gathered MLA one: the scan runs the same view code as the unrolled step
    (serve/step.py), which test_kv_cache_dtype.py's fp8 engines check unrolled, and the in_place-gathered
    `engine` above checks under the scan.)"""
    import k3jax

    kw = {**KW, "kda_state_dtype": "bfloat16", "kda_decode": "gathered", "mla_decode": "paged",
          "kv_cache_dtype": "fp8", "host_cache_bytes": 8 << 20, "cache_bytes": 2 << 20, "progress": False}
    runs = {}
    for scan in (False, True):
        llm = k3jax.LLM(unrolled, **{**kw, "scan_layers": scan})
        first = llm.generate(PROMPTS, GREEDY)
        again = llm.generate(PROMPTS[::-1], GREEDY)
        runs[scan] = ([o.token_ids for o in first], [o.token_ids for o in again], [o.num_cached_tokens for o in again],
                      [[lp.chosen.logprob for lp in o.outputs[0].logprobs] for o in first])
        assert llm.stats()["compiles_after_warmup"] == 0 and _arena_back(llm.engine)
    assert runs[True][:3] == runs[False][:3] and sum(runs[True][2]) > 0
    _close(runs[True][3], runs[False][3], 1e-4)


def test_leaf_map_finds_every_layer_weight_in_the_stacked_leaves():
    cfg = get_preset("tiny-k3")
    plan = layer_scan.plan(cfg)
    _, params = nnx.split(KimiModel(cfg, rngs=nnx.Rngs(3)))
    where = layer_scan.leaf_map(params, plan)
    split = jax.tree.leaves(layer_scan.split_params(params, plan))
    for x, (leaf, group) in zip(jax.tree.leaves(params), where):
        np.testing.assert_array_equal(x, split[leaf] if group is None else split[leaf][group])
    groups = [g for _, g in where if g is not None]
    assert set(groups) == {0, 1} and len(groups) == sum(len(jax.tree.leaves(params["layers"][l]))
                                                         for l in range(plan.start, plan.stop))


def _adapter(model, path, seed, modules):
    """A PEFT adapter with random factors on `modules` ((layer, module path) of `model`) -> (its directory,
    `model`'s weights with it merged in: W + alpha / r * B @ A)."""
    import json
    import os

    from safetensors.numpy import save_file

    rng, r, alpha = np.random.default_rng(seed), 4, 8.0
    flat, tensors = dict(nnx.to_flat_state(model.params)), {}
    for layer, module in modules:
        key = ("layers", layer, *module, "weight")
        w = np.asarray(flat[key][...])  # [out, in]
        a, b = rng.normal(0, 0.3, (r, w.shape[1])), rng.normal(0, 0.3, (w.shape[0], r))
        name = f"base_model.model.language_model.model.layers.{layer}.{'.'.join(module)}"
        tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = a.astype(np.float32), b.astype(np.float32)
        flat[key] = flat[key].replace(value=jnp.asarray(w + alpha / r * b @ a, w.dtype))
    os.makedirs(path)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha}, f)
    return str(path), nnx.from_flat_state(list(flat.items()))


@pytest.fixture(scope="module")
def lora_engine(unrolled):
    """A scanned engine with adapter slots on the dense projections and on the routed experts (one A per expert)
    and ngram drafts: test_scanned_engine_serves_adapters_and_drafts and the own-A case of
    test_scanned_engine_serves_expert_adapters share it (one engine's programs compiled, not two; CI time)."""
    return Engine(unrolled, EngineConfig(**KW, max_loras=1, max_lora_rank=4, max_cpu_loras=3,
                                         lora_target_modules=("all-linear", "experts"),
                                         speculative_config={"num_speculative_tokens": 3, "adaptive": False}),
                  progress=False)


def test_scanned_engine_serves_adapters_and_drafts(lora_engine, unrolled, reference, tmp_path, monkeypatch):
    """LoRA and speculative decoding under the scan: two adapters (projections of an unrolled layer and of
    both groups of the scanned run, one group left out by the second) take turns in one slot; each request's
    greedy tokens are those of the unrolled model's full forward with its adapter merged into the weights,
    while its rows are verified against drafts that are right, half right and wrong (the verify step's kept
    tokens folded into the scanned layers' states by the second scan over the groups)."""
    from serve.lora import LoRARequest

    mods = {"x": [(0, ("self_attn", "q_proj")), (1, ("self_attn", "o_proj")), (4, ("self_attn", "o_proj")),
                  (3, ("block_sparse_moe", "shared_experts", "down_proj"))],
            "y": [(2, ("self_attn", "v_proj")), (6, ("block_sparse_moe", "shared_experts", "up_proj"))]}
    adapters = {n: _adapter(unrolled, tmp_path / n, seed, m) for seed, (n, m) in enumerate(mods.items())}
    e = lora_engine
    assert e.layer_scan == LayerScan(1, 3, 2) and any(t.stacked and not t.experts for t in e._lora_leaves)
    for uid, (name, (path, _)) in enumerate(adapters.items(), 1):
        e.add_lora(LoRARequest(name, uid, path))
    jobs = [(p, name) for p in PROMPTS for name in (None, "x", "y")]  # the adapters alternate in the slot
    want = {f"r{i}": reference(p, GREEDY.max_tokens, adapters[name][1] if name else None) for i, (p, name) in enumerate(jobs)}

    def propose(seq, k):  # right for the first prompt, half right for the second, wrong for the third
        n, tokens = len(seq.output_ids), want[seq.request_id][0]
        d = tokens[n:n + k]
        kind = int(seq.request_id[1:]) // 3
        return d if kind == 0 else d[:1] + [t + 1 for t in d[1:]] if kind == 1 else [t + 1 for t in d]

    monkeypatch.setattr(e, "_propose", propose)  # (the engine's own ngram drafts again after this test)
    done = {}
    for wave in (range(len(jobs)), [1]):  # then "x" once more, after "y" took the slot
        for i in wave:
            e.add_request(jobs[i][0], GREEDY, request_id=f"r{i}", lora_request=jobs[i][1])
        while e.has_unfinished():
            done.update({o.request_id: o for o in e.step() if o.finished})
    for rid, (tokens, lps) in want.items():
        c = done[rid].outputs[0]
        assert c.token_ids == tokens, rid
        _close([lp.chosen.logprob for lp in c.logprobs], lps, 1e-3)
    assert len({tuple(t) for t, _ in want.values()}) == len(want)  # each adapter changes every prompt's tokens
    assert 0 < e.counters["spec_decode_num_accepted_tokens"] < e.counters["spec_decode_num_draft_tokens"]
    assert e.counters["lora_swaps"] >= 2 and e.compiles_after_warmup == 0 and _arena_back(e)


def _expert_adapter(dense, path, seed, layers, shared):
    """A per-expert adapter (vLLM / SGLang / miles naming) with random factors on the routed experts' w1, w3
    and w2 of `layers` of `dense` (a model with dense experts) -> (its directory, `dense`'s weights with it
    merged into every expert: W_e + alpha / r * B_e @ A_e). `shared`: one A per matrix, given once."""
    import json
    import os

    from safetensors.numpy import save_file

    rng, r, alpha = np.random.default_rng(seed), 3, 4.0
    flat, tensors = dict(nnx.to_flat_state(dense.params)), {}
    for layer in layers:
        name = f"base_model.model.language_model.model.layers.{layer}.block_sparse_moe.experts"
        for w in ("w1", "w3", "w2"):
            key = ("layers", layer, "block_sparse_moe", w)
            ws = np.asarray(flat[key][...])  # [E, out, in]
            a = rng.normal(0, 0.3, (1 if shared else ws.shape[0], r, ws.shape[2])).astype(np.float32)
            b = rng.normal(0, 0.3, (ws.shape[0], ws.shape[1], r)).astype(np.float32)
            if shared:
                tensors[f"{name}.{w}.lora_A.weight"] = a[0]
            for e in range(ws.shape[0]):
                if not shared:
                    tensors[f"{name}.{e}.{w}.lora_A.weight"] = a[e]
                tensors[f"{name}.{e}.{w}.lora_B.weight"] = b[e]
            delta = np.einsum("eor,eri->eoi", b, np.broadcast_to(a, (ws.shape[0], *a.shape[1:])))
            flat[key] = flat[key].replace(value=jnp.asarray(ws + alpha / r * delta, ws.dtype))
    os.makedirs(path)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha}, f)
    return str(path), nnx.from_flat_state(list(flat.items()))


@pytest.fixture(scope="module")
def dense_reference(unrolled):
    """`unrolled` with its experts dequantized, and greedy tokens and their logprobs from its full forward with
    the given weights (one compile for both cases below)."""
    from k3jax.dequantize import dequantize_experts

    dense = dequantize_experts(unrolled)
    fn = jax.jit(lambda params, ids: jax.nn.log_softmax(nnx.merge(dense.graphdef, params)(ids)[0], -1))

    def reference(prompt, params):
        seq, lps = list(prompt), []
        for _ in range(GREEDY.max_tokens):
            ids = np.zeros((1, 64), np.int32)
            ids[0, :len(seq)] = seq
            row = np.asarray(fn(params, jnp.asarray(ids)))[0, len(seq) - 1]
            seq.append(int(np.argmax(row)))
            lps.append(float(row[seq[-1]]))
        return seq[len(prompt):], lps
    return dense, reference


@pytest.mark.parametrize("shared", [False, True], ids=["own-A", "shared-A"])
def test_scanned_engine_serves_expert_adapters(unrolled, dense_reference, tmp_path, shared, request):
    """Adapters on K3's routed experts (latent MoE, MXFP4 experts) in both groups of the scanned run and in
    the unrolled last layer: each request's greedy tokens and logprobs are those of the unrolled model's full
    forward with the adapter merged into its (dequantized) experts, beside base rows in the same batch.
    Own A per expert: on `lora_engine` (its dense slots unused, its ngram drafts verified as they come; the
    tokens stay the greedy ones); one A for all experts (`lora_experts_shared_a`): an engine of its own with
    expert slots only."""
    from serve.lora import LoRARequest

    dense, reference = dense_reference
    path, merged = _expert_adapter(dense, tmp_path / "experts", 5, (1, 5, 7), shared)
    if shared:
        e = Engine(unrolled, EngineConfig(**KW, max_loras=1, max_lora_rank=4, lora_target_modules=("experts",),
                                          lora_experts_shared_a=True), progress=False)
    else:
        e = request.getfixturevalue("lora_engine")
    assert e.layer_scan == LayerScan(1, 3, 2) and any(t.stacked and t.experts for t in e._lora_leaves)
    e.add_lora(LoRARequest("experts", 9, path))
    jobs = [(p, lr) for p in PROMPTS[:2] for lr in (None, "experts")]
    for i, (p, lr) in enumerate(jobs):
        e.add_request(p, GREEDY, request_id=f"e{i}", lora_request=lr)
    done = {}
    while e.has_unfinished():
        done.update({o.request_id: o for o in e.step() if o.finished})
    for i, (p, lr) in enumerate(jobs):
        tokens, lps = reference(p, merged if lr else dense.params)
        c = done[f"e{i}"].outputs[0]
        assert c.token_ids == tokens, (i, lr)
        _close([lp.chosen.logprob for lp in c.logprobs], lps, 1e-3)
    assert done["e0"].outputs[0].token_ids != done["e1"].outputs[0].token_ids
    assert e.compiles_after_warmup == 0 and _arena_back(e)
