"""LoRA adapters for the engine: PEFT directories read into slots of the model's factor arrays
(`k3jax/lora.py`), and the registry of what is loaded where.

An adapter is a PEFT directory (`adapter_config.json` + `adapter_model.safetensors`), as
`peft.PeftModel.save_pretrained` writes it for the HF checkpoint this model was loaded from. Its
tensors `...layers.{l}.<module>.lora_A.weight [r, in]` / `lora_B.weight [out, r]` name dense
projections; each is checked against the model's projection (name and shape) before anything is
written, so a bad adapter is an error naming the tensor, never a half-loaded slot. The scaling
(`lora_alpha / r`, `/ sqrt(r)` with `use_rslora`, per module with `alpha_pattern`) is folded into B.

Routed experts (when the engine targets them, `lora_target_modules` naming "experts") come in either
form trainers write:
- per expert, as vLLM / SGLang / miles name them: `...experts.{e}.w1.lora_A.weight [r, in]` and
  `lora_B.weight [out, r]` (w1 gate, w3 up, w2 down; under `block_sparse_moe.` or `mlp.`); an A (or B)
  without the expert index, `...experts.w1.lora_A.weight`, is every expert's (a shared A);
- PEFT's `target_parameters` on transformers' fused experts (`mlp.experts.gate_up_proj [E, 2I, H]`,
  `mlp.experts.down_proj [E, H, I]`): `...mlp.experts[.base_layer].lora_A.weight [E r, in]` /
  `lora_B.weight [out, E r]`, expert e's factors `A.reshape(E, r, in)[e]` and
  `B.reshape(out, r, E)[:, :, e]` (PEFT's `ParamWrapper`), gate_up's B rows split into w1 then w3;
  which parameter a pair adapts is read from its shapes.
An engine holding one A per matrix (`lora_experts_shared_a`) takes adapters whose experts share A.

Adapters take no arena memory: their factors are model parameters of fixed size (`max_loras` slots
of rank `max_lora_rank` on every projection), allocated at start-up beside the weights. More adapters
than slots may be registered (`max_cpu_loras`, vLLM's): their factors wait in host memory and are
written into a slot when a request that uses them is admitted, replacing the least recently used
adapter that no running request uses (the scheduler keeps the running requests' adapters within the
slots). Host memory holds at most `max_cpu_loras` adapters, as vLLM's LRU adapter cache: loading one more
drops the least recently used adapter read from a directory that no running request uses (requests waiting for
it keep it registered) out of host memory; it stays registered under its name and is read from its directory
again when a request that uses it is admitted. A request for an adapter not held when every held one serves
running requests (or was loaded from tensors) is queued with the adapter registered unread (its directory
checked); the adapter is read when the request is admitted, in place of one whose requests ended meanwhile, as
vLLM reads adapters when it schedules their requests.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from safetensors import SafetensorError, safe_open

from k3jax import lora as model_lora

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# PEFT names modules as the HF model object nests them, which transformers 5.x builds differently from
# the checkpoint's tensor names (tests/HF_NOTES.md): KDA's gate under `forget_gate.`, MoE layers under
# `mlp.`; and checkpoints name the dense layer-0 MLP either way.
_ALIASES = ((".forget_gate.", "."), (".mlp.shared_experts.", ".block_sparse_moe.shared_experts."),
            (".block_sparse_moe.", ".mlp."))
# adapter loads of this process, numbered across every engine's registry: engines sharing a host store
# (kv_transfer_config) salt their requests' prefix hashes with it, so one engine's adapter never resumes
# from another engine's adapter that got the same number from its own registry
_LOADS = itertools.count(1)
_FACTOR = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be loaded (its directory, config or a tensor), or a registry operation
    that cannot be done (a name in use, no free slot, an adapter still serving requests)."""


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's `LoRARequest`: which adapter a request uses. An adapter not loaded yet is loaded from
    `lora_path` on first use (and stays loaded). `load_inplace` (vLLM's, for `add_lora`): replace the adapter
    loaded under this name, once the new directory has been read (refused while requests use the old one)."""
    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
    load_inplace: bool = False


@dataclass(eq=False)
class Adapter:
    name: str
    path: str
    uid: int  # unique per load in the process (`_LOADS`): seeds its requests' prefix-cache hashes (and names it
    # to the scheduler)
    rank: int
    factors: Optional[dict[str, tuple[np.ndarray, np.ndarray]]]  # module -> one slot's (lora_a, lora_b)
    # contents, host; None: dropped from host memory (LRU, `Registry.victim`) or registered unread, read from
    # `path` when a request that uses it is admitted
    int_id: int = 0
    slot: Optional[int] = None  # its device slot 1..max_loras (0 is the base model); None: host only
    used: int = 0  # when a request last needed it in its slot (LRU)
    requests: set = field(default_factory=set)  # sequences in flight with it (engine rids)


@dataclass(frozen=True)
class FactorLeaves:
    """One (lora_a, lora_b) pair among the step programs' weight leaves and the projections it holds: one
    projection, or (`stacked`: a scanned run of layers, k3jax/layer_scan.py) the same projection of every
    group, in group order along the leading axis."""

    a: int
    b: int
    modules: tuple[str, ...]
    stacked: bool

    @property
    def experts(self) -> bool:
        """A routed-expert matrix's factors (`model_lora.ExpertFactors`' layout), not a projection's."""
        return ".expert_lora." in self.modules[0]


