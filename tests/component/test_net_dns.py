"""hutch's resolver against a fake upstream DNS server, over real loopback sockets.

Sandboxes are told apart by source address: each test client binds its own 127.0.0.x.
The fake upstream records every query it receives, so "never forwarded" is asserted on
what actually reached it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from ipaddress import IPv4Address

import dns.asyncquery
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest

from hutch.net.destinations import Forbidden
from hutch.net.dns import Resolver, SandboxNetInfo
from hutch.net.egress_log import EgressLog
from hutch.net.rules import parse_policy, policy_from_stored

# The data path's code, on the data path's loop (tests/conftest.py).
pytestmark = pytest.mark.datapath_loop

RULES_SRC = "127.0.0.2"
OPEN_SRC = "127.0.0.3"
DENY_SRC = "127.0.0.4"
CIDR_SRC = "127.0.0.5"
UNKNOWN_SRC = "127.0.0.9"

# name -> (ttl, [addresses]); "cname" entries point elsewhere
ZONE: dict[str, tuple[int, list[str]]] = {
    "good.test.": (5, ["198.18.0.10"]),
    "www.good.test.": (99999, ["198.18.0.11"]),
    "api.test.": (300, ["198.18.0.12", "198.18.0.13"]),
    "a.wild.test.": (300, ["198.18.0.20"]),
    "wild.test.": (300, ["198.18.0.21"]),
    "xn--bcher-kva.test.": (300, ["198.18.0.30"]),
    "many.good.test.": (300, [f"198.18.1.{i}" for i in range(1, 120)]),
    "target.cdn.test.": (60, ["198.18.0.40"]),
    # Issue 16: names under an allowed wildcard resolving where a name must never lead.
    "lan.good.test.": (300, ["10.1.2.3"]),
    "lan172.good.test.": (300, ["172.16.9.9"]),
    "lan192.good.test.": (300, ["192.168.1.1"]),
    "cgnat.good.test.": (300, ["100.64.0.1"]),
    "class-e.good.test.": (300, ["240.0.0.1"]),
    "loop.good.test.": (300, ["127.0.0.1"]),
    "meta.good.test.": (300, ["169.254.169.254"]),
    "mixed.good.test.": (300, ["10.1.2.3", "198.18.0.50"]),
}
CNAMES = {"alias.good.test.": "target.cdn.test.", "sneaky.good.test.": "lan.good.test."}
BLACKHOLE = "slow.test."  # the fake upstream never answers it


@dataclass
class FakeUpstream:
    """A tiny authoritative-ish server (UDP + TCP on one port) that records queries."""

    queries: list[tuple[str, str, str]] = field(default_factory=list)  # (name, type, proto)
    port: int = 0

    def answer(self, wire: bytes, proto: str) -> bytes | None:
        query = dns.message.from_wire(wire)
        q = query.question[0]
        name = q.name.to_text().lower()
        self.queries.append((name, dns.rdatatype.to_text(q.rdtype), proto))
        if name == BLACKHOLE:
            return None
        response = dns.message.make_response(query)
        if name in CNAMES:
            target = CNAMES[name]
            response.answer.append(dns.rrset.from_text(name, 60, "IN", "CNAME", target))
            name = target
        if name not in ZONE:
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif q.rdtype == dns.rdatatype.A:
            ttl, addrs = ZONE[name]
            response.answer.append(dns.rrset.from_text_list(name, ttl, "IN", "A", addrs))
        elif q.rdtype == dns.rdatatype.TXT:
            response.answer.append(dns.rrset.from_text(name, 60, "IN", "TXT", '"secret"'))
        limit = 65535 if proto == "tcp" else 512
        return response.to_wire(max_size=limit, prefer_truncation=True)


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    fake = FakeUpstream()
    loop = asyncio.get_running_loop()

    class Proto(asyncio.DatagramProtocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            reply = fake.answer(data, "udp")
            if reply is not None:
                self.transport.sendto(reply, addr)  # type: ignore[attr-defined]

    async def on_tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            (size,) = struct.unpack("!H", await reader.readexactly(2))
            reply = fake.answer(await reader.readexactly(size), "tcp")
            if reply is not None:
                writer.write(struct.pack("!H", len(reply)) + reply)
                await writer.drain()
        writer.close()

    transport, _ = await loop.create_datagram_endpoint(Proto, local_addr=("127.0.0.53", 0))
    fake.port = transport.get_extra_info("sockname")[1]
    server = await asyncio.start_server(on_tcp, "127.0.0.53", fake.port)
    yield fake
    transport.close()
    server.close()
    await server.wait_closed()


@dataclass
class Directory:
    entries: dict[IPv4Address, SandboxNetInfo]

    def lookup(self, addr: IPv4Address) -> SandboxNetInfo | None:
        return self.entries.get(addr)


@dataclass
class Env:
    resolver: Resolver
    port: int
    log: EgressLog
    learned: list[tuple[str, list[tuple[IPv4Address, int | None]], int]]
    upstream: FakeUpstream
    directory: Directory

    async def ask(
        self, name: str, rdtype: str = "A", src: str = RULES_SRC, tcp: bool = False
    ) -> dns.message.Message:
        q = dns.message.make_query(name, rdtype)
        if tcp:
            return await dns.asyncquery.tcp(q, "127.0.0.1", 5, self.port, source=src)
        return await dns.asyncquery.udp(q, "127.0.0.1", 5, self.port, source=src)

    def forwarded(self) -> set[str]:
        return {name for name, _, _ in self.upstream.queries}


PEERS = {
    "web": IPv4Address("10.213.0.10"),
    "web.hutch.internal": IPv4Address("10.213.0.10"),
}


@pytest.fixture
async def env(upstream: FakeUpstream) -> AsyncIterator[Env]:
    policy = parse_policy(
        [
            "good.test",
            "*.good.test",
            "api.test:443",
            "*.wild.test",
            "Bücher.test",
            "slow.test",
            "alias.good.test",
        ]
    )
    directory = Directory(
        {
            IPv4Address(RULES_SRC): SandboxNetInfo("sb-rules", policy, PEERS),
            IPv4Address(OPEN_SRC): SandboxNetInfo("sb-open", parse_policy([])),
            IPv4Address(DENY_SRC): SandboxNetInfo("sb-deny", parse_policy(["deny-all"])),
            IPv4Address(CIDR_SRC): SandboxNetInfo(
                "sb-cidr", parse_policy(["*.good.test", "10.1.2.0/24:5432"])
            ),
        }
    )
    learned: list[tuple[str, list[tuple[IPv4Address, int | None]], int]] = []

    async def on_learned(
        sid: str, addrs: list[tuple[IPv4Address, int | None]], ttl: int, name: str
    ) -> None:
        learned.append((sid, addrs, ttl))

    log = EgressLog()
    resolver = Resolver(
        directory, ("127.0.0.53", upstream.port), log, on_learned, timeout_s=0.3, attempts=2
    )
    port = await resolver.start("127.0.0.1", 0)
    yield Env(resolver, port, log, learned, upstream, directory)
    await resolver.close()


def a_addrs(msg: dns.message.Message) -> list[str]:
    return sorted(rd.address for rr in msg.answer if rr.rdtype == dns.rdatatype.A for rd in rr)


async def test_allowed_name_is_answered_and_learned_with_floor_ttl(env: Env) -> None:
    reply = await env.ask("good.test")
    assert reply.rcode() == dns.rcode.NOERROR
    assert a_addrs(reply) == ["198.18.0.10"]
    assert env.learned == [("sb-rules", [(IPv4Address("198.18.0.10"), None)], 30)]
    assert env.log.counters("sb-rules") == (1, 0)
    event = env.log.events("sb-rules")[-1]
    assert (event.verdict, event.rule, event.name) == ("allow", "good.test", "good.test")


async def test_long_ttl_is_capped_in_learning_and_in_the_answer(env: Env) -> None:
    reply = await env.ask("www.good.test")
    assert a_addrs(reply) == ["198.18.0.11"]
    assert env.learned[-1][2] == 3600
    assert all(rr.ttl <= 3600 for rr in reply.answer)


async def test_host_port_rule_learns_address_port_pairs(env: Env) -> None:
    await env.ask("api.test")
    sid, learned, ttl = env.learned[-1]
    assert (sid, sorted(learned), ttl) == (
        "sb-rules",
        [(IPv4Address("198.18.0.12"), 443), (IPv4Address("198.18.0.13"), 443)],
        300,
    )


async def test_denied_name_is_nxdomain_and_never_forwarded(env: Env) -> None:
    reply = await env.ask("evil.test")
    assert reply.rcode() == dns.rcode.NXDOMAIN
    assert "evil.test." not in env.forwarded()
    assert env.upstream.queries == []
    assert env.learned == []
    event = env.log.events("sb-rules")[-1]
    assert (event.verdict, event.destination, event.rule) == ("deny", "evil.test", None)
    assert "no rule" in event.reason


async def test_exfiltration_queries_never_reach_upstream(env: Env) -> None:
    secret = "6a6f686e" * 7 + "abcdefg"  # a 63-char label full of "data"
    replies = [
        await env.ask("good.test", "TXT"),
        await env.ask(f"{secret}.evil.test", "A"),
        await env.ask(f"{secret}.evil.test", "TXT"),
        await env.ask("good.test", "MX"),
    ]
    assert [r.rcode() for r in replies] == [dns.rcode.NXDOMAIN] * 4
    assert env.upstream.queries == []
    assert env.log.counters("sb-rules") == (0, 4)


async def test_allowed_subdomain_with_data_goes_out_only_as_an_a_query(env: Env) -> None:
    # *.good.test allows any subdomain: that is the user's choice, but only as A.
    await env.ask("x1.good.test", "A")
    assert env.upstream.queries == [("x1.good.test.", "A", "udp")]


async def test_aaaa_gets_empty_noerror_without_upstream(env: Env) -> None:
    reply = await env.ask("good.test", "AAAA")
    assert reply.rcode() == dns.rcode.NOERROR
    assert reply.answer == []
    assert env.upstream.queries == []


async def test_wildcard_matches_subdomains_but_never_the_apex(env: Env) -> None:
    assert a_addrs(await env.ask("a.wild.test")) == ["198.18.0.20"]
    apex = await env.ask("wild.test")
    assert apex.rcode() == dns.rcode.NXDOMAIN
    assert "wild.test." not in env.forwarded()


async def test_case_trailing_dot_and_punycode(env: Env) -> None:
    assert a_addrs(await env.ask("GOOD.Test.")) == ["198.18.0.10"]
    # The rule was written as "Bücher.test"; the guest's resolver sends the A-label.
    assert a_addrs(await env.ask("XN--BCHER-KVA.test")) == ["198.18.0.30"]


async def test_cname_chain_is_answered_and_target_addresses_learned(env: Env) -> None:
    reply = await env.ask("alias.good.test")
    assert a_addrs(reply) == ["198.18.0.40"]
    assert any(rr.rdtype == dns.rdatatype.CNAME for rr in reply.answer)
    assert env.learned[-1][1] == [(IPv4Address("198.18.0.40"), None)]


async def test_unknown_source_is_refused(env: Env) -> None:
    reply = await env.ask("good.test", src=UNKNOWN_SRC)
    assert reply.rcode() == dns.rcode.REFUSED
    assert env.upstream.queries == []


async def test_open_mode_forwards_anything_and_deny_all_nothing(env: Env) -> None:
    txt = await env.ask("good.test", "TXT", src=OPEN_SRC)
    assert txt.rcode() == dns.rcode.NOERROR
    assert txt.answer and txt.answer[0].rdtype == dns.rdatatype.TXT
    denied = await env.ask("good.test", src=DENY_SRC)
    assert denied.rcode() == dns.rcode.NXDOMAIN
    assert env.upstream.queries == [("good.test.", "TXT", "udp")]
    assert env.log.counters("sb-deny") == (0, 1)


async def test_upstream_timeout_gives_servfail(env: Env) -> None:
    reply = await env.ask("slow.test")
    assert reply.rcode() == dns.rcode.SERVFAIL
    assert [q for q in env.upstream.queries if q[0] == BLACKHOLE] == [
        (BLACKHOLE, "A", "udp"),
        (BLACKHOLE, "A", "udp"),
    ]
    assert env.learned == []
    assert env.log.events("sb-rules")[-1].verdict == "deny"


async def test_tcp_queries_work(env: Env) -> None:
    reply = await env.ask("good.test", tcp=True)
    assert a_addrs(reply) == ["198.18.0.10"]
    denied = await env.ask("evil.test", tcp=True)
    assert denied.rcode() == dns.rcode.NXDOMAIN
    stranger = await env.ask("good.test", src=UNKNOWN_SRC, tcp=True)
    assert stranger.rcode() == dns.rcode.REFUSED
    assert [q[0] for q in env.upstream.queries] == ["good.test."]


async def test_truncated_upstream_answer_is_retried_over_tcp(env: Env) -> None:
    reply = await env.ask("many.good.test", tcp=True)
    assert len(a_addrs(reply)) == 119
    assert ("many.good.test.", "A", "tcp") in env.upstream.queries
    assert len(env.learned[-1][1]) == 119
    # Over UDP the guest gets TC and no partial answer it could act on.
    udp = await env.ask("many.good.test")
    assert udp.flags & dns.flags.TC


async def test_private_network_peers_are_answered_locally(env: Env) -> None:
    reply = await env.ask("WEB")
    assert a_addrs(reply) == ["10.213.0.10"]
    assert reply.answer[0].ttl == 5
    internal = await env.ask("web.hutch.internal")
    assert a_addrs(internal) == ["10.213.0.10"]
    missing = await env.ask("db.hutch.internal")
    assert missing.rcode() == dns.rcode.NXDOMAIN
    assert env.upstream.queries == []


async def test_learning_failure_fails_closed(env: Env) -> None:
    async def broken(
        sid: str, addrs: list[tuple[IPv4Address, int | None]], ttl: int, name: str
    ) -> None:
        raise RuntimeError("nft is gone")

    env.resolver._on_learned = broken
    reply = await env.ask("good.test")
    assert reply.rcode() == dns.rcode.SERVFAIL


async def test_policy_change_applies_to_the_next_query(env: Env) -> None:
    assert (await env.ask("evil.test")).rcode() == dns.rcode.NXDOMAIN
    env.directory.entries[IPv4Address(RULES_SRC)] = SandboxNetInfo(
        "sb-rules", parse_policy(["evil.test"])
    )
    assert (await env.ask("evil.test")).rcode() == dns.rcode.NXDOMAIN  # exists nowhere
    assert env.forwarded() == {"evil.test."}


async def test_resolve_a_for_the_proxy(env: Env) -> None:
    assert sorted(await env.resolver.resolve_a("API.test.")) == [
        (IPv4Address("198.18.0.12"), 300),
        (IPv4Address("198.18.0.13"), 300),
    ]
    await env.resolver.resolve_a("api.test")  # cached
    assert env.upstream.queries == [("api.test.", "A", "udp")]
    assert await env.resolver.resolve_a("nope.test") == []


async def test_garbage_is_dropped_and_server_keeps_working(env: Env) -> None:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(
        asyncio.DatagramProtocol, local_addr=(RULES_SRC, 0), remote_addr=("127.0.0.1", env.port)
    )
    transport.sendto(b"\x00")
    transport.sendto(b"\x12\x34" + b"\xff" * 30)
    transport.close()
    assert a_addrs(await env.ask("good.test")) == ["198.18.0.10"]


async def test_mutated_queries_never_crash_the_resolver(env: Env) -> None:
    rng = random.Random(7)
    base = dns.message.make_query("x.good.test", "A", use_edns=0).to_wire()
    for _ in range(400):
        packet = bytearray(base)
        for _ in range(rng.randint(1, 6)):
            packet[rng.randrange(len(packet))] = rng.randrange(256)
        packet = packet[: rng.randint(0, len(packet))] if rng.random() < 0.3 else packet
        reply = await env.resolver.handle(bytes(packet), RULES_SRC, tcp=False)
        assert reply is None or len(reply) >= 12
    assert a_addrs(await env.ask("good.test")) == ["198.18.0.10"]


# -- issue 16: answers a name must never lead to --------------------------------------------


async def test_private_and_always_denied_answers_are_removed_logged_never_learned(
    env: Env,
) -> None:
    names = {
        "lan.good.test": "private range 10.0.0.0/8",
        "lan172.good.test": "private range 172.16.0.0/12",
        "lan192.good.test": "private range 192.168.0.0/16",
        "cgnat.good.test": "shared (CGNAT) range 100.64.0.0/10",
        "class-e.good.test": "reserved range 240.0.0.0/4",
        "loop.good.test": "loopback",
        "meta.good.test": "link-local (cloud metadata)",
    }
    for name, why in names.items():
        reply = await env.ask(name)
        assert reply.rcode() == dns.rcode.NOERROR, name
        assert a_addrs(reply) == [], name
        event = env.log.events("sb-rules")[-1]
        assert (event.verdict, event.name, event.protocol) == ("deny", name, "dns")
        assert why in event.reason and "answered without" in event.reason, event.reason
    assert env.learned == []
    assert env.log.counters("sb-rules") == (0, len(names))


async def test_a_cname_into_a_private_range_keeps_the_cname_only(env: Env) -> None:
    reply = await env.ask("sneaky.good.test")
    assert a_addrs(reply) == []
    assert [rr.rdtype for rr in reply.answer] == [dns.rdatatype.CNAME]
    assert env.learned == []
    assert "10.1.2.3 (private range 10.0.0.0/8" in env.log.events("sb-rules")[-1].reason


async def test_a_mixed_answer_keeps_and_learns_only_the_public_address(env: Env) -> None:
    assert a_addrs(await env.ask("mixed.good.test")) == ["198.18.0.50"]
    assert env.learned == [("sb-rules", [(IPv4Address("198.18.0.50"), None)], 300)]
    verdicts = [e.verdict for e in env.log.events("sb-rules")]
    assert verdicts == ["deny", "allow"]


async def test_an_ip_rule_covering_a_private_answer_answers_it_without_learning(
    env: Env,
) -> None:
    reply = await env.ask("lan.good.test", src=CIDR_SRC)
    assert a_addrs(reply) == ["10.1.2.3"]
    assert env.learned == []  # the ip rule (port 5432) is all the guest gets there
    event = env.log.events("sb-cidr")[-1]
    assert event.verdict == "allow" and "only as its ip/cidr rules allow" in event.reason
    # Not covered: the same sandbox gets 240/4 and loopback removed.
    assert a_addrs(await env.ask("class-e.good.test", src=CIDR_SRC)) == []
    assert a_addrs(await env.ask("loop.good.test", src=CIDR_SRC)) == []


async def test_the_forbidden_check_is_asked_for_every_answer(env: Env) -> None:
    """The daemon's check also knows its pool and the host's addresses (asked of the
    kernel when the answer comes): an address is judged when it is answered."""
    host_now: set[IPv4Address] = set()

    def forbidden(addr: IPv4Address) -> Forbidden | None:
        return Forbidden("always", "the host's own address") if addr in host_now else None

    env.resolver._forbidden = forbidden
    assert a_addrs(await env.ask("good.test")) == ["198.18.0.10"]
    host_now.add(IPv4Address("198.18.0.10"))
    assert a_addrs(await env.ask("good.test")) == []
    assert "the host's own address" in env.log.events("sb-rules")[-1].reason
    assert len(env.learned) == 1


async def test_an_ordered_policy_answers_in_rule_order_and_names_the_rule(env: Env) -> None:
    """Deny before a wildcard allow: the name gets NXDOMAIN, is never forwarded, and the
    log names the deny rule; a name the wildcard allows is answered and learned on the
    ports left after an earlier port denial."""
    policy = policy_from_stored(
        {
            "default": "deny",
            "rules": [
                {"action": "deny", "host": "www.good.test"},
                {"action": "deny", "host": "*.test:8443"},
                {"action": "allow", "host": "*.good.test:8443"},
                {"action": "allow", "host": "*.good.test:443"},
            ],
        }
    )
    env.directory.entries[IPv4Address(RULES_SRC)] = SandboxNetInfo("sb-rules", policy)
    reply = await env.ask("www.good.test")
    assert reply.rcode() == dns.rcode.NXDOMAIN
    assert env.upstream.queries == [] and env.learned == []
    denied = env.log.events("sb-rules")[-1]
    assert (denied.verdict, denied.rule, denied.rule_index) == (
        "deny", "rules[0] deny www.good.test", 0,
    )  # fmt: skip
    assert (await env.ask("api.test")).rcode() == dns.rcode.NXDOMAIN  # the default
    assert env.log.events("sb-rules")[-1].rule_index is None
    await env.ask("good.test")  # the apex: no rule for it
    assert env.learned == []
    reply = await env.ask("many.good.test")
    assert reply.rcode() == dns.rcode.NOERROR, reply
    _, learned, _ = env.learned[-1]
    assert {port for _, port in learned} == {443}  # 8443 was denied first
    allowed = env.log.events("sb-rules")[-1]
    assert (allowed.verdict, allowed.rule_index) == ("allow", 3)


async def test_default_allow_refuses_the_names_it_denies_and_forwards_the_rest(env: Env) -> None:
    """Default allow with deny rules: a name denied on every port is NXDOMAIN (never
    forwarded), logged with the rule; one denied on 443 only, or not named, is forwarded
    as open egress does (any type)."""
    from hutch.net.rules import policy_from_stored

    doc = {
        "default": "allow",
        "rules": [
            {"action": "allow", "host": "ok.good.test"},
            {"action": "deny", "host": "*.good.test"},
            {"action": "deny", "host": "good.test:443"},
        ],
    }
    env.directory.entries[IPv4Address(OPEN_SRC)] = SandboxNetInfo(
        "sb-open", policy_from_stored(doc)
    )
    denied = await env.ask("www.good.test", src=OPEN_SRC)
    assert denied.rcode() == dns.rcode.NXDOMAIN
    event = env.log.events("sb-open")[-1]
    assert (event.verdict, event.rule, event.rule_index) == (
        "deny", "rules[1] deny *.good.test", 1,
    )  # fmt: skip
    await env.ask("ok.good.test", src=OPEN_SRC)  # the fake upstream's answer, whatever it is
    assert "ok.good.test." in env.forwarded()
    txt = await env.ask("good.test", "TXT", src=OPEN_SRC)
    assert txt.rcode() == dns.rcode.NOERROR and txt.answer
    assert "www.good.test." not in env.forwarded()
    assert env.learned == []  # the address level is open: nothing to learn
