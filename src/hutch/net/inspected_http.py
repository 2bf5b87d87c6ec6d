"""HTTP/1.1 inside a TLS connection the egress proxy terminated: every request checked,
keep-alive kept (asyncio; the decisions are the proxy's, passed in as ``check``).

Per request on the guest's connection:

1. its head is read and parsed strictly (:mod:`hutch.net.http_head`; HTTP/2's preface
   ``PRI * HTTP/2.0``, CONNECT and anything that is not HTTP/1.x are refused);
2. ``check(head)`` decides it (the Host must be the TLS server name, the ordered rules,
   a transform's headers) and opens a fresh upstream TLS connection for it, or raises
   :class:`Refused` (the guest gets a 403 naming why and the connection is closed);
3. the head as ``check`` rewrote it (``Connection: close`` upstream: one request per
   upstream connection, as for plain HTTP) and exactly the body its framing announces
   go up; bytes after the body stay buffered as the start of the guest's next request,
   which goes through steps 1-3 again;
4. the response head is parsed (status and framing); a body framed by
   ``Content-Length`` is relayed exactly and the guest's connection stays open for its
   next request; a chunked or close-delimited body is relayed to the server's end and
   the guest's connection is then closed (``Connection: close`` is set in the head the
   guest gets). Every byte of the answer passes a :class:`Redactor`: a secret that a
   transform injected is replaced by ``*`` of the same length if the server echoes it
   (lengths, hence framing, unchanged; a compressed echo is not recognised).

Bodies stream in 64 KiB pieces both ways; nothing is buffered whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from hutch.net.http_head import BodyFramer, HeadError, RequestHead, parse_request_head

__all__ = [
    "Checked",
    "GuestStream",
    "Redactor",
    "Refused",
    "ResponseHead",
    "parse_response_head",
    "serve_inspected",
]

_CHUNK = 64 * 1024
MAX_RESPONSE_HEAD = 64 * 1024
_STATUS = re.compile(rb"^HTTP/1\.[01] ([1-5][0-9]{2})(?: .*)?$")
_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection"})


class GuestStream(Protocol):
    async def read(self, n: int = ...) -> bytes: ...
    async def write(self, data: bytes) -> None: ...


class Refused(Exception):
    """``check`` refuses the request: ``reason`` goes into the 403 and the log."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Checked:
    """An allowed request: the head to send, the upstream connection opened for it, the
    values to redact from the answer, and ``done(cut)`` called once it is relayed
    (``cut``: why the relay stopped early, or None)."""

    head: bytes
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    redact: Sequence[bytes] = ()
    done: Callable[[str | None], None] | None = None


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
    status = int(match.group(1))
    kept = [lines[0]]
    lengths: list[bytes] = []
    codings: list[bytes] = []
    for line in lines[1:]:
        key, sep, value = line.partition(b":")
        if not sep or not key or key != key.strip():
            raise HeadError("malformed HTTP response header field")
        low = key.lower()
        if low in _HOP:
            continue
        if low == b"content-length":
            lengths.append(value.strip())
        elif low == b"transfer-encoding":
            codings.append(value.strip().lower())
        kept.append(line)
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return ResponseHead(status, "none", 0, kept, end + 4)
    if codings:
        if lengths or codings != [b"chunked"]:
            raise HeadError("response framing is ambiguous (Transfer-Encoding)")
        return ResponseHead(status, "chunked", 0, kept, end + 4)
    if lengths:
        if len(set(lengths)) != 1 or not lengths[0].isdigit():
            raise HeadError("response Content-Length is repeated or not a number")
        return ResponseHead(status, "length", int(lengths[0]), kept, end + 4)
    return ResponseHead(status, "close", 0, kept, end + 4)


def _forbidden(reason: str) -> bytes:
    body = f"hutch egress denied this request: {reason}\n".encode()
    return (
        b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain; charset=utf-8\r\n"
        + f"Content-Length: {len(body)}\r\n".encode()
        + b"Connection: close\r\nX-Hutch-Egress: denied\r\n\r\n"
        + body
    )


async def serve_inspected(
    guest: GuestStream,
    check: Callable[[RequestHead], Awaitable[Checked]],
    on_refused: Callable[[RequestHead | None, str], None],
    sent: Callable[[int], None] | None = None,
) -> None:
    """Serve the guest's requests until it closes, a request is refused (403, then
    closed: ``check`` logs its refusals, ``on_refused(head or None, reason)`` is called
    for requests that could not be read) or an answer ends the connection. ``sent`` is
    told the bytes written upstream (heads and bodies: the meter's egress). See the
    module docstring."""
    buf = b""
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
                reason = "HTTP/2 with prior knowledge cannot be inspected (HTTP/1.1 only)"
            on_refused(None, reason)
            await guest.write(_forbidden(reason))
            return
        try:
            checked = await check(request)
        except Refused as refused:  # ``check`` logged it
            await guest.write(_forbidden(refused.reason))
            return
        cut: str | None = "the relay failed"
        try:
            keep, buf, cut = await _relay(guest, request, buf[request.consumed :], checked, sent)
        finally:
            checked.writer.transport.abort()
            if checked.done is not None:
                checked.done(cut)
        if not keep:
            return


async def _relay(
    guest: GuestStream,
    request: RequestHead,
    rest: bytes,
    checked: Checked,
    sent: Callable[[int], None] | None,
) -> tuple[bool, bytes, str | None]:
    """(keep the guest's connection, the bytes after the body, why it was cut or None)."""
    checked.writer.write(checked.head)
    if sent is not None:
        sent(len(checked.head))
    upload = asyncio.create_task(_upload(guest, checked.writer, BodyFramer(request), rest, sent))
    try:
        keep = await _download(guest, checked.reader, request, Redactor(checked.redact))
        leftover, guest_open = await upload
    except HeadError as exc:
        return False, b"", f"cut: {exc}"
    finally:
        if not upload.done():
            upload.cancel()
            with contextlib.suppress(BaseException):
                await upload
    closing = request.version != "HTTP/1.1"
    return keep and guest_open and not closing, leftover, None


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
) -> bool:
    """Relay the answer (1xx heads first); True when the guest's connection may carry
    its next request."""
    buf = b""
    while True:
        head = parse_response_head(buf, request.method)
        if head is None:
            data = await up.read(_CHUNK)
            if not data:
                raise HeadError("the server closed before a complete response head")
            buf += data
            continue
        buf = buf[head.consumed :]
        if 100 <= head.status < 200:
            await guest.write(redactor.feed(b"\r\n".join(head.lines) + b"\r\n\r\n"))
            await guest.write(redactor.flush())
            continue
        keep = head.framing in ("length", "none")
        lines = head.lines + ([] if keep else [b"Connection: close"])
        await guest.write(redactor.feed(b"\r\n".join(lines) + b"\r\n\r\n"))
        break
    if head.framing == "length":
        left = head.length
        while left > 0:
            if not buf:
                buf = await up.read(min(_CHUNK, left))
                if not buf:
                    raise HeadError("the server closed before the end of the response body")
            piece, buf = buf[:left], buf[left:]
            left -= len(piece)
            await guest.write(redactor.feed(piece))
    elif head.framing in ("chunked", "close"):
        while True:
            if buf:
                await guest.write(redactor.feed(buf))
            buf = await up.read(_CHUNK)
            if not buf:
                break
    await guest.write(redactor.flush())
    return keep
