"""Seeded random initial values for parameters.

Construction runs eagerly for presets (seeded random weights) and abstractly under `nnx.eval_shape`
before a checkpoint load. Eagerly, values are drawn with NumPy from a seed derived from the module's
RNG key: one host draw per tensor instead of one compiled JAX op per shape, which keeps building a
test model well under a second. Under tracing they fall back to `jax.random` (shapes only matter).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _host_rng(rngs: nnx.Rngs):
    key = rngs.params()
    if isinstance(key, jax.core.Tracer):
        return key, None
    return key, np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())


def normal(rngs: nnx.Rngs, shape, dtype, std: float, mean: float = 0.0) -> jax.Array:
    key, rng = _host_rng(rngs)
    if rng is None:
        return (mean + std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return jnp.asarray((mean + std * rng.standard_normal(shape, dtype=np.float32)).astype(dtype))


def uniform(rngs: nnx.Rngs, shape, dtype, low: float, high: float) -> jax.Array:
    key, rng = _host_rng(rngs)
    if rng is None:
        return jax.random.uniform(key, shape, jnp.float32, low, high).astype(dtype)
    return jnp.asarray(rng.uniform(low, high, shape).astype(dtype))


def randint(rngs: nnx.Rngs, shape, dtype, low: int, high: int) -> jax.Array:
    """Integers in [low, high)."""
    key, rng = _host_rng(rngs)
    if rng is None:
        return jax.random.randint(key, shape, low, high, jnp.int32).astype(dtype)
    return jnp.asarray(rng.integers(low, high, shape).astype(dtype))
