"""MoE kernels: MXFP4 format, grouped matmul (reference + Pallas) and routing helpers."""
from pallas_kernels.moe.mxfp4 import (
    E2M1_MAGNITUDES,
    E2M1_VALUES,
    MXFP4Weight,
    dequantize_mxfp4,
    quantize_mxfp4,
)
from pallas_kernels.moe.ops import gmm, route_and_sort
from pallas_kernels.moe.blocked import gmm_blocked, gmm_cpu, gmm_looped
from pallas_kernels.moe.reference import gmm_reference

__all__ = [
    "E2M1_MAGNITUDES",
    "E2M1_VALUES",
    "MXFP4Weight",
    "dequantize_mxfp4",
    "quantize_mxfp4",
    "gmm",
    "gmm_blocked",
    "gmm_cpu",
    "gmm_looped",
    "gmm_reference",
    "route_and_sort",
]
