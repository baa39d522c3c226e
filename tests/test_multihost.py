"""One engine over a mesh spanning two processes (serve/multihost.py), on CPU: two `k3jax serve` processes
(2 simulated devices each, `jax.distributed` with gloo collectives) form one 4-way tensor-parallel mesh;
process 0 serves HTTP and schedules, process 1 replays its steps. Compared with one process on one
device: same greedy and seeded tokens, logprobs to fp32 rounding, prefix-cache reuse (from the arena and
from the host tier, whose copies each process keeps of its own KDA heads), a clean shutdown that
releases the follower."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import numpy as np
import pytest

from test_http import SMALL, _free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the run's XLA flags (tests/conftest.py) kept, two simulated devices added
ENV = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2",
           JAX_PLATFORMS="cpu",
           K3JAX_MULTIHOST_KEEPALIVE="0.3")
PROMPTS = [("The quick brown fox", dict(temperature=0, max_tokens=8)),
           ("Once upon a time, in a land far away", dict(temperature=0, max_tokens=5)),
           ("abc", dict(temperature=0.8, top_p=0.9, seed=3, max_tokens=6)),
           # the sampling extras the channel sends only when used: a structured-output mask, a logit bias
           ("pick", dict(temperature=0, max_tokens=10, structured_outputs={"regex": "(cat|dog)-[0-9]{2}"})),
           ("xyz", dict(temperature=0, max_tokens=4, logit_bias={"7": 5.0})),
           # 53 byte tokens: a prompt-end KDA checkpoint at 32; asked twice, the second resumes from it
           ("The quick brown fox jumps over the lazy dog, and back", dict(temperature=0, max_tokens=4))]


def _wait(proc, log, url, timeout=300):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}:\n{open(log).read()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"not ready after {timeout}s:\n{open(log).read()[-4000:]}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Processes 0 (HTTP on a free port) and 1 of one `k3jax serve --sharding tp` over 2 x 2 devices."""
    logs = tmp_path_factory.mktemp("multihost")
    port, coord = _free_port(), _free_port()
    # a 1 MiB arena (so a dozen requests evict earlier prefixes) with an 8 MiB host tier behind it
    small = [x if prev != "--cache-mb" else "1" for prev, x in zip([None] + SMALL[:-1], SMALL)]
    base = [sys.executable, "-m", "k3jax.cli", "serve", *small, "--host-cache-mb", "8", "--sharding", "tp",
            "--no-compile-cache", "--enable-prompt-embeds",
            "--coordinator-address", f"127.0.0.1:{coord}", "--num-processes", "2"]
    procs, paths = [], []
    for pid in (1, 0):
        paths.append(str(logs / f"process{pid}.log"))
        procs.append(subprocess.Popen(base + ["--process-id", str(pid), "--port", str(port)], cwd=ROOT, env=ENV,
                                      stdout=open(paths[-1], "w"), stderr=subprocess.STDOUT))
    follower, leader = procs
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(leader, paths[1], url)
        yield dict(url=url, leader=leader, follower=follower, leader_log=paths[1], follower_log=paths[0])
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.fixture(scope="module")
def reference():
    """The same engine on one process, one device (without the drafts: tests/test_http.py's `limited` server's
    engine, whose step programs a run compiles once for both files)."""
    from k3jax.runtime import load_model
    from serve.cli import DEFAULTS, engine_config
    from serve.engine import Engine

    o = dict(DEFAULTS, max_model_len=128, max_num_seqs=8, decode_buckets="8", prefill_buckets="1",
             context_buckets="8", prefill_chunk=32, cache_mb=32)
    cfg = engine_config(o)
    return Engine(load_model("tiny-k3"), dataclasses.replace(cfg, measure_moe_time=False), progress=False)


@pytest.fixture(scope="module")
def reference_outputs(reference):
    """`reference`'s outputs for PROMPTS and the last one again (its prefix then cached), computed once for the
    tests that compare with them (the async runs read the first len(PROMPTS))."""
    return _reference_outputs(reference, PROMPTS + PROMPTS[-1:])


def _reference_outputs(engine, prompts):
    from serve.types import SamplingParams, StructuredOutputsParams

    def params(kw):
        kw = dict(kw)
        if "structured_outputs" in kw:
            kw["structured_outputs"] = StructuredOutputsParams(**kw["structured_outputs"])
        if "logit_bias" in kw:
            kw["logit_bias"] = {int(k): v for k, v in kw["logit_bias"].items()}
        return SamplingParams(ignore_eos=True, logprobs=1, **kw)

    ids = [engine.add_request(p, params(kw)) for p, kw in prompts]
    done = {}
    while len(done) < len(ids):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids]


