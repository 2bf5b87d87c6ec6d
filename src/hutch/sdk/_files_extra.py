"""File watch and whole-directory transfers in the SDK: ``sb.files.watch``,
``sb.files.upload_dir``, ``sb.files.download_dir``.

One sans-IO part (:class:`FilesExtraCalls` builds the requests; :class:`WatchDecoder`
reads the NDJSON stream; :func:`tar_chunks` and :func:`extract_tar` pack and unpack
local directories) and two thin shells, mixed into ``Files`` and ``AsyncFiles``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import tarfile
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

import httpx

from hutch.errors import InvalidArgument
from hutch.sdk._closing import AsyncClosesOnExit, ClosesOnExit
from hutch.sdk._core import Call, ClientCore, _check_path, _json
from hutch.sdk._errors import ProtocolError, error_for
from hutch.sdk._types import _get, _opt

if TYPE_CHECKING:
    from hutch.sdk._async_client import AsyncClient, AsyncResponseStream
    from hutch.sdk._client import Client, ResponseStream

__all__ = [
    "ArchiveWritten",
    "AsyncFileWatcher",
    "AsyncFilesExtra",
    "FileWatcher",
    "FilesExtra",
    "FilesExtraCalls",
    "WatchEvent",
]

WatchEventType = Literal["watching", "created", "modified", "deleted", "renamed", "overflow"]
_EVENT_TYPES = ("watching", "created", "modified", "deleted", "renamed", "overflow")
#: Upload pieces handed to httpx, and how many may wait between the tar thread and it.
_TAR_PIECE = 1 << 20
_TAR_QUEUE = 8


@dataclass(frozen=True)
class WatchEvent:
    """A change in the sandbox. ``renamed`` has ``from_path``/``to_path`` (``path`` is
    the new name); ``overflow`` means the guest dropped events (too many at once)."""

    type: WatchEventType
    path: str
    is_dir: bool
    time: float
    from_path: str | None = None
    to_path: str | None = None

    @classmethod
    def from_dict(cls, obj: Any) -> WatchEvent:
        w = "watch event"
        kind = _get(obj, "type", str, w)
        if kind not in _EVENT_TYPES:
            raise ProtocolError(f"watch stream: unknown event {obj!r}")
        return cls(
            type=kind,
            path=_get(obj, "path", str, w),
            is_dir=bool(obj.get("is_dir", True)),
            time=float(_opt(obj, "time", (int, float), w) or 0.0),
            from_path=_opt(obj, "from", str, w),
            to_path=_opt(obj, "to", str, w),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": self.type,
            "path": self.path,
            "is_dir": self.is_dir,
            "time": self.time,
        }
        if self.type == "renamed":
            out["from"], out["to"] = self.from_path, self.to_path
        return out


@dataclass(frozen=True)
class ArchiveWritten:
    """A directory transfer: where it landed, members (directories included), tar bytes."""

    path: str
    entries: int
    bytes: int

    @classmethod
    def from_dict(cls, obj: Any) -> ArchiveWritten:
        w = "archive result"
        return cls(
            path=_get(obj, "path", str, w),
            entries=_get(obj, "entries", int, w),
            bytes=_get(obj, "bytes", int, w),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "entries": self.entries, "bytes": self.bytes}


class WatchDecoder:
    """NDJSON watch stream → :class:`WatchEvent` (the first is ``watching``)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.done = False

    def feed(self, chunk: bytes) -> Sequence[WatchEvent]:
        self._buffer += chunk
        events: list[WatchEvent] = []
        while not self.done and (end := self._buffer.find(b"\n")) >= 0:
            line = bytes(self._buffer[:end]).strip()
            del self._buffer[: end + 1]
            if line:
                event = self._event(line)
                if event is not None:
                    events.append(event)
        return events

    def eof(self) -> Sequence[WatchEvent]:
        self.done = True  # a watch may end at any time (the daemon or sandbox stopped)
        return []

    def _event(self, line: bytes) -> WatchEvent | None:
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ProtocolError(f"watch stream: not a JSON line: {line[:200]!r}") from exc
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind == "end":
            self.done = True
            return None
        if kind == "error":
            self.done = True
            message = obj.get("message")
            raise error_for(
                obj.get("code") if isinstance(obj.get("code"), str) else None,
                None,
                message if isinstance(message, str) else f"watch failed: {obj!r}",
            )
        return WatchEvent.from_dict(obj)


