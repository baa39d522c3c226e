"""Multi-LoRA serving (k3jax/lora.py, serve/lora.py) against PEFT, a reference we did not write.

A tiny Kimi-Linear checkpoint written by HF transformers (variant b5_qlora: q-LoRA MLA, KDA with its
gate projections, dense and shared-expert MLPs) gets two PEFT adapters with random factors on every
dense projection kind (kv_b_proj included, which MLA only uses absorbed), the second with rsLoRA and
per-module rank / alpha overrides. The engine serves both beside the base model in one batch; each row
is compared teacher-forced with `PeftModel` running that adapter (or with the adapter disabled).
"""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.parity

import hf_fixtures as hfx  # noqa: E402

from k3jax import load_model  # noqa: E402
from k3jax.lora import slot_bytes  # noqa: E402
from serve.engine import Engine, EngineConfig  # noqa: E402
from serve.lora import LoRAError, LoRARequest  # noqa: E402
from serve.types import RequestError, SamplingParams  # noqa: E402

VARIANT = "b5_qlora"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj",
           "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj", "down_proj"]
GEN = 10


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """(checkpoint dir, PeftModel with adapters "default" and "second", their saved directories)."""
    root = tmp_path_factory.mktemp("lora")
    path, hf = hfx.make_hf_kimi_linear(str(root / "ckpt"), VARIANT)
    torch.manual_seed(0)
    first = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    second = peft.LoraConfig(r=2, lora_alpha=3, use_rslora=True, init_lora_weights=False,
                             target_modules=["q_proj", "kv_b_proj", "o_proj", "down_proj", "g_b_proj"],
                             rank_pattern={"o_proj": 3}, alpha_pattern={"down_proj": 1.5})
    pm = peft.get_peft_model(hf, first)
    pm.add_adapter("second", second)
    pm.eval()
    pm.save_pretrained(str(root / "adapters"))
    dirs = {"default": str(root / "adapters"), "second": str(root / "adapters" / "second")}
    return path, pm, dirs


@pytest.fixture(scope="module")
def engine(ref):
    path, _, dirs = ref
    eng = Engine(load_model(path), EngineConfig(
        max_model_len=256, page_size=16, cache_bytes=24 << 20, max_num_seqs=4, decode_buckets=(4,),
        prefill_buckets=(2,), context_buckets=(16,), max_num_batched_tokens=256, max_loras=2, max_lora_rank=4,
        max_cpu_loras=3, measure_moe_time=False),  # (no MoE timing programs at warm-up: CI time)
        progress=False)
    eng.add_lora(LoRARequest("a", 1, dirs["default"]))
    return eng


@pytest.fixture
def ab(engine, ref):
    """The module's engine with adapters "a" and "b" loaded, in that order: the state
    `test_mixed_batch_matches_peft` leaves (it loads "b" on first use), so that a later test run on its
    own starts from it too."""
    if engine.list_loras() != ["a", "b"]:
        for name in engine.list_loras():
            engine.remove_lora(name)
        engine.add_lora(LoRARequest("a", 1, ref[2]["default"]))
        engine.add_lora(LoRARequest("b", 2, ref[2]["second"]))
    return engine


@pytest.mark.parametrize("form", ["masked", "gathered"])
def test_apply_forms_equal_per_row_products(form):
    """Both forms of the adapters' term equal each row's own `(x A_s^T) B_s^T` (slot 0: zero), on
    random data, rows-first inputs of any rank."""
    import jax.numpy as jnp

    from k3jax import lora

    rng = np.random.default_rng(0)
    a = rng.normal(size=(4, 24, 3)).astype(np.float32)  # [S + 1, in, R]: slot 0 zeroed below
    b = rng.normal(size=(4, 3, 40)).astype(np.float32)  # [S + 1, R, out]
    a[0], b[0] = 0, 0
    x = rng.normal(size=(5, 7, 24)).astype(np.float32)  # [B, T, in]
    slots = np.array([2, 0, 3, 1, 2], np.int32)
    want = np.stack([x[i] @ a[s] @ b[s] for i, s in enumerate(slots)])
    la, lb = jnp.asarray(np.transpose(a, (1, 0, 2))), jnp.asarray(b)  # the stored layouts
    with lora.rows(jnp.asarray(slots)):
        got = lora.apply(jnp.asarray(x), la, lb, form)
        flat = lora.apply(jnp.asarray(x.reshape(35, 24)), la, lb, form)  # [B * T, in] (MoE's layout)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(flat), want.reshape(35, 40), rtol=1e-5, atol=1e-5)
    assert (np.asarray(got)[1] == 0).all()  # the base row gets exactly nothing
    assert lora.apply(jnp.asarray(x), la, lb, form) is None  # outside a rows context: the base model


def _run(eng, reqs, max_tokens=GEN, params=None):
    """(prompt, adapter) pairs, greedy (or `params`) -> their finished outputs."""
    sp = params or SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    ids = [eng.add_request(list(map(int, p)), sp, lora_request=lr) for p, lr in reqs]
    done = _drain(eng)
    return [done[i] for i in ids]


def _drain(eng) -> dict:
    """Step `eng` until idle -> {request id: finished output}."""
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


@torch.no_grad()
def _peft_logprobs(pm, adapter, prompt, tokens) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced: log-softmax of `adapter` (None: disabled) at the positions that chose `tokens`
    -> (logprob of each token [n], top-1 minus top-2 logit gap there [n]), and the argmaxes."""
    ids = torch.as_tensor(np.concatenate([prompt, tokens])[None], dtype=torch.long)
    if adapter is None:
        with pm.disable_adapter():
            logits = pm(input_ids=ids, use_cache=False).logits[0].float()
    else:
        pm.set_adapter(adapter)
        logits = pm(input_ids=ids, use_cache=False).logits[0].float()
    at = logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]
    lp = torch.log_softmax(at, -1)
    top2 = torch.topk(at, 2, -1).values
    return (lp[torch.arange(len(tokens)), torch.as_tensor(tokens)].numpy(), (top2[:, 0] - top2[:, 1]).numpy(),
            at.argmax(-1).numpy())


def check_against_peft(pm, reqs, outs, names: dict) -> None:
    """Each (prompt, adapter) row's greedy tokens and logprobs are `PeftModel`'s with adapter `names[adapter]`
    (None: disabled), teacher-forced: logprobs within 2e-4, tokens equal wherever PEFT's top-2 gap is clear."""
    for (prompt, lr), out in zip(reqs, outs):
        adapter = names[lr]
        toks = np.asarray(out.outputs[0].token_ids)
        want, gap, argmax = _peft_logprobs(pm, adapter, prompt, toks)
        got = np.asarray([lp.chosen.logprob for lp in out.outputs[0].logprobs])
        np.testing.assert_allclose(got, want, atol=2e-4, err_msg=f"adapter {adapter}")
        clear = gap > 1e-3  # greedy may part from PEFT's only at near-ties
        assert (toks[clear] == argmax[clear]).all(), (adapter, toks, argmax)


