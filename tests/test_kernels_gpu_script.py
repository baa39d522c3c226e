"""CPU checks of ``benchmarks/kernels_gpu.py`` (the device kernel check + benchmark script).

The script is meant for a lent GPU; here it runs in Pallas interpret mode at tiny shapes
(``--quick --interpret --skip-peer``) so that every case, the correctness checks, the JSON
layout and the time-budget path are exercised without one. The fla peer code (numpy -> torch
conversion, comparison with our reference, timing) is exercised with a small pure-torch KDA
recurrence standing in for fla's Triton kernels (fla itself needs Triton and a GPU).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels_gpu.py"
CHECK_CASES = [
    "check_kda_chunk", "check_kda_chunk_varlen", "check_kda_chunk_bf16_state", "check_kda_recurrent",
    "check_kda_pool",
    "check_gmm_float32", "check_gmm_bfloat16", "check_gmm_mxfp4",
    "check_mla_float32", "check_mla_bfloat16", "check_mla_fp8",
]
TIMED_PREFIXES = ["kda_decode_pool_B", "kda_decode_pool_sweep_B", "kda_prefill_H", "kda_prefill_forms_H",
                  "kda_prefill_prepk_H",
                  "moe_gmm_dense_bf16_M",
                  "moe_gmm_mxfp4_M", "mla_paged_decode_H", "mla_paged_decode_fp8_H"]


def _load_script():
    spec = importlib.util.spec_from_file_location("kernels_gpu_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def kg():
    return _load_script()


@pytest.fixture(scope="module")
def quick_run(kg, tmp_path_factory):
    out = tmp_path_factory.mktemp("kernels_gpu") / "x.json"
    returned = kg.main(["--quick", "--interpret", "--skip-peer", "--out", str(out)])
    return returned, json.loads(out.read_text())


# ----------------------------------------------------------------------------------------
# the whole script, in-process
# ----------------------------------------------------------------------------------------
def test_quick_run_has_every_case(kg, quick_run):
    _, res = quick_run
    names = [c["name"] for c in res["cases"]]
    planned = [n for n, _ in kg.plan(kg.config(True), None, True, None)]
    assert names == planned
    for n in CHECK_CASES:
        assert n in names
    for p in TIMED_PREFIXES:
        assert any(n.startswith(p) for n in names), p


def test_quick_run_every_case_passes(quick_run):
    _, res = quick_run
    for c in res["cases"]:
        assert c["status"] == "ok", (c["name"], c.get("error"))
        chk = c["check"]
        assert chk["passed"], (c["name"], chk)
        tol = chk["tol"]
        assert chk["tensors"], c["name"]
        for t, e in chk["tensors"].items():   # re-derive the verdict from the numbers
            assert e["finite"], (c["name"], t)
            assert math.isfinite(e["rel_l2"]) and e["rel_l2"] <= tol["rel_l2"], (c["name"], t, e)
            assert math.isfinite(e["max_rel"]) and e["max_rel"] <= tol["max_rel"], (c["name"], t, e)
        assert c["compile_s"] > 0


def test_quick_run_timings_and_summary(quick_run):
    returned, res = quick_run
    assert returned["cases"] == res["cases"]
    assert res["interpret"] and res["machine"]["interpret_effective"]
    assert res["roofline"]["bandwidth"]["gbps"] > 0
    timed = [c for c in res["cases"] if not c["name"].startswith("check_")]
    assert timed
    for c in timed:
        assert c["time"]["median"] > 0 and c["time_blocked"]["median"] > 0, c["name"]
        assert c["time"]["calls_per_sample"] >= 1
        assert math.isfinite(c["gbps"]) and c["gbps"] > 0
        assert 0 < c["fraction_of_bandwidth"] < math.inf
    s = res["summary"]
    assert s["all_checks_passed"] and not s["errors"] and not s["skipped"]
    assert set(s["checks"]) == {c["name"] for c in res["cases"]}
    assert s["goal_kda_decode"]["cases"] and s["goal_kda_prefill"]["cases"]
    for p in s["goal_kda_prefill"]["cases"]:  # tensor-core variants: checked (emulated) and timed
        assert set(p["dot_precision_variants"]) == {"tf32x3", "tf32", "bf16"}
        for v in p["dot_precision_variants"].values():
            assert v["check_passed"] is True and v["tokens_per_s"] > 0 and not v["error"]
        assert set(p["form_variants"]) == {"split", "staged", "staged_s2", "staged_bf16", "staged_pk", "split_pk"}
        for v in p["form_variants"].values():
            assert v["check_passed"] is True and v["tokens_per_s"] > 0 and not v["error"]
        every = {"default": p["tokens_per_s"], **{n: v["tokens_per_s"] for n, v in
                                                  {**p["dot_precision_variants"], **p["form_variants"]}.items()}}
        assert p["fastest"]["tokens_per_s"] == max(every.values())
        assert every[p["fastest"]["variant"]] == p["fastest"]["tokens_per_s"]
        parts = p["staged_parts"]   # the staged form's stages timed alone
        assert set(parts) == {"layout", "prep", "loop", "output", "sum_s", "prep_kernels"}  # the last: prepk case
        assert min(parts.values()) > 0


def test_quick_run_sweeps_the_decode_kernel_shapes(kg, quick_run):
    """The pooled decode sweep: every (block_v, num_warps) of the config checked and timed, the best
    one reported with its bandwidth, and the sweep listed under the decode goal."""
    _, res = quick_run
    shapes = kg.config(True)["decode_sweep"]["shapes"]
    sweeps = {c["shape"]["B"]: c for c in res["cases"] if c["op"] == "fused_recurrent_kda_pool_sweep"}
    assert set(sweeps) == set(shapes)
    for b, c in sweeps.items():
        assert list(c["variants"]) == [f"bv{bv}_w{nw}" for bv, nw in shapes[b]]
        for v in c["variants"].values():
            assert v["status"] == "ok" and v["check"]["passed"] and v["time"]["median"] > 0 and v["gbps"] > 0
        assert c["best"] in c["variants"] and c["time"] == c["variants"][c["best"]]["time"]
        assert c["time"]["median"] == min(v["time"]["median"] for v in c["variants"].values())
    listed = [d for d in res["summary"]["goal_kda_decode"]["cases"] if "best" in d]
    assert [d["case"] for d in listed] == [c["name"] for c in sweeps.values()]


def test_peer_recorded_as_skipped(quick_run):
    _, res = quick_run
    assert res["peer"]["status"] == "skipped"
    assert all("peer" not in c for c in res["cases"])
    for p in res["summary"]["goal_kda_prefill"]["cases"]:
        assert p["ratio_ours_over_fla"] == {}


def test_time_budget_skips_and_records(kg, tmp_path):
    out = tmp_path / "b.json"
    kg.main(["--quick", "--interpret", "--skip-peer", "--time-budget", "0", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["cases"] and all(c["status"] == "skipped" for c in res["cases"])
    assert res["summary"]["skipped"] == [c["name"] for c in res["cases"]]
    assert not res["summary"]["all_checks_passed"]


def test_phases_filter_cases_and_merge(kg, tmp_path):
    """device_kernels.sh's shape: phases pick their cases by regex (each its own file), then one
    merge; a phase that left no file is named in the merged notes instead of failing the merge."""
    files = []
    for name, regex in (("a", "^check_kda_pool$"), ("b", "^kda_decode_pool_sweep_B")):
        files.append(tmp_path / f"{name}.json")
        kg.main(["--quick", "--interpret", "--skip-peer", "--cases", regex, "--out", str(files[-1])])
    merged = kg.main(["--out", str(tmp_path / "m.json"), "--merge", *map(str, files), str(tmp_path / "gone.json")])
    assert [(c["name"], c["run"]) for c in merged["cases"]] == [("check_kda_pool", 0), ("kda_decode_pool_sweep_B3", 1)]
    assert [r["cases_filter"] for r in merged["runs"]] == ["^check_kda_pool$", "^kda_decode_pool_sweep_B"]
    assert merged["notes"] == [f"no result file: {tmp_path / 'gone.json'}"]
    assert merged["summary"]["all_checks_passed"]
    assert [d["case"] for d in merged["summary"]["goal_kda_decode"]["cases"]] == ["kda_decode_pool_sweep_B3"]
    assert json.loads((tmp_path / "m.json").read_text())["cases"] == merged["cases"]


def test_device_phases_cover_every_case_once(kg):
    """benchmarks/device_kernels.sh: every case of the full plan falls in exactly one phase's regex (a
    case in none would silently never run on the lent GPU), each phase's watchdog fits its limit, and
    the phases' limits fit one device call (600 s at most) with time to install and merge."""
    import re

    sh = (SCRIPT.parent / "device_kernels.sh").read_text()
    phases = re.findall(r"^phase (\w+) \"\$\{\w+:-(\d+)\}\" (\d+) \\?\s*'([^']+)'", sh, re.M)
    assert [p[0] for p in phases] == ["decode", "prefill", "sweep", "fp32"]
    for name, _ in kg.plan(kg.config(False), None, False, None):
        assert len([p for p in phases if re.search(p[3], name)]) == 1, name
    assert all(int(case) < int(limit) for _, limit, case, _ in phases)
    assert sum(int(limit) for _, limit, _, _ in phases) <= 560
    assert "--merge" in sh and all(f"kernels-gpu-{p[0]}.json" in sh or "{decode,prefill,sweep,fp32}" in sh
                                   for p in phases)