def test_two_processes_share_the_prefix_cache_host_tier(cluster, reference):
    """Prefixes the 1 MiB arena evicts come back from the host tier, whose copies every process keeps of
    its own KDA heads: a continued prompt resumes from host memory and answers as one device does."""
    base = "The host tier keeps what the arena evicts, on every process, each for its own heads. "
    flood = [f"{i:02d} an unrelated prompt that only fills the arena with its pages and its KDA state, "
             f"then leaves them cached: {i * 7919:08d}" for i in range(24)]  # ~115 tokens each
    follow_up = base + "And then?"
    seq = [(base, 4)] + [(p, 2) for p in flood] + [(follow_up, 4)]
    with httpx.Client(base_url=cluster["url"], timeout=120) as http:
        got = []
        for prompt, n in seq:
            r = http.post("/v1/completions", json=dict(model="tiny-k3", prompt=prompt, max_tokens=n, temperature=0,
                                                       ignore_eos=True, logprobs=1))
            assert r.status_code == 200, r.text
            got.append(r.json())
        metrics = http.get("/metrics").text
    want = _reference_outputs(reference, [(p, dict(temperature=0, max_tokens=n)) for p, n in seq])
    for g, w in zip(got, want):
        c = g["choices"][0]
        assert c["text"] == w.outputs[0].text
        np.testing.assert_allclose(c["logprobs"]["token_logprobs"], [lp.chosen.logprob for lp in w.outputs[0].logprobs],
                                   atol=2e-4)
    hits = float(metrics.split("vllm:external_prefix_cache_hits_total{")[1].split("}")[1].split()[0])
    assert hits >= 64 and got[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64, \
        [line for line in metrics.splitlines() if "host" in line or "external" in line]
    assert "failed on process" not in open(cluster["follower_log"]).read()


def test_two_processes_take_prompt_vectors_and_refuse_them_in_chat(cluster):
    """Prompt vectors (`prompt_embeds`) travel with the step batch: rows of the embedding table answer as their
    tokens do. A chat's `prompt_embeds` content parts would need the template tokens' rows of a table split
    over the processes, which process 0 alone cannot read (its program would wait for the others): a 400
    naming the field, and the server serves on."""
    from k3jax.runtime import load_model
    from serve.prompt_embeds import encode_b64

    table = np.asarray(load_model("tiny-k3").params["embed_tokens"][...])  # the servers' weights (same seed)
    ids = [72, 105, 33, 44, 90, 101, 7]
    kw = dict(model="tiny-k3", max_tokens=5, temperature=0, ignore_eos=True)
    with httpx.Client(base_url=cluster["url"], timeout=120) as http:
        want = http.post("/v1/completions", json=dict(prompt=ids, **kw)).json()["choices"][0]["text"]
        r = http.post("/v1/completions", json=dict(prompt="", prompt_embeds=encode_b64(table[ids]), **kw))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
        parts = [{"type": "text", "text": "Say: "}, {"type": "prompt_embeds", "data": encode_b64(table[ids])}]
        r = http.post("/v1/chat/completions", json=dict(messages=[{"role": "user", "content": parts}], **kw))
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "multi-process" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json=dict(prompt=ids, **kw))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text


def test_two_processes_serve_like_one_device(cluster, reference_outputs):
    """Greedy and seeded completions over HTTP from the 2-process mesh equal one device's (texts;
    logprobs to fp32 rounding), prefix-cache reuse included; idle pings keep the follower alive
    between requests; SIGINT to process 0 ends both processes cleanly."""
    with httpx.Client(base_url=cluster["url"], timeout=120) as http:
        got = []
        for i, (prompt, kw) in enumerate(PROMPTS + PROMPTS[-1:]):
            r = http.post("/v1/completions", json=dict(model="tiny-k3", prompt=prompt, ignore_eos=True, logprobs=1, **kw))
            assert r.status_code == 200, r.text
            got.append(r.json())
            if i == 1:
                time.sleep(1.0)  # idle: the leader pings the follower (keepalive 0.3 s here)
    want = reference_outputs
    for g, w in zip(got, want):
        c = g["choices"][0]
        assert c["text"] == w.outputs[0].text
        np.testing.assert_allclose(c["logprobs"]["token_logprobs"], [lp.chosen.logprob for lp in w.outputs[0].logprobs],
                                   atol=2e-4)
    assert [g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in got][-2:] == [0, 32]

    cluster["leader"].send_signal(signal.SIGINT)
    assert cluster["leader"].wait(30) == 0
    assert cluster["follower"].wait(30) == 0
    tail = open(cluster["follower_log"]).read()
    steps, pings = map(int, tail.split("process 0 closed after ")[1].split(" idle pings")[0].split(" steps ("))
    assert steps >= sum(kw["max_tokens"] for _, kw in PROMPTS + PROMPTS[-1:] if "structured_outputs" not in kw)
    assert pings >= 1
    import re
    assert re.fullmatch("(cat|dog)-[0-9]{2}", got[3]["choices"][0]["text"])


