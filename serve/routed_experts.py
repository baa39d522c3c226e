"""Routed experts per token (vLLM's `enable_return_routed_experts`, SGLang's `return_routed_experts`).

Rollout routing replay (R3) trains a MoE policy with the expert choices its rollouts made: the serving
engine returns, for every position a sequence fed through the model (prompt and generated tokens but the
last), the logical expert ids each MoE layer's router picked, `[len(prompt) + len(output) - 1, L_moe, k]`.
Ids are logical (before expert-parallel placement and redundant copies), so they do not change when EPLB
moves experts.

The step programs return each position's ids beside the expert counts (`StepOptions.return_routes`); the
engine copies a row's computed positions into its sequence (`Sequence.routes`). Positions a sequence does
not compute, a prefix-cache hit's, come from this module's `RoutesStore`: the ids of every computed
granule of positions (`granule` tokens, keyed by the prefix hash of the tokens up to its end, so a key
names exactly the tokens the ids depend on, salt and adapter included), held in host memory under a byte
budget with least-recently-used eviction. A hit whose granules are not all held is not taken (the
request computes its prompt), so a finished sequence's ids always cover every position.
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from typing import Optional

import numpy as np

from serve.position_rows import PositionRows
from serve.prefix_cache import PrefixHasher

KEY = b"R"  # the store's kind of prefix key


def ids_dtype(num_experts: int) -> np.dtype:
    """The ids' dtype: int16 while every expert id fits (half the bytes of int32 to read back and keep: K3's 896
    experts fit), else int32. One rule for the step programs' outputs and the engine's host copies."""
    return np.dtype(np.int16 if num_experts <= np.iinfo(np.int16).max else np.int32)


def to_base64(routes: np.ndarray, start: int = 0) -> str:
    """SGLang's wire form of a sequence's routed experts (`/generate`'s `meta_info.routed_experts`, the OpenAI
    routes' `sgl_ext.routed_experts`): the int32 ids [positions from `start`, MoE layers, experts per token],
    little-endian, flattened in that order, base64."""
    return base64.b64encode(np.ascontiguousarray(routes[start:], "<i4").tobytes()).decode("ascii")


class RoutesStore:
    """Routed ids of cached prefixes, by granule: `granule` positions [L_moe, k] each, keyed by the prefix
    hash of the tokens through the granule's end; at most `budget` bytes, least recently used evicted."""

    def __init__(self, granule: int, budget: int):
        if granule < 1:
            raise ValueError(f"granule must be >= 1, got {granule}")
        self.granule, self.budget = granule, int(budget)
        self.blocks: OrderedDict[bytes, np.ndarray] = OrderedDict()  # key -> [granule, L_moe, k]
        self.bytes = 0
        self.evicted = 0  # granules dropped for the budget

    def put(self, hasher: PrefixHasher, routes: np.ndarray, start: int, end: int) -> None:
        """Keep the granules that end in (start, end] (positions computed from `start` to `end` complete them).
        `routes` [>= end, L_moe, k] holds the sequence's ids by position, `hasher` its tokens through `end`."""
        g = self.granule
        for c in range(start // g, end // g):  # the granules this range completes
            key = hasher.key(KEY, (c + 1) * g)
            if key in self.blocks:
                self.blocks.move_to_end(key)
                continue
            block = routes[c * g:(c + 1) * g].copy()
            if block.nbytes > self.budget or (block < 0).any():  # (a position not recorded: never stored)
                continue
            self.blocks[key] = block
            self.bytes += block.nbytes
            while self.bytes > self.budget:
                _, old = self.blocks.popitem(last=False)
                self.bytes -= old.nbytes
                self.evicted += 1

    def take(self, hasher: PrefixHasher, n: int) -> Optional[list[np.ndarray]]:
        """The granules of positions [0, n) in order (the stored arrays, not copies), or None when n is not a
        whole number of granules or one of them is not held. Taking refreshes them."""
        g = self.granule
        if n % g:
            return None
        keys = [hasher.key(KEY, (c + 1) * g) for c in range(n // g)]
        if not all(k in self.blocks for k in keys):
            return None
        for k in keys:
            self.blocks.move_to_end(k)
        return [self.blocks[k] for k in keys]

    def clear(self) -> None:
        self.blocks.clear()
        self.bytes = 0


class SequenceRoutes(PositionRows):
    """One sequence's routed ids by position, grown as it computes: `ids` [capacity, L_moe, k], -1 where not
    (yet) recorded."""

    def __init__(self, layers: int, k: int, dtype, capacity: int = 64):
        super().__init__((layers, k), dtype, -1, capacity)

    @property
    def ids(self) -> np.ndarray:
        return self.values

    def first(self, n: int, dtype=np.int32) -> np.ndarray:
        """Positions [0, n) as int32 [n, L_moe, k] (a copy)."""
        return super().first(n, dtype)
