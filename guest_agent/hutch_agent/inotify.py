"""inotify through ctypes (the standard library has no binding): a watch set over a
directory tree and a parser for the kernel's event records."""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from dataclasses import dataclass

from hutch_agent.errors import AgentError

IN_ACCESS = 0x001
IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_CLOSE_WRITE = 0x008
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_EXCL_UNLINK = 0x04000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

#: What a watch asks for: content changes, creation, deletion and both halves of a move.
WATCH_MASK = (
    IN_MODIFY
    | IN_CLOSE_WRITE
    | IN_ATTRIB
    | IN_CREATE
    | IN_DELETE
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_DONT_FOLLOW
    | IN_EXCL_UNLINK
)

_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of NUL-padded name)

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        # The process's own namespace (libc is in it): find_library would run the
        # image's ldconfig, which on a musl image names a libc this process cannot use.
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.inotify_init1.argtypes = [ctypes.c_int]
        _libc.inotify_init1.restype = ctypes.c_int
        _libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        _libc.inotify_add_watch.restype = ctypes.c_int
        _libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        _libc.inotify_rm_watch.restype = ctypes.c_int
    return _libc


@dataclass(frozen=True)
class RawEvent:
    wd: int
    mask: int
    cookie: int
    name: str


def parse(buf: bytes) -> list[RawEvent]:
    """Split what one read() of the inotify fd returned into events."""
    out: list[RawEvent] = []
    pos = 0
    while pos + _EVENT.size <= len(buf):
        wd, mask, cookie, length = _EVENT.unpack_from(buf, pos)
        pos += _EVENT.size
        raw = buf[pos : pos + length].split(b"\0", 1)[0]
        pos += length
        out.append(RawEvent(wd, mask, cookie, os.fsdecode(raw)))
    return out


class Inotify:
    """One inotify instance; maps watch descriptors to the directories they watch."""

    def __init__(self) -> None:
        fd: int = _lib().inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise AgentError("io_error", f"inotify_init1 failed: {os.strerror(err)}")
        self.fd = fd
        self.paths: dict[int, str] = {}
        self.wds: dict[str, int] = {}

    def add(self, path: str, mask: int = WATCH_MASK) -> int | None:
        """Watch ``path``; None when it vanished or is not watchable (a race with the
        tree changing). Raises when the kernel's watch limit is reached."""
        wd: int = _lib().inotify_add_watch(self.fd, os.fsencode(path), mask)
        if wd < 0:
            err = ctypes.get_errno()
            if err == errno.ENOSPC:
                raise AgentError(
                    "invalid_argument",
                    f"too many directories to watch under {path!r} (the guest's "
                    "fs.inotify.max_user_watches limit); watch a smaller tree or "
                    "pass recursive=false",
                )
            if err in (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.ELOOP):
                return None
            raise AgentError("io_error", f"cannot watch {path!r}: {os.strerror(err)}")
        old = self.paths.get(wd)
        if old is not None and old != path:
            self.wds.pop(old, None)
        self.paths[wd] = path
        self.wds[path] = wd
        return wd

    def forget(self, wd: int) -> None:
        """The kernel dropped ``wd`` (IN_IGNORED): forget its path."""
        path = self.paths.pop(wd, None)
        if path is not None and self.wds.get(path) == wd:
            del self.wds[path]

    def rename_tree(self, old: str, new: str) -> None:
        """A watched directory moved inside the tree: its watches now name ``new``."""
        prefix = old.rstrip("/") + "/"
        for wd, path in list(self.paths.items()):
            if path == old or path.startswith(prefix):
                moved = new + path[len(old) :]
                self.wds.pop(path, None)
                self.paths[wd] = moved
                self.wds[moved] = wd

    def drop_tree(self, root: str) -> None:
        """Stop watching ``root`` and everything under it (it left the tree)."""
        prefix = root.rstrip("/") + "/"
        for wd, path in list(self.paths.items()):
            if path == root or path.startswith(prefix):
                _lib().inotify_rm_watch(self.fd, wd)
                self.forget(wd)

    def read(self) -> list[RawEvent]:
        try:
            return parse(os.read(self.fd, 64 * 1024))
        except BlockingIOError:
            return []

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
