"""Prometheus metrics for the HTTP server (prometheus-client).

Two sources, one registry per app (so several apps can live in one process, e.g. in tests):

* frontend measurements, taken in the event loop as outputs reach the API (vLLM's design: request
  timing is bookkept off the engine's hot loop): time to first token, inter-token latency, end-to-end
  latency, queue time, prefill / decode / inference time, per-request token counts, finished requests by
  reason, HTTP rejections;
* an `EngineCollector` that reads `engine.stats()` at scrape time: running/waiting requests, token
  counters, prefix cache, arena usage split into KDA state slots and MLA pages, per-expert token
  counts, MoE dispatch time, inter-rank bytes, compiles after warm-up.

vLLM's names are used where vLLM has the metric (so existing dashboards work); K3-specific ones are
`k3jax:*`. Every metric family is always exported (possibly with no samples or zero values), so a
scrape before warm-up or on an engine that does not report some statistic still lists the family.

Engine statistics read (all optional; absent means 0 / no samples):
  num_requests_running, num_requests_waiting, kv_cache_usage, prompt_tokens, prompt_tokens_cached, generation_tokens,
  preemptions, requests_retracted, requests_aborted, failed_steps, requests_failed, cache_resets, compiles_after_warmup,
  arena_bytes{kda_slots, mla_pages, free, total}, arena_free_units, arena_baseline_free_units,
  arena_cached_units (held only by the prefix cache, reclaimable),
  prefix_cache{query_tokens, hit_tokens, kda_hits, kda_misses, kda_checkpoint_bytes, host_query_tokens,
  host_hit_tokens, host_bytes, host_bytes_restored} (token counts for queries/hits, like vLLM: those of new
  requests, not of preempted ones readmitted; `queries`/`hits` and `kda_checkpoint_hits/misses` are read as fallbacks),
  expert_counts (one sequence of per-expert token counts per MoE layer, or {layer: counts}) with
  moe_layers (the model layer index of each row; the row ordinal is used without it),
  moe_dispatch_seconds, inter_rank_bytes, structured_output_requests, structured_output_errors,
  structured_output_mask_seconds, iteration_tokens{counts{le: steps in that bucket alone, not cumulative}, sum}.
"""

from __future__ import annotations

import operator
import time
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Mapping, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from serve.series import ITERATION_TOKEN_BUCKETS, BucketCounts

__all__ = ["ServerMetrics", "EngineCollector", "CONTENT_TYPE_LATEST", "NAMES"]

# Bucket edges follow vLLM's (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


def token_buckets(max_model_len) -> tuple:
    """vLLM's bucket edges for per-request token counts (`build_1_2_5_buckets(max_model_len)`): 1, 2, 5, 10, 20,
    ... up to the context window; `_TOKEN_BUCKETS` while the window is not known."""
    try:
        max_model_len = operator.index(max_model_len)
    except TypeError:
        return _TOKEN_BUCKETS
    if max_model_len < 1:
        return _TOKEN_BUCKETS
    return tuple(m * 10 ** e for e in range(len(str(max_model_len))) for m in (1, 2, 5) if m * 10 ** e <= max_model_len)


_N_BUCKETS = (1, 2, 5, 10, 20)

# vLLM's labels on every series: the served model's name and the engine ("0" for one engine; data-parallel replicas
# are engines "0", "1", ... as vLLM's DP ranks: each replica's engine statistics and the requests it served; the
# router's and the HTTP front end's series are engine "0")
LABELS = ["model_name", "engine"]
ENGINE = "0"

# vLLM's finish reasons (`FINISH_REASON_STRINGS`), each a `vllm:request_success` series from the start: "error" is a
# request a failed step ended; "repetition" (vLLM's hallucination guard) stays 0 here
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

