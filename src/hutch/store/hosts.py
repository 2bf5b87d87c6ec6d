"""The hosts of a cluster and the host each sandbox runs on. Same database and
transactions as ``hutch.store.db``; the SQL is what SQLite and PostgreSQL both accept.

A host's liveness is its lease (``lease_until``, renewed by the host itself). Marking a
host down and claiming the sweep of its sandboxes are single conditional ``UPDATE``s,
so when several live hosts notice the same expired lease at once exactly one of them
wins each step (the database's own transactions; no lock service of ours).
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hutch.models import SandboxState
from hutch.store.db import LIVE_STATES, RUNNING_STATES, Store

__all__ = ["HOST_STATES", "BuiltinIdentities", "HostRow", "HostStore", "HostUse", "place_in"]

#: ``up``: takes new sandboxes; ``draining``: keeps its sandboxes, takes no new ones;
#: ``down``: its lease expired (or it stopped); its running sandboxes are lost.
HOST_STATES = ("up", "draining", "down")

_COLUMNS = (
    "id", "address", "role", "state", "vcpus", "memory_mib", "disk_gib", "max_sandboxes",
    "accel", "qemu_version", "cpu_model", "labels_json", "started_at", "renewed_at",
    "lease_until", "down_at", "down_reason", "net_pool",
)  # fmt: skip
#: Read with the row, written by the host on its own (:meth:`HostStore.set_images`),
#: never by a registration: a re-registration keeps what the host published.
_READ_ONLY = ("images_json",)

#: What a host publishes of its built-in images: name -> digest -> rootfs sha256.
BuiltinIdentities = dict[str, dict[str, str]]


@dataclass(frozen=True)
class HostRow:
    """One host as it registered: its capacity (``memory_mib`` is what its sandboxes may
    reserve, ``disk_gib`` the free disk of its state dir at registration) and lease."""

    id: str
    address: str
    role: str
    state: str
    vcpus: int
    memory_mib: int
    disk_gib: int
    max_sandboxes: int
    accel: str
    qemu_version: str
    cpu_model: str
    labels: dict[str, str] = field(default_factory=dict)
    started_at: float = 0.0
    renewed_at: float = 0.0
    lease_until: float = 0.0
    down_at: float | None = None
    down_reason: str | None = None
    #: Its sandbox address pool (HUTCH_NET_POOL, a CIDR; "" before migration 16).
    net_pool: str = ""
    #: The built-in images it holds: name -> digest -> the sha256 of its rootfs.ext4
    #: (``hutch.images.identity``; migration 19). Empty: it published none (yet).
    images: BuiltinIdentities = field(default_factory=dict)


@dataclass(frozen=True)
class HostUse:
    """What a host holds now: live sandboxes (paused ones too), those with a VM, and
    the vCPUs and MiB those with a VM reserve."""

    sandboxes: int = 0
    running: int = 0
    vcpus: int = 0
    memory_mib: int = 0


def place_in(db: Any, sandbox_id: str, host: str) -> None:
    """In the transaction that writes the sandbox's row: it runs on ``host``."""
    db.execute("UPDATE sandboxes SET host = ? WHERE id = ?", (host, sandbox_id))


def _marks(values: Iterable[object]) -> str:
    return ", ".join("?" for _ in values)