# The same engine as `reference`, with async scheduling, over a 2 x 2-device mesh: the leader launches each step
# before reading the one in flight back, the followers keep the async carry themselves, and a decode step's logits
# wait on every process until the leader's SAMPLE command brings the sampling batch (masks built then). Tensor
# parallel, then sleep mode, weight updates from disk and a LoRA adapter loaded at runtime, which every process
# applies to its own devices; or expert parallel with load balancing (every 3 steps, 4 redundant experts: the
# leader's EPLB command makes every process move the same experts).
# The engine options of the async scheduling runs below (`async_config(form)`, pasted into their scripts). Each
# form's processes then go on to a failing-step scenario on the same engine (`_LEADER_FAILS` under tp,
# `_LEADER_MOVE_FAILS` under ep, read by their own tests): one start and one warm-up for both (CI time).
_ASYNC_CONFIG = textwrap.dedent("""
    def async_config(form):
        import dataclasses
        from serve.cli import DEFAULTS, engine_config
        eplb = dict(enable_eplb=True, eplb_window_size=6, eplb_step_interval=3, eplb_num_redundant_experts=4)
        lora = dict(enable_lora=True, max_loras=1, max_lora_rank=4)
        o = dict(DEFAULTS, max_model_len=128, max_num_seqs=8, decode_buckets="8", prefill_buckets="1",
                 context_buckets="8", prefill_chunk=32, cache_mb=32, sharding=form, async_scheduling=True,
                 **(eplb if form == "ep" else lora))
        return dataclasses.replace(engine_config(o), measure_moe_time=False)
""")
_ASYNC = textwrap.dedent("""
    _MARK = [7, 6, 5, 4, 3, 2, 1, 0, 3, 2, 1, 0]  # a layer placement the planner never makes (process 1 fails it)
    import dataclasses, json, sys
    import numpy as np
    import k3jax
    import serve.engine
    from k3jax.runtime import load_model
    from serve.cli import DEFAULTS, engine_config
    from serve.engine import Engine, EngineSleeping
    from serve.lora import LoRARequest
    from serve.types import SamplingParams, StructuredOutputsParams
    pid, port = int(sys.argv[1]), sys.argv[2]
    k3jax.initialize_distributed(f"127.0.0.1:{port}", 2, pid)
    form, checkpoint, adapter, merged = sys.argv[4:8]
    from jax.experimental import multihost_utils
    checks, assert_equal = [], multihost_utils.assert_equal
    def counted(*a, **kw):  # device_put's check that a host value is the same on every process (a gather, a compile)
        checks.append(1)
        return assert_equal(*a, **kw)
    multihost_utils.assert_equal = counted
    cfg = async_config(form)
    # tp: the weights read straight into their shards; ep: whole, then placed by the engine (`shard_params`)
    eng = Engine(load_model("tiny-k3", **(dict(sharding=form) if form == "tp" else {})), cfg, progress=False)
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    loaded = len(checks)
    jax.device_put(np.zeros(2, np.float32), NamedSharding(eng.mesh, PartitionSpec()))  # one check: it is counted
    control = len(checks) - loaded
    if eng.is_follower:
        import k3jax.checkpoint as ck
        read, read_tensor, seen = serve.engine.read_config, ck._read, []
        def only_the_leader_has(path):  # a checkpoint directory missing on this host
            if path.endswith("leader-only"):
                raise FileNotFoundError(path)
            return read(path)
        def corrupt_here(st, name, *a, **kw):  # a file this host cannot read, found after a few tensors
            seen.append(name)
            if st.path.endswith("corrupt") and len(seen) > 5:
                raise ck.CheckpointError(f"tensor {name}: unreadable on this host")
            return read_tensor(st, name, *a, **kw)
        serve.engine.read_config, ck._read = only_the_leader_has, corrupt_here
        wait = jax.block_until_ready
        def fails_moving_to_mark(x):  # (ep) this host's devices fail the move to `_MARK` as its gathers finish
            if eng.eplb is not None and eng.eplb.placement[0].tolist() == _MARK:
                raise RuntimeError("injected device failure on process 1")
            return wait(x)
        jax.block_until_ready = fails_moving_to_mark
        print("FOLLOWED", eng.follow(), "CHECKS" + json.dumps([control, len(checks) - control]), flush=True)
        print("PLACEMENT" + json.dumps(eng.eplb.placement.tolist() if eng.eplb is not None else None), flush=True)
        sys.exit(0)

    def run(lora=None):
        ids = []
        for prompt, kw in json.loads(sys.argv[3]):
            if "structured_outputs" in kw:
                kw["structured_outputs"] = StructuredOutputsParams(**kw["structured_outputs"])
            if "logit_bias" in kw:
                kw["logit_bias"] = {int(k): v for k, v in kw["logit_bias"].items()}
            ids.append(eng.add_request(prompt, SamplingParams(ignore_eos=True, logprobs=1, **kw), lora_request=lora))
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o for o in eng.step() if o.finished})
        return [done[i].outputs[0].text for i in ids], [[lp.chosen.logprob for lp in done[i].outputs[0].logprobs]
                                                        for i in ids]
    texts, logprobs = run()
    st = eng.stats()
    c = dict(eng.counters)
    again = []
    if form == "tp":
        eng.sleep(1, ["kv_cache"])  # the cache alone, then the weights alone: every process releases the same part
        eng.wake_up()
        eng.sleep(1, ["weights"])
        eng.wake_up()
        again.append(run()[0])  # the weights each process kept of its own shards
        eng.sleep(2)
        eng.wake_up()
        try:
            run()
        except EngineSleeping as e:
            again.append(str(e))
        for broken in ("-leader-only", "-corrupt"):  # fails before, or in the middle of, reading the weights
            try:
                eng.update_weights_from_disk(checkpoint + broken)
            except RuntimeError as e:
                again.append(str(e))
        eng.update_weights_from_disk(checkpoint)
        again.append(run()[0])
        eng.add_lora(LoRARequest("a", 1, adapter))  # the leader sends its factors; every process writes its slot
        again.append(run("a"))
        eng.remove_lora("a")
        eng.update_weights_from_disk(merged)  # the same adapter merged into the weights
        again.append(run())
    # weights by checkpoint name: the leader sends the tensors, every process writes its own shards (ep: experts
    # at their balanced places, half of them on each process) and reads back its part of a tensor
    from k3jax.checkpoint import hf_tensors
    from pallas_kernels.moe.mxfp4 import dequantize_mxfp4
    base, other = (dict(hf_tensors(m.cfg, m.params)) for m in (load_model("tiny-k3"), load_model("tiny-k3", seed=1)))
    def reads_back(ts):
        same = []
        for e in range(8):
            stem = f"language_model.model.layers.1.block_sparse_moe.experts.{e}.w1."
            want = np.asarray(dequantize_mxfp4(ts[stem + "weight_packed"], ts[stem + "weight_scale"]))
            same.append(np.array_equal(eng.get_weights_by_name(stem + "weight", None), want))
        q = "language_model.model.layers.0.self_attn.q_proj.weight"
        return all(same) and np.array_equal(eng.get_weights_by_name(q, 3), ts[q][:3])
    eng.update_weights_from_tensor(list(other.items()))
    read_other = reads_back(other)
    eng.update_weights_from_tensor(list(base.items()))
    again += [bool(read_other and reads_back(base)), run()[0]]
    print("RESULT" + json.dumps(dict(
        texts=texts, logprobs=logprobs, again=again, ahead=c["steps_launched_ahead"], steps=c["steps"],
        compiles=st["compiles_after_warmup"], free=st["arena_free_units"] + st["arena_cached_units"],
        baseline=st["arena_baseline_free_units"], eplb=st.get("eplb"), checks=[control, len(checks) - control],
        placement=eng.eplb.placement.tolist() if eng.eplb is not None else None)), flush=True)
""")


@pytest.fixture(scope="module")
def async_pair(tmp_path_factory):
    """form -> [(exit status, output)] of processes 0 and 1 running `_ASYNC` under that form and then, on the same
    engine, its failing-step scenario (`_LEADER_FAILS` under tp, `_LEADER_MOVE_FAILS` under ep): one pair of
    processes per form, started by the first test that asks for it and read by both of that form's tests."""
    runs = {}

    def run(form):
        if form not in runs:
            runs[form] = _async_pair(form, tmp_path_factory.mktemp(f"async-{form}"))
        return runs[form]

    return run


