"""Kimi Delta Attention (spec §2.3): projections, short causal conv, decay gate, delta-rule recurrence.

The layer is a pure function of its input chunk and its per-sequence state (conv windows + fp32
recurrent state), so the same code serves full-sequence forward, chunked prefill and decode.
Right-padded rows are masked by `valid`: a padded token gets `g = 0, beta = 0` (the recurrence then
leaves the state untouched) and never enters the conv window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layers import initializers as init
from k3jax.layers.linear import Linear
from k3jax.layers.norms import gated_rms_norm, l2_norm
from pallas_kernels.kda import chunk_kda, fused_recurrent_kda


def kda_decay_gate(f: jax.Array, a_log: jax.Array, dt_bias: jax.Array, lower_bound: float | None) -> jax.Array:
    """Per-channel log-decay g <= 0, fp32. f: [..., N, d]; a_log: [N]; dt_bias: [N, d].

    Kimi-Linear: `-exp(A) softplus(f + dt_bias)`. K3: `lb * sigmoid(exp(A) (f + dt_bias))` (a different
    function, not a clamp), so g in (lb, 0).
    """
    z = f.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    a = jnp.exp(a_log.astype(jnp.float32))[:, None]  # [N, 1]
    if lower_bound is None:
        return -a * jax.nn.softplus(z)
    return lower_bound * jax.nn.sigmoid(a * z)


def causal_conv(x: jax.Array, window: jax.Array, weight: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv + SiLU over a chunk, continuing from `window`.

    x: [B, T, C] projected inputs; window: [B, W-1, C] previous inputs (zeros at sequence start);
    weight: [C, 1, W] (tap W-1 multiplies the current token); valid: [B] tokens of x that are real.
    Returns (y [B, T, C] in x.dtype, new window [B, W-1, C] = last W-1 real inputs).
    """
    width = weight.shape[-1]
    full = jnp.concatenate([window.astype(jnp.float32), x.astype(jnp.float32)], axis=1)  # [B, W-1+T, C]
    taps = weight[:, 0, :].astype(jnp.float32)  # [C, W]
    t = x.shape[1]
    y = sum(full[:, i:i + t, :] * taps[:, i] for i in range(width))
    y = jax.nn.silu(y).astype(x.dtype)
    idx = valid[:, None] + jnp.arange(width - 1)[None, :]  # [B, W-1] into `full`
    new_window = jnp.take_along_axis(full, idx[:, :, None], axis=1)
    return y, new_window


class KDA(nnx.Module):
    """One KDA layer. Parameter names follow the HF checkpoints (`self_attn.*`)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h, n, d, w = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
        p = n * d
        self.cfg = cfg
        self.q_proj = Linear(h, p, ("heads", "embed"), dtype=dtype, rngs=rngs)
        self.k_proj = Linear(h, p, ("heads", "embed"), dtype=dtype, rngs=rngs)
        self.v_proj = Linear(h, p, ("heads", "embed"), dtype=dtype, rngs=rngs)
        conv = lambda: nnx.Param(init.normal(rngs, (p, 1, w), jnp.float32, 0.5), axes=("heads", None, None))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = conv(), conv(), conv()
        self.f_a_proj = Linear(h, d, (None, "embed"), dtype=dtype, rngs=rngs)
        self.f_b_proj = Linear(d, p, ("heads", None), dtype=dtype, rngs=rngs)
        self.b_proj = Linear(h, n, ("heads", "embed"), dtype=dtype, rngs=rngs)
        self.A_log = nnx.Param(init.uniform(rngs, (n,), jnp.float32, -1.0, 1.0), axes=("heads",))
        self.dt_bias = nnx.Param(init.normal(rngs, (p,), jnp.float32, 0.5), axes=("heads",))
        if cfg.kda_full_rank_output_gate:
            self.g_proj = Linear(h, p, ("heads", "embed"), dtype=dtype, rngs=rngs)
        else:
            self.g_a_proj = Linear(h, d, (None, "embed"), dtype=dtype, rngs=rngs)
            self.g_b_proj = Linear(d, p, ("heads", None), dtype=dtype, rngs=rngs)
        self.o_norm = nnx.Param(init.normal(rngs, (d,), jnp.float32, 0.1, mean=1.0), axes=("head_dim",))
        self.o_proj = Linear(p, h, ("embed", "heads"), dtype=dtype, rngs=rngs)

    def output_gate(self, x: jax.Array) -> jax.Array:
        if self.cfg.kda_full_rank_output_gate:
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def __call__(self, x: jax.Array, conv_window: jax.Array, state: jax.Array | None, valid: jax.Array,
                 recurrence=None):
        """x: [B, T, H] normed input; conv_window: [B, 3, W-1, P] (q, k, v); state: [B, N, K, V] fp32;
        valid: [B] real tokens per row. Returns (y [B, T, H], conv_window, state).

        `recurrence(q, k, v, g, beta, window, scale, inputs) -> o`, when given, replaces the delta-rule op
        and owns the state (a cache view updating it in place, or keeping the inputs to commit part of
        the chunk later: `inputs` [B, 3, T, P] are the projected q/k/v before the conv); the returned
        state is then None."""
        cfg = self.cfg
        b, t, _ = x.shape
        n, d = cfg.kda_num_heads, cfg.kda_head_dim
        heads = lambda a: a.reshape(b, t, n, d)
        xq, xk, xv = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, wq = causal_conv(xq, conv_window[:, 0], self.q_conv1d[...], valid)
        k, wk = causal_conv(xk, conv_window[:, 1], self.k_conv1d[...], valid)
        v, wv = causal_conv(xv, conv_window[:, 2], self.v_conv1d[...], valid)
        q, k, v = l2_norm(heads(q)), l2_norm(heads(k)), heads(v).astype(jnp.float32)

        g = kda_decay_gate(heads(self.f_b_proj(self.f_a_proj(x))), self.A_log[...],
                           self.dt_bias[...].reshape(n, d), cfg.gate_lower_bound)  # [B, T, N, d]
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))  # [B, T, N]
        real = (jnp.arange(t)[None, :] < valid[:, None])  # [B, T]
        g = jnp.where(real[:, :, None, None], g, 0.0)
        beta = jnp.where(real[:, :, None], beta, 0.0)

        window = jnp.stack([wq, wk, wv], axis=1)
        if recurrence is not None:
            o, state = recurrence(q, k, v, g, beta, window, d ** -0.5, jnp.stack([xq, xk, xv], axis=1)), None
        else:
            op = fused_recurrent_kda if t == 1 else chunk_kda
            o, state = op(q, k, v, g, beta, scale=d ** -0.5, initial_state=state, output_final_state=True)

        o = gated_rms_norm(o.astype(jnp.float32), self.o_norm[...], heads(self.output_gate(x)), cfg.rms_norm_eps)
        y = self.o_proj(o.reshape(b, t, n * d).astype(x.dtype))
        return y, window, state
