"""MXFP4 (OCP microscaling FP4) weights as shipped for K3's routed experts.

Format (spec §3.3, compressed-tensors ``mxfp4-pack-quantized``), for a logical
weight ``W [..., R, C]`` (PyTorch ``[out, in]``):

* ``packed [..., R, C/2]`` uint8. Element ``(r, c)`` is the nibble
  ``(packed[r, c // 2] >> (4 * (c % 2))) & 0xF`` -- the **low nibble holds the
  even column**.
* Nibble = E2M1 code: bit 3 is the sign, bits 0-2 index the magnitudes
  ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``.
* ``scale [..., R, C/group_size]`` uint8 E8M0: ``2 ** (e - 127)``. ``e = 255``
  is NaN (OCP); ``e = 0`` is 2**-127 (an fp32 subnormal, effectively 0).
* ``W[r, c] = value(code) * 2 ** (scale[r, c // group_size] - 127)``; this is
  exact in fp32 and bf16.

K3 uses ``group_size = 32``; the spec's golden test (§5) uses 4, so the group
size is a parameter everywhere.
"""
from __future__ import annotations

from typing import Tuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "E2M1_VALUES",
    "E2M1_MAGNITUDES",
    "MXFP4Weight",
    "decode_e2m1",
    "e8m0_to_float",
    "unpack_nibbles",
    "dequantize_mxfp4",
    "quantize_mxfp4",
]

#: The 8 non-negative E2M1 magnitudes, indexed by code bits 0-2.
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
#: All 16 E2M1 values indexed by the full 4-bit code (bit 3 = sign; code 8 is -0.0).
E2M1_VALUES = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES]).astype(np.float32)


