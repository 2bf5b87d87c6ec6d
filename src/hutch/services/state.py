"""The sandbox state machine: its states, the transitions allowed between them, and the
one place that writes a sandbox's state.

::

    creating ─► running · failed (could not boot) · stopping (deleted while booting)
    running  ─► pausing (pause, fork, snapshot) · stopping · failed (the VM died)
    pausing  ─► paused · running (the save failed) · resuming (a fork or snapshot
                brings the frozen sandbox back as a clone) · failed
    paused   ─► resuming · stopping
    resuming ─► running · paused (the restore failed) · failed
    stopping ─► destroyed
    destroyed, failed: for good        (failed: also a VM gone after a restart)

The table (:data:`TRANSITIONS`) is the whole truth: every change of ``sandboxes.state``
goes through :meth:`SandboxStates.move` (or :meth:`SandboxStates.insert` for a new row,
which starts ``creating``), which refuses any other with :class:`~hutch.errors.StateError`
naming the state found and the states the change needs, as ``qemu.qmp`` guards its
runstate. Callers that need a state ask :func:`require`. A transition is written before
the side effect it announces, so a daemon killed at any point finds, on restart, a row
that says what to finish (ARCHITECTURE.md, "Crash safety").

Each write also records, in its own transaction, what the change means to the meter
(:mod:`hutch.services.metering`: the intervals it closes and opens) and the lifecycle
event it is (:mod:`hutch.services.events`): a state, its bill and its trace never
disagree, whatever point a daemon is killed at.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from hutch.errors import NotFound, StateError, Unavailable
from hutch.models import SANDBOX_ID_RE, SandboxRecord, SandboxState
from hutch.services.events import EventLog, acting, lifecycle_event, project_of
from hutch.services.metering import changes, held
from hutch.store import Store
from hutch.store.backend import Conn
from hutch.store.hosts import place_in
from hutch.store.meter_sql import close_intervals_in, last_alive_in, open_interval_in

__all__ = ["TRANSITIONS", "SandboxStates", "require"]

S = SandboxState

#: From-state -> the states a sandbox may go to from it.
TRANSITIONS: dict[SandboxState, frozenset[SandboxState]] = {
    # Booted (or adopted after a restart); boot failed; deleted while booting.
    S.CREATING: frozenset({S.RUNNING, S.FAILED, S.STOPPING}),
    # Pause, fork or snapshot saving; delete; the VM died.
    S.RUNNING: frozenset({S.PAUSING, S.STOPPING, S.FAILED}),
    # Saved; the save failed (runs on); a fork's freeze brings it back as a clone; the
    # VM was gone after a restart.
    S.PAUSING: frozenset({S.PAUSED, S.RUNNING, S.RESUMING, S.FAILED}),
    S.PAUSED: frozenset({S.RESUMING, S.STOPPING}),
    # Back; the restore failed (still paused); gone after a restart.
    S.RESUMING: frozenset({S.RUNNING, S.PAUSED, S.FAILED}),
    S.STOPPING: frozenset({S.DESTROYED}),
    S.DESTROYED: frozenset(),
    S.FAILED: frozenset(),
}

#: Fields that go with a state and are written with it (the rest of a row is fixed at
#: insert, or written by its owner: names, policies).
_WITH_STATE = frozenset(
    {"started_at", "expires_at", "ended_at", "error", "pause_mode", "paused_at"}
    | {"resume_from", "resume_clone"}
)


def require(rec: SandboxRecord, *states: SandboxState, hint: str = "") -> SandboxRecord:
    """``rec`` if it is in one of ``states``; else StateError(state, required)."""
    if rec.state not in states:
        raise StateError(f"sandbox {rec.id}", str(rec.state), [str(s) for s in states], hint)
    return rec


def allowed_from(to: SandboxState) -> tuple[SandboxState, ...]:
    """The states from which a sandbox may go to ``to``."""
    return tuple(s for s, targets in TRANSITIONS.items() if to in targets)


class SandboxStates:
    """Reads sandboxes and is the only writer of their state (in ``store``).

    ``checking`` holds the ids a restarted daemon has not checked yet: they answer
    :class:`~hutch.errors.Unavailable` (their row may not say what is true yet).
    """

    def __init__(
        self,
        store: Store,
        events: EventLog | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``events`` None: no event log (the meter is written all the same)."""
        self.store = store
        self.events = events
        self.clock = clock
        self.checking: set[str] = set()
        #: The host new rows run on (``hutch.store.hosts``; ``local`` on one host).
        self.host = "local"

    # -- reads -------------------------------------------------------------------------

    def get(self, sandbox_id: str, project: str | None = None) -> SandboxRecord:
        """The sandbox; with ``project``, one of another project is not found, exactly
        as a missing one (its id is not disclosed)."""
        if not SANDBOX_ID_RE.match(sandbox_id):
            raise NotFound(f"sandbox id {sandbox_id!r} is malformed; ids look like sb-0123456789ab")
        if project is not None and sandbox_id in self.checking:
            # Another project's sandbox is not found even while it is being checked (a
            # 503 would tell that the id exists).
            held = self.store.get_sandbox(sandbox_id)
            if held is None or held.project != project:
                raise NotFound(f"no sandbox {sandbox_id}")
        if sandbox_id in self.checking:
            raise Unavailable(
                f"sandbox {sandbox_id} is still being checked after the daemon restarted; "
                "retry in a moment"
            )
        rec = self.store.get_sandbox(sandbox_id)
        if rec is None or (project is not None and rec.project != project):
            raise NotFound(f"no sandbox {sandbox_id}")
        return rec

    def current(self, sandbox_id: str) -> SandboxRecord | None:
        """The row as stored (no checks): for the engine's own re-reads."""
        return self.store.get_sandbox(sandbox_id)

    def list(
        self, states: Iterable[SandboxState], metadata: dict[str, str] | None = None
    ) -> list[SandboxRecord]:
        return self.store.list_sandboxes(states=list(states), metadata=metadata)

    # -- the writes ----------------------------------------------------------------------

    def insert(
        self, rec: SandboxRecord, origin: str = "cold", host: str | None = None
    ) -> SandboxRecord:
        """A new sandbox's row; it starts ``creating``. ``origin``: what it is made from
        (cold, template, pool, snapshot, fork), for its ``sandbox.created`` event;
        ``host``: the host that makes it (default this one; a fork's child placed on
        another host)."""
        require(rec, S.CREATING)
        data = {
            "image": rec.image,
            "shape": {
                "vcpus": rec.shape.vcpus,
                "memory_mib": rec.shape.memory_mib,
                "disk_gib": rec.shape.disk_gib,
            },
            "from": origin,
        }
        if rec.parent_id is not None:
            data["parent"] = rec.parent_id

        def also(db: Conn) -> None:
            place_in(db, rec.id, host or self.host)
            self._record(db, None, rec, "sandbox.created", data)

        self.store.insert_sandbox(rec, also=also)
        return rec

    def move(
        self, sandbox_id: str, to: SandboxState, *, lost: bool = False, **fields: Any
    ) -> SandboxRecord:
        """Write ``to`` (and ``fields``) if the table allows it from the stored state;
        else raise StateError and write nothing. Returns the row as written. The read
        and the write have no await between them: nothing else of the daemon runs in
        between.

        ``lost``: the sandbox's VM was found gone after a restart; the meter changes at
        its last heartbeat instead of now (the VM is not billed for time no daemon saw
        it alive)."""
        unknown = set(fields) - _WITH_STATE
        if unknown:
            raise ValueError(f"not written with a state: {sorted(unknown)}")
        rec = self.store.get_sandbox(sandbox_id)
        if rec is None:
            raise NotFound(f"no sandbox {sandbox_id}")
        if to not in TRANSITIONS[rec.state]:
            require(rec, *allowed_from(to))
        after = replace(rec, state=to, **fields)
        event = lifecycle_event(rec.state, after, acting().reason)
        self.store.update_sandbox(
            sandbox_id,
            also=lambda db: self._record(db, rec, after, *(event or (None, {})), lost=lost),
            state=to,
            **fields,
        )
        return after

    def disk_grown(self, sandbox_id: str, disk_gib: int) -> None:
        """The sandbox's disk is ``disk_gib`` GiB now (a live grow): its ``disk`` interval
        closes and one of the new size opens, in the transaction of the row's change."""
        rec = self.store.get_sandbox(sandbox_id)
        if rec is None:
            raise NotFound(f"no sandbox {sandbox_id}")
        grown = replace(rec, shape=replace(rec.shape, disk_gib=disk_gib))
        self.store.update_sandbox(
            sandbox_id, also=lambda db: self._record(db, rec, grown, None, {}), disk_gib=disk_gib
        )

    def _record(
        self,
        db: Conn,
        before: SandboxRecord | None,
        after: SandboxRecord,
        event: str | None,
        data: dict[str, Any],
        *,
        lost: bool = False,
    ) -> None:
        """In the transaction of the change: its meter intervals and its event."""
        now = self.clock() if before is not None else after.created_at
        at = (last_alive_in(db, after.id) or now) if lost else now
        close, opened = changes(
            held(before.state, before.pause_mode, before.shape) if before else {},
            held(after.state, after.pause_mode, after.shape),
        )
        close_intervals_in(db, after.id, close, at)
        project = project_of(after)
        for kind, quantity in opened.items():
            open_interval_in(db, project, after.id, kind, quantity, at)
        if event is not None and self.events is not None:
            if lost:
                data = {**data, "billed_until": at}
            self.events.record_in(db, event, project=project, sandbox_id=after.id, data=data)

    # The transitions with the fields that always go with them.

    def running(self, rec: SandboxRecord) -> SandboxRecord:
        """Booted: the clock of ``timeout_s`` starts."""
        now = time.time()
        expires = now + rec.timeout_s if rec.timeout_s else None
        return self.move(rec.id, S.RUNNING, started_at=now, expires_at=expires)

    def running_again(self, sandbox_id: str) -> SandboxRecord:
        """Back from a pause (or a freeze): nothing of the pause is left."""
        return self.move(
            sandbox_id,
            S.RUNNING,
            pause_mode=None,
            paused_at=None,
            resume_from=None,
            resume_clone=False,
        )

    def ended(
        self,
        sandbox_id: str,
        state: SandboxState,
        error: str | None = None,
        *,
        lost: bool = False,
    ) -> SandboxRecord:
        """``destroyed`` or ``failed`` (with why), for good."""
        if state.is_live:
            raise ValueError(f"{state} is not an end state")
        return self.move(sandbox_id, state, ended_at=time.time(), error=error, lost=lost)
