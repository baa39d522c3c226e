"""The engine's weights by checkpoint tensor name: read one, write some (an RL trainer's weight sync).

SGLang's `get_weights_by_name` (check that a sync landed) and `update_weights_from_tensor` (push
tensors, often in buckets, without a checkpoint on disk) speak the HF checkpoint's names and layout,
while the engine holds its weights otherwise: dense projections transposed on CPU
(`k3jax/weight_layout.py`), MXFP4 experts expanded (`k3jax/dequantize.py`), routed experts at their
load-balanced physical places (`serve/eplb.py`), a layer scan's layers stacked (`k3jax/layer_scan.py`),
split over a mesh. `WeightNames` maps each checkpoint name to the per-layer weight holding it and the
transform between the two layouts; the engine reads and writes through its `_leaf_at` table, so a
name means the same tensor in every one of those forms.

Names follow `k3jax.checkpoint.hf_name` (the names `load_model` reads): routed experts one tensor per
expert (`...experts.{e}.w1.weight`, or `weight_packed` / `weight_scale` for MXFP4), the dense layer-0
MLP under `mlp.` or `block_sparse_moe.`, `lm_head.weight` the embedding when tied. `A_log` comes as
the checkpoint's shape for Kimi-Linear ([1, 1, H, 1]) and as its live heads [H] for K3 (whose
checkpoint pads it to 128 entries; any padded length is taken on writes). MXFP4 experts the engine
holds expanded answer under `...weight` (dense); their packed names are accepted on writes (a half
waits for its partner, in the same call or a later one) but not read back (a dense weight does not
determine its scales).

Reads and writes go shard by shard: each device's own shard is scattered into (`write`), and a read copies only
the asked rows of the shards holding them (`read`), so no cross-device program runs. On a multi-process mesh
the leader sends the tensors (`pack_tensors`) and every process writes its shards; a read's rows are
all-gathered from the processes holding them (serve/engine.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import re
from typing import Any, Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.checkpoint import hf_name
from k3jax.dequantize import expand_mxfp4
from k3jax.layers.linear import Linear
from k3jax.layers.moe import MoE
from k3jax.lora import path_names

_EXPERT = re.compile(r"\.experts\.(\d+)\.")


class WeightNameError(KeyError, ValueError):
    """A tensor name this model does not have, or a tensor of the wrong shape or dtype (names it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclasses.dataclass(frozen=True)
class NamedWeight:
    """Where one checkpoint tensor is held among the engine's per-layer weights, and how."""
    leaf: int                      # the weight in `jax.tree.flatten` order of the engine's per-layer state
    shape: tuple[int, ...]         # the checkpoint tensor's shape (one expert's, for routed experts)
    dtype: Any                     # the checkpoint tensor's dtype as the engine takes it
    transposed: bool = False       # held [in, out] (experts [E, in, out]); the checkpoint's is [out, in]
                                   # (a packed half: the dense weight it expands to is)
    moe_layer: Optional[int] = None  # routed experts: the MoE layer's index in depth order (the name has the expert)
    packed_half: Optional[str] = None  # "weight_packed" / "weight_scale" of MXFP4 experts held expanded
    a_log: Optional[str] = None    # A_log's checkpoint form: "kimi_linear" ([1, 1, H, 1]) or "kimi_k3" (padded [H+])


class WeightNames:
    """Checkpoint tensor names -> `NamedWeight` for one engine's per-layer weights (`model`: its `Model` after
    the start-up transforms, before any layer scan). `expanded_group`: the MXFP4 group size when the
    checkpoint's packed experts are held expanded (else None)."""

    def __init__(self, model, expanded_group: Optional[int] = None):
        cfg = model.cfg
        self.expanded_group = expanded_group
        self.prefix = "language_model." if cfg.family == "kimi_k3" else ""
        module = nnx.merge(model.graphdef, model.params)
        transposed: set[tuple] = set()
        for path, node in nnx.iter_graph(module):
            path = tuple(str(p) for p in path)
            if isinstance(node, Linear) and node.in_out:
                transposed.add(path + ("weight",))
            elif isinstance(node, MoE) and node.experts_in_out:
                transposed.update(path + (w,) for w in ("w1", "w2", "w3"))
        if getattr(module, "head_in_out", False):
            transposed.add(("lm_head",))
        flat = jax.tree.flatten_with_path(model.params)[0]
        names = [tuple(path_names(p)[:-1]) for p, _ in flat]  # (the trailing "value")
        moe_layers = sorted({int(n[1]) for n in names if len(n) > 3 and n[2] == "block_sparse_moe" and n[3] == "w1"})
        self.templates: dict[str, NamedWeight] = {}
        for k, (n, (_, x)) in enumerate(zip(names, flat)):
            if n[-1] in ("lora_a", "lora_b", "expert_slots", "expert_copies"):
                continue  # adapter slots and placement tables: not checkpoint tensors
            experts = len(n) > 3 and n[2] == "block_sparse_moe" and n[3] in ("w1", "w2", "w3")
            shape = tuple(x.shape[1:] if experts else x.shape)
            flip = n in transposed or (experts and n[:4] in transposed)
            if flip:
                shape = shape[:-2] + (shape[-1], shape[-2])
            entry = NamedWeight(k, shape, x.dtype, flip, moe_layers.index(int(n[1])) if experts else None,
                                a_log=cfg.family if n[-1] == "A_log" else None)
            name = hf_name(n, self.prefix)
            self._add(name, entry)
            if experts and expanded_group and len(n) == 4:  # dense here, packed in the checkpoint
                rows, cols = shape
                for half, width in (("weight_packed", cols // 2), ("weight_scale", cols // expanded_group)):
                    self._add(name[:-len("weight")] + half,
                              dataclasses.replace(entry, shape=(rows, width), dtype=np.dtype(np.uint8),
                                                  packed_half=half))
        self.tied = cfg.tie_word_embeddings and self.prefix + "lm_head.weight" not in self.templates
        self.experts = cfg.num_experts

    def _add(self, name: str, entry: NamedWeight) -> None:
        self.templates[name] = entry
        if ".mlp." in name:  # HF transformers 5.x writes the dense layer-0 MLP under block_sparse_moe.
            self.templates[name.replace(".mlp.", ".block_sparse_moe.")] = entry

    def resolve(self, name: str) -> tuple[NamedWeight, Optional[int]]:
        """-> (where `name` is held, its expert index or None). Raises WeightNameError naming it."""
        if not isinstance(name, str) or not name:
            raise WeightNameError(f"name: expected a tensor name, got {name!r}")
        if self.tied and name == self.prefix + "lm_head.weight":
            name = self.prefix + "model.embed_tokens.weight"  # tied: the embedding is the head
        entry = self.templates.get(name)
        if entry is not None and entry.moe_layer is None:
            return entry, None
        m = _EXPERT.search(name)
        if m is not None:
            entry = self.templates.get(name[:m.start()] + ".experts.{e}." + name[m.end():])
            if entry is not None:
                e = int(m.group(1))
                if e >= self.experts:
                    raise WeightNameError(f"tensor {name}: expert {e} out of range (the model has {self.experts})")
                return entry, e
        hint = ""
        if name.endswith((".weight_packed", ".weight_scale")) and m is not None:
            hint = " (this engine holds its routed experts dense: ask for `...weight`)"
        near = difflib.get_close_matches(name, list(self.templates), n=3, cutoff=0.8)
        raise WeightNameError(f"tensor {name}: no such weight in this model{hint}"
                              + (f"; near it: {', '.join(near)}" if near else ""))

    def _checkpoint_templates(self) -> Iterable[tuple[str, NamedWeight]]:
        for t, entry in self.templates.items():
            if ".block_sparse_moe." in t and t.replace(".block_sparse_moe.", ".mlp.") in self.templates:
                continue  # the alias of a dense MLP
            if entry.moe_layer is not None and self.expanded_group and entry.packed_half is None:
                continue  # its checkpoint form is the packed pair
            yield t, entry

    def names(self) -> list[str]:
        """Every checkpoint tensor name (routed experts one per expert; MXFP4 held expanded: the packed pairs)."""
        return [t.format(e=e) if "{e}" in t else t for t, _ in self._checkpoint_templates()
                for e in (range(self.experts) if "{e}" in t else [None])]

    def keys(self) -> set[tuple]:
        """(weight, expert) of every held tensor: what writing every checkpoint tensor covers."""
        return {(entry.leaf, e) for t, entry in self._checkpoint_templates()
                for e in (range(self.experts) if "{e}" in t else [None])}

    # ---- layout conversions -------------------------------------------------------------------------------
    def to_checkpoint(self, entry: NamedWeight, held: np.ndarray) -> np.ndarray:
        """One tensor as the engine holds it -> the checkpoint's layout."""
        if entry.transposed:
            held = np.swapaxes(held, -1, -2)
        if entry.a_log == "kimi_linear":
            held = held.reshape(1, 1, -1, 1)
        return held

    def to_held(self, name: str, entry: NamedWeight, value) -> np.ndarray:
        """A checkpoint tensor (numpy, JAX or torch) -> the engine's layout and dtype, checked."""
        a = as_numpy(value)
        if entry.a_log is not None:
            flat = a.reshape(-1)
            heads = entry.shape[0]
            if flat.size < heads:
                raise WeightNameError(f"tensor {name}: {flat.size} entries for {heads} heads")
            a = flat[:heads]
        elif tuple(a.shape) != entry.shape:
            raise WeightNameError(f"tensor {name}: shape {list(a.shape)} does not match the model's {list(entry.shape)}")
        if entry.packed_half is not None or entry.dtype == np.uint8:
            if a.dtype != np.uint8:
                raise WeightNameError(f"tensor {name}: packed MXFP4 data must be uint8, got {a.dtype}")
        elif not np.issubdtype(a.dtype, np.floating) and a.dtype != jnp.bfloat16:
            raise WeightNameError(f"tensor {name}: expected floating-point values, got {a.dtype}")
        if entry.transposed and entry.packed_half is None:
            a = a.T
        return a


def as_numpy(value) -> np.ndarray:
    """numpy / JAX / torch (CPU, any float dtype incl. bfloat16) -> a numpy array."""
    if hasattr(value, "detach"):  # a torch tensor: numpy has no bfloat16, go through float32 (exact)
        t = value.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            return np.asarray(t.float().numpy()).astype(jnp.bfloat16)
        return np.asarray(t.numpy())
    return np.asarray(value)


def digest(items: list[tuple[str, np.ndarray]], prior: str = "") -> str:
    """What a named write changes, chained after `prior` -> a hex digest: each tensor's name, dtype, shape and a
    strided sample of its values (at most 4096). Engines sharing a host store tell their weights apart by it
    (`PrefixCache.origin`, chained onto the weights' checksum `Engine._weights_digest`): each write changes it."""
    h = hashlib.sha256(prior.encode())
    for name, a in items:
        h.update(json.dumps([name, str(a.dtype), list(a.shape)]).encode())
        h.update(np.ascontiguousarray(a.flat[np.arange(0, a.size, max(1, -(-a.size // 4096)))]).tobytes())
    return h.hexdigest()[:16]


def _bits(x: jax.Array) -> jax.Array:
    """A weight's values as unsigned integers of their width (sub-byte types: their values widened to 32 bits)."""
    bits = jnp.finfo(x.dtype).bits if jnp.issubdtype(x.dtype, jnp.floating) else (
        8 if x.dtype == jnp.bool_ else jnp.iinfo(x.dtype).bits)
    if bits not in (8, 16, 32, 64):
        x, bits = x.astype(jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else jnp.int32), 32
    u = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
    return jax.lax.bitcast_convert_type(u, {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint32}[bits])


def _mixed_sum(u: jax.Array, start) -> jax.Array:
    """Each element's bits mixed with its index (`start` + its place in `u`), then a wrapping uint32 sum."""
    idx = jax.lax.iota(jnp.uint32, u.size).reshape(u.shape) + jnp.asarray(start, jnp.uint32)
    v = u.astype(jnp.uint32) ^ (idx * jnp.uint32(0x9E3779B9))
    v = (v ^ (v >> 16)) * jnp.uint32(0x85EBCA6B)  # (murmur3's finaliser: a change of any bit spreads)
    v = (v ^ (v >> 13)) * jnp.uint32(0xC2B2AE35)
    return jnp.sum(v ^ (v >> 16), dtype=jnp.uint32)


@functools.partial(jax.jit, static_argnames="by_rows")
def checksum(x: jax.Array, group: Optional[jax.Array] = None, by_rows: bool = False) -> jax.Array:
    """A weight's whole content -> a uint32 checksum (group: that slice of a layer scan's stacked leaf): each
    element's bits mixed with its index in the weight's own shape, then a wrapping sum. Exact whatever the
    sharding, order or stacking of the values, so engines holding the same weights differently agree; one read of
    the weight on its devices (no transfer but the result). A host store's entries are tagged by it
    (`Engine._weights_digest`): a sample missed updates of the weights outside it.

    `by_rows`: the same sum, one leading-axis row at a time. XLA:CPU does not fuse the mixing into the reduction:
    it held the whole weight as uint32 beside it (twice a bf16 weight's bytes, four times a packed MXFP4 one's); row
    by row at most one copy of the weight's bits (GPU and TPU reductions fuse the mixing: no copy)."""
    if group is not None:
        x = jax.lax.dynamic_index_in_dim(x, group, 0, keepdims=False)
    u = _bits(x)
    if not by_rows or x.ndim < 2 or not x.shape[0]:  # (no rows: no element to sum a row of)
        return _mixed_sum(u, 0)
    per = x.size // x.shape[0]

    def row(i, total):
        return total + _mixed_sum(jax.lax.dynamic_index_in_dim(u, i, 0, keepdims=False),
                                  i.astype(jnp.uint32) * jnp.uint32(per))
    return jax.lax.fori_loop(0, x.shape[0], row, jnp.uint32(0))


def pair_expanded(writes: list[tuple[str, NamedWeight, Optional[int], np.ndarray]], group: int, dtypes: list,
                  pending: dict) -> list:
    """Writes of MXFP4 halves (for experts held expanded) -> dense writes: each matrix's packed and scale
    tensors dequantised together (to `dtypes[leaf]`, the held weight's dtype). A half whose partner has not
    come yet waits in `pending` ({(stem, expert): {half: (entry, value)}}, kept by the caller across calls:
    a trainer's buckets may split a pair)."""
    out, pairs = [], {}  # pairs: held weight -> [(stem, expert, entry, packed, scale)]
    for name, entry, e, a in writes:
        if entry.packed_half is None:
            out.append((name, entry, e, a))
            continue
        stem = name[:-len(entry.packed_half)]
        got = pending.setdefault((stem, e), {})
        got[entry.packed_half] = (entry, a)
        if len(got) == 2:
            del pending[(stem, e)]
            pairs.setdefault(entry.leaf, []).append((stem, e, entry, got["weight_packed"][1], got["weight_scale"][1]))
    for leaf, done in pairs.items():  # one dequantisation per weight (a per-expert call costs ~2 ms of dispatch)
        dense = np.asarray(expand_mxfp4(np.stack([d[3] for d in done]), np.stack([d[4] for d in done]),
                                       dtype=np.dtype(dtypes[leaf]), group_size=group))
        for (stem, e, entry, _, _), w in zip(done, dense):
            dense_entry = dataclasses.replace(entry, shape=w.shape, dtype=w.dtype, packed_half=None)
            out.append((stem + "weight", dense_entry, e, w.T if entry.transposed else w))
    return out


def _bounds(index: tuple, shape: tuple) -> list[tuple[int, int]]:
    """A shard's index (slices) -> [(start, stop)] per axis."""
    return [(sl.start or 0, n if sl.stop is None else sl.stop) for sl, n in zip(index, shape)]


def read(leaf: jax.Array, lead: tuple[int, ...], rows: Optional[int] = None, rows_axis: int = 0
         ) -> tuple[np.ndarray, np.ndarray]:
    """`leaf[lead]` on the host, at most `rows` entries along `rows_axis` of the result, copied shard by shard:
    only the bytes asked for leave the device and no cross-device op runs (a tensor split over a mesh is
    put together on the host) -> (values, which of them this process holds: on a multi-process mesh the rest
    are other processes' shards)."""
    shape = leaf.shape[len(lead):]
    want = [(0, n) for n in shape]
    if rows is not None:
        want[rows_axis] = (0, min(rows, shape[rows_axis]))
    out = np.zeros([b - a for a, b in want], leaf.dtype)
    held = np.zeros(out.shape, bool)
    done = set()
    for shard in leaf.addressable_shards:
        bounds = _bounds(shard.index, leaf.shape)
        head, rest = bounds[:len(lead)], bounds[len(lead):]
        if any(not lo <= i < hi for i, (lo, hi) in zip(lead, head)) or tuple(rest) in done:
            continue
        cut = [(max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(want, rest)]
        if any(a >= b for a, b in cut):
            continue
        done.add(tuple(rest))
        local = tuple(i - lo for i, (lo, _) in zip(lead, head)) + tuple(
            slice(a - lo, b - lo) for (a, b), (lo, _) in zip(cut, rest))
        at = tuple(slice(a - w, b - w) for (a, b), (w, _) in zip(cut, want))
        out[at], held[at] = np.asarray(shard.data[local]), True
    return out, held


def pack_tensors(items: list[tuple[str, np.ndarray]]) -> bytes:
    """(name, array) pairs -> bytes (a JSON header of names, dtypes and shapes, then the raw values; bfloat16
    kept), what the leader of a multi-process mesh sends its followers."""
    head = json.dumps([[n, str(a.dtype), list(a.shape)] for n, a in items]).encode()
    return b"".join([len(head).to_bytes(8, "little"), head, *(np.ascontiguousarray(a).tobytes() for _, a in items)])


def unpack_tensors(raw: bytes) -> list[tuple[str, np.ndarray]]:
    n = int.from_bytes(raw[:8], "little")
    at, out = 8 + n, []
    for name, dtype, shape in json.loads(raw[8:at]):
        dt = np.dtype(jnp.dtype(dtype))
        size = int(np.prod(shape)) * dt.itemsize
        out.append((name, np.frombuffer(raw[at:at + size], dt).reshape(shape)))
        at += size
    return out


def write(leaf: jax.Array, writes: Iterable[tuple[tuple, np.ndarray]]) -> jax.Array:
    """-> `leaf` with each (leading index, value of the remaining axes) written: one scatter per device on its own
    shard (no cross-device op), or the value whole for an empty index. Not donated: the caller's `Model` may
    share the array."""
    writes = list(writes)
    if len(leaf.sharding.device_set) == 1:  # one device: the array as it was (committed or not), one scatter
        if writes[-1][0] == ():
            return jnp.asarray(writes[-1][1], leaf.dtype)
        index = tuple(np.array(ix, np.int32) for ix in zip(*[w[0] for w in writes]))
        return _scatter(leaf, index, np.stack([w[1] for w in writes]).astype(leaf.dtype))
    parts = []
    for shard in leaf.addressable_shards:
        bounds = _bounds(shard.index, leaf.shape)
        mine = [(ix, v) for ix, v in writes
                if all(lo <= i < hi for i, (lo, hi) in zip(ix, bounds))]
        data = shard.data
        if mine:
            depth = len(mine[0][0])
            cut = tuple(slice(lo, hi) for lo, hi in bounds[depth:])
            if depth == 0:
                data = jax.device_put(np.asarray(mine[-1][1][cut], leaf.dtype), shard.device)
            else:
                index = tuple(np.array([i - lo for i in col], np.int32)
                              for col, (lo, _) in zip(zip(*[ix for ix, _ in mine]), bounds))
                values = np.stack([v[cut] for _, v in mine]).astype(leaf.dtype)
                data = _scatter(data, jax.device_put(index, shard.device), jax.device_put(values, shard.device))
        parts.append(data)
    return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, parts)


@jax.jit
def _scatter(leaf, index, values):
    return leaf.at[index].set(values)
