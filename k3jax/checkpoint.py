"""Checkpoints: HF safetensors directories (`kimi_linear`, `kimi_k3`) and Orbax directories.

HF tensors are memory-mapped and streamed one parameter at a time into the abstract model's
layout: per-expert tensors are stacked into `[E, out, in]`, MXFP4 experts stay packed (uint8),
`A_log` is flattened and its zero padding dropped. A missing or mis-shaped tensor is an error that
names the tensor and both shapes; so is one whose cast to the model's dtype would change its values.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import re
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from k3jax.config import ModelConfig, load_hf_config

log = logging.getLogger(__name__)

K3JAX_CONFIG = "k3jax_config.json"
ORBAX_PARAMS = "params"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_NO_WEIGHT_SUFFIX = {"A_log", "dt_bias", "e_score_correction_bias"}
_ATTN_RES = {"self_attention_res", "mlp_res", "output_attn_res"}
_EXPERT_MATS = {"w1", "w2", "w3"}


# safetensors dtypes its NumPy reader can return (BF16 via ml_dtypes, which JAX registers); not F8_* / F4
_NUMPY_DTYPES = {"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F16", "BF16", "F32", "F64"}


class CheckpointError(ValueError):
    """A tensor is missing, mis-shaped, or the directory is not a checkpoint this loader knows."""


# ---- safetensors index --------------------------------------------------------------------

class SafetensorsDir:
    """Tensor name -> lazily opened, memory-mapped file, for single-file or sharded directories."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                self.where = {str(k): str(v) for k, v in weight_map.items()}
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{index}: not valid JSON ({e})") from None
            except (KeyError, TypeError, AttributeError):
                raise CheckpointError(f"{index}: expected an object with a 'weight_map' object "
                                      f"(tensor name -> file name)") from None
            missing = sorted({fn for fn in self.where.values() if not os.path.isfile(os.path.join(path, fn))})
            if missing:
                raise CheckpointError(f"{index}: weight_map names {len(missing)} file(s) not in {path}, e.g. "
                                      f"{missing[:3]}")
        else:
            files = sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"{path}: no *.safetensors files and no model.safetensors.index.json")
            self.where = {}
            for fn in files:
                for k in self._open_file(fn).keys():
                    if k in self.where:  # which copy wins would be the file names' order: ambiguous
                        raise CheckpointError(f"{path}: tensor {k} is in both {self.where[k]} and {fn} (and no "
                                              f"model.safetensors.index.json says which to read)")
                    self.where[k] = fn
        self._open: dict[str, Any] = {}
        self.bytes_read = 0  # tensor bytes copied out of the files so far

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def get(self, name: str, index: tuple = ()) -> np.ndarray:
        """Tensor `name`, or only its slice `index` (a tuple of slices; read from the memory map alone)."""
        dtype = self._slice(name).get_dtype()
        if dtype not in _NUMPY_DTYPES:  # (safetensors' NumPy reader fails on them with an AttributeError)
            raise CheckpointError(f"tensor {name} in {self.where[name]}: dtype {dtype} cannot be read (floats: "
                                  f"F16/BF16/F32/F64; MXFP4 blocks and E8M0 scales: U8 bytes)")
        try:
            arr = self._slice(name)[index] if index else self._file(name).get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"tensor {name} in {self.where[name]}: unreadable ({e})") from None
        self.bytes_read += arr.nbytes
        return arr

    def _slice(self, name: str):
        try:
            return self._file(name).get_slice(name)
        except SafetensorError as e:  # e.g. the index names a file that does not hold the tensor
            raise CheckpointError(f"tensor {name} in {self.where[name]}: unreadable ({e})") from None

    def _file(self, name: str):
        fn = self.where[name]
        if fn not in self._open:
            self._open[fn] = self._open_file(fn)
        return self._open[fn]

    def _open_file(self, fn: str):
        try:
            return safe_open(os.path.join(self.path, fn), framework="numpy")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{os.path.join(self.path, fn)}: not a readable safetensors file ({e})") from None


