import gc
import os
import shutil
import sys
import tempfile
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
    _cheaper_cpu_codegen()
    _share_compiled_programs(config)


# LLVM flags for the test run (see `_cheaper_cpu_codegen`).
_FAST_CODEGEN = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
# XLA:CPU's older loop emitters for fusions, where this XLA still has the flag (probed: an unknown flag aborts).
_OLD_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _cheaper_cpu_codegen():
    """Compile the tests' programs with LLVM's cheap pipeline.

    Most of the suite's time is XLA:CPU's backend compile of small programs that then run for
    milliseconds (131 s of a 169 s selection of engine tests); these two flags cut that compile time by
    ~40 % (91 -> 52 s over 125 programs) and the whole run from 1414 to 920 s. They change how LLVM
    optimises XLA's emitted loops, not what they compute (no fast-math, reductions keep XLA's order; the
    dots are library calls either way). Tests only: served models run long enough that the slower code
    costs more than the compile saves (k3-small decode steps 2-3x slower at optimisation level 0).
    On top of them, XLA:CPU's older (non-MLIR) fusion emitters compile the step programs ~20 % faster again
    (tiny-k3's two step programs: 12.4 -> 10.0 s); the same elementwise and reduction code either way.
    Set before the backend starts (this hook runs before any test module is imported) and inherited by
    the workers and by the subprocesses the tests start (which append their own flags).
    `K3JAX_TEST_FAST_CODEGEN=0` compiles as users do.
    """
    if os.environ.get("K3JAX_TEST_FAST_CODEGEN", "1") == "0":
        return
    flags = os.environ.get("XLA_FLAGS", "").split()
    extra = [f for f in _FAST_CODEGEN if f not in flags]
    if _OLD_EMITTERS not in flags and "PYTEST_XDIST_WORKER" not in os.environ and _xla_knows(_OLD_EMITTERS):
        extra.append(_OLD_EMITTERS)  # the controller decides; the workers inherit its XLA_FLAGS
    os.environ["XLA_FLAGS"] = " ".join(flags + extra)


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib's XLA accepts `flag` (XLA aborts the process on an unknown flag): one CPU backend
    started in a subprocess (~1 s)."""
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True,
                           timeout=120)
    return probe.returncode == 0


# Environment variable naming the run's shared compilation cache (set by the controlling process).
_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


def _share_compiled_programs(config):
    """One on-disk JAX compilation cache for the whole test run, shared by every process in it.

    Some programs are compiled again and again: the tiny models' steps built in file after file (each
    file's compiled code is dropped when it ends, see `_release_compiled_code`), in both xdist workers
    and in the subprocesses that the multi-device, multi-host, HTTP and notebook tests start (the run
    went 1607 -> 1414 s with the cache alone; most programs are unique to their file). JAX's persistent
    cache is keyed by the optimised program, its compile options and devices, so a hit runs exactly
    the executable a compile would have produced. The directory is made fresh for each run (the
    controlling process makes it, workers and subprocesses inherit the environment) and removed at
    its end. `K3JAX_TEST_COMPILE_CACHE=0` turns it off; an existing `JAX_COMPILATION_CACHE_DIR` is
    used as it is and kept.
    """
    if os.environ.get("K3JAX_TEST_COMPILE_CACHE", "1") == "0":
        return
    if _CACHE_ENV not in os.environ:
        path = tempfile.mkdtemp(prefix="k3jax-test-xla-cache-")
        os.environ[_CACHE_ENV] = path
        config._k3jax_owned_cache = path  # removed by this process at the end of the run
    # Programs that compile in under a quarter second are cheaper to compile than to store and load.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.25")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    # A size bound turns on the cache's file lock, so two processes never read a half-written entry.
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                      int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))
    jax.config.update("jax_compilation_cache_max_size", int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"]))


def pytest_unconfigure(config):
    path = getattr(config, "_k3jax_owned_cache", None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


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


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """The HF / PEFT references (torch CPU) on one intra-op thread in each worker: their models are tiny, so more
    threads only add overhead, and idle OpenMP workers spin against the other xdist worker and XLA's compiles
    (a 150-token forward of a tiny Kimi-Linear took 3.6 CPU s on two threads of a busy 2-core host, 0.15 s on
    one). Test files import torch at collection, before this runs."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    yield


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
