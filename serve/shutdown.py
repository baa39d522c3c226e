"""Stopping the HTTP server: drain or abort the requests in flight (vLLM's `--shutdown-timeout`).

On SIGTERM or SIGINT uvicorn stops accepting connections and asks every open one to close after its
current response. Before that, `DrainingServer` marks the server as shutting down (`/health` and new
requests on connections still open answer 503), then either aborts the requests in flight at once
(timeout 0, the default) or gives them up to `timeout_s` seconds to finish and aborts the rest. An
aborted request still gets a whole answer, ending with finish_reason "abort", and its cache memory back.
A second signal forces the exit (uvicorn's own handling). uvicorn raises the signal again once it has
shut down; `sigterm_unwinds` turns that SIGTERM into an exception, so the process unwinds (the engine
shut down) and exits 0 as after Ctrl-C, instead of dying by the signal; stopped while the engine still loads or
compiles, the process exits at once (`exit_during_warmup`). For a Kubernetes rolling update, set
`terminationGracePeriodSeconds` above the time the load balancer takes to stop routing plus the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator, Optional

import uvicorn

# seconds an aborted request has to send its last chunks before uvicorn cancels what is left
ABORT_GRACE_S = 5.0


def graceful_timeout(timeout_s: float) -> float:
    """uvicorn's `timeout_graceful_shutdown` for a drain of `timeout_s` seconds."""
    return float(timeout_s) + ABORT_GRACE_S


class DrainingServer(uvicorn.Server):
    """A uvicorn server that drains (or aborts) the API's requests in flight when it is told to stop.

    state: the app's `ServerState` (serve/api.py); timeout_s: seconds the requests in flight may take to finish
    (0: abort them at once); say: where to report what the shutdown does. The config's
    `timeout_graceful_shutdown` should be `graceful_timeout(timeout_s)`.
    """

    def __init__(self, config: uvicorn.Config, state, timeout_s: float = 0.0,
                 say: Optional[Callable[[str], None]] = None):
        super().__init__(config)
        self.state = state
        self.timeout_s = float(timeout_s)
        self.say = say or (lambda msg: None)
        self.drained_requests: Optional[int] = None  # set at shutdown: requests in flight then

    async def shutdown(self, sockets=None) -> None:
        n = self.state.start_shutdown()
        self.drained_requests = n
        if n and self.timeout_s > 0:
            self.say(f"shutting down: {n} requests in flight get up to {self.timeout_s:g}s to finish")
            asyncio.get_running_loop().call_later(self.timeout_s, self._abort_rest)
        elif n:
            self.say(f"shutting down: aborting {n} requests in flight (--shutdown-timeout 0)")
            self._abort_rest()
        await super().shutdown(sockets)

    def _abort_rest(self) -> None:
        left = self.state.abort_runs(None, None)  # every caller's
        if left and self.timeout_s > 0:
            self.say(f"shutdown timeout: aborted the {left} requests still running")


class Terminated(Exception):
    """SIGTERM arrived in the main thread (raised by `sigterm_unwinds`' handler)."""


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Within: SIGTERM raises `Terminated` in the main thread instead of ending the process (elsewhere: no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_during_warmup(warmup: threading.Thread, code: int, say: Callable[[str], None]) -> None:
    """The server stopped (SIGTERM, Ctrl-C) while `warmup` still loads or compiles the engine: end the process
    now with `code`, its output flushed (nothing is in flight to drain). An XLA compile cannot be interrupted, and
    the interpreter's exit would wait for its compile threads (then say "ready" for a server no longer listening)
    or abort (SIGABRT) tearing the daemon thread down inside XLA. Returns at once when the warm-up is over."""
    if not warmup.is_alive():
        return
    say("start-up interrupted: exiting without waiting for the engine to load and compile")
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
