"""MLA kernels: absorbed paged decode (reference + Pallas)."""
from pallas_kernels.mla.ops import decode_work_follows_length, paged_mla_decode
from pallas_kernels.mla.reference import paged_mla_decode_reference

__all__ = ["decode_work_follows_length", "paged_mla_decode", "paged_mla_decode_reference"]
