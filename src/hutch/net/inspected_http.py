"""HTTP/1.1 inside a TLS connection the egress proxy terminated: every request checked,
keep-alive both ways, WebSockets (asyncio; the decisions are the proxy's, passed in as
``check``).

Per request on the guest's connection:

1. its head is read and parsed strictly (:mod:`hutch.net.http_head`; CONNECT and
   anything that is not HTTP/1.x are refused; HTTP/2 is negotiated by ALPN instead and
   served by :mod:`hutch.net.h2_relay`);
2. ``check(head, upstream)`` decides it (the Host must be the TLS server name, the
   ordered rules, a transform's headers) and returns the upstream connection to use:
   the one the previous request left reusable (``upstream``), or a fresh verified TLS
   connection; or it raises :class:`Refused` (the guest gets a 403 naming why and the
   connection is closed);
3. the head as ``check`` rewrote it and exactly the body its framing announces go up;
   bytes after the body stay buffered as the start of the guest's next request, which
   goes through steps 1-3 again;
4. the response head is parsed (status and framing) and its body relayed exactly as
   framed (``Content-Length`` or chunked, followed with the strict chunked grammar);
   the guest's connection then carries its next request. A close-delimited body is
   relayed to the server's end and the guest's connection is then closed
   (``Connection: close`` in the head the guest gets). Every byte of the answer passes a
   :class:`Redactor`: a secret that a transform injected is replaced by ``*`` of the same
   length if the server echoes it (lengths, hence framing, unchanged; a compressed echo
   is not recognised).

Upstream reuse (:func:`upstream_head`, :func:`reusable`): the upstream connection is kept
for the next request only when nothing about the boundary between two requests is left
to the server's reading: the request had no body (its head ends at CRLF CRLF, strictly
parsed; a request with a body goes up with ``Connection: close``, so no byte of a body a
lenient server might misread as a request is ever followed by another request), the
answer was framed exactly, nothing followed it, and the server did not say close. The
TLS server name is fixed per guest connection and Host must equal it, so the upstream
host never changes under a reused connection; each request is still decided on its own.

WebSockets: a ``GET`` with ``Connection: upgrade`` and ``Upgrade: websocket`` (HTTP/1.1)
is decided like any request and goes up with its Upgrade; a ``101`` answer switches the
connection to raw bytes both ways (metered up, redacted down) until either side ends.
Other upgrades (``h2c``) are dropped as hop-by-hop fields, so the server answers plain
HTTP/1.1. Server-Sent Events are a streamed (chunked or close-delimited) answer: every
piece is passed on as it arrives.

Bodies stream in 64 KiB pieces both ways; nothing is buffered whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from hutch.net.http_head import (
    BodyFramer,
    BodyKind,
    HeadError,
    RequestHead,
    parse_request_head,
)

__all__ = [
    "Check",
    "Checked",
    "GuestStream",
    "Redactor",
    "Refused",
    "ResponseHead",
    "Upstream",
    "forbidden_body",
    "forbidden_response",
    "parse_response_head",
    "read_response_head",
    "reusable",
    "serve_inspected",
    "upstream_head",
]

_CHUNK = 64 * 1024
MAX_RESPONSE_HEAD = 64 * 1024
_STATUS = re.compile(rb"^HTTP/1\.([01]) ([1-5][0-9]{2})(?: .*)?$")
_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection"})
_CLOSE = b"Connection: close\r\n\r\n"


class GuestStream(Protocol):
    async def read(self, n: int = ...) -> bytes: ...
    async def write(self, data: bytes) -> None: ...


class Refused(Exception):
    """``check`` refuses the request: ``reason`` goes into the 403 and the log."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(eq=False)
