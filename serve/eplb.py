"""Expert-parallel load balancing (vLLM's EPLB, with redundant experts): which ranks hold each routed expert.

With the routed experts split over R ranks (`MoE.expert_parallel`), a rank multiplies the tokens routed to
the experts it holds, so an MoE layer takes as long as its busiest rank, and real routing is skewed.
The engine counts the tokens routed to each expert in every MoE layer at every step (the same counts as
the `k3jax:expert_tokens` metric). Every `eplb_step_interval` steps `ExpertBalancer` plans, per layer, a
placement that gives every rank about the same share of the tokens routed over the last `eplb_window_size`
steps, and the engine moves the expert weights to it (one gather along the expert axis per weight, on
the devices) together with each layer's placement table.

Redundant experts (`eplb_num_redundant_experts` X, vLLM's `num_redundant_experts`): the stacked weights
hold E + X *physical* experts, (E + X) / R per rank; the X extra positions hold copies of the hottest
experts (an expert with c copies carries ~1/c of its load on each), which is what evens out a layer whose
hottest expert alone outweighs a rank's fair share, the usual case once R nears E. A placement is
`expert_at` [E + X]: the logical expert each physical position holds.

The router still scores experts in checkpoint order; each MoE layer maps the chosen ids through its table
(`ExpertPlacement` [E, 1 + X]: an expert's physical positions, repeated to fill the row, and
`ExpertCopies` [E]: how many there are) before the grouped matmul: assignment slot i of the step (token-major
order) goes to copy i mod c of its expert. Every slot is computed by exactly one rank whichever rank and
copy that is, with the same weights, and an expert's rows keep their order, so outputs are bit-identical
before and after a move, with or without copies: only where the work happens changes.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.lora import path_names

BUCKETS = 16  # the window is kept as this many partial sums (host memory independent of the window)
MIN_GAIN = 0.02  # a layer moves only if its busiest rank's share of the load falls by more than this


class ExpertPlacement(nnx.Variable):
    """Each routed expert's physical positions in its layer's stacked weights [E, 1 + X] int32, repeated to fill
    the row (not a checkpoint tensor)."""


class ExpertCopies(nnx.Variable):
    """How many physical positions hold each routed expert [E] int32 (1 without redundant experts)."""


def initial_placement(num_experts: int, redundant: int) -> np.ndarray:
    """Checkpoint order, then copies of experts 0, 1, ... in the X redundant positions: `expert_at` [E + X]."""
    return np.concatenate([np.arange(num_experts), np.arange(redundant) % num_experts]).astype(np.int32)


def replica_table(expert_at: np.ndarray, num_experts: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """`expert_at` [P] -> (each expert's positions [E, width], increasing and repeated to fill the row; copies [E])."""
    copies = np.bincount(expert_at, minlength=num_experts).astype(np.int32)
    if copies.min() < 1 or copies.max() > width:
        raise ValueError(f"placement holds experts {copies.min()}..{copies.max()} times; expected 1..{width}")
    order = np.argsort(expert_at, kind="stable")  # positions grouped by expert, increasing
    first = np.concatenate([[0], np.cumsum(copies)[:-1]])
    j = np.arange(width)[None, :] % copies[:, None]
    return order[first[:, None] + j].astype(np.int32), copies


def attach(model, redundant: int = 0):
    """-> a `Model` (k3jax.runtime) whose MoE blocks each hold the initial placement's tables, with their routed
    experts' stacked weights grown to E + `redundant` physical experts (`initial_placement`)."""
    from k3jax.layers.moe import MXFP4Params, MoE  # noqa: PLC0415

    e = model.cfg.num_experts
    expert_at = initial_placement(e, redundant)
    table, copies = replica_table(expert_at, e, 1 + redundant)
    module = nnx.merge(model.graphdef, model.params)
    for _, node in list(nnx.iter_graph(module)):
        if isinstance(node, MoE) and getattr(node, "expert_slots", None) is None:
            node.expert_slots = ExpertPlacement(jnp.asarray(table))
            node.expert_copies = ExpertCopies(jnp.asarray(copies))
            if redundant:  # new variables: the caller's model keeps its own (merge shares them)
                take = jnp.asarray(expert_at)
                for name in ("w1", "w3", "w2"):
                    w = getattr(node, name)
                    if isinstance(w, MXFP4Params):
                        for half in ("weight_packed", "weight_scale"):
                            var = getattr(w, half)
                            setattr(w, half, var.replace(jnp.take(var[...], take, axis=0)))
                    else:
                        setattr(node, name, w.replace(jnp.take(w[...], take, axis=0)))
                held = getattr(node, "expert_lora", None)  # routed-expert adapter slots: one per physical expert
                for f in ([] if held is None else [getattr(held, w) for w in ("w1", "w3", "w2") if hasattr(held, w)]):
                    f.lora_b = f.lora_b.replace(jnp.take(f.lora_b[...], take, axis=0))
                    if f.lora_a[...].shape[0] == e:  # (a shared A stays one)
                        f.lora_a = f.lora_a.replace(jnp.take(f.lora_a[...], take, axis=0))
    graphdef, params = nnx.split(module)
    return dataclasses.replace(model, graphdef=graphdef, params=params)


def expert_leaves(params, shared_a: bool = False) -> list[tuple[int, int, list[int]]]:
    """Per MoE layer in depth order: the indices of its `ExpertPlacement` and `ExpertCopies` leaves and of its
    routed experts' weight leaves (w1, w3, w2, packed or dense; and their adapter slots, k3jax/lora.py
    `ExpertLoRA`: every B, the A unless one is shared by all experts) in `jax.tree.flatten(params)` order."""
    layers: dict[int, list] = {}
    for i, (path, _) in enumerate(jax.tree.flatten_with_path(params)[0]):
        names = path_names(path)
        if "block_sparse_moe" not in names:
            continue
        layer, rest = int(names[names.index("layers") + 1]), names[names.index("block_sparse_moe") + 1:]
        entry = layers.setdefault(layer, [None, None, []])
        if rest[0] == "expert_slots":
            entry[0] = i
        elif rest[0] == "expert_copies":
            entry[1] = i
        elif rest[0] in ("w1", "w2", "w3") or (rest[0] == "expert_lora" and (rest[-1] == "lora_b" or not shared_a)):
            entry[2].append(i)
    return [tuple(entry) for _, entry in sorted(layers.items())]


def replica_counts(load: np.ndarray, redundant: int, ranks: int | None = None) -> np.ndarray:
    """Copies per expert [E]: one each, then each redundant position to the expert with the most load per
    copy (ties: fewer copies, then lower id; so with nothing routed the copies go round the experts), at
    most `ranks` copies of one expert (a copy more could only share a rank with another)."""
    load = np.asarray(load, np.float64)
    e = load.shape[0]
    cap = ranks if ranks is not None else redundant + 1
    if e + redundant > e * cap:
        raise ValueError(f"{redundant} redundant experts: {e} experts hold at most {e * (cap - 1)} copies over {cap} ranks")
    copies = np.ones(e, np.int64)
    ids = np.arange(e)
    for _ in range(redundant):
        share = np.where(copies < cap, load / copies, -1.0)
        copies[np.lexsort((ids, copies, -share))[0]] += 1
    return copies


def balanced_placement(load: np.ndarray, ranks: int, redundant: int = 0) -> np.ndarray:
    """Routed-token counts per expert [E] -> `expert_at` [E + X] (rank r holds positions r P / R ... (r + 1) P / R
    - 1, P = E + X). Copies by `replica_counts`, each carrying load / copies; then greedy largest-first:
    copies by decreasing load (ties by expert id), each to the least loaded rank with a free position that
    does not hold that expert yet where one exists (ties by rank); at most R copies of an expert. A rank's experts are listed in increasing
    id. Deterministic, so every replay agrees."""
    e = load.shape[0]
    p = e + redundant
    if p % ranks:
        raise ValueError(f"{e} experts + {redundant} redundant do not split over {ranks} ranks")
    per = p // ranks
    copies = replica_counts(load, redundant, ranks)
    share = np.asarray(load, np.float64) / copies
    items = np.repeat(np.arange(e), copies)
    rank_load, held = np.zeros(ranks), [[] for _ in range(ranks)]
    for x in items[np.lexsort((items, -share[items]))]:
        open_ = [r for r in range(ranks) if len(held[r]) < per]
        fresh = [r for r in open_ if x not in held[r]] or open_
        r = min(fresh, key=lambda r: (rank_load[r], r))
        held[r].append(x)
        rank_load[r] += share[x]
    return np.concatenate([sorted(h) for h in held]).astype(np.int32)


def rank_loads(load: np.ndarray, expert_at: np.ndarray, ranks: int) -> np.ndarray:
    """Tokens each rank multiplies [R] under `expert_at` [P] (an expert's load split evenly over its copies)."""
    copies = np.bincount(expert_at, minlength=load.shape[0])
    per_position = np.asarray(load, np.float64)[expert_at] / copies[expert_at]
    return per_position.reshape(ranks, -1).sum(axis=1)


def imbalance(load: np.ndarray, expert_at: np.ndarray, ranks: int) -> float:
    """Busiest rank's load over the mean rank load (1.0: balanced; 1.0 when nothing was routed)."""
    per_rank = rank_loads(load, expert_at, ranks)
    return float(per_rank.max() / per_rank.mean()) if per_rank.sum() else 1.0


def moved_index(current: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Gather index along the expert axis taking weights stored by `current` [P] to `new` [P] (both `expert_at`):
    the weights at position p afterwards are those at (the first) position holding expert `new[p]` now."""
    first = np.empty(int(max(current.max(), new.max())) + 1, np.int64)
    first[current[::-1]] = np.arange(current.shape[0])[::-1]
    return first[new].astype(np.int32)


class ExpertBalancer:
    """Host state of the balancing: the recent routed-token counts, when to plan, and the current placement
    ([MoE layer, physical expert] -> logical expert, `expert_at` per layer, which the engine's `ExpertPlacement`
    and `ExpertCopies` leaves encode)."""

    def __init__(self, num_layers: int, num_experts: int, ranks: int, window: int, interval: int, redundant: int = 0):
        self.ranks, self.window, self.interval, self.redundant = ranks, window, interval, redundant
        self.num_experts = num_experts
        self.placement = np.tile(initial_placement(num_experts, redundant), (num_layers, 1))
        self.bucket_steps = max(1, window // BUCKETS)
        self.buckets: deque = deque(maxlen=-(-window // self.bucket_steps))
        self.current, self.in_bucket, self.since = np.zeros((num_layers, num_experts)), 0, 0
        self.rebalances, self.layers_moved, self.failed_moves = 0, 0, 0
        self.last: dict = {}

    def tables(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The `ExpertPlacement` and `ExpertCopies` values of one MoE layer's current placement."""
        return replica_table(self.placement[layer], self.num_experts, 1 + self.redundant)

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
            new = balanced_placement(lo, self.ranks, self.redundant)
            b, a = imbalance(lo, cur, self.ranks), imbalance(lo, new, self.ranks)
            if a < b * (1 - MIN_GAIN):
                moves[layer] = new
            before.append(b)
            after.append(a if layer in moves else b)
        summary = dict(tokens=int(load.sum()), layers_moved=len(moves),
                       imbalance_before=float(np.mean(before)) if before else 1.0,
                       imbalance_after=float(np.mean(after)) if after else 1.0)
        return moves, summary

    def place(self, moves: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """Set these MoE layers' placements ({layer: `expert_at`}) -> their previous ones (what a move that fails
        puts back)."""
        before = {layer: self.placement[layer].copy() for layer in moves}
        for layer, new in moves.items():
            self.placement[layer] = new
        return before

    def applied(self, moves: dict[int, np.ndarray], summary: dict) -> None:
        """Count a move that landed (weights and tables written; `place` set its placement) in the stats."""
        self.rebalances += 1
        self.layers_moved += len(moves)
        self.last = summary

    def reset(self) -> None:
        """The weights were replaced (`update_weights`, placed by `attach`): the initial placement."""
        self.placement[:] = initial_placement(self.num_experts, self.redundant)

    def stats(self) -> dict:
        return dict(ranks=self.ranks, window_size=self.window, step_interval=self.interval,
                    num_redundant_experts=self.redundant, physical_experts=self.placement.shape[1],
                    rebalances=self.rebalances, layers_moved=self.layers_moved, failed_moves=self.failed_moves,
                    last=dict(self.last))


@jax.jit
def take_experts(weight: jax.Array, index: jax.Array) -> jax.Array:
    """weight [P, ...] with its expert rows gathered by `index` [P] (placement stays the caller's)."""
    return jnp.take(weight, index, axis=0)


@jax.jit
def take_groups_experts(weight: jax.Array, index: jax.Array) -> jax.Array:
    """weight [G, P, ...] with group g's expert rows gathered by `index[g]` [P]."""
    return jax.vmap(lambda w, ix: jnp.take(w, ix, axis=0))(weight, index)


def stacked_index(shape: tuple, index: dict[int, np.ndarray]) -> np.ndarray:
    """A scanned run's gather index [G, P] for a stacked weight of `shape` [G, P, ...]: group g's `index[g]`, the
    other groups' rows where they are."""
    full = np.tile(np.arange(shape[1], dtype=np.int32), (shape[0], 1))
    for g, ix in index.items():
        full[g] = ix
    return full


def take_stacked_experts(weight: jax.Array, index: dict[int, np.ndarray]) -> jax.Array:
    """A scanned run's stacked weight [G, P, ...] with group g's expert rows gathered by `index[g]` [P] (the
    other groups as they are), in one gather."""
    return take_groups_experts(weight, jnp.asarray(stacked_index(weight.shape, index)))


def gather_program(weight: jax.Array, index: dict) -> Callable[[], jax.Array]:
    """`take_experts` ({None: index}) or `take_stacked_experts` ({group: index}) of `weight`, compiled now -> a call
    that launches it. (A multi-process leader prepares its moves before telling the followers: what fails on it
    alone fails before any process runs a gather whose collectives would wait for it.)"""
    if None in index:
        fn, ix = take_experts, np.asarray(index[None], np.int32)
    else:
        fn, ix = take_groups_experts, stacked_index(weight.shape, index)
    compiled = fn.lower(weight, ix).compile()
    return lambda: compiled(weight, ix)


def take_on_host(weight: jax.Array, index: dict) -> jax.Array:
    """`take_experts` / `take_stacked_experts` ({None: index} or {group: index}) done in host memory and placed
    back shard by shard, for XLA:CPU in one process: its devices share the host's memory, and the jitted gather
    over a mesh-split expert axis is a cross-device program whose in-process collective XLA:CPU aborts when a
    loaded host leaves one device's thread unscheduled for 40 s (seen in CI runs of the EPLB tests)."""
    full = np.array(weight)  # [P, ...] or [G, P, ...]
    if None in index:
        full = full[index[None]]
    else:
        for g, ix in index.items():
            full[g] = full[g][ix]
    return jax.device_put(full, weight.sharding)
