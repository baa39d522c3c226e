"""Engines on disjoint device groups of one host: data-parallel replicas behind a router that sends a prompt
where its prefix was sent before unless that replica is too busy (serve/data_parallel.py), and a prefill
engine handing prompts to a decode engine through a host store (serve/disaggregated.py). Their runs on 4
simulated devices share tests/test_sharding.py's multi-device process (CI time); here: the router, the
merged statistics and the options."""
import pytest

from k3jax.sharding import load_sharding_config
from serve.data_parallel import PrefixRouter, _salt, merge_stats, replica_devices
from serve.engine import EngineConfig

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
    assert _salt("\ud800", None) != _salt("\ud801", None)  # (JSON's lone surrogates: it raised UnicodeEncodeError)


def test_load_policy_ignores_prefixes():
    r = PrefixRouter(2, block=2, policy="load")
    assert [r.route([1, 2, 3, 4]) for _ in range(4)] == [0, 1, 0, 1]
    assert r.counters["routed_by_prefix"] == 0
    with pytest.raises(ValueError, match="data_parallel_routing='random'"):
        PrefixRouter(2, 2, policy="random")


def test_router_forgets_a_replica_whose_cache_was_cleared():
    """A replica's prefix cache cleared by any path (its cache epoch moved: an HTTP weight update, an arena
    reset) no longer draws the prefixes sent to it; the other replicas' stay."""
    from types import SimpleNamespace

    from serve.data_parallel import DataParallelEngine
    from serve.types import SamplingParams

    r0, r1 = _Replica([]), _Replica([])
    for r in (r0, r1):
        r.prefix_cache, r._prompt = SimpleNamespace(clears=0), lambda p: (None, list(p))
    dp = DataParallelEngine([r0, r1], [(0,), (1,)])
    a, b = [1] * 12, [2] * 12
    for p in (a, b, a, b):
        dp.add_request(p, SamplingParams(max_tokens=1))
    by_prefix = dp.router.counters["routed_by_prefix"]
    assert by_prefix == 2  # the repeats went where their prefixes were sent
    r1.prefix_cache.clears += 1  # replica 1's cache was cleared behind the router's back
    dp.router.load = [0, 0]
    dp.add_request(b, SamplingParams(max_tokens=1))
    dp.add_request(a, SamplingParams(max_tokens=1))
    assert dp.router.counters["routed_by_prefix"] == by_prefix + 1  # only a's (replica 0) still counts


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
    # units only the prefix cache holds are free to vLLM's usage (evicted on demand)
    cached = merge_stats([{**one(50, 10, 20, 2), "arena_cached_units": 25}, one(100, 0, 60, 0)], [(0,), (1,)], router)
    assert cached["kv_cache_usage"] == pytest.approx(0.125)
    # each replica's arena planned from gpu_memory_utilization: the fraction once, the bytes summed
    plan = dict(utilization=0.9, bytes_limit=80, bytes_in_use=10, step_temp_bytes=1, cache_bytes=50)
    planned = merge_stats([{**one(50, 10, 20, 2), "memory_plan": plan}, {**one(100, 0, 60, 0), "memory_plan": plan}],
                          [(0,), (1,)], router)
    assert planned["memory_plan"] == dict(utilization=0.9, bytes_limit=160, bytes_in_use=20, step_temp_bytes=2,
                                          cache_bytes=100)


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


