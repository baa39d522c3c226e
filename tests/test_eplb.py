"""Expert-parallel load balancing (serve/eplb.py): the placement plan, the weight move it implies, and the
balancer's window. The engine runs it on 4 simulated devices in tests/test_sharding.py."""

import json

import numpy as np
import pytest

import jax

import k3jax
from serve.eplb import (ExpertBalancer, attach, balanced_placement, expert_leaves, imbalance, initial_placement,
                        moved_index, rank_loads, replica_counts, replica_table)


def skewed(e: int, seed: int) -> np.ndarray:
    """Routed-token counts with a few hot experts (what random and real routers both produce)."""
    rng = np.random.default_rng(seed)
    return np.floor(rng.pareto(1.2, e) * 100).astype(np.int64)


def ranks_of(expert_at: np.ndarray, ranks: int) -> list[list[int]]:
    """The experts each rank holds under a placement (`expert_at` [P])."""
    return expert_at.reshape(ranks, -1).tolist()


@pytest.mark.parametrize("e,ranks", [(8, 4), (32, 4), (896, 16), (64, 8)])
def test_placement_is_a_balanced_permutation(e, ranks):
    load = skewed(e, e + ranks)
    expert_at = balanced_placement(load, ranks)
    assert sorted(expert_at.tolist()) == list(range(e))  # every expert held once
    per = rank_loads(load, expert_at, ranks)
    assert per.sum() == load.sum()
    # largest-first greedy: the busiest rank exceeds the mean by at most one expert's load
    assert per.max() <= load.sum() / ranks + load.max()
    assert imbalance(load, expert_at, ranks) <= imbalance(load, np.arange(e), ranks)
    assert np.array_equal(expert_at, balanced_placement(load.copy(), ranks))  # deterministic


def test_placement_spreads_the_hot_experts():
    load = np.array([100, 90, 1, 1, 1, 1, 80, 70])  # identity puts 100 + 90 on rank 0 and 80 + 70 on rank 3
    expert_at = balanced_placement(load, 4)
    assert imbalance(load, np.arange(8), 4) == pytest.approx(190 / 86)
    assert rank_loads(load, expert_at, 4).tolist() == [101, 91, 81, 71]
    assert sorted(r for r, held in enumerate(ranks_of(expert_at, 4)) for x in held if x in (0, 1, 6, 7)) == [0, 1, 2, 3]


def test_copies_of_a_dominant_expert_even_out_a_layer():
    """One expert carries half the layer's tokens, one expert per rank: no permutation helps (4.3x the mean),
    eight copies of it spread over the eight ranks do."""
    load = np.array([800, 100, 100, 100, 100, 100, 100, 100])
    assert imbalance(load, balanced_placement(load, 8), 8) == pytest.approx(800 / 187.5)
    assert replica_counts(load, 8, 8).tolist() == [8, 2, 1, 1, 1, 1, 1, 1]  # 800 / 8 ties 100: fewer copies first
    expert_at = balanced_placement(load, 8, redundant=8)
    assert expert_at.shape == (16,) and np.bincount(expert_at).tolist() == [8, 2, 1, 1, 1, 1, 1, 1]
    assert all(0 in held and len(set(held)) == 2 for held in ranks_of(expert_at, 8))  # a copy on every rank
    assert rank_loads(load, expert_at, 8).max() == 200 and imbalance(load, expert_at, 8) == pytest.approx(200 / 187.5)
    # nothing routed yet: the copies go round the experts (the initial placement's choice)
    assert replica_counts(np.zeros(8), 3).tolist() == [2, 2, 2, 1, 1, 1, 1, 1]
    assert initial_placement(8, 3).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2]


@pytest.mark.parametrize("e,ranks,redundant", [(8, 4, 4), (32, 8, 8), (32, 32, 32), (896, 64, 64), (64, 16, 16)])
def test_placement_with_redundant_experts(e, ranks, redundant):
    for seed in range(3):
        load = skewed(e, seed)
        expert_at = balanced_placement(load, ranks, redundant)
        copies = np.bincount(expert_at, minlength=e)
        assert expert_at.shape == (e + redundant,) and copies.min() >= 1 and copies.sum() == e + redundant
        assert np.array_equal(copies, replica_counts(load, redundant, ranks)) and copies.max() <= ranks
        held = ranks_of(expert_at, ranks)
        assert all(len(set(h)) == len(h) for h in held)  # no rank holds two copies of one expert
        per = rank_loads(load, expert_at, ranks)
        assert per.sum() == pytest.approx(load.sum())
        assert per.max() <= load.sum() / ranks + (load / copies).max() + 1e-9
        assert imbalance(load, expert_at, ranks) <= imbalance(load, balanced_placement(load, ranks), ranks) + 1e-9
        table, n = replica_table(expert_at, e, 1 + redundant)
        assert np.array_equal(n, copies)
        for x in range(e):  # each row: the expert's positions, increasing, repeated to fill the row
            where = np.flatnonzero(expert_at == x)
            assert table[x].tolist() == [where[j % len(where)] for j in range(1 + redundant)]
    with pytest.raises(ValueError, match="do not split over 4 ranks"):
        balanced_placement(skewed(8, 0), 4, redundant=3)


