"""Prompts given as embeddings (vLLM's `{"prompt_embeds": [L, H]}`, serve/prompt_embeds.py): the engine's
greedy tokens against the model's full forward over the same vectors, the embedding table's rows against
the token prompt, prefix-cache isolation by the vectors, recompute after preemption, beam search, the
errors, and the HTTP payload formats."""

from __future__ import annotations

import base64
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from serve import prompt_embeds as pe
from serve.beam_search import BeamSearchParams
from serve.types import RequestError, SamplingParams as SP

KW = dict(max_model_len=128, cache_bytes=16 << 20, max_num_seqs=4, prefill_chunk=16, max_prefill_seqs=2,
          decode_buckets=(4,), prefill_buckets=(2,), context_buckets=(8,), measure_moe_time=False, progress=False,
          max_logprobs=4, enable_prompt_embeds=True)
GREEDY = SP(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
RNG = np.random.default_rng(11)
IDS = [int(x) for x in RNG.integers(3, 250, 40)]  # three prefill chunks of 16


@pytest.fixture(scope="module")
def llm():
    import k3jax

    return k3jax.LLM("tiny-k3", **KW)


@pytest.fixture(scope="module")
def table(llm):
    return np.asarray(llm.engine.model.params["embed_tokens"][...])  # [V, H]


@pytest.fixture(scope="module")
def reference(llm, table):
    """Greedy continuation of prompt vectors from the model's full forward (no cache, HF's `inputs_embeds`
    form of `KimiModel.__call__`), one compile: right padding leaves a causal model's earlier logits as
    they are."""
    model = llm.engine.model
    total = 64
    fn = jax.jit(lambda params, x: nnx.merge(model.graphdef, params)(None, inputs_embeds=x)[0])

    def tokens(vectors: np.ndarray, n: int) -> list[int]:
        out = []
        for _ in range(n):
            x = np.zeros((1, total, table.shape[1]), table.dtype)
            seq = np.concatenate([vectors, table[out]]) if out else vectors
            x[0, :len(seq)] = seq
            out.append(int(np.argmax(np.asarray(fn(model.params, jnp.asarray(x)))[0, len(seq) - 1])))
        return out
    return tokens


def _arena_back(e) -> bool:
    return e.allocator.free_units + e._cached_units() == e.allocator.baseline_free_units


def test_random_vectors_match_the_full_forward_in_a_mixed_batch(llm, table, reference):
    """Vectors that are no token's embedding, of several lengths (one to three prefill chunks), beside
    token prompts in one batch: each row's greedy tokens are the full forward's."""
    vecs = [RNG.standard_normal((n, table.shape[1])).astype(np.float32) for n in (5, 23, 40)]
    prompts = [{"prompt_embeds": v} for v in vecs] + [IDS[:20]]
    outs = llm.generate(prompts, GREEDY)
    for v, o in zip(vecs, outs):
        assert o.token_ids == reference(v, GREEDY.max_tokens)
        assert o.prompt_token_ids == [] and o.prompt is None and len(o.outputs[0].logprobs) == 8
    assert outs[3].token_ids == reference(table[IDS[:20]], GREEDY.max_tokens)
    assert llm.stats()["compiles_after_warmup"] == 0 and _arena_back(llm.engine)


def test_the_tables_rows_give_the_token_prompts_output_and_logprobs(llm, table):
    """Embeddings looked up from the model's own table are the token prompt, bit for bit."""
    a, b = llm.generate([IDS, {"prompt_embeds": table[IDS]}], GREEDY)
    assert a.token_ids == b.token_ids
    assert [lp.chosen.logprob for lp in a.outputs[0].logprobs] == [lp.chosen.logprob for lp in b.outputs[0].logprobs]
    # a torch tensor, a [1, L, H] batch of one, and a JAX array are taken as well
    torch = pytest.importorskip("torch")
    for x in (torch.from_numpy(table[IDS]), table[IDS][None], jnp.asarray(table[IDS])):
        assert llm.generate([{"prompt_embeds": x}], GREEDY)[0].token_ids == a.token_ids


def test_the_prefix_cache_is_shared_only_by_the_same_vectors(llm, table, reference):
    """The cache keys of an embeddings prompt are salted with its vectors' digest: the same vectors resume
    from the cache (same tokens), other vectors of the same length and the placeholder token ids do not."""
    v = RNG.standard_normal((40, table.shape[1])).astype(np.float32)
    want = reference(v, GREEDY.max_tokens)
    first = llm.generate([{"prompt_embeds": v}], GREEDY)[0]
    again = llm.generate([{"prompt_embeds": v.copy()}], GREEDY)[0]
    assert first.token_ids == again.token_ids == want
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 32
    w = v.copy()
    w[-1, 0] += 1.0  # one value of the last vector
    other = llm.generate([{"prompt_embeds": w}], GREEDY)[0]
    assert other.num_cached_tokens == 0 and other.token_ids == reference(w, GREEDY.max_tokens)
    zeros = llm.generate([[0] * 40], GREEDY)[0]  # the placeholders, as tokens
    assert zeros.num_cached_tokens == 0 and zeros.token_ids == reference(table[[0] * 40], GREEDY.max_tokens)
    assert _arena_back(llm.engine)


def test_a_preempted_request_recomputes_from_its_vectors(llm, table, reference):
    v = RNG.standard_normal((30, table.shape[1])).astype(np.float32)
    e = llm.engine
    e.reset_prefix_cache()  # nothing to resume from: the recompute runs the vectors again
    rid = e.add_request({"prompt_embeds": v}, SP(temperature=0, max_tokens=10, ignore_eos=True))
    seq = e.requests[rid].seqs[0]
    while len(seq.output_ids) < 3:
        e.step()
    e._preempt(seq)
    e.reset_prefix_cache()
    done = None
    while done is None:
        done = next((o for o in e.step() if o.request_id == rid and o.finished), None)
    assert done.token_ids == reference(v, 10)
    assert _arena_back(e)


def test_beam_search_over_vectors_equals_it_over_tokens(llm, table):
    """The beams fork from an embeddings prompt (children keep the vectors for a recompute)."""
    p = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)
    a = llm.beam_search([IDS[:24]], p)[0]
    b = llm.beam_search([{"prompt_embeds": table[IDS[:24]]}], p)[0]
    assert [s.tokens[24:] for s in a.sequences] == [s.tokens for s in b.sequences]
    assert _arena_back(llm.engine)


