"""Shared-volume file protocol v1: framing and message codec, sans-IO.

A shared volume is served by hutchd to every sandbox that mounts it (ARCHITECTURE
"Volumes"); the guest side (FUSE in the agent) turns kernel requests into these messages
over a byte channel of its own. Every byte here comes from a guest and is hostile: the
decoder bounds what it buffers, never raises on input, and turns anything malformed into
an errno reply (:class:`Malformed`) or a skipped frame, so the server keeps serving.

Frame layout (integers little-endian)::

    offset size
     0      4   magic b"HSF1"
     4      4   body length L (at most MAX_FRAME)
     8      4   CRC-32 of the body
    12      L   body

The CRC is what lets a reader find its way again after a reconnect cut a frame short:
without it, the next session's bytes would complete the cut frame and be taken for its
end. A frame whose CRC does not match is skipped like garbage.

Request body: ``u32 request id, u16 op`` then the op's arguments (:data:`REQUESTS`).
Reply body: ``u32 request id, i32 errno`` (0 = success) then, on success only, the
op's results (:data:`REPLIES`). Argument kinds: ``p`` a path or name (u16 length, bytes),
``b`` bytes (u32 length, at most MAX_IO), ``I`` u32, ``Q`` u64, ``q`` i64, ``A`` an
attribute record (:data:`ATTR`), ``D`` directory entries (u32 count, then ``Q next
offset, Q inode, I mode, p name`` each).

Every new connection starts with the server's :data:`HELLO` (a reply to request id 0,
which no request uses): a guest that was waiting for a reply when the channel went away
(a pause, a fork child, a daemon restart) sends that request again on seeing it, and a
session answers a repeat of the last request id it served from its saved reply instead
of running it twice.

Garbage before a magic (bytes left in QEMU's buffers across a reconnect) is skipped; an
oversize length yields :class:`Oversize` with the request id when it can be read (the
server answers EMSGSIZE) and the frame's bytes are discarded as they arrive, never
buffered.
"""

from __future__ import annotations

import binascii
import errno
import struct
from dataclasses import dataclass
from enum import IntEnum

__all__ = [
    "ATTR",
    "HELLO",
    "HELLO_ID",
    "MAGIC",
    "MAX_DIR_ENTRIES",
    "MAX_FRAME",
    "MAX_IO",
    "MAX_NAME",
    "MAX_PATH",
    "REPLIES",
    "REQUESTS",
    "Attr",
    "DirEntry",
    "FrameDecoder",
    "Malformed",
    "Op",
    "Oversize",
    "Request",
    "decode_reply",
    "decode_request",
    "encode_reply",
    "encode_request",
    "frame",
]

MAGIC = b"HSF1"
#: The largest read or write in one message: FUSE's default max_read/max_write.
MAX_IO = 128 * 1024
#: Linux's PATH_MAX and NAME_MAX: a longer path or name is ENAMETOOLONG.
MAX_PATH = 4096
MAX_NAME = 255
#: A body holds at most one I/O buffer plus two paths and fixed fields.
MAX_FRAME = MAX_IO + 2 * MAX_PATH + 256
#: A READDIR page holds at most this many entries (the server also stops at MAX_IO bytes).
MAX_DIR_ENTRIES = 256
_HEAD = struct.Struct("<4sII")
_REQ = struct.Struct("<IH")
_REP = struct.Struct("<Ii")
#: The request id no request uses: a reply to it is the server's :data:`HELLO`.
HELLO_ID = 0


class Op(IntEnum):
    STAT = 1
    READDIR = 2
    OPEN = 3
    CREATE = 4
    READ = 5
    WRITE = 6
    RELEASE = 7
    FSYNC = 8
    MKDIR = 9
    UNLINK = 10
    RMDIR = 11
    RENAME = 12
    SYMLINK = 13
    READLINK = 14
    LINK = 15
    SETATTR = 16
    STATFS = 17