def _async_pair(form: str, tmp_path) -> list[tuple[int, str]]:
    import k3jax

    if form == "tp":  # the weights (as a checkpoint directory), an adapter and its merged weights the tp part loads
        from k3jax.checkpoint import save_hf_checkpoint

        model = k3jax.load_model("tiny-k3")  # the script's weights, as a checkpoint directory
        save_hf_checkpoint(str(tmp_path / "ckpt"), model.cfg, model.params)
        os.symlink(tmp_path / "ckpt", tmp_path / "ckpt-leader-only")  # the follower's script cannot read this one
        os.symlink(tmp_path / "ckpt", tmp_path / "ckpt-corrupt")  # ... nor all of this one's tensors
        _lora_and_merged(model, tmp_path / "adapter", tmp_path / "merged")
    script = _ASYNC_CONFIG + _ASYNC + (_LEADER_FAILS if form == "tp" else _LEADER_MOVE_FAILS)
    return _two_processes(script, json.dumps(PROMPTS), form, *(str(tmp_path / d) for d in ("ckpt", "adapter", "merged")),
                          timeout=900)  # (the two tests' 600 + 300 s)


def _result(out: str, tag: str) -> dict:
    """The JSON a script printed on the line starting with `tag`."""
    assert tag in out, out[-4000:]
    return json.loads(out.split(tag, 1)[1].splitlines()[0])


@pytest.mark.parametrize("form", ["tp", "ep"])
def test_two_processes_schedule_async_like_one_device(reference_outputs, async_pair, form):
    """async_scheduling on a 2-process mesh: greedy, seeded, structured-output (its masks sent with the deferred
    sample) and logit-bias requests, in one batch, give one synchronous device's texts (logprobs to fp32
    rounding) while most steps are launched before the one in flight is read back; the follower replays every
    step and sample; nothing compiles after warm-up and the arena is back at its baseline. Under `tp`, then:
    after sleep(1) and wake_up the same texts; after sleep(2) requests are refused until
    update_weights_from_disk, which fails as a whole when one process cannot read the directory or one of
    its tensors (after reading others: no process is left waiting in a load program), then succeeds; an adapter loaded at runtime gives the texts of its weights merged into the checkpoint. Under
    `ep` the experts are also re-placed every 3 steps (EPLB), on both processes alike, without changing an
    output. Both: other weights written by checkpoint name (every process writing its own shards) read back
    across the processes, and the originals written back give the first texts. Neither process places a host
    value with `device_put`'s cross-process equality check (tp loads the weights into their shards, ep whole and
    the engine places them: `k3jax.sharding.put`)."""
    (code0, out0), (code1, out1) = async_pair(form)
    assert code0 == 0, out0[-4000:]
    assert code1 == 0 and "failed on process" not in out1, out1[-4000:]
    got = _result(out0, "RESULT")
    want = reference_outputs[:len(PROMPTS)]
    assert got["texts"] == [w.outputs[0].text for w in want]
    for g, w in zip(got["logprobs"], want):
        np.testing.assert_allclose(g, [lp.chosen.logprob for lp in w.outputs[0].logprobs], atol=2e-4)
    assert got["ahead"] > got["steps"] // 2 and got["compiles"] == 0 and got["free"] == got["baseline"]
    assert int(out1.split("FOLLOWED")[1].split()[0]) >= max(kw["max_tokens"] for _, kw in PROMPTS)
    # no host value was placed with device_put's cross-process equality check (a gather and a compile each: one
    # per weight in the load, before), in the load, the engine's placement or anything after (LoRA factors, EPLB
    # tables); the one placed on purpose shows the checks are counted
    assert got["checks"] == _result(out1, "CHECKS") == [1, 0], (got["checks"], out1[-2000:])
    import re
    assert re.fullmatch("(cat|dog)-[0-9]{2}", got["texts"][3])
    if form == "tp":
        again = got["again"]
        assert again[0] == got["texts"] and again[4] == got["texts"], again
        assert "sleep(level=2) discarded the weights" in again[1], again
        for refused in again[2:4]:
            assert "process(es) [1] could not load" in refused and "unchanged" in refused, again
        (lora, lora_lps), (merged, merged_lps) = again[5:7]  # an adapter's outputs are its merged weights'
        assert lora == merged and lora != got["texts"], (lora, merged)
        for a, b in zip(lora_lps, merged_lps):
            np.testing.assert_allclose(a, b, atol=1e-3)
    # other weights written by name read back on both processes' shards; the originals written back answer as before
    assert got["again"][-2:] == [True, got["texts"]], got["again"][-2:]
    if form == "ep":
        initial = list(range(8)) + [0, 1, 2, 3]
        assert got["eplb"]["rebalances"] >= 3 and got["eplb"]["layers_moved"] >= 1
        assert any(p != initial for p in got["placement"])


def _lora_and_merged(model, adapter, merged):
    """A PEFT adapter on three of `model`'s projections (written to `adapter`) and the model with it merged into
    those weights (W + alpha / r * B @ A, an HF checkpoint in `merged`)."""
    import json

    import jax.numpy as jnp
    from flax import nnx
    from safetensors.numpy import save_file

    from k3jax.checkpoint import save_hf_checkpoint

    rng, r, alpha = np.random.default_rng(5), 4, 8.0
    flat = dict(nnx.to_flat_state(model.params))
    tensors = {}
    for layer, module in ((0, ("self_attn", "o_proj")), (0, ("self_attn", "q_proj")), (0, ("mlp", "down_proj"))):
        key = ("layers", layer, *module, "weight")
        w = np.asarray(flat[key][...])  # [out, in]
        a = rng.normal(0, 0.3, (r, w.shape[1])).astype(np.float32)
        b = rng.normal(0, 0.3, (w.shape[0], r)).astype(np.float32)
        name = f"base_model.model.language_model.model.layers.{layer}.{'.'.join(module)}"
        tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = a, b
        flat[key] = flat[key].replace(value=jnp.asarray(w + alpha / r * b @ a, w.dtype))
    os.makedirs(adapter)
    save_file(tensors, os.path.join(adapter, "adapter_model.safetensors"))
    with open(os.path.join(adapter, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha}, f)
    save_hf_checkpoint(str(merged), model.cfg, nnx.from_flat_state(list(flat.items())))