def test_mixed_batch_matches_peft(engine, ref):
    """Base rows, adapter "a" rows and adapter "second" rows (loaded on first use from its path) in one
    batch: every row's greedy tokens and logprobs are PEFT's for its adapter, and the adapters change
    the outputs (the comparison could fail)."""
    _, pm, dirs = ref
    prompts = hfx.make_prompt(VARIANT, 3, batch=3, length=90)
    second = LoRARequest("b", 2, dirs["second"])
    reqs = [(prompts[0], "a"), (prompts[1], None), (prompts[2], second), (prompts[0], "b"), (prompts[0], None)]
    outs = _run(engine, reqs)
    assert engine.list_loras() == ["a", "b"]
    check_against_peft(pm, [(p, lr if isinstance(lr, str) or lr is None else "b") for p, lr in reqs], outs,
                       {None: None, "a": "default", "b": "second"})
    base, with_a, with_b = (np.asarray(outs[i].outputs[0].token_ids) for i in (4, 0, 3))
    assert not np.array_equal(base, with_a) and not np.array_equal(base, with_b) and not np.array_equal(with_a, with_b)


def test_rows_alone_equal_the_mixed_batch(ab, engine, ref):
    """A request's tokens and logprobs do not depend on which adapters the other rows use."""
    prompts = hfx.make_prompt(VARIANT, 4, batch=3, length=40)
    reqs = [(prompts[0], "a"), (prompts[1], "b"), (prompts[2], None)]
    mixed = _run(engine, reqs)
    for req, m in zip(reqs, mixed):
        alone = _run(engine, [req])[0]
        assert alone.outputs[0].token_ids == m.outputs[0].token_ids
        np.testing.assert_allclose([lp.chosen.logprob for lp in alone.outputs[0].logprobs],
                                   [lp.chosen.logprob for lp in m.outputs[0].logprobs], atol=1e-5)


