"""The egress proxy: TCP 80/443 from sandboxes in rules mode, checked by TLS SNI or HTTP Host.

nft redirects a rules-mode sandbox's tcp/80 and tcp/443 (unless an explicit IP rule
covers the destination) here. Per connection:

1. the source must be a registered sandbox address (others: closed at once);
2. the port the guest dialled comes from ``SO_ORIGINAL_DST``;
3. the first bytes are read (with a timeout) and parsed: a TLS ClientHello's SNI (records
   may arrive split over many reads; no SNI, or an encrypted ClientHello, is refused) or
   an HTTP/1.x request head, strictly (:mod:`hutch.net.http_head`: bare CR/LF, control
   bytes, CONNECT, a Host that is absent, repeated or contradicted by an absolute URL
   parsed per RFC 3986 are refused);
4. the name is checked with ``policy.match_name(name, port)``;
5. the host resolves the name *itself* (the guest's idea of the address is never used),
   drops forbidden answers (loopback, link-local, the host's own addresses asked of the
   kernel now, private ranges unless an ip/cidr rule covers them: DNS rebinding, see
   :mod:`hutch.net.destinations`), connects to the first good address on the original
   port, and relays with backpressure: TLS both ways as is; HTTP exactly the one
   checked request, then only the answer (:mod:`hutch.net.http_relay`). Both run in
   protocol callbacks (:mod:`hutch.net.relay`), one task per connection for its
   decision, no streams.

Under ``inspection: full`` (and ``learn``), and under ``partial`` for a destination
whose first matching rule needs the request, TLS is terminated instead
(:mod:`hutch.net.proxy_inspect`): after the SNI check the guest's handshake completes
against a leaf from its project's CA (:mod:`hutch.net.tls_ca`,
:mod:`hutch.net.tls_stream`; ALPN ``h2`` or ``http/1.1``) and every HTTP/1.1 request
(:mod:`hutch.net.inspected_http`: keep-alive, WebSockets) or HTTP/2 stream
(:mod:`hutch.net.h2_relay`) inside is decided on its own and relayed over a verified
upstream TLS connection (HTTP/1.1, reused while that is safe). Learn and dry run decide
by the policy they would enforce and log would-be denials as allowances
(:func:`proxy_decide.observed`).

Floods: with a ``limit``, each new connection first takes a token from its sender's
bucket (:mod:`hutch.net.ratelimit`); without one it is closed at once, before a byte is
read, and counted (the kernel drops SYNs past twice the rate, see :mod:`hutch.net.nft`).

Denials: plain HTTP gets a 403 whose body says what was denied and why; TLS is closed.
Every decision goes to the EgressLog. A rule change cuts relayed connections the new
rules no longer allow (:meth:`EgressProxy.revalidate`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address
from typing import Protocol

from hutch.contract.views import EgressEvent, Verdict
from hutch.errors import NetworkError
from hutch.net.destinations import ForbiddenCheck, opened_by_ip_rule
from hutch.net.dns import SandboxDirectory, SandboxNet
from hutch.net.egress_log import EgressLog
from hutch.net.http_head import RequestHead
from hutch.net.http_relay import OneRequest
from hutch.net.proxy_decide import (
    Allowed,
    Denied,
    HttpFacts,
    SecretResolver,
    decide_destination,
    decide_request,
    observed,
    still_allowed,
    terminates_tls,
)
from hutch.net.proxy_inspect import inspect_tls
from hutch.net.ratelimit import KeyedLimiter, Rate
from hutch.net.relay import Endpoint, Relay
from hutch.net.rules import EgressPolicy, normalize_name
from hutch.net.sniff import MAX_PEEK, Sniffed, sniff
from hutch.net.tls_ca import ProjectCAs

__all__ = [
    "EgressProxy",
    "NameResolver",
    "SecretResolver",
    "Sniffed",
    "close_writer",
    "pipe_both",
    "sniff",
    "so_original_dst_port",
]

log = logging.getLogger(__name__)

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h, at level SOL_IP (0)


class NameResolver(Protocol):
    async def resolve_a(self, name: str) -> list[tuple[IPv4Address, int]]: ...


def so_original_dst_port(sock: socket.socket) -> int:
    """The destination port the guest dialled before nft redirected it here."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)  # struct sockaddr_in
    return int(struct.unpack_from("!H", raw, 2)[0])


