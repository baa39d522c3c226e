"""Recording a profile of the running engine (vLLM's `LLM.start_profile` / `stop_profile` and the server's
`POST /start_profile`, `POST /stop_profile`): a `jax.profiler` trace of whatever runs between the two calls
-- each engine step appears as a `k3jax.step` annotation naming its bucket, with the XLA ops (device and host
threads) inside it. Open the run directory with TensorBoard's profile plugin or XProf, or the
`*.trace.json.gz` it also holds with https://ui.perfetto.dev.

The JAX profiler is process-wide: one trace covers every engine (data-parallel replicas, both phases of a
disaggregated pair) in this process; on a multi-host mesh only the calling process is traced.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Optional

import jax

ENV_DIR = "K3JAX_PROFILER_DIR"  # the default directory (vLLM reads VLLM_TORCH_PROFILER_DIR the same way)


class ProfilerError(RuntimeError):
    """A profile cannot start or stop (none configured, one already running, none running)."""


class Profiler:
    """One recording at a time into `log_dir` (else $K3JAX_PROFILER_DIR); each recording is a new run
    directory under it (`plugins/profile/<timestamp>/`)."""

    _lock = threading.Lock()
    _active: Optional["Profiler"] = None  # the process has one JAX profiler

    def __init__(self, log_dir: Optional[str] = None):
        self.log_dir = log_dir
        self.started: Optional[float] = None
        self._before: set[Path] = set()  # run directories that existed when the recording started

    def directory(self) -> str:
        d = self.log_dir or os.environ.get(ENV_DIR)
        if not d:
            raise ProfilerError(f"start_profile: no profile directory (give one, or set {ENV_DIR}; the server's "
                                f"--profiler-dir)")
        return d

    def start(self) -> str:
        """Start recording -> the directory the trace goes to."""
        d = self.directory()
        with Profiler._lock:
            if Profiler._active is not None:
                raise ProfilerError("start_profile: a profile is already being recorded (stop_profile first)")
            try:
                Path(d).mkdir(parents=True, exist_ok=True)
            except OSError as e:  # a file there, no permission: say so (it was a 500 "internal error")
                raise ProfilerError(f"start_profile: cannot create the profile directory {d} "
                                    f"({type(e).__name__}: {e.strerror or e})") from None
            self._before = set(_runs(d))
            try:
                jax.profiler.start_trace(d, create_perfetto_trace=True)
            except RuntimeError as e:  # a trace started outside this module (jax.profiler directly)
                raise ProfilerError(f"start_profile: {e}") from None
            Profiler._active, self.started = self, time.monotonic()
        return d

    def stop(self) -> dict:
        """Stop recording and write the trace -> {"dir": the run directory, "seconds": the recording's length}."""
        with Profiler._lock:
            if Profiler._active is not self:
                raise ProfilerError("stop_profile: no profile is being recorded" if Profiler._active is None else
                                    "stop_profile: the profile being recorded was started elsewhere")
            _wait_for_a_new_run_name(self.directory())
            try:
                jax.profiler.stop_trace()
            finally:
                Profiler._active = None
            new = sorted(set(_runs(self.directory())) - self._before)
            return {"dir": str(new[-1]) if new else self.directory(),
                    "seconds": round(time.monotonic() - self.started, 3)}

    @property
    def recording(self) -> bool:
        return Profiler._active is self


def _runs(d: str) -> list[Path]:
    root = Path(d) / "plugins" / "profile"
    return [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []


def _run_name() -> str:
    """The name the JAX profiler gives the run directory it writes now: its local time, to the second."""
    return time.strftime("%Y_%m_%d_%H_%M_%S")


def _wait_for_a_new_run_name(d: str, limit_s: float = 1.5) -> None:
    """Wait (under a second) until a trace written now gets a run directory of its own: two recordings
    stopped within one second went to the same directory, the second overwriting the first's files."""
    taken = {p.name for p in _runs(d)}
    deadline = time.monotonic() + limit_s
    while _run_name() in taken and time.monotonic() < deadline:
        time.sleep(0.02)


def step_annotation(rows: int, tokens: int, pages: int):
    """The trace's name for one compiled step call (free when no profile is recording)."""
    return jax.profiler.TraceAnnotation("k3jax.step", rows=rows, tokens=tokens, pages=pages)
