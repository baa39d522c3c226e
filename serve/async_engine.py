"""`AsyncEngine`: the engine stepped by one background thread, with an asyncio streaming API.

    async for out in engine.generate(prompt, params, request_id):   # RequestOutput per new token(s)
        ...
    engine.abort(request_id)   # frees the request's cache at once; its stream ends (finish_reason "abort")
    await engine.abort_all()   # the same for every request in flight (POST /pause)

All engine mutations happen on the engine thread; the event loop only enqueues commands and receives
outputs. A request that fails validation raises `RequestError` from `generate` before taking memory;
an unexpected error inside a step fails the requests that step ran (`StepFailed`; the others keep their
place and run next, recomputed if the failure consumed the cache) and the engine keeps serving; an error in
the engine's own bookkeeping, outside the compiled call, fails every request in flight. An engine that cannot
recover -- DEAD_AFTER_FAILURES failed steps in a row, or as many failed idle passes (a multi-process leader whose
followers are gone), with no success between -- is dead, as vLLM's after its engine core dies. `shutdown()` ends the
requests in flight (their streams raise `EngineDead`, their cache is freed); later requests raise it at once, as
they do once the engine is dead or if its thread ever dies (`errored`, `dead_error`, `check_health()`: vLLM's
`AsyncLLM` names). An AsyncEngine dropped without `shutdown()` is collected: its thread frees the requests it left
and ends (`_drive`).
Outputs a consumer has not read yet coalesce (`_Stream`), as vLLM's do.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import uuid
import weakref
from typing import AsyncIterator, Iterable, Optional, Union

from serve.engine import Engine, EngineSleeping, StepFailed
from serve.types import RequestError, RequestOutput, RequestOutputKind, SamplingParams, loggable

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # the engine thread's longest wait for a command when it has nothing to step
# failed steps (or failed idle / bookkeeping passes) in a row, with no success between, after which the engine is
# dead: one failure ends only the requests it ran (a bad request fails alone); this many say the engine cannot
# recover (a lost device, lost follower processes), where serving on would fail every request behind a /health 200
DEAD_AFTER_FAILURES = 3


class EngineDead(RuntimeError):
    """The async engine was shut down (vLLM's `EngineDeadError`): nothing steps its requests any more."""


def _settle(fut: asyncio.Future, result=None, err: Optional[BaseException] = None) -> None:
    if not fut.done():
        fut.set_exception(err) if err is not None else fut.set_result(result)


def request_ids(request_id: Union[str, Iterable[str]]) -> list[str]:
    """`abort`'s argument, one request id or an iterable of them (vLLM's) -> the ids. An id that cannot be one
    (unhashable) is refused here, in the caller: in the engine thread it would fail every request in flight."""
    if isinstance(request_id, (str, bytes)):
        return [request_id]
    try:
        ids = list(request_id)
    except TypeError:  # one id of another type (what `generate` was given)
        ids = [request_id]
    for rid in ids:
        try:
            hash(rid)
        except TypeError:
            raise TypeError(f"request_id: expected a request id or an iterable of them, got {request_id!r}") from None
    return ids


def _post(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """`fn(*args)` on a consumer's event loop -> False when that loop is closed (its consumer is gone)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:  # "Event loop is closed": never the engine thread's end
        return False


def merge_delta(whole: RequestOutput, new: RequestOutput, text: dict[int, list[str]]) -> None:
    """Fold the delta `new` into the unread delta `whole`, in place (the stream owns both, fresh from the
    engine): tokens and logprobs extended, text pieces gathered in `text` (completion index -> pieces, joined
    when read), finish, metrics and the finishing delta's arrays the newer's; a completion first seen in `new`
    is added in index order."""
    whole.finished, whole.metrics, whole.num_cached_tokens = new.finished, new.metrics, new.num_cached_tokens
    if whole.prompt_logprobs is None:
        whole.prompt_logprobs = new.prompt_logprobs
    for o in new.outputs:
        c = next((c for c in whole.outputs if c.index == o.index), None)
        if c is None:
            whole.outputs.append(o)
            whole.outputs.sort(key=lambda c: c.index)
            continue
        c.token_ids.extend(o.token_ids)
        if o.logprobs is not None:
            c.logprobs = c.logprobs if c.logprobs is not None else []
            c.logprobs.extend(o.logprobs)
        text.setdefault(o.index, []).append(o.text)
        c.finish_reason, c.stop_reason, c.cumulative_logprob = o.finish_reason, o.stop_reason, o.cumulative_logprob
        if o.routed_experts is not None:
            c.routed_experts = o.routed_experts
        if o.hidden_states is not None:
            c.hidden_states = o.hidden_states


class _Stream:
    """A request's outputs not yet read, on its consumer's event loop (vLLM's `RequestOutputCollector`).
    Unread outputs coalesce -- a newer cumulative output replaces the older one, deltas merge into one -- so a
    consumer slower than the engine reads fewer, larger outputs and the backlog stays one output (beside an
    error), never one per step (cumulative ones held every step's whole text: quadratic memory)."""

    def __init__(self, delta: bool):
        self.delta = delta
        self.items: collections.deque = collections.deque()
        self.text: dict[int, list[str]] = {}  # text merged into the last item, not joined yet
        self.ready = asyncio.Event()

    def put(self, item) -> None:
        last = self.items[-1] if self.items else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput) and not last.finished:
            if self.delta:
                merge_delta(last, item, self.text)
            else:
                self.items[-1] = item
        else:
            self._join()
            self.items.append(item)
        self.ready.set()

    async def get(self):
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        if len(self.items) == 1:
            self._join()
        return self.items.popleft()

    def _join(self) -> None:
        """The text pieces merged into the last item, joined into its completions' text."""
        if self.text:
            for c in self.items[-1].outputs:
                if c.index in self.text:
                    c.text += "".join(self.text[c.index])
            self.text = {}


class EngineGroupStatus:
    """vLLM's `AsyncLLM` status names for an engine made of several `AsyncEngine`s (data-parallel replicas, a
    disaggregated prefill / decode pair): it serves while every part does. `parts`: those AsyncEngines."""

    parts: tuple

    @property
    def is_running(self) -> bool:
        return all(a.is_running for a in self.parts)

    @property
    def errored(self) -> bool:
        return not self.is_running

    @property
    def dead_error(self) -> EngineDead:
        """The first stopped part's error (requests on it fail with it)."""
        return next((a.dead_error for a in self.parts if a.errored), EngineDead("the engine is not running"))

    async def check_health(self) -> None:
        """Raises `dead_error` unless every part serves requests."""
        if self.errored:
            raise self.dead_error

    async def get_tokenizer(self):
        return self.parts[0].engine.tokenizer


def running_driver(engine) -> Optional["AsyncEngine"]:
    """The AsyncEngine whose thread steps `engine` now (None: none, or its thread ended: shut down or died). One
    shut down while its thread was still in a step (`shutdown` waits 10 s for it) counts until that step returns:
    a second thread stepping the engine meanwhile corrupted it as well."""
    ref = getattr(engine, "_async_driver", None)
    driver = ref() if ref is not None else None
    return driver if driver is not None and driver.alive else None


def _drive(ref: "weakref.ref[AsyncEngine]", engine, wake: threading.Event) -> None:
    """The engine thread: `AsyncEngine._turn` after turn until `shutdown()`. Between turns it holds the AsyncEngine
    only weakly, so one dropped without `shutdown()` (a notebook cell run again) is collected, as vLLM's `AsyncLLM`
    shuts down in `__del__`: the thread then frees the requests left in the engine (no stream can read them: a
    stream keeps its AsyncEngine alive) and ends, releasing the engine and, with it, its device memory."""
    step_only = False
    while True:
        driver = ref()
        if driver is None or driver._stop:
            break
        try:
            wait, step_only = driver._turn(step_only)
        except BaseException as e:
            driver._died(e)
            return
        del driver  # (the last reference, if the AsyncEngine was dropped meanwhile: it goes here)
        if wait:  # nothing to step: wait for a command, at most IDLE_WAIT_S
            wake.wait(timeout=IDLE_WAIT_S)
            wake.clear()
    # dropped, or shut down (`shutdown()` frees them too once it joined this thread; a step it stopped waiting for
    # left them to this thread, and a later driver stepped them to completion for no one)
    try:
        for rid in list(engine.requests):
            engine.abort(rid)
        engine._reap()
    except Exception:
        log.exception("could not free the requests left in the engine by a dropped or shut down AsyncEngine")


class AsyncEngine:
    def __init__(self, engine: Engine):
        if running_driver(engine) is not None:
            # two engine threads stepping one engine corrupt it, and a stream's outputs went to the other's thread
            # (its consumer waited forever): a notebook cell building an AsyncEngine run twice did that
            raise RuntimeError("engine: another AsyncEngine's thread steps this engine; shut it down first "
                               "(serve.async_engine.running_driver(engine).shutdown(), if it is no longer at hand; "
                               "one shut down already is still in a step: wait for it) or keep using it")
        self.engine = engine
        self._commands: "queue.Queue[tuple]" = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _Stream]] = {}
        # (engine thread) request id -> the stream its engine request answers: a consumer that left and one reusing
        # its id (a retry) both map the id in `_streams`, only the second's request may reach the second's stream
        self._owners: dict[str, tuple[asyncio.AbstractEventLoop, _Stream]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._dead: Optional[str] = None  # why requests are refused (shut down, or the thread died)
        self.errors = 0
        self._failed_steps = 0  # (engine thread) failed steps since the last that ran (DEAD_AFTER_FAILURES)
        self._failed_passes = 0  # (engine thread) failed idle / bookkeeping passes since the last that did not fail
        # the thread holds this AsyncEngine weakly (`_drive`); its collection wakes the thread, which then ends
        ref = weakref.ref(self, lambda _, wake=self._wake: wake.set())
        self._thread = threading.Thread(target=_drive, args=(ref, engine, self._wake), name="k3jax-engine",
                                        daemon=True)
        self._thread.start()
        engine._async_driver = weakref.ref(self)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def capacity(self) -> int:
        """Sequences that run at once (max_num_seqs: the largest decode bucket, or fewer rows of it)."""
        return int(self.engine.sched_cfg.max_num_seqs)

    @property
    def alive(self) -> bool:
        """The engine thread runs (a step that raised fails its requests; the thread goes on)."""
        return self._thread.is_alive()

    # vLLM's `AsyncLLM` names
    @property
    def is_running(self) -> bool:
        """The engine serves requests: not shut down nor dead (DEAD_AFTER_FAILURES), and its thread did not die."""
        return not self._stop and self._thread.is_alive()

    @property
    def errored(self) -> bool:
        """Requests fail with `dead_error` (shut down, dead, or the engine thread died)."""
        return not self.is_running

    @property
    def dead_error(self) -> EngineDead:
        """The error requests fail with once the engine stopped serving."""
        return EngineDead(self._dead or "the engine is not running")

    async def check_health(self) -> None:
        """Raises `dead_error` unless the engine serves requests."""
        if self.errored:
            raise self.dead_error

    async def get_tokenizer(self):
        return self.engine.tokenizer

    # ---- public API (event-loop side) -------------------------------------------------------
    async def generate(self, prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None,
                       priority: int = 0, cache_salt: Optional[str] = None,
                       lora_request=None, on_accept=None) -> AsyncIterator[RequestOutput]:
        """`on_accept()`: called once the engine has queued the request (it passed validation)."""
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        q = _Stream(getattr(params, "output_kind", None) == RequestOutputKind.DELTA)
        done = loop.create_future()
        entry = (loop, q)
        with self._lock:  # (with `shutdown`'s flag: a request is refused, or its command is seen)
            if self._stop:
                raise self.dead_error
            if request_id in self._streams:  # (replacing its entry would end another stream: refused here)
                raise RequestError(f"request_id: {request_id!r} is already in use")
            self._streams[request_id] = entry
            self._commands.put(("add", request_id, prompt, params, done, priority, cache_salt, lora_request, entry))
        self._wake.set()
        finished = False
        try:
            try:
                await done  # raises RequestError if the request was rejected
            except RequestError:
                finished = True  # never queued: nothing of this stream's to abort (the id may be another's)
                raise
            if on_accept is not None:
                on_accept()
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                if self._streams.get(request_id) is entry:
                    del self._streams[request_id]
            if not finished:  # consumer went away early (client disconnect): free its cache now
                self.abort(request_id)

    def abort(self, request_id: Union[str, Iterable[str]]) -> None:
        """End the request(s) (one id or several, as vLLM's): their cache is freed at once, a stream still read
        ends with a last output (finish_reason "abort"); ids not in flight are ignored."""
        for rid in request_ids(request_id):
            self._commands.put(("abort", rid))
        self._wake.set()

    async def abort_all(self) -> int:
        """Abort every request in flight (each stream ends with its last output, finish_reason "abort"; the
        cache they held is free at once) -> how many were aborted. The HTTP server's `POST /pause`."""
        return await self.call(lambda engine: self._abort_all_now())

    def stats(self) -> dict:
        return self.engine.stats()

    async def call(self, fn):
        """Run `fn(engine)` on the engine thread, between steps -> its result (or its exception)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._lock:
            if self._stop:
                raise self.dead_error
            self._commands.put(("call", fn, loop, done))
        self._wake.set()
        return await done

    async def call_each(self, fn) -> list:
        """`fn(engine)` on each engine holding weights -> their results (one here; one per replica with data
        parallelism)."""
        return [await self.call(fn)]

    async def reset_prefix_cache(self) -> bool:
        """`Engine.reset_prefix_cache` on the engine thread."""
        return await self.call(lambda engine: engine.reset_prefix_cache())

    async def retract(self) -> int:
        """`Engine.retract` on the engine thread (SGLang's pause in retract mode) -> the requests retracted."""
        return await self.call(lambda engine: engine.retract())

    async def continue_generation(self) -> None:
        await self.call(lambda engine: engine.continue_generation())

    async def sleep(self, level: int = 1, tags=None) -> None:
        """`Engine.sleep` on the engine thread (vLLM's sleep mode; `tags`: the parts to release)."""
        await self.call(lambda engine: engine.sleep(level, tags))

    async def wake_up(self, tags=None) -> bool:
        """`Engine.wake_up` on the engine thread -> whether the engine is still sleeping."""
        return await self.call(lambda engine: (engine.wake_up(tags), engine.is_sleeping)[1])

    async def is_sleeping(self) -> bool:
        return await self.call(lambda engine: engine.is_sleeping)

    def shutdown(self) -> None:
        """Stop the engine thread; then release a multi-process engine's followers. The requests in flight end
        (their streams and the calls waiting raise `EngineDead`; their cache is freed)."""
        with self._lock:
            self._stop = True
            self._dead = self._dead or "the engine is shut down"
        self._wake.set()
        self._thread.join(timeout=10)
        if self._thread.is_alive():  # a step still running: the channel is that thread's (closed at exit)
            log.warning("engine thread still in a step after 10 s; followers are released at exit")
        else:  # the engine is this thread's now
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
            self.engine._reap()
            self.engine.close()
            self._owners.clear()
        self._end_waiting("the engine was shut down")

    def _end_waiting(self, why: str) -> None:
        """(shutdown) Fail what waits on the engine thread: requests and calls still queued, every open stream."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            fut = cmd[4] if cmd[0] == "add" else cmd[3] if cmd[0] == "call" else None
            if fut is not None:
                _post(fut.get_loop(), _settle, fut, None, EngineDead(why))
        with self._lock:
            entries = list(self._streams.values())
        for loop, q in entries:
            _post(loop, q.put, EngineDead(why))

    # ---- engine thread ------------------------------------------------------------------------
    def _died(self, e: BaseException) -> None:
        """(engine thread, an error while handling an error) Nothing steps the requests any more: end them and
        refuse new ones (EngineDead), never a hang."""
        log.exception("engine thread died")
        with self._lock:
            self._stop = True
            self._dead = self._dead or f"the engine thread died: {type(e).__name__}: {e}"
        self._end_waiting(self._dead)

    def _turn(self, step_only: bool) -> tuple[bool, bool]:
        """One turn of the engine thread: the commands, then a step -> (wait for a command before the next turn,
        the next turn only steps). It never waits itself: `_drive` does, holding this AsyncEngine only weakly."""
        try:
            if step_only:
                if not self.engine.has_unfinished():
                    return False, False
            else:
                self._drain_commands()
                if not self.engine.has_unfinished() or getattr(self.engine, "held", False):
                    self.engine.idle()
                    self._failed_passes = 0
                    # held (`retract`): then a step that runs nothing but hands out what aborts finished
                    return True, self.engine.has_unfinished()
        except Exception as e:  # an abort or an idle task failed: as a failed step's bookkeeping, never
            log.exception("engine bookkeeping failed")  # the thread's end (every stream would hang)
            self.errors += 1
            self._fail_all(e)
            self._failed_passes += 1
            if self._failed_passes >= DEAD_AFTER_FAILURES:
                self._give_up(f"{self._failed_passes} idle / bookkeeping passes failed in a row, the last with "
                              f"{type(e).__name__}: {e}")
            return not self._stop, False  # (one that fails on every pass, an idle task's, spun the thread)
        self._failed_passes = 0
        try:
            outs = self.engine.step()
        except StepFailed as e:  # never take the engine down: the step's requests end with the error
            self.errors += 1
            for out in e.outputs:  # what the step's other part produced
                self._deliver(out.request_id, out)
            log.warning("%s; ended %d request(s): %s", e.summary, len(e.request_ids),
                        ", ".join(map(loggable, e.request_ids)))  # (the ids for the log only: see StepFailed)
            for rid in e.request_ids:
                self._deliver(rid, RuntimeError(e.summary_of(rid)))  # (its own failure's, when it had one)
            self.engine._reap()
            self._step_failed(e, ran=bool(e.outputs) or e.own)
            return False, False
        except Exception as e:  # bookkeeping in an unknown state: fail everything in flight, keep serving
            log.exception("engine step failed")
            self.errors += 1
            self._fail_all(e)
            self._step_failed(e, ran=False)
            return False, False
        self._failed_steps = 0
        for out in outs:
            self._deliver(out.request_id, out)
        return False, False

    def _step_failed(self, err: Exception, ran: bool) -> None:
        """Count a failed step (`ran`: part of it produced outputs, or only its requests' own host-side work failed,
        `StepFailed.own`: a success); DEAD_AFTER_FAILURES failed in a row: the engine is dead (`_give_up`)."""
        self._failed_steps = 0 if ran else self._failed_steps + 1
        if self._failed_steps >= DEAD_AFTER_FAILURES:
            cause = getattr(err, "cause", err)  # (a StepFailed's: what the step raised)
            self._give_up(f"{self._failed_steps} steps failed in a row, the last with {type(cause).__name__}: {cause}")

    def _give_up(self, why: str) -> None:
        """(engine thread) The engine cannot recover: refuse requests from now on (`errored`; an HTTP server's /health
        answers 503 naming `why`), end those in flight and every open stream with `EngineDead(why)`; the thread
        ends at its next turn (`_drive` sees `_stop`; `shutdown()` still closes the engine)."""
        log.error("the engine is dead: %s", why)
        with self._lock:
            self._stop = True
            self._dead = self._dead or f"the engine is dead: {why}"
        try:
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
            self.engine._reap()
        except Exception:  # (it is failing already: the streams must end all the same)
            log.exception("freeing the requests of a dead engine failed")
        self._end_waiting(self._dead)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, prompt, params, done, priority, salt, lora, entry = cmd
                try:
                    self.engine.add_request(prompt, params, rid, priority=priority, cache_salt=salt, lora_request=lora)
                    err = None
                    self._owners[rid] = entry
                except (RequestError, EngineSleeping) as e:  # (asleep: the caller's to retry after wake_up)
                    err = e
                except Exception as e:  # unexpected validation failure: still the client's request only
                    err = RequestError(str(e))
                self._resolve(rid, done, err, entry)
            elif cmd[0] == "abort":
                req = self.engine.requests.get(cmd[1])
                if self.engine.abort(cmd[1]) and req is not None:
                    # a consumer still reading the stream gets its last output (finish_reason "abort")
                    self._deliver(cmd[1], self.engine._output(req))
                self.engine._reap()
            elif cmd[0] == "call":
                _, fn, loop, done = cmd
                try:
                    result, err = fn(self.engine), None
                except BaseException as e:  # (SystemExit too: the caller's error, never the thread's end)
                    result, err = None, e
                _post(loop, _settle, done, result, err)

    def _resolve(self, rid: str, fut: asyncio.Future, err: Optional[Exception], entry: tuple) -> None:
        with self._lock:
            live = self._streams.get(rid) is entry
        if not live:  # its consumer left before the engine queued it (the id may be another stream's by now)
            if err is None:
                self._owners.pop(rid, None)
                self.engine.abort(rid)
                self.engine._reap()
            return
        if not _post(entry[0], _settle, fut, None, err) and err is None:
            self._forget(rid, entry)

    def _deliver(self, rid: str, item) -> None:
        """`item` to the stream that request `rid` answers, while its consumer reads (never to a stream reusing
        the id of a request whose consumer left: a retry under the same id got that request's outputs)."""
        entry = self._owners.get(rid)
        if entry is None:
            return
        if isinstance(item, BaseException) or item.finished:
            del self._owners[rid]  # the request's last item
        with self._lock:
            live = self._streams.get(rid) is entry
        if live and not _post(entry[0], entry[1].put, item):
            self._forget(rid, entry)

    def _forget(self, rid: str, entry: tuple) -> None:
        """A stream whose event loop closed unread (nobody can read or close it): abort its request, free its cache."""
        with self._lock:
            if self._streams.get(rid) is entry:
                del self._streams[rid]
        if self._owners.get(rid) is entry:
            del self._owners[rid]
        self.engine.abort(rid)
        self.engine._reap()

    def _abort_all_now(self) -> int:
        aborted = 0
        for rid, req in list(self.engine.requests.items()):
            if self.engine.abort(rid):
                self._deliver(rid, self.engine._output(req))
                aborted += 1
        self.engine._reap()
        return aborted

    def _fail_all(self, err: Exception) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
            self._deliver(rid, RuntimeError(f"engine step failed: {err}"))
        self.engine._reap()
