"""Protocols through TLS inspection ("full"), over real loopback sockets and real
certificates: keep-alive with upstream reuse, WebSockets, Server-Sent Events and HTTP/2
(ALPN ``h2``, spoken by a real ``h2`` client; streams decided one by one, flow control).
The upstream is an HTTPS/1.1 server with a test CA the proxy trusts; the client trusts
only hutch's CA (as in tests/component/test_net_proxy_tls.py).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from ipaddress import IPv4Address
from pathlib import Path

import pytest
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import (
    DataReceived,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    WindowUpdated,
)
from websockets.asyncio.client import connect as ws_connect

from hutch.net.dns import SandboxNetInfo
from hutch.net.egress_log import EgressLog
from hutch.net.h2_relay import h1_head
from hutch.net.http_head import HeadError
from hutch.net.proxy import EgressProxy
from hutch.net.rules import policy_from_stored
from hutch.net.tls_ca import ProjectCAs, upstream_context
from tests.component.proxy_env import Directory, FakeResolver, forbidden
from tests.netfake.certs import make_certs

# The data path's code, on the data path's loop (tests/conftest.py).
pytestmark = pytest.mark.datapath_loop

SERVER = "127.0.0.20"
SRC = "127.0.0.7"
POLICY = {
    "default": "deny",
    "inspection": "full",
    "rules": [
        {"action": "deny", "host": "api.test", "path": "/admin"},
        {"action": "allow", "host": "api.test"},
        {"action": "allow", "host": "good.test"},
    ],
}
WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def pattern(size: int) -> bytes:
    block = hashlib.sha256(b"hutch").digest() * 2048  # 64 KiB
    return (block * (size // len(block) + 1))[:size]


@dataclass
class Upstream:
    """HTTPS/1.1 keep-alive server. ``/big/N``: N bytes by Content-Length (``written``
    counts what it managed to write); ``/chunked/N``: N bytes chunked; ``/sse``: an event,
    then (after ``sse_go``) another, chunked; ``/ws``: a WebSocket echo; ``POST``: the
    sha256 of the body (Content-Length or chunked); else ``METHOD target``."""

    connections: int = 0
    seen: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    written: int = 0
    sse_go: asyncio.Event = field(default_factory=asyncio.Event)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            while line := await reader.readline():
                method, target, _ = line.decode().rstrip("\r\n").split(" ")
                headers: dict[str, str] = {}
                while field_line := (await reader.readline()).rstrip(b"\r\n"):
                    key, _, value = field_line.decode("latin-1").partition(":")
                    headers[key.strip().lower()] = value.strip()
                self.seen.append((method, target, headers))
                body = await read_body(reader, headers)
                if target == "/ws":
                    await self.websocket(reader, writer, headers)
                    break
                if not await self.answer(writer, method, target, body):
                    break
                if headers.get("connection", "").lower() == "close":
                    break
        writer.close()

    async def answer(
        self, writer: asyncio.StreamWriter, method: str, target: str, body: bytes
    ) -> bool:
        if method == "POST":
            send(writer, hashlib.sha256(body).hexdigest().encode())
        elif target.startswith("/big/"):
            size = int(target[5:])
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
            data = pattern(size)
            for pos in range(0, size, 64 * 1024):
                writer.write(data[pos : pos + 64 * 1024])
                await writer.drain()
                self.written = pos + len(data[pos : pos + 64 * 1024])
        elif target.startswith("/chunked/"):
            data = pattern(int(target[9:]))
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for pos in range(0, len(data), 1000):
                piece = data[pos : pos + 1000]
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            writer.write(b"0\r\n\r\n")
        elif target == "/sse":
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            for event in (b"data: one\n\n", None, b"data: two\n\n"):
                if event is None:
                    await self.sse_go.wait()
                    continue
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
        else:
            send(writer, f"{method} {target}".encode())
        await writer.drain()
        return True

    async def websocket(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, headers: dict[str, str]
    ) -> None:
        accept = base64.b64encode(
            hashlib.sha1(headers["sec-websocket-key"].encode() + WS_GUID).digest()
        )
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n"
        )
        while True:  # echo every frame back (unmasked, as a server sends)
            first, second = await reader.readexactly(2)
            size = second & 0x7F
            if size == 126:
                size = int.from_bytes(await reader.readexactly(2), "big")
            elif size == 127:
                size = int.from_bytes(await reader.readexactly(8), "big")
            mask = await reader.readexactly(4) if second & 0x80 else b"\0\0\0\0"
            payload = bytes(b ^ mask[i % 4] for i, b in enumerate(await reader.readexactly(size)))
            if size < 126:
                length = bytes([size])
            elif size < 65536:
                length = bytes([126]) + size.to_bytes(2, "big")
            else:
                length = bytes([127]) + size.to_bytes(8, "big")
            writer.write(bytes([first]) + length + payload)
            await writer.drain()
            if first & 0x0F == 8:  # close
                return


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding") != "chunked":
        return b""
    body = b""
    while size := int((await reader.readline()).strip(), 16):
        body += await reader.readexactly(size)
        await reader.readline()
    await reader.readline()
    return body


def send(writer: asyncio.StreamWriter, body: bytes) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


@dataclass
class Env:
    port: int
    log: EgressLog
    client: ssl.SSLContext
    upstream: Upstream

    async def connect(self, name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(
            "127.0.0.1", self.port, ssl=self.client, server_hostname=name, local_addr=(SRC, 0)
        )


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    certs = make_certs(tmp_path / "up", ["api.test", "good.test"])
    upstream = Upstream()
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(certs.server_cert, certs.server_key)
    https = await asyncio.start_server(upstream.serve, SERVER, 0, ssl=server_ctx)
    https_port = https.sockets[0].getsockname()[1]
    info = SandboxNetInfo("sb-full", policy_from_stored(POLICY), {}, "proj-a")
    log = EgressLog()
    cas = ProjectCAs(tmp_path / "egress-ca")
    proxy = EgressProxy(
        Directory({IPv4Address(SRC): info}), FakeResolver(), log, forbidden,
        connect_timeout_s=2, peek_timeout_s=2, original_port=lambda _s: https_port,
        ca=cas, upstream_tls=upstream_context(certs.ca_cert),
    )  # fmt: skip
    port = await proxy.start("127.0.0.1", 0)
    client = ssl.create_default_context(cadata=cas.cert_pem("proj-a").decode())
    yield Env(port, log, client, upstream)
    await proxy.close()
    https.close()
    await https.wait_closed()


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(head, body) of one response framed by Content-Length or chunked."""
    head = await reader.readuntil(b"\r\n\r\n")
    fields = {
        k.strip().lower(): v.strip()
        for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:] if line)
    }
    if b"content-length" in fields:
        return head, await reader.readexactly(int(fields[b"content-length"]))
    body = b""
    while size := int((await reader.readline()).strip(), 16):
        body += await reader.readexactly(size)
        await reader.readline()
    await reader.readline()
    return head, body