# ----------------------------------------------------------------------------- decode helpers
def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """``[..., C/2]`` uint8 -> ``[..., C]`` uint8 codes (low nibble = even column)."""
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    lo = packed & jnp.uint8(0x0F)
    hi = packed >> jnp.uint8(4)
    out = jnp.stack([lo, hi], axis=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def decode_e2m1(codes: jax.Array) -> jax.Array:
    """E2M1 codes (any int dtype, values 0..15) -> fp32, arithmetic decode (no gather).

    Magnitude index ``m = code & 7``: ``m < 2`` -> ``m / 2`` (0, 0.5, subnormal);
    otherwise ``(1 + (m & 1) / 2) * 2 ** ((m >> 1) - 1)``. Written with
    elementwise integer/float ops and ``where`` only, so it lowers inside Pallas
    kernels on every backend.
    """
    c = codes.astype(jnp.int32)
    m = c & 7
    mant = (1.0 + 0.5 * (m & 1).astype(jnp.float32))
    e = (m >> 1)  # 0..3
    # 2 ** (e - 1) for e in 1..3 -> 1, 2, 4 ; built with selects (exact, no pow).
    p2 = jnp.where(e == 1, 1.0, jnp.where(e == 2, 2.0, 4.0)).astype(jnp.float32)
    mag = jnp.where(m < 2, 0.5 * m.astype(jnp.float32), mant * p2)
    return jnp.where((c & 8) != 0, -mag, mag)


def e8m0_to_float(scale: jax.Array) -> jax.Array:
    """E8M0 bytes -> fp32 ``2 ** (e - 127)`` exactly (bit construction).

    e in 1..254 -> fp32 with biased exponent e; e = 0 -> 2**-127 (subnormal);
    e = 255 -> NaN.
    """
    e = jnp.asarray(scale).astype(jnp.uint32)
    bits = jnp.where(e == 0, jnp.uint32(0x00400000), e << jnp.uint32(23))
    bits = jnp.where(e == 255, jnp.uint32(0x7FC00000), bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def dequantize_mxfp4(
    packed: jax.Array,
    scale: jax.Array,
    dtype=jnp.float32,
    group_size: int = 32,
) -> jax.Array:
    """Exact dequantisation ``[..., R, C/2], [..., R, C/group_size] -> [..., R, C]``.

    Leading batch dims (e.g. experts) are supported. Values are computed in fp32
    (where they are exact) and cast to ``dtype`` (also exact for bf16).
    """
    packed = jnp.asarray(packed)
    scale = jnp.asarray(scale)
    cols = packed.shape[-1] * 2
    if cols % group_size:
        raise ValueError(f"logical columns {cols} not a multiple of group_size {group_size}")
    n_groups = cols // group_size
    if scale.shape != packed.shape[:-1] + (n_groups,):
        raise ValueError(
            f"scale shape {scale.shape} != {packed.shape[:-1] + (n_groups,)} "
            f"(packed {packed.shape}, group_size {group_size})")
    # Codes by broadcasting each byte to its two columns and shifting (low nibble = even column):
    # one elementwise pass that XLA fuses with the decode and the scale, no separate unpack copy.
    shifts = jnp.asarray([0, 4], jnp.uint8)
    codes = (packed[..., None] >> shifts) & jnp.uint8(0x0F)  # [..., R, C/2, 2]
    q = decode_e2m1(codes).reshape(*packed.shape[:-1], cols)  # [..., R, C] fp32
    s = e8m0_to_float(scale)  # [..., R, G]
    q = q.reshape(*q.shape[:-1], n_groups, group_size) * s[..., None]
    return q.reshape(*packed.shape[:-1], cols).astype(dtype)


# ----------------------------------------------------------------------------- quantize (tests)
def quantize_mxfp4(w, group_size: int = 32) -> Tuple[np.ndarray, np.ndarray]:
    """NumPy MXFP4 quantiser ``w [..., R, C] -> (packed [..., R, C/2], scale [..., R, C/gs])``.

    **For tests and tiny synthetic checkpoints only** -- K3 ships its routed
    experts pre-quantised (QAT-trained at MXFP4); never re-quantise real weights.

    Per group the E8M0 exponent is the smallest ``e`` with ``max|w| / 2**e <= 6``
    (no clipping), so the largest quantised magnitude lands in {3, 4, 6}. Values
    are rounded to the nearest E2M1 grid point (ties to the even code). All-zero
    groups get scale byte 127. Exponents are clamped to the E8M0 range [0, 254].
    """
    w = np.asarray(w, dtype=np.float64)
    if w.ndim < 1 or w.shape[-1] % group_size or w.shape[-1] % 2:
        raise ValueError(f"last dim {w.shape[-1:]} must be a multiple of group_size={group_size} and even")
    if not np.all(np.isfinite(w)):
        raise ValueError("quantize_mxfp4: non-finite input")
    lead, cols = w.shape[:-1], w.shape[-1]
    g = w.reshape(*lead, cols // group_size, group_size)
    amax = np.max(np.abs(g), axis=-1)  # [..., G]
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(np.where(amax > 0, amax / 6.0, 1.0)))
    # fix possible log2 rounding: want amax / 2**e <= 6 and amax / 2**(e-1) > 6
    e = np.where(amax / np.exp2(e) > 6.0, e + 1, e)
    e = np.where((amax > 0) & (amax / np.exp2(e - 1) <= 6.0), e - 1, e)
    e = np.where(amax > 0, e, 0.0)
    e = np.clip(e, -127, 127)
    scale_b = (e + 127).astype(np.uint8)
    a = np.abs(g) / np.exp2(e)[..., None]
    grid = E2M1_MAGNITUDES.astype(np.float64)
    lo = np.clip(np.searchsorted(grid, a, side="right") - 1, 0, 7)
    hi = np.minimum(lo + 1, 7)
    dlo, dhi = a - grid[lo], grid[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0) & (hi != lo))
    idx = np.where(pick_hi, hi, lo)
    idx = np.where(a > 6.0, 7, idx)  # only reachable when the exponent was clamped
    sign = (g < 0) & (idx > 0)
    codes = (idx | (sign.astype(np.int64) << 3)).astype(np.uint8).reshape(*lead, cols)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed, scale_b


# ----------------------------------------------------------------------------- pytree
@flax.struct.dataclass
class MXFP4Weight:
    """A packed MXFP4 weight (pytree; ``packed`` and ``scale`` are leaves).

    ``packed [..., R, C/2]`` uint8, ``scale [..., R, C/group_size]`` uint8 (E8M0).
    ``group_size`` is static metadata (not a leaf).
    """

    packed: jax.Array
    scale: jax.Array
    group_size: int = flax.struct.field(pytree_node=False, default=32)

    @property
    def shape(self) -> Tuple[int, ...]:
        """Logical (dequantised) shape ``[..., R, C]``."""
        s = tuple(self.packed.shape)
        return s[:-1] + (s[-1] * 2,)

    @property
    def ndim(self) -> int:
        return len(self.packed.shape)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize_mxfp4(self.packed, self.scale, dtype=dtype, group_size=self.group_size)

    @classmethod
    def from_float(cls, w, group_size: int = 32) -> "MXFP4Weight":
        """Quantise a float array (tests / synthetic checkpoints only)."""
        p, s = quantize_mxfp4(w, group_size=group_size)
        return cls(packed=jnp.asarray(p), scale=jnp.asarray(s), group_size=group_size)

    def __getitem__(self, idx) -> "MXFP4Weight":
        """Index leading (batch/expert) dims only, e.g. ``w[e]`` or ``w[a:b]``."""
        return MXFP4Weight(packed=self.packed[idx], scale=self.scale[idx], group_size=self.group_size)
