"""The meter and the event log: SQL only (what is billed when, and what an event holds, is
decided in :mod:`hutch.services.metering` and :mod:`hutch.services.events`).

The ``*_in`` functions take the connection of a transaction already open (the state
writer's, so a state change, its meter intervals and its event commit together); the
methods of :class:`MeterStore` open their own.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hutch.store.db import Store
from hutch.store.meter_sql import (
    append_event_in,
    close_intervals_in,
    last_alive_in,
    open_interval_in,
)

__all__ = [
    "EventRow",
    "IntervalRow",
    "MeterStore",
    "append_event_in",
    "close_intervals_in",
    "last_alive_in",
    "open_interval_in",
]


@dataclass(frozen=True)
class EventRow:
    seq: int
    at: float
    project: str
    sandbox_id: str | None
    type: str
    actor: str | None
    source: str | None
    data: dict[str, Any]


@dataclass(frozen=True)
class IntervalRow:
    """``quantity`` units of ``kind`` held by ``subject`` from ``started_at`` to
    ``ended_at`` (None: still open; its VM last seen alive at ``alive_at``)."""

    project: str
    subject: str
    kind: str
    quantity: float
    started_at: float
    ended_at: float | None
    alive_at: float


_EVENT_COLUMNS = "seq, at, project, sandbox_id, type, actor, source, data_json"


def _event(r: tuple[Any, ...]) -> EventRow:
    seq, at, project, sandbox_id, type_, actor, source, data = r
    return EventRow(
        int(seq), float(at), project, sandbox_id, type_, actor, source, json.loads(data)
    )


class MeterStore:
    def __init__(self, store: Store) -> None:
        self._store = store

    # -- events --------------------------------------------------------------------------

    def append_event(self, **fields: Any) -> int:
        with self._store.transaction() as db:
            return append_event_in(db, **fields)

    def events(
        self,
        *,
        project: str | None,
        sandbox_id: str | None = None,
        types: Iterable[str] = (),
        after: int = 0,
        limit: int = 100,
    ) -> list[EventRow]:
        """Events with ``seq > after``, oldest first, at most ``limit``. ``project`` None:
        every project's. A type ending in ``.*`` matches its prefix (``sandbox.*``)."""
        clauses: list[str] = ["seq > ?"]
        params: list[Any] = [after]
        if project is not None:
            clauses.append("project = ?")
            params.append(project)
        if sandbox_id is not None:
            clauses.append("sandbox_id = ?")
            params.append(sandbox_id)
        exact = [t for t in types if not t.endswith(".*")]
        prefixes = [t[:-1] for t in types if t.endswith(".*")]
        alternatives = []
        if exact:
            alternatives.append(f"type IN ({', '.join('?' for _ in exact)})")
            params.extend(exact)
        for prefix in prefixes:
            alternatives.append("substr(type, 1, ?) = ?")
            params.extend([len(prefix), prefix])
        if alternatives:
            clauses.append("(" + " OR ".join(alternatives) + ")")
        query = (
            f"SELECT {_EVENT_COLUMNS} FROM events WHERE {' AND '.join(clauses)} "
            "ORDER BY seq LIMIT ?"
        )
        with self._store.transaction() as db:
            rows = db.execute(query, (*params, limit)).fetchall()
        return [_event(r) for r in rows]

    def prune_events(self, older_than: float, keep: int) -> int:
        """Drop events before ``older_than`` and all but the newest ``keep``; how many."""
        with self._store.transaction() as db:
            dropped = db.execute("DELETE FROM events WHERE at < ?", (older_than,)).rowcount
            top = db.execute("SELECT MAX(seq) FROM events").fetchone()[0]
            if top is not None:
                dropped += db.execute(
                    "DELETE FROM events WHERE seq <= ?", (int(top) - keep,)
                ).rowcount
        return int(dropped)

    # -- the meter -----------------------------------------------------------------------

    def heartbeat(self, subjects: Iterable[str], at: float) -> None:
        """The VMs of ``subjects`` are alive at ``at``: their open intervals say so."""
        wanted = list(subjects)
        if not wanted:
            return
        marks = ", ".join("?" for _ in wanted)
        with self._store.transaction() as db:
            db.execute(
                f"UPDATE meter SET alive_at = {db.dialect.greatest('alive_at', '?')} "
                f"WHERE ended_at IS NULL AND subject IN ({marks})",
                (at, *wanted),
            )

    def intervals(
        self, *, project: str | None, start: float, end: float, subject: str | None = None
    ) -> list[IntervalRow]:
        """Intervals that overlap [start, end) (open ones included)."""
        clauses = ["started_at < ?", "(ended_at IS NULL OR ended_at > ?)"]
        params: list[Any] = [end, start]
        if project is not None:
            clauses.append("project = ?")
            params.append(project)
        if subject is not None:
            clauses.append("subject = ?")
            params.append(subject)
        with self._store.transaction() as db:
            rows = db.execute(
                "SELECT project, subject, kind, quantity, started_at, ended_at, alive_at "
                f"FROM meter WHERE {' AND '.join(clauses)} ORDER BY id",
                params,
            ).fetchall()
        return [
            IntervalRow(p, s, k, float(q), float(a), None if b is None else float(b), float(al))
            for p, s, k, q, a, b, al in rows
        ]

    def open_interval(
        self, project: str, subject: str, kind: str, quantity: float, at: float
    ) -> None:
        with self._store.transaction() as db:
            open_interval_in(db, project, subject, kind, quantity, at)

    def close_intervals(self, subject: str, kinds: Iterable[str], at: float) -> None:
        with self._store.transaction() as db:
            close_intervals_in(db, subject, kinds, at)
