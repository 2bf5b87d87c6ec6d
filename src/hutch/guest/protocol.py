"""Guest agent protocol v1: framing and flow control, sans-IO.

The host daemon and the guest agent (``guest_agent/hutch_agent/``, which mirrors this
module because it cannot import hutch) talk over one byte channel: a virtio-serial port
in the guest, a unix socket on the host (QEMU is the socket server). Everything below is
independent of how bytes move; :mod:`hutch.guest.client` does the I/O.

Frame layout (all integers big-endian)::

    offset size
     0      4   magic  b"\\x89HUT"
     4      1   type   (FrameType)
     5      1   channel: 0 = data/stdin, 1 = stdout, 2 = stderr (DATA and EOF only)
     6      2   reserved, 0
     8      4   stream id (chosen by the host; 0 = the connection itself: hello)
    12      4   header length H  (JSON object, UTF-8; 0 means {})
    16      4   payload length P (raw bytes)
    20      4   CRC-32 of bytes 0..19
    24      H   JSON header
    24+H    P   payload

A frame is at most ``MAX_FRAME`` (1 MiB) in total. The decoder searches for the magic and
checks the header CRC, so garbage in front of a frame (bytes left in QEMU's buffers by an
earlier connection, a half-written frame after a reconnect) is skipped and the stream
resynchronises on the next valid frame. An oversize length, an unknown type or a header
that is not a JSON object yields a :class:`FrameError` (reported back to the peer as an
ERROR frame) and never a crash.

Frame types:

========  ==========  =========================================================
REQUEST   host→agent  opens stream ``id``; header ``{"op": ..., args}``
REPLY     agent→host  intermediate event (exec ``started`` {pid}, read ``opened``)
DATA      both        payload bytes on ``channel``; consumes one credit
EOF       both        end of the channel (stdin closed, upload complete)
CREDIT    both        header ``{"n": k}``: the receiver consumed k DATA frames
END       agent→host  final result; closes the stream
ERROR     agent→host  ``{"code", "message"}``; closes the stream (id 0: frame error)
CANCEL    host→agent  the host abandons the stream; the agent stops sending on it
========  ==========  =========================================================

Handshake: the host sends REQUEST ``hello`` on stream 0 with ``{protocol: [major,
minor], nonce, time_ns, entropy (64 random bytes, base64)}``. In the VM the agent sets
its clock and credits the entropy to the kernel pool (the VMs have no RTC and clones of
one snapshot would share RNG state), then replies END on stream 0 with ``{protocol,
agent_version, nonce, kernel_release, hostname, pid}``. The host discards every frame
until the END carrying its nonce. A hello with a new nonce resets the agent's session
(every stream of the previous host is dropped); a repeated hello with the same nonce is
answered again without a reset, so the host may resend it while the guest boots.
Majors must match; minors only add optional fields.

Operations (REQUEST ``op``), and what the agent sends back:

- ``ping`` → END ``{}``.
- ``exec`` ``{argv | shell, env, cwd, user, stdin: bool, timeout_s}`` → REPLY
  ``{"event": "started", "pid"}`` or ERROR, then DATA on channels 1/2, then END
  ``{exit_code, signal, timed_out, duration_ms}``. With ``stdin`` true the host sends
  DATA on channel 0 and then EOF.
- ``signal`` ``{target: stream id, signal: n}`` → END ``{}`` (signals the process group).
- ``read`` ``{path}`` → REPLY ``{"event": "opened", "size"}``, DATA..., END ``{bytes}``.
- ``write`` ``{path, mode}`` then host DATA... EOF → END ``{entry}``. Written to a
  temporary file in the same directory and renamed into place at EOF, so a failed
  upload never leaves a partial file. Parents are created.
- ``list`` ``{path}`` → END ``{entries: [entry]}``; ``stat`` ``{path}`` → END
  ``{entry}``; ``mkdir`` ``{path, mode}`` → END ``{entry}`` (parents created);
  ``remove`` ``{path, recursive}`` → END ``{}``; ``rename`` ``{source, destination}``
  → END ``{entry}``.

- ``hello`` (stream 0) carries the guest's identity: ``hostname``, ``machine_id``,
  ``entropy``, ``time_ns``, ``net`` (``{address, gateway, dns}`` or null) and, only
  when the operator set ``HUTCH_GUEST_ASLR``, ``aslr: true`` (the agent turns
  address-space randomization back on, which it turns off under TCG at boot); the
  ``identity`` op carries the same fields.
- Background processes ``proc_start / proc_list / proc_get / proc_output / proc_stdin /
  proc_signal / proc_kill / proc_wait`` and terminals ``pty_open / pty_attach /
  pty_resize / pty_signal / pty_close / pty_list``: see
  ``guest_agent/hutch_agent/ops_process.py`` and ``ops_pty.py`` (their tables outlive a
  host session). File watch ``watch``, directory tars ``archive_read / archive_write``,
  interpreter contexts ``ctx_create / ctx_list / ctx_delete / ctx_run / ctx_interrupt /
  ctx_restart``: ``ops_watch.py``, ``ops_archive.py``, ``ops_contexts.py``.

An entry is ``{name, path, type: file|dir|symlink|other, size, mode, mtime}``.
Error codes: ``not_found exists not_a_directory is_a_directory not_empty conflict exited
permission_denied invalid_argument command_not_found unknown_operation io_error
internal``; what each becomes on the host is listed once in
:mod:`hutch.contract.agent_codes`.

Flow control: every stream has a window of ``WINDOW`` DATA frames (of at most ``CHUNK``
bytes) in each direction. A sender stops at zero credit; the receiver sends CREDIT as its
consumer takes frames. So neither side ever holds more than ``WINDOW * CHUNK`` bytes of
a stream, however large the file, and one slow stream never blocks the others.
"""

