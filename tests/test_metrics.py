"""/metrics against vLLM v1's `vllm:*` semantics, with stand-in engines (no model, no compile)."""

from prometheus_client.parser import text_string_to_metric_families

from recording_engine import Recorder, post_then_scrape
from serve.types import RequestError


def _post_then_scrape(engine, body: dict) -> tuple:
    """POST `body` to /v1/completions of an app over `engine`, then GET /metrics -> (response, {(sample name,
    labels without model_name and engine): value})."""
    r, text = post_then_scrape(engine, body)
    samples = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))):
               s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return r, samples


class _Refuses(Recorder):
    """Refuses every request as the engine's validation does (before queueing it)."""

    async def generate(self, prompt, params, request_id, priority=0, on_accept=None, **kw):
        raise RequestError("bad_words: this model has no tokenizer")
        yield


def test_a_request_the_engine_refuses_is_no_aborted_request():
    """A request the engine refuses (a 400) never ran: vLLM counts no finished request for it. Its n samples were
    counted as `vllm:request_success{finished_reason="abort"}`."""
    r, samples = _post_then_scrape(_Refuses(max_model_len=64), {"prompt": [1, 2], "n": 2, "max_tokens": 2})
    assert r.status_code == 400
    assert samples[("vllm:request_success_total", (("finished_reason", "abort"),))] == 0


def test_a_refused_request_is_logged_as_rejected_not_aborted():
    """--enable-log-requests said "finished (abort)" for a request the engine refused with a 400 (the client aborted
    nothing): it is "rejected"."""
    import asyncio

    import httpx

    from serve.api import create_app

    lines = []
    app = create_app(_Refuses(max_model_len=64), "m", request_log=lines.append)

    async def go(body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/v1/completions", json=body)

    for stream in (False, True):
        r = asyncio.run(go({"prompt": [1, 2], "n": 2, "max_tokens": 2, "stream": stream}))
        assert r.status_code == 400
        assert " finished (rejected): 0 tokens" in lines[-1], lines


class _TwoSamples(Recorder):
    """Streams an n = 2 request's deltas: both samples' first tokens, then sample 0 ends at its length (2 tokens),
    then sample 1 at a stop (3 tokens)."""

    async def generate(self, prompt, params, request_id, priority=0, on_accept=None, **kw):
        from serve.types import CompletionOutput, RequestOutput

        on_accept()
        steps = [[(0, [1], None), (1, [2], None)], [(0, [3], "length"), (1, [4], None)], [(1, [5], "stop")]]
        for k, step in enumerate(steps):
            outs = [CompletionOutput(j, "", ids, reason) for j, ids, reason in step]
            yield RequestOutput(request_id, None, list(prompt), outs, finished=k == len(steps) - 1)


def test_request_parameter_histograms():
    """vLLM's `vllm:request_params_max_tokens` (each finished sample's max_tokens), `vllm:request_params_n` and
    `vllm:request_max_num_generation_tokens` (once per prompt when its samples all ended: n, the longest sample's
    tokens; the dashboard's "Max Generation Token in Sequence Group"), in vLLM's expected metrics: they were missing."""
    r, samples = _post_then_scrape(_TwoSamples(max_model_len=64), {"prompt": [[5, 6], [7]], "n": 2, "max_tokens": 3})
    assert r.status_code == 200, r.text
    want = {"request_params_max_tokens": (4, 12), "request_params_n": (2, 4), "request_max_num_generation_tokens": (2, 6)}
    for h, (count, total) in want.items():
        assert (samples[(f"vllm:{h}_count", ())], samples[(f"vllm:{h}_sum", ())]) == (count, total), h
    assert samples[("vllm:request_params_n_bucket", (("le", "2.0"),))] == 2
    assert samples[("vllm:request_params_n_bucket", (("le", "1.0"),))] == 0


def test_token_histogram_buckets_follow_the_context_window():
    """vLLM's per-request token histograms have 1-2-5 bucket edges up to max_model_len (`build_1_2_5_buckets`):
    a 64-token window gives 1 ... 50. The edges were fixed at 1 ... 100000, whatever the window (a 256k window's
    longest prompts all fell in +Inf)."""
    from serve.metrics import ServerMetrics, token_buckets

    _, samples = _post_then_scrape(_TwoSamples(max_model_len=64), {"prompt": [5, 6], "n": 2, "max_tokens": 3})
    for h in ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens",
              "request_max_num_generation_tokens"):
        edges = [dict(labels)["le"] for name, labels in samples if name == f"vllm:{h}_bucket"]
        assert edges == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "+Inf"], (h, edges)
    assert token_buckets(262144)[-3:] == (50000, 100000, 200000) and token_buckets(100)[-1] == 100
    m = ServerMetrics("m", dict, dict, max_model_len=1000)
    assert "vllm:request_prompt_tokens_bucket{engine=\"0\",le=\"1000.0\"" in m.exposition().decode()


