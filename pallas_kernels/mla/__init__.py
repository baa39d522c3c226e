"""MLA kernels: absorbed paged decode (reference + Pallas), over model-dtype or fp8 latent pages."""
from pallas_kernels.mla.fp8_latents import Fp8Latents
from pallas_kernels.mla.ops import decode_work_follows_length, paged_mla_decode
from pallas_kernels.mla.reference import paged_mla_decode_reference

__all__ = ["Fp8Latents", "decode_work_follows_length", "paged_mla_decode", "paged_mla_decode_reference"]
