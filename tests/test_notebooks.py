"""The research notebooks run top to bottom at toy size (their code cells, in order, in a fresh
interpreter; no Jupyter needed)."""

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def code_of(path: str) -> str:
    nb = json.load(open(path))
    assert nb["nbformat"] == 4, f"{path}: nbformat {nb['nbformat']}"
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(not c.get("outputs") for c in cells), f"{path}: commit notebooks without outputs"
    return "\n\n".join("".join(c["source"]) for c in cells)


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path):
    script = tmp_path / "notebook.py"
    script.write_text(code_of(path))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiles after warm-up: 0" in proc.stdout
