"""The serving statistics line (serve/stats_logger.py): rates over the interval, state now, quiet when idle."""

import pytest

from serve.stats_logger import StatsLogger, snapshot, stats_line


def _stats(prompt=0, gen=0, running=0, waiting=0, usage=0.0, queries=0, hits=0, drafted=0, accepted=0):
    return {"prompt_tokens": prompt, "generation_tokens": gen, "num_requests_running": running,
            "num_requests_waiting": waiting, "kv_cache_usage": usage,
            "prefix_cache": {"query_tokens": queries, "hit_tokens": hits},
            "spec_decode_num_draft_tokens": drafted, "spec_decode_num_accepted_tokens": accepted}


def test_line_has_interval_rates_and_current_state():
    a = snapshot(_stats(prompt=100, gen=50, queries=100, hits=20, drafted=10, accepted=5))
    b = snapshot(_stats(prompt=1100, gen=250, running=3, waiting=1, usage=0.4125, queries=1100, hits=770,
                        drafted=30, accepted=20))
    assert stats_line(a, b, 10.0) == ("prompt 100.0 tokens/s, generation 20.0 tokens/s, running 3 reqs, waiting 1 reqs, "
                                      "cache 41.2% used, prefix cache hit rate 75.0%, drafts accepted 75.0%")
    # no lookups and no drafts in the interval: no rate to show
    assert stats_line(b, b, 10.0).endswith("cache 41.2% used, prefix cache hit rate -")


def test_logger_speaks_while_busy_then_once_when_idle():
    said, t = [], [0.0]
    feed = iter([_stats(), _stats(prompt=40, gen=10, running=2), _stats(prompt=40, gen=30, running=1),
                 _stats(prompt=40, gen=35), _stats(prompt=40, gen=35), _stats(prompt=40, gen=35, waiting=1)])
    log = StatsLogger(lambda: next(feed), said.append, interval_s=5.0, clock=lambda: t[0])
    lines = []
    for _ in range(6):
        lines.append(log.tick())
        t[0] += 5.0
    assert lines[0] is None  # the baseline
    assert lines[1].startswith("prompt 8.0 tokens/s, generation 2.0 tokens/s, running 2 reqs")
    assert lines[2].startswith("prompt 0.0 tokens/s, generation 4.0 tokens/s, running 1 reqs")
    assert lines[3].startswith("prompt 0.0 tokens/s, generation 1.0 tokens/s, running 0 reqs") and "idle" not in lines[3]
    assert lines[4].endswith("(idle)") and lines[5] is not None and "waiting 1 reqs" in lines[5]
    assert said == lines[1:]


def test_no_engine_yet_and_bad_interval():
    log = StatsLogger(dict, print, interval_s=1.0)
    assert log.tick() is None and log.tick() is None  # {}: no engine attached yet
    with pytest.raises(ValueError, match="--log-stats-interval"):
        StatsLogger(dict, print, interval_s=0)


@pytest.mark.parametrize("interval", [float("inf"), 1e300, float("nan")])
def test_an_interval_no_thread_can_wait_is_refused(interval):
    """`--log-stats-interval inf` (or any wait past threading.TIMEOUT_MAX) was accepted, then the stats thread died
    at its first wait with an OverflowError traceback and the server logged no statistics."""
    with pytest.raises(ValueError, match="--log-stats-interval: expected seconds > 0"):
        StatsLogger(dict, print, interval_s=interval)


def test_a_disaggregated_pair_counts_the_requests_its_prefill_engine_runs():
    """A disaggregated pair's stats are its decode engine's with the prefill engine's beside them: requests
    prefilling there were left out, so the line said "running 0 reqs" (and went quiet as idle) while the
    server worked on long prompts."""
    pair = dict(_stats(running=1), prefill_engine={"num_requests_running": 2, "num_requests_waiting": 3})
    cur = snapshot(pair)
    assert (cur["running"], cur["waiting"]) == (3, 3)
    said, t = [], [0.0]
    feed = iter([_stats(), pair, dict(_stats(), prefill_engine={"num_requests_running": 1})])
    log = StatsLogger(lambda: next(feed), said.append, interval_s=5.0, clock=lambda: t[0])
    assert log.tick() is None
    assert "running 3 reqs, waiting 3 reqs" in log.tick()
    assert "running 1 reqs, waiting 0 reqs" in log.tick()  # still prefilling: busy, not idle