# ---- the proxy --------------------------------------------------------------------------


@dataclass(eq=False)
class _Relay:
    """A connection being relayed, for :meth:`EgressProxy.revalidate`."""

    sandbox: SandboxNet
    name: str
    port: int
    protocol: str
    transports: tuple[asyncio.WriteTransport, ...]


class EgressProxy:
    """See the module docstring. ``forbidden(addr)`` says why a name must not lead to an
    address (None: it may); ``original_port`` is replaceable for tests without nft;
    ``limit`` is the per-sender rate of new connections (None: unlimited)."""

    def __init__(
        self,
        directory: SandboxDirectory,
        resolver: NameResolver,
        log: EgressLog,
        forbidden: ForbiddenCheck,
        connect_timeout_s: float = 10,
        *,
        peek_timeout_s: float = 10,
        original_port: Callable[[socket.socket], int] = so_original_dst_port,
        limit: Rate | None = None,
        ca: ProjectCAs | None = None,
        upstream_tls: ssl.SSLContext | None = None,
        secrets: SecretResolver | None = None,
    ) -> None:
        self._directory = directory
        #: TLS inspection: the projects' CAs minting leaves for guests, how upstream
        #: servers are verified, where transform secrets come from (set by the daemon).
        self.ca = ca
        self.upstream_tls = upstream_tls
        self.secrets = secrets
        self._resolver = resolver
        self._log = log
        self._forbidden = forbidden
        self._connect_timeout_s = connect_timeout_s
        self._peek_timeout_s = peek_timeout_s
        self._original_port = original_port
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._relays: set[_Relay] = set()
        self.limiter = KeyedLimiter(limit) if limit is not None else None
        self.port = 0

    async def start(self, host: str = "0.0.0.0", port: int = 0) -> int:
        try:
            loop = asyncio.get_running_loop()
            self._server = await loop.create_server(lambda: Endpoint(self._on_client), host, port)
        except OSError as exc:
            raise NetworkError(f"egress proxy cannot listen on {host}:{port}: {exc}") from exc
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        """Stop listening and cut every proxied connection. Safe to call twice."""
        if self._server is not None:
            self._server.close()
            self._server = None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def revalidate(self, sandbox_id: str, policy: EgressPolicy) -> int:
        """The rules of ``sandbox_id`` are now ``policy``: cut every connection relayed for
        it that ``policy`` does not allow (both sides closed at once, each logged).
        Returns how many were cut."""
        cut = 0
        for relay in list(self._relays):
            if relay.sandbox.sandbox_id != sandbox_id:
                continue
            why = still_allowed(policy, relay.name, relay.port)
            if why is None:
                continue
            self._relays.discard(relay)
            for transport in relay.transports:
                transport.abort()
            cut += 1
            self.event(
                relay.sandbox, relay.name, relay.port, relay.protocol, relay.name,
                "deny", None, f"open connection cut: the rules changed ({why})",
            )  # fmt: skip
        return cut

    def _on_client(self, guest: Endpoint) -> None:
        """A guest connected (called as its transport is made): checks that need no
        bytes, then one task for the rest. A refused connection costs no task."""
        assert guest.transport is not None
        peer = guest.transport.get_extra_info("peername")
        if self.limiter is not None and peer and not self.limiter.allow(str(peer[0])):
            guest.close()  # over the sender's rate: closed at once (counted by the limiter)
            return
        try:
            src = ip_address(peer[0])
        except (TypeError, ValueError, IndexError):
            guest.close()
            return
        sandbox = self.current(src)
        if sandbox is None:
            guest.close()  # not a sandbox: nothing to log against, just close
            return
        task = asyncio.get_running_loop().create_task(self._run(guest, src, sandbox))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(
        self, guest: Endpoint, src: IPv4Address | IPv6Address, sandbox: SandboxNet
    ) -> None:
        try:
            await self._serve(guest, src, sandbox)
        except (ConnectionError, OSError) as exc:
            log.debug("proxied connection ended: %s", exc)
        finally:
            if guest.streams is not None:  # handed over to TLS inspection
                await close_writer(guest.streams)
            else:
                guest.close()
                with contextlib.suppress(OSError, ConnectionError):
                    await guest.wait_closed()

    async def _serve(
        self, guest: Endpoint, src: IPv4Address | IPv6Address, sandbox: SandboxNet
    ) -> None:
        """One guest connection, decided and relayed."""
        assert guest.transport is not None
        try:
            port = self._original_port(guest.transport.get_extra_info("socket"))
        except (OSError, AttributeError) as exc:  # no conntrack entry: not redirected by nft
            self.event(sandbox, "-", None, "tcp", None, "deny", None, f"no original port: {exc}")
            return
        seen = await self._peek(guest)
        http = HttpFacts.of(seen.request)
        if seen.error is not None or seen.name is None:
            reason = seen.error or "no name"
            self.event(
                sandbox, seen.name or "-", port, seen.protocol, seen.name, "deny", None, reason,
                http=http,
            )  # fmt: skip
            self._refuse(guest, seen, port, reason)
            return
        if seen.protocol == "tls" and terminates_tls(sandbox.policy, seen.name, port):
            raw, reader, writer = guest.to_streams()
            await inspect_tls(
                self, sandbox, src, seen.name, port, raw, reader, writer,
                handshake_timeout_s=self._peek_timeout_s,
            )  # fmt: skip
            return
        name = seen.name
        try:

            def decide(policy: EgressPolicy) -> Allowed:
                allowed = decide_destination(policy, name, port)
                if allowed.inspect:
                    allowed = self._request_rules(sandbox, policy, name, port, seen.request)
                return allowed

            allowed = observed(decide, sandbox.policy)
            upstream, addr = await self._connect_plain(sandbox.policy, name, port, allowed.rule)
        except Denied as denied:
            self.event(
                sandbox, name, port, seen.protocol, name, "deny", denied.rule,
                denied.reason, http=http, index=denied.index,
            )  # fmt: skip
            self._refuse(guest, seen, port, denied.reason)
            return
        rule, index = allowed.rule, allowed.index
        self.event(
            sandbox, str(addr), port, seen.protocol, name, "allow", rule,
            allowed.note or ("allowed by rule" if rule else "open egress"), http=http,
            index=index,
        )  # fmt: skip
        assert upstream.transport is not None
        release = self.open_relay(
            sandbox, src, name, port, seen.protocol, (guest.transport, upstream.transport),
            str(addr),
        )  # fmt: skip
        if release is None:
            upstream.abort()
            return
        sent = self.counter(sandbox.sandbox_id)
        try:
            if seen.request is not None:
                # Exactly the checked request (its head as the rules rewrote it, then the
                # body as framed), never a byte after it; the server's answer ends it.
                request = allowed.head or seen.request
                skip = seen.request.consumed  # the guest's own head, replaced by ``request``
                guest.buffer[:skip] = b""
                relay = Relay(guest, upstream, sent=sent, upload=OneRequest(request),
                              answer_ends=True)  # fmt: skip
                relay.start(request.head)
                cut = await relay.wait()
                if cut is not None:
                    self.event(sandbox, str(addr), port, "http", name, "deny", rule, cut)
            else:
                relay = Relay(guest, upstream, sent=sent)
                relay.start()
                await relay.wait()
        finally:
            release()
            upstream.close()

    def open_relay(
        self,
        sandbox: SandboxNet,
        src: IPv4Address | IPv6Address,
        name: str,
        port: int,
        protocol: str,
        transports: tuple[asyncio.WriteTransport, ...],
        address: str,
    ) -> Callable[[], None] | None:
        """Register a relay for :meth:`revalidate` and return what unregisters it; None
        (logged) when the rules changed while it was decided and no longer allow it
        (revalidate() cut what was registered then; this one meets the rules in force
        now)."""
        relay = _Relay(sandbox, name, port, protocol, transports)
        self._relays.add(relay)
        now = self.current(src)
        why = "the sandbox is gone" if now is None else still_allowed(now.policy, name, port)
        if why is None:
            return lambda: self._relays.discard(relay)
        self._relays.discard(relay)
        self.event(
            sandbox, address, port, protocol, name, "deny", None,
            f"open connection cut: the rules changed ({why})",
        )  # fmt: skip
        return None

    def current(self, src: IPv4Address | IPv6Address) -> SandboxNet | None:
        """The sandbox at ``src`` with the rules in force now (None: gone)."""
        return self._directory.lookup(src) if isinstance(src, IPv4Address) else None

    def counter(self, sandbox_id: str) -> Callable[[int], None]:
        """Counts the bytes ``sandbox_id`` sends, relayed (the meter's egress bytes)."""

        def sent(count: int) -> None:
            self._log.add_bytes(sandbox_id, sent=count)

        return sent

    def _request_rules(
        self,
        sandbox: SandboxNet,
        policy: EgressPolicy,
        name: str,
        port: int,
        request: RequestHead | None,
    ) -> Allowed:
        """A rule needs the request (methods, path, transform). Plain HTTP: the request
        decides. TLS without inspection ``full``: refused (its request cannot be read)."""
        if request is None:
            assert policy.ordered is not None
            first = policy.ordered.decide_connection(name, None, port).rule
            assert first is not None
            raise Denied(
                f"{first.canonical} needs the HTTP request, which TLS hides from hutch "
                f"when it does not terminate it: {name} on port {port} is refused",
                first.canonical,
                first.index,
            )
        return decide_request(policy, name, port, request, self.reveal(sandbox))

    def reveal(self, sandbox: SandboxNet) -> Callable[[str], str] | None:
        secrets = self.secrets
        if secrets is None:
            return None
        project = sandbox.project
        return lambda name: secrets.reveal(name, project)

    async def _peek(self, guest: Endpoint) -> Sniffed:
        """Sniff what the guest holds until it names its destination (or fails to).
        The bytes stay held in ``guest.buffer`` for the relay."""
        try:
            async with asyncio.timeout(self._peek_timeout_s):
                while True:
                    # The head or ClientHello is looked for in the first MAX_PEEK bytes:
                    # one read may bring a request's body with its head (it stays held),
                    # and the sniffer refuses anything longer than that as too long.
                    buf = guest.buffer
                    seen = sniff(bytes(buf[:MAX_PEEK]))
                    if seen is None and len(buf) > MAX_PEEK:
                        seen = sniff(bytes(buf))
                    if seen is not None:
                        return seen
                    if guest.eof or guest.lost:
                        return Sniffed("unknown", None, "closed before a request")
                    await guest.wait_data()
        except TimeoutError:
            why = f"no TLS ClientHello or HTTP request within {self._peek_timeout_s:g}s"
            return Sniffed("unknown", None, why)

    async def connect(
        self,
        policy: EgressPolicy,
        name: str,
        port: int,
        rule_text: str | None,
        tls: ssl.SSLContext | None = None,
    ) -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter], IPv4Address]:
        """Resolve ``name`` here, drop forbidden answers and connect to the first good
        address (over TLS verified for ``name`` when ``tls`` is given), as streams.
        Failures after the rule allowed carry no rule index: they are not the rule's
        decision."""
        good = await self._destinations(policy, name, port, rule_text)
        errors: list[str] = []
        for addr in good:
            try:
                async with asyncio.timeout(self._connect_timeout_s):
                    if tls is None:
                        conn = await asyncio.open_connection(str(addr), port)
                    else:
                        conn = await asyncio.open_connection(
                            str(addr), port, ssl=tls, server_hostname=name
                        )
                return conn, addr
            except ssl.SSLCertVerificationError as exc:
                raise Denied(
                    f"the server {name}:{port} failed TLS verification: {exc.verify_message}",
                    rule_text,
                ) from exc
            except (OSError, TimeoutError) as exc:
                errors.append(f"{addr}: {exc or 'timed out'}")
        raise Denied(f"cannot connect to {name}:{port} ({'; '.join(errors)})", rule_text)

    async def _connect_plain(
        self, policy: EgressPolicy, name: str, port: int, rule_text: str | None
    ) -> tuple[Endpoint, IPv4Address]:
        """As :meth:`connect`, for the plain relay: the connection's :class:`Endpoint`."""
        good = await self._destinations(policy, name, port, rule_text)
        loop = asyncio.get_running_loop()
        errors: list[str] = []
        for addr in good:
            try:
                async with asyncio.timeout(self._connect_timeout_s):
                    _, upstream = await loop.create_connection(Endpoint, str(addr), port)
                return upstream, addr
            except (OSError, TimeoutError) as exc:
                errors.append(f"{addr}: {exc or 'timed out'}")
        raise Denied(f"cannot connect to {name}:{port} ({'; '.join(errors)})", rule_text)

    async def _destinations(
        self, policy: EgressPolicy, name: str, port: int, rule_text: str | None
    ) -> list[IPv4Address]:
        """The addresses ``name`` may lead to on ``port``, resolved here, in the
        resolver's order; raises Denied when there is none."""
        try:
            addrs = [a for a, _ in await self._resolver.resolve_a(name)]
        except NetworkError as exc:
            raise Denied(f"cannot resolve {name}: {exc}", rule_text) from exc
        if not addrs:
            raise Denied(f"{name} has no IPv4 address", rule_text)
        if policy.screened and policy.ordered is not None:
            # Default allow: an address the name leads to is decided too, in rule order
            # with the name (``decide_connection`` with both): an ip/cidr deny holds for
            # the proxy's own connection, unless a name rule before it decided.
            norm = normalize_name(name)
            kept: list[IPv4Address] = []
            denied: list[Denied] = []
            for addr in addrs:
                decided = policy.ordered.decide_connection(norm, addr, port)
                rule = decided.rule
                if decided.verdict == "deny" and rule is not None:
                    why = f"{rule.canonical} denies {addr} (what {name} resolves to)"
                    denied.append(Denied(why, rule.canonical, rule.index))
                else:
                    kept.append(addr)
            if not kept:
                raise denied[0]
            addrs = kept
        verdicts = [(a, self._forbidden(a)) for a in addrs]
        good = [
            a
            for a, why in verdicts
            if why is None or (why.kind == "private" and opened_by_ip_rule(policy, a, port))
        ]
        if not good:
            bad = ", ".join(str(a) for a in addrs)
            whys = "; ".join(f"{a} is {why.why}" for a, why in verdicts if why is not None)
            raise Denied(f"{name} resolves only to forbidden addresses ({bad}): {whys}", rule_text)
        return good

    def _refuse(self, guest: Endpoint, seen: Sniffed, port: int, reason: str) -> None:
        """Plain HTTP: a 403 saying why (sent before the close that follows)."""
        if seen.protocol != "http" or guest.transport is None:
            return  # TLS (or garbage): just close; there is no way to explain in plain text
        what = f"{seen.name}:{port}" if seen.name else f"this request on port {port}"
        body = f"hutch egress denied {what}: {reason}\n".encode()
        guest.transport.write(
            b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain; charset=utf-8\r\n"
            + f"Content-Length: {len(body)}\r\n".encode()
            + b"Connection: close\r\nX-Hutch-Egress: denied\r\n\r\n"
            + body
        )

    def event(
        self,
        sandbox: SandboxNet,
        destination: str,
        port: int | None,
        protocol: str,
        name: str | None,
        verdict: Verdict,
        rule: str | None,
        reason: str,
        *,
        http: HttpFacts | None = None,
        index: int | None = None,
    ) -> None:
        h = http or HttpFacts()
        self._log.record(
            EgressEvent(
                time.time(),
                sandbox.sandbox_id,
                destination,
                port,
                protocol,
                name,
                verdict,
                rule,
                reason,
                h.method,
                h.path,
                index,
            )
        )


