"""Config reading: K3 nesting, 1-based layer lists, missing K3 switches, presets, real shapes."""

import copy
import json
import os

import pytest

from k3jax.cache import cache_bytes
from k3jax.checkpoint import hf_config_dict
from k3jax.config import PRESETS, ConfigError, ModelConfig, from_hf_config, get_preset


def test_k3_schedule_matches_spec():
    cfg = get_preset("k3")
    assert cfg.num_mla_layers == 24 and cfg.num_kda_layers == 69
    assert cfg.mla_layers[:3] == (3, 7, 11) and cfg.mla_layers[-2:] == (91, 92)
    assert cfg.is_mla(92) and not cfg.is_mla(0)
    assert not cfg.is_moe(0) and all(cfg.is_moe(l) for l in range(1, 93))
    assert cfg.mla_latent_size == 576 and cfg.kda_proj_size == 12288


def test_k3_cache_bytes_match_spec():
    b = cache_bytes(get_preset("k3"), batch=1, max_len=4096, dtype="bfloat16")
    assert b["kda_state"] == 434_110_464  # 414 MiB fp32 (spec §4.1)
    assert b["mla_kv"] == 27_648 * 4096  # 27,648 B/token bf16


@pytest.mark.parametrize("name,total,active,nbytes,routed_bytes,active_bytes", [
    # spec §4.1: 2.78 T / 104.19 B active; the shipped bytes less A_log's zero padding (69 layers x 32 fp32,
    # sliced to the 96 live heads at load); a decode token reads the 113.51 GB of non-routed weights but the
    # 2.35 GB input embedding, and 16 of 896 experts' 1.446 TB
    ("k3", 2_779_484_476_000, 104_189_612_640, 1_559_965_606_912 - 69 * 32 * 4, 1_446_456_066_048, 136_990_294_400),
    # spec §4.2: 49.12 B / 3.11 B; bf16 experts (47.11 B params), 8 of 256 read per token
    ("kimi-linear-48b-a3b", 49_122_681_728, 3_106_972_544, 98_247_513_088, 94_220_845_056, 6_216_094_720),
])
def test_full_size_parameter_counts_match_spec(name, total, active, nbytes, routed_bytes, active_bytes, capsys):
    """The abstract full-size model (shapes only; seconds, not minutes) pins every shape and dtype."""
    from k3jax.cli import main

    assert main(["info", "--model", name, "--dtype", "bfloat16"]) == 0
    info = json.loads(capsys.readouterr().out)
    counts = info["params"]
    assert counts["total"] == total and counts["active_per_token"] == active
    assert info["param_bytes"] == counts["total_bytes"] == nbytes
    assert counts["routed_experts_bytes"] == routed_bytes and counts["active_bytes_per_token"] == active_bytes


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_config_roundtrip(name):
    cfg = get_preset(name)
    assert from_hf_config(json.loads(json.dumps(hf_config_dict(cfg)))) == cfg
    # several stop ids (config.json's eos_token_id as a list): the written config kept only the first
    cfg = cfg.replace(eos_token_ids=(5, 7, *cfg.eos_token_ids))
    assert from_hf_config(json.loads(json.dumps(hf_config_dict(cfg)))).eos_token_ids == cfg.eos_token_ids
    # group-limited routing: the written config said one group
    cfg = cfg.replace(num_expert_group=4, topk_group=1)
    assert from_hf_config(json.loads(json.dumps(hf_config_dict(cfg)))) == cfg


@pytest.mark.parametrize("change", [
    dict(gate_lower_bound=-5.0), dict(kda_full_rank_output_gate=True), dict(mla_use_output_gate=True),
    dict(hidden_act="situ", situ_beta=2.0, situ_linear_beta=9.0), dict(attn_res_block_size=2),
    dict(routed_expert_hidden_size=32, latent_moe_use_norm=True)])
