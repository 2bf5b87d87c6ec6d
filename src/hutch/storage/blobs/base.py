"""The blob store seam: what every store (a local directory, an S3 bucket) promises.

A blob is an immutable file under a key (``snapshots/snap-0123456789ab/state.mig``).
Every call is blocking (run it in a thread from async code) and streams: a blob never
sits in memory whole, only one chunk or one multipart part (``part_size``) at a time.

Integrity is the caller's record, not the store's: :meth:`BlobStore.put` returns the
blob's size and sha256 as it read them, the caller writes them into its own index (for
snapshots: the index object written last), and :meth:`BlobStore.get` is given them
back and refuses a blob whose bytes differ (truncated, corrupt, replaced): the partial
download is removed and ``BlobError`` names the key. So a store that loses or mangles
bytes can make a restore fail, never make it load something hutch did not write.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from hutch.errors import BlobError

__all__ = [
    "CHUNK",
    "BlobInfo",
    "BlobStore",
    "Progress",
    "check_digest",
    "check_key",
    "file_sha256",
    "iter_chunks",
    "part_path",
    "verified_write",
]

#: Bytes read or written at a time when streaming a blob.
CHUNK = 1 << 20
#: A key: relative, ``/``-separated segments of safe characters (no ``.``/``..``).
_KEY_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]{0,254}$")

#: Called with the bytes moved so far (for progress and for tests' fault injection).
Progress = Callable[[int], None]


@dataclass(frozen=True)
class BlobInfo:
    """A stored blob: its key, size in bytes and, where known, its sha256 (hex).

    ``sha256`` is what :meth:`BlobStore.put` computed while reading the source; a
    :meth:`BlobStore.stat` of an S3 object does not know it (None).
    """

    key: str
    size: int
    sha256: str | None = None


class BlobStore(Protocol):
    """A place for immutable blobs: ``file:///dir`` or ``s3://bucket/prefix``."""

    #: What the store is, for messages (``s3://bucket/prefix at http://...``).
    url: str

    def check(self) -> None:
        """Raise ``BlobError`` naming what is wrong when the store is unusable (no such
        directory or bucket, refused credentials, unreachable endpoint)."""
        ...

    def put(self, key: str, source: Path, *, progress: Progress | None = None) -> BlobInfo:
        """Store ``source`` under ``key`` (replacing any blob there) and return its size
        and sha256. Streamed; an S3 store uploads in parts and, cut short (a crash, the
        server gone), continues where it stopped on the next ``put`` of the same key
        and file. Raises ``BlobError``; on failure no partial blob is visible under
        ``key``."""
        ...

    def get(
        self, key: str, dest: Path, *, expect: BlobInfo, progress: Progress | None = None
    ) -> BlobInfo:
        """Write the blob to ``dest`` (atomically: a temp file renamed once verified).
        Refuses (``BlobError`` naming the key) a blob whose size or sha256 is not
        ``expect``'s, leaving ``dest`` untouched."""
        ...

    def stat(self, key: str) -> BlobInfo | None:
        """The blob's size (None when there is no blob under ``key``)."""
        ...

    def delete(self, key: str) -> None:
        """Remove the blob; no blob there is no error."""
        ...

    def list_prefix(self, prefix: str) -> list[BlobInfo]:
        """Every blob whose key starts with ``prefix``, sorted by key."""
        ...

    def abort_uploads(self, older_than_s: float) -> list[str]:
        """Abandon uploads begun more than ``older_than_s`` ago and never finished
        (their parts cost storage); return their keys."""
        ...


def check_key(key: str) -> str:
    """``key`` if it is a valid blob key, else ``BlobError`` saying what is accepted."""
    parts = key.split("/")
    if not key or len(key) > 900 or not all(_KEY_SEGMENT.match(p) for p in parts):
        raise BlobError(
            f"blob key {key!r} is not valid; accepted: '/'-separated names of letters, "
            "digits and ._=+- (not starting with a dot), at most 900 characters"
        )
    return key


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verified_write(
    chunks: Iterator[bytes],
    dest: Path,
    *,
    key: str,
    where: str,
    expect: BlobInfo,
    progress: Progress | None = None,
) -> BlobInfo:
    """Write ``chunks`` to a temp file beside ``dest``, hashing as they come; rename it
    to ``dest`` only if size and sha256 are ``expect``'s, else remove it and raise
    ``BlobError`` naming ``key`` (a stream that breaks off raises too)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = part_path(dest)
    digest = hashlib.sha256()
    size = 0
    try:
        with tmp.open("wb") as f:
            for chunk in chunks:
                f.write(chunk)
                digest.update(chunk)
                size += len(chunk)
                if progress is not None:
                    progress(size)
                if size > expect.size:
                    break  # longer than recorded: no need to read the rest
            f.flush()
            os.fsync(f.fileno())
        if size != expect.size:
            raise BlobError(
                f"blob {key} at {where} is {'truncated' if size < expect.size else 'too long'}: "
                f"{size} bytes read, {expect.size} recorded; it is not used"
            )
        got = digest.hexdigest()
        check_digest(got, key=key, where=where, expect=expect)
        os.rename(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return BlobInfo(key, size, got)


def part_path(dest: Path) -> Path:
    """The temp file a download to ``dest`` is written to before its rename."""
    return dest.with_name(f".{dest.name}.part-{os.getpid()}")


def check_digest(got: str, *, key: str, where: str, expect: BlobInfo) -> None:
    """Refuse (``BlobError`` naming ``key``) a download whose sha256 ``got`` is not the
    recorded one (``expect.sha256`` None: nothing recorded, nothing to check)."""
    if expect.sha256 is not None and got != expect.sha256:
        raise BlobError(
            f"blob {key} at {where} is corrupt: sha256 {got}, {expect.sha256} recorded; "
            "it is not used"
        )


def iter_chunks(f: BinaryIO | Any) -> Iterator[bytes]:
    """``f``'s bytes from its current offset to its end, :data:`CHUNK` at a time."""
    while chunk := f.read(CHUNK):
        yield chunk
