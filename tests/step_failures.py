"""Running an engine to the end through `StepFailed`: what tests of failing requests collect."""

from __future__ import annotations

from serve.engine import StepFailed


class FailingPrefill:
    """An engine's compiled step that raises once, at the first prefill launched in a step that decoded first
    (`engine._step = FailingPrefill(engine)`; put `.real` back after)."""

    def __init__(self, engine):
        self.engine, self.real, self.decoded_in, self.failed = engine, engine._step, None, False
        self._cache_size = self.real._cache_size

    def __call__(self, leaves, arena, token_pages, tables, batch):
        step, prefill = self.engine.counters["steps"], batch.tokens.shape[1] > 1
        if not self.failed and prefill and self.decoded_in == step:
            self.failed = True
            raise RuntimeError("injected device failure")
        if not prefill:
            self.decoded_in = step
        return self.real(leaves, arena, token_pages, tables, batch)


def drain_through_failures(engine, max_steps: int = 100_000) -> tuple[list[StepFailed], dict]:
    """Step until nothing is unfinished -> (every StepFailed raised, finished outputs by request id, those a
    StepFailed carried included). More than `max_steps` steps: an AssertionError (a request that never ends)."""
    failures, done = [], {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        try:
            outs = engine.step()
        except StepFailed as e:
            failures.append(e)
            outs = e.outputs
        done.update({o.request_id: o for o in outs if o.finished})
    assert not engine.has_unfinished(), f"still unfinished after {max_steps} steps"
    return failures, done


class LoopSurface:
    """The surface of an engine the AsyncEngine's thread drives, for stand-ins: nothing in flight, idle passes
    that do nothing; `abort` frees a request the stand-in keeps in `requests`."""

    held, tokenizer = False, None

    def __init__(self):
        self.requests = {}

    def has_unfinished(self):
        return False

    def idle(self):
        pass

    def abort(self, rid):
        return self.requests.pop(rid, None) is not None

    def _reap(self):
        pass

    def close(self):
        pass
