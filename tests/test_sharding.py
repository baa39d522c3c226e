"""Device meshes from sharding_configs/ and the engine on a mesh of simulated CPU devices."""
import json
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax.runtime import load_model
from k3jax.sharding import (CONFIG_DIR, load_sharding_config, make_mesh, moe_exchange_bytes, parse_sharding_config,
                            plan_param_specs, shard_params, spec_for, state_axis)
from k3jax.weight_layout import transpose_dense_weights
from serve.engine import EngineConfig

TP = {"mesh": {"tensor": -1}, "rules": {"heads": "tensor", "mlp": "tensor", "vocab": "tensor", "experts": "tensor"}}


def test_shipped_configs_load():
    names = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml"))
    assert {"single", "tp", "tp_ep", "ep"} <= set(names)
    for n in names:
        cfg = load_sharding_config(n)
        assert cfg.name == n and cfg.mesh_axes
    tp_ep = load_sharding_config("tp_ep")
    assert tp_ep.mesh_shape(8) == {"expert": 2, "tensor": 4}
    assert tp_ep.rule("experts") == ("expert", "tensor") and tp_ep.rule("heads") == "tensor"
    assert tp_ep.rule("kv_latent") is None
    assert load_sharding_config(os.path.join(CONFIG_DIR, "tp.yaml")).mesh_shape(3) == {"tensor": 3}


@pytest.mark.parametrize("data,match", [
    ({"rules": {}}, "'mesh'"),
    ({"mesh": {"tensor": -1}, "rulez": {}}, "'mesh' and 'rules'"),
    ({"mesh": {"tensor": 0}}, r"mesh.tensor: size"),
    ({"mesh": {"a": -1, "b": -1}}, "at most one"),
    ({"mesh": {"tensor": -1}, "rules": {"head": "tensor"}}, "rules.head: unknown logical axis"),
    ({"mesh": {"tensor": -1}, "rules": {"heads": "model"}}, "rules.heads: 'model' is not a mesh axis"),
    ({"mesh": {"tensor": -1}, "rules": {"experts": ["tensor", "expert"]}}, "rules.experts: 'expert' is not a mesh"),
    ({"mesh": {"tensor": -1}, "rules": {"experts": []}}, "rules.experts: a list of mesh axes must be non-empty"),
    ({"mesh": {"tensor": -1}, "rules": {"heads": {"tensor": 2}}}, r"rules.heads: \{'tensor': 2\} is not a mesh axis"),
    ({"mesh": {"expert": 2, "tensor": -1}, "rules": {"experts": [["expert", "tensor"]]}},
     r"rules.experts: \['expert', 'tensor'\] is not a mesh axis"),
])
def test_bad_configs_name_the_key(data, match):
    with pytest.raises(ValueError, match=match):
        parse_sharding_config(data, "bad")


def test_mesh_sizes_must_fit_the_devices():
    cfg = parse_sharding_config({"mesh": {"expert": 2, "tensor": -1}})
    with pytest.raises(ValueError, match="not a multiple of 2"):
        cfg.mesh_shape(3)
    with pytest.raises(ValueError, match="needs 4 devices, 1 are available"):
        parse_sharding_config({"mesh": {"tensor": 4}}).mesh_shape(1)
    mesh = make_mesh(load_sharding_config("single"))
    assert dict(mesh.shape) == {"tensor": 1}
    with pytest.raises(ValueError, match="no config 'nope'"):
        load_sharding_config("nope")
    with pytest.raises(ValueError, match="no config 'nope'"):
        EngineConfig(sharding="nope").validate()


def test_a_config_file_that_is_not_yaml_is_refused_naming_it(tmp_path):
    """A YAML syntax error was yaml's ParserError (not a ValueError: `k3jax serve --sharding` printed a traceback)."""
    path = tmp_path / "mine.yaml"
    path.write_text("mesh: {tensor: -1\n")
    with pytest.raises(ValueError, match="sharding: .*mine.yaml is not valid YAML"):
        EngineConfig(sharding=str(path)).validate()


def test_spec_for_rules_divisibility_and_one_dim_per_axis():
    cfg = parse_sharding_config(TP)
    assert spec_for(("heads", "embed"), (96, 64), cfg, {"tensor": 4}) == (P("tensor"), [])
    assert spec_for(("embed", "mlp"), (64, 128), cfg, {"tensor": 4}) == (P(None, "tensor"), [])
    spec, why = spec_for(("heads", "embed"), (6, 64), cfg, {"tensor": 4})
    assert spec == P() and "not divisible" in why[0]
    spec, why = spec_for(("experts", "mlp", None), (8, 32, 16), cfg, {"tensor": 4})
    assert spec == P("tensor") and "already shards" in why[0]
    assert spec_for(("heads", "embed"), (96, 64), cfg, {"tensor": 1}) == (P(), [])  # a one-wide axis shards nothing
    two = parse_sharding_config({"mesh": {"expert": 2, "tensor": -1},
                                 "rules": {"experts": ["expert", "tensor"], "expert_mlp": "tensor", "heads": "tensor"}})
    sizes = {"expert": 2, "tensor": 4}
    assert spec_for(("experts", "expert_mlp", None), (16, 32, 8), two, sizes)[0] == P(("expert", "tensor"))
    spec, why = spec_for(("experts", "expert_mlp", None), (12, 32, 8), two, sizes)  # 12 % 8: experts stay whole
    assert spec == P(None, "tensor") and "not divisible by ('expert', 'tensor')=8" in why[0]


def test_state_axis_splits_kda_heads_only_when_it_divides_them():
    cfg = parse_sharding_config(TP)
    assert state_axis(cfg, {"tensor": 4}, 96) == "tensor"
    assert state_axis(cfg, {"tensor": 4}, 6) is None  # 6 heads over 4 ranks: slots stay replicated
    assert state_axis(cfg, {"tensor": 1}, 96) is None and state_axis(cfg, {"tensor": 4}, 0) is None
    ep = parse_sharding_config({"mesh": {"expert": -1}, "rules": {"experts": "expert"}})
    assert state_axis(ep, {"expert": 4}, 96) is None  # heads not split: the arena is replicated


def test_param_specs_follow_logical_axes_and_transposition():
    """Each parameter's spec comes from its own logical axes, so the engine's transposed ([in, out])
    weights are split on the same logical dimension as the checkpoint layout."""
    model = load_model("tiny-k3", dtype="float32")
    cfg = parse_sharding_config(TP)
    specs, notes = plan_param_specs(model.params, cfg, {"tensor": 4})
    t_specs, _ = plan_param_specs(transpose_dense_weights(model).params, cfg, {"tensor": 4})
    flat = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda x: isinstance(x, P))[0]}
    t_flat = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_flatten_with_path(
        t_specs, is_leaf=lambda x: isinstance(x, P))[0]}
    embed = next(k for k in flat if k.startswith("['embed_tokens']"))
    assert flat[embed] == P("tensor")  # [vocab, embed]
    o_proj = next(k for k in flat if "self_attn']['o_proj']['weight']" in k)
    assert flat[o_proj] == P(None, "tensor") and t_flat[o_proj] == P("tensor")  # [embed, heads] -> [heads, embed]
    gate = next(k for k in flat if "['mlp']['gate_proj']['weight']" in k)
    assert flat[gate] == P("tensor") and t_flat[gate] == P(None, "tensor")
    assert sum(s != P() for s in flat.values()) > len(flat) // 3
    assert notes == {}  # tiny-k3's sizes all divide by 4