@pytest.mark.parametrize("prompt, params, match", [
    (np.zeros((4, 7), np.float32), GREEDY, r"prompt_embeds: expected shape \[length, 64\]"),
    (np.zeros((0, 64), np.float32), GREEDY, "prompt_embeds: empty prompt"),
    (np.full((3, 64), np.nan, np.float32), GREEDY, "prompt_embeds: holds NaN"),
    (np.ones((3, 64), np.float64) * 1e39, GREEDY, "prompt_embeds: holds NaN or infinite"),  # inf in float32
    (np.array([["a"] * 64]), GREEDY, "prompt_embeds: expected floating-point values"),
    (np.ones((3, 64), np.float32), SP(prompt_logprobs=1), "prompt_logprobs: a prompt given as embeddings"),
    (np.ones((3, 64), np.float32), SP(repetition_penalty=1.2), "repetition_penalty: it counts the prompt"),
    (np.ones((129, 64), np.float32), SP(max_tokens=16), "prompt: 129 prompt tokens exceed the context window"),
])
def test_bad_embeddings_are_refused_naming_the_field(llm, prompt, params, match):
    with pytest.raises(RequestError, match=match):
        llm.engine.add_request({"prompt_embeds": prompt}, params)
    assert not llm.engine.has_unfinished() and _arena_back(llm.engine)


def test_an_engine_without_the_option_refuses_embeddings():
    from k3jax.runtime import load_model
    from serve.engine import Engine, EngineConfig

    kw = {k: v for k, v in KW.items() if k not in ("progress", "enable_prompt_embeds")}
    e = Engine(load_model("tiny-k3"), EngineConfig(**kw), warmup=False)
    with pytest.raises(RequestError, match="prompt_embeds: this engine was started without enable_prompt_embeds"):
        e.add_request({"prompt_embeds": np.ones((3, 64), np.float32)})
    with pytest.raises(RequestError, match=r"'prompt' \(text\), 'prompt_token_ids' or 'prompt_embeds', got keys"):
        e.add_request({"prompt_embeds": np.ones((3, 64)), "prompt": "x"})
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        EngineConfig(enable_prompt_embeds=1).validate()


# ---- the HTTP payloads ---------------------------------------------------------------------------------

def test_payload_formats_decode_to_the_same_vectors():
    a = RNG.standard_normal((6, 64)).astype(np.float32)
    got = pe.decode_b64(pe.encode_b64(a), 64, np.float32)
    np.testing.assert_array_equal(got, a)
    from safetensors.numpy import save

    st = base64.b64encode(save({"embeds": a})).decode()
    np.testing.assert_array_equal(pe.decode_b64(st, 64, np.float32), a)
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save(torch.from_numpy(a).to(torch.bfloat16), buf)  # what vLLM's clients send, in bf16
    got = pe.decode_b64(base64.b64encode(buf.getvalue()).decode(), 64, np.float32)
    np.testing.assert_allclose(got, a, rtol=1e-2, atol=1e-2)
    buf = io.BytesIO()
    torch.save({"x": torch.from_numpy(a)}, buf)
    with pytest.raises(RequestError, match="holds a dict, not one tensor"):
        pe.decode_b64(base64.b64encode(buf.getvalue()).decode(), 64, np.float32)


def _torch_b64(t) -> str:
    buf = io.BytesIO()
    pytest.importorskip("torch").save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


