"""Multi-host serving: one engine over a device mesh that spans several processes (`jax.distributed`).

JAX runs multi-host programs multi-controller: every process must launch the same compiled programs,
in the same order, on the same global shapes. The engine keeps that contract with a leader and
followers. Process 0 (the leader) owns everything on the host side: requests, the scheduler, the
arena's bookkeeping, the prefix cache, sampling parameters, outputs. Once its own launch of each step
program returned (launches are asynchronous; one that raises on the leader alone is never sent, so no
follower runs a program whose collectives wait for the leader) it sends the step's batch (the padded
numpy arrays: tokens, page-table rows, slot bases, copy lists, sampling rows) over the `StepChannel`;
every other process (a follower) sits in `Engine.follow()`,
receives the batch and runs the same step program on its own devices. The followers keep no request
state: everything a step does to the cache is named by its batch, so replaying the batches replays
the cache. Outputs (sampled tokens, logprobs, expert counts) come back replicated, so the leader
reads them locally.

Start-up is symmetric: every process builds the engine from the same model and config and compiles
the same buckets (the leader checks a fingerprint of the config and bucket set against each
follower's before the first step and names the difference). The followers replay only from `follow()`, once
warmed up, so the leader refuses a step, an expert move or a weight update or read before its own warm-up (it
would run there alone, its collectives waiting for processes still compiling). The
leader's `Engine.close()` (also run at interpreter exit) releases the followers.

The host tier of the prefix cache (serve/host_cache.py) keeps process-local copies: before its copy
programs run on the leader, a SPILL / RESTORE command names the units and entries (uids) so every
process runs the same program and keeps or supplies its own columns; FORGET drops entries the leader's
store no longer holds. The device page tables (serve/page_tables.py) are replayed the same way: before a
step whose rows lack entries, a TABLES command carries those entries and every process writes them.

Async scheduling replays too. Every process updates the carry of sampled tokens (a device array the next
step's rows read their input from) by running the same programs, so a step batch's `carry` leaf is never
sent (nor read on the leader's host, which would wait for the step in flight). A decode program samples
apart: its logits stay on every process until the leader has read the step before back and built the
rows' masks; then a SAMPLE command carries the sampling batch with the decode step's number on the channel,
and each follower runs the sample program on the logits it kept for that step.

Sleep mode, weight updates from disk and LoRA adapters replay as commands too: SLEEP / WAKE make every
process release or take back its own devices' memory (level 1 keeps each process's own shards in host
memory: `HostCopy`); UPDATE names a checkpoint directory that every process loads into its own shards, in two
rounds each closed by an all-gather of every process's verdict (the config read, then the weights), so the
weights change only where all could load them; ADAPTER carries a loaded adapter's factors (npz bytes, in
chunks) and LORA the slot each write fills, before the step that needs it.

The channel is host to host, never a device program (`KeyValueTransport`): each message is one value in the
key-value store of `jax.distributed`'s coordination service (which every multi-process JAX job runs), keyed
by its number; followers read them in order. A device collective (`broadcast_one_to_all`, the first form)
queues behind the step in flight and makes the leader wait for it, which defeats async scheduling and cost
two collectives and host syncs a step. A message is a fixed header (command, rows, tokens per row, pages
per layer, a flag) and the batch packed into bytes. The sampling extras that are almost always padding (the
structured-output bitmask, `[rows, V / 32]` int32, 20 KB a row at K3's vocabulary; the logit-bias rows)
are left out when every row is padding, which the flag says. A step's message is small (KBs: a row's page
table is one index into the device tables; the entries a decode step adds are 16 bytes per page per MLA
layer, once every page_size tokens a row; with structured-output rows or prompt vectors a few MB: values of 6 to
200 MiB passed whole through the service in a two-process probe). Messages are kept in blocks of `BLOCK`; each follower acknowledges
the blocks it has read and the leader deletes the blocks every follower has, so the store holds only what a
follower has yet to read.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import time
from typing import Callable, Optional, Protocol

import jax
import numpy as np

log = logging.getLogger(__name__)

_STOP, _STEP, _IDLE = 0, 1, 2
# host tier of the prefix cache (serve/host_cache.py): copies every process runs, named by an int32 payload
SPILL, RESTORE, FORGET = 3, 4, 5
# device page-table entries (serve/page_tables.py) the next step's rows lack, as flat (row, layer, index, unit) quads
TABLES = 6
# async scheduling: the sampling batch of a decode step launched earlier, whose logits wait on the device (the
# header names the step by its number on the channel)
SAMPLE = 7
# expert-parallel load balancing (serve/eplb.py): the MoE layers the leader moves, as flat (layer, placement) rows
EPLB = 8
# sleep mode and weight updates (Engine.sleep / wake_up / update_weights_from_disk), which every process runs on
# its own devices: the level; (weights, kv_cache) flags; a checkpoint directory's path (`text_payload`)
SLEEP, WAKE, UPDATE = 9, 10, 11
# LoRA adapters (serve/lora.py): a loaded adapter's factors (uid, chunk, chunks, then `bytes_payload` of their npz
# bytes: an adapter may exceed one message), the factors a slot takes before the next step (slot, uid; 0: zeros),
# an adapter removed (uid)
ADAPTER, LORA, LORA_DROP = 12, 13, 14
ADAPTER_CHUNK = 64 << 20  # bytes of an adapter's factors per message
# weights by checkpoint name (serve/named_weights.py): tensors to write (chunk, chunks, then `bytes_payload` of
# their `pack_tensors` bytes), and a tensor to read (`text_payload` of [name, truncate_size] as JSON); every process
# writes / reads its own shards, then all answer together
NAMED_WRITE, NAMED_READ = 15, 16
_PAYLOADS = (SPILL, RESTORE, FORGET, TABLES, EPLB, SLEEP, WAKE, UPDATE, ADAPTER, LORA,
             LORA_DROP, NAMED_WRITE, NAMED_READ)  # commands that carry an int32 payload
#: step-batch fields sent only when some row differs from padding (the header says): sampling extras, prompt embeddings
OPTIONAL_FIELDS = ("allowed", "constrained", "bias_ids", "bias_values", "restrict", "proc_args", "proc_on", "embeds",
                   "embed_mask")
#: step-batch fields never sent: the async carry, a device array every process updates itself (same programs)
LOCAL_FIELDS = ("carry",)
# an idle leader pings the followers this often (a follower's log shows the leader alive while idle)
KEEPALIVE_SECONDS = float(os.environ.get("K3JAX_MULTIHOST_KEEPALIVE", "10"))
_HEADER = 5  # int32 words: command, shape (3), full flag


def initialize(coordinator_address: str, num_processes: int, process_id: int,
               local_device_ids: Optional[list[int]] = None) -> None:
    """`jax.distributed.initialize`, with CPU cross-process collectives (gloo) enabled, so the same
    multi-process engine runs on GPU/TPU hosts and on CPU processes (tests, development)."""
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    if ":" not in coordinator_address:
        raise ValueError(f"coordinator_address={coordinator_address!r}: expected 'host:port'")
    try:  # must be set before the CPU backend starts; a no-op for GPU/TPU devices
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception as e:  # pragma: no cover - older/newer JAX without the option
        log.info("CPU collectives option not set: %s", e)
    jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids)


def bytes_payload(head: list[int], raw: bytes) -> np.ndarray:
    """An int32 command payload of `head` words, the length of `raw`, then `raw` padded to whole words."""
    return np.concatenate([np.asarray([*head, len(raw)], np.int32),
                           np.frombuffer(raw + b"\0" * (-len(raw) % 4), np.int32)])


def payload_bytes(payload: np.ndarray, words: int) -> tuple[list[int], bytes]:
    """`bytes_payload`'s inverse -> (its `words` head words, its bytes)."""
    head, n = payload[:words].tolist(), int(payload[words])
    return head, payload[words + 1:].tobytes()[:n]


