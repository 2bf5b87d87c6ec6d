"""The byte pipes the agent serves: the virtio-serial port, or a unix socket in tests."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import socket
import threading
import time

from hutch_agent import PORT_NAME
from hutch_agent.framing import STALL_S, Decoder

log = logging.getLogger("hutch-agent")


class DeviceTransport:
    """The virtio-serial port. read() gives b"" at once while no host is connected."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self.lock = threading.Lock()

    def read_into(self, room: memoryview) -> int:
        """Read into ``room``; 0 while no host is connected (or the read failed)."""
        try:
            return os.readv(self.fd, [room])
        except OSError as exc:
            log.warning("read from the port failed: %s", exc)
            return 0

    def idle(self) -> None:
        time.sleep(0.05)  # no host: poll() gives POLLHUP, so sleep instead of spinning

    def write(self, data: bytes) -> None:
        # Caller holds self.lock. The port takes at most 32 KiB per write, so loop.
        # While the host is away a write blocks until it returns; errors drop the frame.
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as exc:
            log.info("dropped a frame: %s", exc)


class UnixTransport:
    """Test transport: a listening unix socket, one connection at a time."""

    def __init__(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        os.chmod(path, 0o600)
        self.server.listen(1)
        self.conn: socket.socket | None = None
        self.lock = threading.Lock()

    def read_into(self, room: memoryview) -> int:
        """Read into ``room``; 0 once the connection closed (the next call accepts)."""
        if self.conn is None:
            conn, _ = self.server.accept()
            with self.lock:
                self.conn = conn
        try:
            n = self.conn.recv_into(room)
        except OSError:
            n = 0
        if not n:
            with self.lock:  # no writer is inside sendall on this socket now
                with contextlib.suppress(OSError):
                    self.conn.shutdown(socket.SHUT_RDWR)
                self.conn.close()
                self.conn = None
        return n

    def idle(self) -> None:
        pass

    def write(self, data: bytes) -> None:
        if self.conn is None:
            return
        try:
            self.conn.sendall(data)
        except OSError as exc:
            log.info("dropped a frame: %s", exc)


def find_port(name: str = PORT_NAME) -> str:
    """Wait for the virtio-serial port named ``name``; return its /dev path."""
    warned = False
    while True:
        for name_file in sorted(glob.glob("/sys/class/virtio-ports/*/name")):
            try:
                with open(name_file) as f:
                    found = f.read().strip()
            except OSError:
                continue
            if found == name:
                return "/dev/" + os.path.basename(os.path.dirname(name_file))
        if not warned:
            log.warning("virtio-serial port %s not found yet; waiting", name)
            warned = True
        time.sleep(0.5)


def fill(transport: DeviceTransport | UnixTransport, decoder: Decoder, size: int) -> int:
    """Read ``size`` bytes into the decoder's free room, or fewer if the connection ends
    or STALL_S passes first (so the caller can look for a stale frame); return how
    many (the caller commits them)."""
    room = decoder.space(size)[:size]
    read_into = transport.read_into
    deadline = time.monotonic() + STALL_S
    got = 0
    while got < size:
        n = read_into(room[got:])
        got += n
        if not n or time.monotonic() > deadline:
            break
    return got
