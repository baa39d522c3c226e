"""Where one engine step spends its time: a `jax.profiler` trace of decode-only or prefill-only steps, each
XLA op's exclusive time attributed to the source line that emitted it.

    python benchmarks/profile_step.py                                  # Kimi-Linear ckpt, c = 32 decode
    python benchmarks/profile_step.py --phase prefill --concurrency 32 # 4 x 64-token prefill steps
    python benchmarks/profile_step.py --model k3-small --concurrency 8 --top 40

How it works
------------
* The engine is built as `serving.py` builds it, but with one decode bucket (c) and one prefill bucket (4),
  so the process compiles exactly two step programs. XLA dumps their optimized HLO (`--xla_dump_to`, set
  before JAX starts); the op names in the trace are the names in that dump.
* One warm wave, then a second wave whose chosen steps run under `jax.profiler.trace`: `decode` traces the
  steps where every request decodes (none prefills); `prefill` uses `max_tokens=1`, so every traced step
  is prefill only. Only one program runs inside the trace, which keeps op names unambiguous.
* Exclusive time of an op = its span on its XLA thread minus the spans nested in it (a `while` or
  `conditional` holds its body's ops). Each op maps through its HLO `stack_frame_id` to the innermost
  frame in this repository (`file:line function`), and to a coarse part (experts, dense products, KDA, MLA,
  ...) by that frame's file and function.
* Busy time summed over XLA's threads against the steps' wall time says how many cores one engine keeps
  busy; the rest of the wall time is host work and gaps between ops.

Results print as tables; `--out` also writes them as JSON. Timings are on whatever machine runs this: the
numbers in benchmarks/README.md come with the host they were taken on.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

_DUMP = tempfile.mkdtemp(prefix="k3jax_hlo_") if __name__ == "__main__" else None
if _DUMP and "jax" not in sys.modules:  # run as a script: the dump flags must be set before XLA starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={_DUMP} --xla_dump_hlo_as_text"
                               " --xla_dump_hlo_module_re=jit_step").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

import k3jax  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.types import SamplingParams  # noqa: E402

# (part, path substring, function-name regex or None): the first match names an op's part
PARTS = [
    ("routed experts", "pallas_kernels/moe", None),
    ("routed experts", "k3jax/layers/moe.py", r"experts|_slots|gmm"),
    ("router", "k3jax/layers/moe.py", r"route"),
    ("KDA recurrence", "pallas_kernels/kda", None),
    ("MLA attention", "pallas_kernels/mla", None),
    ("dense products", "k3jax/layers/linear.py", None),
    ("dense products", "k3jax/layers/mlp.py", None),
    ("KDA layer (conv, gates, norms)", "k3jax/layers/kda.py", None),
    ("MLA layer (projections, rope)", "k3jax/layers/mla.py", None),
    ("norms", "k3jax/layers/norms.py", None),
    ("cache arena", "serve/memory.py", None),
    ("sampling", "serve/sampling.py", None),
    ("step glue", "serve/step.py", None),
    ("model glue", "k3jax/model.py", None),
]


# ------------------------------------------------------------------ HLO dump -> op name -> source frame


def parse_hlo(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """Optimized HLO text -> ({instruction name: innermost repository frame 'file:line function'},
    {instruction name: its result shape and operation})."""
    files = dict(re.findall(r"^(\d+) \"(.*)\"$", text.split("FunctionNames")[0], re.M))
    funcs_block = text.split("FunctionNames", 1)[1].split("FileLocations", 1)[0] if "FunctionNames" in text else ""
    funcs = dict(re.findall(r"^(\d+) \"(.*)\"$", funcs_block, re.M))
    locs = {m[0]: (m[1], m[2], m[3]) for m in re.findall(
        r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", text, re.M)}
    frames = {m[0]: (m[1], m[2]) for m in re.findall(
        r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)\}", text, re.M)}

    def repo_frame(fid: str) -> str:
        seen = set()
        while fid in frames and fid not in seen:
            seen.add(fid)
            loc, parent = frames[fid]
            f, fn, line = locs.get(loc, ("", "", "0"))
            path = files.get(f, "")
            rel = _repo_rel(path)
            if rel is not None:
                return f"{rel}:{line} {funcs.get(fn, '?')}"
            if parent == fid:
                break
            fid = parent
        return "(no repository frame)"

    out, what = {}, {}
    # a result shape is one token or a tuple "(s32[], f32[2,4]{1,0}, ...)" (while, sort, TopK, multi-output
    # fusions); an op with no stack frame (a copy XLA added) is in the dump all the same
    for name, shape, op, rest in re.findall(
            r"^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*)$", text, re.M):
        fid = re.search(r"stack_frame_id=(\d+)", rest)
        out[name] = repo_frame(fid.group(1)) if fid else "(no repository frame)"
        what[name] = op + " -> " + re.sub(r"\{[^}]*\}|/\*[^*]*\*/", "", shape)  # layouts, index comments dropped
    return out, what


def _repo_rel(path: str) -> str | None:
    for top in ("k3jax/", "serve/", "pallas_kernels/"):
        i = path.find(top)
        if i >= 0 and (i == 0 or path[i - 1] == "/"):
            return path[i:]
    return None


def part_of(frame: str) -> str:
    path, _, fn = frame.partition(" ")
    for part, sub, fre in PARTS:
        if sub in path and (fre is None or re.search(fre, fn)):
            return part
    return "other"


def step_module(rows: int, t: int) -> str:
    """The dumped optimized HLO of the step program whose token batch is `[rows, t]`."""
    found = []
    for p in sorted(Path(_DUMP).glob("*jit_step*cpu_after_optimizations.txt")):
        head = p.read_text().split("\n", 1)[0]
        if f"s32[{rows},{t}]" in head:
            found.append(p)
    if not found:
        raise SystemExit(f"no dumped step program with a [{rows}, {t}] token batch under {_DUMP}")
    return found[-1].read_text()


# ------------------------------------------------------------------ trace -> exclusive time per op


def exclusive_times(trace_dir: str) -> tuple[dict[str, float], dict[str, int], float, int]:
    """Perfetto trace under `trace_dir` -> ({op: exclusive us}, {op: count}, busy us summed over XLA
    threads, number of XLA threads that ran ops)."""
    path = next(Path(trace_dir).rglob("perfetto_trace.json.gz"))
    ev = json.load(gzip.open(path))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    by_tid = defaultdict(list)
    for e in ev:
        a = e.get("args") or {}
        if e.get("ph") == "X" and a.get("hlo_module") == "jit_step" and "hlo_op" in a:
            by_tid[e["tid"]].append((float(e["ts"]), float(e["dur"]), a["hlo_op"]))
    excl, count, busy = defaultdict(float), defaultdict(int), 0.0
    for spans in by_tid.values():
        spans.sort(key=lambda s: (s[0], -s[1]))  # a parent starts no later than its children, and is longer
        stack: list[tuple[float, str]] = []  # (end, name) of the open spans
        for ts, dur, name in spans:
            while stack and ts >= stack[-1][0] - 1e-3:
                stack.pop()
            if stack:
                excl[stack[-1][1]] -= dur  # the parent's time inside this child is not its own
            else:
                busy += dur
            excl[name] += dur
            count[name] += 1
            stack.append((ts + dur, name))
    return dict(excl), dict(count), busy, len(by_tid)


# ------------------------------------------------------------------ driving the engine


def build(model_name: str, c: int, seed: int, prefill_rows: int = 4, chunk: int = 64, bucket: int | None = None):
    import serving as sv

    if model_name == "kimi-linear":
        tmp = tempfile.mkdtemp(prefix="k3jax_prof_kl_")
        path, _, _ = sv.build_kimi_linear(tmp, quick=False)
        model, mml = k3jax.load_model(path), 192
    else:
        model, mml = k3jax.load_model(model_name, seed=seed), 256
    rows = bucket or c  # the one decode program's rows: more than c pads every decode step
    ecfg = dict(max_model_len=mml, page_size=16, max_num_seqs=rows, prefill_chunk=chunk, max_prefill_seqs=prefill_rows,
                max_num_batched_tokens=max(512, prefill_rows * chunk), decode_buckets=(rows,),
                prefill_buckets=(prefill_rows,),
                context_buckets=(mml // 16,), enable_prefix_caching=False, seed=seed)
    ecfg["cache_bytes"] = sv.arena_budget(model, 16, mml, rows)
    return model, Engine(model, EngineConfig(**ecfg), warmup=True, progress=False)


def run(engine: Engine, prompts, sp, phase: str, c: int, steps: int, trace_dir: str | None) -> list[float]:
    """Run one wave; with `trace_dir`, trace `steps` steps of the wanted kind -> their wall times. Decode:
    tracing starts after the first decode-only step that generated a token for all `c` requests. Prefill
    (`max_tokens=1`): every step is prefill-only, tracing starts at the first."""
    for p in prompts:
        engine.add_request(p, sp)
    traced, tracing, ready = [], False, phase == "prefill"
    while engine.has_unfinished():
        if trace_dir is not None and ready and not tracing and len(traced) < steps:
            jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
            tracing = True
        before = dict(engine.counters)
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        dec = engine.counters["decode_steps"] - before["decode_steps"]
        pre = engine.counters["prefill_steps"] - before["prefill_steps"]
        gen = engine.counters["generation_tokens"] - before["generation_tokens"]
        if tracing:
            if (dec and not pre) if phase == "decode" else (pre and not dec):
                traced.append(dt)
            else:
                jax.profiler.stop_trace()
                raise SystemExit(f"a traced step was not {phase}-only: the trace would mix two programs")
            if len(traced) >= steps:
                jax.profiler.stop_trace()
                tracing = False
        ready = ready or (dec and not pre and gen == c)
    if tracing:
        jax.profiler.stop_trace()
    return traced


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="kimi-linear", help="'kimi-linear' (HF-written ckpt, as serving.py) or a preset")
    ap.add_argument("--concurrency", "-c", type=int, default=32)
    ap.add_argument("--bucket", type=int, default=None,
                    help="rows of the decode program (default c; larger: what padding rows cost)")
    ap.add_argument("--phase", choices=["decode", "prefill"], default="decode")
    ap.add_argument("--prefill-rows", type=int, default=4, help="rows of the prefill bucket (serving.py: 4)")
    ap.add_argument("--chunk", type=int, default=64, help="prefill chunk, tokens per row (serving.py: 64)")
    ap.add_argument("--steps", type=int, default=8, help="steps to trace")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (not a multiple of --chunk: padded chunks)")
    ap.add_argument("--gen", type=int, default=32, help="max_tokens of the decode waves")
    ap.add_argument("--top", type=int, default=25, help="source lines to list")
    ap.add_argument("--ops", type=int, default=0, help="also list the N costliest ops with their HLO shapes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the tables as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the trace (Perfetto / TensorBoard) and the HLO dump")
    args = ap.parse_args(argv)
    c = args.concurrency
    model, engine = build(args.model, c, args.seed, args.prefill_rows, args.chunk, args.bucket)
    plen = args.prompt_len
    rng = np.random.default_rng(args.seed)
    vocab_hi = model.cfg.vocab_size - 3
    gen = 1 if args.phase == "prefill" else args.gen
    sp = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    prompts = lambda: rng.integers(0, vocab_hi, (c, plen)).tolist()  # noqa: E731
    run(engine, prompts(), sp, args.phase, c, 0, None)  # warm: caches, allocator, branch predictors
    trace_dir = tempfile.mkdtemp(prefix="k3jax_trace_")
    walls = run(engine, prompts(), sp, args.phase, c, args.steps, trace_dir)
    if not walls:
        raise SystemExit(f"no {args.phase}-only step was seen at c = {c}")
    rows, t = (args.bucket or c, 1) if args.phase == "decode" else (args.prefill_rows, args.chunk)
    frames, what = parse_hlo(step_module(rows, t))
    excl, count, busy, threads = exclusive_times(trace_dir)
    n = len(walls)
    by_line, by_part, n_ops = defaultdict(float), defaultdict(float), defaultdict(int)
    for op, us in excl.items():
        fr = frames.get(op, "(op not in the dump)")
        by_line[fr] += us / n
        by_part[part_of(fr)] += us / n
        n_ops[fr] += count[op] / n
    total = sum(by_part.values())
    wall_ms = float(np.median(walls)) * 1e3
    print(f"\n{args.model}, c = {c} ({rows} rows), {args.phase}: {n} steps traced, median wall {wall_ms:.2f} ms, op time "
          f"{total / 1e3:.2f} ms per step (busy over {threads} XLA thread(s): {busy / n / 1e3:.2f} ms), "
          f"{sum(count.values()) / n:.0f} ops per step")
    print(f"\n{'part':34s} {'ms/step':>8s} {'share':>6s}")
    for part, us in sorted(by_part.items(), key=lambda kv: -kv[1]):
        print(f"{part:34s} {us / 1e3:8.2f} {us / total:6.1%}")
    print(f"\n{'source line (innermost repository frame)':70s} {'ms/step':>8s} {'ops':>6s}")
    for fr, us in sorted(by_line.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{fr[:70]:70s} {us / 1e3:8.3f} {n_ops[fr]:6.0f}")
    if args.ops:
        print(f"\n{'op':28s} {'what':48s} {'us/step':>8s} {'calls':>5s}  source")
        for op, us in sorted(excl.items(), key=lambda kv: -kv[1])[:args.ops]:
            print(f"{op[:28]:28s} {what.get(op, '?')[:48]:48s} {us / n:8.1f} {count[op] / n:5.0f}  "
                  f"{frames.get(op, '?')}")
    result = dict(model=args.model, concurrency=c, rows=rows, phase=args.phase, steps_traced=n, step_wall_ms=wall_ms,
                  op_ms_per_step=total / 1e3, busy_ms_per_step=busy / n / 1e3, xla_threads=threads,
                  ops_per_step=sum(count.values()) / n,
                  parts_ms={k: v / 1e3 for k, v in sorted(by_part.items(), key=lambda kv: -kv[1])},
                  lines_ms={k: v / 1e3 for k, v in sorted(by_line.items(), key=lambda kv: -kv[1])[:args.top]},
                  machine=dict(cpu_count=os.cpu_count(), jax=jax.__version__))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if not args.keep:
        for d in (trace_dir, _DUMP):
            shutil.rmtree(d, ignore_errors=True)
    else:
        print(f"\ntrace: {trace_dir}\noptimized HLO: {_DUMP}")
    return result


if __name__ == "__main__":
    main()
