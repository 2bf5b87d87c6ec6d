"""Content digests, cache keys, atomic writes, directory swaps and build locks shared by
the layers."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "atomic_write_text",
    "file_lock",
    "file_sha256",
    "replace_dir",
    "restore_replaced",
    "short_digest",
    "try_file_lock",
]

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


#: renameat2(2)'s flag that swaps two paths in one step (Linux >= 3.15; ext4, xfs,
#: btrfs, tmpfs).
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the directories ``a`` and ``b`` atomically; False when the file system (or
    the C library) cannot, ``OSError`` for any other failure."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    done = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if done == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def replace_dir(new: Path, final: Path) -> Path | None:
    """Put the directory ``new`` at ``final`` (the same file system) so that a crash at
    any moment leaves the old directory or the new one there, never neither and never
    a mix: exchanged with what is there in one step (``renameat2(RENAME_EXCHANGE)``), or
    renamed when nothing is there. Returns where the old directory is now (``new``'s
    path after an exchange: the caller removes it), or None (there was none).

    Where the exchange is not supported, the old directory is renamed aside first
    (``.<name>.old-<hex>``) and ``new`` renamed in; a crash between the two leaves only
    the aside, which :func:`restore_replaced` renames back at the next start."""
    if not final.exists():
        os.rename(new, final)
        return None
    if _exchange(new, final):
        return new
    aside = final.parent / f".{final.name}.old-{secrets.token_hex(4)}"
    os.rename(final, aside)
    os.rename(new, aside.parent / final.name)
    return aside


def restore_replaced(final: Path) -> list[Path]:
    """After a crash in :func:`replace_dir`'s fallback: ``final`` missing and an old
    directory aside (``.<name>.old-*``) gets it back; asides of a completed replacement
    are left for the caller (returned) to remove."""
    asides = sorted(final.parent.glob(f".{final.name}.old-*"))
    if not final.exists() and asides:
        os.rename(asides.pop(), final)
    return asides
