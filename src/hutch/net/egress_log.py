"""Per-sandbox egress decisions: a bounded ring of recent events plus counters.

Fed by the resolver, the proxy and NFLOG denials; read by ``GET .../egress/log`` and
``GET .../egress``. In memory only: it starts empty when the daemon starts. Not
thread-safe by design: everything that writes runs in the daemon's asyncio loop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hutch.contract.limits import EGRESS_LOG_MAX
from hutch.net.views import EgressEvent

__all__ = ["DEFAULT_CAPACITY", "EgressLog"]

#: What ``GET .../egress/log`` can return at most (the contract's EGRESS_LOG_MAX).
DEFAULT_CAPACITY = EGRESS_LOG_MAX


@dataclass
class _SandboxLog:
    events: deque[EgressEvent]
    allowed: int = 0
    denied: int = 0


@dataclass
class EgressLog:
    """``capacity`` events are kept per sandbox (oldest dropped first); the counters count
    every event ever recorded for the sandbox, dropped or not."""

    capacity: int = DEFAULT_CAPACITY
    _logs: dict[str, _SandboxLog] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"EgressLog capacity must be >= 1, got {self.capacity}")

    def record(self, event: EgressEvent) -> None:
        log = self._logs.get(event.sandbox_id)
        if log is None:
            log = self._logs[event.sandbox_id] = _SandboxLog(deque(maxlen=self.capacity))
        log.events.append(event)
        if event.verdict == "allow":
            log.allowed += 1
        else:
            log.denied += 1

    def events(self, sandbox_id: str, limit: int | None = None) -> list[EgressEvent]:
        """The newest ``limit`` events (all kept if None), oldest first / newest last."""
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        log = self._logs.get(sandbox_id)
        if log is None or limit == 0:
            return []
        items = list(log.events)
        return items if limit is None or limit >= len(items) else items[-limit:]

    def counters(self, sandbox_id: str) -> tuple[int, int]:
        """(allowed, denied) since the daemon started or the sandbox was forgotten."""
        log = self._logs.get(sandbox_id)
        return (0, 0) if log is None else (log.allowed, log.denied)

    def forget(self, sandbox_id: str) -> None:
        """Drop everything about a sandbox (on delete). Safe to call twice."""
        self._logs.pop(sandbox_id, None)
