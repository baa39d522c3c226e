"""Multi-LoRA on the dense projections: many low-rank adapters served in one batch (S-LoRA / punica's
idea, as vLLM's `--enable-lora` serves them).

`attach(model, slots, rank)` gives every `Linear` (attention and gate projections, dense and shared
MLPs, K3's latent MoE down/up) two stacked factor arrays,

    lora_a [in, S + 1, R]    lora_b [S + 1, R, out]

with slot 0 left zero (the base model) and adapters written into slots 1..S. A rank below R is
zero-padded (exact: the padded terms are 0), and the adapter's scaling (alpha / r, or alpha / sqrt(r)
with rsLoRA) is folded into B. The factors are parameters like any other: the step programs take
them as arguments, so loading or replacing an adapter rewrites arrays of fixed shape and never
compiles. A step names each batch row's slot with `rows(slots)`; inside it, a layer whose input is
`[B, ..., in]` (rows first, as every caller lays it out) adds `(x A_s^T) B_s^T` for its row's slot s.
Outside a `rows` context the factors are ignored and the model is the base model.

Two exact forms of that term (`apply` picks by shape; measured on the 2-core CPU host, where the
per-operation cost of small products dominates a decode step):
- masked (few tokens: decode, verify rows): `x @ A_all` for every slot at once as one plain matmul over
  the slots' `(S + 1) R` columns, the other slots' columns zeroed by each row's one-hot mask, then one
  matmul with B_all. Reads each factor array once, no per-row copies; 1.5-3x cheaper than gathering at
  8-32 rows, but its arithmetic grows with S.
- gathered (prefill chunks): each row's own factors are gathered (`[B, in, R]`, `[B, R, out]`) and
  applied as two batched products: arithmetic for one slot per row, whatever S.

Routed experts (opt-in: `targets` naming "experts", or "w1" / "w3" / "w2"): every MoE layer gets an
`ExpertLoRA` with, per targeted expert matrix,

    lora_a [E or 1, S, in, R]    lora_b [E, S, R, out]

(no base slot here: slot s is at index s - 1). The adapter term of assignment (token, expert e) with
slot s is `(x A_{e,s}^T) B_{e,s}^T`, added to that expert's product before the GLU (w1, w3) or before
the routing weight (w2). One A for all experts (`shared_a`, miles' K3 recipe: shared A, per-expert B)
keeps a leading axis of 1. Both products are grouped matmuls (`expert_term`) over (expert, slot)
groups of the rows already sorted by expert, the punica / S-LoRA "SGMV" idea on the MoE's own gmm:
rows of the base model (slot 0) are in no group and cost nothing, and E x S groups of rank R replace
the per-row gather of `[in, R]` factors, which at K3's widths would move megabytes per token.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_ROWS: contextvars.ContextVar = contextvars.ContextVar("k3jax_lora_rows", default=None)


@contextlib.contextmanager
def rows(slots: jax.Array):
    """Run the model with row b of every layer input using adapter slot `slots[b]` ([B] int32, 0: none)."""
    token = _ROWS.set(slots)
    try:
        yield
    finally:
        _ROWS.reset(token)


# masked form while rows x tokens x slots stays at most this (CPU measurements; see the module doc)
MASKED_MAX = 512


def gather(lora_a: jax.Array, lora_b: jax.Array) -> tuple[jax.Array, jax.Array] | None:
    """Each row's factors as (A [B, R, in], B [B, out, R]), or None outside a `rows` context."""
    slots = _ROWS.get()
    if slots is None:
        return None
    a = jnp.take(lora_a, slots, axis=1)  # [in, B, R]
    b = jnp.take(lora_b, slots, axis=0)  # [B, R, out]
    return jnp.transpose(a, (1, 2, 0)), jnp.swapaxes(b, 1, 2)


def apply(x: jax.Array, lora_a: jax.Array, lora_b: jax.Array, form: str = "auto") -> jax.Array | None:
    """x [B, ..., in] (or [B * k, in], rows first) -> the adapters' term [..., out] for each row's slot,
    or None outside a `rows` context. `form`: "masked", "gathered" or "auto" (by shape)."""
    slots = _ROWS.get()
    if slots is None:
        return None
    n, (d_in, s, r), d_out = slots.shape[0], lora_a.shape, lora_b.shape[-1]
    xr = x.reshape(n, -1, d_in).astype(lora_a.dtype)  # [B, k, in]
    if form == "masked" or (form == "auto" and n * xr.shape[1] * s <= MASKED_MAX):
        mask = (jnp.arange(s)[None, :] == slots[:, None]).astype(xr.dtype)  # [B, S + 1]
        u = (xr @ lora_a.reshape(d_in, s * r)).reshape(n, -1, s, r) * mask[:, None, :, None]
        y = u.reshape(n, -1, s * r) @ lora_b.reshape(s * r, d_out)
    else:
        a = jnp.take(lora_a, slots, axis=1)  # [in, B, R]
        b = jnp.take(lora_b, slots, axis=0)  # [B, R, out]
        y = jnp.einsum("btr,bro->bto", jnp.einsum("bti,ibr->btr", xr, a), b)
    return y.reshape(*x.shape[:-1], d_out)


