"""The event log (traces and the audit trail): who did what to which sandbox, and why.

Append-only rows (``store/meter.py``). Lifecycle events are written by the state writer
(:mod:`hutch.services.state`) in the same transaction as the state change, with the
actor and the reason of the work under way (:func:`acting`, a context variable the API
sets per request and internal work sets for itself); exec and file events are appended
when the call ends. An event never holds output, file contents, environment values or
keys: a command is trimmed to :data:`COMMAND_CHARS` and scrubbed (:func:`scrub`).

Types (stable names)::

    sandbox.created   image, shape, from: cold | template | pool | snapshot | fork
    sandbox.started   (booted, or restored from a template/pool/snapshot)
    sandbox.paused    reason: api | idle | fork | snapshot | restart, mode
    sandbox.resumed   reason: api | auto_resume | fork | snapshot | restart
    sandbox.failed    cause
    sandbox.deleted   reason: api | timeout | auto_delete | restart
    sandbox.exec      command, exit_code, signal, timed_out, duration_ms
    sandbox.file      op: read | write | mkdir | remove | rename, path, bytes
    sandbox.forked    children
    snapshot.created  snapshot, name          snapshot.deleted  snapshot
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any

from hutch.contract.auth import Principal
from hutch.models import SandboxRecord, SandboxState
from hutch.store.meter import EventRow, MeterStore, append_event_in

__all__ = [
    "COMMAND_CHARS",
    "EVENT_TYPES",
    "Acting",
    "EventLog",
    "act_as",
    "acting",
    "because",
    "internal",
    "lifecycle_event",
    "project_of",
    "scrub",
]

S = SandboxState
#: Characters of a command an exec event keeps.
COMMAND_CHARS = 200
EVENT_TYPES = (
    "sandbox.created", "sandbox.started", "sandbox.paused", "sandbox.resumed",
    "sandbox.failed", "sandbox.deleted", "sandbox.exec", "sandbox.file", "sandbox.forked",
    "snapshot.created", "snapshot.deleted", "snapshot.uploaded",
)  # fmt: skip
REDACTED = "[redacted]"
_KEYS = re.compile(r"\b(?:hk|e2b)_[A-Za-z0-9_-]{8,}")


@dataclass(frozen=True)
class Acting:
    """Who the work under way is for (None: the daemon's own: reaper, reconcile, a VM
    that stopped) and why (None: the caller asked; "api" in the events)."""

    principal: Principal | None = None
    reason: str | None = None


# Acting is frozen: the shared default cannot be changed in place.
_ACTING: ContextVar[Acting] = ContextVar("hutch_acting", default=Acting())  # noqa: B039


def acting() -> Acting:
    return _ACTING.get()


def act_as(principal: Principal | None) -> None:
    """The rest of this task (a request) acts for ``principal``."""
    _ACTING.set(Acting(principal))


@contextlib.contextmanager
def because(reason: str) -> Iterator[None]:
    """Events of the block say ``reason`` (idle, timeout, auto_resume, fork, ...)."""
    token = _ACTING.set(replace(_ACTING.get(), reason=reason))
    try:
        yield
    finally:
        _ACTING.reset(token)


def internal(reason: str | None = None) -> None:
    """The rest of this task is the daemon's own work (a watcher started by a request
    must not record that request's caller as its actor)."""
    _ACTING.set(Acting(None, reason))


