"""Named device meshes and logical-axis rules: how a model's parameters spread over devices.

Every parameter carries logical axis names (`nnx.Param(..., axes=("heads", "embed"))`: `vocab, embed,
heads, head_dim, q_lora, kv_latent, latent, mlp, experts, expert_mlp`). A sharding config
(`sharding_configs/<name>.yaml`) names a device mesh and maps each logical axis to a mesh axis or to
nothing (replicated); code never hard-codes a mesh. Placing the parameters with those shardings is
all it takes: the engine's jitted step is one SPMD program over the mesh (GSPMD partitions the
matmuls and inserts the collectives). The cache arena follows the `heads` rule: each rank of that
axis keeps only its KDA heads' recurrent states (and conv channels) and a full copy of the MLA
latent pages (`state_axis`, `serve/state_split.py`).

A config file::

    mesh:             # axis name -> size, in mesh order; at most one size may be -1 (the rest)
      tensor: -1
    rules:            # logical axis -> mesh axis, a list of mesh axes (split over their product),
      heads: tensor   # or null to replicate that dimension
      mlp: tensor
      experts: [expert, tensor]

A logical axis the rules omit is replicated. A dimension whose size the mesh axis does not divide is
replicated too (reported by `plan_param_specs`), and a mesh axis shards at most one dimension of a
parameter (the first that asks for it), as XLA requires.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Optional

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MeshAxes = "str | tuple[str, ...]"  # one mesh axis, or several (a dimension split over their product)
LOGICAL_AXES = ("vocab", "embed", "heads", "head_dim", "q_lora", "kv_latent", "latent", "mlp", "experts",
                "expert_mlp")
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sharding_configs")


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """A device mesh (axis names and sizes; -1: the devices left over) and logical-axis rules."""
    name: str
    mesh_axes: tuple[tuple[str, int], ...]
    rules: tuple[tuple[str, Optional[MeshAxes]], ...]

    def rule(self, logical: Optional[str]) -> Optional[MeshAxes]:
        return dict(self.rules).get(logical) if logical else None

    def mesh_shape(self, num_devices: int) -> dict[str, int]:
        """Axis sizes for `num_devices` devices (the -1 axis takes what the others leave)."""
        sizes = dict(self.mesh_axes)
        known = math.prod(s for s in sizes.values() if s != -1)
        if -1 in sizes.values():
            if num_devices % known:
                raise ValueError(f"sharding config {self.name!r}: mesh {sizes} cannot use {num_devices} devices "
                                 f"({num_devices} is not a multiple of {known})")
            sizes = {a: (num_devices // known if s == -1 else s) for a, s in sizes.items()}
        elif known != num_devices:
            raise ValueError(f"sharding config {self.name!r}: mesh {sizes} needs {known} devices, "
                             f"{num_devices} are available")
        return sizes


def parse_sharding_config(data: Any, name: str = "<dict>") -> ShardingConfig:
    """A `ShardingConfig` from the parsed YAML mapping; errors name the offending key."""
    if not isinstance(data, dict) or set(data) - {"mesh", "rules"} or "mesh" not in data:
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"sharding config {name!r}: expected the keys 'mesh' and 'rules', got {keys}")
    mesh = data["mesh"]
    if not isinstance(mesh, dict) or not mesh:
        raise ValueError(f"sharding config {name!r}: 'mesh' must map axis names to sizes")
    for axis, size in mesh.items():
        if not isinstance(axis, str) or not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise ValueError(f"sharding config {name!r}: mesh.{axis}: size must be a positive integer or -1, got {size!r}")
    if list(mesh.values()).count(-1) > 1:
        raise ValueError(f"sharding config {name!r}: 'mesh' may leave at most one axis size as -1")
    rules = data.get("rules") or {}
    if not isinstance(rules, dict):
        raise ValueError(f"sharding config {name!r}: 'rules' must map logical axes to mesh axes")
    parsed = {}
    for logical, axis in rules.items():
        if logical not in LOGICAL_AXES:
            raise ValueError(f"sharding config {name!r}: rules.{logical}: unknown logical axis "
                             f"(known: {', '.join(LOGICAL_AXES)})")
        axes = axis if isinstance(axis, list) else [] if axis is None else [axis]
        if isinstance(axis, list) and (not axis or len(set(map(str, axis))) != len(axis)):
            raise ValueError(f"sharding config {name!r}: rules.{logical}: a list of mesh axes must be non-empty "
                             f"and without repeats, got {axis!r}")
        for a in axes:
            if not isinstance(a, str) or a not in mesh:  # (a mapping or nested list: not an axis name)
                raise ValueError(f"sharding config {name!r}: rules.{logical}: {a!r} is not a mesh axis "
                                 f"({', '.join(mesh)})")
        parsed[logical] = tuple(axes) if isinstance(axis, list) else axis
    return ShardingConfig(name, tuple(mesh.items()), tuple(parsed.items()))


def axes_size(axis: Optional[MeshAxes], mesh_sizes: dict[str, int]) -> int:
    """Devices a rule's mesh axis (or tuple of axes) splits a dimension over."""
    if axis is None:
        return 1
    return math.prod(mesh_sizes.get(a, 1) for a in ((axis,) if isinstance(axis, str) else axis))