class Upstream:
    """An open upstream connection (verified TLS) and the address it reached."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    address: str

    def abort(self) -> None:
        self.writer.transport.abort()

    def alive(self) -> bool:
        """Not closed by either side yet (a server closing an idle kept-alive connection
        is seen here, so the next request opens a fresh one instead)."""
        return not self.reader.at_eof() and not self.writer.is_closing()


@dataclass
class Checked:
    """An allowed request: the head to send (as :mod:`http_head` made it, ending in
    ``Connection: close``), the upstream connection to send it on, the values to redact
    from the answer, and ``done(cut)`` called once it is relayed (``cut``: why the relay
    stopped early, or None)."""

    head: bytes
    upstream: Upstream
    redact: Sequence[bytes] = ()
    done: Callable[[str | None], None] | None = None


#: ``check(request, reusable upstream or None)``: see the module docstring.
Check = Callable[[RequestHead, Upstream | None], Awaitable[Checked]]


class Redactor:
    """Same-length replacement of ``secrets`` in a byte stream fed in pieces: a tail of
    the longest secret's length minus one is held back until the next piece (or
    :meth:`flush`), so a secret split across pieces is still found."""

    def __init__(self, secrets: Sequence[bytes]) -> None:
        self._secrets = [s for s in secrets if s]
        self._keep = max((len(s) for s in self._secrets), default=1) - 1
        self._tail = b""

    def feed(self, data: bytes) -> bytes:
        if not self._secrets:
            return data
        buf = self._tail + data
        for secret in self._secrets:
            buf = buf.replace(secret, b"*" * len(secret))
        cut = max(0, len(buf) - self._keep)
        self._tail = buf[cut:]
        return buf[:cut]

    def flush(self) -> bytes:
        out, self._tail = self._tail, b""
        return out


@dataclass(frozen=True)
class ResponseHead:
    status: int
    framing: str  # "length" | "chunked" | "close" | "none"
    length: int
    lines: list[bytes]  # the status line and the fields, hop-by-hop ones dropped
    consumed: int
    #: The server will close after this answer (``Connection: close``, or HTTP/1.0).
    closing: bool = False


def parse_response_head(buf: bytes, method: str) -> ResponseHead | None:
    """The response head at the start of ``buf`` (None: read more). Raises HeadError
    for what the proxy will not relay (a malformed status line, both or repeated length
    fields, a transfer coding other than chunked, a head over 64 KiB)."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if len(buf) > MAX_RESPONSE_HEAD:
            raise HeadError("response headers are too large")
        return None
    lines = buf[:end].split(b"\r\n")
    match = _STATUS.match(lines[0])
    if match is None:
        raise HeadError("malformed HTTP response status line")
    status = int(match.group(2))
    closing = match.group(1) == b"0"
    kept = [lines[0]]
    lengths: list[bytes] = []
    codings: list[bytes] = []
    for line in lines[1:]:
        key, sep, value = line.partition(b":")
        if not sep or not key or key != key.strip():
            raise HeadError("malformed HTTP response header field")
        low = key.lower()
        if low == b"connection" and b"close" in [o.strip().lower() for o in value.split(b",")]:
            closing = True
        if low in _HOP:
            continue
        if low == b"content-length":
            lengths.append(value.strip())
        elif low == b"transfer-encoding":
            codings.append(value.strip().lower())
        kept.append(line)
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return ResponseHead(status, "none", 0, kept, end + 4, closing)
    if codings:
        if lengths or codings != [b"chunked"]:
            raise HeadError("response framing is ambiguous (Transfer-Encoding)")
        return ResponseHead(status, "chunked", 0, kept, end + 4, closing)
    if lengths:
        if len(set(lengths)) != 1 or not lengths[0].isdigit():
            raise HeadError("response Content-Length is repeated or not a number")
        return ResponseHead(status, "length", int(lengths[0]), kept, end + 4, closing)
    return ResponseHead(status, "close", 0, kept, end + 4, True)


def forbidden_body(reason: str) -> bytes:
    return f"hutch egress denied this request: {reason}\n".encode()


def forbidden_response(reason: str) -> bytes:
    body = forbidden_body(reason)
    return (
        b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain; charset=utf-8\r\n"
        + f"Content-Length: {len(body)}\r\n".encode()
        + b"Connection: close\r\nX-Hutch-Egress: denied\r\n\r\n"
        + body
    )


