"""Helpers shared by the KDA tests (random inputs, error metric)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def l2n(x):
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def make_inputs(seed, B, T, H, K, V, gate="k3", v_dtype=jnp.float32):
    """Fresh random KDA inputs (never zeros). gate: "k3" | "kimi" | "k3_floor"."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = l2n(jax.random.normal(ks[0], (B, T, H, K), jnp.float32))
    k = l2n(jax.random.normal(ks[1], (B, T, H, K), jnp.float32))
    v = jax.random.normal(ks[2], (B, T, H, V), jnp.float32).astype(v_dtype)
    z = jax.random.normal(ks[3], (B, T, H, K), jnp.float32)
    if gate == "k3":            # K3: lb * sigmoid(exp(A) z), lb = -5, pushed to the bound
        g = -5.0 * jax.nn.sigmoid(2.0 * z + 2.0)
    elif gate == "k3_floor":    # g pinned at the lower bound for whole chunks
        g = jnp.full((B, T, H, K), -4.999, jnp.float32)
    elif gate == "kimi":        # Kimi-Linear: -exp(A_log) * softplus(z), unbounded
        A_log = jax.random.normal(ks[5], (H,), jnp.float32)
        g = -jnp.exp(A_log)[None, None, :, None] * jax.nn.softplus(3.0 * z)
    else:
        raise ValueError(gate)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H), jnp.float32))
    return q, k, v, g, beta


def make_state(seed, N, H, K, V):
    return 0.5 * jax.random.normal(jax.random.PRNGKey(seed), (N, H, K, V), jnp.float32)


def rel_err(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@jax.jit
def token_states(q, k, v, g, beta, initial_state):
    """State after every token ``[B, T, H, K, V]`` (token-by-token ground truth)."""
    from pallas_kernels.kda.reference import _token_step

    K = q.shape[-1]
    qs = q.astype(jnp.float32) * K ** -0.5

    def step(S, xs):
        S, _ = _token_step(S, *xs)
        return S, S

    xs = tuple(jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (qs, k, v, g, beta))
    _, states = jax.lax.scan(step, initial_state.astype(jnp.float32), xs)
    return jnp.moveaxis(states, 0, 1)
