"""The nftables dataplane (the package's docstring says how it is proven). Here:
``test_lab_without_table``, the control (everything the other tests find blocked is
reachable without the table), and the egress policies: open, rules, ordered, deny-all,
the resolver and the proxy, a live replace.
"""

from __future__ import annotations

import pytest

from hutch.net.nft_apply import apply, table_exists
from hutch.net.nft_common import SandboxNet, TableConfig
from hutch.net.nft_sandbox import render_replace_policy
from hutch.net.rules import policy_from_stored
from tests.privileged.conftest import HOST_PORTS, Guest, Lab
from tests.privileged.dataplane.tables import NET, blocked, install, reached, sandbox, tcp, udp

pytestmark = pytest.mark.privileged


# ------------------------------------------------------------------------- control


async def test_lab_without_table(lab: Lab, guests: dict[str, Guest]) -> None:
    """Without hutch's table every destination the other tests block is reachable, so
    a block seen there is the table's doing and not a broken lab."""
    a = guests["a"]
    assert not await table_exists(lab.tag, netns=lab.host)
    results = lab.probe(
        a.netns,
        [
            tcp("198.18.1.1", 80),
            tcp("198.18.1.1", 25),
            tcp("169.254.169.254", 80),
            tcp("198.18.0.1", HOST_PORTS["api"]),
            tcp(str(a.gateway), HOST_PORTS["api"]),
            tcp(str(guests["b"].address), 2222),
            tcp("fd01::2", 80),
            udp("198.18.3.1", 53),
        ],
        timeout=3.0,  # first packets wait for ARP/ND on a busy machine
    )
    assert all(not blocked(r) for r in results), results
    assert reached(results[-1], "internet"), "without the table DNS goes where it was sent"
    assert reached(lab.tcp(guests["rogue"], "198.18.1.1", 80), "internet")


# ------------------------------------------------------------------------- policies


async def test_open_mode_reaches_internet_masqueraded(
    lab: Lab, cfg: TableConfig, guests: dict[str, Guest]
) -> None:
    a = guests["a"]
    await install(lab, cfg, [sandbox(a)])
    results = lab.probe(
        a.netns, [tcp("198.18.1.1", 80), tcp("198.18.2.1", 2222), udp("198.18.3.1", 9999)]
    )
    assert reached(results[0], "internet") and "198.18.1.1:80 from 198.18.0.1" in results[0]
    assert reached(results[1], "internet")
    assert reached(results[2], "internet") and "from 198.18.0.1" in results[2]


async def test_rules_mode_allows_only_listed(
    lab: Lab, cfg: TableConfig, guests: dict[str, Guest]
) -> None:
    a = guests["a"]
    await install(lab, cfg, [sandbox(a, ["198.18.1.1", "198.18.2.0/24:8080"])])
    allowed = [tcp("198.18.1.1", 2222), udp("198.18.1.1", 9999), tcp("198.18.2.1", 8080)]
    denied = [tcp("198.18.2.1", 2222), tcp("198.18.3.1", 2222), udp("198.18.3.1", 9999)]
    results = lab.probe(a.netns, allowed + denied)
    assert all(reached(r, "internet") for r in results[:3]), results
    assert all(blocked(r) for r in results[3:]), results


async def test_an_ordered_policy_first_match_decides_addresses(
    lab: Lab, cfg: TableConfig, guests: dict[str, Guest]
) -> None:
    """Deny before allow: the denied /24 is cut out of the allowed /22 in the real
    table; allow before deny: the allow wins. Same probes, opposite orders."""
    a = guests["a"]
    deny = {"action": "deny", "host": "198.18.2.0/24"}
    allow = {"action": "allow", "host": "198.18.0.0/22"}
    probes = [tcp("198.18.1.1", 2222), tcp("198.18.2.1", 2222), udp("198.18.2.1", 9999),
              tcp("198.18.3.1", 2222)]  # fmt: skip
    policy = policy_from_stored({"default": "deny", "rules": [deny, allow]})
    await install(lab, cfg, [SandboxNet(a.sandbox_id, a.tap, a.address, policy)])
    results = lab.probe(a.netns, probes)
    assert reached(results[0], "internet") and reached(results[3], "internet"), results
    assert blocked(results[1]) and blocked(results[2]), results
    policy = policy_from_stored({"default": "deny", "rules": [allow, deny]})
    await install(lab, cfg, [SandboxNet(a.sandbox_id, a.tap, a.address, policy)])
    results = lab.probe(a.netns, probes)
    assert all(reached(r, "internet") for r in results), results


async def test_default_allow_drops_its_denies_after_earlier_allows(
    lab: Lab, cfg: TableConfig, guests: dict[str, Guest]
) -> None:
    """Default allow in the real table: an address an earlier allow names passes, the
    rest of the denied /24 is dropped (TCP and UDP), a port deny takes only its port,
    everything else is open; with a name deny, web traffic goes to the proxy and QUIC
    is dropped."""
    a = guests["a"]
    rules = [
        {"action": "allow", "host": "198.18.2.1"},
        {"action": "deny", "host": "198.18.2.0/24"},
        {"action": "deny", "host": "198.18.3.0/24:2222"},
    ]
    probes = [tcp("198.18.2.1", 2222), tcp("198.18.2.2", 2222), udp("198.18.2.2", 9999),
              tcp("198.18.3.1", 2222), udp("198.18.3.1", 9999), tcp("198.18.1.1", 2222),
              udp("198.18.1.1", 443)]  # fmt: skip
    policy = policy_from_stored({"default": "allow", "rules": rules})
    await install(lab, cfg, [SandboxNet(a.sandbox_id, a.tap, a.address, policy)])
    results = lab.probe(a.netns, probes)
    assert reached(results[0], "internet") and reached(results[4], "internet"), results
    assert reached(results[5], "internet") and reached(results[6], "internet"), results
    assert blocked(results[1]) and blocked(results[2]) and blocked(results[3]), results
    named = policy_from_stored(
        {"default": "allow", "rules": [*rules, {"action": "deny", "host": "evil.test"}]}
    )
    await install(lab, cfg, [SandboxNet(a.sandbox_id, a.tap, a.address, named)])
    results = lab.probe(a.netns, [tcp("198.18.1.1", 443), udp("198.18.1.1", 443)])
    proxy = f"host tcp {a.gateway}:{HOST_PORTS['proxy']}"
    assert results[0].startswith(proxy), results
    assert blocked(results[1]), results


