"""fp8 MLA latent cache (`kv_cache_dtype="fp8"`): the codec's error bound and layout, more tokens per
budget, outputs close to the model-dtype cache, and the engine's invariants kept exactly (prefix-cache
hits and batching bit-identical to a cold single request of the same fp8 engine)."""

import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp

import k3jax
from k3jax.config import PRESETS
from serve.cli import engine_config
from serve.engine import Engine, EngineConfig
from serve.latent_codec import LatentCodec
from serve.memory import ArenaLayout
from test_prefix_cache import close_to_exact, config, logprobs, run, toks, warm_batch_equals_cold


def latents(seed, shape, width):
    """Normal draws whose scale varies by token over five decades (each tile needs its own scale)."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    mag = 10.0 ** jax.random.uniform(k2, (*shape, 1), minval=-3, maxval=2)
    return jax.random.normal(k1, (*shape, width)) * mag


@pytest.mark.parametrize("dtype,words", [("bfloat16", 164), ("float32", 196)])
def test_fp8_codec_error_bound_and_layout(dtype, words):
    codec = LatentCodec.make("fp8", dtype, 576, 64)
    assert codec.words == words and codec.tile == 128  # bf16: 656 B per token, DeepSeek's fp8_ds_mla
    x = latents(0, (7, 33), 576).astype(dtype)
    w = jax.jit(codec.encode)(x)
    y = jax.jit(codec.decode)(w)
    assert w.shape == (7, 33, words) and w.dtype == jnp.float32 and y.dtype == x.dtype
    assert bool(jnp.all(y[..., 512:] == x[..., 512:]))  # the rotary key is stored exactly
    xf, yf = x[..., :512].astype(jnp.float32), y[..., :512].astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf.reshape(7, 33, 4, 128)), -1, keepdims=True)
    scale = jnp.broadcast_to(amax / 224.0, (7, 33, 4, 128)).reshape(7, 33, 512)  # the largest scale used
    # half an e4m3 step (2^-4 relative) or the subnormal floor, plus the model dtype's own rounding
    rounding = 2.0 ** -8 if dtype == "bfloat16" else 0.0
    bound = (2.0 ** -4 + rounding) * jnp.abs(xf) + 2.0 ** -10 * scale
    assert bool(jnp.all(jnp.abs(yf - xf) <= bound))
    err = jnp.abs(yf - xf) / amax.repeat(128, -1).reshape(7, 33, 512)
    assert 0 < float(jnp.mean(err)) < 0.01  # lossy, but tile-relative error ~ 0.5 %


def test_fp8_codec_is_per_token_and_keeps_zeros():
    """A token's words depend on that token alone: a prefill's chunking, batching or prefix-cache resume
    cannot change what is stored. Zero words (a fresh arena) decode to zeros."""
    codec = LatentCodec.make("fp8", "float32", 40, 8)  # tiny presets: 32 compressed values, one scale
    assert codec.tile == 32 and codec.words == 32 // 4 + 1 + 8
    x = latents(1, (5, 9), 40)
    whole = np.asarray(codec.encode(x))
    one = np.stack([np.asarray(codec.encode(x[i:i + 1, j]))[0] for i in range(5) for j in range(9)])
    assert whole.reshape(45, -1).tobytes() == one.tobytes()
    assert not np.any(np.asarray(codec.decode(jnp.zeros((3, codec.words)))))
    for big in (1e6, 1e30, 1e-30, 1e-40):  # no overflow to NaN, no tile flushed to zero by its scale
        y = np.asarray(codec.decode(codec.encode(x * big)))
        assert np.isfinite(y).all() and (big < 1e-39 or np.count_nonzero(y) > 0.9 * y.size)


def test_kv_cache_dtype_names_and_errors():
    assert LatentCodec.make("fp8_ds_mla", "bfloat16", 576, 64) == LatentCodec.make("fp8_e4m3", "bfloat16", 576, 64)
    assert LatentCodec.make("auto", "bfloat16", 576, 64).words == 288
    for bad in ("fp8_e5m2", "int8", None):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            EngineConfig(kv_cache_dtype=bad).validate()
    EngineConfig(kv_cache_dtype="fp8", mla_decode="paged").validate()  # the paged kernel reads fp8 words
    args = dict(max_model_len=64, max_num_seqs=2, page_size=16, prefill_chunk=16, decode_buckets=None,
                prefill_buckets=None, context_buckets=None, cache_mb=8, max_logprobs=1, seed=0,
                kv_cache_dtype="fp8")
    assert engine_config(args).kv_cache_dtype == "fp8"


def test_fp8_arena_holds_more_tokens_in_the_same_budget():
    """K3 at full size, bf16: 656 instead of 1152 bytes per token and MLA layer, so the same budget holds
    1.76x the MLA pages; the KDA state slot (fp32) is the same bytes, spanning more of the smaller units."""
    cfg, budget = PRESETS["k3"], 64 << 30
    lay = {k: ArenaLayout.plan(cfg, budget, 64, jnp.bfloat16, kv_cache_dtype=k) for k in ("auto", "fp8")}
    assert (lay["auto"].unit_bytes, lay["fp8"].unit_bytes) == (64 * 1152, 64 * 656)
    ratio = lay["fp8"].num_units / lay["auto"].num_units
    assert 1.75 < ratio < 1.76
    state = lambda l: l.slot_units * l.unit_bytes
    assert abs(state(lay["fp8"]) - state(lay["auto"])) <= lay["auto"].unit_bytes  # same state bytes


def test_info_plans_the_arena(capsys):
    """`k3jax info --cache-gib` plans one rank's arena from abstract shapes (no weights): with k3-small's KDA
    heads over 4 tensor-parallel ranks, fp8 latents fit more long requests than fp32 ones."""
    import json

    from k3jax.cli import main

    plans = {}
    for kind in ("auto", "fp8"):
        assert main(["info", "--model", "k3-small", "--dtype", "float32", "--sharding", "tp", "--devices", "4",
                     "--cache-gib", "0.25", "--context", "1024,16384", "--kv-cache-dtype", kind]) == 0
        plans[kind] = json.loads(capsys.readouterr().out)["arena"]
    a, f = plans["auto"], plans["fp8"]
    assert (a["mla_bytes_per_token_per_layer"], f["mla_bytes_per_token_per_layer"]) == (2304, 784)
    assert a["kda_state_ranks"] == 4
    # each request: its slot + every MLA layer's ceil(tokens / 64) pages of 64 x 2304 bytes
    unit, mla = 64 * 2304, PRESETS["k3-small"].num_mla_layers
    units, slot = (1 << 28) // unit, -(-a["state_slot_bytes_per_rank"] // unit)
    assert a["sequences"]["16384"] == (units - 1 - slot) // (slot + mla * 256) > 0
    assert f["sequences"]["16384"] > 2 * a["sequences"]["16384"] and f["sequences"]["1024"] > a["sequences"]["1024"]


@pytest.fixture(scope="module")
def engines():
    """fp8 with and without the prefix cache, and the model-dtype cache: the prefix-cache tests' config.

    tiny-kimi-linear (one MLA layer). On tiny-k3 (three MLA layers and AttnRes, random weights) one
    latent's fp8 rounding moved a later token's logprobs by ~1 in a probe; the same rounding emulated
    in fp32 storage did the same, so that is the random model's sensitivity, not the storage."""
    model = k3jax.load_model("tiny-kimi-linear", seed=2)
    units = 6000 // 64
    on = Engine(model, config(64, 16, units, kv_cache_dtype="fp8"), progress=False)
    off = Engine(model, config(64, 16, units, kv_cache_dtype="fp8", enable_prefix_caching=False), progress=False)
    exact = Engine(model, config(64, 16, units, enable_prefix_caching=False), progress=False)
    return on, off, exact


