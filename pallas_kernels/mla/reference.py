"""Plain-jnp reference for absorbed (latent) MLA decode over a paged cache (spec §2.4)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["paged_mla_decode_reference", "check_paged_mla_args"]


def check_paged_mla_args(q_latent, q_rope, kv_pages, page_table, seq_lens, kv_format=None):
    """Static shape validation. Returns (B, H, L, R, num_pages, page_size, max_pages)."""
    if q_latent.ndim != 3 or q_rope.ndim != 3:
        raise ValueError(f"q_latent/q_rope must be [B, H, *], got {q_latent.shape}, {q_rope.shape}")
    b, h, l = q_latent.shape
    if q_rope.shape[:2] != (b, h):
        raise ValueError(f"q_rope {q_rope.shape} does not match q_latent {q_latent.shape}")
    r = q_rope.shape[2]
    if kv_format is not None:
        if (kv_format.lat, kv_format.rope) != (l, r):
            raise ValueError(f"kv_format {kv_format} does not match q_latent / q_rope widths {l} / {r}")
        if kv_pages.ndim != 3 or kv_pages.shape[2] != kv_format.words or kv_pages.dtype != jnp.float32:
            raise ValueError(f"kv_pages must be float32 words [num_pages, page_size, {kv_format.words}] under "
                             f"kv_format, got {kv_pages.dtype}{list(kv_pages.shape)}")
    elif kv_pages.ndim != 3 or kv_pages.shape[2] != l + r:
        raise ValueError(f"kv_pages must be [num_pages, page_size, {l}+{r}], got {kv_pages.shape}")
    num_pages, page_size, _ = kv_pages.shape
    if page_table.ndim != 2 or page_table.shape[0] != b:
        raise ValueError(f"page_table must be [{b}, max_pages], got {page_table.shape}")
    if seq_lens.shape != (b,):
        raise ValueError(f"seq_lens must be [{b}], got {seq_lens.shape}")
    for name, x in (("page_table", page_table), ("seq_lens", seq_lens)):
        if not jnp.issubdtype(x.dtype, jnp.integer):  # a float table would be truncated to pages silently
            raise TypeError(f"{name} must be an integer array, got {x.dtype}")
    return b, h, l, r, num_pages, page_size, page_table.shape[1]


def paged_mla_decode_reference(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float,
    out_dtype=None,
    return_lse: bool = False,
    kv_format=None,
):
    """One decode step of absorbed MLA against a paged latent cache.

    ``q_latent [B, H, L]`` (= W_uk^T q_nope per head), ``q_rope [B, H, R]``,
    ``kv_pages [P, page_size, L + R]`` (per token ``[c̄ ; k_r]``, one KV head shared by
    all query heads), ``page_table [B, max_pages]`` int32, ``seq_lens [B]`` int32.
    Token ``s`` of sequence ``b`` lives at ``kv_pages[page_table[b, s // ps], s % ps]``.

    ``score[b,h,s] = (q_latent·c̄_s + q_rope·k_r,s) * scale``; fp32 softmax over
    ``s < seq_lens[b]``; ``ctx[b,h] = Σ_s p · c̄_s`` (fp32 accumulate), returned as
    ``out_dtype`` (default ``q_latent.dtype``). Rows with ``seq_lens == 0`` give zeros.
    Page-table entries past a sequence's last page and cache slots past its length are
    never used (clamped + masked with ``where``, so stale/NaN contents cannot leak).
    With ``return_lse`` also ``lse [B, H]`` fp32 = log Σ_s exp(score[b,h,s]) (-inf where
    ``seq_lens == 0``): what combining partial attentions over disjoint token sets needs
    (decode context parallelism).

    ``kv_format`` (a :class:`pallas_kernels.mla.fp8_latents.Fp8Latents`): ``kv_pages`` are the cache's
    float32 words ``[P, page_size, words]`` of fp8 latents, dequantised after the gather (values exactly as
    stored, in ``q_latent``'s dtype).
    """
    b, h, l, r, num_pages, page_size, max_pages = check_paged_mla_args(
        q_latent, q_rope, kv_pages, page_table, seq_lens, kv_format)
    out_dtype = q_latent.dtype if out_dtype is None else out_dtype
    seq_lens = seq_lens.astype(jnp.int32)
    pt = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1)
    kv = kv_pages[pt].reshape(b, max_pages * page_size, kv_pages.shape[2])  # [B, S, L+R] (or words)
    if kv_format is not None:
        kv = jnp.concatenate(kv_format.decode(kv), axis=-1).astype(q_latent.dtype)
    pos = jnp.arange(max_pages * page_size, dtype=jnp.int32)
    valid = pos[None, :] < seq_lens[:, None]  # [B, S]
    kv = jnp.where(valid[:, :, None], kv, jnp.zeros((), kv.dtype))
    c_bar, k_r = kv[..., :l], kv[..., l:]
    hp = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bhl,bsl->bhs", q_latent, c_bar, precision=hp, preferred_element_type=jnp.float32)
    s = s + jnp.einsum("bhr,bsr->bhs", q_rope, k_r, precision=hp, preferred_element_type=jnp.float32)
    s = s * jnp.float32(scale)
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(valid[:, None, :], jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    ctx = jnp.einsum("bhs,bsl->bhl", p, c_bar.astype(jnp.float32), precision=hp,
                     preferred_element_type=jnp.float32)
    ctx = ctx / jnp.where(denom > 0, denom, 1.0)
    if return_lse:
        lse = jnp.where(denom > 0, m + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)[..., 0]
        return ctx.astype(out_dtype), lse
    return ctx.astype(out_dtype)
