"""Disaggregated prefill behind one server: a prefill engine and a decode engine on disjoint devices.

Prefill and decode want different things from a device: a prefill chunk is a large matmul-bound
step, a decode step a small bandwidth-bound one, and in one engine every step that prefills delays
every running request's next token. Here each runs on its own devices (`EngineConfig.devices`) with
its own step loop, and they meet in a shared host store (`kv_transfer_config`, serve/host_cache.py):

1. the prefill engine (`kv_producer`) runs the prompt with `max_tokens=1`; when it finishes it has
   published the prompt's MLA pages below its deepest KDA checkpoint and that checkpoint;
2. the decode engine (`kv_consumer`) then runs the request itself: it resumes the prompt from the
   store like a host-tier hit (recomputing only the tail past the checkpoint, within one alignment of
   the prompt end), samples every output token and streams them.

The outputs are the decode engine's, so they are what one engine without a store gives (the resume is
bit-identical to a cold prefill: tests/test_sharding.py, benchmarks/disaggregated.py). This is
vLLM's disaggregated-prefill flow (a proxy sends the request to the prefill instance with max_tokens=1,
then to the decode instance) inside one process, over host memory rather than a network connector.
Requests that must compute their whole prompt on the decode engine anyway skip the prefill engine:
those asking for `prompt_logprobs`, and those of a LoRA adapter (an adapter's cached prefixes are keyed
by its load on one engine).
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import AsyncIterator, Optional

from serve.async_engine import AsyncEngine, EngineGroupStatus, request_ids
from serve.beam_search import BeamSearchParams
from serve.engine import Engine, EngineConfig
from serve.host_cache import HostCache
from serve.types import RequestError, RequestOutput, RequestOutputKind, SamplingParams


def build_pair(model, config: EngineConfig, prefill_devices: tuple[int, ...], decode_devices: tuple[int, ...],
               store_bytes: int, warmup: bool = True) -> tuple[Engine, Engine]:
    """A prefill (producer) and a decode (consumer) engine of `config` on their devices, sharing a host
    store of `store_bytes` -> (prefill engine, decode engine)."""
    if set(prefill_devices) & set(decode_devices):
        raise ValueError(f"prefill devices {list(prefill_devices)} and decode devices {list(decode_devices)} overlap")
    if config.host_cache_bytes:
        raise ValueError("disaggregated prefill: the shared store is the host tier of both engines; leave "
                         "host_cache_bytes at 0 and size the store instead")
    store = HostCache(store_bytes)
    engines = []
    for role, devices in (("kv_producer", prefill_devices), ("kv_consumer", decode_devices)):
        cfg = dataclasses.replace(config, devices=tuple(devices),
                                  kv_transfer_config={"kv_role": role, "store": store})
        engines.append(Engine(model, cfg, warmup=warmup, progress=False))
    return engines[0], engines[1]


def _prefill_params(params) -> Optional[SamplingParams]:
    """What the prefill engine runs: the prompt as the decode engine will see it, one token; None when
    the decode engine computes the whole prompt anyway."""
    if isinstance(params, BeamSearchParams):
        return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    params = params or SamplingParams()
    if params.prompt_logprobs is not None:
        return None
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                          truncate_prompt_tokens=params.truncate_prompt_tokens,
                          output_kind=RequestOutputKind.FINAL_ONLY)  # only its end is read


class DisaggregatedAsyncEngine(EngineGroupStatus):
    """`AsyncEngine`'s API over a prefill engine and a decode engine, each stepped by its own thread, so
    the HTTP server (serve/api.py) serves the pair as one engine."""

    def __init__(self, prefill: Engine, decode: Engine):
        self.prefill, self.decode = AsyncEngine(prefill), AsyncEngine(decode)
        self.engine = decode  # configuration, tokenizer, adapter registry: the engine that answers
        self._phase: dict[str, AsyncEngine] = {}  # request id -> the engine running it now
        self._aborted: set[str] = set()  # ids aborted while in flight (checked between the phases)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def capacity(self) -> int:
        return self.decode.capacity

    @property
    def alive(self) -> bool:
        return self.prefill.alive and self.decode.alive

    @property
    def parts(self) -> tuple:
        return self.prefill, self.decode

    async def generate(self, prompt, params=None, request_id: Optional[str] = None, priority: int = 0,
                       cache_salt: Optional[str] = None, lora_request=None, on_accept=None) -> AsyncIterator[RequestOutput]:
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self._phase:  # (its phase entry is the first request's: abort goes by it)
            raise RequestError(f"request_id: {request_id!r} is already in use")
        # an adapter's prefixes are hashed with its load on one engine, so the other could not find them
        pre = _prefill_params(params) if lora_request is None else None
        try:
            if pre is not None:
                self._phase[request_id] = self.prefill
                stream = self.prefill.generate(prompt, pre, request_id, priority, cache_salt, lora_request,
                                               on_accept=on_accept)
                on_accept = None  # (accepted once)
                last = None
                try:
                    async for last in stream:
                        pass
                finally:
                    await stream.aclose()
                if last is not None and last.outputs[0].finish_reason == "abort" or request_id in self._aborted:
                    if last is not None:  # aborted while prefilling: the stream ends there
                        last.outputs[0].token_ids, last.outputs[0].text = [], ""
                        last.outputs[0].finish_reason = "abort"
                        yield last
                    return
            self._phase[request_id] = self.decode
            stream = self.decode.generate(prompt, params, request_id, priority, cache_salt, lora_request,
                                          on_accept=on_accept)
            try:
                async for out in stream:
                    yield out
            finally:
                await stream.aclose()
        finally:
            self._phase.pop(request_id, None)
            self._aborted.discard(request_id)

    def abort(self, request_id) -> None:
        """`AsyncEngine.abort` (one id or several), each in the phase running it."""
        for rid in request_ids(request_id):
            engine = self._phase.get(rid)
            if engine is not None:
                self._aborted.add(rid)  # also stops a request between its two phases
                engine.abort(rid)

    def stats(self) -> dict:
        """The decode engine's statistics (the requests' outputs), with the prefill engine's beside them."""
        out = dict(self.decode.stats())
        pre = self.prefill.stats()
        out["prefill_engine"] = {k: pre[k] for k in ("num_requests_running", "num_requests_waiting", "kv_cache_usage",
                                                    "prompt_tokens", "kv_transfer_published", "compiles_after_warmup",
                                                    "requests_aborted", "mesh") if k in pre}
        return out

    def replica_stats(self) -> dict:
        """Each engine's own `stats()` by its /metrics `engine` label: the decode engine's under "0" (the requests'
        outputs: one engine's series keep their labels), the prefill engine's under "prefill" (vLLM labels each
        engine's series; its P/D instances each serve their own /metrics)."""
        return {"0": self.decode.stats(), "prefill": self.prefill.stats()}

    async def call(self, fn):
        results = await asyncio.gather(self.prefill.call(fn), self.decode.call(fn), return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException):
                raise res
        return results[1]

    async def call_each(self, fn) -> list:
        """`fn(engine)` on both engines -> the decode engine's result alone (both serve the same weights)."""
        return [await self.call(fn)]

    async def abort_all(self) -> int:
        """Both phases' requests, and those between them: a request whose prefill has finished but whose stream
        has not moved to the decode engine yet (the prefill engine has nothing of it to abort) ends there, as
        `abort` ends it (uncounted: no engine held it)."""
        self._aborted.update(rid for rid, engine in self._phase.items() if engine is self.prefill)
        return sum(await asyncio.gather(self.prefill.abort_all(), self.decode.abort_all()))

    async def reset_prefix_cache(self) -> bool:
        return all(await asyncio.gather(self.prefill.reset_prefix_cache(), self.decode.reset_prefix_cache()))

    async def sleep(self, level: int = 1, tags=None) -> None:
        await asyncio.gather(self.prefill.sleep(level, tags), self.decode.sleep(level, tags))

    async def wake_up(self, tags=None) -> bool:
        return any(await asyncio.gather(self.prefill.wake_up(tags), self.decode.wake_up(tags)))

    async def is_sleeping(self) -> bool:
        return any(await asyncio.gather(self.prefill.is_sleeping(), self.decode.is_sleeping()))

    def shutdown(self) -> None:
        self.prefill.shutdown()
        self.decode.shutdown()