from __future__ import annotations

import enum
import json
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CHANNEL_DATA",
    "CHANNEL_STDERR",
    "CHANNEL_STDOUT",
    "CHUNK",
    "HEADER",
    "MAGIC",
    "MAX_FRAME",
    "PROTOCOL_VERSION",
    "WINDOW",
    "Decoder",
    "Frame",
    "FrameError",
    "FrameType",
    "ReceiveWindow",
    "SendWindow",
    "encode_frame",
]

PROTOCOL_VERSION: tuple[int, int] = (1, 0)
MAGIC = b"\x89HUT"
HEADER = struct.Struct(">4sBBHIIII")
_PREFIX = struct.Struct(">4sBBHIII")  # the CRC-covered part of HEADER
MAX_FRAME = 1 << 20
#: Largest DATA payload a sender puts in one frame, bytes.
CHUNK = 64 * 1024
#: DATA frames a sender may have unacknowledged per stream and direction.
WINDOW = 16
MAX_STREAM_ID = 0xFFFFFFFF

CHANNEL_DATA = 0
CHANNEL_STDOUT = 1
CHANNEL_STDERR = 2


class FrameType(enum.IntEnum):
    REQUEST = 1
    REPLY = 2
    DATA = 3
    EOF = 4
    CREDIT = 5
    END = 6
    ERROR = 7
    CANCEL = 8


@dataclass(frozen=True, slots=True)
class Frame:
    type: FrameType
    stream: int
    header: dict[str, Any] = field(default_factory=dict)
    payload: bytes = b""
    channel: int = CHANNEL_DATA


@dataclass(frozen=True, slots=True)
class FrameError:
    """A frame that could not be decoded. ``stream`` is None when its header was unusable."""

    stream: int | None
    message: str


