"""Weight sync for RL loops: how fast new weights of the served model reach the engine, by each route.

    python benchmarks/weight_sync.py            # k3-small (~1 min)
    python benchmarks/weight_sync.py --quick    # tiny-k3 (writes to the temp dir)

Routes, each installing the same new weights (a differently seeded model) into one engine, whose compiled
programs would be reused (none is needed here: the engine is built with warmup=False):
  * `update_weights(model)`: the whole model in memory in the checkpoint's layout (start-up transforms
    applied to every weight, then installed);
  * `update_weights_from_tensor`: the checkpoint tensors (numpy) by name, in buckets of B MiB (how verl /
    slime stream a trainer's weights to SGLang), B = 16 / 64 / 1024 (one call);
  * `update_weights_from_disk`: a safetensors directory written before (page cache warm);
  * `get_weights_by_name` of every tensor, whole (what a sync check reads back).
After each write route the engine's weights are compared bit for bit with what `update_weights` installs.
Roofline: each route must at least read the checkpoint's bytes once and write the engine's held bytes once
(the CPU engine holds experts expanded to fp32 and projections transposed): (read + write bytes) / the
copy bandwidth measured in the same process.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from k3jax.checkpoint import hf_tensors, save_hf_checkpoint  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serving import machine_info, measure_bandwidth, trace_bench_start, write_result  # noqa: E402

BUCKETS_MIB = (16, 64, 1024)


def buckets(tensors: list[tuple[str, np.ndarray]], mib: int) -> list[list]:
    """Consecutive tensors grouped until a group reaches `mib` MiB."""
    out, cur, size = [], [], 0
    for name, a in tensors:
        cur.append((name, a))
        size += a.nbytes
        if size >= mib << 20:
            out.append(cur)
            cur, size = [], 0
    return out + ([cur] if cur else [])


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> dict:
    args, preset, out_path, log, t_start = trace_bench_start("weight_sync", __doc__, argv)
    reps = 2 if args.quick else 3
    bw = measure_bandwidth(256 if args.quick else 512)
    base, new = k3jax.load_model(preset, seed=args.seed), k3jax.load_model(preset, seed=args.seed + 1)
    engine = Engine(base, EngineConfig(max_model_len=256, cache_bytes=16 << 20, max_num_seqs=4, measure_moe_time=False),
                    warmup=False, progress=False)
    tensors = [(n, np.ascontiguousarray(a)) for n, a in hf_tensors(new.cfg, new.params)]
    ckpt_bytes = sum(a.nbytes for _, a in tensors)
    held_bytes = sum(x.nbytes for x in engine._leaves)
    want = [np.asarray(x) for x in engine._engine_leaves(new)]
    floor = (ckpt_bytes + held_bytes) / (bw["copy_GBps"] * 1e9)
    log(f"{preset}: {len(tensors)} checkpoint tensors, {ckpt_bytes / 2**20:.1f} MiB; engine holds "
        f"{held_bytes / 2**20:.1f} MiB; copy bandwidth {bw['copy_GBps']:.1f} GB/s -> floor {floor * 1e3:.1f} ms")

    def exact() -> bool:
        return all(np.array_equal(np.asarray(a), b) for a, b in zip(engine._leaves, want))

    def restore():
        engine.update_weights(base)

    routes = {}

    def record(name: str, fn, **extra):
        times = []
        for _ in range(reps):  # (each timing ends once the weights are on the device: dispatch is asynchronous)
            restore()
            jax.block_until_ready(engine._leaves)
            times += timed(lambda: jax.block_until_ready((fn(), engine._leaves)), 1)
        ok = exact()
        routes[name] = dict(seconds=times, median_s=float(np.median(times)), exact=ok,
                            floor_fraction=floor / float(np.median(times)), **extra)
        log(f"{name}: {np.median(times) * 1e3:.1f} ms ({floor / np.median(times):.0%} of the floor), exact {ok}")

    record("update_weights(model)", lambda: engine.update_weights(new))
    for mib in BUCKETS_MIB:
        parts = buckets(tensors, mib)
        record(f"update_weights_from_tensor {mib} MiB buckets",
               lambda parts=parts: [engine.update_weights_from_tensor(p) for p in parts], calls=len(parts))
    with tempfile.TemporaryDirectory() as d:
        save_hf_checkpoint(d, new.cfg, new.params)
        engine.update_weights_from_disk(d)  # (page cache warm, the loader's programs compiled)
        record("update_weights_from_disk", lambda: engine.update_weights_from_disk(d))
    names = engine.weight_names.names()
    read = [n.replace("weight_packed", "weight") for n in names if not n.endswith("weight_scale")] \
        if engine._expanded_group else names
    got = timed(lambda: [engine.get_weights_by_name(n, None) for n in read], reps)
    read_bytes = sum(engine.get_weights_by_name(n, None).nbytes for n in read)
    routes["get_weights_by_name (every tensor)"] = dict(
        seconds=got, median_s=float(np.median(got)), tensors=len(read), bytes=read_bytes,
        floor_fraction=read_bytes / (bw["read_GBps"] * 1e9) / float(np.median(got)))
    log(f"get_weights_by_name x {len(read)}: {np.median(got) * 1e3:.1f} ms")
    restore()

    result = dict(benchmark="weight_sync", preset=preset, machine=machine_info(), bandwidth=bw,
                  jax=jax.__version__, checkpoint_tensors=len(tensors), checkpoint_bytes=ckpt_bytes,
                  engine_held_bytes=held_bytes, floor_s=floor, routes=routes)
    return write_result(result, out_path, t_start, log)


if __name__ == "__main__":
    main()