# Every metric family name as it appears in the exposition (counters with their `_total` suffix).
NAMES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds", "vllm:iteration_tokens_total",
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens",
    "vllm:request_params_n", "vllm:request_params_max_tokens", "vllm:request_time_per_output_token_seconds",
    "vllm:request_prefill_kv_computed_tokens", "vllm:engine_sleep_state",
    "vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
    "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    "k3jax:expert_tokens_total", "k3jax:moe_dispatch_seconds_total", "k3jax:inter_rank_bytes_total",
    "k3jax:eplb_rebalances_total", "k3jax:expert_load_imbalance",
    "k3jax:kda_slot_usage_perc", "k3jax:mla_page_usage_perc", "k3jax:kda_slot_bytes", "k3jax:mla_page_bytes",
    "k3jax:arena_bytes", "k3jax:arena_free_units", "k3jax:arena_baseline_free_units", "k3jax:arena_cached_units",
    "k3jax:kda_checkpoint_bytes", "k3jax:host_cache_bytes", "k3jax:host_cache_restored_bytes_total",
    "k3jax:kda_checkpoint_hits_total", "k3jax:kda_checkpoint_misses_total", "k3jax:compiles_after_warmup",
    "k3jax:requests_aborted_total", "k3jax:failed_steps_total", "k3jax:requests_failed_total",
    "k3jax:cache_resets_total", "k3jax:structured_output_requests_total",
    "k3jax:structured_output_errors_total", "k3jax:structured_output_mask_seconds_total", "k3jax:engine_ready", "k3jax:api_requests_in_flight",
    "k3jax:api_sequences_in_flight", "k3jax:api_paused", "k3jax:api_requests_held", "k3jax:http_requests_rejected_total", "k3jax:retractions_total",
    "k3jax:requests_retracted_total",
    "k3jax:new_token_ratio", "k3jax:engine_sleep_level", "k3jax:replica_requests_running",
    "k3jax:replica_requests_waiting", "k3jax:replica_kv_cache_usage_perc", "k3jax:data_parallel_routed_total",
)


def _num(x: Any, default: float = 0.0) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return default
    return v if v == v else default  # NaN -> default


def _first(d: Mapping, *keys, default=0.0):
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return default


def _iteration_tokens(it, model: str, engine: str = ENGINE) -> HistogramMetricFamily:
    """vLLM's `vllm:iteration_tokens_total` (a histogram, whatever its name) from the engine's per-bucket counts
    (zeros in vLLM's buckets when the engine reports none)."""
    h = HistogramMetricFamily("vllm:iteration_tokens_total", "Tokens per engine step (prompt and decode rows').",
                              labels=LABELS)
    if not (isinstance(it, Mapping) and isinstance(it.get("counts"), Mapping) and it["counts"]):
        it = BucketCounts(ITERATION_TOKEN_BUCKETS).as_dict()
    buckets, total = [], 0.0
    for le, n in sorted(it["counts"].items(), key=lambda kv: float(kv[0])):  # cumulative, as Prometheus's
        total += _num(n)
        buckets.append((le, total))
    h.add_metric([model, engine], buckets, _num(it.get("sum")))
    return h


def _sleep_state(level, model: str, engine: str = ENGINE) -> GaugeMetricFamily:
    """vLLM's `vllm:engine_sleep_state`: 1 on the state the engine is in (awake, weights_offloaded: sleep level 1,
    discard_all: level 2), 0 on the others."""
    level = int(_num(level))
    g = GaugeMetricFamily("vllm:engine_sleep_state", "Engine sleep state: awake, weights_offloaded (sleep level 1) "
                          "or discard_all (level 2) is 1.", labels=LABELS + ["sleep_state"])
    for state, at in (("awake", 0), ("weights_offloaded", 1), ("discard_all", 2)):
        g.add_metric([model, engine, state], float(level == at))
    return g


