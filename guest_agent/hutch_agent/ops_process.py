"""Background processes: started detached, listed, output kept in a bounded buffer, stdin,
signals.

The process table is module state, not session state: ``Agent.reset_session`` (the host
went away: a daemon restart, a memory pause and resume) cancels the *streams* that were
reading a process, never the process. Output keeps going into the process's ring while no
one reads it, and a later ``proc_output`` picks it up by offset.

Ops (all take ``pid``, the process's pid in the guest, except start and list):

- ``proc_start`` {argv | shell, env, cwd, user, stdin: bool, timeout_s} → END {process}
- ``proc_list`` → END {processes}; ``proc_get`` → END {process}
- ``proc_output`` {offset, follow} → DATA (channel 1/2, header {offset}) ... END
  {next_offset, process}. Offsets count the bytes of stdout and stderr together, in the
  order they were read; the ring keeps the newest ``OUTPUT_LIMIT`` bytes, so a frame's
  offset may jump past what was dropped (``process.dropped_bytes`` says how much).
- ``proc_stdin`` {eof} + host DATA ... EOF → END {written, process}
- ``proc_signal`` {signal} → END {}; ``proc_kill`` → END {process} (SIGKILL, waits)
- ``proc_wait`` {timeout_s} → END {process} (running still, if the wait timed out)

Error code ``exited``: the process has already exited (the host maps it to a conflict).
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import Any

from hutch_agent.errors import AgentError
from hutch_agent.framing import CHUNK, DATA
from hutch_agent.ops import Op
from hutch_agent.spawn import popen, spawn_args, watch_output
from hutch_agent.streams import Cancelled, Stream

#: Output kept per process (stdout and stderr together), bytes.
OUTPUT_LIMIT = 2 << 20
#: Exited processes kept for inspection (each with its output); the oldest go first.
MAX_EXITED = 16
MAX_RUNNING = 512
#: How often a waiting reader looks at its stream (a host that went away), seconds.
POLL_S = 0.25
KILL_WAIT_S = 5.0


class OutputRing:
    """The newest ``limit`` bytes of a byte stream, as [offset, channel, bytes] chunks.

    ``start`` is the offset of the first byte still held (= bytes dropped); ``end`` the
    total produced. ``cond`` is also the owner's state lock, so "no new output and the
    producer is finished" is one atomic check. Small writes of one channel are merged
    into the last chunk (up to ``CHUNK``): a program printing a byte at a time must not
    cost a list entry per byte.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.chunks: collections.deque[tuple[int, int, bytearray]] = collections.deque()
        self.start = 0
        self.end = 0
        self.cond = threading.Condition()

    def append(self, channel: int, data: bytes) -> None:
        with self.cond:
            last = self.chunks[-1] if self.chunks else None
            if last is not None and last[1] == channel and len(last[2]) + len(data) <= CHUNK:
                last[2].extend(data)
            else:
                self.chunks.append((self.end, channel, bytearray(data)))
            self.end += len(data)
            while self.end - self.start > self.limit:
                offset, ch, chunk = self.chunks[0]
                excess = self.end - self.start - self.limit
                if excess >= len(chunk):
                    self.chunks.popleft()
                    self.start = offset + len(chunk)
                else:
                    del chunk[:excess]
                    self.chunks[0] = (offset + excess, ch, chunk)
                    self.start = offset + excess
            self.cond.notify_all()

    def read_from(self, offset: int) -> list[tuple[int, int, bytes]]:
        """Copies of the bytes at or after ``offset`` (call with ``cond`` held)."""
        out: list[tuple[int, int, bytes]] = []
        for start, ch, chunk in self.chunks:
            end = start + len(chunk)
            if end <= offset:
                continue
            skip = max(0, offset - start)
            out.append((start + skip, ch, bytes(chunk[skip:])))
        return out


