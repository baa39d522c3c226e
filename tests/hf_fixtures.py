"""Tiny random Kimi-Linear checkpoints written by HF transformers, for parity tests.

Reference = ``transformers.KimiLinearForCausalLM`` (transformers 5.23, torch CPU, float32).
Without ``fla`` / ``causal_conv1d`` / ``kernels`` installed, transformers runs its own
pure-torch KDA code: ``chunk_kimi_delta_attention`` (chunk 64) for every multi-token
forward and prefill, ``recurrent_kimi_delta_attention`` + ``causal_conv1d_update`` for
single-token decode steps. Nothing is substituted here. We force
``attn_implementation="eager"`` and ``experts_implementation="eager"`` (the plain
reference loops) so the reference does not depend on sdpa / grouped_mm dispatch.

See tests/HF_NOTES.md for what HF writes to disk (names, shapes, config keys).

Public API
----------
make_hf_kimi_linear(out_dir, variant, seed) -> (path, hf_model)
hf_logits(hf_model, ids) -> np.float32 [B, T, V]
hf_greedy(hf_model, ids, n) -> np.int64 [B, n]        (model.generate, greedy, with cache)
hf_logits_and_router_stats(hf_model, ids) -> (logits, router min margin, bias fraction)   (one forward)
logit_top2_margin(logits) -> float
make_prompt(variant, seed, batch, length) -> np.int64 [B, T]
VARIANTS: dict of variant name -> spec
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from transformers import GenerationConfig, KimiLinearConfig, KimiLinearForCausalLM

# --------------------------------------------------------------------------------------
# Variants. Layer lists in linear_attn_config are 1-based (as in the real checkpoints).
# --------------------------------------------------------------------------------------
VARIANTS: dict[str, dict] = {
    # (a) KDA+dense, KDA+MoE, KDA+MoE, MLA+MoE; no q-LoRA; routed_scaling_factor 1.0.
    "a4": dict(
        config=dict(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            num_experts=8,
            num_experts_per_token=2,
            num_shared_experts=1,
            routed_scaling_factor=1.0,
            linear_attn_config=dict(
                kda_layers=[1, 2, 3], full_attn_layers=[4], head_dim=16, num_heads=4, short_conv_kernel_size=4
            ),
        ),
        sharded=False,
        dense_mlp_name="hf",  # layer-0 dense MLP saved as HF 5.23 writes it: block_sparse_moe.{gate,up,down}_proj
    ),
    # (b) MLA first (with the dense MLP) and last; q-LoRA; KDA heads != MLA heads; v_head_dim != qk_nope;
    #     16 experts top-4, 2 shared experts, routed_scaling_factor 2.446; real-checkpoint name mlp.* for layer 0.
    "b5_qlora": dict(
        config=dict(
            vocab_size=320,
            hidden_size=96,
            intermediate_size=160,
            moe_intermediate_size=24,
            num_hidden_layers=5,
            num_attention_heads=6,
            num_key_value_heads=6,
            q_lora_rank=40,
            kv_lora_rank=48,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=24,
            num_experts=16,
            num_experts_per_token=4,
            num_shared_experts=2,
            routed_scaling_factor=2.446,
            linear_attn_config=dict(
                kda_layers=[2, 3, 4], full_attn_layers=[1, 5], head_dim=32, num_heads=3, short_conv_kernel_size=4
            ),
        ),
        sharded=False,
        dense_mlp_name="mlp",  # rewritten after save to the real Kimi-Linear name model.layers.0.mlp.*
    ),
    # (c) 6 layers, vocab 512, sharded safetensors (model.safetensors.index.json).
    "c6_sharded": dict(
        config=dict(
            vocab_size=512,
            hidden_size=80,
            intermediate_size=144,
            moe_intermediate_size=40,
            num_hidden_layers=6,
            num_attention_heads=5,
            num_key_value_heads=5,
            q_lora_rank=None,
            kv_lora_rank=40,
            qk_nope_head_dim=24,
            qk_rope_head_dim=16,
            v_head_dim=16,
            num_experts=12,
            num_experts_per_token=3,
            num_shared_experts=1,
            routed_scaling_factor=2.446,
            linear_attn_config=dict(
                kda_layers=[1, 2, 4, 5], full_attn_layers=[3, 6], head_dim=16, num_heads=5, short_conv_kernel_size=4
            ),
        ),
        sharded=True,
        max_shard_size="400KB",
        dense_mlp_name="hf",
    ),
}

# Seeds chosen (see /tmp search, reported in HF_NOTES.md) so that, for the standard test prompt,
# router top-k margins and greedy top-1/top-2 logit margins are far from ties.
DEFAULT_SEEDS: dict[str, int] = {"a4": 26, "b5_qlora": 31, "c6_sharded": 20}

# Keys of the real Kimi-Linear config.json that HF does not need but writes through (kwargs are kept).
_REAL_STYLE_EXTRA = dict(
    model_type="kimi_linear",
    hidden_act="silu",
    rms_norm_eps=1e-5,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    moe_renormalize=True,
    moe_router_activation_func="sigmoid",
    use_grouped_topk=True,
    num_expert_group=1,
    topk_group=1,
    mla_use_nope=True,
    num_nextn_predict_layers=0,
    tie_word_embeddings=False,
)


def _special_ids(vocab: int) -> dict:
    # Mirror the real layout (specials at the top of the vocab); prompts never use them.
    return dict(bos_token_id=vocab - 3, pad_token_id=vocab - 2, eos_token_id=vocab - 1)


def make_config(variant: str) -> KimiLinearConfig:
    spec = VARIANTS[variant]
    kw = {} if spec.get("hf_native") else dict(_REAL_STYLE_EXTRA)  # hf_native: only the keys HF itself names
    kw.update(spec["config"])
    kw.update(_special_ids(kw["vocab_size"]))
    return KimiLinearConfig(**kw)


# --------------------------------------------------------------------------------------
# Random re-initialisation (non-trivial values everywhere, incl. A_log / dt_bias / conv / norms / bias)
# --------------------------------------------------------------------------------------
@torch.no_grad()
def _reinit_(model: KimiLinearForCausalLM, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=g, dtype=torch.float32) * (hi - lo) + lo

    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        shape = tuple(p.shape)
        if name.endswith("embed_tokens.weight"):
            v = normal(shape, 1.0)
        elif name.endswith("A_log"):
            # per-head decay rate exp(A_log) in [e^-3, e^1.5]: mixes long- and short-memory heads
            v = uniform(shape, -3.0, 1.5)
        elif name.endswith("dt_bias"):
            v = normal(shape, 1.0, mean=-1.5)
        elif name.endswith("conv1d.weight"):
            v = normal(shape, 0.4)
        elif name.endswith("e_score_correction_bias"):
            # large enough to change the selected experts for many tokens (sigmoid scores live in (0,1))
            v = normal(shape, 0.15)
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            # input/post/final/q_a/kv_a RMSNorm and the KDA gated o_norm
            v = normal(shape, 0.2, mean=1.0)
        elif name.endswith("mlp.gate.weight"):
            v = normal(shape, 1.2 / math.sqrt(shape[-1]))
        elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            v = normal(shape, 1.0 / math.sqrt(shape[-1]))
        elif name.endswith("lm_head.weight"):
            v = normal(shape, 1.5 / math.sqrt(shape[-1]))
        elif p.dim() == 2:  # every other nn.Linear ([out, in]; num_shared_experts=0's are empty)
            v = normal(shape, 1.0 / math.sqrt(max(shape[-1], 1)))
        else:
            raise AssertionError(f"unhandled tensor {name} {shape}")
        p.copy_(v.to(p.dtype))


def _build_model(variant: str, seed: int) -> KimiLinearForCausalLM:
    cfg = make_config(variant)
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM._from_config(
        cfg, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    )
    _reinit_(model, seed)
    return model.eval()


def _rename_dense_mlp_to_real(path: Path) -> None:
    """HF 5.23 save_pretrained writes layer 0's dense MLP as block_sparse_moe.{gate,up,down}_proj (its MoE rename is
    reversed for every layer). The released Kimi-Linear checkpoint calls it mlp.{gate,up,down}_proj. Rewrite."""
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    sd = load_file(str(f))
    out = {}
    for k, v in sd.items():
        if ".block_sparse_moe." in k and any(k.endswith(f".{n}_proj.weight") and ".experts." not in k and ".shared_experts." not in k for n in ("gate", "up", "down")):
            k = k.replace(".block_sparse_moe.", ".mlp.")
        out[k] = v
    save_file(out, str(f), metadata={"format": "pt"})


def make_hf_kimi_linear(out_dir, variant: str, seed: int | None = None):
    """Build a tiny random float32 KimiLinearForCausalLM, save_pretrained(safe_serialization=True) to out_dir,
    reload it from disk with from_pretrained (so the returned model is exactly what HF reads back) and check the
    reloaded logits equal the in-memory ones bit-for-bit. Returns (path, hf_model)."""
    if seed is None:
        seed = DEFAULT_SEEDS[variant]
    spec = VARIANTS[variant]
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    model = _build_model(variant, seed)
    kw = dict(safe_serialization=True)
    if spec.get("sharded"):
        kw["max_shard_size"] = spec["max_shard_size"]
    model.save_pretrained(str(path), **kw)
    if spec.get("dense_mlp_name") == "mlp":
        _rename_dense_mlp_to_real(path)
    if spec.get("sharded"):
        assert (path / "model.safetensors.index.json").exists(), "expected a sharded checkpoint"

    reloaded = KimiLinearForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    probe = make_prompt(variant, seed + 1, batch=1, length=70)
    a, b = hf_logits(model, probe), hf_logits(reloaded, probe)
    assert np.array_equal(a, b), f"HF reload mismatch for {variant}: max|d|={np.abs(a - b).max()}"
    return str(path), reloaded


# --------------------------------------------------------------------------------------
# Reference outputs
# --------------------------------------------------------------------------------------
def make_prompt(variant: str, seed: int, batch: int = 2, length: int = 150) -> np.ndarray:
    vocab = VARIANTS[variant]["config"]["vocab_size"]
    rng = np.random.default_rng(10_000 + seed)
    return rng.integers(0, vocab - 3, size=(batch, length), dtype=np.int64)  # never the 3 special ids


@torch.no_grad()
def hf_logits(hf_model, ids) -> np.ndarray:
    ids_t = torch.as_tensor(np.asarray(ids), dtype=torch.long)
    out = hf_model(input_ids=ids_t, use_cache=False)
    return out.logits.float().numpy()


@torch.no_grad()
def hf_greedy(hf_model, ids, n: int) -> np.ndarray:
    """Greedy tokens from HF model.generate(do_sample=False) (KV/recurrent cache: chunked KDA prefill, then
    recurrent single-token KDA + conv-state updates + cached MLA). EOS stopping is disabled."""
    ids_t = torch.as_tensor(np.asarray(ids), dtype=torch.long)
    gc = GenerationConfig(
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=hf_model.config.pad_token_id,
        bos_token_id=hf_model.config.bos_token_id,
        use_cache=True,
    )
    # A None in the passed GenerationConfig does not override the model's own generation_config.eos_token_id
    # (it would still stop at EOS); clear it on the model for the duration of the call.
    saved_eos = hf_model.generation_config.eos_token_id
    hf_model.generation_config.eos_token_id = None
    try:
        out = hf_model.generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t), generation_config=gc)
    finally:
        hf_model.generation_config.eos_token_id = saved_eos
    new = out[:, ids_t.shape[1]:].numpy()
    assert new.shape == (ids_t.shape[0], n), new.shape
    return new.astype(np.int64)


@torch.no_grad()
def hf_logits_and_router_stats(hf_model, ids) -> tuple[np.ndarray, float, float]:
    """One cache-free forward of `ids` with forward hooks on every router -> (float32 logits as `hf_logits`
    gives them, the smallest gap over all MoE layers and tokens between the k-th and (k+1)-th largest selection
    score sigmoid(logit) + e_score_correction_bias, the fraction of (layer, token) decisions whose expert set
    differs with vs without the correction bias)."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter

    gaps, diff, tot = [], [0], [0]

    def hook(mod, inp, _out):
        x = inp[0].reshape(-1, mod.hidden_dim).float()
        s = torch.sigmoid(x @ mod.weight.float().T)
        top = torch.topk(s + mod.e_score_correction_bias.float(), mod.top_k + 1, dim=-1).values
        gaps.append((top[:, mod.top_k - 1] - top[:, mod.top_k]).min().item())
        a = torch.topk(s + mod.e_score_correction_bias, mod.top_k, -1).indices.sort(-1).values
        b = torch.topk(s, mod.top_k, -1).indices.sort(-1).values
        diff[0] += int((a != b).any(-1).sum())
        tot[0] += a.shape[0]

    hs = [m.register_forward_hook(hook) for m in hf_model.modules() if isinstance(m, KimiLinearTopkRouter)]
    try:
        logits = hf_logits(hf_model, ids)
    finally:
        for h in hs:
            h.remove()
    return logits, float(min(gaps)), diff[0] / max(tot[0], 1)


def logit_top2_margin(logits) -> float:
    """Smallest top-1 minus top-2 gap over the leading positions of a [..., V] logits array."""
    x = np.sort(np.asarray(logits, dtype=np.float64), axis=-1)
    return float((x[..., -1] - x[..., -2]).min())


def saved_tensor_names(path) -> dict:
    """name -> shape for every tensor in the saved checkpoint (single file or sharded)."""
    from safetensors import safe_open

    path = Path(path)
    idx = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(idx.read_text())["weight_map"].values())) if idx.exists() else ["model.safetensors"]
    out = {}
    for fn in files:
        with safe_open(str(path / fn), "pt") as f:
            for k in f.keys():
                out[k] = tuple(f.get_slice(k).get_shape())
    return out
