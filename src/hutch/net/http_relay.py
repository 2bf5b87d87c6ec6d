"""One checked plain-HTTP request through the egress proxy, and nothing after it (asyncio).

Why one and not "parse and check each request of a keep-alive connection": the proxy
would then have to agree with every server, request after request, on where each one
ends. Relaying exactly one request (its head as :mod:`hutch.net.http_head` rewrote it,
then precisely the body its framing announces) and then no further byte from the guest
means a second request can never reach the server, whatever the server makes of the
first one: pipelined or smuggled bytes are read and dropped. The server is told
``Connection: close``; its answer is relayed until it closes. Clients open a new
connection for their next request (HTTP clients handle ``Connection: close`` always);
TLS connections are not affected (the proxy sees only their SNI, once).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from hutch.net.http_head import BodyFramer, HeadError, RequestHead

__all__ = ["relay_one_request"]

_CHUNK = 64 * 1024


async def _upload(
    guest: asyncio.StreamReader,
    up: asyncio.StreamWriter,
    framer: BodyFramer,
    first: bytes,
    sent: Callable[[int], None],
) -> None:
    """The body, exactly as framed. Whatever the guest sends after it (a pipelined or
    smuggled request) is read and dropped; the guest's EOF is passed on as a half-close,
    as a plain relay would, so a server that ignores ``Connection: close`` still ends."""
    data = first
    while not framer.done:
        if data:
            take = framer.feed(data)
            up.write(data[:take])
            sent(take)
            await up.drain()
            if framer.done:
                break  # the rest of ``data`` is never sent
        data = await guest.read(_CHUNK)
        if not data:
            break  # the guest gave up mid-body; the server sees a short body
    while await guest.read(_CHUNK):
        pass  # never sent
    if up.can_write_eof():
        with contextlib.suppress(OSError):
            up.write_eof()


async def _download(up: asyncio.StreamReader, guest: asyncio.StreamWriter) -> None:
    while data := await up.read(_CHUNK):
        guest.write(data)
        await guest.drain()
    if guest.can_write_eof():
        with contextlib.suppress(OSError):
            guest.write_eof()


async def relay_one_request(
    guest_reader: asyncio.StreamReader,
    guest_writer: asyncio.StreamWriter,
    up_reader: asyncio.StreamReader,
    up_writer: asyncio.StreamWriter,
    request: RequestHead,
    buffered: bytes,
    *,
    sent: Callable[[int], None] = lambda count: None,
) -> str | None:
    """Send ``request`` (``buffered``: bytes read after its head) upstream and relay the
    answer until the server closes (or, after the guest closed, ends its answer).
    Returns None, or why the body was cut (a malformed chunked body: the connection is
    closed at once, nothing more is sent). ``sent`` is told every count of bytes
    written upstream (the meter's egress)."""
    up_writer.write(request.head)
    sent(len(request.head))
    upload = asyncio.create_task(
        _upload(guest_reader, up_writer, BodyFramer(request), buffered, sent)
    )
    download = asyncio.create_task(_download(up_reader, guest_writer))
    try:
        done, _ = await asyncio.wait({upload, download}, return_when=asyncio.FIRST_COMPLETED)
        if upload in done:
            error = upload.exception()
            if isinstance(error, HeadError):
                return f"request body: {error}"
            if error is not None:
                raise error
            await download  # the guest is done sending: the answer, to the end
        else:
            download.result()  # the server closed (or failed) first: we are done
    finally:
        for task in (upload, download):
            task.cancel()
        await asyncio.gather(upload, download, return_exceptions=True)
    return None
