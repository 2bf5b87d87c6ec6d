"""The SNI/Host egress proxy over real loopback sockets.

The fake internet: an HTTPS server (one certificate for good.test, other.test and
*.wild.test: several names on one address) and an HTTP server, both on 127.0.0.20.
Sandboxes connect from their own 127.0.0.x source. There is no nft here, so the port the
guest "dialled" comes from the injectable ``original_port`` hook.
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
from hutch.net.proxy import EgressProxy, sniff
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


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("cert")
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


@pytest.fixture
async def env(cert: tuple[Path, Path]) -> AsyncIterator[Env]:
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
    yield env
    await proxy.close()
    for server in (http, https, keepalive):
        server.close()
        await server.wait_closed()


async def test_allowed_sni_is_proxied_to_the_address_the_host_resolved(env: Env) -> None:
    assert await env.tls("good.test") == b"hello good.test\n"
    assert env.sni_seen == ["good.test"]
    assert env.resolver.asked == ["good.test"]
    event = env.log.events("sb-rules")[-1]
    assert (event.verdict, event.name, event.rule, event.protocol) == (
        "allow", "good.test", "good.test", "tls",
    )  # fmt: skip
    assert event.destination == SERVER and event.port == env.https_port


async def test_sni_of_another_name_on_the_same_address_is_refused(env: Env) -> None:
    with pytest.raises((ConnectionError, ssl.SSLError, asyncio.IncompleteReadError)):
        await env.tls("other.test")
    assert env.sni_seen == []  # the server never saw the handshake
    event = env.log.events("sb-rules")[-1]
    assert (event.verdict, event.name, event.rule) == ("deny", "other.test", None)
    assert "no rule allows other.test" in event.reason


async def test_no_sni_is_refused(env: Env) -> None:
    with pytest.raises((ConnectionError, ssl.SSLError, asyncio.IncompleteReadError)):
        await env.tls(None)
    assert env.sni_seen == []
    assert "no server name" in env.log.events("sb-rules")[-1].reason


async def test_host_port_rule_holds_only_on_its_port(env: Env) -> None:
    assert await env.tls("api.test") == b"hello api.test\n"
    reply = await env.get("api.test")  # the HTTP port is not api.test's port
    assert reply.startswith(b"HTTP/1.1 403")


async def test_allowed_host_header_passes_and_gets_connection_close(env: Env) -> None:
    reply = await env.get("good.test:80")
    assert reply.startswith(b"HTTP/1.1 200")
    assert reply.endswith(b"host=good.test:80 connection=close")


async def test_host_mismatch_gets_a_403_that_says_why(env: Env) -> None:
    reply = await env.get("other.test")
    assert reply.startswith(b"HTTP/1.1 403 Forbidden")
    assert b"hutch egress denied other.test" in reply and b"no rule allows" in reply
    assert env.resolver.asked == []  # denied before any lookup
    assert env.log.counters("sb-rules") == (0, 1)


async def test_absolute_url_for_another_host_is_refused(env: Env) -> None:
    reply = await env.http(b"GET http://other.test/ HTTP/1.1\r\nHost: good.test\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 403")
    assert b"different hosts" in reply
    # CONNECT would open a tunnel to any port of the named server: never relayed.
    connect = await env.http(b"CONNECT good.test:443 HTTP/1.1\r\nHost: good.test\r\n\r\n")
    assert connect.startswith(b"HTTP/1.1 403") and b"CONNECT" in connect
    # A URL in the query string of an origin-form target is not an absolute-form target.
    assert (await env.get("good.test", "/r?next=http://other.test/")).startswith(b"HTTP/1.1 200")


async def test_missing_or_repeated_host_is_refused(env: Env) -> None:
    assert (await env.http(b"GET / HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.1 403")
    double = b"GET / HTTP/1.1\r\nHost: good.test\r\nHost: other.test\r\n\r\n"
    assert b"more than one Host" in await env.http(double)


async def test_wildcard_case_trailing_dot_and_punycode(env: Env) -> None:
    assert (await env.get("a.wild.test")).startswith(b"HTTP/1.1 200")
    assert (await env.get("wild.test")).startswith(b"HTTP/1.1 403")  # apex not covered
    assert (await env.get("GOOD.Test.")).startswith(b"HTTP/1.1 200")
    assert (await env.get("xn--bcher-kva.test")).startswith(b"HTTP/1.1 200")
    assert (await env.get("b\u00fccher.test")).startswith(b"HTTP/1.1 403")  # raw UTF-8 in Host
    assert await env.tls("A.Wild.Test") == b"hello A.Wild.Test\n"  # sent as written
    assert env.log.events("sb-rules")[-1].rule == "*.wild.test"


async def test_dns_rebinding_to_forbidden_addresses_is_refused(env: Env) -> None:
    reply = await env.get("rebind.test")
    assert reply.startswith(b"HTTP/1.1 403")
    assert b"forbidden addresses (127.0.0.1, 10.1.2.3)" in reply
    event = env.log.events("sb-rules")[-1]
    assert (event.verdict, event.rule) == ("deny", "rebind.test")
    # A name with one good and one forbidden address uses the good one only.
    assert (await env.get("mixed.test")).startswith(b"HTTP/1.1 200")


async def test_resolution_failure_is_a_denial(env: Env) -> None:
    reply = await env.get("down.test")
    assert reply.startswith(b"HTTP/1.1 403") and b"cannot resolve down.test" in reply


async def test_big_transfers_are_intact_both_ways(env: Env) -> None:
    reply = await env.get("good.test", "/big")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert hashlib.sha256(body).hexdigest() == hashlib.sha256(BIG).hexdigest()
    upload = b"POST /upload HTTP/1.1\r\nHost: good.test\r\nContent-Length: %d\r\n\r\n" % len(BIG)
    reply = await env.http(upload + BIG)
    assert reply.endswith(hashlib.sha256(BIG).hexdigest().encode())


async def test_tls_echo_of_megabytes(env: Env) -> None:
    env.dialled = env.https_port
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", env.port, ssl=env.ca, server_hostname="good.test", local_addr=(RULES_SRC, 0)
    )
    await reader.readline()
    payload = BIG[: 4 * 1024 * 1024]

    async def send() -> None:
        writer.write(payload)
        await writer.drain()

    sender = asyncio.create_task(send())
    got = await asyncio.wait_for(reader.readexactly(len(payload)), 30)
    await sender
    writer.close()
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()


async def test_unknown_source_is_closed_without_a_word(env: Env) -> None:
    assert await env.get("good.test", src=UNKNOWN_SRC) == b""
    assert env.resolver.asked == []


async def test_open_and_deny_all_modes(env: Env) -> None:
    assert (await env.get("other.test", src=OPEN_SRC)).startswith(b"HTTP/1.1 200")
    assert (await env.get("rebind.test", src=OPEN_SRC)).startswith(b"HTTP/1.1 403")
    reply = await env.get("good.test", src=DENY_SRC)
    assert reply.startswith(b"HTTP/1.1 403") and b"deny-all" in reply


async def test_silent_or_garbage_clients_are_cut(env: Env) -> None:
    env.dialled = env.http_port
    reader, writer = await asyncio.open_connection("127.0.0.1", env.port, local_addr=(RULES_SRC, 0))
    assert await asyncio.wait_for(reader.read(), 5) == b""  # peek timeout 0.5 s
    writer.close()
    assert "within" in env.log.events("sb-rules")[-1].reason
    assert await env.http(b"\x00\x01SSH-2.0-x\r\n") == b""
    assert "neither" in env.log.events("sb-rules")[-1].reason


def client_hello(name: str | None) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=name)
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def refragment(hello: bytes, size: int) -> bytes:
    """The same handshake split into TLS records of ``size`` bytes each."""
    body = hello[5:]
    return b"".join(
        hello[:3] + len(chunk).to_bytes(2, "big") + chunk
        for chunk in (body[i : i + size] for i in range(0, len(body), size))
    )


def test_sniff_waits_for_the_whole_client_hello_across_reads_and_records() -> None:
    for hello in (client_hello("good.test"), refragment(client_hello("good.test"), 50)):
        for cut in range(len(hello)):
            assert sniff(hello[:cut]) is None, cut
        seen = sniff(hello)
        assert seen is not None and (seen.protocol, seen.name) == ("tls", "good.test")
    no_sni = sniff(client_hello(None))
    assert no_sni is not None and no_sni.name is None and "no server name" in str(no_sni.error)
    for junk in (
        b"\x16\x03\x01\x00\x05\x01\x00\x00\x01\x00",
        b"\x16\x03\x01\x00\x04\x02\x00\x00\x00",
    ):
        bad = sniff(junk)
        assert bad is not None and bad.name is None


async def test_client_hello_dribbled_byte_by_byte_still_works(env: Env) -> None:
    env.dialled = env.https_port
    hello = refragment(client_hello("good.test"), 100)
    reader, writer = await asyncio.open_connection("127.0.0.1", env.port, local_addr=(RULES_SRC, 0))
    for i in range(0, len(hello), 7):
        writer.write(hello[i : i + 7])
        await writer.drain()
        await asyncio.sleep(0.001)
    first = await asyncio.wait_for(reader.read(5), 5)
    writer.close()
    assert first[:1] == b"\x16"  # the real server's ServerHello came back
    assert env.sni_seen == ["good.test"]


# -- issue 16: one checked request per connection, RFC 3986 authorities, live revalidation --


async def test_bare_lf_or_cr_in_the_head_is_refused_before_anything_is_sent(env: Env) -> None:
    smuggles = [
        b"GET / HTTP/1.1\r\nHost: good.test\r\nX-A: 1\nConnection: keep-alive\r\n\r\n"
        b"GET /smuggled HTTP/1.1\r\nHost: other.test\r\n\r\n",
        b"GET / HTTP/1.1\n\r\nGET http://other.test/smuggled HTTP/1.1\r\nHost: good.test\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: good.test\r\nX-A: 1\rConnection: keep-alive\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: good.test\r\nX-A: \x00\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost : good.test\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: good.test\r\n folded\r\n\r\n",
    ]
    for request in smuggles:
        reply = await env.lenient_http(request)
        assert reply.startswith(b"HTTP/1.1 403"), (request, reply)
        assert reply.count(b"HTTP/1.1 ") == 1
    assert env.lenient.seen == []
    reasons = [e.reason for e in env.log.events("sb-rules")]
    assert sum("bare LF" in r for r in reasons) == 2 and any("bare CR" in r for r in reasons)
    assert env.resolver.asked == []  # refused before any lookup


async def test_a_connection_carries_exactly_the_one_checked_request(env: Env) -> None:
    """Even to a server that ignores ``Connection: close``: a pipelined request after the
    checked one is never sent (the client reads its answer, then closes)."""
    env.lenient.ignore_close = True
    env.dialled = env.lenient.port
    reader, writer = await asyncio.open_connection("127.0.0.1", env.port, local_addr=(RULES_SRC, 0))
    writer.write(
        b"GET /first HTTP/1.1\r\nHost: good.test\r\nConnection: keep-alive\r\n\r\n"
        b"GET /second HTTP/1.1\r\nHost: other.test\r\n\r\n"
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    assert (
        await reader.readexactly(length) == b"GET /first " + hashlib.sha256().hexdigest().encode()
    )
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 10) == b""  # no second answer
    writer.close()
    await asyncio.wait_for(env.lenient.finished.wait(), 10)  # the server saw the end
    assert [(m, t, h) for m, t, h, _ in env.lenient.seen] == [("GET", "/first", "good.test")]
    env.lenient.ignore_close = False
    # A body (by length or chunked) goes with its request; what follows it does not.
    payload = b"x" * 70000
    by_length = (
        b"POST /upload HTTP/1.1\r\nHost: good.test\r\nContent-Length: %d\r\n\r\n" % len(payload)
        + payload
        + b"GET /third HTTP/1.1\r\nHost: other.test\r\n\r\n"
    )
    reply = await env.lenient_http(by_length)
    assert reply.endswith(hashlib.sha256(payload).hexdigest().encode())
    chunked = (
        b"POST /chunks HTTP/1.1\r\nHost: good.test\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
        b"GET /fourth HTTP/1.1\r\nHost: other.test\r\n\r\n"
    )
    reply = await env.lenient_http(chunked)
    assert reply.endswith(hashlib.sha256(b"hello world").hexdigest().encode())
    assert [(t, b) for _, t, _, b in env.lenient.seen[1:]] == [
        ("/upload", payload),
        ("/chunks", b"hello world"),
    ]


async def test_ambiguous_framing_is_refused(env: Env) -> None:
    cases = {
        b"Content-Length: 5\r\nTransfer-Encoding: chunked": "both Content-Length",
        b"Content-Length: 5\r\nContent-Length: 6": "more than one Content-Length",
        b"Transfer-Encoding: gzip, chunked": "other than a single 'chunked'",
        b"Content-Length: +5": "not a number",
    }
    for fields, why in cases.items():
        request = b"POST / HTTP/1.1\r\nHost: good.test\r\n" + fields + b"\r\n\r\nhello"
        reply = await env.lenient_http(request)
        assert reply.startswith(b"HTTP/1.1 403") and why.encode() in reply, (fields, reply)
    bad_chunk = (
        b"POST / HTTP/1.1\r\nHost: good.test\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\n0\r\n\r\n"
    )
    await env.lenient_http(bad_chunk)
    assert "request body: chunked body" in env.log.events("sb-rules")[-1].reason
    assert env.lenient.seen == []  # the server never got a complete request


async def test_absolute_form_authority_follows_rfc_3986(env: Env) -> None:
    def get(target: bytes) -> bytes:
        return b"GET " + target + b" HTTP/1.1\r\nHost: good.test\r\n\r\n"

    refused = {
        b"http://other.test#@good.test/": "fragment",
        b"http://other.test?@good.test/": "different hosts",
        b"http://good.test@other.test/": "userinfo",
        b"http://other.test/": "different hosts",
        b"https://good.test/": "scheme",
        b"http://good.test:8080/": "different hosts",
        b"good.test/": "not origin-form",
    }
    for target, why in refused.items():
        reply = await env.lenient_http(get(target))
        assert reply.startswith(b"HTTP/1.1 403") and why.encode() in reply, (target, reply)
    assert env.lenient.seen == []
    for ok in (b"http://good.test/abs", b"HTTP://GOOD.TEST:80/abs?q=@other.test"):
        assert (await env.lenient_http(get(ok))).startswith(b"HTTP/1.1 200"), ok
    assert [t for _, t, _, _ in env.lenient.seen] == [
        "http://good.test/abs",
        "HTTP://GOOD.TEST:80/abs?q=@other.test",
    ]


async def test_revalidate_cuts_relayed_connections_the_new_rules_deny(env: Env) -> None:
    env.dialled = env.https_port
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", env.port, ssl=env.ca, server_hostname="good.test", local_addr=(RULES_SRC, 0)
    )
    assert await reader.readline() == b"hello good.test\n"

    async def echo(text: bytes) -> bytes:
        writer.write(text)
        await writer.drain()
        return await asyncio.wait_for(reader.read(100), 5)

    assert await echo(b"before") == b"before"
    # Another sandbox's rule change, or one that still allows good.test: nothing cut.
    assert env.proxy.revalidate("sb-open", parse_policy(["deny-all"])) == 0
    assert env.proxy.revalidate("sb-rules", parse_policy(["good.test", "x.test"])) == 0
    assert env.proxy.revalidate("sb-rules", parse_policy([f"good.test:{env.https_port}"])) == 0
    assert await echo(b"still") == b"still"
    # The name stays, but not on the port this connection uses: cut.
    assert env.proxy.revalidate("sb-rules", parse_policy(["good.test:1"])) == 1
    with pytest.raises((ConnectionError, ssl.SSLError, asyncio.IncompleteReadError)):
        data = await echo(b"after")
        if not data:
            raise ConnectionResetError("closed")
    writer.close()
    event = env.log.events("sb-rules")[-1]
    assert (event.verdict, event.name, event.protocol) == ("deny", "good.test", "tls")
    assert "rules changed" in event.reason and "no rule allows good.test on port" in event.reason
    assert env.proxy.revalidate("sb-rules", parse_policy(["other.test"])) == 0  # gone already


async def test_an_ordered_policy_first_match_decides_and_names_the_rule(env: Env) -> None:
    """Deny before allow: other.test shares the address and certificate of good.test and
    matches the later ``*.test`` allow, yet the earlier deny wins, by SNI and by Host."""
    assert await env.tls("good.test", src=ORDERED_SRC) == b"hello good.test\n"
    allowed = env.log.events("sb-ordered")[-1]
    assert (allowed.verdict, allowed.rule) == ("allow", "rules[1] allow *.test")
    with pytest.raises((ConnectionError, ssl.SSLError, asyncio.IncompleteReadError)):
        await env.tls("other.test", src=ORDERED_SRC)
    denied = env.log.events("sb-ordered")[-1]
    assert (denied.verdict, denied.name, denied.rule) == (
        "deny",
        "other.test",
        "rules[0] deny other.test",
    )
    reply = await env.get("other.test", src=ORDERED_SRC)
    assert reply.startswith(b"HTTP/1.1 403 Forbidden")
    assert b"rules[0] deny other.test denies other.test on port" in reply
    reply = await env.get("good.test", "/docs/a?token=s3cret", src=ORDERED_SRC)
    assert reply.startswith(b"HTTP/1.1 200")
    assert env.resolver.asked == ["good.test", "good.test"]  # denied before any lookup
    # The log keeps the method and the path, never the query; each event its rule.
    http = env.log.events("sb-ordered")[-1]
    assert (http.protocol, http.method, http.path, http.rule_index) == ("http", "GET", "/docs/a", 1)
    assert not any("s3cret" in repr(e) for e in env.log.events("sb-ordered"))
    counts = [(c.index, c.allowed, c.denied) for c in env.log.rule_counts("sb-ordered")]
    assert counts == [(0, 0, 2), (1, 2, 0)]
    reply = await env.get("good.example", src=ORDERED_SRC)
    assert b"no rule allows good.example on port" in reply and b"the default is deny" in reply
    # A live change: a deny put first cuts the open connection it now denies.
    env.dialled = env.https_port
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", env.port, ssl=env.ca, server_hostname="good.test",
        local_addr=(ORDERED_SRC, 0),
    )  # fmt: skip
    assert await reader.readline() == b"hello good.test\n"
    keep = ordered_policy({"action": "deny", "host": "api.test"})
    assert env.proxy.revalidate("sb-ordered", keep) == 0
    cut = ordered_policy({"action": "deny", "host": "good.test"})
    assert env.proxy.revalidate("sb-ordered", cut) == 1
    writer.close()
    assert "rules changed" in env.log.events("sb-ordered")[-1].reason


async def test_partial_inspection_decides_plain_http_by_method_and_path(env: Env) -> None:
    """GET /docs allowed, POST /admin denied with a 403 naming the rule, the default for
    the rest; TLS to a host whose rules need the request is refused (no TLS termination
    yet: fail closed), other allowed TLS passes as before."""
    docs = await env.get("api.test", "/docs/intro?q=1", src=PARTIAL_SRC)
    assert docs.startswith(b"HTTP/1.1 200"), docs
    event = env.log.events("sb-partial")[-1]
    assert (event.verdict, event.method, event.path, event.rule_index) == (
        "allow", "GET", "/docs/intro", 1,
    )  # fmt: skip
    post = b"POST /admin HTTP/1.1\r\nHost: api.test\r\nContent-Length: 2\r\n\r\nhi"
    reply = await env.http(post, src=PARTIAL_SRC)
    assert reply.startswith(b"HTTP/1.1 403 Forbidden"), reply
    assert b"rules[0] deny POST api.test/admin denies POST /admin on api.test:" in reply
    event = env.log.events("sb-partial")[-1]
    assert (event.verdict, event.rule, event.method, event.path) == (
        "deny", "rules[0] deny POST api.test/admin", "POST", "/admin",
    )  # fmt: skip
    reply = await env.get("api.test", "/admin", src=PARTIAL_SRC)  # GET: no rule matches
    assert b"no rule allows GET /admin on api.test:" in reply and b"default is deny" in reply
    reply = await env.get("api.test", "/docs/../admin", src=PARTIAL_SRC)  # ambiguous path
    assert reply.startswith(b"HTTP/1.1 403")
    assert env.resolver.asked == ["api.test"]  # only the allowed request looked it up
    with pytest.raises((ConnectionError, ssl.SSLError, asyncio.IncompleteReadError)):
        await env.tls("api.test", src=PARTIAL_SRC)
    # TLS to a host a request rule needs is terminated under partial (with the project's
    # CA: this proxy has none, so it is refused, never passed uninspected).
    assert "TLS inspection needs the egress CAs" in env.log.events("sb-partial")[-1].reason
    assert await env.tls("good.test", src=PARTIAL_SRC) == b"hello good.test\n"


async def test_a_transform_rewrites_headers_and_placeholders_are_refused(env: Env) -> None:
    """A transform (literal values: the secrets store is not wired yet) sets and removes
    headers of a plain-HTTP request; a request carrying a {secret:...} placeholder is
    refused before any upstream connection opens."""
    head = (
        b"GET /x HTTP/1.1\r\nHost: other.test\r\nCookie: session=1\r\n"
        b"x-api-key: the-guests-own\r\n\r\n"
    )
    reply = await env.lenient_http(head, src=PARTIAL_SRC)
    assert reply.startswith(b"HTTP/1.1 200"), reply
    got = env.lenient.headers[-1]
    assert got["x-api-key"] == "k-123" and "cookie" not in got
    assert got["connection"] == "close"
    event = env.log.events("sb-partial")[-1]
    assert (event.verdict, event.rule_index) == ("allow", 3)
    served = len(env.lenient.seen)
    asked = list(env.resolver.asked)
    sneaky = b"GET /x HTTP/1.1\r\nHost: other.test\r\nAuthorization: Bearer {SECRET:openai}\r\n\r\n"
    reply = await env.lenient_http(sneaky, src=PARTIAL_SRC)
    assert reply.startswith(b"HTTP/1.1 403") and b"placeholder" in reply
    assert len(env.lenient.seen) == served and env.resolver.asked == asked  # nothing opened


async def test_a_private_answer_is_used_only_under_an_ip_rule_covering_it(env: Env) -> None:
    def private_server(addr: IPv4Address) -> Forbidden | None:
        return Forbidden("private", "private range (here)") if addr == IPv4Address(SERVER) else None

    directory = Directory(
        {
            IPv4Address(RULES_SRC): SandboxNetInfo("sb-a", parse_policy(["good.test"])),
            IPv4Address(OPEN_SRC): SandboxNetInfo(
                "sb-b", parse_policy(["good.test", f"{SERVER}/32:{env.http_port}"])
            ),
        }
    )
    proxy = EgressProxy(
        directory, env.resolver, env.log, private_server,
        original_port=lambda _sock: env.http_port,
    )  # fmt: skip
    port = await proxy.start("127.0.0.1", 0)
    try:
        request = b"GET / HTTP/1.1\r\nHost: good.test\r\n\r\n"
        results = {}
        for src in (RULES_SRC, OPEN_SRC):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(src, 0))
            writer.write(request)
            results[src] = await asyncio.wait_for(reader.read(), 10)
            writer.close()
    finally:
        await proxy.close()
    assert results[RULES_SRC].startswith(b"HTTP/1.1 403")
    assert b"private range (here)" in results[RULES_SRC]
    assert results[OPEN_SRC].startswith(b"HTTP/1.1 200")