def factor_leaves(paths: dict[str, tuple[int, int]], leaf_at: list[tuple[int, Optional[int]]]) -> list[FactorLeaves]:
    """`model_lora.module_paths` of the per-layer weights and `layer_scan.leaf_map` (or the identity) -> the
    factor leaves of the step programs' weights, each with its projections."""
    held: dict[tuple[int, int], dict] = {}
    for module, (ia, ib) in paths.items():
        (a, group), (b, _) = leaf_at[ia], leaf_at[ib]
        held.setdefault((a, b), {})[group] = module
    return [FactorLeaves(a, b, tuple(by[g] for g in sorted(by)) if None not in by else (by[None],), None not in by)
            for (a, b), by in held.items()]


def read_peft(path: str, shapes: dict[str, tuple[int, int]], max_rank: int, prefix: str = "",
              targets: Optional[tuple[str, ...]] = None, experts: Optional[dict[str, tuple[int, bool]]] = None,
              ) -> tuple[int, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Read a PEFT LoRA directory against the model's projections (`parse_peft`)."""
    conf, cfg_file, weights = check_peft_dir(path)
    try:
        with safe_open(weights, framework="numpy") as f:
            named = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, TypeError, ValueError, SafetensorError) as e:  # a damaged or cut-off file: the adapter's fault
        raise LoRAError(f"{weights}: not a readable safetensors file ({e})") from None
    return parse_peft(conf, named, shapes, max_rank, prefix, targets, experts, cfg_file, weights)


def check_peft_dir(path: str) -> tuple[dict, str, str]:
    """A PEFT LoRA directory's config and weights file, without reading its tensors (what a request for an
    adapter read later is checked against) -> (config, config file, weights file); else a LoRAError."""
    if not os.path.isdir(path):
        raise LoRAError(f"lora_path {path!r}: not a directory")
    cfg_file = os.path.join(path, CONFIG)
    if not os.path.exists(cfg_file):
        raise LoRAError(f"lora_path {path!r}: no {CONFIG} (expected a PEFT adapter directory)")
    try:
        with open(cfg_file, encoding="utf-8") as f:
            conf = json.load(f)
    except (OSError, ValueError) as e:  # (not UTF-8 text, not JSON, unreadable)
        raise LoRAError(f"{cfg_file}: not JSON ({e})") from None
    weights = os.path.join(path, WEIGHTS)
    if not os.path.exists(weights):
        other = [f for f in os.listdir(path) if f.startswith("adapter_model")]
        raise LoRAError(f"lora_path {path!r}: no {WEIGHTS}" + (f" (found {other}: save it with safetensors)"
                                                                   if other else ""))
    return conf, cfg_file, weights


