"""Background processes in the SDK, sans-IO: ``sb.processes.start(...)`` → ``Process``.

:class:`ProcessCalls` builds each request and reads each answer; :class:`ProcessEventDecoder`
reads a followed output stream. The shells (``Processes``/``Process`` and their asyncio
twins) are in ``_async/processes.py`` and, generated from it, ``_sync/processes.py``.

A background process has no deadline unless given one, keeps running while nobody
watches (and across a memory pause), and keeps its newest 2 MiB of output (stdout and
stderr together) for :meth:`Process.output` / :meth:`Process.stream` to fetch by offset.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import httpx

from hutch.errors import InvalidArgument
from hutch.sdk._core import Call, ClientCore, list_of, one
from hutch.sdk._errors import ProtocolError
from hutch.sdk._exec import CommandArgs, command_body
from hutch.sdk._streams import LineDecoder, error_line
from hutch.sdk._values import maybe, moment, need

__all__ = [
    "ProcessCalls",
    "ProcessChunk",
    "ProcessDropped",
    "ProcessEnd",
    "ProcessEvent",
    "ProcessEventDecoder",
    "ProcessInfo",
    "ProcessOutput",
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
        argv = need(obj, "argv", list, w)
        return cls(
            pid=need(obj, "pid", int, w),
            argv=[str(a) for a in argv],
            state=need(obj, "state", str, w),
            exit_code=maybe(obj, "exit_code", int, w),
            signal=maybe(obj, "signal", int, w),
            timed_out=bool(need(obj, "timed_out", bool, w)),
            started_at=moment(obj, "started_at", w),
            ended_at=moment(obj, "ended_at", w),
            output_bytes=need(obj, "output_bytes", int, w),
            dropped_bytes=need(obj, "dropped_bytes", int, w),
            stdin_open=bool(need(obj, "stdin_open", bool, w)),
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
            stdout=need(obj, "stdout", str, w),
            stderr=need(obj, "stderr", str, w),
            next_offset=need(obj, "next_offset", int, w),
            dropped_bytes=need(obj, "dropped_bytes", int, w),
            process=ProcessInfo.from_dict(need(obj, "process", dict, w)),
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


class ProcessEventDecoder(LineDecoder[ProcessEvent]):
    """NDJSON output events → :data:`ProcessEvent`; an ``error`` line raises."""

    what = "process output"
    ended_early = (
        "the process output stream ended before the process did; the daemon may "
        "have restarted or the sandbox paused: stream again from the last offset"
    )

    def item(self, obj: Any) -> ProcessEvent:
        w = "process output event"
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind in ("stdout", "stderr"):
            return ProcessChunk(kind, need(obj, "offset", int, w), need(obj, "data", str, w))
        if kind == "dropped":
            return ProcessDropped(need(obj, "bytes", int, w))
        if kind == "end":
            self.done = True
            return ProcessEnd(
                need(obj, "next_offset", int, w),
                ProcessInfo.from_dict(need(obj, "process", dict, w)),
            )
        if kind == "error":
            self.done = True
            raise error_line(obj, "process output failed")
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
        return self.core.sandbox_path(sandbox_id, tail + suffix)

    def start(
        self,
        sandbox_id: str,
        cmd: str | Sequence[str],
        args: CommandArgs,
        *,
        keep_stdin: bool = False,
    ) -> Call[ProcessInfo]:
        body = command_body(cmd, args)
        if keep_stdin:
            body["keep_stdin"] = True
        req = self.core.request("POST", self._path(sandbox_id), json_body=body)
        return Call(req, one(ProcessInfo.from_dict))

    def list(self, sandbox_id: str) -> Call[builtins.list[ProcessInfo]]:
        req = self.core.request("GET", self._path(sandbox_id))
        return Call(req, list_of("processes", ProcessInfo.from_dict))

    def get(self, sandbox_id: str, pid: int) -> Call[ProcessInfo]:
        req = self.core.request("GET", self._path(sandbox_id, pid))
        return Call(req, one(ProcessInfo.from_dict))

    def output(self, sandbox_id: str, pid: int, offset: int = 0) -> Call[ProcessOutput]:
        req = self.core.request(
            "GET", self._path(sandbox_id, pid, "/output"), params=[("offset", _offset(offset))]
        )
        return Call(req, one(ProcessOutput.from_dict))

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
        return Call(req, one(ProcessInfo.from_dict))

    def signal(self, sandbox_id: str, pid: int, sig: SignalArg) -> Call[ProcessInfo]:
        req = self.core.request(
            "POST", self._path(sandbox_id, pid, "/signal"), json_body={"signal": _signal(sig)}
        )
        return Call(req, one(ProcessInfo.from_dict))

    def kill(self, sandbox_id: str, pid: int) -> Call[ProcessInfo]:
        req = self.core.request("DELETE", self._path(sandbox_id, pid))
        return Call(req, one(ProcessInfo.from_dict))

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
        return Call(req, one(ProcessInfo.from_dict))


def _offset(offset: int) -> str:
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise InvalidArgument(f"offset={offset!r} must be a byte offset >= 0")
    return str(offset)
