"""Host side of the agent's background processes (``proc_*`` operations).

A background process belongs to the guest, not to this connection: it keeps running
and buffering its output while the host is away (a memory pause, a daemon restart), and
is found again by its pid. See ``guest_agent/hutch_agent/ops_process.py`` for the wire
format.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from hutch.errors import GuestError, InvalidArgument
from hutch.guest._stream import StreamState
from hutch.guest.client import AgentClient, command_header
from hutch.guest.protocol import CHANNEL_STDERR, Frame, FrameType

__all__ = [
    "GuestProcesses",
    "OutputChunk",
    "OutputEnd",
    "OutputStream",
    "ProcessInfo",
    "agent_call",
    "frame_error",
]


@dataclass(frozen=True)
class ProcessInfo:
    """A background process as the agent sees it. ``output_bytes`` counts all output
    produced (stdout and stderr together); ``dropped_bytes`` how much of it the bounded
    buffer no longer holds (reading from an offset below that starts at it)."""

    pid: int
    argv: tuple[str, ...]
    state: Literal["running", "exited"]
    exit_code: int | None
    signal: int | None
    timed_out: bool
    started_at: float
    ended_at: float | None
    output_bytes: int
    dropped_bytes: int
    stdin_open: bool

    @classmethod
    def from_wire(cls, data: Any) -> ProcessInfo:
        try:
            return cls(
                pid=int(data["pid"]),
                argv=tuple(str(a) for a in data["argv"]),
                state="exited" if data["state"] == "exited" else "running",
                exit_code=None if data.get("exit_code") is None else int(data["exit_code"]),
                signal=None if data.get("signal") is None else int(data["signal"]),
                timed_out=bool(data.get("timed_out")),
                started_at=float(data["started_at"]),
                ended_at=None if data.get("ended_at") is None else float(data["ended_at"]),
                output_bytes=int(data.get("output_bytes", 0)),
                dropped_bytes=int(data.get("dropped_bytes", 0)),
                stdin_open=bool(data.get("stdin_open")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise GuestError(f"the guest agent sent a malformed process: {data!r}") from exc


@dataclass(frozen=True)
class OutputChunk:
    """Output bytes starting at ``offset`` of the process's combined output."""

    stream: Literal["stdout", "stderr"]
    offset: int
    data: bytes


@dataclass(frozen=True)
class OutputEnd:
    """Where a read stopped: pass ``next_offset`` to continue later."""

    next_offset: int
    process: ProcessInfo


def frame_error(state: StreamState, frame: Frame, feature: str) -> Exception:
    """The hutch error for a frame that is not the expected one; an agent too old for
    ``feature`` gets a Conflict saying to rebuild the image."""
    return state.unexpected(frame, feature)


async def agent_call(agent: AgentClient, header: dict[str, Any], feature: str) -> dict[str, Any]:
    """One request, its END header back (errors mapped by :func:`frame_error`)."""
    state = await agent.open_stream(header)
    try:
        frame = await state.next()
        if frame.type is not FrameType.END:
            raise frame_error(state, frame, feature)
        return frame.header
    finally:
        agent.close_stream(state)


_FEATURE = "background processes"


class OutputStream:
    """A process's output from an offset. Iterate for chunks; ``end`` is set once the
    agent finished (without ``follow``: at the current end; with it: at the exit)."""

    def __init__(self, agent: AgentClient, state: StreamState) -> None:
        self._agent = agent
        self._state = state
        self.end: OutputEnd | None = None

    def __aiter__(self) -> AsyncIterator[OutputChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[OutputChunk]:
        try:
            while self.end is None:
                frame = await self._state.next()
                if frame.type is FrameType.DATA:
                    yield OutputChunk(
                        "stderr" if frame.channel == CHANNEL_STDERR else "stdout",
                        int(frame.header.get("offset", 0)),
                        frame.payload,
                    )
                elif frame.type is FrameType.END:
                    self.end = OutputEnd(
                        int(frame.header.get("next_offset", 0)),
                        ProcessInfo.from_wire(frame.header.get("process")),
                    )
                else:
                    raise frame_error(self._state, frame, _FEATURE)
        finally:
            self._agent.close_stream(self._state)

    async def aclose(self) -> None:
        """Stop reading; the process is not affected."""
        self._agent.close_stream(self._state)


class GuestProcesses:
    """Background processes of one guest, over its agent connection."""

    def __init__(self, agent: AgentClient) -> None:
        self._agent = agent

    async def _call(self, header: dict[str, Any]) -> dict[str, Any]:
        return await agent_call(self._agent, header, _FEATURE)

    async def start(
        self,
        argv: list[str] | None = None,
        *,
        shell: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: bool = False,
        timeout_s: float | None = None,
    ) -> ProcessInfo:
        """Start a detached process. With ``stdin`` its stdin is a pipe that
        :meth:`write_stdin` feeds (else /dev/null). No deadline unless ``timeout_s``."""
        header = command_header(
            "proc_start", argv, shell, env, cwd, user, timeout_s, stdin=bool(stdin)
        )
        return ProcessInfo.from_wire((await self._call(header)).get("process"))

    async def list(self) -> builtins.list[ProcessInfo]:
        reply = await self._call({"op": "proc_list"})
        return [ProcessInfo.from_wire(p) for p in reply.get("processes", [])]

    async def get(self, pid: int) -> ProcessInfo:
        return ProcessInfo.from_wire(
            (await self._call({"op": "proc_get", "pid": pid})).get("process")
        )

    async def output(self, pid: int, offset: int = 0, *, follow: bool = False) -> OutputStream:
        """Output from ``offset``; with ``follow`` it continues live until the exit.
        An unknown pid raises NotFound on the first iteration."""
        if offset < 0:
            raise InvalidArgument(f"offset={offset}; give a byte offset >= 0")
        header = {"op": "proc_output", "pid": pid, "offset": offset, "follow": follow}
        return OutputStream(self._agent, await self._agent.open_stream(header))

    async def write_stdin(
        self, pid: int, data: bytes | AsyncIterable[bytes], *, eof: bool = False
    ) -> ProcessInfo:
        """Write to the process's stdin; ``eof`` closes it afterwards."""
        state = await self._agent.open_stream({"op": "proc_stdin", "pid": pid, "eof": eof})
        try:
            await state.upload(data)
            frame = await state.next()
            if frame.type is not FrameType.END:
                raise frame_error(state, frame, _FEATURE)
            return ProcessInfo.from_wire(frame.header.get("process"))
        finally:
            self._agent.close_stream(state)

    async def signal(self, pid: int, signum: int) -> None:
        """Signal the process group. Conflict if the process has exited."""
        await self._call({"op": "proc_signal", "pid": pid, "signal": int(signum)})

    async def kill(self, pid: int) -> ProcessInfo:
        """SIGKILL the process group and wait (briefly) for the exit."""
        return ProcessInfo.from_wire(
            (await self._call({"op": "proc_kill", "pid": pid})).get("process")
        )

    async def wait(self, pid: int, timeout_s: float | None = None) -> ProcessInfo:
        """Wait for the exit; after ``timeout_s`` the process comes back still running."""
        header: dict[str, Any] = {"op": "proc_wait", "pid": pid}
        if timeout_s is not None:
            header["timeout_s"] = timeout_s
        return ProcessInfo.from_wire((await self._call(header)).get("process"))
