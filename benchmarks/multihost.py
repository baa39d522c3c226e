"""Multi-host serving overhead (serve/multihost.py): what the leader spends broadcasting step batches.

    python benchmarks/multihost.py           # k3-small, 2 processes x 2 CPU devices, ~3 min
    python benchmarks/multihost.py --quick   # tiny-k3

Two processes (2 simulated CPU devices each, gloo collectives) form one 4-way tensor-parallel mesh;
process 0 runs a wave of c requests (greedy, fixed lengths) and reports, per step: the wall time of
`engine.step()` and the host time the leader spent in the step channel (`stats()["step_broadcast_seconds"]`:
header + batch broadcasts). Then the same wave on one process over 4 devices (same mesh, no channel)
gives the step time without it, and the two-process wave once more with async scheduling (each step also
sends its deferred sample's batch). On this 2-core host both processes share the cores, so the step
times say little about a real multi-host deployment; the broadcast time per step and its bytes are
what this measures. Results: `benchmarks/results/multihost-cpu.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import k3jax
    from k3jax import SamplingParams
    model, pid, nproc, port, conc, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
    async_scheduling = sys.argv[7] == "1"
    if nproc > 1:
        k3jax.initialize_distributed(f"127.0.0.1:{port}", nproc, pid)
    llm = k3jax.LLM(model, sharding="tp", max_model_len=256, cache_bytes=64 << 20, max_num_seqs=conc,
                    prefill_chunk=64, max_prefill_seqs=2, decode_buckets=(conc,), prefill_buckets=(2,),
                    context_buckets=(16,), measure_moe_time=False, progress=False, async_scheduling=async_scheduling)
    e = llm.engine
    if e.is_follower:
        llm.follow()
        sys.exit(0)
    rng = np.random.default_rng(0)
    for _ in range(conc):
        e.add_request([int(x) for x in rng.integers(3, 200, 48)],
                      SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    steps, t_wave = [], time.perf_counter()
    while e.has_unfinished():
        b0, t0 = e.stats()["step_broadcast_seconds"], time.perf_counter()
        e.step()
        steps.append((time.perf_counter() - t0, e.stats()["step_broadcast_seconds"] - b0))
    wave = time.perf_counter() - t_wave
    batch = e._pad_batch(conc, 1, 16, [])
    nbytes = sum(np.asarray(x).nbytes for x in __import__("jax").tree.leaves(batch))
    st = llm.stats()
    llm.close()
    med = lambda xs: float(np.median(xs)) if xs else None
    print("RESULT" + json.dumps(dict(
        processes=nproc, devices=st["mesh"], async_scheduling=async_scheduling, steps=len(steps),
        compiles=st["compiles_after_warmup"], wave_s=wave, tokens_per_s=conc * new / wave,
        step_ms_median=1e3 * med([a for a, _ in steps]), broadcast_ms_median=1e3 * med([b for _, b in steps]),
        broadcast_ms_total=1e3 * st["step_broadcast_seconds"], decode_batch_bytes=int(nbytes))), flush=True)
""")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(model: str, nproc: int, conc: int, new: int, async_scheduling: bool = False) -> dict:
    devices = 4 // nproc
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    port = _port()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, model, str(pid), str(nproc), str(port), str(conc), str(new),
                               str(int(async_scheduling))],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for pid in range(nproc)]
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"worker failed ({p.returncode}):\n{err[-3000:]}")
    line = [l for l in outs[0][0].splitlines() if l.startswith("RESULT")][0]
    return json.loads(line[len("RESULT"):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    model, conc, new = ("tiny-k3", 4, 8) if a.quick else ("k3-small", 8, 32)
    t0 = time.time()
    res = {"model": model, "concurrency": conc, "max_tokens": new,
           "two_processes": run(model, 2, conc, new), "one_process": run(model, 1, conc, new),
           "two_processes_async": run(model, 2, conc, new, async_scheduling=True)}
    res["seconds"] = round(time.time() - t0, 1)
    out = a.out or os.path.join(ROOT, "benchmarks", "results", "multihost-cpu-quick.json" if a.quick else "multihost-cpu.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
