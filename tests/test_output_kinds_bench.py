"""benchmarks/output_kinds.py: it builds its long outputs through the engine's own `_append` (as decoding does)
and times both output kinds on them."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import output_kinds  # noqa: E402

from k3jax.runtime import load_model  # noqa: E402
from serve.types import RequestOutputKind  # noqa: E402


def test_rows_of_long_outputs_and_both_kinds_timed():
    e, rids = output_kinds.engine_with(2, 12, 2, load_model("tiny-k3"))
    for o in e._outputs(rids):  # (cumulative: every token so far, each with its logprob entry)
        (c,) = o.outputs
        assert len(c.token_ids) == 12 and len(c.logprobs) == 12 and len(c.text) == 12
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        assert len(output_kinds.time_outputs(e, rids, kind, 2)) == 2


def test_outputs_as_long_as_the_model_window_build(monkeypatch):
    """L = 4096 (the script's longest) needs max_model_len past tiny-k3's 4096 positions: the engine refuses that
    unless lifted, which crashed the script; the lift must not outlive the engine's construction."""
    monkeypatch.delenv("K3JAX_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    model = load_model("tiny-k3")
    e, rids = output_kinds.engine_with(1, model.cfg.max_position_embeddings, None, model)
    (o,) = e._outputs(rids)
    assert len(o.outputs[0].token_ids) == model.cfg.max_position_embeddings
    assert "K3JAX_ALLOW_LONG_MAX_MODEL_LEN" not in os.environ