def test_hf_config_roundtrip_keeps_k3_switches_of_a_kimi_linear_model(change):
    """A kimi_linear model with one of K3's switches (which the reader takes from a kimi_linear config.json too)
    was written without it: read back as another model (gate_lower_bound: the other KDA gate over the same
    tensors, no error). The plain Kimi-Linear config still names none of them, as the real one."""
    cfg = get_preset("tiny-kimi-linear").replace(**change)
    assert from_hf_config(json.loads(json.dumps(hf_config_dict(cfg)))) == cfg
    d = hf_config_dict(get_preset("tiny-kimi-linear"))
    assert not {"mla_use_output_gate", "attn_res_block_size", "activation_situ_beta"} & set(d)
    assert not {"gate_lower_bound", "use_full_rank_gate"} & set(d["linear_attn_config"])
    with pytest.raises(ValueError, match="kimi_linear model with expert_format='mxfp4' has no HF config.json"):
        hf_config_dict(get_preset("tiny-kimi-linear").replace(expert_format="mxfp4"))


def test_layer_lists_are_one_based():
    d = hf_config_dict(get_preset("tiny-k3"))
    assert d["text_config"]["linear_attn_config"]["full_attn_layers"] == [4, 7, 8]
    bad = copy.deepcopy(d)
    bad["text_config"]["linear_attn_config"]["full_attn_layers"] = [0, 4]
    with pytest.raises(ConfigError, match="full_attn_layers"):
        from_hf_config(bad)


@pytest.mark.parametrize("key", ["routed_scaling_factor", "mla_use_output_gate", "routed_expert_hidden_size", "attn_res_block_size",
                                 "hidden_act", "activation_situ_beta", "latent_moe_use_norm"])
def test_missing_k3_switch_is_named(key):
    d = hf_config_dict(get_preset("tiny-k3"))
    del d["text_config"][key]
    with pytest.raises(ConfigError, match=key):
        from_hf_config(d)


@pytest.mark.parametrize("key", ["gate_lower_bound", "use_full_rank_gate"])
def test_missing_k3_linear_switch_is_named(key):
    d = hf_config_dict(get_preset("tiny-k3"))
    del d["text_config"]["linear_attn_config"][key]
    with pytest.raises(ConfigError, match=key):
        from_hf_config(d)


def test_kimi_linear_flat_config_has_defaults():
    d = hf_config_dict(get_preset("kimi-linear-48b-a3b"))
    assert "text_config" not in d
    cfg = from_hf_config(d)
    assert cfg.gate_lower_bound is None and not cfg.kda_full_rank_output_gate and cfg.hidden_act == "silu"
    assert cfg.mla_layers == (3, 7, 11, 15, 19, 23, 26)


def test_bad_values_are_rejected():
    with pytest.raises(ConfigError, match="model_type"):
        from_hf_config({"model_type": "llama"})
    with pytest.raises(ConfigError, match="num_experts_per_token"):
        get_preset("tiny-k3").replace(num_experts_per_token=9)
    with pytest.raises(ConfigError, match="unknown preset"):
        get_preset("k4")


def _kl(**kw):
    d = hf_config_dict(get_preset("tiny-kimi-linear"))
    d.update(kw)
    return d


def _k3_with(mutate):
    d = hf_config_dict(get_preset("tiny-k3"))
    mutate(d, d["text_config"])
    return d