@pytest.mark.parametrize("redundant", [0, 4])
def test_moved_weights_follow_their_experts(redundant):
    """After a move, position p holds the weights of the expert the new placement puts at p, starting from
    any earlier placement (copies included)."""
    rng = np.random.default_rng(redundant)
    logical = rng.standard_normal((16, 3, 5))  # weights in checkpoint order [E, ...]
    current = rng.permutation(initial_placement(16, redundant)).astype(np.int32)  # expert held at each position
    stored = logical[current]
    new = balanced_placement(skewed(16, 1), 4, redundant)
    moved = stored[moved_index(current, new)]
    np.testing.assert_array_equal(moved, logical[new])


def test_compiled_gathers_move_what_the_host_gather_moves():
    """`gather_program` (what a multi-process engine launches: compiled before the leader sends a move) gathers a
    layer's experts, or a scanned run's groups in one program, as `take_on_host` does."""
    import jax.numpy as jnp

    from serve.eplb import gather_program, take_on_host

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((12, 3, 5)), jnp.float32)
    stacked = jnp.asarray(rng.standard_normal((3, 12, 2, 4)), jnp.float32)
    ix = rng.permutation(12).astype(np.int32)
    for weight, index in ((w, {None: ix}), (stacked, {0: ix, 2: ix[::-1].copy()})):
        np.testing.assert_array_equal(np.asarray(gather_program(weight, index)()),
                                      np.asarray(take_on_host(weight, index)))


def test_balancer_window_interval_and_gain():
    b = ExpertBalancer(num_layers=2, num_experts=8, ranks=4, window=32, interval=5)
    assert b.bucket_steps == 2
    hot = np.zeros((2, 8))
    hot[0, [0, 1]] = 10  # layer 0: two hot experts on rank 0; layer 1: nothing routed (uniform)
    due = [b.observe(hot) for _ in range(5)]
    assert due == [False] * 4 + [True]
    assert b.window_load()[0, 0] == 50
    moves, summary = b.plan()
    assert list(moves) == [0] and summary["layers_moved"] == 1
    assert summary["imbalance_before"] > summary["imbalance_after"]
    assert not b.observe(hot)  # the interval restarts with a plan
    before = b.place(moves)  # the placement first (the engine writes its tables), then the stats once it landed
    assert b.rebalances == 0 and np.array_equal(before[0], np.arange(8))
    b.applied(moves, summary)
    assert b.rebalances == 1 and b.stats()["last"] == summary
    assert not any(0 in held and 1 in held for held in ranks_of(b.placement[0], 4))  # hot pair split
    assert b.plan()[0] == {}  # already balanced: nothing moves
    for _ in range(40):  # the window forgets: old counts leave it
        b.observe(np.zeros((2, 8)))
    assert b.window_load().sum() == 0
    b.reset()
    assert np.array_equal(b.placement, np.tile(np.arange(8), (2, 1)))


@pytest.mark.parametrize("redundant", [0, 4])
def test_attach_gives_every_moe_layer_its_tables_and_finds_its_weights(redundant):
    """tiny-k3: 7 MoE layers (layer 0 is dense), MXFP4 experts (w1, w3, w2 each packed + scale), 8 experts;
    with 4 redundant experts the stacked weights hold 12, the copies of experts 0..3 after the originals."""
    plain = k3jax.load_model("tiny-k3", seed=0)
    model = attach(plain, redundant)
    leaves = jax.tree.leaves(model.params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree.flatten_with_path(model.params)[0]]
    before = {jax.tree_util.keystr(p): x for p, x in jax.tree.flatten_with_path(plain.params)[0]}
    found = expert_leaves(model.params)
    assert len(found) == 7
    for slots, copies, weights in found:
        table = np.asarray(leaves[slots])
        assert table.shape == (8, 1 + redundant)
        held = [[x, 8 + x] if x < redundant else [x] for x in range(8)]  # repeated to fill the row
        want = [[h[j % len(h)] for j in range(1 + redundant)] for h in held]
        assert table.tolist() == want
        assert np.asarray(leaves[copies]).tolist() == [1 + (redundant > 0)] * 4 + [1] * 4
        assert len(weights) == 6 and all(leaves[i].shape[0] == 8 + redundant for i in weights)
        for i in weights:  # the copies are the originals' weights
            np.testing.assert_array_equal(np.asarray(leaves[i]), np.asarray(before[paths[i]])[initial_placement(8, redundant)])
    assert expert_leaves(attach(model, redundant).params) == found  # attaching twice adds nothing