# Processes that build different engines (here max_model_len) are refused by the engine check before compiling.
# The same processes then go on to `_MEMORY` and `_HOST_COPY` (one start for the three tests, CI time), which they
# reach only once both were refused: a process that built its engine stops there (exit status 3).
_MISMATCH = textwrap.dedent("""
    import sys
    import k3jax
    pid, port = int(sys.argv[1]), sys.argv[2]
    k3jax.initialize_distributed(f"127.0.0.1:{port}", 2, pid)
    try:
        k3jax.LLM("tiny-k3", sharding="tp", max_model_len=64 if pid == 0 else 128, cache_bytes=8 << 20,
                  max_num_seqs=4, prefill_chunk=16, max_prefill_seqs=1, decode_buckets=(4,), prefill_buckets=(1,),
                  context_buckets=(8,), measure_moe_time=False, progress=False)
    except RuntimeError as e:
        print("ERROR", e, flush=True)
    else:
        sys.exit(3)
""")


@pytest.fixture(scope="module")
def mismatch_then_memory():
    """[(exit status, output)] of processes 0 and 1 running `_MISMATCH`, then `_MEMORY` and `_HOST_COPY`."""
    return _two_processes(_MISMATCH + _MEMORY + _HOST_COPY + _LEAVE)


def _two_processes(script: str, *args: str, timeout: float = 300) -> list[tuple[int, str]]:
    """Run `script` as processes 0 and 1 of one cluster (argv: process id, coordinator port, `args`) -> each
    one's (exit status, output)."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", script, str(pid), str(port), *args], cwd=ROOT, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for pid in (0, 1)]
    try:
        return [(p.returncode, out) for p, out in ((p, p.communicate(timeout=timeout)[0]) for p in procs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_processes_that_build_different_engines_are_told_before_compiling(mismatch_then_memory):
    for code, out in mismatch_then_memory:
        assert code != 3, out[-3000:]
        assert "process(es) [1] built a different engine than process 0" in out, out[-3000:]


# A step whose launch raises on process 0 alone (an injected device failure; in life device memory, an
# interrupt): process 0 sends a step only once its own launch returned, so process 1 never runs a program whose
# collectives would wait for process 0 (both hung, before). The failed prefill's request ends; the others answer as
# before, and so does everything after. Once closed, process 0 refuses requests up front.
# Process 0's part, run by `_ASYNC`'s tp processes once that test's part is done (its engine, back on the original
# weights; process 1 follows on).
_LEADER_FAILS = textwrap.dedent("""
    sys.path.insert(0, "tests")
    from step_failures import FailingPrefill, drain_through_failures
    def run(prompts):
        ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)) for p in prompts]
        failures, done = drain_through_failures(eng)
        return [done[i].outputs[0].text if i in done else None for i in ids], [f.request_ids for f in failures]
    prompts = ["The quick brown fox", "jumps over", "the lazy dog"]
    want, _ = run(prompts)
    eng._step = FailingPrefill(eng)
    got, failed = run(prompts)
    eng._step = eng._step.real
    again, _ = run(prompts)
    eng.close()
    try:  # the followers are gone: refused up front (a step launched now would wait for them forever)
        closed = eng.add_request("after close", SamplingParams(max_tokens=2))
    except RuntimeError as e:
        closed = str(e)
    print("FAILED_STEP" + json.dumps(dict(want=want, got=got, failed=failed, again=again, closed=closed)), flush=True)
