"""What the engine records for its readers without growing for its life: the latest samples of a series
(`Recent`) and observations counted by bucket (`BucketCounts`, a Prometheus histogram's contents)."""

from __future__ import annotations

import bisect
import collections
import itertools
import math
from typing import Iterable

__all__ = ["Recent", "BucketCounts", "ITERATION_TOKEN_BUCKETS"]

# vLLM's `vllm:iteration_tokens_total` buckets (tokens per engine step)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Recent:
    """The last `size` values appended, and `total`, how many ever were. A reader notes `total`, then
    `since(that)` gives what was appended after it (as far as the ring still holds it)."""

    def __init__(self, size: int = 1 << 16):
        self._values: collections.deque = collections.deque(maxlen=size)
        self.total = 0

    def append(self, value) -> None:
        self._values.append(value)
        self.total += 1

    def since(self, total: int) -> list:
        n = min(self.total - total, len(self._values))
        return list(itertools.islice(self._values, len(self._values) - n, None)) if n > 0 else []

    def __len__(self) -> int:  # the values held (at most `size`)
        return len(self._values)

    def __iter__(self):
        return iter(list(self._values))


class BucketCounts:
    """Observations counted by bucket: `counts[i]` those <= `edges[i]` and above the edge before (the last,
    above every edge), not cumulative, so a reader on another thread sees each count only grow."""

    def __init__(self, edges: Iterable[float]):
        self.edges = tuple(edges)
        self.counts = [0] * (len(self.edges) + 1)
        self.sum = 0

    def observe(self, value) -> None:
        self.counts[bisect.bisect_left(self.edges, value)] += 1
        self.sum += value

    def as_dict(self) -> dict:
        """{"counts": {upper edge as Prometheus writes `le` ("+Inf" last): count}, "sum"} (summing two of
        these key by key adds their histograms)."""
        les = [_le(e) for e in self.edges] + ["+Inf"]
        return {"counts": dict(zip(les, list(self.counts))), "sum": self.sum}


def _le(edge: float) -> str:
    return "+Inf" if math.isinf(edge) else repr(float(edge))