def test_tensor_parallel_size_picks_the_mesh_devices(monkeypatch):
    """vLLM's tensor_parallel_size: the first N devices under the `tp` config (or the given one), each
    data-parallel replica N of its own; mismatches name both options."""
    import jax

    dev = jax.devices()[0]
    monkeypatch.setattr(jax, "devices", lambda *a: [dev] * 8)  # an 8-device host, as far as the config can tell
    c = EngineConfig(tensor_parallel_size=4)
    c.validate()
    assert c.sharding == "tp" and c.mesh_devices() == (0, 1, 2, 3)
    one = EngineConfig(tensor_parallel_size=1)
    assert one.sharding is None and one.mesh_devices() is None  # one device, no mesh
    assert EngineConfig(tensor_parallel_size=1, sharding="tp").mesh_devices() == (0,)
    assert EngineConfig(tensor_parallel_size=2, sharding="tp_ep").sharding == "tp_ep"
    assert EngineConfig(tensor_parallel_size=2, devices=(4, 6)).mesh_devices() == (4, 6)
    assert replica_devices(2, EngineConfig(tensor_parallel_size=4)) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert replica_devices(2, EngineConfig(tensor_parallel_size=2, devices=(1, 3, 5, 7))) == [(1, 3), (5, 7)]
    assert replica_devices(3, EngineConfig(tensor_parallel_size=2)) == [(0, 1), (2, 3), (4, 5)]
    for kw, match in ((dict(tensor_parallel_size=0), "tensor_parallel_size=0"),
                      (dict(tensor_parallel_size=True), "tensor_parallel_size=True"),
                      (dict(tensor_parallel_size=9), "tensor_parallel_size=9: only 8 devices"),
                      (dict(tensor_parallel_size=2, devices=(0,)), r"devices=\(0,\) names 1")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**kw).validate()
    with pytest.raises(ValueError, match="data_parallel_size=3 x tensor_parallel_size=4: 12 devices wanted, 8"):
        replica_devices(3, EngineConfig(tensor_parallel_size=4))
    from k3jax.cli import build_parser
    from serve.cli import DEFAULTS, engine_config

    args = build_parser().parse_args(["serve", "-tp", "2"])
    cfg = engine_config({k: getattr(args, k, v) for k, v in DEFAULTS.items()})
    assert cfg.tensor_parallel_size == 2 and cfg.sharding == "tp" and cfg.mesh_devices() == (0, 1)


def test_vllms_enable_expert_parallel_is_taken_where_the_mesh_splits_the_experts(tmp_path):
    """vLLM's `--enable-expert-parallel` / `-ep` (a launch line with it failed: unrecognized argument): taken with
    -tp N (the `tp` config splits the experts by expert already) and on one device; refused, naming the option, where
    the experts would stay whole on every device (a config without an `experts` rule, experts that do not divide
    over its ranks) or spread over data-parallel replicas (which share nothing; vLLM's EP spans TP x DP)."""
    from k3jax.cli import build_parser
    from serve.cli import DEFAULTS, engine_config
    from serve.engine import expert_parallel_refusal

    def cfg(*argv):
        args = build_parser().parse_args(["serve", *argv])
        return engine_config({k: getattr(args, k, v) for k, v in DEFAULTS.items()})

    assert not cfg().enable_expert_parallel
    c = cfg("-tp", "1", "--enable-expert-parallel")
    assert c.enable_expert_parallel and c.sharding is None
    c.validate()
    cfg("-ep", "--sharding", "single").validate()  # one device: nothing to split
    mine = tmp_path / "dense.yaml"
    mine.write_text("mesh: {tensor: -1}\nrules: {heads: tensor, mlp: tensor}\n")
    cfg("--sharding", str(mine)).validate()
    with pytest.raises(ValueError, match="enable_expert_parallel: sharding=.*dense.yaml.* does not split the routed"):
        cfg("-ep", "--sharding", str(mine)).validate()
    with pytest.raises(ValueError, match="enable_expert_parallel with data_parallel_size=2: replicas share nothing"):
        replica_devices(2, cfg("-ep"))
    assert replica_devices(1, cfg("-ep")) == [(0,)]
    tp = load_sharding_config("tp")
    assert expert_parallel_refusal("tp", tp.rule("experts"), {"tensor": 4}, 8, 8) is None
    assert expert_parallel_refusal("tp", tp.rule("experts"), {"tensor": 1}, 6, 6) is None
    assert expert_parallel_refusal("tp", tp.rule("experts"), {"tensor": 4}, 6, 6) == (
        "enable_expert_parallel: sharding='tp': the 6 routed experts do not split evenly over the 4 ranks of its "
        "`experts` rule 'tensor'")
    assert "the 8 routed experts and their copies (11)" in expert_parallel_refusal("ep", "expert", {"expert": 4}, 8, 11)
    tp_ep = load_sharding_config("tp_ep")
    assert expert_parallel_refusal("tp_ep", tp_ep.rule("experts"), {"expert": 2, "tensor": 2}, 8, 8) is None