@pytest.mark.parametrize("d,match", [
    # a value of the wrong type or out of range is a ConfigError naming the key, not a ZeroDivisionError /
    # TypeError / ValueError from deep inside the model build or its first step
    (_kl(moe_layer_freq=0), "moe_layer_freq"),
    (_kl(vocab_size="abc"), "vocab_size"),
    (_kl(hidden_size=0), "hidden_size"),
    (_kl(q_lora_rank="16"), "q_lora_rank"),
    (_kl(moe_intermediate_size=0), "moe_intermediate_size"),
    (_kl(rms_norm_eps="x"), "rms_norm_eps"),
    (_kl(moe_renormalize="false"), "moe_renormalize"),  # bool("false") was True
    (_kl(quantization_config={"quant_method": "fp8"}), "quantization_config"),  # was ignored
    # a layer listed twice was counted twice (two MLA cache layers for one) or hid an unassigned layer
    (_kl(linear_attn_config={"num_heads": 4, "head_dim": 16, "full_attn_layers": [4, 4]}), "twice"),
    (_kl(linear_attn_config={"num_heads": 4, "head_dim": 16, "full_attn_layers": [4], "kda_layers": [1, 1, 2]}),
     "twice"),
    (_kl(linear_attn_config={"num_heads": 4, "head_dim": 16, "full_attn_layers": 4}), "full_attn_layers"),
    (_k3_with(lambda d, tc: d.update(text_config=None)), "text_config"),
    (_k3_with(lambda d, tc: tc.update(attn_res_block_size=0)), "attn_res_block_size"),
    (_k3_with(lambda d, tc: tc["linear_attn_config"].update(gate_lower_bound=0)), "gate_lower_bound"),
    (_k3_with(lambda d, tc: tc["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=0)),
     "group_size"),
    (_k3_with(lambda d, tc: tc["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=8)),
     "num_bits"),
    ([], "JSON object"),
    (_kl(first_k_dense_replace=-1), "first_k_dense_replace"),  # made layer 0 an MoE layer
    (_kl(eos_token_id="5"), "eos_token_id"),  # was dropped: the model never stopped on it
    # were kept as given: a list failed the first step (the config is hashed: "Non-hashable static arguments")
    (_kl(pad_token_id=[1]), "config.json: pad_token_id must be an integer"),
    (_kl(bos_token_id="<s>"), "config.json: bos_token_id must be an integer"),
    (_k3_with(lambda d, tc: tc.update(pad_token_id=[1])), "text_config: pad_token_id must be an integer"),
    # an engine with max_model_len "auto" then said its cache held no request ("give the cache more memory")
    (_kl(max_position_embeddings=0), "max_position_embeddings must be a positive integer"),
    # group-limited routing HF's router cannot run (uneven or 1-expert groups) or that leaves fewer than
    # top-k experts to pick (HF then picks masked experts)
    (_kl(num_expert_group=3, topk_group=1), "num_experts=8 must be divisible by num_expert_group=3"),
    (_kl(num_expert_group=8, topk_group=4), "num_expert_group=8 leaves 1 expert per group"),
    (_kl(num_expert_group=4, topk_group=1, num_experts_per_token=3), "num_experts_per_token=3 exceeds the 2"),
    (_kl(topk_group=0), "topk_group must be a positive integer"),
    (_kl(linear_attn_config=None, layer_types=["full_attention"] * 2), "layer_types must name"),
    # HF builds full_attn_layers' plan only beside kda_layers, else its default (no full-attention layer of 4): k3jax
    # built layer 4 as MLA, a model HF does not build from this config
    (_kl(linear_attn_config={"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4, "full_attn_layers": [4]}),
     r"full_attn_layers \[4\] without kda_layers: HF transformers then ignores it and builds its default "
     r"full-attention layers \[\]; give kda_layers"),
])
def test_bad_config_values_are_named(d, match):
    with pytest.raises(ConfigError, match=match):
        from_hf_config(d)


def test_hf_alias_keys_are_read():
    """HF transformers reads `norm_topk_prob` / `n_group` / ... (KimiLinearConfig.attribute_map) for
    moe_renormalize / num_expert_group / ...: k3jax ignored them (renormalised where HF does not; routed over
    every expert where HF keeps the best group). Both names with different values: an error naming both."""
    names = dict(norm_topk_prob="moe_renormalize", n_shared_experts="num_shared_experts",
                 num_experts_per_tok="num_experts_per_token", n_group="num_expert_group")

    def kl(**aliases):
        d = hf_config_dict(get_preset("tiny-kimi-linear"))
        for alias in aliases:
            d.pop(names.get(alias), None)
        return from_hf_config({**d, **aliases})

    assert kl(norm_topk_prob=False).moe_renormalize is False
    cfg = kl(n_shared_experts=2, num_experts_per_tok=3)
    assert (cfg.num_shared_experts, cfg.num_experts_per_token) == (2, 3)
    assert (kl(n_group=2, topk_group=1).num_expert_group, kl(n_group=2, topk_group=1).topk_group) == (2, 1)
    with pytest.raises(ConfigError, match="moe_renormalize=True and its alias norm_topk_prob=False disagree"):
        from_hf_config(_kl(norm_topk_prob=False))
    # HF's kernel size when linear_attn_config names none (k3jax took 4: conv weights then "mis-shaped")
    d = _kl(linear_conv_kernel_dim=3)
    del d["linear_attn_config"]["short_conv_kernel_size"]
    assert from_hf_config(d).short_conv_kernel_size == 3


@pytest.mark.parametrize("keys", [
    dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_heads=4, linear_head_dim=16,
         linear_conv_kernel_dim=4),
    dict(linear_num_heads=4, linear_head_dim=16, mlp_layer_types=["dense", "dense", "sparse", "sparse"]),
    dict(linear_attn_config={"short_conv_kernel_size": 3}, layer_types=["full_attention"] + ["linear_attention"] * 3),
    dict(num_hidden_layers=9),  # HF's defaults throughout: MLA at 0-based 4 and 8, 32 heads of 128
    dict(num_hidden_layers=9, linear_attn_config={"full_attn_layers": [5, 9]}),  # (HF's default plan: no kda_layers needed)
    dict(linear_attn_config={"full_attn_layers": [2], "kda_layers": [1, 3, 4]}),
])
def test_hf_native_kimi_linear_config_is_read_as_hf_reads_it(keys):
    """HF transformers' KimiLinearConfig takes `layer_types` / `mlp_layer_types` / `linear_num_heads` /
    `linear_head_dim` / `linear_conv_kernel_dim` (what it writes when built from its own keys) for a missing
    linear_attn_config or missing keys of it: k3jax refused such configs ("required key 'linear_attn_config' is
    missing"). Layers, KDA sizes and the MLP plan are read as HF builds them."""
    transformers = pytest.importorskip("transformers")
    d = hf_config_dict(get_preset("tiny-kimi-linear"))
    for k in ("linear_attn_config", "first_k_dense_replace", "moe_layer_freq"):
        del d[k]
    d.update(keys)
    hf = transformers.KimiLinearConfig(**d)
    cfg = from_hf_config(d)
    assert [("full_attention" if cfg.is_mla(l) else "linear_attention") for l in range(cfg.num_hidden_layers)] \
        == hf.layer_types
    assert [("sparse" if cfg.is_moe(l) else "dense") for l in range(cfg.num_hidden_layers)] == hf.mlp_layer_types
    assert (cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size) == (
        hf.linear_num_heads, hf.linear_head_dim, hf.linear_conv_kernel_dim)


def test_eos_ids_past_the_vocabulary_are_dropped():
    """HF's KimiLinearConfig defaults eos_token_id to 163586 whatever vocab_size is (a tiny checkpoint built
    from it keeps it): the id can never be generated, and kept as a stop id it failed the engine's start
    ("EOS token ID 163586 is out of range (vocab_size=320)" from the structured-output tokenizer). It is
    dropped from config.json's ids; a k3jax config that holds one is an error naming eos_token_ids."""
    assert from_hf_config(_kl(eos_token_id=[163586, 257])).eos_token_ids == (257,)
    assert from_hf_config(_kl(eos_token_id=163586)).eos_token_ids == ()
    with pytest.raises(ConfigError, match="eos_token_ids"):
        get_preset("tiny-kimi-linear").replace(eos_token_ids=(320,))


@pytest.mark.parametrize("key,value", [("pad_token_id", [3]), ("bos_token_id", "x"), ("eos_token_ids", ["a"]),
                                       ("eos_token_ids", None)])
def test_bad_token_ids_in_a_k3jax_config_are_named(key, value):
    """An Orbax directory's k3jax_config.json: a list pad_token_id failed the first step, a string eos id never
    stopped anything."""
    d = get_preset("tiny-kimi-linear").to_dict()
    d[key] = value
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_dict(d)


def test_unreadable_config_json_names_the_file(tmp_path):
    from k3jax.config import load_hf_config

    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        load_hf_config(str(tmp_path))


def test_info_reads_a_converted_checkpoint(tmp_path, capsys):
    """`k3jax info --model DIR` plans an Orbax directory written by `k3jax convert`, as `load_model` and the
    other commands read it (it looked for an HF config.json: "No such file or directory")."""
    from k3jax.cli import main

    dst = str(tmp_path / "orbax")
    assert main(["convert", "tiny-k3", dst]) == 0
    capsys.readouterr()
    # the source's dtype by default, as the other commands' (it wrote bf16: a preset's copy generated other tokens)
    from k3jax.checkpoint import stored_dtype
    assert stored_dtype(dst) == "float32"
    assert main(["info", "--model", dst]) == 0
    from_dir = json.loads(capsys.readouterr().out)
    assert main(["info", "--model", "tiny-k3"]) == 0
    assert from_dir["params"] == json.loads(capsys.readouterr().out)["params"]
    assert main(["info", "--model", str(tmp_path / "nope")]) == 2
    assert "neither a preset" in capsys.readouterr().err


@pytest.mark.parametrize("flags,match", [
    (["--page-size", "0"], "--page-size"), (["--sharding", "tp", "--devices", "0"], "--devices"),
    (["--cache-gib", "1", "--context", "abc"], "--context"), (["--max-loras", "-2"], "--max-loras"),
    (["--cache-gib", "1e-7"], "--cache-gib 1e-07 (107 bytes per rank): the cache budget holds 0 units"),
    (["--cache-gib", "inf"], "--cache-gib"),  # (an OverflowError traceback)
    (["--sharding", "tp", "--devices", "4", "-dcp", "0"], "--decode-context-parallel-size"),  # (ZeroDivisionError)
    (["--sharding", "tp", "--devices", "4", "-dcp", "-1", "--cache-gib", "1"], "--decode-context-parallel-size"),
    # (planned 0 bytes for a name the engine refuses)
    (["--max-loras", "1", "--lora-target-modules", "q_prj"], "--lora-target-modules: this model has no projection"),
])
def test_info_rejects_bad_flags_by_name(flags, match, capsys):
    """`k3jax info` with a flag it cannot plan with: exit 2 naming the flag (was a ZeroDivisionError traceback)."""
    from k3jax.cli import main

    assert main(["info", "--model", "tiny-k3", *flags]) == 2
    assert match in capsys.readouterr().err


def test_convert_refuses_a_file_as_dst_before_loading(tmp_path, capsys):
    """`k3jax convert SRC FILE`: exit 2 naming DST (a FileExistsError traceback after the weights had loaded)."""
    from k3jax.cli import main

    dst = tmp_path / "afile"
    dst.write_text("x")
    assert main(["convert", "tiny-k3", str(dst)]) == 2
    assert "DST" in capsys.readouterr().err and dst.read_text() == "x"


def test_python_dash_m_k3jax_runs_the_cli():
    """`python -m k3jax` is the `k3jax` command (it was "No module named k3jax.__main__")."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "k3jax", "info", "--model", "tiny-k3", "--page-size", "0"],
                       capture_output=True, text=True, cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert r.returncode == 2 and "--page-size" in r.stderr, r.stderr
