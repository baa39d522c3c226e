"""Paged absorbed-MLA decode: reference vs brute force, Pallas kernels (interpret) vs reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla import paged_mla_decode, paged_mla_decode_reference
from pallas_kernels.mla.kernel import paged_mla_decode_pallas

from numeric_checks import assert_close

B, H, L, R, PS, MAX_PAGES, NUM_PAGES = 4, 16, 32, 8, 4, 3, 12
SCALE = (L // 4 + R) ** -0.5
SEQ_LENS = [9, 5, 0, 12]  # ragged, partial last page, a length-0 row, an exactly full table
PAGE_TABLE = [
    [1, 2, 3],     # 9 tokens: pages 1,2 full + 1 slot of page 3 (rest of page 3 is stale)
    [4, 5, 11],    # 5 tokens: entry 2 is stale and points at a NaN-filled page
    [7, -5, 100],  # length 0: every entry is garbage, some out of range
    [10, 0, 6],    # 12 tokens: all three pages used
]


def _brute(q, qr, kv, pt, sl, scale):
    q, qr, kv = (np.asarray(a, np.float64) for a in (q, qr, kv))
    out = np.zeros((q.shape[0], q.shape[1], L))
    for b in range(q.shape[0]):
        n = sl[b]
        if n == 0:
            continue
        toks = np.concatenate([kv[pt[b][j]] for j in range(-(-n // PS))])[:n]
        s = (q[b] @ toks[:, :L].T + qr[b] @ toks[:, L:].T) * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        out[b] = (p / p.sum(-1, keepdims=True)) @ toks[:, :L]
    return out


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, L)).astype(np.float32)
    qr = rng.standard_normal((B, H, R)).astype(np.float32)
    kv = rng.standard_normal((NUM_PAGES, PS, L + R)).astype(np.float32)
    kv[11] = np.nan  # only reachable through a stale entry
    kv[3, 1:] = np.inf  # stale slots in the last page of sequence 0
    args = dict(q_latent=jnp.asarray(q), q_rope=jnp.asarray(qr), kv_pages=jnp.asarray(kv),
                page_table=jnp.asarray(PAGE_TABLE, jnp.int32), seq_lens=jnp.asarray(SEQ_LENS, jnp.int32))
    ref = np.asarray(paged_mla_decode_reference(**args, scale=SCALE))
    return dict(args=args, ref=ref, np=(q, qr, kv))


def test_reference_matches_brute_force(data):
    q, qr, kv = data["np"]
    want = _brute(q, qr, kv, PAGE_TABLE, SEQ_LENS, SCALE)
    assert_close(data["ref"], want)
    assert np.all(data["ref"][2] == 0)


@pytest.mark.parametrize("variant,block_h", [("mosaic", 8), ("triton", 16)])
def test_kernel_matches_reference(data, variant, block_h):
    fn = jax.jit(lambda a: paged_mla_decode_pallas(**a, scale=SCALE, interpret=True, variant=variant,
                                                    block_h=block_h))
    out = np.asarray(fn(data["args"]))
    assert out.shape == (B, H, L) and out.dtype == np.float32
    assert_close(out, data["ref"])
    assert np.all(out[2] == 0)


def _brute_lse(q, qr, kv, pt, sl, scale):
    q, qr, kv = (np.asarray(a, np.float64) for a in (q, qr, kv))
    out = np.full((q.shape[0], q.shape[1]), -np.inf)
    for b in range(q.shape[0]):
        if sl[b]:
            toks = np.concatenate([kv[pt[b][j]] for j in range(-(-sl[b] // PS))])[:sl[b]]
            s = (q[b] @ toks[:, :L].T + qr[b] @ toks[:, L:].T) * scale
            out[b] = s.max(-1) + np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1))
    return out


@pytest.mark.parametrize("impl", ["reference", "mosaic", "triton"])
def test_log_sum_exp_output(data, impl):
    """`return_lse`: each row's log-sum-exp of its scores (what combines attention over token sets split
    across ranks), -inf for an empty row; the context output is unchanged."""
    q, qr, kv = data["np"]
    if impl == "reference":
        fn = lambda a: paged_mla_decode_reference(**a, scale=SCALE, return_lse=True)  # noqa: E731
    else:
        fn = lambda a: paged_mla_decode_pallas(**a, scale=SCALE, interpret=True, variant=impl,  # noqa: E731
                                               block_h=8 if impl == "mosaic" else 16, return_lse=True)
    ctx, lse = jax.jit(fn)(data["args"])
    want = _brute_lse(q, qr, kv, PAGE_TABLE, SEQ_LENS, SCALE)
    assert lse.shape == (B, H) and lse.dtype == jnp.float32
    assert np.all(np.isneginf(np.asarray(lse)[2]))
    keep = np.asarray(SEQ_LENS) > 0
    np.testing.assert_allclose(np.asarray(lse, np.float64)[keep], want[keep], rtol=1e-5, atol=1e-5)
    assert_close(ctx, data["ref"])


def test_triton_pads_a_head_count_no_block_divides(data):
    """12 heads (K3's 96 over 8 tensor-parallel ranks): Triton needs power-of-two blocks, so the wrapper runs
    16 heads and slices; the same rows as the reference's."""
    args = dict(data["args"], q_latent=data["args"]["q_latent"][:, :12], q_rope=data["args"]["q_rope"][:, :12])
    ctx, lse = jax.jit(lambda a: paged_mla_decode_pallas(**a, scale=SCALE, interpret=True, variant="triton",
                                                         return_lse=True))(args)
    ref_ctx, ref_lse = paged_mla_decode_reference(**args, scale=SCALE, return_lse=True)
    assert ctx.shape == (B, 12, L) and lse.shape == (B, 12)
    assert_close(ctx, data["ref"][:, :12])
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5)


