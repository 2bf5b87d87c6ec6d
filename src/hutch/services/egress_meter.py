"""Egress into the meter and the event log: what the network layer counted (bytes sent out
and denied, denials) becomes meter rows and ``egress.denied`` events.

The network layer tallies per sandbox (:class:`hutch.net.egress_log.EgressLog`: nft's
byte counters, read every 2 s, and the proxy's relayed bytes); :meth:`EgressMeter.flush_bytes`
takes the tally (every ``HUTCH_METER_HEARTBEAT_S``, from the reaper) and writes it in one
transaction: per sandbox an ``egress`` and an ``egress_denied`` row (counted kinds of
:mod:`hutch.services.metering`), grown in place for up to ``COUNTED_ROW_S`` so that a
busy sandbox costs a row a minute, not one per flush. :meth:`EgressMeter.flush_denials`
(every ``HUTCH_EGRESS_EVENT_S``) writes one ``egress.denied`` event per sandbox that was
denied anything in that time: counts, bytes, the top destinations and whether a denial
spike fired. A flood is the same one event as a single denial.

Exactness: the nft table is made anew when the daemon starts, so its counters start at
zero with the tally; a byte is taken once and written once. What a daemon killed with
SIGKILL had counted but not written yet (at most one heartbeat plus one counter poll) is
lost, never counted twice.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from typing import Any, Protocol

from hutch.errors import HutchError
from hutch.net.egress_log import DenialTally
from hutch.services.events import EventLog
from hutch.services.metering import COUNTED_ROW_S
from hutch.store import Store
from hutch.store.meter_sql import add_amount_in, grow_amount_in

__all__ = ["EgressMeter", "EgressSource"]

log = logging.getLogger(__name__)


class EgressSource(Protocol):
    """What the network layer hands over (the enforcer)."""

    def take_bytes(self) -> dict[str, tuple[int, int]]: ...

    def take_denials(self) -> dict[str, DenialTally]: ...

    def add_back(self, sandbox_id: str, sent: int, denied: int) -> None: ...


def _day(at: float) -> dt.date:
    return dt.datetime.fromtimestamp(at, dt.UTC).date()


class EgressMeter:
    def __init__(
        self,
        store: Store,
        events: EventLog,
        source: Callable[[], EgressSource | None],
        clock: Callable[[], float],
    ) -> None:
        """``source()``: the network layer, or None (no networking: nothing to meter)."""
        self.store = store
        self.events = events
        self.source = source
        self.clock = clock
        # (sandbox, kind) -> (row id, started_at) of the row the next amount grows.
        self._rows: dict[tuple[str, str], tuple[int, float]] = {}
        self._denials_at: float | None = None

    def flush_bytes(self) -> None:
        """Write the bytes counted since the last flush. On a database error they are
        handed back to the tally (the next flush writes them)."""
        src = self.source()
        if src is None:
            return
        taken = src.take_bytes()
        if not taken:
            return
        at = self.clock()
        projects = {sid: self._project(sid) for sid in taken}
        rows = dict(self._rows)
        try:
            with self.store.transaction() as db:
                for sid, (sent, denied) in taken.items():
                    project = projects[sid]
                    if project is None:
                        continue  # no such sandbox (never had a row): nothing to bill
                    for kind, amount in (("egress", sent), ("egress_denied", denied)):
                        if amount:
                            self._add(db, rows, project, sid, kind, amount, at)
        except HutchError as exc:
            log.error("egress meter: %d sandboxes' bytes not written yet: %s", len(taken), exc)
            for sid, (sent, denied) in taken.items():
                src.add_back(sid, sent, denied)
            return
        self._rows = {k: v for k, v in rows.items() if at - v[1] < COUNTED_ROW_S}

    def _add(
        self,
        db: Any,
        rows: dict[tuple[str, str], tuple[int, float]],
        project: str,
        sid: str,
        kind: str,
        amount: int,
        at: float,
    ) -> None:
        held = rows.get((sid, kind))
        fresh = held is not None and at - held[1] < COUNTED_ROW_S and _day(held[1]) == _day(at)
        if held is not None and fresh and grow_amount_in(db, held[0], amount, at):
            return
        rows[(sid, kind)] = (add_amount_in(db, project, sid, kind, amount, at), at)

    def flush_denials(self, every_s: float, *, force: bool = False) -> None:
        """Every ``every_s`` (called more often: it waits its turn; the first call starts
        the first interval), one ``egress.denied`` event per sandbox denied anything
        since the last, in one transaction. ``force``: now (the daemon is stopping)."""
        now = self.clock()
        if self._denials_at is None and not force:
            self._denials_at = now
            return
        if not force and self._denials_at is not None and now - self._denials_at < every_s:
            return
        window = now - self._denials_at if self._denials_at is not None else None
        self._denials_at = now
        src = self.source()
        if src is None:
            return
        taken = src.take_denials()
        if not taken:
            return
        try:
            with self.store.transaction() as db:
                for sid, tally in taken.items():
                    project = self._project(sid)
                    if project is None:
                        continue
                    self.events.record_in(
                        db,
                        "egress.denied",
                        project=project,
                        sandbox_id=sid,
                        data=_denial_data(tally, window),
                    )
        except HutchError as exc:
            log.error("egress.denied events of %d sandboxes lost: %s", len(taken), exc)

    def forget(self, sandbox_id: str) -> None:
        for kind in ("egress", "egress_denied"):
            self._rows.pop((sandbox_id, kind), None)

    def _project(self, sandbox_id: str) -> str | None:
        rec = self.store.get_sandbox(sandbox_id)
        return rec.project if rec is not None else None


def _denial_data(tally: DenialTally, window: float | None) -> dict[str, Any]:
    return {
        "denials": tally.denials,
        "bytes": tally.bytes,
        "window_s": round(window, 3) if window is not None else None,
        "spike": tally.spike,
        "top": [{"destination": d, "port": p, "reason": r, "count": n} for d, p, r, n in tally.top],
        "other": tally.other,
    }
