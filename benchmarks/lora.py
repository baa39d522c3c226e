"""Multi-LoRA serving cost on CPU: what adapter slots add to a decode step, and the engine against PEFT.

    python benchmarks/lora.py            # k3-small + an HF-written Kimi-Linear checkpoint, ~5 min quiet
    python benchmarks/lora.py --quick    # tiny models, ~1 min (writes to the temp dir)

Part 1 (k3-small, random weights): one engine without adapters, one with `max_loras=4`,
`max_lora_rank=16` (random rank-16 adapters on every dense projection), and one with the same slots on
q/k/v/o only (`lora_target_modules`). The same waves of c = 8 requests (64-128 prompt tokens, 32
greedy tokens) run on the base engine, then on the LoRA engine with every row on the base model, every
row on one adapter, and the rows spread over four adapters, then on the q/k/v/o engine with four
adapters; waves are interleaved and repeated. Reported: median decode-step time over decode-only full
steps, generated tokens/s, and the memory roofline of the step (the base step's bytes with the weights
as the step reads them, `serving.decode_bytes`, plus the factors each distinct adapter in the batch
must read) at the bandwidth measured in the same process.

Part 2 (Kimi-Linear structure at small size, written by transformers): a rank-16 PEFT adapter with
random factors on every dense projection; the engine with that adapter against `PeftModel.generate`
(torch CPU, the peer) on the same 8 prompts: generated tokens/s of both and whether greedy tokens agree.

Part 3 (k3-small): adapters on the routed experts too (`lora_target_modules=("all-linear", "experts")`,
per-expert A, and the same with `lora_experts_shared_a`), waves as in part 1 on those engines beside the
base engine and the dense-projection LoRA engine: what the expert term adds to a decode step.

Part 4 (the part 2 checkpoint): PEFT's `target_parameters` on the fused expert parameters plus every dense
projection, the engine against `PeftModel.generate` as in part 2.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import k3jax  # noqa: E402
from k3jax.layers.linear import Linear  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.lora import LoRARequest  # noqa: E402
from serve.types import SamplingParams  # noqa: E402
from serving import bench_start, build_kimi_linear, decode_bytes, hf_generate, med, run_wave, write_result  # noqa: E402


QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")


def random_adapter(model, out_dir: str, rank: int, seed: int, scale: float = 0.02, targets=None) -> str:
    """A PEFT-format adapter with random factors on every dense projection of `model` (or those named
    in `targets`)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for path, node in nnx.iter_graph(nnx.merge(model.graphdef, model.params)):
        if isinstance(node, Linear) and (targets is None or path[-1] in targets):
            name = "base_model.model.model." + ".".join(map(str, path))
            o, i = node.out_in().shape
            tensors[f"{name}.lora_A.weight"] = (rng.normal(size=(rank, i)) * scale).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = (rng.normal(size=(o, rank)) * scale).astype(np.float32)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}, f)
    return out_dir


def factor_bytes(engine: Engine) -> int:
    """Bytes of one adapter's factors over every projection (one slot of every factor array)."""
    return engine.lora_bytes // (engine.config.max_loras + 1)


def wave(engine: Engine, reqs: list, gen: int) -> dict:
    """Submit (prompt, adapter) pairs at once, step to completion -> wall time, generated tokens/s, the
    decode-only steps of the full batch, token ids."""
    w = run_wave(engine, [p for p, _ in reqs], SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True),
                 [lr for _, lr in reqs])
    return dict(wall_s=w["wall_s"], gen_tok_s=w["gen_tok_s"], token_ids=w["token_ids"],
                decode_steps=[dt for dt, rows in w["decode_only_steps"] if rows == len(reqs)])


