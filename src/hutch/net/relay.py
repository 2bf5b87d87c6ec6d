"""Two sockets joined in asyncio Protocol callbacks: the egress proxy's plain relay.

Why callbacks and not streams: a proxied connection used to cost the data path's thread
1.5-2 ms of CPU (ARCHITECTURE.md, "Where a proxied connection's time goes"): a
StreamReader, StreamReaderProtocol and StreamWriter per socket, two relay tasks, a
``drain()`` future per chunk and a task switch for every read. Here each socket has one
:class:`Endpoint` (its protocol) and the bytes go from one endpoint's
``data_received`` straight into the other's ``transport.write``, in the same callback.

An :class:`Endpoint` first *holds* what arrives (``buffer``; the proxy sniffs the SNI or
the request head there, :meth:`Endpoint.wait_data`); :class:`Relay` then joins two of
them:

- **backpressure** both ways: when one side's transport buffers past its high-water
  mark (``pause_writing``), the other side stops reading until it drains
  (``resume_writing``);
- **half-close**: an EOF from one side is passed on as ``write_eof`` and the other
  direction keeps going; the relay ends when both sides ended (or, with
  ``answer_ends``, when the upstream side ended: the one-request HTTP relay), or at
  once when either connection is lost;
- **counting**: ``sent`` is told the size of every chunk written to the upstream side
  (the meter's egress bytes);
- **filtering**: ``upload`` sees every chunk from side ``a`` and returns what goes on
  (:class:`hutch.net.http_relay.OneRequest`: exactly the checked body, nothing after
  it); raising :class:`RelayCut` ends the relay, with its reason as the result;
- **cut**: aborting either transport (``EgressProxy.revalidate``) ends it at once.

Ending closes both transports (what they still buffer is sent first) and
:meth:`Relay.wait` returns after both connections are gone; a cancelled ``wait``
aborts both.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import cast

__all__ = ["Endpoint", "Relay", "RelayCut"]

#: What an endpoint holds before it is relayed, beyond which it stops reading (the
#: sniffer refuses anything longer than ``sniff.MAX_PEEK`` anyway).
HOLD_LIMIT = 256 * 1024


class RelayCut(Exception):
    """Raised by an ``upload`` filter: the relay ends at once, ``reason`` is its result."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Endpoint(asyncio.Protocol):
    """One socket of a relay (its asyncio protocol). Before :class:`Relay` takes it,
    received bytes are held in ``buffer`` (reading pauses past :data:`HOLD_LIMIT`),
    an EOF sets ``eof`` and the end of the connection sets ``lost``; ``on_made`` is
    called with the endpoint once its transport exists."""

    def __init__(self, on_made: Callable[[Endpoint], None] | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False
        self.lost = False
        #: Set when the connection was handed over to streams (:meth:`to_streams`).
        self.streams: asyncio.StreamWriter | None = None
        self._on_made = on_made
        self._relay: Relay | None = None
        self._held = False  # reading paused because the buffer is full
        self._waiter: asyncio.Future[None] | None = None
        self._closed: asyncio.Future[None] | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport (they implement
        # its methods), so no isinstance check here.
        self.transport = cast(asyncio.Transport, transport)
        if self._on_made is not None:
            self._on_made(self)

    def data_received(self, data: bytes) -> None:
        if self._relay is not None:
            self._relay._received(self, data)
            return
        self.buffer += data
        if len(self.buffer) >= HOLD_LIMIT:
            self.pause_reading()
            self._held = True
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        if self._relay is not None:
            self._relay._ended(self)
        self._wake()
        return True  # keep the transport: the other direction may still be talking

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._relay is not None:
            self._relay._lost()
        self._wake()
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        if self._relay is not None:
            self._relay._other(self).pause_reading()

    def resume_writing(self) -> None:
        if self._relay is not None:
            self._relay._other(self).resume_reading()

    # -- for the proxy -------------------------------------------------------------------

    async def wait_data(self) -> None:
        """Until more bytes, an EOF or the end of the connection arrive (returns at once
        when the connection already ended or sent EOF)."""
        if self.eof or self.lost:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def take(self) -> bytes:
        """What is held, handed over (the buffer is emptied; reading resumes)."""
        data = bytes(self.buffer)
        self.buffer.clear()
        if self._held:
            self._held = False
            self.resume_reading()
        return data

    def to_streams(self) -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
        """Hand the connection over to asyncio streams (TLS inspection reads and writes
        through them): what was held, then a reader of what comes next (its EOF or end
        included) and a writer. The endpoint is done with the connection after this."""
        assert self.transport is not None and self._relay is None
        held = self.take()
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        self.transport.set_protocol(protocol)
        protocol.connection_made(self.transport)
        if self.lost:
            protocol.connection_lost(None)
        elif self.eof:
            reader.feed_eof()
        self.streams = asyncio.StreamWriter(self.transport, protocol, reader, loop)
        return held, reader, self.streams

    def pause_reading(self) -> None:
        # After an EOF the transport no longer reads; resuming it then would read the
        # EOF again, so an ended side is never paused or resumed.
        if self.transport is not None and not self.eof:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.eof:
            self.transport.resume_reading()

    def close(self) -> None:
        """Close the transport (what it buffers is sent first)."""
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    async def wait_closed(self) -> None:
        """Until the connection is gone (after :meth:`close` or :meth:`abort`)."""
        if self.streams is not None:  # handed over: the streams' protocol hears the end
            with contextlib.suppress(OSError, ConnectionError):
                await self.streams.wait_closed()
            return
        if self.lost or self.transport is None:
            return
        if self._closed is None:
            self._closed = asyncio.get_running_loop().create_future()
        await self._closed

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Relay:
    """Joins ``a`` (the guest) and ``b`` (upstream); see the module docstring. Either
    endpoint may already hold bytes and an EOF: :meth:`start` sends what they hold."""

    def __init__(
        self,
        a: Endpoint,
        b: Endpoint,
        *,
        sent: Callable[[int], None] | None = None,
        upload: Callable[[bytes], bytes] | None = None,
        answer_ends: bool = False,
    ) -> None:
        self.a, self.b = a, b
        self._sent = sent
        self._upload = upload
        self._answer_ends = answer_ends
        self._done: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()

    def start(self, first: bytes = b"") -> None:
        """Send ``first`` to ``b`` as it is (counted, not filtered: a checked request's
        head), then what both endpoints hold, and relay from now on."""
        a, b = self.a, self.b
        a._relay = b._relay = self
        # Taken before anything is written: taking resumes a side held at the limit,
        # and the writes below may pause it again for backpressure.
        held_a, held_b = a.take(), b.take()
        if first:
            self._write_up(first)
        if held_a:
            self._received(a, held_a)
        if held_b:
            self._received(b, held_b)
        if self._done.done():
            return
        if a.lost or b.lost:
            self._lost()
            return
        for side in (a, b):
            if side.eof:
                self._ended(side)

    async def wait(self) -> str | None:
        """Until the relay ended and both connections are gone: None, or why ``upload``
        cut it. Cancelled: both connections are aborted."""
        try:
            result = await asyncio.shield(self._done)
            await self.a.wait_closed()
            await self.b.wait_closed()
        except asyncio.CancelledError:
            self.a.abort()
            self.b.abort()
            raise
        return result

    # -- callbacks from the endpoints ----------------------------------------------------

    def _other(self, side: Endpoint) -> Endpoint:
        return self.b if side is self.a else self.a

    def _write_up(self, data: bytes) -> None:
        assert self.b.transport is not None
        self.b.transport.write(data)
        if self._sent is not None:
            self._sent(len(data))

    def _received(self, side: Endpoint, data: bytes) -> None:
        if self._done.done():
            return
        if side is self.b:
            assert self.a.transport is not None
            self.a.transport.write(data)
            return
        if self._upload is not None:
            try:
                data = self._upload(data)
            except RelayCut as cut:
                self._finish(cut.reason)
                return
        if data:
            self._write_up(data)

    def _ended(self, side: Endpoint) -> None:
        if self._done.done():
            return
        other = self._other(side)
        if other.transport is not None and other.transport.can_write_eof():
            with contextlib.suppress(OSError):
                other.transport.write_eof()  # sent once what it buffers is out
        if (self.a.eof and self.b.eof) or (side is self.b and self._answer_ends):
            self._finish(None)

    def _lost(self) -> None:
        self._finish(None)

    def _finish(self, result: str | None) -> None:
        if self._done.done():
            return
        self._done.set_result(result)
        self.a.close()
        self.b.close()