def _one_sample_families(label_values: list) -> tuple[Callable, Callable]:
    """The collector's `gauge(name, doc, value, labels=None, extra_values=None)` and `counter(name, doc, value)`:
    a family of one sample, `value` read as `_num` reads it, labelled `LABELS` = `label_values` (then `labels` =
    `extra_values` where given)."""
    def gauge(name, doc, value, labels=None, extra_values=None):
        g = GaugeMetricFamily(name, doc, labels=LABELS + (labels or []))
        g.add_metric(label_values + (extra_values or []), _num(value))
        return g

    def counter(name, doc, value):
        c = CounterMetricFamily(name, doc, labels=LABELS)
        c.add_metric(label_values, _num(value))
        return c
    return gauge, counter


def engine_labels(each) -> list[tuple[str, Any]]:
    """Engines' statistics -> (`engine` label, statistics) pairs: a list is labelled by index ("0", "1", ...: data-
    parallel replicas), a mapping by its keys (a disaggregated pair: "0" decode, "prefill")."""
    if isinstance(each, Mapping):
        return [(str(label), s) for label, s in each.items()]
    return [(str(i), s) for i, s in enumerate(each)]


class EngineCollector:
    """Reads the engine's statistics at scrape time (a custom prometheus collector). `each`: each engine's own
    statistics (data-parallel replicas: a list, their series then carry engine "0", "1", ...; a disaggregated pair:
    {"0": decode, "prefill": prefill}; [] or None: one engine)."""

    def __init__(self, stats: Callable[[], dict], model_name: str, frontend: Callable[[], dict],
                 each: Optional[Callable[[], list]] = None):
        self._stats, self._model, self._frontend, self._each = stats, model_name, frontend, each

    def describe(self):  # no describe-time scrape (stats may not exist yet)
        return []

    def collect(self) -> Iterable:
        s = self._stats() or {}
        each = (self._each() if self._each is not None else None) or [s]
        families: dict[str, Any] = {}  # one family per name, its samples every engine's
        for label, es in engine_labels(each):
            for fam in self._engine_families(es or {}, label):
                if fam.name in families:
                    families[fam.name].samples.extend(fam.samples)
                else:
                    families[fam.name] = fam
        yield from families.values()
        yield from self._group_families(s, self._frontend() or {})

    def _engine_families(self, s: Mapping, engine: str) -> Iterable:
        """The series of one engine's statistics, labelled with its index."""
        m, L = self._model, LABELS
        mv = [m, engine]  # the values of L
        gauge, counter = _one_sample_families(mv)

        yield gauge("vllm:num_requests_running", "Sequences holding a state slot (prefilling or decoding).",
                    s.get("num_requests_running", 0))
        yield gauge("vllm:num_requests_waiting", "Sequences waiting for a state slot.",
                    s.get("num_requests_waiting", 0))
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of the cache arena requests hold (MLA pages + KDA slots; "
                    "units only the prefix cache holds count as free, as vLLM's), 0-1.",
                    s.get("kv_cache_usage", 0.0))
        yield counter("vllm:prompt_tokens", "Prompt tokens prefilled (per sequence, counted when its prefill ends, "
                      "cached ones included, as vLLM's).", s.get("prompt_tokens", 0))
        yield counter("vllm:prompt_tokens_cached", "Of those, tokens taken from the prefix cache (device and host "
                      "tiers) when the sequence was first admitted.", s.get("prompt_tokens_cached", 0))
        yield counter("vllm:generation_tokens", "Generated tokens.", s.get("generation_tokens", 0))
        yield counter("vllm:num_preemptions", "Sequences preempted (recomputed later).", s.get("preemptions", 0))
        yield counter("k3jax:retractions", "Preemptions because decodes ran out of pages (the admission "
                      "look-ahead's estimate was too low).", s.get("retractions", 0))
        yield counter("k3jax:requests_retracted", "Requests a pause kept open without their cache (retract / keep: "
                      "recomputed under the weights served when generation continues).", s.get("requests_retracted", 0))
        yield gauge("k3jax:new_token_ratio", "Share of their remaining max_tokens that admission reserves for "
                    "running requests (SGLang's adaptive new-token ratio; 0: no look-ahead).",
                    s.get("new_token_ratio", 0.0))
        cc = s.get("cache_config")
        if isinstance(cc, Mapping) and cc:  # vLLM's cache_config_info: the configuration as labels, value 1
            keys = sorted(cc)
            yield gauge("vllm:cache_config_info", "The cache's configuration (labels: block_size is the MLA page size "
                        "in tokens, num_gpu_blocks the arena's units, each a page or a share of a KDA state slot).",
                        1.0, keys, ["" if cc[k] is None else str(cc[k]) for k in keys])
        yield gauge("k3jax:engine_sleep_level", "0 awake; 1 or 2 while the engine's device memory is released "
                    "(sleep mode).", s.get("sleep_level", 0))
        yield _sleep_state(s.get("sleep_level", 0), m, engine)
        # LoRA (vLLM's lora_requests_info: the adapters with running / waiting requests, as labels)
        lr = s.get("lora_requests") or {}
        if isinstance(lr, Mapping) and s.get("max_loras"):
            running = ",".join(sorted(n for n, c in lr.items() if c.get("running")))
            waiting = ",".join(sorted(n for n, c in lr.items() if c.get("waiting")))
            yield gauge("vllm:lora_requests_info", "LoRA adapters in use (labels); the value is the scrape time.",
                        time.time(), ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
                        [running, waiting, str(s.get("max_loras"))])
            per = GaugeMetricFamily("k3jax:lora_requests_running", "Sequences running with each loaded LoRA "
                                    "adapter.", labels=L + ["lora_name"])
            for n, c in sorted(lr.items()):
                per.add_metric(mv + [n], _num(c.get("running", 0)))
            yield per
        # speculative decoding (serve/speculative.py): vLLM's names
        yield counter("vllm:spec_decode_num_drafts", "Decode rows that carried drafts.", s.get("spec_decode_num_drafts", 0))
        yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.",
                      s.get("spec_decode_num_draft_tokens", 0))
        yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      s.get("spec_decode_num_accepted_tokens", 0))
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.", labels=L + ["position"])
        for i, n in enumerate(s.get("spec_decode_accepted_per_pos") or []):
            per_pos.add_metric(mv + [str(i)], _num(n))
        yield per_pos

        pc = s.get("prefix_cache") or {}
        if not isinstance(pc, Mapping):
            pc = {}
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      _first(pc, "query_tokens", "queries", default=s.get("prefix_cache_queries", 0)))
        yield counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                      _first(pc, "hit_tokens", "hits", default=s.get("prefix_cache_hits", 0)))
        yield counter("vllm:external_prefix_cache_queries", "Prompt tokens looked up in the host tier of the "
                      "prefix cache (those the device tier did not hold).", pc.get("host_query_tokens", 0))
        yield counter("vllm:external_prefix_cache_hits", "Prompt tokens restored from the host tier of the "
                      "prefix cache.", pc.get("host_hit_tokens", 0))
        yield gauge("k3jax:host_cache_bytes", "Bytes of evicted prefix-cache pages and KDA checkpoints held in "
                    "host memory.", pc.get("host_bytes", 0))
        yield counter("k3jax:host_cache_restored_bytes", "Bytes copied from the host tier back into the arena.",
                      pc.get("host_bytes_restored", 0))
        yield counter("k3jax:kda_checkpoint_hits", "Prefix-cache lookups that resumed from a KDA state checkpoint.",
                      _first(pc, "kda_hits", "kda_checkpoint_hits", default=s.get("kda_checkpoint_hits", 0)))
        yield counter("k3jax:kda_checkpoint_misses", "Prefix-cache lookups with no usable KDA state checkpoint.",
                      _first(pc, "kda_misses", "kda_checkpoint_misses",
                             default=s.get("kda_checkpoint_misses", 0)))

        # Arena: one byte budget, split by kind.
        ab = s.get("arena_bytes") or {}
        total = _num(ab.get("total", 0))
        kda, mla = _num(ab.get("kda_slots", 0)), _num(ab.get("mla_pages", 0))
        yield gauge("k3jax:kda_slot_usage_perc", "Fraction of the arena held by KDA state slots, 0-1.",
                    kda / total if total else 0.0)
        yield gauge("k3jax:mla_page_usage_perc", "Fraction of the arena held by MLA latent pages, 0-1.",
                    mla / total if total else 0.0)
        yield gauge("k3jax:kda_slot_bytes", "Bytes of the arena held by KDA state slots.", kda)
        yield gauge("k3jax:mla_page_bytes", "Bytes of the arena held by MLA latent pages.", mla)
        yield gauge("k3jax:arena_bytes", "Total bytes of the cache arena.", total)
        yield gauge("k3jax:arena_free_units", "Free arena units now.", s.get("arena_free_units", 0))
        yield gauge("k3jax:arena_baseline_free_units", "Free arena units with no request in flight.",
                    s.get("arena_baseline_free_units", 0))
        yield gauge("k3jax:arena_cached_units", "Arena units held only by the prefix cache (reclaimable).",
                    s.get("arena_cached_units", 0))
        yield gauge("k3jax:kda_checkpoint_bytes", "Bytes of the arena held by cached KDA state checkpoints.",
                    pc.get("kda_checkpoint_bytes", 0))
        yield gauge("k3jax:compiles_after_warmup", "Step programs compiled after warm-up (should stay 0).",
                    s.get("compiles_after_warmup", 0))
        yield counter("k3jax:requests_aborted", "Requests aborted (client disconnects included).",
                      s.get("requests_aborted", 0))
        yield counter("k3jax:failed_steps", "Engine steps that raised (the engine kept serving).",
                      s.get("failed_steps", 0))
        yield counter("k3jax:requests_failed", "Requests ended with an error because the step running them "
                      "failed.", s.get("requests_failed", 0))
        yield counter("k3jax:cache_resets", "Arenas replaced after a failed step consumed the cache (requests "
                      "holding state were recomputed, the prefix cache emptied).", s.get("cache_resets", 0))
        yield counter("k3jax:structured_output_requests", "Requests with an output constraint (JSON schema, "
                      "regex, choice, grammar; forced tool calls).", s.get("structured_output_requests", 0))
        yield counter("k3jax:structured_output_errors", "Sampled tokens that broke their constraint (0 unless "
                      "something is wrong: the mask forbids them).", s.get("structured_output_errors", 0))
        yield counter("k3jax:structured_output_mask_seconds", "Host time computing the allowed-token masks of "
                      "constrained rows before their steps.", s.get("structured_output_mask_seconds", 0.0))
        yield _iteration_tokens(s.get("iteration_tokens"), m, engine)

        # MoE.
        ex = CounterMetricFamily("k3jax:expert_tokens", "Tokens routed to each expert, per MoE layer.",
                                 labels=L + ["layer", "expert"])
        counts = s.get("expert_counts")
        if counts is not None:
            if isinstance(counts, Mapping):
                items = counts.items()
            else:  # one row per MoE layer; label rows with the model's layer index when the engine names them
                counts = list(counts)
                names = list(s.get("moe_layers") or [])
                items = zip(names if len(names) == len(counts) else range(len(counts)), counts)
            for layer, per_expert in items:
                try:
                    values = list(per_expert)
                except TypeError:
                    continue
                for e, c in enumerate(values):
                    ex.add_metric(mv + [str(layer), str(e)], _num(c))
        yield ex
        yield counter("k3jax:moe_dispatch_seconds", "Time in the MoE blocks (routing, dispatch, expert GEMMs, combine): "
                      "per step, the time measured at warm-up for the step's shape.",
                      s.get("moe_dispatch_seconds", 0.0))
        yield counter("k3jax:inter_rank_bytes", "Bytes the expert-parallel MoE sends between ranks (all-reduce of the "
                      "slot outputs, ring estimate from the step shapes; 0 on one device).",
                      s.get("inter_rank_bytes", 0))
        balance = s.get("eplb") or {}
        yield counter("k3jax:eplb_rebalances", "Expert placements planned by expert-parallel load balancing "
                      "(enable_eplb; each moves the MoE layers whose busiest rank gains).", s.get("eplb_rebalances", 0))
        yield gauge("k3jax:expert_load_imbalance", "Busiest rank's share of the routed tokens over the mean rank's, "
                    "averaged over the MoE layers, under the placement the last plan left (1: balanced; 1 without "
                    "enable_eplb or before its first plan).", _num((balance.get("last") or {}).get("imbalance_after"), 1.0))

    def _group_families(self, s: Mapping, fe: Mapping) -> Iterable:
        """The router's and the HTTP front end's series (engine "0"): `s` is the merged statistics."""
        m, L = self._model, LABELS
        mv = [m, ENGINE]
        gauge, _ = _one_sample_families(mv)

        # Data-parallel replicas (serve/data_parallel.py): each replica's gauges, and how the router chose.
        reps = s.get("replicas") or []
        for name, key, doc in (("k3jax:replica_requests_running", "num_requests_running", "Running sequences per replica."),
                               ("k3jax:replica_requests_waiting", "num_requests_waiting", "Waiting sequences per replica."),
                               ("k3jax:replica_kv_cache_usage_perc", "kv_cache_usage", "Arena usage per replica (0-1).")):
            g = GaugeMetricFamily(name, doc, labels=L + ["replica"])
            for i, r in enumerate(reps):
                g.add_metric(mv + [str(i)], _num(r.get(key)))
            yield g
        routed = CounterMetricFamily("k3jax:data_parallel_routed", "Requests the data-parallel router sent by cached "
                                     "prefix or by load (the least loaded replica).", labels=L + ["by"])
        for by in ("prefix", "load"):
            if f"routed_by_{by}" in (s.get("data_parallel_router") or {}):
                routed.add_metric(mv + [by], _num(s["data_parallel_router"][f"routed_by_{by}"]))
        yield routed

        # Frontend state.
        yield gauge("k3jax:engine_ready", "1 once the engine is warmed up and serving.", fe.get("ready", 0))
        yield gauge("k3jax:api_requests_in_flight", "HTTP generation requests admitted and not finished.",
                    fe.get("requests_in_flight", 0))
        yield gauge("k3jax:api_sequences_in_flight", "Sequences (requests x n) admitted by the API, not finished.",
                    fe.get("sequences_in_flight", 0))
        yield gauge("k3jax:api_paused", "1 while POST /pause holds new generation requests (until POST /resume).",
                    fe.get("paused", 0))
        yield gauge("k3jax:api_requests_held", "HTTP generation requests waiting, unadmitted, for POST /resume.",
                    fe.get("requests_held", 0))