def text_payload(text: str) -> np.ndarray:
    return bytes_payload([], text.encode())


def payload_text(payload: np.ndarray) -> str:
    return payload_bytes(payload, 0)[1].decode()


class HostCopy:
    """A device array's values in this process's host memory (sleep level 1): the whole array where this
    process holds all of it, else (a multi-process mesh) only its own devices' shards, each distinct shard
    once; `restore` puts them back on the same devices."""

    def __init__(self, shape: tuple[int, ...], dtype, shards: dict, where: list):
        self.shape, self.dtype = shape, dtype
        self.shards = shards  # shard index (start, stop, step per dim) -> values
        self.where = where  # (device, shard index) per addressable device, in the array's order

    @classmethod
    def of(cls, x: jax.Array) -> "HostCopy":
        shards, where = {}, []
        for s in x.addressable_shards:
            key = tuple((sl.start, sl.stop, sl.step) for sl in s.index)
            if key not in shards:  # copies: on CPU a device array's host view would keep its buffer alive
                shards[key] = np.array(s.data, copy=True)
            where.append((s.device, key))
        return cls(x.shape, x.dtype, shards, where)

    def restore(self, sharding) -> jax.Array:
        """-> the array again, with `sharding` (its own, from the engine's leaf specs; None: one device)."""
        if sharding is None:
            (key,) = self.shards
            return jax.numpy.asarray(self.shards[key])
        pieces = [jax.device_put(self.shards[key], device) for device, key in self.where]
        return jax.make_array_from_single_device_arrays(self.shape, sharding, pieces)


