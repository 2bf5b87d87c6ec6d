"""The guest's side of a TLS connection the egress proxy terminates (asyncio).

The proxy has already read the guest's ClientHello (to learn its SNI and decide), so the
handshake cannot start on a fresh socket: an ``ssl.SSLObject`` over two memory BIOs is
fed those bytes first, then whatever the socket brings. Reads and writes are plain
coroutines; concurrent use by one reader task and one writer task is safe (each SSLObject
call runs between awaits, and the bytes it produces are written before the next await).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl

__all__ = ["TlsStream"]

_READ = 64 * 1024


class TlsStream:
    """TLS server side over ``reader``/``writer``; ``first`` is what was read already."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        context: ssl.SSLContext,
        first: bytes,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._obj = context.wrap_bio(self._in, self._out, server_side=True)
        self._in.write(first)
        self._eof = False

    async def handshake(self) -> None:
        """Complete the handshake; ``ssl.SSLError``/``ConnectionError`` when it fails
        (e.g. the guest does not trust hutch's CA and aborts)."""
        while True:
            try:
                self._obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                if self._eof:
                    raise ConnectionError("the guest closed during the TLS handshake") from None
                await self._fill()
        await self._flush()

    @property
    def alpn(self) -> str | None:
        return self._obj.selected_alpn_protocol()

    async def _fill(self) -> None:
        data = await self._reader.read(_READ)
        if data:
            self._in.write(data)
        else:
            self._eof = True
            self._in.write_eof()

    async def _flush(self) -> None:
        out = self._out.read()
        if out:
            self._writer.write(out)
            await self._writer.drain()

    async def read(self, n: int = _READ) -> bytes:
        """Up to ``n`` decrypted bytes; b"" at the end (close_notify or the socket's EOF)."""
        while True:
            try:
                return self._obj.read(n)
            except ssl.SSLWantReadError:
                await self._flush()
                if self._eof:
                    return b""
                await self._fill()
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""

    async def write(self, data: bytes) -> None:
        """Encrypt and send ``data`` (waits for the socket's buffer: backpressure)."""
        if data:
            self._obj.write(data)
            await self._flush()

    async def close(self) -> None:
        """Send close_notify (best effort); the caller closes the socket."""
        with contextlib.suppress(ssl.SSLError, OSError, ConnectionError):
            self._obj.unwrap()
        with contextlib.suppress(OSError, ConnectionError):
            await self._flush()