def test_beam_search_with_an_adapter_matches_peft(engine, ref):
    """A beam search runs with its request's adapter in every forked beam: the hypotheses are
    `PeftModel.generate(num_beams=2)`'s with that adapter, and differ from the base model's."""
    import torch

    from serve.beam_search import BeamSearchParams

    _, pm, _ = ref
    prompt = [int(t) for t in hfx.make_prompt(VARIANT, 6, batch=1, length=33)[0]]
    outs = _run(engine, [(prompt, "a"), (prompt, None)], params=BeamSearchParams(2, 6, ignore_eos=True))
    got, base = ([c.token_ids for c in o.outputs] for o in outs)
    pm.set_adapter("default")
    with torch.no_grad():
        g = pm.generate(input_ids=torch.tensor([prompt]), num_beams=2, num_return_sequences=2, max_new_tokens=6,
                        do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got == g[:, len(prompt):].tolist()
    assert got != base


def test_prefix_cache_is_per_adapter_load(ab, engine, ref):
    """Cached prefixes are shared only by requests of the same adapter, and only with the same load of
    it: a reloaded adapter never hits pages its previous load computed."""
    _, _, dirs = ref
    p = hfx.make_prompt(VARIANT, 5, batch=1, length=100)[0]
    first = _run(engine, [(p, "a")], max_tokens=3)[0]
    assert _run(engine, [(p, "a")], max_tokens=3)[0].num_cached_tokens >= 64
    base = _run(engine, [(p, None)], max_tokens=3)[0]
    assert base.num_cached_tokens == 0
    assert _run(engine, [(p, "b")], max_tokens=3)[0].num_cached_tokens == 0
    # a base-model request whose cache_salt spells the adapter's part of the hash salt (it read "a"'s prefix)
    rid = engine.add_request(list(map(int, p)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                             cache_salt="\0lora:%d" % engine.loras.get("a").uid)
    spoof = _drain(engine)[rid]
    assert spoof.num_cached_tokens == 0 and spoof.outputs[0].token_ids == base.outputs[0].token_ids
    engine.remove_lora("a")
    engine.add_lora(LoRARequest("a", 1, dirs["default"]))
    again = _run(engine, [(p, "a")], max_tokens=3)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_more_adapters_than_slots(ab, engine, ref):
    """Three adapters on two device slots (`max_cpu_loras`): the running requests never use more than two
    at once, a waiting adapter is swapped in once one is idle, and a swapped-in adapter gives the tokens
    it gives from a slot it never left ("c" is "b"'s directory under another name)."""
    _, _, dirs = ref
    engine.add_lora(LoRARequest("c", 3, dirs["second"]))
    assert engine.stats()["lora_adapters_in_slots"] == ["a", "b"]
    prompts = hfx.make_prompt(VARIANT, 8, batch=3, length=40)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    reqs = [(prompts[0], "a"), (prompts[1], "b"), (prompts[2], "c"), (prompts[0], "c"), (prompts[1], None)]
    ids = [engine.add_request(list(map(int, p)), sp, lora_request=lr) for p, lr in reqs]
    swaps, done, most = engine.counters["lora_swaps"], {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        running = {s.lora.name for s in engine.seqs.values() if s.lora is not None and s.slot is not None}
        most = max(most, len(running))
        assert {a.name for a in engine._running_adapters(internal=True)} == running  # (read from `_running`)
        assert all(engine.seqs[r].lora.slot is not None for r in engine.seqs if engine.seqs[r].slot is not None
                   and engine.seqs[r].lora is not None)
    assert most == 2 and engine.counters["lora_swaps"] > swaps
    toks = [done[i] for i in ids]
    assert toks[3] == _run(engine, [(prompts[0], "b")], max_tokens=6)[0].outputs[0].token_ids
    assert toks[2] == _run(engine, [(prompts[2], "b")], max_tokens=6)[0].outputs[0].token_ids
    assert toks[0] == _run(engine, [(prompts[0], "a")], max_tokens=6)[0].outputs[0].token_ids  # swapped back in
    engine.remove_lora("c")


def test_running_adapters_are_read_from_the_running_rows_alone():
    """`Engine._running_adapters` (every LoRA admission, every request naming an adapter not read yet) walked every
    request queued: with thousands waiting, each cost host time growing with the queue. It reads `_running`."""
    from types import SimpleNamespace

    class Queue(dict):
        def values(self):
            raise AssertionError("walked every request")

    a, b, c = "abc"  # (adapters)
    row = lambda lora, slot=0, internal=None, finished=False: SimpleNamespace(  # noqa: E731
        lora=lora, slot=slot, internal=internal, finished=finished)
    running = {"r1": row(a), "r2": row(None), "r3": row(b, internal="canonical"), "r4": row(c, finished=True),
               "r5": row(c, slot=None)}  # (a forked beam's parent gave its slot away before it leaves)
    eng = SimpleNamespace(seqs=Queue({f"w{i}": row(c, slot=None) for i in range(1000)}), _running=running)
    assert Engine._running_adapters(eng) == {a}
    assert Engine._running_adapters(eng, internal=True) == {a, b}


def test_the_waiting_cut_counts_a_pending_canonical_rows_adapter():
    """A prefix-cache canonical row not admitted yet is a waiting row the scheduler admits first, its adapter taking
    a LoRA slot. `_queue_head` left it out of the waiting cut: with 2 slots and a queue [a, b x 5, c, c] the cut
    counted a and the bs as taking rows (the bs are skipped: c holds the second slot) and hid the requests of c,
    which the plan over the whole queue admits with the row."""
    from types import SimpleNamespace

    from serve.scheduler import SchedulerConfig

    cfg = SchedulerConfig(max_num_seqs=6, max_prefill_seqs=4, prefill_chunk=16, align=16, token_budget=64,
                          page_size=16, num_mla_layers=2, slot_units=1, max_loras=2)
    adapter = {n: SimpleNamespace(uid=i + 1) for i, n in enumerate("abc")}
    row = lambda rid, place, name, internal=None: SimpleNamespace(  # noqa: E731
        rid=rid, place=place, priority=0, order=place, lora=adapter[name], slot=None, hit=None, internal=internal,
        finished=False, proposals=None)
    canon = row("canon", 1, "c", internal="prompt_end")
    queue = [(0, 2 + i, 2 + i, row(f"w{i}", 2 + i, n)) for i, n in enumerate("abbbbbcc")]
    eng = SimpleNamespace(
        seqs={"canon": canon, **{e[3].rid: e[3] for e in queue}}, _canonical_pending={"canon"}, _running={},
        _waiting=lambda n: queue[:n], _match=lambda s: None, _canonicalize_shared_tails=lambda head: False,
        _deferred=lambda head, lent: set(), _waits_at=None, sched_cfg=cfg, _queued_loras={1: 1, 2: 5, 3: 2})
    head, _ = Engine._queue_head(eng, 8)
    assert {"w6", "w7"} <= {s.rid for s in head}, [s.rid for s in head]  # (the plan over all admits them)


def test_swap_evicts_the_least_recently_used_adapter(ab, engine, ref):
    """The adapter swapped out is the one whose requests ended longest ago, not the one admitted first: "a"'s
    request outlives "b"'s (both admitted in one step), so "c" takes "b"'s slot (it used to take "a"'s)."""
    engine.add_lora(LoRARequest("c", 3, ref[2]["second"]))
    prompts = hfx.make_prompt(VARIANT, 9, batch=2, length=20)
    ids = [engine.add_request(list(map(int, prompts[0])), SamplingParams(max_tokens=8, ignore_eos=True),
                              lora_request="a"),
           engine.add_request(list(map(int, prompts[1])), SamplingParams(max_tokens=1, ignore_eos=True),
                              lora_request="b")]
    while engine.has_unfinished():
        engine.step()
    assert all(engine.seqs.get(i) is None or engine.seqs[i].finished for i in ids)
    _run(engine, [(prompts[1], "c")], max_tokens=1)
    assert engine.stats()["lora_adapters_in_slots"] == ["a", "c"]
    engine.remove_lora("c")
    engine.remove_lora("b")  # back to the `ab` state: "b" in a slot again
    engine.add_lora(LoRARequest("b", 2, ref[2]["second"]))


def test_loading_past_max_cpu_loras_drops_the_least_recently_used(ab, engine, ref):
    """vLLM's LRU adapter cache: a load past `max_cpu_loras` drops the least recently used idle adapter from
    slots and host memory; it stays registered and a request naming it reads it again, with the tokens it
    gave before. A refused read leaves the registry as it was."""
    _, _, dirs = ref
    prompt = list(map(int, hfx.make_prompt(VARIANT, 10, batch=1, length=24)[0]))
    engine.add_lora(LoRARequest("c", 3, dirs["second"]))
    want = {n: _run(engine, [(prompt, n)], max_tokens=4)[0].outputs[0].token_ids for n in "bca"}  # "b" LRU now
    evictions = engine.counters["lora_evictions"]
    engine.add_lora(LoRARequest("d", 4, dirs["default"]))
    assert engine.counters["lora_evictions"] == evictions + 1
    assert engine.list_loras() == ["a", "b", "c", "d"] and engine.loras.get("b").factors is None
    assert sorted(a.name for a in engine.loras.held()) == ["a", "c", "d"]
    assert "b" not in engine.stats()["lora_adapters_in_slots"]
    with pytest.raises(LoRAError, match=r"'b': an adapter of that name is loaded already \(from .*unload it first"):
        engine.add_lora(LoRARequest("b", 2, dirs["default"]))  # a dropped name is still registered (vLLM's refusal)
    assert engine.loras.get("b").path == dirs["second"] and engine.loras.get("b").factors is None
    assert _run(engine, [(prompt, "b")], max_tokens=4)[0].outputs[0].token_ids == want["b"]  # read again:
    assert engine.loras.get("c").factors is None  # ... in place of "c", the least recently used then
    assert _run(engine, [(prompt, "c")], max_tokens=4)[0].outputs[0].token_ids == want["c"]
    assert engine.loras.get("a").factors is None  # ... in place of "a"
    engine.remove_lora("a")  # a dropped adapter unloads like any other
    assert engine.list_loras() == ["b", "c", "d"]
    for name in "cd":
        engine.remove_lora(name)
    engine.add_lora(LoRARequest("a", 1, dirs["default"]))  # back to the `ab` state


def test_host_memory_holds_at_most_max_cpu_loras_adapters(ab, engine, ref, tmp_path):
    """vLLM reads an adapter into its LRU cache when it schedules the adapter's requests, so host memory holds at
    most max_cpu_loras of them. Requests for four adapters at once (max_cpu_loras=3, two slots) get each adapter's
    own tokens while at most three are held at any point: one whose requests only wait is dropped and read again
    as they are admitted (they were read at add_request: four held, until a later load). A request arriving while
    every held adapter serves running requests or came from tensors is queued with its adapter registered unread,
    and served once a slot frees (one whose directory broke meanwhile ends with the error, the others go on); a
    request that can never be held (tensors fill host memory) is refused."""
    import shutil

    from step_failures import drain_through_failures

    _, _, dirs = ref
    prompt = list(map(int, hfx.make_prompt(VARIANT, 11, batch=1, length=24)[0]))
    engine.add_lora(LoRARequest("c", 3, dirs["second"]))
    engine.add_lora(LoRARequest("d", 4, dirs["default"]))  # past max_cpu_loras=3: one of a, b, c is dropped
    want = {n: _run(engine, [(prompt, n)], max_tokens=4)[0].outputs[0].token_ids for n in "abcd"}

    def within_bound(reqs, max_tokens=4):
        ids = []
        for lr in reqs:
            ids.append(engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                 ignore_eos=True), lora_request=lr))
            assert len(engine.loras.held()) <= 3
        return ids

    def drain(ids):
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step() if o.finished})
            assert len(engine.loras.held()) <= 3
        return [done[i].outputs[0].token_ids for i in ids]

    evictions = engine.counters["lora_evictions"]
    assert drain(within_bound("abcd")) == [want[n] for n in "abcd"]
    assert engine.counters["lora_evictions"] > evictions  # (read again as admitted)
    engine.remove_lora("c")
    engine.remove_lora("d")
    q = "base_model.model.model.layers.1.self_attn.q_proj"
    tensors = {f"{q}.lora_A.weight": np.ones((2, 96), np.float32), f"{q}.lora_B.weight": np.ones((96, 2), np.float32)}
    assert drain(within_bound("ab")) == [want["a"], want["b"]]  # both held again
    engine.load_lora_adapter_from_tensors("t", tensors, {"peft_type": "LORA", "r": 2, "lora_alpha": 2})
    ids = within_bound("ab", max_tokens=8)
    engine.step()  # both admitted: every held adapter serves running requests or came from tensors
    assert {a.name for a in engine._running_adapters()} == {"a", "b"}
    ids += within_bound([LoRARequest("c", 3, dirs["second"])])
    assert engine.loras.get("c").factors is None  # registered unread, its request queued
    toks = drain(ids)
    assert toks[2] == want["c"] and engine.loras.get("c").factors is not None
    broken = shutil.copytree(dirs["second"], tmp_path / "e")
    ids = within_bound("ab", max_tokens=8)
    engine.step()
    ids += within_bound([LoRARequest("e", 5, str(broken))])
    assert engine.loras.get("e").factors is None
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")  # before its request is admitted
    failures, done = drain_through_failures(engine)
    assert [f.request_ids for f in failures] == [[ids[2]]] and "not a readable safetensors" in str(failures[0].cause)
    assert [done[i].outputs[0].token_ids[:4] for i in ids[:2]] == [want["a"], want["b"]]
    assert len(engine.loras.held()) <= 3
    engine.remove_lora("c")
    for name in "uv":
        engine.load_lora_adapter_from_tensors(name, tensors, {"peft_type": "LORA", "r": 2, "lora_alpha": 2})
    assert sorted(a.name for a in engine.loras.held()) == ["t", "u", "v"]  # none of them can be dropped
    with pytest.raises(RequestError, match="max_cpu_loras=3 adapters loaded from tensors fill host memory"):
        engine.add_request(prompt, SamplingParams(max_tokens=2), lora_request=LoRARequest("c", 3, dirs["second"]))
    for name in [n for n in engine.list_loras() if n not in "ab"]:
        engine.remove_lora(name)


