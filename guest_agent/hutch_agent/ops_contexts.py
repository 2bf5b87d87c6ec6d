"""Code interpreter contexts: stateful Python processes returning structured outputs.

Each context is its own ``python3 -I kernel.py`` (see :mod:`hutch_agent.kernel`). The
contexts live in a table of the agent process, not in a stream, so they outlive the
host's connection (a daemon restart or a reconnect finds them again).

- ``ctx_create`` ``{language, cwd, env}`` → END ``{context}``
- ``ctx_list`` → END ``{contexts: [context]}``
- ``ctx_delete`` ``{id}`` → END ``{}``
- ``ctx_run`` ``{id, code, timeout_s}`` → REPLY ``{"event": "accepted"}``, then DATA
  frames of JSON lines, one output each::

      {"type": "stdout"|"stderr", "text"}
      {"type": "display"|"result", "data": {mime: value}}
      {"type": "error", "ename", "evalue", "traceback": [str]}

  then END ``{duration_ms, status: ok|error|interrupted|timeout}``. Runs in one context
  are queued: each starts when the one before it ended.
- ``ctx_interrupt`` ``{id}`` → END ``{}`` (SIGINT: the run ends with KeyboardInterrupt)
- ``ctx_restart`` ``{id}`` → END ``{context}`` (a fresh process; variables are gone)

A context is ``{id, language, cwd, pid, state: idle|busy|dead, created_at, runs}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import select
import signal
import subprocess
import threading
import time
from typing import Any

from hutch_agent import HOME, runtime
from hutch_agent.errors import AgentError
from hutch_agent.framing import CHUNK, DATA, REPLY
from hutch_agent.ops import Op
from hutch_agent.streams import Cancelled, Stream

KERNEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel.py")
LANGUAGES = ("python",)
MAX_CONTEXTS = 16
#: After an interrupt for a timeout, how long the kernel gets to finish the run.
INTERRUPT_GRACE_S = 5.0
#: Outputs held for a run whose host has not taken them yet.
SINK_ITEMS = 256


class Context:
    def __init__(self, cid: str, language: str, cwd: str, env: dict[str, str]) -> None:
        self.id, self.language, self.cwd, self.env = cid, language, cwd, env
        self.created_at = time.time()
        self.run_lock = threading.Lock()  # one run at a time, the rest queue
        self.lock = threading.Lock()
        self.sink: queue.Queue[dict[str, Any] | None] | None = None
        self.run_id = 0
        self.runs = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.requests: int = -1
        self.reader: threading.Thread | None = None
        self.start()

    # -- process ------------------------------------------------------------------------
    def start(self) -> None:
        req_r, req_w = os.pipe()
        msg_r, msg_w = os.pipe()
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": HOME,
            "LANG": "C.UTF-8",
            "MPLBACKEND": "Agg",
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }
        try:
            # The kernel learns its pipes' fd numbers from argv; fds 1 and 2 stay plain
            # stdout/stderr for the user's code and its children.
            proc = subprocess.Popen(
                [runtime.python_command(), "-I", KERNEL, str(req_r), str(msg_w)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=self.cwd,
                env=env,
                pass_fds=(req_r, msg_w),
                start_new_session=True,
            )
        except BaseException as exc:
            for fd in (req_w, msg_r):
                os.close(fd)
            if isinstance(exc, FileNotFoundError) and exc.filename == runtime.python_command():
                raise AgentError(
                    "command_not_found",
                    "the code interpreter runs the image's own python3, and this image "
                    f"has none on PATH ({env.get('PATH')})",
                ) from exc
            raise
        finally:
            os.close(req_r)
            os.close(msg_w)
        self.proc = proc
        self.requests = req_w
        self.reader = threading.Thread(
            target=self.pump, args=(proc, msg_r), name=f"ctx-{self.id}", daemon=True
        )
        self.reader.start()

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if self.requests >= 0:
            with contextlib.suppress(OSError):
                os.close(self.requests)
            self.requests = -1
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if self.reader is not None and self.reader is not threading.current_thread():
            self.reader.join(5)
        self.post(None)

    @property
    def state(self) -> str:
        if self.proc is None or self.proc.poll() is not None:
            return "dead"
        return "busy" if self.run_lock.locked() else "idle"

    def info(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "language": self.language,
            "cwd": self.cwd,
            "pid": self.proc.pid if self.proc else None,
            "state": self.state,
            "created_at": self.created_at,
            "runs": self.runs,
        }

    # -- output -------------------------------------------------------------------------
    def post(self, item: dict[str, Any] | None) -> None:
        """Hand ``item`` to the current run. The queue is bounded, so a run whose host
        reads slowly holds the kernel back (its pipes fill) instead of the agent's RAM."""
        while True:
            with self.lock:
                sink = self.sink
            if sink is None:
                return
            try:
                sink.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def pump(self, proc: subprocess.Popen[bytes], msg_fd: int) -> None:
        """Read the kernel's stdout, stderr and messages; hand them to the current run.

        Output between runs (a background thread printing) has no run to go to and is
        dropped. EOF on the message pipe means the kernel is gone.
        """
        assert proc.stdout is not None and proc.stderr is not None
        names = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
        poller = select.poll()
        for fd in (*names, msg_fd):
            poller.register(fd, select.POLLIN)
        partial = b""
        open_fds = {*names, msg_fd}
        try:
            while msg_fd in open_fds:
                for fd, _ev in poller.poll():
                    data = os.read(fd, CHUNK)
                    if not data:
                        poller.unregister(fd)
                        open_fds.discard(fd)
                        continue
                    if fd in names:
                        self.post({"type": names[fd], "text": data.decode("utf-8", "replace")})
                        continue
                    partial += data
                    *lines, partial = partial.split(b"\n")
                    for line in lines:
                        self.message(line, names, poller, open_fds)
        finally:
            os.close(msg_fd)
            for pipe in (proc.stdout, proc.stderr):
                pipe.close()
            proc.wait()
            self.post({"type": "died", "code": proc.returncode})

    def message(self, line: bytes, names: dict[int, str], poller: Any, open_fds: set[int]) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            return
        if not isinstance(msg, dict) or msg.get("id") != self.run_id:
            return  # a run that was given up on
        if msg.get("type") == "done":
            # The kernel flushed stdout/stderr before "done": take what is in the pipes.
            for fd, name in names.items():
                while fd in open_fds and select.select([fd], [], [], 0)[0]:
                    data = os.read(fd, CHUNK)
                    if not data:
                        poller.unregister(fd)
                        open_fds.discard(fd)
                        break
                    self.post({"type": name, "text": data.decode("utf-8", "replace")})
        msg.pop("id", None)
        self.post(msg)

    # -- running --------------------------------------------------------------------------
    def run(self, st: Stream, code: str, timeout_s: float | None) -> dict[str, Any]:
        with self.run_lock:
            if self.state == "dead":
                raise AgentError(
                    "conflict",
                    f"context {self.id}'s Python process has exited; restart the context",
                )
            sink: queue.Queue[dict[str, Any] | None] = queue.Queue(SINK_ITEMS)
            with self.lock:
                self.run_id += 1
                self.sink = sink
            self.runs += 1
            started = time.monotonic()
            try:
                line = json.dumps({"id": self.run_id, "code": code}) + "\n"
                try:
                    os.write(self.requests, line.encode())
                except OSError as exc:
                    raise AgentError(
                        "conflict", f"context {self.id}'s Python process is gone; restart it"
                    ) from exc
                status = self.collect(st, sink, started, timeout_s)
            finally:
                with self.lock:
                    self.sink = None
            return {"status": status, "duration_ms": int((time.monotonic() - started) * 1000)}

    def collect(
        self,
        st: Stream,
        sink: queue.Queue[dict[str, Any] | None],
        started: float,
        timeout_s: float | None,
    ) -> str:
        out = Outputs(st)
        status = "ok"
        deadline = None if timeout_s is None else started + timeout_s
        interrupted_at: float | None = None
        while True:
            if st.cancelled and interrupted_at is None:
                # The host gave up on this run: stop the code rather than let it run on.
                self.interrupt()
                interrupted_at = time.monotonic()
            now = time.monotonic()
            wait = 0.2
            if deadline is not None and interrupted_at is None:
                if now >= deadline:
                    self.interrupt()
                    interrupted_at = now
                    status = "timeout"
                    out.add(
                        {
                            "type": "error",
                            "ename": "TimeoutError",
                            "evalue": f"the code ran longer than timeout_s={timeout_s:g} and "
                            "was interrupted",
                            "traceback": [],
                        }
                    )
                    continue
                wait = min(wait, deadline - now)
            if interrupted_at is not None and now - interrupted_at > INTERRUPT_GRACE_S:
                # The code ignores SIGINT (or is stuck in C): a fresh process it is.
                self.stop()
                self.start()
                out.add(
                    {
                        "type": "error",
                        "ename": "KernelRestarted",
                        "evalue": "the code did not stop on interrupt; the context was "
                        "restarted and its variables are gone",
                        "traceback": [],
                    }
                )
                out.flush()
                return "timeout" if status == "timeout" else "interrupted"
            try:
                item = sink.get(timeout=max(0.01, wait))
            except queue.Empty:
                out.flush()
                continue
            if item is None or item.get("type") == "died":
                code = None if item is None else item.get("code")
                out.add(
                    {
                        "type": "error",
                        "ename": "KernelDied",
                        "evalue": f"the context's Python process exited (code {code}); "
                        "restart the context to use it again",
                        "traceback": [],
                    }
                )
                out.flush()
                return "error"
            if item.get("type") == "done":
                out.flush()
                return status
            if item.get("type") == "error":
                if item.get("ename") == "KeyboardInterrupt" and status == "timeout":
                    continue  # already reported as a timeout
                if status == "ok":
                    status = "interrupted" if item.get("ename") == "KeyboardInterrupt" else "error"
            out.add(item)

    def interrupt(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGINT)


