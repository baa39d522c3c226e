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


def attach(model, slots: int, rank: int, targets: tuple[str, ...] | None = None):
    """-> a `Model` (k3jax.runtime) whose every `Linear` (or those whose name is in `targets`, e.g.
    ("q_proj", "o_proj")) holds `slots` adapter slots of rank `rank`, all zero (so the same function as
    `model` until adapters are written). Apply before the engine's start-up transforms (the factors are
    sharded by the weight's logical axes like the weight)."""
    from k3jax.layers.linear import Linear  # noqa: PLC0415  (linear imports this module)

    if slots < 1 or rank < 1:
        raise ValueError(f"max_loras={slots}, max_lora_rank={rank}: both must be >= 1")
    module = nnx.merge(model.graphdef, model.params)
    for path, node in list(nnx.iter_graph(module)):
        if not isinstance(node, Linear) or hasattr(node, "lora_a") or (targets is not None and path[-1] not in targets):
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
    """One module's PEFT factors A [r, in], B [out, r] -> one slot of `lora_a` / `lora_b` ([in, R],
    [R, out]) with the scaling folded into B and the rank zero-padded to R."""
    r = a.shape[0]
    pa = np.zeros((a.shape[1], rank), np.float32)
    pb = np.zeros((rank, b.shape[0]), np.float32)
    pa[:, :r] = a.T
    pb[:r] = b.T.astype(np.float32) * scaling
    return pa, pb


def write_slot(lora_a: jax.Array, lora_b: jax.Array, slot: int, a, b) -> tuple[jax.Array, jax.Array]:
    """`lora_a` [..., in, S + 1, R] / `lora_b` [..., S + 1, R, out] with slot `slot` set to `slot_arrays`
    contents a [..., in, R] / b [..., R, out] (zeros where a / b is None). Leading axes: a scanned run's
    layers stacked (k3jax/layer_scan.py)."""
    lead = lora_a.shape[:-3]
    a = jnp.zeros((*lead, lora_a.shape[-3], lora_a.shape[-1]), lora_a.dtype) if a is None else jnp.asarray(a, lora_a.dtype)
    b = jnp.zeros((*lead, *lora_b.shape[-2:]), lora_b.dtype) if b is None else jnp.asarray(b, lora_b.dtype)
    return lora_a.at[..., slot, :].set(a), lora_b.at[..., slot, :, :].set(b)


def stack_slot(pairs: list, lora_a: jax.Array, lora_b: jax.Array) -> tuple:
    """Per group of a scanned run, its layer's (a, b) or (None, None) -> one (a [G, in, R], b [G, R, out])
    for `write_slot` on the stacked `lora_a` / `lora_b`, zeros for the layers the adapter leaves out
    ((None, None) when it has none of them)."""
    if all(a is None and b is None for a, b in pairs):
        return None, None
    za = jnp.zeros((lora_a.shape[-3], lora_a.shape[-1]), lora_a.dtype)
    zb = jnp.zeros(lora_b.shape[-2:], lora_b.dtype)
    return (jnp.stack([za if a is None else jnp.asarray(a, lora_a.dtype) for a, _ in pairs]),
            jnp.stack([zb if b is None else jnp.asarray(b, lora_b.dtype) for _, b in pairs]))


def projection_names(cfg) -> set[str]:
    """Names of the projections that can take adapters in a model of `cfg` ("q_proj", "kv_b_proj", ...)."""
    from k3jax.layers.linear import Linear  # noqa: PLC0415
    from k3jax.model import KimiModel  # noqa: PLC0415

    module = nnx.eval_shape(lambda: KimiModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    return {str(path[-1]) for path, node in nnx.iter_graph(module) if isinstance(node, Linear)}


def slot_bytes(cfg, dtype, rank: int, targets: tuple[str, ...] | None = None) -> int:
    """Bytes of one adapter slot over every projection of a model of `cfg` (no weights materialised):
    what each of `max_loras` slots (and the base slot 0) adds beside the weights."""
    from k3jax.layers.linear import Linear  # noqa: PLC0415
    from k3jax.model import KimiModel  # noqa: PLC0415

    module = nnx.eval_shape(lambda: KimiModel(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    size = jnp.dtype(dtype).itemsize
    return sum(rank * sum(node.weight.shape) * size for path, node in nnx.iter_graph(module)
               if isinstance(node, Linear) and (targets is None or path[-1] in targets))
