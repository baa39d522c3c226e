"""Loading weights onto a mesh: whole onto one device then placed by the engine, against straight into the
shards (`k3jax.load_model(path, sharding=...)`, what `LLM(path, sharding=...)` and `k3jax serve --sharding`
do).

    python benchmarks/sharded_load.py           # the recorded run, ~2 min on the 2-core CPU host
    python benchmarks/sharded_load.py --quick   # tiny-k3

k3-small's random weights written as a sharded HF safetensors directory (MXFP4 experts), then, each in a fresh
process on 4 simulated CPU devices, for the `tp` and `ep` configs: the load, then the engine built over it
(accelerator forms: packed experts, `[out, in]` weights; no compile). Recorded per run: seconds to load and to
build the engine, the bytes of live arrays on each device right after the load (the device-memory question:
a whole load puts the entire model on device 0 first) and of the engine's weights on each device, the tensor
bytes read from the files, and the process's peak resident memory (host: the memory-mapped files count in it).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = ("whole", "sharded")


def child(path: str, mode: str, sharding: str) -> dict:
    """One load in this (fresh) process -> its measurements."""
    import simulated_devices

    simulated_devices.use(4)
    import jax

    from k3jax import checkpoint
    from k3jax.runtime import load_model
    from serve.engine import Engine, EngineConfig

    read = [0]
    get = checkpoint.SafetensorsDir.get

    def counted(self, name, index=()):
        arr = get(self, name, index)
        read[0] += arr.nbytes
        return arr

    checkpoint.SafetensorsDir.get = counted

    def per_device(arrays=None) -> list[int]:
        """Bytes on each device of `arrays` (default: every live array, after collecting garbage)."""
        if arrays is None:
            gc.collect()
            arrays = jax.live_arrays()
        live = [0] * len(jax.devices())
        for a in arrays:
            for s in a.addressable_shards:
                live[s.device.id] += s.data.nbytes
        return live

    t0 = time.perf_counter()
    model = load_model(path, **(dict(sharding=sharding) if mode == "sharded" else {}))
    jax.block_until_ready(jax.tree.leaves(model.params))
    t1 = time.perf_counter()
    after_load = per_device()
    eng = Engine(model, EngineConfig(sharding=sharding, expert_weights="packed", dense_weights="out_in",
                                     cache_bytes=16 << 20, max_model_len=64), warmup=False, progress=False)
    jax.block_until_ready(eng._leaves)
    t2 = time.perf_counter()
    return dict(mode=mode, sharding=sharding, load_s=t1 - t0, engine_s=t2 - t1, bytes_read=read[0],
                device_bytes_after_load=after_load, device_param_bytes=per_device(eng._leaves),
                param_bytes=sum(x.nbytes for x in eng._leaves),
                peak_rss_mib=peak_rss_mib())


def peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM: getrusage's maxrss would start at the parent's at fork)."""
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024


def main(argv=None) -> dict:
    from serving import bench_start, write_result

    args, out, log, t_start, result = bench_start("sharded_load", __doc__, argv)
    import k3jax
    from k3jax.checkpoint import save_hf_checkpoint

    preset = "tiny-k3" if args.quick else "k3-small"
    src = k3jax.load_model(preset)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, preset)
        save_hf_checkpoint(path, src.cfg, src.params, max_shard_bytes=64 << 20)
        del src
        for sharding in ("tp", "ep"):
            for mode in MODES:
                proc = subprocess.run([sys.executable, __file__, "--child", path, mode, sharding],
                                      capture_output=True, text=True, cwd=REPO)
                line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
                if proc.returncode or not line:
                    raise RuntimeError(proc.stderr[-3000:])
                r = json.loads(line[0][len("RESULT"):])
                runs.append(r)
                mib = lambda b: b / 2 ** 20  # noqa: E731
                log(f"{sharding:>2} {mode:>7}: load {r['load_s']:.2f} s, engine {r['engine_s']:.2f} s; after the load "
                    f"device 0 holds {mib(r['device_bytes_after_load'][0]):.1f} MiB, in the engine each device "
                    f"{mib(max(r['device_param_bytes'])):.1f} MiB of weights; read {mib(r['bytes_read']):.1f} MiB; "
                    f"peak RSS {r['peak_rss_mib']:.0f} MiB")
    result.update(model=preset, devices=4, runs=runs)
    return write_result(result, out, t_start, log)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print("RESULT" + json.dumps(child(*sys.argv[2:5])))
    else:
        main()
