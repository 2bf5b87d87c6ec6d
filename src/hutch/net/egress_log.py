"""Per-sandbox egress decisions: a bounded ring of recent events plus counters.

Fed by the resolver, the proxy and NFLOG denials (all in the data path's thread, see
:mod:`hutch.net.datapath`); read by ``GET .../egress/log`` and ``GET .../egress`` (the
API's loop). One lock guards it: every call is a few dict/deque operations. In memory
only: it starts empty when the daemon starts.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from hutch.contract.limits import EGRESS_LOG_MAX
from hutch.contract.views import EgressEvent

__all__ = ["DEFAULT_CAPACITY", "EgressLog"]

#: What ``GET .../egress/log`` can return at most (the contract's EGRESS_LOG_MAX).
DEFAULT_CAPACITY = EGRESS_LOG_MAX


@dataclass
class _SandboxLog:
    events: deque[EgressEvent]
    allowed: int = 0
    denied: int = 0
    rate_limited: int = 0


@dataclass
class EgressLog:
    """``capacity`` events are kept per sandbox (oldest dropped first); the counters count
    every event ever recorded for the sandbox, dropped or not."""

    capacity: int = DEFAULT_CAPACITY
    _logs: dict[str, _SandboxLog] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"EgressLog capacity must be >= 1, got {self.capacity}")

    def record(self, event: EgressEvent, *, count: bool = True) -> None:
        """Keep ``event``; ``count=False`` when what it reports is counted elsewhere (an
        NFLOG denial: the nft counter has it; a summary of many packets)."""
        with self._lock:
            log = self._get(event.sandbox_id)
            log.events.append(event)
            if count and event.verdict == "allow":
                log.allowed += 1
            elif count:
                log.denied += 1

    def add_rate_limited(self, sandbox_id: str, count: int) -> None:
        """Count ``count`` queries/connections refused by the daemon's rate limiter."""
        with self._lock:
            self._get(sandbox_id).rate_limited += count

    def rate_limited(self, sandbox_id: str) -> int:
        with self._lock:
            log = self._logs.get(sandbox_id)
            return 0 if log is None else log.rate_limited

    def _get(self, sandbox_id: str) -> _SandboxLog:
        log = self._logs.get(sandbox_id)
        if log is None:
            log = self._logs[sandbox_id] = _SandboxLog(deque(maxlen=self.capacity))
        return log

    def events(self, sandbox_id: str, limit: int | None = None) -> list[EgressEvent]:
        """The newest ``limit`` events (all kept if None), oldest first / newest last."""
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        with self._lock:
            log = self._logs.get(sandbox_id)
            if log is None or limit == 0:
                return []
            items = list(log.events)
        return items if limit is None or limit >= len(items) else items[-limit:]

    def counters(self, sandbox_id: str) -> tuple[int, int]:
        """(allowed, denied) since the daemon started or the sandbox was forgotten."""
        with self._lock:
            log = self._logs.get(sandbox_id)
            return (0, 0) if log is None else (log.allowed, log.denied)

    def forget(self, sandbox_id: str) -> None:
        """Drop everything about a sandbox (on delete). Safe to call twice."""
        with self._lock:
            self._logs.pop(sandbox_id, None)
