"""Per-sandbox egress decisions: a bounded ring of recent events plus counters.

Fed by the resolver, the proxy and NFLOG denials (all in the data path's thread, see
:mod:`hutch.net.datapath`); read by ``GET .../egress/log`` and ``GET .../egress`` (the
API's loop). One lock guards it: every call is a few dict/deque operations. In memory
only: it starts empty when the daemon starts.

For the meter and the event log it tallies, per sandbox, what the last take left: bytes
sent out (nft forwarded + proxy relayed) and denied (:meth:`EgressLog.add_bytes`,
:meth:`EgressLog.take_bytes`), and the denials with a bounded sample of their
destinations (:meth:`EgressLog.take_denials`): whatever the packet rate, a take is one
entry per sandbox. A sandbox forgotten (deleted) keeps its tally until it is taken.

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

__all__ = ["DEFAULT_CAPACITY", "DENIAL_SAMPLE_KEYS", "SPIKE_WINDOW_S", "DenialTally", "EgressLog"]

#: The denial-spike window, in seconds (fixed windows: minute 0, 1, 2, ...).
SPIKE_WINDOW_S = 60

#: What ``GET .../egress/log`` can return at most (the contract's EGRESS_LOG_MAX).
DEFAULT_CAPACITY = EGRESS_LOG_MAX

#: Distinct (destination, port, reason) a denial tally keeps; the rest count as "other".
DENIAL_SAMPLE_KEYS = 32


@dataclass(frozen=True)
class DenialTally:
    """The denials of one sandbox since the last take: ``denials`` (packets dropped by
    nft, queries and connections refused by the resolver and the proxy), ``bytes`` (of
    the dropped packets), ``top`` the most frequent (destination, port, reason, count)
    of those logged one by one, ``other`` the logged ones past the sample's keys, and
    ``spike`` whether a denial spike fired meanwhile."""

    denials: int
    bytes: int
    top: tuple[tuple[str, int | None, str, int], ...]
    other: int
    spike: bool


@dataclass
class _Tally:
    sent: int = 0
    denied_bytes: int = 0  # until the next take_bytes
    denied_seen: int = 0  # until the next take_denials
    denials: int = 0
    sample: dict[tuple[str, int | None, str], int] = field(default_factory=dict)
    other: int = 0
    spike: bool = False

    @property
    def empty(self) -> bool:
        return not (
            self.sent or self.denied_bytes or self.denied_seen or self.denials
            or self.sample or self.other
        )  # fmt: skip

    def note(self, event: EgressEvent) -> None:
        key = (event.destination, event.port, event.reason)
        if key in self.sample or len(self.sample) < DENIAL_SAMPLE_KEYS:
            self.sample[key] = self.sample.get(key, 0) + 1
        else:
            self.other += 1


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
    _tallies: dict[str, _Tally] = field(default_factory=dict)
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
                self._tally(event.sandbox_id).denials += 1
                spike = self._watch(log, event)
            if event.verdict == "deny" and event.destination != "-":
                self._tally(event.sandbox_id).note(event)  # a denial, not a summary line
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
        self._tally(event.sandbox_id).spike = True
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

    # -- tallies for the meter and the event log -----------------------------------------

    def _tally(self, sandbox_id: str) -> _Tally:
        tally = self._tallies.get(sandbox_id)
        if tally is None:
            tally = self._tallies[sandbox_id] = _Tally()
        return tally

    def add_bytes(
        self, sandbox_id: str, *, sent: int = 0, denied: int = 0, denials: int = 0
    ) -> None:
        """``sent`` bytes went out for the sandbox (forwarded or relayed), ``denied``
        bytes of ``denials`` packets were dropped (counted by nft, not recorded here)."""
        if sent < 0 or denied < 0 or denials < 0:
            raise ValueError(f"negative tally: sent={sent} denied={denied} denials={denials}")
        if not (sent or denied or denials):
            return
        with self._lock:
            tally = self._tally(sandbox_id)
            tally.sent += sent
            tally.denied_bytes += denied
            tally.denied_seen += denied
            tally.denials += denials

    def take_bytes(self) -> dict[str, tuple[int, int]]:
        """(sent, denied) bytes per sandbox since the last take, and zero them."""
        out: dict[str, tuple[int, int]] = {}
        with self._lock:
            for sid, tally in list(self._tallies.items()):
                if tally.sent or tally.denied_bytes:
                    out[sid] = (tally.sent, tally.denied_bytes)
                    tally.sent = tally.denied_bytes = 0
                self._drop_if_empty(sid, tally)
        return out

    def take_denials(self) -> dict[str, DenialTally]:
        """The denials per sandbox since the last take (sandboxes with none left out),
        and zero them. ``bytes``: the denied bytes added since the last denial take (the
        meter takes them with :meth:`take_bytes`, apart)."""
        out: dict[str, DenialTally] = {}
        with self._lock:
            for sid, tally in list(self._tallies.items()):
                if tally.denials or tally.sample or tally.other:
                    ranked = sorted(tally.sample.items(), key=lambda kv: (-kv[1], str(kv[0])))
                    top = tuple((d, p, r, n) for (d, p, r), n in ranked[:5])
                    other = tally.other + sum(n for _, n in ranked[5:])
                    out[sid] = DenialTally(
                        tally.denials, tally.denied_seen, top, other, tally.spike
                    )
                    tally.denials, tally.sample, tally.other = 0, {}, 0
                    tally.spike, tally.denied_seen = False, 0
                self._drop_if_empty(sid, tally)
        return out

    def _drop_if_empty(self, sid: str, tally: _Tally) -> None:
        if sid not in self._logs and tally.empty:
            del self._tallies[sid]  # forgotten and nothing left to take

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
