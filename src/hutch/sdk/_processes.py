"""Background processes in the SDK: ``sb.processes.start(...)`` → :class:`Process`.

One sans-IO core (:class:`ProcessCalls` builds each request and reads each answer;
:class:`ProcessEventDecoder` reads a followed output stream) and two thin shells that only
send: the blocking :class:`Processes`/:class:`Process` and the asyncio
:class:`AsyncProcesses`/:class:`AsyncProcess`.

A background process has no deadline unless given one, keeps running while nobody
watches (and across a memory pause), and keeps its newest 2 MiB of output (stdout and
stderr together) for :meth:`Process.output` / :meth:`Process.stream` to fetch by offset.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import httpx

from hutch.errors import InvalidArgument
from hutch.sdk._async_client import AsyncClient, AsyncResponseStream
from hutch.sdk._client import Client, ResponseStream
from hutch.sdk._core import Call, ClientCore, _cmd, _json, _list_of
from hutch.sdk._errors import ProtocolError, error_for
from hutch.sdk._types import _get, _opt, _time

__all__ = [
    "AsyncProcess",
    "AsyncProcesses",
    "Process",
    "ProcessCalls",
    "ProcessChunk",
    "ProcessDropped",
    "ProcessEnd",
    "ProcessEvent",
    "ProcessEventDecoder",
    "ProcessInfo",
    "ProcessOutput",
    "Processes",
    "SignalArg",
]

#: A signal by number (15) or name ("TERM", "SIGTERM").
SignalArg = int | str


@dataclass(frozen=True)
class ProcessInfo:
    """A background process as the daemon reported it. ``state``: running or exited;
    ``exit_code`` when it exited, ``signal`` when a signal ended it; ``timed_out``: its
    ``timeout_s`` ran out. ``output_bytes``: output produced so far (stdout + stderr);
    ``dropped_bytes``: how much of the oldest is no longer buffered."""

    pid: int
    argv: list[str]
    state: str
    exit_code: int | None
    signal: int | None
    timed_out: bool
    started_at: datetime | None
    ended_at: datetime | None
    output_bytes: int
    dropped_bytes: int
    stdin_open: bool

    @property
    def running(self) -> bool:
        return self.state == "running"

    @classmethod
    def from_dict(cls, obj: Any) -> ProcessInfo:
        w = "process"
        argv = _get(obj, "argv", list, w)
        return cls(
            pid=_get(obj, "pid", int, w),
            argv=[str(a) for a in argv],
            state=_get(obj, "state", str, w),
            exit_code=_opt(obj, "exit_code", int, w),
            signal=_opt(obj, "signal", int, w),
            timed_out=bool(_get(obj, "timed_out", bool, w)),
            started_at=_time(obj, "started_at", w),
            ended_at=_time(obj, "ended_at", w),
            output_bytes=_get(obj, "output_bytes", int, w),
            dropped_bytes=_get(obj, "dropped_bytes", int, w),
            stdin_open=bool(_get(obj, "stdin_open", bool, w)),
        )


@dataclass(frozen=True)
class ProcessOutput:
    """Buffered output from an offset. ``next_offset``: where to continue next time;
    ``dropped_bytes``: bytes after the offset asked for that were no longer buffered."""

    stdout: str
    stderr: str
    next_offset: int
    dropped_bytes: int
    process: ProcessInfo

    @classmethod
    def from_dict(cls, obj: Any) -> ProcessOutput:
        w = "process output"
        return cls(
            stdout=_get(obj, "stdout", str, w),
            stderr=_get(obj, "stderr", str, w),
            next_offset=_get(obj, "next_offset", int, w),
            dropped_bytes=_get(obj, "dropped_bytes", int, w),
            process=ProcessInfo.from_dict(_get(obj, "process", dict, w)),
        )


@dataclass(frozen=True)
class ProcessChunk:
    """Output at byte ``offset`` of the process's combined output."""

    stream: Literal["stdout", "stderr"]
    offset: int
    data: str


@dataclass(frozen=True)
class ProcessDropped:
    """The buffer overran while this stream lagged: ``bytes`` were skipped."""

    bytes: int


@dataclass(frozen=True)
class ProcessEnd:
    """The last event of a followed stream: the process exited."""

    next_offset: int
    process: ProcessInfo


ProcessEvent = ProcessChunk | ProcessDropped | ProcessEnd