async def read_response_head(
    reader: asyncio.StreamReader, buf: bytes, method: str
) -> tuple[ResponseHead, bytes]:
    """The next response head from the server: parsed from ``buf`` (bytes already read)
    and as much more of ``reader`` as it takes. Returns the head and the bytes after it.
    Raises HeadError as :func:`parse_response_head` does, or when the server closes
    before the head is complete."""
    while (head := parse_response_head(buf, method)) is None:
        data = await reader.read(_CHUNK)
        if not data:
            raise HeadError("the server closed before a complete response head")
        buf += data
    return head, buf[head.consumed :]


def upstream_head(head: bytes, request: RequestHead) -> bytes:
    """The head sent upstream for ``request`` (``head``: the checked, maybe rewritten
    head, ending in ``Connection: close``): a WebSocket upgrade goes up with
    ``Upgrade: websocket``/``Connection: Upgrade``; an HTTP/1.1 request without a body
    keeps the connection (reuse); anything else keeps ``Connection: close``."""
    if not head.endswith(_CLOSE):
        raise HeadError("a checked request head must end with Connection: close")
    base = head[: -len(_CLOSE)]
    if request.version != "HTTP/1.1":
        return head
    if request.upgrade == "websocket" and request.method == "GET" and request.body == "none":
        return base + b"Upgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    if request.body == "none":
        return base + b"\r\n"
    return head


def reusable(sent_head: bytes, response: ResponseHead, leftover: bytes) -> bool:
    """May the upstream connection carry the next request? See the module docstring."""
    return (
        not sent_head.endswith(_CLOSE)
        and response.framing in ("length", "chunked", "none")
        and not response.closing
        and not leftover
    )


async def serve_inspected(
    guest: GuestStream,
    check: Check,
    on_refused: Callable[[RequestHead | None, str], None],
    sent: Callable[[int], None] | None = None,
) -> None:
    """Serve the guest's requests until it closes, a request is refused (403, then
    closed: ``check`` logs its refusals, ``on_refused(head or None, reason)`` is called
    for requests that could not be read) or an answer ends the connection. ``sent`` is
    told the bytes written upstream (heads and bodies: the meter's egress). See the
    module docstring."""
    buf = b""
    idle: Upstream | None = None
    try:
        while True:
            request: RequestHead | None = None
            try:
                while request is None:
                    request = parse_request_head(buf)
                    if request is None:
                        data = await guest.read(_CHUNK)
                        if not data:
                            if buf:
                                on_refused(None, "the connection closed inside a request head")
                            return
                        buf += data
            except HeadError as exc:
                reason = str(exc)
                if buf.startswith(b"PRI * HTTP/2.0"):
                    reason = (
                        "HTTP/2 with prior knowledge is refused (HTTP/2 is inspected when "
                        "negotiated by TLS ALPN)"
                    )
                on_refused(None, reason)
                await guest.write(forbidden_response(reason))
                return
            if idle is not None and not idle.alive():
                idle.abort()
                idle = None
            try:
                checked = await check(request, idle)
            except Refused as refused:  # ``check`` logged it
                await guest.write(forbidden_response(refused.reason))
                return
            if idle is not None and checked.upstream is not idle:
                idle.abort()
            idle = None
            cut: str | None = "the relay failed"
            reuse = False
            try:
                keep, buf, cut, reuse = await _relay(
                    guest, request, buf[request.consumed :], checked, sent
                )
            finally:
                if reuse:
                    idle = checked.upstream
                else:
                    checked.upstream.abort()
                if checked.done is not None:
                    checked.done(cut)
            if not keep:
                return
    finally:
        if idle is not None:
            idle.abort()