# ---- name mapping ---------------------------------------------------------------------------

def hf_name(path: tuple, prefix: str) -> str:
    """Map an NNX state path to the HF tensor name (experts: with `{e}` for the expert index)."""
    parts = [str(p) for p in path]
    if parts == ["lm_head"]:
        return f"{prefix}lm_head.weight"
    if len(parts) >= 2 and parts[-2] in _ATTN_RES:
        parts = parts[:-2] + [f"{parts[-2]}_{parts[-1]}", "weight"]
    elif len(parts) >= 2 and parts[-2] in _EXPERT_MATS and parts[-1] in ("weight_packed", "weight_scale"):
        parts = parts[:-2] + ["experts", "{e}", parts[-2], parts[-1]]
    elif parts[-1] in _EXPERT_MATS:
        parts = parts[:-1] + ["experts", "{e}", parts[-1], "weight"]
    elif parts[-1] not in _NO_WEIGHT_SUFFIX and parts[-1] != "weight":
        parts.append("weight")
    return f"{prefix}model." + ".".join(parts)


def _aliases(name: str) -> list[str]:
    """HF transformers 5.x writes the dense layer-0 MLP under `block_sparse_moe.`; releases use `mlp.`."""
    if ".mlp." in name:
        return [name, name.replace(".mlp.", ".block_sparse_moe.")]
    return [name]


def _cast(name: str, arr: np.ndarray, want) -> np.ndarray:
    """`arr` as dtype `want`, by a cast that keeps the values: floats of any width into a float weight, bytes
    (uint8, or int8 bit for bit) into the packed MXFP4 ones. Integers or bools into a float weight, floats or
    wider integers into MXFP4 bytes (a cast would truncate or wrap them) mean the tensor is not what the model
    reads: an error naming it."""
    got = arr.dtype
    if jnp.issubdtype(want, jnp.integer):
        if not jnp.issubdtype(got, jnp.integer) or np.dtype(got).itemsize != 1:
            raise CheckpointError(f"tensor {name}: {got} data where the model expects packed {want} (MXFP4 bytes)")
    elif got == np.uint8:
        raise CheckpointError(f"tensor {name}: packed uint8 data where the model expects {want}; "
                              f"check text_config.quantization_config")
    elif not jnp.issubdtype(got, jnp.floating):
        kind = "integer" if jnp.issubdtype(got, jnp.integer) else "non-float"
        raise CheckpointError(f"tensor {name}: {kind} data ({got}) where the model expects {want}")
    return arr.astype(want) if got != want else arr


def _read(st: SafetensorsDir, name: str, want: tuple[int, ...], dtype, fix: Callable | None = None,
          index: tuple = ()) -> np.ndarray:
    """Tensor `name` (or an alias) checked against the model's shape `want` and cast to its `dtype` (`_cast`);
    only its slice `index` when given (a `fix`ed tensor is read whole, then sliced: the fix changes its shape)."""
    for cand in _aliases(name):
        if cand in st:
            got = st.shape(cand)
            if fix is None and got != want:
                raise CheckpointError(f"tensor {cand}: checkpoint shape {got} does not match the model's {want}")
            arr = _cast(cand, st.get(cand, index if fix is None else ()), dtype)
            if fix is not None:
                try:
                    arr = fix(arr)
                except CheckpointError as e:
                    raise CheckpointError(f"tensor {cand}: {e}") from None
                if tuple(arr.shape) != want:
                    raise CheckpointError(f"tensor {cand}: checkpoint shape {got} does not match the model's {want}")
                arr = arr[index] if index else arr
            return arr
    raise CheckpointError(f"tensor {name} is missing from the checkpoint (expected shape {want})")


