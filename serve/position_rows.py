"""Per-position values a sequence collects as it computes (its routed experts, its hidden states).

A step program returns a value per position it ran; the engine copies a row's computed positions into the
sequence's `PositionRows`, which grows as the sequence does. A preempted sequence recomputes from its start
(or a prefix-cache hit) and overwrites the same positions with the same values.
"""

from __future__ import annotations

import numpy as np


class PositionRows:
    """Values by position, [capacity, *shape] of `dtype`, `fill` where not (yet) recorded. `end` is the end of
    the furthest positions written."""

    def __init__(self, shape: tuple[int, ...], dtype, fill, capacity: int = 64):
        self.fill = fill
        self.values = np.full((capacity, *shape), fill, dtype)
        self.end = 0

    def write(self, start: int, rows: np.ndarray) -> None:
        """Positions [start, start + len(rows)) computed with these values [n, *shape]."""
        end = start + len(rows)
        if end > len(self.values):
            grown = np.full((max(end, 2 * len(self.values)), *self.values.shape[1:]), self.fill, self.values.dtype)
            grown[:len(self.values)] = self.values
            self.values = grown
        self.values[start:end] = rows
        self.end = max(self.end, end)

    def fill_from(self, blocks: list[np.ndarray]) -> None:
        """Positions from the start, block by block (a prefix-cache hit's)."""
        if blocks:
            self.write(0, np.concatenate(blocks))

    def first(self, n: int, dtype=None) -> np.ndarray:
        """Positions [0, n) as `dtype` (default: the stored one) [n, *shape] (a copy)."""
        out = np.full((n, *self.values.shape[1:]), self.fill, dtype or self.values.dtype)
        m = min(n, len(self.values))
        out[:m] = self.values[:m]
        return out