class ProcessEventDecoder:
    """NDJSON output events → :data:`ProcessEvent`; an ``error`` line raises."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.done = False

    def feed(self, chunk: bytes) -> Sequence[ProcessEvent]:
        self._buffer += chunk
        events: list[ProcessEvent] = []
        while not self.done and (end := self._buffer.find(b"\n")) >= 0:
            line = bytes(self._buffer[:end]).strip()
            del self._buffer[: end + 1]
            if line:
                events.append(self._event(line))
        return events

    def eof(self) -> Sequence[ProcessEvent]:
        rest = bytes(self._buffer).strip()
        self._buffer.clear()
        events = [self._event(rest)] if rest and not self.done else []
        if not self.done:
            raise ProtocolError(
                "the process output stream ended before the process did; the daemon may "
                "have restarted or the sandbox paused: stream again from the last offset"
            )
        return events

    def _event(self, line: bytes) -> ProcessEvent:
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ProtocolError(f"process output: not a JSON line: {line[:200]!r}") from exc
        w = "process output event"
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind in ("stdout", "stderr"):
            return ProcessChunk(kind, _get(obj, "offset", int, w), _get(obj, "data", str, w))
        if kind == "dropped":
            return ProcessDropped(_get(obj, "bytes", int, w))
        if kind == "end":
            self.done = True
            return ProcessEnd(
                _get(obj, "next_offset", int, w),
                ProcessInfo.from_dict(_get(obj, "process", dict, w)),
            )
        if kind == "error":
            self.done = True
            code, message = obj.get("code"), obj.get("message")
            raise error_for(
                code if isinstance(code, str) else None,
                None,
                message if isinstance(message, str) else f"process output failed: {obj!r}",
            )
        raise ProtocolError(f"process output: unknown event {obj!r}")


def _signal(sig: SignalArg) -> int | str:
    if isinstance(sig, bool) or not isinstance(sig, int | str) or sig in ("", 0):
        raise InvalidArgument(f"signal={sig!r}; give a number (15) or a name ('TERM')")
    return sig


def _pid(pid: int) -> int:
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise InvalidArgument(f"pid={pid!r} must be a positive integer")
    return pid


class ProcessCalls:
    """Builds every background-process request of API v1. No I/O."""

    def __init__(self, core: ClientCore) -> None:
        self.core = core

    def _path(self, sandbox_id: str, pid: int | None = None, suffix: str = "") -> str:
        tail = "/processes" if pid is None else f"/processes/{_pid(pid)}"
        return self.core._sandbox_path(sandbox_id, tail + suffix)

    def start(
        self,
        sandbox_id: str,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        keep_stdin: bool = False,
        timeout_s: float | None = None,
    ) -> Call[ProcessInfo]:
        body: dict[str, Any] = {"cmd": _cmd(cmd)}
        if env:
            body["env"] = dict(env)
        if cwd is not None:
            body["cwd"] = cwd
        if user is not None:
            body["user"] = user
        if stdin is not None:
            body["stdin"] = stdin.decode() if isinstance(stdin, bytes) else stdin
        if keep_stdin:
            body["keep_stdin"] = True
        if timeout_s is not None:
            if timeout_s <= 0:
                raise InvalidArgument(f"timeout_s={timeout_s!r} must be > 0 seconds")
            body["timeout_s"] = timeout_s
        req = self.core.request("POST", self._path(sandbox_id), json_body=body)
        return Call(req, lambda r: ProcessInfo.from_dict(_json(r)))

    def list(self, sandbox_id: str) -> Call[builtins.list[ProcessInfo]]:
        req = self.core.request("GET", self._path(sandbox_id))
        return Call(req, _list_of("processes", ProcessInfo.from_dict))

    def get(self, sandbox_id: str, pid: int) -> Call[ProcessInfo]:
        req = self.core.request("GET", self._path(sandbox_id, pid))
        return Call(req, lambda r: ProcessInfo.from_dict(_json(r)))

    def output(self, sandbox_id: str, pid: int, offset: int = 0) -> Call[ProcessOutput]:
        req = self.core.request(
            "GET", self._path(sandbox_id, pid, "/output"), params=[("offset", _offset(offset))]
        )
        return Call(req, lambda r: ProcessOutput.from_dict(_json(r)))

    def follow_request(self, sandbox_id: str, pid: int, offset: int = 0) -> httpx.Request:
        # No read bound: a quiet process may print nothing for hours.
        return self.core.request(
            "GET",
            self._path(sandbox_id, pid, "/output"),
            params=[("offset", _offset(offset)), ("follow", "true")],
            read_timeout=None,
        )

    def write_stdin(
        self, sandbox_id: str, pid: int, data: str | bytes, eof: bool = False
    ) -> Call[ProcessInfo]:
        content = data.encode() if isinstance(data, str) else bytes(data)
        req = self.core.request(
            "POST",
            self._path(sandbox_id, pid, "/stdin"),
            params=[("eof", "true" if eof else "false")],
            content=content,
        )
        return Call(req, lambda r: ProcessInfo.from_dict(_json(r)))

    def signal(self, sandbox_id: str, pid: int, sig: SignalArg) -> Call[ProcessInfo]:
        req = self.core.request(
            "POST", self._path(sandbox_id, pid, "/signal"), json_body={"signal": _signal(sig)}
        )
        return Call(req, lambda r: ProcessInfo.from_dict(_json(r)))

    def kill(self, sandbox_id: str, pid: int) -> Call[ProcessInfo]:
        req = self.core.request("DELETE", self._path(sandbox_id, pid))
        return Call(req, lambda r: ProcessInfo.from_dict(_json(r)))

    def wait(self, sandbox_id: str, pid: int, timeout_s: float | None = None) -> Call[ProcessInfo]:
        params: list[tuple[str, str]] = []
        read = self.core.config.timeouts.read
        read_timeout: float | None = None
        if timeout_s is not None:
            if timeout_s < 0:
                raise InvalidArgument(f"timeout_s={timeout_s!r} must be >= 0 seconds")
            params.append(("timeout_s", str(timeout_s)))
            read_timeout = None if read is None else timeout_s + read
        req = self.core.request(
            "POST",
            self._path(sandbox_id, pid, "/wait"),
            params=params,
            read_timeout=read_timeout,
        )
        return Call(req, lambda r: ProcessInfo.from_dict(_json(r)))


def _offset(offset: int) -> str:
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise InvalidArgument(f"offset={offset!r} must be a byte offset >= 0")
    return str(offset)


# -- blocking shell -------------------------------------------------------------------


class Process:
    """A background process in a sandbox (``sb.processes.start(...)``)."""

    def __init__(self, client: Client, sandbox_id: str, info: ProcessInfo) -> None:
        self._client = client
        self._calls = ProcessCalls(client.core)
        self._sandbox_id = sandbox_id
        self._info = info

    @property
    def pid(self) -> int:
        return self._info.pid

    @property
    def info(self) -> ProcessInfo:
        """What the daemon said last; :meth:`refresh` asks again."""
        return self._info

    def _keep(self, info: ProcessInfo) -> ProcessInfo:
        self._info = info
        return info

    def refresh(self) -> ProcessInfo:
        return self._keep(self._client.call(self._calls.get(self._sandbox_id, self.pid)))

    def output(self, offset: int = 0) -> ProcessOutput:
        """What is buffered from ``offset`` on (stdout and stderr apart)."""
        out = self._client.call(self._calls.output(self._sandbox_id, self.pid, offset))
        self._info = out.process
        return out

    def stream(self, offset: int = 0) -> ResponseStream[ProcessEvent]:
        """Output from ``offset``, live until the process exits (the last event is a
        :class:`ProcessEnd`). Use ``with`` or ``close()`` to stop early."""
        request = self._calls.follow_request(self._sandbox_id, self.pid, offset)
        return ResponseStream(self._client, request, ProcessEventDecoder())

    def write_stdin(self, data: str | bytes, eof: bool = False) -> ProcessInfo:
        """Write to its stdin (it must have been started with ``keep_stdin=True``)."""
        call = self._calls.write_stdin(self._sandbox_id, self.pid, data, eof)
        return self._keep(self._client.call(call))

    def close_stdin(self) -> ProcessInfo:
        return self.write_stdin(b"", eof=True)

    def signal(self, sig: SignalArg) -> ProcessInfo:
        """Signal its process group. ``Conflict`` if it has already exited."""
        return self._keep(self._client.call(self._calls.signal(self._sandbox_id, self.pid, sig)))

    def kill(self) -> ProcessInfo:
        """SIGKILL its process group; returns it exited (a no-op if it already was)."""
        return self._keep(self._client.call(self._calls.kill(self._sandbox_id, self.pid)))

    def wait(self, timeout_s: float | None = None) -> ProcessInfo:
        """Wait for the exit; after ``timeout_s`` it comes back still running."""
        call = self._calls.wait(self._sandbox_id, self.pid, timeout_s)
        return self._keep(self._client.call(call))

    def __repr__(self) -> str:
        return f"Process(pid={self.pid}, state={self._info.state!r}, argv={self._info.argv!r})"


class Processes:
    """``sb.processes``: commands running detached in the sandbox."""

    def __init__(self, client: Client, sandbox_id: str) -> None:
        self._client = client
        self._calls = ProcessCalls(client.core)
        self._id = sandbox_id

    def start(
        self,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        keep_stdin: bool = False,
        timeout_s: float | None = None,
    ) -> Process:
        """Start ``cmd`` (a string runs with /bin/sh -c) and return at once. ``stdin`` is
        written first; ``keep_stdin`` keeps the pipe open for ``write_stdin``."""
        call = self._calls.start(
            self._id,
            cmd,
            env=env,
            cwd=cwd,
            user=user,
            stdin=stdin,
            keep_stdin=keep_stdin,
            timeout_s=timeout_s,
        )
        return Process(self._client, self._id, self._client.call(call))

    def list(self) -> builtins.list[Process]:
        infos = self._client.call(self._calls.list(self._id))
        return [Process(self._client, self._id, info) for info in infos]

    def get(self, pid: int) -> Process:
        """``NotFound`` if the sandbox has no such background process."""
        return Process(self._client, self._id, self._client.call(self._calls.get(self._id, pid)))


# -- asyncio shell --------------------------------------------------------------------


class AsyncProcess:
    """A background process of an ``AsyncSandbox``; see :class:`Process`."""

    def __init__(self, client: AsyncClient, sandbox_id: str, info: ProcessInfo) -> None:
        self._client = client
        self._calls = ProcessCalls(client.core)
        self._sandbox_id = sandbox_id
        self._info = info

    @property
    def pid(self) -> int:
        return self._info.pid

    @property
    def info(self) -> ProcessInfo:
        return self._info

    def _keep(self, info: ProcessInfo) -> ProcessInfo:
        self._info = info
        return info

    async def refresh(self) -> ProcessInfo:
        return self._keep(await self._client.call(self._calls.get(self._sandbox_id, self.pid)))

    async def output(self, offset: int = 0) -> ProcessOutput:
        out = await self._client.call(self._calls.output(self._sandbox_id, self.pid, offset))
        self._info = out.process
        return out

    def stream(self, offset: int = 0) -> AsyncResponseStream[ProcessEvent]:
        request = self._calls.follow_request(self._sandbox_id, self.pid, offset)
        return AsyncResponseStream(self._client, request, ProcessEventDecoder())

    async def write_stdin(self, data: str | bytes, eof: bool = False) -> ProcessInfo:
        call = self._calls.write_stdin(self._sandbox_id, self.pid, data, eof)
        return self._keep(await self._client.call(call))

    async def close_stdin(self) -> ProcessInfo:
        return await self.write_stdin(b"", eof=True)

    async def signal(self, sig: SignalArg) -> ProcessInfo:
        call = self._calls.signal(self._sandbox_id, self.pid, sig)
        return self._keep(await self._client.call(call))

    async def kill(self) -> ProcessInfo:
        return self._keep(await self._client.call(self._calls.kill(self._sandbox_id, self.pid)))

    async def wait(self, timeout_s: float | None = None) -> ProcessInfo:
        call = self._calls.wait(self._sandbox_id, self.pid, timeout_s)
        return self._keep(await self._client.call(call))

    def __repr__(self) -> str:
        return f"AsyncProcess(pid={self.pid}, state={self._info.state!r})"


class AsyncProcesses:
    """``sb.processes`` of an ``AsyncSandbox``; see :class:`Processes`."""

    def __init__(self, client: AsyncClient, sandbox_id: str) -> None:
        self._client = client
        self._calls = ProcessCalls(client.core)
        self._id = sandbox_id

    async def start(
        self,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        keep_stdin: bool = False,
        timeout_s: float | None = None,
    ) -> AsyncProcess:
        call = self._calls.start(
            self._id,
            cmd,
            env=env,
            cwd=cwd,
            user=user,
            stdin=stdin,
            keep_stdin=keep_stdin,
            timeout_s=timeout_s,
        )
        return AsyncProcess(self._client, self._id, await self._client.call(call))

    async def list(self) -> builtins.list[AsyncProcess]:
        infos = await self._client.call(self._calls.list(self._id))
        return [AsyncProcess(self._client, self._id, info) for info in infos]

    async def get(self, pid: int) -> AsyncProcess:
        info = await self._client.call(self._calls.get(self._id, pid))
        return AsyncProcess(self._client, self._id, info)
