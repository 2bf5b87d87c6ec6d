"""HTTP/2 from the guest inside a TLS connection the egress proxy terminated (ALPN ``h2``;
asyncio over the ``h2`` state machine). The decisions are the proxy's, passed in as
``check``, the same one :mod:`hutch.net.inspected_http` uses for HTTP/1.1.

Per stream:

1. its headers become an HTTP/1.1 request head (``:method :path HTTP/1.1``, ``Host:``
   from ``:authority``, the other fields as sent, split ``cookie`` fields joined) that
   :func:`hutch.net.http_head.parse_request_head` checks strictly like any other, so a
   stream is decided exactly as the same request over HTTP/1.1 would be (``:authority``
   must be the TLS server name, like Host; methods, paths, transforms, secrets in the
   guest's head refused). Bytes HTTP/1.1 cannot carry (CR, LF, NUL in a value, a field
   name that is not a token, a scheme other than https, CONNECT) refuse the stream;
2. a denied stream gets a ``403`` whose body names the rule (and, if the guest is still
   sending, ``RST_STREAM(NO_ERROR)``); the connection and its other streams go on;
3. an allowed stream goes up as HTTP/1.1 (why not h2 upstream: one strict request
   grammar to check and one response framing to follow, shared with the HTTP/1.1 path;
   the guest still multiplexes, each stream taking an upstream connection from a small
   pool of reusable ones, :data:`POOL`, or opening one): the head, then the DATA frames
   (chunked when the guest gave no ``content-length``);
4. the answer's head becomes the stream's HEADERS (hop-by-hop fields dropped), its body
   (de-chunked) DATA frames, every byte through the transform's :class:`Redactor`.

Bounded memory: the guest's DATA is acknowledged (WINDOW_UPDATE) only once written
upstream, so at most :data:`STREAM_WINDOW` per stream and :data:`CONNECTION_WINDOW` per
connection are ever buffered; answers are read upstream 64 KiB at a time and only while
the stream's send window has room, so a slow guest slows the server (TCP backpressure)
instead of filling memory. A 100 MiB download streams through in those bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    Event,
    RemoteSettingsChanged,
    RequestReceived,
    StreamEnded,
    StreamReset,
    WindowUpdated,
)
from h2.exceptions import H2Error, ProtocolError
from h2.settings import SettingCodes, Settings

from hutch.net.http_head import BodyFramer, HeadError, RequestHead, parse_request_head
from hutch.net.inspected_http import (
    Check,
    Checked,
    GuestStream,
    Redactor,
    Refused,
    ResponseHead,
    Upstream,
    forbidden_body,
    read_response_head,
    reusable,
    upstream_head,
)

__all__ = ["CONNECTION_WINDOW", "MAX_STREAMS", "POOL", "STREAM_WINDOW", "h1_head", "serve_h2"]

log = logging.getLogger(__name__)

STREAM_WINDOW = 1 << 20
CONNECTION_WINDOW = 4 << 20
MAX_STREAMS = 100
POOL = 4
_CHUNK = 64 * 1024
_DEFAULT_WINDOW = 65535
_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9a-z]+")
_VALUE = re.compile(rb"[\x20-\x7e\x80-\xff\t]*")
# Fields HTTP/1.1 treats as hop-by-hop or framing: never copied between the two.
_DROP = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade", b"te"}
)


def h1_head(headers: list[tuple[bytes, bytes]], ended: bool) -> bytes:
    """The HTTP/1.1 request head for an HTTP/2 request's ``headers`` (``ended``: the
    HEADERS frame ended the stream, so there is no body). Raises HeadError for what
    HTTP/1.1 cannot carry faithfully."""
    pseudo: dict[bytes, bytes] = {}
    fields: list[tuple[bytes, bytes]] = []
    for name, value in headers:
        if name.startswith(b":"):
            if name in pseudo:
                raise HeadError(f"repeated HTTP/2 pseudo-header {name.decode('latin-1')}")
            pseudo[name] = value
        else:
            fields.append((name, value))
    method, path = pseudo.get(b":method"), pseudo.get(b":path")
    if method is None or path is None:
        raise HeadError("HTTP/2 request without :method or :path")
    if method == b"CONNECT":
        raise HeadError("CONNECT (a tunnel to any port) is not relayed; use a host:port rule")
    if pseudo.get(b":scheme") != b"https":
        raise HeadError("HTTP/2 request :scheme is not https")
    hosts = [v for k, v in fields if k == b"host"]
    authority = pseudo.get(b":authority")
    if authority is None and len(hosts) != 1:
        raise HeadError("HTTP/2 request without :authority or a single Host")
    if authority is not None and hosts and hosts != [authority]:
        raise HeadError("HTTP/2 :authority and Host name different hosts")
    host = authority if authority is not None else hosts[0]
    lines = [method + b" " + path + b" HTTP/1.1", b"Host: " + host]
    cookies: list[bytes] = []
    has_length = False
    for name, value in fields:
        if not _NAME.fullmatch(name):
            raise HeadError(f"HTTP/2 header name {name[:40]!r} is not a lower-case token")
        if not _VALUE.fullmatch(value) or value != value.strip(b" \t"):
            raise HeadError(f"HTTP/2 header {name.decode()} holds bytes HTTP/1.1 cannot carry")
        if name == b"host" or name in _DROP:
            continue
        if name == b"cookie":
            cookies.append(value)
            continue
        has_length = has_length or name == b"content-length"
        lines.append(name + b": " + value)
    if cookies:
        lines.append(b"cookie: " + b"; ".join(cookies))
    if not ended and not has_length:
        lines.append(b"transfer-encoding: chunked")
    return b"\r\n".join(lines) + b"\r\n\r\n"


@dataclass(eq=False)
class _Stream:
    id: int
    ended: bool  # the guest sent END_STREAM
    body: asyncio.Queue[tuple[bytes, int] | None] = field(default_factory=asyncio.Queue)
    window: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class _Server:
    def __init__(
        self,
        guest: GuestStream,
        check: Check,
        on_refused: Callable[[RequestHead | None, str], None],
        sent: Callable[[int], None] | None,
    ) -> None:
        self.guest = guest
        self.check = check
        self.on_refused = on_refused
        self.sent = sent or (lambda _count: None)
        config = H2Configuration(client_side=False, header_encoding=None)
        self.conn = H2Connection(config)
        self.conn.local_settings = Settings(
            client=False,
            initial_values={
                SettingCodes.MAX_CONCURRENT_STREAMS: MAX_STREAMS,
                SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
                SettingCodes.MAX_HEADER_LIST_SIZE: 64 * 1024,
            },
        )
        self.streams: dict[int, _Stream] = {}
        self.idle: list[Upstream] = []
        self.lock = asyncio.Lock()

    async def flush(self) -> None:
        async with self.lock:
            data = self.conn.data_to_send()
            if data:
                await self.guest.write(data)

    async def run(self) -> None:
        self.conn.initiate_connection()
        self.conn.increment_flow_control_window(CONNECTION_WINDOW - _DEFAULT_WINDOW)
        await self.flush()
        try:
            while True:
                data = await self.guest.read(_CHUNK)
                if not data:
                    return
                try:
                    events = self.conn.receive_data(data)
                except ProtocolError as exc:
                    self.on_refused(None, f"HTTP/2 protocol error from the guest: {exc}")
                    await self.flush()  # h2 queued the GOAWAY
                    return
                stop = False
                for event in events:
                    stop = self.handle(event) or stop
                await self.flush()
                if stop:
                    return
        finally:
            tasks = [s.task for s in self.streams.values() if s.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for upstream in self.idle:
                upstream.abort()
            self.idle.clear()

    def handle(self, event: Event) -> bool:
        """Apply one event; True when the connection is over."""
        if isinstance(event, RequestReceived):
            stream = _Stream(event.stream_id, event.stream_ended is not None)
            self.streams[stream.id] = stream
            stream.task = asyncio.create_task(self.serve_stream(stream, event.headers or []))
        elif isinstance(event, DataReceived):
            stream_or_none = self.streams.get(event.stream_id)
            if stream_or_none is None:  # answered already: give the window back now
                self.ack(event.flow_controlled_length, event.stream_id)
            else:
                stream_or_none.body.put_nowait((event.data or b"", event.flow_controlled_length))
        elif isinstance(event, StreamEnded):
            ended = self.streams.get(event.stream_id)
            if ended is not None:
                ended.ended = True
                ended.body.put_nowait(None)
        elif isinstance(event, StreamReset):
            reset = self.streams.get(event.stream_id)
            if reset is not None and reset.task is not None:
                reset.task.cancel()
        elif isinstance(event, WindowUpdated | RemoteSettingsChanged):
            for stream in self.streams.values():
                stream.window.set()
        elif isinstance(event, ConnectionTerminated):
            return True
        return False

    def ack(self, count: int, stream_id: int) -> None:
        if count:
            with contextlib.suppress(H2Error):
                self.conn.acknowledge_received_data(count, stream_id)

    async def serve_stream(self, stream: _Stream, headers: list[tuple[bytes, bytes]]) -> None:
        try:
            try:
                request = parse_request_head(h1_head(list(headers), stream.ended))
                if request is None:  # cannot happen: the head is complete
                    raise HeadError("incomplete request head")
            except HeadError as exc:
                self.on_refused(None, str(exc))
                await self.refuse(stream, str(exc))
                return
            idle = self.take_idle()
            try:
                checked = await self.check(request, idle)
            except Refused as refused:  # ``check`` logged it
                if idle is not None:
                    self.idle.append(idle)
                await self.refuse(stream, refused.reason)
                return
            if idle is not None and checked.upstream is not idle:
                idle.abort()
            cut: str | None = "the relay failed"
            reuse = False
            try:
                cut, reuse = await self.relay(stream, request, checked)
            finally:
                if reuse and len(self.idle) < POOL:
                    self.idle.append(checked.upstream)
                else:
                    checked.upstream.abort()
                if checked.done is not None:
                    checked.done(cut)
        except (ConnectionError, OSError, H2Error, HeadError) as exc:
            log.debug("HTTP/2 stream %d ended: %s", stream.id, exc)
            await self.reset(stream, ErrorCodes.INTERNAL_ERROR)
        finally:
            self.streams.pop(stream.id, None)
            while not stream.body.empty():  # never forwarded: give the window back
                item = stream.body.get_nowait()
                if item is not None:
                    self.ack(item[1], stream.id)
            with contextlib.suppress(ConnectionError, OSError):
                await self.flush()

    def take_idle(self) -> Upstream | None:
        while self.idle:
            upstream = self.idle.pop()
            if upstream.alive():
                return upstream
            upstream.abort()
        return None

    async def reset(self, stream: _Stream, code: ErrorCodes) -> None:
        with contextlib.suppress(H2Error):
            self.conn.reset_stream(stream.id, code)
        with contextlib.suppress(ConnectionError, OSError):
            await self.flush()

    async def refuse(self, stream: _Stream, reason: str) -> None:
        body = forbidden_body(reason)
        headers = [
            (b":status", b"403"),
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            (b"x-hutch-egress", b"denied"),
        ]
        self.conn.send_headers(stream.id, headers)
        await self.send_data(stream, body, end=True)
        if not stream.ended:  # stop the guest's upload: the answer is complete
            await self.reset(stream, ErrorCodes.NO_ERROR)

    async def send_data(self, stream: _Stream, data: bytes, *, end: bool) -> None:
        """DATA frames within the stream's and the connection's send windows."""
        while data:
            stream.window.clear()
            window = self.conn.local_flow_control_window(stream.id)
            if window <= 0:
                await stream.window.wait()
                continue
            size = min(window, self.conn.max_outbound_frame_size, len(data))
            self.conn.send_data(stream.id, data[:size])
            data = data[size:]
            await self.flush()
        if end:
            self.conn.end_stream(stream.id)
            await self.flush()

    async def relay(
        self, stream: _Stream, request: RequestHead, checked: Checked
    ) -> tuple[str | None, bool]:
        """(why the relay was cut or None, the upstream connection may be reused)."""
        up = checked.upstream
        head = upstream_head(checked.head, request)
        up.writer.write(head)
        self.sent(len(head))
        upload = asyncio.create_task(self.upload(stream, up, request.body == "chunked"))
        try:
            response, leftover = await self.download(stream, up, request, Redactor(checked.redact))
            await upload
        except HeadError as exc:
            await self.reset(stream, ErrorCodes.INTERNAL_ERROR)
            return f"cut: {exc}", False
        finally:
            if not upload.done():
                upload.cancel()
                with contextlib.suppress(BaseException):
                    await upload
        return None, reusable(head, response, leftover)

    async def upload(self, stream: _Stream, up: Upstream, chunked: bool) -> None:
        while True:
            item = await stream.body.get()
            if item is None:
                break
            data, flow = item
            if data:
                out = b"%x\r\n%s\r\n" % (len(data), data) if chunked else data
                up.writer.write(out)
                self.sent(len(out))
                await up.writer.drain()
            self.ack(flow, stream.id)  # forwarded: the guest may send that much more
            await self.flush()
        if chunked:
            up.writer.write(b"0\r\n\r\n")
            self.sent(5)
            await up.writer.drain()

    async def download(
        self, stream: _Stream, up: Upstream, request: RequestHead, redactor: Redactor
    ) -> tuple[ResponseHead, bytes]:
        buf = b""
        while True:
            head, buf = await read_response_head(up.reader, buf, request.method)
            if head.status == 101:
                raise HeadError("the server switched protocols without being asked to")
            if head.status >= 200:
                break
        headers = [(b":status", str(head.status).encode())]
        for line in head.lines[1:]:
            key, _, value = line.partition(b":")
            name = key.strip().lower()
            if name not in _DROP:
                headers.append((name, redactor.feed(value.strip()) + redactor.flush()))
        self.conn.send_headers(stream.id, headers, end_stream=head.framing == "none")
        await self.flush()
        if head.framing == "none":
            return head, buf
        framer: BodyFramer | None = None
        if head.framing in ("length", "chunked"):
            framer = BodyFramer.framing(
                "length" if head.framing == "length" else "chunked", head.length
            )
            framer.keep_payload()
        while framer is None or not framer.done:
            if not buf:
                buf = await up.reader.read(_CHUNK)
                if not buf:
                    if framer is not None:
                        raise HeadError("the server closed before the end of the response body")
                    break
            if framer is None:
                payload, buf = buf, b""
            else:
                take = framer.feed(buf)
                buf = buf[take:]
                payload = framer.take_payload()
            await self.send_data(stream, redactor.feed(payload), end=False)
        await self.send_data(stream, redactor.flush(), end=True)
        return head, buf


async def serve_h2(
    guest: GuestStream,
    check: Check,
    on_refused: Callable[[RequestHead | None, str], None],
    sent: Callable[[int], None] | None = None,
) -> None:
    """Serve an HTTP/2 connection (the guest chose ``h2`` by ALPN) until the guest ends
    it: every stream decided by ``check`` and relayed as in the module docstring.
    ``on_refused`` is told about streams that could not be read; ``sent`` the bytes
    written upstream."""
    await _Server(guest, check, on_refused, sent).run()