def _write_adapter(d, tensors: dict, **conf):
    from safetensors.numpy import save_file

    os.makedirs(d, exist_ok=True)
    save_file(tensors, os.path.join(d, "adapter_model.safetensors"))
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 2, "lora_alpha": 2, **conf}, f)
    return d


def test_bad_adapters_and_registry_errors(ab, engine, ref, tmp_path):
    """Every failure names what is wrong and leaves the loaded adapters as they were."""
    _, _, dirs = ref
    q = "base_model.model.model.layers.1.self_attn.q_proj"
    ok = {f"{q}.lora_A.weight": np.ones((2, 96), np.float32), f"{q}.lora_B.weight": np.ones((96, 2), np.float32)}
    assert engine.list_loras() == ["a", "b"]
    engine.load_lora_adapter_from_tensors("c", ok, {"peft_type": "LORA", "r": 2, "lora_alpha": 2})  # (no directory)
    busy = [engine.add_request([1, 2, 3], SamplingParams(max_tokens=4), lora_request=n) for n in "ab"]
    engine.step()  # both admitted: their adapters serve running requests
    with pytest.raises(LoRAError, match=r"max_cpu_loras=3 adapters are loaded \(a, b, c\) and none can be dropped"):
        engine.add_lora(LoRARequest("d", 4, dirs["default"]))  # each serves a running request or came from tensors
    for rid in busy:
        engine.abort(rid)
    engine.remove_lora("c")
    engine.remove_lora("b")
    cases = [
        (str(tmp_path / "nowhere"), "not a directory"),
        (_write_adapter(str(tmp_path / "dora"), ok, use_dora=True), "use_dora"),
        (_write_adapter(str(tmp_path / "experts"), {
            "base_model.model.model.layers.1.mlp.experts.gate_up_proj.lora_A.weight": np.ones((2, 96), np.float32),
            "base_model.model.model.layers.1.mlp.experts.gate_up_proj.lora_B.weight": np.ones((48, 2), np.float32)}),
         r"tensor base_model\.model\.model\.layers\.1\.mlp\.experts\.gate_up_proj\.lora_A\.weight: this model has no"),
        (_write_adapter(str(tmp_path / "shape"), {**ok, f"{q}.lora_B.weight": np.ones((95, 2), np.float32)}),
         r"q_proj\.lora_B\.weight: shape \[95, 2\], expected \[96, 2\]"),
        (_write_adapter(str(tmp_path / "rank"), {f"{q}.lora_A.weight": np.ones((5, 96), np.float32),
                                                 f"{q}.lora_B.weight": np.ones((96, 5), np.float32)}),
         "rank 5 exceeds max_lora_rank=4"),
        (_write_adapter(str(tmp_path / "half"), {f"{q}.lora_A.weight": np.ones((2, 96), np.float32)}),
         "lora_B is missing"),
    ]
    for path, match in cases:
        with pytest.raises(LoRAError, match=match):
            engine.add_lora(LoRARequest("c", 3, path))
    assert engine.list_loras() == ["a"]
    with pytest.raises(LoRAError, match="'a': an adapter of that name is loaded already"):
        engine.add_lora(LoRARequest("a", 1, dirs["default"]))
    with pytest.raises(RequestError, match="lora_request: no LoRA adapter 'zz' is loaded"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), lora_request="zz")
    with pytest.raises(RequestError, match="lora_request: lora_path .* no adapter_config.json"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), lora_request=LoRARequest("c", 3, str(tmp_path)))
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), lora_request="a")
    with pytest.raises(LoRAError, match="1 requests in flight"):
        engine.remove_lora("a")
    engine.abort(rid)
    engine.add_lora(LoRARequest("b", 2, dirs["second"]))
    assert engine.list_loras() == ["a", "b"]


