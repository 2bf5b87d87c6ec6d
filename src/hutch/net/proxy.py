"""The egress proxy: TCP 80/443 from sandboxes in rules mode, checked by TLS SNI or HTTP Host.

nft redirects a rules-mode sandbox's tcp/80 and tcp/443 (unless an explicit IP rule
covers the destination) here. Per connection:

1. the source must be a registered sandbox address (others: closed at once);
2. the port the guest dialled comes from ``SO_ORIGINAL_DST``;
3. the first bytes are read (with a timeout) and parsed: a TLS ClientHello's SNI (records
   may arrive split over many reads; no SNI, or an encrypted ClientHello, is refused) or
   an HTTP/1.x request's Host header (port stripped; absent, repeated or contradicted by
   an absolute URL is refused);
4. the name is checked with ``policy.match_name(name, port)``;
5. the host resolves the name *itself* (the guest's idea of the address is never used),
   drops forbidden answers (loopback, private, link-local, the host: DNS rebinding),
   connects to the first good address on the original port, replays the bytes read and
   pipes both ways with backpressure.

Floods: with a ``limit``, each new connection first takes a token from its sender's
bucket (:mod:`hutch.net.ratelimit`); without one it is closed at once, before a byte is
read, and counted (the kernel drops SYNs past twice the rate, see :mod:`hutch.net.nft`).

Denials: plain HTTP gets a 403 whose body says what was denied and why; TLS is closed.
Every decision goes to the EgressLog. HTTP requests get ``Connection: close`` so a kept-
alive connection cannot carry a second request for another name on the same address.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from ipaddress import IPv4Address, ip_address
from typing import Literal, Protocol

from hutch.errors import NetworkError
from hutch.net.dns import SandboxDirectory, SandboxNet
from hutch.net.egress_log import EgressLog
from hutch.net.ratelimit import KeyedLimiter, Rate
from hutch.net.rules import normalize_name
from hutch.net.views import EgressEvent, Verdict

__all__ = [
    "EgressProxy",
    "NameResolver",
    "Sniffed",
    "close_writer",
    "pipe_both",
    "sniff",
    "so_original_dst_port",
]

log = logging.getLogger(__name__)

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h, at level SOL_IP (0)
MAX_HTTP_HEAD = 16 * 1024
MAX_TLS_HELLO = 64 * 1024
MAX_PEEK = MAX_TLS_HELLO + 1024
_EXT_SERVER_NAME = 0
_EXT_ECH = 0xFE0D
_REQUEST_LINE = re.compile(rb"^([A-Z]{1,16}) (\S+) HTTP/1\.[01]$")
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
    ``head`` is what to send upstream instead of the bytes read (HTTP rewrites)."""

    protocol: Literal["tls", "http", "unknown"]
    name: str | None
    error: str | None = None
    head: bytes | None = None


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
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if len(buf) > MAX_HTTP_HEAD:
            return Sniffed("http", None, "HTTP request headers are too large")
        return None
    lines = buf[:end].split(b"\r\n")
    match = _REQUEST_LINE.match(lines[0])
    if match is None:
        return Sniffed("http", None, "malformed HTTP request line")
    hosts: list[str] = []
    kept: list[bytes] = [lines[0]]
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t") or b":" not in line:
            return Sniffed("http", None, "malformed HTTP header line")
        key, _, value = line.partition(b":")
        lower = key.strip().lower()
        if lower == b"host":
            hosts.append(value.strip().decode("latin-1"))
        if lower not in (b"connection", b"proxy-connection", b"keep-alive"):
            kept.append(line)
    if not hosts:
        return Sniffed("http", None, "HTTP request has no Host header")
    if len(hosts) > 1:
        return Sniffed("http", None, "HTTP request has more than one Host header")
    name = _strip_port(hosts[0])
    target = match.group(2).decode("latin-1")
    # absolute-form (http://host/...): servers prefer it over Host, so both must agree;
    # same for CONNECT's authority-form (a forward proxy at an allowed name).
    authority = None
    if not target.startswith("/") and "://" in target:
        authority = target.split("://", 1)[1].split("/", 1)[0].rpartition("@")[2]
    elif match.group(1) == b"CONNECT":
        authority = target
    if authority is not None and normalize_name(_strip_port(authority)) != normalize_name(name):
        return Sniffed("http", name, "request URL and Host header name different hosts")
    kept.append(b"Connection: close")
    head = b"\r\n".join(kept) + b"\r\n\r\n" + buf[end + 4 :]
    return Sniffed("http", name, None, head)


