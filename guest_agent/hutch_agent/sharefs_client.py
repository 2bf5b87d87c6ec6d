"""The guest side of a shared volume's channel: sends ``sharefs_wire`` requests on the
volume's virtio-serial port and waits for each reply.

One request at a time (the FUSE loop that calls this is sequential). The host end may go
away and come back (a memory-mode pause and resume, a fork child, a daemon restart):
QEMU then drops what it was sending, and every new host session starts with a
``HELLO``. Seeing one while it waits, the client sends the request again (the session
answers a repeat it has served from its saved reply), so the caller just waits longer.
Handles the old session gave out are EBADF in the new one: the filesystem layer reopens
them (``fuse_fs``). Nothing here times out: like an NFS hard mount, a call waits as long
as the host is away.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import threading
import time

from hutch_agent.sharefs_wire import (
    HELLO_ID,
    FrameDecoder,
    Op,
    Oversize,
    decode_reply,
    encode_request,
)

log = logging.getLogger("hutch-agent")

_IDLE_S = 0.05  # while no host is connected, poll() gives POLLHUP at once: sleep instead
#: A reply whose bytes stop this long is given up on (FrameDecoder.resync) and the
#: request sent again: the host writes each reply whole, so such a gap means the frame
#: was cut by a reconnect (or its magic was data). Giving up too early costs one repeat,
#: which the session answers from its saved reply.
STALL_S = 0.5


class RemoteError(OSError):
    """The host answered a request with an errno."""


class ShareFsClient:
    """Calls on one channel (``fd``: the port, opened read-write; a socket in tests)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        # The host never sends an oversize frame: such a header is garbage to skip.
        self._decoder = FrameDecoder(discard_oversize=False)
        self._next_id = 0
        self._lock = threading.Lock()
        #: Incremented on every HELLO: how many host sessions this channel has seen.
        self.sessions = 0

    def _new_id(self) -> int:
        self._next_id = self._next_id % 0xFFFFFFFF + 1  # never HELLO_ID (0)
        return self._next_id

    def call(self, op: Op, *args: object) -> tuple[object, ...]:
        """Send one request and return its results; ``RemoteError`` for an errno reply."""
        with self._lock:
            req_id = self._new_id()
            request = encode_request(req_id, op, *args)
            self._send(request)
            while True:
                frames, stalled = self._receive()
                if stalled:
                    # A reply cut short (or a magic inside data) stalled the decoder:
                    # whatever the reply was, it is lost; ask again (a session that
                    # served it answers from its saved reply).
                    self._send(request)
                for body in frames:
                    if isinstance(body, Oversize):
                        continue
                    rid = int.from_bytes(body[:4], "little")
                    if rid == HELLO_ID:
                        self.sessions += 1
                        log.info("sharefs: new host session; sending request %d again", req_id)
                        self._send(request)
                        continue
                    if rid != req_id:
                        continue  # an old session's late reply
                    try:
                        _, err, results = decode_reply(op, body)
                    except ValueError:
                        raise RemoteError(errno.EPROTO, f"malformed {op.name} reply") from None
                    if err:
                        raise RemoteError(err, os.strerror(err))
                    return results

    def _send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.fd, view) :]
            except InterruptedError:
                continue
            except OSError as exc:
                # No host now: the request is lost, and sent again at the next HELLO.
                log.info("sharefs: send failed (%s); waiting for the host", exc)
                return

    def _receive(self) -> tuple[list[bytes | Oversize], bool]:
        """The frames that arrive next (waits for at least some bytes), and whether a
        stalled partial frame was given up on."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while True:
            events = poller.poll(int(STALL_S * 1000) if self._decoder.pending else None)
            if not events:
                return self._decoder.resync(), True
            readable = any(ev & select.POLLIN for _, ev in events)
            if not readable:
                time.sleep(_IDLE_S)  # POLLHUP: the host is away
                continue
            try:
                data = os.read(self.fd, 65536)
            except (InterruptedError, BlockingIOError):
                continue
            except OSError as exc:
                log.info("sharefs: read failed: %s", exc)
                time.sleep(_IDLE_S)
                continue
            if not data:
                time.sleep(_IDLE_S)
                continue
            return self._decoder.feed(data), False
