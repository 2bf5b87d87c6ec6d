"""The secrets table. Same database and transactions as ``hutch.store.db``.

A row is the current version of one secret of a project: the AEAD nonce and ciphertext
(sealed by ``hutch.services.secret_box``, never a value in clear), the id of the key that
sealed it, the version (1 at create, +1 at each replace) and when it was created and last
replaced. Older versions are not kept: a replaced value is gone.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hutch.store.backend import Conn
from hutch.store.db import LIVE_STATES, Store

__all__ = ["SealedValue", "SecretRow", "SecretStore"]

_COLUMNS = "project, name, version, key_id, nonce, ciphertext, created_at, updated_at"


@dataclass(frozen=True)
class SealedValue:
    """What the store keeps of a value: the key id, the nonce and the ciphertext (tag
    included)."""

    key_id: str
    nonce: bytes
    ciphertext: bytes


@dataclass(frozen=True)
class SecretRow:
    project: str
    name: str
    version: int
    sealed: SealedValue
    created_at: float
    updated_at: float


def _row(r: tuple[Any, ...]) -> SecretRow:
    project, name, version, key_id, nonce, ciphertext, created, updated = r
    return SecretRow(
        project=project,
        name=name,
        version=int(version),
        sealed=SealedValue(key_id, bytes(nonce), bytes(ciphertext)),
        created_at=float(created),
        updated_at=float(updated),
    )


class SecretStore:
    def __init__(self, store: Store) -> None:
        self._store = store

    def put(
        self, project: str, name: str, seal: Callable[[int], SealedValue], now: float
    ) -> SecretRow:
        """Write the next version of (project, name): ``seal(version)`` seals the value
        for that version, inside the transaction, so two concurrent replaces cannot
        both write the same version."""
        with self._store.transaction() as db:
            cur = db.execute(
                "SELECT version, created_at FROM secrets WHERE project = ? AND name = ?"
                + db.dialect.for_update,
                (project, name),
            ).fetchone()
            version = 1 if cur is None else int(cur[0]) + 1
            created = now if cur is None else float(cur[1])
            sealed = seal(version)
            db.execute(
                f"INSERT INTO secrets ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (project, name) DO UPDATE SET version = excluded.version, "
                "key_id = excluded.key_id, nonce = excluded.nonce, "
                "ciphertext = excluded.ciphertext, updated_at = excluded.updated_at",
                (project, name, version, sealed.key_id, sealed.nonce, sealed.ciphertext,
                 created, now),
            )  # fmt: skip
        return SecretRow(project, name, version, sealed, created, now)

    def get(self, project: str, name: str) -> SecretRow | None:
        with self._store.transaction() as db:
            r = db.execute(
                f"SELECT {_COLUMNS} FROM secrets WHERE project = ? AND name = ?", (project, name)
            ).fetchone()
        return _row(r) if r else None

    def list(self, project: str) -> list[SecretRow]:
        with self._store.transaction() as db:
            rows = db.execute(
                f"SELECT {_COLUMNS} FROM secrets WHERE project = ? ORDER BY name", (project,)
            ).fetchall()
        return [_row(r) for r in rows]

    def count(self) -> int:
        """Secrets of every project (a missing key file is only recreated when 0)."""
        with self._store.transaction() as db:
            return int(db.execute("SELECT COUNT(*) FROM secrets").fetchone()[0])

    def key_ids(self) -> set[str]:
        """The ids of the keys the stored secrets were sealed with."""
        with self._store.transaction() as db:
            return {r[0] for r in db.execute("SELECT DISTINCT key_id FROM secrets")}

    def delete(self, project: str, name: str) -> tuple[bool, builtins.list[str]]:
        """Delete (project, name) unless live sandboxes name it in their env_secrets:
        (deleted, users), read and written in one transaction; with users, nothing is
        deleted."""
        with self._store.transaction() as db:
            found = _users(db, project, name)
            if found:
                return False, found
            cur = db.execute("DELETE FROM secrets WHERE project = ? AND name = ?", (project, name))
            return cur.rowcount > 0, []

    def users(self, project: str, name: str) -> builtins.list[str]:
        """Ids of the live sandboxes of ``project`` whose env_secrets name ``name``."""
        with self._store.transaction() as db:
            return _users(db, project, name)


def _users(db: Conn, project: str, name: str) -> list[str]:
    live = ", ".join("?" for _ in LIVE_STATES)
    rows = db.execute(
        f"SELECT id, env_secrets_json FROM sandboxes WHERE project = ? AND state IN ({live}) "
        "AND env_secrets_json != '{}' ORDER BY created_at, id",
        (project, *(str(s) for s in LIVE_STATES)),
    ).fetchall()
    return [sid for sid, refs in rows if name in json.loads(refs).values()]
