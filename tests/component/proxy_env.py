"""The SNI/Host egress proxy's test harness, over real loopback sockets (the proxy tests
``test_net_proxy*.py`` share it).

The fake internet: an HTTPS server (one certificate for good.test, other.test and
*.wild.test: several names on one address) and an HTTP server, both on 127.0.0.20.
Sandboxes connect from their own 127.0.0.x source. There is no nft here, so the port the
guest "dialled" comes from the injectable ``original_port`` hook.

The fixtures ``cert`` (one per module) and ``env`` (one proxy per test) are defined
here once; a test file that wants them imports them (under other names than the
fixtures', so that they do not shadow the tests' parameters)::

    from tests.component.proxy_env import cert_fixture, env_fixture  # noqa: F401
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import ssl
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Any

import pytest

from hutch.errors import NetworkError
from hutch.net.destinations import Forbidden
from hutch.net.dns import SandboxNetInfo
from hutch.net.egress_log import EgressLog
from hutch.net.proxy import EgressProxy
from hutch.net.rules import normalize_name, parse_policy, policy_from_stored

SERVER = "127.0.0.20"
RULES_SRC, OPEN_SRC, DENY_SRC, UNKNOWN_SRC = "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.9"
ORDERED_SRC = "127.0.0.5"  # an ordered policy (hutch.contract.egress_policy)
PARTIAL_SRC = "127.0.0.6"  # an ordered policy with method/path rules, inspection partial
PARTIAL = {
    "default": "deny",
    "inspection": "partial",
    "rules": [
        {"action": "deny", "host": "api.test", "methods": ["POST"], "path": "/admin"},
        {"action": "allow", "host": "api.test", "methods": ["GET", "HEAD"], "path": "/docs"},
        {"action": "allow", "host": "good.test"},
        {
            "action": "transform",
            "host": "other.test",
            "set_headers": {"X-Api-Key": "k-123"},
            "remove_headers": ["Cookie"],
        },
    ],
}
BIG = random.Random(5).randbytes(16 * 1024 * 1024)

RESOLVE = {
    "good.test": [SERVER],
    "other.test": [SERVER],
    "api.test": [SERVER],
    "a.wild.test": [SERVER],
    "wild.test": [SERVER],
    "xn--bcher-kva.test": [SERVER],
    "rebind.test": ["127.0.0.1", "10.1.2.3"],
    "mixed.test": ["10.1.2.3", SERVER],
}


def forbidden(addr: IPv4Address) -> Forbidden | None:
    # Loopback is normally forbidden as a whole; here 127.0.0.20 plays the internet.
    if addr == IPv4Address("127.0.0.1"):
        return Forbidden("always", "loopback")
    if addr in IPv4Network("10.0.0.0/8"):
        return Forbidden("private", "private range 10.0.0.0/8")
    return None


@dataclass
class FakeResolver:
    asked: list[str] = field(default_factory=list)

    async def resolve_a(self, name: str) -> list[tuple[IPv4Address, int]]:
        norm = normalize_name(name) or ""
        self.asked.append(norm)
        if norm == "down.test":
            raise NetworkError("upstream DNS timed out")
        return [(IPv4Address(a), 60) for a in RESOLVE.get(norm, [])]


def make_cert(d: Path) -> tuple[Path, Path]:
    """A self-signed certificate for the fake internet's names, in directory ``d``."""
    key, crt = d / "key.pem", d / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(crt), "-days", "2", "-subj", "/CN=good.test",
         "-addext", "subjectAltName=DNS:good.test,DNS:other.test,DNS:api.test,DNS:*.wild.test"],
        check=True, capture_output=True,
    )  # fmt: skip
    return crt, key


async def http_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """GET /big -> BIG; POST /upload -> sha256 of the body; else echo Host and Connection."""
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        lines = head.split("\r\n")
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])
        }
        path = lines[0].split(" ")[1]
        if path == "/big":
            body = BIG
        elif path == "/upload":
            data = await reader.readexactly(int(headers["content-length"]))
            body = hashlib.sha256(data).hexdigest().encode()
        else:
            body = f"host={headers.get('host')} connection={headers.get('connection')}".encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
    writer.close()


@dataclass
class Lenient:
    """A keep-alive server as lenient as many real ones: a line ends at LF (a CR before
    it is dropped), the first Connection header wins, HTTP/1.1 keeps the connection,
    bodies by Content-Length or chunked. ``seen``: (method, target, host, body) served."""

    seen: list[tuple[str, str, str | None, bytes]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)  # of each request served
    port: int = 0
    ignore_close: bool = False  # like a careless server: keep-alive whatever is asked
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ValueError):
            while line := await reader.readline():
                method, target, version = line.decode("latin-1").rstrip("\r\n").split(" ")
                headers: dict[str, str] = {}
                while field_line := (await reader.readline()).rstrip(b"\r\n"):
                    key, _, value = field_line.decode("latin-1").partition(":")
                    headers.setdefault(key.strip().lower(), value.strip())
                body = b""
                if "content-length" in headers:
                    body = await reader.readexactly(int(headers["content-length"]))
                elif headers.get("transfer-encoding", "").lower() == "chunked":
                    while size := int((await reader.readline()).split(b";")[0], 16):
                        body += await reader.readexactly(size)
                        await reader.readline()
                    while (await reader.readline()).strip():
                        pass
                self.seen.append((method, target, headers.get("host"), body))
                self.headers.append(headers)
                answer = f"{method} {target} {hashlib.sha256(body).hexdigest()}".encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(answer))
                writer.write(answer)
                await writer.drain()
                close = headers.get("connection", "").lower() == "close"
                if (close and not self.ignore_close) or version != "HTTP/1.1":
                    break
        writer.close()
        self.finished.set()


