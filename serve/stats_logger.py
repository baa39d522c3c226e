"""A line of serving statistics every few seconds while the server works (vLLM's stats log).

`k3jax serve` prints, every `--log-stats-interval` seconds (default 10) while requests run or since the
last line something happened:

    [k3jax serve] prompt 1234.5 tokens/s, generation 456.7 tokens/s, running 8 reqs, waiting 2 reqs,
    cache 41.2% used, prefix cache hit rate 63.0%, drafts accepted 71.4%

Throughputs and rates are over the interval (deltas of the engine's counters), the rest is the state now;
an idle server prints nothing after its one line saying it went idle. `--disable-log-stats` turns it off.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Mapping, Optional

# the engine counters a line is made of (cumulative)
_COUNTERS = ("prompt_tokens", "generation_tokens", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def snapshot(stats: Mapping) -> dict:
    """The numbers a stats line needs from `Engine.stats()` (or merged data-parallel stats). A disaggregated
    pair's requests run on its prefill engine, then on its decode engine: running and waiting count both, so
    the line does not show an idle server (and go quiet) while prompts prefill."""
    pc = stats.get("prefix_cache") or {}
    pre = stats.get("prefill_engine") or {}
    snap = {k: float(stats.get(k, 0) or 0) for k in _COUNTERS}
    snap.update(query_tokens=float(pc.get("query_tokens", 0) or 0), hit_tokens=float(pc.get("hit_tokens", 0) or 0),
                running=sum(int(s.get("num_requests_running", 0) or 0) for s in (stats, pre)),
                waiting=sum(int(s.get("num_requests_waiting", 0) or 0) for s in (stats, pre)),
                usage=float(stats.get("kv_cache_usage", 0.0) or 0.0))
    return snap


def busy(prev: Mapping, cur: Mapping) -> bool:
    """Whether anything ran between the two snapshots or is running now."""
    return bool(cur["running"] or cur["waiting"] or any(cur[k] != prev[k] for k in _COUNTERS + ("query_tokens",)))


def stats_line(prev: Mapping, cur: Mapping, seconds: float) -> str:
    """One line from two snapshots `seconds` apart."""
    dt = max(seconds, 1e-9)
    queries = cur["query_tokens"] - prev["query_tokens"]
    hits = cur["hit_tokens"] - prev["hit_tokens"]
    parts = [f"prompt {(cur['prompt_tokens'] - prev['prompt_tokens']) / dt:.1f} tokens/s",
             f"generation {(cur['generation_tokens'] - prev['generation_tokens']) / dt:.1f} tokens/s",
             f"running {cur['running']} reqs", f"waiting {cur['waiting']} reqs", f"cache {100 * cur['usage']:.1f}% used",
             f"prefix cache hit rate {100 * hits / queries:.1f}%" if queries else "prefix cache hit rate -"]
    drafted = cur["spec_decode_num_draft_tokens"] - prev["spec_decode_num_draft_tokens"]
    if drafted:
        accepted = cur["spec_decode_num_accepted_tokens"] - prev["spec_decode_num_accepted_tokens"]
        parts.append(f"drafts accepted {100 * accepted / drafted:.1f}%")
    return ", ".join(parts)


class StatsLogger:
    """A daemon thread saying `stats_line` every `interval_s` seconds while the server is busy.

    stats: returns the engine's statistics (may return {} while there is no engine); say: prints a line.
    """

    def __init__(self, stats: Callable[[], Mapping], say: Callable[[str], None], interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        if not 0 < interval_s <= threading.TIMEOUT_MAX:  # (a longer wait raises OverflowError in the thread)
            raise ValueError(f"--log-stats-interval: expected seconds > 0 and at most {threading.TIMEOUT_MAX:g}, "
                             f"got {interval_s}")
        self.stats, self.say, self.interval_s, self.clock = stats, say, float(interval_s), clock
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._prev: Optional[dict] = None
        self._prev_t = 0.0
        self._was_busy = False

    def tick(self) -> Optional[str]:
        """Read the statistics once -> the line said, or None (idle, or the first reading)."""
        stats = self.stats()
        if not stats:
            return None
        cur, now = snapshot(stats), self.clock()
        prev, prev_t, self._prev, self._prev_t = self._prev, self._prev_t, cur, now
        if prev is None:
            return None
        if busy(prev, cur):
            self._was_busy = True
            line = stats_line(prev, cur, now - prev_t)
        elif self._was_busy:  # one line on going idle, then quiet
            self._was_busy = False
            line = stats_line(prev, cur, now - prev_t) + " (idle)"
        else:
            return None
        self.say(line)
        return line

    def start(self) -> "StatsLogger":
        self._thread = threading.Thread(target=self._run, name="k3jax-stats", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        self.tick()  # the baseline
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception as e:  # never let a statistics hiccup end the thread
                self.say(f"stats: {type(e).__name__}: {e}")