class _StepFails(Recorder):
    """Accepts the request, streams each sample's first token, then fails as a raising engine step does."""

    async def generate(self, prompt, params, request_id, priority=0, on_accept=None, **kw):
        from serve.types import CompletionOutput, RequestOutput

        on_accept()
        yield RequestOutput(request_id, None, list(prompt),
                            [CompletionOutput(j, "", [1], None) for j in range(params.n)])
        raise RuntimeError("step failed")


def test_samples_a_failed_step_ended_finish_with_error():
    """vLLM's finish reasons are stop, length, abort, error and repetition, each a `vllm:request_success` series;
    a request an engine failure ended is an "error". Its samples were counted as "abort" and the "error" and
    "repetition" series were missing."""
    r, samples = _post_then_scrape(_StepFails(max_model_len=64), {"prompt": [1, 2], "n": 2, "max_tokens": 4,
                                                                  "stream": True})
    assert r.status_code == 200 and '"internal_error"' in r.text
    success = {dict(labels)["finished_reason"]: v for (name, labels), v in samples.items()
               if name == "vllm:request_success_total"}
    assert success == {"stop": 0, "length": 0, "abort": 0, "error": 2, "repetition": 0}


class _Timed(Recorder):
    """An n = 2 request whose steps the engine timed at 10.0, 10.5 and 11.5 s: sample 0 ends at its second token,
    sample 1 at its third; 1 of the prompt's tokens came from the prefix cache."""

    async def generate(self, prompt, params, request_id, priority=0, on_accept=None, **kw):
        from serve.types import CompletionOutput, RequestMetrics, RequestOutput

        on_accept()
        steps = [(10.0, [(0, [1], None), (1, [2], None)]), (10.5, [(0, [3], "length"), (1, [4], None)]),
                 (11.5, [(1, [5], "stop")])]
        for k, (t, step) in enumerate(steps):
            metrics = RequestMetrics(arrival_time=9.0, first_scheduled_time=9.5, first_token_time=10.0,
                                     last_token_time=t)
            outs = [CompletionOutput(j, "", ids, reason) for j, ids, reason in step]
            yield RequestOutput(request_id, None, list(prompt), outs, finished=k == len(steps) - 1, metrics=metrics,
                                num_cached_tokens=1)


def test_request_tpot_prefill_computed_tokens_and_sleep_state():
    """vLLM v1's `vllm:request_time_per_output_token_seconds` (each finished sample's decode time over its tokens
    after the first), `vllm:request_prefill_kv_computed_tokens` (prompt tokens not taken from the prefix cache) and
    `vllm:engine_sleep_state` (1 on awake / weights_offloaded / discard_all): they were missing."""
    from serve.metrics import ServerMetrics

    r, samples = _post_then_scrape(_Timed(max_model_len=64), {"prompt": [5, 6, 7], "n": 2, "max_tokens": 3})
    assert r.status_code == 200, r.text
    tpot = "vllm:request_time_per_output_token_seconds"
    assert (samples[(f"{tpot}_count", ())], samples[(f"{tpot}_sum", ())]) == (2, 0.5 / 1 + 1.5 / 2)
    kv = "vllm:request_prefill_kv_computed_tokens"
    assert (samples[(f"{kv}_count", ())], samples[(f"{kv}_sum", ())]) == (2, 2 * (3 - 1))
    assert samples[("vllm:engine_sleep_state", (("sleep_state", "awake"),))] == 1
    asleep = ServerMetrics("m", lambda: {"sleep_level": 2}, dict).exposition().decode()
    assert 'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="discard_all"} 1.0' in asleep
    assert 'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 0.0' in asleep


def test_every_series_has_vllms_model_name_and_engine_labels():
    """vLLM v1 labels its series `model_name` and `engine` (the engine's index, "0" for one engine): queries and
    dashboards written for vLLM select or group by both. Ours had no `engine` label."""
    from serve.metrics import ServerMetrics

    stats = {"expert_counts": [[1, 2]], "cache_config": {"block_size": 16}, "max_loras": 1, "lora_requests": {},
             "replicas": [{"num_requests_running": 1}], "spec_decode_accepted_per_pos": [1]}
    text = ServerMetrics("m", lambda: stats, dict, max_model_len=64).exposition().decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert len(samples) > 300
    assert all(s.labels.get("model_name") == "m" and s.labels.get("engine") == "0" for s in samples), [
        s for s in samples if s.labels.get("engine") != "0"][:3]