def test_stale_entries_do_not_matter(data):
    a = dict(data["args"])
    pt = np.array(PAGE_TABLE)
    pt[1, 2] = 9  # a different stale page
    a["page_table"] = jnp.asarray(pt, jnp.int32)
    kv = np.asarray(a["kv_pages"]).copy()
    kv[3, 1:] = -7.0  # different stale slot contents
    a["kv_pages"] = jnp.asarray(kv)
    out = paged_mla_decode_pallas(**a, scale=SCALE, interpret=True, variant="mosaic", block_h=16)
    assert_close(out, data["ref"])
    np.testing.assert_array_equal(np.asarray(paged_mla_decode_reference(**a, scale=SCALE)), data["ref"])


@pytest.mark.parametrize("backend", ["reference", "interpret"])
@pytest.mark.parametrize("name", ["page_table", "seq_lens"])
def test_index_arguments_must_be_integers(data, backend, name):
    """A float page table or length vector raises naming it (both forms had truncated it to ints silently:
    page 1.7 read as page 1)."""
    a = dict(data["args"])
    a[name] = a[name].astype(jnp.float32) + 0.7
    with pytest.raises(TypeError, match=f"^{name} must be an integer array"):
        paged_mla_decode(**a, scale=SCALE, backend=backend)


def test_ops_dispatch_and_bf16(data, monkeypatch):
    monkeypatch.delenv("K3JAX_KERNELS", raising=False)
    out = paged_mla_decode(**data["args"], scale=SCALE, backend="reference")
    np.testing.assert_array_equal(np.asarray(out), data["ref"])
    a = {k: (v.astype(jnp.bfloat16) if v.dtype == jnp.float32 else v) for k, v in data["args"].items()}
    a["kv_pages"] = jnp.nan_to_num(a["kv_pages"])  # bf16 run: finite cache
    ref16 = paged_mla_decode(**a, scale=SCALE, backend="reference")
    out16 = paged_mla_decode(**a, scale=SCALE, backend="interpret")
    assert out16.dtype == jnp.bfloat16
    assert_close(out16.astype(jnp.float32), ref16.astype(jnp.float32), rtol=3e-2)


# ----------------------------------------------------------------------------- lowering / device
_TRITON_CHECKS = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


@pytest.mark.parametrize("return_lse,fp8", [(False, False), (True, False), (False, True)],
                         ids=["ctx", "ctx+lse", "fp8"])
