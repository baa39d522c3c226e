"""How one token's MLA latent is stored in the cache arena (`kv_cache_dtype`, vLLM's option).

The latent is `kv_lora_rank` compressed values (K3: 512) then the `qk_rope_head_dim` rotary key
(64): 576 values per token per MLA layer. The arena is float32 words, so every format is a whole
number of words per token:

* `auto`: the model dtype, bit-exact (bf16: two values per word, 288 words; fp32: 576).
* `fp8` (aliases `fp8_e4m3`, `fp8_ds_mla`): the compressed part as float8_e4m3fn with one fp32 scale
  per 128 values (the power of two that puts the tile's largest magnitude in (224, 448], the top of
  the format's range), and the rotary part in
  the model dtype, unquantized (models whose compressed width is not a multiple of 128, the tiny
  test presets, use gcd(128, width) values per scale). Per token: 512 x 1 B + 4 x 4 B + 64 x 2 B = 656 B for a bf16 model
  (DeepSeek V3.2's `fp8_ds_mla` layout; 57 % of bf16's 1152 B), 784 B for an fp32 model. Positions
  stay exact because the rotary key is not quantized; each tile's error is at most half an fp8 step
  of its own magnitude (2^-4 relative), plus a subnormal floor of 2^-10 x scale (<= amax / 2^17.8).

A token's stored words depend on that token's latent alone (per-token, per-tile scales; no running
statistics), and the step attends over what the cache stores, including the tokens it just wrote.
So a prefill computes the same values whatever its chunking, and a prefix-cache hit reads exactly
what a cold prefill would have attended over: warm and cold outputs stay bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import math

import jax
import jax.numpy as jnp

WORD = 4  # bytes per arena word (float32)
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
TILE = 128  # compressed values per fp8 scale (fewer where the width is not a multiple)

ALIASES = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_ds_mla": "fp8"}


def canonical(kv_cache_dtype: str) -> str:
    """vLLM's spellings -> "auto" | "fp8"; anything else is an error naming the option."""
    kind = ALIASES.get(kv_cache_dtype) if isinstance(kv_cache_dtype, str) else None
    if kind is None:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: expected one of {sorted(ALIASES)} (fp8 is "
                         f"float8_e4m3fn with a scale per {TILE} latent values; fp8_e5m2 is not supported)")
    return kind


def pack_words(x: jax.Array) -> jax.Array:
    """[..., n] values of a 1-, 2- or 4-byte dtype -> [..., n * itemsize / 4] float32 words (bit-exact)."""
    if x.dtype == jnp.float32:
        return x
    ratio = WORD // x.dtype.itemsize
    return jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], -1, ratio), jnp.float32)


