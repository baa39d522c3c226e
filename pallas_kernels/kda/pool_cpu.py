"""Pool decode in plain jnp for CPU: ``fused_recurrent_kda_pool`` one row at a time, in place.

The reference gathers every row's state (``[B, H, K, V]``), scans, and scatters the states back:
three passes over all the states through memory, which on a CPU stop fitting in cache from a few
tens of rows (measured 8 % of the memory roofline at B >= 32 on the 2-core host). Here a loop over
the rows reads one state, runs its tokens, and writes it back with a dynamic-update-slice, which
XLA performs in place on the loop-carried pool (donate it in the enclosing jit), so each state
crosses memory once each way while it sits in cache. Each row's arithmetic is the same whatever
the batch; padding rows (slot outside ``[0, S)``) write the clamped slot they read back unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kda.reference import kda_token_step, pool_rows

__all__ = ["fused_recurrent_kda_pool_cpu"]


def fused_recurrent_kda_pool_cpu(q, k, v, g, beta, state_pool, slot_ids, scale=None):
    """Same contract as ``fused_recurrent_kda_pool_reference``: -> ``(o [B,T,H,V], new_pool)``."""
    b, t = q.shape[:2]
    s_pool = state_pool.shape[0]
    slot_ids = slot_ids.astype(jnp.int32)

    def row(i, carry):
        pool, out = carry
        sid = slot_ids[i]
        real = pool_rows(sid, s_pool)
        slot = jnp.clip(sid, 0, s_pool - 1)
        s0 = jax.lax.dynamic_index_in_dim(pool, slot, keepdims=False)  # [H, K, V]
        xs = [jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in (q, k, v, g, beta)]  # [T, H, .]

        def token(s, x):
            o, s = kda_token_step(s, *x, scale=scale)
            return s, o

        s1, o = jax.lax.scan(token, s0.astype(jnp.float32), xs)  # o [T, H, V]
        s1 = jnp.where(real, s1.astype(pool.dtype), s0)
        pool = jax.lax.dynamic_update_index_in_dim(pool, s1, slot, 0)
        o = jnp.where(real, o, 0.0).astype(v.dtype)
        return pool, jax.lax.dynamic_update_index_in_dim(out, o, i, 0)

    out = jnp.zeros((b, t, q.shape[2], v.shape[-1]), v.dtype)
    # A trip count XLA cannot fold (a constant 1 would inline the body and lose the in-place update)
    # that is still b whatever the ids: every row runs, padding ones included.
    n = jnp.maximum(b - jnp.sum(slot_ids < -(1 << 30), dtype=jnp.int32), b)
    pool, out = jax.lax.fori_loop(0, n, row, (state_pool, out))
    return out, pool
