"""The meter's and the event log's statements that run inside a transaction opened by
someone else (the state writer's, a snapshot row's), so that what they record commits with
the change it follows. No imports from the rest of the package (``db`` uses it)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from hutch.store.backend import Conn

__all__ = ["append_event_in", "close_intervals_in", "last_alive_in", "open_interval_in"]


def append_event_in(
    db: Conn,
    *,
    at: float,
    project: str,
    sandbox_id: str | None,
    type: str,
    actor: str | None,
    source: str | None,
    data: Mapping[str, Any],
) -> int:
    row = db.execute(
        "INSERT INTO events (at, project, sandbox_id, type, actor, source, data_json) "
        "VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING seq",
        (at, project, sandbox_id, type, actor, source, json.dumps(dict(data))),
    ).fetchone()
    return int(row[0])


def open_interval_in(
    db: Conn, project: str, subject: str, kind: str, quantity: float, at: float
) -> None:
    """Open ``kind`` for ``subject`` at ``at``; one already open is kept (never two)."""
    db.execute(
        "INSERT INTO meter (project, subject, kind, quantity, started_at, alive_at) "
        "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (subject, kind) WHERE ended_at IS NULL "
        "DO NOTHING",
        (project, subject, kind, quantity, at, at),
    )


def close_intervals_in(db: Conn, subject: str, kinds: Iterable[str], at: float) -> None:
    """Close the open ``kinds`` of ``subject`` at ``at`` (never before they started)."""
    wanted = list(kinds)
    if not wanted:
        return
    marks = ", ".join("?" for _ in wanted)
    db.execute(
        f"UPDATE meter SET ended_at = {db.dialect.greatest('started_at', '?')} "
        f"WHERE subject = ? AND ended_at IS NULL AND kind IN ({marks})",
        (at, subject, *wanted),
    )


def last_alive_in(db: Conn, subject: str) -> float | None:
    """The last heartbeat of the subject's open intervals (None: none open)."""
    row = db.execute(
        "SELECT MAX(alive_at) FROM meter WHERE subject = ? AND ended_at IS NULL", (subject,)
    ).fetchone()
    return None if row is None or row[0] is None else float(row[0])
