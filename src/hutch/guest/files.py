"""File operations of the guest agent client: streamed reads and atomic writes, listing,
stat, mkdir, remove and rename (paths normalized by :mod:`hutch.guest.paths`)."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

from hutch.guest.connection import AgentConnection
from hutch.guest.paths import normalize_guest_path
from hutch.guest.protocol import FrameType
from hutch.guest.results import FileEntry


class FileOps(AgentConnection):
    """The guest's files."""

    async def read_file(self, path: str) -> AsyncIterator[bytes]:
        """Stream a file's content in chunks of up to 64 KiB.

        Errors (NotFound, InvalidArgument for a directory, ...) surface on the first
        iteration. Leaving the loop early tells the agent to stop.
        """
        full = normalize_guest_path(path)
        state = await self._start({"op": "read", "path": full})
        try:
            frame = await state.next()
            if frame.type is not FrameType.REPLY:
                raise state.unexpected(frame)
            while True:
                frame = await state.next()
                if frame.type is FrameType.DATA:
                    yield frame.payload
                elif frame.type is FrameType.END:
                    return
                else:
                    raise state.unexpected(frame)
        finally:
            self._forget(state)

    async def write_file(
        self, path: str, data: bytes | AsyncIterable[bytes], *, mode: int = 0o644
    ) -> FileEntry:
        """Write a file (parents created), streaming ``data``; atomic: all or nothing."""
        full = normalize_guest_path(path)
        state = await self._start({"op": "write", "path": full, "mode": mode})
        try:
            await state.upload(data)
            return FileEntry.from_wire((await state.expect_end()).get("entry"))
        finally:
            # On any failure before END this sends CANCEL: the agent drops its temp file.
            self._forget(state)

    async def list_dir(self, path: str) -> list[FileEntry]:
        reply = await self._request({"op": "list", "path": normalize_guest_path(path)})
        return [FileEntry.from_wire(e) for e in reply.get("entries", [])]

    async def stat(self, path: str) -> FileEntry:
        reply = await self._request({"op": "stat", "path": normalize_guest_path(path)})
        return FileEntry.from_wire(reply.get("entry"))

    async def mkdir(self, path: str, *, mode: int = 0o755) -> FileEntry:
        """Create a directory and its parents; succeeds if it already is a directory."""
        reply = await self._request(
            {"op": "mkdir", "path": normalize_guest_path(path), "mode": mode}
        )
        return FileEntry.from_wire(reply.get("entry"))

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file or directory; a non-empty directory needs ``recursive``."""
        await self._request(
            {"op": "remove", "path": normalize_guest_path(path), "recursive": recursive}
        )

    async def rename(self, source: str, destination: str) -> FileEntry:
        reply = await self._request(
            {
                "op": "rename",
                "source": normalize_guest_path(source),
                "destination": normalize_guest_path(destination),
            }
        )
        return FileEntry.from_wire(reply.get("entry"))