@pytest.mark.parametrize("platform,variant", [("tpu", "mosaic"), ("cuda", "triton")])
def test_kernel_lowers_at_k3_shapes(platform, variant, return_lse, fp8):
    """Lower (not run) the kernel for TPU Mosaic / GPU Triton at K3 MLA shapes (96 heads, 512+64), also
    with the log-sum-exp output decode context parallelism uses (12 heads: one of 8 tensor-parallel ranks),
    and over fp8 latent pages (164 words a token, dequantised in the tile)."""
    from pallas_kernels.mla import Fp8Latents

    b, h, ps, mp, pages = 4, 12 if return_lse else 96, 16, 8, 64  # 12: Triton pads to 16 heads
    dt = jnp.bfloat16
    fmt = Fp8Latents(512, 64, 128) if fp8 else None
    args = (jax.ShapeDtypeStruct((b, h, 512), dt), jax.ShapeDtypeStruct((b, h, 64), dt),
            jax.ShapeDtypeStruct((pages, ps, 576), dt) if not fp8 else
            jax.ShapeDtypeStruct((pages, ps, fmt.words), jnp.float32),
            jax.ShapeDtypeStruct((b, mp), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32))
    fn = jax.jit(lambda *a: paged_mla_decode_pallas(*a, scale=192 ** -0.5, variant=variant, return_lse=return_lse,
                                                    kv_format=fmt))
    exp = jax.export.export(fn, platforms=[platform], disabled_checks=_TRITON_CHECKS)(*args)
    text = exp.mlir_module()
    assert ("tpu_custom_call" in text) if platform == "tpu" else ("xla.gpu.triton" in text)


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "tpu"), reason="needs a GPU/TPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_device_compiled_kernel(dtype):
    """Device check: compiled (non-interpret) kernel vs reference at K3 latent widths."""
    rng = np.random.default_rng(6)
    b, h, ps, mp, pages = 4, 32, 16, 8, 40
    q = jnp.asarray(rng.standard_normal((b, h, 512)), dtype)
    qr = jnp.asarray(rng.standard_normal((b, h, 64)), dtype)
    kv = jnp.asarray(rng.standard_normal((pages, ps, 576)), dtype)
    pt = jnp.asarray(rng.permutation(pages)[: b * mp].reshape(b, mp), jnp.int32)
    sl = jnp.asarray([100, 0, 128, 17], jnp.int32)
    out = jax.jit(lambda *a: paged_mla_decode_pallas(*a, scale=192 ** -0.5))(q, qr, kv, pt, sl)
    ref = paged_mla_decode_reference(q, qr, kv, pt, sl, scale=192 ** -0.5)
    assert_close(out.astype(jnp.float32), ref.astype(jnp.float32), rtol=1e-5 if dtype == jnp.float32 else 3e-2)


@pytest.mark.parametrize("platform,backend,interpret,env,follows", [
    ("gpu", "auto", False, "", True),  # the Triton kernel: a loop over the row's own pages
    ("gpu", "pallas", False, "", True),
    ("gpu", "interpret", False, "", False),
    ("gpu", "auto", True, "", False),
    ("gpu", "auto", False, "reference", False),  # K3JAX_KERNELS wins
    ("gpu", "reference", False, "", False),  # the reference gathers every table entry
    ("tpu", "auto", False, "", False),  # Mosaic's grid steps over every table entry
    ("cpu", "auto", False, "", False),
    ("cpu", "pallas", False, "", False),  # Pallas on CPU runs interpreted
])
def test_decode_work_follows_length_only_for_the_gpu_kernel(monkeypatch, platform, backend, interpret, env,
                                                              follows):
    """The engine compiles one-token decodes at the widest page table alone where this is True."""
    from pallas_kernels.mla import decode_work_follows_length

    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    monkeypatch.setenv("K3JAX_KERNELS", env)
    assert decode_work_follows_length(backend, interpret) is follows


@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_triton_split_k_matches_reference(data, num_splits):
    """Flash-decoding on the Triton kernel: each row's pages shared by `num_splits` programs (5 > any
    row's 3 pages leaves splits with no keys), merged by log-sum-exp; context and lse equal the
    one-program kernel's, the empty row stays zeros / -inf."""
    q, qr, kv = data["np"]
    ctx, lse = jax.jit(lambda a: paged_mla_decode_pallas(**a, scale=SCALE, interpret=True, variant="triton",
                                                         return_lse=True, num_splits=num_splits))(data["args"])
    assert_close(ctx, data["ref"])
    assert np.all(np.asarray(ctx)[2] == 0) and np.all(np.isneginf(np.asarray(lse)[2]))
    keep = np.asarray(SEQ_LENS) > 0
    want = _brute_lse(q, qr, kv, PAGE_TABLE, SEQ_LENS, SCALE)
    np.testing.assert_allclose(np.asarray(lse, np.float64)[keep], want[keep], rtol=1e-5, atol=1e-5)
    bf = {k: (v.astype(jnp.bfloat16) if v.dtype == jnp.float32 else v) for k, v in data["args"].items()}
    one, many = (paged_mla_decode_pallas(**bf, scale=SCALE, interpret=True, variant="triton", num_splits=n)
                 for n in (1, num_splits))
    assert many.dtype == jnp.bfloat16
    assert_close(np.asarray(many, np.float32), np.asarray(one, np.float32), rtol=2e-2)
    with pytest.raises(ValueError, match="num_splits"):
        paged_mla_decode_pallas(**data["args"], scale=SCALE, interpret=True, variant="triton", num_splits=0)


def test_default_num_splits_fills_the_gpu_only_when_batch_does_not():
    from pallas_kernels.mla.kernel import default_num_splits

    assert default_num_splits(1, 1, 128) == 32           # one row of 8192 tokens (pages of 64): 4 pages each
    assert default_num_splits(1, 1, 3) == 1              # too short to split
    assert default_num_splits(32, 1, 128) == 9           # 32 programs -> 288
    assert default_num_splits(256, 1, 128) == 1          # batch alone fills it


