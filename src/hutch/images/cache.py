"""Content digests, cache keys, atomic writes and build locks shared by the layers."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_write_text", "file_lock", "file_sha256", "short_digest", "try_file_lock"]

DIGEST_CHARS = 16  # 64 bits: plenty to tell the few builds of one image apart


def short_digest(*parts: str) -> str:
    """Hex digest of ``parts``; each part is length-prefixed so ("ab","c") != ("a","bc")."""
    h = hashlib.sha256()
    for part in parts:
        raw = part.encode()
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.hexdigest()[:DIGEST_CHARS]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_text(path: Path, text: str, mode: int = 0o644) -> None:
    """Write ``text`` so readers see the old file or the whole new one, never a part."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed) for the block.

    flock is released by the kernel when the process dies, so a crashed build never
    leaves a stale lock behind.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def try_file_lock(path: Path) -> Iterator[bool]:
    """Try an exclusive ``flock`` on ``path`` (created if needed) without waiting: the
    block gets True while holding it, False when another holder has it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
