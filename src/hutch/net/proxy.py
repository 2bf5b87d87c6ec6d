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
import dataclasses
import logging
import re
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from ipaddress import IPv4Address, ip_address
from typing import Literal, Protocol

from hutch.contract.egress_policy import HttpRequest
from hutch.contract.views import EgressEvent, Verdict
from hutch.errors import NetworkError
from hutch.net.destinations import ForbiddenCheck, opened_by_ip_rule
from hutch.net.dns import SandboxDirectory, SandboxNet
from hutch.net.egress_log import EgressLog
from hutch.net.http_head import HeadError, RequestHead, parse_request_head, rewrite_fields
from hutch.net.http_relay import relay_one_request
from hutch.net.ratelimit import KeyedLimiter, Rate
from hutch.net.rules import EgressPolicy, normalize_name

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
MAX_TLS_HELLO = 64 * 1024
MAX_PEEK = MAX_TLS_HELLO + 1024
_EXT_SERVER_NAME = 0
_EXT_ECH = 0xFE0D
_METHOD_START = re.compile(rb"^[A-Z]{1,16}( |$)")


class NameResolver(Protocol):
    async def resolve_a(self, name: str) -> list[tuple[IPv4Address, int]]: ...


def so_original_dst_port(sock: socket.socket) -> int:
    """The destination port the guest dialled before nft redirected it here."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)  # struct sockaddr_in
    return int(struct.unpack_from("!H", raw, 2)[0])


# ---- what the guest sent first ---------------------------------------------------------


@dataclass(frozen=True)
class Sniffed:
    """What the first bytes say: the protocol, the name, or why there is none.
    ``head`` is what to send upstream instead of the bytes read (HTTP rewrites);
    ``request`` the checked HTTP request (its body follows ``request.consumed``)."""

    protocol: Literal["tls", "http", "unknown"]
    name: str | None
    error: str | None = None
    head: bytes | None = None
    request: RequestHead | None = None


def sniff(buf: bytes) -> Sniffed | None:
    """Parse the start of a connection; None means "read more bytes first"."""
    if not buf:
        return None
    if buf[0] == 0x16:
        return _sniff_tls(buf)
    if len(buf) > MAX_PEEK:  # e.g. endless empty TLS records: never buffer without bound
        return Sniffed("unknown", None, "no server name in the first 64 KiB")
    if _METHOD_START.match(buf[:17]):
        return _sniff_http(buf)
    return Sniffed("unknown", None, "neither a TLS ClientHello nor an HTTP/1.x request")


def _sniff_tls(buf: bytes) -> Sniffed | None:
    handshake = bytearray()
    off = 0
    while True:
        if len(buf) < off + 5:
            return None
        ctype = buf[off]
        (length,) = struct.unpack_from("!H", buf, off + 3)
        if ctype != 0x16:
            return Sniffed("tls", None, "TLS data before the ClientHello was complete")
        if len(buf) < off + 5 + length:
            return None
        handshake += buf[off + 5 : off + 5 + length]
        off += 5 + length
        if len(handshake) >= 4:
            if handshake[0] != 1:
                return Sniffed("tls", None, "the first TLS handshake message is not ClientHello")
            need = 4 + int.from_bytes(handshake[1:4], "big")
            if need > MAX_TLS_HELLO:
                return Sniffed("tls", None, "TLS ClientHello is too large")
            if len(handshake) >= need:
                return _client_hello(bytes(handshake[4:need]))


def _client_hello(body: bytes) -> Sniffed:
    try:
        pos = 2 + 32  # legacy_version, random
        pos += 1 + body[pos]  # session id
        pos += 2 + struct.unpack_from("!H", body, pos)[0]  # cipher suites
        pos += 1 + body[pos]  # compression methods
        if pos == len(body):
            return Sniffed("tls", None, "TLS ClientHello has no server name (SNI)")
        (ext_total,) = struct.unpack_from("!H", body, pos)
        pos += 2
        end = pos + ext_total
        if end > len(body):
            raise ValueError("extensions overrun")
        names: list[str] = []
        while pos + 4 <= end:
            ext_type, ext_len = struct.unpack_from("!HH", body, pos)
            pos += 4
            data = body[pos : pos + ext_len]
            pos += ext_len
            if ext_type == _EXT_ECH:
                return Sniffed("tls", None, "encrypted ClientHello (ECH) hides the server name")
            if ext_type == _EXT_SERVER_NAME:
                names.extend(_server_names(data))
    except (IndexError, struct.error, ValueError, UnicodeDecodeError):
        return Sniffed("tls", None, "malformed TLS ClientHello")
    if not names:
        return Sniffed("tls", None, "TLS ClientHello has no server name (SNI)")
    if len(names) > 1:
        return Sniffed("tls", None, "TLS ClientHello names more than one server")
    return Sniffed("tls", names[0])


def _server_names(data: bytes) -> list[str]:
    (total,) = struct.unpack_from("!H", data, 0)
    pos, end, out = 2, 2 + total, []
    if end > len(data):
        raise ValueError("server_name list overruns")
    while pos + 3 <= end:
        kind, length = data[pos], struct.unpack_from("!H", data, pos + 1)[0]
        pos += 3
        if kind == 0:  # host_name
            out.append(data[pos : pos + length].decode("ascii"))
        pos += length
    return out


def _sniff_http(buf: bytes) -> Sniffed | None:
    try:
        request = parse_request_head(buf)
    except HeadError as exc:
        return Sniffed("http", None, str(exc))
    if request is None:
        return None
    return Sniffed("http", request.host.host, None, request.head, request)


# ---- the proxy --------------------------------------------------------------------------


class _Denied(Exception):
    def __init__(self, reason: str, rule: str | None = None, index: int | None = None) -> None:
        super().__init__(reason)
        self.reason, self.rule, self.index = reason, rule, index


class SecretResolver(Protocol):
    """Where a transform's ``{secret:NAME}`` values come from (the secrets store's
    ``reveal(name, project)``). Not wired yet: the contract refuses secret references
    until the store is on main, so :func:`_no_secrets` stands in and refuses."""

    def reveal(self, name: str, project: str) -> str: ...


def _no_secrets(name: str) -> str:
    raise LookupError(f"secret {name!r}: this daemon has no secrets store yet")


def _path_of(target: str) -> str:
    """A request target's path without its query (for 403 bodies and the log)."""
    if "://" in target:
        rest = target.split("://", 1)[1]
        target = "/" + rest.split("/", 1)[1] if "/" in rest else "/"
    return target.split("?", 1)[0]