#: Arguments of each request, in order (kinds as in the module docstring).
REQUESTS: dict[Op, str] = {
    Op.STAT: "p",  # path
    Op.READDIR: "pQ",  # path, offset (opaque cookie from the previous page; 0 = start)
    Op.OPEN: "pI",  # path, open flags (only access mode, O_APPEND, O_TRUNC, O_*SYNC kept)
    Op.CREATE: "pII",  # path, open flags, mode
    Op.READ: "QQI",  # handle, offset, size (<= MAX_IO)
    Op.WRITE: "QQb",  # handle, offset, data
    Op.RELEASE: "Q",  # handle
    Op.FSYNC: "QI",  # handle, datasync (0/1)
    Op.MKDIR: "pI",  # path, mode
    Op.UNLINK: "p",
    Op.RMDIR: "p",
    Op.RENAME: "ppI",  # old path, new path, flags (0 only)
    Op.SYMLINK: "bp",  # target (stored as text, never followed by the host), path
    Op.READLINK: "p",
    Op.LINK: "pp",  # existing path, new path
    # path, valid bits (SET_*), mode, size, atime ns, mtime ns
    Op.SETATTR: "pIIQqq",
    Op.STATFS: "",
}
#: Results of each successful reply.
REPLIES: dict[Op, str] = {
    Op.STAT: "A",
    Op.READDIR: "D",
    Op.OPEN: "Q",  # handle
    Op.CREATE: "QA",  # handle, attributes of the file
    Op.READ: "b",
    Op.WRITE: "I",  # bytes written
    Op.RELEASE: "",
    Op.FSYNC: "",
    Op.MKDIR: "A",
    Op.UNLINK: "",
    Op.RMDIR: "",
    Op.RENAME: "",
    Op.SYMLINK: "A",
    Op.READLINK: "b",
    Op.LINK: "A",
    Op.SETATTR: "A",
    # block size, blocks, blocks free, blocks available, files, files free, name max
    Op.STATFS: "QQQQQQQ",
}


@dataclass(frozen=True)
class Attr:
    """What ``lstat`` says of one file; times in nanoseconds since the epoch."""

    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    blocks: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int


ATTR = struct.Struct("<QIIIIQQqqq")


@dataclass(frozen=True)
class DirEntry:
    next_offset: int
    ino: int
    mode: int
    name: bytes


@dataclass(frozen=True)
class Request:
    req_id: int
    op: Op
    args: tuple[object, ...]


@dataclass(frozen=True)
class Malformed:
    """A frame whose body does not parse; ``errno`` is what to answer (EPROTO, EINVAL,
    ENAMETOOLONG, ENOSYS for an unknown op)."""

    req_id: int
    errno: int
    reason: str


@dataclass(frozen=True)
class Oversize:
    """A frame longer than MAX_FRAME; its bytes are discarded (``req_id`` -1 when the
    length arrived but not the id)."""

    req_id: int
    length: int


class _Short(Exception):
    """The body ended inside a field."""


class _Bad(Exception):
    def __init__(self, err: int, reason: str) -> None:
        super().__init__(reason)
        self.errno = err
        self.reason = reason


_FIXED = {"I": struct.Struct("<I"), "Q": struct.Struct("<Q"), "q": struct.Struct("<q")}


def _check_path(raw: bytes) -> None:
    """A path is relative to the volume's root: b"" is the root, else names joined by
    "/"; no empty, "." or ".." name, no NUL. The server's resolver checks it again."""
    if len(raw) > MAX_PATH:
        raise _Bad(errno.ENAMETOOLONG, "path longer than PATH_MAX")
    if raw == b"":
        return
    if b"\0" in raw:
        raise _Bad(errno.EINVAL, "NUL in a path")
    for name in raw.split(b"/"):
        if name in (b"", b".", b".."):
            raise _Bad(
                errno.EINVAL, f"path name {name!r} not allowed (no '/' first, '.', '..', '//')"
            )
        if len(name) > MAX_NAME:
            raise _Bad(errno.ENAMETOOLONG, "a name longer than NAME_MAX")