def test_shard_params_places_new_variables_without_deprecated_flax_calls():
    """Every parameter comes back as a new Variable on the mesh (the source's arrays stay where they were),
    through no API flax deprecates (`Variable.value`'s setter: one warning per parameter on every engine
    built with `sharding=`, and gone in a later flax)."""
    model = load_model("tiny-k3", dtype="float32")
    cfg = load_sharding_config("tp")
    mesh = make_mesh(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        placed, _ = shard_params(model.params, mesh, cfg)
    is_var = lambda x: isinstance(x, nnx.Variable)
    before, after = jax.tree.leaves(model.params, is_leaf=is_var), jax.tree.leaves(placed, is_leaf=is_var)
    assert len(after) == len(before) and all(a is not b for a, b in zip(after, before))
    assert all(isinstance(v[...].sharding, NamedSharding) and v[...].sharding.mesh == mesh for v in after)
    assert not any(isinstance(v[...].sharding, NamedSharding) for v in before)
    assert all(a.get_metadata() == b.get_metadata() for a, b in zip(after, before))  # logical axes kept


_MULTI = textwrap.dedent("""
    import dataclasses, json, os, sys
    import jax, numpy as np
    import k3jax
    from k3jax import SamplingParams
    assert len(jax.devices()) == 4, jax.devices()
    prompts = [[1, 2, 3, 4, 5], list(range(10, 47)), [7] * 3, list(range(100, 120))]
    sps = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2),
           SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2),
           SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True, logprobs=2),
           SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=2)]
    kw = dict(max_model_len=64, cache_bytes=8 << 20, max_num_seqs=4, prefill_chunk=16, max_prefill_seqs=2,
              decode_buckets=(4,), prefill_buckets=(2,), context_buckets=(4,), measure_moe_time=False,
              progress=False)
    out = {}

    def named_weights(llm, model, write):
        # weights by checkpoint name on a mesh: every 5th tensor read back as the checkpoint has it (experts
        # that the CPU engine holds expanded, dense); `write`: other weights pushed by name read back, then the
        # originals pushed back (the generations that follow check that they landed where they were)
        from k3jax.checkpoint import hf_tensors
        from pallas_kernels.moe.mxfp4 import dequantize_mxfp4
        mism = []

        def check(m):
            ts = dict(hf_tensors(m.cfg, m.params))
            for name in sorted(ts)[::5]:
                want = ts[name]
                if name.endswith("weight_scale") and llm.engine._expanded_group:
                    continue
                if name.endswith("weight_packed") and llm.engine._expanded_group:
                    want = np.asarray(dequantize_mxfp4(want, ts[name.replace("packed", "scale")]))
                    name = name.replace("weight_packed", "weight")
                got = llm.get_weights_by_name(name, None)
                if got.shape != want.shape or not np.array_equal(got, want):
                    mism.append(name)
        base = k3jax.load_model(model, seed=0)
        check(base)
        if write:
            other = k3jax.load_model(model, seed=1)
            llm.update_weights_from_tensor(list(hf_tensors(other.cfg, other.params)))
            check(other)
            llm.update_weights_from_tensor(list(hf_tensors(base.cfg, base.params)))
        return mism

    for model in sys.argv[1:]:
        # tiny-kimi-linear: tensor-parallel (its experts split over the 4 devices too); expert parallelism alone,
        # the mesh forms' mix and the accelerator's decode forms are the same code, run on tiny-k3 (CI time)
        forms = (((None, "gathered"), ("tp", "gathered"), ("tp_ep", "gathered"), ("ep", "gathered"),
                  ("tp", "dcp_paged"), ("ep", "eplb_scan"), ("tp", "scan_paged"), ("tp", "scan_dcp"))
                 if model == "tiny-k3" else ((None, "gathered"), ("tp", "gathered")))
        for sh, mla in forms:
            # "paged": the accelerator's decode forms (paged MLA kernel, batched KDA op on gathered states); "dcp":
            # decode context parallelism (the MLA pages split by position over the 4 ranks too); "scan": the layers'
            # repeating group scanned over (k3jax/layer_scan.py). Each tensor-parallel form mixes two of them, so
            # that every branch of serve/step.py's arena code runs on the heads-split arena with 3 engines
            # (compiles: CI time) where 6 ran every pair: "scan_paged" (the paged kernel per rank on its query
            # heads; prefill's gathered MLA and the batched KDA op writing back layer by layer), "dcp_paged"
            # (unscanned: prefill's context-parallel shares kept for the step's end, decode through the kernel's
            # log-sum-exp), "scan_dcp" (the CPU's decode forms: a one-token decode through the context-parallel
            # shares too, written back layer by layer; the in-place KDA states under the scan)
            kda = "gathered" if mla.endswith("paged") else "auto"
            dcp = 4 if "dcp" in mla else 1
            # "eplb_scan": expert-parallel load balancing, re-placing the experts every 3 steps while generating,
            # with 4 redundant experts (12 stacked, 3 per rank), under async scheduling (a step is in flight, on the
            # experts' old places, whenever the counts read back call for a move), the layers scanned (a move
            # gathers the stacked experts of every moved group at once)
            eplb = (dict(enable_eplb=True, eplb_window_size=6, eplb_step_interval=3, eplb_num_redundant_experts=4,
                         async_scheduling=True) if mla.startswith("eplb") else {})
            llm = k3jax.LLM(model, sharding=sh, mla_decode="paged" if mla.endswith("paged") else "gathered",
                            kda_decode=kda, decode_context_parallel_size=dcp, **eplb, **kw,
                            scan_layers="scan" in mla)
            eng = llm.engine
            weights_mismatched = named_weights(llm, model, write=sh == "tp_ep" or mla == "eplb_scan")
            res = llm.generate(prompts, sps)
            # stale words in every free unit (a finite float32 word, NaN as bf16 or fp8): masked slots must not read them
            free = np.flatnonzero(eng.allocator.owner == eng.allocator.FREE)
            stale = eng.arena.at[free].set(np.uint32(0x3F807FC0).view(np.float32))
            eng.arena = stale if eng.mesh is None else jax.device_put(stale, eng.arena.sharding)
            # reuse: prompts extending an earlier one resume from its KDA checkpoints and shared pages
            again = llm.generate([list(range(10, 47)) + [3, 1, 4], list(range(10, 43)) + [9] * 9], sps[:2])
            if eplb:  # and once more on demand, then the same prompts again
                eplb_summary = eng.rebalance_experts()
                res_after = llm.generate(prompts, sps)
            st = llm.stats()
            leaves = [x for x in jax.tree.leaves(eng._step_params()) if x.ndim]  # (a layer scan's 0-d placeholders out)
            split = [x for x in leaves if x.addressable_shards[0].data.shape != x.shape]
            # compiled decode and prefill programs: one rank's arena is never copied or communicated
            local = "f32[%d,%d]" % (eng.layout.num_units, eng.layout.unit_elems)
            arena_ops = bad = 0
            gathers = []  # result shapes of the all-gathers (dcp: none may rebuild a whole context)
            # all MLA decode forms, on tiny-k3 (the arena's reads and writes are the same code for both models)
            for rows, t in (((4, 1), (2, 16)) if sh == "tp" and model == "tiny-k3" else ()):
                hlo = eng.lower_step(eng._pad_batch(rows, t, 4, [])).compile().as_text()
                made = [l.split(" = ", 1)[1] for l in hlo.splitlines() if " = " in l]
                ops = [m.split("(")[0].split()[-1] for m in made if m.startswith(local)]
                arena_ops += len(ops)
                bad += sum(o in ("copy", "all-gather", "all-reduce", "collective-permute", "all-to-all") for o in ops)
                gathers += [m.split("{")[0] for m in made if " all-gather" in m.split("(")[0]]
            out[f"{model}/{sh}" + ("" if mla == "gathered" else "/" + mla)] = dict(
                tokens=[r.token_ids for r in res], again=[r.token_ids for r in again],
                cached=[r.num_cached_tokens for r in again], arena_ops=arena_ops, arena_bad_ops=bad,
                state_ranks=st["arena_state_ranks"], slot_units=eng.layout.slot_units,
                arena_spec=str(getattr(eng.arena.sharding, "spec", "")), arena_local=list(eng.arena.addressable_shards[0].data.shape),
                unit=[eng.layout.num_units, eng.layout.unit_elems], gathers=gathers,
                context_ranks=st["arena_context_ranks"], mla_form=st["decode_forms"]["mla"], scan=str(eng.layer_scan),
                span=4 * eng.layout.page_size, seqs_at_max_len=eng.layout.sequences_at(64),
                eplb=dict(st["eplb"], summary=eplb_summary, placement=eng.eplb.placement.tolist(),
                          ahead=eng.counters["steps_launched_ahead"],
                          tokens_after=[r.token_ids for r in res_after],
                          logprobs_after=[[lp.chosen.logprob for lp in r.outputs[0].logprobs] for r in res_after])
                if eplb else None,
                logprobs=[[lp.chosen.logprob for lp in r.outputs[0].logprobs] for r in res],
                mesh=st["mesh"], compiles=st["compiles_after_warmup"], split=len(split), leaves=len(leaves),
                weights_mismatched=weights_mismatched,
                devices=sorted(d.id for d in eng.arena.sharding.device_set),
                arena_replicated=eng.arena.sharding.is_fully_replicated,
                free=st["arena_free_units"] + st["arena_cached_units"], baseline=st["arena_baseline_free_units"],
                exchange=st["inter_rank_bytes"],
                expert_parallel=[getattr(m, "expert_parallel", None) is not None for _, m in
                                 __import__("flax").nnx.iter_graph(__import__("flax").nnx.merge(
                                     eng.model.graphdef, eng.model.params)) if type(m).__name__ == "MoE"])
    try:  # 8 experts + 3 copies do not split over the 4 expert ranks: refused before anything is placed
        k3jax.LLM("tiny-k3", sharding="ep", enable_eplb=True, eplb_num_redundant_experts=3, **kw)
    except ValueError as e:
        out["uneven_copies_error"] = str(e)
""")

# Engines on disjoint device groups, after the meshes above in the same process (its reference engine,
# "tiny-k3/None", has the same options): data-parallel replicas (serve/data_parallel.py) generating and
# serving HTTP, and a prefill / decode pair (serve/disaggregated.py) serving HTTP. Checked by
# tests below; the router, stats and options have unit tests in tests/test_device_groups.py.
_GROUPS = textwrap.dedent("""
    import asyncio
    import httpx
    from serve.api import create_app
    from serve.data_parallel import DataParallelAsyncEngine, build_replicas
    from serve.disaggregated import DisaggregatedAsyncEngine, build_pair
    from serve.engine import EngineConfig

    later = [list(range(10, 47)) + [3, 1, 4], list(range(10, 43)) + [9] * 9]
    greedy = [(p, sp) for p, sp in zip(prompts, sps) if sp.temperature == 0]
    cfg = EngineConfig(**{k: v for k, v in kw.items() if k != "progress"})

    async def complete(c, prompt, max_tokens):
        r = await c.post("/v1/completions", json=dict(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                      ignore_eos=True, return_token_ids=True))
        return r.json()["choices"][0]["token_ids"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def leave_after_one_token(engine, rid):  # a consumer that goes away: the request is aborted
        gen = engine.generate(list(range(1, 30)), SamplingParams(max_tokens=30, ignore_eos=True), rid)
        await gen.__anext__()
        await gen.aclose()
        await asyncio.sleep(0.5)

    async def abort_while_reading(engine, rid):  # an explicit abort: the reader's stream ends, "abort"
        last = None
        async for last in engine.generate(list(range(2, 31)), SamplingParams(max_tokens=30, ignore_eos=True), rid):
            engine.abort(rid)
        return last.outputs[0].finish_reason

    async def abort_in_prefill(engine, rid):  # aborted before the prefill engine hands it over
        gen = engine.generate(list(range(3, 32)), SamplingParams(max_tokens=30, ignore_eos=True), rid)
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)  # the request is on the prefill engine now
        engine.abort(rid)
        last = await asyncio.wait_for(first, 60)
        rest = [o async for o in gen]
        return last.outputs[0].finish_reason, len(rest), len(last.outputs[0].token_ids)

    # data-parallel: two one-device replicas on devices 1 and 0, generating (each compiles its own programs: a
    # replica's are one-device-mesh programs, not the unsharded engine's, and XLA:CPU's are keyed by device)
    dp = k3jax.LLM("tiny-k3", data_parallel_size=2, devices=(1, 0), **kw)
    res = dp.generate(prompts, sps)
    again = dp.generate(later, sps[:2])
    st = dp.stats()
    out["dp"] = dict(tokens=[r.token_ids for r in res], again=[r.token_ids for r in again],
                     cached=[r.num_cached_tokens for r in again], replicas=st["replicas"],
                     router=st["data_parallel_router"], compiles=st["compiles_after_warmup"],
                     free=st["arena_free_units"] + st["arena_cached_units"], baseline=st["arena_baseline_free_units"],
                     running=st["num_requests_running"],
                     arena=[sorted(d.id for d in e.arena.sharding.device_set) for e in dp.engine.replicas],
                     params=[sorted({d.id for x in jax.tree.leaves(e.model.params) for d in x.sharding.device_set})
                             for e in dp.engine.replicas])
    out["dp"]["weights"] = [np.asarray(w).tolist() for w in dp.get_weights_by_name(
        "language_model.model.layers.0.self_attn.q_proj.weight", 2)]
    # replicas of a 2-way tensor mesh each: placed (built, not compiled: CI time)
    engines, groups = build_replicas(dp.model, dataclasses.replace(cfg, sharding="tp"), 2, warmup=False)
    out["dp_tp"] = dict(groups=[list(g) for g in groups], mesh=[dict(e.mesh.shape) for e in engines],
                        arena=[sorted(d.id for d in e.arena.sharding.device_set) for e in engines])
    del engines

    # the HTTP server over the replicas, each stepped by its own thread
    aeng = DataParallelAsyncEngine(dp.engine.replicas, dp.engine.devices)
    app = create_app(None, "m", max_model_len=64)
    app.state.k3.attach(aeng)

    async def serve_dp():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            health = (await c.get("/health")).status_code
            got = await asyncio.gather(*(complete(c, p, sp.max_tokens) for p, sp in greedy))
            follow = await complete(c, later[0], 8)  # extends prompt 1: goes where that prompt went
            await leave_after_one_token(aeng, "long")
            ended = await asyncio.wait_for(abort_while_reading(aeng, "read"), 60)
            metrics = (await c.get("/metrics")).text
            reset = (await c.post("/reset_prefix_cache")).json()
            return health, [t for t, _ in got] + [follow[0]], follow[1], metrics, reset, ended
    health, tokens, hit, metrics, reset, ended = asyncio.run(serve_dp())
    st = aeng.stats()
    out["dp_http"] = dict(health=health, tokens=tokens, hit=hit, reset=reset, capacity=app.state.k3.capacity, ended=ended,
                          free=st["arena_free_units"], baseline=st["arena_baseline_free_units"],
                          running=st["num_requests_running"], waiting=st["num_requests_waiting"],
                          cached=st["arena_cached_units"], aborted=st["requests_aborted"],
                          metric=[l for l in metrics.splitlines() if l.startswith((
                              "vllm:generation_tokens_total", "k3jax:replica_requests_running",
                              "k3jax:data_parallel_routed_total", "vllm:time_to_first_token_seconds_count"))])
    aeng.shutdown()

    # disaggregated prefill: a prefill engine on device 0 hands prompts to a decode engine on device 1 (programs
    # the replicas compiled)
    pre, dec = build_pair(dp.model, cfg, (0,), (1,), 64 << 20)
    pd = DisaggregatedAsyncEngine(pre, dec)
    app = create_app(None, "m", max_model_len=64)
    app.state.k3.attach(pd)

    async def serve_pd():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            got = await asyncio.gather(*(complete(c, p, sp.max_tokens) for p, sp in greedy))
            await leave_after_one_token(pd, "long")
            ended = [await asyncio.wait_for(abort_while_reading(pd, "read"), 60), await abort_in_prefill(pd, "early")]
            await asyncio.sleep(0.3)
            return got, ended
    got, ended = asyncio.run(serve_pd())
    st = pd.stats()
    out["pd"] = dict(tokens=[t for t, _ in got], hits=[h for _, h in got], prefill=st["prefill_engine"], ended=ended,
                     compiles=st["compiles_after_warmup"], running=st["num_requests_running"],
                     free=st["arena_free_units"] + st["arena_cached_units"], baseline=st["arena_baseline_free_units"],
                     aborted=st["requests_aborted"], host_hits=st["prefix_cache"].get("host_hits", 0),
                     devices=[sorted(d.id for d in e.arena.sharding.device_set) for e in (pre, dec)])
    pd.shutdown()
""")


@pytest.fixture(scope="module")
def multi_device():
    """Both test models served unsharded, tensor-parallel and expert-parallel on 4 simulated CPU devices,
    tiny-k3 also TP x EP and with the accelerator's decode forms, then tiny-k3 as data-parallel replicas
    and as a disaggregated prefill / decode pair (a fresh process: the device count is fixed when JAX
    starts)."""
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = _MULTI + _GROUPS + '\nprint("RESULT" + json.dumps(out))\n'
    proc = subprocess.run([sys.executable, "-c", script, "tiny-k3", "tiny-kimi-linear"], env=env, cwd=root,
                          capture_output=True, text=True, timeout=1500)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[0][len("RESULT"):])


