"""Address pool, names and the always-denied destinations (hutch.net.addressing)."""

from __future__ import annotations

import json
from ipaddress import IPv4Address, IPv4Network

import pytest

from hutch.errors import Capacity, InvalidArgument, NetworkError
from hutch.net.addressing import (
    AddressPool,
    guest_mac,
    is_forbidden_destination,
    parse_ip_addr_json,
    sandbox_key,
    tap_name,
    tap_prefix,
)


def test_blocks_are_slash30s_from_index_1() -> None:
    pool = AddressPool("10.213.0.0/16")
    block = pool.block(1)
    assert block.network == IPv4Network("10.213.0.4/30")
    assert (block.gateway, block.guest) == (IPv4Address("10.213.0.5"), IPv4Address("10.213.0.6"))
    assert block.prefix == 30 and block.guest_cidr == "10.213.0.6/30"
    last = pool.block(pool.capacity)
    assert last.guest == IPv4Address("10.213.255.254")
    assert pool.capacity == 16383


@pytest.mark.parametrize("index", [0, -1, 16384])
def test_block_outside_pool_is_refused(index: int) -> None:
    with pytest.raises(InvalidArgument, match="outside pool"):
        AddressPool("10.213.0.0/16").block(index)


def test_first_free_and_capacity() -> None:
    pool = AddressPool("10.9.0.0/28")  # blocks 1..3
    assert pool.capacity == 3
    assert pool.first_free([]) == 1
    assert pool.first_free([1, 2]) == 3
    assert pool.first_free([2, 3]) == 1
    with pytest.raises(Capacity, match="HUTCH_NET_POOL"):
        pool.first_free([1, 2, 3])


def test_index_of() -> None:
    pool = AddressPool("10.213.0.0/16")
    assert pool.index_of("10.213.0.6") == 1
    assert pool.index_of(IPv4Address("10.213.0.9")) == 2
    assert pool.index_of("10.213.0.2") is None  # block 0 is never a sandbox
    assert pool.index_of("10.214.0.6") is None
    assert IPv4Address("10.213.7.7") in pool and IPv4Address("10.0.0.1") not in pool


@pytest.mark.parametrize("cidr", ["10.213.0.0/30", "10.213.0.1/16", "nonsense", "fd00::/64"])
def test_bad_pools_are_refused(cidr: str) -> None:
    with pytest.raises(InvalidArgument):
        AddressPool(cidr)


def test_tap_names() -> None:
    name = tap_name("ab12", "sb-0123456789ab")
    assert name == "hab120123456789"
    assert len(name) == 15  # IFNAMSIZ - 1
    assert name.startswith(tap_prefix("ab12"))
    assert sandbox_key("sb-0123456789ab") == "0123456789ab"
    with pytest.raises(InvalidArgument):
        tap_name("ab12", "sb-XYZ")
    with pytest.raises(InvalidArgument):
        tap_name("AB12x", "sb-0123456789ab")


def test_parse_ip_addr_json() -> None:
    text = json.dumps(
        [
            {
                "ifname": "lo",
                "addr_info": [
                    {"family": "inet", "local": "127.0.0.1", "prefixlen": 8},
                    {"family": "inet6", "local": "::1", "prefixlen": 128},
                ],
            },
            {"ifname": "eth0", "addr_info": [{"family": "inet", "local": "192.0.2.10"}]},
            {"ifname": "dummy0"},
        ]
    )
    assert parse_ip_addr_json(text) == {IPv4Address("127.0.0.1"), IPv4Address("192.0.2.10")}
    with pytest.raises(NetworkError):
        parse_ip_addr_json("not json")


@pytest.mark.parametrize(
    "addr",
    [
        "127.0.0.1",
        "127.9.9.9",
        "169.254.169.254",
        "169.254.1.1",
        "10.1.2.3",
        "172.16.0.1",
        "172.31.255.255",
        "192.168.1.1",
        "100.64.0.1",
        "224.0.0.251",
        "239.1.1.1",
        "255.255.255.255",
        "0.0.0.0",
        "240.0.0.1",
        "::1",
        "fe80::1",
        "::",
        "2001:db8::1",
        "::ffff:127.0.0.1",
        "::ffff:169.254.169.254",
    ],
)
def test_forbidden_destinations(addr: str) -> None:
    assert is_forbidden_destination(addr)


@pytest.mark.parametrize(
    "addr", ["198.18.1.1", "198.19.255.1", "8.8.8.8", "93.184.216.34", "::ffff:8.8.8.8"]
)
def test_public_and_benchmark_destinations_allowed(addr: str) -> None:
    # 198.18.0.0/15 stays allowed: the test suites' fake internet lives there.
    assert not is_forbidden_destination(addr)


def test_pool_and_host_addresses_are_forbidden() -> None:
    pool = AddressPool("198.19.0.0/16")  # public-looking on purpose
    assert is_forbidden_destination("198.19.0.6", pool)
    assert is_forbidden_destination("198.19.0.6", IPv4Network("198.19.0.0/16"))
    assert not is_forbidden_destination("198.18.0.6", pool)
    hosts = [IPv4Address("203.0.113.7")]
    assert is_forbidden_destination("203.0.113.7", pool, hosts)
    assert not is_forbidden_destination("203.0.113.8", pool, hosts)


def test_guest_macs_are_stable_distinct_and_locally_administered() -> None:
    macs = {guest_mac(f"sb-{i:012x}") for i in range(1000)}
    assert len(macs) == 1000
    assert guest_mac("sb-000000000001") == guest_mac("sb-000000000001")
    for mac in macs:
        first = int(mac[:2], 16)
        assert first & 0b10 and not first & 0b01, mac  # locally administered, unicast
        assert len(mac) == 17
