"""LoRA on the routed experts (k3jax/lora.py `ExpertLoRA`, serve/lora.py) against PEFT, a reference we did
not write.

PEFT adapts transformers' fused expert parameters (`target_parameters`: `mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`; its `ParamWrapper` folds each expert's `B_e A_e` into the weight) beside dense
projections. The engine serves such adapters with per-expert factors, one with every expert's own A and
one whose experts share an A (the miles K3 recipe) given in the per-expert naming vLLM / SGLang / miles
use, with an A tensor for all experts; rows of each and of the base model run in one batch and are
compared teacher-forced with `PeftModel`.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.parity

import hf_fixtures as hfx  # noqa: E402

from k3jax import load_model  # noqa: E402
from k3jax.lora import slot_bytes  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.lora import LoRAError, LoRARequest  # noqa: E402
from test_lora import _run, _write_adapter, check_against_peft  # noqa: E402

VARIANT = "b5_qlora"
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
N_EXP, INTER, HIDDEN = 16, 24, 96


def _share_a(pm, adapter: str) -> None:
    """Give every expert of `adapter`'s expert factors expert 0's A (PEFT's layout: rows [E r, in])."""
    for name, mod in pm.named_modules():
        if hasattr(mod, "num_experts") and mod.num_experts > 1 and adapter in getattr(mod, "lora_A", {}):
            w = mod.lora_A[adapter].weight
            r = w.shape[0] // mod.num_experts
            with torch.no_grad():
                w.copy_(w[:r].repeat(mod.num_experts, 1))


def _per_expert_names(src: str, dst: str, conf: dict) -> str:
    """Rewrite a PEFT fused-parameter adapter (experts sharing A) in the per-expert naming, the shared A
    once per matrix (`experts.w1.lora_A.weight`), B per expert -- the math of PEFT's ParamWrapper."""
    from safetensors.numpy import load_file

    out = {}
    for name, x in load_file(f"{src}/adapter_model.safetensors").items():
        if ".mlp.experts." not in name:
            out[name] = x
            continue
        if not name.endswith("lora_A.weight"):
            continue
        b = load_file(f"{src}/adapter_model.safetensors")[name.replace("lora_A", "lora_B")]
        layer = name.split(".mlp.experts")[0]
        r = x.shape[0] // N_EXP
        a0, be = x[:r], b.reshape(b.shape[0], r, N_EXP)
        parts = {"w1": (slice(0, INTER),), "w3": (slice(INTER, 2 * INTER),)} if x.shape[1] == HIDDEN else {"w2": (slice(None),)}
        for w, (rows,) in parts.items():
            out[f"{layer}.block_sparse_moe.experts.{w}.lora_A.weight"] = np.ascontiguousarray(a0)
            for e in range(N_EXP):
                out[f"{layer}.block_sparse_moe.experts.{e}.{w}.lora_B.weight"] = np.ascontiguousarray(be[rows, :, e])
    return _write_adapter(dst, out, **conf)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """(checkpoint dir, PeftModel with adapters "own" (per-expert A) and "shared" (experts share A), their
    directories, the shared one also in the per-expert naming)."""
    root = tmp_path_factory.mktemp("lora_experts")
    path, hf = hfx.make_hf_kimi_linear(str(root / "ckpt"), VARIANT)
    torch.manual_seed(1)
    own = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "down_proj"],
                          target_parameters=EXPERT_PARAMS, init_lora_weights=False)
    shared = peft.LoraConfig(r=3, lora_alpha=4, target_modules=[], target_parameters=EXPERT_PARAMS,
                             init_lora_weights=False)
    pm = peft.get_peft_model(hf, own, adapter_name="own")
    pm.add_adapter("shared", shared)
    _share_a(pm, "shared")
    pm.eval()
    pm.save_pretrained(str(root / "adapters"))
    dirs = {"own": str(root / "adapters" / "own"), "shared": str(root / "adapters" / "shared")}
    dirs["shared_named"] = _per_expert_names(dirs["shared"], str(root / "shared_named"), {"r": 3, "lora_alpha": 4})
    return path, pm, dirs


def _engine(path, **kw):
    return Engine(load_model(path), EngineConfig(
        max_model_len=256, page_size=16, cache_bytes=24 << 20, max_num_seqs=4, decode_buckets=(4,),
        prefill_buckets=(2,), context_buckets=(16,), max_num_batched_tokens=256, max_loras=2, max_lora_rank=4,
        lora_target_modules=("all-linear", "experts"), measure_moe_time=False, **kw), progress=False)  # (CI time)


