"""The serial console path on the host (hutch.vm.console), with real FIFOs: a writer
standing in for QEMU (it opens ``console.out`` read-write, as ``-chardev pipe`` does)
and the daemon's pump. The same path with a real guest: tests/e2e/test_console_log.py."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from hutch.vm.console import (
    PIPE_BYTES,
    ConsolePump,
    RotatingLog,
    console_fifo,
    console_tail,
)

CAP = 64 * 1024


def _qemu_end(console_log: Path) -> int:
    """What QEMU holds: console.out opened read-write, non-blocking."""
    out = console_fifo(console_log).with_name("console.out")
    return os.open(out, os.O_RDWR | os.O_NONBLOCK)


def _on_disk(console_log: Path) -> int:
    return sum(
        p.stat().st_size
        for p in (console_log, console_log.with_name("console.log.1"))
        if p.exists()
    )


def test_rotating_log_keeps_at_most_two_files_of_the_cap(tmp_path: Path) -> None:
    path = tmp_path / "console.log"
    log = RotatingLog(path, CAP)
    written = b"".join(f"line {i:06d}\n".encode() for i in range(40_000))  # ~480 KiB
    for start in range(0, len(written), 5000):
        log.write(written[start : start + 5000])
    log.close()
    assert path.stat().st_size <= CAP
    assert (tmp_path / "console.log.1").stat().st_size == CAP
    # What is kept is the newest output, in order, across the rotation.
    kept = (tmp_path / "console.log.1").read_bytes() + path.read_bytes()
    assert written.endswith(kept)
    assert console_tail(path, 3000).encode() == written[-3000:]
    assert console_tail(path, 10 * CAP).encode() == kept


def test_an_oversized_log_from_before_the_cap_is_cut_to_its_tail(tmp_path: Path) -> None:
    path = tmp_path / "console.log"
    old = os.urandom(5 * CAP)
    path.write_bytes(old)
    RotatingLog(path, CAP).close()
    assert _on_disk(path) == CAP
    assert (tmp_path / "console.log.1").read_bytes() == old[-CAP:]


async def test_pump_drains_the_fifo_into_the_capped_log(tmp_path: Path) -> None:
    path = tmp_path / "console.log"
    pump = ConsolePump.for_launch(path, CAP)
    for name in ("console.in", "console.out"):
        assert stat.S_ISFIFO(os.lstat(tmp_path / name).st_mode)
        assert stat.S_IMODE(os.lstat(tmp_path / name).st_mode) == 0o600
    fd = _qemu_end(path)
    sent = bytearray()
    try:
        for i in range(3000):  # ~3 MiB, far more than the pipe holds
            chunk = f"{i:05d} ".encode() * 170 + b"\n"
            view = memoryview(chunk)
            while view:
                try:
                    view = view[os.write(fd, view) :]
                except BlockingIOError:
                    await asyncio.sleep(0.001)  # the pump runs
            sent += chunk
        os.write(fd, b"LAST-WORDS\n")
        sent += b"LAST-WORDS\n"
    finally:
        os.close(fd)  # "QEMU exits"
    pump.close()  # drains what is left
    assert _on_disk(path) <= 2 * CAP
    assert console_tail(path, 200).endswith("LAST-WORDS\n")
    assert bytes(sent).endswith((tmp_path / "console.log.1").read_bytes() + path.read_bytes())
    pump.close()  # idempotent


async def test_with_no_daemon_the_pipe_holds_output_and_writes_never_fail(
    tmp_path: Path,
) -> None:
    """While hutchd is down nobody drains: QEMU's writes stop with EAGAIN once the pipe is
    full (its serial port then waits), never EPIPE; the next daemon gets all of it."""
    path = tmp_path / "console.log"
    ConsolePump.for_launch(path, CAP).close()  # a daemon that ran, then went away
    fd = _qemu_end(path)
    try:
        os.write(fd, b"x")  # opens nothing: QEMU's own read end keeps the pipe alive
        # The next daemon's pump sizes the pipe; it then stands for the minutes the
        # daemon is down while the guest keeps writing.
        pump = ConsolePump.for_adopt(path, 2 * PIPE_BYTES)
        assert pump is not None
        pump._stop_reading()
        buffered = 1
        with pytest.raises(BlockingIOError):
            while True:
                buffered += os.write(fd, b"y" * 4096)
        assert buffered >= PIPE_BYTES - 4096
        pump.start()
        await asyncio.sleep(0.05)
        pump.close()
    finally:
        os.close(fd)
    kept = path.read_bytes()
    assert len(kept) == buffered and kept == b"x" + b"y" * (buffered - 1)


def test_adopting_a_vm_without_a_console_fifo_pumps_nothing(tmp_path: Path) -> None:
    # Launched before the console was piped: QEMU writes console.log itself.
    assert ConsolePump.for_adopt(tmp_path / "console.log", CAP) is None