class LoRAParam(nnx.Param):
    """Adapter factors: a parameter the engine rewrites when adapters load (never a checkpoint tensor)."""


EXPERT_PROJECTIONS = ("w1", "w3", "w2")  # every routed expert's gate, up and down matrices
EXPERTS = "experts"  # a `targets` entry naming all three
ALL_LINEAR = "all-linear"  # a `targets` entry naming every dense projection (PEFT's value)


def split_targets(targets: tuple[str, ...] | None) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """`targets` -> (the dense projections' names, None: all of them; the expert matrices targeted).
    None: every dense projection and no routed expert (expert factors are E times a projection's)."""
    if targets is None:
        return None, ()
    experts = tuple(w for w in EXPERT_PROJECTIONS if w in targets or EXPERTS in targets)
    dense = tuple(t for t in targets if t not in (EXPERTS, ALL_LINEAR, *EXPERT_PROJECTIONS))
    return (None if ALL_LINEAR in targets else dense), experts


class ExpertFactors(nnx.Module):
    """One routed-expert matrix's adapter slots: `lora_a [E or 1, S, in, R]`, `lora_b [E, S, R, out]`."""

    def __init__(self, experts: int, slots: int, rank: int, d_in: int, d_out: int, dtype, shared_a: bool):
        self.lora_a = LoRAParam(jnp.zeros((1 if shared_a else experts, slots, d_in, rank), dtype),
                                axes=(None if shared_a else "experts", None, None, None))
        self.lora_b = LoRAParam(jnp.zeros((experts, slots, rank, d_out), dtype), axes=("experts", None, None, None))


class ExpertLoRA(nnx.Module):
    """A MoE layer's routed-expert adapter slots: an `ExpertFactors` per targeted matrix (w1 / w3 / w2)."""

    def __init__(self, factors: dict):
        for name, f in factors.items():
            setattr(self, name, f)

    def factors(self) -> dict[str, tuple[jax.Array, jax.Array]]:
        return {w: (getattr(self, w).lora_a[...], getattr(self, w).lora_b[...])
                for w in EXPERT_PROJECTIONS if hasattr(self, w)}


def token_slots(n: int) -> jax.Array | None:
    """Each of a step's `n` tokens' adapter slot ([n] int32, rows first: row b's tokens are n / B
    consecutive ones), or None outside a `rows` context."""
    slots = _ROWS.get()
    if slots is None:
        return None
    return jnp.repeat(slots, n // slots.shape[0], total_repeat_length=n)


def _grouped(x: jax.Array, w: jax.Array, key: jax.Array) -> jax.Array:
    """Row i of x [M, in] times w[key[i]] ([G, in, out]); rows with key >= G get 0 -> [M, out] fp32."""
    from pallas_kernels.dispatch import resolve_backend  # noqa: PLC0415
    from pallas_kernels.moe import gmm  # noqa: PLC0415

    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=w.shape[0]).astype(jnp.int32)
    # the CPU form computes only the groups with rows; elsewhere ragged_dot (rank-wide tiles are below the
    # Pallas kernel's block shapes)
    backend = "auto" if resolve_backend("auto") == "reference" else "reference"
    y = gmm(x[order].astype(w.dtype), w, sizes, rhs_layout="in_out", preferred_element_type=jnp.float32,
            backend=backend)
    return jnp.zeros_like(y).at[order].set(y)


def expert_term(x: jax.Array, experts: jax.Array, slots: jax.Array, lora_a: jax.Array, lora_b: jax.Array,
                groups: int) -> jax.Array:
    """The adapters' term of routed-expert rows: x [M, in] (assignment rows), experts [M] (the row's expert
    among the `groups` held here; >= groups: another rank's), slots [M] (0: the base model), factors as
    `ExpertFactors` holds them (this rank's experts) -> [M, out] fp32, exactly 0 on base and foreign rows."""
    ea, s, d_in, r = lora_a.shape
    live = (slots > 0) & (experts < groups)
    kb = jnp.where(live, experts * s + slots - 1, groups * s)  # (expert, slot) groups
    ka = kb if ea > 1 else jnp.where(live, slots - 1, s)  # shared A: slot groups
    u = _grouped(x, lora_a.reshape(ea * s, d_in, r), ka)  # [M, R]
    return _grouped(u, lora_b.reshape(groups * s, r, lora_b.shape[-1]), kb)


