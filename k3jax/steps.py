"""Pure step functions over explicit arrays: the graph is split once, params and cache are pytrees.

    forward(graphdef, params, tokens)                      -> logits [B, T, V] fp32
    prefill_step(graphdef, params, cache, tokens, valid)   -> (last-token logits [B, V], cache)
    decode_step(graphdef, params, cache, tokens)           -> (logits [B, V], cache)

Each is wrapped in `jax.jit` with the graph definition static and the cache donated, so XLA updates
the state in place.
"""

from __future__ import annotations

from functools import partial

import jax
from flax import nnx

from k3jax.cache import ModelCache


def _merge(graphdef, params):
    return nnx.merge(graphdef, params)


@partial(jax.jit, static_argnums=(0,))
def forward(graphdef, params, tokens: jax.Array) -> jax.Array:
    logits, _ = _merge(graphdef, params)(tokens)
    return logits


@partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def prefill_step(graphdef, params, cache: ModelCache, tokens: jax.Array, valid: jax.Array):
    """One chunk of prompt per row (right-padded, `valid` real tokens); returns last-real-token logits."""
    return _merge(graphdef, params)(tokens, cache, valid, last_only=True)


@partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def decode_step(graphdef, params, cache: ModelCache, tokens: jax.Array):
    """tokens [B] -> (logits [B, V], cache) for one new token per row."""
    logits, cache = _merge(graphdef, params)(tokens[:, None], cache, None, last_only=True)
    return logits, cache
