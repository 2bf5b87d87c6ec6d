"""``sb.files``: the filesystem of one sandbox, with file watches and whole-directory
transfers. Requests are built by :class:`FileCalls`; tar packing is in ``_tar``."""

from __future__ import annotations

import builtins
import os

from hutch.contract.limits import DEFAULT_FILE_MODE
from hutch.sdk import _io_async as _io
from hutch.sdk._async._closing import AsyncClosesOnExit
from hutch.sdk._async.client import AsyncClient, AsyncResponseStream
from hutch.sdk._errors import ProtocolError
from hutch.sdk._files import (
    ArchiveWritten,
    FileCalls,
    FileEntry,
    WatchDecoder,
    WatchEvent,
    WrittenFile,
)
from hutch.sdk._streams import BytesDecoder
from hutch.sdk._tar import local_dir, tar_chunks

__all__ = ["AsyncFileWatcher", "AsyncFiles"]


class AsyncFileWatcher(AsyncClosesOnExit):
    """``for event in sb.files.watch(path)``: changes as they happen. The watch is in
    place when ``watch()`` returns. Stop with ``close()`` or a ``with`` block."""

    def __init__(self, stream: AsyncResponseStream[WatchEvent], path: str) -> None:
        self._stream = stream
        #: The watched directory as the guest names it.
        self.path = path

    @classmethod
    async def start(cls, stream: AsyncResponseStream[WatchEvent]) -> AsyncFileWatcher:
        """Wait for the guest's ``watching`` event, then hand the stream out."""
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            raise ProtocolError("the watch stream ended before it started") from None
        if first.type != "watching":
            await stream.aclose()
            raise ProtocolError(f"watch stream: expected 'watching' first, got {first!r}")
        return cls(stream, first.path)

    def __aiter__(self) -> AsyncFileWatcher:
        return self

    async def __anext__(self) -> WatchEvent:
        return await anext(self._stream)

    async def aclose(self) -> None:
        await self._stream.aclose()


class AsyncFiles:
    """The filesystem of one sandbox (``sb.files``). Relative paths are resolved by the
    guest agent (from the sandbox user's home directory)."""

    def __init__(self, client: AsyncClient, sandbox_id: str) -> None:
        self._client = client
        self._id = sandbox_id
        self._calls = FileCalls(client.core)

    async def write(
        self, path: str, data: _io.AsyncUploadData, mode: int = DEFAULT_FILE_MODE
    ) -> WrittenFile:
        """Create or replace ``path`` with ``data`` (bytes, str as UTF-8, a binary file
        object or an iterator of bytes; on the asyncio client also async iterables and
        async file objects; streamed, never loaded whole)."""
        return await self._client.write_file(self._id, path, data, mode)

    async def read(self, path: str) -> bytes:
        return await self._client.read_file(self._id, path)

    def read_stream(self, path: str) -> AsyncResponseStream[bytes]:
        """Chunks of ``path`` as they arrive; use for big files."""
        return self._client.read_file_stream(self._id, path)

    async def list(self, path: str = ".") -> builtins.list[FileEntry]:
        return await self._client.list_files(self._id, path)

    async def stat(self, path: str) -> FileEntry:
        return await self._client.stat_file(self._id, path)

    async def mkdir(self, path: str) -> FileEntry:
        """Create ``path`` and missing parents."""
        return await self._client.mkdir(self._id, path)

    async def rename(self, source: str, destination: str) -> FileEntry:
        return await self._client.rename(self._id, source, destination)

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._client.remove_file(self._id, path, recursive)

    async def watch(
        self, path: str = ".", recursive: bool = True, timeout_s: float | None = None
    ) -> AsyncFileWatcher:
        """Watch directory ``path`` for created, modified, deleted and renamed entries;
        the iteration ends after ``timeout_s`` seconds if given, or when ``path`` is
        deleted."""
        request = self._calls.watch_request(self._id, path, recursive, timeout_s)
        return await AsyncFileWatcher.start(
            AsyncResponseStream(self._client, request, WatchDecoder())
        )

    async def upload_dir(self, local: str | os.PathLike[str], remote: str) -> ArchiveWritten:
        """Copy local directory ``local``'s content into ``remote`` (created; files
        replaced, directories merged), streamed as one tar."""
        chunks = tar_chunks(local)
        try:
            upload = self._calls.upload(self._id, remote, _io.tar_pieces(chunks))
            return await self._client.call(upload)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()

    async def download_dir(self, remote: str, local: str | os.PathLike[str]) -> ArchiveWritten:
        """Copy directory ``remote``'s content into local directory ``local`` (created)."""
        local_dir(local, must_exist=False)
        request = self._calls.download_request(self._id, remote)
        async with AsyncResponseStream(self._client, request, BytesDecoder()) as stream:
            entries, total = await _io.unpack_tar(stream, local)
        return ArchiveWritten(str(local), entries, total)