def test_copies_compute_what_the_original_experts_do():
    """An MoE layer with 4 redundant experts, after a move to a skewed placement: each routed slot goes to one
    copy of its expert (alternating over the copies), and the output is the plain layer's bit for bit."""
    from flax import nnx
    from k3jax.layers.moe import MoE

    plain = k3jax.load_model("tiny-k3", seed=0)
    model = attach(plain, 4)
    moe = lambda m: next(n for _, n in nnx.iter_graph(nnx.merge(m.graphdef, m.params)) if isinstance(n, MoE))
    ref, layer = moe(plain), moe(model)
    rng = np.random.default_rng(0)
    z = jax.numpy.asarray(rng.standard_normal((24, plain.cfg.expert_in_size)), jax.numpy.float32)
    ids = jax.numpy.asarray(np.stack([rng.choice(8, 2, replace=False) for _ in range(24)]), jax.numpy.int32)
    w = jax.numpy.asarray(rng.uniform(0.1, 1.0, (24, 2)), jax.numpy.float32)
    want = np.asarray(ref.experts(z, ids, w))
    np.testing.assert_array_equal(np.asarray(layer.experts(z, ids, w)), want)
    load = np.array([50, 40, 1, 1, 1, 1, 30, 20])
    new = balanced_placement(load, 4, 4)
    index = jax.numpy.asarray(moved_index(initial_placement(8, 4), new))
    for w_ in (layer.w1, layer.w3, layer.w2):
        for var in (w_.weight_packed, w_.weight_scale):
            var.set_value(var[...][index])
    table, copies = replica_table(new, 8, 5)
    layer.expert_slots.set_value(jax.numpy.asarray(table))
    layer.expert_copies.set_value(jax.numpy.asarray(copies))
    assert copies.tolist() == [3, 2, 1, 1, 1, 1, 2, 1]
    np.testing.assert_array_equal(np.asarray(layer.experts(z, ids, w)), want)
    physical = np.asarray(layer._physical(ids, layer.expert_slots[...], layer.expert_copies[...]))
    assert np.array_equal(new[physical], np.asarray(ids))  # every slot lands on a copy of its own expert
    assert len(set(physical[np.asarray(ids) == 0].tolist())) == 3  # expert 0's slots use all three copies