def _strip_port(host: str) -> str:
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if ":" in host else host


# ---- the proxy --------------------------------------------------------------------------


class _Denied(Exception):
    def __init__(self, reason: str, rule: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.rule = reason, rule


class EgressProxy:
    """See the module docstring. ``forbidden(addr)`` says an address must never be
    connected to; ``original_port`` is replaceable for tests without nft; ``limit`` is
    the per-sender rate of new connections (None: unlimited)."""

    def __init__(
        self,
        directory: SandboxDirectory,
        resolver: NameResolver,
        log: EgressLog,
        forbidden: Callable[[IPv4Address], bool],
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
        if seen.error is not None or seen.name is None:
            reason = seen.error or "no name"
            self._event(
                sandbox, seen.name or "-", port, seen.protocol, seen.name, "deny", None, reason
            )
            await self._refuse(writer, seen, port, reason)
            return
        try:
            rule, upstream, addr = await self._decide_and_connect(sandbox, seen.name, port)
        except _Denied as denied:
            self._event(
                sandbox,
                seen.name,
                port,
                seen.protocol,
                seen.name,
                "deny",
                denied.rule,
                denied.reason,
            )
            await self._refuse(writer, seen, port, denied.reason)
            return
        self._event(
            sandbox,
            str(addr),
            port,
            seen.protocol,
            seen.name,
            "allow",
            rule,
            "allowed by rule" if rule else "open egress",
        )
        up_reader, up_writer = upstream
        try:
            up_writer.write(seen.head if seen.head is not None else raw)
            await pipe_both(reader, writer, up_reader, up_writer)
        finally:
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
        self, sandbox: SandboxNet, name: str, port: int
    ) -> tuple[str | None, tuple[asyncio.StreamReader, asyncio.StreamWriter], IPv4Address]:
        policy = sandbox.policy
        rule_text: str | None = None
        if normalize_name(name) is None:
            raise _Denied(f"{name!r} is not a valid hostname")
        if policy.mode == "deny-all":
            raise _Denied("egress is deny-all")
        if policy.mode == "rules":
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
        good = [a for a in addrs if not self._forbidden(a)]
        if not good:
            bad = ", ".join(str(a) for a in addrs)
            raise _Denied(f"{name} resolves only to forbidden addresses ({bad})", rule_text)
        errors: list[str] = []
        for addr in good:
            try:
                async with asyncio.timeout(self._connect_timeout_s):
                    conn = await asyncio.open_connection(str(addr), port)
                return rule_text, conn, addr
            except (OSError, TimeoutError) as exc:
                errors.append(f"{addr}: {exc or 'timed out'}")
        raise _Denied(f"cannot connect to {name}:{port} ({'; '.join(errors)})", rule_text)

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
    ) -> None:
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
            )
        )


# ---- plumbing ---------------------------------------------------------------------------


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Copy until EOF; ``drain`` makes a slow reader slow down the writer (backpressure)."""
    while data := await src.read(64 * 1024):
        dst.write(data)
        await dst.drain()
    if dst.can_write_eof():  # half-close: the other direction may still be talking
        with contextlib.suppress(OSError):
            dst.write_eof()


async def pipe_both(
    a_reader: asyncio.StreamReader,
    a_writer: asyncio.StreamWriter,
    b_reader: asyncio.StreamReader,
    b_writer: asyncio.StreamWriter,
) -> None:
    """Both directions until both reach EOF or either fails (then both are cut)."""
    up = asyncio.create_task(_pump(a_reader, b_writer))
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
