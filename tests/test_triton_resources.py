"""benchmarks/triton_resources.py without Triton: the capture step (JAX's Pallas Triton lowering, hooked)
and the reading of cuobjdump's resource line. Compiling needs the triton package (a side venv)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_resources.py"


@pytest.fixture(scope="module")
def tr():
    spec = importlib.util.spec_from_file_location("triton_resources_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_capture_keeps_each_kernels_triton_ir(tr, tmp_path):
    """Each configuration's kernel IR is written with its warps; the IR is Triton's (a tt.func whose
    pointer arguments are the kernel's operands), and the hook is removed afterwards."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    before = reg.lowering.lower_jaxpr_to_triton_module
    rows = tr.capture(tmp_path, only="kda_decode_pool/bv16")
    assert reg.lowering.lower_jaxpr_to_triton_module is before
    assert [(r["config"], r["num_warps"], r["num_stages"]) for r in rows] == [
        ("kda_decode_pool/bv16/w1", 1, 1), ("kda_decode_pool/bv16/w2", 2, 1)]
    assert json.loads((tmp_path / "manifest.json").read_text()) == rows
    for r in rows:
        ir = (tmp_path / r["ir"]).read_text()
        assert '"tt.func"' in ir and "sym_name = \"kda_scan_gpu\"" in ir and "!tt.ptr<f32>" in ir
    assert len({(tmp_path / r["ir"]).read_text() for r in rows}) == 1  # warps are a compile option, not IR
    names = [f"{c[0]}/w{c[1]}" for c in tr.configs()]
    assert len(names) == len(set(names))  # every configuration named apart
    assert set(tr.CALIBRATION) <= set(names)
    # an op of several kernels: each configuration keeps the one it names (`pick`)
    for r in tr.capture(tmp_path, only="kda_chunk_prep_"):
        part = r["config"].split("/")[0].removeprefix("kda_chunk_prep_")
        assert f'sym_name = "kda_chunk_prep_{part}_gpu"' in (tmp_path / r["ir"]).read_text(), r["config"]


def test_resource_line_is_read(tr):
    text = ("\nResource usage:\n Common:\n  GLOBAL:0\n Function kda_scan_gpu:\n"
            "  REG:255 STACK:1440 SHARED:1024 LOCAL:0 CONSTANT[0]:640 TEXTURE:0 SURFACE:0 SAMPLER:0\n")
    assert tr.resource_usage(text) == dict(registers=255, stack_bytes=1440)
    with pytest.raises(ValueError, match="one kernel"):
        tr.resource_usage(text + text)
