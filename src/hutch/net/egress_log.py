"""Per-sandbox egress decisions: a bounded ring of recent events plus counters.

Fed by the resolver, the proxy and NFLOG denials (all in the data path's thread, see
:mod:`hutch.net.datapath`); read by ``GET .../egress/log`` and ``GET .../egress`` (the
API's loop). One lock guards it: every call is a few dict/deque operations. In memory
only: it starts empty when the daemon starts.

It also keeps, per sandbox, the decisions each rule of an ordered policy made (by rule
index: ``EgressEvent.rule_index``) and watches for *denial spikes*: when the counted
denials of one sandbox in the current minute (a fixed window) reach ``spike_per_min``,
``on_spike`` is called once for that minute, in the recording thread and outside the
lock (so it must be short: append to an event log, log a line).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hutch.contract.limits import EGRESS_LOG_MAX
from hutch.contract.views import DenialSpike, EgressEvent, RuleCount

__all__ = ["DEFAULT_CAPACITY", "SPIKE_WINDOW_S", "EgressLog"]

#: The denial-spike window, in seconds (fixed windows: minute 0, 1, 2, ...).
SPIKE_WINDOW_S = 60

#: What ``GET .../egress/log`` can return at most (the contract's EGRESS_LOG_MAX).
DEFAULT_CAPACITY = EGRESS_LOG_MAX


@dataclass
class _SandboxLog:
    events: deque[EgressEvent]
    allowed: int = 0
    denied: int = 0
    rate_limited: int = 0
    #: rule index -> [allowed, denied]
    rules: dict[int, list[int]] = field(default_factory=dict)
    window: int = -1  # the spike window the count below is for
    window_denials: int = 0
    spiked: bool = False


@dataclass
class EgressLog:
    """``capacity`` events are kept per sandbox (oldest dropped first); the counters count
    every event ever recorded for the sandbox, dropped or not."""

    capacity: int = DEFAULT_CAPACITY
    #: Denials per minute per sandbox that make a spike (None: no spike watch).
    spike_per_min: int | None = None
    on_spike: Callable[[DenialSpike], None] | None = None
    clock: Callable[[], float] = time.time
    _logs: dict[str, _SandboxLog] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"EgressLog capacity must be >= 1, got {self.capacity}")

    def record(self, event: EgressEvent, *, count: bool = True) -> None:
        """Keep ``event``; ``count=False`` when what it reports is counted elsewhere (an
        NFLOG denial: the nft counter has it; a summary of many packets)."""
        spike: DenialSpike | None = None
        with self._lock:
            log = self._get(event.sandbox_id)
            log.events.append(event)
            if count and event.verdict == "allow":
                log.allowed += 1
            elif count:
                log.denied += 1
                spike = self._watch(log, event)
            if count and event.rule_index is not None:
                pair = log.rules.setdefault(event.rule_index, [0, 0])
                pair[0 if event.verdict == "allow" else 1] += 1
        if spike is not None:
            self._spiked(spike)

    def _watch(self, log: _SandboxLog, event: EgressEvent) -> DenialSpike | None:
        """Count a denial in its minute; the spike when this one reaches the threshold."""
        if self.spike_per_min is None:
            return None
        now = self.clock()
        window = int(now // SPIKE_WINDOW_S)
        if window != log.window:
            log.window, log.window_denials, log.spiked = window, 0, False
        log.window_denials += 1
        if log.spiked or log.window_denials < self.spike_per_min:
            return None
        log.spiked = True
        return DenialSpike(now, event.sandbox_id, log.window_denials, self.spike_per_min, event)

    def _spiked(self, spike: DenialSpike) -> None:
        summary = EgressEvent(
            spike.time, spike.sandbox_id, "-", None, "summary", None, "deny", None,
            f"denial spike: {spike.denials} denials this minute (threshold "
            f"{spike.threshold}); the last: {spike.last.destination} ({spike.last.reason})",
        )  # fmt: skip
        with self._lock:
            self._get(spike.sandbox_id).events.append(summary)
        if self.on_spike is not None:
            self.on_spike(spike)

    def rule_counts(self, sandbox_id: str) -> tuple[RuleCount, ...]:
        """Decisions per ordered-policy rule, by index."""
        with self._lock:
            log = self._logs.get(sandbox_id)
            if log is None:
                return ()
            return tuple(RuleCount(i, a, d) for i, (a, d) in sorted(log.rules.items()))

    def reset_rule_counts(self, sandbox_id: str) -> None:
        """A new policy: its rules count from zero (indexes mean other rules now)."""
        with self._lock:
            log = self._logs.get(sandbox_id)
            if log is not None:
                log.rules.clear()

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