@pytest.fixture(scope="module")
def engine(ref):
    return _engine(ref[0])


def test_expert_adapters_match_peft_in_one_batch(engine, ref):
    """Rows with per-expert A, rows with a shared A (per-expert naming) and base rows in one batch: each
    row's greedy tokens and logprobs are PEFT's for its adapter; the expert factors change the outputs."""
    _, pm, dirs = ref
    engine.add_lora(LoRARequest("own", 1, dirs["own"]))
    engine.add_lora(LoRARequest("shared", 2, dirs["shared_named"]))
    prompts = hfx.make_prompt(VARIANT, 11, batch=3, length=70)
    reqs = [(prompts[0], "own"), (prompts[1], None), (prompts[2], "shared"), (prompts[0], "shared"),
            (prompts[0], None)]
    outs = _run(engine, reqs)
    check_against_peft(pm, reqs, outs, {None: None, "own": "own", "shared": "shared"})
    toks = [out.outputs[0].token_ids for out in outs]
    assert toks[0] != toks[4] and toks[3] != toks[4] and toks[0] != toks[3]
    stats = engine.stats()
    assert stats["compiles_after_warmup"] == 0
    # dense projections: 3 slots (the base one too); expert matrices: 2
    dense = slot_bytes(engine.cfg, engine.model.dtype, 4, ("all-linear",))
    assert stats["lora_bytes"] == 3 * dense + 2 * (slot_bytes(engine.cfg, engine.model.dtype, 4,
                                                              ("all-linear", "experts")) - dense)


def test_fused_form_equals_per_expert_form(engine, ref):
    """The shared adapter read in PEFT's fused-parameter form writes the same slot contents as in the
    per-expert naming; swapping it in gives the same tokens."""
    _, _, dirs = ref
    p = hfx.make_prompt(VARIANT, 12, batch=1, length=30)[0]
    want = _run(engine, [(p, "shared")])[0].outputs[0].token_ids
    engine.remove_lora("shared")
    engine.add_lora(LoRARequest("shared", 2, dirs["shared"]))
    assert _run(engine, [(p, "shared")])[0].outputs[0].token_ids == want


def test_shared_a_engine_and_errors(ref, tmp_path):
    """`lora_experts_shared_a`: A slots of one expert, the shared adapter served as PEFT serves it; an
    adapter whose experts' A differ is refused naming the tensor; experts without slots refuse expert
    factors; bad expert tensors name what is wrong, and nothing is loaded."""
    path, pm, dirs = ref
    eng = _engine(path, lora_experts_shared_a=True, max_cpu_loras=2)
    eng.add_lora(LoRARequest("shared", 1, dirs["shared"]))
    with pytest.raises(LoRAError, match=r"mlp\.experts\.(base_layer\.)?lora_A\.weight: lora_A of experts 0 and 1 "
                                        r"differ.*lora_experts_shared_a"):
        eng.add_lora(LoRARequest("own", 2, dirs["own"]))
    prompts = hfx.make_prompt(VARIANT, 13, batch=2, length=40)
    reqs = [(prompts[0], "shared"), (prompts[1], None)]
    check_against_peft(pm, reqs, _run(eng, reqs), {None: None, "shared": "shared"})
    b = "base_model.model.model.layers.1.block_sparse_moe.experts"
    ok_a, ok_b = np.ones((2, HIDDEN), np.float32), np.ones((INTER, 2), np.float32)
    cases = [
        ({f"{b}.16.w1.lora_A.weight": ok_a, f"{b}.16.w1.lora_B.weight": ok_b}, "expert 16 is out of range"),
        ({f"{b}.3.w1.lora_A.weight": ok_a}, r"expert_lora\.w1: lora_B is missing"),
        ({f"{b}.3.w1.lora_A.weight": ok_a, f"{b}.3.w1.lora_B.weight": np.ones((INTER + 1, 2), np.float32)},
         r"3\.w1\.lora_B\.weight: shape \[25, 2\], expected \[24, 2\]"),
        ({f"{b}.w2.lora_A.weight": ok_a, f"{b}.0.w2.lora_B.weight": np.ones((HIDDEN, 2), np.float32)},
         r"w2\.lora_A\.weight: shape \[2, 96\], the expert matrix takes \[r, 24\]"),
        ({"base_model.model.model.layers.1.mlp.experts.lora_A.weight": np.ones((32, 24), np.float32),
          "base_model.model.model.layers.1.mlp.experts.lora_B.weight": np.ones((95, 32), np.float32)},
         "neither the experts' gate_up_proj"),
    ]
    for k, (tensors, match) in enumerate(cases):
        with pytest.raises(LoRAError, match=match):
            eng.add_lora(LoRARequest(f"bad{k}", 5 + k, _write_adapter(str(tmp_path / f"bad{k}"), tensors)))
    assert eng.list_loras() == ["shared"]
    dense_only = Engine(load_model(path), EngineConfig(max_model_len=256, cache_bytes=8 << 20, max_loras=1,
                                                       max_lora_rank=4), warmup=False)
    with pytest.raises(LoRAError, match=r"mlp\.experts.*routed experts only when lora_target_modules names 'experts'"):
        dense_only.add_lora(LoRARequest("own", 1, dirs["own"]))