class FilesExtraCalls:
    """Builds the watch and archive requests. No I/O."""

    def __init__(self, core: ClientCore) -> None:
        self.core = core

    def watch_request(
        self, sandbox_id: str, path: str, recursive: bool, timeout_s: float | None = None
    ) -> httpx.Request:
        params = [("path", _check_path(path)), ("recursive", "true" if recursive else "false")]
        if timeout_s is not None:
            if timeout_s <= 0:
                raise InvalidArgument(f"timeout_s={timeout_s!r} must be > 0 seconds")
            params.append(("timeout_s", repr(float(timeout_s))))
        # A quiet directory sends nothing for as long as it stays quiet: no read timeout.
        return self.core.request(
            "GET",
            self.core._sandbox_path(sandbox_id, "/files/watch"),
            params=params,
            read_timeout=None,
        )

    def download_request(self, sandbox_id: str, path: str) -> httpx.Request:
        params = [("path", _check_path(path))]
        return self.core.request(
            "GET", self.core._sandbox_path(sandbox_id, "/files/archive"), params=params
        )

    def upload(self, sandbox_id: str, path: str, content: Any) -> Call[ArchiveWritten]:
        params = [("path", _check_path(path))]
        req = self.core.request(
            "PUT",
            self.core._sandbox_path(sandbox_id, "/files/archive"),
            params=params,
            content=content,
        )
        return Call(req, lambda r: ArchiveWritten.from_dict(_json(r)))


# -- local tar packing and unpacking ----------------------------------------------------


def _local_dir(local: str | os.PathLike[str], must_exist: bool) -> Path:
    path = Path(local)
    if must_exist and not path.is_dir():
        raise InvalidArgument(f"{str(path)!r} is not a local directory; give a directory to upload")
    if not must_exist and path.exists() and not path.is_dir():
        raise InvalidArgument(f"{str(path)!r} exists and is not a directory")
    return path


class _QueueWriter:
    def __init__(self, q: queue.Queue[bytes | BaseException | None], stop: threading.Event):
        self.q, self.stop = q, stop
        self.buf = bytearray()

    def write(self, data: bytes) -> int:
        self.buf += data
        if len(self.buf) >= _TAR_PIECE:
            self.flush()
        return len(data)

    def flush(self) -> None:
        if self.buf:
            self.put(bytes(self.buf))
            self.buf.clear()

    def put(self, item: bytes | BaseException | None) -> None:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.2)
                return
            except queue.Full:
                continue
        raise _Stopped()


class _Stopped(Exception):
    pass


def tar_chunks(local: str | os.PathLike[str]) -> Iterator[bytes]:
    """A tar stream of directory ``local``'s content, in pieces, never whole in memory
    (a thread packs while the caller sends). Closing the iterator stops the packing."""
    root = _local_dir(local, must_exist=True)
    q: queue.Queue[bytes | BaseException | None] = queue.Queue(_TAR_QUEUE)
    stop = threading.Event()

    def pack() -> None:
        writer = _QueueWriter(q, stop)
        try:
            with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
                for dirpath, dirnames, filenames in os.walk(root):
                    dirnames.sort()
                    for name in [*dirnames, *sorted(filenames)]:
                        full = os.path.join(dirpath, name)
                        tar.add(full, arcname=os.path.relpath(full, root), recursive=False)
            writer.flush()
            writer.put(None)
        except _Stopped:
            pass
        except BaseException as exc:
            with contextlib.suppress(_Stopped):
                writer.put(exc)

    thread = threading.Thread(target=pack, name="hutch-tar", daemon=True)
    thread.start()

    def pieces() -> Iterator[bytes]:
        try:
            while True:
                item = q.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise InvalidArgument(f"cannot pack {str(root)!r}: {item}") from item
                yield item
        finally:
            stop.set()

    return pieces()


def extract_tar(fileobj: IO[bytes], dest: str | os.PathLike[str]) -> int:
    """Unpack a tar stream into ``dest`` (created); members escaping it are refused."""
    target = _local_dir(dest, must_exist=False)
    target.mkdir(parents=True, exist_ok=True)
    root = os.path.realpath(target)
    count = 0
    with tarfile.open(fileobj=fileobj, mode="r|*") as tar:
        for member in tar:
            name = member.name
            resolved = os.path.realpath(os.path.join(root, name))
            if (
                name.startswith("/")
                or ".." in name.split("/")
                or not (resolved == root or resolved.startswith(root + os.sep))
            ):
                raise InvalidArgument(f"archive member {name!r} points outside {str(target)!r}")
            if member.isdev() or member.isfifo():
                continue
            if hasattr(tarfile, "data_filter"):
                tar.extract(member, root, filter="data")
            else:  # pragma: no cover - Python < 3.11.4
                if member.issym() or member.islnk():
                    link = os.path.realpath(
                        os.path.join(os.path.dirname(resolved), member.linkname)
                    )
                    if not link.startswith(root + os.sep):
                        raise InvalidArgument(f"archive member {name!r} links outside the target")
                tar.extract(member, root)
            count += 1
    return count