def test_a_mesh_that_does_not_fit_the_engines_devices_is_refused_before_loading(monkeypatch, tmp_path, capsys):
    """`-tp 3 --sharding tp_ep` (a mesh of 2 x N) or a config of fixed size on more devices: refused naming the
    option that chose the devices, by `LLM` before any weight is read and by `k3jax serve` before it listens (it
    listened, then said "start-up failed" from the weights' placement, naming no option)."""
    import jax

    import serve.shutdown
    from k3jax.cli import main
    from serve.data_parallel import load_options

    dev = jax.devices()[0]
    monkeypatch.setattr(jax, "devices", lambda *a: [dev] * 8)
    EngineConfig(tensor_parallel_size=4, sharding="tp_ep").check_mesh()  # expert 2 x tensor 2
    EngineConfig().check_mesh()
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=3: sharding config 'tp_ep': mesh .* cannot use 3 "):
        EngineConfig(tensor_parallel_size=3, sharding="tp_ep").check_mesh()
    with pytest.raises(ValueError, match=r"^devices=\[0, 1, 2\]: sharding config 'tp_ep'"):
        EngineConfig(devices=(0, 1, 2), sharding="tp_ep").check_mesh()
    two = tmp_path / "two.yaml"
    two.write_text("mesh: {tensor: 2}\nrules: {heads: tensor}\n")
    with pytest.raises(ValueError, match="needs 2 devices, 8 are available"):
        EngineConfig(sharding=str(two)).check_mesh()
    EngineConfig(sharding=str(two), tensor_parallel_size=2).check_mesh()
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=3: "):  # what LLM reads the weights with
        load_options(EngineConfig(tensor_parallel_size=3, sharding="tp_ep"))
    with pytest.raises(ValueError, match=r"^devices=\[0\]: sharding config 'tp_ep'"):  # a replica's group
        load_options(EngineConfig(sharding="tp_ep", tensor_parallel_size=1), data_parallel_size=2)

    def listened(*a, **k):
        raise AssertionError("the server listened")

    monkeypatch.setattr(serve.shutdown, "DrainingServer", listened)
    assert main(["serve", "--model", "tiny-k3", "-tp", "3", "--sharding", "tp_ep", "--no-compile-cache"]) == 2
    assert "tensor_parallel_size=3: sharding config 'tp_ep'" in capsys.readouterr().err
    assert main(["serve", "--model", "tiny-k3", "-dp", "2", "-tp", "1", "--sharding", "tp_ep",
                 "--no-compile-cache"]) == 2
    assert "devices=[0]: sharding config 'tp_ep'" in capsys.readouterr().err


def test_disaggregated_serve_options_name_what_is_wrong():
    from k3jax.cli import build_parser
    from serve.cli import DEFAULTS, disaggregation

    def opts(*argv):
        args = build_parser().parse_args(["serve", *argv])
        return {k: getattr(args, k, v) for k, v in DEFAULTS.items()}

    assert disaggregation(opts()) is None
    assert disaggregation(opts("--prefill-devices", "0,1", "--decode-devices", "3,2")) == ((0, 1), (3, 2))
    for argv, match in ((("--prefill-devices", "0"), "both --prefill-devices and --decode-devices"),
                        (("--prefill-devices", "0", "--decode-devices", "1", "-dp", "2"), "not with --data-parallel"),
                        (("--prefill-devices", "0", "--decode-devices", "1", "--no-prefix-caching"), "prefix caching"),
                        (("--prefill-devices", "0", "--decode-devices", "1", "--host-cache-mb", "8"), "host-cache-mb"),
                        (("--prefill-devices", "a", "--decode-devices", "1"), "--prefill-devices: expected"),
                        (("--prefill-devices", "0", "--decode-devices", "-1"), "--decode-devices: expected"),
                        (("--prefill-devices", "0", "--decode-devices", "1", "--kv-store-mb", "0"), "--kv-store-mb")):
        with pytest.raises(ValueError, match=match):
            disaggregation(opts(*argv))
    from serve.disaggregated import build_pair

    with pytest.raises(ValueError, match=r"prefill devices \[0\] and decode devices \[0, 1\] overlap"):
        build_pair(None, EngineConfig(), (0,), (0, 1), 1 << 20)
    with pytest.raises(ValueError, match="leave host_cache_bytes at 0"):
        build_pair(None, EngineConfig(host_cache_bytes=1 << 20), (0,), (1,), 1 << 20)