def test_runner_records_exceptions(kg, tmp_path):
    result = dict(cases=[])
    runner = kg.Runner(result, [tmp_path / "r.json"], budget_s=1e9)

    def boom():
        raise NotImplementedError("no Pallas Triton lowering")

    runner.run("boom", boom)
    runner.run("fine", lambda: dict(op="x"))
    saved = json.loads((tmp_path / "r.json").read_text())
    assert [c["status"] for c in saved["cases"]] == ["error", "ok"]
    assert saved["cases"][0]["error"] == "NotImplementedError: no Pallas Triton lowering"


def test_check_fails_on_wrong_output(kg):
    ref = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    assert kg.check({"o": (ref * (1 + 1e-7), ref)}, "kda_f32")["passed"]
    assert not kg.check({"o": (ref * (1 + 1e-3), ref)}, "kda_f32")["passed"]
    bad = ref.copy()
    bad[0, 0] = np.nan
    assert not kg.check({"o": (bad, ref)}, "kda_f32")["passed"]


# ----------------------------------------------------------------------------------------
# the peer path with a pure-torch stand-in for fla
# ----------------------------------------------------------------------------------------
def _torch_kda(torch, decay=True):
    """fla-compatible ``(q,k,v,g,beta, scale, initial_state, output_final_state)`` token loop
    of KDA, [B,T,H,K] layout; ``decay=False`` is a deliberately wrong peer."""

    def fn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, **_):
        B, T, H, K = q.shape
        q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
        S = (initial_state.float().clone() if initial_state is not None
             else torch.zeros(B, H, K, v.shape[-1]))
        o = torch.empty(B, T, H, v.shape[-1])
        for t in range(T):
            if decay:
                S = S * g[:, t].exp()[..., None]
            u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
            S = S + k[:, t, :, :, None] * u[:, :, None, :]
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S)
        return o.to(v.dtype), (S if output_final_state else None)

    return fn


