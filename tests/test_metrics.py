"""/metrics against vLLM v1's `vllm:*` semantics, with stand-in engines (no model, no compile)."""

from prometheus_client.parser import text_string_to_metric_families

from recording_engine import Recorder, post_then_scrape
from serve.types import RequestError


def _post_then_scrape(engine, body: dict) -> tuple:
    """POST `body` to /v1/completions of an app over `engine`, then GET /metrics -> (response, {(sample name,
    labels without model_name): value})."""
    r, text = post_then_scrape(engine, body)
    samples = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
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
    assert "vllm:request_prompt_tokens_bucket{le=\"1000.0\"" in m.exposition().decode()