def unpack_words(w: jax.Array, dtype) -> jax.Array:
    """Inverse of `pack_words`: [..., words] float32 -> [..., words * 4 / itemsize] `dtype`."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return w
    return jax.lax.bitcast_convert_type(w, dtype).reshape(*w.shape[:-1], -1)


def scale_exponent(amax: jax.Array) -> jax.Array:
    """k such that amax / 2^k is in (224, 448]: the tile fills the top of the e4m3 range.

    Powers of two keep encoding division-free: `x * (1 / s)` and `q * s` are exact, so a value's words
    are the same in every program and vector lane (a float division is not: XLA:CPU's vectorised
    division rounded differently from its scalar tail, which made a token's scale depend on its row)."""
    m, e = jnp.frexp(amax)  # amax = m * 2^e, m in [0.5, 1)
    k = jnp.where(m <= FP8_MAX / 512, e - 9, e - 8)  # m * 2^9 <= 448, else m * 2^8 in (224, 256)
    return jnp.clip(jnp.where(amax > 0, k, 0), -126, 126)  # finite 2^k and 2^-k


@dataclass(frozen=True)
class LatentCodec:
    """One token's latent <-> its arena words. Hashable: part of the arena layout, a jit key."""

    kind: str  # "auto" | "fp8"
    dtype: str  # model dtype name: what `decode` returns (and the rotary part's storage under fp8)
    width: int  # latent values per token (kv_lora_rank + rope)
    rope: int  # trailing rotary values (kept in the model dtype under fp8)

    @classmethod
    def make(cls, kv_cache_dtype: str, dtype, width: int, rope: int) -> "LatentCodec":
        codec = cls(canonical(kv_cache_dtype), jnp.dtype(dtype).name, width, rope)
        size = jnp.dtype(dtype).itemsize
        if codec.kind == "auto" and (width * size) % WORD:
            raise ValueError(f"latent width {width} x {size} B is not a whole number of 4-byte words")
        if codec.kind == "fp8" and (codec.compressed % WORD or (rope * size) % WORD):
            raise ValueError(f"kv_cache_dtype=fp8 needs kv_lora_rank a multiple of {WORD} (got "
                             f"{codec.compressed}) and whole words of rotary values (got {rope} x {size} B)")
        return codec

    @property
    def as_stored(self) -> bool:
        """Latents are the arena's float32 words themselves (fp32 model, `auto`). Every other arena word is a
        finite float32 too (fp32 states and conv windows; bf16-packed states, whose high halves are finite bf16
        values, read as finite float32), so a stale word read as a latent is finite; under any other format it
        may be NaN or inf (a float32's low half read as bf16, any byte read as fp8)."""
        return self.kind == "auto" and self.dtype == "float32"

    @property
    def compressed(self) -> int:
        return self.width - self.rope

    @property
    def tile(self) -> int:
        """Compressed values per fp8 scale."""
        return math.gcd(TILE, self.compressed)

    @property
    def words(self) -> int:
        """float32 words per token."""
        size = jnp.dtype(self.dtype).itemsize
        if self.kind == "auto":
            return self.width * size // WORD
        return self.compressed // WORD + self.compressed // self.tile + self.rope * size // WORD

    def kernel_format(self):
        """What the paged MLA decode kernel is told of the words it reads: None (pages of model-dtype values, a
        view of the words) or the fp8 layout (`pallas_kernels.mla.Fp8Latents`), dequantised in the tile."""
        if self.kind == "auto":
            return None
        from pallas_kernels.mla.fp8_latents import Fp8Latents

        return Fp8Latents(self.compressed, self.rope, self.tile, self.dtype)

    def encode(self, x: jax.Array) -> jax.Array:
        """[..., width] latents -> [..., words] float32 words."""
        x = x.astype(self.dtype)
        if self.kind == "auto":
            return pack_words(x)
        lead, c, t = x.shape[:-1], self.compressed, self.tile
        tiles = x[..., :c].astype(jnp.float32).reshape(*lead, c // t, t)
        amax = jnp.max(jnp.abs(tiles), axis=-1, keepdims=True)  # [..., c / t, 1]
        k = scale_exponent(amax)
        scale, inv = jnp.ldexp(jnp.float32(1), k), jnp.ldexp(jnp.float32(1), -k)  # 2^k, 1 / 2^k exactly
        q = jnp.clip(tiles * inv, -FP8_MAX, FP8_MAX).astype(FP8).reshape(*lead, c)
        return jnp.concatenate([pack_words(q), scale[..., 0], pack_words(x[..., c:])], axis=-1)

    def decode(self, w: jax.Array) -> jax.Array:
        """[..., words] float32 words -> [..., width] latents in the model dtype."""
        if self.kind == "auto":
            return unpack_words(w, self.dtype)
        lead, c = w.shape[:-1], self.compressed
        nq, ns = c // WORD, c // self.tile
        q = unpack_words(w[..., :nq], FP8).astype(jnp.float32).reshape(*lead, ns, self.tile)
        nope = (q * w[..., nq:nq + ns, None]).reshape(*lead, c).astype(self.dtype)
        return jnp.concatenate([nope, unpack_words(w[..., nq + ns:], self.dtype)], axis=-1)
