"""envd's ``process.Process`` service on hutch's background processes and terminals.

Every E2B command is a hutch background process (``ProcessService``): ``Start`` starts it
(stdin kept open unless the request says ``stdin: false``) and follows its output from
the first byte to the exit, so a foreground ``commands.run`` and a background handle
are the same stream; ``Connect`` follows a running one from where its output is now
(E2B sends what is produced after a connect); stdin, signals and listing go to the same
process by its guest pid. A ``Start`` with ``pty`` opens a hutch terminal instead; its
pid (the shell's guest pid) selects it from then on.

A hutch terminal has one attached stream at a time and takes its input on it, while
E2B sends input in separate requests: the face keeps, per terminal, one attached
session (:class:`PtyHolder`) that fans its output out to the E2B streams following it
and takes their input. After a daemon restart or a pause the first call re-attaches.

Exit status as envd reports it (Go's ``ProcessState``): ``exitCode`` N and ``exit status
N``, or -1 and ``signal: killed`` (etc.) for a process ended by a signal;
``CommandExitException`` follows from a non-zero code.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from hutch.e2b.connect import ConnectError, b64decode, b64encode
from hutch.e2b.rpc import Call, RpcService
from hutch.e2b.wiring import Hutch
from hutch.errors import Conflict, InvalidArgument, NotFound
from hutch.services.processes import AttachedPty, ProcessInfo

__all__ = ["ProcessRpc", "end_event"]

Message = dict[str, Any]
SIGKILL, SIGTERM = 9, 15
_SIGNALS = {"SIGNAL_SIGKILL": SIGKILL, "SIGNAL_SIGTERM": SIGTERM, 9: SIGKILL, 15: SIGTERM}
#: How Go's os.ProcessState names the usual signals ("signal: killed").
_GO_SIGNAL_NAMES = {
    1: "hangup",
    2: "interrupt",
    3: "quit",
    6: "aborted",
    9: "killed",
    11: "segmentation fault",
    13: "broken pipe",
    14: "alarm clock",
    15: "terminated",
}
_PTY_QUEUE = 256
KEEPALIVE: Message = {"event": {"keepalive": {}}}


def end_event(info: ProcessInfo) -> Message:
    """envd's EndEvent for a process that has exited."""
    end: Message
    if info.signal is not None:
        name = _GO_SIGNAL_NAMES.get(info.signal, str(info.signal))
        end = {"exitCode": -1, "exited": False, "status": f"signal: {name}"}
    else:
        code = info.exit_code or 0
        end = {"exitCode": code, "exited": True, "status": f"exit status {code}"}
    if info.timed_out:
        end["error"] = "the process ran past its timeout and was killed"
    return end


def _pty_end_event(exit_code: int | None, signal: int | None) -> Message:
    if signal is not None:
        name = _GO_SIGNAL_NAMES.get(signal, str(signal))
        return {"exitCode": -1, "exited": False, "status": f"signal: {name}"}
    code = exit_code or 0
    return {"exitCode": code, "exited": True, "status": f"exit status {code}"}


def _selector(msg: Message) -> int | str:
    """The pid (int) or tag (str) a ProcessSelector names."""
    selector = msg.get("process")
    if not isinstance(selector, dict):
        raise ConnectError("invalid_argument", "process: give a selector {pid} or {tag}")
    if "pid" in selector:
        pid = selector["pid"]
        if isinstance(pid, str) and pid.isdigit():
            pid = int(pid)
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise ConnectError("invalid_argument", f"process.pid={pid!r} is not a pid")
        return pid
    tag = selector.get("tag")
    if isinstance(tag, str) and tag:
        return tag
    raise ConnectError("invalid_argument", "process: give a selector {pid} or {tag}")