def parse_peft(conf: dict, named: dict, shapes: dict[str, tuple[int, int]], max_rank: int, prefix: str = "",
               targets: Optional[tuple[str, ...]] = None, experts: Optional[dict[str, tuple[int, bool]]] = None,
               cfg_where: str = "config", weights: str = "tensors",
               ) -> tuple[int, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """A PEFT LoRA adapter (its `adapter_config.json` as a dict, its tensors by name) against the model's
    projections `shapes` (module path -> (out, in)) -> (largest rank, {module: one slot's contents, as
    `model_lora.slot_arrays` lays them out, with the scaling folded in}). `experts`: the routed-expert
    matrices with slots (module path -> (experts, shared A)); their `shapes` are one expert's and their
    contents (A [Ea, in, R], B [E, R, out]). `prefix` is the checkpoint's text-model prefix
    ("language_model." for K3). `cfg_where` / `weights` name the config and the tensors in errors."""
    experts = experts or {}
    if not isinstance(conf, dict):
        raise LoRAError(f"{cfg_where}: expected a JSON object, got {type(conf).__name__}")
    if str(conf.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"{cfg_where}: peft_type {conf.get('peft_type')!r}; only LORA adapters are served")
    for key, ok, why in (("use_dora", lambda v: not v, "DoRA adapters are not supported"),
                         ("bias", lambda v: v in (None, "none"), "adapters with trained biases are not supported"),
                         ("lora_bias", lambda v: not v, "adapters with trained biases are not supported"),
                         ("init_lora_weights", lambda v: not _moves_base(v), "its factors were trained against base "
                          "weights that PEFT's init changed (the served checkpoint's minus the initial factors); "
                          "save it converted to a plain LoRA adapter "
                          "(save_pretrained(path_initial_model_for_weight_conversion=...))"),
                         ("modules_to_save", lambda v: not v, "adapters that replace whole modules are not supported"),
                         ("fan_in_fan_out", lambda v: not v, "fan_in_fan_out factors are not supported")):
        if key in conf and not ok(conf[key]):
            raise LoRAError(f"{cfg_where}: {key}={conf[key]!r}: {why}")
    try:
        alpha = float(conf.get("lora_alpha", 8))  # PEFT's default (LoraConfig), whatever r is
    except (TypeError, ValueError):
        raise LoRAError(f"{cfg_where}: lora_alpha={conf.get('lora_alpha')!r} is not a number") from None
    if not math.isfinite(alpha):
        raise LoRAError(f"{cfg_where}: lora_alpha={conf.get('lora_alpha')!r} is not a finite number")
    alpha_pattern = _alpha_pattern(conf.get("alpha_pattern") or {}, cfg_where)
    rslora = bool(conf.get("use_rslora", False))
    tensors: dict[str, dict[str, np.ndarray]] = {}
    by_expert: dict[str, dict[str, dict]] = {}  # expert matrix -> A / B -> expert (None: all) -> (name, array)
    fused: dict[str, dict[str, tuple]] = {}  # PEFT module of a fused expert parameter -> A / B -> (name, array)
    for name, value in named.items():
        m = _FACTOR.match(name)
        if m is None:
            raise LoRAError(f"{weights}: tensor {name}: not a LoRA factor (lora_A / lora_B weight)")
        value = np.asarray(value)
        if value.dtype.kind not in "fV" and value.dtype.name != "bfloat16":
            raise LoRAError(f"{weights}: tensor {name}: dtype {value.dtype}, expected floating point")
        if not np.isfinite(value).all():  # (a decode step multiplies every slot's factors: it would reach all rows)
            raise LoRAError(f"{weights}: tensor {name}: holds NaN or infinite values")
        hit = _expert_module(m.group("module"), prefix)
        if hit is not None and any(e.startswith(hit[0]) for e in experts):
            module, expert = hit
            if expert == "fused":
                fused.setdefault((module, m.group("module")), {})[m.group("which")] = (name, value)
            else:
                by_expert.setdefault(module, {}).setdefault(m.group("which"), {})[expert] = (name, value)
            continue
        module = _module_path(m.group("module"), prefix, shapes)
        if module is None:
            where = (f"lora_target_modules={list(targets)}" if targets is not None else
                     "the dense projections; routed experts only when lora_target_modules names 'experts', "
                     "the router, embeddings and lm_head never")
            raise LoRAError(f"{weights}: tensor {name}: this model has no projection {m.group('module')!r} that "
                            f"takes adapters (they apply to {where})")
        tensors.setdefault(module, {})[m.group("which")] = (name, value)
    if not tensors and not by_expert and not fused:
        raise LoRAError(f"{weights}: no LoRA factors")
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    top = 0
    per_expert = _unfuse(weights, fused, shapes, experts)
    per_expert.update(_per_expert(weights, by_expert, shapes, experts))
    for module, (na, a, b) in sorted(per_expert.items()):
        r = a.shape[1]
        _check_rank(weights, na, r, max_rank)
        scaling = _pattern(alpha_pattern, _peft_module(na), alpha) / (math.sqrt(r) if rslora else r)
        n_exp, shared = experts[module]
        if shared and a.shape[0] > 1:
            if not all(np.array_equal(a[0], a[e]) for e in range(1, a.shape[0])):
                e = next(e for e in range(1, a.shape[0]) if not np.array_equal(a[0], a[e]))
                raise LoRAError(f"{weights}: tensor {na}: lora_A of experts 0 and {e} differ, and this engine holds "
                                f"one A for all experts (lora_experts_shared_a); start it without that to serve "
                                f"per-expert A")
        a = a[:1] if shared else np.broadcast_to(a, (n_exp, *a.shape[1:]))  # one A, or each expert's
        out[module] = model_lora.slot_arrays(a, b, max_rank, scaling)
        top = max(top, r)
    for module, pair in sorted(tensors.items()):
        if set(pair) != {"A", "B"}:
            missing = ({"A", "B"} - set(pair)).pop()
            raise LoRAError(f"{weights}: {module}: lora_{missing} is missing (found only "
                            f"{next(iter(pair.values()))[0]})")
        (na, a), (nb, b) = pair["A"], pair["B"]
        o, i = shapes[module]
        r = a.shape[0] if a.ndim else 0
        if a.ndim != 2 or a.shape[1] != i:
            raise LoRAError(f"{weights}: tensor {na}: shape {list(a.shape)}, the projection takes [r, {i}]")
        if b.ndim != 2 or b.shape != (o, r):
            raise LoRAError(f"{weights}: tensor {nb}: shape {list(b.shape)}, expected [{o}, {r}] (out, r)")
        _check_rank(weights, na, r, max_rank)
        scaling = _pattern(alpha_pattern, _peft_module(na), alpha) / (math.sqrt(r) if rslora else r)
        out[module] = model_lora.slot_arrays(a.astype(np.float32), b.astype(np.float32), max_rank, scaling)
        top = max(top, r)
    return top, out


def _check_rank(weights: str, name: str, r: int, max_rank: int) -> None:
    """A factor pair's rank `r` (of tensor `name`) fits the slots: 1..max_rank (0 would divide its scaling by 0)."""
    if r < 1:
        raise LoRAError(f"{weights}: tensor {name}: rank 0 (an empty factor); expected 1..max_lora_rank={max_rank}")
    if r > max_rank:
        raise LoRAError(f"{weights}: tensor {name}: rank {r} exceeds max_lora_rank={max_rank}")


def _alpha_pattern(patterns, cfg_where: str) -> dict[str, float]:
    """The config's `alpha_pattern` checked: {module regex: number}, else a LoRAError naming it."""
    if not isinstance(patterns, dict):
        raise LoRAError(f"{cfg_where}: alpha_pattern: expected an object of module name -> alpha, got "
                        f"{type(patterns).__name__}")
    out = {}
    for key, value in patterns.items():
        try:
            re.compile(key)
            out[key] = float(value)
        except (TypeError, ValueError, re.error):
            out[key] = math.nan
        if not math.isfinite(out[key]):
            raise LoRAError(f"{cfg_where}: alpha_pattern[{key!r}]={value!r}: expected a module name (regex) and "
                            f"a finite number")
    return out


def _moves_base(init) -> bool:
    """A PEFT `init_lora_weights` that subtracts the initial factors from the base weights (PiSSA, OLoRA,
    CorDA): the adapter alone is only right on that changed base, which PEFT rebuilds when it loads one."""
    return isinstance(init, str) and init.lower().startswith(("pissa", "olora", "corda"))


def _strip(name: str, prefix: str) -> str:
    """A PEFT module name without PEFT's and the checkpoint's leading names: `layers.0.self_attn.q_proj`."""
    for head in ("base_model.model.", ""):
        if name.startswith(head):
            name = name[len(head):]
            break
    for p in (prefix + "model.", "model.", prefix):
        if p and name.startswith(p):
            name = name[len(p):]
            break
    return name


_EXPERT = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts(?:\.(\d+))?(?:\.(w[123]))?")


def _expert_module(name: str, prefix: str) -> Optional[tuple[str, object]]:
    """A PEFT module name of routed experts -> (the model's expert-matrix path, the expert index or None
    for all experts), or (the layer's `expert_lora` path, "fused") for PEFT's fused-parameter form; None
    when it names no routed expert."""
    name = _strip(name, prefix)
    while name.endswith(".base_layer"):  # PEFT nests one wrapper per targeted parameter of a module
        name = name[:-len(".base_layer")]
    m = _EXPERT.fullmatch(name)
    if m is None or (m.group(2) is not None and m.group(3) is None):
        return None
    base = f"layers.{m.group(1)}.block_sparse_moe.expert_lora"
    if m.group(3) is None:
        return base, "fused"
    return f"{base}.{m.group(3)}", None if m.group(2) is None else int(m.group(2))


def _pair(weights: str, where: str, parts: dict) -> tuple:
    if set(parts) != {"A", "B"}:
        missing = ({"A", "B"} - set(parts)).pop()
        raise LoRAError(f"{weights}: {where}: lora_{missing} is missing (found only {next(iter(parts.values()))[0]})")
    return parts["A"], parts["B"]


def _unfuse(weights: str, fused: dict, shapes: dict, experts: dict) -> dict:
    """PEFT's fused-parameter expert factors ({(layer's expert_lora path, PEFT module): {A / B: (name, array)}})
    -> {expert matrix: (A's name, A [E, r, in], B [E, out, r])}."""
    out = {}
    for (base, peft_module), parts in sorted(fused.items()):
        (na, a), (nb, b) = _pair(weights, peft_module, parts)
        held = [m for m in experts if m.rsplit(".", 1)[0] == base]
        n_exp = experts[held[0]][0]
        o, n = shapes[held[0]]
        i, d = (n, o) if held[0].endswith(".w2") else (o, n)  # intermediate, expert input widths
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] % n_exp or b.shape[1] != a.shape[0]:
            raise LoRAError(f"{weights}: tensors {na} {list(a.shape)} / {nb} {list(b.shape)}: expected "
                            f"[{n_exp} r, in] / [out, {n_exp} r] (PEFT's factors of a fused expert parameter)")
        r = a.shape[0] // n_exp
        ae = a.reshape(n_exp, r, a.shape[1]).astype(np.float32)
        be = np.transpose(b.reshape(b.shape[0], r, n_exp), (2, 0, 1)).astype(np.float32)  # [E, out, r]
        if a.shape[1] == d and b.shape[0] == 2 * i:  # gate_up_proj = [w1; w3]
            parts_of = {"w1": be[:, :i], "w3": be[:, i:]}
        elif a.shape[1] == i and b.shape[0] == d:  # down_proj
            parts_of = {"w2": be}
        else:
            raise LoRAError(f"{weights}: tensors {na} {list(a.shape)} / {nb} {list(b.shape)}: neither the experts' "
                            f"gate_up_proj (in {d}, out {2 * i}) nor their down_proj (in {i}, out {d})")
        for w, bw in parts_of.items():
            if f"{base}.{w}" not in experts:
                raise LoRAError(f"{weights}: tensor {na}: adapts the routed experts' {w}, which hold no adapter "
                                f"slots here (lora_target_modules)")
            out[f"{base}.{w}"] = (na, ae, np.ascontiguousarray(bw))
    return out


