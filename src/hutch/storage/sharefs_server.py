"""The host side of a shared volume: serves one volume's directory tree to one sandbox's
channel (protocol: :mod:`hutch.storage.sharefs_wire`).

Hostile input, so:
- every path goes through :class:`~hutch.storage.sharefs_resolve.ConfinedRoot` (openat2
  beneath the root, no symlink, magic link or mount crossed; the last name no-follow);
- only regular files, directories and symlinks are ever created: no device node, FIFO or
  socket (there is no MKNOD), modes lose setuid/setgid (``& 0o777``, sticky kept on
  directories), ownership never changes (files belong to hutchd's user on the host;
  the guest side presents them as its own), no xattrs (so no ``security.capability``);
- a file opened for I/O must be a regular file (opened ``O_NONBLOCK``, so a FIFO that
  got there some other way cannot hang the server);
- at most ``max_handles`` open files per connection (EMFILE past it), handle numbers are
  never reused, not even across sessions (a random 62-bit base each: a handle the guest
  kept from before a reconnect is EBADF), and all of them close with the connection;
- every failure is an errno reply: :meth:`ShareFsSession.handle` never raises;
- a repeat of the last request id is answered from the saved reply, not run again (the
  guest repeats the request it was waiting on when it sees a new session's HELLO, which
  may be one this session has served already: ``sharefs_wire``).

The size limit is not enforced here: the tree lives on a filesystem of the volume's size
(a host-mounted ext4 image), whose ENOSPC reaches the guest as an errno.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import stat
from collections.abc import Callable

from hutch.storage.sharefs_resolve import ConfinedRoot
from hutch.storage.sharefs_wire import (
    HELLO,
    HELLO_ID,
    MAX_DIR_ENTRIES,
    MAX_IO,
    Attr,
    DirEntry,
    FrameDecoder,
    Malformed,
    Op,
    Oversize,
    Request,
    decode_request,
    encode_reply,
)

__all__ = [
    "DEFAULT_MAX_HANDLES",
    "SET_ATIME",
    "SET_MODE",
    "SET_MTIME",
    "SET_SIZE",
    "STALL_S",
    "ShareFsSession",
    "serve_stream",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_HANDLES = 256
#: A frame whose bytes stop arriving for this long is given up on (``resync``): the
#: guest writes each request whole, so a gap this long inside one is no request.
STALL_S = 2.0
#: SETATTR's ``valid`` bits.
SET_MODE = 1
SET_SIZE = 2
SET_ATIME = 4
SET_MTIME = 8
_SET_ALL = SET_MODE | SET_SIZE | SET_ATIME | SET_MTIME
#: Open flags a guest may ask for; everything else (O_CREAT, O_DIRECTORY, O_PATH,
#: O_TMPFILE, O_NOATIME, ...) is dropped.
_OPEN_KEEP = os.O_ACCMODE | os.O_APPEND | os.O_TRUNC | os.O_SYNC | os.O_DSYNC
_PERM = 0o777
_DIR_RD = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _attr(st: os.stat_result) -> Attr:
    return Attr(
        ino=st.st_ino,
        mode=st.st_mode,
        nlink=st.st_nlink,
        uid=st.st_uid,
        gid=st.st_gid,
        size=st.st_size,
        blocks=st.st_blocks,
        atime_ns=st.st_atime_ns,
        mtime_ns=st.st_mtime_ns,
        ctime_ns=st.st_ctime_ns,
    )


class ShareFsSession:
    """One sandbox's connection to one shared volume: its handles and its decoder.

    ``feed(bytes) -> bytes`` (replies to send) is the whole I/O surface, so the caller
    chooses the transport (a chardev socket in hutchd, a socketpair in tests) and runs
    it off the event loop (file I/O blocks)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_handles: int = DEFAULT_MAX_HANDLES,
        read_only: bool = False,
    ) -> None:
        self.root = ConfinedRoot(root)
        self.read_only = read_only
        self.max_handles = max_handles
        self._handles: dict[int, int] = {}
        # Handle numbers start at a random base per session: after a reconnect (a
        # resume, a fork child, a daemon restart) the guest may still hold handles of
        # the old session, and they must be EBADF here, never another file's handle.
        self._next_handle = secrets.randbits(62) + 1
        self._decoder = FrameDecoder()
        self._last: tuple[int, bytes] | None = None  # (request id, its framed reply)
        self._ops: dict[Op, Callable[..., tuple[object, ...]]] = {
            Op.STAT: self._stat,
            Op.READDIR: self._readdir,
            Op.OPEN: self._open,
            Op.CREATE: self._create,
            Op.READ: self._read,
            Op.WRITE: self._write,
            Op.RELEASE: self._release,
            Op.FSYNC: self._fsync,
            Op.MKDIR: self._mkdir,
            Op.UNLINK: self._unlink,
            Op.RMDIR: self._rmdir,
            Op.RENAME: self._rename,
            Op.SYMLINK: self._symlink,
            Op.READLINK: self._readlink,
            Op.LINK: self._link,
            Op.SETATTR: self._setattr,
            Op.STATFS: self._statfs,
        }

    @property
    def open_handles(self) -> int:
        return len(self._handles)

    def close(self) -> None:
        """Close every handle and the root; safe to call twice."""
        for fd in self._handles.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._handles.clear()
        self.root.close()

    @property
    def pending(self) -> bool:
        """A request has begun arriving but not ended (see :meth:`resync`)."""
        return self._decoder.pending

    def resync(self) -> bytes:
        """The partial request buffered stalled (its bytes stopped for ``STALL_S``): a
        magic inside data, or a request cut by a reconnect. Give up on it, scan on."""
        return self._answer(self._decoder.resync())

    def feed(self, data: bytes) -> bytes:
        """Bytes from the guest -> the replies to send back (possibly none yet)."""
        return self._answer(self._decoder.feed(data))

    def _answer(self, items: list[bytes | Oversize]) -> bytes:
        out: list[bytes] = []
        for item in items:
            if isinstance(item, Oversize):
                log.warning("sharefs: dropped a %d-byte frame (limit exceeded)", item.length)
                out.append(encode_reply(max(item.req_id, 0), None, errno.EMSGSIZE))
            else:
                out.append(self.handle(item))
        return b"".join(out)

    def handle(self, body: bytes) -> bytes:
        """One request body -> one framed reply. Never raises."""
        req = decode_request(body)
        if isinstance(req, Malformed):
            log.info("sharefs: malformed request: %s", req.reason)
            return encode_reply(max(req.req_id, 0), None, req.errno)
        if self._last is not None and self._last[0] == req.req_id != HELLO_ID:
            return self._last[1]
        reply = self._dispatch(req)
        self._last = (req.req_id, reply)
        return reply

    @staticmethod
    def hello() -> bytes:
        """What to send first on a new connection (``sharefs_wire.HELLO``)."""
        return HELLO

    def _dispatch(self, req: Request) -> bytes:
        try:
            if self.read_only and req.op in _WRITES:
                return encode_reply(req.req_id, None, errno.EROFS)
            results = self._ops[req.op](*req.args)
            return encode_reply(req.req_id, req.op, 0, *results)
        except OSError as exc:
            return encode_reply(req.req_id, None, exc.errno or errno.EIO)
        except (OverflowError, ValueError) as exc:  # an offset or mode Python cannot pass on
            log.info("sharefs: %s refused: %s", req.op.name, exc)
            return encode_reply(req.req_id, None, errno.EINVAL)
        except Exception:  # the server outlives any bug a message finds
            log.exception("sharefs: %s failed", req.op.name)
            return encode_reply(req.req_id, None, errno.EIO)

    # -- handles --------------------------------------------------------------------

    def _add_handle(self, fd: int) -> int:
        if len(self._handles) >= self.max_handles:
            os.close(fd)
            raise OSError(errno.EMFILE, "too many open files on this volume")
        h = self._next_handle
        self._next_handle += 1
        self._handles[h] = fd
        return h

    def _fd(self, handle: int) -> int:
        try:
            return self._handles[handle]
        except KeyError:
            raise OSError(errno.EBADF, "unknown handle") from None

    @staticmethod
    def _regular(fd: int) -> os.stat_result:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise OSError(
                errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EPERM, "not a regular file"
            )
        return st

    # -- operations (each returns the reply's results) --------------------------------

    def _lstat(self, path: bytes) -> os.stat_result:
        if path == b"":
            return os.fstat(self.root.fd)
        parent, name = self.root.parent(path)
        try:
            return os.stat(name, dir_fd=parent, follow_symlinks=False)
        finally:
            os.close(parent)

    def _stat(self, path: bytes) -> tuple[object, ...]:
        return (_attr(self._lstat(path)),)

    def _readdir(self, path: bytes, offset: int) -> tuple[object, ...]:
        fd = self.root.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            names = sorted(os.listdir(fd))
            entries: list[DirEntry] = []
            size = 0
            for i in range(offset, len(names)):
                name = os.fsencode(names[i])
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:  # removed since the listing
                    continue
                size += 24 + len(name)
                if len(entries) >= MAX_DIR_ENTRIES or size > MAX_IO:
                    break
                entries.append(DirEntry(i + 1, st.st_ino, st.st_mode, name))
            return (tuple(entries),)
        finally:
            os.close(fd)

    def _open(self, path: bytes, flags: int) -> tuple[object, ...]:
        flags &= _OPEN_KEEP
        # Before the open: O_TRUNC acts at open time.
        if self.read_only and (flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC):
            raise OSError(errno.EROFS, "read-only volume")
        fd = self.root.open(path, flags | os.O_NONBLOCK)
        self._regular(fd)
        return (self._add_handle(fd),)

    def _create(self, path: bytes, flags: int, mode: int) -> tuple[object, ...]:
        keep = (flags & _OPEN_KEEP) | os.O_NONBLOCK
        try:
            fd = self.root.open(path, keep | os.O_CREAT | os.O_EXCL, mode & _PERM)
            # The guest kernel applied its umask already; the host's must not apply again.
            os.fchmod(fd, mode & _PERM)
        except FileExistsError:
            if flags & os.O_EXCL:
                raise
            fd = self.root.open(path, keep)
        st = self._regular(fd)
        return (self._add_handle(fd), _attr(st))

    def _read(self, handle: int, offset: int, size: int) -> tuple[object, ...]:
        if size > MAX_IO:
            raise OSError(errno.EINVAL, "read larger than MAX_IO")
        return (os.pread(self._fd(handle), size, offset),)

    def _write(self, handle: int, offset: int, data: bytes) -> tuple[object, ...]:
        return (os.pwrite(self._fd(handle), data, offset),)

    def _release(self, handle: int) -> tuple[object, ...]:
        self._fd(handle)
        os.close(self._handles.pop(handle))
        return ()

    def _fsync(self, handle: int, datasync: int) -> tuple[object, ...]:
        (os.fdatasync if datasync else os.fsync)(self._fd(handle))
        return ()

    def _mkdir(self, path: bytes, mode: int) -> tuple[object, ...]:
        parent, name = self.root.parent(path)
        try:
            os.mkdir(name, mode & (_PERM | stat.S_ISVTX), dir_fd=parent)
            fd = os.open(name, _DIR_RD, dir_fd=parent)
            try:
                os.fchmod(fd, mode & (_PERM | stat.S_ISVTX))
                return (_attr(os.fstat(fd)),)
            finally:
                os.close(fd)
        finally:
            os.close(parent)

    def _unlink(self, path: bytes) -> tuple[object, ...]:
        parent, name = self.root.parent(path)
        try:
            os.unlink(name, dir_fd=parent)
        finally:
            os.close(parent)
        return ()

    def _rmdir(self, path: bytes) -> tuple[object, ...]:
        parent, name = self.root.parent(path)
        try:
            os.rmdir(name, dir_fd=parent)
        finally:
            os.close(parent)
        return ()

    def _rename(self, old: bytes, new: bytes, flags: int) -> tuple[object, ...]:
        if flags:
            raise OSError(errno.EINVAL, "rename flags are not supported")
        old_parent, old_name = self.root.parent(old)
        try:
            new_parent, new_name = self.root.parent(new)
            try:
                os.rename(old_name, new_name, src_dir_fd=old_parent, dst_dir_fd=new_parent)
            finally:
                os.close(new_parent)
        finally:
            os.close(old_parent)
        return ()

    def _symlink(self, target: bytes, path: bytes) -> tuple[object, ...]:
        if not target or b"\0" in target or len(target) >= 4096:
            raise OSError(errno.EINVAL, "bad symlink target")
        parent, name = self.root.parent(path)
        try:
            # The target is text the guest kernel follows in the guest; the host never does.
            os.symlink(target, name, dir_fd=parent)
            return (_attr(os.stat(name, dir_fd=parent, follow_symlinks=False)),)
        finally:
            os.close(parent)

    def _readlink(self, path: bytes) -> tuple[object, ...]:
        parent, name = self.root.parent(path)
        try:
            return (os.readlink(name, dir_fd=parent),)
        finally:
            os.close(parent)

    def _link(self, old: bytes, new: bytes) -> tuple[object, ...]:
        old_parent, old_name = self.root.parent(old)
        try:
            if stat.S_ISDIR(os.stat(old_name, dir_fd=old_parent, follow_symlinks=False).st_mode):
                raise OSError(errno.EPERM, "hard link to a directory")
            new_parent, new_name = self.root.parent(new)
            try:
                os.link(
                    old_name,
                    new_name,
                    src_dir_fd=old_parent,
                    dst_dir_fd=new_parent,
                    follow_symlinks=False,
                )
                return (_attr(os.stat(new_name, dir_fd=new_parent, follow_symlinks=False)),)
            finally:
                os.close(new_parent)
        finally:
            os.close(old_parent)

    def _setattr(
        self, path: bytes, valid: int, mode: int, size: int, atime_ns: int, mtime_ns: int
    ) -> tuple[object, ...]:
        if valid & ~_SET_ALL:
            raise OSError(errno.EPERM, "only mode, size and times can be set (no owner change)")
        st = self._lstat(path)
        if stat.S_ISLNK(st.st_mode):
            if valid & (SET_MODE | SET_SIZE):
                raise OSError(errno.EOPNOTSUPP, "a symlink has no mode or size")
        elif valid & (SET_MODE | SET_SIZE):
            want = os.O_WRONLY if valid & SET_SIZE else os.O_RDONLY
            fd = self.root.open(path, want | os.O_NONBLOCK)
            try:
                now = os.fstat(fd)
                if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
                    raise OSError(errno.ESTALE, "the file changed during setattr")
                if valid & SET_MODE:
                    keep = _PERM | (stat.S_ISVTX if stat.S_ISDIR(now.st_mode) else 0)
                    os.fchmod(fd, mode & keep)
                if valid & SET_SIZE:
                    if not stat.S_ISREG(now.st_mode):
                        raise OSError(errno.EISDIR, "size of a non-file")
                    os.ftruncate(fd, size)
            finally:
                os.close(fd)
        if valid & (SET_ATIME | SET_MTIME):
            a = atime_ns if valid & SET_ATIME else st.st_atime_ns
            m = mtime_ns if valid & SET_MTIME else st.st_mtime_ns
            if path == b"":
                _utime_root(self.root.fd, a, m)
            else:
                parent, name = self.root.parent(path)
                try:
                    os.utime(name, ns=(a, m), dir_fd=parent, follow_symlinks=False)
                finally:
                    os.close(parent)
        return (_attr(self._lstat(path)),)

    def _statfs(self) -> tuple[object, ...]:
        v = os.fstatvfs(self.root.fd)
        return (v.f_frsize, v.f_blocks, v.f_bfree, v.f_bavail, v.f_files, v.f_ffree, v.f_namemax)