class Outputs:
    """Batches outputs into DATA frames of JSON lines (a big image spans several)."""

    def __init__(self, st: Stream) -> None:
        self.st = st
        self.buf = bytearray()

    def add(self, item: dict[str, Any]) -> None:
        self.buf += json.dumps(item, separators=(",", ":")).encode() + b"\n"
        if len(self.buf) >= CHUNK:
            self.flush()

    def flush(self) -> None:
        while self.buf:
            if self.st.cancelled:
                self.buf.clear()  # the host is gone; keep draining the kernel
                return
            if not self.st.take_credit():
                continue
            chunk = bytes(self.buf[:CHUNK])
            del self.buf[:CHUNK]
            self.st.send(DATA, None, chunk)


class Table:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.contexts: dict[str, Context] = {}

    def get(self, cid: Any) -> Context:
        with self.lock:
            ctx = self.contexts.get(cid) if isinstance(cid, str) else None
        if ctx is None:
            raise AgentError("not_found", f"no context {cid!r} in this sandbox")
        return ctx


TABLE = Table()


def op_create(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    language = h.get("language") or "python"
    if language not in LANGUAGES:
        raise AgentError(
            "invalid_argument",
            f"language {language!r} is not supported; supported: {', '.join(LANGUAGES)}",
        )
    cwd = h.get("cwd") or (HOME if os.path.isdir(HOME) else "/")  # a bare image: no /root
    if not isinstance(cwd, str) or not os.path.isdir(cwd):
        raise AgentError("not_found", f"working directory {cwd!r} does not exist in the sandbox")
    env = h.get("env") or {}
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and "\0" not in k + v and "=" not in k
        for k, v in env.items()
    ):
        raise AgentError("invalid_argument", "env must map names to strings")
    with TABLE.lock:
        live = sum(1 for c in TABLE.contexts.values() if c.state != "dead")
        if live >= MAX_CONTEXTS:
            raise AgentError(
                "conflict",
                f"this sandbox already has {live} contexts (the most it keeps); delete one first",
            )
        cid = "ctx-" + secrets.token_hex(6)
        ctx = Context(cid, language, cwd, dict(env))
        TABLE.contexts[cid] = ctx
    return {"context": ctx.info()}


