"""Public MLA ops: paged absorbed decode with backend dispatch."""
from __future__ import annotations

from typing import Optional

import jax

from pallas_kernels.dispatch import resolve_backend, resolve_interpret
from pallas_kernels.mla.fp8_latents import Fp8Latents
from pallas_kernels.mla.reference import paged_mla_decode_reference

__all__ = ["paged_mla_decode", "decode_work_follows_length", "Fp8Latents"]


def paged_mla_decode(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float,
    backend: str = "auto",
    interpret: bool = False,
    out_dtype=None,
    block_h: Optional[int] = None,
    return_lse: bool = False,
    kv_format=None,
):
    """Absorbed MLA decode over a paged latent cache -> ``ctx [B, H, L]`` (and, with ``return_lse``,
    the fp32 log-sum-exp of each row's scores ``[B, H]``).

    See :func:`pallas_kernels.mla.reference.paged_mla_decode_reference` for the exact
    semantics (fp32 softmax over the first ``seq_lens[b]`` tokens gathered through
    ``page_table``; zero rows for ``seq_lens == 0``; stale page-table entries ignored).
    ``backend``: ``"auto"`` | ``"reference"`` | ``"pallas"`` | ``"interpret"``.
    ``block_h``: query heads per kernel program (Pallas only). ``kv_format``: an
    :class:`~pallas_kernels.mla.fp8_latents.Fp8Latents` when ``kv_pages`` are fp8 latent words, which the
    kernels dequantise in the tile (the reference after its gather).
    """
    if resolve_backend(backend) == "reference":
        return paged_mla_decode_reference(
            q_latent, q_rope, kv_pages, page_table, seq_lens, scale=scale, out_dtype=out_dtype,
            return_lse=return_lse, kv_format=kv_format)
    from pallas_kernels.mla import kernel  # local import

    return kernel.paged_mla_decode_pallas(
        q_latent, q_rope, kv_pages, page_table, seq_lens, scale=scale, out_dtype=out_dtype,
        block_h=block_h, interpret=resolve_interpret(backend, interpret), return_lse=return_lse,
        kv_format=kv_format)


def decode_work_follows_length(backend: str = "auto", interpret: bool = False) -> bool:
    """Whether :func:`paged_mla_decode` under ``backend`` does work in proportion to each row's own
    length, not to the page table's width.

    True for the GPU (Triton) kernel: each program loops over its row's ``cdiv(seq_len, page_size)``
    pages, so a wider table costs only its int32 entries. False for the reference (it gathers every
    table entry) and for the TPU Mosaic / interpret form (its grid steps over every table entry,
    skipping the compute of those past the sequence but not the step). A caller that compiles one
    program per table width (the engine's context buckets) needs only the widest where this is True.
    """
    if resolve_backend(backend) == "reference":
        return False
    from pallas_kernels.mla import kernel  # local import, as in paged_mla_decode

    return kernel.auto_variant(resolve_interpret(backend, interpret)) == "triton"