def stream_ring(
    st: Stream,
    ring: OutputRing,
    offset: int,
    follow: bool,
    finished: Any,
    still_mine: Any = None,
) -> tuple[int, bool]:
    """Send ``ring``'s bytes from ``offset`` as DATA frames; with ``follow`` keep going
    until ``finished()`` (checked under ``ring.cond``) with nothing left to send.

    Returns (next offset, whether it stopped because ``still_mine()`` turned false).
    Raises Cancelled when the host cancels or goes away.
    """
    pos = offset
    while True:
        with ring.cond:
            chunks = ring.read_from(pos)
            if not chunks:
                if not follow or finished():
                    return max(pos, ring.start), False
                ring.cond.wait(POLL_S)
        if st.cancelled:
            raise Cancelled()
        if still_mine is not None and not still_mine():
            return pos, True
        for start, channel, data in chunks:
            for at in range(0, len(data), CHUNK):
                if not st.take_credit():
                    raise Cancelled()
                piece = data[at : at + CHUNK]
                st.send(DATA, {"offset": start + at}, piece, channel)
            pos = start + len(data)


class Process:
    def __init__(self, proc: subprocess.Popen[bytes], argv: list[str], timeout: float | None):
        self.proc = proc
        self.pid = proc.pid
        self.argv = argv
        self.timeout = timeout
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.exit_code: int | None = None
        self.signal: int | None = None
        self.timed_out = False
        self.exited = False
        self.ring = OutputRing(OUTPUT_LIMIT)
        self.stdin_lock = threading.Lock()
        self.stdin_open = proc.stdin is not None

    def to_wire(self) -> dict[str, Any]:
        with self.ring.cond:
            return {
                "pid": self.pid,
                "argv": self.argv,
                "state": "exited" if self.exited else "running",
                "exit_code": self.exit_code,
                "signal": self.signal,
                "timed_out": self.timed_out,
                "started_at": self.started_at,
                "ended_at": self.ended_at,
                "output_bytes": self.ring.end,
                "dropped_bytes": self.ring.start,
                "stdin_open": self.stdin_open,
            }

    def how_it_ended(self) -> str:
        if self.signal is not None:
            return f"exited (killed by signal {self.signal})"
        return f"exited with code {self.exit_code}"


PROCS: dict[int, Process] = {}
PROCS_LOCK = threading.Lock()


def lookup(h: dict[str, Any]) -> Process:
    pid = h.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool):
        raise AgentError("invalid_argument", f"pid must be an integer, got {pid!r}")
    with PROCS_LOCK:
        p = PROCS.get(pid)
    if p is None:
        raise AgentError(
            "not_found",
            f"no background process {pid} in this sandbox; list them with GET .../processes",
        )
    return p


def _forget_old_exited() -> None:
    # Caller holds PROCS_LOCK.
    exited = sorted((p for p in PROCS.values() if p.exited), key=lambda p: p.ended_at or 0)
    for p in exited[: max(0, len(exited) - MAX_EXITED + 1)]:
        PROCS.pop(p.pid, None)


