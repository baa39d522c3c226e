"""KDA ops with a bf16-stored state (`state_dtype`): the state is rounded where a cache of that
dtype would store it, and the chunked, recurrent and Pallas (interpret) forms agree on where."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from pallas_kernels.kda import chunk_kda, fused_recurrent_kda
from pallas_kernels.kda import reference as ref
from pallas_kernels.kda.pallas_kda import chunk_kda_pallas, fused_recurrent_kda_pallas
from pallas_kernels.kda.testing import make_inputs, make_state, rel_err

B, H, K, V = 2, 2, 16, 32
BF16 = "bfloat16"
REF = "reference"
TOL = 1e-5  # same-order fp32 arithmetic; a flipped bf16 rounding would show as ~1e-3


def _bf16(x):
    return x.astype(jnp.bfloat16).astype(jnp.float32)


@pytest.fixture(scope="module")
def case():
    x = make_inputs(401, B, 100, H, K, V, gate="k3")
    return x, _bf16(make_state(402, B, H, K, V))


def test_chunked_rounds_at_every_chunk_end(case):
    """One call over 100 tokens == four chunk-sized calls with the state stored in bf16 between them."""
    x, s0 = case
    c = 32
    o, s = chunk_kda(*x, initial_state=s0, output_final_state=True, chunk_size=c, state_dtype=BF16, backend=REF)
    outs, st = [], s0
    for a in range(0, 100, c):
        part = [y[:, a:a + c] for y in x]
        oi, st = chunk_kda(*part, initial_state=st, output_final_state=True, chunk_size=c, backend=REF)
        outs.append(oi)
        st = _bf16(st)
    assert rel_err(o, jnp.concatenate(outs, 1)) <= TOL and rel_err(s, st) <= TOL
    assert bool(jnp.all(s == _bf16(s)))  # the final state is a bf16 value
    o32, s32 = chunk_kda(*x, initial_state=s0, output_final_state=True, chunk_size=c, backend=REF)
    assert rel_err(s, s32) > 1e-4  # the rounding happened (fp32 carries more)


def test_recurrent_rounds_after_every_token(case):
    x, s0 = case
    o, s = fused_recurrent_kda(*[y[:, :20] for y in x], initial_state=s0, output_final_state=True,
                               state_dtype=BF16, backend=REF)
    outs, st = [], s0
    for t in range(20):
        oi, st = ref.kda_token_step(st, *[y[:, t] for y in x])
        outs.append(oi)
        st = _bf16(st)
    assert rel_err(o, jnp.stack(outs, 1)) <= TOL and rel_err(s, st) <= TOL
    # a chunk of one token is a token: the chunked form rounds at the same places
    oc, sc = chunk_kda(*[y[:, :20] for y in x], initial_state=s0, output_final_state=True, chunk_size=1,
                       state_dtype=BF16, backend=REF)
    assert rel_err(oc, o) <= TOL and rel_err(sc, s) <= TOL


def test_varlen_rounds_per_sequence(case):
    x, s0 = case
    packed = [jnp.concatenate([y[0, :40], y[1, :56]])[None] for y in x]
    cu = jnp.array([0, 40, 96], jnp.int32)
    o, s = chunk_kda(*packed, initial_state=s0, output_final_state=True, cu_seqlens=cu, chunk_size=16,
                     state_dtype=BF16, backend=REF)
    for n, (a, e) in enumerate([(0, 40), (40, 96)]):
        on, sn = chunk_kda(*[y[:, a:e] for y in packed], initial_state=s0[n:n + 1], output_final_state=True,
                           chunk_size=16, state_dtype=BF16, backend=REF)
        assert rel_err(o[:, a:e], on) <= TOL and rel_err(s[n:n + 1], sn) <= TOL


@pytest.mark.parametrize("variant", ["tpu", "gpu"])
def test_pallas_interpret_matches_the_reference(case, variant):
    x, s0 = case
    o_ref, s_ref = chunk_kda(*x, initial_state=s0, output_final_state=True, chunk_size=32, state_dtype=BF16,
                             backend=REF)
    o, s = chunk_kda_pallas(*x, initial_state=s0, output_final_state=True, chunk_size=32, interpret=True,
                            variant=variant, state_dtype=BF16)
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL
    short = [y[:, :11] for y in x]
    o_ref, s_ref = fused_recurrent_kda(*short, initial_state=s0, output_final_state=True, state_dtype=BF16,
                                       backend=REF)
    o, s = fused_recurrent_kda_pallas(*short, initial_state=s0, output_final_state=True, interpret=True,
                                      variant=variant, state_dtype=BF16)
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL


def test_state_dtype_is_checked(case):
    x, s0 = case
    with pytest.raises(ValueError, match="state_dtype"):
        chunk_kda(*x, initial_state=s0, state_dtype="float16", backend=REF)
    o, s = chunk_kda(*x, initial_state=s0, output_final_state=True, state_dtype="float32", backend=REF)
    o2, s2 = chunk_kda(*x, initial_state=s0, output_final_state=True, backend=REF)
    assert bool(jnp.all(s == s2))  # float32 is the exact default


# ---- the engine with bf16-stored KDA states -----------------------------------------------------

import json  # noqa: E402

import numpy as np  # noqa: E402

import k3jax  # noqa: E402
from k3jax.config import PRESETS  # noqa: E402
from serve.cli import engine_config  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.memory import ArenaLayout  # noqa: E402
from serve.types import SamplingParams  # noqa: E402
from test_prefix_cache import close_to_exact, config, logprobs, run, toks, warm_batch_equals_cold  # noqa: E402


def test_names_errors_and_the_slot_size():
    for bad in ("float16", "fp8", None):
        with pytest.raises(ValueError, match="kda_state_dtype"):
            EngineConfig(kda_state_dtype=bad).validate()
    args = dict(max_model_len=64, max_num_seqs=2, page_size=16, prefill_chunk=16, decode_buckets=None,
                prefill_buckets=None, context_buckets=None, cache_mb=8, max_logprobs=1, seed=0,
                kda_state_dtype="bfloat16")
    assert engine_config(args).kda_state_dtype == "bfloat16"
    # K3 at full size: a sequence's state slot is 414 MiB in fp32 and half that in bf16 (conv windows stay fp32)
    cfg = PRESETS["k3"]
    lay = {d: ArenaLayout.plan(cfg, 64 << 30, 64, jnp.bfloat16, kda_state_dtype=d) for d in ("auto", "bfloat16")}
    slot = {d: lay[d].slot_units * lay[d].unit_bytes for d in lay}
    states = cfg.num_kda_layers * cfg.kda_num_heads * cfg.kda_head_dim ** 2 * 4
    assert states == 434_110_464 and slot["auto"] >= states > slot["bfloat16"] >= states // 2
    assert slot["auto"] - slot["bfloat16"] >= states // 2 - lay["auto"].unit_bytes


def test_info_plans_more_short_requests(capsys):
    from k3jax.cli import main

    plans = {}
    for d in ("float32", "bfloat16"):
        assert main(["info", "--model", "k3-small", "--dtype", "float32", "--cache-gib", "0.25",
                     "--context", "64,16384", "--kda-state-dtype", d]) == 0
        plans[d] = json.loads(capsys.readouterr().out)["arena"]
    a, b = plans["float32"], plans["bfloat16"]
    assert b["kda_state_dtype"] == "bfloat16" and b["state_slot_bytes_per_rank"] < 0.6 * a["state_slot_bytes_per_rank"]
    # short requests are state-bound (85 -> 139 at 64 tokens); long ones are page-bound
    assert b["sequences"]["64"] > 1.5 * a["sequences"]["64"] and b["sequences"]["16384"] >= a["sequences"]["16384"]


@pytest.fixture(scope="module")
def engines():
    """tiny-kimi-linear (three KDA layers), bf16 states: with and without the prefix cache, with 128-token
    prefill rows (rounded inside the row at 64), and the fp32-state engine."""
    model = k3jax.load_model("tiny-kimi-linear", seed=2)
    units = 6000 // 64
    bf = dict(kda_state_dtype="bfloat16")
    on = Engine(model, config(64, 64, units, **bf), progress=False)
    off = Engine(model, config(64, 64, units, enable_prefix_caching=False, **bf), progress=False)
    long_rows = Engine(model, config(64, 128, units, enable_prefix_caching=False, **bf),
                       progress=False)
    exact = Engine(model, config(64, 64, units, enable_prefix_caching=False), progress=False)
    return on, off, long_rows, exact


def test_engine_stays_close_to_fp32_states(engines):
    on, off, _, exact = engines
    assert off.stats()["kda_state_dtype"] == "bfloat16" and exact.stats()["kda_state_dtype"] == "float32"
    assert 2 * off.layout.state_words == exact.layout.state_words  # (here both slots round up to one unit)
    close_to_exact(exact, off, [toks(60 + s, 50 + 70 * s) for s in range(3)])


def test_rounding_points_do_not_depend_on_rows_batches_or_the_cache(engines):
    """The state is rounded at every multiple of 64 inside a 128-token row too, so rows of 64 and of 128
    agree to fp32 rounding; warm prefix-cache resumes and batched requests are bit-identical to a lone
    cold request."""
    on, off, long_rows, exact = engines
    p = toks(70, 200)
    a, b, c = run(off, p), run(long_rows, p), run(exact, p)
    rows = max(abs(x[1] - y[1]) for x, y in zip(logprobs(a), logprobs(b)))
    dtype = max(abs(x[1] - y[1]) for x, y in zip(logprobs(a), logprobs(c)))
    assert a.token_ids == b.token_ids and rows < 2e-5 and dtype > 20 * rows, (rows, dtype)

    warm_batch_equals_cold(on, off, toks(71, 130), 128, seed=72)  # prompt-end checkpoint at 128
    for e in engines:
        assert e.stats()["compiles_after_warmup"] == 0
        assert e.allocator.free_units + e._cached_units() == e.allocator.baseline_free_units


def _drain(engine, ids):
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    return [outs[r] for r in ids]


def test_recompute_after_preemption_is_bit_identical(engines, monkeypatch):
    """A preempted request recomputes its prompt as prompt rows and the tokens it had decoded as decode rows
    (their samples dropped), so its state is rounded where the run that decoded them rounded it: retracted
    mid-decode, preempted for memory and forked beams that found no memory all end with the tokens and the
    logprobs (bits) of the request alone."""
    import dataclasses

    from serve.beam_search import BeamSearchParams
    from serve.scheduler import units_for

    on, off = engines[0], engines[1]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=4)
    prompts = [toks(80 + i, 30 + 50 * i) for i in range(3)]
    alone = [logprobs(run(off, p, params=sp)) for p in prompts]
    ids = [on.add_request(p, sp) for p in prompts]  # (with the prefix cache: it resumes at most at the prompt end)
    for _ in range(9):
        on.step()
    assert on.retract() == 3
    on.continue_generation()
    assert [logprobs(o) for o in _drain(on, ids)] == alone

    # room for the prompts, 3 units short of their last tokens, admitted without look-ahead: decodes preempt
    monkeypatch.setattr(off, "config", dataclasses.replace(off.config, schedule_conservativeness=0.0))
    monkeypatch.setattr(off, "new_token_ratio", 0.0)
    prompts = [toks(90 + i, 40 + 20 * i) for i in range(4)]
    sp = dataclasses.replace(sp, max_tokens=40)
    alone = [logprobs(run(off, p, params=sp)) for p in prompts]
    room = sum(off.layout.slot_units + units_for(len(p) + 40, off.sched_cfg) for p in prompts) - 3
    before = off.stats()["preemptions"]
    hog = off.allocator.alloc_pages(off.allocator.free_units - room)
    try:
        outs = _drain(off, [off.add_request(p, sp) for p in prompts])
    finally:
        off.allocator.free_pages(hog)
    assert off.stats()["preemptions"] > before
    assert [logprobs(o) for o in outs] == alone

    bp, p = BeamSearchParams(2, 10, ignore_eos=True), toks(99, 37)
    roomy = _drain(off, [off.add_request(p, bp)])[0]
    hog = off.allocator.alloc_pages(off.allocator.free_units - off.layout.slot_units
                                    - off.layout.pages_for(len(p) + 10) * off.cfg.num_mla_layers - 2)
    before = off.counters["beam_fork_recomputes"]
    try:
        tight = _drain(off, [off.add_request(p, bp)])[0]
    finally:
        off.allocator.free_pages(hog)
    assert off.counters["beam_fork_recomputes"] > before
    assert [(c.token_ids, c.cumulative_logprob) for c in tight.outputs] == \
        [(c.token_ids, c.cumulative_logprob) for c in roomy.outputs]
    for e in (on, off):
        st = e.stats()
        assert st["compiles_after_warmup"] == 0
        assert st["arena_free_units"] + st["arena_cached_units"] == st["arena_baseline_free_units"]


def test_bf16_decode_step_updates_the_arena_in_place(engines):
    """The in-place decode loop decodes and re-encodes each row's bf16 state inside the loop; the compiled
    step still never copies the arena (as tests/test_engine.py checks for fp32 states)."""
    eng = engines[1]
    lay = eng.layout
    batch = eng._pad_batch(eng.decode_buckets[-1], 1, eng.context_buckets[-1], [])
    hlo = eng.lower_step(batch).compile().as_text()
    made = [line.split(" = ", 1)[1] for line in hlo.splitlines() if " = " in line]
    arena = f"f32[{lay.num_units},{lay.unit_elems}]"
    assert not [m for m in made if m.startswith(arena) and (" copy(" in m[:80] or m.split("(")[0].endswith("copy"))]
    assert sum(m.startswith(arena) for m in made) >= 2 and "bf16" in hlo  # the arena and the bf16 state are there


def test_speculative_verify_rounds_like_decoding():
    """Verify rows round the state after every position, as plain decoding stores it, so drafts accepted
    or rejected leave the plain decoder's tokens and logprobs."""
    model = k3jax.load_model("tiny-kimi-linear", dtype="float32", seed=0)
    # the `engines` fixture's bf16 engine with the prefix cache (`on`), option for option, plus the drafts: its decode
    # and prefill programs come from the run's compilation cache, only the verify program is new (CI time)
    cfg = config(64, 64, 6000 // 64, kda_state_dtype="bfloat16",
                 speculative_config={"num_speculative_tokens": 3, "adaptive": False})
    engine = Engine(model, cfg, progress=False)
    rng = np.random.default_rng(12)
    prompts = [[int(x) for x in rng.integers(3, 200, size=int(rng.integers(5, 40)))] for _ in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)

    def generate(propose):
        engine._propose = propose
        ids = [engine.add_request(p, sp) for p in prompts]
        outs = {}
        while engine.has_unfinished():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        return [outs[r] for r in ids]

    plain = generate(lambda s, k: [])
    want = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain)}

    def corrupt(s, k):  # the plain continuation, wrong at the third draft
        d = list(want[tuple(s.prompt_ids)][len(s.output_ids):][:k])
        if len(d) > 2:
            d[2] = (d[2] + 1) % 200
        return d

    spec = generate(corrupt)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        # A verify row's matmuls have other shapes than a decode row's, so fp32 values differ in the last bits
        # and may round a few state elements to the neighbouring bf16 value (up to 8.5e-5 in logprobs seen on
        # one CI CPU, none on another); the bf16 rounding itself is worth 2.8e-3 on average (bf16 against fp32
        # states, benchmarks/kda_state_dtype.py).
        np.testing.assert_allclose([x[1] for x in logprobs(a)], [x[1] for x in logprobs(b)], rtol=0, atol=3e-4)
    assert 0 < engine.counters["spec_decode_num_accepted_tokens"] < engine.counters["spec_decode_num_draft_tokens"]
    st = engine.stats()
    assert st["compiles_after_warmup"] == 0
    assert st["arena_free_units"] + st["arena_cached_units"] == st["arena_baseline_free_units"]
