"""Expert-parallel load balancing (vLLM's EPLB, without redundant experts): which rank holds each routed
expert.

With the routed experts split over R ranks (E / R each, `MoE.expert_parallel`), a rank multiplies the tokens
routed to its own experts, so an MoE layer takes as long as its busiest rank, and real routing is skewed.
The engine counts the tokens routed to each expert in every MoE layer at every step (the same counts as
the `k3jax:expert_tokens` metric). Every `eplb_step_interval` steps `ExpertBalancer` plans, per layer, a
placement that gives every rank about the same share of the tokens routed over the last `eplb_window_size`
steps, and the engine moves the expert weights to it (one gather along the expert axis per weight, on
the devices) together with each layer's placement table.

The router still scores experts in checkpoint order; each MoE layer maps the chosen ids through its table
(`ExpertPlacement`: logical id -> position in the stacked weights) before the grouped matmul. Every routed
slot is computed by exactly one rank whichever rank that is, and an expert's rows keep their order, so
outputs are bit-identical before and after a move: only where the work happens changes.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.lora import path_names

BUCKETS = 16  # the window is kept as this many partial sums (host memory independent of the window)
MIN_GAIN = 0.02  # a layer moves only if its busiest rank's share of the load falls by more than this


class ExpertPlacement(nnx.Variable):
    """Each routed expert's position in its layer's stacked weights [E] int32 (not a checkpoint tensor)."""


def attach(model):
    """-> a `Model` (k3jax.runtime) whose MoE blocks each hold an identity `ExpertPlacement`."""
    from k3jax.layers.moe import MoE  # noqa: PLC0415

    module = nnx.merge(model.graphdef, model.params)
    for _, node in list(nnx.iter_graph(module)):
        if isinstance(node, MoE) and getattr(node, "expert_slots", None) is None:
            node.expert_slots = ExpertPlacement(jnp.arange(model.cfg.num_experts, dtype=jnp.int32))
    graphdef, params = nnx.split(module)
    return dataclasses.replace(model, graphdef=graphdef, params=params)


def expert_leaves(params) -> list[tuple[int, list[int]]]:
    """Per MoE layer in depth order: the index of its `ExpertPlacement` leaf and of its routed experts' weight
    leaves (w1, w3, w2, packed or dense) in `jax.tree.flatten(params)` order."""
    layers: dict[int, list] = {}
    for i, (path, _) in enumerate(jax.tree.flatten_with_path(params)[0]):
        names = path_names(path)
        if "block_sparse_moe" not in names:
            continue
        layer, rest = int(names[names.index("layers") + 1]), names[names.index("block_sparse_moe") + 1:]
        entry = layers.setdefault(layer, [None, []])
        if rest[0] == "expert_slots":
            entry[0] = i
        elif rest[0] in ("w1", "w2", "w3"):
            entry[1].append(i)
    return [(slots, weights) for _, (slots, weights) in sorted(layers.items())]


def balanced_placement(load: np.ndarray, ranks: int) -> np.ndarray:
    """Routed-token counts per expert [E] -> each expert's position [E] (rank r holds positions
    r E / R ... (r + 1) E / R - 1). Greedy largest-first: experts by decreasing load (ties by id), each to
    the least loaded rank with a free position (ties by rank). Deterministic, so every replay agrees."""
    e = load.shape[0]
    per = e // ranks
    rank_load, filled = np.zeros(ranks), np.zeros(ranks, np.int64)
    slots = np.empty(e, np.int32)
    for x in np.lexsort((np.arange(e), -np.asarray(load, np.float64))):
        open_ = np.flatnonzero(filled < per)
        r = open_[np.argmin(rank_load[open_])]
        slots[x] = r * per + filled[r]
        filled[r] += 1
        rank_load[r] += load[x]
    return slots


def rank_loads(load: np.ndarray, slots: np.ndarray, ranks: int) -> np.ndarray:
    """Tokens each rank multiplies [R] under `slots` [E]."""
    return np.bincount(slots // (load.shape[0] // ranks), weights=load, minlength=ranks)


def imbalance(load: np.ndarray, slots: np.ndarray, ranks: int) -> float:
    """Busiest rank's load over the mean rank load (1.0: balanced; 1.0 when nothing was routed)."""
    per_rank = rank_loads(load, slots, ranks)
    return float(per_rank.max() / per_rank.mean()) if per_rank.sum() else 1.0


