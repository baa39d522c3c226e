"""Step-program buckets: the (rows, tokens per row, pages per layer) shapes an engine compiles at start-up.

Pure functions of the engine's options. `Engine` builds its buckets with them; `k3jax info` counts the
programs a configuration compiles before it serves, which on a deep model is the start-up cost (every
layer is unrolled in every program: benchmarks/README.md, "Engine start-up").
"""

from __future__ import annotations

from typing import Optional, Sequence


def geometric(top: int, base: int = 4) -> tuple[int, ...]:
    """1, base, base^2, ... below `top`, then `top`."""
    out, x = [], 1
    while x < top:
        out.append(x)
        x *= base
    return tuple(out) + (top,)


def default_buckets(max_num_seqs: int, max_prefill_seqs: int, max_model_len: int, page_size: int,
                    decode: Optional[Sequence[int]] = None, prefill: Optional[Sequence[int]] = None,
                    context: Optional[Sequence[int]] = None) -> tuple[tuple[int, ...], ...]:
    """-> (decode rows, prefill rows, context pages): the given ones sorted, else the defaults (decode rows
    and context pages in powers of 4 up to their maxima, prefill rows 1 and `max_prefill_seqs`)."""
    pages = -(-max_model_len // page_size)
    decode = tuple(sorted(decode or geometric(max_num_seqs)))
    prefill = tuple(sorted(prefill or {1, max_prefill_seqs}))
    context = tuple(sorted(context or geometric(pages)))
    if context[-1] < pages:
        raise ValueError(f"context_buckets must reach {pages} pages (max_model_len / page_size)")
    return decode, prefill, context


def program_shapes(decode: Sequence[int], prefill: Sequence[int], context: Sequence[int],
                   decode_context: Sequence[int], prefill_chunk: int, verify_tokens: int = 0,
                   long_chunk: int = 0) -> list[tuple[int, int, int]]:
    """Every (rows, tokens per row, pages per layer) program: one-token decodes at `decode_context` widths,
    verify rows (speculative decoding, `verify_tokens` > 0) and prefill chunks at every context width, and
    the one-row long prefill (`long_chunk` > 0; it replaces the one-row prefill chunk)."""
    shapes = [(b, 1, p) for b in decode for p in decode_context]
    if verify_tokens:
        shapes += [(b, verify_tokens, p) for b in decode for p in context]
    shapes += [(b, prefill_chunk, p) for b in prefill if not (long_chunk and b == 1) for p in context]
    if long_chunk:
        shapes += [(1, long_chunk, p) for p in context]
    return shapes
