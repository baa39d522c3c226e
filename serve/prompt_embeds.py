"""Prompt embeddings (vLLM's `EmbedsPrompt`, `--enable-prompt-embeds`): a prompt given as vectors
[L, hidden_size] that enter the model where token embeddings would (soft prompts, an encoder's
outputs projected into the model's space, embeddings edited by a researcher).

The engine keeps such a prompt as L placeholder token ids plus the vectors; the step feeds the vectors
at the prompt's positions (`StepBatch.embeds`), generated tokens go through the embedding table as
usual. Prefix caching stays safe because the request's cache keys are salted with a digest of the
vectors: only a request with the same vectors (bit for bit) can reuse its pages and states.

Over HTTP each prompt is one base64 string (`/v1/completions` field `prompt_embeds`) holding a
`torch.save`d tensor (what vLLM's clients send; loaded with `weights_only=True`, needs torch on the
server), a NumPy `.npy` file, or a safetensors file with one tensor.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import struct
import threading

import ml_dtypes
import numpy as np

from serve.types import RequestError

_SPARSE_CHECK = threading.Lock()  # torch's sparse-invariants switch is global; payloads decode on worker threads
MAX_B64_CHARS = 256 << 20  # one prompt's base64 text (a 128k x 1k fp16 prompt is 0.35 GB of it)
# safetensors dtype names -> numpy (the little-endian kinds `as_prompt_embeds` takes)
SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": ml_dtypes.bfloat16, "I64": "<i8",
                      "I32": "<i4", "I16": "<i2", "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1"}


def as_prompt_embeds(x, hidden_size: int, dtype, field: str = "prompt_embeds") -> np.ndarray:
    """A tensor-like [L, H] (or [1, L, H]) -> a C-contiguous numpy array [L, H] of `dtype`; RequestError
    naming `field` when it is not finite vectors of the model's width. Takes numpy, JAX and torch
    tensors (torch's floating dtypes via `.float()`: bf16 has no numpy dtype; sparse ones made dense)."""
    try:
        a = _torch_numpy(x) if hasattr(x, "detach") and hasattr(x, "float") else np.asarray(x)
    except Exception as e:
        raise RequestError(f"{field}: expected an array [length, {hidden_size}], got {type(x).__name__} ({e})")
    if a.ndim == 3 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 2 or a.shape[1] != hidden_size:
        raise RequestError(f"{field}: expected shape [length, {hidden_size}] (the model's hidden size), got "
                           f"{list(a.shape)}")
    if a.shape[0] == 0:
        raise RequestError(f"{field}: empty prompt (0 vectors)")
    if a.dtype.kind not in "fiu" and str(a.dtype) != "bfloat16":
        raise RequestError(f"{field}: expected floating-point values, got dtype {a.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow becomes inf, refused below
        a = np.ascontiguousarray(a.astype(dtype))
    if not np.isfinite(a.astype(np.float32)).all():
        raise RequestError(f"{field}: holds NaN or infinite values (in the model dtype {np.dtype(dtype).name})")
    return a


def _torch_numpy(t) -> np.ndarray:
    """A torch tensor -> numpy: dense (vLLM's clients may send a sparse one), floating dtypes as float32,
    the others as they are, so the dtype check refuses complex and bool tensors as it does numpy's."""
    t = t.detach().cpu().to_dense()
    return (t.float() if t.is_floating_point() else t).numpy()


def splice(ids: list[int], parts: list[np.ndarray], token_rows) -> np.ndarray:
    """A prompt of token ids with holes (id -1 - k: part k's vectors go there) -> its vectors [L, H]:
    `token_rows(ids)` gives the tokens' rows of the embedding table (a chat template rendered around
    content given as vectors)."""
    tokens = [t for t in ids if t >= 0]
    rows = iter(token_rows(tokens) if tokens else ())
    out = [parts[-1 - t] if t < 0 else next(rows)[None] for t in ids]
    return np.ascontiguousarray(np.concatenate(out).astype(parts[0].dtype if parts else np.float32))


def digest(a: np.ndarray) -> bytes:
    """A salt for the prefix cache: the vectors' shape, dtype and bytes hashed (equal only for equal vectors)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{a.shape}:{a.dtype.str}".encode())
    h.update(a.tobytes())
    return h.digest()


def decode_b64(text: str, hidden_size: int, dtype, field: str = "prompt_embeds") -> np.ndarray:
    """One base64 prompt of the HTTP API -> [L, H] (see the module docstring for the formats)."""
    if not isinstance(text, str) or not text:
        raise RequestError(f"{field}: expected a non-empty base64 string")
    if len(text) > MAX_B64_CHARS:
        raise RequestError(f"{field}: {len(text)} base64 characters, more than the limit of {MAX_B64_CHARS}")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(f"{field}: not valid base64 ({e})") from None
    return as_prompt_embeds(_load(raw, field), hidden_size, dtype, field)


def _load(raw: bytes, field: str):
    if raw.startswith(b"\x93NUMPY"):
        try:
            return np.load(io.BytesIO(raw), allow_pickle=False)
        except Exception as e:
            raise RequestError(f"{field}: a .npy payload that numpy cannot read ({e})") from None
    if raw.startswith(b"PK\x03\x04"):  # torch.save's zip container
        try:
            import torch
        except ImportError:
            raise RequestError(f"{field}: a torch.save payload needs torch on the server; send the tensor as a "
                               f"NumPy .npy or safetensors file instead") from None
        try:  # a sparse tensor's indices are checked as it loads (else densifying it could write out of bounds);
            with _SPARSE_CHECK, torch.sparse.check_sparse_tensor_invariants():  # (a process-wide flag: one at a time)
                t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as e:
            raise RequestError(f"{field}: a torch.save payload that torch cannot load safely ({e})") from None
        if not isinstance(t, torch.Tensor):
            raise RequestError(f"{field}: the torch.save payload holds a {type(t).__name__}, not one tensor")
        return t
    if len(raw) >= 8:
        n = struct.unpack("<Q", raw[:8])[0]
        if 2 <= n <= len(raw) - 8 and raw[8:9] == b"{":
            return _safetensors(raw, field)
    raise RequestError(f"{field}: unrecognised payload (expected torch.save, NumPy .npy or safetensors bytes)")


def _safetensors(raw: bytes, field: str):
    """(Read by hand: `safetensors.numpy` has no bfloat16, the usual dtype of a torch model's embeddings.)"""
    from safetensors import deserialize

    try:
        tensors = deserialize(raw)
    except Exception as e:
        raise RequestError(f"{field}: a safetensors payload that cannot be read ({e})") from None
    if len(tensors) != 1:
        raise RequestError(f"{field}: a safetensors payload must hold exactly one tensor, got {len(tensors)}")
    t = tensors[0][1]
    if t["dtype"] not in SAFETENSORS_DTYPES:
        raise RequestError(f"{field}: expected floating-point values, got safetensors dtype {t['dtype']}")
    return np.frombuffer(t["data"], SAFETENSORS_DTYPES[t["dtype"]]).reshape(t["shape"])


def encode_b64(a: np.ndarray) -> str:
    """[L, H] -> base64 of a NumPy .npy file (what `decode_b64` reads; tests and clients without torch)."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(a), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()