def moved_index(current: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Gather index along the expert axis taking weights stored by `current` [E] to `new` [E]: the
    weights at position p afterwards are those at position `index[p]` now."""
    expert_at = np.argsort(new)  # the expert each new position holds
    return current[expert_at].astype(np.int32)


class ExpertBalancer:
    """Host state of the balancing: the recent routed-token counts, when to plan, and the current placement
    ([MoE layer, expert] positions, the values of the engine's `ExpertPlacement` leaves)."""

    def __init__(self, num_layers: int, num_experts: int, ranks: int, window: int, interval: int):
        self.ranks, self.window, self.interval = ranks, window, interval
        self.placement = np.tile(np.arange(num_experts, dtype=np.int32), (num_layers, 1))
        self.bucket_steps = max(1, window // BUCKETS)
        self.buckets: deque = deque(maxlen=-(-window // self.bucket_steps))
        self.current, self.in_bucket, self.since = np.zeros((num_layers, num_experts)), 0, 0
        self.rebalances, self.layers_moved = 0, 0
        self.last: dict = {}

    def observe(self, counts: np.ndarray) -> bool:
        """Add one step's counts [L, E]; -> whether a plan is due."""
        self.current += counts
        self.in_bucket += 1
        if self.in_bucket == self.bucket_steps:
            self.buckets.append(self.current)
            self.current, self.in_bucket = np.zeros_like(self.current), 0
        self.since += 1
        return self.since >= self.interval

    def window_load(self) -> np.ndarray:
        """Routed tokens per [MoE layer, expert] over (about) the last `window` steps."""
        return sum(self.buckets, self.current.copy())

    def plan(self) -> tuple[dict[int, np.ndarray], dict]:
        """-> ({MoE layer: new placement} for the layers worth moving, summary). Resets the interval."""
        self.since = 0
        load = self.window_load()
        moves, before, after = {}, [], []
        for layer, (lo, cur) in enumerate(zip(load, self.placement)):
            new = balanced_placement(lo, self.ranks)
            b, a = imbalance(lo, cur, self.ranks), imbalance(lo, new, self.ranks)
            if a < b * (1 - MIN_GAIN):
                moves[layer] = new
            before.append(b)
            after.append(a if layer in moves else b)
        summary = dict(tokens=int(load.sum()), layers_moved=len(moves),
                       imbalance_before=float(np.mean(before)) if before else 1.0,
                       imbalance_after=float(np.mean(after)) if after else 1.0)
        return moves, summary

    def applied(self, moves: dict[int, np.ndarray], summary: dict) -> None:
        for layer, new in moves.items():
            self.placement[layer] = new
        self.rebalances += 1
        self.layers_moved += len(moves)
        self.last = summary

    def reset(self) -> None:
        """The weights were replaced in checkpoint order (`update_weights`): identity placement."""
        self.placement[:] = np.arange(self.placement.shape[1], dtype=np.int32)

    def stats(self) -> dict:
        return dict(ranks=self.ranks, window_size=self.window, step_interval=self.interval,
                    rebalances=self.rebalances, layers_moved=self.layers_moved, last=dict(self.last))


@jax.jit
def take_experts(weight: jax.Array, index: jax.Array) -> jax.Array:
    """weight [E, ...] with its expert rows gathered by `index` [E] (placement stays the caller's)."""
    return jnp.take(weight, index, axis=0)