# Weights read straight into their shards (k3jax.load_model(..., sharding=...)): tiny-k3 written as a sharded
# HF directory (MXFP4 experts, padded A_log) and as Orbax, loaded whole and onto a 4-device mesh.
_LOADS = textwrap.dedent("""
    import json, sys, tempfile
    import jax, numpy as np
    from flax import nnx
    from k3jax import checkpoint
    from k3jax.runtime import load_model
    from k3jax.sharding import load_sharding_config, placement
    from serve.engine import Engine, EngineConfig

    out = {}
    src = load_model("tiny-k3")
    d = tempfile.mkdtemp()
    checkpoint.save_hf_checkpoint(d + "/hf", src.cfg, src.params, max_shard_bytes=1 << 18, a_log_pad=3)
    checkpoint.save_orbax(d + "/orbax", src.cfg, src.params, src.dtype)
    reads = []  # (tensor, bytes read, the tensor's bytes) of every read from the safetensors files
    get = checkpoint.SafetensorsDir.get

    def counted(self, name, index=()):
        arr = get(self, name, index)
        reads.append((name, arr.nbytes, int(np.prod(self.shape(name))) * arr.itemsize))
        return arr

    checkpoint.SafetensorsDir.get = counted
    from serve.named_weights import checksum

    def split_checksum(a):  # `checksum` (a host store's weight tag) of `a`, split over the mesh, against one
        # device's copy (row by row, as `Engine._weights_digest` sums there), then with one bit of one element of its
        # last shard flipped (every copy of that shard)
        one = lambda x: jax.device_put(np.asarray(x), jax.devices()[0])
        want = int(checksum(one(a), by_rows=True))
        last = a.addressable_shards[-1]
        data = np.array(last.data)
        data.view(np.uint8).flat[data.nbytes // 2] ^= 1
        changed = jax.make_array_from_single_device_arrays(a.shape, a.sharding, [
            jax.device_put(data, s.device) if s.index == last.index else s.data for s in a.addressable_shards])
        return dict(dtype=str(a.dtype), split=len({repr(s.index) for s in a.addressable_shards}),
                    same=int(checksum(a)) == want, moved=int(checksum(changed)) != want,
                    moved_alike=int(checksum(changed)) == int(checksum(one(changed), by_rows=True)))

    whole = load_model(d + "/hf")
    ref = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(whole.params)}
    out["whole"] = dict(bytes=sum(b for _, b, _ in reads), partial=sum(b < full for _, b, full in reads))
    for form in ("hf", "orbax"):
        for sh in ("tp", "ep"):
            reads.clear()
            m = load_model(f"{d}/{form}", sharding=sh)
            place = placement(load_sharding_config(sh))
            flat = [(k, v[...], v) for k, v in nnx.to_flat_state(m.params)]
            per = {}  # tensor -> [its bytes, bytes read, reads]
            for name, b, full in reads:
                e = per.setdefault(name, [full, 0, 0])
                e[1], e[2] = e[1] + b, e[2] + 1
            out[f"{form}/{sh}"] = dict(
                equal=all(np.array_equal(np.asarray(a), ref[k]) for k, a, _ in flat),
                placed=all(a.sharding == place(v) for _, a, v in flat),
                split=sum(not a.sharding.is_fully_replicated for _, a, _ in flat), leaves=len(flat),
                bytes=sum(b for _, b, _ in reads), partial=sum(b < full for _, b, full in reads),
                # tensors read in slices: each slice once, the slices adding up to the tensor
                sliced=sum(e[2] > 1 for e in per.values()),
                sliced_whole=all(e[1] == e[0] for name, e in per.items() if e[2] > 1 and "A_log" not in name))
            if form == "hf":  # the largest weight split over the mesh
                out[f"{form}/{sh}"]["checksum"] = split_checksum(max(
                    (a for _, a, _ in flat if not a.sharding.is_fully_replicated), key=lambda a: a.size))
            if form == "hf" and sh == "ep":  # the engine's own placement of these arrays is a no-op
                eng = Engine(m, EngineConfig(sharding=sh, expert_weights="packed", dense_weights="out_in",
                                             cache_bytes=4 << 20, max_model_len=64), warmup=False)
                out["engine"] = dict(kept=all(a is b for a, (_, b, _) in zip(jax.tree.leaves(eng.model.params), flat)),
                                     load_options=eng.load_options())
    # vLLM's tensor_parallel_size: a mesh over the first 2 devices, the weights loaded into it (as LLM does)
    cfg = EngineConfig(tensor_parallel_size=2, expert_weights="packed", dense_weights="out_in", cache_bytes=4 << 20,
                       max_model_len=64)
    m = load_model(d + "/hf", sharding=cfg.sharding, devices=cfg.mesh_devices())
    eng = Engine(m, cfg, warmup=False)
    out["tp2"] = dict(mesh=dict(eng.mesh.shape), devices=sorted(x.id for x in eng.mesh.devices.flat),
                      kept=all(a is b for a, b in zip(jax.tree.leaves(eng.model.params), jax.tree.leaves(m.params))),
                      load_options=eng.load_options(), arena=sorted(x.id for x in eng.arena.sharding.device_set))
    del eng
    # two data-parallel replicas of it: loaded into the first one's shards, copied from there to the second's
    from serve.data_parallel import build_replicas, load_options
    opts = load_options(cfg, 2)
    m = load_model(d + "/hf", **opts)
    engines, groups = build_replicas(m, cfg, 2, warmup=False)
    first, second = (jax.tree.leaves(e.model.params) for e in engines)
    out["dp_tp2"] = dict(options=opts, groups=[list(g) for g in groups],
                         kept=all(a is b for a, b in zip(first, jax.tree.leaves(m.params))),
                         second=sorted({x.id for a in second for x in a.sharding.device_set}),
                         equal=all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(first, second)))
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def sharded_loads():
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _LOADS], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[0][len("RESULT"):])


@pytest.mark.parametrize("form", ["hf", "orbax"])
@pytest.mark.parametrize("sh", ["tp", "ep"])
def test_weights_load_straight_into_their_shards(sharded_loads, form, sh):
    """`load_model(path, sharding=...)`: every parameter arrives with the sharding the engine gives it, the
    same values as a whole load; from HF safetensors each device's slice is read on its own (never the
    whole tensor per device), each byte once."""
    r, whole = sharded_loads[f"{form}/{sh}"], sharded_loads["whole"]
    assert r["equal"] and r["placed"] and r["split"] > 0
    if form == "hf":
        assert whole["partial"] == 0 and r["partial"] > 0 and r["sliced"] > 0 and r["sliced_whole"]
        # every tensor byte read once, not once per device (A_log, fixed before slicing, is read whole per slice)
        assert whole["bytes"] <= r["bytes"] <= whole["bytes"] * 1.01


@pytest.mark.parametrize("sh", ["tp", "ep"])
def test_the_weights_checksum_of_a_split_weight_is_one_devices(sharded_loads, sh):
    """`named_weights.checksum`, which tags a host store's entries by the weights (`Engine._weights_digest`): a
    weight split over 4 devices (tp: a float32 matrix by rows; ep: the packed uint8 experts) sums to what one
    device's copy sums row by row, so engines sharded differently share a store; one bit of one shard moves it."""
    got = sharded_loads[f"hf/{sh}"]["checksum"]
    assert got["split"] == 4 and got["same"] and got["moved"] and got["moved_alike"], got
    assert got["dtype"] == ("float32" if sh == "tp" else "uint8"), got