def _strings(value: Any, what: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConnectError("invalid_argument", f"{what} must be a list of strings")
    return value


class PtyHolder:
    """The face's one session attached to a terminal: its output goes to every
    subscribed stream (with backpressure), input goes in through :meth:`send`."""

    def __init__(self, session: AttachedPty, on_gone: Callable[[], None]) -> None:
        self.session = session
        self._subscribers: set[asyncio.Queue[tuple[str, Any]]] = set()
        self._on_gone = on_gone
        self.task = asyncio.get_running_loop().create_task(self._pump())

    def subscribe(self) -> asyncio.Queue[tuple[str, Any]]:
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(_PTY_QUEUE)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[tuple[str, Any]]) -> None:
        self._subscribers.discard(queue)

    def send(self, data: bytes) -> None:
        self.session.send(data)

    async def _pump(self) -> None:
        last: tuple[str, Any]
        try:
            async for data in self.session.output():
                for queue in list(self._subscribers):
                    await queue.put(("data", data))
            end = self.session.end
            if end is not None and end.detached:
                last = ("error", ConnectError("aborted", "another client attached to the terminal"))
            else:
                last = ("end", end)
        except Exception as exc:
            last = ("error", exc)
        finally:
            self._on_gone()
        for queue in list(self._subscribers):
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(last)

    async def close(self) -> None:
        await self.session.detach()
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