class _Replica:
    """What DataParallelEngine reads of an engine, with a scripted step: outputs, or a StepFailed."""

    def __init__(self, script):
        from types import SimpleNamespace
        self.sched_cfg, self.align, self.script, self.added = SimpleNamespace(max_num_seqs=8), 4, list(script), []

    def _prompt_ids(self, prompt):
        return None, list(prompt)

    def add_request(self, prompt, params, request_id, **kw):
        self.added.append(request_id)

    def has_unfinished(self):
        return bool(self.script)

    def step(self):
        got = self.script.pop(0)
        if isinstance(got, Exception):
            raise got
        return got


def test_a_failed_replica_step_loses_no_other_replicas_outputs():
    """One replica's step fails: the re-raised StepFailed names its ended requests and carries every output
    the others (and the failed one's successful part) produced, and the router stops counting them all."""
    from types import SimpleNamespace

    from serve.data_parallel import DataParallelEngine
    from serve.engine import StepFailed
    from serve.types import SamplingParams

    out = lambda rid, fin: SimpleNamespace(request_id=rid, finished=fin)
    bad = StepFailed(["b"], RuntimeError("device lost"), [out("d", True)])  # b's part failed, d's decode ran
    r0, r1 = _Replica([[out("a", True), out("c", False)]]), _Replica([bad])
    dp = DataParallelEngine([r0, r1], [(0,), (1,)], routing="load")
    for rid in "abcd":
        dp.add_request([ord(rid)] * 9, SamplingParams(max_tokens=1), rid)
    assert r0.added == ["a", "c"] and r1.added == ["b", "d"] and dp.router.load == [2, 2]
    with pytest.raises(StepFailed, match="device lost") as e:
        dp.step()
    assert e.value.request_ids == ["b"] and sorted(o.request_id for o in e.value.outputs) == ["a", "c", "d"]
    assert dp.router.load == [1, 0] and list(dp._where) == ["c"]  # only c still runs
    assert not e.value.own  # (a device failure: it counts towards an AsyncEngine's DEAD_AFTER_FAILURES)
    r0.script, r1.script = [StepFailed(["c"], ValueError("its bookkeeping"), own=True)], [[]]
    with pytest.raises(StepFailed, match="its bookkeeping") as e:
        dp.step()
    assert e.value.own  # only requests' own host-side work failed, on every failed replica
    # both fail in one step, differently: each replica's requests are told their own error, not the first's
    own = KeyError("f's own bookkeeping")
    r0.script = [StepFailed(["e"], RuntimeError("device lost on 0"))]
    r1.script = [StepFailed(["f", "g"], RuntimeError("device lost on 1"), causes={"f": own})]
    with pytest.raises(StepFailed) as e:
        dp.step()
    assert sorted(e.value.request_ids) == ["e", "f", "g"]
    assert [e.value.summary_of(r) for r in "efg"] == [
        "engine step failed (RuntimeError: device lost on 0)", "engine step failed (KeyError: \"f's own bookkeeping\")",
        "engine step failed (RuntimeError: device lost on 1)"]


def test_pause_aborts_on_every_replica_and_both_phases():
    """`abort_all` (the HTTP server's POST /pause) reaches every data-parallel replica and both engines of a
    disaggregated pair, and counts what each aborted."""
    import asyncio

    from serve.data_parallel import DataParallelAsyncEngine
    from serve.disaggregated import DisaggregatedAsyncEngine

    class Stub:
        def __init__(self, n):
            self.n, self.calls = n, 0

        async def abort_all(self):
            self.calls += 1
            return self.n

    dp = DataParallelAsyncEngine.__new__(DataParallelAsyncEngine)
    dp.replicas = [Stub(2), Stub(0), Stub(1)]
    pd = DisaggregatedAsyncEngine.__new__(DisaggregatedAsyncEngine)
    pd.prefill, pd.decode, pd._phase, pd._aborted = Stub(1), Stub(4), {}, set()
    assert asyncio.run(dp.abort_all()) == 3 and [r.calls for r in dp.replicas] == [1, 1, 1]
    assert asyncio.run(pd.abort_all()) == 5 and pd.prefill.calls == pd.decode.calls == 1