def _read_param(st: SafetensorsDir, name: str, shape: tuple[int, ...], dtype, fix: Callable | None,
                index: tuple = ()) -> np.ndarray:
    """One parameter (or its slice `index`) as the model holds it; per-expert tensors (`{e}` in `name`)
    are stacked `[E, ...]`, reading only the experts (and the part of each) the slice covers."""
    if "{e}" not in name:
        return _read(st, name, shape, dtype, fix, index)
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    experts = range(*index[0].indices(shape[0]))
    rest = index[1:] if any(i != slice(None) for i in index[1:]) else ()
    return np.stack([_read(st, name.format(e=e), shape[1:], dtype, None, rest) for e in experts])


def _fix_a_log(n: int):
    def fix(a: np.ndarray) -> np.ndarray:
        flat = a.reshape(-1)
        if flat.size < n:
            raise CheckpointError(f"A_log has {flat.size} entries for {n} heads")
        if np.any(flat[n:]):  # live values past num_heads: the weights are another model's than config.json's
            raise CheckpointError(f"A_log has {flat.size} entries for {n} heads, and those past {n} are not zero "
                                  f"padding")
        return flat[:n]  # K3 stores F32[128] with only the first num_heads live (the rest zero)
    return fix


def load_hf_params(path: str, cfg: ModelConfig, abstract: nnx.State, dtype, progress: bool = True,
                   place: Callable | None = None) -> nnx.State:
    """Fill `abstract` (from `nnx.eval_shape`) with tensors from an HF safetensors directory.

    `place(var) -> Sharding`, when given, puts each parameter straight into its shards: every device
    receives only its own slice and a process reads from disk only the slices its devices hold (on a
    multi-process mesh, its share), so no device or host ever holds a whole model it only serves a part
    of. Without it each tensor is read whole onto the default device."""
    st = SafetensorsDir(path)
    prefix = "language_model." if cfg.family == "kimi_k3" else ""
    flat = list(nnx.to_flat_state(abstract))
    used: set[str] = set()
    for key, var in flat:
        name = hf_name(key, prefix)
        names = [name.format(e=e) for e in range(var.shape[0])] if "{e}" in name else _aliases(name)
        used.update(n for n in names if n in st)
    _check_unused(st, used, prefix, cfg.num_hidden_layers)
    values = {}
    for key, var in tqdm(flat, desc=f"loading {os.path.basename(path.rstrip('/'))}", unit="tensor",
                         disable=not progress):
        shape, target = tuple(var.shape), var.dtype
        name = hf_name(key, prefix)
        fix = _fix_a_log(shape[0]) if key[-1] == "A_log" else None

        def read(index: tuple = (), name=name, shape=shape, fix=fix, target=target) -> np.ndarray:
            return _read_param(st, name, shape, target, fix, index)

        sharding = place(var) if place is not None else None
        values[key] = jnp.asarray(read()) if sharding is None else _placed(shape, sharding, read)
    log.info("%s: read %.2f GiB of tensors", path, st.bytes_read / 2 ** 30)
    return _fill(abstract, values)


def _check_unused(st: SafetensorsDir, used: set[str], prefix: str, num_layers: int) -> None:
    """Tensors of the decoder layers that the model has no parameter for mean config.json describes another
    model than the weights (e.g. `num_shared_experts` missing or 0 beside shared-expert weights): an error,
    before any tensor is read. Layers past `num_hidden_layers` (e.g. MTP heads) are skipped with a warning."""
    head = prefix + "model.layers."
    unused, beyond = [], []
    for k in st.where:
        if k in used or not k.startswith(head) or 0 in st.shape(k):
            continue  # an empty tensor holds no weights (HF writes num_shared_experts=0's as [0, H])
        layer = k[len(head):].split(".", 1)[0]
        (beyond if layer.isdigit() and int(layer) >= num_layers else unused).append(k)
    if unused:
        hint = ("; MXFP4 experts need text_config.quantization_config" if any(
            k.endswith((".weight_packed", ".weight_scale")) for k in unused) else "")
        raise CheckpointError(f"{len(unused)} checkpoint tensors have no place in the model config.json describes, "
                              f"e.g. {sorted(unused)[:3]}: config.json does not match the weights{hint}")
    if beyond:
        log.warning("%d checkpoint tensors of layers past num_hidden_layers=%d were not used, e.g. %s",
                    len(beyond), num_layers, beyond[:3])


