"""Data parallelism: several engine replicas on disjoint device groups of one host, behind one router.

vLLM's `--data-parallel-size`, SGLang's `--dp-size`: each replica is a whole `Engine` (its own copy of
the weights, cache arena, compiled programs and prefix cache) on its own devices, e.g. 8 devices as
4 replicas of a 2-way tensor mesh. Replicas share nothing, so none waits on another's collectives; a
request runs from admission to its last token on one replica. What makes a replica the right one is its
prefix cache: a hybrid model's KDA state cannot be rebuilt from another replica's pages, so a
conversation that goes back to the replica that served its earlier turns resumes from a checkpoint,
and one that lands elsewhere recomputes its whole history.

`PrefixRouter` picks the replica the way SGLang's cache-aware router does: per replica it remembers the
chained hashes of the prompt blocks it sent there (bounded, least recently used first out: an estimate
of that replica's cache), and a request goes where its longest leading run of blocks was sent, unless
that replica is busier than the least loaded one by more than `balance_abs` sequences (a quarter of a
replica's `max_num_seqs`) and `balance_rel` times; with no block matched it goes to the least loaded
(sequences in flight). `routing="load"` always takes the least loaded (vLLM's data-parallel balancing),
for comparison (benchmarks/data_parallel.py).

`DataParallelEngine` drives the replicas for `LLM` (offline batches: each step runs every replica with
work in its own thread, so the devices compute at once); `DataParallelAsyncEngine` gives the HTTP server
one `AsyncEngine` per replica, each stepping on its own thread at its own pace.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import itertools
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, Optional, Sequence

import jax

from serve.async_engine import AsyncEngine, EngineGroupStatus, request_ids
from serve.beam_search import BeamSearchParams
from serve.engine import Engine, EngineConfig, StepFailed, kv_cache_usage
from serve.types import RequestError, RequestOutput, SamplingParams


def replica_devices(size: int, config: EngineConfig) -> list[tuple[int, ...]]:
    """The device indices (into `jax.devices()`) of each of `size` replicas: `config.devices` (default: all)
    split into equal consecutive groups; one device each without a sharding config."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"data_parallel_size={size!r}: expected an integer >= 1")
    if config.enable_expert_parallel and size > 1:
        raise ValueError(f"enable_expert_parallel with data_parallel_size={size}: replicas share nothing, so each "
                         f"would hold every expert its own mesh does not split (vLLM's expert parallelism spans TP x "
                         f"DP devices); run one engine whose mesh splits the experts over the devices instead "
                         f"(sharding 'ep' or 'tp_ep')")
    pool = list(config.devices) if config.devices is not None else list(range(len(jax.devices())))
    if len(set(pool)) != len(pool):
        raise ValueError(f"devices={config.devices!r}: an index appears twice")
    tp = config.tensor_parallel_size
    if tp is not None and (config.sharding is not None or tp > 1):  # vLLM's -dp M -tp N: M groups of N devices
        if size * tp > len(pool):
            raise ValueError(f"data_parallel_size={size} x tensor_parallel_size={tp}: {size * tp} devices wanted, "
                             f"{len(pool)} available")
        return [tuple(pool[i * tp:(i + 1) * tp]) for i in range(size)]
    if config.sharding is None:
        if size > len(pool):
            raise ValueError(f"data_parallel_size={size}: {len(pool)} devices hold at most {len(pool)} one-device "
                             f"replicas (set sharding to split each replica over several)")
        return [(d,) for d in pool[:size]]
    if len(pool) % size:
        raise ValueError(f"data_parallel_size={size}: the {len(pool)} devices do not split into {size} equal groups")
    group = len(pool) // size
    return [tuple(pool[i * group:(i + 1) * group]) for i in range(size)]


def load_options(config: EngineConfig, data_parallel_size: int = 1, devices=None) -> dict:
    """`k3jax.load_model` options that read the weights straight into the placement of the first engine built
    from `config`: one engine's mesh, the first of `data_parallel_size` replicas' device groups, or `devices`
    (a disaggregated pair's prefill devices). No device then holds more than its share: the other engines
    copy theirs from that first one, device to device. `{}` for one engine on the default device."""
    if devices is None and data_parallel_size > 1:
        devices = replica_devices(data_parallel_size, config)[0]
    (config if devices is None else dataclasses.replace(config, devices=tuple(devices))).check_mesh()
    if devices is None:
        devices = config.mesh_devices()
        if devices is None and not config.sharding:
            return {}
    return dict(sharding=config.sharding, devices=None if devices is None else tuple(devices))


