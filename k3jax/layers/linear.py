"""Bias-free linear layer storing its weight PyTorch-style `[out, in]`, as checkpoints ship it, or
transposed `[in, out]` once at start-up for backends that multiply that form faster
(see `k3jax/weight_layout.py`), optionally with per-row low-rank adapters (`k3jax/lora.py`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import lora
from k3jax.layers import initializers as init


def matmul(spec: str, a: jax.Array, b: jax.Array, out_dtype=None) -> jax.Array:
    """`einsum(spec, a, b)` summed in fp32 and returned in `out_dtype` (default: the operands' dtype).

    fp32 operands: the plain einsum. bf16 operands: each product is exact in fp32 and the sum is kept
    in fp32, then rounded once, as accelerator matmuls do. It is also what XLA:CPU runs natively (AMX /
    AVX512-BF16 through its dot fusions): a bf16 x bf16 -> bf16 dot is instead rewritten to fp32 with
    both operands converted on every call (measured on the 2-core Xeon host, k3-small: a
    [512, 512] weight converted 85 times per decode step)."""
    out = out_dtype or jnp.result_type(a, b)
    if jnp.bfloat16 in (a.dtype, b.dtype) and _batched(spec) and _cpu():
        # XLA:CPU's batched dot has no bf16 x bf16 -> fp32 form: widen the operands (exact) instead
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(out)


def _batched(spec: str) -> bool:
    """Whether an einsum has a batch dimension (an index in both operands and the output)."""
    ins, out = spec.replace(".", "").split("->")
    lhs, rhs = ins.split(",")
    return bool(set(lhs) & set(rhs) & set(out))


def project(x: jax.Array, w: jax.Array, in_out: bool, out_dtype=None) -> jax.Array:
    """x [..., in] times a weight held `[in, out]` (`in_out`) or `[out, in]` -> [..., out], summed in fp32,
    returned in `out_dtype` (default: the weight's dtype)."""
    spec = "...i,io->...o" if in_out else "...i,oi->...o"
    lead = x.shape[:-1]
    x = x.astype(w.dtype)
    if w.dtype == jnp.bfloat16 and math.prod(lead) == 1 and _cpu():
        # XLA:CPU multiplies a single bf16 row as a matrix-vector product, which it upcasts (the
        # weight converted to fp32 on every call, 2-3x slower); as two identical rows it stays a
        # native bf16 matmul
        two = jnp.broadcast_to(x.reshape(1, -1), (2, x.shape[-1]))
        return matmul(spec, two, w, out_dtype)[:1].reshape(*lead, -1)
    return matmul(spec, x, w, out_dtype)


def _cpu() -> bool:
    return jax.default_backend() == "cpu"


class Linear(nnx.Module):
    """`y = x W^T` with `W [out, in]`; `axes` names the logical sharding axes of (out, in).

    `in_out` (static) says the weight is held as `[in, out]` = W^T (axes swapped with it); the
    layer computes the same product either way. Code that reads the weight itself uses `out_in()`.
    `lora_a` / `lora_b` (set by `k3jax.lora.attach`) hold adapter slots; inside a `lora.rows(...)`
    context each row adds its slot's `(x A^T) B^T`."""

    def __init__(self, in_features: int, out_features: int, axes: tuple[str | None, str | None], *,
                 dtype, rngs: nnx.Rngs, std: float | None = None):
        std = in_features ** -0.5 if std is None else std
        self.weight = nnx.Param(init.normal(rngs, (out_features, in_features), dtype, std), axes=axes)
        self.in_out = False

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...]
        y = project(x, w, self.in_out)
        if not hasattr(self, "lora_a"):
            return y
        d = lora.apply(x, self.lora_a[...], self.lora_b[...])
        return y if d is None else y + d.astype(y.dtype)

    def out_in(self) -> jax.Array:
        """The weight as `[out, in]`, however it is held."""
        w = self.weight[...]
        return w.T if self.in_out else w

    def lora_factors(self) -> tuple[jax.Array, jax.Array] | None:
        """This step's rows' adapter factors (A [B, R, in], B [B, out, R]), or None (no adapters here)."""
        if not hasattr(self, "lora_a"):
            return None
        return lora.gather(self.lora_a[...], self.lora_b[...])
