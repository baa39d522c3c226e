"""Whole-model behaviour: cache-free forward vs chunked prefill + decode, padding, checkpoints, CLI."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from k3jax import steps
from k3jax.cache import init_cache
from k3jax.checkpoint import CheckpointError, save_hf_checkpoint, save_orbax

T = 70  # longer than one 64-token KDA chunk, not a multiple of it
# The cache length of every cached test: the one `generate_greedy` rounds its cache to (a multiple of 256), so the
# chunked-prefill and decode tests run the programs it compiles (each cache length is a program of its own; CI time)
MAX_LEN = 256


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
    logits, cache = model.prefill(ids[:, :T - 1], max_len=MAX_LEN)
    assert rel(logits, full_logits[:, T - 2]) < 1e-5
    logits, cache = steps.decode_step(model.graphdef, model.params, cache, jnp.asarray(ids[:, T - 1]))
    assert rel(logits, full_logits[:, T - 1]) < 1e-5
    assert np.asarray(cache.lengths).tolist() == [T, T]


def test_ragged_rows_match_their_own_forward(model, ids, full_logits):
    """Two rows with different real lengths in one padded prefill chunk (the [2, 32] chunk that
    `test_prefill_then_decode_equals_forward` compiles: a chunk of another length is a program of its own)."""
    chunk, short = model.prefill_chunk, 20
    cache = init_cache(model.cfg, 2, MAX_LEN, model.dtype)
    valid = jnp.array([chunk, short], jnp.int32)
    piece = ids[:, :chunk].copy()
    piece[1, short:] = 7  # garbage after the real tokens must not matter
    logits, cache = steps.prefill_step(model.graphdef, model.params, cache, jnp.asarray(piece), valid)
    assert rel(logits[0], full_logits[0, chunk - 1]) < 1e-5
    # row 1's reference: the whole forward at its 20th token (causal: what a forward over its 20 tokens gives;
    # no program of another shape to compile)
    assert rel(logits[1], full_logits[1, short - 1]) < 1e-5
    # decode continues each row from its own length
    nxt = jnp.asarray([ids[0, chunk], ids[1, short]])
    logits, cache = steps.decode_step(model.graphdef, model.params, cache, nxt)
    assert rel(logits[0], full_logits[0, chunk]) < 1e-5 and rel(logits[1], full_logits[1, short]) < 1e-5


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
    assert m2.cfg == model.cfg and m2.graphdef == model.graphdef
    # Orbax restores arrays committed to the device, which jit lowers as another program than the preset's
    # uncommitted ones (a second forward compile, CI time): the same values (dtypes kept) handed over uncommitted
    # run `m2.forward`'s computation in the program compiled above
    params = jax.tree.map(np.asarray, m2.params)
    np.testing.assert_array_equal(np.asarray(steps.forward(m2.graphdef, params, ids)), full_logits)


def _with_embed(model, embed):
    """`model.params` with `embed_tokens` replaced (another model's weights, to tell two saves apart)."""
    from flax import nnx

    return nnx.from_flat_state([(k, v.replace(value=jnp.asarray(embed)) if k == ("embed_tokens",) else v)
                                for k, v in nnx.to_flat_state(model.params)])


def test_saving_over_an_earlier_save_replaces_its_weights(model, tmp_path):
    """A save over an earlier sharded one left its model.safetensors.index.json: load_model read the old shards
    (the new model.safetensors ignored); over a single-file save, the stale model.safetensors (what HF reads
    first) stayed beside the new index. A directory holding an Orbax checkpoint (read first) is refused."""
    path = str(tmp_path / "ckpt")
    embed = lambda m: np.asarray(m.params["embed_tokens"][...])
    other = _with_embed(model, embed(model) + 1)
    save_hf_checkpoint(path, model.cfg, model.params, max_shard_bytes=100_000)
    save_hf_checkpoint(path, model.cfg, other)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]
    np.testing.assert_array_equal(embed(k3jax.load_model(path)), embed(model) + 1)
    save_hf_checkpoint(path, model.cfg, model.params, max_shard_bytes=100_000)
    assert "model.safetensors" not in os.listdir(path)
    np.testing.assert_array_equal(embed(k3jax.load_model(path)), embed(model))
    save_orbax(str(tmp_path / "orbax"), model.cfg, model.params, model.dtype)
    with pytest.raises(CheckpointError, match=r"orbax: holds an Orbax checkpoint"):
        save_hf_checkpoint(str(tmp_path / "orbax"), model.cfg, other)