def _placed(shape: tuple[int, ...], sharding, read: Callable) -> jax.Array:
    """An array with `sharding` built from `read(index)` per addressable shard; a slice several devices
    hold (replicated dims) is read once."""
    seen: dict[tuple, np.ndarray] = {}

    def shard(index: tuple) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in seen:
            seen[key] = read(index)
        return seen[key]

    return jax.make_array_from_callback(shape, sharding, shard)


def _fill(abstract: nnx.State, values: dict) -> nnx.State:
    return nnx.from_flat_state([(k, v.replace(value=values[k])) for k, v in nnx.to_flat_state(abstract)])


# ---- writing HF-format checkpoints ----------------------------------------------------------

def _k3_keys(cfg: ModelConfig) -> tuple[dict, dict]:
    """K3's own config.json keys: (text_config's, linear_attn_config's)."""
    return ({"mla_use_output_gate": cfg.mla_use_output_gate, "routed_expert_hidden_size": cfg.routed_expert_hidden_size,
             "latent_moe_use_norm": cfg.latent_moe_use_norm, "attn_res_block_size": cfg.attn_res_block_size,
             "activation_situ_beta": cfg.situ_beta, "activation_situ_linear_beta": cfg.situ_linear_beta},
            {"gate_lower_bound": cfg.gate_lower_bound, "use_full_rank_gate": cfg.kda_full_rank_output_gate})


# the ModelConfig fields `_k3_keys` writes (a kimi_linear config.json without them reads their defaults)
_K3_FIELDS = ("mla_use_output_gate", "routed_expert_hidden_size", "latent_moe_use_norm", "attn_res_block_size",
              "situ_beta", "situ_linear_beta", "gate_lower_bound", "kda_full_rank_output_gate")


def hf_config_dict(cfg: ModelConfig) -> dict:
    """The HF `config.json` for `cfg`: K3 nests its text model under `text_config`; lists are 1-based."""
    one = lambda ls: [l + 1 for l in ls]
    text = {
        "model_type": "kimi_linear", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "mla_use_nope": True,
        "linear_attn_config": {
            "num_heads": cfg.kda_num_heads, "head_dim": cfg.kda_head_dim,
            "short_conv_kernel_size": cfg.short_conv_kernel_size,
            "kda_layers": one(cfg.kda_layers), "full_attn_layers": one(cfg.mla_layers)},
        "num_experts": cfg.num_experts, "num_experts_per_token": cfg.num_experts_per_token,
        "moe_intermediate_size": cfg.moe_intermediate_size, "num_shared_experts": cfg.num_shared_experts,
        "routed_scaling_factor": cfg.routed_scaling_factor, "moe_renormalize": cfg.moe_renormalize,
        "first_k_dense_replace": cfg.first_k_dense_replace, "moe_layer_freq": cfg.moe_layer_freq,
        "moe_router_activation_func": "sigmoid", "use_grouped_topk": True, "num_expert_group": cfg.num_expert_group,
        "topk_group": cfg.topk_group, "hidden_act": cfg.hidden_act, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings, "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
        # every stop id (HF takes an int or a list): only the first one lost the others on a round trip
        "eos_token_id": (cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids) or None),
    }
    k3_text, k3_linear = _k3_keys(cfg)
    if cfg.family == "kimi_linear":
        if cfg.expert_format != "dense":  # (config.json has no quantization_config form for kimi_linear)
            raise CheckpointError(f"a kimi_linear model with expert_format={cfg.expert_format!r} has no HF config.json "
                                  f"(MXFP4 experts are K3's: family kimi_k3)")
        # K3 switches a kimi_linear config may set: written when not their default (the real Kimi-Linear config
        # names none), else a round trip lost them (gate_lower_bound: another gate, same tensors, no error)
        fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
        plain_text, plain_linear = _k3_keys(cfg.replace(**{k: fields[k].default for k in _K3_FIELDS}))
        text.update({k: v for k, v in k3_text.items() if v != plain_text[k]})
        text["linear_attn_config"].update({k: v for k, v in k3_linear.items() if v != plain_linear[k]})
        return {"architectures": ["KimiLinearForCausalLM"], **text}
    text.update({**k3_text, "topk_method": "noaux_tc", "num_nextn_predict_layers": 0})
    text["linear_attn_config"].update(k3_linear)
    if cfg.expert_format == "mxfp4":
        text["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "mxfp4-pack-quantized",
                                          "weights": {"type": "float", "num_bits": 4, "strategy": "group",
                                                      "group_size": cfg.mxfp4_group_size, "symmetric": True,
                                                      "dynamic": False, "scale_dtype": "torch.uint8"}}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                       "re:.*lm_head.*"]}
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "bos_token_id": cfg.bos_token_id, "eos_token_id": text["eos_token_id"],
            "pad_token_id": cfg.pad_token_id, "tie_word_embeddings": cfg.tie_word_embeddings,
            "text_config": text}