@dataclass(frozen=True)
class _Http:
    """What the egress log keeps of a plain-HTTP request: the method and the path
    without its query (query values can hold secrets)."""

    method: str | None = None
    path: str | None = None

    @classmethod
    def of(cls, seen: Sniffed) -> _Http:
        if seen.request is None:
            return cls()
        return cls(seen.request.method, _path_of(seen.request.target))


@dataclass(eq=False)
class _Relay:
    """A connection being relayed, for :meth:`EgressProxy.revalidate`."""

    sandbox: SandboxNet
    name: str
    port: int
    protocol: str
    writers: tuple[asyncio.StreamWriter, asyncio.StreamWriter]


def still_allowed(policy: EgressPolicy, name: str, port: int) -> str | None:
    """None when ``policy`` allows ``name`` on ``port`` through the proxy; else why not."""
    if policy.mode == "open":
        return None
    if policy.mode == "deny-all":
        return "egress is now deny-all"
    if policy.match_name(name, port) is None:
        return f"no rule allows {name} on port {port} any more"
    return None


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
    ) -> None:
        self._directory = directory
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
            self._event(
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
        sandbox = self._directory.lookup(src) if isinstance(src, IPv4Address) else None
        if sandbox is None:
            return  # not a sandbox: nothing to log against, just close
        try:
            port = self._original_port(writer.get_extra_info("socket"))
        except (OSError, AttributeError) as exc:  # no conntrack entry: not redirected by nft
            self._event(sandbox, "-", None, "tcp", None, "deny", None, f"no original port: {exc}")
            return
        seen, raw = await self._peek(reader)
        http = _Http.of(seen)
        if seen.error is not None or seen.name is None:
            reason = seen.error or "no name"
            self._event(
                sandbox, seen.name or "-", port, seen.protocol, seen.name, "deny", None, reason,
                http=http,
            )  # fmt: skip
            await self._refuse(writer, seen, port, reason)
            return
        try:
            rewritten: list[RequestHead] = []  # a transform's head, decided before connecting
            rule, index, upstream, addr = await self._decide_and_connect(
                sandbox, seen.name, port, seen.request, rewritten
            )
        except _Denied as denied:
            self._event(
                sandbox, seen.name, port, seen.protocol, seen.name, "deny", denied.rule,
                denied.reason, http=http, index=denied.index,
            )  # fmt: skip
            await self._refuse(writer, seen, port, denied.reason)
            return
        self._event(
            sandbox, str(addr), port, seen.protocol, seen.name, "allow", rule,
            "allowed by rule" if rule else "open egress", http=http, index=index,
        )  # fmt: skip
        up_reader, up_writer = upstream
        relay = _Relay(sandbox, seen.name, port, seen.protocol, (writer, up_writer))
        self._relays.add(relay)
        # The rules may have changed while this connection was decided: revalidate()
        # cut what was registered then; this one meets the rules in force now.
        now = self._directory.lookup(src) if isinstance(src, IPv4Address) else None
        why = "the sandbox is gone" if now is None else still_allowed(now.policy, seen.name, port)
        if why is not None:
            self._relays.discard(relay)
            self._event(
                sandbox, str(addr), port, seen.protocol, seen.name, "deny", None,
                f"open connection cut: the rules changed ({why})",
            )  # fmt: skip
            up_writer.transport.abort()
            return
        sid = sandbox.sandbox_id

        def sent(count: int) -> None:  # the sandbox's egress, relayed (the meter's bytes)
            self._log.add_bytes(sid, sent=count)

        try:
            if seen.request is not None:
                body = raw[seen.request.consumed :]
                request = rewritten[0] if rewritten else seen.request
                cut = await relay_one_request(
                    reader, writer, up_reader, up_writer, request, body, sent=sent
                )
                if cut is not None:
                    self._event(sandbox, str(addr), port, "http", seen.name, "deny", rule, cut)
            else:
                up_writer.write(raw)
                sent(len(raw))
                await pipe_both(reader, writer, up_reader, up_writer, sent=sent)
        finally:
            self._relays.discard(relay)
            await close_writer(up_writer)

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

    async def _decide_and_connect(
        self,
        sandbox: SandboxNet,
        name: str,
        port: int,
        request: RequestHead | None = None,
        rewritten: list[RequestHead] | None = None,
    ) -> tuple[
        str | None, int | None, tuple[asyncio.StreamReader, asyncio.StreamWriter], IPv4Address
    ]:
        """(rule text, ordered rule index, the upstream connection, its address).
        ``request``: the plain-HTTP request, for rules that need it (methods, path);
        a transform rule's rewritten request is put in ``rewritten``."""
        policy = sandbox.policy
        rule_text: str | None = None
        index: int | None = None
        if normalize_name(name) is None:
            raise _Denied(f"{name!r} is not a valid hostname")
        if policy.mode == "deny-all":
            raise _Denied("egress is deny-all")
        if policy.mode == "rules" and policy.ordered is not None:
            # Ordered: the first rule whose host matches decides, and a denial names it.
            decided = policy.ordered.decide_connection(name, None, port)
            if decided.verdict == "inspect":
                rule_text, index, head = self._decide_request(policy, name, port, request)
                if head is not None and rewritten is not None:
                    rewritten.append(head)
            elif decided.verdict != "allow":
                if decided.rule is None:
                    raise _Denied(f"no rule allows {name} on port {port} (the default is deny)")
                raise _Denied(
                    f"{decided.rule.canonical} denies {name} on port {port}",
                    decided.rule.canonical,
                    decided.rule.index,
                )
            else:
                assert decided.rule is not None
                rule_text, index = decided.rule.canonical, decided.rule.index
        elif policy.mode == "rules":
            rule = policy.match_name(name, port)
            if rule is None:
                raise _Denied(f"no rule allows {name} on port {port}")
            rule_text = rule.canonical
        try:
            addrs = [a for a, _ in await self._resolver.resolve_a(name)]
        except NetworkError as exc:
            raise _Denied(f"cannot resolve {name}: {exc}", rule_text) from exc
        if not addrs:
            raise _Denied(f"{name} has no IPv4 address", rule_text)
        verdicts = [(a, self._forbidden(a)) for a in addrs]
        good = [
            a
            for a, why in verdicts
            if why is None or (why.kind == "private" and opened_by_ip_rule(policy, a, port))
        ]
        if not good:
            bad = ", ".join(str(a) for a in addrs)
            whys = "; ".join(f"{a} is {why.why}" for a, why in verdicts if why is not None)
            raise _Denied(f"{name} resolves only to forbidden addresses ({bad}): {whys}", rule_text)
        errors: list[str] = []
        for addr in good:
            try:
                async with asyncio.timeout(self._connect_timeout_s):
                    conn = await asyncio.open_connection(str(addr), port)
                return rule_text, index, conn, addr
            except (OSError, TimeoutError) as exc:
                errors.append(f"{addr}: {exc or 'timed out'}")
        # Failures after the rule allowed carry no index: they are not the rule's decision.
        raise _Denied(f"cannot connect to {name}:{port} ({'; '.join(errors)})", rule_text)

    @staticmethod
    def _decide_request(
        policy: EgressPolicy, name: str, port: int, request: RequestHead | None
    ) -> tuple[str | None, int | None, RequestHead | None]:
        """A rule needs the request (methods, path, transform): the plain-HTTP request
        decides, first match in order (:meth:`OrderedPolicy.decide`); a transform gives
        the rewritten request. TLS is refused: its request cannot be read without TLS
        termination, which is not built yet (fail closed). A request carrying a
        ``{secret:`` placeholder is refused: only a transform rule fills secrets, never
        the guest's own request."""
        assert policy.ordered is not None
        first = policy.ordered.decide_connection(name, None, port).rule
        assert first is not None
        if request is None:
            raise _Denied(
                f"{first.canonical} needs the HTTP request, which TLS hides from hutch "
                f"(TLS inspection is not available yet): {name} on port {port} is refused",
                first.canonical,
                first.index,
            )
        if b"{secret:" in request.head.lower():
            raise _Denied(
                "the request carries a {secret:...} placeholder; hutch fills secrets only "
                "through a transform rule bound to the host, never from the guest's request"
            )
        decision = policy.ordered.decide(
            HttpRequest(name, None, port, request.method, request.target)
        )
        if decision.rule is None:
            if decision.allowed:
                return None, None, None
            raise _Denied(
                f"no rule allows {request.method} {_path_of(request.target)} on {name}:{port} "
                "(the default is deny)"
            )
        rule = decision.rule
        if not decision.allowed:
            raise _Denied(
                f"{rule.canonical} denies {request.method} {_path_of(request.target)} on "
                f"{name}:{port}",
                rule.canonical,
                rule.index,
            )
        if decision.action != "transform":
            return rule.canonical, rule.index, None
        try:
            values = [(n, tpl.render(_no_secrets)) for n, tpl in rule.set_headers]
            head = rewrite_fields(request.head, values, rule.remove_headers)
        except (HeadError, LookupError) as exc:
            raise _Denied(f"{rule.canonical} cannot transform: {exc}", rule.canonical) from exc
        return rule.canonical, rule.index, dataclasses.replace(request, head=head)

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

    def _event(
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
        http: _Http | None = None,
        index: int | None = None,
    ) -> None:
        h = http or _Http()
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
