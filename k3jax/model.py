"""The Kimi K3 / Kimi-Linear decoder as Flax NNX modules with explicit cache state.

`KimiModel.__call__(tokens, cache, valid)` processes one chunk of tokens per row:
- `cache=None`: a whole sequence from empty state (MLA in expanded form over the chunk itself);
- with a `ModelCache`: continue each row from its cache (chunked prefill when T > 1, decode when
  T == 1); MLA writes its latents into the cache and attends in absorbed form.
Rows are right-padded: `valid[b]` tokens of row b are real; padded tokens change no state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.cache import CacheView, ContiguousView, FreshView, ModelCache
from k3jax.config import ModelConfig
from k3jax.layers.attn_res import AttnResMixer
from k3jax.layers.kda import KDA
from k3jax.layers import initializers as init
from k3jax.layers.linear import project
from k3jax.layers.mla import MLA
from k3jax.layers.mlp import MLP
from k3jax.layers.moe import MoE
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

    def ffn(self, h: jax.Array, trace: list | None = None) -> jax.Array:
        x = self.post_attention_layernorm(h)
        return self.block_sparse_moe(x, trace) if self.is_moe else self.mlp(x)


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
    def _attention(self, l: int, x: jax.Array, view: CacheView, valid: jax.Array) -> jax.Array:
        layer, j = self.layers[l], self.cache_index[l]
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
    def _classic(self, x, view, valid, trace):
        for l, layer in enumerate(self.layers):
            x = x + self._attention(l, layer.input_layernorm(x), view, valid)
            x = x + layer.ffn(x, trace)
        return x

    def _attn_res(self, emb, view, valid, trace):
        """Block AttnRes (spec §2.2): `bank` holds closed block sums (bank[0] = embedding)."""
        eps, block = self.cfg.rms_norm_eps, self.cfg.attn_res_block_size
        bank: list[jax.Array] = []
        p = emb
        for l, layer in enumerate(self.layers):
            h = layer.self_attention_res(bank + [p], eps) if bank else p
            if l % block == 0:
                bank.append(p)
                p = None
            a = self._attention(l, layer.input_layernorm(h), view, valid)
            p = a if p is None else p + a
            h = layer.mlp_res(bank + [p], eps)
            p = p + layer.ffn(h, trace)
        return self.output_attn_res(bank + [p], eps)

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
            embeds: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        """The forward pass against any cache view (fresh, contiguous, or the engine's paged arena).
        `trace`, when given, collects each MoE layer's routed expert ids; `hidden` receives the final
        hidden states of every position [B, T, H] (before the norm; `logits` turns them into logits).
        `embeds` = (values [B, T, H], use [B, T] bool): where `use` is set, the position's input is that
        vector instead of its token's embedding (prompt embeddings)."""
        x = self.embed(tokens, embeds)
        x = (self._attn_res if self.cfg.uses_attn_res else self._classic)(x, view, valid, trace)
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
