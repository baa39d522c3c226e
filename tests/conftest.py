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
    # `--dist loadfile` hands files to the workers in collection order unless xdist reorders them by
    # test count, which put the slow files with few tests (multi-process servers, the notebook) last,
    # leaving one worker alone for minutes at the end of a run: keep our order (`SLOW_FIRST`).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# Test files in order of their time on the 2-core CI host (longest first, as measured), so the short files
# fill the end of a parallel run; the others follow in their usual order.
SLOW_FIRST = ("test_engine.py", "test_sharding.py", "test_multihost.py", "test_engine_pallas.py",
              "test_parity_hf.py", "test_notebooks.py", "test_kda_state_dtype.py", "test_prefix_cache.py",
              "test_kernels_gpu_script.py", "test_model.py", "test_run_batch.py", "test_http.py",
              "test_weight_layout.py", "test_kv_cache_dtype.py", "test_speculative.py", "test_moe_gmm.py",
              "test_host_cache.py", "test_lora.py", "test_k3_chat.py", "test_sampling_engine.py",
              "test_beam_search.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


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