def load_sharding_config(name_or_path: str) -> ShardingConfig:
    """Read `sharding_configs/<name>.yaml`, or a YAML file by path."""
    import yaml

    path = name_or_path if name_or_path.endswith((".yaml", ".yml")) else os.path.join(CONFIG_DIR, f"{name_or_path}.yaml")
    if not os.path.isfile(path):
        known = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml")) if os.path.isdir(CONFIG_DIR) else []
        raise ValueError(f"sharding: no config {name_or_path!r} (looked for {path}; known: {', '.join(known)})")
    with open(path) as f:
        try:
            raw = yaml.safe_load(f)
        except yaml.YAMLError as e:  # (not a ValueError: `k3jax serve` printed a traceback)
            raise ValueError(f"sharding: {path} is not valid YAML ({e})") from None
    return parse_sharding_config(raw, os.path.basename(path)[:-5] if path.endswith(".yaml") else path)


def make_mesh(config: ShardingConfig, devices=None) -> Mesh:
    """The config's mesh over `devices` (default: all), devices in `jax.devices()` order."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = config.mesh_shape(len(devices))
    return Mesh(np.asarray(devices, dtype=object).reshape(tuple(sizes.values())), tuple(sizes))


def spec_for(axes: tuple, shape: tuple, config: ShardingConfig, mesh_sizes: dict[str, int]) -> tuple[P, list[str]]:
    """PartitionSpec of one parameter from its logical axes -> (spec, why dims were left replicated)."""
    out, used, notes = [], set(), []
    for dim, (logical, size) in enumerate(zip(axes, shape)):
        axis = config.rule(logical)
        members = set((axis,) if isinstance(axis, str) else axis or ())
        split = axes_size(axis, mesh_sizes)
        if split == 1:
            out.append(None)
        elif members & used:
            out.append(None)
            notes.append(f"dim {dim} ({logical}): mesh axis {sorted(members & used)} already shards another dim")
        elif size % split:
            out.append(None)
            notes.append(f"dim {dim} ({logical}) of size {size} is not divisible by {axis}={split}")
        else:
            out.append(axis)
            used |= members
    while out and out[-1] is None:
        out.pop()
    return P(*out), notes


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _value(var):
    """A Variable's array, or its `jax.ShapeDtypeStruct` for abstract parameters."""
    return var.get_value() if hasattr(var, "get_value") else var.value


def bytes_per_device(params, config: ShardingConfig, num_devices: int) -> dict:
    """Parameter bytes in all and on each device under `config` on `num_devices` devices (works on
    abstract parameters, e.g. the full K3's shapes)."""
    sizes = config.mesh_shape(num_devices)
    specs, notes = plan_param_specs(params, config, sizes)
    total = per_device = 0
    for var, spec in zip(jax.tree.leaves(params, is_leaf=_is_var), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        value = _value(var)
        nbytes = math.prod(value.shape) * np.dtype(value.dtype).itemsize
        total += nbytes
        per_device += nbytes // math.prod(axes_size(a, sizes) for a in spec)
    return dict(mesh=sizes, param_bytes=total, param_bytes_per_device=per_device, replicated_dims=len(notes))


def plan_param_specs(params, config: ShardingConfig, mesh_sizes: dict[str, int]) -> tuple[Any, dict[str, list[str]]]:
    """-> (a PartitionSpec per parameter, as a pytree like `params`; {param path: replicated-dim notes})."""
    notes: dict[str, list[str]] = {}

    def one(path, var):
        spec, why = param_spec(var, config, mesh_sizes, jax.tree_util.keystr(path))
        if why:
            notes[jax.tree_util.keystr(path)] = why
        return spec

    specs = jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_var)
    return specs, notes


def param_spec(var, config: ShardingConfig, mesh_sizes: dict[str, int], name: str = "") -> tuple[P, list[str]]:
    """One parameter's (or abstract parameter's) PartitionSpec from its logical axes -> (spec, notes)."""
    value = _value(var)
    axes = tuple(getattr(var, "axes", None) or (None,) * value.ndim)
    if len(axes) != value.ndim:
        raise ValueError(f"parameter {name}: logical axes {axes} do not match its shape {value.shape}")
    return spec_for(axes, value.shape, config, mesh_sizes)