def attach(model, slots: int, rank: int, targets: tuple[str, ...] | None = None, shared_a: bool = False):
    """-> a `Model` (k3jax.runtime) whose every `Linear` (or those whose name is in `targets`, e.g.
    ("q_proj", "o_proj"); see `split_targets`) holds `slots` adapter slots of rank `rank`, all zero (so
    the same function as `model` until adapters are written), and, where `targets` names them, every
    MoE layer's routed experts too (`ExpertLoRA`; one A per matrix with `shared_a`). Apply before the
    engine's start-up transforms (the factors are sharded by the weight's logical axes like the weight)."""
    from k3jax.layers.linear import Linear  # noqa: PLC0415  (linear imports this module)
    from k3jax.layers.moe import MoE  # noqa: PLC0415

    if slots < 1 or rank < 1:
        raise ValueError(f"max_loras={slots}, max_lora_rank={rank}: both must be >= 1")
    dense, experts = split_targets(targets)
    module = nnx.merge(model.graphdef, model.params)
    for path, node in list(nnx.iter_graph(module)):
        if isinstance(node, MoE) and experts and not hasattr(node, "expert_lora"):
            cfg = node.cfg
            shapes = {"w1": (cfg.expert_in_size, cfg.moe_intermediate_size),
                      "w3": (cfg.expert_in_size, cfg.moe_intermediate_size),
                      "w2": (cfg.moe_intermediate_size, cfg.expert_in_size)}
            node.expert_lora = ExpertLoRA({w: ExpertFactors(cfg.num_experts, slots, rank, *shapes[w], model.dtype,
                                                            shared_a) for w in experts})
        if not isinstance(node, Linear) or hasattr(node, "lora_a") or (dense is not None and path[-1] not in dense):
            continue
        out_f, in_f = node.out_in().shape
        out_ax, in_ax = tuple(getattr(node.weight, "axes", None) or (None, None))
        if node.in_out:
            out_ax, in_ax = in_ax, out_ax
        dtype = node.weight[...].dtype
        node.lora_a = LoRAParam(jnp.zeros((in_f, slots + 1, rank), dtype), axes=(in_ax, None, None))
        node.lora_b = LoRAParam(jnp.zeros((slots + 1, rank, out_f), dtype), axes=(None, None, out_ax))
    graphdef, params = nnx.split(module)
    return dataclasses.replace(model, graphdef=graphdef, params=params)


def path_names(path) -> list[str]:
    """A parameter's pytree path as plain names: ("layers", "0", "self_attn", "q_proj", "lora_a")."""
    return [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]


def module_paths(params) -> dict[str, tuple[int, int]]:
    """Dotted module path of every `Linear` with adapter slots ("layers.0.self_attn.q_proj") -> the
    indices of its (lora_a, lora_b) leaves in `jax.tree.flatten(params)` order."""
    found: dict[str, list] = {}
    for i, (path, _) in enumerate(jax.tree.flatten_with_path(params)[0]):
        names = path_names(path)
        for which, tag in enumerate(("lora_a", "lora_b")):
            if tag in names:
                mod = ".".join(names[:names.index(tag)])
                found.setdefault(mod, [None, None])[which] = i
    return {m: (a, b) for m, (a, b) in found.items()}


def slot_arrays(a: np.ndarray, b: np.ndarray, rank: int, scaling: float) -> tuple[np.ndarray, np.ndarray]:
    """One module's PEFT factors A [..., r, in], B [..., out, r] -> one slot of `lora_a` / `lora_b` ([..., in, R],
    [..., R, out]) with the scaling folded into B and the rank zero-padded to R (leading axes: experts)."""
    r = a.shape[-2]
    pa = np.zeros((*a.shape[:-2], a.shape[-1], rank), np.float32)
    pb = np.zeros((*b.shape[:-2], rank, b.shape[-2]), np.float32)
    pa[..., :r] = np.swapaxes(a, -1, -2)
    pb[..., :r, :] = np.swapaxes(b, -1, -2).astype(np.float32) * scaling
    return pa, pb


def write_slot(lora_a: jax.Array, lora_b: jax.Array, slot: int, a, b) -> tuple[jax.Array, jax.Array]:
    """`lora_a` [..., in, S + 1, R] / `lora_b` [..., S + 1, R, out] with slot `slot` set to `slot_arrays`
    contents a [..., in, R] / b [..., R, out] (zeros where a / b is None). Leading axes: a scanned run's
    layers stacked (k3jax/layer_scan.py)."""
    lead = lora_a.shape[:-3]
    a = jnp.zeros((*lead, lora_a.shape[-3], lora_a.shape[-1]), lora_a.dtype) if a is None else jnp.asarray(a, lora_a.dtype)
    b = jnp.zeros((*lead, *lora_b.shape[-2:]), lora_b.dtype) if b is None else jnp.asarray(b, lora_b.dtype)
    return lora_a.at[..., slot, :].set(a), lora_b.at[..., slot, :, :].set(b)