def encode_frame(frame: Frame) -> bytes:
    """Serialise one frame. Raises ValueError if it would exceed ``MAX_FRAME``."""
    head = json.dumps(frame.header, separators=(",", ":")).encode() if frame.header else b""
    total = HEADER.size + len(head) + len(frame.payload)
    if total > MAX_FRAME:
        raise ValueError(f"frame of {total} bytes exceeds the {MAX_FRAME}-byte limit")
    if not 0 <= frame.stream <= MAX_STREAM_ID:
        raise ValueError(f"stream id {frame.stream} out of range")
    prefix = _PREFIX.pack(
        MAGIC, int(frame.type), frame.channel, 0, frame.stream, len(head), len(frame.payload)
    )
    return b"".join((prefix, struct.pack(">I", zlib.crc32(prefix)), head, frame.payload))


class Decoder:
    """Incremental frame decoder: ``feed(bytes) -> list[Frame]``.

    Problems found while decoding are collected and handed out by :meth:`pop_errors`;
    the decoder then resynchronises on the next magic. ``skipped`` counts garbage bytes.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._errors: list[FrameError] = []
        self.skipped = 0

    def reset(self) -> None:
        """Forget buffered bytes (the peer reconnected)."""
        self._buf.clear()

    @property
    def buffered(self) -> int:
        """Bytes held for an incomplete frame."""
        return len(self._buf)

    def pop_errors(self) -> list[FrameError]:
        errors, self._errors = self._errors, []
        return errors

    def feed(self, data: bytes) -> list[Frame]:
        self._buf += data
        frames: list[Frame] = []
        buf = self._buf
        pos = 0
        while True:
            start = buf.find(MAGIC, pos)
            if start < 0:
                # Keep a possible partial magic at the end; the rest is garbage.
                keep = max(pos, len(buf) - (len(MAGIC) - 1))
                self.skipped += keep - pos
                pos = keep
                break
            self.skipped += start - pos
            pos = start
            if len(buf) - pos < HEADER.size:
                break
            _magic, ftype, channel, _res, stream, hlen, plen, crc = HEADER.unpack_from(buf, pos)
            if zlib.crc32(buf[pos : pos + HEADER.size - 4]) != crc:
                # Not a frame start: a stray magic inside garbage. Skip one byte.
                pos += 1
                self.skipped += 1
                continue
            total = HEADER.size + hlen + plen
            if total > MAX_FRAME:
                self._errors.append(
                    FrameError(stream, f"frame of {total} bytes exceeds {MAX_FRAME}")
                )
                pos += 1
                self.skipped += 1
                continue
            if len(buf) - pos < total:
                break
            body = pos + HEADER.size
            head_bytes = bytes(buf[body : body + hlen])
            payload = bytes(buf[body + hlen : pos + total])
            pos += total
            try:
                kind = FrameType(ftype)
            except ValueError:
                self._errors.append(FrameError(stream, f"unknown frame type {ftype}"))
                continue
            header: Any = {}
            if hlen:
                try:
                    header = json.loads(head_bytes)
                except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                    self._errors.append(FrameError(stream, f"frame header is not JSON: {exc}"))
                    continue
                if not isinstance(header, dict):
                    self._errors.append(FrameError(stream, "frame header is not a JSON object"))
                    continue
            frames.append(Frame(kind, stream, header, payload, channel))
        del buf[:pos]
        return frames


class SendWindow:
    """Sender side of one stream direction: may send while ``available > 0``."""

    def __init__(self, initial: int = WINDOW) -> None:
        self.available = initial

    def consume(self) -> None:
        if self.available <= 0:
            raise RuntimeError("no send credit left; wait for CREDIT")
        self.available -= 1

    def grant(self, n: int) -> None:
        if n < 0:
            raise ValueError("credit grants are positive")
        self.available += n


class ReceiveWindow:
    """Receiver side: counts consumed frames and says when to send CREDIT.

    Credit goes back in batches of half the window, which halves the CREDIT traffic
    while the sender always keeps at least half a window in flight.
    """

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._pending = 0

    def consumed(self, n: int = 1) -> int:
        """Record ``n`` consumed frames; return the credit to grant now (0 = not yet)."""
        self._pending += n
        if self._pending >= max(1, self.window // 2):
            grant, self._pending = self._pending, 0
            return grant
        return 0
