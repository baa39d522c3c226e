"""Simulated CPU devices for the benchmarks that need a mesh: call `use(n)` before JAX is imported (the
device count is fixed when JAX starts); an XLA_FLAGS that already sets a count is left as it is."""

import os


def use(count: int) -> None:
    flag = "--xla_force_host_platform_device_count"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={count}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
