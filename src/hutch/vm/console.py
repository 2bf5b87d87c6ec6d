"""A VM's serial console: QEMU writes it into a pipe, and the daemon drains the pipe into
a size-capped log that rotates once (``console.log`` and the one before, ``console.log.1``).

Why a pipe: with QEMU's ``file`` chardev the log grows as long as the guest writes (a
guest writing to ``/dev/ttyS0`` in a loop fills the host's disk), and QEMU, which runs
as an unprivileged user under ``-sandbox``, cannot rotate anything. So QEMU gets
``-chardev pipe,path=<dir>/console``: it opens the FIFOs ``console.in`` (guest input;
nobody writes it) and ``console.out`` (guest output) **read-write**. Holding a read end
itself, QEMU never sees EPIPE, even while no daemon runs (VMs outlive the daemon):

- daemon up: a :class:`ConsolePump` on the event loop reads ``console.out`` as data
  comes and appends it to the log, rotating at ``max_bytes`` (so at most
  ``2 * max_bytes`` on disk per sandbox);
- daemon down: the pipe buffers up to :data:`PIPE_BYTES`; past that QEMU's serial port
  waits for room (the guest's console writes block, as on a serial line with flow
  control): nothing grows and nothing is lost. The next daemon adopts the VM, opens the
  FIFO again and drains what waited.

When QEMU exits the pump drains what is left before the exit is reported, so failure
messages built from :func:`console_tail` see the guest's last words.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import stat
from pathlib import Path

__all__ = [
    "DEFAULT_LOG_BYTES",
    "MIN_LOG_BYTES",
    "PIPE_BYTES",
    "ConsolePump",
    "RotatingLog",
    "console_fifo",
    "console_tail",
]

log = logging.getLogger(__name__)

#: Per log file; the previous one is kept as ``.1``.
DEFAULT_LOG_BYTES = 1 << 20
MIN_LOG_BYTES = 4096
#: Capacity asked for the console pipe (Linux' default pipe-max-size): what a running
#: guest can write while no daemon drains it before its console blocks.
PIPE_BYTES = 1 << 20
_READ = 64 * 1024
#: Reads per readable event: a chatty guest cannot hold the event loop for long.
_READS_PER_EVENT = 4
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def console_fifo(console_log: Path) -> Path:
    """The chardev ``path`` QEMU is given for ``console_log``: QEMU opens ``<it>.in`` and
    ``<it>.out``."""
    return console_log.with_name("console")


def _fifos(console_log: Path) -> tuple[Path, Path]:
    base = console_fifo(console_log)
    return base.with_name(base.name + ".in"), base.with_name(base.name + ".out")


def _is_fifo(path: Path) -> bool:
    try:
        return stat.S_ISFIFO(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def make_fifos(console_log: Path) -> None:
    """Create ``console.in`` and ``console.out`` (0600) unless they are FIFOs already
    (a restore reuses the ones of the QEMU before it)."""
    for fifo in _fifos(console_log):
        if not _is_fifo(fifo):
            with contextlib.suppress(FileNotFoundError):
                fifo.unlink()
            os.mkfifo(fifo, 0o600)


def console_tail(console_log: Path, max_bytes: int = 4096) -> str:
    """The last ``max_bytes`` of the console, across the rotation (``.1`` then current)."""
    chunks: list[bytes] = []
    want = max_bytes
    for path in (console_log, console_log.with_name(console_log.name + ".1")):
        if want <= 0:
            break
        try:
            with path.open("rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - want))
                data = f.read(want)
        except OSError:
            continue
        chunks.insert(0, data)
        want -= len(data)
    return b"".join(chunks).decode(errors="replace")


class RotatingLog:
    """Appends to ``path``; once it holds ``max_bytes`` it becomes ``path.1`` (replacing
    the one before) and a new ``path`` starts. At most ``2 * max_bytes`` on disk."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        if max_bytes < MIN_LOG_BYTES:
            raise ValueError(f"max_bytes={max_bytes}; at least {MIN_LOG_BYTES}")
        self.path = path
        self.previous = path.with_name(path.name + ".1")
        self.max_bytes = max_bytes
        self._fd = self._open()
        self._size = os.fstat(self._fd).st_size
        if self._size > max_bytes:
            # A log written before the cap existed (QEMU's file chardev): keep its end.
            os.close(self._fd)
            self._keep_tail()
            self._fd = self._open()
            self._size = os.fstat(self._fd).st_size

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def _keep_tail(self) -> None:
        with self.path.open("rb") as f:
            f.seek(-self.max_bytes, os.SEEK_END)
            tail = f.read()
        tmp = self.previous.with_name(self.previous.name + ".tmp")
        tmp.write_bytes(tail)
        os.replace(tmp, self.previous)
        self.path.unlink()

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            room = self.max_bytes - self._size
            if room <= 0:
                self.rotate()
                continue
            piece = view[:room]
            written = os.write(self._fd, piece)
            self._size += written
            view = view[written:]

    def rotate(self) -> None:
        os.close(self._fd)
        os.replace(self.path, self.previous)
        self._fd = self._open()
        self._size = 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class ConsolePump:
    """Drains one QEMU's ``console.out`` into its :class:`RotatingLog` on the event loop.

    Open it before QEMU starts (:meth:`for_launch`) or when adopting a running QEMU
    (:meth:`for_adopt`); :meth:`close` once QEMU has exited (it drains what is left).
    """

    def __init__(self, console_log: Path, max_bytes: int) -> None:
        _, out = _fifos(console_log)
        # Read-write: the daemon then never sees EOF or POLLHUP between QEMUs (before
        # one opens the FIFO, or after it exits), only data or EAGAIN.
        self._fd = os.open(out, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        with contextlib.suppress(OSError):
            fcntl.fcntl(self._fd, _F_SETPIPE_SZ, PIPE_BYTES)
        try:
            self.log = RotatingLog(console_log, max_bytes)
        except BaseException:
            os.close(self._fd)
            raise
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def for_launch(cls, console_log: Path, max_bytes: int) -> ConsolePump:
        """Create the FIFOs QEMU's ``-chardev pipe`` opens, and start draining."""
        make_fifos(console_log)
        pump = cls(console_log, max_bytes)
        pump.start()
        return pump

    @classmethod
    def for_adopt(cls, console_log: Path, max_bytes: int) -> ConsolePump | None:
        """Drain the console of a QEMU started by an earlier daemon; None when it has no
        console FIFO (a VM launched before the console was piped writes its file itself)."""
        if not _is_fifo(_fifos(console_log)[1]):
            return None
        pump = cls(console_log, max_bytes)
        pump.start()
        return pump

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._on_readable)

    def _on_readable(self) -> None:
        try:
            for _ in range(_READS_PER_EVENT):
                if not self._read_once():
                    break
        except OSError as exc:  # the log's disk is full or gone: stop, never crash the loop
            log.warning("console of %s: %s; no longer logged", self.log.path, exc)
            self._stop_reading()

    def _read_once(self) -> bool:
        """Move one chunk from the pipe to the log; False when the pipe is empty."""
        try:
            data = os.read(self._fd, _READ)
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno == errno.EINTR:
                return True
            raise
        if not data:
            return False
        self.log.write(data)
        return True

    def drain(self) -> None:
        """Move everything the pipe holds now to the log."""
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            while self._read_once():
                pass

    def _stop_reading(self) -> None:
        if self._loop is not None and self._fd >= 0:
            with contextlib.suppress(ValueError, RuntimeError):
                self._loop.remove_reader(self._fd)
        self._loop = None

    def close(self) -> None:
        """Drain what is left, then stop. Idempotent."""
        if self._fd < 0:
            return
        self.drain()
        self._stop_reading()
        os.close(self._fd)
        self._fd = -1
        self.log.close()