def op_start(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    argv, kw = spawn_args(h)
    timeout = h.get("timeout_s")
    if timeout is not None and (
        not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0
    ):
        raise AgentError("invalid_argument", "timeout_s must be a positive number")
    with PROCS_LOCK:
        running = sum(1 for p in PROCS.values() if not p.exited)
    if running >= MAX_RUNNING:
        raise AgentError(
            "invalid_argument",
            f"{running} background processes are running; kill some before starting more",
        )
    proc = popen(
        argv,
        stdin=subprocess.PIPE if h.get("stdin") else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: signals reach its children
        **kw,
    )
    p = Process(proc, argv, None if timeout is None else float(timeout))
    with PROCS_LOCK:
        _forget_old_exited()
        PROCS[p.pid] = p  # a reused pid replaces the exited process that had it
    threading.Thread(target=pump, args=(p,), name=f"proc-{p.pid}", daemon=True).start()
    return {"process": p.to_wire()}


def pump(p: Process) -> None:
    """Read the process's output into its ring until it exits; enforce its timeout."""
    proc = p.proc
    assert proc.stdout is not None and proc.stderr is not None
    poller, channels, pidfd = watch_output(proc)
    deadline = None if p.timeout is None else time.monotonic() + p.timeout
    exited = False
    try:
        while channels:
            wait_s: float | None = None
            if exited:
                wait_s = 0  # drain what is buffered; background children may hold the pipes
            elif pidfd is None:
                wait_s = 0.05
            if deadline is not None and not p.timed_out and not exited:
                left = max(0.0, deadline - time.monotonic())
                wait_s = left if wait_s is None else min(wait_s, left)
            events = poller.poll(None if wait_s is None else wait_s * 1000)
            if not exited and pidfd is None and proc.poll() is not None:
                exited = True
            if deadline is not None and not p.timed_out and time.monotonic() >= deadline:
                with p.ring.cond:
                    p.timed_out = True
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
            if not events:
                if exited:
                    break
                continue
            for fd, _ev in events:
                if fd == pidfd:
                    exited = True
                    poller.unregister(fd)
                    continue
                data = os.read(fd, CHUNK)
                if not data:
                    poller.unregister(fd)
                    del channels[fd]
                    continue
                p.ring.append(channels[fd], data)
    finally:
        if pidfd is not None:
            os.close(pidfd)
        rc = proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()
        with p.ring.cond:
            p.exit_code = rc if rc >= 0 else None
            p.signal = -rc if rc < 0 else None
            p.ended_at = time.time()
            p.exited = True
            p.ring.cond.notify_all()
        with p.stdin_lock:
            close_stdin(p)


def close_stdin(p: Process) -> None:
    # Caller holds p.stdin_lock.
    if p.proc.stdin is not None and p.stdin_open:
        with contextlib.suppress(OSError):
            p.proc.stdin.close()
    with p.ring.cond:
        p.stdin_open = False


def op_list(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    with PROCS_LOCK:
        procs = sorted(PROCS.values(), key=lambda p: p.started_at)
    return {"processes": [p.to_wire() for p in procs]}


def op_get(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    return {"process": lookup(h).to_wire()}


def op_output(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    p = lookup(h)
    offset = h.get("offset", 0)
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise AgentError("invalid_argument", f"offset must be a byte count >= 0, got {offset!r}")
    follow = bool(h.get("follow"))
    pos, _ = stream_ring(st, p.ring, offset, follow, lambda: p.exited)
    return {"next_offset": pos, "process": p.to_wire()}


def op_stdin(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    p = lookup(h)
    if p.proc.stdin is None:
        raise AgentError(
            "invalid_argument",
            f"process {p.pid} was started without stdin; start it with stdin enabled",
        )
    written = 0
    with p.stdin_lock:
        if not p.stdin_open:
            if p.exited:
                raise AgentError("exited", f"process {p.pid} already {p.how_it_ended()}")
            raise AgentError("exited", f"the stdin of process {p.pid} is already closed")
        fd = p.proc.stdin.fileno()
        broken = False
        for chunk in st.inbound_frames():
            view = memoryview(chunk)
            while view and not broken:
                try:
                    n = os.write(fd, view)
                except OSError:
                    broken = True  # it closed its stdin or exited; keep taking frames
                    break
                view = view[n:]
                written += n
        if broken or h.get("eof"):
            close_stdin(p)
    return {"written": written, "process": p.to_wire()}


def signal_number(h: dict[str, Any]) -> int:
    signum = h.get("signal")
    if not isinstance(signum, int) or isinstance(signum, bool) or not 0 < signum < signal.NSIG:
        raise AgentError("invalid_argument", f"signal {signum!r} is not a signal number")
    return signum


def op_signal(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    p = lookup(h)
    signum = signal_number(h)
    with p.ring.cond:  # exited is set under this lock after the wait: the pgid is ours
        if p.exited:
            raise AgentError("exited", f"process {p.pid} already {p.how_it_ended()}")
        with contextlib.suppress(ProcessLookupError):  # exiting now; the pump records it
            os.killpg(p.pid, signum)
    return {}


def op_kill(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    p = lookup(h)
    with p.ring.cond:
        if not p.exited:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + KILL_WAIT_S
        while not p.exited and time.monotonic() < deadline:
            p.ring.cond.wait(POLL_S)
    return {"process": p.to_wire()}


def op_wait(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    p = lookup(h)
    timeout = h.get("timeout_s")
    if timeout is not None and (not isinstance(timeout, int | float) or timeout < 0):
        raise AgentError("invalid_argument", "timeout_s must be a number >= 0")
    deadline = None if timeout is None else time.monotonic() + float(timeout)
    with p.ring.cond:
        while not p.exited:
            if st.cancelled:
                raise Cancelled()
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if left <= 0:
                break
            p.ring.cond.wait(left)
    return {"process": p.to_wire()}


OPS: dict[str, Op] = {
    "proc_start": op_start,
    "proc_list": op_list,
    "proc_get": op_get,
    "proc_output": op_output,
    "proc_stdin": op_stdin,
    "proc_signal": op_signal,
    "proc_kill": op_kill,
    "proc_wait": op_wait,
}
