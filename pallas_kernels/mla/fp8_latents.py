"""fp8 latent pages for the paged MLA decode: the kernels read the cache's words and dequantise in the tile.

A cache page stored in fp8 (DeepSeek's `fp8_ds_mla` layout, what `serve/latent_codec.py` writes) holds per
token, as float32 words:

    lat / 4 words     the compressed latent as float8_e4m3fn, value 4w + j in byte j of word w
    lat / tile words  one float32 scale (a power of two) per `tile` compressed values
    the rotary key    `rope` values in `rope_dtype` (bf16: value 2w + k in half k of word w; fp32: as is)

Passing those words (not values decoded beforehand) keeps a decode step's cache traffic at 656 B a token and
layer for K3 instead of 1152. Without a reshape inside the kernel, a page is read as *planes*: for each scale
tile t and byte j, the [page, tile / 4] values of byte j of the tile's words (value 4 (t tile / 4 + w) + j at
column w), and likewise the rotary halves. The queries are permuted the same way outside the kernel
(`permute`), so each plane's dot with its query plane is part of the score, and the context comes out per
plane and is put back in order (`unpermute`). Decoding a byte is integer arithmetic on the word (sign,
exponent, mantissa into a float32's bits; subnormals as m * 2^-9), which every Pallas backend lowers; the
scale multiplies exactly (a power of two).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["Fp8Latents", "decode_byte", "bf16_half"]


@dataclass(frozen=True)
class Fp8Latents:
    """The layout of one token's fp8 latent words (hashable: a static kernel argument)."""

    lat: int  # compressed latent values (K3: 512)
    rope: int  # rotary values (K3: 64)
    tile: int  # compressed values per scale (K3: 128)
    rope_dtype: str = "bfloat16"  # "bfloat16" | "float32"

    def __post_init__(self):
        if self.lat % self.tile or self.tile % 4:
            raise ValueError(f"fp8 latents: tile {self.tile} must divide {self.lat} and be a multiple of 4")
        if self.rope_dtype not in ("bfloat16", "float32") or (self.rope_dtype == "bfloat16" and self.rope % 2):
            raise ValueError(f"fp8 latents: rotary part {self.rope} x {self.rope_dtype} is not whole words")

    @property
    def tiles(self) -> int:
        return self.lat // self.tile

    @property
    def plane(self) -> int:
        """Columns of one compressed plane (words per scale tile)."""
        return self.tile // 4

    @property
    def rope_halves(self) -> int:
        """Values of the rotary key per word: 2 (bf16) or 1 (fp32)."""
        return 2 if self.rope_dtype == "bfloat16" else 1

    @property
    def scale_word(self) -> int:
        return self.lat // 4

    @property
    def rope_word(self) -> int:
        return self.lat // 4 + self.tiles

    @property
    def words(self) -> int:
        return self.rope_word + self.rope // self.rope_halves

    def decode(self, words: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[..., words] float32 -> (compressed [..., lat], rotary [..., rope]) float32 values, exactly as stored."""
        lead = words.shape[:-1]
        u = lax.bitcast_convert_type(words[..., :self.scale_word], jnp.uint32)
        q = jnp.stack([decode_byte(u, j) for j in range(4)], axis=-1).reshape(*lead, self.tiles, self.tile)
        scale = words[..., self.scale_word:self.rope_word]
        c = (q * scale[..., None]).reshape(*lead, self.lat)
        r = words[..., self.rope_word:self.words]
        if self.rope_halves == 2:
            ur = lax.bitcast_convert_type(r, jnp.uint32)
            r = jnp.stack([bf16_half(ur, 0), bf16_half(ur, 1)], axis=-1).reshape(*lead, self.rope)
        return c, r

    def permute(self, q_lat: jax.Array, q_rope: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Queries [..., lat], [..., rope] -> the same values in plane order (plane t * 4 + j of the compressed
        part, then the rotary halves), as the kernels read the page's planes."""
        lead = q_lat.shape[:-1]
        q_lat = jnp.swapaxes(q_lat.reshape(*lead, self.tiles, self.plane, 4), -1, -2).reshape(*lead, self.lat)
        q_rope = jnp.swapaxes(q_rope.reshape(*lead, -1, self.rope_halves), -1, -2).reshape(*lead, self.rope)
        return q_lat, q_rope

    def unpermute(self, ctx: jax.Array) -> jax.Array:
        """A context [..., lat] in plane order -> value order."""
        lead = ctx.shape[:-1]
        return jnp.swapaxes(ctx.reshape(*lead, self.tiles, 4, self.plane), -1, -2).reshape(*lead, self.lat)

    def planes(self, load, valid_rows) -> tuple[list, list]:
        """One page's planes from `load(first_word, words) -> [page, words]` float32 (a ref read or a slice of a
        loaded block) -> (compressed planes [page, tile / 4] in plane order, rotary planes), float32 values
        with the rows past the sequence (`valid_rows` [page, 1] bool) zeroed: stale words may hold any bits."""
        c = []
        for t in range(self.tiles):
            u = lax.bitcast_convert_type(load(t * self.plane, self.plane), jnp.uint32)
            scale = jnp.where(valid_rows, load(self.scale_word + t, 1), 0.0)  # [page, 1]
            c += [jnp.where(valid_rows, decode_byte(u, j), 0.0) * scale for j in range(4)]
        r = load(self.rope_word, self.rope // self.rope_halves)
        if self.rope_halves == 2:
            ur = lax.bitcast_convert_type(r, jnp.uint32)
            return c, [bf16_half(ur, 0), bf16_half(ur, 1)]
        return c, [r]


def decode_byte(u: jax.Array, j: int) -> jax.Array:
    """Byte j of uint32 words as float8_e4m3fn -> float32 (bit manipulation: every backend lowers it)."""
    b = (u >> (8 * j)) & 0xFF
    sign, exp, man = b >> 7, (b >> 3) & 0xF, b & 7
    normal = lax.bitcast_convert_type((sign << 31) | ((exp + 120) << 23) | (man << 20), jnp.float32)
    sub = man.astype(jnp.float32) * (2.0 ** -9)
    return jnp.where(exp == 0, jnp.where(sign == 1, -sub, sub), normal)


def bf16_half(u: jax.Array, k: int) -> jax.Array:
    """Half k (0: low) of uint32 words as bfloat16 -> float32 (exact)."""
    bits = (u << 16) if k == 0 else (u & jnp.uint32(0xFFFF0000))
    return lax.bitcast_convert_type(bits, jnp.float32)
