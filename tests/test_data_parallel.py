"""Data-parallel replicas (serve/data_parallel.py): engines on disjoint device groups behind a router that
sends a prompt where its prefix was sent before, unless that replica is too busy."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from serve.data_parallel import PrefixRouter, merge_stats, replica_devices
from serve.engine import EngineConfig

_MULTI = textwrap.dedent("""
    import asyncio, json
    import httpx
    import k3jax
    from k3jax import SamplingParams
    from serve.api import create_app
    from serve.data_parallel import DataParallelAsyncEngine

    kw = dict(max_model_len=64, cache_bytes=8 << 20, max_num_seqs=4, prefill_chunk=16, max_prefill_seqs=2,
              decode_buckets=(4,), prefill_buckets=(2,), context_buckets=(4,), measure_moe_time=False,
              progress=False)
    prompts = [list(range(10, 47)), list(range(10, 43)), [5, 6, 7], list(range(20, 60)), list(range(30, 50))]
    sps = [SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
           SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True, n=2),
           SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)]
    later = [list(range(10, 47)) + [3, 1, 4], list(range(20, 60)) + [9, 9]]
    out = {}
    for name, opts in (("one", {}), ("tp", dict(data_parallel_size=2, sharding="tp"))):
        llm = k3jax.LLM("tiny-k3", **opts, **kw)
        res = llm.generate(prompts, sps)
        again = llm.generate(later, sps[0])
        st = llm.stats()
        out[name] = dict(tokens=[[c.token_ids for c in r.outputs] for r in res], again=[r.token_ids for r in again],
                         cached=[r.num_cached_tokens for r in again], replicas=st.get("replicas"),
                         router=st.get("data_parallel_router"), compiles=st["compiles_after_warmup"],
                         free=st["arena_free_units"] + st["arena_cached_units"],
                         baseline=st["arena_baseline_free_units"], generated=st["generation_tokens"],
                         running=st["num_requests_running"])
        if name == "tp":
            dp = llm

    # one-device replicas (no sharding config) on devices 3 and 1: placed there (built, not compiled)
    import jax
    from serve.data_parallel import build_replicas
    from serve.engine import EngineConfig
    cfg = EngineConfig(**{k: v for k, v in kw.items() if k != "progress"}, devices=(3, 1))
    engines, groups = build_replicas(dp.model, cfg, 2, progress=False, warmup=False)
    out["single"] = dict(groups=[list(g) for g in groups], mesh=[dict(e.mesh.shape) for e in engines],
                         arena=[sorted(d.id for d in e.arena.sharding.device_set) for e in engines],
                         params=[sorted({d.id for x in jax.tree.leaves(e.model.params) for d in x.sharding.device_set})
                                 for e in engines])
    del engines

    # the HTTP server over the tensor-mesh replicas, each stepped by its own thread
    aeng = DataParallelAsyncEngine(dp.engine.replicas, dp.engine.devices)
    app = create_app(None, "m", max_model_len=64)
    app.state.k3.attach(aeng)

    async def http():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            health = (await c.get("/health")).status_code
            rs = await asyncio.gather(*(c.post("/v1/completions", json=dict(
                model="m", prompt=p, max_tokens=sp.max_tokens, temperature=0, ignore_eos=True,
                return_token_ids=True)) for p, sp in zip(prompts, sps) if sp.temperature == 0))
            texts = [[ch["token_ids"] for ch in r.json()["choices"]] for r in rs]
            # a prompt extending an earlier one goes to the replica that cached it
            r = await c.post("/v1/completions", json=dict(model="m", prompt=later[0], max_tokens=7, temperature=0,
                                                          ignore_eos=True, return_token_ids=True))
            texts.append([r.json()["choices"][0]["token_ids"]])
            hit = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            # a long request aborted after its first token: its cache comes back
            agen = aeng.generate(list(range(1, 30)), SamplingParams(max_tokens=30, ignore_eos=True), "long")
            await agen.__anext__()
            await agen.aclose()
            await asyncio.sleep(0.5)
            metrics = (await c.get("/metrics")).text
            reset = (await c.post("/reset_prefix_cache")).json()
            return health, texts, metrics, reset, hit
    health, texts, metrics, reset, hit = asyncio.run(http())
    st = aeng.stats()
    out["http"] = dict(health=health, tokens=texts, reset=reset, hit=hit, capacity=app.state.k3.capacity,
                       free=st["arena_free_units"], baseline=st["arena_baseline_free_units"],
                       running=st["num_requests_running"], waiting=st["num_requests_waiting"],
                       cached=st["arena_cached_units"], aborted=st["requests_aborted"],
                       metric=[l for l in metrics.splitlines() if l.startswith(("vllm:generation_tokens_total",
                                                                                "k3jax:replica_requests_running",
                                                                                "k3jax:data_parallel_routed_total"))])
    aeng.shutdown()
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def replicas():
    """tiny-k3 on 4 simulated CPU devices: one engine, 2 replicas of a 2-way tensor mesh, 2 one-device
    replicas on devices 3 and 1 (placed, not compiled: CI time), then the HTTP app over the tensor-mesh
    replicas (a fresh process: the device count is fixed when JAX starts)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _MULTI], env=env, cwd=root, capture_output=True, text=True,
                          timeout=1200)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[0][len("RESULT"):])


def test_replicas_generate_what_one_engine_does(replicas):
    """Greedy, seeded (n=2) and later prompts that resume from cached prefixes: token for token what one
    engine on one device generates, on tensor-mesh replicas and on one-device replicas; the later prompts
    go back to the replica that cached their prefix; nothing compiles after warm-up; no unit leaks."""
    one, r = replicas["one"], replicas["tp"]
    assert all(c >= 32 for c in one["cached"])
    assert r["tokens"] == one["tokens"] and r["again"] == one["again"]
    assert r["cached"] == one["cached"]  # routed to the replica holding the prefix
    assert [x["devices"] for x in r["replicas"]] == [[0, 1], [2, 3]]
    assert all(x["generation_tokens"] > 0 for x in r["replicas"])  # both replicas served
    assert r["generated"] == one["generated"] and r["compiles"] == 0 and r["running"] == 0
    assert r["free"] == r["baseline"]
    assert r["router"]["routed_by_prefix"] >= 3 and r["router"]["routed_by_load"] >= 2
    assert all(x["load"] == 0 for x in r["replicas"])


def test_one_device_replicas_are_placed_on_their_devices(replicas):
    """Without a sharding config each replica runs on one device (the "single" config's mesh), the ones
    `devices` names, in that order: weights and arena there and nowhere else."""
    s = replicas["single"]
    assert s["groups"] == [[3], [1]] and s["mesh"] == [{"tensor": 1}] * 2
    assert s["arena"] == [[3], [1]] and s["params"] == [[3], [1]]


def test_http_server_over_replicas(replicas):
    """The API app serves a DataParallelAsyncEngine as one engine: the same tokens, both replicas' rows as
    its capacity, summed metrics, an aborted request's cache returned, the prefix-cache reset on both."""
    h, one = replicas["http"], replicas["one"]
    assert h["health"] == 200 and h["capacity"] == 8
    assert h["tokens"][:-1] == [t for i, t in enumerate(one["tokens"]) if i != 1]  # the greedy prompts
    assert h["tokens"][-1] == [one["again"][0]] and h["hit"] == one["cached"][0]  # routed to its prefix
    assert h["reset"] == {"reset": True} and h["cached"] == 0
    assert h["running"] == h["waiting"] == 0 and h["free"] == h["baseline"] and h["aborted"] == 1
    metric = {l.rsplit(" ", 1)[0]: float(l.rsplit(" ", 1)[1]) for l in h["metric"]}
    assert metric['vllm:generation_tokens_total{model_name="m"}'] > 0
    assert metric['k3jax:replica_requests_running{model_name="m",replica="1"}'] == 0
    assert metric['k3jax:data_parallel_routed_total{by="prefix",model_name="m"}'] >= 1
    assert metric['k3jax:data_parallel_routed_total{by="load",model_name="m"}'] >= 4


def test_router_prefers_the_replica_that_cached_the_prefix():
    r = PrefixRouter(3, block=4, balance_abs=2, balance_rel=1.5)
    a, b = list(range(100, 120)), list(range(200, 220))
    assert r.route(a) == 0 and r.route(b) == 1  # no prefix known: least loaded, lowest index
    assert r.route(a[:12] + [7, 7, 7, 7]) == 0  # its first 3 blocks were sent to replica 0
    assert r.route(b + [1]) == 1
    assert r.route([1, 2, 3]) == 2  # shorter than a block: least loaded
    assert r.route(a, salt=b"tenant") == 2  # another salt matches nothing: least loaded (ties: lowest index)
    assert r.counters == {"routed_by_prefix": 2, "routed_by_load": 4, "routed_blocks_matched": 3 + 5}
    assert r.load == [2, 2, 2]
    assert r.route(a, seqs=3) == 0 and r.load == [5, 2, 2]
    # replica 0 runs 3 more than the least loaded (> balance_abs) and more than 1.5x it: too busy
    assert r.route(a) == 1 and r.load == [5, 3, 2]  # replica 1 now holds a's blocks too
    r.done(1, 3)
    assert r.route(a) == 1  # the same depth on 0 and 1: the less loaded
    r.forget()
    assert r.load == [5, 1, 2] and r.route(a) == 1 and r.counters["routed_by_load"] == 6  # least loaded now
    assert r.hashes(a, b"x") != r.hashes(a) and len(r.hashes(a + [1])) == 5


def test_load_policy_ignores_prefixes():
    r = PrefixRouter(2, block=2, policy="load")
    assert [r.route([1, 2, 3, 4]) for _ in range(4)] == [0, 1, 0, 1]
    assert r.counters["routed_by_prefix"] == 0
    with pytest.raises(ValueError, match="data_parallel_routing='random'"):
        PrefixRouter(2, 2, policy="random")


def test_router_forgets_the_least_recently_sent_blocks():
    r = PrefixRouter(2, block=2, max_blocks=3)
    matched = lambda ids: (r.route(ids), r.counters["routed_blocks_matched"])[1]
    r.route([1, 2, 3, 4, 5, 6])                    # replica 0 holds A1 A2 A3
    assert matched([1, 2, 3, 4, 5, 6]) == 3        # all three, still on 0
    assert matched([1, 2, 7, 8, 9, 9]) == 3 + 1    # A1 matched; B2 B3 push out A2 A3 (3 blocks at most)
    assert matched([1, 2, 3, 4, 5, 6]) == 4 + 1    # only A1 is left


def test_merged_stats_sum_counters_and_recompute_ratios():
    def one(free, hits, queries, running):
        return {"generation_tokens": 10, "arena_free_units": free, "arena_baseline_free_units": 100,
                "kv_cache_usage": 1 - free / 100, "num_requests_running": running, "num_requests_waiting": 0,
                "new_token_ratio": 0.5 if running else 0.3, "mesh": {"tensor": 2}, "sharding": "tp",
                "expert_counts": [[1, 2], [3, 4]], "arena_bytes": {"mla": 5, "kda": 7}, "moe_layers": [1, 3],
                "compiles_after_warmup": 0, "prefix_cache": {"hit_tokens": hits, "query_tokens": queries,
                                                             "hit_rate": hits / queries}}
    router = PrefixRouter(2, 4)
    m = merge_stats([one(50, 10, 20, 2), one(100, 0, 60, 0)], [(0, 1), (2, 3)], router)
    assert m["generation_tokens"] == 20 and m["num_requests_running"] == 2
    assert m["kv_cache_usage"] == pytest.approx(0.25) and m["new_token_ratio"] == pytest.approx(0.4)
    assert m["prefix_cache"]["hit_rate"] == pytest.approx(10 / 80)
    assert m["mesh"] == {"tensor": 2} and m["sharding"] == "tp" and m["moe_layers"] == [1, 3]
    assert m["expert_counts"] == [[2, 4], [6, 8]] and m["arena_bytes"] == {"mla": 10, "kda": 14}
    assert m["data_parallel_size"] == 2 and [x["devices"] for x in m["replicas"]] == [[0, 1], [2, 3]]
    assert m["replicas"][0]["kv_cache_usage"] == 0.5


def test_bad_data_parallel_and_device_options_name_the_option():
    import jax

    n = len(jax.devices())
    with pytest.raises(ValueError, match="data_parallel_size=0"):
        replica_devices(0, EngineConfig())
    with pytest.raises(ValueError, match=f"data_parallel_size={n + 1}: {n} devices"):
        replica_devices(n + 1, EngineConfig())
    assert replica_devices(1, EngineConfig()) == [(0,)]
    for devices, match in (((n,), "indices into jax.devices"), ((), "non-empty"), ((0, 0), "appears twice"),
                           ("0", "indices"), ((True,), "indices")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(devices=devices).validate()
    if n == 1:
        with pytest.raises(ValueError, match="do not split into 2"):
            replica_devices(2, EngineConfig(sharding="tp"))
    from k3jax.cli import build_parser
    from serve.cli import DEFAULTS, engine_config

    args = build_parser().parse_args(["serve", "-dp", "0"])
    with pytest.raises(ValueError, match="--data-parallel-size"):
        engine_config({k: getattr(args, k, v) for k, v in DEFAULTS.items()})
    assert build_parser().parse_args(["serve", "--data-parallel-size", "2"]).data_parallel_size == 2
