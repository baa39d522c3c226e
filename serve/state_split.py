"""The cache arena split over a mesh axis by KDA heads: which part of it each rank holds, and how the
step runs its arena reads and writes on every rank's own part.

The arena `float32[num_units, R * unit_elems]` is split by columns over the `heads` rule's mesh axis
(R ranks): rank r's `[num_units, unit_elems]` holds every MLA page (the one-KV-head latent is the same
on every rank; with decode context parallelism, every R-th token of each page instead) and, in each state slot, KDA heads r N / R ... (r + 1) N / R - 1 with their conv
channels. Head blocks are contiguous, as GSPMD splits the KDA projections under the same rule, so a
rank's state meets its own heads' q, k, v without communication.

Each arena access of the step (`serve/memory.py`) is written for one rank's arena and runs here inside
`jax.shard_map`: page reads leave every rank with its own (identical) copy and are declared
replicated; page writes carry replicated contents to every rank; KDA reads and writes carry the head
axis split like the arena. The kernels that consume the arena run per rank too: the batched KDA op on
the rank's heads and gathered states, the paged MLA kernel on the rank's query heads against its own
pages (`serve/step.py`). Nothing in the arena crosses devices. Without a split (`StateSplit` is None)
the functions are called directly on the whole arena, which is then replicated or on one device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3jax.sharding import axes_size


@dataclass(frozen=True)
class StateSplit:
    mesh: Mesh
    axis: Any  # mesh axis name, or a tuple of names (split over their product)

    @property
    def ranks(self) -> int:
        return axes_size(self.axis, dict(self.mesh.shape))

    @property
    def arena(self) -> P:
        """The arena's spec: columns split over the axis."""
        return P(None, self.axis)

    def sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.arena)

    def heads(self, dim: int) -> P:
        """A spec splitting dimension `dim` (a KDA head or conv-channel axis) over the axis."""
        return P(*([None] * dim), self.axis)


def on_ranks(split: StateSplit | None, fn: Callable, in_specs, out_specs) -> Callable:
    """`fn` written for one rank's arena, run on every rank (`shard_map`) when the arena is split.

    Specs use `split.arena` for the arena, `split.heads(d)` for head-split values and `P()` for
    values every rank holds whole. `check_vma=False`: page reads return each rank's own copy, equal
    on every rank by construction, which the replication check cannot know."""
    if split is None:
        return fn
    return jax.shard_map(fn, mesh=split.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
