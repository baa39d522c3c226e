"""The online serving benchmark's own arithmetic (benchmarks/online_serving.py): arrival process and the
per-request latencies it reports, on hand-made traces."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from online_serving import Trace, arrivals, summarize  # noqa: E402


def test_poisson_arrivals_have_the_asked_rate_and_inf_sends_at_once():
    t = arrivals(4000, 2.0, np.random.default_rng(0))
    assert all(b >= a for a, b in zip(t, t[1:])) and t[0] > 0
    assert len(t) / t[-1] == pytest.approx(2.0, rel=0.05)
    gaps = np.diff(t)
    assert np.std(gaps) == pytest.approx(np.mean(gaps), rel=0.1)  # exponential: std = mean
    assert arrivals(5, math.inf, np.random.default_rng(0)) == [0.0] * 5


def test_latencies_of_a_trace():
    # sent at 10 s; 1 token at 10.5, then a chunk of 2 at 10.9, then 1 at 11.0
    tr = Trace(sent=10.0, arrivals=[(10.5, 1), (10.9, 2), (11.0, 1)], tokens=[5, 6, 7, 8])
    assert tr.ttft == pytest.approx(0.5) and tr.e2e == pytest.approx(1.0)
    assert tr.tpot == pytest.approx(0.5 / 3)
    assert tr.itl() == pytest.approx([0.2, 0.2, 0.1])  # a 2-token chunk counts as 2 gaps of half its wait


def test_summary_counts_failures_and_short_outputs_apart():
    ok = Trace(sent=0.0, arrivals=[(0.1, 1), (0.3, 1)], tokens=[1, 2])
    short = Trace(sent=0.0, arrivals=[(0.2, 1)], tokens=[1])
    bad = Trace(sent=0.5, error="RuntimeError: HTTP 400")
    s = summarize([ok, short, bad], gen=2)
    assert (s["completed"], s["failed"]) == (1, 2) and s["errors"] == ["RuntimeError: HTTP 400"]
    assert s["wall_s"] == pytest.approx(0.3) and s["output_throughput"] == pytest.approx(2 / 0.3)
    assert s["ttft_s"]["p50"] == pytest.approx(0.1) and s["itl_s"]["p99"] == pytest.approx(0.2)