def test_sparse_torch_tensors_are_made_dense_and_checked():
    """vLLM densifies a sparse `prompt_embeds` tensor (it was a TypeError, a 500 over HTTP); its indices are
    checked as it loads, so one pointing outside its shape is a 400, not a write out of bounds."""
    torch = pytest.importorskip("torch")
    a = RNG.standard_normal((4, 64)).astype(np.float32)
    a[1] = 0
    for t in (torch.from_numpy(a).to_sparse(), torch.from_numpy(a).to_sparse_csr()):
        np.testing.assert_array_equal(pe.decode_b64(_torch_b64(t), 64, np.float32), a)
        np.testing.assert_array_equal(pe.as_prompt_embeds(t, 64, np.float32), a)
    bad = torch.sparse_coo_tensor(torch.tensor([[0], [1000]]), torch.tensor([1.0]), (3, 64), check_invariants=False)
    with pytest.raises(RequestError, match="prompt_embeds: a torch.save payload that torch cannot load safely"):
        pe.decode_b64(_torch_b64(bad), 64, np.float32)


def test_complex_and_bool_torch_tensors_are_refused_as_numpys_are():
    """torch's complex values lost their imaginary part and bools became 0 / 1 silently (`.float()`),
    where the same numpy arrays are refused."""
    torch = pytest.importorskip("torch")
    for dtype in (torch.complex64, torch.bool):
        t = torch.ones(3, 64, dtype=dtype)
        with pytest.raises(RequestError, match=f"prompt_embeds: expected floating-point values, got dtype "
                                               f"{str(dtype).split('.')[1]}"):
            pe.decode_b64(_torch_b64(t), 64, np.float32)
        with pytest.raises(RequestError, match="expected floating-point values"):
            pe.as_prompt_embeds(t, 64, np.float32)


def test_a_bf16_safetensors_payload_is_read():
    """A one-tensor safetensors file in bfloat16 (a torch model's embeddings as saved) was refused: numpy's
    safetensors reader has no bfloat16. A dtype that is no number (fp8 here) is refused naming it."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save

    t = torch.from_numpy(RNG.standard_normal((5, 64)).astype(np.float32)).to(torch.bfloat16)
    for x in (t, t[None]):
        got = pe.decode_b64(base64.b64encode(save({"embeds": x})).decode(), 64, np.float32)
        np.testing.assert_array_equal(got, t.float().numpy())
    fp8 = base64.b64encode(save({"embeds": t.to(torch.float8_e4m3fn)})).decode()
    with pytest.raises(RequestError, match="prompt_embeds: expected floating-point values, got safetensors dtype F8_E4M3"):
        pe.decode_b64(fp8, 64, np.float32)


@pytest.mark.parametrize("text, match", [
    ("", "expected a non-empty base64 string"),
    ("not base64!", "not valid base64"),
    (base64.b64encode(b"hello world, not a tensor").decode(), "unrecognised payload"),
    ("AAAA", "unrecognised payload"),
    (None, "a .npy payload that numpy cannot read"),  # an object array: loading it would unpickle
])
def test_bad_payloads_are_refused(text, match):
    if text is None:
        buf = io.BytesIO()
        np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
        text = base64.b64encode(buf.getvalue()).decode()
    with pytest.raises(RequestError, match="prompt_embeds: " + match):
        pe.decode_b64(text, 64, np.float32)


def test_a_safetensors_payload_must_hold_one_tensor():
    from safetensors.numpy import save

    two = base64.b64encode(save({"a": np.ones((2, 64), np.float32), "b": np.ones((2, 64), np.float32)})).decode()
    with pytest.raises(RequestError, match="exactly one tensor, got 2"):
        pe.decode_b64(two, 64, np.float32)


def test_chat_holes_and_splicing_place_the_vectors_inside_the_template(llm, table):
    """Chat content given as vectors: the rendered template's text around a hole is encoded on its own and
    the hole becomes id -1 - k; `splice` puts the part's vectors there and table rows elsewhere."""
    from k3jax.chat_template import encode_chat

    tok = llm.engine.tokenizer
    msgs = [{"role": "user", "content": "ab<HOLE>cd"}]
    plain = encode_chat(tok, [{"role": "user", "content": "abcd"}], family=tok.chat_family)
    holed = encode_chat(tok, msgs, family=tok.chat_family, holes=("<HOLE>",))
    at = holed.index(-1)
    assert holed[:at] + holed[at + 1:] == plain and holed.count(-1) == 1
    part = RNG.standard_normal((3, table.shape[1])).astype(np.float32)
    rows = lambda ids: table[ids]  # noqa: E731
    got = pe.splice(holed, [part], rows)
    assert got.shape == (len(holed) + 2, table.shape[1])
    np.testing.assert_array_equal(got[at:at + 3], part)
    np.testing.assert_array_equal(np.delete(got, range(at, at + 3), axis=0), table[plain])