def test_convert_copies_the_tokenizer_and_generation_config(tmp_path, capsys):
    """`k3jax convert HF_DIR DST` wrote the weights alone: DST loaded with the byte tokenizer (other token ids,
    garbage text) and without the checkpoint's sampling defaults."""
    import dataclasses

    from test_tokenizer import KL_SPECIALS, synthetic_ranks, write_tokenizer_dir

    from k3jax.cli import main
    from k3jax.config import get_preset
    from k3jax.runtime import init_model
    from serve import generation_config

    ranks = synthetic_ranks()
    cfg = dataclasses.replace(get_preset("tiny-kimi-linear"), vocab_size=len(ranks) + 256, bos_token_id=len(ranks),
                              eos_token_ids=(len(ranks) + 1,), pad_token_id=len(ranks) + 255)
    src, dst = tmp_path / "hf", str(tmp_path / "orbax")
    save_hf_checkpoint(str(src), cfg, init_model(cfg, np.float32, 0)[1])
    write_tokenizer_dir(src, ranks, KL_SPECIALS)
    json.dump({"temperature": 0.3}, open(src / "generation_config.json", "w"))
    assert main(["convert", str(src), dst, "--dtype", "float32"]) == 0
    assert "with tiktoken.model, tokenizer_config.json, generation_config.json" in capsys.readouterr().out
    want, got = k3jax.load_model(str(src)).tokenizer, k3jax.load_model(dst).tokenizer
    assert type(got) is type(want) and got.encode("hello world") == want.encode("hello world")
    assert generation_config.read(dst) == generation_config.read(str(src)) == {"temperature": 0.3}


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
    for dtype in (jnp.float16, np.int32):  # as objects they were taken: a float16 model, an int32 one (all zeros)
        with pytest.raises(ValueError, match="dtype must be one of"):
            k3jax.load_model("tiny-k3", dtype=dtype)
    assert k3jax.load_model("tiny-k3", dtype=jnp.bfloat16).dtype == jnp.bfloat16


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


def test_bools_for_a_float_weight_are_refused(model, tmp_path):
    """bool data (not an integer to NumPy) passed the integer check and was cast to 0.0 / 1.0."""
    prefix = "language_model." if model.cfg.family == "kimi_k3" else ""
    name = f"{prefix}model.norm.weight"
    path = _broken_checkpoint(model, tmp_path, lambda t: t.__setitem__(name, np.ones(model.cfg.hidden_size, bool)))
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)}: non-float data \(bool\)"):
        k3jax.load_model(path)


EXPERT = "language_model.model.layers.1.block_sparse_moe.experts.3.w1."


@pytest.mark.parametrize("what,dtype", [("weight_packed", np.float32), ("weight_scale", np.uint16)])
def test_mxfp4_bytes_of_another_dtype_are_refused(model, tmp_path, what, dtype):
    """Float or wider-integer MXFP4 blocks / scales were cast to uint8 silently (2.7 -> 2, 300 -> 44): a wrong
    model with no error."""
    if model.cfg.expert_format != "mxfp4":
        pytest.skip("no MXFP4 experts")
    name = EXPERT + what
    path = _broken_checkpoint(model, tmp_path, lambda t: t.__setitem__(name, t[name].astype(dtype)))
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)}: {np.dtype(dtype)} data where the model expects "
                                              rf"packed uint8"):
        k3jax.load_model(path)


def test_mxfp4_bytes_as_int8_load_bit_for_bit(model, ids, full_logits, tmp_path):
    if model.cfg.expert_format != "mxfp4":
        pytest.skip("no MXFP4 experts")
    name = EXPERT + "weight_packed"
    path = _broken_checkpoint(model, tmp_path, lambda t: t.__setitem__(name, t[name].view(np.int8)))
    np.testing.assert_array_equal(k3jax.load_model(path).forward(ids), full_logits)


def _set_stored_dtype(file, name, dtype):
    """Rewrite the safetensors header's dtype of tensor `name` (same bytes: e.g. U8 -> F8_E8M0)."""
    data = open(file, "rb").read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header[name]["dtype"] = dtype
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    open(file, "wb").write(len(raw).to_bytes(8, "little") + raw + data[8 + n:])


def test_a_dtype_numpy_cannot_read_is_named(model, tmp_path):
    """An MXFP4 scale stored as F8_E8M0 (torch.float8_e8m0fnu) failed deep in safetensors' NumPy reader with
    "module 'numpy' has no attribute 'float8_e8m0fnu'"."""
    if model.cfg.expert_format != "mxfp4":
        pytest.skip("no MXFP4 experts")
    path = _broken_checkpoint(model, tmp_path, lambda t: None)
    name = EXPERT + "weight_scale"
    _set_stored_dtype(os.path.join(path, "model.safetensors"), name, "F8_E8M0")
    for where in PLACED:
        with pytest.raises(CheckpointError, match=rf"{re.escape(name)} in model\.safetensors: dtype F8_E8M0 cannot be "
                                                  rf"read"):
            k3jax.load_model(path, **where)