async def test_rules_mode_web_goes_to_proxy_unless_ip_rule(
    lab: Lab, cfg: TableConfig, guests: dict[str, Guest]
) -> None:
    a = guests["a"]
    await install(lab, cfg, [sandbox(a, ["198.18.1.1", "good.test"])])
    results = lab.probe(
        a.netns, [tcp("198.18.3.1", 443), tcp("198.18.3.1", 80), tcp("198.18.1.1", 443)]
    )
    proxy = f"host tcp {a.gateway}:{HOST_PORTS['proxy']}"
    # The proxy sees the guest's own address and finds the original destination.
    assert results[0].startswith(proxy) and "orig 198.18.3.1:443" in results[0], results
    assert f"from {a.address}" in results[0]
    assert results[1].startswith(proxy) and "orig 198.18.3.1:80" in results[1], results
    assert reached(results[2], "internet"), "an explicit ip rule skips the proxy"


async def test_rules_mode_web_to_denied_destinations_is_not_proxied(
    lab: Lab, cfg: TableConfig, guests: dict[str, Guest]
) -> None:
    """Web traffic to always-denied destinations is dropped by the filter (logged with
    its reason) instead of being handed to the proxy; a peer's web server is reached."""
    a, b = guests["a"], guests["b"]
    await install(lab, cfg, [sandbox(a, ["good.test"]), sandbox(b)], {NET: [a.address, b.address]})
    results = lab.probe(
        a.netns,
        [
            tcp("169.254.169.254", 80),
            tcp("198.18.0.1", 443),
            tcp(str(a.gateway), 80),
            tcp("10.213.0.14", 80),  # a sandbox address that is not a peer
            tcp(str(b.address), 80),  # a peer
        ],
    )
    assert all(blocked(r) for r in results[:4]), results
    assert results[4].startswith(f"b tcp {b.address}:80 from {a.address}"), results


async def test_open_mode_web_is_not_proxied(
    lab: Lab, cfg: TableConfig, guests: dict[str, Guest]
) -> None:
    a = guests["a"]
    await install(lab, cfg, [sandbox(a)])
    assert reached(lab.tcp(a, "198.18.3.1", 443), "internet")


@pytest.mark.parametrize("rules", [[], ["deny-all"], ["198.18.1.1"]])
async def test_dns_to_any_address_goes_to_resolver(
    lab: Lab, cfg: TableConfig, guests: dict[str, Guest], rules: list[str]
) -> None:
    a = guests["a"]
    await install(lab, cfg, [sandbox(a, rules)])
    results = lab.probe(
        a.netns, [udp("198.18.3.1", 53), tcp("198.18.1.1", 53), udp(str(a.gateway), 53)]
    )
    assert results[0].startswith(f"host udp {a.gateway}:{HOST_PORTS['dns']} from {a.address}")
    assert results[1].startswith(f"host tcp {a.gateway}:{HOST_PORTS['dns']}"), results
    assert "orig 198.18.1.1:53" in results[1]
    assert results[2].startswith("host udp"), results


async def test_resolver_and_proxy_ports_not_reachable_directly(
    lab: Lab, cfg: TableConfig, guests: dict[str, Guest]
) -> None:
    a = guests["a"]
    await install(lab, cfg, [sandbox(a, ["198.18.1.1"])])
    gw = str(a.gateway)
    results = lab.probe(a.netns, [tcp(gw, HOST_PORTS["dns"]), tcp(gw, HOST_PORTS["proxy"])])
    assert all(blocked(r) for r in results), results


async def test_deny_all(lab: Lab, cfg: TableConfig, guests: dict[str, Guest]) -> None:
    a = guests["a"]
    await install(lab, cfg, [sandbox(a, ["deny-all"])])
    results = lab.probe(
        a.netns, [tcp("198.18.1.1", 80), tcp("198.18.1.1", 443), udp("198.18.1.1", 9999)]
    )
    assert all(blocked(r) for r in results), results


async def test_live_policy_replace(lab: Lab, cfg: TableConfig, guests: dict[str, Guest]) -> None:
    a = guests["a"]
    await install(lab, cfg, [sandbox(a)])
    assert reached(lab.tcp(a, "198.18.1.1", 2222), "internet")

    await apply(render_replace_policy(cfg, sandbox(a, ["deny-all"])), netns=lab.host)
    assert blocked(lab.tcp(a, "198.18.1.1", 2222))

    await apply(render_replace_policy(cfg, sandbox(a, ["198.18.3.1:2222"])), netns=lab.host)
    results = lab.probe(a.netns, [tcp("198.18.3.1", 2222), tcp("198.18.1.1", 2222)])
    assert reached(results[0], "internet") and blocked(results[1]), results

    await apply(render_replace_policy(cfg, sandbox(a)), netns=lab.host)
    assert reached(lab.tcp(a, "198.18.1.1", 2222), "internet")