def test_a_refused_unload_keeps_the_adapters_canonical_rows(ab, engine):
    """remove_lora of an adapter a request still uses is refused before the adapter's canonical re-prefill rows
    (a conversation's tail queued for the prefix cache) are aborted: their work is kept, and the continuation
    resumes from it once they ran."""
    rng = np.random.default_rng(5)
    sp = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    prompt = rng.integers(3, 200, 60).tolist()  # a tail of ~200 tokens: its canonical row takes a few steps
    rid, first = engine.add_request(prompt, sp, lora_request="a"), None
    while engine.has_unfinished():
        first = next((o for o in engine.step() if o.request_id == rid and o.finished), first)
    before = engine.counters["canonical_rows"]
    engine.add_request(prompt + first.outputs[0].token_ids + rng.integers(3, 200, 9).tolist(),
                       SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), lora_request="a")
    engine.step()  # the continuation reuses the conversation: its tail is queued as a canonical row
    adapter = engine.loras.get("a")
    canonical = [s for s in engine.seqs.values() if s.internal and s.lora is adapter and not s.finished]
    assert engine.counters["canonical_rows"] > before and canonical
    with pytest.raises(LoRAError, match="1 requests in flight"):
        engine.remove_lora("a")
    assert not any(s.finished for s in canonical)
    while engine.has_unfinished():
        engine.step()
    assert engine.list_loras() == ["a", "b"]


def test_target_modules(ref):
    """`lora_target_modules` gives slots to the named projections only: an unknown name is refused at
    start-up, and an adapter touching a projection without slots is refused naming the tensor."""
    path, _, dirs = ref
    model = load_model(path)
    cfg = dict(max_model_len=256, cache_bytes=8 << 20, max_loras=1, max_lora_rank=4)
    with pytest.raises(ValueError, match="lora_target_modules: this model has no projection named 'qq_proj'"):
        Engine(model, EngineConfig(**cfg, lora_target_modules=("q_proj", "qq_proj")), warmup=False)
    eng = Engine(model, EngineConfig(**cfg, lora_target_modules=("q_proj", "kv_b_proj")), warmup=False)
    assert {m.rsplit(".", 1)[1] for t in eng._lora_leaves for m in t.modules} == {"q_proj", "kv_b_proj"}
    assert eng.lora_bytes == 2 * slot_bytes(eng.cfg, eng.model.dtype, 4, ("q_proj", "kv_b_proj"))
    with pytest.raises(LoRAError, match=r"_proj\.lora_[AB]\.weight: .* lora_target_modules=\['q_proj', 'kv_b_proj'\]"):
        eng.add_lora(LoRARequest("second", 1, dirs["second"]))
    assert eng.list_loras() == []


def test_update_weights_keeps_adapters_and_nothing_leaks(ab, engine, ref):
    """New base weights (here the same checkpoint) keep the loaded adapters serving; no step compiled
    after warm-up; the arena is back at its baseline."""
    path = ref[0]
    p = hfx.make_prompt(VARIANT, 6, batch=1, length=20)[0]
    before = _run(engine, [(p, "b")])[0].outputs[0].token_ids
    engine.update_weights(load_model(path))
    assert _run(engine, [(p, "b")])[0].outputs[0].token_ids == before
    stats = engine.stats()
    assert stats["compiles_after_warmup"] == 0
    assert engine.allocator.free_units == engine.allocator.baseline_free_units - stats["arena_cached_units"]
    engine.reset_prefix_cache()
    assert engine.allocator.free_units == engine.allocator.baseline_free_units
    assert stats["lora_adapters"] == ["a", "b"] and stats["max_loras"] == 2
    # the planner's figure (`k3jax info --max-loras`) is what the engine allocates: 3 slots incl. the base one
    assert stats["lora_bytes"] == 3 * slot_bytes(engine.cfg, engine.model.dtype, 4)


