"""Summary lines in a sandbox's egress log for what is counted but not logged one by one:
queries and connections the rate limits refused, and denials past the log budget.

:mod:`hutch.net.enforcer` calls :meth:`Summaries.take_refused` with the limiters' counts
every second and :meth:`Summaries.kernel` with the nft counters every poll, so a flood
costs the log at most one line per sandbox, kind and tick, whatever the packet rate. The
counts themselves go to the counters (``rate_limited``, ``log_dropped`` in
``GET .../egress``), exact; the line says how many and why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from ipaddress import IPv4Address
from typing import Literal

from hutch.config import NetLimits
from hutch.contract.views import EgressEvent
from hutch.net.dns import SandboxNet
from hutch.net.egress_log import EgressLog
from hutch.net.nft import KERNEL_CEILING
from hutch.net.nft_apply import SandboxCounters
from hutch.net.ratelimit import KeyedLimiter

__all__ = ["LimiterKind", "Summaries"]

LimiterKind = Literal["dns", "proxy"]


class Summaries:
    """See the module docstring. ``clock`` gives the events' UNIX time."""

    def __init__(
        self, log: EgressLog, limits: NetLimits, clock: Callable[[], float] = time.time
    ) -> None:
        self._log = log
        self._limits = limits
        self._clock = clock
        self._last: dict[str, SandboxCounters] = {}
        self._last_time: float | None = None

    def take_refused(
        self,
        limiters: Iterable[tuple[LimiterKind, KeyedLimiter | None]],
        lookup: Callable[[IPv4Address], SandboxNet | None],
        window_s: float,
    ) -> None:
        """Take each limiter's refusals (keyed by sender address) and note them for the
        sandbox ``lookup`` finds behind each sender; other senders have no log."""
        for kind, limiter in limiters:
            if limiter is None:
                continue
            for source, count in limiter.take_refused().items():
                try:
                    sandbox = lookup(IPv4Address(source))
                except ValueError:
                    sandbox = None
                if sandbox is not None:
                    self.refused(sandbox.sandbox_id, kind, count, window_s)

    def refused(self, sandbox_id: str, kind: LimiterKind, count: int, window_s: float) -> None:
        """``count`` queries (``dns``) or new proxy connections (``proxy``) of
        ``sandbox_id`` were refused by the daemon's limiter in the last ``window_s``."""
        if count <= 0:
            return
        lim = self._limits
        if kind == "dns":
            what = f"{count} DNS queries answered REFUSED"
            rate, port, proto = f"{lim.dns_rate}/s, burst {lim.dns_burst}", 53, "dns"
        else:
            what = f"{count} new proxy connections closed"
            rate = f"{lim.proxy_conn_rate}/s, burst {lim.proxy_conn_burst}"
            port, proto = None, "tcp"
        self._log.add_rate_limited(sandbox_id, count)
        reason = f"rate-limited: {what} in the last {window_s:.0f} s (limit {rate} per sandbox)"
        self._note(sandbox_id, port, proto, reason)

    def kernel(self, counters: Mapping[str, SandboxCounters]) -> None:
        """The nft counters as just read: one line per sandbox whose kernel-dropped or
        unlogged count grew since the last call. Sandboxes not in ``counters`` (gone)
        are forgotten."""
        now = time.monotonic()
        window = now - self._last_time if self._last_time is not None else 0.0
        self._last_time = now
        lim, k = self._limits, KERNEL_CEILING
        since = f" in the last {window:.0f} s" if window else ""
        for sid, current in counters.items():
            previous = self._last.get(sid, SandboxCounters(0, 0))
            limited = _grew(previous.rate_limited, current.rate_limited)
            unlogged = _grew(previous.unlogged, current.unlogged)
            if limited:
                self._note(
                    sid,
                    None,
                    "kernel",
                    f"rate-limited: {limited} DNS packets or new resolver/proxy connections "
                    f"dropped by the kernel{since} (past {k * lim.dns_rate} DNS packets/s or "
                    f"{k * lim.proxy_conn_rate} connections/s per sandbox)",
                )
            if unlogged:
                self._note(
                    sid,
                    None,
                    "log",
                    f"{unlogged} denied packets not logged one by one{since} (past the log "
                    f"budget of {lim.deny_log_rate}/s, burst {lim.deny_log_burst} per "
                    "sandbox); the denied counter includes them",
                )
        self._last = dict(counters)

    def _note(self, sid: str, port: int | None, protocol: str, reason: str) -> None:
        event = EgressEvent(self._clock(), sid, "-", port, protocol, None, "deny", None, reason)
        # Counted already (limiter counts, nft counters): a line, not another denial.
        self._log.record(event, count=False)


def _grew(before: int, now: int) -> int:
    """How much a counter grew (a counter that went down was re-created: all of it)."""
    return now - before if now >= before else now
