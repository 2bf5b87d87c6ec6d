"""Taps and sysctls (hutch.net.links), in a scratch network namespace."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from ipaddress import IPv4Address

import pytest

from hutch.errors import NetworkError
from hutch.net.addressing import host_addresses, tap_name
from hutch.net.links import create_tap, delete_tap, enable_ip_forward, link_exists, list_links

from .conftest import require_tools, sh

pytestmark = pytest.mark.privileged


@pytest.fixture
def netns() -> Iterator[str]:
    require_tools()
    name = f"hxl{secrets.token_hex(3)}"
    sh("ip", "netns", "add", name)
    try:
        yield name
    finally:
        sh("ip", "netns", "del", name, check=False)


def link_info(netns: str, name: str) -> dict[str, object]:
    info: list[dict[str, object]] = json.loads(
        sh("ip", "-n", netns, "-j", "-d", "addr", "show", "dev", name).stdout
    )
    return info[0]


async def test_create_tap_is_persistent_addressed_up_and_idempotent(netns: str) -> None:
    tag = secrets.token_hex(2)
    name = tap_name(tag, "sb-0123456789ab")
    await create_tap(name, IPv4Address("10.213.0.5"), 30, netns=netns)
    await create_tap(name, IPv4Address("10.213.0.5"), 30, netns=netns)  # again: no error

    info = link_info(netns, name)
    assert "UP" in info["flags"]  # type: ignore[operator]
    kind = info["linkinfo"]["info_data"]  # type: ignore[index]
    assert kind["type"] == "tap" and kind["persist"] is True
    v4 = [(a["local"], a["prefixlen"]) for a in info["addr_info"] if a["family"] == "inet"]  # type: ignore[attr-defined]
    assert v4 == [("10.213.0.5", 30)]
    v6 = [a for a in info["addr_info"] if a["family"] == "inet6"]  # type: ignore[attr-defined]
    assert v6 == [], "IPv6 is disabled on sandbox taps"
    assert IPv4Address("10.213.0.5") in await host_addresses(netns)

    # A new lease on the same tap replaces the address instead of adding a second one.
    await create_tap(name, IPv4Address("10.213.0.9"), 30, netns=netns)
    info = link_info(netns, name)
    v4 = [(a["local"], a["prefixlen"]) for a in info["addr_info"] if a["family"] == "inet"]  # type: ignore[attr-defined]
    assert v4 == [("10.213.0.9", 30)]

    other = tap_name(tag, "sb-ba9876543210")
    await create_tap(other, IPv4Address("10.213.0.13"), 30, owner=65534, netns=netns)
    assert link_info(netns, other)["linkinfo"]["info_data"]["user"] in (65534, "nobody")  # type: ignore[index]
    assert await list_links(f"h{tag}", netns=netns) == sorted([name, other])

    await delete_tap(name, netns=netns)
    await delete_tap(name, netns=netns)  # idempotent
    assert not await link_exists(name, netns=netns)
    assert await list_links(f"h{tag}", netns=netns) == [other]


async def test_create_tap_rejects_long_names(netns: str) -> None:
    with pytest.raises(NetworkError, match="longer than 15"):
        await create_tap("h" * 16, IPv4Address("10.213.0.5"), netns=netns)


async def test_enable_ip_forward(netns: str) -> None:
    def forwarding() -> str:
        return sh("ip", "netns", "exec", netns, "sysctl", "-n", "net.ipv4.ip_forward").stdout

    sh("ip", "netns", "exec", netns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=0")
    assert forwarding().strip() == "0"
    await enable_ip_forward(netns=netns)
    assert forwarding().strip() == "1"


async def test_ip_errors_name_the_command(netns: str) -> None:
    from hutch.net.links import run_ip

    with pytest.raises(NetworkError, match="ip link set dev nosuch0 up"):
        await run_ip(["link", "set", "dev", "nosuch0", "up"], netns=netns)