def hf_tensors(cfg: ModelConfig, params: nnx.State, a_log_pad: int = 0) -> Iterable[tuple[str, np.ndarray]]:
    """(name, array) pairs in the HF layout: experts unstacked, `A_log` zero-padded by `a_log_pad`
    (K3 ships F32[128] for 96 heads)."""
    prefix = "language_model." if cfg.family == "kimi_k3" else ""
    for key, var in nnx.to_flat_state(params):
        arr = np.asarray(jax.device_get(var[...]))
        name = hf_name(key, prefix)
        if "{e}" in name:
            for e in range(arr.shape[0]):
                yield name.format(e=e), np.ascontiguousarray(arr[e])
        elif key[-1] == "A_log":
            shaped = np.pad(arr, (0, a_log_pad)) if cfg.family == "kimi_k3" else arr.reshape(1, 1, -1, 1)
            yield name, shaped
        else:
            yield name, arr


def _tied_head(cfg: ModelConfig, params: nnx.State) -> list[tuple[str, np.ndarray]]:
    """A tied model's head as its own `lm_head.weight` (the embedding): HF's KimiLinearForCausalLM (and vLLM's)
    never tie, and without it loaded the export with a random head; k3jax reads it back as an untied head of
    the same values. (Not in `hf_tensors`: the engine's weight names have no tied head.)"""
    if not cfg.tie_word_embeddings:
        return []
    prefix = "language_model." if cfg.family == "kimi_k3" else ""
    return [(f"{prefix}lm_head.weight", np.asarray(jax.device_get(params["embed_tokens"][...])))]