class ProcessRpc:
    def __init__(self, hutch: Hutch) -> None:
        self.hutch = hutch
        self._ptys: dict[tuple[str, int], PtyHolder] = {}
        #: Start's ``tag`` per process (kept in memory: lost with a daemon restart).
        self._tags: dict[tuple[str, str], int] = {}

    def service(self) -> RpcService:
        svc = RpcService("process.Process")
        svc.server_stream("Start", self.start, KEEPALIVE)
        svc.server_stream("Connect", self.connect, KEEPALIVE)
        svc.unary("List", self.list_processes)
        svc.unary("SendInput", self.send_input)
        svc.client_stream("StreamInput", self.stream_input)
        svc.unary("SendSignal", self.send_signal)
        svc.unary("CloseStdin", self.close_stdin)
        svc.unary("Update", self.update)
        return svc

    async def close(self) -> None:
        for holder in list(self._ptys.values()):
            await holder.close()

    # -- finding what a pid is ---------------------------------------------------------

    def _pid(self, sandbox_id: str, selected: int | str) -> int:
        if isinstance(selected, int):
            return selected
        pid = self._tags.get((sandbox_id, selected))
        if pid is None:
            raise ConnectError("not_found", f"no process tagged {selected!r}")
        return pid

    async def _pty_id(self, sandbox_id: str, pid: int) -> str | None:
        holder = self._ptys.get((sandbox_id, pid))
        if holder is not None:
            return holder.session.pty_id
        for pty in await self.hutch.processes.list_ptys(sandbox_id):
            if pty.pid == pid and pty.state == "running":
                return pty.pty_id
        return None

    async def _holder(self, sandbox_id: str, pid: int) -> PtyHolder | None:
        """The attached session of the terminal ``pid`` (attaching now if none is)."""
        holder = self._ptys.get((sandbox_id, pid))
        if holder is not None:
            return holder
        pty_id = await self._pty_id(sandbox_id, pid)
        if pty_id is None:
            return None
        session = await self.hutch.processes.attach_pty(sandbox_id, pty_id, busy=False)
        return self._hold(sandbox_id, session)

    def _hold(self, sandbox_id: str, session: AttachedPty) -> PtyHolder:
        key = (sandbox_id, session.pid)

        def gone() -> None:
            if self._ptys.get(key) is holder:
                del self._ptys[key]

        holder = PtyHolder(session, gone)
        self._ptys[key] = holder
        return holder

    # -- streams -----------------------------------------------------------------------

    async def start(self, call: Call, req: Message) -> AsyncIterator[Message]:
        cfg = req.get("process")
        if not isinstance(cfg, dict) or not isinstance(cfg.get("cmd"), str) or not cfg["cmd"]:
            raise ConnectError("invalid_argument", "process.cmd is required")
        argv = [cfg["cmd"], *_strings(cfg.get("args"), "process.args")]
        envs = cfg.get("envs") or {}
        if not isinstance(envs, dict) or not all(isinstance(v, str) for v in envs.values()):
            raise ConnectError("invalid_argument", "process.envs must map names to strings")
        cwd = cfg.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise ConnectError("invalid_argument", "process.cwd must be a string")
        pty = req.get("pty")
        if pty is not None:
            async for message in self._start_pty(call, argv, envs, cwd, pty):
                yield message
            return
        # envd keeps stdin open unless told otherwise (older SDKs never say).
        keep_stdin = req.get("stdin", True) is not False
        info = await self._start_process(call, argv, envs, cwd, keep_stdin)
        tag = req.get("tag")
        if isinstance(tag, str) and tag:
            self._tags[(call.sandbox_id, tag)] = info.pid
        yield {"event": {"start": {"pid": info.pid}}}
        async for message in self._follow(call.sandbox_id, info.pid, 0):
            yield message

    async def _start_process(
        self, call: Call, argv: list[str], envs: dict[str, str], cwd: str | None, stdin: bool
    ) -> ProcessInfo:
        start = self.hutch.processes.start
        try:
            return await start(
                call.sandbox_id, argv, env=envs, cwd=cwd, user=call.user, keep_stdin=stdin
            )
        except InvalidArgument as exc:
            # E2B runs every command with /bin/bash; an image without bash gets /bin/sh.
            if argv[0] != "/bin/bash" or "not found" not in exc.message:
                raise
            return await start(
                call.sandbox_id,
                ["/bin/sh", *argv[1:]],
                env=envs,
                cwd=cwd,
                user=call.user,
                keep_stdin=stdin,
            )

    async def _follow(self, sandbox_id: str, pid: int, offset: int) -> AsyncIterator[Message]:
        async with self.hutch.processes.output(sandbox_id, pid, offset, follow=True) as stream:
            async for chunk in stream:
                yield {"event": {"data": {chunk.stream: b64encode(chunk.data)}}}
            end = stream.end
        if end is None:
            raise ConnectError("unavailable", f"the output of process {pid} ended early")
        yield {"event": {"end": end_event(end.process)}}

    async def _start_pty(
        self, call: Call, argv: list[str], envs: dict[str, str], cwd: str | None, pty: Any
    ) -> AsyncIterator[Message]:
        size = pty.get("size") if isinstance(pty, dict) else None
        size = size if isinstance(size, dict) else {}
        rows, cols = int(size.get("rows") or 24), int(size.get("cols") or 80)
        term = envs.get("TERM", "xterm-256color")
        session = await self.hutch.processes.open_pty(
            call.sandbox_id,
            cmd=argv,
            rows=rows,
            cols=cols,
            term=term,
            env=envs,
            cwd=cwd,
            user=call.user,
            busy=False,
        )
        holder = self._hold(call.sandbox_id, session)
        async for message in self._watch_pty(call.sandbox_id, holder):
            yield message

    async def _watch_pty(self, sandbox_id: str, holder: PtyHolder) -> AsyncIterator[Message]:
        queue = holder.subscribe()
        try:
            with self.hutch.processes.attached(sandbox_id):
                yield {"event": {"start": {"pid": holder.session.pid}}}
                while True:
                    kind, value = await queue.get()
                    if kind == "data":
                        yield {"event": {"data": {"pty": b64encode(value)}}}
                    elif kind == "end":
                        exit_code = value.exit_code if value else None
                        signal = value.signal if value else None
                        yield {"event": {"end": _pty_end_event(exit_code, signal)}}
                        return
                    else:
                        raise value
        finally:
            holder.unsubscribe(queue)

    async def connect(self, call: Call, req: Message) -> AsyncIterator[Message]:
        pid = self._pid(call.sandbox_id, _selector(req))
        try:
            info = await self.hutch.processes.get(call.sandbox_id, pid)
        except NotFound:
            holder = await self._holder(call.sandbox_id, pid)
            if holder is None:
                raise ConnectError("not_found", f"no process or terminal with pid {pid}") from None
            async for message in self._watch_pty(call.sandbox_id, holder):
                yield message
            return
        yield {"event": {"start": {"pid": pid}}}
        async for message in self._follow(call.sandbox_id, pid, info.output_bytes):
            yield message

    # -- unary -------------------------------------------------------------------------

    async def list_processes(self, call: Call, req: Message) -> Message:
        tags = {pid: tag for (sb, tag), pid in self._tags.items() if sb == call.sandbox_id}
        out = []
        for p in await self.hutch.processes.list(call.sandbox_id):
            if p.state == "running":
                out.append(self._info(p.pid, list(p.argv), tags.get(p.pid)))
        for t in await self.hutch.processes.list_ptys(call.sandbox_id):
            if t.state == "running":
                out.append(self._info(t.pid, list(t.argv), tags.get(t.pid)))
        return {"processes": out}

    @staticmethod
    def _info(pid: int, argv: list[str], tag: str | None) -> Message:
        info: Message = {
            "pid": pid,
            "config": {"cmd": argv[0] if argv else "", "args": argv[1:], "envs": {}},
        }
        if tag is not None:
            info["tag"] = tag
        return info

    async def _send(self, sandbox_id: str, pid: int, kind: str, data: bytes) -> None:
        if kind == "pty":
            holder = await self._holder(sandbox_id, pid)
            if holder is None:
                raise ConnectError("not_found", f"no terminal with pid {pid}")
            holder.send(data)
            return
        try:
            await self.hutch.processes.write_stdin(sandbox_id, pid, data)
        except Conflict as exc:
            raise ConnectError("failed_precondition", exc.message) from exc

    @staticmethod
    def _input(msg: Any) -> tuple[str, bytes]:
        if isinstance(msg, dict):
            for kind in ("stdin", "pty"):
                if kind in msg:
                    return kind, b64decode(msg[kind], f"input.{kind}")
        raise ConnectError("invalid_argument", "input: give {stdin} or {pty} (base64)")

    async def send_input(self, call: Call, req: Message) -> Message:
        pid = self._pid(call.sandbox_id, _selector(req))
        kind, data = self._input(req.get("input"))
        await self._send(call.sandbox_id, pid, kind, data)
        return {}

    async def stream_input(self, call: Call, messages: AsyncIterator[Message]) -> Message:
        pid: int | None = None
        async for msg in messages:
            if "start" in msg:
                pid = self._pid(call.sandbox_id, _selector(msg["start"] or {}))
            elif "data" in msg:
                if pid is None:
                    raise ConnectError("invalid_argument", "the input stream must start with start")
                kind, data = self._input((msg["data"] or {}).get("input"))
                await self._send(call.sandbox_id, pid, kind, data)
        return {}

    async def send_signal(self, call: Call, req: Message) -> Message:
        pid = self._pid(call.sandbox_id, _selector(req))
        signum = _SIGNALS.get(req.get("signal"))
        if signum is None:
            raise ConnectError(
                "invalid_argument",
                f"signal {req.get('signal')!r}: SIGNAL_SIGKILL or SIGNAL_SIGTERM",
            )
        procs = self.hutch.processes
        try:
            if (await procs.get(call.sandbox_id, pid)).state == "exited":
                raise ConnectError("not_found", f"process {pid} has already exited")
            if signum == SIGKILL:
                await procs.kill(call.sandbox_id, pid)
            else:
                await procs.signal(call.sandbox_id, pid, signum)
            return {}
        except Conflict as exc:  # exited already: gone, as envd sees it
            raise ConnectError("not_found", exc.message) from exc
        except NotFound:
            pass
        pty_id = await self._pty_id(call.sandbox_id, pid)
        if pty_id is None:
            raise ConnectError("not_found", f"no process or terminal with pid {pid}")
        if signum == SIGKILL:
            await procs.close_pty(call.sandbox_id, pty_id)
        else:
            await procs.signal_pty(call.sandbox_id, pty_id, signum)
        return {}

    async def close_stdin(self, call: Call, req: Message) -> Message:
        pid = self._pid(call.sandbox_id, _selector(req))
        try:
            await self.hutch.processes.write_stdin(call.sandbox_id, pid, b"", eof=True)
        except NotFound:
            if await self._pty_id(call.sandbox_id, pid) is not None:
                raise ConnectError(
                    "invalid_argument", "a terminal has no stdin to close; send Ctrl-D (0x04)"
                ) from None
            raise
        except Conflict as exc:
            raise ConnectError("failed_precondition", exc.message) from exc
        return {}

    async def update(self, call: Call, req: Message) -> Message:
        pid = self._pid(call.sandbox_id, _selector(req))
        size = (req.get("pty") or {}).get("size") if isinstance(req.get("pty"), dict) else None
        if not isinstance(size, dict):
            raise ConnectError("invalid_argument", "pty.size {rows, cols} is required")
        pty_id = await self._pty_id(call.sandbox_id, pid)
        if pty_id is None:
            raise ConnectError("not_found", f"no terminal with pid {pid}")
        await self.hutch.processes.resize_pty(
            call.sandbox_id, pty_id, int(size.get("rows") or 0), int(size.get("cols") or 0)
        )
        return {}
