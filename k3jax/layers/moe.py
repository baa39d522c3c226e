"""Sigmoid-routed MoE (spec §2.5): fp32 router with selection-only correction bias, sorted grouped
matmul over stacked experts (dense or MXFP4-packed), shared experts, and K3's latent down/up path
with a post-combine RMSNorm."""

from __future__ import annotations

import contextlib
import contextvars

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from k3jax import lora
from k3jax.config import ModelConfig
from k3jax.layers.activations import glu
from k3jax.layers import initializers as init
from k3jax.layers.linear import Linear
from k3jax.layers.mlp import MLP
from k3jax.layers.norms import rms_norm
from pallas_kernels.moe import MXFP4Weight, gmm
from pallas_kernels.moe.reference import expert_window

# Inside a scan over layers (k3jax/layer_scan.py): (offset, count) when the MoE layer's weights hold every
# scanned layer's experts and this layer's are experts [offset, offset + count) of them.
_WINDOW: contextvars.ContextVar = contextvars.ContextVar("k3jax_expert_window", default=None)


@contextlib.contextmanager
def stacked_experts(offset: jax.Array, count: int):
    """Run MoE layers whose expert weights are the stack of every scanned layer's, this layer's at
    `[offset, offset + count)`: the grouped matmul reads the routed experts out of the stack (on CPU only
    those, where slicing the layer's experts first would copy all of them every step)."""
    token = _WINDOW.set((offset, count))
    try:
        yield
    finally:
        _WINDOW.reset(token)


def keep_best_groups(choice: jax.Array, groups: int, keep: int) -> jax.Array:
    """choice [N, E] biased scores -> the same with every expert outside the token's `keep` best of `groups`
    equal expert groups at -inf (DeepSeek-V3's group-limited routing, HF's KimiLinearTopkRouter and vLLM's
    grouped_topk): a group's score is the sum of its two best biased scores."""
    n, e = choice.shape
    per = choice.reshape(n, groups, e // groups)
    _, best = jax.lax.top_k(jax.lax.top_k(per, 2)[0].sum(-1), keep)  # [N, keep] group ids
    kept = jnp.any(best[:, :, None] == jnp.arange(groups)[None, None, :], axis=1)  # [N, groups]
    return jnp.where(kept[:, :, None], per, -jnp.inf).reshape(n, e)


def route(x: jax.Array, router_w: jax.Array, bias: jax.Array, top_k: int, renormalize: bool,
          scaling: float, groups: int = 1, keep_groups: int = 1) -> tuple[jax.Array, jax.Array]:
    """x [N, H] -> (expert ids [N, k] int32, weights [N, k] fp32).

    Scores are fp32 sigmoids; the correction bias only picks the experts (within the `keep_groups` best of
    `groups` expert groups when fewer are kept, `keep_best_groups`); the weights are the raw scores of the
    chosen experts, renormalised (top-1 too, to 1.0: HF's and vLLM's), times the scaling factor.
    """
    logits = jnp.einsum("nh,eh->ne", x.astype(jnp.float32), router_w.astype(jnp.float32))
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias.astype(jnp.float32)[None, :]
    if keep_groups < groups:  # (static: one group, K3's and Kimi-Linear's, traces the plain top-k)
        choice = keep_best_groups(choice, groups, keep_groups)
    _, ids = jax.lax.top_k(choice, top_k)
    w = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), w * scaling


