"""hutch's DNS resolver for sandboxes (UDP and TCP on one port, in the data path's loop).

nft redirects every packet a sandbox sends to port 53 here, so this is the only DNS a
guest can reach. Per query, by the sandbox the source address belongs to:

- unknown source: REFUSED (the port is bound on 0.0.0.0; nft keeps others out too);
- private-network peers (``web``, ``sb-…``, ``web.hutch.internal``): answered here, TTL 5;
  other ``*.hutch.internal`` names: NXDOMAIN, never forwarded;
- open egress: the query is forwarded upstream as is;
- deny-all: NXDOMAIN;
- rules: only names a host/wildcard rule allows go upstream, and only as A (or CNAME)
  queries rebuilt by us, so nothing but an allowed name leaves the host. AAAA gets an
  empty NOERROR (guests are IPv4 only); every other type (TXT, ...) and every other
  name gets NXDOMAIN without going upstream. Every A record of the answer (also those
  behind a CNAME) is checked with ``forbidden`` (:mod:`hutch.net.destinations`):
  loopback, link-local, the pool, the host's own addresses and private/CGNAT/240/4
  ranges are removed from the answer and never learned (the removal is logged as a
  denial); a private address one of the sandbox's ip/cidr rules covers stays in the
  answer but is not learned either. The A addresses left are handed to ``on_learned``
  (awaited *before* the guest sees the answer, so the nft allow set is filled before
  the guest can connect) with their TTL clamped to 30 s - 1 h; answer TTLs are capped
  to that so the guest does not cache past the nft element.

Upstream failure or timeout gives SERVFAIL: the guest fails closed.

Floods: with a ``limit``, each query first takes a token from its sender's bucket
(:mod:`hutch.net.ratelimit`); without one it is answered REFUSED from its header and
question alone (:func:`hutch.net.dns_io.refused_reply`), before any parsing, and
counted. A sender may also have at most :data:`MAX_INFLIGHT_PER_SOURCE` queries waiting
for the upstream, so names that time out cannot use up the server's in-flight slots for
everyone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from ipaddress import IPv4Address, ip_address
from typing import Protocol

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from hutch.contract.egress_policy import PolicyRule
from hutch.contract.views import EgressEvent, Verdict
from hutch.errors import NetworkError
from hutch.net.destinations import ForbiddenCheck, classify_destination, filter_answer
from hutch.net.dns_io import (
    formerr_reply,
    query_tcp,
    query_udp,
    refused_reply,
    serve_tcp_dns,
    start_udp_dns,
)
from hutch.net.egress_log import EgressLog
from hutch.net.ratelimit import KeyedLimiter, Rate
from hutch.net.rules import EgressPolicy, normalize_name

__all__ = [
    "INTERNAL_SUFFIX",
    "MAX_INFLIGHT_PER_SOURCE",
    "PEER_TTL_S",
    "TTL_CAP_S",
    "TTL_FLOOR_S",
    "Learned",
    "OnLearned",
    "Resolver",
    "SandboxDirectory",
    "SandboxNet",
    "SandboxNetInfo",
]

log = logging.getLogger(__name__)

TTL_FLOOR_S = 30
TTL_CAP_S = 3600
PEER_TTL_S = 5
INTERNAL_SUFFIX = "hutch.internal"
_MAX_INFLIGHT = 512  # concurrent queries; beyond that UDP queries are dropped (flood guard)
#: Queries one sender may have in flight (with a limit); past it: REFUSED, counted.
MAX_INFLIGHT_PER_SOURCE = 64

Learned = list[tuple[IPv4Address, int | None]]
#: ``on_learned(sandbox_id, [(address, port | None)], ttl, name)``
OnLearned = Callable[[str, Learned, int, str], Awaitable[None]]


class SandboxNet(Protocol):
    """What the resolver and proxy need to know about the sandbox behind an address."""

    @property
    def sandbox_id(self) -> str: ...
    @property
    def policy(self) -> EgressPolicy: ...
    @property
    def project(self) -> str:
        """Whose secrets a transform's ``{secret:NAME}`` reads (the egress proxy)."""
        ...

    @property
    def peers(self) -> Mapping[str, IPv4Address]:
        """Private-network names (lower case; names, ids, and both with
        ``.hutch.internal``) -> the peer's address."""
        ...


