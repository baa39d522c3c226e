"""Hidden states per position (EngineConfig.enable_return_hidden_states, SamplingParams.return_hidden_states;
SGLang's return_hidden_states): what a finished request gets equals the model's full forward over the finished
sequence after the final norm, whatever computed each position (prefill chunks, decode rows, speculative verify
rows, a recompute after preemption, row tiles of deterministic inference), with async scheduling; such a
request computes its whole prompt even when the prefix cache holds it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from serve.position_rows import PositionRows
from serve.sglang_api import hidden_lists
from serve.types import RequestError, SamplingParams as SP

PAD = 256
ATOL = 1e-4  # fp32 tiny-k3: chunked prefill and cached decode against one full forward


def _llm(**kw):
    import k3jax

    return k3jax.LLM("tiny-k3", max_model_len=PAD, measure_moe_time=False, progress=False,
                     enable_return_hidden_states=True, **kw)


@pytest.fixture(scope="module")
def llm():
    """tests/test_routed_experts.py's engine, option for option (routed experts on too): one set of step programs
    in the run's compilation cache for both files (CI time)."""
    return _llm(cache_bytes=260_000, max_num_seqs=4, prefill_chunk=16, max_prefill_seqs=2, decode_buckets=(4,),
                prefill_buckets=(2,), context_buckets=(16,), async_scheduling=True, enable_return_routed_experts=True,
                speculative_config={"num_speculative_tokens": 3, "adaptive": False})


@pytest.fixture(scope="module")
def reference():
    """(normed final hidden states [len - 1, H], their logits' argmax) of a full forward over a sequence's first
    len - 1 tokens (no cache; one compile)."""
    import k3jax
    from k3jax.cache import FreshView

    model = k3jax.load_model("tiny-k3")

    @jax.jit
    def forward(ids):
        m = nnx.merge(model.graphdef, model.params)
        hidden = []
        m.run(ids, FreshView(m.cfg, PAD), jnp.full((1,), PAD, jnp.int32), False, hidden=hidden)
        normed = m.norm(hidden[0])[0]
        return normed, m.logits(hidden[0])[0].argmax(-1)

    def of(seq):
        padded = np.zeros((1, PAD), np.int32)
        padded[0, :len(seq) - 1] = seq[:-1]
        normed, greedy = forward(jnp.asarray(padded))
        return np.asarray(normed)[:len(seq) - 1], np.asarray(greedy)[:len(seq) - 1]
    return of


def _check(out, reference):
    for c in out.outputs:
        seq = out.prompt_token_ids + c.token_ids
        want, _ = reference(seq)
        assert c.hidden_states.dtype == np.float32 and c.hidden_states.shape == want.shape
        np.testing.assert_allclose(c.hidden_states, want, atol=ATOL, err_msg=f"{out.request_id}#{c.index}")


def test_hidden_states_are_the_full_forwards_whatever_computed_them(llm, reference):
    """Shared-prefix prompts with n = 2, sampled and greedy, on a small arena (preemptions), async scheduling and
    n-gram drafts (a greedy row whose drafts the bias makes the model accept): every sequence's hidden states =
    the full forward's, position by position; greedy tokens are the argmax of the LM head over them. A second
    wave finds the prompts cached but computes them again (every position is needed); a request that does not
    ask reuses them, and carries no hidden states."""
    eng = llm.engine
    rng = np.random.default_rng(0)
    base = rng.integers(3, 300, 70).tolist()
    prompts = [base + rng.integers(3, 300, k).tolist() for k in (5, 20, 40)] + [rng.integers(3, 300, 12).tolist() * 3]
    params = [SP(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True, n=2 if i == 1 else 1,
                 return_hidden_states=True) for i in range(4)]
    prompts.append(list(range(10, 40)) + [5] * 8)
    params.append(SP(temperature=0, logit_bias={5: 100.0}, max_tokens=40, ignore_eos=True, return_hidden_states=True))
    greedy = SP(temperature=0, max_tokens=12, ignore_eos=True, return_hidden_states=True)
    prompts.append(rng.integers(3, 300, 30).tolist())
    params.append(greedy)
    for wave in range(2):
        outs = llm.generate(prompts, params)
        for out in outs:
            _check(out, reference)
            assert out.num_cached_tokens == 0  # the whole prompt computed, cached or not
        last = outs[-1]
        _, argmax = reference(last.prompt_token_ids + last.token_ids)
        assert last.token_ids == argmax[len(last.prompt_token_ids) - 1:].tolist()
    n = eng.counters
    assert n["preemptions"] > 0 and n["spec_decode_num_accepted_tokens"] > 30
    plain = llm.generate([prompts[0]], SP(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert plain.num_cached_tokens > 0 and plain.outputs[0].hidden_states is None
    assert llm.stats()["compiles_after_warmup"] == 0


def test_deterministic_row_tiles_return_hidden_states(reference):
    """Deterministic inference runs decode rows in tiles of 8 (serve/step.py `_row_tiles`): the tiles' hidden
    states are each row's, in place."""
    llm = _llm(cache_bytes=1 << 20, max_num_seqs=16, prefill_chunk=16, max_prefill_seqs=2,
               context_buckets=(16,), enable_deterministic_inference=True)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 300, int(k)).tolist() for k in rng.integers(5, 40, 10)]
    for out in llm.generate(prompts, SP(temperature=0, max_tokens=6, ignore_eos=True, return_hidden_states=True)):
        _check(out, reference)


def test_hidden_states_need_the_engine_option():
    """A request asking without the engine option is refused naming the field; the field must be a bool."""
    import k3jax
    from serve.engine import Engine, EngineConfig

    eng = Engine(k3jax.load_model("tiny-k3"), EngineConfig(max_model_len=64, page_size=16, cache_bytes=1 << 20,
                                                            measure_moe_time=False), progress=False, warmup=False)
    with pytest.raises(RequestError, match="return_hidden_states: this engine was started without"):
        eng.add_request([1, 2, 3], SP(return_hidden_states=True))
    with pytest.raises(RequestError, match="return_hidden_states: must be true or false"):
        eng.add_request([1, 2, 3], SP(return_hidden_states="yes"))
    assert not eng.has_unfinished()


def test_position_rows_grow_and_sglang_lists():
    rows = PositionRows((2,), np.float32, np.nan, capacity=2)
    rows.write(0, np.ones((3, 2)))
    rows.write(3, np.full((2, 2), 2.0))
    assert rows.end == 5 and rows.first(5).tolist() == [[1, 1]] * 3 + [[2, 2]] * 2
    assert np.isnan(rows.first(6)[5]).all()
    hidden = np.arange(10, dtype=np.float32).reshape(5, 2)
    assert hidden_lists(hidden, 3) == [[[0, 1], [2, 3], [4, 5]], [6, 7], [8, 9]]
