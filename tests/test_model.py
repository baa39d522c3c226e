"""Whole-model behaviour: cache-free forward vs chunked prefill + decode, padding, checkpoints, CLI."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from k3jax import steps
from k3jax.cache import init_cache
from k3jax.checkpoint import CheckpointError, save_hf_checkpoint, save_orbax

T = 70  # longer than one 64-token KDA chunk, not a multiple of it


@pytest.fixture(scope="module", params=["tiny-k3", "tiny-kimi-linear"])
def model(request):
    m = k3jax.load_model(request.param, dtype="float32", seed=0)
    m.prefill_chunk = 32
    return m


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, 256, (2, T)).astype(np.int32)


@pytest.fixture(scope="module")
def full_logits(model, ids):
    return model.forward(ids)


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def test_forward_shape_and_finite(model, full_logits):
    assert full_logits.shape == (2, T, model.cfg.vocab_size) and full_logits.dtype == np.float32
    assert np.isfinite(full_logits).all()


def test_prefill_then_decode_equals_forward(model, ids, full_logits):
    """Chunked prefill of T-1 tokens (3 chunks of 32, last one padded) then one decode step."""
    logits, cache = model.prefill(ids[:, :T - 1], max_len=80)
    assert rel(logits, full_logits[:, T - 2]) < 1e-5
    logits, cache = steps.decode_step(model.graphdef, model.params, cache, jnp.asarray(ids[:, T - 1]))
    assert rel(logits, full_logits[:, T - 1]) < 1e-5
    assert np.asarray(cache.lengths).tolist() == [T, T]


def test_ragged_rows_match_their_own_forward(model, ids, full_logits):
    """Two rows with different real lengths in one padded prefill chunk."""
    cache = init_cache(model.cfg, 2, 80, model.dtype)
    valid = jnp.array([T, 40], jnp.int32)
    piece = ids.copy()
    piece[1, 40:] = 7  # garbage after the real tokens must not matter
    logits, cache = steps.prefill_step(model.graphdef, model.params, cache, jnp.asarray(piece), valid)
    assert rel(logits[0], full_logits[0, T - 1]) < 1e-5
    # row 1's reference: the whole forward at its 40th token (causal: what a forward over its 40 tokens gives;
    # no program of another shape to compile)
    assert rel(logits[1], full_logits[1, 39]) < 1e-5
    # decode continues each row from its own length
    nxt = jnp.asarray([ids[0, 0], ids[1, 40]])
    logits, cache = steps.decode_step(model.graphdef, model.params, cache, nxt)
    assert rel(logits[1], full_logits[1, 40]) < 1e-5


def test_generate_greedy_matches_forward_argmax(model, ids):
    """Each generated token is the argmax of a full forward over the prompt and the tokens before it
    (one teacher-forced forward over the whole sequence: the model is causal)."""
    prompt = ids[:, :40]
    out = model.generate_greedy(prompt, 8)
    assert out.shape == (2, 8)
    # padded to T with any tokens (causal: they change no logit before them), so the forward is the compiled one
    seq = np.concatenate([prompt, out, ids[:, 48:]], 1).astype(np.int32)  # [B, T]
    logits = model.forward(seq)
    np.testing.assert_array_equal(out, logits[:, 39:47].argmax(-1))


def test_hf_checkpoint_roundtrip(model, ids, full_logits, tmp_path):
    path = str(tmp_path / "ckpt")
    save_hf_checkpoint(path, model.cfg, model.params, max_shard_bytes=100_000, a_log_pad=4)
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    names = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    if model.cfg.family == "kimi_k3":
        assert all(n.startswith("language_model.") for n in names)
        assert "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_packed" in names
    m2 = k3jax.load_model(path)
    assert m2.cfg == model.cfg
    np.testing.assert_array_equal(m2.forward(ids), full_logits)


def test_orbax_convert_roundtrip(model, ids, full_logits, tmp_path):
    save_orbax(str(tmp_path / "orbax"), model.cfg, model.params, model.dtype)
    m2 = k3jax.load_model(str(tmp_path / "orbax"))
    np.testing.assert_array_equal(m2.forward(ids), full_logits)


def _broken_checkpoint(model, tmp_path, mutate):
    from safetensors.numpy import load_file, save_file

    path = str(tmp_path / "broken")
    save_hf_checkpoint(path, model.cfg, model.params)
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    mutate(tensors)
    save_file(tensors, f)
    return path


# loaded whole, and straight into a placement (a 1-device mesh: read shard by shard, tests/test_sharding.py)
PLACED = [{}, dict(devices=[0])]


@pytest.mark.parametrize("where", PLACED)
def test_missing_tensor_is_named(model, tmp_path, where):
    prefix = "language_model." if model.cfg.family == "kimi_k3" else ""
    name = f"{prefix}model.layers.1.self_attn.q_proj.weight"
    path = _broken_checkpoint(model, tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        k3jax.load_model(path, **where)


@pytest.mark.parametrize("where", PLACED)
def test_misshaped_tensor_names_both_shapes(model, tmp_path, where):
    prefix = "language_model." if model.cfg.family == "kimi_k3" else ""
    name = f"{prefix}model.norm.weight"
    path = _broken_checkpoint(model, tmp_path, lambda t: t.__setitem__(name, np.ones(5, np.float32)))
    with pytest.raises(CheckpointError, match=rf"{name.replace('.', '.')}.*\(5,\).*\({model.cfg.hidden_size},\)"):
        k3jax.load_model(path, **where)


def test_bad_inputs_are_clear(model):
    with pytest.raises(ValueError, match="token ids"):
        model.forward(np.array([[0, model.cfg.vocab_size]]))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        model.forward(np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate_greedy(np.array([[1, 2]]), 0)
    with pytest.raises(FileNotFoundError):
        k3jax.load_model("/nonexistent/dir")
    with pytest.raises(ValueError, match="dtype"):
        k3jax.load_model("tiny-k3", dtype="float16")


def test_num_params_counts_as_info_does(model):
    """`Model.num_params` (the notebook's and `k3jax convert`'s count) is `k3jax info`'s total: an MXFP4 byte
    holds two parameters, its scales none (it counted array elements: tiny-k3 464,748 against 545,388)."""
    from k3jax.runtime import abstract_model, param_counts

    assert model.num_params == param_counts(model.cfg, abstract_model(model.cfg, model.dtype)[1])["total"]
    packed = [x for p, x in jax.tree_util.tree_flatten_with_path(model.params)[0] if "weight_packed" in str(p)]
    assert bool(packed) == (model.cfg.family == "kimi_k3")
    assert model.num_params == (545_388 if model.cfg.family == "kimi_k3" else 315_252)


def test_real_shapes_are_abstract_only():
    with pytest.raises(ValueError, match="planning"):
        k3jax.load_model("k3")


def _edit_config(path, edit):
    f = os.path.join(path, "config.json")
    d = json.load(open(f))
    edit(d.get("text_config", d))
    json.dump(d, open(f, "w"))


def test_tensors_the_config_has_no_place_for_are_an_error(model, tmp_path):
    """config.json without num_shared_experts (HF's default: 1) beside shared-expert weights: the loader dropped
    the shared experts with a log warning and served a model with other logits."""
    path = str(tmp_path / "ckpt")
    save_hf_checkpoint(path, model.cfg, model.params)
    _edit_config(path, lambda tc: tc.pop("num_shared_experts"))
    with pytest.raises(CheckpointError, match=r"shared_experts.*config\.json does not match the weights"):
        k3jax.load_model(path)


def test_bad_shard_index_or_file_is_named(model, tmp_path):
    path = str(tmp_path / "ckpt")
    save_hf_checkpoint(path, model.cfg, model.params, max_shard_bytes=100_000)
    index = os.path.join(path, "model.safetensors.index.json")
    first = sorted(set(json.load(open(index))["weight_map"].values()))[0]
    os.rename(os.path.join(path, first), os.path.join(path, "moved"))
    with pytest.raises(CheckpointError, match=rf"index\.json: weight_map names 1 file.*{first}"):
        k3jax.load_model(path)
    open(os.path.join(path, first), "wb").write(b"not safetensors")
    with pytest.raises(CheckpointError, match=rf"{first}: not a readable safetensors file"):
        k3jax.load_model(path)
    json.dump({"metadata": {}}, open(index, "w"))
    with pytest.raises(CheckpointError, match=r"index\.json: expected an object with a 'weight_map'"):
        k3jax.load_model(path)


def test_integer_tensor_for_a_float_weight_is_refused(model, tmp_path):
    prefix = "language_model." if model.cfg.family == "kimi_k3" else ""
    name = f"{prefix}model.norm.weight"
    path = _broken_checkpoint(model, tmp_path, lambda t: t.__setitem__(name, np.ones(model.cfg.hidden_size, np.int32)))
    with pytest.raises(CheckpointError, match=rf"{name.replace('.', '.')}: integer data"):
        k3jax.load_model(path)


def test_orbax_config_mismatch_names_the_parameter(model, tmp_path):
    path = str(tmp_path / "orbax")
    save_orbax(path, model.cfg, model.params, model.dtype)
    f = os.path.join(path, "k3jax_config.json")
    d = json.load(open(f))
    d["config"]["vocab_size"] += 1
    json.dump(d, open(f, "w"))
    with pytest.raises(CheckpointError, match=r"(embed_tokens|lm_head) is stored with shape"):
        k3jax.load_model(path)


def test_bad_tokenizer_fails_before_the_weights_are_read(model, tmp_path, monkeypatch):
    """A tiktoken.model without its tokenizer_config.json: the error came after every tensor was read (a full
    K3 checkpoint is 1.5 TB)."""
    import base64

    from k3jax import checkpoint

    path = str(tmp_path / "ckpt")
    save_hf_checkpoint(path, model.cfg, model.params)
    with open(os.path.join(path, "tiktoken.model"), "w") as f:
        f.writelines(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256))
    reads = []
    get = checkpoint.SafetensorsDir.get
    monkeypatch.setattr(checkpoint.SafetensorsDir, "get", lambda st, name, *a: reads.append(name) or get(st, name, *a))
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json"):
        k3jax.load_model(path)
    assert reads == []