def get(path: str, method: str = "GET", host: str = "api.test", extra: str = "") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode()


async def test_keep_alive_reuses_the_upstream_and_decides_each_request(env: Env) -> None:
    """One guest connection: bodiless requests share one upstream connection (kept
    alive, no ``Connection: close``), a chunked answer keeps the guest's connection, a
    request with a body goes up with ``Connection: close`` (the next opens a new upstream
    connection), each request is logged with its method and path, and a denied one gets
    a 403 naming the rule."""
    reader, writer = await env.connect("api.test")
    body = pattern(300_000)
    try:
        answers = []
        for raw in (get("/docs/1"), get("/docs/2"), get("/chunked/5000")):
            writer.write(raw)
            answers.append(await asyncio.wait_for(read_response(reader), 10))
        writer.write(get("/upload", "POST", extra=f"Content-Length: {len(body)}\r\n") + body)
        answers.append(await asyncio.wait_for(read_response(reader), 10))
        writer.write(get("/after"))
        answers.append(await asyncio.wait_for(read_response(reader), 10))
        writer.write(get("/admin/x"))
        denied = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert [a[1] for a in answers[:2]] == [b"GET /docs/1", b"GET /docs/2"]
    assert answers[2][1] == pattern(5000)
    assert answers[3][1] == hashlib.sha256(body).hexdigest().encode()
    assert answers[4][1] == b"GET /after"
    assert denied.startswith(b"HTTP/1.1 403") and b"rules[0] deny api.test/admin" in denied
    assert env.upstream.connections == 2, env.upstream.seen
    conn = [s[2].get("connection") for s in env.upstream.seen]
    assert conn == [None, None, None, "close", None]
    events = [(e.verdict, e.method, e.path, e.rule_index) for e in env.log.events("sb-full")]
    assert events == [
        ("allow", "GET", "/docs/1", 1), ("allow", "GET", "/docs/2", 1),
        ("allow", "GET", "/chunked/5000", 1), ("allow", "POST", "/upload", 1),
        ("allow", "GET", "/after", 1), ("deny", "GET", "/admin/x", 0),
    ]  # fmt: skip
    counts = {c.index: (c.allowed, c.denied) for c in env.log.rule_counts("sb-full")}
    assert counts == {0: (0, 1), 1: (5, 0)}