def test_a_failed_move_counts_in_no_stats_and_ends_no_request():
    """A move whose weights fail to land (injected as they are placed, then as they finish; in life device memory)
    leaves the placement and the `eplb` stats (rebalances, layers_moved, last) as they were; the next move counts
    once. One the engine schedules (every `eplb_step_interval` steps) fails alone: the step's requests go on to the
    same tokens. A multi-process leader (its channel faked) not warmed up yet refuses a move, a step and weight
    updates and reads, sending nothing: its followers replay them only from `follow()`, after their own warm-up.
    (Two CPU devices in a subprocess: expert parallelism needs a mesh; tests/step_failures.py drains the engine.
    tiny-kimi-linear: half tiny-k3's layers, so its two step programs compile in half the time; the bookkeeping is
    the model's either way, and on CPU the engine holds tiny-k3's MXFP4 experts expanded, so both move dense
    expert weights. tests/test_sharding.py runs EPLB's moves on tiny-k3.)"""
    import os
    import subprocess
    import sys

    code = """
import json, sys, jax, numpy as np, k3jax
sys.path.insert(0, "tests")
from serve.engine import Engine, EngineConfig
from serve.types import SamplingParams
from step_failures import drain_through_failures
cfg = EngineConfig(max_model_len=128, page_size=16, cache_bytes=64 * 16 * 2560, max_num_seqs=4, decode_buckets=(4,),
                   prefill_buckets=(1,), context_buckets=(8,), measure_moe_time=False, sharding="ep",
                   enable_eplb=True, eplb_num_redundant_experts=2)
engine = Engine(k3jax.load_model("tiny-kimi-linear", seed=0), cfg, warmup=False, progress=False)
start, plan = engine.eplb.placement.copy(), engine.eplb.plan
engine.eplb.plan = lambda: ({0: start[0][::-1].copy()}, dict(layers_moved=1, imbalance_after=1.0))
class Leader:  # a multi-process leader's channel, before warm-up: what it would send the followers
    leader, closed, sent = True, False, []
    def command(self, cmd, payload):
        self.sent.append(cmd)
name = next(n for n in engine.weight_names.names() if "q_proj" in n)  # (a small dense weight)
held = engine.get_weights_by_name(name, None)
engine.channel, cold = Leader(), []
for call in (engine.rebalance_experts, engine.step, lambda: engine.update_weights_from_disk("/nowhere"),
             lambda: engine.update_weights_from_tensor([(name, held)]), lambda: engine.get_weights_by_name(name)):
    try:
        call()
        cold.append(None)
    except Exception as e:
        cold.append(str(e))
cold = dict(errors=cold, sent=engine.channel.sent, kept=engine.eplb.placement.tolist() == start.tolist())
engine.channel = None
real = engine._set_leaves
def broken(leaves):
    raise RuntimeError("injected device failure")
engine._set_leaves = broken
try:
    engine.rebalance_experts()
    failed = None
except RuntimeError as e:
    failed = str(e)
after_failure = dict(engine.stats()["eplb"], kept=engine.eplb.placement.tolist() == start.tolist(),
                     counted=engine.counters["eplb_rebalances"])
engine._set_leaves = real
wait = jax.block_until_ready
def late(x):  # the devices fail as the gathers finish (after the move was launched)
    jax.block_until_ready = wait
    raise RuntimeError("injected late device failure")
jax.block_until_ready = late
engine._scheduled_rebalance()
after_late = dict(engine.stats()["eplb"], kept=engine.eplb.placement.tolist() == start.tolist(),
                  counted=engine.counters["eplb_rebalances"])
engine.rebalance_experts()
after_move = engine.stats()["eplb"]
def run():
    ids = [engine.add_request(x, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
           for x in ("The quick brown fox", "jumps over")]
    failures, done = drain_through_failures(engine)
    return [done[i].outputs[0].token_ids for i in ids], [str(f) for f in failures]
want = run()
engine._set_leaves, engine.eplb.interval = broken, 2  # scheduled moves, every 2 steps, each failing
scheduled = run()
print("RESULT" + json.dumps(dict(cold=cold, failed=failed, after_failure=after_failure, after_late=after_late,
                                 after_move=after_move, want=want,
                                 scheduled=scheduled, after_scheduled=engine.stats()["eplb"])))
"""
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and "RESULT" in out.stdout, out.stderr[-3000:]
    got = json.loads(out.stdout.split("RESULT")[1])
    # a multi-process leader not warmed up refuses a move, a step and weight updates and reads (its followers replay
    # them only from follow(), after their own warm-up): nothing moved, nothing sent
    cold = got["cold"]
    assert all(e and "not warmed up; call warmup() first" in e for e in cold["errors"]), got
    assert [e.split(":")[0] for e in cold["errors"]] == ["rebalance_experts", "step", "update_weights_from_disk",
                                                        "update_weights_from_tensor", "get_weights_by_name"], got
    assert cold["kept"] and cold["sent"] == [], got
    assert got["failed"] == "injected device failure", got
    failed = got["after_failure"]
    assert failed["kept"] and (failed["rebalances"], failed["layers_moved"], failed["last"], failed["counted"]) == (0, 0, {}, 0), got
    # one that fails late, as its gathers finish: undone too, and counted once, as failed (it counted as a
    # rebalance as well, and stayed, broken weights and all)
    late = got["after_late"]
    assert late["kept"] and (late["rebalances"], late["failed_moves"], late["counted"]) == (0, 1, 0), got
    moved = got["after_move"]
    assert (moved["rebalances"], moved["layers_moved"], moved["last"]["layers_moved"]) == (1, 1, 1), got
    # scheduled moves that fail (inside a step's read-back) end no request: the outputs stand, the moves are counted
    # as failed, not as rebalances (they ended the requests of the step that planned them)
    assert got["scheduled"] == got["want"] and got["want"][1] == [], got
    after = got["after_scheduled"]
    assert after["failed_moves"] >= 2 and (after["rebalances"], after["layers_moved"]) == (1, 1), got