class _ChunkReader:
    """A file object over an iterator of byte chunks (for tarfile's stream mode)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks = chunks
        self.buf = b""
        self.total = 0

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self.buf) < size:
            chunk = next(self.chunks, None)
            if chunk is None:
                break
            self.buf += chunk
            self.total += len(chunk)
        if size < 0:
            data, self.buf = self.buf, b""
        else:
            data, self.buf = self.buf[:size], self.buf[size:]
        return data


# -- the shells -------------------------------------------------------------------------


class FileWatcher(ClosesOnExit):
    """``for event in sb.files.watch(path)``: changes as they happen. The watch is in
    place when ``watch()`` returns. Stop with ``close()`` or a ``with`` block."""

    def __init__(self, stream: ResponseStream[WatchEvent]) -> None:
        self._stream = stream
        try:
            first = next(stream)
        except StopIteration:
            raise ProtocolError("the watch stream ended before it started") from None
        if first.type != "watching":
            stream.close()
            raise ProtocolError(f"watch stream: expected 'watching' first, got {first!r}")
        #: The watched directory as the guest names it.
        self.path = first.path

    def __iter__(self) -> Iterator[WatchEvent]:
        return self

    def __next__(self) -> WatchEvent:
        return next(self._stream)

    def close(self) -> None:
        self._stream.close()


class AsyncFileWatcher(AsyncClosesOnExit):
    """``async for event in await sb.files.watch(path)``; see :class:`FileWatcher`."""

    def __init__(self, stream: AsyncResponseStream[WatchEvent], path: str) -> None:
        self._stream = stream
        self.path = path

    @classmethod
    async def start(cls, stream: AsyncResponseStream[WatchEvent]) -> AsyncFileWatcher:
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


class FilesExtra:
    """Mixed into :class:`hutch.sdk.Files` (``sb.files``)."""

    _client: Client
    _id: str

    def watch(
        self, path: str = ".", recursive: bool = True, timeout_s: float | None = None
    ) -> FileWatcher:
        """Watch directory ``path`` for created, modified, deleted and renamed entries;
        the iteration ends after ``timeout_s`` seconds if given, or when ``path`` is
        deleted."""
        from hutch.sdk._client import ResponseStream

        calls = FilesExtraCalls(self._client.core)
        request = calls.watch_request(self._id, path, recursive, timeout_s)
        return FileWatcher(ResponseStream(self._client, request, WatchDecoder()))

    def upload_dir(self, local: str | os.PathLike[str], remote: str) -> ArchiveWritten:
        """Copy local directory ``local``'s content into ``remote`` (created; files
        replaced, directories merged), streamed as one tar."""
        calls = FilesExtraCalls(self._client.core)
        chunks = tar_chunks(local)
        try:
            return self._client.call(calls.upload(self._id, remote, chunks))
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()

    def download_dir(self, remote: str, local: str | os.PathLike[str]) -> ArchiveWritten:
        """Copy directory ``remote``'s content into local directory ``local`` (created)."""
        from hutch.sdk._bodies import BytesDecoder
        from hutch.sdk._client import ResponseStream

        _local_dir(local, must_exist=False)
        calls = FilesExtraCalls(self._client.core)
        stream = ResponseStream(
            self._client, calls.download_request(self._id, remote), BytesDecoder()
        )
        with stream:
            reader = _ChunkReader(iter(stream))
            entries = extract_tar(reader, local)  # type: ignore[arg-type]
        return ArchiveWritten(str(local), entries, reader.total)


class AsyncFilesExtra:
    """Mixed into :class:`hutch.sdk.AsyncFiles`; see :class:`FilesExtra`."""

    _client: AsyncClient
    _id: str

    async def watch(
        self, path: str = ".", recursive: bool = True, timeout_s: float | None = None
    ) -> AsyncFileWatcher:
        from hutch.sdk._async_client import AsyncResponseStream

        calls = FilesExtraCalls(self._client.core)
        request = calls.watch_request(self._id, path, recursive, timeout_s)
        return await AsyncFileWatcher.start(
            AsyncResponseStream(self._client, request, WatchDecoder())
        )

    async def upload_dir(self, local: str | os.PathLike[str], remote: str) -> ArchiveWritten:
        calls = FilesExtraCalls(self._client.core)
        chunks = tar_chunks(local)

        async def pieces() -> Any:
            while True:
                piece = await asyncio.to_thread(next, chunks, None)
                if piece is None:
                    return
                yield piece

        try:
            return await self._client.call(calls.upload(self._id, remote, pieces()))
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()

    async def download_dir(self, remote: str, local: str | os.PathLike[str]) -> ArchiveWritten:
        from hutch.sdk._async_client import AsyncResponseStream
        from hutch.sdk._bodies import BytesDecoder

        _local_dir(local, must_exist=False)
        calls = FilesExtraCalls(self._client.core)
        total = 0
        # Spooled to a temporary file, then unpacked off the event loop.
        with tempfile.TemporaryFile() as spool:
            async with AsyncResponseStream(
                self._client, calls.download_request(self._id, remote), BytesDecoder()
            ) as stream:
                async for chunk in stream:
                    total += len(chunk)
                    await asyncio.to_thread(spool.write, chunk)
            spool.seek(0)
            entries = await asyncio.to_thread(extract_tar, spool, local)
        return ArchiveWritten(str(local), entries, total)