""")


def test_a_step_failing_on_process_0_alone_leaves_the_processes_in_step(async_pair):
    (code0, out0), (code1, out1) = async_pair("tp")
    assert code0 == 0 and code1 == 0, (out0[-3000:], out1[-3000:])
    got = _result(out0, "FAILED_STEP")
    assert [len(ids) for ids in got["failed"]] == [1] and got["got"].count(None) == 1, got  # the failed prefill's
    assert [t for t in got["got"] if t is not None] == [t for t, g in zip(got["want"], got["got"]) if g is not None]
    assert got["again"] == got["want"], got
    assert "was closed" in got["closed"], got["closed"]
    assert "failed on process" not in out1  # process 1 never ran the step process 0 could not launch


# An EPLB move asked of process 0 before warm-up (simulated) is refused: process 1 replays moves only from follow(),
# so process 0 moved alone (its gathers waiting for process 1, or its experts placed apart from process 1's).
# An EPLB move whose expert gather fails on process 0 alone (injected as it is compiled; in life a compile, device
# memory or an interrupt): process 0 prepares its gathers (and, off XLA:CPU, launches them) before sending the move,
# so a move it could not make is never sent and process 1 never waits in the gather's collectives for it (both hung,
# before: the move was sent first). The placement stays as it was on both processes, the outputs do not change; a
# later move goes through on both alike. Then moves that fail late, as the gathers finish (after the move was sent),
# on process 0 alone and on process 1 alone: the processes exchange verdicts, so neither keeps the move (before,
# the leader counted it both as a rebalance and as failed, and the processes could disagree on the placement);
# requests after them answer as before.
# Process 0's part, run by `_ASYNC`'s ep processes once that test's part is done (its engine; process 1 follows on).
_LEADER_MOVE_FAILS = textwrap.dedent("""
    import serve.eplb
    def run(prompts=("The quick brown fox", "jumps over", "the lazy dog")):
        ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)) for p in prompts]
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o for o in eng.step() if o.finished})
        return [done[i].outputs[0].text for i in ids]
    def across_processes(plan=eng.eplb.plan):  # (once) layer 0's experts swap processes
        eng.eplb.plan = plan
        return {0: np.roll(eng.eplb.placement[0], eng.eplb.placement.shape[1] // 2)}, {}
    want = run()
    before = eng.eplb.placement.copy()
    eng.eplb.plan, gather = across_processes, serve.eplb.take_experts
    eng.warmed_up = False  # as before warm-up: process 1 would never join the move
    try:
        eng.rebalance_experts()
        cold = None
    except RuntimeError as e:
        cold = str(e)
    eng.warmed_up = True
    class Broken:  # the expert gather, failing on process 0 alone
        def __call__(self, *args):
            raise RuntimeError("injected device failure")
        lower = __call__
    serve.eplb.take_experts = Broken()
    try:
        eng.rebalance_experts()
        failed = None
    except RuntimeError as e:
        failed = str(e)
    serve.eplb.take_experts = gather
    kept = eng.eplb.placement.tolist() == before.tolist()
    got = run()
    eng.eplb.plan = across_processes
    eng.rebalance_experts()
    moved = eng.eplb.placement[0].tolist() != before[0].tolist()
    again = run()
    import jax
    placed, counted, plan = eng.eplb.placement.copy(), eng.stats()["eplb"]["rebalances"], eng.eplb.plan
    wait, late = jax.block_until_ready, []
    def fails_once(x):  # process 0's devices fail as the gathers finish
        jax.block_until_ready = wait
        raise RuntimeError("injected late device failure")
    for mark, here in ((np.roll(placed[0], 3), True), (np.asarray(_MARK), False)):
        eng.eplb.plan = lambda mark=mark: ({0: mark.astype(np.int32)}, {})
        jax.block_until_ready = fails_once if here else wait
        try:
            eng.rebalance_experts()
            late.append(None)
        except RuntimeError as e:
            late.append(str(e))
    jax.block_until_ready, eng.eplb.plan = wait, plan
    late_kept = eng.eplb.placement.tolist() == placed.tolist() and eng.stats()["eplb"]["rebalances"] == counted
    after_late = run()
    eng.close()
    print("FAILED_MOVE" + json.dumps(dict(want=want, cold=cold, failed=failed, kept=kept, got=got, moved=moved,
                                          again=again, late=late, late_kept=late_kept, after_late=after_late,
                                          placement=eng.eplb.placement.tolist())), flush=True)
""")


def test_an_expert_move_failing_on_process_0_alone_leaves_the_processes_in_step(async_pair):
    (code0, out0), (code1, out1) = async_pair("ep")
    assert code0 == 0 and code1 == 0, (out0[-3000:], out1[-3000:])
    got = _result(out0, "FAILED_MOVE")
    # a move asked of process 0 before warm-up is refused (it ran there alone: its gathers' collectives waited for
    # process 1, which replays moves only from follow(), after its own warm-up)
    assert got["cold"] and "not warmed up; call warmup() first" in got["cold"], got
    assert "injected device failure" in got["failed"] and got["kept"] and got["moved"], got
    assert got["got"] == got["want"] == got["again"] == got["after_late"], got
    assert "failed on process" not in out1  # process 1 never ran the move process 0 could not make
    # late failures (process 0's, then process 1's): the move stands nowhere, counted as no rebalance
    assert got["late"][0] == "injected late device failure" and "process(es) [1] could not move" in got["late"][1], got
    assert got["late_kept"] and _result(out1, "PLACEMENT") == got["placement"], got


# gpu_memory_utilization on two processes whose (simulated) devices differ in size: each plans from its own,
# both must build the same (smallest) arena or the engine check before compiling refuses them. The step
# temporaries are a given 1 MiB here (their measurement compiles; tests/test_memory_budget.py measures them).
# Run by `_MISMATCH`'s processes once their engines were refused (nothing of them left on the devices).
_MEMORY = textwrap.dedent("""
    import gc
    import jax
    import serve.engine
    from serve.engine import Engine, EngineConfig
    gc.collect()
    assert not jax.live_arrays(), [x.shape for x in jax.live_arrays()]  # (the refused engine's arrays are gone)
    limit = (48 << 20) if pid == 0 else (40 << 20)
    used = lambda d: sum(s.data.nbytes for x in jax.live_arrays() for s in x.addressable_shards if s.device == d)
    serve.engine.device_memory = lambda devices: [dict(bytes_limit=limit, bytes_in_use=used(d)) for d in devices]
    Engine._step_temp_bytes = lambda self: 1 << 20
    eng = Engine(k3jax.load_model("tiny-k3", sharding="tp"),
                 EngineConfig(sharding="tp", gpu_memory_utilization=0.5, max_model_len=64, max_num_seqs=4,
                              prefill_chunk=16, max_prefill_seqs=1, decode_buckets=(4,), prefill_buckets=(1,),
                              context_buckets=(4,), measure_moe_time=False), warmup=False, progress=False)
    print("UNITS", eng.layout.num_units, eng.memory_plan.bytes_limit, flush=True)
""")
# The end of `mismatch_then_memory`'s script, after `_HOST_COPY`.
_LEAVE = textwrap.dedent("""
    from jax.experimental import multihost_utils
    import os
    multihost_utils.sync_global_devices("sized")  # both built: leave without serving (no warm-up, no close)
    os._exit(0)
""")


def test_processes_size_one_arena_from_their_device_memory(mismatch_then_memory):
    got = []
    for code, out in mismatch_then_memory:
        assert code == 0, out[-3000:]
        got.append([int(x) for x in out.split("UNITS ")[1].split()[:2]])
    (units0, limit0), (units1, limit1) = got
    assert (limit0, limit1) == (48 << 20, 40 << 20) and units0 == units1  # process 1's smaller device decides


def test_serve_multihost_options_are_checked(capsys):
    """Multi-host flags without a mesh (or a coordinator), or with disaggregated prefill, fail at once, saying
    what is missing or in the way (`k3jax serve`'s own entry point, in this process: both are refused before
    the process would join a cluster; CI time)."""
    from k3jax.cli import main

    assert main(["serve", "--num-processes", "2"]) != 0
    err = capsys.readouterr().err
    assert "--coordinator-address" in err and "--sharding" in err, err
    # disaggregated prefill's two engines live in one process: refused before joining the cluster (process 1 would
    # build the one engine over every process's devices and wait for process 0 forever)
    assert main(["serve", "--num-processes", "2", "--sharding", "tp", "--coordinator-address",
                 f"127.0.0.1:{_free_port()}", "--prefill-devices", "0", "--decode-devices", "1"]) != 0
    err = capsys.readouterr().err
    assert "--prefill-devices" in err and "multi-host" in err, err


def test_step_batch_packing_roundtrip():
    from serve.multihost import pack, unpack

    rng = np.random.default_rng(0)
    leaves = [rng.integers(-5, 9, (3, 4)).astype(np.int32), rng.standard_normal(7).astype(np.float32),
              rng.integers(0, 2 ** 32, (2, 2), dtype=np.uint64).astype(np.uint32), np.zeros((0,), np.int32)]
    back = unpack(pack(leaves), [np.zeros_like(x) for x in leaves])
    for a, b in zip(leaves, back):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    with pytest.raises(ValueError, match="does not match"):
        unpack(pack(leaves)[:-1], leaves)


# A sleeping engine's host copies, on a mesh of a process's own 2 devices: run by `mismatch_then_memory`'s processes
# after `_MEMORY` (a process of its own cost a Python and JAX start; CI time).
_HOST_COPY = textwrap.dedent("""
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from serve.multihost import HostCopy
    mesh = Mesh(np.array(jax.local_devices()[:2]), ("x",))
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    for spec, kept in ((P("x"), 2), (P(), 1)):
        a = jax.device_put(x, NamedSharding(mesh, spec))
        h = HostCopy.of(a)
        assert len(h.shards) == kept and len(h.where) == 2, (spec, h.shards.keys())
        a.delete()
        b = h.restore(NamedSharding(mesh, spec))
        assert b.sharding == NamedSharding(mesh, spec) and np.array_equal(np.asarray(b), x)
    one = HostCopy.of(jax.numpy.asarray(x))
    assert np.array_equal(np.asarray(one.restore(None)), x)
    print("HOST_COPIES_OK", flush=True)
""")


def test_command_payloads_and_host_copies_roundtrip(mismatch_then_memory):
    """Bytes and text in int32 command payloads (every length mod 4, non-ASCII); a sleeping engine's host copy
    of a sharded and of a replicated array (a process's 2 devices, in each process of `mismatch_then_memory`)
    comes back with its values and sharding, a replicated one kept once."""
    from serve.multihost import bytes_payload, payload_bytes, payload_text, text_payload

    for n in range(9):
        raw = bytes(np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8))
        p = bytes_payload([7, -1, n], raw)
        assert p.dtype == np.int32 and payload_bytes(p, 3) == ([7, -1, n], raw)
    assert payload_text(text_payload("/ckpt/K3 — étape 2")) == "/ckpt/K3 — étape 2"
    for code, out in mismatch_then_memory:
        assert code == 0 and "HOST_COPIES_OK" in out, out[-3000:]


class _Tape:
    """An in-memory transport: the leader's messages, read back in order by a follower."""

    def __init__(self):
        self.messages: list[bytes] = []

    def send(self, message: bytes) -> None:
        self.messages.append(bytes(message))

    def receive(self) -> bytes:
        return self.messages.pop(0)


def _channels(make):
    """A leader and a follower channel over one tape."""
    from serve import multihost

    tape = _Tape()
    leader, follower = multihost.StepChannel(make, tape), multihost.StepChannel(make, tape)
    follower.leader = False
    return leader, follower, tape


def _over_tape(channel, batch, shape):
    """One exchange: the leader sends `batch` (-> bytes of batch sent), a follower reads it (-> the batch it
    rebuilt)."""
    if channel.leader:
        channel.send(batch, shape)
        return channel._sent
    return channel.receive()[1]


def test_channel_sends_prompt_embeddings_only_when_a_row_has_them():
    """A step batch of an engine with enable_prompt_embeds: the [B, T, H] vectors and their mask travel only
    in steps where some row holds prompt vectors; the follower rebuilds the batch exactly either way."""
    import jax

    from serve.sampling import SamplingBatch
    from serve.step import StepBatch

    rows, t, pages, hidden = 2, 4, 3, 8

    def make(r, t, p, embeds=None, mask=None):
        z = np.zeros
        return StepBatch(z((r, t), np.int32), z(r, np.int32), z(r, np.int32), z(r, np.int32), z(r, np.int32),
                         z(r, np.int32), z(2, np.int32), z(2, np.int32),
                         SamplingBatch.from_params([], [], [], r, None, None, 5, None, 1), z((r, t), np.int32),
                         z(r, np.int32), z((r, t, hidden), np.float32) if embeds is None else embeds,
                         z((r, t), bool) if mask is None else mask, pages=p)

    leader, follower, _ = _channels(make)
    vectors = np.random.default_rng(0).standard_normal((rows, t, hidden)).astype(np.float32)
    mask = np.zeros((rows, t), bool)
    mask[1, :3] = True
    sizes = []
    for batch in (make(rows, t, pages), make(rows, t, pages, vectors, mask), make(rows, t, pages)):
        sizes.append(_over_tape(leader, batch, (rows, t, pages)))
        got = _over_tape(follower, None, (rows, t, pages))
        for a, b in zip(jax.tree.leaves(batch), jax.tree.leaves(got)):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    # (one flag for every optional leaf: the sampling extras travel with the vectors)
    assert sizes[0] == sizes[2] < rows * t * hidden * 4 < rows * t * (hidden * 4 + 1) <= sizes[1] - sizes[0]


def test_channel_names_deferred_samples_and_never_sends_the_carry():
    """Async scheduling over the channel: a step batch's carry (a device array each process updates itself) is
    never read or sent -- the follower's batch has None there and everything else equal -- and a SAMPLE carries
    a sampling batch with the number of the step it samples."""
    import jax

    from serve import multihost
    from serve.sampling import SamplingBatch
    from serve.step import StepBatch
    from serve.types import SamplingParams

    class Unreadable:  # reading the carry on the host would wait for the step in flight
        def __array__(self, *a, **k):
            raise AssertionError("the carry was read on the host")

    rows, t, pages = 2, 1, 3

    def make(r, t, p, sampling=None, tokens=None):
        z = np.zeros
        return StepBatch(z((r, t), np.int32) if tokens is None else tokens, z(r, np.int32), z(r, np.int32),
                         z(r, np.int32), z(r, np.int32), z(r, np.int32), z(2, np.int32), z(2, np.int32),
                         sampling or SamplingBatch.from_params([], [], [], r, None, None, 5, None, 1),
                         z((r, t), np.int32), z(r, np.int32), carry=Unreadable(), splice=np.full(r, -1, np.int32),
                         pages=p)

    leader, follower, _ = _channels(make)
    batch = make(rows, t, pages, tokens=np.asarray([[5], [9]], np.int32))
    batch.splice = np.asarray([3, -1], np.int32)
    sent = _over_tape(leader, batch, (rows, t, pages))
    got = _over_tape(follower, None, (rows, t, pages))
    assert got.carry is None and leader.steps == follower.steps == 1
    want = jax.tree.leaves(dataclasses.replace(batch, carry=None))
    assert len(want) == len(jax.tree.leaves(got)) == len(jax.tree.leaves(batch)) - 1
    assert all(np.array_equal(a, b) for a, b in zip(want, jax.tree.leaves(got)))
    assert sent == sum(a.nbytes for a in want) - rows * (1 * 4 + 5 * 8 + 1 + 1)  # the extras are padding: not sent

    allowed = np.full((rows, 1), -1, np.int32)
    allowed[1] = [6]
    sampling = SamplingBatch.from_params([SamplingParams(temperature=0.5, seed=1)], [1], [2], rows, None, None, 5,
                                         allowed, 1)
    leader.sample(7, sampling)
    cmd, (step, back) = follower.receive()
    assert cmd == multihost.SAMPLE and step == 7 and leader.steps == follower.steps == 1
    for a, b in zip(jax.tree.leaves(sampling), jax.tree.leaves(back)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_channel_sends_the_sampling_extras_only_when_a_row_uses_them():
    """Leader and follower channels over an in-memory transport: the follower rebuilds the leader's batch
    exactly, with the bitmask / bias leaves in the message only when some row is not padding."""
    import jax

    from serve.sampling import SamplingBatch
    from serve.types import SamplingParams

    rows, words = 4, 3
    make = lambda r, t, p: SamplingBatch.from_params([], [], [], r, None, None, 5, None, words)  # noqa: E731
    leader, follower, _ = _channels(make)
    run = lambda channel, batch: _over_tape(channel, batch, (rows, 1, 1))  # noqa: E731

    allowed = np.full((rows, words), -1, np.int32)
    allowed[1] = [5, 0, -7]
    plain = SamplingBatch.from_params([SamplingParams(temperature=0.5, seed=1)], [1], [2], rows, None, None, 5,
                                      None, words)
    extras = SamplingBatch.from_params([SamplingParams(logit_bias={3: 2.0})], [0], [0], rows, None, None, 5,
                                       allowed, words, constrained=np.arange(rows) == 1)
    sizes = []
    for batch in (plain, extras, plain):
        sizes.append(run(leader, batch))
        got = run(follower, None)
        for a, b in zip(jax.tree.leaves(batch), jax.tree.leaves(got)):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    assert sizes[0] == sizes[2] < sizes[1]
    assert sizes[1] - sizes[0] == rows * (words * 4 + 5 * 8 + 1 + 1)  # mask + bias ids/values + restrict + constrained


class _FakeStore:
    """The coordination service's key-value calls the transport makes, in memory. A wait for a key not yet
    set times out (as a real one does after POLL_MS); `fail` makes the next wait fail otherwise."""

    def __init__(self):
        self.kv: dict[str, bytes] = {}
        self.waits = 0
        self.fail = None
        self.ever: set[str] = set()

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.kv, key
        self.kv[key] = bytes(value)
        self.ever.add(key)

    def key_value_try_get_bytes(self, key):
        if key not in self.kv:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.kv[key]

    def blocking_key_value_get_bytes(self, key, timeout_in_ms):
        self.waits += 1
        if self.fail is not None:
            raise RuntimeError(self.fail)
        assert key in self.kv or key not in self.ever, f"{key} was deleted before this follower read it"
        if key not in self.kv:
            raise RuntimeError(f"DEADLINE_EXCEEDED: {key} not set within {timeout_in_ms} ms")
        return self.kv[key]

    def key_value_delete(self, key):
        for k in [k for k in self.kv if k == key or k.startswith(key + "/")]:
            del self.kv[k]


def test_key_value_transport_delivers_in_order_and_keeps_only_unread_blocks():
    """Two followers reading the leader's messages at their own pace: each gets every message in order; the
    leader deletes a block of messages only once both have read it, so the store holds what the slower one has
    yet to read (plus at most the block being written and the one read last); a wait that times out is renewed, another error is raised."""
    from serve.multihost import KeyValueTransport

    store = _FakeStore()
    leader = KeyValueTransport(0, 3, client=store)
    fast, slow = (KeyValueTransport(p, 3, client=store) for p in (1, 2))
    fast.prefix = slow.prefix = leader.prefix  # (each process numbers its own channels alike)
    block = KeyValueTransport.BLOCK
    messages = [f"m{i}".encode() * (i % 7 + 1) for i in range(5 * block + 3)]
    got_fast, got_slow = [], []
    for i, m in enumerate(messages):
        leader.send(m)
        got_fast.append(fast.receive())
        while len(got_slow) < i - 2 and i % 5 == 4:  # the slow follower reads in bursts, 3 messages behind
            got_slow.append(slow.receive())
        stored = [k for k in store.kv if "/ack/" not in k]
        oldest = min(int(k.rsplit("/", 1)[1]) for k in stored)
        assert oldest <= len(got_slow)  # nothing unread is gone
        assert len(stored) <= (i + 1 - len(got_slow)) + 2 * block  # unread + the blocks in writing and just read
    assert len(stored) < 2 * block  # read blocks went
    while len(got_slow) < len(messages):
        got_slow.append(slow.receive())
    assert got_fast == messages and got_slow == messages

    waits = store.waits
    with pytest.raises(RuntimeError):
        store.fail = "UNAVAILABLE: the coordination service is gone"
        fast.receive()
    store.fail = None
    assert store.waits == waits + 1

    class Later(_FakeStore):  # the key appears while the follower waits (after two renewed waits)
        def blocking_key_value_get_bytes(self, key, timeout_in_ms):
            if self.waits == 2:
                self.kv[key] = b"late"
            return super().blocking_key_value_get_bytes(key, timeout_in_ms)

    store = Later()
    follower = KeyValueTransport(1, 2, client=store)
    assert follower.receive() == b"late" and store.waits == 3
