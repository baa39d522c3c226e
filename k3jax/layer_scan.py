"""Scanning over a model's repeating layers: one compiled copy of a repeated group of layers.

Unrolled, a step program holds a copy of the layer code per layer, and XLA compiles every copy: K3's
93 layers take ~108 s per step program on the 2-core CPU host and a default bucket set is tens of
programs (benchmarks/startup.py). K3 repeats a 12-layer group (3 x [KDA, KDA, KDA, MLA], one AttnRes
block), Kimi-Linear a 4-layer one. `plan` finds the longest run of identical groups (the same
attention kind, MoE or dense FFN and AttnRes block starts at each position), `split_params` stacks
those layers' weights into one array per (position in the group, weight) with a leading group axis,
and the model runs the run as one `jax.lax.scan` over the groups (`KimiModel.run(..., scan=)`): a
program's size no longer grows with depth. Layers before and after the run stay unrolled.

Inside the scan the cache index of a layer is traced (`first + group * stride`), so cache views
address their state by a traced layer index there (`CacheView.scan_state`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax.config import ModelConfig
from k3jax.sharding import put


@dataclass(frozen=True)
class LayerScan:
    """Layers start .. start + period * groups - 1 run as `groups` scanned groups of `period` layers."""

    start: int
    period: int
    groups: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.groups

    def covers(self, layer: int) -> bool:
        return self.start <= layer < self.stop

    def layers_at(self, i: int) -> list[int]:
        """The layers at position i of every group."""
        return [self.start + g * self.period + i for g in range(self.groups)]

    @property
    def compiled_layers_saved(self) -> int:
        """Layer copies a program holds fewer than unrolled (the scanned group is compiled once)."""
        return (self.groups - 1) * self.period


def layer_signature(cfg: ModelConfig, layer: int) -> tuple:
    """What makes two layers' code and weight shapes the same: attention kind, FFN kind, and (AttnRes)
    whether the layer opens a block."""
    opens = layer % cfg.attn_res_block_size == 0 if cfg.uses_attn_res else None
    return cfg.is_mla(layer), cfg.is_moe(layer), opens


def plan(cfg: ModelConfig, min_groups: int = 2, max_period: int = 32) -> Optional[LayerScan]:
    """The run of identical consecutive groups that saves the most compiled layer copies (the shortest
    period on a tie), or None when no group repeats `min_groups` times. With AttnRes, layer 0 (which
    mixes the embedding alone) stays out of the run."""
    n = cfg.num_hidden_layers
    sig = [layer_signature(cfg, l) for l in range(n)]
    first = 1 if cfg.uses_attn_res else 0
    best: Optional[LayerScan] = None
    for p in range(1, min(max_period, n // 2) + 1):
        for s in range(first, n - 2 * p + 1):
            g = 1
            while s + (g + 1) * p <= n and sig[s + g * p:s + (g + 1) * p] == sig[s:s + p]:
                g += 1
            if g >= min_groups and (best is None or (g - 1) * p > best.compiled_layers_saved):
                best = LayerScan(s, p, g)
    return best


def cache_strides(cfg: ModelConfig, scan: LayerScan) -> tuple[int, int]:
    """(KDA layers, MLA layers) per group: how far a position's cache index moves from group to group."""
    group = range(scan.start, scan.start + scan.period)
    mla = sum(1 for l in group if cfg.is_mla(l))
    return scan.period - mla, mla


def _is_expert_weight(path) -> bool:
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return (len(names) > 1 and names[0] == "block_sparse_moe" and names[1] in ("w1", "w2", "w3"))


def split_experts(state) -> tuple:
    """A scanned position's stacked layer state -> (the state with its routed experts' weights as [G]
    placeholders, {path: those weights as one stack [G * E, ...]}). The scan slices the first per group;
    the MoE reads its layer's experts out of the second (`k3jax.layers.moe.stacked_experts`), gathering the
    routed ones, where a per-group slice would copy every expert of the layer each step. (A reshape of
    the leading axes: free for arrays whose expert axis is not split over devices.)"""
    whole = {}

    def cut(path, x):
        if not _is_expert_weight(path):
            return x
        whole[jax.tree_util.keystr(path)] = x.reshape(-1, *x.shape[2:])
        return jnp.zeros((x.shape[0],), x.dtype)

    return jax.tree_util.tree_map_with_path(cut, state), whole


def join_experts(state, whole: dict):
    """Put `split_experts`' stacks back in place of their placeholders."""
    return jax.tree_util.tree_map_with_path(lambda p, x: whole.get(jax.tree_util.keystr(p), x), state)


def _stack(xs: list[jax.Array]) -> jax.Array:
    """Stack one weight of every group -> [G, ...], keeping a mesh placement (the group axis whole)."""
    sh = getattr(xs[0], "sharding", None)
    if isinstance(sh, NamedSharding):
        out = NamedSharding(sh.mesh, P(None, *sh.spec))
        return jax.jit(lambda *a: jnp.stack(a), out_shardings=out)(*xs)
    return jnp.stack(xs)


def split_params(params, scan: LayerScan):
    """A model's parameter state -> (the state with the scanned layers' weights replaced by 0-d placeholders,
    [per position in the group: that layer's state with every weight stacked over the groups, [G, ...]]).

    The placeholders keep the model's graph whole (`nnx.merge` of the first part builds every module);
    the scanned layers' modules are rebuilt inside the scan from the stacked part."""
    layers = params["layers"]
    stacked = [jax.tree.map(lambda *xs: _stack(list(xs)), *[layers[l] for l in scan.layers_at(i)])
               for i in range(scan.period)]

    def hollow(path, x):
        scanned = (len(path) > 1 and getattr(path[0], "key", None) == "layers"
                   and scan.covers(getattr(path[1], "key", -1)))
        if not scanned:
            return x
        sh = getattr(x, "sharding", None)  # on a mesh, placed on it like every weight (weight writes re-place
        zero = jnp.zeros((), x.dtype)      # every leaf where it was: the programs must see the same placement)
        return put(zero, NamedSharding(sh.mesh, P())) if isinstance(sh, NamedSharding) else zero

    return jax.tree_util.tree_map_with_path(hollow, params), stacked


def leaf_map(params, scan: LayerScan) -> list[tuple[int, Optional[int]]]:
    """Where each weight of `params` (in `jax.tree.flatten` order) is held among the leaves of
    `split_params(params, scan)`: (leaf, None) for a layer outside the run (its own leaf, same index), or
    (leaf, group) for a scanned layer's weight, at `group` along the leading axis of its position's
    stacked leaf. Lets the engine write one layer's weights (adapter slots, moved experts) either way."""
    flat = jax.tree.flatten_with_path(params)[0]
    at, base = {}, len(flat)  # (position in the group, path inside the layer) -> stacked leaf
    for i in range(scan.period):
        inner = jax.tree.flatten_with_path(params["layers"][scan.start + i])[0]
        at.update({(i, jax.tree_util.keystr(p)): base + k for k, (p, _) in enumerate(inner)})
        base += len(inner)
    out = []
    for k, (path, _) in enumerate(flat):
        layer = getattr(path[1], "key", None) if len(path) > 1 and getattr(path[0], "key", None) == "layers" else None
        if isinstance(layer, int) and scan.covers(layer):
            group, i = divmod(layer - scan.start, scan.period)
            out.append((at[(i, jax.tree_util.keystr(path[2:]))], group))
        else:
            out.append((k, None))
    return out
