"""Local directories as tar streams, for ``files.upload_dir`` and ``files.download_dir``:
packed by a thread while the caller sends (never whole in memory), unpacked with every
member checked to stay inside the target."""

from __future__ import annotations

import contextlib
import os
import queue
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from hutch.errors import InvalidArgument

__all__ = ["ChunkReader", "extract_tar", "local_dir", "tar_chunks"]

#: Upload pieces handed to httpx, and how many may wait between the tar thread and it.
_TAR_PIECE = 1 << 20
_TAR_QUEUE = 8


def local_dir(local: str | os.PathLike[str], must_exist: bool) -> Path:
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
    root = local_dir(local, must_exist=True)
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
    target = local_dir(dest, must_exist=False)
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


class ChunkReader:
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
