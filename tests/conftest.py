import gc
import warnings

import jax
import pytest

# Mapped regions above which a test's teardown drops compiled code even mid-file (the kernel's
# default vm.max_map_count is 65530; the largest test file peaks near 38000 on its own).
MAP_VALVE = 50_000


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Under xdist, end the run when a worker crashes instead of replacing it.

    With `--dist loadfile`, pytest-xdist 3.8 can re-queue the dead worker's finished files as empty
    work units after replacing it and then wait forever with every worker idle (pytest-xdist #784,
    #1378): a crash would surface as a CI time-out, not as the failing test. Set
    `--max-worker-restart` explicitly to override.
    """
    if getattr(config.option, "maxworkerrestart", "absent") is None:
        config.option.maxworkerrestart = "0"


@pytest.fixture(scope="session")
def session_tmp_dir(tmp_path_factory):
    """One temporary directory shared by the whole test session (e.g. for generated checkpoints)."""
    return tmp_path_factory.mktemp("k3jax_session")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drop every compiled executable when a test file ends.

    XLA:CPU maps the machine code of each compiled executable into memory mappings of its own (code,
    read-only data, data). An xdist worker that runs many test files accumulates tens of thousands of
    them, and once a process reaches the kernel's `vm.max_map_count` (65530 by default) the next
    compile fails to map its code and XLA segfaults. Clearing JAX's caches after each file (its
    module-scoped fixtures are torn down by then) unmaps the code of everything no longer referenced.
    """
    yield
    jax.clear_caches()
    gc.collect()


def _mapped_regions() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True)
def _map_valve(request):
    """Safety valve inside a long test file: past `MAP_VALVE` mapped regions, clear JAX's caches after
    the test (a later test recompiles what it needs) rather than let the next compile crash."""
    yield
    if _mapped_regions() > MAP_VALVE:
        warnings.warn(f"{request.node.nodeid}: over {MAP_VALVE} memory mappings of compiled code; "
                      "clearing JAX's caches mid-file")
        jax.clear_caches()
        gc.collect()