def _decode_fields(kinds: str, body: bytes, pos: int) -> tuple[tuple[object, ...], int]:
    out: list[object] = []
    for kind in kinds:
        if kind in _FIXED:
            s = _FIXED[kind]
            if pos + s.size > len(body):
                raise _Short()
            out.append(s.unpack_from(body, pos)[0])
            pos += s.size
        elif kind == "p" or kind == "b":
            width, limit = (2, MAX_PATH) if kind == "p" else (4, MAX_IO)
            if pos + width > len(body):
                raise _Short()
            n = int.from_bytes(body[pos : pos + width], "little")
            pos += width
            if n > limit:
                raise _Bad(
                    errno.ENAMETOOLONG if kind == "p" else errno.EINVAL, f"field of {n} bytes"
                )
            if pos + n > len(body):
                raise _Short()
            raw = bytes(body[pos : pos + n])
            pos += n
            if kind == "p":
                _check_path(raw)
            out.append(raw)
        elif kind == "A":
            if pos + ATTR.size > len(body):
                raise _Short()
            out.append(Attr(*ATTR.unpack_from(body, pos)))
            pos += ATTR.size
        elif kind == "D":
            if pos + 4 > len(body):
                raise _Short()
            count = int.from_bytes(body[pos : pos + 4], "little")
            pos += 4
            if count > MAX_DIR_ENTRIES:
                raise _Bad(errno.EPROTO, f"{count} directory entries in one reply")
            items: list[DirEntry] = []
            for _ in range(count):
                (off, ino, mode, name), pos = _decode_fields("QQIp", body, pos)
                assert isinstance(off, int) and isinstance(ino, int)
                assert isinstance(mode, int) and isinstance(name, bytes)
                items.append(DirEntry(off, ino, mode, name))
            out.append(tuple(items))
        else:  # pragma: no cover - the tables above use only these kinds
            raise AssertionError(kind)
    return tuple(out), pos


def _encode_fields(kinds: str, values: tuple[object, ...]) -> bytes:
    if len(kinds) != len(values):
        raise ValueError(f"{len(kinds)} fields expected, {len(values)} given")
    parts: list[bytes] = []
    for kind, value in zip(kinds, values, strict=True):
        if kind in _FIXED:
            parts.append(_FIXED[kind].pack(value))
        elif kind == "p":
            assert isinstance(value, bytes)
            parts.append(len(value).to_bytes(2, "little") + value)
        elif kind == "b":
            assert isinstance(value, bytes)
            parts.append(len(value).to_bytes(4, "little") + value)
        elif kind == "A":
            assert isinstance(value, Attr)
            v = value
            parts.append(
                ATTR.pack(
                    v.ino,
                    v.mode,
                    v.nlink,
                    v.uid,
                    v.gid,
                    v.size,
                    v.blocks,
                    v.atime_ns,
                    v.mtime_ns,
                    v.ctime_ns,
                )
            )
        elif kind == "D":
            assert isinstance(value, tuple)
            parts.append(len(value).to_bytes(4, "little"))
            for e in value:
                assert isinstance(e, DirEntry)
                parts.append(_encode_fields("QQIp", (e.next_offset, e.ino, e.mode, e.name)))
        else:  # pragma: no cover
            raise AssertionError(kind)
    return b"".join(parts)


def frame(body: bytes) -> bytes:
    if len(body) > MAX_FRAME:
        raise ValueError(f"frame body of {len(body)} bytes exceeds {MAX_FRAME}")
    return _HEAD.pack(MAGIC, len(body), binascii.crc32(body)) + body


#: What a server sends first on every connection (see the module docstring).
HELLO = frame(_REP.pack(HELLO_ID, 0))


def encode_request(req_id: int, op: Op, *args: object) -> bytes:
    """One framed request (used by the guest side and by tests)."""
    return frame(_REQ.pack(req_id, op) + _encode_fields(REQUESTS[op], args))


def encode_reply(req_id: int, op: Op | None, err: int, *results: object) -> bytes:
    """One framed reply: results only when ``err`` is 0 (``op`` may be None then)."""
    if err:
        return frame(_REP.pack(req_id, err))
    assert op is not None
    return frame(_REP.pack(req_id, 0) + _encode_fields(REPLIES[op], results))