def part_k3_small(quick: bool, bw: float, log) -> dict:
    model = k3jax.load_model("tiny-k3" if quick else "k3-small", seed=0)
    c, gen, reps = (4, 8, 1) if quick else (8, 32, 4)
    rank, slots = (4, 2) if quick else (16, 4)
    ecfg = dict(max_model_len=256, page_size=16, cache_bytes=(64 if quick else 192) << 20, max_num_seqs=c,
                decode_buckets=(c,), prefill_buckets=(4,), context_buckets=(16,), max_num_batched_tokens=512)
    t0 = time.perf_counter()
    base = Engine(model, EngineConfig(**ecfg), progress=False)
    t_base = time.perf_counter() - t0
    t0 = time.perf_counter()
    lora = Engine(model, EngineConfig(**ecfg, max_loras=slots, max_lora_rank=rank), progress=False)
    t_lora = time.perf_counter() - t0
    attn = Engine(model, EngineConfig(**ecfg, max_loras=slots, max_lora_rank=rank, lora_target_modules=QKVO),
                  progress=False)
    tmp = tempfile.mkdtemp()
    names = []
    for s in range(slots):
        t0 = time.perf_counter()
        lora.add_lora(LoRARequest(f"a{s}", s + 1, random_adapter(model, f"{tmp}/a{s}", rank, s)))
        names.append(f"a{s}")
        log(f"  adapter a{s} loaded in {time.perf_counter() - t0:.2f} s")
        attn.add_lora(LoRARequest(f"a{s}", s + 1, random_adapter(model, f"{tmp}/q{s}", rank, s, targets=QKVO)))
    rng = np.random.default_rng(0)
    cases = {"base engine": (base, lambda i: None), "lora engine, base rows": (lora, lambda i: None),
             "lora engine, one adapter": (lora, lambda i: names[0]),
             f"lora engine, {slots} adapters": (lora, lambda i: names[i % slots]),
             f"q/k/v/o-only lora engine, {slots} adapters": (attn, lambda i: names[i % slots])}
    runs = {k: [] for k in cases}
    for _ in range(reps):
        prompts = [list(map(int, rng.integers(3, model.cfg.vocab_size, rng.integers(64, 129)))) for _ in range(c)]
        for k, (eng, pick) in cases.items():
            runs[k].append(wave(eng, [(p, pick(i)) for i, p in enumerate(prompts)], gen))
    one, one_attn = factor_bytes(lora), factor_bytes(attn)
    # the weights as the step reads them (experts expanded on CPU), as benchmarks/serving.py counts them
    roof_base = decode_bytes(base.model, c, 96 + gen / 2, 16)["total_bytes"]
    out = dict(model="tiny-k3" if quick else "k3-small", concurrency=c, gen=gen, reps=reps, rank=rank,
               max_loras=slots, startup_s=dict(base=t_base, lora=t_lora), lora_bytes=lora.lora_bytes,
               adapter_factor_bytes=one, qkvo_adapter_factor_bytes=one_attn, qkvo_lora_bytes=attn.lora_bytes,
               compiles_after_warmup=lora.stats()["compiles_after_warmup"] + attn.stats()["compiles_after_warmup"],
               cases={})
    summarize(out, runs, slots, roof_base, lambda k: one_attn if "q/k/v/o" in k else one, bw, "lora engine, base rows",
              log)
    return out


def summarize(out: dict, runs: dict, slots: int, roof_base: float, factor_bytes_of, bw: float, base_rows: str,
              log) -> None:
    """Per case of `runs` ({name: waves}, the first the base engine): median decode step against its roofline (the
    base step's bytes + the factors of the distinct adapters in the batch, `factor_bytes_of(name)` each) and
    against the first case; and whether the `base_rows` case gave the base engine's tokens."""
    ref = None
    for k, ws in runs.items():
        steps = [dt for w in ws for dt in w["decode_steps"]]
        distinct = 0 if "base" in k else (1 if "one" in k else slots)
        roof = (roof_base + distinct * factor_bytes_of(k)) / (bw * 1e9)
        step = med(steps)
        ref = ref or step
        out["cases"][k] = dict(decode_step_median_s=step, decode_steps=len(steps),
                               decode_step_wave_medians_s=[med(w["decode_steps"]) for w in ws],
                               gen_tok_s=med([w["gen_tok_s"] for w in ws]), adapters_in_batch=distinct,
                               roofline_s=roof, step_over_roofline=step / roof, step_over_base_engine=step / ref)
        log(f"  {k}: decode step {step * 1e3:.1f} ms ({step / roof:.2f}x its roofline {roof * 1e3:.1f} ms, "
            f"{step / ref:.2f}x the base engine), {out['cases'][k]['gen_tok_s']:.1f} gen tok/s")
    first = next(iter(runs))
    same = [a == b for w1, w2 in zip(runs[first], runs[base_rows]) for a, b in zip(w1["token_ids"], w2["token_ids"])]
    out["base_rows_identical_to_base_engine"] = f"{sum(same)}/{len(same)}"


