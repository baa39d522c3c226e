"""The Kimi K3 / Kimi-Linear decoder as Flax NNX modules with explicit cache state.

`KimiModel.__call__(tokens, cache, valid)` processes one chunk of tokens per row:
- `cache=None`: a whole sequence from empty state (MLA in expanded form over the chunk itself);
- with a `ModelCache`: continue each row from its cache (chunked prefill when T > 1, decode when
  T == 1); MLA writes its latents into the cache and attends in absorbed form.
Rows are right-padded: `valid[b]` tokens of row b are real; padded tokens change no state.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.cache import CacheView, ContiguousView, FreshView, ModelCache
from k3jax.config import ModelConfig
from k3jax.layer_scan import LayerScan, cache_strides, join_experts, split_experts
from k3jax.layers.attn_res import AttnResMixer, DepthBank
from k3jax.layers.kda import KDA
from k3jax.layers import initializers as init
from k3jax.layers.linear import project
from k3jax.layers.mla import MLA
from k3jax.layers.mlp import MLP
from k3jax.layers.moe import MoE, stacked_experts
from k3jax.layers.norms import RMSNorm


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.is_mla = cfg.is_mla(layer)
        self.is_moe = cfg.is_moe(layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = (MLA if self.is_mla else KDA)(cfg, dtype=dtype, rngs=rngs)
        if self.is_moe:
            self.block_sparse_moe = MoE(cfg, dtype=dtype, rngs=rngs)
        else:
            self.mlp = MLP(cfg, cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)
        if cfg.uses_attn_res:
            self.self_attention_res = AttnResMixer(cfg.hidden_size, dtype=dtype, rngs=rngs)
            self.mlp_res = AttnResMixer(cfg.hidden_size, dtype=dtype, rngs=rngs)

    def ffn(self, h: jax.Array, trace: list | None = None, valid: jax.Array | None = None) -> jax.Array:
        x = self.post_attention_layernorm(h)
        return self.block_sparse_moe(x, trace, valid) if self.is_moe else self.mlp(x)


class KimiModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        h = cfg.hidden_size
        self.embed_tokens = nnx.Param(init.normal(rngs, (cfg.vocab_size, h), dtype, 1.0), axes=("vocab", "embed"))
        self.layers = nnx.List([DecoderLayer(cfg, l, dtype=dtype, rngs=rngs) for l in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(init.normal(rngs, (cfg.vocab_size, h), dtype, h ** -0.5), axes=("vocab", "embed"))
        self.head_in_out = False  # lm_head held as [H, V] (k3jax/weight_layout.py)
        if cfg.uses_attn_res:
            self.output_attn_res = AttnResMixer(h, dtype=dtype, rngs=rngs)
        # index of each layer inside the stacked per-kind cache arrays
        self.cache_index = tuple(
            (cfg.mla_layers.index(l) if cfg.is_mla(l) else cfg.kda_layers.index(l)) for l in range(cfg.num_hidden_layers))

    # ---- attention with explicit state ------------------------------------------------------
    def _attention(self, layer: DecoderLayer, j, x: jax.Array, view: CacheView, valid: jax.Array) -> jax.Array:
        """`layer`'s attention on normed x [B, T, H]; j: its index in its kind's cache (traced in a scan)."""
        if layer.is_mla:
            attn: MLA = layer.self_attn
            latent = attn.latent(x)  # [B, T, 576]
            attend = view.mla_attend(j, latent, valid)
            if attend is not None:  # attention where the cache keeps the context (paged kernel, ranks)
                return attn.attend_with(x, attend)
            kv, mask = view.mla(j, latent, valid)
            form = attn.expanded if view.mla_form == "expanded" else attn.absorbed
            return form(x, kv, mask)
        window, state = view.kda(j, x.shape[0])
        y, window, state = layer.self_attn(x, window, state, valid, view.kda_recurrence(j))
        view.set_kda(j, window, state)
        return y

    # ---- the residual stream ------------------------------------------------------------------
    def _classic_layer(self, l, layer, j, x, view, valid, trace):
        x = x + self._attention(layer, j, layer.input_layernorm(x), view, valid)
        return x + layer.ffn(x, trace, valid)

    def _attn_res_layer(self, l, layer, j, carry, view, valid, trace):
        """Block AttnRes (spec §2.2): `bank` holds closed block sums (bank[0] = embedding), `p` the open
        block's partial sum (None right after a block closes)."""
        eps = self.cfg.rms_norm_eps
        bank, p = carry
        h = layer.self_attention_res.mix(bank, p, eps) if l else p
        if l % self.cfg.attn_res_block_size == 0:
            bank = bank + [p] if isinstance(bank, list) else bank.push(p)
            p = None
        a = self._attention(layer, j, layer.input_layernorm(h), view, valid)
        p = a if p is None else p + a
        h = layer.mlp_res.mix(bank, p, eps)
        return bank, p + layer.ffn(h, trace, valid)

    def _layers(self, layer_fn, carry, view, valid, trace, scan):
        """Run every layer over `carry` (unrolled, and the scanned run as one `lax.scan` when given)."""
        l = 0
        while l < self.cfg.num_hidden_layers:
            if scan is not None and l == scan[0].start:
                carry = self._scan(layer_fn, carry, view, valid, trace, *scan)
                l = scan[0].stop
                continue
            carry = layer_fn(l, self.layers[l], self.cache_index[l], carry, view, valid, trace)
            l += 1
        return carry

    def _experts_whole(self, l: int) -> bool:
        """Layer l has routed experts that are not split over devices (expert parallelism slices per group)."""
        layer = self.layers[l]
        return layer.is_moe and getattr(layer.block_sparse_moe, "expert_parallel", None) is None

    def scanned_layers(self, scan: LayerScan, stacked: list):
        """-> (per position in the group: the weights a loop over the groups slices, `layer_at(i, g, sliced_i)`
        -> (position i's layer module for group g, the context to run it in)). Routed experts whose expert
        axis is whole stay one stack per weight, read by expert id (`split_experts`), not sliced per group."""
        graphs = [nnx.graphdef(self.layers[scan.start + i]) for i in range(scan.period)]
        split = [split_experts(s) if self._experts_whole(scan.start + i) else (s, {}) for i, s in enumerate(stacked)]
        experts = [whole for _, whole in split]
        counts = [jax.tree.leaves(s["block_sparse_moe"]["w1"])[0].shape[1] if whole else 0  # experts per layer
                  for s, whole in zip(stacked, experts)]

        def layer_at(i: int, g: jax.Array, sliced):
            layer = nnx.merge(graphs[i], join_experts(sliced, experts[i]))
            return layer, (stacked_experts(g * counts[i], counts[i]) if experts[i] else contextlib.nullcontext())

        return [s for s, _ in split], layer_at

    def _scan(self, layer_fn, carry, view, valid, trace, scan: LayerScan, stacked: list):
        """Layers scan.start .. scan.stop - 1 as a scan over their groups: each step rebuilds the group's
        layers from `stacked` [per position: state with weights [G, ...]] and runs them with traced
        cache indices; the view's arrays ride in the carry and the routed expert ids come out per group."""
        first = [self.cache_index[scan.start + i] for i in range(scan.period)]
        kda_stride, mla_stride = cache_strides(self.cfg, scan)
        bank_size = None
        if self.cfg.uses_attn_res:  # the growing list becomes a fixed-size array with a count
            bank, p = carry
            opens = sum(1 for l in range(scan.start, scan.stop) if l % self.cfg.attn_res_block_size == 0)
            bank_size = len(bank) + opens
            carry = (DepthBank.of(bank, bank_size), p)
        sliced, layer_at = self.scanned_layers(scan, stacked)

        def body(c, xs):
            g, states = xs
            model_carry, view_state = c
            view.set_scan_state(view_state)
            routed = [] if trace is not None else None
            for i in range(scan.period):
                layer, window = layer_at(i, g, states[i])
                j = first[i] + g * (mla_stride if layer.is_mla else kda_stride)
                with window:
                    model_carry = layer_fn(scan.start + i, layer, j, model_carry, view, valid, routed)
            return (model_carry, view.scan_state()), (routed or [], view.scan_outputs())

        groups = jnp.arange(scan.groups, dtype=jnp.int32)
        (carry, view_state), (routed, outputs) = jax.lax.scan(body, (carry, view.scan_state()), (groups, sliced))
        view.set_scan_state(view_state)
        view.set_scan_outputs(outputs)
        if trace is not None:  # [per MoE position: ids [G, N, k]] -> layer order
            trace.extend(ids[g] for g in range(scan.groups) for ids in routed)
        if bank_size is not None:
            bank, p = carry
            carry = (bank.entries(bank_size), p)
        return carry

    def __call__(self, tokens: jax.Array | None, cache: ModelCache | None = None, valid: jax.Array | None = None,
                 last_only: bool = False, inputs_embeds: jax.Array | None = None
                 ) -> tuple[jax.Array, ModelCache | None]:
        """tokens [B, T] int32 -> (logits fp32 [B, T, V] or [B, V] if last_only, updated cache).
        `inputs_embeds` [B, T, H] (HF's name) replaces the token embeddings; `tokens` may then be None."""
        embeds = None
        if inputs_embeds is not None:
            b, t = inputs_embeds.shape[:2]
            tokens = jnp.zeros((b, t), jnp.int32) if tokens is None else tokens
            embeds = (inputs_embeds, jnp.ones((b, t), bool))
        b, t = tokens.shape
        if valid is None:
            valid = jnp.full((b,), t, jnp.int32)
        view = FreshView(self.cfg, t) if cache is None else ContiguousView(cache)
        logits = self.run(tokens, view, valid, last_only, embeds=embeds)
        return logits, (None if cache is None else view.result(valid))

    def run(self, tokens: jax.Array, view: CacheView, valid: jax.Array, last_only: bool,
            trace: list | None = None, hidden: list | None = None,
            embeds: tuple[jax.Array, jax.Array] | None = None,
            scan: tuple[LayerScan, list] | None = None) -> jax.Array:
        """The forward pass against any cache view (fresh, contiguous, or the engine's paged arena).
        `trace`, when given, collects each MoE layer's routed expert ids; `hidden` receives the final
        hidden states of every position [B, T, H] (before the norm; `logits` turns them into logits).
        `embeds` = (values [B, T, H], use [B, T] bool): where `use` is set, the position's input is that
        vector instead of its token's embedding (prompt embeddings). `scan` = (plan, stacked weights from
        `layer_scan.split_params`): the planned run of layers runs as one scan over its groups."""
        x = self.embed(tokens, embeds)
        if self.cfg.uses_attn_res:
            bank, p = self._layers(self._attn_res_layer, ([], x), view, valid, trace, scan)
            x = self.output_attn_res.mix(bank, p, self.cfg.rms_norm_eps)
        else:
            x = self._layers(self._classic_layer, x, view, valid, trace, scan)
        if hidden is not None:
            hidden.append(x)
        if last_only:
            x = jnp.take_along_axis(x, jnp.maximum(valid - 1, 0)[:, None, None], axis=1)[:, 0]
        return self.logits(x)

    def embed(self, tokens: jax.Array, embeds: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        """tokens [B, T] -> input vectors [B, T, H]: the embedding table's rows, or `embeds`' values where
        its mask is set."""
        x = jnp.take(self.embed_tokens[...], tokens, axis=0)
        if embeds is None:
            return x
        values, use = embeds
        return jnp.where(use[..., None], values.astype(x.dtype), x)

    def logits(self, x: jax.Array) -> jax.Array:
        """Final norm and LM head: hidden [..., H] -> fp32 logits [..., V]."""
        x = self.norm(x)
        head = self.embed_tokens[...] if self.cfg.tie_word_embeddings else self.lm_head[...]
        return project(x, head, self.head_in_out, jnp.float32)
