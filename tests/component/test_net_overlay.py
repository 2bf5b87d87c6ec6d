"""Private networks across hosts, in the rows: two NetworkServices (two hosts, each on
the in-memory dataplane) sharing one database learn each other's members from it: the
DNS view, the member sets, the always-denied pools and what the tunnel carries, set up
as members come and torn down as they go. The real data path is not proven yet
(ARCHITECTURE.md, "Private networks across hosts")."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

import pytest

from hutch.config import ClusterSettings, Settings
from hutch.net.dataplane import MemoryDataplane
from hutch.net.rules import EgressPolicy
from hutch.services.network import NetworkService
from hutch.services.overlay import POLL_S
from hutch.store import Store
from hutch.store.hosts import HostRow, HostStore
from tests.component.conftest import until

pytestmark = pytest.mark.timeout(60)

POOLS = {"w1": "10.231.1.0/24", "w2": "10.231.2.0/24"}


@pytest.fixture
async def two_hosts(tmp_path: Path) -> AsyncIterator[dict[str, NetworkService]]:
    shared = tmp_path / "cluster.db"
    made: dict[str, NetworkService] = {}
    try:
        for n, host in enumerate(POOLS, 1):
            settings = Settings(
                state_dir=tmp_path / host,
                net_pool=IPv4Network(POOLS[host]),
                dns_upstream=("127.0.0.1", 9),
                cluster=ClusterSettings(
                    role="worker",
                    host_id=host,
                    address=f"http://127.0.0.1:{17070 + n}",
                    shared_db=shared,
                    tunnel_port=14788 + n,
                ),
            )
            settings.state_dir.mkdir()
            store = Store(settings.database)
            now = time.time()
            HostStore(store).register(
                HostRow(host, settings.host_address, "worker", "up", 1, 1024, 1, 10, "tcg",
                        "7.2", "max", started_at=now, renewed_at=now, lease_until=now + 60,
                        net_pool=POOLS[host])
            )  # fmt: skip
            net = NetworkService(
                settings, store, names=lambda sid: None, dataplane=MemoryDataplane()
            )
            await net.start([])
            made[host] = net
        yield made
    finally:
        for net in made.values():
            await net.close()


def _dataplane(net: NetworkService) -> MemoryDataplane:
    assert isinstance(net.enforcer.dataplane, MemoryDataplane)
    return net.enforcer.dataplane


async def _until(check: Callable[[], bool]) -> None:
    await until(check, "the other host never learned it", POLL_S * 5)


async def test_members_on_two_hosts_learn_each_other_and_the_tunnel_follows(
    two_hosts: dict[str, NetworkService],
) -> None:
    w1, w2 = two_hosts["w1"], two_hosts["w2"]
    nid = w1.create_network("team", "default").id
    await w1.attach("sb-aaaaaaaaaaaa", EgressPolicy.open(), [nid])
    await w2.attach("sb-bbbbbbbbbbbb", EgressPolicy.open(), [nid])
    await w2.attach("sb-cccccccccccc", EgressPolicy.open())  # on no network
    a, b = w1.address_of("sb-aaaaaaaaaaaa"), w2.address_of("sb-bbbbbbbbbbbb")
    assert a is not None and b is not None
    # w2 saw w1's member at once (its own join reads the store); w1 within a poll.
    await _until(lambda: b in _dataplane(w1).networks.get(nid, []))
    assert sorted(_dataplane(w2).networks[nid]) == sorted([a, b])
    # Private DNS answers the member on the other host, by id (and name when it has one).
    info = w1.enforcer.lookup(a)
    assert info is not None and info.peers["sb-bbbbbbbbbbbb"] == b
    info_b = w2.enforcer.lookup(b)
    assert info_b is not None and info_b.peers["sb-aaaaaaaaaaaa"] == a
    # The tunnel carries exactly the other host's member, to w2's end.
    t1 = _dataplane(w1).tunnel
    assert t1.routes == ((b, "w2"),)
    assert [(p.host, p.port) for p in t1.peers] == [("w2", 14790)]
    assert _dataplane(w2).tunnel.routes == ((a, "w1"),)
    # The other host's pool and end are always denied here (sandboxes not peers).
    assert _dataplane(w1).cluster_pools == [IPv4Network(POOLS["w2"])]
    assert _dataplane(w1).tunnel_peers == [IPv4Address("127.0.0.1")]
    # A non-member on w2 is not in any set nor routed from w1.
    c = w2.address_of("sb-cccccccccccc")
    assert c is not None and all(c not in v for v in _dataplane(w1).networks.values())
    # The member on w2 leaves: w1 tears the route (and with the last, the device) down.
    await w2.leave("sb-bbbbbbbbbbbb", nid, "default")
    await _until(lambda: _dataplane(w1).tunnel.empty)
    assert _dataplane(w2).tunnel.empty  # w2 has no member left: nothing to carry
    assert _dataplane(w1).networks[nid] == [a]
    info = w1.enforcer.lookup(a)
    assert info is not None and "sb-bbbbbbbbbbbb" not in info.peers
    # Joined again, then deleted on its host: gone from w1 as well.
    await w2.join("sb-bbbbbbbbbbbb", nid, "default")
    await _until(lambda: not _dataplane(w1).tunnel.empty)
    await w2.detach("sb-bbbbbbbbbbbb")
    await _until(lambda: _dataplane(w1).tunnel.empty)
    await w1.detach("sb-aaaaaaaaaaaa")
    await w2.detach("sb-cccccccccccc")


async def test_any_host_shows_the_guest_address_another_host_leased(
    two_hosts: dict[str, NetworkService], tmp_path: Path
) -> None:
    """Issue 14: a sandbox's view shows its guest address through every host (the
    lease is the other host's, in that host's pool); gone with the lease; a host whose
    pool is unknown (registered before migration 16) shows none rather than a wrong one."""
    w1, w2 = two_hosts["w1"], two_hosts["w2"]
    await w1.attach("sb-aaaaaaaaaaaa", EgressPolicy.open())
    await w2.attach("sb-bbbbbbbbbbbb", EgressPolicy.open())
    a, b = w1.address_of("sb-aaaaaaaaaaaa"), w2.address_of("sb-bbbbbbbbbbbb")
    assert a is not None and b is not None
    assert a in IPv4Network(POOLS["w1"]) and b in IPv4Network(POOLS["w2"])
    assert w2.address_of("sb-aaaaaaaaaaaa") is None  # not attached on w2
    assert w2.shown_address("sb-aaaaaaaaaaaa") == a
    assert w1.shown_address("sb-bbbbbbbbbbbb") == b
    assert w1.shown_address("sb-aaaaaaaaaaaa") == a  # its own lease
    assert w1.shown_address("sb-000000000000") is None
    hosts = HostStore(Store(tmp_path / "cluster.db"))  # the hosts' shared database
    row = hosts.get("w2")
    assert row is not None and row.net_pool == POOLS["w2"]
    hosts.register(replace(row, net_pool=""))
    assert w1.shown_address("sb-bbbbbbbbbbbb") is None
    hosts.register(row)
    await w2.detach("sb-bbbbbbbbbbbb")
    assert w1.shown_address("sb-bbbbbbbbbbbb") is None
