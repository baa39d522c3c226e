"""Shared kernel-backend selection for every op in ``pallas_kernels``.

``backend`` values accepted by the public ops:

* ``"auto"``      -- Pallas on GPU/TPU, the plain-jnp reference elsewhere (CPU; an op with a faster
  jnp form for CPU runs that instead: ``moe.blocked.gmm_cpu``, ``kda.pool_cpu``).
* ``"reference"`` -- the plain-jnp reference implementation (runs anywhere).
* ``"pallas"``    -- the Pallas kernel (compiled; needs a GPU/TPU unless interpret).
* ``"interpret"`` -- the Pallas kernel in HLO interpret mode (runs on CPU; slow).

The environment variable ``K3JAX_KERNELS`` (``reference`` | ``pallas`` | ``interpret``)
overrides whatever the caller asked for, so a whole program can be switched without code
changes. It is read at trace time: set it before the first jit of a step function.
"""

from __future__ import annotations

import os

import jax

ENV_VAR = "K3JAX_KERNELS"
_VALID = ("auto", "reference", "pallas", "interpret")


def _env_override() -> str | None:
    val = os.environ.get(ENV_VAR, "").strip().lower()
    if not val:
        return None
    if val not in ("reference", "pallas", "interpret"):
        raise ValueError(f"{ENV_VAR}={val!r}: expected reference, pallas or interpret")
    return val


def resolve_backend(backend: str = "auto") -> str:
    """Return ``"reference"`` or ``"pallas"`` for a requested ``backend``.

    ``"interpret"`` (argument or env) resolves to ``"pallas"``; ask
    :func:`resolve_interpret` whether the kernel should run interpreted.
    """
    if backend not in _VALID:
        raise ValueError(f"backend={backend!r}: expected one of {_VALID}")
    env = _env_override()
    if env is not None:
        backend = env
    if backend == "auto":
        return "pallas" if jax.default_backend() in ("gpu", "tpu") else "reference"
    if backend == "interpret":
        return "pallas"
    return backend


def resolve_interpret(backend: str = "auto", interpret: bool = False) -> bool:
    """Whether a Pallas kernel should run in interpret mode.

    True when the caller passed ``interpret=True`` or ``backend="interpret"``, or when
    ``K3JAX_KERNELS=interpret`` is set. Also True when Pallas was explicitly requested on a
    platform without a Pallas lowering (CPU), so ``backend="pallas"`` never crashes on CPU.
    """
    env = _env_override()
    if env == "interpret" or backend == "interpret" or interpret:
        return True
    if resolve_backend(backend) == "pallas" and jax.default_backend() not in ("gpu", "tpu"):
        return True
    return False
