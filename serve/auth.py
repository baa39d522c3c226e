"""API keys and per-key rate limits for the HTTP server.

Keys are bearer tokens (`Authorization: Bearer KEY`). They come from

* the environment variable `K3JAX_API_KEYS` (comma-separated keys),
* `--api-key KEY` on the command line (vLLM's flag; repeat it for more keys), else vLLM's environment variable
  `VLLM_API_KEY` (one key), and/or
* a key file (`--api-key-file`): one key per line, optionally followed by per-key limits,
  `KEY [rpm=N] [tpm=N]`; blank lines and `#` comments (from a `#` at a line's start or after whitespace) are
  ignored.

With no keys configured the server is open (no 401s). Limits are a sliding 60-second window per key
(the anonymous caller when no keys are configured): `rpm` requests and `tpm` tokens per minute. A
request is charged `prompt tokens + max_tokens` (times `n`) when it is admitted, corrected to the
tokens it actually used when it finishes. Over a limit the caller gets 429 and `Retry-After` (whole
seconds until enough of the window has passed).
"""

from __future__ import annotations

import hmac
import math
import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

ENV_KEYS = "K3JAX_API_KEYS"
VLLM_ENV_KEY = "VLLM_API_KEY"  # vLLM's: one key, taken when no --api-key is given
WINDOW_S = 60.0
ANONYMOUS = ""
_COMMENT = re.compile(r"(?:^|\s)#")


@dataclass(frozen=True)
class Limits:
    rpm: Optional[int] = None  # requests per minute; None: unlimited
    tpm: Optional[int] = None  # tokens per minute; None: unlimited

    def __post_init__(self):
        for name in ("rpm", "tpm"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}: expected a positive integer, got {v!r}")


class RateLimited(Exception):
    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.message, self.retry_after = message, max(1, int(retry_after))


def parse_key_file(path: str) -> dict[str, Limits]:
    """`KEY [rpm=N] [tpm=N]` per line -> {key: Limits} (limits None where not given). A comment starts with a `#`
    that begins the line or follows whitespace (a `#` inside a key is the key's); a UTF-8 byte-order mark is
    skipped."""
    keys: dict[str, Limits] = {}
    with open(path, encoding="utf-8-sig") as f:
        for lineno, raw in enumerate(f, 1):
            line = _COMMENT.split(raw, 1)[0].strip()
            if not line:
                continue
            key, *opts = line.split()
            kw: dict[str, int] = {}
            for opt in opts:
                name, sep, value = opt.partition("=")
                if not sep or name not in ("rpm", "tpm"):
                    raise ValueError(f"{path}:{lineno}: expected 'KEY [rpm=N] [tpm=N]', got {opt!r}")
                try:
                    kw[name] = int(value)
                except ValueError:
                    raise ValueError(f"{path}:{lineno}: {name} must be an integer, got {value!r}") from None
            try:
                keys[key] = Limits(**kw)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
    if not keys:
        raise ValueError(f"{path}: no API keys in the file")
    return keys


def load_api_keys(key_file: Optional[str] = None, env: Optional[dict] = None,
                  given: Iterable[str] = ()) -> Optional[dict[str, Limits]]:
    """Keys from `K3JAX_API_KEYS`, `given` (`--api-key`; without it vLLM's `VLLM_API_KEY`, as vLLM takes it) and
    the key file (whose per-key limits win); None when none names any (open server)."""
    env = os.environ if env is None else env
    keys: dict[str, Limits] = {}
    given = tuple(given)
    if any(not k.strip() for k in given):
        raise ValueError("--api-key: an empty key")
    for k in [*(env.get(ENV_KEYS) or "").split(","), *(given or [env.get(VLLM_ENV_KEY) or ""])]:
        if k.strip():
            keys[k.strip()] = Limits()
    if key_file:
        try:
            keys.update(parse_key_file(key_file))
        except (OSError, UnicodeDecodeError) as e:  # a directory, no permission, not text
            raise ValueError(f"--api-key-file {key_file}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    return keys or None


class _Window:
    __slots__ = ("events",)

    def __init__(self):
        self.events: deque[list] = deque()  # [time, tokens]

    def prune(self, now: float) -> None:
        while self.events and now - self.events[0][0] >= WINDOW_S:
            self.events.popleft()


class Ticket:
    """One admitted request's charge; `settle(tokens)` replaces the reservation by the actual use."""

    def __init__(self, limiter: "RateLimiter", event: Optional[list]):
        self._limiter, self._event = limiter, event

    def settle(self, tokens: int) -> None:
        if self._event is not None:
            with self._limiter._lock:
                self._event[1] = max(0, int(tokens))
            self._event = None


class RateLimiter:
    def __init__(self, default: Limits = Limits(), per_key: Optional[dict[str, Limits]] = None):
        self.default = default
        self.per_key = dict(per_key or {})
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()

    def limits_for(self, key: str) -> Limits:
        own = self.per_key.get(key)
        if own is None:
            return self.default
        return Limits(own.rpm if own.rpm is not None else self.default.rpm,
                      own.tpm if own.tpm is not None else self.default.tpm)

    def admit(self, key: str, tokens: int, now: Optional[float] = None, charge: bool = True) -> Ticket:
        """Charge one request of `tokens` (reserved) to `key`, or raise `RateLimited`; `charge` False: only
        whether it would be admitted (the server asks with one token before a request's costly work)."""
        lim = self.limits_for(key)
        if lim.rpm is None and lim.tpm is None:
            return Ticket(self, None)
        now = time.monotonic() if now is None else now
        with self._lock:
            w = self._windows.setdefault(key, _Window())
            w.prune(now)
            if lim.rpm is not None and len(w.events) >= lim.rpm:
                wait = w.events[len(w.events) - lim.rpm][0] + WINDOW_S - now
                raise RateLimited(f"rate limit reached: {lim.rpm} requests per minute for this key; "
                                  f"retry in {math.ceil(wait)} s", math.ceil(wait))
            if lim.tpm is not None:
                if tokens > lim.tpm:
                    raise RateLimited(f"request of {tokens} tokens (prompt + max_tokens) exceeds this key's "
                                      f"limit of {lim.tpm} tokens per minute; lower max_tokens", math.ceil(WINDOW_S))
                used = sum(e[1] for e in w.events)
                if used + tokens > lim.tpm:
                    excess, wait = used + tokens - lim.tpm, WINDOW_S
                    for t, n in w.events:
                        excess -= n
                        if excess <= 0:
                            wait = t + WINDOW_S - now
                            break
                    needs = f", this request needs {tokens}" if charge else ""
                    raise RateLimited(f"rate limit reached: {lim.tpm} tokens per minute for this key "
                                      f"({used} used in the last minute{needs}); "
                                      f"retry in {math.ceil(wait)} s", math.ceil(wait))
            if not charge:
                return Ticket(self, None)
            event = [now, int(tokens)]
            w.events.append(event)
        return Ticket(self, event)


class KeyStore:
    """Constant-time bearer-token check; returns the key's identity (the key itself) or None."""

    def __init__(self, keys: Optional[Iterable[str]]):
        self._keys = [k.encode() for k in (keys or [])]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: Optional[str]) -> Optional[str]:
        if not self.enabled:
            return ANONYMOUS
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        tok = token.strip().encode()
        found = None
        for k in self._keys:  # no early exit: time does not depend on which key matched
            if hmac.compare_digest(k, tok):
                found = k
        return None if found is None else found.decode()