class PrefixRouter:
    """Which replica gets a request: cache-aware, load-balanced (see the module docstring). `route` counts
    the request's sequences as that replica's load until `done` returns them."""

    POLICIES = ("cache_aware", "load")

    def __init__(self, replicas: int, block: int, max_blocks: int = 1 << 16, balance_abs: int = 8,
                 balance_rel: float = 1.5, policy: str = "cache_aware"):
        if policy not in self.POLICIES:
            raise ValueError(f"data_parallel_routing={policy!r}: expected one of {', '.join(self.POLICIES)}")
        self.policy = policy  # "load": the least loaded replica always (vLLM's data-parallel balancing)
        self.block, self.max_blocks = block, max_blocks
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.load = [0] * replicas  # sequences in flight per replica
        self._sent: list[collections.OrderedDict[bytes, None]] = [collections.OrderedDict() for _ in range(replicas)]
        self._epochs: list = [None] * replicas  # each replica's cache epoch when `_sent` was last valid
        self.counters = {"routed_by_prefix": 0, "routed_by_load": 0, "routed_blocks_matched": 0}

    def hashes(self, ids: Sequence[int], salt: bytes = b"") -> list[bytes]:
        """Chained hashes of the prompt's full blocks: block i's names the whole prefix up to its end."""
        out, h = [], hashlib.blake2b(salt, digest_size=16).digest()
        for i in range(len(ids) // self.block):
            chunk = ",".join(map(str, ids[i * self.block:(i + 1) * self.block])).encode()
            h = hashlib.blake2b(h + chunk, digest_size=16).digest()
            out.append(h)
        return out

    def route(self, ids: Sequence[int], salt: bytes = b"", seqs: int = 1) -> int:
        hashes = self.hashes(ids, salt) if self.policy == "cache_aware" else []
        least = min(range(len(self.load)), key=lambda r: (self.load[r], r))
        best, depth = least, 0
        for r, sent in enumerate(self._sent):
            d = next((i for i, h in enumerate(hashes) if h not in sent), len(hashes))
            if d > depth or (d == depth and d and self.load[r] < self.load[best]):
                best, depth = r, d
        busy = (self.load[best] - self.load[least] > self.balance_abs
                and self.load[best] > self.balance_rel * self.load[least])
        if depth == 0 or busy:
            best = least
            self.counters["routed_by_load"] += 1
        else:
            self.counters["routed_by_prefix"] += 1
            self.counters["routed_blocks_matched"] += depth
        sent = self._sent[best]
        for h in hashes:
            sent[h] = None
            sent.move_to_end(h)
        while len(sent) > self.max_blocks:
            sent.popitem(last=False)
        self.load[best] += seqs
        return best

    def done(self, replica: int, seqs: int = 1) -> None:
        self.load[replica] -= seqs

    def forget(self) -> None:
        """The replicas' prefix caches were cleared (reset, new weights, sleep): nothing is cached anywhere."""
        for sent in self._sent:
            sent.clear()

    def sync(self, epochs: Sequence) -> None:
        """Forget what was sent to each replica whose cache epoch (`cache_epoch`) moved since the last call: its
        prefix cache was cleared by whatever path (a weight update over HTTP, an arena reset after a failure)."""
        for r, epoch in enumerate(epochs):
            if epoch != self._epochs[r]:
                self._sent[r].clear()
                self._epochs[r] = epoch


def router_for(engines: list[Engine], routing: str) -> PrefixRouter:
    """The router over these replicas: blocks of the KDA checkpoint alignment (a shorter match resumes
    nothing), a replica too busy once it runs a quarter of its rows more than the least loaded one."""
    rows = engines[0].sched_cfg.max_num_seqs
    return PrefixRouter(len(engines), engines[0].align, balance_abs=max(2, rows // 4), policy=routing)


def cache_epoch(engine: Engine) -> int:
    """How many times the engine's prefix cache was cleared (0 without one)."""
    cache = getattr(engine, "prefix_cache", None)
    return cache.clears if cache is not None else 0


def _salt(cache_salt: Optional[str], lora_request) -> bytes:
    """Requests share cached prefixes only with the same salt and adapter (as the engine hashes them; a lone
    surrogate, JSON's "\\ud800", encoded as such: it raised UnicodeEncodeError)."""
    name = getattr(lora_request, "lora_name", lora_request)
    return (cache_salt or "").encode("utf-8", "surrogatepass") + (
        b"\0lora:" + str(name).encode("utf-8", "surrogatepass") if name is not None else b"")


def _num_seqs(params) -> int:
    if isinstance(params, BeamSearchParams):
        return params.beam_width
    return params.n if isinstance(params, SamplingParams) else 1


def _prompt_ids(engine: Engine, prompt) -> list[int]:
    """The prompt's token ids for routing; [] when it cannot be read (the replica then names the fault) or is
    given as embeddings (placeholder ids: routed by load alone)."""
    if isinstance(prompt, dict) and "prompt_embeds" in prompt:
        return []
    try:
        return list(engine._prompt(prompt)[1])
    except Exception:
        return []


def _route(router: PrefixRouter, engines: list[Engine], prompt, cache_salt: Optional[str], lora_request,
           seqs: int) -> int:
    """The replica a new request of `seqs` sequences goes to (the router first learns which replicas' prefix
    caches were cleared since it last looked)."""
    router.sync([cache_epoch(e) for e in engines])
    return router.route(_prompt_ids(engines[0], prompt), _salt(cache_salt, lora_request), seqs)


# ---- stats --------------------------------------------------------------------------------------

# the same on every replica (configuration, or the replica's own mesh): reported once, not summed
_SAME = frozenset({"arena_state_ranks", "kv_bytes_per_token_per_layer", "kda_slot_bytes", "max_loras", "processes",
                   "block_size", "unit_bytes", "kda_slot_units", "gpu_memory_utilization",
                   "sleep_level", "moe_layers", "lora_adapters", "lora_adapters_in_slots", "mesh", "decode_forms",
                   "moe_step_seconds", "spec_decode_cost_ratio", "sharding", "kv_cache_dtype", "kda_state_dtype",
                   "expert_format", "dense_weight_layout", "arena_context_ranks",
                   "ranks", "window_size", "step_interval", "num_redundant_experts",
                   "physical_experts",  # these five: `eplb`'s configuration
                   "utilization"})  # `memory_plan`'s gpu_memory_utilization
_MEAN = frozenset({"new_token_ratio", "imbalance_before", "imbalance_after"})


def _step_or_failure(engine: Engine):
    """engine.step()'s outputs, or the `StepFailed` it raised (so one replica's failure loses no other's)."""
    try:
        return engine.step()
    except StepFailed as e:
        return e


def _merge(key: str, values: list):
    first = values[0]
    if key in _SAME or first is None or isinstance(first, (bool, str)):
        return first
    if isinstance(first, (int, float)):
        total = sum(values)
        return total / len(values) if key in _MEAN else total
    if isinstance(first, dict):
        keys = list(dict.fromkeys(k for v in values for k in v))
        return {k: _merge(k, [v[k] for v in values if k in v]) for k in keys}
    if isinstance(first, list) and all(isinstance(v, list) and len(v) == len(first) for v in values):
        return [_merge(key, list(col)) for col in zip(*values)]
    return first


def merge_stats(stats: list[dict], devices: list[tuple[int, ...]], router: PrefixRouter) -> dict:
    """One engine's `stats()` shape over all replicas: counters and memory summed, configuration once,
    usage ratios recomputed from the sums; plus `data_parallel_size` and each replica's own gauges."""
    out = _merge("", stats)
    out["kv_cache_usage"] = kv_cache_usage(out["arena_free_units"], out.get("arena_cached_units", 0),
                                           out["arena_baseline_free_units"])
    pc = out.get("prefix_cache") or {}
    if "hit_rate" in pc:
        pc["hit_rate"] = pc["hit_tokens"] / pc["query_tokens"] if pc["query_tokens"] else 0.0
    out["data_parallel_size"] = len(stats)
    out["data_parallel_router"] = dict(router.counters)
    out["replicas"] = [{"devices": list(d), "load": router.load[i],
                        **{k: s[k] for k in ("num_requests_running", "num_requests_waiting", "kv_cache_usage",
                                             "generation_tokens", "compiles_after_warmup") if k in s}}
                       for i, (s, d) in enumerate(zip(stats, devices))]
    return out


# ---- replicas, and driving them for LLM ----------------------------------------------------------

def _first_replica(name: str) -> property:
    """A read-only attribute of a replica group that is its first replica's `name` (one that every replica
    holds alike)."""
    return property(lambda self: getattr(self.replicas[0], name), doc=f"The first replica's `{name}`.")


def build_replicas(model, config: EngineConfig, size: int, progress: bool = True,
                   warmup: bool = True) -> tuple[list[Engine], list[tuple[int, ...]]]:
    """`size` engines of `config`, each on its own device group -> (engines, their device indices)."""
    if jax.process_count() > 1:
        raise ValueError("data_parallel_size: replicas live in one process; a multi-process mesh runs one engine")
    dataclasses.replace(config, devices=None, tensor_parallel_size=None).validate()
    groups = replica_devices(size, config)
    for g in groups:  # each replica's devices exist and fit the mesh
        dataclasses.replace(config, devices=g).validate()
        dataclasses.replace(config, devices=g).check_mesh()
    # built side by side: XLA compiles each replica's programs (its own devices) with the GIL released. Each
    # replica draws its unseeded requests' seeds from a stream of its own (config.seed + its index): with one
    # seed, the k-th unseeded request of every replica sampled the same tokens (duplicated rollouts)
    def build(k: int) -> Engine:
        seed = None if config.seed is None else config.seed + k
        return Engine(model, dataclasses.replace(config, devices=groups[k], seed=seed), warmup=warmup,
                      progress=progress and k == 0)

    with ThreadPoolExecutor(size, thread_name_prefix="k3jax-dp-build") as pool:
        engines = list(pool.map(build, range(size)))
    return engines, groups


class DataParallelEngine:
    """`size` replicas stepped together for `LLM`: `add_request` routes, `step` runs one step of every
    replica with work (each in its own thread) and returns all their outputs. The engine methods `LLM`
    uses that change state (adapters, weights, sleep, prefix-cache reset) apply to every replica."""

    def __init__(self, engines: list[Engine], devices: list[tuple[int, ...]], routing: str = "cache_aware"):
        self.replicas, self.devices = list(engines), list(devices)
        self.router = router_for(engines, routing)
        self._where: dict[str, tuple[int, int]] = {}  # request id -> (replica, sequences)
        self._ids = itertools.count()
        self._pool = ThreadPoolExecutor(len(engines), thread_name_prefix="k3jax-dp")

    @classmethod
    def build(cls, model, config: EngineConfig, size: int, progress: bool = True,
              routing: str = "cache_aware") -> "DataParallelEngine":
        """`size` replicas of `config` (see `build_replicas`), compiled and warm."""
        PrefixRouter(1, 1, policy=routing)  # a bad policy fails before anything compiles
        return cls(*build_replicas(model, config, size, progress), routing=routing)

    # what LLM reads of an engine: the first replica's (they share model, configuration and sleep level)
    tokenizer = _first_replica("tokenizer")
    cfg = _first_replica("cfg")
    generation_defaults = _first_replica("generation_defaults")
    config = _first_replica("config")
    model = _first_replica("model")
    sleep_level = _first_replica("sleep_level")

    def add_request(self, prompt, params=None, request_id: Optional[str] = None, priority: int = 0,
                    cache_salt: Optional[str] = None, lora_request=None) -> str:
        request_id = request_id or f"dp-{next(self._ids)}"
        if request_id in self._where:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        params = params or SamplingParams()
        seqs = _num_seqs(params)
        r = _route(self.router, self.replicas, prompt, cache_salt, lora_request, seqs)
        self._where[request_id] = (r, seqs)  # (before the replica queues it: a Ctrl-C in between, abort finds it)
        try:
            self.replicas[r].add_request(prompt, params, request_id, priority=priority, cache_salt=cache_salt,
                                         lora_request=lora_request)
        except BaseException as e:
            if self._where.pop(request_id, None) is not None:
                self.router.done(r, seqs)
            if not isinstance(e, Exception):  # a Ctrl-C inside it: what the replica queued goes too
                self.replicas[r].abort(request_id)
            raise
        return request_id

    def abort(self, request_id: str) -> bool:
        where = self._where.pop(request_id, None)
        if where is None:
            return False
        self.router.done(*where)
        return self.replicas[where[0]].abort(request_id)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.replicas)

    def _reap(self) -> None:
        """Forget the requests that ended (`LLM.generate` withdraws its requests after a failed step)."""
        self._all(lambda e: e._reap())

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work. A replica's `StepFailed` does not lose the others' outputs:
        they travel in the re-raised `StepFailed` (with every failed replica's ended requests)."""
        busy = [e for e in self.replicas if e.has_unfinished()]
        if len(busy) == 1:
            results = [_step_or_failure(busy[0])]
        else:
            results = [f.result() for f in [self._pool.submit(_step_or_failure, e) for e in busy]]
        outs = [o for r in results for o in (r.outputs if isinstance(r, StepFailed) else r)]
        failed = [r for r in results if isinstance(r, StepFailed)]
        for o in outs:
            if o.finished and o.request_id in self._where:
                self.router.done(*self._where.pop(o.request_id))
        for rid in (rid for f in failed for rid in f.request_ids):
            if rid in self._where:
                self.router.done(*self._where.pop(rid))
        if failed:
            raise StepFailed([rid for f in failed for rid in f.request_ids], failed[0].cause, outs,
                             own=all(f.own for f in failed),
                             causes={rid: f.causes.get(rid, f.cause) for f in failed for rid in f.request_ids})
        return outs

    def _all(self, fn: Callable[[Engine], object]) -> list:
        return [fn(e) for e in self.replicas]

    def add_lora(self, lora_request):
        self._all(lambda e: e._lora_room(lora_request.lora_name, lora_request.lora_path,
                                         replace=getattr(lora_request, "load_inplace", False)))
        return self._all(lambda e: e.add_lora(lora_request))[0]

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors, config_dict: dict):
        self._all(lambda e: e._lora_room(lora_name, ""))
        return self._all(lambda e: e.load_lora_adapter_from_tensors(lora_name, tensors, config_dict))[0]

    def remove_lora(self, name: str) -> None:
        self._all(lambda e: e.remove_lora(name))

    def list_loras(self) -> list[str]:
        return self.replicas[0].list_loras()

    def _check_idle(self, what: str) -> None:
        """Sleep and weight updates change every replica or none: each must be idle before the first changes
        (else a busy replica would leave the others asleep, or serving other weights than it)."""
        self._all(lambda e: e._check_idle(what))

    def update_weights(self, model) -> None:
        self._check_idle("update_weights")
        self._all(lambda e: e.update_weights(model))
        self.router.forget()

    def update_weights_from_disk(self, path: str) -> None:
        self._check_idle("update_weights_from_disk")
        self._all(lambda e: e.update_weights_from_disk(path))  # each replica reads into its own devices
        self.router.forget()

    def get_weights_by_name(self, name: str, truncate_size=100) -> list:
        return self._all(lambda e: e.get_weights_by_name(name, truncate_size))  # each replica's (SGLang's form)

    def update_weights_from_tensor(self, named_tensors, flush_cache: bool = True) -> None:
        named_tensors = list(named_tensors.items()) if isinstance(named_tensors, dict) else list(named_tensors)
        self._check_idle("update_weights_from_tensor")
        self._all(lambda e: e.update_weights_from_tensor(named_tensors, flush_cache))
        if flush_cache:
            self.router.forget()

    def sleep(self, level: int = 1, tags=None) -> None:
        self._check_idle("sleep")
        self._all(lambda e: e.sleep(level, tags))
        self.router.forget()

    def wake_up(self, tags=None) -> None:
        self._all(lambda e: e.wake_up(tags))

    def reset_prefix_cache(self) -> bool:
        done = all(self._all(lambda e: e.reset_prefix_cache()))
        self.router.forget()
        return done

    def stats(self) -> dict:
        return merge_stats(self._all(lambda e: e.stats()), self.devices, self.router)

    def follow(self) -> int:
        raise RuntimeError("follow: data-parallel replicas live in one process; there is nothing to follow")

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._all(lambda e: e.close())


# ---- online: the HTTP server ---------------------------------------------------------------------

class DataParallelAsyncEngine(EngineGroupStatus):
    """One `AsyncEngine` (and engine thread) per replica behind the router, with `AsyncEngine`'s API, so the
    HTTP server (serve/api.py) serves it as one engine. `call(fn)` runs `fn` on every replica (adapters,
    weights), returning the first replica's result."""

    def __init__(self, engines: list[Engine], devices: Optional[list[tuple[int, ...]]] = None,
                 routing: str = "cache_aware"):
        self.replicas = [AsyncEngine(e) for e in engines]
        self.engine = engines[0]  # configuration, tokenizer, adapter registry (the same on every replica)
        self.devices = devices or [tuple(sorted(d.id for d in e.mesh.devices.flat)) if e.mesh is not None else ()
                                   for e in engines]
        self.router = router_for(engines, routing)
        self._where: dict[str, int] = {}

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def capacity(self) -> int:
        """Sequences that run at once: every replica's max_num_seqs."""
        return sum(int(a.engine.sched_cfg.max_num_seqs) for a in self.replicas)

    @property
    def alive(self) -> bool:
        return all(a.alive for a in self.replicas)

    @property
    def parts(self) -> tuple:
        return tuple(self.replicas)

    @property
    def data_parallel_size(self) -> int:
        return len(self.replicas)

    def engine_index(self, request_id: str) -> int:
        """The replica running the request (vLLM's `engine` label of its metrics); 0 once it ended."""
        return self._where.get(request_id, 0)

    async def generate(self, prompt, params=None, request_id: Optional[str] = None, priority: int = 0,
                       cache_salt: Optional[str] = None, lora_request=None, on_accept=None) -> AsyncIterator[RequestOutput]:
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self._where:  # (on another replica its stream would run beside the first, whose abort
            raise RequestError(f"request_id: {request_id!r} is already in use")  # would then miss it)
        seqs = _num_seqs(params or SamplingParams())
        r = _route(self.router, [a.engine for a in self.replicas], prompt, cache_salt, lora_request, seqs)
        self._where[request_id] = r
        stream = self.replicas[r].generate(prompt, params, request_id, priority, cache_salt, lora_request,
                                           on_accept=on_accept)
        try:
            async for out in stream:
                yield out
        finally:  # a consumer that leaves early (client disconnect) aborts the request on its replica now
            await stream.aclose()
            self._where.pop(request_id, None)
            self.router.done(r, seqs)

    def abort(self, request_id) -> None:
        """`AsyncEngine.abort` (one id or several), each on the replica running it."""
        for rid in request_ids(request_id):
            r = self._where.get(rid)
            if r is not None:
                self.replicas[r].abort(rid)

    def stats(self) -> dict:
        return merge_stats([a.engine.stats() for a in self.replicas], self.devices, self.router)

    def replica_stats(self) -> list[dict]:
        """Each replica's own `stats()` (the /metrics series of engine "0", "1", ..., as vLLM labels DP ranks)."""
        return [a.engine.stats() for a in self.replicas]

    async def call(self, fn):
        return (await self.call_each(fn))[0]

    async def call_each(self, fn) -> list:
        """`fn(engine)` on every replica's engine thread -> their results, in replica order."""
        results = await asyncio.gather(*(a.call(fn) for a in self.replicas), return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException):
                raise res
        return list(results)

    async def abort_all(self) -> int:
        return sum(await asyncio.gather(*(a.abort_all() for a in self.replicas)))

    async def reset_prefix_cache(self) -> bool:
        done = all(await asyncio.gather(*(a.reset_prefix_cache() for a in self.replicas)))
        self.router.forget()
        return done

    async def retract(self) -> int:
        return sum(await asyncio.gather(*(a.retract() for a in self.replicas)))

    async def continue_generation(self) -> None:
        await asyncio.gather(*(a.continue_generation() for a in self.replicas))

    async def sleep(self, level: int = 1, tags=None) -> None:
        await asyncio.gather(*(a.sleep(level, tags) for a in self.replicas))
        self.router.forget()

    async def wake_up(self, tags=None) -> bool:
        return any(await asyncio.gather(*(a.wake_up(tags) for a in self.replicas)))

    async def is_sleeping(self) -> bool:
        return any(await asyncio.gather(*(a.is_sleeping() for a in self.replicas)))

    def shutdown(self) -> None:
        for a in self.replicas:
            a.shutdown()
