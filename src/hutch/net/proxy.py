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
   checked request, then only the answer (:mod:`hutch.net.http_relay`).

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
from hutch.net.http_relay import relay_one_request
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
from hutch.net.rules import EgressPolicy, normalize_name
from hutch.net.sniff import Sniffed, sniff
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
    writers: tuple[asyncio.StreamWriter, asyncio.StreamWriter]


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
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._relays: set[_Relay] = set()
        self.limiter = KeyedLimiter(limit) if limit is not None else None
        self.port = 0

    async def start(self, host: str = "0.0.0.0", port: int = 0) -> int:
        try:
            self._server = await asyncio.start_server(self._on_client, host, port)
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
            for writer in relay.writers:
                writer.transport.abort()
            cut += 1
            self.event(
                relay.sandbox, relay.name, relay.port, relay.protocol, relay.name,
                "deny", None, f"open connection cut: the rules changed ({why})",
            )  # fmt: skip
        return cut

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, OSError) as exc:
            log.debug("proxied connection ended: %s", exc)
        finally:
            if task is not None:
                self._tasks.discard(task)
            await close_writer(writer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        if self.limiter is not None and peer and not self.limiter.allow(str(peer[0])):
            return  # over the sender's rate: closed at once (counted by the limiter)
        try:
            src = ip_address(peer[0])
        except (TypeError, ValueError, IndexError):
            return
        sandbox = self.current(src)
        if sandbox is None:
            return  # not a sandbox: nothing to log against, just close
        try:
            port = self._original_port(writer.get_extra_info("socket"))
        except (OSError, AttributeError) as exc:  # no conntrack entry: not redirected by nft
            self.event(sandbox, "-", None, "tcp", None, "deny", None, f"no original port: {exc}")
            return
        seen, raw = await self._peek(reader)
        http = HttpFacts.of(seen.request)
        if seen.error is not None or seen.name is None:
            reason = seen.error or "no name"
            self.event(
                sandbox, seen.name or "-", port, seen.protocol, seen.name, "deny", None, reason,
                http=http,
            )  # fmt: skip
            await self._refuse(writer, seen, port, reason)
            return
        if seen.protocol == "tls" and terminates_tls(sandbox.policy, seen.name, port):
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
            upstream, addr = await self.connect(sandbox.policy, seen.name, port, allowed.rule)
        except Denied as denied:
            self.event(
                sandbox, seen.name, port, seen.protocol, seen.name, "deny", denied.rule,
                denied.reason, http=http, index=denied.index,
            )  # fmt: skip
            await self._refuse(writer, seen, port, denied.reason)
            return
        rule, index = allowed.rule, allowed.index
        self.event(
            sandbox, str(addr), port, seen.protocol, seen.name, "allow", rule,
            allowed.note or ("allowed by rule" if rule else "open egress"), http=http,
            index=index,
        )  # fmt: skip
        up_reader, up_writer = upstream
        release = self.open_relay(
            sandbox, src, seen.name, port, seen.protocol, (writer, up_writer), str(addr)
        )
        if release is None:
            up_writer.transport.abort()
            return
        sent = self.counter(sandbox.sandbox_id)
        try:
            if seen.request is not None:
                body = raw[seen.request.consumed :]
                request = allowed.head or seen.request
                cut = await relay_one_request(
                    reader, writer, up_reader, up_writer, request, body, sent=sent
                )
                if cut is not None:
                    self.event(sandbox, str(addr), port, "http", seen.name, "deny", rule, cut)
            else:
                up_writer.write(raw)
                sent(len(raw))
                await pipe_both(reader, writer, up_reader, up_writer, sent=sent)
        finally:
            release()
            await close_writer(up_writer)

    def open_relay(
        self,
        sandbox: SandboxNet,
        src: IPv4Address | IPv6Address,
        name: str,
        port: int,
        protocol: str,
        writers: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
        address: str,
    ) -> Callable[[], None] | None:
        """Register a relay for :meth:`revalidate` and return what unregisters it; None
        (logged) when the rules changed while it was decided and no longer allow it
        (revalidate() cut what was registered then; this one meets the rules in force
        now)."""
        relay = _Relay(sandbox, name, port, protocol, writers)
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

    async def _peek(self, reader: asyncio.StreamReader) -> tuple[Sniffed, bytes]:
        buf = b""
        try:
            async with asyncio.timeout(self._peek_timeout_s):
                while True:
                    seen = sniff(buf)
                    if seen is not None:
                        return seen, buf
                    chunk = await reader.read(4096)
                    if not chunk:
                        return Sniffed("unknown", None, "closed before a request"), buf
                    buf += chunk
        except TimeoutError:
            why = f"no TLS ClientHello or HTTP request within {self._peek_timeout_s:g}s"
            return Sniffed("unknown", None, why), buf

    async def connect(
        self,
        policy: EgressPolicy,
        name: str,
        port: int,
        rule_text: str | None,
        tls: ssl.SSLContext | None = None,
    ) -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter], IPv4Address]:
        """Resolve ``name`` here, drop forbidden answers and connect to the first good
        address (over TLS verified for ``name`` when ``tls`` is given). Failures after
        the rule allowed carry no rule index: they are not the rule's decision."""
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

    async def _refuse(
        self, writer: asyncio.StreamWriter, seen: Sniffed, port: int, reason: str
    ) -> None:
        if seen.protocol != "http":
            return  # TLS (or garbage): just close; there is no way to explain in plain text
        what = f"{seen.name}:{port}" if seen.name else f"this request on port {port}"
        body = f"hutch egress denied {what}: {reason}\n".encode()
        writer.write(
            b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain; charset=utf-8\r\n"
            + f"Content-Length: {len(body)}\r\n".encode()
            + b"Connection: close\r\nX-Hutch-Egress: denied\r\n\r\n"
            + body
        )
        with contextlib.suppress(ConnectionError, OSError):
            await writer.drain()

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
