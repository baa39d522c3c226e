"""A bfloat16 model served on CPU: dots summed in fp32 and run natively, no weight converted per step,
outputs within bf16 rounding of the fp32 model's (`k3jax/layers/linear.matmul`, `k3jax/dequantize.py`).

Before, a bf16 engine on the 2-core Xeon host ran 5x slower than the fp32 one (k3-small decode step at
1 row: 121 vs 24 ms): XLA:CPU rewrites bf16 -> bf16 dots, and single-row or batched bf16 dots, to fp32,
converting every weight on every step, and hoisted the conversion of whole expert stacks out of the
grouped matmul's loop."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import k3jax
from k3jax.layers.linear import Linear
from k3jax.layers.moe import MoE
from serve.engine import Engine, EngineConfig
from serve.types import SamplingParams

PROMPTS = [list(range(5, 29)), list(range(40, 64)), [3] * 12 + [7] * 12]  # one length: one forward compile per dtype


@pytest.fixture(scope="module")
def models():
    return {dt: k3jax.load_model("tiny-k3", dtype=dt, seed=3) for dt in ("float32", "bfloat16")}


@pytest.fixture(scope="module")
def engine(models):
    # one decode row (the single-row form) and a 4 x 32 prefill (many rows): two programs (CI time)
    cfg = EngineConfig(max_model_len=128, page_size=16, cache_bytes=4 << 20, max_num_seqs=1, prefill_chunk=32,
                       max_prefill_seqs=4, max_num_batched_tokens=256, decode_buckets=(1,), prefill_buckets=(4,),
                       context_buckets=(8,), max_logprobs=1, enable_prefix_caching=False, measure_moe_time=False)
    return Engine(models["bfloat16"], cfg, warmup=True, progress=False)


def _weight_converts(hlo: str, shapes: set) -> list[str]:
    """Instructions of the compiled program that make an fp32 array of a weight's shape (either layout)
    out of the step's weight arguments: a weight converted whole. Instructions inside fusion bodies are
    computed element by element where the fusion reads them (a gathered embedding row): not counted."""
    fused = set(re.findall(r"calls=(%[\w.\-]+)", hlo))
    out, inside = [], False
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?(%[\w.\-]+) \(.*\{$", line)
        if head:
            inside = head.group(1) in fused
            continue
        # a convert (or a loop fusion of one) of the step's weight arguments; dots (kCustom) emit fp32 too
        m = re.search(r"= f32\[([\d,]+)\]\S* \w+\(.*%leaves_", line)
        conv = "convert" in line.split("metadata")[0] and "kind=kCustom" not in line
        if not inside and m and conv and tuple(int(d) for d in m.group(1).split(",")) in shapes:
            out.append(line.strip()[:240])
    return out


def test_bf16_step_programs_convert_no_weight(engine):
    """The decode program (1 row) and the prefill program (4 x 32 tokens) keep every dense weight bf16: no
    fp32 copy of any 2-D weight is made inside a step (the routed experts are fp32 from start-up)."""
    module = nnx.merge(engine.model.graphdef, engine.model.params)
    # projections and the LM head; left out: the router (read in fp32 by the spec) and kv_b_proj, which
    # MLA multiplies per head (a batched dot, which XLA:CPU only runs in fp32: `matmul` widens it)
    leaves = [n.weight[...] for p, n in nnx.iter_graph(module) if isinstance(n, Linear) and p[-1] != "kv_b_proj"]
    leaves.append(module.lm_head[...])
    assert len(leaves) > 20 and all(x.dtype == jnp.bfloat16 for x in leaves)
    shapes = {tuple(x.shape) for x in leaves} | {tuple(x.shape[::-1]) for x in leaves}
    experts = [x for x in jax.tree.leaves(engine.model.params) if x.ndim == 3 and x.dtype == jnp.float32]
    assert experts, "routed experts are expanded to fp32 on CPU"
    for rows, t in ((1, 1), (4, 32)):
        hlo = engine.lower_step(engine._pad_batch(rows, t, 8, [])).compile().as_text()  # 8 pages: the context bucket
        conv = _weight_converts(hlo, shapes)
        assert not conv, f"rows {rows}, t {t}:\n" + "\n".join(conv)


def _prompt_logprobs(model, prompt: list[int]) -> np.ndarray:
    """Each prompt token's logprob after the ones before it, from the model's plain forward."""
    logits = np.asarray(model.forward(np.array([prompt])), np.float64)[0, :-1]
    top = logits.max(-1, keepdims=True)
    lsm = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return lsm[np.arange(len(prompt) - 1), prompt[1:]]


def test_bf16_engine_is_within_bf16_rounding_of_fp32(engine, models):
    """Prompt logprobs (teacher-forced, so all score the same tokens) of the bf16 engine against the fp32
    model's forward: within 1.5x of the bf16 model's own forward error (a random tiny model's bf16
    rounding flips some routing decisions, so that error is not small), and closer to the bf16 forward
    than that forward is to fp32."""
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    ids = [engine.add_request(p, sp) for p in PROMPTS]
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    errs = {"engine": [], "forward": [], "engine_vs_forward": []}
    for rid, prompt in zip(ids, PROMPTS):
        got = np.array([lp.chosen.logprob for lp in done[rid].prompt_logprobs[1:]])  # the prompt token's, per position
        want = {dt: _prompt_logprobs(models[dt], prompt) for dt in models}
        errs["engine"] += list(np.abs(got - want["float32"]))
        errs["forward"] += list(np.abs(want["bfloat16"] - want["float32"]))
        errs["engine_vs_forward"] += list(np.abs(got - want["bfloat16"]))
        assert len(done[rid].outputs[0].token_ids) == 4
    mean = {k: float(np.mean(v)) for k, v in errs.items()}
    assert 0 < mean["engine"] <= 1.5 * mean["forward"], mean
    assert mean["engine_vs_forward"] <= mean["forward"], mean
    s = engine.stats()
    assert s["compiles_after_warmup"] == 0 and s["arena_free_units"] == s["arena_baseline_free_units"]


def _generate(engine, prompts, sp) -> list[list[int]]:
    ids = [engine.add_request(p, sp) for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return [list(done[r]) for r in ids]


def test_stale_arena_words_never_reach_the_outputs(engine):
    """A page's positions past a row's last token, and the pages a step gathers past the row's own, hold
    whatever their units held before (a freed KDA slot's state words, another layer's latents). Read as bf16
    latent pairs such words are NaN or inf at times; the attention masks their scores, and must also keep
    their values out of the context product (0 x NaN is NaN). With every free unit filled with NaN bit
    patterns the same prompts give the same tokens (before the fix: every token 0)."""
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    want = _generate(engine, PROMPTS, sp)
    alloc = engine.allocator
    free = np.flatnonzero(alloc.owner == alloc.FREE)
    assert len(free) == alloc.free_units
    nan = np.uint32(0x3F807FC0).view(np.float32)  # a finite float32 whose low half is a bf16 NaN
    engine.arena = engine.arena.at[free].set(nan)
    assert _generate(engine, PROMPTS, sp) == want
    assert engine.stats()["compiles_after_warmup"] == 0


def test_bf16_dense_experts_are_widened_on_cpu():
    """A bf16 model with dense (non-MXFP4) routed experts, Kimi-Linear's form: the CPU engine holds them in
    fp32 too (a bf16 grouped-matmul loop converts the whole stack every step), the rest in bf16."""
    model = k3jax.load_model("tiny-kimi-linear", dtype="bfloat16", seed=1)
    eng = Engine(model, EngineConfig(max_model_len=64, page_size=16, cache_bytes=1 << 20, max_num_seqs=2,
                                     decode_buckets=(2,), prefill_buckets=(1,), context_buckets=(4,)),
                 warmup=False, progress=False)
    def experts(m):
        return [getattr(n, w)[...] for _, n in nnx.iter_graph(nnx.merge(m.graphdef, m.params))
                if isinstance(n, MoE) for w in ("w1", "w2", "w3")]

    assert experts(eng.model) and all(w.dtype == jnp.float32 for w in experts(eng.model))
    assert all(w.dtype == jnp.bfloat16 for w in experts(model))  # the loaded model is left as it was
    dense = [x for x in jax.tree.leaves(eng.model.params) if x.ndim == 2 and x.size >= 1024]
    assert dense and all(x.dtype == jnp.bfloat16 for x in dense)


def test_llm_update_weights_loads_a_preset_in_the_engines_dtype(engine):
    """`LLM.update_weights(preset)` loads the preset in the engine's dtype (it loaded float32 whatever the
    engine's, which a bf16 engine refused: "... is float32[...], the engine's bfloat16[...]")."""
    from serve.llm import LLM

    llm = LLM.__new__(LLM)
    llm.engine, llm.model = engine, engine.model
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(PROMPTS[:1], sp, use_tqdm=False)]
    llm.update_weights("tiny-k3", seed=3)  # the engine's own weights again
    assert [o.token_ids for o in llm.generate(PROMPTS[:1], sp, use_tqdm=False)] == want
    assert engine.counters["weight_updates"] == 1 and engine.stats()["compiles_after_warmup"] == 0