class HostStore:
    def __init__(self, store: Store) -> None:
        self._store = store

    # -- the hosts -----------------------------------------------------------------------

    def register(self, row: HostRow) -> None:
        """Insert or refresh ``row`` (a host starting): up, with a fresh lease; a host
        that was down comes back (its sweep is done or no longer needed)."""
        values = _to_row(row)
        updates = ", ".join(f"{c} = excluded.{c}" for c in _COLUMNS if c != "id")
        with self._store.transaction() as db:
            db.execute(
                f"INSERT INTO hosts ({', '.join(_COLUMNS)}, swept) VALUES ({_marks(values)}, 0) "
                f"ON CONFLICT (id) DO UPDATE SET {updates}, swept = 0",
                values,
            )

    def renew(self, host_id: str, now: float, lease_until: float) -> bool:
        """Extend the lease; False when the host was marked down meanwhile (its
        running sandboxes have been reported lost: it must not keep them)."""
        with self._store.transaction() as db:
            cur = db.execute(
                "UPDATE hosts SET renewed_at = ?, lease_until = ? WHERE id = ? AND state != 'down'",
                (now, lease_until, host_id),
            )
            return bool(cur.rowcount)

    def set_state(self, host_id: str, state: str, reason: str | None = None) -> bool:
        """``up`` or ``draining`` (a live host), or ``down`` (a host stopping cleanly,
        with ``reason``). False when there is no such host."""
        if state not in HOST_STATES:
            raise ValueError(f"host state {state!r}; accepted: {HOST_STATES}")
        with self._store.transaction() as db:
            if state == "down":
                cur = db.execute(
                    "UPDATE hosts SET state = 'down', down_at = renewed_at, down_reason = ? "
                    "WHERE id = ?",
                    (reason, host_id),
                )
            else:
                cur = db.execute(
                    "UPDATE hosts SET state = ? WHERE id = ? AND state != 'down'",
                    (state, host_id),
                )
            return bool(cur.rowcount)

    def set_images(self, host_id: str, images: BuiltinIdentities) -> bool:
        """Publish the built-in images ``host_id`` holds (what :attr:`HostRow.images`
        reads back); False when there is no such host (not registered yet)."""
        doc = json.dumps(
            {n: dict(sorted(d.items())) for n, d in sorted(images.items())}, sort_keys=True
        )
        with self._store.transaction() as db:
            cur = db.execute("UPDATE hosts SET images_json = ? WHERE id = ?", (doc, host_id))
            return bool(cur.rowcount)

    def get(self, host_id: str) -> HostRow | None:
        with self._store.transaction() as db:
            row = db.execute(f"SELECT {_SELECT} FROM hosts WHERE id = ?", (host_id,)).fetchone()
        return _from_row(row) if row else None

    def all(self) -> builtins.list[HostRow]:
        with self._store.transaction() as db:
            rows = db.execute(f"SELECT {_SELECT} FROM hosts ORDER BY id").fetchall()
        return [_from_row(r) for r in rows]

    def expire(self, now: float) -> builtins.list[str]:
        """Mark down every host whose lease ended before ``now``; the ids this call
        marked (another host's concurrent call marks the others)."""
        marked: builtins.list[str] = []
        with self._store.transaction() as db:
            rows = db.execute(
                "SELECT id, lease_until FROM hosts WHERE state != 'down' AND lease_until < ?",
                (now,),
            ).fetchall()
            for host_id, lease_until in rows:
                cur = db.execute(
                    "UPDATE hosts SET state = 'down', down_at = ?, down_reason = ? "
                    "WHERE id = ? AND state != 'down' AND lease_until < ?",
                    (now, f"its lease expired at {float(lease_until):.3f}", host_id, now),
                )
                if cur.rowcount:
                    marked.append(str(host_id))
        return marked

    def claim_sweep(self, host_id: str) -> bool:
        """True for the one caller that takes the sweep of a down host's sandboxes."""
        with self._store.transaction() as db:
            cur = db.execute(
                "UPDATE hosts SET swept = 1 WHERE id = ? AND state = 'down' AND swept = 0",
                (host_id,),
            )
            return bool(cur.rowcount)

    def unswept(self) -> builtins.list[str]:
        """Down hosts whose sandboxes nobody has swept yet."""
        with self._store.transaction() as db:
            rows = db.execute("SELECT id FROM hosts WHERE state = 'down' AND swept = 0").fetchall()
        return [str(r[0]) for r in rows]

    # -- the sandboxes on them -------------------------------------------------------------

    def host_of(self, sandbox_id: str) -> str | None:
        with self._store.transaction() as db:
            row = db.execute("SELECT host FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
        return str(row[0]) if row else None

    def move_sandbox(
        self, sandbox_id: str, from_host: str, to_host: str, resume_from: str | None
    ) -> bool:
        """The paused sandbox now lives on ``to_host`` (a cross-host resume took it),
        its pause at ``resume_from`` there; False when its row no longer names
        ``from_host`` or is no longer paused (another host took it first)."""
        with self._store.transaction() as db:
            cur = db.execute(
                "UPDATE sandboxes SET host = ?, resume_from = ? "
                "WHERE id = ? AND host = ? AND state = 'paused'",
                (to_host, resume_from, sandbox_id, from_host),
            )
            return bool(cur.rowcount)

    def host_of_snapshot(self, snapshot_id: str) -> str | None:
        """The host that holds a snapshot's files: the one that saved it (migration 20;
        for a row saved before, the host its sandbox is on)."""
        with self._store.transaction() as db:
            row = db.execute(
                "SELECT COALESCE(n.host, s.host) FROM snapshots n "
                "LEFT JOIN sandboxes s ON s.id = n.sandbox_id WHERE n.id = ?",
                (snapshot_id,),
            ).fetchone()
        return str(row[0]) if row and row[0] is not None else None

    def ids_on(self, host: str, states: Iterable[SandboxState] = LIVE_STATES) -> set[str]:
        wanted = [str(s) for s in states]
        with self._store.transaction() as db:
            rows = db.execute(
                f"SELECT id FROM sandboxes WHERE host = ? AND state IN ({_marks(wanted)})",
                (host, *wanted),
            ).fetchall()
        return {str(r[0]) for r in rows}

    def usage(self) -> dict[str, HostUse]:
        """Host id -> what it holds (hosts with nothing are absent)."""
        live = [str(s) for s in LIVE_STATES]
        running = [str(s) for s in RUNNING_STATES]
        run = f"state IN ({_marks(running)})"
        with self._store.transaction() as db:
            rows = db.execute(
                f"SELECT host, COUNT(*), "
                f"COALESCE(SUM(CASE WHEN {run} THEN 1 ELSE 0 END), 0), "
                f"COALESCE(SUM(CASE WHEN {run} THEN vcpus ELSE 0 END), 0), "
                f"COALESCE(SUM(CASE WHEN {run} THEN memory_mib ELSE 0 END), 0) "
                f"FROM sandboxes WHERE state IN ({_marks(live)}) GROUP BY host",
                (*running, *running, *running, *live),
            ).fetchall()
        return {str(h): HostUse(int(n), int(r), int(v), int(m)) for h, n, r, v, m in rows}


def _to_row(row: HostRow) -> tuple[Any, ...]:
    return (
        row.id, row.address, row.role, row.state, row.vcpus, row.memory_mib, row.disk_gib,
        row.max_sandboxes, row.accel, row.qemu_version, row.cpu_model,
        json.dumps(row.labels, sort_keys=True), row.started_at, row.renewed_at,
        row.lease_until, row.down_at, row.down_reason, row.net_pool,
    )  # fmt: skip


_SELECT = ", ".join((*_COLUMNS, *_READ_ONLY))


def _images(raw: object) -> BuiltinIdentities:
    """``images_json`` as published; anything else (a hand-edited row) is nothing."""
    try:
        doc = json.loads(str(raw))
        return {str(n): {str(d): str(h) for d, h in digests.items()} for n, digests in doc.items()}
    except (ValueError, AttributeError, TypeError):
        return {}


def _from_row(row: tuple[Any, ...]) -> HostRow:
    v = dict(zip((*_COLUMNS, *_READ_ONLY), row, strict=True))
    return HostRow(
        id=str(v["id"]), address=str(v["address"]), role=str(v["role"]), state=str(v["state"]),
        vcpus=int(v["vcpus"]), memory_mib=int(v["memory_mib"]), disk_gib=int(v["disk_gib"]),
        max_sandboxes=int(v["max_sandboxes"]), accel=str(v["accel"]),
        qemu_version=str(v["qemu_version"]), cpu_model=str(v["cpu_model"]),
        labels=dict(json.loads(v["labels_json"])), started_at=float(v["started_at"]),
        renewed_at=float(v["renewed_at"]), lease_until=float(v["lease_until"]),
        down_at=v["down_at"], down_reason=v["down_reason"], net_pool=str(v["net_pool"]),
        images=_images(v["images_json"]),
    )  # fmt: skip
