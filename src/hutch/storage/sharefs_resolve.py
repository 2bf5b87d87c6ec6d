"""Confined path resolution for the shared-volume server: a guest's path never leaves
the volume's tree, whatever it names.

The guest kernel (FUSE) follows symlinks itself, in the guest's namespace: the host
never needs to follow one. So every path the guest sends is resolved with
``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS |
RESOLVE_NO_XDEV)`` from an ``O_PATH`` descriptor of the volume's root: a ``..`` or
absolute path, a symlink anywhere in it (to ``/etc`` or to ``..``), a magic link or a
mount point crossed fails in the host kernel (EXDEV / ELOOP), not in Python string code.
The operation itself then runs on the *last name* relative to its parent's descriptor
with no-follow semantics (``O_NOFOLLOW``, ``AT_SYMLINK_NOFOLLOW``, ``renameat``,
``unlinkat``), so a symlink as the last name is the link itself, never its target.

A kernel without openat2 (before 5.6: ENOSYS) gets the same rules by a walk, one
``O_PATH | O_NOFOLLOW | O_DIRECTORY`` open per name, each checked to be on the root's
device. Names are checked before either (:func:`split_path`) as defence in depth.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Callable

__all__ = [
    "RESOLVE_FLAGS",
    "ConfinedRoot",
    "openat2",
    "split_path",
]

# <linux/openat2.h>
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_FLAGS = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
#: openat2 is 437 on every architecture that uses the generic syscall table and x86_64.
_SYS_OPENAT2 = 437
_OPEN_HOW = struct.Struct("=QQQ")
_libc: ctypes.CDLL | None = None
_DIR_PATH = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC


def openat2(
    dirfd: int, path: bytes, flags: int, mode: int = 0, resolve: int = RESOLVE_FLAGS
) -> int:
    """``openat2(2)`` through ``syscall``; raises OSError with the kernel's errno."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    how = ctypes.create_string_buffer(_OPEN_HOW.pack(flags, mode, resolve), _OPEN_HOW.size)
    fd = _libc.syscall(
        ctypes.c_long(_SYS_OPENAT2),
        ctypes.c_int(dirfd),
        ctypes.c_char_p(path),
        how,
        ctypes.c_size_t(_OPEN_HOW.size),
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path.decode(errors="replace"))
    return int(fd)


def split_path(path: bytes) -> list[bytes]:
    """b"a/b/c" -> [b"a", b"b", b"c"]; b"" (the root) -> []. Raises OSError(EINVAL) for
    an absolute path, an empty, ``.`` or ``..`` name or a NUL, ENAMETOOLONG past
    PATH_MAX / NAME_MAX."""
    if len(path) > 4096:
        raise OSError(errno.ENAMETOOLONG, "path too long")
    if path == b"":
        return []
    if b"\0" in path:
        raise OSError(errno.EINVAL, "NUL in a path")
    names = path.split(b"/")
    for name in names:
        if name in (b"", b".", b".."):
            raise OSError(errno.EINVAL, f"path name {name!r} not allowed")
        if len(name) > 255:
            raise OSError(errno.ENAMETOOLONG, "name too long")
    return names


class ConfinedRoot:
    """The volume's root directory, held as an ``O_PATH`` descriptor; every lookup is
    relative to it. ``close()`` is safe to call twice."""

    def __init__(self, root: str | os.PathLike[str], *, use_openat2: bool | None = None) -> None:
        self.fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.dev = os.fstat(self.fd).st_dev
        self._openat2 = _probe_openat2(self.fd) if use_openat2 is None else use_openat2

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def open(self, path: bytes, flags: int, mode: int = 0) -> int:
        """Open ``path`` (no symlink anywhere, the last name included) beneath the root."""
        names = split_path(path)
        flags |= os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
        if not names:
            return os.open(".", flags, mode, dir_fd=self.fd)
        if self._openat2:
            return openat2(self.fd, path, flags, mode)
        parent = self._walk(names[:-1])
        try:
            fd = os.open(names[-1], flags, mode, dir_fd=parent)
        finally:
            os.close(parent)
        return self._same_dev(fd)

    def parent(self, path: bytes) -> tuple[int, bytes]:
        """(an O_PATH descriptor of the parent directory, the last name) for an
        operation on the name itself. The caller closes the descriptor. The root itself
        has no name: EINVAL (it cannot be removed, renamed or replaced)."""
        names = split_path(path)
        if not names:
            raise OSError(errno.EINVAL, "the volume's root has no parent")
        return self.dir(b"/".join(names[:-1])), names[-1]

    def dir(self, path: bytes) -> int:
        """An O_PATH descriptor of the directory ``path``."""
        names = split_path(path)
        if self._openat2:
            flags = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
            return openat2(self.fd, path or b".", flags)
        return self._walk(names)

    def _walk(self, names: list[bytes]) -> int:
        cur = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.fd)
        try:
            for name in names:
                nxt = os.open(
                    name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=cur
                )
                os.close(cur)
                cur = self._same_dev(nxt)
        except BaseException:
            if cur >= 0:
                os.close(cur)
            raise
        return cur

    def _same_dev(self, fd: int) -> int:
        if os.fstat(fd).st_dev != self.dev:
            os.close(fd)
            raise OSError(errno.EXDEV, "path crosses a mount point")
        return fd


def _probe_openat2(rootfd: int, call: Callable[..., int] = openat2) -> bool:
    try:
        os.close(call(rootfd, b".", os.O_PATH | os.O_CLOEXEC))
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EPERM):  # EPERM: a seccomp filter refusing it
            return False
        raise
    return True
