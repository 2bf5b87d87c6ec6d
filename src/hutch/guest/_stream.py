"""Host-side state of one multiplexed stream: its inbox and both credit windows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any

from hutch.errors import GuestError
from hutch.guest.protocol import (
    CHANNEL_DATA,
    CHUNK,
    Frame,
    FrameType,
    ReceiveWindow,
    SendWindow,
)
from hutch.guest.results import error_from_wire

CLOSED_MESSAGE = "the guest agent connection closed; the VM may have stopped"

Sender = Callable[[Frame], None]
Drain = Callable[[], Awaitable[None]]


class StreamState:
    """One request's stream. Frames for it are pushed by the client's reader task.

    ``done`` turns true on the agent's END or ERROR (the stream is closed on both sides)
    or when the connection is lost (``lost``).
    """

    def __init__(self, sid: int, send: Sender, drain: Drain) -> None:
        self.sid = sid
        self._send = send
        self._drain = drain
        self._inbox: asyncio.Queue[Frame | None] = asyncio.Queue()
        self._out = SendWindow()
        self._in = ReceiveWindow()
        self._credit = asyncio.Event()
        self.done = False
        self.lost = False
        #: Why the connection went, when the host ended it on purpose (a pause, a delete).
        self.lost_reason: str | None = None

    # -- called by the reader task ------------------------------------------------------
    def deliver(self, frame: Frame) -> None:
        if frame.type is FrameType.CREDIT:
            n = frame.header.get("n")
            if isinstance(n, int) and n > 0:
                self._out.grant(n)
                self._credit.set()
            return
        if frame.type in (FrameType.END, FrameType.ERROR):
            self.done = True
            self._credit.set()  # wake an uploader: there is no one to send to any more
        self._inbox.put_nowait(frame)

    def connection_lost(self, reason: str | None = None) -> None:
        self.done = self.lost = True
        self.lost_reason = reason
        self._credit.set()
        self._inbox.put_nowait(None)

    # -- called by the request's task ---------------------------------------------------
    async def next(self) -> Frame:
        """The next frame from the agent; raises GuestError if the connection is lost.

        Consuming a DATA frame returns credit to the agent (in batches).
        """
        frame = await self._inbox.get()
        if frame is None:
            self._inbox.put_nowait(None)  # later callers must see it too
            raise GuestError(self.lost_reason or CLOSED_MESSAGE)
        if frame.type is FrameType.DATA:
            grant = self._in.consumed()
            if grant and not self.done:
                self._send(Frame(FrameType.CREDIT, self.sid, {"n": grant}))
        return frame

    async def expect_end(self) -> dict[str, Any]:
        """Wait for END and return its header; raise the mapped error on ERROR."""
        frame = await self.next()
        return self.result(frame)

    def result(self, frame: Frame) -> dict[str, Any]:
        if frame.type is FrameType.END:
            return frame.header
        raise self.unexpected(frame)

    def unexpected(self, frame: Frame, feature: str | None = None) -> Exception:
        """The error for a frame the request did not expect: the agent's ERROR mapped by
        the contract's table (``feature``: see ``error_from_wire``), else GuestError."""
        if frame.type is FrameType.ERROR:
            return error_from_wire(frame.header, feature)
        return GuestError(
            f"the guest agent broke protocol: unexpected {frame.type.name} on stream {self.sid}"
        )

    async def upload(self, data: bytes | AsyncIterable[bytes], channel: int = CHANNEL_DATA) -> None:
        """Send ``data`` as DATA frames within the credit window, then EOF.

        Stops quietly when the agent closed the stream (its END/ERROR explains why).
        """
        if isinstance(data, bytes | bytearray | memoryview):
            view = memoryview(data)
            for offset in range(0, len(view), CHUNK):
                if not await self._send_chunk(bytes(view[offset : offset + CHUNK]), channel):
                    return
        else:
            async for piece in data:
                view = memoryview(piece)
                for offset in range(0, len(view), CHUNK):
                    if not await self._send_chunk(bytes(view[offset : offset + CHUNK]), channel):
                        return
        if not self.done:
            self._send(Frame(FrameType.EOF, self.sid, channel=channel))

    async def _send_chunk(self, chunk: bytes, channel: int) -> bool:
        if not chunk:
            return not self.done
        while self._out.available <= 0 and not self.done:
            self._credit.clear()
            await self._credit.wait()
        if self.lost:
            raise GuestError(self.lost_reason or CLOSED_MESSAGE)
        if self.done:
            return False
        self._out.consume()
        self._send(Frame(FrameType.DATA, self.sid, payload=chunk, channel=channel))
        await self._drain()  # keep the socket buffer bounded when many streams upload
        return True