def test_unset_max_tokens_is_observed_as_the_rest_of_the_context():
    """A request without max_tokens may generate up to the context window's end: vLLM's server resolves it to that
    (max_model_len - prompt tokens) and `vllm:request_params_max_tokens` observes it. It was not observed at all."""
    r, samples = _post_then_scrape(Recorder(max_model_len=64), {"prompt": [1, 2, 3], "max_tokens": None})
    assert r.status_code == 200, r.text
    h = "vllm:request_params_max_tokens"
    assert (samples[(f"{h}_count", ())], samples[(f"{h}_sum", ())]) == (1, 64 - 3)


class _Speculative(Recorder):
    """Streams a sample as speculative decoding steps it: its first token, then 3 tokens (2 drafts accepted), then
    2 (1 accepted, and the end)."""

    async def generate(self, prompt, params, request_id, priority=0, on_accept=None, **kw):
        from serve.types import CompletionOutput, RequestOutput

        on_accept()
        steps = [([1], None), ([2, 3, 4], None), ([5, 6], "length")]
        for k, (ids, reason) in enumerate(steps):
            yield RequestOutput(request_id, None, list(prompt), [CompletionOutput(0, "", ids, reason)],
                                finished=k == len(steps) - 1)


def test_inter_token_latency_is_observed_once_per_step_output():
    """vLLM observes `vllm:inter_token_latency_seconds` once per engine output of a sample (the gap since its last
    one), however many tokens a speculative step accepted. Ours split each gap into one sample per token (5 samples
    of a fraction of the gap here, not 2), so accepted drafts showed as latency that no client waited for."""
    r, samples = _post_then_scrape(_Speculative(max_model_len=64), {"prompt": [1, 2], "max_tokens": 6,
                                                                    "stream": True})
    assert r.status_code == 200, r.text
    assert samples[("vllm:inter_token_latency_seconds_count", ())] == 2
    assert samples[("vllm:request_generation_tokens_sum", ())] == 6


class _TwoReplicas(Recorder):
    """Two data-parallel replicas as the server sees them (`DataParallelAsyncEngine`'s names): a request's prompt k
    runs on replica k % 2, and each replica reports its own statistics beside the merged ones."""

    data_parallel_size = 2

    def engine_index(self, request_id: str) -> int:
        return int(request_id.rsplit("-", 1)[1]) % 2

    def replica_stats(self) -> list:
        return [{"num_requests_running": 1, "generation_tokens": 3}, {"num_requests_running": 2, "generation_tokens": 5}]

    def stats(self) -> dict:
        return {"num_requests_running": 3, "generation_tokens": 8, "replicas": [{"num_requests_running": 1},
                                                                                {"num_requests_running": 2}]}


def test_data_parallel_replicas_are_vllms_engines():
    """vLLM labels each data-parallel engine's series with its index (engine="0", engine="1"): its scheduler gauges
    and token counters, and the request histograms and finish reasons of the requests it served. Ours put every
    replica's totals and every request under engine="0", so a dashboard grouped by engine saw one engine."""
    r, text = post_then_scrape(_TwoReplicas(max_model_len=64), {"prompt": [[1, 2], [3], [4]], "max_tokens": 1})
    assert r.status_code == 200, r.text
    families = list(text_string_to_metric_families(text))
    assert len({f.name for f in families}) == len(families)  # one family per name, every engine's samples in it
    got = {(s.name, s.labels["engine"], s.labels.get("finished_reason", s.labels.get("replica"))): s.value
           for f in families for s in f.samples}
    for engine, running, generated, served in (("0", 1, 3, 2), ("1", 2, 5, 1)):
        assert got["vllm:num_requests_running", engine, None] == running
        assert got["vllm:generation_tokens_total", engine, None] == generated
        assert got["vllm:time_to_first_token_seconds_count", engine, None] == served
        assert got["vllm:request_success_total", engine, "length"] == served
        assert got["vllm:request_success_total", engine, "abort"] == 0
    # the router's and the front end's series stay engine "0"
    assert got["k3jax:replica_requests_running", "0", "1"] == 2 and got["k3jax:engine_ready", "0", None] == 1
    assert not any(e == "1" for name, e, _ in got if name.startswith("k3jax:replica_"))


class _Burst(Recorder):
    """Streams 20 one-token outputs of a sample without awaiting: far faster than the server reads them, so they
    coalesce unread (`serve.api._Unread`)."""

    async def generate(self, prompt, params, request_id, priority=0, on_accept=None, **kw):
        from serve.types import CompletionOutput, RequestOutput

        on_accept()
        for k in range(20):
            end = "length" if k == 19 else None
            yield RequestOutput(request_id, None, list(prompt), [CompletionOutput(0, "", [1], end)],
                                finished=end is not None)