def test_replicas_and_pairs_answer_vllms_status_names():
    """vLLM's `AsyncLLM` status names (`is_running`, `errored`, `dead_error`, `check_health`, `get_tokenizer`) on
    data-parallel replicas and a disaggregated pair, as on one AsyncEngine: they serve while every part does, and
    a stopped part's error is theirs (the wrappers had only `alive`)."""
    import asyncio
    from types import SimpleNamespace

    from serve.async_engine import EngineDead
    from serve.data_parallel import DataParallelAsyncEngine
    from serve.disaggregated import DisaggregatedAsyncEngine

    def part(dead=None):
        return SimpleNamespace(is_running=dead is None, errored=dead is not None,
                               dead_error=EngineDead(dead or "the engine is not running"),
                               engine=SimpleNamespace(tokenizer="tok"))

    dp = DataParallelAsyncEngine.__new__(DataParallelAsyncEngine)
    pd = DisaggregatedAsyncEngine.__new__(DisaggregatedAsyncEngine)
    dp.replicas = [part(), part()]
    pd.prefill, pd.decode = part(), part()
    for eng in (dp, pd):
        assert eng.is_running and not eng.errored and asyncio.run(eng.get_tokenizer()) == "tok"
        asyncio.run(eng.check_health())
    dp.replicas[1] = part("the engine thread died: boom")
    pd.decode = part("the engine is shut down")
    for eng, why in ((dp, "thread died: boom"), (pd, "shut down")):
        assert not eng.is_running and eng.errored and why in str(eng.dead_error)
        with pytest.raises(EngineDead, match=why):
            asyncio.run(eng.check_health())


def test_disaggregated_pair_refuses_a_request_id_in_flight():
    """A second request under an id in flight on a disaggregated pair is refused before it runs anything, as
    `AsyncEngine` and the replicas refuse it; it used to run a prefill, then fail and take the first request's
    phase with it, so `abort(id)` no longer reached the first request (it ran on to its end)."""
    import asyncio
    from types import SimpleNamespace

    from serve.disaggregated import DisaggregatedAsyncEngine
    from serve.types import RequestError, SamplingParams

    def out(reason):
        return SimpleNamespace(finished=reason is not None,
                               outputs=[SimpleNamespace(finish_reason=reason, token_ids=[1], text="a")])

    class Phase:
        """An `AsyncEngine` stand-in: refuses ids in flight; prefill ends at once, decode runs until aborted."""

        def __init__(self, prefill):
            self.prefill, self.live, self.runs = prefill, {}, 0

        async def generate(self, prompt, params, rid, *args, on_accept=None):
            if rid in self.live:
                raise RequestError(f"request_id: {rid!r} is already in use")
            self.runs += 1
            stop = self.live[rid] = asyncio.Event()
            try:
                if self.prefill:
                    yield out("length")
                    return
                yield out(None)
                await stop.wait()
                yield out("abort")
            finally:
                del self.live[rid]

        def abort(self, rid):
            if rid in self.live:
                self.live[rid].set()

    pd = DisaggregatedAsyncEngine.__new__(DisaggregatedAsyncEngine)
    pd.prefill, pd.decode, pd._phase, pd._aborted = Phase(True), Phase(False), {}, set()

    async def main():
        first = pd.generate([1, 2, 3], SamplingParams(max_tokens=50), "x")
        await first.__anext__()  # decoding
        with pytest.raises(RequestError, match="already in use"):
            async for _ in pd.generate([1, 2, 3], SamplingParams(max_tokens=50), "x"):
                pass
        assert pd.prefill.runs == 1  # the refused request prefilled nothing
        pd.abort("x")
        last = await asyncio.wait_for(first.__anext__(), 5)
        assert last.outputs[0].finish_reason == "abort"
        await first.aclose()
        assert not pd._phase

    asyncio.run(main())


