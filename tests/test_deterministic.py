"""Deterministic inference (`enable_deterministic_inference`): a request's logits are the same bits alone, in a
batch, at another row, with its prompt's chunks scheduled beside other prompts', and resumed from the prefix
cache; greedy and seeded sampling repeat exactly."""

from __future__ import annotations

import numpy as np
import pytest

import k3jax
from serve.engine import Engine, EngineConfig
from serve.types import SamplingParams

KW = dict(max_model_len=256, page_size=16, cache_bytes=32 << 20, max_num_seqs=6, max_prefill_seqs=3,
          prefill_chunk=32, measure_moe_time=False, max_logprobs=1)
RNG = np.random.default_rng(5)
TARGET = [int(x) for x in RNG.integers(3, 300, 90)]  # three prefill chunks
OTHERS = [[int(x) for x in RNG.integers(3, 300, n)] for n in (17, 64, 130, 40, 75)]
PARAMS = {"greedy": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1),
          "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True, logprobs=1)}


@pytest.fixture(scope="module")
def engine():
    return Engine(k3jax.load_model("tiny-k3"), EngineConfig(**KW, enable_deterministic_inference=True), progress=False)


def _run(engine, prompts, sp, at: int, stagger: bool = False):
    """Submit `prompts` (with a few steps between submissions when `stagger`) -> prompt `at`'s (tokens, logprobs)."""
    ids, done = [], {}
    for i, p in enumerate(prompts):
        ids.append(engine.add_request(p, sp))
        if stagger and i % 2:
            for _ in range(2):
                done.update({o.request_id: o for o in engine.step() if o.finished})
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    c = done[ids[at]].outputs[0]
    return c.token_ids, [lp.logprob for lp, _ in c.logprobs]


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_a_request_is_the_same_bits_in_any_batch(engine, kind):
    sp = PARAMS[kind]
    engine.reset_prefix_cache()
    alone = _run(engine, [TARGET], sp, 0)
    engine.reset_prefix_cache()
    first = _run(engine, [TARGET] + OTHERS, sp, 0)
    engine.reset_prefix_cache()
    last = _run(engine, OTHERS + [TARGET], sp, len(OTHERS), stagger=True)  # another row, chunks beside others'
    hit = engine.stats()["prefix_cache"]["hit_tokens"]
    warm = _run(engine, OTHERS[:2] + [TARGET], sp, 2)  # its prompt from the prefix cache
    assert engine.stats()["prefix_cache"]["hit_tokens"] - hit >= 64
    for got in (first, last, warm):
        assert got[0] == alone[0]
        assert got[1] == alone[1]  # bit for bit
    assert engine.stats()["compiles_after_warmup"] == 0


def test_one_program_per_kind_and_what_it_refuses():
    model = k3jax.load_model("tiny-k3")
    eng = Engine(model, EngineConfig(**KW, enable_deterministic_inference=True), warmup=False)
    # 6 sequences decode in an 8-row program: whole row groups of the CPU matmul kernels (DETERMINISTIC_ROWS)
    assert (eng.decode_buckets, eng.prefill_buckets, len(eng.context_buckets)) == ((8,), (3,), 1)
    assert eng.stats()["deterministic_inference"] is True
    for extra, match in ((dict(speculative_config={"num_speculative_tokens": 2}), "speculative decoding"),
                         (dict(long_prefill_chunk=None), "long_prefill_chunk=None"),
                         (dict(decode_buckets=(1, 6)), r"decode_buckets=\(1, 6\): deterministic inference")):
        with pytest.raises(ValueError, match=match):
            Engine(model, EngineConfig(**KW, enable_deterministic_inference=True, **extra), warmup=False)


def test_cli_flag_builds_one_decode_program():
    from k3jax.cli import build_parser
    from serve.cli import engine_config

    o = vars(build_parser().parse_args(["serve", "--model", "tiny-k3", "--enable-deterministic-inference",
                                        "--max-num-seqs", "8"]))
    cfg = engine_config(o)
    assert cfg.enable_deterministic_inference and cfg.decode_buckets == (8,)