def test_http_models_requests_and_runtime_loading(ab, engine, ref):
    """An adapter is a model of its own name: listed with its parent, chosen by `model`, named in the
    response; vLLM's load / unload endpoints; a name that is neither is a 404 listing what is served."""
    import httpx

    from serve.api import create_app
    from serve.async_engine import AsyncEngine

    _, _, dirs = ref
    prompt = [int(t) for t in hfx.make_prompt(VARIANT, 7, batch=1, length=30)[0]]
    want = _run(engine, [(prompt, "a")], max_tokens=6)[0].outputs[0].token_ids
    aeng = AsyncEngine(engine)
    app = create_app(aeng, "kimi", allow_runtime_lora_updating=True)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            cards = (await c.get("/v1/models")).json()["data"]
            assert [(m["id"], m["parent"]) for m in cards] == [("kimi", None), ("a", "kimi"), ("b", "kimi")]
            assert cards[1]["root"] == dirs["default"]
            r = await c.post("/v1/completions", json={"model": "a", "prompt": prompt, "max_tokens": 6,
                                                      "temperature": 0, "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "a" and r.json()["choices"][0]["token_ids"] == want
            r = await c.post("/v1/completions", json={"model": "nope", "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 404 and "`a`, `b`" in r.json()["error"]["message"]
            r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
            assert r.status_code == 200 and "removed" in r.text
            r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
            assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": "/no/such/dir"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": dirs["second"]})
            assert r.status_code == 200, r.text
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": dirs["second"]})
            assert r.status_code == 200, r.text
            assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["kimi", "a", "c", "d"]
            # one more than max_cpu_loras: the least recently used ("a") leaves host memory, still served
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "e", "lora_path": dirs["second"]})
            assert r.status_code == 200, r.text
            assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["kimi", "a", "c", "d", "e"]
            r = await c.post("/v1/completions", json={"model": "a", "prompt": prompt, "max_tokens": 6,
                                                      "temperature": 0, "return_token_ids": True})
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want  # read again
            metrics = (await c.get("/metrics")).text
            assert 'max_lora="2"' in metrics and "k3jax:lora_requests_running" in metrics

    try:
        asyncio.run(go())
    finally:
        aeng.shutdown()


def test_load_inplace_replaces_an_adapter_over_http(ab, engine, ref):
    """vLLM's `load_inplace` on /v1/load_lora_adapter (an RL loop's in-place reload; its clients send the field,
    false too, which was a 400 "extra fields not permitted"): the adapter of that name is replaced by the new
    directory's, which serves the next request, never the old load's cached prefixes; a new directory that
    cannot be read leaves the old adapter serving; without it a loaded name is refused, saying how to replace."""
    import httpx

    from serve.api import create_app
    from serve.async_engine import AsyncEngine

    _, _, dirs = ref
    prompt = [int(t) for t in hfx.make_prompt(VARIANT, 12, batch=1, length=40)[0]]
    want = {n: _run(engine, [(prompt, n)], max_tokens=5)[0].outputs[0].token_ids for n in "ab"}
    aeng = AsyncEngine(engine)
    app = create_app(aeng, "kimi", allow_runtime_lora_updating=True)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            async def tokens():
                r = await c.post("/v1/completions", json={"model": "a", "prompt": prompt, "max_tokens": 5,
                                                          "temperature": 0, "return_token_ids": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"], r.json()["usage"]

            load = lambda **kw: c.post("/v1/load_lora_adapter", json={"lora_name": "a", **kw})  # noqa: E731
            r = await load(lora_path=dirs["second"], load_inplace=False)
            assert r.status_code == 400 and "loaded already (load_inplace: true" in r.json()["error"]["message"]
            r = await load(lora_path="/no/such/dir", load_inplace=True)
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
            assert (await tokens())[0] == want["a"]  # the old one still serves (and cached the prompt)
            r = await load(lora_path=dirs["second"], load_inplace=True)
            assert r.status_code == 200, r.text
            toks, usage = await tokens()
            assert toks == want["b"] and not (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            assert engine.loras.get("a").path == dirs["second"] and engine.list_loras() == ["a", "b"]

    try:
        asyncio.run(go())
    finally:
        aeng.shutdown()


def test_cli_lora_modules():
    from serve.cli import lora_modules

    got = lora_modules({"enable_lora": True, "max_loras": 2,
                        "lora_modules": ["sql=/a/sql", '{"name": "chat", "path": "/a/chat"}']})
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in got] == [("sql", 1, "/a/sql"), ("chat", 2, "/a/chat")]
    with pytest.raises(ValueError, match="needs --enable-lora"):
        lora_modules({"lora_modules": ["x=/y"]})
    with pytest.raises(ValueError, match="expected name=path"):
        lora_modules({"enable_lora": True, "lora_modules": ["x"]})
    more = lora_modules({"enable_lora": True, "max_loras": 1, "lora_modules": ["x=/y", "z=/w"]})
    assert [r.lora_name for r in more] == ["x", "z"]  # past max_cpu_loras: the first leaves host memory (LRU)
    with pytest.raises(ValueError, match="served model's id"):  # it would never be reached
        lora_modules({"enable_lora": True, "model": "k3-small", "lora_modules": ["k3-small=/y"]})
    with pytest.raises(ValueError, match="second adapter named 'x'"):
        lora_modules({"enable_lora": True, "max_loras": 2, "lora_modules": ["x=/y", "x=/w"]})


def test_llm_chat_takes_a_lora_request(ab, engine):
    """`LLM.chat(..., lora_request=)` (vLLM's): the conversation runs with the adapter, as the same rendered
    prompt does through the engine."""
    from serve.llm import LLM

    llm = LLM.__new__(LLM)  # an LLM over this module's engine
    llm.engine, llm.model, llm.progress = engine, engine.model, False
    conv = [{"role": "user", "content": "Add two and three."}]
    sp = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    outs = {lora: llm.chat(conv, sp, lora_request=lora)[0] for lora in ("a", None)}
    for lora, out in outs.items():  # (the prompt as rendered)
        assert out.outputs[0].token_ids == _run(engine, [(out.prompt_token_ids, lora)], params=sp)[0].outputs[0].token_ids
    assert outs["a"].outputs[0].token_ids != outs[None].outputs[0].token_ids


def test_alpha_pattern_keys_match_peft_module_names():
    """`alpha_pattern` keys are matched as PEFT matched them, against the trained model's module names: a full
    path (`model.layers.1.self_attn.q_proj`) or a name under transformers' nesting (`forget_gate.f_a_proj`,
    `mlp.shared_experts.up_proj`) scales those modules, as `PeftModel` does (they used to get `lora_alpha`)."""
    from torch import nn

    from serve.lora import parse_peft

    def layer(*names):
        return nn.ModuleDict({n: nn.Linear(8, 8, bias=False) for n in names})

    attn = nn.ModuleDict({"q_proj": nn.Linear(8, 8, bias=False), "forget_gate": layer("f_a_proj")})
    net = nn.ModuleDict({"model": nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({
        "self_attn": attn, "mlp": nn.ModuleDict({"shared_experts": layer("up_proj")})})])})})
    torch.manual_seed(0)
    conf = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "f_a_proj", "up_proj"], init_lora_weights=False,
                           alpha_pattern={"model.layers.0.self_attn.q_proj": 2, "forget_gate.f_a_proj": 3,
                                          "mlp.shared_experts.up_proj": 5})
    pm = peft.get_peft_model(net, conf)
    tensors = {k: v.detach().numpy() for k, v in peft.get_peft_model_state_dict(pm).items()}
    modules = {"q_proj": "layers.0.self_attn.q_proj", "f_a_proj": "layers.0.self_attn.f_a_proj",
               "up_proj": "layers.0.block_sparse_moe.shared_experts.up_proj"}
    _, factors = parse_peft(json.loads(json.dumps(conf.to_dict(), default=list)), tensors,
                            {m: (8, 8) for m in modules.values()}, 4)
    for name, mod in pm.named_modules():
        if name.rsplit(".", 1)[-1] in modules and hasattr(mod, "lora_A"):
            want = (mod.lora_B["default"].weight @ mod.lora_A["default"].weight).detach().numpy()
            want = want * mod.scaling["default"]
            a, b = factors[modules[name.rsplit(".", 1)[-1]]]
            np.testing.assert_allclose((a @ b).T, want, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("conf, match", [
    (dict(init_lora_weights="pissa"), "init_lora_weights='pissa': .*path_initial_model_for_weight_conversion"),
    (dict(init_lora_weights="olora"), "init_lora_weights='olora'"),
    (dict(init_lora_weights=False, lora_bias=True), "lora_bias=True: adapters with trained biases"),
])
def test_adapters_for_another_base_or_with_biases_are_refused(conf, match):
    """PiSSA / OLoRA adapters as PEFT saves them unconverted are right only on the base PEFT's init changed
    (they used to load and add to the unchanged one: wrong outputs), and `lora_bias` trains a bias: both are
    refused naming the config field; PiSSA converted on save is a plain adapter, and loads."""
    from torch import nn

    from serve.lora import parse_peft

    torch.manual_seed(0)
    net = nn.ModuleDict({"model": nn.ModuleDict({"q_proj": nn.Linear(16, 16, bias=False)})})
    pm = peft.get_peft_model(net, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], **conf))
    tensors = {k: v.detach().numpy() for k, v in peft.get_peft_model_state_dict(pm).items()}
    saved = json.loads(json.dumps(pm.peft_config["default"].to_dict(), default=list))
    with pytest.raises(LoRAError, match=match):
        parse_peft(saved, tensors, {"q_proj": (16, 16)}, 8)
    if conf.get("init_lora_weights") == "pissa":
        parse_peft({**saved, "init_lora_weights": True}, tensors, {"q_proj": (16, 16)}, 8)  # as converted


