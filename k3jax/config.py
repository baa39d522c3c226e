"""Model configuration for Kimi K3 and Kimi-Linear, read from HF `config.json` or named presets.

One frozen dataclass covers both families. Layer schedules are stored 0-based (HF lists are
1-based). A K3 config that lacks one of K3's switches is an error naming the key: a silent default
would give a runnable but wrong model (spec §5).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

log = logging.getLogger(__name__)

FAMILIES = ("kimi_k3", "kimi_linear")


class ConfigError(ValueError):
    """A config key is missing or has a value this implementation cannot honour."""


@dataclass(frozen=True)
class ModelConfig:
    """Everything the math needs. Sizes follow the spec's names (§1)."""

    family: str  # "kimi_k3" | "kimi_linear"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int  # dense FFN width (layers < first_k_dense_replace)
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # MLA
    num_attention_heads: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_output_gate: bool = False
    mla_layers: tuple[int, ...] = ()  # 0-based
    # KDA
    kda_num_heads: int = 0
    kda_head_dim: int = 128
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = None  # K3: -5.0 selects the sigmoid gate; None: softplus gate
    kda_full_rank_output_gate: bool = False  # K3: g_proj [P, H]; Kimi-Linear: g_a/g_b rank head_dim
    # MoE
    num_experts: int = 0
    num_experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    # group-limited routing (DeepSeek-V3's): experts split into `num_expert_group` equal groups, only the
    # `topk_group` best (sum of each group's top-2 biased scores) may be picked; topk_group >= groups: off
    num_expert_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    routed_expert_hidden_size: int | None = None  # K3 latent MoE width; None: experts act on hidden
    latent_moe_use_norm: bool = False
    expert_format: str = "dense"  # "dense" | "mxfp4" (routed experts only)
    mxfp4_group_size: int = 32
    # activations
    hidden_act: str = "silu"  # "silu" | "situ" (MLPs only; the short conv always uses SiLU)
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    # residual stream
    attn_res_block_size: int | None = None  # K3 Block AttnRes; None: classic pre-norm residuals
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    max_position_embeddings: int = 1 << 20

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ConfigError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.hidden_act not in ("silu", "situ"):
            raise ConfigError(f"hidden_act must be 'silu' or 'situ', got {self.hidden_act!r}")
        if self.expert_format not in ("dense", "mxfp4"):
            raise ConfigError(f"expert_format must be 'dense' or 'mxfp4', got {self.expert_format!r}")
        for name in _POSITIVE:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        for name in _NON_NEGATIVE:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {v!r}")
        for name in ("q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name} must be None or a positive integer, got {v!r}")
        for name in ("bos_token_id", "pad_token_id"):  # (a list here failed the first step: the config is hashed)
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ConfigError(f"{name} must be None or an integer token id, got {v!r}")
        eos = self.eos_token_ids
        if not isinstance(eos, tuple) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in eos):
            raise ConfigError(f"eos_token_ids must be a tuple of token ids (integers >= 0), got {eos!r}")
        if any(x >= self.vocab_size for x in eos):
            raise ConfigError(f"eos_token_ids {eos!r} must be below vocab_size={self.vocab_size}")
        if self.mla_layers and self.num_attention_heads < 1:
            raise ConfigError(f"num_attention_heads must be >= 1 with MLA layers, got {self.num_attention_heads}")
        if len(self.mla_layers) < self.num_hidden_layers and self.kda_num_heads < 1:
            raise ConfigError(f"linear_attn_config.num_heads must be >= 1 with KDA layers, got {self.kda_num_heads}")
        if self.num_experts and self.moe_intermediate_size < 1:
            raise ConfigError(f"moe_intermediate_size must be >= 1 with num_experts={self.num_experts}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if self.gate_lower_bound is not None and not self.gate_lower_bound < 0:
            raise ConfigError(f"gate_lower_bound must be negative (K3: -5.0), got {self.gate_lower_bound!r}")
        for l in self.mla_layers:
            if isinstance(l, bool) or not isinstance(l, int) or not 0 <= l < self.num_hidden_layers:
                raise ConfigError(f"full_attn_layers entry {l + 1} is outside 1..{self.num_hidden_layers}")
        if len(set(self.mla_layers)) != len(self.mla_layers):
            raise ConfigError(f"full_attn_layers names a layer twice: {[l + 1 for l in self.mla_layers]}")
        if self.num_experts and not 0 < self.num_experts_per_token <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_token={self.num_experts_per_token} must be in 1..num_experts={self.num_experts}")
        if self.group_limited:
            _check_expert_groups(self.num_experts, self.num_expert_group, self.topk_group, self.num_experts_per_token)
        if self.expert_format == "mxfp4":
            for name, width in (("routed expert input", self.expert_in_size), ("moe_intermediate_size", self.moe_intermediate_size)):
                if width % self.mxfp4_group_size:
                    raise ConfigError(f"MXFP4 needs {name} ({width}) divisible by group size {self.mxfp4_group_size}")

    # ---- derived -------------------------------------------------------------------------
    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(l for l in range(self.num_hidden_layers) if l not in set(self.mla_layers))

    def is_mla(self, layer: int) -> bool:
        return layer in self.mla_layers

    def is_moe(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)

    @property
    def group_limited(self) -> bool:
        """Routing keeps only the `topk_group` best expert groups (False for one group, K3's and Kimi-Linear's)."""
        return self.num_experts > 0 and self.topk_group < self.num_expert_group

    @property
    def kda_proj_size(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_latent_size(self) -> int:
        """Width of one token's absorbed MLA cache entry (K3: 512 + 64 = 576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def expert_in_size(self) -> int:
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def num_kda_layers(self) -> int:
        return len(self.kda_layers)

    @property
    def num_mla_layers(self) -> int:
        return len(self.mla_layers)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown k3jax config keys: {sorted(unknown)}")
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name not in d and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"k3jax config lacks required keys: {missing}")
        d = dict(d)
        for k in ("mla_layers", "eos_token_ids"):
            if k in d and d[k] is not None:
                if not isinstance(d[k], (list, tuple)):
                    raise ConfigError(f"k3jax config key {k}: expected a list, got {d[k]!r}")
                d[k] = tuple(d[k])
        return cls(**d)


_POSITIVE = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "kv_lora_rank",
             "qk_nope_head_dim", "v_head_dim", "kda_head_dim", "short_conv_kernel_size", "moe_layer_freq",
             "mxfp4_group_size", "max_position_embeddings", "num_expert_group", "topk_group")
_NON_NEGATIVE = ("num_attention_heads", "qk_rope_head_dim", "kda_num_heads", "num_experts", "num_experts_per_token",
                 "moe_intermediate_size", "num_shared_experts", "first_k_dense_replace")


def _check_expert_groups(experts: int, groups: int, keep: int, top_k: int) -> None:
    """Group-limited routing needs equal groups of at least 2 experts (a group's score is its top-2 sum; HF's
    router fails on smaller ones) and at least `top_k` experts in the kept groups."""
    if experts % groups:
        raise ConfigError(f"num_experts={experts} must be divisible by num_expert_group={groups}")
    if experts // groups < 2:
        raise ConfigError(f"num_expert_group={groups} leaves {experts // groups} expert per group: group-limited "
                          f"routing scores a group by its top-2 experts, it needs at least 2")
    if top_k > keep * (experts // groups):
        raise ConfigError(f"num_experts_per_token={top_k} exceeds the {keep * (experts // groups)} experts of the "
                          f"topk_group={keep} groups routing keeps")


# ---- reading HF config.json ---------------------------------------------------------------

_MISSING = object()


def _typed(d: Mapping[str, Any], key: str, where: str, default: Any, ok, what: str, cast):
    """`cast(d[key])` (`default` when absent or null; required without one): a ConfigError naming the key for a
    value that is not `what` (`ok(value)` false: a string, a list, 2.5 for an integer, "false" for a bool)."""
    v = d.get(key)
    if v is None:
        if default is _MISSING:
            raise ConfigError(f"{where}: required key {key!r} is missing")
        return default
    if not ok(v):
        raise ConfigError(f"{where}: {key} must be {what}, got {v!r}")
    return cast(v)


def _finite(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _int(d: Mapping[str, Any], key: str, where: str, default: Any = _MISSING):
    return _typed(d, key, where, default, lambda v: _finite(v) and v == int(v), "an integer", int)


def _float(d: Mapping[str, Any], key: str, where: str, default: Any = _MISSING):
    return _typed(d, key, where, default, _finite, "a finite number", float)


def _bool(d: Mapping[str, Any], key: str, where: str, default: Any = _MISSING):
    return _typed(d, key, where, default, lambda v: isinstance(v, bool), "true or false", bool)


_K3_REQUIRED_TEXT_KEYS = (
    "routed_scaling_factor", "first_k_dense_replace", "mla_use_output_gate", "routed_expert_hidden_size", "latent_moe_use_norm",
    "attn_res_block_size", "hidden_act", "activation_situ_beta", "activation_situ_linear_beta",
)
_K3_REQUIRED_LINEAR_KEYS = ("gate_lower_bound", "use_full_rank_gate")


def _req(d: Mapping[str, Any], key: str, where: str):
    if key not in d or d[key] is None:
        raise ConfigError(f"{where}: required key {key!r} is missing")
    return d[key]


def _one_based_to_zero(layers, key: str, n: int) -> tuple[int, ...]:
    if not isinstance(layers, (list, tuple)):
        raise ConfigError(f"linear_attn_config.{key}: expected a list of 1-based layer indices, got {layers!r}")
    out = []
    for x in layers:
        if isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= n:
            raise ConfigError(f"linear_attn_config.{key}: entry {x!r} is not a 1-based layer index in 1..{n}")
        if x - 1 in out:
            raise ConfigError(f"linear_attn_config.{key}: layer {x} is listed twice")
        out.append(x - 1)
    return tuple(sorted(out))


@functools.lru_cache(maxsize=64)
def _warn_unreachable_eos(eos: int, vocab_size: int) -> None:
    """Said once per id and vocabulary (a config is read several times while an engine is built)."""
    log.warning("config.json: eos_token_id %d is outside the vocabulary (vocab_size=%d): the model cannot generate "
                "it, it is not used as a stop token", eos, vocab_size)


def _eos_ids(vocab_size: int, *vals) -> tuple[int, ...]:
    """The distinct stop ids of `eos_token_id` values (ints or lists). An id past the vocabulary (HF's
    KimiLinearConfig defaults eos_token_id to 163586 whatever vocab_size is) can never be generated: it is
    dropped with a warning, as stopping on it is a no-op (kept, it failed the engine's start: the structured
    output tokenizer refuses an EOS id out of range)."""
    out: list[int] = []
    for v in vals:
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 0):
                raise ConfigError(f"config.json: eos_token_id entries must be token ids (integers >= 0), got {x!r}")
            if x is not None and x >= vocab_size:
                _warn_unreachable_eos(x, vocab_size)
            elif x is not None and x not in out:
                out.append(x)
    return tuple(out)


def _check_hf_layer_plans(tc: Mapping[str, Any], where: str, mla: tuple[int, ...], first_dense: int, freq: int,
                          experts: int) -> None:
    """HF transformers builds its layers from `layer_types` / `mlp_layer_types` when config.json has them (it
    writes both), not from linear_attn_config / first_k_dense_replace / moe_layer_freq (which it ignores):
    lists that disagree with what k3jax builds describe another model, an error naming both keys."""
    n = tc["num_hidden_layers"]
    plans = {"layer_types": (["full_attention" if l in mla else "linear_attention" for l in range(n)],
                             "linear_attn_config.full_attn_layers")}
    if experts and freq > 0:  # (moe_layer_freq=0 is refused by ModelConfig, naming it)
        plans["mlp_layer_types"] = (["sparse" if l >= first_dense and l % freq == 0 else "dense" for l in range(n)],
                                    f"first_k_dense_replace={first_dense} / moe_layer_freq={freq}")
    for key, (ours, source) in plans.items():
        if tc.get(key) is not None and tc[key] != ours:
            raise ConfigError(f"{where}: {key} {tc[key]!r} (what HF transformers builds) disagrees with {source} "
                              f"({ours!r})")


def _hf_layer_types_mla(tc: Mapping[str, Any], where: str, n: int) -> tuple[int, ...]:
    """The 0-based MLA layers of a Kimi-Linear config without linear_attn_config.full_attn_layers, as HF
    transformers builds them: `layer_types` ("full_attention" / "linear_attention" per layer), else its
    default (MLA at 0-based layers 4, 8, ...)."""
    types = tc.get("layer_types")
    if types is None:
        return tuple(l for l in range(n) if l and l % 4 == 0)
    if (not isinstance(types, (list, tuple)) or len(types) != n
            or any(t not in ("full_attention", "linear_attention") for t in types)):
        raise ConfigError(f"{where}: layer_types must name 'full_attention' or 'linear_attention' for each of the "
                          f"{n} layers, got {types!r}")
    return tuple(l for l, t in enumerate(types) if t == "full_attention")


def _check_hf_full_attn_layers(tc: Mapping[str, Any], lac: Mapping[str, Any], lwhere: str, mla: tuple[int, ...]) -> None:
    """HF transformers' KimiLinearConfig builds its layers from full_attn_layers only beside kda_layers; with neither
    kda_layers nor `layer_types` it builds its default plan (MLA at 0-based layers 4, 8, ...) whatever
    full_attn_layers says: a full_attn_layers that disagrees describes a model HF would build otherwise, an error
    naming what to add (the same plan: accepted)."""
    if "kda_layers" in lac or tc.get("layer_types") is not None:
        return  # (both kept: HF reads them, and they are checked against full_attn_layers)
    hf = _hf_layer_types_mla({}, lwhere, tc["num_hidden_layers"])
    if mla != hf:
        raise ConfigError(f"{lwhere}: full_attn_layers {[l + 1 for l in mla]} without kda_layers: HF transformers then "
                          f"ignores it and builds its default full-attention layers {[l + 1 for l in hf]}; give "
                          f"kda_layers (the other layers) or layer_types")


def _hf_leading_dense(tc: Mapping[str, Any], n: int) -> int:
    """first_k_dense_replace when config.json has none: the dense layers that lead HF's `mlp_layer_types` (an
    HF-native config names only that list), else HF's default 1. (_check_hf_layer_plans checks the rest.)"""
    types = tc.get("mlp_layer_types")
    if not isinstance(types, (list, tuple)):
        return 1
    return next((l for l, t in enumerate(types) if t != "dense"), n)


# HF transformers' KimiLinearConfig.attribute_map: the other name it reads for each key (DeepSeek's / Mixtral's)
_HF_ALIASES = {"moe_renormalize": "norm_topk_prob", "num_experts": "num_local_experts",
               "num_experts_per_token": "num_experts_per_tok", "num_shared_experts": "n_shared_experts",
               "num_expert_group": "n_group"}


def _resolve_aliases(tc: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """`tc` with each key of `_HF_ALIASES` taken from its alias when only the alias is given, as HF reads
    them (`norm_topk_prob: false` was ignored: renormalised weights; `n_shared_experts` / `num_experts_per_tok`
    failed naming tensors or num_experts_per_token=0). Both given with different values: an error naming both."""
    out = dict(tc)
    for key, alias in _HF_ALIASES.items():
        if tc.get(alias) is None:
            continue
        if tc.get(key) is not None and tc[key] != tc[alias]:
            raise ConfigError(f"{where}: {key}={tc[key]!r} and its alias {alias}={tc[alias]!r} disagree")
        out[key] = tc[alias]
    return out


def _expert_groups(tc: Mapping[str, Any], where: str) -> dict[str, int]:
    """num_expert_group / topk_group. HF transformers routes group-limited whatever `use_grouped_topk` says,
    vLLM unless it is false: with it false and groups that limit the routing the two disagree, an error naming
    the keys (keep every group, topk_group = num_expert_group, for vLLM's routing)."""
    groups, keep = _int(tc, "num_expert_group", where, 1), _int(tc, "topk_group", where, 1)
    if 0 < keep < groups and tc.get("use_grouped_topk") is False:
        raise ConfigError(f"{where}: use_grouped_topk=false with num_expert_group={groups} > topk_group={keep}: "
                          f"HF transformers routes group-limited, vLLM over every expert; set topk_group="
                          f"{groups} (every group) or drop use_grouped_topk")
    return dict(num_expert_group=groups, topk_group=keep)


def from_hf_config(cfg: Mapping[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a parsed HF `config.json` (K3 with `text_config`, or flat Kimi-Linear)."""
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"config.json: expected a JSON object, got {type(cfg).__name__}")
    top_type = cfg.get("model_type")
    if top_type == "kimi_k3" or "text_config" in cfg:
        family = "kimi_k3"
        if not isinstance(cfg.get("text_config"), Mapping):
            raise ConfigError("config.json: model_type 'kimi_k3' needs a 'text_config' object")
        tc = cfg["text_config"]
        where = "config.json text_config"
    elif top_type == "kimi_linear":
        family, tc, where = "kimi_linear", cfg, "config.json"
    else:
        raise ConfigError(f"config.json: model_type {top_type!r} is not 'kimi_k3' or 'kimi_linear'")

    tc = _resolve_aliases(tc, where)
    n = _int(tc, "num_hidden_layers", where)
    # HF-native Kimi-Linear configs may name only `layer_types` and the `linear_*` keys (K3 needs the object)
    lac = _req(tc, "linear_attn_config", where) if family == "kimi_k3" else tc.get("linear_attn_config") or {}
    lwhere = f"{where}.linear_attn_config"
    if not isinstance(lac, Mapping):
        raise ConfigError(f"{lwhere}: expected an object, got {lac!r}")
    if family == "kimi_k3" or lac.get("full_attn_layers") is not None:
        mla = _one_based_to_zero(_req(lac, "full_attn_layers", lwhere), "full_attn_layers", n)
        if family == "kimi_linear":
            _check_hf_full_attn_layers(tc, lac, lwhere, mla)
    else:
        mla = _hf_layer_types_mla(tc, where, n)
    if family == "kimi_k3":
        heads, head_dim = _int(lac, "num_heads", lwhere), _int(lac, "head_dim", lwhere)
    else:  # HF reads each linear_attn_config key, else the `linear_*` key it writes beside it, else its default
        heads = _int(lac, "num_heads", lwhere, _int(tc, "linear_num_heads", where, 32))
        head_dim = _int(lac, "head_dim", lwhere, _int(tc, "linear_head_dim", where, 128))
    if "kda_layers" in lac and lac["kda_layers"] is not None:
        kda = _one_based_to_zero(lac["kda_layers"], "kda_layers", n)
        if set(kda) & set(mla) or len(kda) + len(mla) != n:
            raise ConfigError(f"{lwhere}: kda_layers and full_attn_layers must partition 1..{n}")
    if tc.get("attention_bias"):  # HF's KimiLinear then adds biases to q_a/kv_a/o_proj; K3 and Kimi-Linear have none
        raise ConfigError(f"{where}: attention_bias=true (biases on the MLA projections) is not supported")
    if tc.get("mla_use_nope") is False:
        raise ConfigError(f"{where}: mla_use_nope=false (rotary MLA) is not supported; K3/Kimi-Linear are NoPE")

    common = dict(
        vocab_size=_int(tc, "vocab_size", where),
        hidden_size=_int(tc, "hidden_size", where),
        num_hidden_layers=n,
        intermediate_size=_int(tc, "intermediate_size", where),
        rms_norm_eps=_float(tc, "rms_norm_eps", where, 1e-5),
        tie_word_embeddings=_bool(cfg, "tie_word_embeddings", "config.json",
                                  _bool(tc, "tie_word_embeddings", where, False)),
        num_attention_heads=_int(tc, "num_attention_heads", where),
        q_lora_rank=_int(tc, "q_lora_rank", where, None),
        kv_lora_rank=_int(tc, "kv_lora_rank", where),
        qk_nope_head_dim=_int(tc, "qk_nope_head_dim", where),
        qk_rope_head_dim=_int(tc, "qk_rope_head_dim", where),
        v_head_dim=_int(tc, "v_head_dim", where),
        mla_layers=mla,
        kda_num_heads=heads,
        kda_head_dim=head_dim,
        # HF reads linear_conv_kernel_dim (what it writes beside linear_attn_config) when the object has none
        short_conv_kernel_size=_int(lac, "short_conv_kernel_size", lwhere,
                                    _int(tc, "linear_conv_kernel_dim", where, 4)),
        num_experts=_int(tc, "num_experts", where, 0),
        num_experts_per_token=_int(tc, "num_experts_per_token", where, 0),
        moe_intermediate_size=_int(tc, "moe_intermediate_size", where, 0),
        num_shared_experts=_int(tc, "num_shared_experts", where, 0),
        # HF's KimiLinearConfig defaults (K3 requires both keys, see _K3_REQUIRED_TEXT_KEYS)
        routed_scaling_factor=_float(tc, "routed_scaling_factor", where, 2.446),
        moe_renormalize=_bool(tc, "moe_renormalize", where, True),
        first_k_dense_replace=_int(tc, "first_k_dense_replace", where, _hf_leading_dense(tc, n)),
        moe_layer_freq=_int(tc, "moe_layer_freq", where, 1),
        bos_token_id=_int(cfg, "bos_token_id", "config.json", _int(tc, "bos_token_id", where, None)),
        pad_token_id=_int(cfg, "pad_token_id", "config.json", _int(tc, "pad_token_id", where, None)),
        max_position_embeddings=_int(tc, "max_position_embeddings", where,
                                     _int(tc, "model_max_length", where, 1 << 20)),
    )
    if family != "kimi_k3":  # (HF transformers' KimiLinear writes and reads these lists; K3 names none)
        _check_hf_layer_plans(tc, where, mla, common["first_k_dense_replace"], common["moe_layer_freq"],
                              common["num_experts"])
    if tc.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"{where}: moe_router_activation_func must be 'sigmoid'")
    common.update(_expert_groups(tc, where))

    if family == "kimi_k3":
        for k in _K3_REQUIRED_TEXT_KEYS:
            _req(tc, k, where)
        for k in _K3_REQUIRED_LINEAR_KEYS:
            _req(lac, k, lwhere)
        act = tc["hidden_act"]
        qc = tc.get("quantization_config")
        expert_format, group = "dense", 32
        if qc is not None and not isinstance(qc, Mapping):
            raise ConfigError(f"{where}.quantization_config: expected an object, got {qc!r}")
        if qc:
            fmt = qc.get("format")
            if fmt != "mxfp4-pack-quantized":
                raise ConfigError(f"{where}.quantization_config.format {fmt!r} is not 'mxfp4-pack-quantized'")
            expert_format = "mxfp4"
            try:
                weights = qc["config_groups"]["group_0"]["weights"]
            except (KeyError, TypeError):
                weights = {}
            qwhere = f"{where}.quantization_config.config_groups.group_0.weights"
            group = _int(weights, "group_size", qwhere, 32) if isinstance(weights, Mapping) else 32
            if isinstance(weights, Mapping) and _int(weights, "num_bits", qwhere, 4) != 4:
                raise ConfigError(f"{qwhere}: num_bits {weights['num_bits']!r} is not 4 (MXFP4)")
        return ModelConfig(
            family=family, **common,
            mla_use_output_gate=_bool(tc, "mla_use_output_gate", where),
            gate_lower_bound=_float(lac, "gate_lower_bound", lwhere),
            kda_full_rank_output_gate=_bool(lac, "use_full_rank_gate", lwhere),
            routed_expert_hidden_size=_int(tc, "routed_expert_hidden_size", where),
            latent_moe_use_norm=_bool(tc, "latent_moe_use_norm", where),
            expert_format=expert_format, mxfp4_group_size=group,
            hidden_act=act, situ_beta=_float(tc, "activation_situ_beta", where),
            situ_linear_beta=_float(tc, "activation_situ_linear_beta", where),
            attn_res_block_size=_int(tc, "attn_res_block_size", where),
            # K3's tokenizer_config says [EOS]=163585, the configs say <|end_of_msg|>=163586: stop on both.
            eos_token_ids=_eos_ids(common["vocab_size"], cfg.get("eos_token_id"), tc.get("eos_token_id"),
                                   *[i for i in (163585, 163586) if i < common["vocab_size"]]),
        )
    if tc.get("quantization_config"):
        raise ConfigError(f"{where}: quantization_config is not supported for kimi_linear checkpoints (only K3's "
                          f"MXFP4 routed experts, under text_config)")
    return ModelConfig(
        family=family, **common,
        mla_use_output_gate=_bool(tc, "mla_use_output_gate", where, False),
        gate_lower_bound=_float(lac, "gate_lower_bound", lwhere, None),
        kda_full_rank_output_gate=_bool(lac, "use_full_rank_gate", lwhere, False),
        hidden_act=tc.get("hidden_act", "silu"),
        # K3's switches, absent from Kimi-Linear's config.json (k3jax's export writes those a model sets)
        routed_expert_hidden_size=_int(tc, "routed_expert_hidden_size", where, None),
        latent_moe_use_norm=_bool(tc, "latent_moe_use_norm", where, False),
        attn_res_block_size=_int(tc, "attn_res_block_size", where, None),
        situ_beta=_float(tc, "activation_situ_beta", where, 4.0),
        situ_linear_beta=_float(tc, "activation_situ_linear_beta", where, 25.0),
        eos_token_ids=_eos_ids(common["vocab_size"], cfg.get("eos_token_id"), tc.get("eos_token_id")),
    )


def load_hf_config(path: str | os.PathLike) -> ModelConfig:
    p = os.path.join(path, "config.json") if os.path.isdir(path) else path
    with open(p) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from None
    return from_hf_config(raw)


# ---- presets -------------------------------------------------------------------------------

def _k3_mla_layers(n: int, period: int = 4) -> tuple[int, ...]:
    """K3 places MLA every `period` layers (1-based 4, 8, ...) and also at the last layer."""
    return tuple(sorted({l for l in range(period - 1, n, period)} | {n - 1}))


_BYTE_SPECIALS = dict(bos_token_id=256, eos_token_ids=(257,), pad_token_id=258)

PRESETS: dict[str, ModelConfig] = {
    # Every K3 feature at test size: K3 gate, full-rank KDA output gate, gated NoPE MLA with q-LoRA,
    # latent MoE with SiTU and post-combine norm, shared experts, MXFP4 experts, AttnRes blocks,
    # two MLA layers at the end (like K3's 92-93).
    "tiny-k3": ModelConfig(
        family="kimi_k3", vocab_size=320, hidden_size=64, num_hidden_layers=8, intermediate_size=128,
        num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, mla_use_output_gate=True, mla_layers=(3, 6, 7),
        kda_num_heads=4, kda_head_dim=16, gate_lower_bound=-5.0, kda_full_rank_output_gate=True,
        num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, num_shared_experts=2,
        routed_scaling_factor=1.0, routed_expert_hidden_size=32, latent_moe_use_norm=True,
        expert_format="mxfp4", hidden_act="situ", attn_res_block_size=3, **_BYTE_SPECIALS,
        max_position_embeddings=4096),
    "tiny-kimi-linear": ModelConfig(
        family="kimi_linear", vocab_size=320, hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, mla_layers=(3,), kda_num_heads=4, kda_head_dim=16,
        num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, num_shared_experts=1,
        routed_scaling_factor=2.446, hidden_act="silu", **_BYTE_SPECIALS, max_position_embeddings=4096),
    # ~100M parameters with K3's structure (KDA head dim 128, 576-wide MLA latent), for CPU benchmarks.
    "k3-small": ModelConfig(
        family="kimi_k3", vocab_size=512, hidden_size=512, num_hidden_layers=12, intermediate_size=1536,
        num_attention_heads=4, q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mla_use_output_gate=True, mla_layers=_k3_mla_layers(12),
        kda_num_heads=4, kda_head_dim=128, gate_lower_bound=-5.0, kda_full_rank_output_gate=True,
        num_experts=32, num_experts_per_token=4, moe_intermediate_size=256, num_shared_experts=2,
        routed_expert_hidden_size=256, latent_moe_use_norm=True, expert_format="mxfp4",
        hidden_act="situ", attn_res_block_size=4, **_BYTE_SPECIALS, max_position_embeddings=32768),
    "kimi-linear-48b-a3b": ModelConfig(
        family="kimi_linear", vocab_size=163840, hidden_size=2304, num_hidden_layers=27, intermediate_size=9216,
        num_attention_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mla_layers=(3, 7, 11, 15, 19, 23, 26), kda_num_heads=32, kda_head_dim=128,
        num_experts=256, num_experts_per_token=8, moe_intermediate_size=1024, num_shared_experts=1,
        routed_scaling_factor=2.446, hidden_act="silu", bos_token_id=163584,
        eos_token_ids=(163586,), pad_token_id=163839),
    "k3": ModelConfig(
        family="kimi_k3", vocab_size=163840, hidden_size=7168, num_hidden_layers=93, intermediate_size=33792,
        num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mla_use_output_gate=True, mla_layers=_k3_mla_layers(93),
        kda_num_heads=96, kda_head_dim=128, gate_lower_bound=-5.0, kda_full_rank_output_gate=True,
        num_experts=896, num_experts_per_token=16, moe_intermediate_size=3072, num_shared_experts=2,
        routed_scaling_factor=1.0, routed_expert_hidden_size=3584, latent_moe_use_norm=True,
        expert_format="mxfp4", hidden_act="situ", attn_res_block_size=12, bos_token_id=163584,
        eos_token_ids=(163586, 163585), pad_token_id=163839),
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known: {sorted(PRESETS)}") from None