# ---- fp8 latent pages (kv_cache_dtype="fp8"): the kernels dequantise the cache's words in the tile ------------
def _fp8_pages(dtype, lat=L, rope=R):
    """The data fixture's pages as the fp8 codec stores them (float32 words), random magnitudes per token so
    the tiles' scales differ, a stale page of NaN words; -> (format, words, their values as stored)."""
    from serve.latent_codec import LatentCodec
    from pallas_kernels.mla import Fp8Latents

    rng = np.random.default_rng(3)
    codec = LatentCodec.make("fp8", dtype, lat + rope, rope)
    fmt = Fp8Latents(lat, rope, codec.tile, jnp.dtype(dtype).name)
    vals = rng.standard_normal((NUM_PAGES, PS, lat + rope)) * np.exp(rng.normal(0, 2, (NUM_PAGES, PS, 1)))
    words = codec.encode(jnp.asarray(vals, jnp.float32)).at[11].set(np.float32(np.nan))
    return fmt, words, codec.decode(words)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("impl", ["reference", "mosaic", "triton"])
def test_fp8_pages_match_attention_over_the_values_they_store(data, dtype, impl):
    """fp8 pages (compressed part as e4m3 with a power-of-two scale per tile, rotary key in the model dtype)
    passed as words: every form attends over exactly the values the cache stores (the codec's decode), as the
    model-dtype kernel does over decoded pages; stale NaN words and out-of-range entries never leak, length-0
    rows give zeros and -inf. The planes' products sum in another order: fp32 to 1e-5."""
    fmt, words, values = _fp8_pages(dtype)
    assert fmt.words == words.shape[-1] < values.shape[-1] * jnp.dtype(dtype).itemsize // 4
    a = dict(data["args"], q_latent=data["args"]["q_latent"].astype(dtype), q_rope=data["args"]["q_rope"].astype(dtype))
    want, want_lse = paged_mla_decode_reference(**dict(a, kv_pages=values), scale=SCALE, return_lse=True,
                                                out_dtype=jnp.float32)
    if impl == "reference":
        got, lse = paged_mla_decode_reference(**dict(a, kv_pages=words), scale=SCALE, return_lse=True,
                                              out_dtype=jnp.float32, kv_format=fmt)
    else:
        got, lse = jax.jit(lambda a, w: paged_mla_decode_pallas(
            **dict(a, kv_pages=w), scale=SCALE, interpret=True, variant=impl, block_h=16, kv_format=fmt,
            return_lse=True, out_dtype=jnp.float32))(a, words)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert np.all(np.isfinite(np.asarray(got))) and np.all(np.asarray(got)[2] == 0)
    assert_close(got, want, rtol=tol)
    assert np.asarray(lse)[2].tolist() == [-np.inf] * H
    assert_close(np.asarray(lse)[[0, 1, 3]], np.asarray(want_lse)[[0, 1, 3]], rtol=1e-5)
    if impl == "reference" and dtype == jnp.float32:
        q, qr, _ = data["np"]  # and the reference is attention over those values (brute force in float64)
        assert_close(got, _brute(q, qr, np.asarray(values), PAGE_TABLE, SEQ_LENS, SCALE))


def test_fp8_format_checks_and_layout():
    from pallas_kernels.mla import Fp8Latents

    fmt = Fp8Latents(512, 64, 128)
    assert (fmt.words, fmt.tiles, fmt.plane, fmt.scale_word, fmt.rope_word) == (164, 4, 32, 128, 132)
    assert Fp8Latents(512, 64, 128, "float32").words == 196  # an fp32 model's rotary key: 64 words
    with pytest.raises(ValueError, match="tile 96 must divide 512"):
        Fp8Latents(512, 64, 96)
    q = jnp.arange(2 * 512, dtype=jnp.float32).reshape(2, 512)
    ql, qr = fmt.permute(q, jnp.tile(jnp.arange(64, dtype=jnp.float32), (2, 1)))
    assert ql[0, :3].tolist() == [0, 4, 8] and ql[0, 32] == 1 and ql[0, 128] == 128 and qr[0, :2].tolist() == [0, 2]
    np.testing.assert_array_equal(fmt.unpermute(ql), q)
    with pytest.raises(ValueError, match="float32 words"):
        paged_mla_decode_reference(q[:, None], jnp.zeros((2, 1, 64)), jnp.zeros((4, 16, 576)),
                                   jnp.zeros((2, 2), jnp.int32), jnp.zeros((2,), jnp.int32), scale=1.0, kv_format=fmt)