def op_list(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    with TABLE.lock:
        contexts = sorted(TABLE.contexts.values(), key=lambda c: c.created_at)
    return {"contexts": [c.info() for c in contexts]}


def op_delete(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    ctx = TABLE.get(h.get("id"))
    with TABLE.lock:
        TABLE.contexts.pop(ctx.id, None)
    ctx.stop()
    return {}


def op_run(st: Stream, h: dict[str, Any]) -> dict[str, Any] | None:
    ctx = TABLE.get(h.get("id"))
    code = h.get("code")
    if not isinstance(code, str):
        raise AgentError("invalid_argument", "code must be a string")
    timeout = h.get("timeout_s")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
    ):
        raise AgentError("invalid_argument", "timeout_s must be a positive number")
    st.send(REPLY, {"event": "accepted", "context": ctx.id})
    result = ctx.run(st, code, None if timeout is None else float(timeout))
    if st.cancelled:
        raise Cancelled()
    return result


def op_interrupt(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    ctx = TABLE.get(h.get("id"))
    ctx.interrupt()
    return {"state": ctx.state}


def op_restart(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    ctx = TABLE.get(h.get("id"))
    # A run in progress ends with KernelDied; the next one gets the fresh process.
    ctx.stop()
    with ctx.run_lock:
        ctx.start()
        ctx.runs = 0
    return {"context": ctx.info()}


OPS: dict[str, Op] = {
    "ctx_create": op_create,
    "ctx_list": op_list,
    "ctx_delete": op_delete,
    "ctx_run": op_run,
    "ctx_interrupt": op_interrupt,
    "ctx_restart": op_restart,
}