class SandboxDirectory(Protocol):
    def lookup(self, addr: IPv4Address) -> SandboxNet | None:
        """The sandbox using guest address ``addr``, or None."""
        ...


@dataclass(frozen=True)
class SandboxNetInfo:
    """A plain SandboxNet (the lead may use it or its own type)."""

    sandbox_id: str
    policy: EgressPolicy
    peers: Mapping[str, IPv4Address] = field(default_factory=dict)
    #: Whose secrets a transform's ``{secret:NAME}`` reads (the egress proxy).
    project: str = "default"


def clamp_ttl(ttl: int) -> int:
    return max(TTL_FLOOR_S, min(TTL_CAP_S, ttl))


class Resolver:
    """See the module docstring. ``upstream`` is (ip, port); ``timeout_s`` is per upstream
    attempt, ``attempts`` UDP tries before SERVFAIL. ``forbidden`` judges each answered
    address (default: the fixed ranges only; the daemon adds its pool and the host);
    ``limit`` the per-sender query rate (None: unlimited). ``limiter`` counts what it
    refused (``take_refused``)."""

    def __init__(
        self,
        directory: SandboxDirectory,
        upstream: tuple[str, int],
        log: EgressLog,
        on_learned: OnLearned,
        *,
        timeout_s: float = 2.0,
        attempts: int = 2,
        forbidden: ForbiddenCheck = classify_destination,
        limit: Rate | None = None,
    ) -> None:
        self._directory = directory
        self._upstream = upstream
        self._log = log
        self._on_learned = on_learned
        self._forbidden = forbidden
        self._timeout_s = timeout_s
        self._attempts = max(1, attempts)
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._cache: dict[str, tuple[float, list[tuple[IPv4Address, int]]]] = {}
        self.limiter = KeyedLimiter(limit) if limit is not None else None
        self._inflight: dict[str, int] = {}
        self.port = 0

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self, host: str = "0.0.0.0", port: int = 0) -> int:
        """Listen on UDP and TCP ``host:port`` (same port number; 0 picks one). Returns it."""
        last: OSError | None = None
        for _ in range(20 if port == 0 else 1):
            udp = await start_udp_dns(host, port, self._on_datagram)
            chosen = int(udp.get_extra_info("sockname")[1])
            try:
                self._tcp = await asyncio.start_server(self._on_tcp, host, chosen)
            except OSError as exc:  # TCP port taken by someone else: try another number
                udp.close()
                last = exc
                continue
            self._udp, self.port = udp, chosen
            return chosen
        raise NetworkError(f"DNS resolver cannot listen on {host}:{port} (TCP): {last}")

    async def close(self) -> None:
        """Stop listening and cancel queries in flight. Safe to call twice."""
        if self._udp is not None:
            self._udp.close()
            self._udp = None
        if self._tcp is not None:
            self._tcp.close()
            self._tcp = None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- transports ------------------------------------------------------------------

    def _on_datagram(self, data: bytes, addr: tuple[str, int]) -> None:
        source = addr[0]
        if not self._admit(source):
            reply = refused_reply(data)
            if reply is not None and self._udp is not None:
                self._udp.sendto(reply, addr)
            return
        if len(self._tasks) >= _MAX_INFLIGHT:
            return
        task = asyncio.get_running_loop().create_task(self._answer_datagram(data, addr))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if self.limiter is not None:
            self._inflight[source] = self._inflight.get(source, 0) + 1
            task.add_done_callback(lambda _t: self._done(source))

    def _admit(self, source: str) -> bool:
        """Whether ``source`` may have this query looked at (a token and a free slot)."""
        if self.limiter is None:
            return True
        if self._inflight.get(source, 0) >= MAX_INFLIGHT_PER_SOURCE:
            self.limiter.refuse(source)
            return False
        return self.limiter.allow(source)

    def queries_in_flight(self, source: str) -> int:
        """How many of ``source``'s queries wait for the upstream now (0 unlimited)."""
        return self._inflight.get(source, 0)

    def _done(self, source: str) -> None:
        left = self._inflight.get(source, 1) - 1
        if left > 0:
            self._inflight[source] = left
        else:
            self._inflight.pop(source, None)

    async def _answer_datagram(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            reply = await self.handle(data, addr[0], tcp=False)
        except Exception:  # a bug must not kill the server; the guest sees a timeout
            log.exception("DNS query from %s failed", addr[0])
            return
        if reply is not None and self._udp is not None:
            self._udp.sendto(reply, addr)

    async def _on_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)  # so close() cancels open TCP connections too
        peer = writer.get_extra_info("peername")

        async def answer(query: bytes) -> bytes | None:
            if self.limiter is not None and not self.limiter.allow(peer[0]):
                return refused_reply(query)
            return await self.handle(query, peer[0], tcp=True)

        try:
            await serve_tcp_dns(reader, writer, answer, self._timeout_s * 5)
        finally:
            if task is not None:
                self._tasks.discard(task)

    # ---- the decision ----------------------------------------------------------------

    async def handle(self, wire: bytes, source: str, *, tcp: bool) -> bytes | None:
        """The reply to one query from ``source`` (None: drop it)."""
        try:
            src = ip_address(source)
        except ValueError:
            src = None
        sandbox = self._directory.lookup(src) if isinstance(src, IPv4Address) else None
        try:
            query = dns.message.from_wire(wire)
        except Exception:  # untrusted bytes: any parser failure is the sender's fault
            return formerr_reply(wire) if sandbox is not None else None
        if sandbox is None:
            return _reply(query, dns.rcode.REFUSED, tcp)
        if query.opcode() != dns.opcode.QUERY:
            return _reply(query, dns.rcode.NOTIMP, tcp)
        if len(query.question) != 1:
            return _reply(query, dns.rcode.FORMERR, tcp)
        q = query.question[0]
        raw_name = q.name.to_text(omit_final_dot=True)
        name = normalize_name(raw_name)
        local = self._answer_local(query, name, q, sandbox, tcp)
        if local is not None:
            return local
        policy = sandbox.policy
        sid = sandbox.sandbox_id
        if policy.mode == "open":
            denier = (
                policy.ordered.name_denied_by(name)
                if policy.screened and policy.ordered is not None and name is not None
                else None
            )
            if denier is not None:  # default allow: a name deny holds in DNS too
                why = f"{denier.canonical} denies this name"
                self._event(sid, raw_name, "deny", denier.canonical, why, denier.index)
                return _reply(query, dns.rcode.NXDOMAIN, tcp)
            return await self._forward_raw(query, wire, tcp)
        if policy.mode == "deny-all":
            self._event(sid, raw_name, "deny", None, "egress is deny-all")
            return _reply(query, dns.rcode.NXDOMAIN, tcp)
        rule = policy.name_allowed_any_port(name) if name is not None else None
        if name is None or rule is None:
            denier = policy.ordered.name_denied_by(name) if policy.ordered and name else None
            if denier is not None:
                why = f"{denier.canonical} denies this name"
                self._event(sid, raw_name, "deny", denier.canonical, why, denier.index)
                return _reply(query, dns.rcode.NXDOMAIN, tcp)
            self._event(sid, raw_name, "deny", None, "no rule allows this name")
            return _reply(query, dns.rcode.NXDOMAIN, tcp)
        if q.rdclass != dns.rdataclass.IN:
            self._event(sid, name, "deny", rule.canonical, "only class IN is answered")
            return _reply(query, dns.rcode.NXDOMAIN, tcp)
        if q.rdtype == dns.rdatatype.AAAA:
            return _reply(query, dns.rcode.NOERROR, tcp)  # IPv4-only guests: no AAAA
        if q.rdtype not in (dns.rdatatype.A, dns.rdatatype.CNAME):
            kind = dns.rdatatype.to_text(q.rdtype)
            self._event(
                sid, name, "deny", rule.canonical, f"{kind} queries are not answered under rules"
            )
            return _reply(query, dns.rcode.NXDOMAIN, tcp)
        index = rule.index if isinstance(rule, PolicyRule) else None
        return await self._forward_allowed(
            query, name, q.rdtype, sandbox, rule.canonical, tcp, index
        )

    def _answer_local(
        self,
        query: dns.message.Message,
        name: str | None,
        q: dns.rrset.RRset,
        sandbox: SandboxNet,
        tcp: bool,
    ) -> bytes | None:
        if name is None:
            return None
        peer = sandbox.peers.get(name)
        if peer is None:
            if name == INTERNAL_SUFFIX or name.endswith("." + INTERNAL_SUFFIX):
                return _reply(query, dns.rcode.NXDOMAIN, tcp)
            return None
        response = dns.message.make_response(query, recursion_available=True)
        response.flags |= dns.flags.AA
        if q.rdtype == dns.rdatatype.A and q.rdclass == dns.rdataclass.IN:
            response.answer.append(dns.rrset.from_text(q.name, PEER_TTL_S, "IN", "A", str(peer)))
        return _to_wire(response, query, tcp)

    async def _forward_raw(self, query: dns.message.Message, wire: bytes, tcp: bool) -> bytes:
        """Open egress: the guest's own bytes, over the transport it used."""
        try:
            answer = await self._exchange(wire, tcp)
            reply = dns.message.from_wire(answer)
            if not query.is_response(reply):
                raise NetworkError("upstream answer does not match the query")
        except (NetworkError, dns.exception.DNSException) as exc:
            log.warning("DNS forward failed: %s", exc)
            return _reply(query, dns.rcode.SERVFAIL, tcp)
        return answer

    async def _forward_allowed(
        self,
        query: dns.message.Message,
        name: str,
        rdtype: dns.rdatatype.RdataType,
        sandbox: SandboxNet,
        rule: str,
        tcp: bool,
        index: int | None = None,
    ) -> bytes:
        """``index``: the ordered policy's rule that allowed the name (for its counts)."""
        sid = sandbox.sandbox_id
        try:
            upstream = await self._ask_upstream(name, rdtype)
        except NetworkError as exc:
            self._event(sid, name, "deny", rule, f"upstream DNS failed: {exc}")
            return _reply(query, dns.rcode.SERVFAIL, tcp)
        response = dns.message.make_response(query, recursion_available=True)
        response.set_rcode(upstream.rcode())
        sorted_out = filter_answer(_a_records(upstream), sandbox.policy, self._forbidden)
        answered = {a for a, _ in sorted_out.answer}
        ttl = clamp_ttl(min((t for _, t in sorted_out.answer), default=TTL_FLOOR_S))
        for rrset in upstream.answer:
            if rrset.rdtype == dns.rdatatype.CNAME:
                kept = list(rrset)
            elif rrset.rdtype == dns.rdatatype.A:
                kept = [rd for rd in rrset if IPv4Address(rd.address) in answered]
            else:
                continue
            if kept:
                response.answer.append(
                    dns.rrset.from_rdata_list(rrset.name, min(rrset.ttl, ttl), kept)
                )
        if sorted_out.refused:
            why = f"answered without {sorted_out.refusal()}"
            self._event(sid, name, "deny", rule, why)
        if sorted_out.learn:
            ports = sandbox.policy.name_ports(name)
            learned: Learned = [(a, p) for a, _ in sorted_out.learn for p in ports]
            try:
                await self._on_learned(sid, learned, ttl, name)
            except Exception as exc:  # the allow set is not filled: do not let it resolve
                log.error("learning %s for %s failed: %s", name, sid, exc)
                self._event(sid, name, "deny", rule, f"cannot add its addresses: {exc}")
                return _reply(query, dns.rcode.SERVFAIL, tcp)
        if sorted_out.answer or not sorted_out.refused:
            got = ", ".join(str(a) for a, _ in sorted_out.answer)
            got = got or dns.rcode.to_text(upstream.rcode())
            learnt = {a for a, _ in sorted_out.learn}
            via_ip = [str(a) for a, _ in sorted_out.answer if a not in learnt]
            note = f"; {', '.join(via_ip)} only as its ip/cidr rules allow" if via_ip else ""
            why = f"resolved to {got} (allowed for {ttl}s{note})"
            self._event(sid, name, "allow", rule, why, index)
        return _to_wire(response, query, tcp)

    # ---- upstream --------------------------------------------------------------------

    async def _exchange(self, wire: bytes, tcp: bool) -> bytes:
        """One upstream round trip: UDP with retries (TCP if truncated), or TCP."""
        if tcp:
            return await query_tcp(self._upstream, wire, self._timeout_s)
        for attempt in range(self._attempts):
            try:
                answer = await query_udp(self._upstream, wire, self._timeout_s)
            except NetworkError:
                if attempt + 1 == self._attempts:
                    raise
                continue
            if len(answer) >= 3 and answer[2] & 0x02:  # TC bit: ask again over TCP
                return await query_tcp(self._upstream, wire, self._timeout_s)
            return answer
        raise NetworkError("unreachable")  # pragma: no cover

    async def _ask_upstream(
        self, name: str, rdtype: dns.rdatatype.RdataType
    ) -> dns.message.Message:
        """A query we build (nothing of the guest's packet goes out but the name)."""
        query = dns.message.make_query(name + ".", rdtype, use_edns=0, payload=1232)
        try:
            reply = dns.message.from_wire(await self._exchange(query.to_wire(), False))
        except dns.exception.DNSException as exc:
            raise NetworkError(f"bad answer from upstream DNS: {exc}") from exc
        if not query.is_response(reply):
            raise NetworkError("upstream answer does not match the query")
        if reply.rcode() not in (dns.rcode.NOERROR, dns.rcode.NXDOMAIN):
            raise NetworkError(f"upstream DNS answered {dns.rcode.to_text(reply.rcode())}")
        return reply

    async def resolve_a(self, name: str) -> list[tuple[IPv4Address, int]]:
        """The A records of ``name`` as (address, ttl seconds), resolved by the host for
        the proxy (cached for their TTL). [] when the name does not exist. Raises
        NetworkError when the upstream fails or times out."""
        norm = normalize_name(name)
        if norm is None:
            return []
        now = time.monotonic()
        hit = self._cache.get(norm)
        if hit is not None and hit[0] > now:
            return list(hit[1])
        reply = await self._ask_upstream(norm, dns.rdatatype.A)
        addrs = _a_records(reply)
        if len(self._cache) > 4096:
            self._cache.clear()
        ttl = min((t for _, t in addrs), default=0)
        self._cache[norm] = (now + min(ttl, TTL_CAP_S), addrs)
        return addrs

    def _event(
        self,
        sid: str,
        name: str,
        verdict: Verdict,
        rule: str | None,
        why: str,
        index: int | None = None,
    ) -> None:
        event = EgressEvent(
            time.time(), sid, name, None, "dns", name, verdict, rule, why, rule_index=index
        )
        self._log.record(event)


def _a_records(message: dns.message.Message) -> list[tuple[IPv4Address, int]]:
    out: list[tuple[IPv4Address, int]] = []
    for rrset in message.answer:
        if rrset.rdtype == dns.rdatatype.A and rrset.rdclass == dns.rdataclass.IN:
            out.extend((IPv4Address(rd.address), rrset.ttl) for rd in rrset)
    return out


def _reply(query: dns.message.Message, rcode: dns.rcode.Rcode, tcp: bool) -> bytes:
    response = dns.message.make_response(query, recursion_available=True)
    response.set_rcode(rcode)
    return _to_wire(response, query, tcp)


def _to_wire(response: dns.message.Message, query: dns.message.Message, tcp: bool) -> bytes:
    # UDP answers must fit what the guest can take; dnspython truncates and sets TC.
    limit = 65535 if tcp else max(512, query.payload if query.edns >= 0 else 512)
    return response.to_wire(max_size=limit, prefer_truncation=True)