def _init_experts(rngs, shape, dtype, fmt: str, group: int):
    """Random stacked expert weights [E, out, in] (seeded presets).

    MXFP4 experts are drawn directly in the packed format: uniform random E2M1 nibbles (rms ~2.93)
    with one E8M0 scale per group picked so the weight rms is ~ in**-0.5.
    """
    std = shape[-1] ** -0.5
    if fmt == "dense":
        return nnx.Param(init.normal(rngs, shape, dtype, std), axes=("experts", "expert_mlp", None))
    e, out, cin = shape
    packed = init.randint(rngs, (e, out, cin // 2), jnp.uint8, 0, 256)
    base = 127 + int(round(math.log2(std / 2.93)))
    scale = init.randint(rngs, (e, out, cin // group), jnp.uint8, base - 1, base + 2)
    return MXFP4Params(packed, scale)


class MXFP4Params(nnx.Module):
    """Routed-expert weights kept packed: uint8 E2M1 pairs + one E8M0 byte per 32 inputs."""

    def __init__(self, packed: jax.Array, scale: jax.Array):
        self.weight_packed = nnx.Param(packed, axes=("experts", "expert_mlp", None))
        self.weight_scale = nnx.Param(scale, axes=("experts", "expert_mlp", None))

    def value(self) -> MXFP4Weight:
        """The packed weight, its group size read off the shapes (the checkpoint's, not always 32)."""
        packed, scale = self.weight_packed[...], self.weight_scale[...]
        return MXFP4Weight(packed, scale, 2 * packed.shape[-1] // scale.shape[-1])


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h, e, i, din = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_in_size
        self.cfg = cfg
        self.gate = Router(h, e, dtype=dtype, rngs=rngs)
        fmt, grp = cfg.expert_format, cfg.mxfp4_group_size
        self.w1 = _init_experts(rngs, (e, i, din), dtype, fmt, grp)  # gate  [E, I, Din]
        self.w3 = _init_experts(rngs, (e, i, din), dtype, fmt, grp)  # up    [E, I, Din]
        self.w2 = _init_experts(rngs, (e, din, i), dtype, fmt, grp)  # down  [E, Din, I]
        if cfg.routed_expert_hidden_size:
            self.routed_expert_down_proj = Linear(h, din, ("latent", "embed"), dtype=dtype, rngs=rngs)
            self.routed_expert_up_proj = Linear(din, h, ("embed", "latent"), dtype=dtype, rngs=rngs)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = nnx.Param(jnp.ones((din,), dtype), axes=("latent",))
        if cfg.num_shared_experts:
            self.shared_experts = MLP(cfg, h, cfg.num_shared_experts * i, dtype=dtype, rngs=rngs)
        self.experts_in_out = False  # dense experts held [E, in, out] (k3jax/weight_layout.py)
        # (mesh, axis) when the routed experts are split over a mesh axis (k3jax/sharding.py): each rank
        # runs its own experts inside `shard_map` and the slots' outputs are summed across the axis.
        self.expert_parallel = None
        # `expert_slots` / `expert_copies` (set only by serve/eplb.py `attach`): each expert's positions in the
        # stacked weights and how many there are, when expert-parallel load balancing moves and copies them
        # (`ExpertPlacement` [E, 1 + X], `ExpertCopies` [E]; the weights then hold E + X experts); absent:
        # checkpoint order
        # `expert_lora` (set only by k3jax/lora.py `attach`): the routed experts' adapter slots

    @property
    def physical_experts(self) -> int:
        """Experts held in the stacked weights: E, or E + X with redundant copies (serve/eplb.py)."""
        w = self.w1.weight_packed if isinstance(self.w1, MXFP4Params) else self.w1
        return w[...].shape[0]

    def _expert_weight(self, w):
        return w.value() if isinstance(w, MXFP4Params) else w[...]

    def _adapters(self, n: int):
        """(each token's adapter slot [n], {matrix: (lora_a, lora_b)}) inside a `lora.rows` context when the
        routed experts hold adapter slots, else None."""
        held = getattr(self, "expert_lora", None)
        slots = lora.token_slots(n) if held is not None else None
        return None if slots is None else (slots, held.factors())

    def experts(self, z: jax.Array, ids: jax.Array, weights: jax.Array, real: jax.Array | None = None) -> jax.Array:
        """Sorted grouped matmul. z [N, Din]; ids, weights [N, k] -> sum_k w * E_k(z) in fp32 [N, Din].
        `real` [N] bool: tokens that are padding (False) go to no expert and get exactly 0, so a padded
        batch's grouped matmuls hold only its real rows."""
        ws = tuple(self._expert_weight(w) for w in (self.w1, self.w3, self.w2))
        adapters = self._adapters(z.shape[0])
        slots = getattr(self, "expert_slots", None)
        if slots is not None:  # logical ids -> positions of the (moved, copied) weights
            ids = self._physical(ids, slots[...], self.expert_copies[...])
        if real is not None:  # -1: no rank's expert (`_slots` sorts such slots last, uncounted)
            ids = jnp.where(real[:, None], ids, -1)
        window = _WINDOW.get()
        if window is not None and self.expert_parallel is not None:  # (the scan slices these itself)
            ws, window = tuple(expert_window(w, *window) for w in ws), None
        if self.expert_parallel is None:
            out = self._slots(z, ids, ws, 0, window, adapters)
        else:
            out = self._slots_expert_parallel(z, ids, ws, adapters)
        return jnp.einsum("nkd,nk->nd", out, weights)

    @staticmethod
    def _physical(ids: jax.Array, table: jax.Array, copies: jax.Array) -> jax.Array:
        """Routed expert ids [N, k] -> positions in the stacked weights: assignment slot i (token-major) takes
        copy i mod c of its expert (table [E, M], copies [E]), so an expert's copies share its tokens evenly."""
        if table.shape[1] == 1:
            return table[ids, 0]
        copy = jnp.arange(ids.size, dtype=jnp.int32).reshape(ids.shape) % copies[ids]
        return table[ids, copy]

    def _slots(self, z: jax.Array, ids: jax.Array, ws: tuple, first: jax.Array | int, window=None,
               adapters=None) -> jax.Array:
        """Each (token, slot)'s expert output [N, k, Din] fp32, for the experts `[first, first + G)` held
        in `ws` (G = their leading size, or `window` = (offset, G): `ws` stacks several layers' experts and
        these are [offset, offset + G) of them); slots routed elsewhere are exactly 0. `adapters`: each
        token's adapter slot and the factors of these G experts (`_adapters`)."""
        cfg = self.cfg
        n, k = ids.shape
        g = ws[0].shape[0] if window is None else window[1]
        local = ids.reshape(-1) - first
        flat = jnp.where((local >= 0) & (local < g), local, g)  # other experts' slots sort last, uncounted
        order = jnp.argsort(flat, stable=True)  # [N*k] assignment slots sorted by expert
        group_sizes = jnp.bincount(flat, length=g).astype(jnp.int32)
        # dense experts wider than the activations (fp32 on CPU for a bf16 model, k3jax/dequantize.py):
        # rows are widened instead of the weights narrowed, the same exact products
        dense = not isinstance(ws[0], MXFP4Weight)
        wide = ws[0].dtype if dense and ws[0].dtype.itemsize > z.dtype.itemsize else z.dtype
        xs = z[order // k].astype(wide)
        kw = dict(preferred_element_type=jnp.float32, rhs_layout="in_out" if self.experts_in_out else "out_in",
                  group_offset=None if window is None else window[0])
        held = {} if adapters is None else adapters[1]
        if held:  # each sorted row's expert (g: elsewhere) and adapter slot
            row_expert, row_slot = flat[order], adapters[0][order // k]

        def product(name, x, w):  # x w^T for each row's expert, plus its adapter's term
            y = gmm(x, w, group_sizes, **kw)
            return y if name not in held else y + lora.expert_term(x, row_expert, row_slot, *held[name], g)

        h1, h3 = product("w1", xs, ws[0]), product("w3", xs, ws[1])
        a = glu(cfg.hidden_act, h1, h3, cfg.situ_beta, cfg.situ_linear_beta).astype(z.dtype).astype(wide)
        out = product("w2", a, ws[2])  # rows past the groups (other ranks' slots) are 0
        return jnp.zeros_like(out).at[order].set(out).reshape(n, k, -1)

    def _slots_expert_parallel(self, z: jax.Array, ids: jax.Array, ws: tuple, adapters=None) -> jax.Array:
        """`_slots` with the experts split over a mesh axis: tokens and routing replicated, each rank
        multiplies its slots by its own experts, and one all-reduce of the [N, k, Din] slot outputs
        combines them. Every slot is nonzero on exactly one rank, so the sum is exact: the same values
        as one device, whatever the mesh."""
        from k3jax.sharding import axes_size

        mesh, axis = self.expert_parallel  # axis: a mesh axis name or a tuple of them
        per_rank = ws[0].shape[0] // axes_size(axis, dict(mesh.shape))  # physical experts (with any copies)

        def local(z, ids, ws, adapters):
            first = jax.lax.axis_index(axis) * per_rank
            return jax.lax.psum(self._slots(z, ids, ws, first, None, adapters), axis)

        spec_w = jax.tree.map(lambda _: P(axis), ws)
        # adapter factors split like the experts (a shared A whole), token slots whole
        spec_a = P() if adapters is None else (P(), {w: (P(axis) if a.shape[0] > 1 else P(), P(axis))
                                                      for w, (a, _) in adapters[1].items()})
        # check_vma=False: the grouped matmul's loops start from replicated zeros and accumulate
        # per-rank values, which the varying-axes type check rejects; the psum makes the result replicated.
        return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), spec_w, spec_a), out_specs=P(),
                             check_vma=False)(z, ids, ws, adapters)

    def __call__(self, x: jax.Array, trace: list | None = None, valid: jax.Array | None = None) -> jax.Array:
        """x [B, T, H] normed -> [B, T, H]. `trace`, when given, collects the routed expert ids [N, k].
        `valid` [B]: real tokens per row; the routed experts skip the padding after them (their rows of
        the routed part are 0; a padding token's output is never read)."""
        cfg = self.cfg
        b, t, h = x.shape
        xf = x.reshape(b * t, h)
        real = None if valid is None else (jnp.arange(t)[None, :] < valid[:, None]).reshape(-1)  # [B*T]
        ids, w = route(xf, self.gate.weight[...], self.gate.e_score_correction_bias[...],
                       cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor,
                       cfg.num_expert_group, cfg.topk_group)
        if trace is not None:
            trace.append(ids)
        if cfg.routed_expert_hidden_size:
            z = self.routed_expert_down_proj(xf)
            y = self.experts(z, ids, w, real).astype(x.dtype)
            if cfg.latent_moe_use_norm:
                y = rms_norm(y, self.routed_expert_norm[...], cfg.rms_norm_eps)
            y = self.routed_expert_up_proj(y)
        else:
            y = self.experts(xf, ids, w, real).astype(x.dtype)
        if cfg.num_shared_experts:
            y = y + self.shared_experts(xf)
        return y.reshape(b, t, h)


class Router(nnx.Module):
    def __init__(self, h: int, e: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(init.normal(rngs, (e, h), dtype, h ** -0.5), axes=("experts", "embed"))
        self.e_score_correction_bias = nnx.Param(init.normal(rngs, (e,), jnp.float32, 0.1), axes=("experts",))
