"""The sandbox store on SQLite (WAL, the default) or PostgreSQL (``HUTCH_DATABASE_URL``).

One connection guarded by a lock: every statement is short, so callers on the event loop
call these methods directly. Writes are single transactions; a crash at any point leaves
either the old or the new row, never a torn one. Which database it is matters only to
the backend (``hutch.store.backend``): the SQL here and in the other store modules is
the same for both.
"""

from __future__ import annotations

import enum
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from hutch.errors import Conflict, QuotaExceeded, StoreError
from hutch.models import NetworkMode, PauseMode, SandboxRecord, SandboxState, Shape, SnapshotRecord
from hutch.store.backend import Backend, Conn, ConnectionLost, IntegrityViolation
from hutch.store.meter_sql import close_intervals_in, open_interval_in
from hutch.store.migrations import LEDGER, MIGRATIONS, script_for, statements

#: What runs in a write's own transaction after it (the state writer's meter and event).
Also = Callable[[Conn], None] | None

_COLUMNS = (
    "id", "name", "image", "image_digest", "state", "vcpus", "memory_mib", "disk_gib",
    "env_json", "metadata_json", "timeout_s", "created_at", "started_at", "expires_at",
    "ended_at", "error", "pause_mode", "paused_at", "resume_from", "resume_clone",
    "parent_id", "auto_resume", "auto_pause_s", "auto_delete_s", "snapshot_id", "network",
    "project",
    "env_secrets_json", "placement_labels_json",
)  # fmt: skip
_UPDATABLE = {
    "state", "image_digest", "started_at", "expires_at", "ended_at", "error", "name",
    "pause_mode", "paused_at", "resume_from", "resume_clone", "timeout_s", "auto_pause_s",
    "disk_gib",
}  # fmt: skip
LIVE_STATES = tuple(s for s in SandboxState if s.is_live)
#: States in which a sandbox has (or is getting) a QEMU process and reserves memory.
RUNNING_STATES = (
    SandboxState.CREATING, SandboxState.RUNNING, SandboxState.PAUSING, SandboxState.RESUMING,
    SandboxState.STOPPING,
)  # fmt: skip


def open_backend(target: Path | str) -> Backend:
    """A path: SQLite; a ``postgresql://`` URL (``Settings.database``): PostgreSQL."""
    if isinstance(target, Path):
        from hutch.store.sqlite_backend import SqliteBackend

        return SqliteBackend(target)
    from hutch.store.pg_backend import PostgresBackend

    return PostgresBackend(target)