def save_hf_checkpoint(path: str, cfg: ModelConfig, params: nnx.State, *, max_shard_bytes: int | None = None,
                       a_log_pad: int = 0) -> None:
    """Write `config.json` + safetensors in the released HF layout (sharded with an index when
    `max_shard_bytes` is set). Used to make test checkpoints and to export converted weights. config.json's
    `torch_dtype` is the weights' own, as HF writes it (`dtype="auto"` loads them in it; without it: float32).
    Saving over an earlier HF save replaces its weight files; a directory holding an Orbax checkpoint is refused."""
    from safetensors.numpy import save_file

    if is_orbax_dir(path):  # (load_model reads the Orbax checkpoint first: the export would never be read)
        raise CheckpointError(f"{path}: holds an Orbax checkpoint ({K3JAX_CONFIG} + {ORBAX_PARAMS}/), which "
                              f"load_model would read instead of the HF files; write the HF checkpoint to another "
                              f"directory")
    config = {**hf_config_dict(cfg), "torch_dtype": jnp.dtype(params["embed_tokens"][...].dtype).name}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in itertools.chain(hf_tensors(cfg, params, a_log_pad), _tied_head(cfg, params)):
        if max_shard_bytes and shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for fn, shard in zip(names, shards):
        save_file(shard, os.path.join(path, fn))
    if len(shards) > 1:
        weight_map = {k: fn for fn, shard in zip(names, shards) for k in shard}
        total = sum(a.nbytes for shard in shards for a in shard.values())
        with open(os.path.join(path, SAFETENSORS_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        names.append(SAFETENSORS_INDEX)
    _remove_stale_weights(path, set(names))


_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")


def _remove_stale_weights(path: str, keep: set[str]) -> None:
    """Delete the weight files of an earlier save into `path` that this one does not write (as HF's
    save_pretrained does): a stale index (sharded before, one file now) made load_model read the old weights; a
    stale model.safetensors beside a new index is what HF reads first."""
    for fn in os.listdir(path):
        if fn not in keep and (fn == SAFETENSORS_INDEX or _WEIGHT_FILE.fullmatch(fn)):
            os.remove(os.path.join(path, fn))


TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "special_tokens_map.json", "tokenization_kimi.py",
                   "chat_template.jinja", "generation_config.json")


def copy_tokenizer_files(src: str, dst: str) -> list[str]:
    """Copy the tokenizer and generation-config files of checkpoint directory `src` into `dst` (those it has);
    the names copied. Without them a converted checkpoint loaded with the byte tokenizer and no sampling
    defaults."""
    import shutil

    copied = []
    for fn in TOKENIZER_FILES:
        s, d = os.path.join(src, fn), os.path.join(dst, fn)
        if os.path.isfile(s) and not (os.path.exists(d) and os.path.samefile(s, d)):
            shutil.copyfile(s, d)
            copied.append(fn)
    return copied


# ---- Orbax ----------------------------------------------------------------------------------

def is_orbax_dir(path: str) -> bool:
    return os.path.exists(os.path.join(path, K3JAX_CONFIG)) and os.path.isdir(os.path.join(path, ORBAX_PARAMS))


def save_orbax(path: str, cfg: ModelConfig, params: nnx.State, dtype) -> None:
    """Write params with Orbax plus the k3jax config (used by `k3jax convert`)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(path, ORBAX_PARAMS), nnx.to_pure_dict(params), force=True)
    with open(os.path.join(path, K3JAX_CONFIG), "w") as f:
        json.dump({"config": cfg.to_dict(), "dtype": jnp.dtype(dtype).name}, f, indent=1)


def load_orbax_params(path: str, abstract: nnx.State, place: Callable | None = None) -> nnx.State:
    """Restore into abstract targets (shape and dtype from `abstract`; each array's sharding from
    `place(var)` when given, else `abstract`'s: Orbax then reads only each device's slice)."""
    import orbax.checkpoint as ocp

    if place is not None:
        abstract = nnx.from_flat_state([(k, v.replace(value=jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=place(v))))
                                        for k, v in nnx.to_flat_state(abstract)])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)),
                          nnx.to_pure_dict(abstract))
    params = os.path.join(os.path.abspath(path), ORBAX_PARAMS)
    with ocp.StandardCheckpointer() as ckpt:
        metadata = ckpt.metadata(params)
        _check_orbax_shapes(path, getattr(metadata, "item_metadata", metadata), target)
        restored = ckpt.restore(params, target)
    nnx.replace_by_pure_dict(abstract, restored)
    return abstract


def _check_orbax_shapes(path: str, stored, target) -> None:
    """The stored arrays are the model's (same names and shapes): else an error naming the parameter, before
    Orbax fails on the first mismatch without naming it."""
    def flat(tree) -> dict[str, tuple]:
        return {".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in kp): tuple(v.shape)
                for kp, v in jax.tree_util.tree_flatten_with_path(tree)[0]}

    have, want = flat(stored), flat(target)
    if not have:  # (Orbax logs a warning and answers no metadata: every parameter read as missing)
        raise CheckpointError(f"{os.path.join(path, ORBAX_PARAMS)}: no readable Orbax checkpoint (empty or damaged)")
    where = f"{path}: the Orbax params do not match {K3JAX_CONFIG}"
    missing = sorted(set(want) - set(have))
    if missing:
        raise CheckpointError(f"{where}: {len(missing)} parameters missing, e.g. {missing[:3]}")
    extra = sorted(set(have) - set(want))
    if extra:
        raise CheckpointError(f"{where}: {len(extra)} parameters the model has no place for, e.g. {extra[:3]}")
    for name, shape in want.items():
        if have[name] != shape:
            raise CheckpointError(f"{where}: parameter {name} is stored with shape {have[name]}, the model's is {shape}")


def read_orbax_config(path: str) -> tuple[ModelConfig, str]:
    file = os.path.join(path, K3JAX_CONFIG)
    try:
        with open(file) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("config"), dict) or not isinstance(d.get("dtype"), str):
        raise CheckpointError(f"{file}: expected an object with 'config' (an object of k3jax config keys) and "
                              f"'dtype'")
    return ModelConfig.from_dict(d["config"]), d["dtype"]


# ---- entry point ----------------------------------------------------------------------------

def read_config(path: str) -> ModelConfig:
    """The model config of an HF safetensors or Orbax checkpoint directory (no weights read)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory")
    if is_orbax_dir(path):
        return read_orbax_config(path)[0]
    if not os.path.exists(os.path.join(path, "config.json")):
        if os.path.exists(os.path.join(path, K3JAX_CONFIG)):
            raise CheckpointError(f"{path}: {K3JAX_CONFIG} without its {ORBAX_PARAMS}/ directory (an incomplete "
                                  f"Orbax checkpoint)")
        raise CheckpointError(f"{path}: no config.json (HF) and no {K3JAX_CONFIG} (Orbax)")
    cfg = load_hf_config(path)
    head = ("language_model." if cfg.family == "kimi_k3" else "") + "lm_head.weight"
    weights = any(f.endswith((".safetensors", ".safetensors.index.json")) for f in os.listdir(path))  # (config only: none)
    if cfg.tie_word_embeddings and weights and head in SafetensorsDir(path):
        # HF's and vLLM's KimiLinearForCausalLM keep their own lm_head whatever tie_word_embeddings says: a
        # checkpoint that ships one is served with it
        cfg = cfg.replace(tie_word_embeddings=False)
    return cfg


def stored_dtype(path: str) -> str | None:
    """The dtype a checkpoint directory says its weights are in: an Orbax directory's recorded one, else
    config.json's `torch_dtype` (newer transformers: `dtype`; a multimodal K3 config's `text_config` too);
    None when it names none or cannot be read (loading it then says why)."""
    try:
        if is_orbax_dir(path):
            return read_orbax_config(path)[1]
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    for d in (raw, raw.get("text_config")) if isinstance(raw, dict) else ():
        for key in ("torch_dtype", "dtype"):
            if isinstance(d, dict) and isinstance(d.get(key), str):
                return d[key].removeprefix("torch.")
    return None


def load_checkpoint(path: str, dtype, progress: bool = True, place: Callable | None = None):
    """-> (cfg, graphdef, params) for an HF safetensors or Orbax directory; `place(var) -> Sharding` puts
    each parameter straight into its shards (see `load_hf_params`)."""
    from k3jax.runtime import abstract_model

    path = os.fspath(path)
    cfg = read_config(path)
    graphdef, abstract = abstract_model(cfg, dtype)
    if is_orbax_dir(path):
        return cfg, graphdef, load_orbax_params(path, abstract, place)
    return cfg, graphdef, load_hf_params(path, cfg, abstract, dtype, progress, place)
