"""Logit bias and repetition penalties on device (vLLM's semantics), before temperature and filtering.

Order, as in vLLM: a structured-output row's allowed-token bitmask first (`apply_bitmask`), then the bias (OpenAI `logit_bias`, and `min_tokens`' ban of stop tokens, which the
host writes as a -inf bias while a request is short; with `allowed_token_ids` the row lists exactly the
allowed tokens and every other logit becomes -inf), then the penalties over the row's tokens:

* repetition (`r`, 1 is off): every token seen in the prompt or the output has its logit divided by
  `r` when positive and multiplied by `r` otherwise;
* frequency (`f`) and presence (`p`): `logit -= f * count + p * (count > 0)` where `count` is how often
  the token occurs in the output so far (the prompt does not count).

The token history comes from the engine's token pages (`serve/step.py`): `[B, S]` ids over the row's
page positions, with `in_ctx` marking positions before the current one and `is_out` those at or after
the prompt's end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_bias(logits: jax.Array, ids: jax.Array, values: jax.Array, restrict: jax.Array | None = None) -> jax.Array:
    """logits [B, V] + values [B, N] at ids [B, N] (-1: unused entry) -> [B, V]; rows with `restrict` [B]
    keep only their listed tokens (the others -inf: `allowed_token_ids`)."""
    b, v = logits.shape
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], ids.shape)
    ids = jnp.where(ids < 0, v, ids)
    out = logits.at[rows, ids].add(values, mode="drop")
    if restrict is None:
        return out
    listed = jnp.zeros((b, v), bool).at[rows, ids].set(True, mode="drop")
    return jnp.where(restrict[:, None] & ~listed, -jnp.inf, out)


def apply_bitmask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """logits [B, V] with every token whose bit is clear in mask [B, W] int32 set to -inf (bit t % 32 of
    word t // 32 is token t; a row of -1 allows everything: structured outputs, serve/structured.py)."""
    v = logits.shape[-1]
    t = jnp.arange(v, dtype=jnp.int32)
    bits = (mask[:, t >> 5] >> (t & 31)) & 1  # [B, V]
    return jnp.where(bits != 0, logits, -jnp.inf)


def token_counts(history: jax.Array, weight: jax.Array, vocab: int) -> jax.Array:
    """How often each token occurs in each row where `weight` is set: [B, S] -> [B, V] float32."""
    b = history.shape[0]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], history.shape)
    ids = jnp.where(weight, history, vocab)  # masked positions fall off the end
    return jnp.zeros((b, vocab), jnp.float32).at[rows, ids].add(1.0, mode="drop")


def apply_penalties(logits: jax.Array, history: jax.Array, in_ctx: jax.Array, is_out: jax.Array,
                    presence: jax.Array, frequency: jax.Array, repetition: jax.Array) -> jax.Array:
    """logits [B, V]; history/in_ctx/is_out [B, S]; presence/frequency/repetition [B] -> [B, V]."""
    v = logits.shape[-1]
    out = token_counts(history, in_ctx & is_out, v)  # [B, V] output occurrences
    seen = token_counts(history, in_ctx, v) > 0  # [B, V] in the prompt or the output
    r = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency[:, None] * out - presence[:, None] * (out > 0)
