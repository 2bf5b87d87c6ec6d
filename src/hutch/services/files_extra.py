"""File watch and whole-directory transfers (tar), on top of the guest operations.

Archive transfers are work in flight (no auto-pause mid-transfer; pause, snapshot and
fork wait for them) and resume a paused ``auto_resume`` sandbox. A watch does not count:
it is an observer, and a sandbox with a watch open may still pause (the watch then ends
with an error saying so).
"""

from __future__ import annotations

from collections.abc import AsyncIterable

from hutch.guest.archive import ArchiveWritten, read_archive, write_archive
from hutch.guest.watch import FileWatch, WatchEvent, start_watch
from hutch.services.activity import LeasedBytes
from hutch.services.guest_ops import GuestOps

__all__ = ["ArchiveWritten", "FileWatch", "FilesExtraService", "WatchEvent"]


class FilesExtraService:
    def __init__(self, guest: GuestOps) -> None:
        self.guest = guest

    async def watch(self, sandbox_id: str, path: str, *, recursive: bool = True) -> FileWatch:
        """Returns once the guest watches ``path``; iterate ``.events()``, then ``close()``."""
        runtime = await self.guest.ready(sandbox_id)
        return await start_watch(runtime.agent, path, recursive=recursive)

    async def read_archive(self, sandbox_id: str, path: str) -> LeasedBytes:
        """A tar stream of directory ``path``; an error (no such directory) is raised
        here. In flight until its last byte or it is closed."""
        lease = self.guest.activity.work(sandbox_id, f"archive download {path}")
        try:
            runtime = await self.guest.ready(sandbox_id, lease)
        except BaseException:
            lease.release()
            raise
        return await LeasedBytes.open(read_archive(runtime.agent, path), lease)

    async def write_archive(
        self, sandbox_id: str, path: str, data: bytes | AsyncIterable[bytes]
    ) -> ArchiveWritten:
        with self.guest.activity.work(sandbox_id, f"archive upload {path}") as lease:
            runtime = await self.guest.ready(sandbox_id, lease)
            return await write_archive(runtime.agent, path, data)