def test_the_engine_keeps_weights_loaded_into_its_placement(sharded_loads):
    eng = sharded_loads["engine"]
    assert eng["kept"] and eng["load_options"] == {"sharding": "ep", "devices": None}
    tp2 = sharded_loads["tp2"]  # tensor_parallel_size=2 on the 4-device host: devices 0 and 1
    assert tp2 == dict(mesh={"tensor": 2}, devices=[0, 1], kept=True, arena=[0, 1],
                       load_options={"sharding": "tp", "devices": [0, 1]})
    # -dp 2 -tp 2: the weights read into replica 0's devices; replica 1's copied there from them
    assert sharded_loads["dp_tp2"] == dict(options={"sharding": "tp", "devices": [0, 1]}, groups=[[0, 1], [2, 3]],
                                           kept=True, second=[2, 3], equal=True)


@pytest.mark.parametrize("model", ["tiny-k3", "tiny-kimi-linear"])
def test_engine_on_a_mesh_matches_one_device(multi_device, model):
    """Same greedy (and seeded) tokens on 1 device, a 4-way tensor mesh (experts split over it too) and a
    2 x 2 expert x tensor mesh, also when later prompts resume from the prefix cache and (tp) with the
    accelerator's decode forms (paged MLA kernel, batched KDA op, each per rank); logprobs to fp32
    rounding (tensor-parallel partial sums are reduced in another order); parameters really split, the
    arena on all 4 devices, MoE blocks expert-parallel, no compile after warm-up, no cache units leaked."""
    one = multi_device[f"{model}/None"]
    assert one["mesh"] is None and one["exchange"] == 0 and not any(one["expert_parallel"])
    for sh, mesh in (("tp", {"tensor": 4}), ("tp_ep", {"expert": 2, "tensor": 2}), ("ep", {"expert": 4}),
                     ("tp/dcp_paged", {"tensor": 4}), ("tp/scan_paged", {"tensor": 4}), ("tp/scan_dcp", {"tensor": 4})):
        if f"{model}/{sh}" not in multi_device:
            assert model != "tiny-k3"  # tiny-k3 runs every form
            continue
        r = multi_device[f"{model}/{sh}"]
        assert r["mesh"] == mesh
        assert r["tokens"] == one["tokens"] and r["again"] == one["again"]
        assert r["cached"] == one["cached"] and all(c >= 16 for c in r["cached"])
        for a, b in zip(r["logprobs"], one["logprobs"]):
            assert a == pytest.approx(b, abs=2e-4)
        assert r["split"] > (r["leaves"] // 4 if sh != "ep" else 0)
        assert r["devices"] == [0, 1, 2, 3]
        assert r["expert_parallel"] and all(r["expert_parallel"])
        assert r["compiles"] == 0
        assert r["free"] == r["baseline"]  # free + held only by the prefix cache
        assert (r["scan"] == "LayerScan(start=1, period=3, groups=2)") == ("scan" in sh)
    # weights by checkpoint name (serve/named_weights.py) read back whatever the mesh, form or expert placement;
    # pushed by name and restored on tp_ep and eplb_scan (their generations above then match one device's)
    assert all(r.get("weights_mismatched") == [] for k, r in multi_device.items() if k.startswith(model + "/"))


@pytest.mark.parametrize("model", ["tiny-k3", "tiny-kimi-linear"])
def test_arena_state_slots_split_by_kda_heads(multi_device, model):
    """Under the `heads` rule the arena is split by columns over that axis: each device holds a
    [num_units, unit_elems] arena (every MLA page, its own KDA heads' states), so a state slot spans
    fewer units (4 KDA heads: 1 per rank under tp, 2 under tp_ep) and the same per-device budget holds
    more sequences. Without a heads split (ep) the arena is replicated as before."""
    one = multi_device[f"{model}/None"]
    assert one["state_ranks"] == 1 and one["arena_local"] == one["unit"]
    for sh, ranks in (("tp", 4), ("tp_ep", 2), ("ep", 1)):
        if f"{model}/{sh}" not in multi_device:
            assert model != "tiny-k3"
            continue
        r = multi_device[f"{model}/{sh}"]
        assert r["state_ranks"] == ranks and r["unit"] == one["unit"]
        assert r["arena_local"] == one["unit"]  # one rank's arena: the same units as on one device
        if ranks == 1:
            assert r["arena_replicated"] and r["slot_units"] == one["slot_units"]
        else:
            assert not r["arena_replicated"] and "tensor" in r["arena_spec"]
            assert r["slot_units"] <= -(-one["slot_units"] // ranks) + 1 < one["slot_units"]
    # every arena access runs on the rank's own part: no copy of it and no collective over it, also
    # when decode stores latents and runs the paged MLA kernel per rank (on its query heads); the compiled
    # programs are inspected on tiny-k3 only (the same arena code for both models; CI time)
    for tp in (multi_device[k] for k in (f"{model}/tp", f"{model}/tp/scan_paged", f"{model}/tp/scan_dcp")
               if model == "tiny-k3"):
        assert tp["arena_ops"] >= 4 and tp["arena_bad_ops"] == 0


@pytest.mark.parametrize("form", ["dcp_paged", "scan_dcp"])
def test_decode_context_parallel_splits_the_pages_by_position(multi_device, form):
    """decode_context_parallel_size=4 under tp on 4 devices: each rank holds every 4th token of each page, so a
    unit is a quarter of a page and the same per-rank budget holds 4x the units; prefill and decode attend
    over each rank's share with the partial softmaxes combined (at decode through the paged MLA kernel's
    log-sum-exp: `dcp_paged`, or as prefill does, with the layers scanned, each MLA layer's shares written back
    as it runs: `scan_dcp`), the same tokens and prefix-cache reuse as one device (checked above), no arena copy
    or collective, and no all-gather rebuilds a context."""
    tp, dcp = multi_device["tiny-k3/tp"], multi_device[f"tiny-k3/tp/{form}"]
    assert tp["context_ranks"] == 1 and dcp["context_ranks"] == 4 and dcp["state_ranks"] == 4
    assert tp["mla_form"] == "gathered"
    assert dcp["mla_form"] == ("paged" if form.endswith("paged") else "gathered") + "_context_parallel"
    assert dcp["unit"][1] * 4 == tp["unit"][1] and dcp["unit"][0] // 4 == tp["unit"][0]
    assert dcp["slot_units"] >= tp["slot_units"] * 4 - 3  # a state slot: the same bytes in smaller units
    assert dcp["seqs_at_max_len"] > tp["seqs_at_max_len"]
    assert dcp["arena_ops"] >= 4 and dcp["arena_bad_ops"] == 0
    span = dcp["span"]  # a gathered context would be [rows, span, latent words]
    assert dcp["gathers"] and not [g for g in dcp["gathers"] if f",{span}," in g]


def test_expert_load_balancing_moves_experts_without_changing_outputs(multi_device):
    """enable_eplb under ep on 4 devices with 4 redundant experts: the engine re-places and re-copies each MoE
    layer's experts every 3 steps (and once more on demand) so the ranks' shares of the recently routed tokens
    even out; the weights move with their placement tables, so tokens and logprobs stay those of the plain
    expert-parallel engine bit for bit (every slot is still computed by one copy on one rank), with no compile
    after warm-up and no cache leaked. The balancing engine schedules asynchronously: the counts that trigger a
    move are read back while the next step, launched on the old placement, is in flight. Its layers are scanned:
    each move gathers the stacked experts of the moved groups (the scan reorders some sums: logprobs to 1e-5
    against the unrolled engine, bit for bit across its own moves)."""
    ep, r = multi_device["tiny-k3/ep"], multi_device["tiny-k3/ep/eplb_scan"]
    e = r["eplb"]
    assert r["scan"] == "LayerScan(start=1, period=3, groups=2)"
    assert r["tokens"] == ep["tokens"] and e["tokens_after"] == ep["tokens"]
    for a, b in zip(r["logprobs"], ep["logprobs"]):
        assert a == pytest.approx(b, abs=1e-5, rel=0)
    assert e["logprobs_after"] == r["logprobs"]
    assert r["again"] == ep["again"] and r["cached"] == ep["cached"]
    assert e["rebalances"] >= 3 and e["layers_moved"] >= 1 and e["ranks"] == 4 and e["ahead"] > 10
    assert e["num_redundant_experts"] == 4 and e["physical_experts"] == 12
    initial = list(range(8)) + [0, 1, 2, 3]
    assert any(p != initial for p in e["placement"])  # experts really moved and were copied anew
    assert all(sorted(set(p)) == list(range(8)) and len(p) == 12 for p in e["placement"])
    s = e["summary"]
    assert s["tokens"] > 0 and 1.0 <= s["imbalance_after"] <= s["imbalance_before"]
    assert r["compiles"] == 0 and r["free"] == r["baseline"]
    assert multi_device["uneven_copies_error"] == (
        "eplb_num_redundant_experts=3: the 8 routed experts and their copies (11) must split evenly over the 4 ranks "
        "of the `experts` rule under sharding='ep'")


def test_expert_parallel_is_exact_and_counts_its_traffic(multi_device):
    """Experts split over 4 devices and nothing else: every slot's output is nonzero on one rank only,
    so the all-reduce adds exact zeros and the logprobs are the one-device logprobs (bit for bit under XLA's
    default CPU emitters; the test run's older fusion emitters, tests/conftest.py, may order one of the
    sharded program's local sums differently: within 1e-5; tensor parallelism's reordered partial sums are
    checked to 2e-4). The traffic estimate is the same for every config that splits the experts over all 4
    devices (on tiny-k3: Kimi-Linear's routed experts are split by the same code, checked under tp above)."""
    model = "tiny-k3"
    one, ep = multi_device[f"{model}/None"], multi_device[f"{model}/ep"]
    assert ep["tokens"] == one["tokens"]
    for a, b in zip(ep["logprobs"], one["logprobs"]):
        assert a == pytest.approx(b, abs=1e-5, rel=0)
    assert ep["exchange"] > 0  # tp, ep and tp_ep all split the experts over the 4 devices
    assert all(multi_device[k]["exchange"] == ep["exchange"] for k in (f"{model}/tp", f"{model}/tp_ep")
               if k in multi_device)


def test_data_parallel_replicas_generate_what_one_engine_does(multi_device):
    """Two one-device replicas (devices 1 and 0, in that order): the same greedy and seeded tokens as one
    engine, later prompts routed back to the replica that cached their prefix (the same cached tokens),
    both replicas used, nothing compiled after warm-up, nothing leaked. Replicas of a 2-way tensor mesh
    each take their own pair of devices."""
    one, dp = multi_device["tiny-k3/None"], multi_device["dp"]
    assert dp["tokens"] == one["tokens"] and dp["again"] == one["again"] and dp["cached"] == one["cached"]
    assert [r["devices"] for r in dp["replicas"]] == [[1], [0]] == dp["arena"] == dp["params"]
    assert all(r["generation_tokens"] > 0 for r in dp["replicas"]) and all(r["load"] == 0 for r in dp["replicas"])
    assert dp["router"]["routed_by_prefix"] == 2 and dp["router"]["routed_by_load"] == 4
    assert dp["compiles"] == 0 and dp["running"] == 0 and dp["free"] == dp["baseline"]
    tp = multi_device["dp_tp"]
    assert tp["groups"] == [[0, 1], [2, 3]] == tp["arena"] and tp["mesh"] == [{"tensor": 2}] * 2
    # get_weights_by_name on replicas: each replica's copy (SGLang's list form)
    q = np.asarray(load_model("tiny-k3", seed=0).params["layers"][0]["self_attn"]["q_proj"]["weight"][...])[:2]
    assert dp["weights"] == [q.tolist(), q.tolist()]


def test_http_server_over_data_parallel_replicas(multi_device):
    """The API app serves the replicas as one engine: the same tokens, a follow-up prompt hitting its
    prefix, both replicas' rows as capacity, an abandoned request's cache returned, summed and per-replica
    metrics (each replica's engine series under its index, vLLM's `engine` label), the prefix cache reset on
    both."""
    h, one = multi_device["dp_http"], multi_device["tiny-k3/None"]
    assert h["health"] == 200 and h["capacity"] == 8
    assert h["tokens"] == [one["tokens"][i] for i in (0, 1, 3)] + [one["again"][0]]
    assert h["hit"] == one["cached"][0]
    assert h["reset"] == {"reset": True} and h["cached"] == 0
    assert h["ended"] == "abort"  # an explicit abort ends the stream its reader still reads
    assert h["running"] == h["waiting"] == 0 and h["free"] == h["baseline"] and h["aborted"] == 2
    metric = {l.rsplit(" ", 1)[0]: float(l.rsplit(" ", 1)[1]) for l in h["metric"]}
    assert all(metric[f'vllm:generation_tokens_total{{engine="{e}",model_name="m"}}'] > 0 for e in "01")
    assert sum(metric[f'vllm:time_to_first_token_seconds_count{{engine="{e}",model_name="m"}}'] for e in "01") == 4
    assert metric['k3jax:replica_requests_running{engine="0",model_name="m",replica="1"}'] == 0
    assert metric['k3jax:data_parallel_routed_total{by="prefix",engine="0",model_name="m"}'] >= 1
    assert metric['k3jax:data_parallel_routed_total{by="load",engine="0",model_name="m"}'] >= 3


def test_disaggregated_prefill_over_http(multi_device):
    """A prefill engine (device 0) and a decode engine (device 1) behind the API app: the decode engine
    resumes every prompt from what the prefill engine published (up to the last checkpoint within one
    alignment of its end) and generates what one engine does; a request whose consumer leaves is aborted
    on the engine running it, an explicit abort ends the stream in either phase; nothing leaks, nothing compiles after warm-up."""
    d, one = multi_device["pd"], multi_device["tiny-k3/None"]
    assert d["devices"] == [[0], [1]]
    assert d["tokens"] == [one["tokens"][i] for i in (0, 1, 3)]
    assert d["hits"] == [0, 32, 16]  # prompts of 5, 37 and 20 tokens; checkpoints every 16
    # and the abandoned request, and the one aborted while decoding
    assert d["host_hits"] == 4 and d["prefill"]["kv_transfer_published"] >= 3
    assert d["compiles"] == 0 and d["prefill"]["compiles_after_warmup"] == 0
    assert d["running"] == 0 and d["prefill"]["num_requests_running"] == 0
    # explicit aborts end the reader's stream: in the decode phase, and in the prefill phase (no tokens, no
    # decode phase: the decode engine never sees it)
    assert d["ended"] == ["abort", ["abort", 0, 0]]
    assert d["prefill"]["num_requests_running"] == 0 and d["prefill"]["requests_aborted"] <= 1
    assert d["free"] == d["baseline"] and d["aborted"] == 2


def test_moe_exchange_bytes_is_a_ring_all_reduce_per_group():
    one_layer = 10 * 2 * 16 * 4  # [tokens, top_k, width] fp32
    assert moe_exchange_bytes(3, 10, 2, 16, 1, 8) == 0
    assert moe_exchange_bytes(1, 10, 2, 16, 4, 4) == 2 * 3 * one_layer  # one group of 4: each sends 2 * 3/4
    assert moe_exchange_bytes(3, 10, 2, 16, 2, 8) == 3 * 4 * 2 * 1 * one_layer  # 4 groups of 2


def test_serve_command_line_takes_a_sharding_config_and_decode_forms():
    from k3jax.cli import build_parser
    from serve.cli import DEFAULTS, engine_config

    def cfg(*argv):
        args = build_parser().parse_args(["serve", *argv])
        return engine_config({k: getattr(args, k, v) for k, v in DEFAULTS.items()})

    assert cfg().sharding is None and (cfg().kda_decode, cfg().mla_decode) == ("auto", "auto")
    forms = cfg("--kda-decode", "gathered", "--mla-decode", "paged")
    assert (forms.kda_decode, forms.mla_decode) == ("gathered", "paged")
    assert not cfg().scan_layers and cfg("--scan-layers").scan_layers
    c = cfg("--sharding", "tp_ep")
    assert c.sharding == "tp_ep"
    c.validate()
    with pytest.raises(ValueError, match="no config 'tpp'"):
        cfg("--sharding", "tpp").validate()
    assert not cfg().enable_eplb
    c = cfg("--sharding", "ep", "--enable-eplb", "--eplb-window-size", "50", "--eplb-step-interval", "200")
    assert (c.enable_eplb, c.eplb_window_size, c.eplb_step_interval, c.eplb_num_redundant_experts) == (True, 50, 200, 0)
    c.validate()
    assert cfg("--sharding", "ep", "--enable-eplb", "--eplb-num-redundant-experts", "32").eplb_num_redundant_experts == 32
    assert cfg("--sharding", "ep", "--enable-eplb", "--num-redundant-experts", "8").eplb_num_redundant_experts == 8
    with pytest.raises(ValueError, match="eplb_num_redundant_experts=8: redundant experts are placed by"):
        cfg("--sharding", "ep", "--num-redundant-experts", "8").validate()
    with pytest.raises(ValueError, match="eplb_step_interval=0"):
        cfg("--sharding", "ep", "--enable-eplb", "--eplb-step-interval", "0").validate()
    assert cfg().decode_context_parallel_size == 1
    assert cfg("--sharding", "tp", "-dcp", "8").decode_context_parallel_size == 8
    with pytest.raises(ValueError, match="decode_context_parallel_size=4 splits the MLA pages"):
        cfg("--decode-context-parallel-size", "4").validate()


def test_info_reports_bytes_per_device(capsys):
    """`k3jax info --sharding` plans per-device parameter and cache bytes from abstract shapes (no weights)."""
    from k3jax.cli import main

    assert main(["info", "--model", "tiny-k3", "--dtype", "float32", "--sharding", "tp", "--devices", "4"]) == 0
    info = json.loads(capsys.readouterr().out)
    sh = info["sharding"]
    assert sh["mesh"] == {"tensor": 4} and sh["param_bytes"] == info["param_bytes"]
    assert info["param_bytes"] // 4 < sh["param_bytes_per_device"] < info["param_bytes"]
    per_seq, per_dev = info["cache_bytes_per_sequence_at_4096"], sh["cache_bytes_per_sequence_at_4096_per_device"]
    assert sh["kda_state_ranks"] == 4 and per_dev["kda_state"] * 4 == per_seq["kda_state"] > 0
    assert per_dev["mla_kv"] == per_seq["mla_kv"]  # every rank keeps the whole latent cache
    # decode context parallelism splits the latent cache by position over the same 4 ranks
    args = ["info", "--model", "tiny-k3", "--dtype", "float32", "--sharding", "tp", "--devices", "4", "--cache-gib",
            "0.01", "--context", "4096", "--page-size", "16"]
    assert main(args) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main(args + ["-dcp", "4"]) == 0
    dcp = json.loads(capsys.readouterr().out)
    assert dcp["sharding"]["cache_bytes_per_sequence_at_4096_per_device"]["mla_kv"] * 4 == per_seq["mla_kv"]
    assert dcp["arena"]["mla_bytes_per_token"] * 4 == whole["arena"]["mla_bytes_per_token"]
    assert dcp["arena"]["sequences"]["4096"] > whole["arena"]["sequences"]["4096"] > 0
    assert main(args + ["-dcp", "2"]) == 2 and "decode-context-parallel-size 2" in capsys.readouterr().err
    assert main(["info", "--model", "tiny-k3", "--dtype", "float32", "--sharding", "single", "--devices", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["sharding"]["param_bytes_per_device"] == info["param_bytes"]


def test_info_counts_the_step_programs_compiled_at_start_up(capsys):
    """K3's serving defaults (64 sequences, 32768 tokens, 16-token pages): decode rows 1 / 4 / 16 / 64 and
    prefill rows 1 / 4 over 7 context buckets are 42 programs; 18 where one-token decodes need only the
    widest bucket (a GPU's paged MLA kernel)."""
    from k3jax.cli import main

    assert main(["info", "--model", "tiny-k3", "--dtype", "float32", "--page-size", "16"]) == 0
    got = json.loads(capsys.readouterr().out)["step_programs"]
    assert got["decode_rows"] == [1, 4, 16, 64] and got["prefill_rows"] == [1, 4]
    assert got["context_pages"] == [1, 4, 16, 64, 256, 1024, 2048]
    assert (got["programs"], got["programs_with_gpu_paged_decode"]) == (42, 18)
    from k3jax.config import PRESETS
    assert got["page_tables_bytes"] == (64 + 4 + 1) * PRESETS["tiny-k3"].num_mla_layers * 2048 * 4
    assert got["layer_scan"] == {"first_layer": 1, "period": 3, "groups": 2}
    assert got["layers_compiled_per_program"] == {"unrolled": 8, "scan_layers": 5}
    assert main(["info", "--model", "k3", "--dtype", "bfloat16"]) == 0
    got = json.loads(capsys.readouterr().out)["step_programs"]  # K3: 7 groups of 12 scanned, 21 layers compiled
    assert got["layer_scan"] == {"first_layer": 1, "period": 12, "groups": 7}
    assert got["layers_compiled_per_program"] == {"unrolled": 93, "scan_layers": 21}
    assert main(["info", "--model", "tiny-k3", "--dtype", "float32", "--max-num-seqs", "8", "--max-model-len",
                 "1024", "--page-size", "64", "--max-prefill-seqs", "1"]) == 0
    got = json.loads(capsys.readouterr().out)["step_programs"]
    assert (got["decode_rows"], got["prefill_rows"], got["context_pages"]) == ([1, 4, 8], [1], [1, 4, 16])
    assert (got["programs"], got["programs_with_gpu_paged_decode"]) == (12, 6)


def test_info_plans_with_the_engines_page_size_by_default(capsys):
    """`k3jax info` without --page-size plans the pages `k3jax serve` and `EngineConfig` use (it said 64 while
    they use 16, so it counted other programs than serve compiles)."""
    import dataclasses

    from k3jax.cli import build_parser, main
    from serve.engine import EngineConfig

    page = {f.name: f.default for f in dataclasses.fields(EngineConfig)}["page_size"]
    assert build_parser().parse_args(["serve"]).page_size == page
    assert main(["info", "--model", "tiny-k3", "--dtype", "float32", "--cache-gib", "0.01"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step_programs"]["page_size"] == info["arena"]["page_size"] == page
    assert main(["info", "--model", "tiny-k3", "--dtype", "float32", "--page-size", str(page)]) == 0
    assert json.loads(capsys.readouterr().out)["step_programs"] == info["step_programs"]
