"""The named egress policies table (per project). Same database and transactions as
``hutch.store.db``. A row holds a policy document in canonical form
(:meth:`hutch.contract.egress_policy.OrderedPolicy.document`); sandboxes get a copy
when it is attached, so editing or deleting a row changes no sandbox."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from hutch.store.db import Store

__all__ = ["EgressPolicyRow", "EgressPolicyStore"]


@dataclass(frozen=True)
class EgressPolicyRow:
    project: str
    name: str
    policy: dict[str, Any]
    created_at: float
    updated_at: float


class EgressPolicyStore:
    def __init__(self, store: Store) -> None:
        self._store = store

    def put(self, project: str, name: str, policy: dict[str, Any]) -> tuple[EgressPolicyRow, bool]:
        """Create or replace; returns the row and whether it was created."""
        now = time.time()
        with self._store.transaction() as db:
            old = db.execute(
                "SELECT created_at FROM egress_policies WHERE project = ? AND name = ?"
                + db.dialect.for_update,
                (project, name),
            ).fetchone()
            created = float(old[0]) if old else now
            db.execute(
                "INSERT INTO egress_policies "
                "(project, name, policy_json, created_at, updated_at) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (project, name) DO UPDATE SET policy_json = excluded.policy_json, "
                "updated_at = excluded.updated_at",
                (project, name, json.dumps(policy), created, now),
            )
        return EgressPolicyRow(project, name, policy, created, now), old is None

    def get(self, project: str, name: str) -> EgressPolicyRow | None:
        with self._store.transaction() as db:
            row = db.execute(
                "SELECT project, name, policy_json, created_at, updated_at FROM egress_policies "
                "WHERE project = ? AND name = ?",
                (project, name),
            ).fetchone()
        return _row(row) if row else None

    def list(self, project: str) -> list[EgressPolicyRow]:
        with self._store.transaction() as db:
            rows = db.execute(
                "SELECT project, name, policy_json, created_at, updated_at FROM egress_policies "
                "WHERE project = ? ORDER BY name",
                (project,),
            ).fetchall()
        return [_row(r) for r in rows]

    def delete(self, project: str, name: str) -> bool:
        with self._store.transaction() as db:
            cur = db.execute(
                "DELETE FROM egress_policies WHERE project = ? AND name = ?", (project, name)
            )
            return cur.rowcount > 0


def _row(r: tuple[Any, ...]) -> EgressPolicyRow:
    project, name, policy, created, updated = r
    return EgressPolicyRow(
        str(project), str(name), json.loads(policy), float(created), float(updated)
    )