def _per_expert(weights: str, by_expert: dict, shapes: dict, experts: dict) -> dict:
    """Per-expert (or all-expert) factors -> {expert matrix: (A's name, A [E or 1, r, in], B [E, out, r])};
    experts the adapter leaves out get zeros."""
    out = {}
    for module, parts in sorted(by_expert.items()):
        if module not in experts:
            name = next(iter(next(iter(parts.values())).values()))[0]
            raise LoRAError(f"{weights}: tensor {name}: adapts routed experts' {module.rsplit('.', 1)[1]}, which "
                            f"hold no adapter slots here (lora_target_modules)")
        n_exp, _ = experts[module]
        o, i = shapes[module]
        a_parts, b_parts = parts.get("A", {}), parts.get("B", {})
        for which, have in (("A", a_parts), ("B", b_parts)):
            if not have:
                found = next(iter((a_parts or b_parts).values()))[0]
                raise LoRAError(f"{weights}: {module}: lora_{which} is missing (found only {found})")
        for e in (set(a_parts) | set(b_parts)) - {None}:
            found = (a_parts.get(e) or b_parts.get(e))[0]
            if not 0 <= e < n_exp:
                raise LoRAError(f"{weights}: tensor {found}: expert {e} is out of range (the model has {n_exp})")
            for which, have in (("A", a_parts), ("B", b_parts)):
                if e not in have and None not in have:
                    raise LoRAError(f"{weights}: {module} expert {e}: lora_{which} is missing (found only {found})")
        ranks = {x.shape[0] if x.ndim else -1 for _, x in a_parts.values()}
        na = next(iter(a_parts.values()))[0]
        if len(ranks) != 1:
            raise LoRAError(f"{weights}: {module}: its experts' lora_A have different ranks {sorted(ranks)}")
        r = ranks.pop()
        for nm, x in a_parts.values():
            if x.shape != (r, i):
                raise LoRAError(f"{weights}: tensor {nm}: shape {list(x.shape)}, the expert matrix takes [r, {i}]")
        for nm, x in b_parts.values():
            if x.shape != (o, r):
                raise LoRAError(f"{weights}: tensor {nm}: shape {list(x.shape)}, expected [{o}, {r}] (out, r)")
        a = np.zeros((n_exp, r, i), np.float32)
        b = np.zeros((n_exp, o, r), np.float32)
        present = [e for e in range(n_exp) if e in b_parts or None in b_parts]
        for e in present:
            a[e] = (a_parts.get(e) or a_parts[None])[1]
            b[e] = (b_parts.get(e) or b_parts[None])[1]
        a[[e for e in range(n_exp) if e not in present]] = a[present[0]]  # (their B is 0: any A is exact)
        if set(a_parts) == {None}:  # one A given for all experts
            a = a_parts[None][1][None].astype(np.float32)
        out[module] = (na, a, b)
    return out


