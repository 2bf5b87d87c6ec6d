"""The nftables dataplane (the package's docstring says how it is proven). Here:
what is denied whatever the policy (always-denied destinations, spoofed sources, IPv6,
interfaces hutch did not register) and private networks between sandboxes.
"""

from __future__ import annotations

import pytest

from hutch.net.nft import render_networks
from hutch.net.nft_apply import apply, read_counters
from hutch.net.nft_common import TableConfig
from tests.privileged.conftest import HOST_PORTS, Guest, Lab, sh
from tests.privileged.dataplane.tables import NET, blocked, install, reached, sandbox, tcp, udp

pytestmark = pytest.mark.privileged


# ------------------------------------------------------------------------- always denied


async def test_always_denied_even_in_open_mode(
    lab: Lab, cfg: TableConfig, guests: dict[str, Guest]
) -> None:
    a, b = guests["a"], guests["b"]
    await install(lab, cfg, [sandbox(a), sandbox(b)])
    results = lab.probe(
        a.netns,
        [
            tcp("169.254.169.254", 80),  # cloud metadata
            tcp("198.18.1.1", 25),  # SMTP
            tcp("198.18.0.1", HOST_PORTS["api"]),  # the host (the daemon API)
            tcp(str(a.gateway), HOST_PORTS["api"]),  # the host via the gateway
            tcp(str(b.address), 2222),  # another sandbox
            tcp("198.18.1.1", 80),  # ... while the internet is open
        ],
    )
    assert all(blocked(r) for r in results[:5]), results
    assert reached(results[5], "internet")


async def test_anti_spoof(lab: Lab, cfg: TableConfig, guests: dict[str, Guest]) -> None:
    a, b = guests["a"], guests["b"]
    await install(lab, cfg, [sandbox(a), sandbox(b)])
    for extra in ("10.213.0.99/32", f"{b.address}/32", "198.18.9.9/32"):
        sh("ip", "-n", a.netns, "addr", "add", extra, "dev", "eth0")
    try:
        results = lab.probe(
            a.netns,
            [
                tcp("198.18.1.1", 80, src="10.213.0.99"),
                tcp("198.18.1.1", 80, src=str(b.address)),
                tcp("198.18.1.1", 80, src="198.18.9.9"),
                tcp("198.18.3.1", 53, src="10.213.0.99"),  # to the resolver (input path)
                tcp("198.18.1.1", 80),
            ],
        )
    finally:
        for extra in ("10.213.0.99/32", f"{b.address}/32", "198.18.9.9/32"):
            sh("ip", "-n", a.netns, "addr", "del", extra, "dev", "eth0", check=False)
    assert all(blocked(r) for r in results[:4]), results
    assert reached(results[4], "internet")
    counters = await read_counters(cfg.tag, netns=lab.host)
    assert counters[a.sandbox_id].denied >= 4


async def test_ipv6_from_tap_dropped(lab: Lab, cfg: TableConfig, guests: dict[str, Guest]) -> None:
    a = guests["a"]
    await install(lab, cfg, [sandbox(a)])
    results = lab.probe(a.netns, [tcp("fd01::2", 80), tcp("fd00::1:1", HOST_PORTS["api"])])
    assert all(blocked(r) for r in results), results
    assert reached(lab.tcp(lab.host, "fd01::2", 80), "internet"), "control: v6 route works"


async def test_unregistered_tap_dropped(
    lab: Lab, cfg: TableConfig, guests: dict[str, Guest]
) -> None:
    a, rogue = guests["a"], guests["rogue"]
    await install(lab, cfg, [sandbox(a)])
    results = lab.probe(
        rogue.netns,
        [tcp("198.18.1.1", 80), tcp(str(rogue.gateway), HOST_PORTS["api"]), udp("198.18.1.1", 53)],
    )
    assert all(blocked(r) for r in results), results


# ------------------------------------------------------------------------- networks


async def test_private_network_peers(lab: Lab, cfg: TableConfig, guests: dict[str, Guest]) -> None:
    a, b = guests["a"], guests["b"]
    await install(lab, cfg, [sandbox(a, ["deny-all"]), sandbox(b)], {NET: [a.address, b.address]})
    ab = lab.tcp(a, str(b.address), 2222)
    ba = lab.tcp(b, str(a.address), 2222)
    # Peers see each other's real addresses (no masquerade), whatever the egress policy.
    assert ab.startswith(f"b tcp {b.address}:2222 from {a.address}"), ab
    assert ba.startswith(f"a tcp {a.address}:2222 from {b.address}"), ba

    await apply(render_networks(cfg, {}, removed=[NET]), netns=lab.host)
    assert blocked(lab.tcp(a, str(b.address), 2222))
    assert blocked(lab.tcp(b, str(a.address), 2222))

    # A network with one member opens nothing; a second network does not join the first.
    await apply(
        render_networks(cfg, {NET: [a.address], "net-ba9876543210": [b.address]}),
        netns=lab.host,
    )
    assert blocked(lab.tcp(a, str(b.address), 2222))