_EP = r'''
import os
# the test run's XLA flags (tests/conftest.py: cheaper CPU codegen) kept, 4 CPU devices added
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from k3jax import lora
from k3jax.config import get_preset
from k3jax.layers.moe import MoE

out = {}
for name in ("tiny-kimi-linear", "tiny-k3"):
    for shared in (False, True):
        cfg = get_preset(name)
        cfg = __import__("dataclasses").replace(cfg, expert_format="dense")
        moe = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
        e, s, r, d, i = cfg.num_experts, 3, 4, cfg.expert_in_size, cfg.moe_intermediate_size
        rng = np.random.default_rng(1)
        moe.expert_lora = lora.ExpertLoRA({w: lora.ExpertFactors(e, s, r, *dims, jnp.float32, shared)
                                           for w, dims in (("w1", (d, i)), ("w3", (d, i)), ("w2", (i, d)))})
        for w in ("w1", "w3", "w2"):
            f = getattr(moe.expert_lora, w)
            f.lora_a.set_value(jnp.asarray(rng.normal(0, 0.5, f.lora_a.shape), jnp.float32))
            f.lora_b.set_value(jnp.asarray(rng.normal(0, 0.5, f.lora_b.shape), jnp.float32))
        x = jnp.asarray(rng.normal(size=(6, 5, cfg.hidden_size)), jnp.float32)  # [B, T, H]
        slots = jnp.asarray([2, 0, 3, 1, 0, 2], jnp.int32)
        base = jax.jit(lambda x: moe(x))(x)  # compiled as the expert-parallel term below (not op by op: CI time)
        with lora.rows(slots):
            one = jax.jit(lambda x: moe(x))(x)
        mesh = jax.make_mesh((4,), ("ep",))
        moe.expert_parallel = (mesh, "ep")
        split = lambda v, spec: jax.device_put(v, jax.sharding.NamedSharding(mesh, spec))
        for path, v in nnx.iter_graph(moe):  # experts and their factors split, everything else whole
            if isinstance(v, nnx.Variable):
                by_expert = path[-1] in ("w1", "w2", "w3", "lora_b") or (path[-1] == "lora_a" and not shared)
                v.set_value(split(v.get_value(), jax.sharding.PartitionSpec("ep" if by_expert else None)))
        with lora.rows(split(slots, jax.sharding.PartitionSpec())):
            four = jax.jit(lambda x: moe(x))(split(x, jax.sharding.PartitionSpec()))
        out[f"{name}/{shared}"] = dict(
            ep=float(jnp.max(jnp.abs(four - one))), scale=float(jnp.max(jnp.abs(one))),
            changed=[bool(jnp.any(one[b] != base[b])) for b in range(6)])
print("RESULT", __import__("json").dumps(out))
'''


def test_expert_parallel_adapter_term_equals_one_device():
    """The routed experts' adapter term with the experts (and their factors) split over 4 expert ranks equals
    one device's, for both MoE kinds and both A forms; rows of slot 0 are exactly the base model's."""
    import json
    import subprocess
    import sys

    # (-W: no flax Variable `.value` read or write, deprecated in flax 0.12; the setter's warning names flax's module)
    res = subprocess.run([sys.executable, "-W", "error:'.value':DeprecationWarning", "-c", _EP], capture_output=True,
                         text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.split("RESULT", 1)[1])
    for key, r in out.items():
        assert r["ep"] <= 1e-5 * max(1.0, r["scale"]), (key, r)
        assert r["changed"] == [True, False, True, True, False, True], (key, r)


@pytest.mark.parametrize("targets,shared", [(None, False), (["all-linear", "experts"], False),
                                            (["q_proj", "w2"], True)])
