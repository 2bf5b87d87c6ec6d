"""The nftables dataplane (the package's docstring says how it is proven). Here:
rule changes against flows already open (cut or kept), learned addresses and their TTLs,
the host address set, a bad script changing nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from ipaddress import IPv4Address

import pytest

from hutch.errors import NetworkError
from hutch.net.addressing import host_addresses
from hutch.net.nft import render_host_addrs
from hutch.net.nft_apply import apply, read_counters
from hutch.net.nft_common import TableConfig
from hutch.net.nft_sandbox import LearnedAddress, render_learned, render_replace_policy
from tests.privileged.conftest import ECHO_PORT, HOST_PORTS, Guest, Lab, sh
from tests.privileged.dataplane.tables import blocked, install, reached, sandbox, tcp, udp

pytestmark = pytest.mark.privileged


class Held:
    """One TCP connection held open from a guest to an echo server (see ``Lab.hold``)."""

    def __init__(self, lab: Lab, guest: Guest, host: str) -> None:
        self.proc = lab.hold(guest.netns, host, ECHO_PORT)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "connected"

    def say(self, text: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        self.proc.kill()
        self.proc.communicate(timeout=10)


@contextlib.contextmanager
def held(lab: Lab, guest: Guest, *hosts: str) -> Iterator[list[Held]]:
    holders: list[Held] = []
    try:
        for host in hosts:
            holders.append(Held(lab, guest, host))
        yield holders
    finally:
        for holder in holders:
            holder.close()


async def test_a_tightening_rule_change_cuts_open_connections(
    lab: Lab, cfg: TableConfig, guests: dict[str, Guest]
) -> None:
    """A change that removes access stops connections opened before it on their next
    packet (and logs it); one the new rules still allow keeps going; loosening again
    lets a new connection through."""
    a = guests["a"]
    await install(lab, cfg, [sandbox(a, ["198.18.1.1", "198.18.2.1"])])
    with held(lab, a, "198.18.1.1", "198.18.2.1") as (kept, cut):
        assert kept.say("before") == "before" and cut.say("before") == "before"
        await apply(render_replace_policy(cfg, sandbox(a, ["198.18.1.1"])), netns=lab.host)
        assert kept.say("after") == "after", "still allowed: untouched"
        assert cut.say("after").startswith("FAIL"), "no longer allowed: cut"
        assert kept.say("again") == "again"
        await apply(render_replace_policy(cfg, sandbox(a, ["deny-all"])), netns=lab.host)
        assert kept.say("deny-all").startswith("FAIL")
    await apply(render_replace_policy(cfg, sandbox(a)), netns=lab.host)
    assert reached(lab.tcp(a, "198.18.2.1", 2222), "internet")
    counters = await read_counters(cfg.tag, netns=lab.host)
    assert counters[a.sandbox_id].denied >= 2


async def test_an_open_mode_connection_is_cut_by_the_first_rules(
    lab: Lab, cfg: TableConfig, guests: dict[str, Guest]
) -> None:
    a = guests["a"]
    await install(lab, cfg, [sandbox(a)])
    with held(lab, a, "198.18.1.1", "198.18.3.1") as (kept, cut):
        assert kept.say("open") == "open" and cut.say("open") == "open"
        await apply(render_replace_policy(cfg, sandbox(a, ["198.18.1.0/24"])), netns=lab.host)
        assert kept.say("rules") == "rules"
        assert cut.say("rules").startswith("FAIL")


async def test_flows_of_a_name_still_allowed_outlive_its_ttl_and_rule_changes(
    lab: Lab, cfg: TableConfig, guests: dict[str, Guest]
) -> None:
    """The TTL bounds new connections to a learned address; its open flows stay while
    the name is allowed (the manager carries it over as keep-only), and are cut once
    the rules drop the name."""
    a = guests["a"]
    web = IPv4Address("198.18.3.1")
    await install(lab, cfg, [sandbox(a, ["good.test"])])
    await apply(render_learned(cfg, a.sandbox_id, [LearnedAddress(web, None, 1)]), netns=lab.host)
    with held(lab, a, str(web)) as (flow,):
        assert flow.say("learned") == "learned"
        await asyncio.sleep(1.6)  # the TTL runs out (nft removes the element)
        assert blocked(lab.tcp(a, str(web), 2222)), "no new connection past the TTL"
        assert flow.say("past ttl") == "past ttl"
        carried = [LearnedAddress(web, None, None, keep=60)]
        script = render_replace_policy(cfg, sandbox(a, ["good.test", "x.test"]), carried)
        await apply(script, netns=lab.host)
        assert flow.say("rules changed") == "rules changed"
        assert blocked(lab.tcp(a, str(web), 2222)), "keep-only: still no new connection"
        await apply(render_replace_policy(cfg, sandbox(a, ["x.test"])), netns=lab.host)
        assert flow.say("name dropped").startswith("FAIL")


async def test_udp_443_to_learned_addresses_is_dropped(
    lab: Lab, cfg: TableConfig, guests: dict[str, Guest]
) -> None:
    """QUIC carries its server name where the proxy does not look: UDP 443 to an address
    only a name rule allows is dropped; other UDP ports of the name, and UDP 443 under
    an explicit ip rule, stay open."""
    a = guests["a"]
    await install(lab, cfg, [sandbox(a, ["good.test", "quic.test:443", "198.18.2.1"])])
    learned = [
        LearnedAddress(IPv4Address("198.18.3.1"), None, 60),
        LearnedAddress(IPv4Address("198.18.1.1"), 443, 60),
    ]
    await apply(render_learned(cfg, a.sandbox_id, learned), netns=lab.host)
    results = lab.probe(
        a.netns,
        [
            udp("198.18.3.1", 443),
            udp("198.18.1.1", 443),
            udp("198.18.3.1", 9999),
            udp("198.18.2.1", 443),
        ],
    )
    assert blocked(results[0]) and blocked(results[1]), results
    assert reached(results[2], "internet") and reached(results[3], "internet"), results


async def test_the_host_address_set_decides_what_is_proxied(
    lab: Lab, cfg: TableConfig, guests: dict[str, Guest]
) -> None:
    """An address the host gains later: until the set knows it, web traffic to it is
    handed to the proxy (which asks the kernel itself); once the set is updated it is
    dropped as the host's like every other host address."""
    a = guests["a"]
    await install(lab, cfg, [sandbox(a, ["good.test"])])
    sh("ip", "-n", lab.host, "addr", "add", "198.18.77.1/32", "dev", "lo")
    try:
        before = lab.tcp(a, "198.18.77.1", 80)
        assert before.startswith(f"host tcp {a.gateway}:{HOST_PORTS['proxy']}"), before
        await apply(render_host_addrs(cfg, await host_addresses(lab.host)), netns=lab.host)
        assert blocked(lab.tcp(a, "198.18.77.1", 80))
        assert blocked(lab.tcp(a, "198.18.77.1", HOST_PORTS["api"]))
    finally:
        sh("ip", "-n", lab.host, "addr", "del", "198.18.77.1/32", "dev", "lo")


