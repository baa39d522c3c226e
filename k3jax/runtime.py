"""`Model`: a loaded model (config, split params, tokenizer) with the simple offline entry points, and
`load_model(path_or_preset)`."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import steps
from k3jax.cache import init_cache
from k3jax.config import ModelConfig, PRESETS, get_preset
from k3jax.model import KimiModel

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_dtype(dtype, path_or_preset: str):
    """`dtype="auto"` (vLLM's) -> the checkpoint's own: bfloat16 for a bfloat16 checkpoint, else float32 (a
    float16 one too: exact; float32 also for presets' seeded weights and checkpoints that name no dtype).
    Any other dtype is returned as given."""
    if not (isinstance(dtype, str) and dtype == "auto"):
        return dtype
    if path_or_preset in PRESETS or not os.path.isdir(path_or_preset):
        return "float32"
    from k3jax.checkpoint import stored_dtype

    return "bfloat16" if stored_dtype(path_or_preset) == "bfloat16" else "float32"


def parse_dtype(dtype) -> jnp.dtype:
    """A name in DTYPES, or the same dtype as an object (`jnp.bfloat16`, an engine's `model.dtype`). Other dtypes
    are refused as objects too, as their names are (`jnp.float16` built a float16 model, `np.int32` one of zeros)."""
    try:
        name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
    except (TypeError, ValueError):
        name = None
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto' (the checkpoint's), got {dtype!r}")
    return jnp.dtype(DTYPES[name])


def abstract_model(cfg: ModelConfig, dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """Shapes and dtypes of every parameter without materialising any (works for full K3)."""
    model = nnx.eval_shape(lambda: KimiModel(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    return nnx.split(model)


def param_counts(cfg: ModelConfig, params) -> dict[str, int]:
    """Parameter counts of a (possibly abstract) parameter tree, in the model card's convention.

    An MXFP4 byte packs two parameters and its E8M0 scales are not parameters. `active_per_token`
    is what one token's forward pass multiplies with: everything but the routed experts, plus
    `num_experts_per_token` of each MoE layer's experts, less the input embedding (a lookup) unless
    it is tied to the LM head. Full K3: 2.78 T total, 104.19 B active. The `*_bytes` entries count
    storage (scales included); `active_bytes_per_token` is what one decode token reads of the weights,
    the numerator of a batch-1 decode roofline (K3 in bf16: 137 GB).
    """
    total = routed = embed = 0
    total_b = routed_b = embed_b = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]  # drops `.value`
        size = int(np.prod(leaf.shape))
        nbytes = size * np.dtype(leaf.dtype).itemsize
        n = 0 if keys[-1] == "weight_scale" else 2 * size if keys[-1] == "weight_packed" else size
        total, total_b = total + n, total_b + nbytes
        if "block_sparse_moe" in keys and keys[keys.index("block_sparse_moe") + 1] in ("w1", "w2", "w3"):
            routed, routed_b = routed + n, routed_b + nbytes
        if keys == ["embed_tokens"]:
            embed, embed_b = n, nbytes
    k, e = cfg.num_experts_per_token, cfg.num_experts
    active = total - routed + (routed * k // e if e else 0)
    active_b = total_b - routed_b + (routed_b * k // e if e else 0)
    if not cfg.tie_word_embeddings:
        active, active_b = active - embed, active_b - embed_b
    return {"total": total, "routed_experts": routed, "active_per_token": active, "total_bytes": total_b,
            "routed_experts_bytes": routed_b, "active_bytes_per_token": active_b}


def tie_head(model: "Model") -> "Model":
    """An untied `model` whose own head holds its embedding's values -> the same model tied (one copy, the same
    logits). A tied model's HF export carries its head as `lm_head.weight` (HF never ties Kimi-Linear), which
    `load_model` reads as an untied head: tied again, it fits an engine serving the tied model. ValueError naming
    the head when its values differ (another model's head)."""
    params = model.params
    if model.cfg.tie_word_embeddings:
        return model
    if not bool(jnp.array_equal(params["lm_head"][...], params["embed_tokens"][...])):
        raise ValueError("lm_head.weight differs from embed_tokens: the model has a head of its own, not the tied "
                         "head (tie_word_embeddings) of the model served")
    cfg = model.cfg.replace(tie_word_embeddings=True)
    kept = nnx.from_flat_state([(k, v) for k, v in nnx.to_flat_state(params) if k != ("lm_head",)])
    return dataclasses.replace(model, cfg=cfg, graphdef=abstract_model(cfg, model.dtype)[0], params=kept)


def init_model(cfg: ModelConfig, dtype, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
    """Seeded random weights (presets); values are drawn on the host (see layers/initializers.py)."""
    return nnx.split(KimiModel(cfg, dtype=dtype, rngs=nnx.Rngs(params=seed)))


@dataclass
class Model:
    cfg: ModelConfig
    graphdef: Any
    params: Any
    dtype: jnp.dtype
    tokenizer: Any = None
    source: str = ""
    prefill_chunk: int = 256

    # ---- full-sequence forward ---------------------------------------------------------------
    def forward(self, token_ids) -> np.ndarray:
        """token_ids [B, T] -> float32 logits [B, T, V] (no cache)."""
        ids = self._ids(token_ids)
        return np.asarray(steps.forward(self.graphdef, self.params, ids), dtype=np.float32)

    # ---- cached generation ------------------------------------------------------------------
    def prefill(self, token_ids, max_len: int):
        """Chunked prefill of [B, T] prompts into a fresh cache; returns (last logits [B, V], cache)."""
        ids = self._ids(token_ids)
        b, t = ids.shape
        if t > max_len:
            raise ValueError(f"prompt length {t} exceeds the cache length {max_len}")
        cache = init_cache(self.cfg, b, max_len, self.dtype)
        chunk = min(self.prefill_chunk, _next_pow2(t))
        logits = None
        for start in range(0, t, chunk):
            piece = np.zeros((b, chunk), np.int32)
            n = min(chunk, t - start)
            piece[:, :n] = ids[:, start:start + n]
            valid = jnp.full((b,), n, jnp.int32)
            logits, cache = steps.prefill_step(self.graphdef, self.params, cache, jnp.asarray(piece), valid)
        return logits, cache

    def generate_greedy(self, token_ids, max_new_tokens: int) -> np.ndarray:
        """Greedy continuation: chunked prefill, then recurrent decode through the explicit cache (its length
        rounded up to a multiple of 256, so that prompts of nearby lengths share the compiled programs). Each
        token is the argmax of `steps.decode_step`'s logits, on device: the decode program that `decode_step`'s
        callers compile too, not one of its own."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        ids = self._ids(token_ids)
        logits, cache = self.prefill(ids, -(-(ids.shape[1] + max_new_tokens) // 256) * 256)
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out = [tok]
        for _ in range(max_new_tokens - 1):
            logits, cache = steps.decode_step(self.graphdef, self.params, cache, tok)
            tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            out.append(tok)
        return np.asarray(jnp.stack(out, axis=1))

    def generate_text(self, prompt: str, max_new_tokens: int) -> str:
        if self.tokenizer is None:
            raise ValueError(f"{self.source}: no tokenizer (no tiktoken.model beside the weights); use token ids")
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError("prompt encodes to zero tokens")
        new = self.generate_greedy(np.asarray([ids], np.int32), max_new_tokens)[0].tolist()
        stop = set(self.cfg.eos_token_ids)
        for i, t in enumerate(new):
            if t in stop:
                new = new[:i]
                break
        return self.tokenizer.decode(new)

    # ---- helpers ----------------------------------------------------------------------------
    def _ids(self, token_ids) -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"token_ids must be a non-empty [B, T] integer array, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token_ids must be integers, got {ids.dtype}")
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size}), got range "
                             f"[{ids.min()}, {ids.max()}]")
        return ids.astype(np.int32)

    @property
    def num_params(self) -> int:
        """Parameters in the model card's convention, as `k3jax info` counts them (`param_counts`): an MXFP4
        byte packs two, its E8M0 scales are none."""
        return param_counts(self.cfg, self.params)["total"]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def load_model(path_or_preset: str | os.PathLike, dtype="auto", seed: int = 0, *, sharding: str | None = None,
               devices=None) -> Model:
    """Load a preset name (seeded random weights), an HF safetensors directory (`kimi_linear` or
    `kimi_k3`), or an Orbax directory written by `k3jax convert`. Never downloads anything. `dtype`: "auto"
    (the default, vLLM's: the checkpoint's, `resolve_dtype`; presets float32), float32 or bfloat16.

    `sharding` (a config name or YAML path, as the engine's) and `devices` (indices into `jax.devices()`)
    load the weights straight into the placement an engine with the same two options gives them: each
    device receives only its shard, read from disk alone (no device first holds the whole model), and the
    engine's own placement is then a no-op. Without them the weights land whole on the default device."""
    from k3jax import checkpoint
    from k3jax.tokenizer import load_tokenizer

    path_or_preset = os.fspath(path_or_preset)  # a pathlib.Path too, as HF's from_pretrained takes one
    dt = parse_dtype(resolve_dtype(dtype, path_or_preset))
    place = None
    if sharding is not None or devices is not None:
        from k3jax.sharding import load_sharding_config, placement, put

        place = placement(load_sharding_config(sharding or "single"),
                          None if devices is None else [jax.devices()[i] for i in devices])
    if path_or_preset in PRESETS:
        cfg = get_preset(path_or_preset)
        if cfg.vocab_size > 1 << 16 or cfg.hidden_size > 4096:
            raise ValueError(f"preset {path_or_preset!r} has the real model's shapes; use it for planning "
                             f"(k3jax.runtime.abstract_model), it cannot be materialised with random weights here")
        graphdef, params = init_model(cfg, dt, seed)
        if place is not None:
            params = nnx.from_flat_state([(k, v.replace(value=put(v[...], place(v))))
                                          for k, v in nnx.to_flat_state(params)])
        tok = load_tokenizer(None, family="byte", vocab_size=cfg.vocab_size)
        return Model(cfg, graphdef, params, dt, tok, source=path_or_preset)
    if not os.path.isdir(path_or_preset):
        raise FileNotFoundError(f"{path_or_preset!r} is neither a preset ({sorted(PRESETS)}) nor a directory")
    # the tokenizer first: a missing or mismatched tokenizer file fails before the weights are read
    tok = _checkpoint_tokenizer(path_or_preset, checkpoint.read_config(path_or_preset))
    cfg, graphdef, params = checkpoint.load_checkpoint(path_or_preset, dt, place=place)
    return Model(cfg, graphdef, params, dt, tok, source=path_or_preset)


def _checkpoint_tokenizer(path: str, cfg: ModelConfig):
    """The Kimi tiktoken vocabulary beside the weights, else the byte tokenizer when the vocab fits it;
    None (token ids only) for tiny test checkpoints with neither."""
    from k3jax.tokenizer import BYTE_NAMED_SPECIALS, ByteTokenizer, load_tokenizer

    if os.path.isfile(os.path.join(path, "tiktoken.model")):
        return load_tokenizer(path, family="k3" if cfg.family == "kimi_k3" else "kimi_linear",
                              vocab_size=cfg.vocab_size)
    if cfg.vocab_size < 256 + len(BYTE_NAMED_SPECIALS):
        return None
    return ByteTokenizer(cfg.vocab_size, eos_token_ids=_fallback_stop_ids(path, cfg))


def _fallback_stop_ids(path: str, cfg: ModelConfig) -> tuple[int, ...] | None:
    """Stop ids of the byte tokenizer standing in for a checkpoint without tokenizer files: the checkpoint's own
    eos ids (config.json's, and generation_config.json's as HF's `generate` and vLLM add them), since the byte
    tokenizer's 257 / 261 are ordinary tokens of the model's vocabulary (stopping on them ended answers HF goes
    on with). None (the byte tokenizer's own, <|im_end|> included) for a checkpoint whose specials are the byte
    tokenizer's (a preset saved by k3jax, whose chat turns end with <|im_end|>) or that names no eos id."""
    from k3jax.tokenizer import BYTE_BOS, BYTE_EOS, BYTE_PAD, _eos_ids_from, _read_json

    if cfg.bos_token_id == BYTE_BOS and cfg.pad_token_id == BYTE_PAD and BYTE_EOS in cfg.eos_token_ids:
        return None
    eos = list(cfg.eos_token_ids)
    gen = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen):  # (read as the tokenizer reads it beside tokenizer files)
        eos += [i for i in _eos_ids_from(_read_json(gen).get("eos_token_id")) if 0 <= i < cfg.vocab_size]
    return tuple(dict.fromkeys(eos)) or None