@dataclass
class Env:
    proxy: EgressProxy
    port: int
    http_port: int
    https_port: int
    log: EgressLog
    resolver: FakeResolver
    ca: ssl.SSLContext
    sni_seen: list[str | None]
    lenient: Lenient
    dialled: int = 0

    async def lenient_http(self, request: bytes, src: str = RULES_SRC) -> bytes:
        """``request`` as is to the lenient keep-alive server, through the proxy."""
        port, self.http_port = self.http_port, self.lenient.port
        try:
            return await self.http(request, src)
        finally:
            self.http_port = port

    async def http(self, request: bytes, src: str = RULES_SRC) -> bytes:
        self.dialled = self.http_port
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port, local_addr=(src, 0))
        try:
            writer.write(request)
            await writer.drain()
            return await asyncio.wait_for(reader.read(), 10)
        except ConnectionResetError:  # closed with our bytes unread: the kernel sends RST
            return b""
        finally:
            writer.close()

    async def get(self, host: str, path: str = "/", src: str = RULES_SRC) -> bytes:
        return await self.http(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode(), src)

    async def tls(self, name: str | None, src: str = RULES_SRC) -> bytes:
        """Handshake with SNI ``name`` through the proxy; returns the server's greeting."""
        self.dialled = self.https_port
        ctx = self.ca
        if name is None:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", self.port, ssl=ctx, server_hostname=name or "",
            local_addr=(src, 0),
        )  # fmt: skip
        try:
            return await asyncio.wait_for(reader.readline(), 10)
        finally:
            writer.close()


@dataclass
class Directory:
    entries: dict[IPv4Address, SandboxNetInfo]

    def lookup(self, addr: IPv4Address) -> SandboxNetInfo | None:
        return self.entries.get(addr)


def sandboxes(https_port: int) -> dict[IPv4Address, SandboxNetInfo]:
    rules = parse_policy(["good.test", f"api.test:{https_port}", "*.wild.test", "rebind.test",
                          "mixed.test", "Bücher.test", "down.test"])  # fmt: skip
    return {
        IPv4Address(RULES_SRC): SandboxNetInfo("sb-rules", rules),
        IPv4Address(OPEN_SRC): SandboxNetInfo("sb-open", parse_policy([])),
        IPv4Address(DENY_SRC): SandboxNetInfo("sb-deny", parse_policy(["deny-all"])),
        IPv4Address(ORDERED_SRC): SandboxNetInfo("sb-ordered", ordered_policy()),
        IPv4Address(PARTIAL_SRC): SandboxNetInfo("sb-partial", policy_from_stored(PARTIAL)),
    }


def ordered_policy(*first: dict[str, str]) -> Any:
    return policy_from_stored(
        {
            "default": "deny",
            "rules": [
                *first,
                {"action": "deny", "host": "other.test"},
                {"action": "allow", "host": "*.test"},  # other.test is denied above
            ],
        }
    )


@contextlib.asynccontextmanager
async def proxy_env(cert: tuple[Path, Path]) -> AsyncIterator[Env]:
    """The servers of the fake internet and a proxy in front of them, closed after."""
    crt, key = cert
    sni_seen: list[str | None] = []
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(crt, key)
    server_ctx.sni_callback = lambda _obj, name, _ctx: sni_seen.append(name)

    async def tls_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            writer.write(f"hello {sni_seen[-1]}\n".encode())
            while data := await reader.read(65536):  # then echo
                writer.write(data)
                await writer.drain()
        writer.close()

    http = await asyncio.start_server(http_server, SERVER, 0)
    https = await asyncio.start_server(tls_server, SERVER, 0, ssl=server_ctx)
    lenient = Lenient()
    keepalive = await asyncio.start_server(lenient.serve, SERVER, 0)
    lenient.port = keepalive.sockets[0].getsockname()[1]
    http_port = http.sockets[0].getsockname()[1]
    https_port = https.sockets[0].getsockname()[1]
    directory = sandboxes(https_port)
    log, resolver = EgressLog(), FakeResolver()
    holder: list[Env] = []
    proxy = EgressProxy(
        Directory(directory), resolver, log, forbidden,
        connect_timeout_s=2, peek_timeout_s=0.5, original_port=lambda _sock: holder[0].dialled,
    )  # fmt: skip
    port = await proxy.start("127.0.0.1", 0)
    ca = ssl.create_default_context(cafile=str(crt))
    env = Env(proxy, port, http_port, https_port, log, resolver, ca, sni_seen, lenient)
    holder.append(env)
    try:
        yield env
    finally:
        await proxy.close()
        for server in (http, https, keepalive):
            server.close()
            await server.wait_closed()


@pytest.fixture(scope="module", name="cert")
def cert_fixture(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The fake internet's certificate and key (made once per test module)."""
    return make_cert(tmp_path_factory.mktemp("cert"))


@pytest.fixture(name="env")
async def env_fixture(cert: tuple[Path, Path]) -> AsyncIterator[Env]:
    """A fresh proxy and servers (:func:`proxy_env`) for one test."""
    async with proxy_env(cert) as env:
        yield env
