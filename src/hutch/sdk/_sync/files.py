# Generated from src/hutch/sdk/_async/files.py by scripts/unasync.py: do not edit.
"""``sb.files``: the filesystem of one sandbox, with file watches and whole-directory
transfers. Requests are built by :class:`FileCalls`; tar packing is in ``_tar``."""

from __future__ import annotations

import builtins
import os

from hutch.contract.limits import DEFAULT_FILE_MODE
from hutch.sdk import _io_sync as _io
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
from hutch.sdk._sync._closing import ClosesOnExit
from hutch.sdk._sync.client import Client, ResponseStream
from hutch.sdk._tar import local_dir, tar_chunks

__all__ = ["FileWatcher", "Files"]


class FileWatcher(ClosesOnExit):
    """``for event in sb.files.watch(path)``: changes as they happen. The watch is in
    place when ``watch()`` returns. Stop with ``close()`` or a ``with`` block."""

    def __init__(self, stream: ResponseStream[WatchEvent], path: str) -> None:
        self._stream = stream
        #: The watched directory as the guest names it.
        self.path = path

    @classmethod
    def start(cls, stream: ResponseStream[WatchEvent]) -> FileWatcher:
        """Wait for the guest's ``watching`` event, then hand the stream out."""
        try:
            first = next(stream)
        except StopIteration:
            raise ProtocolError("the watch stream ended before it started") from None
        if first.type != "watching":
            stream.close()
            raise ProtocolError(f"watch stream: expected 'watching' first, got {first!r}")
        return cls(stream, first.path)

    def __iter__(self) -> FileWatcher:
        return self

    def __next__(self) -> WatchEvent:
        return next(self._stream)

    def close(self) -> None:
        self._stream.close()


class Files:
    """The filesystem of one sandbox (``sb.files``). Relative paths are resolved by the
    guest agent (from the sandbox user's home directory)."""

    def __init__(self, client: Client, sandbox_id: str) -> None:
        self._client = client
        self._id = sandbox_id
        self._calls = FileCalls(client.core)

    def write(self, path: str, data: _io.UploadData, mode: int = DEFAULT_FILE_MODE) -> WrittenFile:
        """Create or replace ``path`` with ``data`` (bytes, str as UTF-8, a binary file
        object or an iterator of bytes; on the asyncio client also async iterables and
        async file objects; streamed, never loaded whole)."""
        return self._client.write_file(self._id, path, data, mode)

    def read(self, path: str) -> bytes:
        return self._client.read_file(self._id, path)

    def read_stream(self, path: str) -> ResponseStream[bytes]:
        """Chunks of ``path`` as they arrive; use for big files."""
        return self._client.read_file_stream(self._id, path)

    def list(self, path: str = ".") -> builtins.list[FileEntry]:
        return self._client.list_files(self._id, path)

    def stat(self, path: str) -> FileEntry:
        return self._client.stat_file(self._id, path)

    def mkdir(self, path: str) -> FileEntry:
        """Create ``path`` and missing parents."""
        return self._client.mkdir(self._id, path)

    def rename(self, source: str, destination: str) -> FileEntry:
        return self._client.rename(self._id, source, destination)

    def remove(self, path: str, recursive: bool = False) -> None:
        self._client.remove_file(self._id, path, recursive)

    def watch(
        self, path: str = ".", recursive: bool = True, timeout_s: float | None = None
    ) -> FileWatcher:
        """Watch directory ``path`` for created, modified, deleted and renamed entries;
        the iteration ends after ``timeout_s`` seconds if given, or when ``path`` is
        deleted."""
        request = self._calls.watch_request(self._id, path, recursive, timeout_s)
        return FileWatcher.start(ResponseStream(self._client, request, WatchDecoder()))

    def upload_dir(self, local: str | os.PathLike[str], remote: str) -> ArchiveWritten:
        """Copy local directory ``local``'s content into ``remote`` (created; files
        replaced, directories merged), streamed as one tar."""
        chunks = tar_chunks(local)
        try:
            upload = self._calls.upload(self._id, remote, _io.tar_pieces(chunks))
            return self._client.call(upload)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()

    def download_dir(self, remote: str, local: str | os.PathLike[str]) -> ArchiveWritten:
        """Copy directory ``remote``'s content into local directory ``local`` (created)."""
        local_dir(local, must_exist=False)
        request = self._calls.download_request(self._id, remote)
        with ResponseStream(self._client, request, BytesDecoder()) as stream:
            entries, total = _io.unpack_tar(stream, local)
        return ArchiveWritten(str(local), entries, total)
