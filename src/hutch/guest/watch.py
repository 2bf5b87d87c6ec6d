"""File watch over the agent's ``watch`` operation (inotify in the guest).

``await start_watch(agent, path)`` returns once the guest's watches are in place (so a
change made after it returns is never missed) or raises (NotFound, InvalidArgument for
a file); iterate :meth:`FileWatch.events`; :meth:`FileWatch.close` cancels the watch.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Literal

from hutch.errors import GuestError
from hutch.guest._lines import JsonLines, failure
from hutch.guest._stream import StreamState
from hutch.guest.client import AgentClient
from hutch.guest.paths import normalize_guest_path
from hutch.guest.protocol import FrameType

__all__ = ["EVENT_TYPES", "FileWatch", "WatchEvent", "start_watch"]

EventType = Literal["created", "modified", "deleted", "renamed", "overflow"]
EVENT_TYPES: tuple[str, ...] = ("created", "modified", "deleted", "renamed", "overflow")


@dataclass(frozen=True)
class WatchEvent:
    """One change. ``renamed`` carries ``from_path``/``to_path`` (``path`` is the new
    name); ``overflow`` means the guest dropped events (its queue was full)."""

    type: EventType
    path: str
    is_dir: bool
    time: float
    from_path: str | None = None
    to_path: str | None = None

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> WatchEvent:
        kind = data.get("type")
        if kind not in EVENT_TYPES:
            raise GuestError(f"the guest agent sent an unknown watch event: {data!r}")
        try:
            return cls(
                type=kind,
                path=str(data["path"]),
                is_dir=bool(data.get("is_dir", False)),
                time=float(data["time"]),
                from_path=None if data.get("from") is None else str(data["from"]),
                to_path=None if data.get("to") is None else str(data["to"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise GuestError(f"the guest agent sent a malformed watch event: {data!r}") from exc

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": self.type,
            "path": self.path,
            "is_dir": self.is_dir,
            "time": self.time,
        }
        if self.type == "renamed":
            out["from"] = self.from_path
            out["to"] = self.to_path
        return out


class FileWatch:
    def __init__(self, agent: AgentClient, state: StreamState, path: str, watches: int) -> None:
        self._agent = agent
        self._state = state
        self.path = path
        #: Directories the guest watches (1 unless recursive).
        self.watches = watches
        #: Why the stream ended on the guest's side ("deleted": the directory went away).
        self.end_reason: str | None = None

    async def events(self) -> AsyncGenerator[WatchEvent, None]:
        """Events as they happen, until the watched directory is deleted or
        :meth:`close`. Raises GuestError if the sandbox stops."""
        lines = JsonLines("watch event")
        try:
            while True:
                frame = await self._state.next()
                if frame.type is FrameType.DATA:
                    for item in lines.feed(frame.payload):
                        yield WatchEvent.from_wire(item)
                elif frame.type is FrameType.END:
                    self.end_reason = str(frame.header.get("reason") or "") or None
                    return
                else:
                    raise failure(self._state, frame)
        finally:
            self.close()

    def close(self) -> None:
        """Stop watching (the guest removes its watches). Idempotent."""
        self._agent.close_stream(self._state)


async def start_watch(agent: AgentClient, path: str, *, recursive: bool = True) -> FileWatch:
    full = normalize_guest_path(path)
    state = await agent.open_stream({"op": "watch", "path": full, "recursive": recursive})
    try:
        frame = await state.next()
        if frame.type is not FrameType.REPLY or frame.header.get("event") != "watching":
            raise failure(state, frame)
    except BaseException:
        agent.close_stream(state)
        raise
    return FileWatch(
        agent, state, str(frame.header.get("path", full)), int(frame.header.get("watches", 1))
    )
