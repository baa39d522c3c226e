"""Kernels for k3jax: one folder per op (reference + Pallas kernel + ops dispatcher)."""

from pallas_kernels.dispatch import resolve_backend, resolve_interpret

__all__ = ["resolve_backend", "resolve_interpret"]