def test_inter_token_latency_counts_every_output_a_slow_reader_merged():
    """The engine's outputs a reader has not taken yet coalesce, but vLLM's inter-token latency is the engine's: one
    observation per output as it arrives (19 gaps of 20 outputs here), whatever the client's speed. It was observed
    as the server read the merged output: none here (one output read), a stalled client's dashboard showed no ITL."""
    for stream in (True, False):
        r, samples = _post_then_scrape(_Burst(max_model_len=64), {"prompt": [1, 2], "max_tokens": 20,
                                                                  "stream": stream})
        assert r.status_code == 200, r.text
        assert samples[("vllm:inter_token_latency_seconds_count", ())] == 19, stream
        assert samples[("vllm:request_generation_tokens_sum", ())] == 20


def test_end_to_end_latency_ends_when_the_last_output_arrives_not_when_it_is_read(monkeypatch):
    """vLLM's `e2e_request_latency` is the engine's: arrival to the finishing output. It was taken when the server
    read that output, so a client that reads late (here: 5 s pass on the server's clock between the outputs' arrival
    and the reading of them) showed its own slowness as the request's latency."""
    import time as real_time
    import types

    import serve.api

    late = {"offset": 0.0}
    clock = types.SimpleNamespace(**{k: getattr(real_time, k) for k in ("time", "perf_counter", "sleep")},
                                  monotonic=lambda: real_time.monotonic() + late["offset"])
    monkeypatch.setattr(serve.api, "time", clock)
    observe = serve.api._Run._observe

    def read_late(self, i, out):
        late["offset"] = 5.0  # every output has arrived (the burst yields without awaiting): the reader is late
        return observe(self, i, out)

    monkeypatch.setattr(serve.api._Run, "_observe", read_late)
    r, samples = _post_then_scrape(_Burst(max_model_len=64), {"prompt": [1, 2], "max_tokens": 20})
    assert r.status_code == 200, r.text
    assert samples[("vllm:e2e_request_latency_seconds_count", ())] == 1
    assert samples[("vllm:e2e_request_latency_seconds_sum", ())] < 5.0


class _Phase(Recorder):
    """One engine of a disaggregated pair as `DisaggregatedAsyncEngine` drives it (an `AsyncEngine`'s names)."""

    def __init__(self, stats: dict):
        super().__init__(max_model_len=64)
        self._stats = stats

    def stats(self) -> dict:
        return self._stats

    async def generate(self, prompt, params, request_id, priority=0, cache_salt=None, lora_request=None,
                       on_accept=None):
        async for out in super().generate(prompt, params, request_id, priority, on_accept=on_accept or (lambda: None)):
            yield out


def test_a_disaggregated_pair_exports_both_engines():
    """A disaggregated pair's /metrics: the decode engine's series (and the requests') as engine="0", as one
    engine's; the prefill engine's as engine="prefill" (vLLM labels each engine's series). The prefill engine's
    were in `stats()["prefill_engine"]` alone: a dashboard saw no prefill queue, cache or tokens."""
    from serve.disaggregated import DisaggregatedAsyncEngine

    pd = DisaggregatedAsyncEngine.__new__(DisaggregatedAsyncEngine)
    pd.prefill = _Phase({"num_requests_waiting": 3, "prompt_tokens": 40, "kv_cache_usage": 0.5})
    pd.decode = _Phase({"num_requests_running": 2, "generation_tokens": 7})
    pd.engine, pd._phase, pd._aborted = pd.decode.engine, {}, set()
    r, text = post_then_scrape(pd, {"prompt": [1, 2], "max_tokens": 1})
    assert r.status_code == 200, r.text
    families = list(text_string_to_metric_families(text))
    assert len({f.name for f in families}) == len(families)
    got = {(s.name, s.labels["engine"]): s.value for f in families for s in f.samples if len(s.labels) == 2}
    assert got["vllm:num_requests_running", "0"] == 2 and got["vllm:generation_tokens_total", "0"] == 7
    assert got["vllm:num_requests_waiting", "prefill"] == 3 and got["vllm:prompt_tokens_total", "prefill"] == 40
    assert got["vllm:kv_cache_usage_perc", "prefill"] == 0.5 and got["vllm:num_requests_running", "prefill"] == 0
    assert got["vllm:time_to_first_token_seconds_count", "0"] == 1 and got["k3jax:engine_ready", "0"] == 1
    assert not any(e == "prefill" and n.startswith(("vllm:time_to_first", "k3jax:engine_ready")) for n, e in got)
