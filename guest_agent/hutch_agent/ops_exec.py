"""exec and signal: run commands with streamed output, stdin, timeouts and signals."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import Any

from hutch_agent.errors import AgentError
from hutch_agent.framing import (
    CHUNK,
    DATA,
    REPLY,
)
from hutch_agent.ops import Op
from hutch_agent.spawn import popen, spawn_args, watch_output
from hutch_agent.streams import Cancelled, Stream


# -- exec -------------------------------------------------------------------------
def op_exec(st: Stream, h: dict[str, Any]) -> dict[str, Any] | None:
    argv, kw = spawn_args(h)
    timeout = h.get("timeout_s")
    if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
        raise AgentError("invalid_argument", "timeout_s must be a positive number")
    started = time.monotonic()
    proc = popen(
        argv,
        stdin=subprocess.PIPE if h.get("stdin") else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        **kw,
    )
    st.proc = proc
    st.send(REPLY, {"event": "started", "pid": proc.pid})
    if proc.stdin is not None:
        threading.Thread(target=pump_stdin, args=(st, proc.stdin), daemon=True).start()
    deadline = None if timeout is None else started + float(timeout)
    timed_out = pump_output(st, proc, deadline)
    rc = proc.returncode
    return {
        "exit_code": rc if rc >= 0 else None,
        "signal": -rc if rc < 0 else None,
        "timed_out": timed_out,
        "duration_ms": int((time.monotonic() - started) * 1000),
    }


def op_signal(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    signum, target = h.get("signal"), h.get("target")
    if not isinstance(signum, int) or not 0 < signum < signal.NSIG:
        raise AgentError("invalid_argument", f"signal {signum!r} is not a signal number")
    other = st.session.get(target)
    if other is None or other.proc is None:
        raise AgentError("not_found", f"no running command on stream {target!r}")
    with other.cond:  # reaped is set under this lock, so the pgid is still ours
        if other.reaped:
            raise AgentError("not_found", "the command has already exited")
        try:
            os.killpg(other.proc.pid, signum)
        except ProcessLookupError as exc:
            raise AgentError("not_found", "the command has already exited") from exc
    return {}


def pump_stdin(st: Stream, pipe: Any) -> None:
    broken = False
    try:
        for chunk in st.inbound_frames():
            if broken:
                continue  # keep granting credit so the host can finish
            try:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(pipe.fileno(), view) :]
            except OSError:
                broken = True  # the command closed its stdin or exited
    except Cancelled:
        pass
    finally:
        with contextlib.suppress(OSError):
            pipe.close()


def pump_output(st: Stream, proc: subprocess.Popen[bytes], deadline: float | None) -> bool:
    """Stream stdout/stderr as produced until the command exits; return timed_out.

    Output left in the pipes by background children after the command exits is sent if
    it is already there; the stream then ends without waiting for them.
    """
    assert proc.stdout is not None and proc.stderr is not None
    poller, channels, pidfd = watch_output(proc)
    exited = timed_out = False

    def kill() -> None:
        nonlocal timed_out
        timed_out = True
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)

    try:
        while channels or not exited:
            if exited:
                wait_ms: float | None = 0
            elif deadline is not None and not timed_out:
                wait_ms = max(0.0, deadline - time.monotonic()) * 1000
            else:
                wait_ms = None
            if pidfd is None and not exited:
                wait_ms = 50 if wait_ms is None else min(wait_ms, 50)
            events = poller.poll(wait_ms)
            if pidfd is None and not exited and proc.poll() is not None:
                exited = True
            if not events:
                if exited:
                    break
                if deadline is not None and not timed_out and time.monotonic() >= deadline:
                    kill()
                continue
            for fd, _ev in events:
                if fd == pidfd:
                    exited = True
                    poller.unregister(fd)
                    continue
                if fd not in channels:
                    continue
                while not st.cancelled and not st.take_credit(None if timed_out else deadline):
                    if not st.cancelled:
                        kill()  # the host stopped reading and the deadline passed
                data = os.read(fd, CHUNK)
                if not data:
                    poller.unregister(fd)
                    del channels[fd]
                    continue
                st.send(DATA, None, data, channels[fd])
    finally:
        if pidfd is not None:
            os.close(pidfd)
        if not exited and proc.poll() is None:
            kill()  # only after an unexpected error: leave no command behind
        with st.cond:
            proc.wait()
            st.reaped = True
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()
    return timed_out


OPS: dict[str, Op] = {"exec": op_exec, "signal": op_signal}
