"""The sandbox store on SQLite (WAL).

One connection guarded by a lock: every statement is short, so callers on the event loop
call these methods directly. Writes are single transactions; a crash at any point leaves
either the old or the new row, never a torn one.
"""

from __future__ import annotations

import enum
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from hutch.errors import Conflict, QuotaExceeded, StoreError
from hutch.models import NetworkMode, PauseMode, SandboxRecord, SandboxState, Shape, SnapshotRecord
from hutch.store.meter_sql import close_intervals_in, open_interval_in
from hutch.store.migrations import MIGRATIONS

#: What runs in a write's own transaction after it (the state writer's meter and event).
Also = Callable[[sqlite3.Connection], None] | None

_COLUMNS = (
    "id", "name", "image", "image_digest", "state", "vcpus", "memory_mib", "disk_gib",
    "env_json", "metadata_json", "timeout_s", "created_at", "started_at", "expires_at",
    "ended_at", "error", "pause_mode", "paused_at", "resume_from", "resume_clone",
    "parent_id", "auto_resume", "auto_pause_s", "auto_delete_s", "snapshot_id", "network",
    "project",
    "env_secrets_json",
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


class Store:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(
                str(path), isolation_level=None, check_same_thread=False, timeout=30.0
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the database {path}: {exc}") from exc
        self._lock = threading.RLock()
        self._migrate()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def transaction(self) -> AbstractContextManager[sqlite3.Connection]:
        """One write transaction (for the other tables' modules in this package)."""
        return self._tx()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                yield self._db
                self._db.execute("COMMIT")
            except sqlite3.IntegrityError as exc:
                self._db.execute("ROLLBACK")
                raise Conflict(f"conflicts with an existing sandbox: {exc}") from exc
            except sqlite3.Error as exc:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise StoreError(f"database error: {exc}") from exc
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def schema_version(self) -> int:
        with self._lock:
            row = self._db.execute("PRAGMA user_version").fetchone()
        return int(row[0])

    def _migrate(self) -> None:
        current = self.schema_version()
        if current > len(MIGRATIONS):
            raise StoreError(
                f"{self.path} has schema version {current}, newer than this hutch "
                f"({len(MIGRATIONS)}); upgrade hutch or use another state directory"
            )
        for version, script in enumerate(MIGRATIONS[current:], start=current + 1):
            with self._tx() as db:
                for statement in script.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute(f"PRAGMA user_version = {version}")

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
        with self._lock:
            row = self._db.execute(
                f"SELECT {', '.join(_COLUMNS)} FROM sandboxes WHERE id = ?", (sandbox_id,)
            ).fetchone()
        return _from_row(row) if row else None

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
        for key, value in (metadata or {}).items():
            clauses.append("json_extract(metadata_json, ?) = ?")
            params.extend([_json_path(key), value])
        if clauses:
            query += " WHERE " + " AND ".join(clauses)
        query += " ORDER BY created_at, id"
        with self._lock:
            rows = self._db.execute(query, params).fetchall()
        return [_from_row(r) for r in rows]

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
                "INSERT INTO snapshots (id, name, sandbox_id, image, vcpus, memory_mib, "
                "disk_gib, path, size_bytes, created_at, ready, project) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (snap.id, snap.name, snap.sandbox_id, snap.image, snap.shape.vcpus,
                 snap.shape.memory_mib, snap.shape.disk_gib, snap.path, snap.size_bytes,
                 snap.created_at, int(ready), snap.project),
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
        with self._lock:
            row = self._db.execute(
                f"SELECT {_SNAPSHOT_COLUMNS} FROM snapshots WHERE id = ? AND ready = 1",
                (snapshot_id,),
            ).fetchone()
        return _snapshot_from_row(row) if row else None

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
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_SNAPSHOT_COLUMNS} FROM snapshots{where} ORDER BY created_at, id",
                params,
            ).fetchall()
        return [_snapshot_from_row(r) for r in rows]

    def delete_snapshot(self, snapshot_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM snapshots WHERE id = ?", (snapshot_id,))
            close_intervals_in(db, snapshot_id, ["snapshot"], time.time())

    def count_by_state(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute(
                "SELECT state, COUNT(*) FROM sandboxes GROUP BY state"
            ).fetchall()
        return {str(state): int(n) for state, n in rows}

    def live_usage(self) -> tuple[int, int]:
        """(number of live sandboxes, MiB of memory reserved by those with a VM process).

        Paused sandboxes count against the number but hold no host memory.
        """
        live = [str(s) for s in LIVE_STATES]
        running = [str(s) for s in RUNNING_STATES]
        with self._lock:
            row = self._db.execute(
                f"SELECT COUNT(*), COALESCE(SUM(CASE WHEN state IN "
                f"({', '.join('?' for _ in running)}) THEN memory_mib ELSE 0 END), 0) "
                f"FROM sandboxes WHERE state IN ({', '.join('?' for _ in live)})",
                (*running, *live),
            ).fetchone()
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


def _snapshot_bytes(db: sqlite3.Connection, project: str, but: str | None = None) -> int:
    """Bytes of the project's snapshots: ready ones' sizes and the reservations of those
    being saved (``but``: leave that one out)."""
    (total,) = db.execute(
        "SELECT COALESCE(SUM(size_bytes), 0) FROM snapshots WHERE project = ? AND id != ?",
        (project, but or ""),
    ).fetchone()
    return int(total)


def _meter_snapshot(
    db: sqlite3.Connection, project: str, snapshot_id: str, size: int, at: float
) -> None:
    """A ready snapshot holds ``size`` bytes of storage from ``at`` until it is deleted
    (GB = 10^9 bytes, as the storage price counts them)."""
    open_interval_in(db, project, snapshot_id, "snapshot", size / 1e9, at)


def _json_path(key: str) -> str:
    # Quote the key so dots and brackets in user metadata keys are taken literally.
    return '$."' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


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
    )