def placement(config: ShardingConfig, devices=None):
    """-> `place(var) -> NamedSharding`: where `shard_params` puts each parameter on `config`'s mesh over
    `devices`. Loaders take it to read each parameter straight into its shards
    (`k3jax.load_model(..., sharding=...)`); the engine's placement on the same mesh is then a no-op."""
    mesh = make_mesh(config, devices)
    sizes = dict(mesh.shape)
    return lambda var: NamedSharding(mesh, param_spec(var, config, sizes)[0])


def put(x, sharding):
    """`jax.device_put(x, sharding)` of one array, without a cross-process check of host values.

    `device_put` of a host value (a NumPy array, or a jax array not committed to a device) on a sharding that spans
    processes first checks that every process passed the same value: an all-gather and a compile per shape (a
    2-process tiny-k3 load ran 248, about a second). Every caller's value is the same on every process by
    construction (seeded weights, the adapter factors the leader sent, the same tables), so such a value is built
    from this process's own shards (`jax.make_array_from_callback`: no check, no device holds another process's
    shard) with the dtype `device_put` gives it. Anything else (a sharding of this process's devices, a committed
    array) goes to `device_put` as before."""
    if (not isinstance(sharding, jax.sharding.Sharding) or sharding.is_fully_addressable
            or (isinstance(x, jax.Array) and x.committed)):
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    host = host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=False)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index], dtype=host.dtype)


def shard_params(params, mesh: Mesh, config: ShardingConfig):
    """-> (params placed on `mesh` by the rules, {param path: replicated-dim notes})."""
    specs, notes = plan_param_specs(params, config, dict(mesh.shape))

    def place(var, spec):
        # A new Variable holding the placed array: flax 0.12 deprecates the `.value` setter, and `var[...] = x`
        # would keep (or fail to reconcile with) the old placement.
        return var.replace(value=put(var[...], NamedSharding(mesh, spec)))

    placed = jax.tree.map(place, params, specs, is_leaf=_is_var)
    return placed, notes


def shard_model(model, config: ShardingConfig, devices=None):
    """-> (mesh, a `Model` whose parameters are placed on it, replicated-dim notes). Routed experts
    split over a mesh axis run expert-parallel (`MoE.expert_parallel`)."""
    mesh = make_mesh(config, devices)
    params, notes = shard_params(model.params, mesh, config)
    return mesh, enable_expert_parallel(dataclasses.replace(model, params=params), mesh, config), notes


def expert_axis(config: ShardingConfig, mesh: Mesh, num_experts: int) -> Optional[MeshAxes]:
    """The mesh axis (or axes) the routed experts are split over, or None (not split, or not divisible)."""
    axis = config.rule("experts")
    size = axes_size(axis, dict(mesh.shape))
    return axis if size > 1 and num_experts % size == 0 else None


def state_axis(config: ShardingConfig, mesh_sizes: dict[str, int], num_kda_heads: int) -> Optional[MeshAxes]:
    """The mesh axis (or axes) the KDA heads, and so the arena's state slots, are split over: the
    `heads` rule when it divides the KDA head count, else None (every rank holds every head's state)."""
    axis = config.rule("heads")
    size = axes_size(axis, mesh_sizes)
    return axis if size > 1 and num_kda_heads and num_kda_heads % size == 0 else None


def moe_exchange_bytes(num_moe_layers: int, tokens: int, top_k: int, width: int, ranks_per_group: int,
                       num_devices: int, itemsize: int = 4) -> int:
    """Bytes the expert-parallel MoE sends between ranks in one step, all ranks together: per MoE layer
    one all-reduce of the slot outputs [tokens, top_k, width] within each group of `ranks_per_group`
    expert ranks, counted as a ring all-reduce (each rank sends 2 (n - 1) / n of the payload)."""
    n = ranks_per_group
    if n <= 1:
        return 0
    return num_moe_layers * (num_devices // n) * 2 * (n - 1) * tokens * top_k * width * itemsize


def enable_expert_parallel(model, mesh: Mesh, config: ShardingConfig):
    """-> `model` with every MoE block set to run its routed experts per rank of the experts' mesh axis
    (inside `shard_map`, one all-reduce of the slot outputs), when that axis splits them."""
    from k3jax.layers.moe import MoE

    module = nnx.merge(model.graphdef, model.params)
    moes = [node for _, node in nnx.iter_graph(module) if isinstance(node, MoE)]
    # the physical experts: E, or E + X with redundant copies (serve/eplb.py)
    axis = expert_axis(config, mesh, moes[0].physical_experts) if moes else None
    if axis is None:
        return model
    for node in moes:
        node.expert_parallel = (mesh, axis)
    graphdef, params = nnx.split(module)
    return dataclasses.replace(model, graphdef=graphdef, params=params)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