class Store:
    def __init__(self, target: Path | str) -> None:
        """``target``: the SQLite file, or a PostgreSQL URL (``Settings.database``)."""
        self.target = target
        #: The SQLite file (None on PostgreSQL).
        self.path: Path | None = target if isinstance(target, Path) else None
        self._backend = open_backend(target)
        self._lock = threading.RLock()
        self._migrate()

    @property
    def display(self) -> str:
        """The database, for messages: the SQLite path, or the URL without its password."""
        return self._backend.display

    @property
    def dialect_name(self) -> str:
        return self._backend.dialect.name

    def close(self) -> None:
        with self._lock:
            self._backend.close()

    def transaction(self) -> AbstractContextManager[Conn]:
        """One write transaction (for the other tables' modules in this package)."""
        return self._tx()

    def _connect(self, begin: Callable[[Conn], None] | None) -> Conn:
        """The connection (with a transaction begun), reconnecting once if the one held
        was found lost at its first statement: nothing of the call ran yet, so a server
        restart between two calls costs a reconnect, not an error."""
        for attempt in (1, 2):
            try:
                db = self._backend.conn()
                if begin is not None:
                    begin(db)
                return db
            except Exception as exc:
                mapped = self._backend.translate(exc)
                if isinstance(mapped, ConnectionLost) and attempt == 1:
                    continue
                raise self._error(exc, mapped) from exc
        raise AssertionError("unreachable")

    def _error(self, exc: BaseException, mapped: BaseException | None) -> BaseException:
        if isinstance(mapped, IntegrityViolation):
            return Conflict(f"conflicts with an existing sandbox: {mapped}")
        if isinstance(mapped, ConnectionLost):
            return StoreError(
                f"{mapped}; this call's transaction did not commit (unless the commit "
                "itself was cut), and the next call reconnects"
            )
        if mapped is not None:
            return StoreError(f"database error: {mapped}")
        return exc

    @contextmanager
    def _tx(self, schema: bool = False) -> Iterator[Conn]:
        with self._lock:
            begin = self._backend.begin_schema if schema else self._backend.begin
            db = self._connect(begin)
            try:
                yield db
                self._backend.commit(db)
            except BaseException as exc:
                self._backend.rollback(db)
                mapped = self._backend.translate(exc)
                if mapped is None:
                    raise
                raise self._error(exc, mapped) from exc

    def _fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        """The rows of one read, outside a transaction (its own snapshot on PostgreSQL),
        read again once if the connection was found lost (a read repeats safely)."""
        with self._lock:
            for attempt in (1, 2):
                db = self._connect(None)
                try:
                    return list(db.execute(sql, params).fetchall())
                except Exception as exc:
                    mapped = self._backend.translate(exc)
                    if isinstance(mapped, ConnectionLost) and attempt == 1:
                        continue
                    raise self._error(exc, mapped) from exc
        raise AssertionError("unreachable")

    def schema_version(self) -> int:
        with self._tx() as db:
            return self._version_in(db)

    def _version_in(self, db: Conn) -> int:
        row = db.execute("SELECT MAX(version) FROM hutch_schema").fetchone()
        ledger = int(row[0]) if row and row[0] is not None else 0
        return max(ledger, self._backend.legacy_version(db))

    def _migrate(self) -> None:
        dialect = self._backend.dialect.name
        while True:
            with self._tx(schema=True) as db:
                db.execute(script_for(LEDGER, dialect))
                current = self._version_in(db)
                if current > len(MIGRATIONS):
                    raise StoreError(
                        f"{self._backend.display} has schema version {current}, newer than "
                        f"this hutch ({len(MIGRATIONS)}); upgrade hutch or use another "
                        "database"
                    )
                recorded = db.execute("SELECT COUNT(*) FROM hutch_schema").fetchone()[0]
                if int(recorded) < current:  # a database from before the ledger
                    for old in range(1, current + 1):
                        db.execute(
                            "INSERT INTO hutch_schema (version, applied_at) VALUES (?, ?) "
                            "ON CONFLICT (version) DO NOTHING",
                            (old, time.time()),
                        )
                if current == len(MIGRATIONS):
                    return
                version = current + 1
                for statement in statements(script_for(MIGRATIONS[current], dialect)):
                    db.execute(statement)
                db.execute(
                    "INSERT INTO hutch_schema (version, applied_at) VALUES (?, ?)",
                    (version, time.time()),
                )
                self._backend.stamp(db, version)

    # -- sandboxes ---------------------------------------------------------------------

    def insert_sandbox(self, rec: SandboxRecord, also: Also = None) -> None:
        """``also`` runs in the same transaction (the meter and the event of the row)."""
        row = _to_row(rec)
        marks = ", ".join("?" for _ in _COLUMNS)
        with self._tx() as db:
            if rec.name is not None:
                live = ", ".join("?" for _ in LIVE_STATES)
                clash = db.execute(
                    f"SELECT id FROM sandboxes WHERE project = ? AND name = ? "
                    f"AND state IN ({live})",
                    (rec.project, rec.name, *LIVE_STATES),
                ).fetchone()
                if clash:
                    raise Conflict(
                        f"a sandbox named {rec.name!r} already exists ({clash[0]}); "
                        "choose another name or delete it first"
                    )
            db.execute(f"INSERT INTO sandboxes ({', '.join(_COLUMNS)}) VALUES ({marks})", row)
            if also is not None:
                also(db)

    def update_sandbox(self, sandbox_id: str, also: Also = None, **changes: Any) -> None:
        """``also`` runs in the same transaction (the meter and the event of a state)."""
        unknown = set(changes) - _UPDATABLE
        if unknown:
            raise ValueError(f"not updatable: {sorted(unknown)}")
        if not changes:
            return
        sets = ", ".join(f"{key} = ?" for key in changes)
        values = [str(v) if isinstance(v, enum.Enum) else v for v in changes.values()]
        with self._tx() as db:
            db.execute(f"UPDATE sandboxes SET {sets} WHERE id = ?", (*values, sandbox_id))
            if also is not None:
                also(db)

    def get_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        rows = self._fetch(
            f"SELECT {', '.join(_COLUMNS)} FROM sandboxes WHERE id = ?", (sandbox_id,)
        )
        return _from_row(rows[0]) if rows else None

    def list_sandboxes(
        self,
        states: Iterable[SandboxState] | None = None,
        metadata: dict[str, str] | None = None,
        project: str | None = None,
    ) -> list[SandboxRecord]:
        """``project=None``: every project's (the engine's own sweeps)."""
        query = f"SELECT {', '.join(_COLUMNS)} FROM sandboxes"
        params: list[Any] = []
        clauses: list[str] = []
        if project is not None:
            clauses.append("project = ?")
            params.append(project)
        if states is not None:
            wanted = [str(s) for s in states]
            clauses.append(f"state IN ({', '.join('?' for _ in wanted)})")
            params.extend(wanted)
        dialect = self._backend.dialect
        for key, value in (metadata or {}).items():
            clauses.append(f"{dialect.json_text('metadata_json')} = ?")
            params.extend([dialect.json_key(key), value])
        if clauses:
            query += " WHERE " + " AND ".join(clauses)
        query += " ORDER BY created_at, id"
        return [_from_row(r) for r in self._fetch(query, params)]

    # -- snapshots ----------------------------------------------------------------------

    def insert_snapshot(
        self, snap: SnapshotRecord, *, ready: bool = True, quota: int | None = None
    ) -> None:
        """``ready=False``: the snapshot is being saved; it is not listed nor found until
        :meth:`finish_snapshot` (its row is the intent a restarted daemon finishes).

        ``quota``: the project's ``max_snapshot_bytes``. ``snap.size_bytes`` (a save's
        reservation) is counted against it with every other row of the project, ready or
        being saved, in the transaction of the insert: :class:`QuotaExceeded` and no row
        when it does not fit, so concurrent saves never reserve past it together."""
        with self._tx() as db:
            if quota is not None:
                used = _snapshot_bytes(db, snap.project)
                if used + snap.size_bytes > quota:
                    raise QuotaExceeded(
                        f"project {snap.project!r} quota max_snapshot_bytes exceeded: {used} "
                        f"in use or reserved + {snap.size_bytes} for this snapshot > limit "
                        f"{quota}; delete snapshots or raise the quota"
                    )
            db.execute(
                # host: where the sandbox runs as it is saved (its files stay there).
                "INSERT INTO snapshots (id, name, sandbox_id, image, vcpus, memory_mib, "
                "disk_gib, path, size_bytes, created_at, ready, project, host) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
                "(SELECT host FROM sandboxes WHERE id = ?))",
                (snap.id, snap.name, snap.sandbox_id, snap.image, snap.shape.vcpus,
                 snap.shape.memory_mib, snap.shape.disk_gib, snap.path, snap.size_bytes,
                 snap.created_at, int(ready), snap.project, snap.sandbox_id),
            )  # fmt: skip
            if ready:
                _meter_snapshot(db, snap.project, snap.id, snap.size_bytes, snap.created_at)

    def finish_snapshot(
        self, snapshot_id: str, size_bytes: int, *, quota: int | None = None
    ) -> bool:
        """The save is done: ``size_bytes`` replaces its reservation and it is listed.
        With ``quota``, a snapshot that takes its project past it (the guest wrote more
        than the reservation foresaw) is deleted instead, in the same transaction:
        False (the caller removes its files and refuses)."""
        with self._tx() as db:
            if quota is not None:
                found = db.execute(
                    "SELECT project FROM snapshots WHERE id = ?", (snapshot_id,)
                ).fetchone()
                if found is not None:
                    others = _snapshot_bytes(db, str(found[0]), but=snapshot_id)
                    if others + size_bytes > quota:
                        db.execute("DELETE FROM snapshots WHERE id = ?", (snapshot_id,))
                        return False
            db.execute(
                "UPDATE snapshots SET ready = 1, size_bytes = ? WHERE id = ?",
                (size_bytes, snapshot_id),
            )
            row = db.execute("SELECT project FROM snapshots WHERE id = ?", (snapshot_id,))
            found = row.fetchone()
            if found is not None:
                _meter_snapshot(db, str(found[0]), snapshot_id, size_bytes, time.time())
        return True

    def get_snapshot(self, snapshot_id: str) -> SnapshotRecord | None:
        """A ready snapshot (one still being saved is not found)."""
        rows = self._fetch(
            f"SELECT {_SNAPSHOT_COLUMNS} FROM snapshots WHERE id = ? AND ready = 1",
            (snapshot_id,),
        )
        return _snapshot_from_row(rows[0]) if rows else None

    def list_snapshots(
        self, *, ready: bool | None = True, project: str | None = None
    ) -> list[SnapshotRecord]:
        """Ready snapshots; ``ready=False``: those being saved; ``None``: all.
        ``project=None``: every project's."""
        clauses: list[str] = [] if ready is None else [f"ready = {int(ready)}"]
        params: list[Any] = []
        if project is not None:
            clauses.append("project = ?")
            params.append(project)
        where = " WHERE " + " AND ".join(clauses) if clauses else ""
        rows = self._fetch(
            f"SELECT {_SNAPSHOT_COLUMNS} FROM snapshots{where} ORDER BY created_at, id", params
        )
        return [_snapshot_from_row(r) for r in rows]

    def delete_snapshot(self, snapshot_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM snapshots WHERE id = ?", (snapshot_id,))
            close_intervals_in(db, snapshot_id, ["snapshot"], time.time())

    def count_by_state(self) -> dict[str, int]:
        rows = self._fetch("SELECT state, COUNT(*) FROM sandboxes GROUP BY state")
        return {str(state): int(n) for state, n in rows}

    def live_usage(self) -> tuple[int, int]:
        """(number of live sandboxes, MiB of memory reserved by those with a VM process).

        Paused sandboxes count against the number but hold no host memory.
        """
        live = [str(s) for s in LIVE_STATES]
        running = [str(s) for s in RUNNING_STATES]
        (row,) = self._fetch(
            f"SELECT COUNT(*), COALESCE(SUM(CASE WHEN state IN "
            f"({', '.join('?' for _ in running)}) THEN memory_mib ELSE 0 END), 0) "
            f"FROM sandboxes WHERE state IN ({', '.join('?' for _ in live)})",
            (*running, *live),
        )
        return int(row[0]), int(row[1])


_SNAPSHOT_COLUMNS = (
    "id, name, sandbox_id, image, vcpus, memory_mib, disk_gib, path, size_bytes, created_at, "
    "project"
)


def _snapshot_from_row(row: tuple[Any, ...]) -> SnapshotRecord:
    sid, name, sandbox_id, image, vcpus, memory, disk, path, size, created, project = row
    return SnapshotRecord(
        id=sid, name=name, sandbox_id=sandbox_id, image=image, shape=Shape(vcpus, memory, disk),
        path=path, size_bytes=size, created_at=created, project=project,
    )  # fmt: skip


def _snapshot_bytes(db: Conn, project: str, but: str | None = None) -> int:
    """Bytes of the project's snapshots: ready ones' sizes and the reservations of those
    being saved (``but``: leave that one out). The project's row is locked first, so on
    PostgreSQL two saves' transactions sum and reserve one after the other (a no-op
    write on SQLite, whose write transactions run one at a time anyway)."""
    db.execute("UPDATE projects SET name = name WHERE name = ?", (project,))
    (total,) = db.execute(
        "SELECT COALESCE(SUM(size_bytes), 0) FROM snapshots WHERE project = ? AND id != ?",
        (project, but or ""),
    ).fetchone()
    return int(total)


def _meter_snapshot(db: Conn, project: str, snapshot_id: str, size: int, at: float) -> None:
    """A ready snapshot holds ``size`` bytes of storage from ``at`` until it is deleted
    (GB = 10^9 bytes, as the storage price counts them)."""
    open_interval_in(db, project, snapshot_id, "snapshot", size / 1e9, at)


def _to_row(rec: SandboxRecord) -> tuple[Any, ...]:
    return (
        rec.id,
        rec.name,
        rec.image,
        rec.image_digest,
        str(rec.state),
        rec.shape.vcpus,
        rec.shape.memory_mib,
        rec.shape.disk_gib,
        json.dumps(rec.env),
        json.dumps(rec.metadata),
        rec.timeout_s,
        rec.created_at,
        rec.started_at,
        rec.expires_at,
        rec.ended_at,
        rec.error,
        str(rec.pause_mode) if rec.pause_mode else None,
        rec.paused_at,
        rec.resume_from,
        int(rec.resume_clone),
        rec.parent_id,
        int(rec.auto_resume),
        rec.auto_pause_s,
        rec.auto_delete_s,
        rec.snapshot_id,
        str(rec.network),
        rec.project,
        json.dumps(rec.env_secrets),
        json.dumps(rec.placement_labels),
    )


def _from_row(row: tuple[Any, ...]) -> SandboxRecord:
    values = dict(zip(_COLUMNS, row, strict=True))
    return SandboxRecord(
        id=values["id"],
        name=values["name"],
        image=values["image"],
        image_digest=values["image_digest"],
        state=SandboxState(values["state"]),
        shape=Shape(values["vcpus"], values["memory_mib"], values["disk_gib"]),
        env=json.loads(values["env_json"]),
        metadata=json.loads(values["metadata_json"]),
        timeout_s=values["timeout_s"],
        created_at=values["created_at"],
        started_at=values["started_at"],
        expires_at=values["expires_at"],
        ended_at=values["ended_at"],
        error=values["error"],
        pause_mode=PauseMode(values["pause_mode"]) if values["pause_mode"] else None,
        paused_at=values["paused_at"],
        resume_from=values["resume_from"],
        resume_clone=bool(values["resume_clone"]),
        parent_id=values["parent_id"],
        auto_resume=bool(values["auto_resume"]),
        auto_pause_s=values["auto_pause_s"],
        auto_delete_s=values["auto_delete_s"],
        snapshot_id=values["snapshot_id"],
        network=NetworkMode(values["network"]),
        project=values["project"],
        env_secrets=json.loads(values["env_secrets_json"]),
        placement_labels=json.loads(values["placement_labels_json"]),
    )