_REQUEST_HISTOGRAMS = (  # ServerMetrics.engine()'s attribute, name, help, bucket edges
    ("ttft", "vllm:time_to_first_token_seconds", "Time from arrival to the first token.", _TTFT_BUCKETS),
    ("itl", "vllm:inter_token_latency_seconds", "Time between a sample's successive outputs (a step's tokens, "
     "accepted drafts included, are one gap, as vLLM's).", _ITL_BUCKETS),
    # vLLM's per-request TPOT: a sample's decode time over its tokens after the first (0 with one token)
    ("tpot", "vllm:request_time_per_output_token_seconds", "Mean time per output token of each request (after its "
     "first).", _ITL_BUCKETS),
    ("e2e", "vllm:e2e_request_latency_seconds", "Time from arrival to the last token.", _E2E_BUCKETS),
    ("queue", "vllm:request_queue_time_seconds", "Time from arrival to first scheduling.", _E2E_BUCKETS),
    ("prefill", "vllm:request_prefill_time_seconds", "Time from first scheduling to the first token.", _E2E_BUCKETS),
    ("decode", "vllm:request_decode_time_seconds", "Time from the first token to the last.", _E2E_BUCKETS),
    ("inference", "vllm:request_inference_time_seconds", "Time from first scheduling to the last token.",
     _E2E_BUCKETS),
    ("req_n", "vllm:request_params_n", "The n request parameter.", _N_BUCKETS),
)
_TOKEN_HISTOGRAMS = (  # ... with token_buckets(max_model_len)
    ("req_prompt", "vllm:request_prompt_tokens", "Prompt tokens per request."),
    ("req_gen", "vllm:request_generation_tokens", "Generated tokens per request."),
    # vLLM's request parameters: max_tokens per sample; the most tokens a sample generated, per prompt once its
    # samples all ended (as vllm:request_params_n)
    ("req_max_gen", "vllm:request_max_num_generation_tokens", "Most tokens a sample of the request generated."),
    ("req_max_tokens", "vllm:request_params_max_tokens", "The max_tokens request parameter."),
    ("req_prefill_computed", "vllm:request_prefill_kv_computed_tokens", "Prompt tokens a request computed (not "
     "taken from the prefix cache)."),
)


