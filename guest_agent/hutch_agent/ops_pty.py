"""Interactive terminals: a shell on a PTY, resized and signalled, reattachable after a
dropped connection.

A terminal outlives the stream that opened it (like a background process, it is module
state, untouched by ``Agent.reset_session``): its output goes into a bounded scrollback
whether or not a host is attached, and ``pty_attach`` replays that scrollback and carries
on. One stream is attached at a time; a new attach takes over and the old stream ends with
END {"detached": true}.

Ops:

- ``pty_open`` {argv | shell, rows, cols, term, env, cwd, user} → REPLY {"event":
  "ready", pty_id, pid}, then the attached session (below).
- ``pty_attach`` {pty_id} → REPLY ready, scrollback, then the attached session.
  Attached session: agent DATA (channel 1) = terminal output; host DATA (channel 0) =
  keyboard input; END {exit_code, signal} when the program exits, or END {detached}.
- ``pty_resize`` {pty_id, rows, cols}; ``pty_signal`` {pty_id, signal} (to the
  terminal's foreground process group); ``pty_close`` {pty_id} (SIGHUP, then SIGKILL);
  ``pty_list`` → END {ptys}.

Error code ``exited``: the terminal's program has exited (the host maps it to a conflict).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import select
import signal
import struct
import subprocess
import termios
import threading
import time
from typing import Any

from hutch_agent.errors import AgentError
from hutch_agent.framing import CHUNK, REPLY, STDOUT
from hutch_agent.ops import Op
from hutch_agent.ops_process import (
    POLL_S,
    OutputRing,
    signal_number,
    stream_ring,
)
from hutch_agent.spawn import popen, spawn_args
from hutch_agent.streams import Cancelled, Stream

SCROLLBACK = 256 * 1024
MAX_PTYS = 64
#: Exited terminals kept so a late attach gets "exited" rather than "not found".
MAX_EXITED = 16
CLOSE_WAIT_S = 2.0


def _size(h: dict[str, Any], key: str, default: int) -> int:
    value = h.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1000:
        raise AgentError("invalid_argument", f"{key} must be 1-1000, got {value!r}")
    return value


def _set_size(fd: int, rows: int, cols: int) -> None:
    # The kernel sends SIGWINCH to the terminal's foreground process group itself when
    # the size changes, so full-screen programs redraw without help from us.
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class Pty:
    def __init__(self, proc: subprocess.Popen[bytes], master: int, argv: list[str]) -> None:
        self.id = "pty-" + secrets.token_hex(6)
        self.proc = proc
        self.pid = proc.pid
        self.master = master
        self.argv = argv
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.exit_code: int | None = None
        self.signal: int | None = None
        self.exited = False
        self.ring = OutputRing(SCROLLBACK)
        self.attached: Stream | None = None
        self.rows = self.cols = 0

    def to_wire(self) -> dict[str, Any]:
        with self.ring.cond:
            return {
                "pty_id": self.id,
                "pid": self.pid,
                "argv": self.argv,
                "state": "exited" if self.exited else "running",
                "exit_code": self.exit_code,
                "signal": self.signal,
                "rows": self.rows,
                "cols": self.cols,
                "attached": self.attached is not None,
                "started_at": self.started_at,
                "ended_at": self.ended_at,
            }

    def how_it_ended(self) -> str:
        if self.signal is not None:
            return f"exited (killed by signal {self.signal})"
        return f"exited with code {self.exit_code}"


PTYS: dict[str, Pty] = {}
PTYS_LOCK = threading.Lock()


def lookup(h: dict[str, Any]) -> Pty:
    pty_id = h.get("pty_id")
    with PTYS_LOCK:
        t = PTYS.get(pty_id) if isinstance(pty_id, str) else None
    if t is None:
        raise AgentError(
            "not_found",
            f"no terminal {pty_id!r} in this sandbox (closed, or the sandbox restarted)",
        )
    return t


def running(h: dict[str, Any]) -> Pty:
    t = lookup(h)
    if t.exited:
        raise AgentError("exited", f"terminal {t.id} is closed: its program {t.how_it_ended()}")
    return t


def _make_controlling_tty() -> None:
    # Runs in the child after setsid (start_new_session): stdin is the pty's slave.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def op_open(st: Stream, h: dict[str, Any]) -> dict[str, Any] | None:
    if h.get("argv") is None and h.get("shell") is None:
        shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
        h = {**h, "argv": [shell, "-l"]}
    argv, kw = spawn_args(h)
    rows, cols = _size(h, "rows", 24), _size(h, "cols", 80)
    term = h.get("term") or "xterm-256color"
    if not isinstance(term, str) or not term.isprintable() or len(term) > 64:
        raise AgentError("invalid_argument", f"term {term!r} is not a terminal type name")
    kw["env"] = {**kw["env"], "TERM": term}
    with PTYS_LOCK:
        alive = sum(1 for t in PTYS.values() if not t.exited)
    if alive >= MAX_PTYS:
        raise AgentError("invalid_argument", f"{alive} terminals are open; close some first")
    master, slave = os.openpty()
    try:
        _set_size(slave, rows, cols)
        if "user" in kw:
            os.fchown(slave, kw["user"], -1)
        os.set_inheritable(slave, False)
        proc = popen(
            argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
            preexec_fn=_make_controlling_tty,
            **kw,
        )
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    t = Pty(proc, master, argv)
    t.rows, t.cols = rows, cols
    with PTYS_LOCK:
        exited = sorted((x for x in PTYS.values() if x.exited), key=lambda x: x.ended_at or 0)
        evicted = exited[: max(0, len(exited) - MAX_EXITED + 1)]
        PTYS[t.id] = t
    for old in evicted:
        forget(old)
    threading.Thread(target=pump, args=(t,), name=f"{t.id}", daemon=True).start()
    return attached(st, t)


def pump(t: Pty) -> None:
    """Terminal output into the scrollback until the program exits."""
    poller = select.poll()
    poller.register(t.master, select.POLLIN)
    pidfd: int | None
    try:
        pidfd = os.pidfd_open(t.pid)
        poller.register(pidfd, select.POLLIN)
    except OSError:
        pidfd = None
    exited = False
    drains = 0
    try:
        while True:
            timeout_ms = 0 if exited else (None if pidfd is not None else 50)
            events = poller.poll(timeout_ms)
            if pidfd is None and t.proc.poll() is not None:
                exited = True
            if exited:
                drains += 1
            # After the exit: what is buffered, but not forever for a background child
            # that keeps the terminal open and writing.
            if exited and (not events or drains > 64):
                break
            done = False
            for fd, ev in events:
                if fd == pidfd:
                    exited = True
                    poller.unregister(fd)
                    continue
                try:
                    data = os.read(fd, CHUNK) if ev & (select.POLLIN | select.POLLHUP) else b""
                except OSError:  # EIO: every holder of the slave side closed it
                    data = b""
                if not data:
                    done = True
                    break
                t.ring.append(STDOUT, data)
            if done:
                break
    finally:
        if pidfd is not None:
            os.close(pidfd)
        # The master stays open until the terminal is forgotten (close, or evicted as an
        # old exited one): other threads may still hold its number.
        rc = t.proc.wait()
        with t.ring.cond:
            t.exit_code = rc if rc >= 0 else None
            t.signal = -rc if rc < 0 else None
            t.ended_at = time.time()
            t.exited = True
            t.ring.cond.notify_all()


def forget(t: Pty) -> None:
    """Drop an exited terminal from the table and release its master side."""
    with PTYS_LOCK:
        PTYS.pop(t.id, None)
    with contextlib.suppress(OSError):
        os.close(t.master)


def attached(st: Stream, t: Pty) -> dict[str, Any]:
    """Serve ``st`` as the terminal's attached stream: replay, then live both ways."""
    with t.ring.cond:
        old, t.attached = t.attached, st
        t.ring.cond.notify_all()
    if old is not None:
        old.inbound.put(None)  # ends the old stream's input thread
    st.send(REPLY, {"event": "ready", "pty_id": t.id, "pid": t.pid})
    threading.Thread(target=pump_input, args=(st, t), name=f"{t.id}-in", daemon=True).start()
    try:
        _, detached = stream_ring(
            st, t.ring, t.ring.start, True, lambda: t.exited, lambda: t.attached is st
        )
    finally:
        with t.ring.cond:
            if t.attached is st:
                t.attached = None
    if detached:
        return {"detached": True, "pty_id": t.id}
    return {"pty_id": t.id, "exit_code": t.exit_code, "signal": t.signal}