def _fake_peer(torch, decay=True):
    fn = _torch_kda(torch, decay)

    def pool_fwd(q, k, v, g, beta, scale, initial_state, inplace_final_state,
                 ssm_state_indices, **_):
        assert inplace_final_state
        idx = ssm_state_indices.long()
        o, S = fn(q, k, v, g, beta, scale=scale, initial_state=initial_state[idx],
                  output_final_state=True)
        initial_state[idx] = S
        return o, initial_state

    return SimpleNamespace(torch=torch, chunk_kda=fn, fused_recurrent_kda=fn,
                           pool_fwd=pool_fwd, device="cpu")


@pytest.mark.parametrize("decay", [True, False], ids=["correct", "wrong"])
def test_peer_prefill_path(kg, decay):
    torch = pytest.importorskip("torch")
    from pallas_kernels.kda import chunk_kda

    K = 8
    x, S0 = kg.kda_case(3, 1, 20, 2, K, 1)
    o, s = chunk_kda(*x, initial_state=S0, output_final_state=True, backend="reference")
    x_np = [np.asarray(a) for a in x]
    ref = (np.asarray(o), np.asarray(s))
    for variant, tol in (("fp32", 1e-5), ("bf16_safe_gate", 5e-2)):
        r = kg.peer_prefill(_fake_peer(torch, decay), x_np, np.asarray(S0), ref, variant,
                            scale=K ** -0.5, reps=2, target_s=1e-3)
        assert r["dtype"] == kg.PEER_PREFILL_VARIANTS[variant]["dtype"]
        assert r["check"]["passed"] == decay, (variant, r["check"])
        if decay:
            assert all(e["rel_l2"] < tol for e in r["check"]["tensors"].values()), variant
        assert r["time"]["median"] > 0 and r["time_events"]["median"] > 0