def test_info_plans_what_the_engine_allocates(capsys, targets, shared):
    """`k3jax info --max-loras` gives the bytes an engine's adapter slots take, routed experts included."""
    import json

    from k3jax.cli import main
    from k3jax.runtime import load_model as load_preset

    args = ["info", "--model", "tiny-k3", "--dtype", "float32", "--max-loras", "2", "--max-lora-rank", "4"]
    args += (["--lora-target-modules", *targets] if targets else []) + (["--lora-experts-shared-a"] if shared else [])
    assert main(args) == 0
    info = json.loads(capsys.readouterr().out)["lora"]
    eng = Engine(load_preset("tiny-k3"), EngineConfig(max_model_len=64, cache_bytes=4 << 20, max_loras=2, max_lora_rank=4,
                                                      lora_target_modules=tuple(targets) if targets else None,
                                                      lora_experts_shared_a=shared), warmup=False)
    assert info["bytes_all_slots"] == eng.lora_bytes
    assert (info["bytes_routed_experts_per_adapter"] > 0) == (targets is not None)


def test_adapter_from_tensors_python_and_http(engine, ref):
    """SGLang's `load_lora_adapter_from_tensors`, the RL loop's adapter sync: PEFT's in-memory state dict (torch
    tensors) and config give the tokens the saved directory gives, from Python and over HTTP (base64
    safetensors); a bad payload is a 400 verdict that names it and loads nothing."""
    import asyncio
    import base64
    import json

    import httpx
    from safetensors.torch import save as st_save

    from serve.api import create_app
    from serve.async_engine import AsyncEngine

    _, pm, dirs = ref
    for name in engine.list_loras():
        engine.remove_lora(name)
    engine.add_lora(LoRARequest("disk", 1, dirs["own"]))
    prompt = [int(t) for t in hfx.make_prompt(VARIANT, 14, batch=1, length=30)[0]]
    want = _run(engine, [(prompt, "disk")])[0].outputs[0].token_ids
    state = peft.get_peft_model_state_dict(pm, adapter_name="own")
    conf = json.loads(json.dumps(pm.peft_config["own"].to_dict(), default=sorted))
    engine.remove_lora("disk")
    engine.load_lora_adapter_from_tensors("mem", list(state.items()), conf)
    assert _run(engine, [(prompt, "mem")])[0].outputs[0].token_ids == want
    engine.remove_lora("mem")
    with pytest.raises(LoRAError, match="config_dict: use_dora=True"):
        engine.load_lora_adapter_from_tensors("mem", state, {**conf, "use_dora": True})
    aeng = AsyncEngine(engine)
    app = create_app(aeng, "kimi", allow_runtime_lora_updating=True)
    payload = base64.b64encode(st_save({k: v.contiguous() for k, v in state.items()})).decode()

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            body = {"lora_name": "web", "config_dict": conf, "serialized_tensors": payload}
            r = await c.post("/load_lora_adapter_from_tensors", json=body)
            assert r.status_code == 400 and "load_format" in r.json()["error_message"], r.text
            r = await c.post("/load_lora_adapter_from_tensors", json={**body, "load_format": "safetensors",
                                                                      "serialized_tensors": ["eA=="]})
            assert r.status_code == 400 and "serialized_tensors[0]: not a safetensors file" in r.json()["error_message"]
            # a bad alpha_pattern: a 400 verdict naming it (was a 500)
            r = await c.post("/load_lora_adapter_from_tensors", json={
                **body, "load_format": "safetensors", "config_dict": {**conf, "alpha_pattern": {"o_proj": "x"}}})
            assert r.status_code == 400 and "alpha_pattern['o_proj']='x'" in r.json()["error_message"], r.text
            r = await c.post("/load_lora_adapter_from_tensors", json={**body, "load_format": "safetensors"})
            assert r.status_code == 200 and r.json()["success"] and "web" in r.json()["loaded_adapters"], r.text
            r = await c.post("/v1/completions", json={"model": "web", "prompt": prompt, "max_tokens": len(want),
                                                      "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            assert r.json()["choices"][0]["token_ids"] == want, r.text
            r = await c.post("/unload_lora_adapter", json={"lora_name": "web"})
            assert r.status_code == 200 and r.json()["loaded_adapters"] == {}
            r = await c.post("/load_lora_adapter", json={"lora_name": "dir", "lora_path": "/no/such/dir"})
            assert r.status_code == 400 and "not a directory" in r.json()["error_message"]

    try:
        asyncio.run(go())
    finally:
        aeng.shutdown()
    assert engine.list_loras() == []


_EPLB = r'''
import json, os, tempfile
import numpy as np, k3jax
from safetensors.numpy import save_file
from serve.engine import Engine, EngineConfig
from serve.lora import LoRARequest

model = k3jax.load_model("tiny-k3", seed=0)
cfg = model.cfg
rng = np.random.default_rng(3)
d = tempfile.mkdtemp()
tensors = {}
for layer in (l for l in range(cfg.num_hidden_layers) if cfg.is_moe(l)):
    for w, (o, i) in {"w1": (cfg.moe_intermediate_size, cfg.expert_in_size), "w3": (cfg.moe_intermediate_size, cfg.expert_in_size),
                      "w2": (cfg.expert_in_size, cfg.moe_intermediate_size)}.items():
        for e in range(cfg.num_experts):
            name = f"base_model.model.model.layers.{layer}.block_sparse_moe.experts.{e}.{w}"
            tensors[f"{name}.lora_A.weight"] = rng.normal(0, 0.3, (3, i)).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = rng.normal(0, 0.3, (o, 3)).astype(np.float32)
save_file(tensors, os.path.join(d, "adapter_model.safetensors"))
json.dump({"peft_type": "LORA", "r": 3, "lora_alpha": 6}, open(os.path.join(d, "adapter_config.json"), "w"))
kw = dict(max_model_len=128, page_size=16, cache_bytes=64 * 16 * 2560, max_num_seqs=4, decode_buckets=(4,),
          prefill_buckets=(2,), context_buckets=(8,), measure_moe_time=False, max_loras=1, max_lora_rank=4,
          lora_target_modules=("experts",))
# built, not compiled: no step program runs (CI time, and fewer cross-device programs on a loaded 2-core host)
ep = Engine(model, EngineConfig(**kw, sharding="ep", enable_eplb=True, eplb_num_redundant_experts=2), warmup=False,
            progress=False)
ep._move_experts({l: p[::-1].copy() for l, p in enumerate(ep.eplb.placement)}, {})  # a permuted layout, with copies
ep.add_lora(LoRARequest("x", 1, d))  # written by the current placement
moe = [l for l in range(cfg.num_hidden_layers) if cfg.is_moe(l)]

def rows_follow(engine):  # every physical expert's factors are its logical expert's (both A and B: own A)
    adapter, checked = engine.loras.by_name["x"], 0
    for t in (t for t in engine._lora_leaves if t.experts):
        for g, module in enumerate(t.modules):
            at = engine.eplb.placement[moe.index(int(module.split(".")[1]))]
            for leaf, want in ((t.a, adapter.factors[module][0]), (t.b, adapter.factors[module][1])):
                x = np.asarray(engine._leaves[leaf])
                x = x[g] if t.stacked else x
                np.testing.assert_array_equal(x[:, 0], want[at], err_msg=module)
                checked += 1
    return checked

first = rows_follow(ep)
copies = int((np.bincount(ep.eplb.placement[0]) == 2).sum())
ep._move_experts({l: np.roll(p, 3) for l, p in enumerate(ep.eplb.placement)}, {})  # the factors move with their experts
print("RESULT", json.dumps(dict(first=first, moved=rows_follow(ep), copies=copies, physical=len(ep.eplb.placement[0]))))
'''


def test_expert_adapters_with_expert_load_balancing():
    """EPLB with redundant copies (2 CPU devices): an adapter written under a permuted placement lands, A and B,
    in every physical copy of each expert, and moves with the experts. (With the MoE's own physical-id
    routing and the expert-parallel term test above, the served term is then one device's.)"""
    import json
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    cwd = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", _EPLB], capture_output=True, text=True, env=env, timeout=900, cwd=cwd)
    if res.returncode != 0 and "Termination timeout for `all reduce" in res.stderr:
        # XLA:CPU aborts a collective whose device threads a loaded 2-core host starved (see test_named_weights)
        res = subprocess.run([sys.executable, "-c", _EPLB], capture_output=True, text=True, env=env, timeout=900, cwd=cwd)
    said = "\n".join(l for l in res.stderr.splitlines() if not l.lstrip().startswith("@"))
    assert res.returncode == 0, said[-3000:]
    out = json.loads(res.stdout.split("RESULT", 1)[1])
    # 7 MoE layers x 3 matrices x (A, B); 8 experts + 2 copies in 10 physical places
    assert out == dict(first=42, moved=42, copies=2, physical=10), out
