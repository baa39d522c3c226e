"""GLU activations: SiLU-GLU (Kimi-Linear) and SiTU-GLU (K3, spec §2.5), computed in fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def situ_glu(gate: jax.Array, up: jax.Array, beta: float = 4.0, linear_beta: float = 25.0) -> jax.Array:
    """`[b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)]` in fp32, cast back to the input dtype."""
    g = gate.astype(jnp.float32)
    u = up.astype(jnp.float32)
    y = beta * jnp.tanh(g / beta) * jax.nn.sigmoid(g) * (linear_beta * jnp.tanh(u / linear_beta))
    return y.astype(gate.dtype)


def silu_glu(gate: jax.Array, up: jax.Array) -> jax.Array:
    g = gate.astype(jnp.float32)
    return (jax.nn.silu(g) * up.astype(jnp.float32)).astype(gate.dtype)


def glu(kind: str, gate: jax.Array, up: jax.Array, beta: float = 4.0, linear_beta: float = 25.0) -> jax.Array:
    if kind == "situ":
        return situ_glu(gate, up, beta, linear_beta)
    if kind == "silu":
        return silu_glu(gate, up)
    raise ValueError(f"hidden_act {kind!r} is not 'silu' or 'situ'")
