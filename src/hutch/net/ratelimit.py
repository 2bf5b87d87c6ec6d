"""Per-sandbox rate limits for the data path: token buckets keyed by the sender.

The resolver and the proxy ask :meth:`KeyedLimiter.allow` once per DNS query or new
connection, with the sender's address as the key, *before* they parse anything: a
refused one costs a dict lookup and a little arithmetic. Refusals are only counted
here; :meth:`KeyedLimiter.take_refused` hands the counts over (:mod:`hutch.net.enforcer`
turns them into one summary line per sandbox and second in the egress log, never one
line per packet).

The kernel has its own ceiling at twice these rates (:mod:`hutch.net.nft`), so a flood
past that never reaches Python at all.

Not thread-safe: a limiter is used from the one event loop that runs its server.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from hutch.errors import InvalidArgument

__all__ = ["MAX_KEYS", "KeyedLimiter", "Rate"]

#: Buckets kept at most; past it the idle ones (full again) are forgotten. Senders are
#: sandbox addresses, so this is only reached by packets from elsewhere.
MAX_KEYS = 4096


@dataclass(frozen=True)
class Rate:
    """``per_second`` tokens flow in, at most ``burst`` are kept; one event takes one."""

    per_second: float
    burst: int

    def __post_init__(self) -> None:
        if not self.per_second > 0:
            raise InvalidArgument(f"a rate must be > 0 per second, got {self.per_second}")
        if self.burst < 1:
            raise InvalidArgument(f"a burst must be >= 1, got {self.burst}")

    def __str__(self) -> str:
        return f"{self.per_second:g}/s, burst {self.burst}"


class KeyedLimiter:
    """One token bucket per key (a sandbox's address), created full on first use.

    ``clock`` is monotonic seconds (replaceable in tests)."""

    def __init__(self, rate: Rate, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self._clock = clock
        # key -> [tokens, last refill time]
        self._buckets: dict[str, list[float]] = {}
        self._refused: dict[str, int] = {}

    def allow(self, key: str) -> bool:
        """Take a token for ``key``: True if there was one, else False (and counted)."""
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= MAX_KEYS:
                self._forget_idle(now)
            bucket = self._buckets[key] = [float(self.rate.burst), now]
        else:
            tokens = bucket[0] + (now - bucket[1]) * self.rate.per_second
            bucket[0] = min(float(self.rate.burst), tokens)
            bucket[1] = now
        if bucket[0] >= 1.0:
            bucket[0] -= 1.0
            return True
        self._refused[key] = self._refused.get(key, 0) + 1
        return False

    def refuse(self, key: str) -> None:
        """Count a refusal made for another reason (e.g. too many in flight)."""
        self._refused[key] = self._refused.get(key, 0) + 1

    def take_refused(self) -> dict[str, int]:
        """Refusals per key since the last call (keys with none are left out)."""
        refused, self._refused = self._refused, {}
        return refused

    def _forget_idle(self, now: float) -> None:
        full = float(self.rate.burst)
        idle = [
            key
            for key, (tokens, last) in self._buckets.items()
            if tokens + (now - last) * self.rate.per_second >= full
        ]
        for key in idle:
            del self._buckets[key]
        if len(self._buckets) >= MAX_KEYS:
            # Every sender is busy (a spray from many addresses): start over rather
            # than grow. The worst this does is give each sender a fresh burst.
            self._buckets.clear()
