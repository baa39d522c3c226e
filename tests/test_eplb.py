"""Expert-parallel load balancing (serve/eplb.py): the placement plan, the weight move it implies, and the
balancer's window. The engine runs it on 4 simulated devices in tests/test_sharding.py."""

import numpy as np
import pytest

import jax

import k3jax
from serve.eplb import ExpertBalancer, attach, balanced_placement, expert_leaves, imbalance, moved_index, rank_loads


def skewed(e: int, seed: int) -> np.ndarray:
    """Routed-token counts with a few hot experts (what random and real routers both produce)."""
    rng = np.random.default_rng(seed)
    return np.floor(rng.pareto(1.2, e) * 100).astype(np.int64)


@pytest.mark.parametrize("e,ranks", [(8, 4), (32, 4), (896, 16), (64, 8)])
def test_placement_is_a_balanced_permutation(e, ranks):
    load = skewed(e, e + ranks)
    slots = balanced_placement(load, ranks)
    assert sorted(slots.tolist()) == list(range(e))  # every position taken once
    assert np.all(np.bincount(slots // (e // ranks), minlength=ranks) == e // ranks)
    per = rank_loads(load, slots, ranks)
    assert per.sum() == load.sum()
    # largest-first greedy: the busiest rank exceeds the mean by at most one expert's load
    assert per.max() <= load.sum() / ranks + load.max()
    assert imbalance(load, slots, ranks) <= imbalance(load, np.arange(e), ranks)
    assert np.array_equal(slots, balanced_placement(load.copy(), ranks))  # deterministic


def test_placement_spreads_the_hot_experts():
    load = np.array([100, 90, 1, 1, 1, 1, 80, 70])  # identity puts 100 + 90 on rank 0 and 80 + 70 on rank 3
    slots = balanced_placement(load, 4)
    assert imbalance(load, np.arange(8), 4) == pytest.approx(190 / 86)
    assert rank_loads(load, slots, 4).tolist() == [101, 91, 81, 71]
    assert len({s // 2 for s in slots[[0, 1, 6, 7]]}) == 4


def test_moved_weights_follow_their_experts():
    """After a move, position p holds the weights of the expert the new placement puts at p, starting from
    any earlier placement."""
    rng = np.random.default_rng(0)
    logical = rng.standard_normal((16, 3, 5))  # weights in checkpoint order [E, ...]
    current = rng.permutation(16).astype(np.int32)  # expert e stored at current[e]
    stored = np.empty_like(logical)
    stored[current] = logical
    new = balanced_placement(skewed(16, 1), 4)
    moved = stored[moved_index(current, new)]
    for expert in range(16):
        np.testing.assert_array_equal(moved[new[expert]], logical[expert])


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
    b.applied(moves, summary)
    assert b.rebalances == 1 and b.stats()["last"] == summary
    assert b.placement[0, 0] // 2 != b.placement[0, 1] // 2
    assert b.plan()[0] == {}  # already balanced: nothing moves
    for _ in range(40):  # the window forgets: old counts leave it
        b.observe(np.zeros((2, 8)))
    assert b.window_load().sum() == 0
    b.reset()
    assert np.array_equal(b.placement, np.tile(np.arange(8), (2, 1)))


def test_attach_gives_every_moe_layer_an_identity_table_and_finds_its_weights():
    """tiny-k3: 7 MoE layers (layer 0 is dense), MXFP4 experts (w1, w3, w2 each packed + scale)."""
    model = attach(k3jax.load_model("tiny-k3", seed=0))
    leaves = jax.tree.leaves(model.params)
    found = expert_leaves(model.params)
    assert len(found) == 7
    for slots, weights in found:
        assert np.array_equal(np.asarray(leaves[slots]), np.arange(8))
        assert len(weights) == 6 and all(leaves[i].shape[0] == 8 for i in weights)
    assert expert_leaves(attach(model).params) == found  # attaching twice adds nothing
