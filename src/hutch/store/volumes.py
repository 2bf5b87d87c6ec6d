"""The volumes table and the mounts that hold them. Same database as ``hutch.store.db``.

A volume row exists only once its file is complete (the file is made under a temporary
name and renamed first; ``hutch.storage.volumes``), and names the host whose disk holds
that file (``host``; several hosts share the database). A mount row says sandbox S uses
volume V at a path; it is written with S's create and removed by S's teardown, and a
volume with a mount row cannot be deleted (checked in the delete's own transaction).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hutch.contract.volumes import VolumeKind
from hutch.errors import Conflict
from hutch.store.db import Store

__all__ = ["MountRow", "VolumeRow", "VolumeStore", "new_volume_id"]

_COLUMNS = "id, project, name, kind, size_bytes, created_at, host"


def new_volume_id() -> str:
    return "vol-" + secrets.token_hex(6)


@dataclass(frozen=True)
class VolumeRow:
    id: str
    project: str
    name: str
    kind: VolumeKind
    size_bytes: int
    created_at: float
    #: The host whose disk holds the file; None: a volume made before hosts were
    #: recorded that no host has claimed yet (:meth:`VolumeStore.claim_unhomed`).
    host: str | None = None


@dataclass(frozen=True)
class MountRow:
    volume_id: str
    sandbox_id: str
    path: str
    read_only: bool
    #: Position among the sandbox's volumes: its drive is ``vol<slot>`` in QEMU.
    slot: int


def _volume(r: tuple[Any, ...]) -> VolumeRow:
    vid, project, name, kind, size, created, host = r
    return VolumeRow(vid, project, name, VolumeKind(kind), int(size), float(created), host)


def _mount(r: tuple[Any, ...]) -> MountRow:
    vid, sid, path, ro, slot = r
    return MountRow(vid, sid, path, bool(ro), int(slot))


class VolumeStore:
    def __init__(self, store: Store) -> None:
        self._store = store

    def insert(self, row: VolumeRow) -> None:
        """``Conflict`` if the project has a volume of that name."""
        try:
            with self._store.transaction() as db:
                db.execute(
                    f"INSERT INTO volumes ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (row.id, row.project, row.name, row.kind.value, row.size_bytes,
                     row.created_at, row.host),
                )  # fmt: skip
        except Conflict:
            raise Conflict(
                f"a volume named {row.name!r} already exists in project {row.project!r}; "
                "delete it first or pick another name"
            ) from None

    def get(self, project: str, ref: str) -> VolumeRow | None:
        """By id or name, in ``project`` only (another project's volume is not found)."""
        with self._store.transaction() as db:
            r = db.execute(
                f"SELECT {_COLUMNS} FROM volumes WHERE project = ? AND (id = ? OR name = ?)",
                (project, ref, ref),
            ).fetchone()
        return _volume(r) if r else None

    def get_by_id(self, volume_id: str) -> VolumeRow | None:
        with self._store.transaction() as db:
            r = db.execute(f"SELECT {_COLUMNS} FROM volumes WHERE id = ?", (volume_id,)).fetchone()
        return _volume(r) if r else None

    def list_volumes(self, project: str | None) -> list[VolumeRow]:
        """The project's volumes by name; ``None``: every project's."""
        with self._store.transaction() as db:
            if project is None:
                rows = db.execute(f"SELECT {_COLUMNS} FROM volumes ORDER BY project, name")
            else:
                rows = db.execute(
                    f"SELECT {_COLUMNS} FROM volumes WHERE project = ? ORDER BY name", (project,)
                )
            return [_volume(r) for r in rows.fetchall()]

    def all_ids(self) -> set[str]:
        with self._store.transaction() as db:
            return {r[0] for r in db.execute("SELECT id FROM volumes").fetchall()}

    def claim_unhomed(self, host: str, volume_ids: set[str]) -> list[str]:
        """Record ``host`` as the home of those of ``volume_ids`` (the files in its state
        directory) that no host has claimed yet (rows from before hosts were recorded);
        the ids claimed."""
        claimed: list[str] = []
        with self._store.transaction() as db:
            for vid in sorted(volume_ids):
                cur = db.execute(
                    "UPDATE volumes SET host = ? WHERE id = ? AND host IS NULL", (host, vid)
                )
                if cur.rowcount:
                    claimed.append(vid)
        return claimed

    def set_size(self, volume_id: str, size_bytes: int) -> None:
        with self._store.transaction() as db:
            db.execute("UPDATE volumes SET size_bytes = ? WHERE id = ?", (size_bytes, volume_id))

    def delete(self, volume_id: str) -> None:
        """Remove the row; ``Conflict`` naming the sandboxes while any mounts it (checked
        in the same transaction as the delete)."""
        with self._store.transaction() as db:
            users = [
                r[0]
                for r in db.execute(
                    "SELECT sandbox_id FROM volume_mounts WHERE volume_id = ? ORDER BY sandbox_id",
                    (volume_id,),
                ).fetchall()
            ]
            if not users:
                db.execute("DELETE FROM volumes WHERE id = ?", (volume_id,))
        if users:
            raise Conflict(
                f"volume {volume_id} is mounted by sandbox(es) {', '.join(users)}; "
                "delete them first"
            )

    # -- mounts -------------------------------------------------------------------------

    def attach(self, sandbox_id: str, mounts: Sequence[MountRow], host: str) -> None:
        """Record ``mounts`` of ``sandbox_id``, which runs on ``host``, in one
        transaction; ``Conflict`` if an exclusive volume among them is mounted by
        another sandbox already, or if a volume's file is on another host."""
        with self._store.transaction() as db:
            for m in mounts:
                # The volume's row stays locked until the commit: two sandboxes taking
                # one exclusive volume at once (two hosts) check one after the other.
                found = db.execute(
                    "SELECT kind, host FROM volumes WHERE id = ?" + db.dialect.for_update,
                    (m.volume_id,),
                ).fetchone()
                if found is None:
                    raise Conflict(f"volume {m.volume_id} was deleted meanwhile")
                if found[1] not in (None, host):
                    raise Conflict(
                        f"volume {m.volume_id} is on host {found[1]}, not on host {host}; a "
                        "sandbox mounts volumes of the host it runs on (create it again: "
                        "it is placed on the volume's host)"
                    )
                if found[0] == VolumeKind.EXCLUSIVE.value:
                    other = db.execute(
                        "SELECT sandbox_id FROM volume_mounts WHERE volume_id = ? "
                        "AND sandbox_id != ?",
                        (m.volume_id, sandbox_id),
                    ).fetchone()
                    if other is not None:
                        raise Conflict(
                            f"exclusive volume {m.volume_id} is mounted by sandbox {other[0]}; "
                            "an exclusive volume is attached to one sandbox at a time "
                            "(delete that sandbox first, or use a shared volume)"
                        )
                db.execute(
                    "INSERT INTO volume_mounts "
                    "(volume_id, sandbox_id, path, read_only, slot) VALUES (?, ?, ?, ?, ?) "
                    "ON CONFLICT (volume_id, sandbox_id) DO UPDATE SET path = excluded.path, "
                    "read_only = excluded.read_only, slot = excluded.slot",
                    (m.volume_id, sandbox_id, m.path, int(m.read_only), m.slot),
                )

    def release(self, sandbox_id: str) -> int:
        """Drop every mount of ``sandbox_id`` (safe to call twice); how many there were."""
        with self._store.transaction() as db:
            cur = db.execute("DELETE FROM volume_mounts WHERE sandbox_id = ?", (sandbox_id,))
            return int(cur.rowcount)

    def mounts_of_sandbox(self, sandbox_id: str) -> list[MountRow]:
        with self._store.transaction() as db:
            rows = db.execute(
                "SELECT volume_id, sandbox_id, path, read_only, slot FROM volume_mounts "
                "WHERE sandbox_id = ? ORDER BY slot",
                (sandbox_id,),
            ).fetchall()
        return [_mount(r) for r in rows]

    def mounts_of_volume(self, volume_id: str) -> list[MountRow]:
        with self._store.transaction() as db:
            rows = db.execute(
                "SELECT volume_id, sandbox_id, path, read_only, slot FROM volume_mounts "
                "WHERE volume_id = ? ORDER BY sandbox_id",
                (volume_id,),
            ).fetchall()
        return [_mount(r) for r in rows]

    def mounting_sandboxes(self) -> set[str]:
        with self._store.transaction() as db:
            return {r[0] for r in db.execute("SELECT sandbox_id FROM volume_mounts").fetchall()}
