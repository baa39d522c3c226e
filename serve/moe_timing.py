"""MoE dispatch time: the model's MoE blocks timed per step shape, measured once at warm-up.

The step is one compiled program, so the time its MoE blocks take (routing, sort by expert,
expert GEMMs, un-sort and combine, shared experts) cannot be read off the host per call without
host callbacks that would serialise the step. Instead, for every token count a compiled bucket
runs (rows x tokens per row), the engine compiles the same MoE blocks alone, with the model's
weights, on RMS-normalised random hidden states of that many tokens, and times them (median of a
few warm calls). Each step then adds the time measured for its token count. The value is a
measurement of the code the step runs at the step's shape; it does not follow routing skew
within a shape (on CPU the blocked grouped matmul's cost is fixed by the shape; on GPU/TPU the
Pallas kernel skips empty tiles, so skewed steps can be faster than the figure).
"""

from __future__ import annotations

import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.layer_scan import LayerScan


@partial(jax.jit, static_argnums=(0,), static_argnames=("scan",))
def moe_blocks(graphdef, params, x: jax.Array, scan: LayerScan | None = None) -> jax.Array:
    """Run every MoE block of the model on x [N, H] (each block on the same input) -> [L_moe, N, H].
    With `scan`, params = (state, stacked weights) as the engine's step takes them, and the scanned
    layers' blocks run as a map over their groups, as in the step."""
    stacked = None
    if scan is not None:
        params, stacked = params
    model = nnx.merge(graphdef, params)
    block = lambda layer: layer.block_sparse_moe(x[None])[0]  # noqa: E731
    outs = [block(layer) for l, layer in enumerate(model.layers) if layer.is_moe and not (scan and scan.covers(l))]
    if scan is not None:
        moe = [i for i in range(scan.period) if model.layers[scan.start + i].is_moe]
        sliced, layer_at = model.scanned_layers(scan, stacked)

        def group(xs):  # the group's MoE blocks, built as the step's scan builds them
            g, states = xs
            ys = []
            for i in moe:
                layer, window = layer_at(i, g, states[i])
                with window:
                    ys.append(block(layer))
            return jnp.stack(ys)

        if moe:
            ys = jax.lax.map(group, (jnp.arange(scan.groups, dtype=jnp.int32), sliced))
            outs.append(ys.reshape(-1, *ys.shape[2:]))  # (order across layers does not matter for a timing)
    return jnp.concatenate([o[None] if o.ndim == 2 else o for o in outs])


def moe_input(hidden_size: int, dtype, tokens: int, seed: int = 0) -> jax.Array:
    """RMS-normalised random hidden states [tokens, hidden_size] (what a MoE block sees after its norm)."""
    x = np.random.default_rng(seed).standard_normal((tokens, hidden_size)).astype(np.float32)
    return jnp.asarray(x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True)), dtype)


def compile_moe_blocks(graphdef, params, hidden_size: int, dtype, tokens: int, scan: LayerScan | None = None) -> None:
    """Compile `moe_blocks` at `tokens` tokens without running it (start-up compiles these side by side
    with the step programs; `time_moe_blocks` then finds the program compiled)."""
    moe_blocks.lower(graphdef, params, moe_input(hidden_size, dtype, tokens), scan=scan).compile()


def time_moe_blocks(graphdef, params, hidden_size: int, dtype, tokens: int, reps: int = 3,
                    seed: int = 0, scan: LayerScan | None = None) -> float:
    """Median seconds of all MoE blocks over `tokens` tokens (compile excluded); 0.0 without MoE."""
    model = nnx.merge(graphdef, params if scan is None else params[0])
    if not any(layer.is_moe for layer in model.layers):
        return 0.0
    x = moe_input(hidden_size, dtype, tokens, seed)
    jax.block_until_ready(moe_blocks(graphdef, params, x, scan=scan))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(moe_blocks(graphdef, params, x, scan=scan))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))
