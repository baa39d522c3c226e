"""KDA (Kimi Delta Attention) ops: jnp reference + Pallas kernels + dispatch.

Public API (flash-linear-attention names, layout [B, T, H, D], states [N, H, K, V] fp32):
``chunk_kda``, ``fused_recurrent_kda``, ``fused_recurrent_kda_pool``, ``naive_recurrent_kda``.
"""

from pallas_kernels.kda.ops import (
    chunk_kda,
    fused_recurrent_kda,
    fused_recurrent_kda_pool,
    naive_recurrent_kda,
)
from pallas_kernels.kda.reference import varlen_chunk_offsets

__all__ = [
    "chunk_kda",
    "fused_recurrent_kda",
    "fused_recurrent_kda_pool",
    "naive_recurrent_kda",
    "varlen_chunk_offsets",
]
