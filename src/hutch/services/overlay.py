"""Private networks across hosts, as rows: what this host needs to know of the members
on the other hosts (pure; :class:`hutch.services.network.NetworkService` reads the rows
from the shared store, calls :func:`overlay_of` and pushes the result to the host).

Each host knows its own members; the others' come from the shared database: their
leases (``net_leases``: host, block) and the hosts' ends of the overlay
(``net_tunnels``: underlay address, port, MAC, sandbox pool), so a remote member's
guest address is its host's pool's block. Nothing here is sent between hosts but
through the database, polled every :data:`POLL_S` seconds.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network

from hutch.errors import InvalidArgument
from hutch.net.addressing import AddressPool
from hutch.net.tunnel import TunnelPeer, TunnelState
from hutch.store.net import RemoteMember, TunnelRow

__all__ = ["POLL_S", "Overlay", "overlay_of"]

#: How often a host reads the other hosts' members (a member that joins on another
#: host is reachable from here at most this much later).
POLL_S = 1.0


@dataclass(frozen=True)
class Overlay:
    """The other hosts as this host sees them: the members of each network that run
    elsewhere (network id -> sandbox id -> guest address), what the tunnel carries,
    and the other hosts' pools and endpoints (always denied to this host's guests)."""

    members: Mapping[str, Mapping[str, IPv4Address]] = field(default_factory=dict)
    tunnel: TunnelState = field(default_factory=TunnelState)
    pools: tuple[IPv4Network, ...] = ()
    endpoints: tuple[IPv4Address, ...] = ()


def overlay_of(
    local: Collection[str],
    memberships: Mapping[str, Iterable[str]],
    remote: Iterable[RemoteMember],
    tunnels: Iterable[TunnelRow],
) -> Overlay:
    """``local``: this host's attached sandbox ids; ``memberships``: every network's
    members (cluster-wide); ``remote``: members leased on other hosts; ``tunnels``: the
    other live hosts' ends. Members of a host with no end (or a bad pool) are left out:
    unreachable from here, as before the tunnel."""
    ends = {t.host: t for t in tunnels if _ipv4(t.address)}
    pools: dict[str, AddressPool] = {}
    for host, end in ends.items():
        try:
            pools[host] = AddressPool(end.pool)
        except InvalidArgument:
            continue
    members: dict[str, dict[str, IPv4Address]] = {}
    hosts_of: dict[IPv4Address, str] = {}
    for m in remote:
        pool = pools.get(m.host)
        if pool is None:
            continue
        try:
            address = pool.block(m.block).guest
        except InvalidArgument:
            continue
        members.setdefault(m.network_id, {})[m.sandbox_id] = address
        hosts_of[address] = m.host
    here = set(local)
    routed: dict[IPv4Address, str] = {}
    for nid, addresses in members.items():
        if here & set(memberships.get(nid, ())):
            for address in addresses.values():
                routed[address] = hosts_of[address]
    peers = tuple(
        sorted(
            TunnelPeer(h, IPv4Address(ends[h].address), ends[h].port, ends[h].mac)
            for h in set(routed.values())
        )
    )
    return Overlay(
        members=members,
        tunnel=TunnelState(peers, tuple(sorted(routed.items()))),
        pools=tuple(sorted(p.network for p in pools.values())),
        endpoints=tuple(sorted({IPv4Address(e.address) for e in ends.values()})),
    )


def _ipv4(text: str) -> bool:
    try:
        IPv4Address(text)
    except ValueError:
        return False
    return True