def test_abort_all_ends_a_request_between_the_pairs_phases():
    """`abort_all` (POST /pause, `abort_all_requests`) while a request's prefill has finished but its stream has not
    moved to the decode engine: neither engine holds it then, and it used to go on to decode every token (a pause
    waited for it); it ends with finish_reason "abort" instead, and the decode engine never runs it."""
    import asyncio
    from types import SimpleNamespace

    from serve.disaggregated import DisaggregatedAsyncEngine
    from serve.types import SamplingParams

    def out(reason):
        return SimpleNamespace(finished=reason is not None,
                               outputs=[SimpleNamespace(finish_reason=reason, token_ids=[1], text="a")])

    class Phase:
        """An `AsyncEngine` stand-in whose prefill finishes once `release` is set (its output then on the way)."""

        def __init__(self, prefill):
            self.prefill, self.runs = prefill, 0
            self.finished, self.release = asyncio.Event(), asyncio.Event()

        async def generate(self, prompt, params, rid, *args, on_accept=None):
            self.runs += 1
            if self.prefill:
                self.finished.set()
                await self.release.wait()
                yield out("length")
                return
            for _ in range(50):
                await asyncio.sleep(0)
                yield out(None)
            yield out("length")

        async def abort_all(self):
            return 0  # (nothing of the request is left on either engine)

    async def main():
        pd = DisaggregatedAsyncEngine.__new__(DisaggregatedAsyncEngine)
        pd.prefill, pd.decode, pd._phase, pd._aborted = Phase(True), Phase(False), {}, set()
        outs = []

        async def read():
            async for o in pd.generate([1, 2, 3], SamplingParams(max_tokens=50), "x"):
                outs.append(o)

        task = asyncio.ensure_future(read())
        await pd.prefill.finished.wait()
        assert await pd.abort_all() == 0
        pd.prefill.release.set()
        await asyncio.wait_for(task, 5)
        assert [o.outputs[0].finish_reason for o in outs] == ["abort"] and outs[0].outputs[0].token_ids == []
        assert pd.decode.runs == 0 and not pd._phase and not pd._aborted

    asyncio.run(main())


def test_replicas_draw_unseeded_requests_seeds_from_streams_of_their_own(monkeypatch):
    """Each replica's unseeded requests take their seeds from its own stream (config.seed + its index): with one
    seed everywhere the k-th unseeded request of every replica sampled the same tokens (an RL group's rollouts
    of one prompt, spread over the replicas, came back in identical pairs)."""
    import jax

    import serve.data_parallel as dp

    dev = jax.devices()[0]
    monkeypatch.setattr(jax, "devices", lambda *a: [dev] * 3)  # a 3-device host, as far as the config can tell
    monkeypatch.setattr(dp, "Engine", lambda model, config, **kw: config)  # what each replica is built with
    configs, groups = dp.build_replicas(None, EngineConfig(seed=7), 3, progress=False, warmup=False)
    assert [c.seed for c in configs] == [7, 8, 9] and [c.devices for c in configs] == groups == [(0,), (1,), (2,)]
    assert dp.build_replicas(None, EngineConfig(seed=None), 2, warmup=False)[0][1].seed is None  # (random anyway)


def test_sleep_and_weight_updates_change_every_replica_or_none():
    """A replica with requests in flight refuses sleep and weight updates before any replica changes: none is
    left asleep, or serving other weights than the others."""
    from serve.data_parallel import DataParallelEngine

    class Replica(_Replica):
        def __init__(self, busy):
            super().__init__([])
            self.busy, self.changed = busy, []

        def _check_idle(self, what):
            if self.busy:
                raise RuntimeError(f"{what}: 1 requests in flight (e.g. 'x'); finish or abort them first")

        def _change(self, what):
            self._check_idle(what)
            self.changed.append(what)

        def sleep(self, level, tags):
            self._change("sleep")

        def update_weights(self, model):
            self._change("update_weights")

        def update_weights_from_disk(self, path):
            self._change("update_weights_from_disk")

        def update_weights_from_tensor(self, named_tensors, flush_cache):
            self._change("update_weights_from_tensor")

    idle, busy = Replica(False), Replica(True)
    dp = DataParallelEngine([idle, busy], [(0,), (1,)])
    for what, call in (("sleep", lambda: dp.sleep(1)), ("update_weights", lambda: dp.update_weights(None)),
                       ("update_weights_from_disk", lambda: dp.update_weights_from_disk("/ckpt")),
                       ("update_weights_from_tensor", lambda: dp.update_weights_from_tensor([("w", None)]))):
        with pytest.raises(RuntimeError, match=f"{what}: 1 requests in flight"):
            call()
    assert idle.changed == [] == busy.changed
    busy.busy = False
    dp.sleep(1)
    assert idle.changed == ["sleep"] == busy.changed


