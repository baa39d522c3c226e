"""Shared numeric assertions of the kernel tests (test_mla_paged.py, test_moe_gmm.py)."""
import numpy as np


def assert_close(out, ref, rtol=1e-5):
    """`out` finite and within `rtol` of `ref` (absolute floor: rtol x ref's largest magnitude), in float64."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol * np.abs(ref).max())
