"""Host side of the agent's interactive terminals (``pty_*`` operations).

A terminal lives in the guest until its program exits or it is closed: dropping the
stream attached to it (a closed WebSocket, a daemon restart, a memory pause) leaves it
running with a bounded scrollback, and :meth:`GuestPtys.attach` picks it up again,
replaying the scrollback first. See ``guest_agent/hutch_agent/ops_pty.py``.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from hutch.contract.limits import PTY_SIZE_RANGE
from hutch.errors import GuestError, InvalidArgument
from hutch.guest._stream import StreamState
from hutch.guest.client import AgentClient
from hutch.guest.commands import program_fields
from hutch.guest.processes import agent_call, frame_error
from hutch.guest.protocol import CHANNEL_DATA, FrameType

__all__ = ["GuestPtys", "PtyEnd", "PtyInfo", "PtySession"]

_FEATURE = "interactive terminals"
SIZE_RANGE = PTY_SIZE_RANGE


@dataclass(frozen=True)
class PtyInfo:
    pty_id: str
    pid: int
    argv: tuple[str, ...]
    state: Literal["running", "exited"]
    exit_code: int | None
    signal: int | None
    rows: int
    cols: int
    attached: bool
    started_at: float
    ended_at: float | None

    @classmethod
    def from_wire(cls, data: Any) -> PtyInfo:
        try:
            return cls(
                pty_id=str(data["pty_id"]),
                pid=int(data["pid"]),
                argv=tuple(str(a) for a in data["argv"]),
                state="exited" if data["state"] == "exited" else "running",
                exit_code=None if data.get("exit_code") is None else int(data["exit_code"]),
                signal=None if data.get("signal") is None else int(data["signal"]),
                rows=int(data.get("rows", 0)),
                cols=int(data.get("cols", 0)),
                attached=bool(data.get("attached")),
                started_at=float(data["started_at"]),
                ended_at=None if data.get("ended_at") is None else float(data["ended_at"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise GuestError(f"the guest agent sent a malformed terminal: {data!r}") from exc


@dataclass(frozen=True)
class PtyEnd:
    """Why an attached session ended: the program exited (``exit_code``/``signal``), or
    another client attached to the same terminal (``detached``)."""

    detached: bool
    exit_code: int | None
    signal: int | None


def check_size(rows: int, cols: int) -> None:
    lo, hi = SIZE_RANGE
    for name, value in (("rows", rows), ("cols", cols)):
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise InvalidArgument(f"{name}={value!r} is out of range; accepted: {lo}-{hi}")


class PtySession:
    """One stream attached to a terminal: iterate :meth:`output`, :meth:`send` input.

    :meth:`detach` (or losing the connection) leaves the terminal running.
    """

    def __init__(self, agent: AgentClient, state: StreamState, pty_id: str, pid: int) -> None:
        self._agent = agent
        self._state = state
        self.pty_id = pty_id
        self.pid = pid
        self.end: PtyEnd | None = None
        self._input: asyncio.Queue[bytes | None] = asyncio.Queue()
        # Input rides the stream's credit window through upload(), fed from a queue.
        self._uploader = asyncio.create_task(state.upload(self._pending(), CHANNEL_DATA))

    async def _pending(self) -> AsyncIterator[bytes]:
        while (data := await self._input.get()) is not None:
            yield data

    def send(self, data: bytes) -> None:
        """Queue keyboard input for the terminal (sent in order, flow-controlled)."""
        if data:
            self._input.put_nowait(bytes(data))

    async def output(self) -> AsyncIterator[bytes]:
        """Terminal output until the program exits or the session is detached."""
        while self.end is None:
            frame = await self._state.next()
            if frame.type is FrameType.DATA:
                yield frame.payload
            elif frame.type is FrameType.END:
                h = frame.header
                self.end = PtyEnd(
                    detached=bool(h.get("detached")),
                    exit_code=None if h.get("exit_code") is None else int(h["exit_code"]),
                    signal=None if h.get("signal") is None else int(h["signal"]),
                )
                await self.detach()
            else:
                raise frame_error(self._state, frame, _FEATURE)

    async def detach(self) -> None:
        """Stop this session; the terminal keeps running in the guest. Idempotent."""
        self._agent.close_stream(self._state)
        if not self._uploader.done():
            self._uploader.cancel()
        with contextlib.suppress(asyncio.CancelledError, GuestError):
            await self._uploader


class GuestPtys:
    """Terminals of one guest, over its agent connection."""

    def __init__(self, agent: AgentClient) -> None:
        self._agent = agent

    async def _call(self, header: dict[str, Any]) -> dict[str, Any]:
        return await agent_call(self._agent, header, _FEATURE)

    async def _session(self, header: dict[str, Any]) -> PtySession:
        state = await self._agent.open_stream(header)
        try:
            frame = await state.next()
            if frame.type is not FrameType.REPLY or frame.header.get("event") != "ready":
                raise frame_error(state, frame, _FEATURE)
        except BaseException:
            self._agent.close_stream(state)
            raise
        return PtySession(
            self._agent, state, str(frame.header["pty_id"]), int(frame.header.get("pid", 0))
        )

    async def open(
        self,
        argv: builtins.list[str] | None = None,
        *,
        shell: str | None = None,
        rows: int = 24,
        cols: int = 80,
        term: str = "xterm-256color",
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
    ) -> PtySession:
        """Start ``argv`` (or ``shell`` via /bin/sh -c; default: a login shell) on a new
        terminal and attach to it."""
        check_size(rows, cols)
        if argv is not None and shell is not None:
            raise InvalidArgument("give argv or shell, not both")
        header: dict[str, Any] = {
            "op": "pty_open", "rows": rows, "cols": cols, "term": term,
            **program_fields(argv, shell, env, cwd, user),
        }  # fmt: skip
        return await self._session(header)

    async def attach(self, pty_id: str) -> PtySession:
        """Reattach: the scrollback comes first, then live output. NotFound for an
        unknown id, Conflict for a terminal whose program has exited."""
        return await self._session({"op": "pty_attach", "pty_id": pty_id})

    async def resize(self, pty_id: str, rows: int, cols: int) -> None:
        check_size(rows, cols)
        await self._call({"op": "pty_resize", "pty_id": pty_id, "rows": rows, "cols": cols})

    async def signal(self, pty_id: str, signum: int) -> None:
        """Signal the terminal's foreground process group (what Ctrl-C reaches)."""
        await self._call({"op": "pty_signal", "pty_id": pty_id, "signal": int(signum)})

    async def close(self, pty_id: str) -> PtyInfo:
        """Hang up the terminal (SIGHUP, then SIGKILL) and forget it."""
        return PtyInfo.from_wire(
            (await self._call({"op": "pty_close", "pty_id": pty_id})).get("pty")
        )

    async def list(self) -> builtins.list[PtyInfo]:
        reply = await self._call({"op": "pty_list"})
        return [PtyInfo.from_wire(t) for t in reply.get("ptys", [])]