def _utime_root(rootfd: int, atime_ns: int, mtime_ns: int) -> None:
    # utimensat on an O_PATH descriptor is EBADF: open the root directory itself.
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=rootfd)
    try:
        os.utime(fd, ns=(atime_ns, mtime_ns))
    finally:
        os.close(fd)


_WRITES = frozenset(
    {Op.CREATE, Op.WRITE, Op.MKDIR, Op.UNLINK, Op.RMDIR, Op.RENAME, Op.SYMLINK, Op.LINK, Op.SETATTR}
)


async def _finish_in_thread(fn: Callable[..., bytes], *args: object) -> bytes:
    """``fn(*args)`` in a worker thread; if the caller is cancelled meanwhile, wait for
    the thread before passing the cancellation on: the session's handles close after
    this, and a call still running would write to a descriptor number that may by then
    be another file of hutchd's."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait({fut})
        raise


async def serve_stream(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, session: ShareFsSession
) -> None:
    """Serve ``session`` on one connection until the peer closes it (a sandbox stopped,
    or QEMU's chardev went away: hutchd reconnects with a new session). Requests are
    answered in order, each in a worker thread (file I/O blocks); the session's handles
    close when this returns, however it returns. Sends the HELLO first."""
    try:
        writer.write(session.hello())
        await writer.drain()
        while True:
            if session.pending:
                try:
                    data = await asyncio.wait_for(reader.read(65536), STALL_S)
                except TimeoutError:
                    log.info("sharefs: a request stalled half-way; scanning past it")
                    out = await _finish_in_thread(session.resync)
                    if out:
                        writer.write(out)
                        await writer.drain()
                    continue
            else:
                data = await reader.read(65536)
            if not data:
                return
            out = await _finish_in_thread(session.feed, data)
            if out:
                writer.write(out)
                await writer.drain()
    except (ConnectionError, BrokenPipeError) as exc:
        log.info("sharefs: connection ended: %s", exc)
    finally:
        session.close()
        writer.close()
        with contextlib.suppress(ConnectionError, BrokenPipeError):
            await writer.wait_closed()