def pump_input(st: Stream, t: Pty) -> None:
    try:
        for chunk in st.inbound_frames():
            if t.attached is not st or t.exited:
                continue  # keep granting credit; a detached stream's input is dropped
            view = memoryview(chunk)
            try:
                while view:
                    view = view[os.write(t.master, view) :]
            except OSError:
                pass  # the terminal closed under us; the output side reports the exit
    except Cancelled:
        pass


def op_attach(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    return attached(st, running(h))


def op_resize(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    t = running(h)
    rows, cols = _size(h, "rows", t.rows), _size(h, "cols", t.cols)
    with t.ring.cond:
        if t.exited:
            raise AgentError("exited", f"terminal {t.id} is closed")
        _set_size(t.master, rows, cols)
        t.rows, t.cols = rows, cols
    return {"rows": rows, "cols": cols}


def op_signal(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    t = running(h)
    signum = signal_number(h)
    with t.ring.cond:
        if t.exited:
            raise AgentError("exited", f"terminal {t.id} is closed")
        try:
            pgrp = os.tcgetpgrp(t.master)  # the foreground job, as Ctrl-C would reach
        except OSError:
            pgrp = t.pid
        try:
            os.killpg(pgrp, signum)
        except ProcessLookupError:
            os.killpg(t.pid, signum)
    return {"pgrp": pgrp}


def op_close(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    t = lookup(h)
    with t.ring.cond:
        if not t.exited:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(t.pid, signal.SIGHUP)
            deadline = time.monotonic() + CLOSE_WAIT_S
            while not t.exited and time.monotonic() < deadline:
                t.ring.cond.wait(POLL_S)
            if not t.exited:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(t.pid, signal.SIGKILL)
                while not t.exited:
                    t.ring.cond.wait(POLL_S)
    forget(t)
    return {"pty": t.to_wire()}


def op_list(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    with PTYS_LOCK:
        ptys = sorted(PTYS.values(), key=lambda t: t.started_at)
    return {"ptys": [t.to_wire() for t in ptys]}


OPS: dict[str, Op] = {
    "pty_open": op_open,
    "pty_attach": op_attach,
    "pty_resize": op_resize,
    "pty_signal": op_signal,
    "pty_close": op_close,
    "pty_list": op_list,
}