def project_of(rec: SandboxRecord) -> str:
    """The sandbox's project (what its events and meter intervals are filed under)."""
    return rec.project


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without keys (``hk_…``, ``e2b_…``) or any of ``secrets`` (values of the
    call's environment: a command may spell one out)."""
    for secret in sorted({s for s in secrets if len(s) >= 3}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return _KEYS.sub(REDACTED, text)


def lifecycle_event(
    before: SandboxState, after: SandboxRecord, reason: str | None
) -> tuple[str, dict[str, Any]] | None:
    """The event a transition from ``before`` to ``after.state`` records, if any."""
    to = after.state
    why = reason or "api"
    if to is S.RUNNING and before is S.CREATING:
        return "sandbox.started", {}
    if to is S.RUNNING and before is S.RESUMING:
        return "sandbox.resumed", {"reason": why}
    if to is S.PAUSED or (to is S.RESUMING and before is S.PAUSING):
        # A fork or snapshot freezes the sandbox and brings it back as a clone: the pair
        # paused/resumed says so.
        mode = str(after.pause_mode) if after.pause_mode else None
        return "sandbox.paused", {"reason": why, "mode": mode}
    if to is S.FAILED:
        return "sandbox.failed", {"cause": after.error or ""}
    if to is S.DESTROYED:
        return "sandbox.deleted", {"reason": why}
    return None


class EventLog:
    """Appends events and serves them: pages and followed streams."""

    def __init__(
        self,
        store: MeterStore,
        *,
        retention_s: float,
        max_events: int,
        clock: Callable[[], float] = time.time,
        enabled: bool = True,
    ) -> None:
        """``enabled`` False: nothing is appended (HUTCH_EVENTS=off)."""
        self.store = store
        self.enabled = enabled
        self.retention_s = retention_s
        self.max_events = max_events
        self.clock = clock
        self._changed = asyncio.Event()
        #: Told of every event appended (type, data): the metrics count from them.
        self.listeners: list[Callable[[str, Mapping[str, Any]], None]] = []

    # -- appending -----------------------------------------------------------------------

    def _row(
        self, type: str, project: str, sandbox_id: str | None, data: Mapping[str, Any]
    ) -> dict[str, Any]:
        who = acting().principal
        return {
            "at": self.clock(),
            "project": project,
            "sandbox_id": sandbox_id,
            "type": type,
            "actor": who.key_id if who is not None else None,
            "source": (who.source or None) if who is not None else None,
            "data": data,
        }

    def record_in(
        self,
        db: Any,
        type: str,
        *,
        project: str,
        sandbox_id: str | None,
        data: Mapping[str, Any],
    ) -> None:
        """Append in the transaction of ``db`` (the change it records)."""
        if not self.enabled:
            return
        append_event_in(db, **self._row(type, project, sandbox_id, data))
        self._appended(type, data)

    def record(
        self,
        type: str,
        *,
        project: str,
        sandbox_id: str | None,
        data: Mapping[str, Any],
    ) -> None:
        if not self.enabled:
            return
        self.store.append_event(**self._row(type, project, sandbox_id, data))
        self._appended(type, data)

    def _appended(self, type: str, data: Mapping[str, Any]) -> None:
        for listener in self.listeners:
            listener(type, data)
        self.poke()

    def poke(self) -> None:
        """Wake the followers (they read what is committed by the time they run)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a script, a test): followers poll anyway
        event, self._changed = self._changed, asyncio.Event()
        loop.call_soon(event.set)

    # -- reading -------------------------------------------------------------------------

    def page(
        self,
        *,
        project: str | None,
        sandbox_id: str | None = None,
        types: Iterable[str] = (),
        after: int = 0,
        limit: int = 100,
    ) -> list[EventRow]:
        return self.store.events(
            project=project, sandbox_id=sandbox_id, types=list(types), after=after, limit=limit
        )

    async def follow(
        self,
        *,
        project: str | None,
        sandbox_id: str,
        types: Iterable[str],
        after: int,
        ended: Callable[[], bool],
        poll_s: float = 1.0,
    ) -> AsyncIterator[EventRow]:
        """Events after ``after`` as they are appended, until ``ended()`` holds once
        everything before it was read (the sandbox is destroyed or failed)."""
        wanted = list(types)
        while True:
            changed = self._changed
            over = ended()  # read before the page: an end event is then in it
            rows = self.page(
                project=project, sandbox_id=sandbox_id, types=wanted, after=after, limit=500
            )
            for row in rows:
                after = row.seq
                yield row
            if rows:
                continue
            if over:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), poll_s)

    def prune(self) -> int:
        """Retention: events older than ``retention_s`` go, and all but the newest
        ``max_events``."""
        return self.store.prune_events(self.clock() - self.retention_s, self.max_events)