def expert_adapter(model, out_dir: str, rank: int, seed: int, shared: bool, scale: float = 0.02) -> str:
    """`random_adapter` on every dense projection plus every MoE layer's routed experts (per-expert names;
    `shared`: one A per matrix for all experts)."""
    from safetensors.numpy import load_file, save_file

    random_adapter(model, out_dir, rank, seed, scale)
    tensors = load_file(os.path.join(out_dir, "adapter_model.safetensors"))
    rng, cfg = np.random.default_rng(seed + 100), model.cfg
    dims = {"w1": (cfg.moe_intermediate_size, cfg.expert_in_size), "w3": (cfg.moe_intermediate_size, cfg.expert_in_size),
            "w2": (cfg.expert_in_size, cfg.moe_intermediate_size)}
    for layer in (l for l in range(cfg.num_hidden_layers) if cfg.is_moe(l)):
        name = f"base_model.model.model.layers.{layer}.block_sparse_moe.experts"
        for w, (o, i) in dims.items():
            if shared:
                tensors[f"{name}.{w}.lora_A.weight"] = (rng.normal(size=(rank, i)) * scale).astype(np.float32)
            for e in range(cfg.num_experts):
                if not shared:
                    tensors[f"{name}.{e}.{w}.lora_A.weight"] = (rng.normal(size=(rank, i)) * scale).astype(np.float32)
                tensors[f"{name}.{e}.{w}.lora_B.weight"] = (rng.normal(size=(o, rank)) * scale).astype(np.float32)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    return out_dir