# ---- plumbing ---------------------------------------------------------------------------


async def _pump(
    src: asyncio.StreamReader,
    dst: asyncio.StreamWriter,
    counted: Callable[[int], None] | None = None,
) -> None:
    """Copy until EOF; ``drain`` makes a slow reader slow down the writer (backpressure).
    ``counted`` is told the size of every chunk written."""
    while data := await src.read(64 * 1024):
        dst.write(data)
        if counted is not None:
            counted(len(data))
        await dst.drain()
    if dst.can_write_eof():  # half-close: the other direction may still be talking
        with contextlib.suppress(OSError):
            dst.write_eof()


async def pipe_both(
    a_reader: asyncio.StreamReader,
    a_writer: asyncio.StreamWriter,
    b_reader: asyncio.StreamReader,
    b_writer: asyncio.StreamWriter,
    *,
    sent: Callable[[int], None] | None = None,
) -> None:
    """Both directions until both reach EOF or either fails (then both are cut).
    ``sent`` is told the bytes written from a to b."""
    up = asyncio.create_task(_pump(a_reader, b_writer, sent))
    down = asyncio.create_task(_pump(b_reader, a_writer))
    try:
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in (up, down):
            task.cancel()
        await asyncio.gather(up, down, return_exceptions=True)


async def close_writer(writer: asyncio.StreamWriter) -> None:
    """Close and wait, ignoring a peer that is already gone."""
    writer.close()
    with contextlib.suppress(OSError, ConnectionError):
        await writer.wait_closed()