async def test_a_websocket_is_decided_then_relayed_both_ways(env: Env) -> None:
    """A real WebSocket client (``websockets``) through ``full``: the upgrade request is
    decided and logged, the 101 switches to raw frames both ways, text and a 200 KiB
    binary message echo back; bytes up reach the meter."""
    async with ws_connect(
        "wss://api.test/ws", ssl=env.client, host="127.0.0.1", port=env.port,
        server_hostname="api.test", local_addr=(SRC, 0), open_timeout=10,
    ) as ws:  # fmt: skip
        await ws.send("hello")
        assert await asyncio.wait_for(ws.recv(), 10) == "hello"
        blob = pattern(200 * 1024)
        await ws.send(blob)
        assert await asyncio.wait_for(ws.recv(), 10) == blob
    seen = env.upstream.seen[-1]
    assert (seen[1], seen[2]["upgrade"], seen[2]["connection"]) == ("/ws", "websocket", "Upgrade")
    event = env.log.events("sb-full")[-1]
    assert (event.verdict, event.method, event.path) == ("allow", "GET", "/ws")
    sent, _ = env.log.take_bytes()["sb-full"]
    assert sent > len(blob)


async def test_a_denied_websocket_gets_a_403(env: Env) -> None:
    with pytest.raises(Exception, match="403"):
        async with ws_connect(
            "wss://api.test/admin", ssl=env.client, host="127.0.0.1", port=env.port,
            server_hostname="api.test", local_addr=(SRC, 0), open_timeout=10,
        ):  # fmt: skip
            pass
    assert env.upstream.seen == []


async def test_server_sent_events_stream_as_they_come(env: Env) -> None:
    """The first event reaches the client while the server still holds the second (no
    buffering of the answer); after the stream ends the connection carries the next
    request."""
    reader, writer = await env.connect("api.test")
    try:
        writer.write(get("/sse", extra="Accept: text/event-stream\r\n"))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert b"text/event-stream" in head and b"chunked" in head.lower()
        first = await asyncio.wait_for(reader.readuntil(b"data: one\n\n\r\n"), 10)
        assert first.endswith(b"data: one\n\n\r\n")
        env.upstream.sse_go.set()
        rest = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 10)
        assert b"data: two" in rest
        writer.write(get("/next"))
        _, body = await asyncio.wait_for(read_response(reader), 10)
        assert body == b"GET /next"
    finally:
        writer.close()