def decode_request(body: bytes) -> Request | Malformed:
    """Parse one request body; never raises."""
    if len(body) < _REQ.size:
        return Malformed(-1, errno.EPROTO, "request shorter than its header")
    req_id, raw_op = _REQ.unpack_from(body, 0)
    try:
        op = Op(raw_op)
    except ValueError:
        return Malformed(req_id, errno.ENOSYS, f"unknown op {raw_op}")
    try:
        args, end = _decode_fields(REQUESTS[op], body, _REQ.size)
    except _Short:
        return Malformed(req_id, errno.EPROTO, f"{op.name}: body ends inside a field")
    except _Bad as exc:
        return Malformed(req_id, exc.errno, f"{op.name}: {exc.reason}")
    if end != len(body):
        return Malformed(
            req_id, errno.EPROTO, f"{op.name}: {len(body) - end} bytes after the last field"
        )
    return Request(req_id, op, args)


def decode_reply(op: Op, body: bytes) -> tuple[int, int, tuple[object, ...]]:
    """Parse a reply body for ``op`` -> (request id, errno, results); raises ValueError
    on a malformed reply (the guest side's concern: the host is trusted there)."""
    if len(body) < _REP.size:
        raise ValueError("reply shorter than its header")
    req_id, err = _REP.unpack_from(body, 0)
    if err:
        return req_id, err, ()
    try:
        results, end = _decode_fields(REPLIES[op], body, _REP.size)
    except (_Short, _Bad) as exc:
        raise ValueError(f"malformed {op.name} reply") from exc
    if end != len(body):
        raise ValueError(f"{op.name} reply: trailing bytes")
    return req_id, err, results


class FrameDecoder:
    """Split a byte stream into frame bodies. Buffers at most one frame (MAX_FRAME plus
    its header); skips garbage before a magic and a frame whose CRC does not match (it
    scans on from the byte after that magic, so a frame inside the bad one is found).

    ``discard_oversize`` (the server): a frame longer than MAX_FRAME yields
    :class:`Oversize` and its bytes are dropped as they stream past, never buffered.
    False (the guest, whose server never sends one): such a header is garbage, skipped
    like any other. :meth:`resync` gives up on a partial frame that stalled."""

    def __init__(self, *, discard_oversize: bool = True) -> None:
        self._buf = bytearray()
        self._discard = 0  # bytes of an oversize frame still to drop
        self._discard_oversize = discard_oversize
        self.skipped = 0  # garbage bytes dropped while looking for a magic (for logs)

    @property
    def pending(self) -> bool:
        """Whether a frame has begun (its magic is buffered) but not ended."""
        return self._buf.startswith(MAGIC)

    def resync(self) -> list[bytes | Oversize]:
        """Give up on the partial frame buffered (its magic may have been data, or its
        end was lost across a reconnect) and scan on from its second byte."""
        if self._buf:
            self.skipped += 1
            del self._buf[:1]
        return self.feed(b"")

    def feed(self, data: bytes) -> list[bytes | Oversize]:
        out: list[bytes | Oversize] = []
        if self._discard:
            drop = min(self._discard, len(data))
            self._discard -= drop
            data = data[drop:]
        self._buf += data
        while True:
            if self._discard:
                drop = min(self._discard, len(self._buf))
                self._discard -= drop
                del self._buf[:drop]
                if self._discard:
                    return out
            at = self._buf.find(MAGIC)
            if at < 0:
                # Keep a tail that may be the start of a magic; the rest is garbage.
                keep = len(MAGIC) - 1
                if len(self._buf) > keep:
                    self.skipped += len(self._buf) - keep
                    del self._buf[: len(self._buf) - keep]
                return out
            if at:
                self.skipped += at
                del self._buf[:at]
            if len(self._buf) < _HEAD.size:
                return out
            _, length, crc = _HEAD.unpack_from(self._buf, 0)
            if length > MAX_FRAME:
                if not self._discard_oversize:
                    self.skipped += 1
                    del self._buf[:1]
                    continue
                have = self._buf[_HEAD.size : _HEAD.size + 4]
                req_id = int.from_bytes(have, "little") if len(have) == 4 else -1
                out.append(Oversize(req_id, length))
                del self._buf[: _HEAD.size]
                self._discard = length
                continue
            if len(self._buf) < _HEAD.size + length:
                return out
            body = bytes(self._buf[_HEAD.size : _HEAD.size + length])
            if binascii.crc32(body) != crc:
                # Not a frame (a magic inside data, or a frame cut by a reconnect).
                self.skipped += 1
                del self._buf[:1]
                continue
            out.append(body)
            del self._buf[: _HEAD.size + length]
