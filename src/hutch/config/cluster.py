"""This hutchd as a host of a cluster (ARCHITECTURE.md, "Many hosts"): its role, id,
address, labels, lease and the cluster secret."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hutch.config.env import _ENV_OF, _number
from hutch.errors import InvalidArgument

if TYPE_CHECKING:
    from hutch.config.settings import Settings

#: several hutchds sharing one database; ARCHITECTURE.md, "Many hosts").
HOST_ROLES = ("single", "worker")
#: Seconds a host's lease lasts without a renewal before another host marks it down.
HOST_LEASE_S_RANGE = (2.0, 3600.0)


@dataclass(frozen=True)
class ClusterSettings:
    """This hutchd as a host of a cluster (``hutch.services.cluster``).

    - ``role``: ``single`` or ``worker``. A single host registers itself too (so
      ``hutch host ls`` works on one machine), as host ``local``.
    - ``host_id``: the host's id in the ``hosts`` table; a worker's default is
      ``<hostname>-<daemon tag>``. Two hutchds on one database must not share it.
    - ``address``: the URL the other hutchds reach this one's API at (default: its
      listen address); where sandboxes' egress cannot go (the host's own addresses).
    - ``labels``: ``key=value`` pairs that creates pin to (``placement.labels``).
    - ``lease_s``: a lease not renewed for this long marks the host down; renewed every
      third of it.
    - ``secret_path``: the cluster secret that signs host-to-host calls; every host of a
      cluster holds the same file (0600). Created on first start when missing.
    - ``shared_db``: one SQLite file shared by the hutchds of one machine (WAL), until
      the PostgreSQL store takes ``HUTCH_DATABASE_URL``; None: ``<state>/hutch.db``.
    """

    role: str = "single"
    host_id: str = ""
    address: str = ""
    labels: tuple[tuple[str, str], ...] = ()
    lease_s: float = 15.0
    secret_path: Path | None = None
    shared_db: Path | None = None
    # -- the overlay between hosts (hutch.net.tunnel; private networks across hosts) --
    #: UDP port of this host's VXLAN end (``HUTCH_TUNNEL_PORT``, e.g. 4789); None or 0
    #: = off (the default until the data path is proven: ARCHITECTURE.md, "Private
    #: networks across hosts").
    tunnel_port: int | None = None
    #: Underlay IPv4 address of this host's end (``HUTCH_TUNNEL_ADDRESS``); "" = the
    #: host of ``address`` (resolved at start).
    tunnel_address: str = ""

    @property
    def worker(self) -> bool:
        return self.role == "worker"

    @property
    def tunnel_udp_port(self) -> int:
        """The tunnel's UDP port; 0 = no tunnel."""
        return self.tunnel_port or 0


def parse_labels(value: str, name: str = "HUTCH_HOST_LABELS") -> tuple[tuple[str, str], ...]:
    """``k=v,k2=v2`` -> sorted pairs; InvalidArgument names a bad pair."""
    pairs: dict[str, str] = {}
    for item in (p.strip() for p in value.split(",")):
        if not item:
            continue
        key, sep, val = item.partition("=")
        if not sep or not _LABEL_RE.match(key) or not _LABEL_RE.match(val):
            raise InvalidArgument(
                f"{name}: {item!r} is not key=value (letters, digits, '.', '_', '-', "
                "'/'; 1-63 characters each)"
            )
        pairs[key] = val
    return tuple(sorted(pairs.items()))


_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")


#: The cluster's settings (:class:`ClusterSettings`), by their config-file key.
CLUSTER_KEYS = (
    "role", "host_id", "host_address", "host_labels", "host_lease_s", "cluster_secret_file",
    "shared_db", "tunnel_port", "tunnel_address",
)  # fmt: skip


def _cluster_settings(s: Settings, values: dict[str, Any], source: str) -> Settings:
    def shown(key: str) -> str:
        return _ENV_OF.get(key, key) if source == "environment" else f"{source}: {key}"

    c = s.cluster
    if "role" in values:
        role = str(values["role"]).strip().lower()
        if role not in HOST_ROLES:
            raise InvalidArgument(
                f"{shown('role')}={values['role']!r}; accepted: {', '.join(HOST_ROLES)}"
            )
        c = replace(c, role=role)
    if "host_id" in values:
        host_id = str(values["host_id"]).strip()
        if not _LABEL_RE.match(host_id) or "/" in host_id:
            raise InvalidArgument(
                f"{shown('host_id')}={host_id!r}; use 1-63 letters, digits, '.', '_', '-'"
            )
        c = replace(c, host_id=host_id)
    if "host_address" in values:
        address = str(values["host_address"]).strip().rstrip("/")
        if not re.match(r"^https?://[^/\s]+$", address):
            raise InvalidArgument(
                f"{shown('host_address')}={address!r}; use http://HOST:PORT (or https://)"
            )
        c = replace(c, address=address)
    if "host_labels" in values:
        c = replace(c, labels=parse_labels(str(values["host_labels"]), shown("host_labels")))
    if "host_lease_s" in values:
        lease = _number(values, "host_lease_s", float, source)
        lo, hi = HOST_LEASE_S_RANGE
        if not lo <= lease <= hi:
            raise InvalidArgument(f"{shown('host_lease_s')}={lease:g}; accepted: {lo:g}-{hi:g} s")
        c = replace(c, lease_s=lease)
    if "cluster_secret_file" in values:
        c = replace(c, secret_path=Path(str(values["cluster_secret_file"])).resolve())
    if "shared_db" in values:
        c = replace(c, shared_db=Path(str(values["shared_db"])).resolve())
    # -- the overlay between hosts --
    if "tunnel_port" in values:
        port = _number(values, "tunnel_port", int, source)
        if not 0 <= port <= 65535:
            raise InvalidArgument(f"{shown('tunnel_port')}={port}; accepted: 0 (off) or 1-65535")
        c = replace(c, tunnel_port=port)
    if "tunnel_address" in values:
        text = str(values["tunnel_address"]).strip()
        try:
            ipaddress.IPv4Address(text)
        except ValueError as exc:
            raise InvalidArgument(
                f"{shown('tunnel_address')}={text!r}; use this host's IPv4 address on the "
                "network between the hosts"
            ) from exc
        c = replace(c, tunnel_address=text)
    return replace(s, cluster=c)