def mesh_processes(mesh) -> set[int]:
    """Indices of the processes whose devices the mesh holds."""
    return {d.process_index for d in mesh.devices.flat}


class Transport(Protocol):
    """Messages (bytes) from process 0 to every other process, in order."""

    def send(self, message: bytes) -> None: ...

    def receive(self) -> bytes: ...


_CHANNELS = itertools.count()  # channels made in this process (every process makes them in the same order)


class KeyValueTransport:
    """Messages through the key-value store of `jax.distributed`'s coordination service: the leader sets
    `{prefix}/{block}/{n}` for its n-th message, followers wait for each key in turn. Every `BLOCK` messages a
    follower records the blocks it has read (`{prefix}/ack/{process}`), and as the leader starts a block it
    deletes (one call, the block's directory) those every follower has read."""

    BLOCK = 64
    POLL_MS = 60_000  # a follower's wait for one message is renewed after this (the leader may idle for long)

    def __init__(self, process: int, processes: int, client=None):
        if client is None:
            try:
                from jax._src import distributed

                client = distributed.global_state.client
            except (ImportError, AttributeError) as e:  # pragma: no cover - a JAX without the coordination client
                raise RuntimeError(f"this JAX ({jax.__version__}) exposes no jax.distributed key-value client, "
                                   f"which the multi-process step channel uses: {e}") from e
            if client is None:
                raise RuntimeError("a multi-process step channel needs jax.distributed.initialize() first")
        self.client, self.process, self.processes = client, process, processes
        self.prefix = f"k3jax/channel{next(_CHANNELS)}"
        self.n = 0  # messages sent (leader) or received (follower)
        self.deleted = 0  # leader: blocks deleted

    def send(self, message: bytes) -> None:
        if self.n % self.BLOCK == 0 and self.n // self.BLOCK > self.deleted:
            self._delete_read_blocks()
        self.client.key_value_set_bytes(f"{self.prefix}/{self.n // self.BLOCK}/{self.n}", message)
        self.n += 1

    def _delete_read_blocks(self) -> None:
        read = [self._acked(p) for p in range(1, self.processes)]
        for block in range(self.deleted, min(read, default=self.n // self.BLOCK)):
            self.client.key_value_delete(f"{self.prefix}/{block}")
            self.deleted = block + 1

    def _acked(self, process: int) -> int:
        """Blocks the follower has read (0 before its first acknowledgement)."""
        try:
            return int(self.client.key_value_try_get_bytes(f"{self.prefix}/ack/{process}"))
        except Exception:  # not set yet
            return 0

    def receive(self) -> bytes:
        key = f"{self.prefix}/{self.n // self.BLOCK}/{self.n}"
        while True:
            try:
                message = self.client.blocking_key_value_get_bytes(key, self.POLL_MS)
                break
            except Exception as e:
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        self.n += 1
        if self.n % self.BLOCK == 0:
            self.client.key_value_set_bytes(f"{self.prefix}/ack/{self.process}", str(self.n // self.BLOCK).encode(),
                                            allow_overwrite=True)
        return message


def pack(leaves: list[np.ndarray]) -> np.ndarray:
    """Leaves -> one uint8 buffer (their bytes back to back)."""
    return np.concatenate([np.ascontiguousarray(x).reshape(-1).view(np.uint8) for x in leaves]) if leaves \
        else np.zeros(0, np.uint8)


def unpack(buf: np.ndarray, template: list[np.ndarray]) -> list[np.ndarray]:
    """Inverse of `pack`, with shapes and dtypes from `template`."""
    sizes = [x.size * x.dtype.itemsize for x in template]
    if sum(sizes) != buf.size:
        raise ValueError(f"step batch of {buf.size} bytes does not match the template's {sum(sizes)}")
    out, at = [], 0
    for x, n in zip(template, sizes):
        out.append(buf[at:at + n].view(x.dtype).reshape(x.shape))
        at += n
    return out


class StepChannel:
    """The leader's step batches, replayed by every follower (see the module docstring).

    `make_batch(rows, t, pages)` builds a padding batch of that bucket: the followers' template for
    shapes and dtypes (the engine's `_pad_batch` with no rows). `transport`: default `KeyValueTransport`."""

    def __init__(self, make_batch: Callable, transport: Optional[Transport] = None):
        self.make_batch = make_batch
        self.process = jax.process_index()
        self.leader = self.process == 0
        self.transport = transport if transport is not None else KeyValueTransport(self.process, jax.process_count())
        self.closed = False
        self.steps = 0  # batches sent (leader) or received (follower)
        self.pings = 0  # idle keepalives sent (leader) or received (follower)
        self.seconds = 0.0  # leader: host time spent sending step batches and samples (after warm-up)
        self.last = time.monotonic()  # last exchange
        self.bytes = 0  # leader: step-batch and sample bytes sent (after warm-up)
        self._sent = 0
        self._templates: dict = {}

    # ---- both sides ---------------------------------------------------------------------------
    def _template(self, cmd: int, shape: tuple[int, int, int]):
        """The padding batch of a bucket (`_STEP`) or its sampling batch (`SAMPLE`, shape = (rows, step, 0)):
        (leaves, treedef, indices of the optional leaves, indices of the leaves sent)."""
        key = (cmd, shape[0]) if cmd == SAMPLE else (cmd, shape)
        if key not in self._templates:
            pad = self.make_batch(shape[0], 1, 1).sampling if cmd == SAMPLE else self.make_batch(*shape)
            flat, treedef = jax.tree.flatten_with_path(pad)
            name = lambda path: getattr(path[-1], "name", None)  # noqa: E731
            leaves = [None if name(path) in LOCAL_FIELDS else np.asarray(x) for path, x in flat]
            optional = [i for i, (path, _) in enumerate(flat) if name(path) in OPTIONAL_FIELDS]
            sent = [i for i, (path, _) in enumerate(flat) if name(path) not in LOCAL_FIELDS]
            self._templates[key] = (leaves, treedef, optional, sent)
        return self._templates[key]

    def _send(self, cmd: int, shape: tuple[int, int, int], batch=None) -> None:
        """Leader: one message of a header and (a step or a sample) its batch or (a command) its int32 payload.
        The optional leaves go only when some differ from padding; local leaves (the async carry) are neither
        read nor sent. Steps and samples count in `seconds` and `bytes`."""
        if self.closed and cmd != _STOP:
            raise RuntimeError("the step channel is closed (the followers were released)")
        t0, body, full = time.monotonic(), b"", False
        if cmd in (_STEP, SAMPLE):
            template, _, optional, sent = self._template(cmd, shape)
            flat = jax.tree.leaves(batch)
            leaves = {i: np.asarray(flat[i]) for i in sent}
            full = any(not np.array_equal(leaves[i], template[i]) for i in optional)
            body = pack([leaves[i] for i in sent if full or i not in optional]).tobytes()
        elif cmd in _PAYLOADS:
            body = np.ascontiguousarray(batch, np.int32).tobytes()
        head = np.asarray([cmd, *shape, int(full)], np.int32).tobytes()
        self.transport.send(head + body)
        self._sent = len(body)
        self.last = time.monotonic()
        if cmd in (_STEP, SAMPLE):
            self.seconds += self.last - t0
            self.bytes += len(body)

    def _receive(self):
        """Follower: the next message -> (cmd, shape, its batch, int32 payload or None)."""
        message = self.transport.receive()
        head = np.frombuffer(message[:4 * _HEADER], np.int32)
        cmd, shape, full = int(head[0]), tuple(int(x) for x in head[1:4]), bool(head[4])
        body = np.frombuffer(message[4 * _HEADER:], np.uint8)
        if cmd in _PAYLOADS:
            return cmd, shape, body.view(np.int32).copy()
        if cmd in (_STEP, SAMPLE):
            template, treedef, optional, sent = self._template(cmd, shape)
            sent = [i for i in sent if full or i not in optional]
            out = list(template)
            for i, x in zip(sent, unpack(body, [template[i] for i in sent])):
                out[i] = x.copy()
            return cmd, shape, jax.tree.unflatten(treedef, out)
        return cmd, shape, None

    def prime(self, shape: tuple[int, int, int], sample: bool = False) -> None:
        """Build one bucket's templates (every process, at warm-up: `make_batch` touches the engine's batch
        state, which it must not in the middle of a step); `sample`: also its sampling batch's (a decode
        bucket of an async engine)."""
        self._template(_STEP, shape)
        if sample:
            self._template(SAMPLE, (shape[0], 0, 0))

    def check(self, fingerprint: str) -> None:
        """Every process compares its engine fingerprint with the leader's; raises on a mismatch."""
        from jax.experimental import multihost_utils

        digest = np.frombuffer(hashlib.sha256(fingerprint.encode()).digest()[:8], np.int32)  # 2 words
        every = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1, 2)  # [processes, 2]
        bad = [i for i, d in enumerate(every) if not np.array_equal(d, every[0])]
        if bad:
            raise RuntimeError(f"process(es) {bad} built a different engine than process 0 (model, config or "
                               f"buckets differ): every process must build the same engine. "
                               f"Process {self.process}: {fingerprint}")

    # ---- leader -------------------------------------------------------------------------------
    def send(self, batch, shape: tuple[int, int, int]) -> None:
        self._send(_STEP, shape, batch)
        self.steps += 1

    def sample(self, step: int, sampling) -> None:
        """Async scheduling: the sampling batch (masks built now) of the decode step sent as number `step`,
        whose logits every process keeps until this arrives."""
        self._send(SAMPLE, (int(sampling.temperature.shape[0]), step, 0), sampling)

    def command(self, cmd: int, payload: np.ndarray) -> None:
        """Send a command with an int32 payload (host-tier copies SPILL / RESTORE / FORGET, page-table entries
        TABLES, expert moves EPLB)."""
        self._send(cmd, (len(payload), 0, 0), payload)

    def keepalive(self) -> None:
        """An idle leader's ping (every KEEPALIVE_SECONDS): the followers count them (their exit log says how
        many), which shows the leader alive through idle time."""
        if self.leader and not self.closed and time.monotonic() - self.last >= KEEPALIVE_SECONDS:
            self._send(_IDLE, (0, 0, 0))
            self.pings += 1

    def close(self) -> None:
        """Release the followers (their `follow()` returns)."""
        if self.leader and not self.closed:
            self.closed = True
            self._send(_STOP, (0, 0, 0))

    # ---- follower -----------------------------------------------------------------------------
    def receive(self):
        """-> the leader's next (command, step batch or payload): (_STEP, batch), (SPILL / RESTORE / FORGET /
        TABLES, int32 payload), (SAMPLE, (step number, sampling batch)), or None once the leader closed the
        channel."""
        while True:
            cmd, shape, batch = self._receive()
            if cmd == _STOP:
                self.closed = True
                return None
            if cmd == _STEP:
                self.steps += 1
                return cmd, batch
            if cmd == SAMPLE:  # (the step it samples, its sampling batch)
                return cmd, (shape[1], batch)
            if cmd in _PAYLOADS:
                return cmd, batch
            self.pings += 1
