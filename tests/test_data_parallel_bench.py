"""benchmarks/data_parallel.py: its two simulated devices also when XLA_FLAGS already holds other flags."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_two_devices_beside_other_xla_flags():
    env = dict(os.environ, XLA_FLAGS="--xla_cpu_enable_fast_math=false", PYTHONPATH=str(REPO))
    env.pop("JAX_PLATFORMS", None)
    code = "import data_parallel, jax; print(len(jax.devices()), jax.default_backend())"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO / "benchmarks", env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["2", "cpu"]