async def test_bad_script_changes_nothing(
    lab: Lab, cfg: TableConfig, guests: dict[str, Guest]
) -> None:
    a = guests["a"]
    await install(lab, cfg, [sandbox(a)])
    script = render_replace_policy(cfg, sandbox(a, ["deny-all"])) + "add rule inet nope x drop\n"
    with pytest.raises(NetworkError) as info:
        await apply(script, netns=lab.host)
    assert "add rule inet nope x drop" in str(info.value)
    assert reached(lab.tcp(a, "198.18.1.1", 2222), "internet"), "old policy stays in force"


async def test_dns_learned_addresses(lab: Lab, cfg: TableConfig, guests: dict[str, Guest]) -> None:
    a = guests["a"]
    await install(lab, cfg, [sandbox(a, ["good.test", "api.good.test:8080"])])
    probes = [tcp("198.18.3.1", 2222), tcp("198.18.2.1", 8080), tcp("198.18.2.1", 2222)]
    assert all(blocked(r) for r in lab.probe(a.netns, probes))

    learned = [
        LearnedAddress(IPv4Address("198.18.3.1"), None, 60),
        LearnedAddress(IPv4Address("198.18.2.1"), 8080, 60),
    ]
    await apply(render_learned(cfg, a.sandbox_id, learned), netns=lab.host)
    results = lab.probe(a.netns, probes)
    assert reached(results[0], "internet") and reached(results[1], "internet"), results
    assert blocked(results[2]), "a host:port rule teaches that port only"

    # Re-learning refreshes the timeout; a short TTL then expires on its own.
    short = [LearnedAddress(IPv4Address("198.18.3.1"), None, 1)]
    await apply(render_learned(cfg, a.sandbox_id, short), netns=lab.host)
    await asyncio.sleep(1.6)
    assert blocked(lab.tcp(a, "198.18.3.1", 2222))


async def test_replace_keeps_passed_learned(
    lab: Lab, cfg: TableConfig, guests: dict[str, Guest]
) -> None:
    a = guests["a"]
    await install(lab, cfg, [sandbox(a, ["good.test"])])
    keep = [LearnedAddress(IPv4Address("198.18.3.1"), None, 60)]
    await apply(render_learned(cfg, a.sandbox_id, keep), netns=lab.host)
    await apply(
        render_replace_policy(cfg, sandbox(a, ["good.test", "1.2.3.4"]), keep), netns=lab.host
    )
    assert reached(lab.tcp(a, "198.18.3.1", 2222), "internet")
    await apply(render_replace_policy(cfg, sandbox(a, ["other.test"])), netns=lab.host)
    assert blocked(lab.tcp(a, "198.18.3.1", 2222)), "learned addresses not passed are gone"
