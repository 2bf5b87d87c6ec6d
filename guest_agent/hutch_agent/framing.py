"""Frames of protocol v1 (mirror of ``hutch.guest.protocol``): encoder and sans-IO decoder."""

from __future__ import annotations

import json
import logging
import struct
import zlib
from typing import Any

log = logging.getLogger("hutch-agent")

# -- framing (mirror of hutch.guest.protocol) -----------------------------------------
MAGIC = b"\x89HUT"
HEADER = struct.Struct(">4sBBHIIII")
PREFIX = struct.Struct(">4sBBHIII")
MAX_FRAME = 1 << 20
CHUNK = 64 * 1024
WINDOW = 16
READ_SIZE = 64 * 1024  # the least room a read gets in the decoder's buffer, bytes
BULK_MIN = 8 * 1024  # a frame missing this many bytes is read in a tight loop
STALL_S = 3.0  # an incomplete frame pending this long, while bytes arrive, is suspect
REQUEST, REPLY, DATA, EOF, CREDIT, END, ERROR, CANCEL = range(1, 9)
STDOUT, STDERR = 1, 2


def encode(
    ftype: int,
    sid: int,
    header: dict[str, Any] | None = None,
    payload: bytes = b"",
    channel: int = 0,
) -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode() if header else b""
    prefix = PREFIX.pack(MAGIC, ftype, channel, 0, sid, len(head), len(payload))
    return b"".join((prefix, struct.pack(">I", zlib.crc32(prefix)), head, payload))


class Frame:
    __slots__ = ("channel", "header", "payload", "sid", "type")

    def __init__(
        self, ftype: int, sid: int, header: dict[str, Any], payload: bytes, channel: int
    ) -> None:
        self.type, self.sid, self.header, self.payload, self.channel = (
            ftype,
            sid,
            header,
            payload,
            channel,
        )


class Decoder:
    """Sans-IO decoder; resyncs on the magic. Errors are (stream id | None, message).

    It owns its receive buffer: a transport reads straight into :meth:`space` and calls
    :meth:`commit`; :meth:`feed` copies bytes in for callers that have them already. Why:
    the port hands over one 4 KiB page per read(), and growing and shrinking a bytearray
    by that much per read (plus the copy out of a throw-away read buffer) cost more than
    the read itself; under TCG that capped uploads at ~2.5 MB/s. ``need`` is how many
    buffered bytes the frame at the front needs, so the reads that only carry a frame's
    middle return at once without re-parsing its header.
    """

    def __init__(self) -> None:
        self.buf = bytearray(2 * READ_SIZE)
        self.view = memoryview(self.buf)
        self.start = 0  # first byte not yet parsed
        self.end = 0  # end of the bytes received
        self.need = 0
        self.errors: list[tuple[int | None, str]] = []

    @property
    def pending(self) -> int:
        """Bytes held for an incomplete frame."""
        return self.end - self.start

    def space(self, minimum: int = READ_SIZE) -> memoryview:
        """Free room after the received bytes, at least ``minimum`` bytes long."""
        if len(self.buf) - self.end < minimum:
            pending = self.end - self.start
            size = max(len(self.buf), pending + max(minimum, self.need - pending))
            if size > len(self.buf):
                # A new buffer (never a resize: views of the old one may be alive).
                buf = bytearray(size)
                buf[:pending] = self.view[self.start : self.end]
                self.buf, self.view = buf, memoryview(buf)
            else:
                self.view[:pending] = self.view[self.start : self.end]
            self.start, self.end = 0, pending
        return self.view[self.end :]

    def missing(self) -> int:
        """Bytes the frame at the front still lacks; 0 when none is under way."""
        return max(0, self.need - (self.end - self.start))

    def feed(self, data: bytes | memoryview) -> list[Frame]:
        n = len(data)
        self.space(n)[:n] = data
        return self.commit(n)

    def skip_to_hello(self) -> list[Frame] | None:
        """Drop a stalled incomplete frame if a hello header lies inside its bytes.

        Only a new host's greeting (a REQUEST on stream 0, resent every second) proves
        the frame at the front is the stale head of a connection we missed the end of;
        without one the host is merely slow and the frame is kept, never dropped (that
        would silently lose, say, 64 KiB of an upload). None: nothing was dropped.
        """
        buf, view, end = self.buf, self.view, self.end
        pos = self.start + 1
        while True:
            at = buf.find(MAGIC, pos, end)
            if at < 0 or end - at < HEADER.size:
                return None
            _m, ftype, _c, _r, sid, _h, _p, crc = HEADER.unpack_from(buf, at)
            is_hello = ftype == REQUEST and sid == 0
            if is_hello and zlib.crc32(view[at : at + HEADER.size - 4]) == crc:
                self.start, self.need = at, 0
                return self.commit(0)
            pos = at + 1

    def commit(self, n: int) -> list[Frame]:
        """``n`` bytes were written at the front of :meth:`space`; parse what is complete."""
        self.end += n
        end = self.end
        if end - self.start < self.need:
            return []
        self.need = 0
        buf, view = self.buf, self.view
        frames: list[Frame] = []
        pos = self.start
        while True:
            start = buf.find(MAGIC, pos, end)
            if start < 0:
                pos = max(pos, end - len(MAGIC) + 1)
                break
            pos = start
            if end - pos < HEADER.size:
                self.need = HEADER.size
                break
            _m, ftype, channel, _r, sid, hlen, plen, crc = HEADER.unpack_from(buf, pos)
            if zlib.crc32(view[pos : pos + HEADER.size - 4]) != crc:
                pos += 1
                continue
            total = HEADER.size + hlen + plen
            if total > MAX_FRAME:
                self.errors.append((sid, f"frame of {total} bytes exceeds {MAX_FRAME}"))
                pos += 1
                continue
            if end - pos < total:
                self.need = total
                break
            body = pos + HEADER.size
            head, payload = bytes(view[body : body + hlen]), bytes(view[body + hlen : pos + total])
            pos += total
            if not REQUEST <= ftype <= CANCEL:
                self.errors.append((sid, f"unknown frame type {ftype}"))
                continue
            try:
                header = json.loads(head) if hlen else {}
            except ValueError as exc:
                self.errors.append((sid, f"frame header is not JSON: {exc}"))
                continue
            if not isinstance(header, dict):
                self.errors.append((sid, "frame header is not a JSON object"))
                continue
            frames.append(Frame(ftype, sid, header, payload, channel))
        if pos >= end:
            self.start = self.end = 0
        else:
            self.start = pos
        return frames