def test_a_config_without_lora_alpha_scales_as_peft(tmp_path):
    """A config without `lora_alpha` takes PEFT's default (8), as `PeftModel.from_pretrained` reads it, not `r`
    (which scaled by 1 instead of 8 / r)."""
    from torch import nn

    from serve.lora import read_peft

    torch.manual_seed(0)
    net = lambda: nn.ModuleDict({"model": nn.ModuleDict({"q_proj": nn.Linear(16, 16, bias=False)})})  # noqa: E731
    pm = peft.get_peft_model(net(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                    init_lora_weights=False))
    pm.save_pretrained(str(tmp_path))
    cfg_file = tmp_path / "adapter_config.json"
    conf = json.loads(cfg_file.read_text())
    del conf["lora_alpha"]
    conf["r"] = 4
    cfg_file.write_text(json.dumps(conf))
    loaded = peft.PeftModel.from_pretrained(net(), str(tmp_path)).base_model.model["model"]["q_proj"]
    want = (loaded.lora_B["default"].weight @ loaded.lora_A["default"].weight).detach().numpy()
    want = want * loaded.scaling["default"]
    _, factors = read_peft(str(tmp_path), {"q_proj": (16, 16)}, 4)
    a, b = factors["q_proj"]
    np.testing.assert_allclose((a @ b).T, want, rtol=1e-5, atol=1e-6)


def test_a_damaged_adapter_directory_is_a_lora_error(tmp_path):
    """An adapter file cut off mid-copy, or a config that is not UTF-8 text, is the adapter's fault: a LoRAError
    naming the file (the HTTP routes answer 400 with it), not safetensors' or the codec's own exception (a 500)."""
    from serve.lora import read_peft

    q = "base_model.model.model.q_proj"
    d = _write_adapter(str(tmp_path / "cut"), {f"{q}.lora_A.weight": np.ones((2, 16), np.float32),
                                               f"{q}.lora_B.weight": np.ones((16, 2), np.float32)})
    weights = tmp_path / "cut" / "adapter_model.safetensors"
    raw = weights.read_bytes()
    assert read_peft(d, {"q_proj": (16, 16)}, 4)[0] == 2
    weights.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(LoRAError, match="adapter_model.safetensors: not a readable safetensors file"):
        read_peft(d, {"q_proj": (16, 16)}, 4)
    weights.write_bytes(raw)
    (tmp_path / "cut" / "adapter_config.json").write_bytes(b'{"r": "\xff"}')
    with pytest.raises(LoRAError, match="adapter_config.json: not JSON"):
        read_peft(d, {"q_proj": (16, 16)}, 4)