def test_fp8_engine_stays_close_to_the_model_dtype_cache(engines):
    on, off, exact = engines
    assert off.stats()["kv_bytes_per_token_per_layer"] == 17 * 4 and exact.stats()["kv_bytes_per_token_per_layer"] == 160
    assert off.layout.num_units > 2 * exact.layout.num_units  # same cache_bytes, 40 -> 17 words per token
    close_to_exact(exact, off, [toks(40 + s, 40 + 60 * s) for s in range(4)])


def test_fp8_prefix_hits_and_batching_are_bit_identical(engines):
    """A warm resume reads exactly the words a cold prefill attended over, and a request's result does
    not depend on its batch: both bit-identical to a lone cold request of the fp8 engine."""
    on, off, _ = engines
    warm_batch_equals_cold(on, off, toks(7, 100), 96, seed=8)  # prompt-end checkpoint at 96
    for e in (on, off):
        assert e.stats()["compiles_after_warmup"] == 0
        assert e.allocator.free_units + e._cached_units() == e.allocator.baseline_free_units


def test_fp8_paged_decode_reads_the_words(engines, monkeypatch):
    """mla_decode='paged' over fp8 latents: each decode step's MLA op reads the arena's words through the page
    table and dequantises them itself (`pallas_kernels.mla.Fp8Latents`; on CPU the op's reference, whose
    kernels are checked against it in tests/test_mla_paged.py), with stale words in the free units: the same
    tokens as the gathered form, logprobs to fp32 rounding, no compile after warm-up."""
    import serve.step

    _, off, _ = engines
    seen, op = [], serve.step.paged_mla_decode
    monkeypatch.setattr(serve.step, "paged_mla_decode", lambda *a, **kw: seen.append((a[2].shape, kw["kv_format"]))
                        or op(*a, **kw))
    paged = Engine(off.model, dataclasses.replace(off.config, mla_decode="paged"), progress=False)
    assert paged.mla_paged and paged.stats()["decode_forms"]["mla"] == "paged"
    words = paged.layout.codec.words  # the op is handed the arena's words (17 a token here), not decoded values
    assert seen and all(shape[-1] == words and fmt == paged.layout.codec.kernel_format() for shape, fmt in seen)
    free = np.flatnonzero(paged.allocator.owner == paged.allocator.FREE)
    paged.arena = paged.arena.at[free].set(np.uint32(0x3F807F7F).view(np.float32))
    for p in (toks(3, 37), toks(5, 70)):
        a, b = logprobs(run(off, p, n=10)), logprobs(run(paged, p, n=10))
        assert [x[0] for x in a] == [x[0] for x in b]
        np.testing.assert_allclose([x[1] for x in a], [x[1] for x in b], atol=1e-4)
    assert paged.stats()["compiles_after_warmup"] == 0


def test_fp8_engine_never_reads_stale_words(engines):
    """Context slots past a row's last token hold whatever their units held before; read as fp8 codes and
    scales such words are NaN or inf at times. With every free unit filled with a finite float32 whose bytes
    include an fp8 NaN code (0x7F), the same prompt gives the same tokens and logprobs."""
    _, off, _ = engines
    prompt = toks(3, 37)
    want = logprobs(run(off, prompt))
    free = np.flatnonzero(off.allocator.owner == off.allocator.FREE)
    off.arena = off.arena.at[free].set(np.uint32(0x3F807F7F).view(np.float32))
    assert logprobs(run(off, prompt)) == want
    assert off.stats()["compiles_after_warmup"] == 0