def _module_path(name: str, prefix: str, shapes: dict) -> Optional[str]:
    """A PEFT module name (`base_model.model.model.layers.0.self_attn.q_proj`) -> the model's module
    path (`layers.0.self_attn.q_proj`), or None."""
    name = _strip(name, prefix)
    names = [name]
    for old, new in _ALIASES:
        names += [n.replace(old, new) for n in names if old in n]
    return next((n for n in names if n in shapes), None)


def _peft_module(tensor: str) -> str:
    """A factor's tensor name -> the module name PEFT matched `alpha_pattern` against when it built the
    adapter (`model.layers.1.self_attn.forget_gate.f_a_proj`, under `base_model.model.`): as the trained
    model nested it, which the model's own paths (`_module_path`) need not be."""
    name = _FACTOR.match(tensor).group("module")
    while name.endswith(".base_layer"):
        name = name[:-len(".base_layer")]
    return name


def _pattern(patterns: dict, module: str, default: float) -> float:
    """PEFT's per-module override: a key matches a module name ending in it (as a regex), so a full
    path (`model.layers.0.self_attn.q_proj`) or a short name (`q_proj`) against `_peft_module`'s name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(value)
    return default


class Registry:
    """Registered adapters by name (at most `capacity`) and the ones holding device slots (at most
    `slots`). Pure bookkeeping: the engine writes the factors."""

    def __init__(self, slots: int, rank: int, capacity: Optional[int] = None):
        self.slots, self.rank = slots, rank
        self.capacity = capacity if capacity is not None else slots
        self.by_name: dict[str, Adapter] = {}
        self.in_slot: dict[int, Adapter] = {}
        self._clock = itertools.count(1)

    def held(self) -> list[Adapter]:
        """The registered adapters whose factors are in host memory (at most `capacity`; beyond it only while
        adapters loaded from tensors fill the rest as a request is admitted: `Engine._read_admitted`)."""
        return [a for a in self.by_name.values() if a.factors is not None]

    def victim(self, running=frozenset(), spill: bool = False) -> Optional[Adapter]:
        """Before a load: None while fewer than `capacity` adapters are held, else the one to drop from host
        memory: the least recently used that was read from a directory (so it can be read again) and that is
        not in `running` (the adapters of requests admitted and not finished; waiting requests read theirs
        again when admitted). When none can go: None with `spill` (the caller waits or reads later), else a
        LoRAError."""
        held = self.held()
        if len(held) < self.capacity:
            return None
        idle = [a for a in held if a.path and a not in running]
        if not idle and spill:
            return None
        if not idle:
            key = "max_cpu_loras" if self.capacity > self.slots else "max_loras"
            raise LoRAError(f"{key}={self.capacity} adapters are loaded ({', '.join(sorted(a.name for a in held))}) "
                            f"and none can be dropped (each serves running requests or was loaded from tensors); "
                            f"unload one first")
        return min(idle, key=lambda a: a.used)

    def has_room(self, running=frozenset()) -> bool:
        """Whether one more adapter can be held now (below `capacity`, or one can be dropped: `victim`)."""
        return len(self.held()) < self.capacity or self.victim(running, spill=True) is not None

    def can_ever_hold(self) -> bool:
        """Whether an adapter read from a directory can be held at some point: some held one is droppable once
        its requests end (those loaded from tensors never are)."""
        held = self.held()
        return len(held) < self.capacity or any(a.path for a in held)

    def forget_unread(self, name) -> None:
        """Forget `name`'s registration if it was never read and no request waits for it (registered unread for
        requests that ended before it was read, or whose read failed): it holds nothing and serves no one, so a
        load of the name from any directory takes its place (as where it was never registered)."""
        adapter = self.by_name.get(name) if isinstance(name, str) else None
        if adapter is not None and adapter.factors is None and not adapter.rank and not adapter.requests:
            del self.by_name[name]

    def drop(self, adapter: Adapter) -> None:
        """`adapter` gives up its slot and host memory; it stays registered (by name and directory)."""
        if adapter.slot is not None:
            del self.in_slot[adapter.slot]
            adapter.slot = None
        adapter.factors = None

    def add(self, name: str, path: str, rank: int, factors: Optional[dict], int_id: int = 0,
            spill: bool = False) -> Adapter:
        """Register an adapter held in host memory (`factors` None: registered unread, read when its requests are
        admitted); `spill`: beyond `capacity` if need be (`victim`'s)."""
        if name in self.by_name:
            raise LoRAError(f"lora_name {name!r}: an adapter of that name is loaded already")
        if factors is not None and len(self.held()) >= self.capacity and not spill:  # the engine makes room first
            raise RuntimeError(f"no host memory for adapter {name!r}: {self.capacity} adapters are held")
        adapter = Adapter(name, path, next(_LOADS), rank, factors, int_id, used=next(self._clock))
        self.by_name[name] = adapter
        return adapter

    def place(self, adapter: Adapter, busy: set) -> Optional[int]:
        """Give `adapter` a device slot -> the slot its factors must be written to, or None when it holds
        one already. A free slot first, else the least recently used adapter not in `busy` (adapters
        of running requests) gives up its slot."""
        adapter.used = next(self._clock)
        if adapter.slot is not None:
            return None
        free = [s for s in range(1, self.slots + 1) if s not in self.in_slot]
        if free:
            slot = free[0]
        else:
            idle = [a for a in self.in_slot.values() if a not in busy]
            if not idle:  # the scheduler admits within the slots; this is a bookkeeping error
                raise RuntimeError(f"no LoRA slot for adapter {adapter.name!r}: all {self.slots} are in use")
            victim = min(idle, key=lambda a: a.used)
            slot, victim.slot = victim.slot, None
        adapter.slot = slot
        self.in_slot[slot] = adapter
        return slot

    def release(self, adapter: Adapter, rid) -> None:
        """Request `rid` is done with `adapter`: it was in use until now (LRU counts the last use, not the
        last admission)."""
        adapter.requests.discard(rid)
        adapter.used = next(self._clock)

    def check_unused(self, name: str, besides=frozenset()) -> Adapter:
        """The adapter `name`, unless requests other than `besides` (request ids) use it: a LoRAError then."""
        adapter = self.get(name)
        used = adapter.requests - set(besides)
        if used:
            raise LoRAError(f"lora_name {name!r}: {len(used)} requests in flight use it; finish or abort them first")
        return adapter

    def remove(self, name: str) -> Adapter:
        self.drop(self.check_unused(name))
        return self.by_name.pop(name)

    def get(self, name: str) -> Adapter:
        if name not in self.by_name:
            raise LoRAError(f"lora_name {name!r}: no adapter of that name is loaded"
                            + (f" (loaded: {', '.join(sorted(self.by_name))})" if self.by_name else ""))
        return self.by_name[name]