class ServerMetrics:
    """The app's registry: frontend histograms/counters plus the engine collector. The request histograms of the
    engine that served a request: `engine(index)` (a data-parallel replica's index, vLLM's `engine` label);
    `each`: each replica's own engine statistics (see EngineCollector)."""

    def __init__(self, model_name: str, stats: Callable[[], dict], frontend: Callable[[], dict],
                 max_model_len: Optional[int] = None, each: Optional[Callable[[], list]] = None):
        disable_created_metrics()  # no `*_created` series (as vLLM)
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        r, L = self.registry, LABELS
        self._histograms = {attr: Histogram(name, doc, L, buckets=edges, registry=r)
                            for attr, name, doc, edges in _REQUEST_HISTOGRAMS}
        self._engines: dict[str, SimpleNamespace] = {}  # engine label -> its histograms' children
        self._token_histograms: dict = {}
        self.max_model_len = None
        self._success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                L + ["finished_reason"], registry=r)
        self._rejected = Counter("k3jax:http_requests_rejected", "HTTP requests refused, by reason.",
                                 L + ["reason"], registry=r)
        self.size_token_buckets(max_model_len)
        self.engine(0)
        for reason in ("auth", "rate_limit", "queue_full", "invalid"):
            self._rejected.labels(model_name, ENGINE, reason)
        r.register(EngineCollector(stats, model_name, frontend, each))

    def engine(self, index=0) -> SimpleNamespace:
        """Engine `index`'s request histograms (ttft, itl, ... as `_REQUEST_HISTOGRAMS` / `_TOKEN_HISTOGRAMS` name
        them); its finish-reason series exist from the first call (zeros, as vLLM's)."""
        key = str(index)
        hs = self._engines.get(key)
        if hs is None:
            hs = self._engines[key] = SimpleNamespace(**{
                attr: h.labels(self.model_name, key)
                for attr, h in (*self._histograms.items(), *self._token_histograms.items())})
            for reason in FINISH_REASONS:
                self._success.labels(self.model_name, key, reason)
        return hs

    def size_token_buckets(self, max_model_len: Optional[int]) -> None:
        """(Re)build the per-request token histograms with vLLM's bucket edges for this context window (the
        engine's, once attached; nothing was observed before)."""
        if max_model_len == self.max_model_len and self._token_histograms:
            return
        for h in self._token_histograms.values():
            self.registry.unregister(h)
        edges = token_buckets(max_model_len)
        self._token_histograms = {attr: Histogram(name, doc, LABELS, buckets=edges, registry=self.registry)
                                  for attr, name, doc in _TOKEN_HISTOGRAMS}
        known, self._engines = list(self._engines), {}
        for key in known:
            self.engine(key)
        self.max_model_len = max_model_len

    def finished(self, reason: str | None, engine=0) -> None:
        self._success.labels(self.model_name, str(engine), reason or "unknown").inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, ENGINE, reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