@pytest.mark.parametrize("decay", [True, False], ids=["correct", "wrong"])
def test_peer_decode_path(kg, decay):
    torch = pytest.importorskip("torch")
    from pallas_kernels.kda import fused_recurrent_kda_pool

    K, S = 8, 6
    x, pool = kg.kda_case(4, 3, 1, 2, K, S)
    slots = np.array([4, 0, 2], np.int32)
    ref = fused_recurrent_kda_pool(*x, pool, slots, backend="reference")
    res = kg.peer_decode(_fake_peer(torch, decay), [np.asarray(a) for a in x],
                         np.asarray(pool), slots, (np.asarray(ref[0]), np.asarray(ref[1])),
                         scale=K ** -0.5, reps=2, target_s=1e-3)
    for name in ("public", "pool_inplace"):
        assert res[name]["check"]["passed"] == decay, (name, res[name]["check"])
        if decay:
            assert all(e["rel_l2"] < 1e-5 for e in res[name]["check"]["tensors"].values())
        assert res[name]["time"]["median"] > 0


def test_summary_joins_the_forms_case_to_fla(kg):
    """The split / staged forms run as their own case; the summary joins them to the default kernel's
    case of the same shape and takes their ratios from its fla times (fla time / form time)."""
    main = dict(name="kda_prefill_H96_T8192", op="chunk_kda", status="ok", shape=dict(H=96, T=8192),
                time=dict(median=0.04), tokens_per_s=8192 / 0.04, check=dict(passed=True), dot_precision="tf32x3",
                peer=dict(fp32=dict(time=dict(median=0.004), ratio_ours_over_peer=0.1)), dot_precision_variants={})
    forms = dict(name="kda_prefill_forms_H96_T8192", op="chunk_kda_forms", status="ok", shape=dict(H=96, T=8192),
                 time=dict(median=0.005), check=dict(passed=True), staged_parts=dict(loop=0.003),
                 form_variants=dict(staged=dict(time=dict(median=0.005), tokens_per_s=8192 / 0.005,
                                                check=dict(passed=True)),
                                    split=dict(status="error", error="launch failed")))
    prepk = dict(name="kda_prefill_prepk_H96_T8192", op="chunk_kda_forms", status="ok", shape=dict(H=96, T=8192),
                 time=dict(median=0.01), check=dict(passed=True), staged_parts=dict(prep_kernels=0.002),
                 form_variants=dict(staged_pk=dict(time=dict(median=0.01), tokens_per_s=8192 / 0.01,
                                                   check=dict(passed=True))))
    p = kg.summarize([main, forms, prepk])["goal_kda_prefill"]["cases"]
    assert len(p) == 1 and p[0]["staged_parts"] == {"loop": 0.003, "prep_kernels": 0.002}
    assert set(p[0]["form_variants"]) == {"staged", "split", "staged_pk"}
    assert math.isclose(p[0]["form_variants"]["staged_pk"]["ratio_ours_over_fla"]["fp32"], 0.4)
    assert math.isclose(p[0]["form_variants"]["staged"]["ratio_ours_over_fla"]["fp32"], 0.8)
    assert p[0]["form_variants"]["split"]["error"] == "launch failed"
    assert p[0]["fastest"]["variant"] == "staged" and p[0]["fastest"]["met"] == {"fp32": True}
    assert "ratio_ours_over_peer" not in forms["form_variants"]["staged"]   # the case itself is left as recorded
