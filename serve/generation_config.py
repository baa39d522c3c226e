"""A model's default sampling settings from its `generation_config.json` (vLLM's `--generation-config`).

Checkpoints ship the sampling their authors recommend (K3: temperature 1.0, top_p 0.95). vLLM reads it by
default (`auto`) and applies it where a request leaves a field unset: `LLM.generate` without sampling
parameters uses `LLM.get_default_sampling_params()`, and the OpenAI server fills a request's missing
temperature / top_p / top_k / min_p / repetition_penalty from it, and max_tokens from its max_new_tokens
(cut to what the context leaves after the prompt); an explicit value, even the OpenAI default, always
wins. `vllm` ignores the file (the API's own defaults); a directory reads that directory's file instead
of the model's.
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

from serve.types import SamplingParams

#: generation_config.json keys that become SamplingParams fields (vLLM's list; max_new_tokens -> max_tokens)
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
FILE = "generation_config.json"


def read(path: str) -> dict:
    """The sampling fields a directory's generation_config.json sets ({} without the file), checked:
    ValueError naming the file and the key."""
    file = os.path.join(path, FILE)
    if not os.path.isfile(file):
        return {}
    try:
        with open(file) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not readable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a JSON object")
    out = {}
    for key, field in KEYS.items():
        v = raw.get(key)
        if v is None:
            continue
        integral = field in ("top_k", "max_tokens")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (
                integral and int(v) != v):
            raise ValueError(f"{file}: {key} must be {'an integer' if integral else 'a number'}, got {v!r}")
        out[field] = int(v) if integral else float(v)
    try:
        SamplingParams(**out).validate(vocab_size=1 << 31)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None
    return out


def resolve(setting: Optional[str], model_dir: Optional[str]) -> dict:
    """`auto` (default): the model directory's file; `vllm`: none; a directory: its file."""
    setting = setting or "auto"
    if setting == "vllm":
        return {}
    if setting == "auto":
        return read(model_dir) if model_dir and os.path.isdir(model_dir) else {}
    if not os.path.isdir(setting):
        raise ValueError(f"generation_config: {setting!r} is neither 'auto', 'vllm' nor a directory")
    return read(setting)


def default_params(defaults: dict) -> SamplingParams:
    """vLLM's `get_default_sampling_params`: SamplingParams with the model's fields set."""
    return SamplingParams(**defaults)
