"""The networking tables: address leases, egress rules, private networks and their
members, exposed ports. Same database and transactions as ``hutch.store.db``."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from hutch.contract.auth import DEFAULT_PROJECT
from hutch.errors import Conflict
from hutch.store.db import Store

__all__ = ["Lease", "NetStore", "NetworkRow", "RemoteMember", "TunnelRow"]


@dataclass(frozen=True)
class Lease:
    sandbox_id: str
    block: int
    tap: str


@dataclass(frozen=True)
class NetworkRow:
    id: str
    name: str
    created_at: float
    project: str = DEFAULT_PROJECT


@dataclass(frozen=True)
class TunnelRow:
    """One host's end of the overlay between hosts (``net_tunnels``)."""

    host: str
    address: str
    port: int
    mac: str
    pool: str


@dataclass(frozen=True)
class RemoteMember:
    """A member of a private network whose address lease is on another host."""

    network_id: str
    sandbox_id: str
    host: str
    block: int


class NetStore:
    """``host``: the host whose address leases these are (each host of a cluster has
    its own pool and taps; the other tables are the cluster's)."""

    def __init__(self, store: Store, host: str = "local") -> None:
        self._store = store
        self.host = host

    def _rows(self, sql: str, *params: object) -> list[tuple[object, ...]]:
        with self._store.transaction() as db:
            return list(db.execute(sql, params).fetchall())

    # -- leases --------------------------------------------------------------------------

    def add_lease(self, sandbox_id: str, block: int, tap: str) -> None:
        with self._store.transaction() as db:
            db.execute(
                "INSERT INTO net_leases (sandbox_id, block, tap, host) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (sandbox_id) DO UPDATE SET block = excluded.block, "
                "tap = excluded.tap, host = excluded.host",
                (sandbox_id, block, tap, self.host),
            )

    def remove_lease(self, sandbox_id: str) -> None:
        self._rows("DELETE FROM net_leases WHERE sandbox_id = ?", sandbox_id)

    def leases(self) -> dict[str, Lease]:
        rows = self._rows("SELECT sandbox_id, block, tap FROM net_leases WHERE host = ?", self.host)
        return {str(r[0]): Lease(str(r[0]), int(str(r[1])), str(r[2])) for r in rows}

    def other_host_lease(self, sandbox_id: str) -> tuple[int, str] | None:
        """The block and the pool (its host's ``HUTCH_NET_POOL``) of ``sandbox_id``'s
        lease when another host holds it; None when none does (or its pool is unknown:
        a host registered before migration 16)."""
        rows = self._rows(
            "SELECT l.block, h.net_pool FROM net_leases l JOIN hosts h ON h.id = l.host "
            "WHERE l.sandbox_id = ? AND l.host != ? AND h.net_pool != ''",
            sandbox_id,
            self.host,
        )
        return (int(str(rows[0][0])), str(rows[0][1])) if rows else None

    # -- egress rules --------------------------------------------------------------------

    def set_rules(self, sandbox_id: str, rules: list[str] | dict[str, Any]) -> None:
        """Today's rule list, or an ordered policy's document (``hutch.net.rules``)."""
        with self._store.transaction() as db:
            db.execute(
                "INSERT INTO egress_rules (sandbox_id, rules_json, updated_at) "
                "VALUES (?, ?, ?) ON CONFLICT (sandbox_id) DO UPDATE SET "
                "rules_json = excluded.rules_json, updated_at = excluded.updated_at",
                (sandbox_id, json.dumps(rules), time.time()),
            )

    def rules(self, sandbox_id: str) -> list[str] | dict[str, Any]:
        rows = self._rows("SELECT rules_json FROM egress_rules WHERE sandbox_id = ?", sandbox_id)
        if not rows:
            return []
        stored = json.loads(str(rows[0][0]))
        return dict(stored) if isinstance(stored, dict) else list(stored)

    def remove_rules(self, sandbox_id: str) -> None:
        self._rows("DELETE FROM egress_rules WHERE sandbox_id = ?", sandbox_id)

    # -- private networks ----------------------------------------------------------------

    def insert_network(self, row: NetworkRow) -> None:
        try:
            self._rows(
                "INSERT INTO networks (id, name, created_at, project) VALUES (?, ?, ?, ?)",
                row.id,
                row.name,
                row.created_at,
                row.project,
            )
        except Conflict as exc:
            raise Conflict(
                f"a network named {row.name!r} already exists; choose another name"
            ) from exc

    def network(self, id_or_name: str, project: str) -> NetworkRow | None:
        """By id or name, in ``project`` only."""
        rows = self._rows(
            "SELECT id, name, created_at, project FROM networks "
            "WHERE (id = ? OR name = ?) AND project = ?",
            id_or_name,
            id_or_name,
            project,
        )
        return _network(rows[0]) if rows else None

    def networks(self, project: str | None = None) -> list[NetworkRow]:
        """``project``'s networks; None: every project's."""
        if project is None:
            rows = self._rows(
                "SELECT id, name, created_at, project FROM networks ORDER BY created_at"
            )
        else:
            rows = self._rows(
                "SELECT id, name, created_at, project FROM networks WHERE project = ? "
                "ORDER BY created_at",
                project,
            )
        return [_network(r) for r in rows]

    def delete_network(self, network_id: str) -> None:
        with self._store.transaction() as db:
            members = [
                str(r[0])
                for r in db.execute(
                    "SELECT sandbox_id FROM network_members WHERE network_id = ? "
                    "ORDER BY sandbox_id",
                    (network_id,),
                )
            ]
            if members:
                raise Conflict(
                    f"network {network_id} is in use by {', '.join(members)}; take them "
                    "off it (DELETE /v1/sandboxes/{id}/networks/" + network_id + ") or "
                    "delete them first"
                )
            db.execute("DELETE FROM networks WHERE id = ?", (network_id,))

    def add_member(self, network_id: str, sandbox_id: str) -> None:
        self._rows(
            "INSERT INTO network_members (network_id, sandbox_id) VALUES (?, ?) "
            "ON CONFLICT DO NOTHING",
            network_id,
            sandbox_id,
        )

    def remove_member(self, network_id: str, sandbox_id: str) -> None:
        self._rows(
            "DELETE FROM network_members WHERE network_id = ? AND sandbox_id = ?",
            network_id,
            sandbox_id,
        )

    def members(self, network_id: str) -> list[str]:
        rows = self._rows(
            "SELECT sandbox_id FROM network_members WHERE network_id = ? ORDER BY sandbox_id",
            network_id,
        )
        return [str(r[0]) for r in rows]

    def memberships(self) -> dict[str, list[str]]:
        """Every network id with its member sandbox ids (networks without members too)."""
        out: dict[str, list[str]] = {n.id: [] for n in self.networks()}
        for nid, sid in self._rows("SELECT network_id, sandbox_id FROM network_members"):
            out.setdefault(str(nid), []).append(str(sid))
        return out

    def networks_of(self, sandbox_id: str) -> list[str]:
        rows = self._rows(
            "SELECT network_id FROM network_members WHERE sandbox_id = ? ORDER BY network_id",
            sandbox_id,
        )
        return [str(r[0]) for r in rows]

    # -- exposed ports -------------------------------------------------------------------

    def add_port(self, sandbox_id: str, guest_port: int, host_port: int) -> None:
        self._rows(
            "INSERT INTO exposed_ports (sandbox_id, guest_port, host_port) VALUES (?, ?, ?) "
            "ON CONFLICT (sandbox_id, guest_port) DO UPDATE SET host_port = excluded.host_port",
            sandbox_id,
            guest_port,
            host_port,
        )

    def remove_port(self, sandbox_id: str, guest_port: int) -> None:
        self._rows(
            "DELETE FROM exposed_ports WHERE sandbox_id = ? AND guest_port = ?",
            sandbox_id,
            guest_port,
        )

    def ports(self, sandbox_id: str | None = None) -> list[tuple[str, int, int]]:
        """(sandbox id, guest port, host port) of one sandbox, or of all."""
        if sandbox_id is None:
            rows = self._rows("SELECT sandbox_id, guest_port, host_port FROM exposed_ports")
        else:
            rows = self._rows(
                "SELECT sandbox_id, guest_port, host_port FROM exposed_ports "
                "WHERE sandbox_id = ? ORDER BY guest_port",
                sandbox_id,
            )
        return [(str(r[0]), int(str(r[1])), int(str(r[2]))) for r in rows]

    # -- the overlay between hosts ---------------------------------------------------------

    def set_tunnel(self, row: TunnelRow) -> None:
        self._rows(
            "INSERT INTO net_tunnels (host, address, port, mac, pool, updated_at) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (host) DO UPDATE SET "
            "address = excluded.address, port = excluded.port, mac = excluded.mac, "
            "pool = excluded.pool, updated_at = excluded.updated_at",
            row.host,
            row.address,
            row.port,
            row.mac,
            row.pool,
            time.time(),
        )

    def tunnels(self) -> list[TunnelRow]:
        """The other hosts' ends, of hosts not marked down."""
        rows = self._rows(
            "SELECT t.host, t.address, t.port, t.mac, t.pool FROM net_tunnels t "
            "JOIN hosts h ON h.id = t.host WHERE t.host != ? AND h.state != 'down' "
            "ORDER BY t.host",
            self.host,
        )
        return [TunnelRow(str(r[0]), str(r[1]), int(str(r[2])), str(r[3]), str(r[4])) for r in rows]

    def remote_members(self) -> list[RemoteMember]:
        """Members of every network whose lease is on another host."""
        rows = self._rows(
            "SELECT m.network_id, m.sandbox_id, l.host, l.block FROM network_members m "
            "JOIN net_leases l ON l.sandbox_id = m.sandbox_id WHERE l.host != ? "
            "ORDER BY m.network_id, m.sandbox_id",
            self.host,
        )
        return [RemoteMember(str(r[0]), str(r[1]), str(r[2]), int(str(r[3]))) for r in rows]

    # -- a sandbox leaves ----------------------------------------------------------------

    def forget_sandbox(self, sandbox_id: str) -> None:
        """Everything networking keeps for ``sandbox_id``, in one transaction."""
        with self._store.transaction() as db:
            for table in ("net_leases", "egress_rules", "network_members", "exposed_ports"):
                db.execute(f"DELETE FROM {table} WHERE sandbox_id = ?", (sandbox_id,))


def _network(row: tuple[object, ...]) -> NetworkRow:
    return NetworkRow(str(row[0]), str(row[1]), float(str(row[2])), str(row[3]))
