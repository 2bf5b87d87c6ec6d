"""The projects and api_keys tables. Same database and transactions as ``hutch.store.db``.

A key row holds the sha256 of the whole secret, never the secret; it is found by its id
(the secret's second part) and the hash compared in constant time by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hutch.errors import Conflict
from hutch.store.db import LIVE_STATES, RUNNING_STATES, Store

__all__ = ["QUOTA_FIELDS", "KeyRow", "ProjectRow", "ProjectStore", "ProjectUse"]

#: The quotas of a project, as columns (None: unlimited).
QUOTA_FIELDS = ("max_sandboxes", "max_vcpus", "max_memory_mib", "max_snapshot_bytes")


@dataclass(frozen=True)
class ProjectRow:
    name: str
    created_at: float
    quotas: dict[str, int | None]


@dataclass(frozen=True)
class ProjectUse:
    """What a project holds now, in the quotas' units."""

    sandboxes: int  # live (not ended): paused ones too
    vcpus: int  # of sandboxes with a VM (or getting one: creating, resuming)
    memory_mib: int
    snapshot_bytes: int

    def of(self, quota: str) -> int:
        return {
            "max_sandboxes": self.sandboxes,
            "max_vcpus": self.vcpus,
            "max_memory_mib": self.memory_mib,
            "max_snapshot_bytes": self.snapshot_bytes,
        }[quota]


@dataclass(frozen=True)
class KeyRow:
    id: str
    project: str
    name: str
    role: str
    secret_sha256: str
    created_at: float
    created_by: str | None
    expires_at: float | None
    revoked_at: float | None
    last_used_at: float | None


LIVE_STATES_TUPLE = tuple(str(s) for s in LIVE_STATES)
RUNNING_STATES_TUPLE = tuple(str(s) for s in RUNNING_STATES)
_PROJECT_COLUMNS = "name, created_at, " + ", ".join(QUOTA_FIELDS)
_KEY_COLUMNS = (
    "id, project, name, role, secret_sha256, created_at, created_by, expires_at, "
    "revoked_at, last_used_at"
)


def _project(r: tuple[Any, ...]) -> ProjectRow:
    return ProjectRow(str(r[0]), float(r[1]), dict(zip(QUOTA_FIELDS, r[2:], strict=True)))


def _key(r: tuple[Any, ...]) -> KeyRow:
    return KeyRow(*r)


class ProjectStore:
    def __init__(self, store: Store) -> None:
        self._store = store

    # -- projects ----------------------------------------------------------------------

    def insert(self, row: ProjectRow) -> None:
        try:
            with self._store.transaction() as db:
                db.execute(
                    f"INSERT INTO projects ({_PROJECT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)",
                    (row.name, row.created_at, *(row.quotas.get(q) for q in QUOTA_FIELDS)),
                )
        except Conflict:
            raise Conflict(f"a project named {row.name!r} already exists") from None

    def get(self, name: str) -> ProjectRow | None:
        with self._store.transaction() as db:
            r = db.execute(
                f"SELECT {_PROJECT_COLUMNS} FROM projects WHERE name = ?", (name,)
            ).fetchone()
        return _project(r) if r else None

    def all(self) -> list[ProjectRow]:
        with self._store.transaction() as db:
            rows = db.execute(f"SELECT {_PROJECT_COLUMNS} FROM projects ORDER BY name").fetchall()
        return [_project(r) for r in rows]

    def set_quotas(self, name: str, quotas: dict[str, int | None]) -> None:
        unknown = set(quotas) - set(QUOTA_FIELDS)
        if unknown:
            raise ValueError(f"not quotas: {sorted(unknown)}")
        if not quotas:
            return
        sets = ", ".join(f"{q} = ?" for q in quotas)
        with self._store.transaction() as db:
            db.execute(f"UPDATE projects SET {sets} WHERE name = ?", (*quotas.values(), name))

    def holdings(self, name: str) -> dict[str, int]:
        """What the project still holds, by kind (only kinds with some)."""
        live = ", ".join("?" for _ in LIVE_STATES_TUPLE)
        queries = {
            "sandboxes": (
                f"SELECT COUNT(*) FROM sandboxes WHERE project = ? AND state IN ({live})",
                (name, *LIVE_STATES_TUPLE),
            ),
            "snapshots": ("SELECT COUNT(*) FROM snapshots WHERE project = ?", (name,)),
            "networks": ("SELECT COUNT(*) FROM networks WHERE project = ?", (name,)),
            "images": ("SELECT COUNT(*) FROM images WHERE project = ?", (name,)),
            "volumes": ("SELECT COUNT(*) FROM volumes WHERE project = ?", (name,)),
            "secrets": ("SELECT COUNT(*) FROM secrets WHERE project = ?", (name,)),
            "keys": (
                "SELECT COUNT(*) FROM api_keys WHERE project = ? AND revoked_at IS NULL",
                (name,),
            ),
        }
        out: dict[str, int] = {}
        with self._store.transaction() as db:
            for kind, (sql, params) in queries.items():
                n = int(db.execute(sql, params).fetchone()[0])
                if n:
                    out[kind] = n
        return out

    def delete(self, name: str) -> None:
        """Delete the project and its revoked keys (the caller checked it holds nothing)."""
        with self._store.transaction() as db:
            db.execute("DELETE FROM api_keys WHERE project = ?", (name,))
            db.execute("DELETE FROM projects WHERE name = ?", (name,))

    def use(self, name: str) -> ProjectUse:
        live = ", ".join("?" for _ in LIVE_STATES_TUPLE)
        running = ", ".join("?" for _ in RUNNING_STATES_TUPLE)
        with self._store.transaction() as db:
            count, vcpus, memory = db.execute(
                f"SELECT COUNT(*), "
                f"COALESCE(SUM(CASE WHEN state IN ({running}) THEN vcpus ELSE 0 END), 0), "
                f"COALESCE(SUM(CASE WHEN state IN ({running}) THEN memory_mib ELSE 0 END), 0) "
                f"FROM sandboxes WHERE project = ? AND state IN ({live})",
                (*RUNNING_STATES_TUPLE, *RUNNING_STATES_TUPLE, name, *LIVE_STATES_TUPLE),
            ).fetchone()
            (snap_bytes,) = db.execute(
                "SELECT COALESCE(SUM(size_bytes), 0) FROM snapshots WHERE project = ?", (name,)
            ).fetchone()
        return ProjectUse(int(count), int(vcpus), int(memory), int(snap_bytes))

    # -- keys --------------------------------------------------------------------------

    def insert_key(self, row: KeyRow) -> None:
        with self._store.transaction() as db:
            db.execute(
                f"INSERT INTO api_keys ({_KEY_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (row.id, row.project, row.name, row.role, row.secret_sha256, row.created_at,
                 row.created_by, row.expires_at, row.revoked_at, row.last_used_at),
            )  # fmt: skip

    def key(self, key_id: str) -> KeyRow | None:
        with self._store.transaction() as db:
            r = db.execute(
                f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE id = ?", (key_id,)
            ).fetchone()
        return _key(r) if r else None

    def keys(self, project: str) -> list[KeyRow]:
        with self._store.transaction() as db:
            rows = db.execute(
                f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE project = ? ORDER BY created_at, id",
                (project,),
            ).fetchall()
        return [_key(r) for r in rows]

    def revoke(self, key_id: str, at: float) -> None:
        with self._store.transaction() as db:
            db.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                (at, key_id),
            )

    def touch(self, key_id: str, at: float) -> None:
        with self._store.transaction() as db:
            db.execute("UPDATE api_keys SET last_used_at = ? WHERE id = ?", (at, key_id))
