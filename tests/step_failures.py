"""Running an engine to the end through `StepFailed`: what tests of failing requests collect."""

from __future__ import annotations

from serve.engine import StepFailed


def drain_through_failures(engine) -> tuple[list[StepFailed], dict]:
    """Step until nothing is unfinished -> (every StepFailed raised, finished outputs by request id, those a
    StepFailed carried included)."""
    failures, done = [], {}
    while engine.has_unfinished():
        try:
            outs = engine.step()
        except StepFailed as e:
            failures.append(e)
            outs = e.outputs
        done.update({o.request_id: o for o in outs if o.finished})
    return failures, done