def part_experts(quick: bool, bw: float, log) -> dict:
    model = k3jax.load_model("tiny-k3" if quick else "k3-small", seed=0)
    c, gen, reps = (4, 8, 1) if quick else (8, 32, 3)
    rank, slots = (4, 2) if quick else (16, 4)
    ecfg = dict(max_model_len=256, page_size=16, cache_bytes=(64 if quick else 192) << 20, max_num_seqs=c,
                decode_buckets=(c,), prefill_buckets=(4,), context_buckets=(16,), max_num_batched_tokens=512,
                max_loras=slots, max_lora_rank=rank)
    base = Engine(model, EngineConfig(**{k: v for k, v in ecfg.items() if "lora" not in k}), progress=False)
    dense = Engine(model, EngineConfig(**ecfg), progress=False)
    engines = {"own A": Engine(model, EngineConfig(**ecfg, lora_target_modules=("all-linear", "experts")), progress=False),
               "shared A": Engine(model, EngineConfig(**ecfg, lora_target_modules=("all-linear", "experts"),
                                                      lora_experts_shared_a=True), progress=False)}
    tmp = tempfile.mkdtemp()
    names = [f"a{s}" for s in range(slots)]
    load_s = {}
    for s, n in enumerate(names):
        dense.add_lora(LoRARequest(n, s + 1, random_adapter(model, f"{tmp}/d{s}", rank, s)))
        for kind, eng in engines.items():
            t0 = time.perf_counter()
            eng.add_lora(LoRARequest(n, s + 1, expert_adapter(model, f"{tmp}/{kind[0]}{s}", rank, s, kind == "shared A")))
            load_s.setdefault(kind, []).append(time.perf_counter() - t0)
    rng = np.random.default_rng(0)
    cases = {"base engine": (base, lambda i: None),
             f"dense-projection lora engine, {slots} adapters": (dense, lambda i: names[i % slots]),
             "expert lora engine (own A), base rows": (engines["own A"], lambda i: None),
             "expert lora engine (own A), one adapter": (engines["own A"], lambda i: names[0]),
             f"expert lora engine (own A), {slots} adapters": (engines["own A"], lambda i: names[i % slots]),
             f"expert lora engine (shared A), {slots} adapters": (engines["shared A"], lambda i: names[i % slots])}
    runs = {k: [] for k in cases}
    for _ in range(reps):
        prompts = [list(map(int, rng.integers(3, model.cfg.vocab_size, rng.integers(64, 129)))) for _ in range(c)]
        for k, (eng, pick) in cases.items():
            runs[k].append(wave(eng, [(p, pick(i)) for i, p in enumerate(prompts)], gen))
    roof_base = decode_bytes(base.model, c, 96 + gen / 2, 16)["total_bytes"]
    per = {"dense": factor_bytes(dense), "own A": engines["own A"].lora_bytes // slots,
           "shared A": engines["shared A"].lora_bytes // slots}  # (upper bound: the dense slot 0 counted in)
    out = dict(model="tiny-k3" if quick else "k3-small", concurrency=c, gen=gen, reps=reps, rank=rank, max_loras=slots,
               lora_bytes={"dense": dense.lora_bytes, **{k: e.lora_bytes for k, e in engines.items()}},
               adapter_load_s={k: med(v) for k, v in load_s.items()},
               compiles_after_warmup=sum(e.stats()["compiles_after_warmup"] for e in (dense, *engines.values())),
               cases={})
    kind = lambda k: "dense" if "dense" in k else "shared A" if "shared" in k else "own A"  # noqa: E731
    summarize(out, runs, slots, roof_base, lambda k: per[kind(k)], bw, "expert lora engine (own A), base rows", log)
    return out


def part_peft(quick: bool, log, experts: bool = False) -> dict:
    import peft
    import torch

    torch.set_num_threads(2)
    tmp = tempfile.mkdtemp()
    path, hf, _ = build_kimi_linear(f"{tmp}/ckpt", quick)
    rank = 4 if quick else 16
    torch.manual_seed(1)
    pm = peft.get_peft_model(hf, peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj",
                        "g_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj", "down_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if experts else None))
    with torch.no_grad():  # peft's random B is large at this width; keep the adapter a perturbation
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.mul_(0.1)
    pm.eval()
    pm.save_pretrained(f"{tmp}/adapter")
    c, plen, gen = (4, 32, 8) if quick else (8, 128, 32)
    model = k3jax.load_model(path)
    eng = Engine(model, EngineConfig(max_model_len=256, page_size=16, cache_bytes=64 << 20, max_num_seqs=c,
                                     decode_buckets=(c,), prefill_buckets=(4,), context_buckets=(16,),
                                     max_loras=1, max_lora_rank=rank,
                                     lora_target_modules=("all-linear", "experts") if experts else None),
                 progress=False)
    eng.add_lora(LoRARequest("a", 1, f"{tmp}/adapter"))
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(1 if quick else 2):
        prompts = [list(map(int, rng.integers(3, 500, plen))) for _ in range(c)]
        w = wave(eng, [(p, "a") for p in prompts], gen)
        hf_s, hf_toks = hf_generate(pm, prompts, gen)
        same = sum(list(map(int, a)) == list(b) for a, b in zip(hf_toks, w["token_ids"]))
        rows.append(dict(engine_gen_tok_s=w["gen_tok_s"], peft_gen_tok_s=c * gen / hf_s,
                         ratio=w["gen_tok_s"] / (c * gen / hf_s), greedy_identical=f"{same}/{c}"))
        log(f"  engine {rows[-1]['engine_gen_tok_s']:.1f} vs PEFT {rows[-1]['peft_gen_tok_s']:.1f} gen tok/s "
            f"({rows[-1]['ratio']:.2f}x), greedy identical {same}/{c}")
    return dict(model="Kimi-Linear structure (HF-written)", rank=rank, concurrency=c, prompt_len=plen, gen=gen,
                waves=rows, ratio_median=med([r["ratio"] for r in rows]))


def main(argv=None):
    args, out, log, t_start, result = bench_start("lora", __doc__, argv)
    bw = result["bandwidth"]
    log(f"bandwidth {bw['GBps']:.1f} GB/s; part 1: adapter slots on k3-small")
    result["slots"] = part_k3_small(args.quick, bw["GBps"], log)
    log("part 2: engine vs PEFT on a Kimi-Linear checkpoint")
    result["peft"] = part_peft(args.quick, log)
    log("part 3: adapters on the routed experts too, k3-small")
    result["expert_slots"] = part_experts(args.quick, bw["GBps"], log)
    log("part 4: engine vs PEFT with the routed experts adapted (target_parameters)")
    result["peft_experts"] = part_peft(args.quick, log, experts=True)
    write_result(result, out, t_start, log)


if __name__ == "__main__":
    main()