def write_expert_slot(lora_a: jax.Array, lora_b: jax.Array, slot: int, a, b) -> tuple[jax.Array, jax.Array]:
    """`ExpertFactors`' `lora_a` [..., Ea, S, in, R] / `lora_b` [..., E, S, R, out] with slot `slot` (1..S, at
    index slot - 1) set to a [..., Ea, in, R] / b [..., E, R, out] (zeros where None)."""
    sa, sb = slot_shapes(lora_a, lora_b, True)
    a = jnp.zeros((*lora_a.shape[:-4], *sa), lora_a.dtype) if a is None else jnp.asarray(a, lora_a.dtype)
    b = jnp.zeros((*lora_b.shape[:-4], *sb), lora_b.dtype) if b is None else jnp.asarray(b, lora_b.dtype)
    return lora_a.at[..., slot - 1, :, :].set(a), lora_b.at[..., slot - 1, :, :].set(b)


def slot_shapes(lora_a: jax.Array, lora_b: jax.Array, experts: bool) -> tuple[tuple, tuple]:
    """The shapes of one slot's (a, b) contents for one layer: ([in, R], [R, out]) for a projection,
    ([Ea, in, R], [E, R, out]) for a routed-expert matrix."""
    if experts:
        return (lora_a.shape[-4], *lora_a.shape[-2:]), (lora_b.shape[-4], *lora_b.shape[-2:])
    return (lora_a.shape[-3], lora_a.shape[-1]), tuple(lora_b.shape[-2:])


def stack_slot(pairs: list, lora_a: jax.Array, lora_b: jax.Array, experts: bool = False) -> tuple:
    """Per group of a scanned run, its layer's (a, b) or (None, None) -> one (a [G, ...], b [G, ...]) for
    `write_slot` / `write_expert_slot` on the stacked `lora_a` / `lora_b`, zeros for the layers the adapter
    leaves out ((None, None) when it has none of them)."""
    if all(a is None and b is None for a, b in pairs):
        return None, None
    sa, sb = slot_shapes(lora_a, lora_b, experts)
    za, zb = jnp.zeros(sa, lora_a.dtype), jnp.zeros(sb, lora_b.dtype)
    return (jnp.stack([za if a is None else jnp.asarray(a, lora_a.dtype) for a, _ in pairs]),
            jnp.stack([zb if b is None else jnp.asarray(b, lora_b.dtype) for _, b in pairs]))


def projection_names(cfg) -> set[str]:
    """Names `targets` may hold for a model of `cfg`: its dense projections ("q_proj", "kv_b_proj", ...),
    "all-linear", and with routed experts "experts", "w1", "w3", "w2"."""
    from k3jax.layers.linear import Linear  # noqa: PLC0415
    from k3jax.model import KimiModel  # noqa: PLC0415

    module = nnx.eval_shape(lambda: KimiModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    names = {str(path[-1]) for path, node in nnx.iter_graph(module) if isinstance(node, Linear)} | {ALL_LINEAR}
    return names | ({EXPERTS, *EXPERT_PROJECTIONS} if cfg.num_experts and any(
        cfg.is_moe(i) for i in range(cfg.num_hidden_layers)) else set())


def slot_bytes(cfg, dtype, rank: int, targets: tuple[str, ...] | None = None, shared_a: bool = False) -> int:
    """Bytes of one adapter slot over every projection (and targeted expert matrix) of a model of `cfg`
    (no weights materialised): what each of `max_loras` slots (and the dense projections' base slot 0)
    adds beside the weights."""
    from k3jax.layers.linear import Linear  # noqa: PLC0415
    from k3jax.model import KimiModel  # noqa: PLC0415

    dense, experts = split_targets(targets)
    module = nnx.eval_shape(lambda: KimiModel(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    size = jnp.dtype(dtype).itemsize
    total = sum(rank * sum(node.weight.shape) * size for path, node in nnx.iter_graph(module)
                if isinstance(node, Linear) and (dense is None or path[-1] in dense))
    moe_layers = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)) if cfg.num_experts else 0
    e, d, i = cfg.num_experts, cfg.expert_in_size, cfg.moe_intermediate_size
    for w in experts:
        d_in, d_out = (i, d) if w == "w2" else (d, i)
        total += moe_layers * rank * ((1 if shared_a else e) * d_in + e * d_out) * size
    return total