async def _relay(
    guest: GuestStream,
    request: RequestHead,
    rest: bytes,
    checked: Checked,
    sent: Callable[[int], None] | None,
) -> tuple[bool, bytes, str | None, bool]:
    """(keep the guest's connection, the bytes after the body, why it was cut or None,
    the upstream connection may be reused)."""
    up = checked.upstream
    head = upstream_head(checked.head, request)
    up.writer.write(head)
    if sent is not None:
        sent(len(head))
    upload = asyncio.create_task(_upload(guest, up.writer, BodyFramer(request), rest, sent))
    redactor = Redactor(checked.redact)
    try:
        response, leftover_up = await _download(guest, up.reader, request, redactor)
        leftover, guest_open = await upload
        if response.status == 101:
            await _tunnel(guest, up, leftover, leftover_up, redactor, sent)
            return False, b"", None, False
    except HeadError as exc:
        return False, b"", f"cut: {exc}", False
    finally:
        if not upload.done():
            upload.cancel()
            with contextlib.suppress(BaseException):
                await upload
    keep = response.framing != "close" and guest_open and request.version == "HTTP/1.1"
    return keep, leftover, None, reusable(head, response, leftover_up)


async def _upload(
    guest: GuestStream,
    up: asyncio.StreamWriter,
    framer: BodyFramer,
    data: bytes,
    sent: Callable[[int], None] | None,
) -> tuple[bytes, bool]:
    """The body, exactly; returns (bytes after it, whether the guest is still open)."""
    while not framer.done:
        if data:
            take = framer.feed(data)
            up.write(data[:take])
            if sent is not None:
                sent(take)
            await up.drain()
            data = data[take:]
            if framer.done:
                break
        data = await guest.read(_CHUNK)
        if not data:
            return b"", False
    return data, True


async def _download(
    guest: GuestStream, up: asyncio.StreamReader, request: RequestHead, redactor: Redactor
) -> tuple[ResponseHead, bytes]:
    """Relay the answer (1xx heads first; a 101 to a WebSocket upgrade ends it: the
    tunnel follows). Returns its head and the bytes the server sent after it."""
    buf = b""
    while True:
        head, buf = await read_response_head(up, buf, request.method)
        if head.status == 101:
            if request.upgrade != "websocket":
                raise HeadError("the server switched protocols without being asked to")
            lines = [*head.lines, b"Connection: Upgrade"]
            await guest.write(redactor.feed(b"\r\n".join(lines) + b"\r\n\r\n"))
            await guest.write(redactor.flush())
            return head, buf
        if 100 <= head.status < 200:
            await guest.write(redactor.feed(b"\r\n".join(head.lines) + b"\r\n\r\n"))
            await guest.write(redactor.flush())
            continue
        lines = head.lines + ([b"Connection: close"] if head.framing == "close" else [])
        await guest.write(redactor.feed(b"\r\n".join(lines) + b"\r\n\r\n"))
        break
    if head.framing in ("length", "chunked"):
        kind: BodyKind = "length" if head.framing == "length" else "chunked"
        framer = BodyFramer.framing(kind, head.length)
        while not framer.done:
            if not buf:
                buf = await up.read(_CHUNK)
                if not buf:
                    raise HeadError("the server closed before the end of the response body")
            take = framer.feed(buf)
            piece, buf = buf[:take], buf[take:]
            await guest.write(redactor.feed(piece))
    elif head.framing == "close":
        while True:
            if buf:
                await guest.write(redactor.feed(buf))
            buf = await up.read(_CHUNK)
            if not buf:
                break
    await guest.write(redactor.flush())
    return head, buf


async def _tunnel(
    guest: GuestStream,
    up: Upstream,
    first_up: bytes,
    first_down: bytes,
    redactor: Redactor,
    sent: Callable[[int], None] | None,
) -> None:
    """After a 101: raw bytes both ways until either side ends (then both are cut)."""

    async def upward() -> None:
        data = first_up
        while True:
            if data:
                up.writer.write(data)
                if sent is not None:
                    sent(len(data))
                await up.writer.drain()
            data = await guest.read(_CHUNK)
            if not data:
                return

    async def downward() -> None:
        data = first_down
        while True:
            if data:
                await guest.write(redactor.feed(data))
                await guest.write(redactor.flush())
            data = await up.reader.read(_CHUNK)
            if not data:
                return

    tasks = [asyncio.create_task(upward()), asyncio.create_task(downward())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