def test_a_failed_step_under_llm_raises_its_own_error_with_replicas():
    """`LLM.generate` over data-parallel replicas: a failed step withdraws the other requests and raises the
    step's StepFailed (not an error of the clean-up), and every replica forgets the withdrawn requests."""
    from serve.data_parallel import DataParallelEngine
    from serve.engine import StepFailed
    from serve.llm import LLM
    from serve.types import SamplingParams

    class Replica(_Replica):
        def __init__(self, script):
            super().__init__(script)
            self.aborted, self.reaped = [], 0

        def abort(self, request_id):
            self.aborted.append(request_id)
            return True

        def _reap(self):
            self.reaped += 1

    r0, r1 = Replica([[]]), Replica([StepFailed(["b"], RuntimeError("device lost"), [])])
    llm = LLM.__new__(LLM)
    llm.engine, llm.progress = DataParallelEngine([r0, r1], [(0,), (1,)], routing="load"), False
    with pytest.raises(StepFailed, match="device lost"):
        llm.generate([[1] * 9, [2] * 9], SamplingParams(max_tokens=1))
    assert r0.aborted == r0.added and r0.reaped == r1.reaped == 1 and llm.engine.router.load == [0, 0]


def test_a_request_id_streaming_on_any_replica_is_refused():
    """DataParallelAsyncEngine.generate with a request_id already streaming (on whichever replica): refused before
    it is routed, so it neither runs beside the first on another replica nor takes the first's place in the map
    its abort goes by."""
    import asyncio

    from serve.data_parallel import DataParallelAsyncEngine, router_for
    from serve.types import RequestError, SamplingParams

    class Replica:  # an AsyncEngine whose streams run until cancelled
        engine = None  # (no prefix cache)

        def __init__(self):
            self.aborted = []

        async def generate(self, prompt, params, request_id, *args, on_accept=None):
            await asyncio.sleep(3600)
            yield request_id

        def abort(self, request_id):
            self.aborted.append(request_id)

    async def main():
        dp = DataParallelAsyncEngine.__new__(DataParallelAsyncEngine)
        dp.replicas, dp.engine, dp._where = [Replica(), Replica()], object(), {}
        dp.router = router_for([_Replica([]), _Replica([])], "load")
        first = asyncio.ensure_future(dp.generate([1, 2, 3], SamplingParams(), "x").__anext__())
        await asyncio.sleep(0.01)
        assert dp.router.load == [1, 0] and dp._where == {"x": 0}
        with pytest.raises(RequestError, match="request_id: 'x' is already in use"):
            await asyncio.wait_for(dp.generate([4, 5], SamplingParams(), "x").__anext__(), 5)
        assert dp.router.load == [1, 0] and dp._where == {"x": 0}
        dp.abort("x")
        assert dp.replicas[0].aborted == ["x"] and dp.replicas[1].aborted == []
        first.cancel()

    asyncio.run(main())


def test_an_adapter_is_loaded_on_every_replica_or_none():
    """Past max_cpu_loras each replica drops its own least recently used idle adapter: when one replica has none
    idle (its running requests use every held adapter) the load is refused before any replica loads it. It used to load
    on the others first, which then served it alone and refused it again as "loaded already"."""
    from types import SimpleNamespace

    from serve.data_parallel import DataParallelEngine
    from serve.engine import Engine
    from serve.lora import LoRAError, LoRARequest, Registry

    class Replica(_Replica):
        _lora_room, _canonical_rids, list_loras = Engine._lora_room, Engine._canonical_rids, Engine.list_loras
        _running_adapters = Engine._running_adapters

        def __init__(self):
            super().__init__([])
            self.config, self.loras = SimpleNamespace(max_loras=1), Registry(1, 4, 2)
            self.seqs = self._running = {}  # (every request here runs: in a slot)
            for name in "ab":
                self.loras.add(name, f"/adapters/{name}", 4, {})

        def add_lora(self, req):  # Engine._load_adapter's bookkeeping, no factors
            victim = self._lora_room(req.lora_name)
            if victim is not None:
                self.loras.drop(victim)
            return self.loras.add(req.lora_name, req.lora_path, 4, {})

    idle, busy = Replica(), Replica()
    for name in "ab":  # a request running (in a slot) on each of its adapters
        busy.seqs[f"r-{name}"] = SimpleNamespace(lora=busy.loras.get(name), slot=0, finished=False, internal=False)
    dp = DataParallelEngine([idle, busy], [(0,), (1,)])
    with pytest.raises(LoRAError, match="none can be dropped"):
        dp.add_lora(LoRARequest("c", 3, "/adapters/c"))
    assert idle.list_loras() == ["a", "b"] == busy.list_loras()
    for name in "ab":
        busy.seqs[f"r-{name}"].finished = True
    dp.add_lora(LoRARequest("c", 3, "/adapters/c"))  # now each drops one
    assert idle.list_loras() == ["a", "b", "c"] == busy.list_loras()
