"""Seeded random initial values for parameters.

Construction runs eagerly for presets (seeded random weights) and abstractly under `nnx.eval_shape`
before a checkpoint load. Eagerly, values are drawn with NumPy from a seed derived from the module's
RNG key: one host draw per tensor instead of one compiled JAX op per shape, which keeps building a
test model well under a second. Under tracing they are zeros of the right shape and dtype (shapes only matter) and the RNG stream
is left alone (see `_host_rng`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _host_rng(rngs: nnx.Rngs):
    """A NumPy generator seeded from the next `params` key, or None under tracing.

    Under tracing the stream is not advanced: each advance writes a traced counter, and JAX's
    tracer bookkeeping on that write walks every equation traced so far, which made an abstract
    full-K3 build (~10^4 tensors) quadratic (minutes). Abstract builds need shapes, not draws.
    """
    if isinstance(rngs.params.key[...], jax.core.Tracer):
        return None
    key = rngs.params()
    return np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())


def normal(rngs: nnx.Rngs, shape, dtype, std: float, mean: float = 0.0) -> jax.Array:
    rng = _host_rng(rngs)
    if rng is None:
        return jnp.zeros(shape, dtype)
    return jnp.asarray((mean + std * rng.standard_normal(shape, dtype=np.float32)).astype(dtype))


def uniform(rngs: nnx.Rngs, shape, dtype, low: float, high: float) -> jax.Array:
    rng = _host_rng(rngs)
    if rng is None:
        return jnp.zeros(shape, dtype)
    return jnp.asarray(rng.uniform(low, high, shape).astype(dtype))


def randint(rngs: nnx.Rngs, shape, dtype, low: int, high: int) -> jax.Array:
    """Integers in [low, high)."""
    rng = _host_rng(rngs)
    if rng is None:
        return jnp.zeros(shape, dtype)
    return jnp.asarray(rng.integers(low, high, shape).astype(dtype))
