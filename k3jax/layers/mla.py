"""Multi-head Latent Attention, NoPE (spec §2.4), with an optional q-LoRA and sigmoid output gate.

The cache holds one 576-wide (kv_lora + rope) latent per token per layer: the normed compressed KV
`c` and the shared, un-rotated key part `k_r`. Two equivalent attention forms:
- expanded (full-sequence forward without a cache): per-head K/V are materialised from `c`;
- absorbed (against a cache, decode and chunked prefill): `W_uk` is folded into the query and
  `W_uv` applied after the softmax, so attention reads only the latent cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layers.linear import Linear, matmul
from k3jax.layers.norms import LORA_NORM_EPS, rms_norm

NEG_INF = -1e30


class MLA(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.cfg = cfg
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, ("q_lora", "embed"), dtype=dtype, rngs=rngs)
            self.q_a_layernorm = nnx.Param(jnp.ones((cfg.q_lora_rank,), dtype), axes=("q_lora",))
            self.q_b_proj = Linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, ("heads", "q_lora"), dtype=dtype, rngs=rngs)
        else:
            self.q_proj = Linear(h, nh * cfg.qk_head_dim, ("heads", "embed"), dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(h, cfg.mla_latent_size, ("kv_latent", "embed"), dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = nnx.Param(jnp.ones((cfg.kv_lora_rank,), dtype), axes=("kv_latent",))
        self.kv_b_proj = Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                ("heads", "kv_latent"), dtype=dtype, rngs=rngs)
        if cfg.mla_use_output_gate:
            self.g_proj = Linear(h, nh * cfg.v_head_dim, ("heads", "embed"), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(nh * cfg.v_head_dim, h, ("embed", "heads"), dtype=dtype, rngs=rngs)

    # ---- pieces -----------------------------------------------------------------------------
    def queries(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [B, T, H] -> (q_nope [B, T, nh, dn], q_rope [B, T, nh, dr])."""
        cfg = self.cfg
        if cfg.q_lora_rank:
            q = self.q_b_proj(rms_norm(self.q_a_proj(x), self.q_a_layernorm[...], LORA_NORM_EPS))
        else:
            q = self.q_proj(x)
        q = q.reshape(*x.shape[:2], cfg.num_attention_heads, cfg.qk_head_dim)
        return q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]

    def latent(self, x: jax.Array) -> jax.Array:
        """x [B, T, H] -> cache entries [B, T, kv_lora + rope] = [normed c ; k_r]."""
        r = self.cfg.kv_lora_rank
        c = self.kv_a_proj_with_mqa(x)
        return jnp.concatenate([rms_norm(c[..., :r], self.kv_a_layernorm[...], LORA_NORM_EPS), c[..., r:]], -1)

    def _w_ukv(self) -> jax.Array:
        """kv_b_proj as [nh, dn + dv, r]: per head W_uk rows then W_uv rows (a free reshape)."""
        cfg = self.cfg
        return self.kv_b_proj.out_in().reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim,
                                                  cfg.kv_lora_rank)

    def _kv_b_lora(self) -> tuple[jax.Array, jax.Array] | None:
        """kv_b_proj's adapter factors for this step's rows (k3jax/lora.py): (A [B, R, r], B [B, nh, dn + dv, R])
        or None. The adapters' term of W is B A per head, applied where W is: in the query absorption,
        the output absorption, and the expanded keys / values."""
        factors = self.kv_b_proj.lora_factors()
        if factors is None:
            return None
        a, b = factors
        cfg = self.cfg
        return a, b.reshape(b.shape[0], cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)

    def _w_uk_uv(self) -> tuple[jax.Array, jax.Array]:
        dn = self.cfg.qk_nope_head_dim
        w = self._w_ukv()
        return w[:, :dn], w[:, dn:]  # [nh, dn, r], [nh, dv, r]

    def _finish(self, x: jax.Array, o: jax.Array) -> jax.Array:
        """o [B, T, nh, dv] -> output gate (K3) -> o_proj."""
        o = o.reshape(*o.shape[:2], -1).astype(x.dtype)
        if self.cfg.mla_use_output_gate:
            o = o * jax.nn.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    @property
    def scale(self) -> float:
        return self.cfg.qk_head_dim ** -0.5

    # ---- attention forms --------------------------------------------------------------------
    def expanded(self, x: jax.Array, latent: jax.Array, mask: jax.Array) -> jax.Array:
        """Attention over `latent` [B, S, 576] with per-head K/V materialised. mask: [B, T, S] bool."""
        cfg = self.cfg
        q_n, q_r = self.queries(x)
        w_uk, w_uv = self._w_uk_uv()
        c, k_r = latent[..., :cfg.kv_lora_rank], latent[..., cfg.kv_lora_rank:]
        k_n = matmul("bsr,hdr->bshd", c, w_uk)
        v = matmul("bsr,hdr->bshd", c, w_uv)
        lora = self._kv_b_lora()
        if lora is not None:  # per-row adapters on kv_b_proj: + c A^T B^T, per head
            a, b = lora
            kv = matmul("bsk,bhdk->bshd", matmul("bsr,bkr->bsk", c.astype(a.dtype), a), b)
            k_n, v = k_n + kv[..., :cfg.qk_nope_head_dim], v + kv[..., cfg.qk_nope_head_dim:]
        s = (jnp.einsum("bthd,bshd->bhts", q_n, k_n, preferred_element_type=jnp.float32)
             + jnp.einsum("bthd,bsd->bhts", q_r, k_r, preferred_element_type=jnp.float32)) * self.scale
        p = jax.nn.softmax(jnp.where(mask[:, None], s, NEG_INF), axis=-1).astype(v.dtype)
        return self._finish(x, matmul("bhts,bshd->bthd", p, v))

    def _absorbed_queries(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, H] -> (q_lat [B, T, nh, r] = W_uk^T q_nope per head, q_rope [B, T, nh, dr], W [nh, dn + dv, r]).

        The product uses the whole per-head kv_b_proj block [nh, dn + dv, r] in place: slicing W_uk / W_uv
        out of it would copy the weight on every step (XLA:CPU cannot feed a strided slice to a dot). The
        query is zero-padded over the W_uv rows (exact: the extra terms are 0 * w); the extra arithmetic
        is a few nh * r * dv FLOPs per token, far below the weight traffic it saves at decode."""
        cfg = self.cfg
        q_n, q_r = self.queries(x)
        w = self._w_ukv()
        q_pad = jnp.pad(q_n, ((0, 0),) * 3 + ((0, cfg.v_head_dim),))
        # heads leading, [nh, B*T, dn + dv]: XLA:CPU runs this as a batched matmul, ~2x faster than the
        # per-head product with heads between rows and features (measured: 32 rows 0.79 -> 0.39 ms)
        lead, (nh, d) = q_pad.shape[:2], q_pad.shape[2:]
        q_lat = matmul("hmd,hdr->hmr", q_pad.reshape(-1, nh, d).transpose(1, 0, 2), w)
        q_lat = q_lat.transpose(1, 0, 2).reshape(*lead, nh, -1)
        lora = self._kv_b_lora()
        if lora is not None:  # (W + B A)^T q = W^T q + A^T (B^T q), per row and head
            a, b = lora
            q_lat = q_lat + matmul("bthk,bkr->bthr", matmul("bthd,bhdk->bthk", q_pad.astype(b.dtype), b), a)
        return q_lat, q_r, w

    def _absorbed_output(self, x: jax.Array, ctx: jax.Array, w: jax.Array) -> jax.Array:
        """ctx [B, T, nh, r] (attention over the latents c) -> W_uv per head -> gate -> o_proj."""
        out = matmul("bthr,hdr->bthd", ctx, w)
        lora = self._kv_b_lora()
        if lora is not None:  # + B (A ctx), per row and head
            a, b = lora
            out = out + matmul("bthk,bhdk->bthd", matmul("bthr,bkr->bthk", ctx.astype(a.dtype), a), b)
        return self._finish(x, out[..., self.cfg.qk_nope_head_dim:])

    def absorbed(self, x: jax.Array, latent: jax.Array, mask: jax.Array) -> jax.Array:
        """Same attention with W_uk folded into the query: reads only the latent cache."""
        cfg = self.cfg
        q_lat, q_r, w = self._absorbed_queries(x)  # [B, T, nh, r], [B, T, nh, dr]
        # Both contractions read the cache entries [c ; k_r] whole: slicing c and k_r out of the
        # gathered context would copy it twice more per layer (XLA:CPU cannot feed a slice to a
        # dot). Scores: [q_lat ; q_r] . [c ; k_r] in one product; context: p . [c ; k_r], keeping
        # the first r columns of the (small) result.
        q = jnp.concatenate([q_lat, q_r.astype(q_lat.dtype)], -1)  # [B, T, nh, r + dr]
        s = jnp.einsum("bthr,bsr->bhts", q, latent, preferred_element_type=jnp.float32) * self.scale
        p = jax.nn.softmax(jnp.where(mask[:, None], s, NEG_INF), axis=-1).astype(latent.dtype)
        # [B, nh, T, r] then transposed: XLA:CPU runs this contraction ~4x faster than one that
        # emits [B, T, nh, r] directly (the dot's natural output layout keeps heads next to batch)
        ctx = matmul("bhts,bsr->bhtr", p, latent)[..., :cfg.kv_lora_rank].transpose(0, 2, 1, 3)  # [B, T, nh, r]
        return self._absorbed_output(x, ctx, w)

    def attend_with(self, x: jax.Array, attend) -> jax.Array:
        """Absorbed attention computed by the cache view (`CacheView.mla_attend`):
        `attend(q_lat [B, T, nh, r], q_rope [B, T, nh, dr], scale) -> ctx [B, T, nh, r]` (the view has
        already stored the chunk's latents, so the context includes them)."""
        q_lat, q_r, w = self._absorbed_queries(x)
        ctx = attend(q_lat, q_r.astype(q_lat.dtype), self.scale)
        return self._absorbed_output(x, ctx.astype(q_lat.dtype), w)
