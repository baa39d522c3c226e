"""benchmarks/async_scheduling.py: its pairs compare the same tokens, and its host / device split of a
synchronous decode step adds up to the step."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import async_scheduling  # noqa: E402


def test_one_pair_at_c1(monkeypatch):
    monkeypatch.setattr(async_scheduling, "GEN", 6)
    (res,) = async_scheduling.run_model("tiny-k3", [1], reps=1, seed=0)["results"]
    assert res["same_tokens"] and res["compiles_after_warmup"] == {"sync": 0, "async_": 0}
    assert res["steps_launched_ahead"] > 0 and len(res["pairs"]) == 1
    split = res["sync_decode_step"]
    assert split["decode_steps"] >= 4 and split["device_ms"] > 0 and split["host_ms"] > 0
    assert split["device_ms"] + split["host_ms"] == pytest.approx(split["step_ms"])
    assert 1.0 <= split["overlap_bound"] <= 2.0


def test_structured_mix_keeps_steps_in_flight(monkeypatch):
    monkeypatch.setattr(async_scheduling, "GEN", 6)
    # c = 1: the programs of the test above (one constrained request; nothing new to compile)
    res = async_scheduling.structured_mix("tiny-k3", 1, reps=1, seed=0, every=1)
    assert res["async_"]["same_tokens"] and set(res["compiles_after_warmup"].values()) == {0}
    assert res["async_"]["launched_ahead"] > 0.5 and res["sync"]["launched_ahead"] == 0