class H2Client:
    """An HTTP/2 client (the ``h2`` state machine) over TLS with ALPN ``h2`` only.
    ``acking`` False: received DATA is not acknowledged (the server's send window
    closes)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.conn = H2Connection(H2Configuration(client_side=True, header_encoding=None))
        self.status: dict[int, int] = {}
        self.bodies: dict[int, bytearray] = {}
        self.received: dict[int, int] = {}
        self.hashes: dict[int, hashlib._Hash] = {}
        self.done: dict[int, asyncio.Event] = {}
        self.reset: set[int] = set()
        self.window = asyncio.Event()
        self.acking = True
        self.unacked: list[tuple[int, int]] = []
        self.conn.initiate_connection()
        self.flush()
        self.task = asyncio.create_task(self.read_loop())

    @classmethod
    async def open(cls, env: Env, name: str = "api.test") -> H2Client:
        ctx = ssl.create_default_context(cadata=env.client.get_ca_certs(True)[0])
        ctx.set_alpn_protocols(["h2"])
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", env.port, ssl=ctx, server_hostname=name, local_addr=(SRC, 0)
        )
        assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "h2"
        return cls(reader, writer)

    def flush(self) -> None:
        self.writer.write(self.conn.data_to_send())

    async def read_loop(self) -> None:
        while data := await self.reader.read(65536):
            for event in self.conn.receive_data(data):
                sid = getattr(event, "stream_id", 0)
                if isinstance(event, ResponseReceived):
                    self.status[sid] = int(dict(event.headers or [])[b":status"])
                elif isinstance(event, DataReceived):
                    chunk = event.data or b""
                    self.received[sid] = self.received.get(sid, 0) + len(chunk)
                    if sid in self.hashes:
                        self.hashes[sid].update(chunk)
                    else:
                        self.bodies.setdefault(sid, bytearray()).extend(chunk)
                    if self.acking:
                        self.conn.acknowledge_received_data(event.flow_controlled_length, sid)
                    else:
                        self.unacked.append((event.flow_controlled_length, sid))
                elif isinstance(event, StreamEnded | StreamReset):
                    if isinstance(event, StreamReset):
                        self.reset.add(sid)
                    self.done.setdefault(sid, asyncio.Event()).set()
                elif isinstance(event, WindowUpdated):
                    self.window.set()
            self.flush()

    def ack_all(self) -> None:
        self.acking = True
        for count, sid in self.unacked:
            self.conn.acknowledge_received_data(count, sid)
        self.unacked.clear()
        self.flush()

    def request(
        self, path: str, method: str = "GET", authority: str = "api.test", end: bool = True,
        hashed: bool = False,
    ) -> int:  # fmt: skip
        sid = self.conn.get_next_available_stream_id()
        headers = [
            (b":method", method.encode()), (b":scheme", b"https"),
            (b":authority", authority.encode()), (b":path", path.encode()),
        ]  # fmt: skip
        self.done[sid] = asyncio.Event()
        if hashed:
            self.hashes[sid] = hashlib.sha256()
        self.conn.send_headers(sid, headers, end_stream=end)
        self.flush()
        return sid

    async def send_body(self, sid: int, data: bytes) -> None:
        while data:
            self.window.clear()
            room = min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size)
            if room <= 0:
                await asyncio.wait_for(self.window.wait(), 10)
                continue
            self.conn.send_data(sid, data[:room])
            data = data[room:]
            self.flush()
            await self.writer.drain()
        self.conn.end_stream(sid)
        self.flush()

    async def wait(self, sid: int) -> bytes:
        await asyncio.wait_for(self.done[sid].wait(), 30)
        return bytes(self.bodies.get(sid, b""))

    async def close(self) -> None:
        self.conn.close_connection()
        self.flush()
        self.task.cancel()
        with contextlib.suppress(BaseException):
            await self.task
        self.writer.close()


async def test_http2_streams_are_decided_one_by_one(env: Env) -> None:
    """ALPN offers h2; on one HTTP/2 connection concurrent streams are each decided:
    allowed ones answered, a denied path and a fronted ``:authority`` get 403s naming why
    while the others go on; a 1 MiB upload without content-length streams up (chunked)
    and its sha256 matches; bodiless streams share upstream connections."""
    h2 = await H2Client.open(env)
    try:
        docs = h2.request("/docs/a?q=1")
        admin = h2.request("/admin")
        fronted = h2.request("/x", authority="good.test")
        upload = h2.request("/upload", "POST", end=False)
        body = pattern(1 << 20)
        await h2.send_body(upload, body)
        assert await h2.wait(docs) == b"GET /docs/a?q=1"
        denied = await h2.wait(admin)
        assert h2.status[admin] == 403 and b"rules[0] deny api.test/admin" in denied
        assert h2.status[fronted] == 403 and b"domain fronting" in await h2.wait(fronted)
        assert await h2.wait(upload) == hashlib.sha256(body).hexdigest().encode()
        for n in range(3):
            assert await h2.wait(h2.request(f"/again/{n}")) == f"GET /again/{n}".encode()
    finally:
        await h2.close()
    assert h2.status[docs] == 200 and h2.status[upload] == 200
    posted = [s for s in env.upstream.seen if s[0] == "POST"]
    assert posted[0][2]["transfer-encoding"] == "chunked"
    assert env.upstream.connections <= 3, env.upstream.seen  # reused, not one per stream
    events = [(e.verdict, e.method, e.path) for e in env.log.events("sb-full")]
    assert ("deny", "GET", "/admin") in events and ("allow", "POST", "/upload") in events
    assert sum(1 for e in events if e[0] == "allow") == 5


async def test_http2_download_is_flow_controlled(env: Env) -> None:
    """A 64 MiB answer over HTTP/2 to a client that stops acknowledging: the proxy stops
    reading upstream (the server's writes stall far below the body's size: memory stays
    bounded); once the client reads again the whole body arrives and its sha256 matches."""
    size = 64 << 20
    h2 = await H2Client.open(env)
    try:
        h2.acking = False
        sid = h2.request(f"/big/{size}", hashed=True)
        await asyncio.sleep(1.5)
        stalled_at = env.upstream.written
        assert stalled_at < 20 << 20, stalled_at  # socket buffers: ~4-9 MiB here
        assert h2.received.get(sid, 0) <= 1 << 20
        h2.ack_all()
        await asyncio.wait_for(h2.done[sid].wait(), 60)
    finally:
        await h2.close()
    assert h2.status[sid] == 200 and h2.received[sid] == size
    assert h2.hashes[sid].hexdigest() == hashlib.sha256(pattern(size)).hexdigest()


def test_http2_headers_hutch_cannot_carry_to_http1_are_refused() -> None:
    ok = h1_head(
        [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"a.test"),
         (b":path", b"/p"), (b"cookie", b"a=1"), (b"cookie", b"b=2"), (b"te", b"trailers")],
        ended=True,
    )  # fmt: skip
    assert ok == b"GET /p HTTP/1.1\r\nHost: a.test\r\ncookie: a=1; b=2\r\n\r\n"
    base = [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"a.test")]
    bad = [
        [*base, (b":path", b"/p"), (b"x-a", b"1\r\nX-Injected: 1")],
        [*base, (b":path", b"/p"), (b"x-a", b"1\x00")],
        [(b":method", b"CONNECT"), (b":authority", b"a.test:22")],
        [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")],
        [*base, (b":path", b"/"), (b"host", b"b.test")],
    ]
    for headers in bad:
        with pytest.raises(HeadError):
            h1_head(headers, ended=True)
    chunked = h1_head([*base, (b":method", b"POST"), (b":path", b"/u")][1:], ended=False)
    assert chunked.endswith(b"transfer-encoding: chunked\r\n\r\n")
