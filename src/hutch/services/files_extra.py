"""File watch and whole-directory transfers (tar), on top of :class:`SandboxService`.

Archive transfers are work in flight (no auto-pause mid-transfer; pause, snapshot and
fork wait for them) and resume a paused ``auto_resume`` sandbox. A watch does not count:
it is an observer, and a sandbox with a watch open may still pause (the watch then ends
with an error saying so).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

from hutch.guest.archive import ArchiveWritten, read_archive, write_archive
from hutch.guest.watch import FileWatch, WatchEvent, start_watch
from hutch.services.inflight import Work
from hutch.services.sandboxes import SandboxService

__all__ = ["ArchiveWritten", "FileWatch", "FilesExtraService", "WatchEvent"]


class FilesExtraService:
    def __init__(self, sandboxes: SandboxService) -> None:
        self.sandboxes = sandboxes

    async def watch(self, sandbox_id: str, path: str, *, recursive: bool = True) -> FileWatch:
        """Returns once the guest watches ``path``; iterate ``.events()``, then ``close()``."""
        runtime = await self.sandboxes.ready(sandbox_id)
        return await start_watch(runtime.agent, path, recursive=recursive)

    async def read_archive(
        self, sandbox_id: str, path: str, work: Work | None = None
    ) -> AsyncIterator[bytes]:
        """A tar stream of directory ``path``; errors surface on the first chunk. The
        caller ends ``work`` (``sandboxes.begin_work``) once the stream is done."""
        runtime = await self.sandboxes.ready(sandbox_id, work)
        return read_archive(runtime.agent, path)

    async def write_archive(
        self, sandbox_id: str, path: str, data: bytes | AsyncIterable[bytes]
    ) -> ArchiveWritten:
        with self.sandboxes.work(sandbox_id, f"archive upload {path}") as work:
            runtime = await self.sandboxes.ready(sandbox_id, work)
            return await write_archive(runtime.agent, path, data)
