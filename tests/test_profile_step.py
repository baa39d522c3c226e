"""The step profiler's two parsers (benchmarks/profile_step.py): HLO ops attributed to the repository line
that emitted them, and exclusive op time from a trace with nested spans."""

import gzip
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import profile_step  # noqa: E402

from k3jax.layers.linear import project  # noqa: E402


def test_hlo_ops_map_to_their_repository_line_and_part():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(8, 16)), jnp.float32)
    text = jax.jit(lambda x, w: jnp.tanh(project(x, w, True))).lower(x, w).compile().as_text()
    frames, what = profile_step.parse_hlo(text)
    dots = [op for op, w_ in what.items() if w_.startswith("dot ->")]
    assert dots, what
    for op in dots:
        assert frames[op].startswith("k3jax/layers/linear.py:") and frames[op].endswith(" matmul")
        assert profile_step.part_of(frames[op]) == "dense products"
        assert what[op] == "dot -> f32[4,16]"
    # the tanh was written in this test file, outside the repository's packages
    assert any(f == "(no repository frame)" for f in frames.values())


def test_exclusive_time_takes_nested_spans_off_their_parent(tmp_path):
    def span(tid, ts, dur, op, module="jit_step"):
        return dict(ph="X", pid=1, tid=tid, ts=ts, dur=dur, name=op,
                    args=dict(hlo_module=module, hlo_op=op))

    events = [span(1, 0.0, 100.0, "while.1"), span(1, 10.0, 20.0, "dot.2"), span(1, 40.0, 20.0, "dot.3"),
              span(1, 45.0, 5.0, "copy.4"),  # nested two deep: inside dot.3
              span(1, 120.0, 10.0, "dot.2"), span(2, 0.0, 50.0, "fusion.5"),
              span(2, 60.0, 7.0, "other", module="jit_other"),  # another program: ignored
              dict(ph="X", pid=1, tid=3, ts=0.0, dur=500.0, name="python frame")]
    run = tmp_path / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump(dict(traceEvents=events), f)
    excl, count, busy, threads = profile_step.exclusive_times(str(tmp_path))
    assert excl == {"while.1": 60.0, "dot.2": 30.0, "dot.3": 15.0, "copy.4": 5.0, "fusion.5": 50.0}
    assert count == {"while.1": 1, "dot.2": 2, "dot.3": 1, "copy.4": 1, "fusion.5": 1}
    assert busy == 100.0 + 10.0 + 50.0 and threads == 2


def test_tuple_shaped_and_frameless_ops_are_in_the_parse():
    """Ops whose result is a tuple (a while loop, TopK) and ops with no stack frame are attributed too (they
    were reported as "(op not in the dump)", a quarter of a tiny-k3 decode step's op time)."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(8, 8)), jnp.float32)

    def f(x, w, n):
        y = jax.lax.fori_loop(0, n, lambda i, a: jnp.tanh(project(a, w, True)), x)  # n traced: a while loop
        return jax.lax.top_k(y, 2)

    text = jax.jit(f).lower(x, w, 3).compile().as_text()
    frames, what = profile_step.parse_hlo(text)
    entry = text.split("\nENTRY ", 1)[1].split("\n}", 1)[0]
    assert set(re.findall(r"^\s*(?:ROOT )?%([\w.\-]+) = ", entry, re.M)) <= set(frames)
    loops = [op for op, w_ in what.items() if w_.startswith("while -> (")]
    assert loops and all(frames[op] == "(no repository frame)" for op in loops)  # (the loop is this file's)
    assert any(w_.endswith("-> (f32[4,2], s32[4,2])") for w_ in what.values())  # top_k's values and indices