def test_a_tensor_in_two_files_without_an_index_is_refused(model, tmp_path):
    """With no index, every *.safetensors file was read and the last file (by name) silently won a tensor that
    two files hold (HF reads model.safetensors alone): another model than either file's."""
    from safetensors.numpy import save_file

    prefix = "language_model." if model.cfg.family == "kimi_k3" else ""
    name = f"{prefix}model.norm.weight"
    path = str(tmp_path / "ckpt")
    save_hf_checkpoint(path, model.cfg, model.params)
    save_file({name: np.zeros(model.cfg.hidden_size, np.float32)}, os.path.join(path, "zz-extra.safetensors"))
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(name)} is in both model\.safetensors and "
                                              rf"zz-extra\.safetensors"):
        k3jax.load_model(path)


def test_a_log_past_num_heads_must_be_zero_padding(model, tmp_path):
    """K3 pads A_log with zeros past num_heads; live values there (the weights of a model with more heads than
    config.json says) were dropped silently."""
    prefix = "language_model." if model.cfg.family == "kimi_k3" else ""
    name = f"{prefix}model.layers.0.self_attn.A_log"
    pad = lambda t, v: t.__setitem__(name, np.concatenate([t[name].reshape(-1), np.full(4, v, np.float32)]))
    path = _broken_checkpoint(model, tmp_path, lambda t: pad(t, 0.5))
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)}: A_log has {model.cfg.kda_num_heads + 4} entries "
                                              rf"for {model.cfg.kda_num_heads} heads, and those past"):
        k3jax.load_model(path)
    path = _broken_checkpoint(model, tmp_path, lambda t: pad(t, 0.0))
    assert k3jax.load_model(path).cfg == model.cfg


def test_load_model_takes_a_pathlib_path(model, tmp_path):
    """`load_model(pathlib.Path(dir))` (HF's from_pretrained takes one) failed with an AttributeError (rstrip)."""
    save_hf_checkpoint(str(tmp_path / "ckpt"), model.cfg, model.params)
    m2 = k3jax.load_model(tmp_path / "ckpt")
    assert m2.cfg == model.cfg and m2.source == str(tmp_path / "ckpt")
    embed = lambda m: np.asarray(m.params["embed_tokens"][...])
    np.testing.assert_array_equal(embed(m2), embed(model))


def test_an_exported_checkpoint_names_its_dtype(tmp_path):
    """save_hf_checkpoint wrote no torch_dtype: a bfloat16 export came back in float32 under dtype="auto"."""
    m = k3jax.load_model("tiny-kimi-linear", dtype="bfloat16")
    save_hf_checkpoint(str(tmp_path / "ckpt"), m.cfg, m.params)
    assert k3jax.load_model(str(tmp_path / "ckpt"), dtype="auto").dtype == jnp.bfloat16


def test_incomplete_orbax_dir_is_named(model, tmp_path):
    """An Orbax directory without its params/ said it had no k3jax_config.json; an empty or damaged params/ said
    every parameter was missing."""
    import shutil

    path = str(tmp_path / "orbax")
    save_orbax(path, model.cfg, model.params, model.dtype)
    params = os.path.join(path, "params")
    shutil.rmtree(params)
    with pytest.raises(CheckpointError, match=r"k3jax_config\.json without its params/ directory"):
        k3jax.load_model(path)
    os.makedirs(params)
    with pytest.raises(CheckpointError, match=r"params: no readable Orbax checkpoint \(empty or damaged\)"):
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


def test_checkpoint_without_tokenizer_files_stops_on_its_own_eos_ids(model, tmp_path):
    """Without tokenizer files the byte tokenizer stands in, and its specials 257 (<|eos|>) / 261 (<|im_end|>)
    were stop ids even for a model whose eos is another id (there they are ordinary tokens: generation ended where
    HF's goes on). The stop ids are the checkpoint's eos ids, config.json's and generation_config.json's; a preset
    saved as a checkpoint (the byte tokenizer's own specials) keeps <|im_end|>."""
    from serve.engine import Engine, EngineConfig

    path = str(tmp_path / "ckpt")
    save_hf_checkpoint(path, model.cfg.replace(bos_token_id=1, eos_token_ids=(2,), pad_token_id=3), model.params)
    json.dump({"eos_token_id": [2, 300, 9999]}, open(os.path.join(path, "generation_config.json"), "w"))
    m = k3jax.load_model(path)
    assert m.tokenizer.eos_token_ids == (2, 300)  # (9999: past the vocabulary, never generated)
    eng = Engine(m, EngineConfig(max_model_len=32, page_size=16, cache_bytes=60 * 2560, max_num_seqs=1,
                                 prefill_chunk=16, max_prefill_seqs=1, max_num_batched_tokens=32,
                                 decode_buckets=(1,), prefill_buckets=(1,), context_buckets=(2,),
                                 enable_prefix_caching=False, measure_moe_time=False), warmup=False, progress=False)
    assert set(eng.stop_ids) == {2, 300}
    save_hf_checkpoint(str(tmp_path / "preset"), model.cfg, model.params)
    assert k3jax.load_model(str(tmp_path / "preset")).tokenizer.eos_token_ids == (257, 261)
