"""Whole directories as tar streams over the agent's ``archive_read``/``archive_write``.

Both directions stream within the protocol's credit window: a directory of any size
never sits in memory on either side.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

from hutch.guest._lines import failure
from hutch.guest.client import AgentClient
from hutch.guest.paths import normalize_guest_path
from hutch.guest.protocol import FrameType

__all__ = ["ArchiveWritten", "read_archive", "write_archive"]


@dataclass(frozen=True)
class ArchiveWritten:
    """What an upload unpacked: members (directories included) and tar bytes read."""

    path: str
    entries: int
    bytes: int


async def read_archive(agent: AgentClient, path: str) -> AsyncIterator[bytes]:
    """An uncompressed tar stream of directory ``path`` (member names relative to it).

    Errors (NotFound, InvalidArgument for a file) surface on the first iteration.
    Leaving the loop early tells the agent to stop.
    """
    full = normalize_guest_path(path)
    state = await agent.open_stream({"op": "archive_read", "path": full})
    try:
        frame = await state.next()
        if frame.type is not FrameType.REPLY:
            raise failure(state, frame)
        while True:
            frame = await state.next()
            if frame.type is FrameType.DATA:
                yield frame.payload
            elif frame.type is FrameType.END:
                return
            else:
                raise failure(state, frame)
    finally:
        agent.close_stream(state)


async def write_archive(
    agent: AgentClient, path: str, data: bytes | AsyncIterable[bytes]
) -> ArchiveWritten:
    """Unpack a tar stream (plain or gzip) into directory ``path`` (created if missing).

    All or nothing: a refused member (absolute, ``..``, a link out of the directory, a
    device) raises InvalidArgument naming it, and nothing is written.
    """
    full = normalize_guest_path(path)
    state = await agent.open_stream({"op": "archive_write", "path": full})
    try:
        await state.upload(data)
        frame = await state.next()
        if frame.type is not FrameType.END:
            raise failure(state, frame)
        return ArchiveWritten(
            full, int(frame.header.get("entries", 0)), int(frame.header.get("bytes", 0))
        )
    finally:
        agent.close_stream(state)