@pytest.mark.parametrize("bad, conf, match", [
    ("nan", {}, r"q_proj\.lora_B\.weight: holds NaN or infinite values"),
    ("inf", {}, r"q_proj\.lora_A\.weight: holds NaN or infinite values"),
    (None, {"lora_alpha": float("inf")}, "lora_alpha=inf is not a finite number"),
    (None, {"alpha_pattern": {"q_proj": float("nan")}}, r"alpha_pattern\['q_proj'\]=nan: .*a finite number"),
    ("rank0", {}, r"q_proj\.lora_A\.weight: rank 0"),
])
def test_adapters_with_non_finite_or_empty_factors_are_refused(bad, conf, match):
    """A decode step multiplies every slot's factors under a per-row 0 / 1 mask, so a NaN or infinity in one
    loaded adapter (a diverged RL step's push) made every row of the batch NaN, the base model's and the other
    adapters' too: such factors (and a non-finite lora_alpha) are refused naming the tensor or key. A rank-0
    pair divided its scaling by 0 (a ZeroDivisionError, an HTTP 500): refused the same way."""
    from serve.lora import parse_peft

    q = "base_model.model.model.q_proj"
    a, b = np.full((2, 16), 0.1, np.float32), np.full((16, 2), 0.1, np.float32)
    if bad == "nan":
        b[3, 1] = np.nan
    elif bad == "inf":
        a[0, 5] = -np.inf
    elif bad == "rank0":
        a, b = a[:0], b[:, :0]
    tensors = {f"{q}.lora_A.weight": a, f"{q}.lora_B.weight": b}
    with pytest.raises(LoRAError, match=match):
        parse_peft({"r": 2, "lora_alpha": 4, **conf}, tensors, {"q_proj": (16, 16)}, 4)


def test_a_failed_read_at_admission_ends_a_cached_prompts_request_alone(ab, engine, ref, tmp_path):
    """A request whose prompt is cached but for its last token is admitted straight into the decode rows; when its
    adapter (unloaded from host memory while the request waited) cannot be read again, the request ends with that
    error and the decode rows beside it run on (it used to stay in the decode batch with no adapter slot: the
    whole decode step failed)."""
    import shutil

    from step_failures import drain_through_failures

    _, _, dirs = ref
    unit = engine.config.prefix_hash_unit
    prompt = list(map(int, hfx.make_prompt(VARIANT, 12, batch=1, length=4 * unit + 1)[0]))
    broken = shutil.copytree(dirs["second"], tmp_path / "e")
    engine.add_lora(LoRARequest("e", 5, str(broken)))
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    _run(engine, [(prompt, "e")], params=sp)  # its prompt cached, under this load of "e"
    _run(engine, [(prompt[:9], "a"), (prompt[:9], "b")], params=sp)  # "e" the least recently used now
    other = engine.add_request(prompt[:20], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                               lora_request="a")
    engine.step()  # "a"'s request decodes from now on
    waiting = engine.add_request(prompt, sp, lora_request="e")
    engine.add_lora(LoRARequest("d", 4, dirs["default"]))  # past max_cpu_loras: "e" (idle, waited for) goes
    assert engine.loras.get("e").factors is None
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    failures, done = drain_through_failures(engine)
    assert [f.request_ids for f in failures] == [[waiting]]
    assert "not a readable safetensors" in str(failures[0].cause)
    assert len(done[other].outputs[0].token_ids) == 8
    for name in "de":
        engine.remove_lora(name)


def test_a_registration_no_request_read_gives_way_to_a_later_load(ab, engine, ref):
    """An adapter registered unread for a request (every held adapter busy) that ended before it was read (aborted;
    or its read failed) holds no factors and serves no one: a later request or `add_lora` naming it from another
    directory takes its place (it was refused as "loaded already", so one bad or abandoned request kept the name
    until remove_lora, which a request arriving while host memory had room never did)."""
    import dataclasses

    _, _, dirs = ref
    q = "base_model.model.model.layers.1.self_attn.q_proj"
    tensors = {f"{q}.lora_A.weight": np.ones((2, 96), np.float32), f"{q}.lora_B.weight": np.ones((96, 2), np.float32)}
    prompt = list(map(int, hfx.make_prompt(VARIANT, 13, batch=1, length=24)[0]))
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = _run(engine, [(prompt, LoRARequest("f", 6, dirs["default"]))], params=sp)[0].outputs[0].token_ids
    engine.remove_lora("f")
    engine.load_lora_adapter_from_tensors("t", tensors, {"peft_type": "LORA", "r": 2, "lora_alpha": 2})
    busy = [engine.add_request(prompt, dataclasses.replace(sp, max_tokens=8), lora_request=n) for n in "ab"]
    engine.step()  # every held adapter serves running requests or came from tensors
    rid = engine.add_request(prompt, sp, lora_request=LoRARequest("c", 3, dirs["second"]))
    assert engine.loras.get("c").factors is None  # registered unread
    engine.abort(rid)
    rid = engine.add_request(prompt, sp, lora_request=LoRARequest("c", 3, dirs["default"]))
    done = _drain(engine)
    assert engine.loras.get("c").path == dirs["default"] and done[rid].outputs[0].token_ids == want
    assert all(done[r].outputs[0].finish_reason == "length" for r in busy)
    for name in "ct":
        engine.remove_lora(name)


def test_a_canonical_row_whose_adapter_cannot_be_read_again_is_dropped(ab, engine, ref, tmp_path):
    """A canonical re-prefill row (the prefix cache's own, no request behind it) waiting with an adapter dropped
    from host memory (`_read_admitted` made room for another) whose directory is gone when the row is admitted: the
    row is dropped with its memory, as unloading its adapter drops it (it was reported as a failed request of its
    internal id, which ending could not find: it stayed, holding a row slot, and the next step ran it without an
    adapter slot)."""
    import shutil

    from serve.prefix_cache import DECODE
    from step_failures import drain_through_failures

    _, _, dirs = ref
    gone = shutil.copytree(dirs["second"], tmp_path / "e")
    adapter = engine.add_lora(LoRARequest("e", 5, str(gone)))
    prompt = list(map(int, hfx.make_prompt(VARIANT, 14, batch=1, length=60)[0]))
    _run(engine, [(prompt, "e")], params=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    rid, (h, _) = next((r, t) for r, t in engine._tails.items() if t[1] is adapter)
    del engine._tails[rid]  # (as `_canonicalize_shared_tails` spawns it when a request continues the tail)
    free = engine.stats()["arena_free_units"]
    engine._spawn_canonical_ids(h.tokens, h, (len(h.tokens) - 1) // engine.align * engine.align, DECODE, rid, adapter)
    engine._drop_from_host(adapter)
    shutil.rmtree(gone)
    failures, _ = drain_through_failures(engine, max_steps=50)
    assert failures == [] and not any(s.internal for s in engine.seqs.values())
    assert engine.stats()["arena_free_units"] == free  # (its row's memory back)
    engine.remove_lora("e")
