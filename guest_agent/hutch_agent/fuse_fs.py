"""A shared volume as a FUSE filesystem: kernel FUSE requests (``fuse_proto``) turned
into ``sharefs_wire`` calls on the volume's channel (``sharefs_client``), sans-IO:
:meth:`ShareFs.handle` takes one request's bytes and returns the reply's (None when the
kernel wants none).

Nodes are paths: the host speaks paths relative to the volume's root, so a node id is a
number for a path, counted by the kernel's lookups and dropped at FORGET. A rename moves
the paths of the node and of everything under it; an unlink or rmdir detaches the node
(what the kernel still holds of it is ESTALE, except its open files).

Open files keep the host handle and the flags they were opened with. A new host session
(resume, fork child, daemon restart) knows none of the old handles (EBADF): the file is
opened again by its path, without ``O_TRUNC``, and the call repeated once. A file
unlinked in the meantime cannot be found again and stays EBADF.

What is refused here, before the host sees it: device nodes, FIFOs and sockets (MKNOD
of anything but a regular file is EPERM), owner changes to anything but the owner shown
(EPERM), rename flags (EINVAL), xattrs and locks (ENOSYS: the kernel then keeps locks
locally and reports xattrs unsupported). Every file shows as owned by ``uid:gid`` (root
by default): the host stores no owners. The mount uses ``default_permissions``, so the
guest kernel checks modes against that owner.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass

from hutch_agent import fuse_proto as fp
from hutch_agent.sharefs_client import RemoteError, ShareFsClient
from hutch_agent.sharefs_wire import MAX_IO, Attr, DirEntry, Op

log = logging.getLogger("hutch-agent")

#: How long the kernel may trust a name -> node answer. Nodes are paths, so a stale
#: entry still names the right file; attributes are never cached (other sandboxes write
#: the same files), see ATTR_VALID.
ENTRY_VALID_S = 1
ATTR_VALID_S = 0
_OPEN_KEEP = os.O_ACCMODE | os.O_APPEND | os.O_TRUNC | os.O_SYNC | os.O_DSYNC
# SETATTR valid bits of the wire (``hutch.storage.sharefs_server.SET_*``).
_SET_MODE, _SET_SIZE, _SET_ATIME, _SET_MTIME = 1, 2, 4, 8


class FsError(Exception):
    def __init__(self, err: int) -> None:
        super().__init__(os.strerror(err))
        self.errno = err


@dataclass
class Node:
    path: bytes | None  # None: unlinked (or renamed over)
    lookups: int


@dataclass
class OpenFile:
    node: int
    flags: int  # as opened, without O_TRUNC (what a reopen uses)
    handle: int


def _name(raw: bytes) -> bytes:
    """A NUL-terminated name from the kernel."""
    end = raw.find(b"\0")
    return raw if end < 0 else raw[:end]


def _two_names(raw: bytes) -> tuple[bytes, bytes]:
    first, _, rest = raw.partition(b"\0")
    return first, _name(rest)


class ShareFs:
    def __init__(
        self, client: ShareFsClient, *, uid: int = 0, gid: int = 0, read_only: bool = False
    ) -> None:
        self.client = client
        self.uid, self.gid = uid, gid
        self.read_only = read_only
        self.nodes: dict[int, Node] = {fp.ROOT_ID: Node(b"", 1)}
        self._by_path: dict[bytes, int] = {b"": fp.ROOT_ID}
        self._next_node = fp.ROOT_ID + 1
        self.files: dict[int, OpenFile] = {}
        self._next_fh = 1
        self.destroyed = False
        self._ops: dict[int, Callable[[int, bytes], bytes]] = {
            fp.Opcode.INIT: self._init,
            fp.Opcode.LOOKUP: self._lookup,
            fp.Opcode.GETATTR: self._getattr,
            fp.Opcode.SETATTR: self._setattr,
            fp.Opcode.READLINK: self._readlink,
            fp.Opcode.SYMLINK: self._symlink,
            fp.Opcode.MKNOD: self._mknod,
            fp.Opcode.MKDIR: self._mkdir,
            fp.Opcode.UNLINK: self._unlink,
            fp.Opcode.RMDIR: self._rmdir,
            fp.Opcode.RENAME: self._rename,
            fp.Opcode.RENAME2: self._rename2,
            fp.Opcode.LINK: self._link,
            fp.Opcode.OPEN: self._open,
            fp.Opcode.CREATE: self._create,
            fp.Opcode.READ: self._read,
            fp.Opcode.WRITE: self._write,
            fp.Opcode.FLUSH: lambda n, a: b"",
            fp.Opcode.RELEASE: self._release,
            fp.Opcode.FSYNC: self._fsync,
            fp.Opcode.OPENDIR: self._opendir,
            fp.Opcode.READDIR: self._readdir,
            fp.Opcode.RELEASEDIR: lambda n, a: b"",
            fp.Opcode.FSYNCDIR: lambda n, a: b"",
            fp.Opcode.STATFS: self._statfs,
            fp.Opcode.DESTROY: self._destroy,
        }

    # -- the request loop's one entry point -------------------------------------------

    def handle(self, request: bytes) -> bytes | None:
        """One request from /dev/fuse -> its reply (None: none expected). Never raises:
        a failure is an errno reply, an unexpected one EIO (logged)."""
        if len(request) < fp.IN_HEADER.size:
            return None
        _, opcode, unique, nodeid, *_ = fp.IN_HEADER.unpack_from(request, 0)
        args = request[fp.IN_HEADER.size :]
        if opcode == fp.Opcode.FORGET:
            if len(args) >= fp.FORGET_IN.size:
                self._forget(nodeid, fp.FORGET_IN.unpack_from(args, 0)[0])
            return None
        if opcode == fp.Opcode.BATCH_FORGET:
            self._batch_forget(args)
            return None
        if opcode == fp.Opcode.INTERRUPT:
            return None  # requests run one at a time to the end; nothing to interrupt
        op = self._ops.get(opcode)
        if op is None:
            return fp.reply(unique, errno.ENOSYS)
        try:
            return fp.reply(unique, 0, op(nodeid, args))
        except FsError as exc:
            return fp.reply(unique, exc.errno)
        except OSError as exc:  # RemoteError: the host's errno
            return fp.reply(unique, exc.errno or errno.EIO)
        except Exception:
            log.exception("sharefs: FUSE opcode %d failed", opcode)
            return fp.reply(unique, errno.EIO)

    # -- nodes ------------------------------------------------------------------------

    def _path(self, nodeid: int) -> bytes:
        node = self.nodes.get(nodeid)
        if node is None or node.path is None:
            raise FsError(errno.ESTALE)
        return node.path

    def _child(self, nodeid: int, name: bytes) -> bytes:
        if not name or b"/" in name or name in (b".", b".."):
            raise FsError(errno.EINVAL)
        parent = self._path(nodeid)
        return parent + b"/" + name if parent else name

    def _remember(self, path: bytes) -> int:
        """The node of ``path``, with one more lookup counted."""
        nodeid = self._by_path.get(path)
        if nodeid is not None:
            self.nodes[nodeid].lookups += 1
            return nodeid
        nodeid = self._next_node
        self._next_node += 1
        self.nodes[nodeid] = Node(path, 1)
        self._by_path[path] = nodeid
        return nodeid

    def _detach(self, path: bytes) -> None:
        nodeid = self._by_path.pop(path, None)
        if nodeid is not None:
            self.nodes[nodeid].path = None

    def _move(self, old: bytes, new: bytes) -> None:
        self._detach(new)
        prefix = old + b"/"
        for nodeid, node in self.nodes.items():
            if node.path is None:
                continue
            if node.path == old:
                moved = new
            elif node.path.startswith(prefix):
                moved = new + node.path[len(old) :]
            else:
                continue
            del self._by_path[node.path]
            node.path = moved
            self._by_path[moved] = nodeid

    def _forget(self, nodeid: int, count: int) -> None:
        node = self.nodes.get(nodeid)
        if node is None or nodeid == fp.ROOT_ID:
            return
        node.lookups -= count
        if node.lookups <= 0:
            del self.nodes[nodeid]
            if node.path is not None and self._by_path.get(node.path) == nodeid:
                del self._by_path[node.path]

    def _batch_forget(self, args: bytes) -> None:
        if len(args) < fp.BATCH_FORGET_IN.size:
            return
        (count, _) = fp.BATCH_FORGET_IN.unpack_from(args, 0)
        pos = fp.BATCH_FORGET_IN.size
        for _ in range(count):
            if pos + fp.FORGET_ONE.size > len(args):
                break
            nodeid, nlookup = fp.FORGET_ONE.unpack_from(args, pos)
            pos += fp.FORGET_ONE.size
            self._forget(nodeid, nlookup)

    # -- encoding ---------------------------------------------------------------------

    def _attr(self, a: Attr) -> bytes:
        mode = a.mode & ~(stat.S_ISUID | stat.S_ISGID) if not stat.S_ISDIR(a.mode) else a.mode
        return fp.ATTR.pack(
            a.ino,
            a.size,
            a.blocks,
            a.atime_ns // 10**9,
            a.mtime_ns // 10**9,
            a.ctime_ns // 10**9,
            a.atime_ns % 10**9,
            a.mtime_ns % 10**9,
            a.ctime_ns % 10**9,
            mode,
            a.nlink,
            self.uid,
            self.gid,
            0,
            4096,
            0,
        )

    def _entry(self, path: bytes, a: Attr) -> bytes:
        nodeid = self._remember(path)
        return fp.ENTRY_HEAD.pack(nodeid, 0, ENTRY_VALID_S, ATTR_VALID_S, 0, 0) + self._attr(a)

    def _attr_out(self, a: Attr) -> bytes:
        return fp.ATTR_HEAD.pack(ATTR_VALID_S, 0, 0) + self._attr(a)

    def _call(self, op: Op, *args: object) -> tuple[object, ...]:
        return self.client.call(op, *args)

    def _stat(self, path: bytes) -> Attr:
        (a,) = self._call(Op.STAT, path)
        assert isinstance(a, Attr)
        return a

    # -- operations (each returns the reply's payload or raises) ------------------------

    def _init(self, nodeid: int, args: bytes) -> bytes:
        major, minor, readahead, flags = fp.INIT_IN.unpack_from(args, 0)
        if major != fp.KERNEL_VERSION:
            # A kernel of another major asks again with ours (FUSE's negotiation).
            return fp.INIT_OUT.pack(fp.KERNEL_VERSION, fp.KERNEL_MINOR, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        want = flags & (fp.FUSE_BIG_WRITES | fp.FUSE_AUTO_INVAL_DATA)
        return fp.INIT_OUT.pack(
            fp.KERNEL_VERSION,
            min(minor, fp.KERNEL_MINOR),
            readahead,
            want,
            16,  # max_background
            12,  # congestion_threshold
            fp.MAX_WRITE,
            1,  # time_gran: nanoseconds
            fp.MAX_WRITE // 4096,
            0,
            0,
        )

    def _destroy(self, nodeid: int, args: bytes) -> bytes:
        self.destroyed = True
        return b""

    def _lookup(self, nodeid: int, args: bytes) -> bytes:
        path = self._child(nodeid, _name(args))
        return self._entry(path, self._stat(path))

    def _getattr(self, nodeid: int, args: bytes) -> bytes:
        return self._attr_out(self._stat(self._path(nodeid)))

    def _setattr(self, nodeid: int, args: bytes) -> bytes:
        f = fp.SETATTR_IN.unpack_from(args, 0)
        valid, size, atime, mtime = f[0], f[3], f[5], f[6]
        atimensec, mtimensec, mode, uid, gid = f[8], f[9], f[11], f[13], f[14]
        if (valid & fp.FATTR_UID and uid != self.uid) or (valid & fp.FATTR_GID and gid != self.gid):
            raise FsError(errno.EPERM)  # the host keeps no owners
        bits = 0
        now = time.time_ns()
        a_ns = m_ns = 0
        if valid & fp.FATTR_MODE:
            bits |= _SET_MODE
        if valid & fp.FATTR_SIZE:
            bits |= _SET_SIZE
        if valid & (fp.FATTR_ATIME | fp.FATTR_ATIME_NOW):
            bits |= _SET_ATIME
            a_ns = now if valid & fp.FATTR_ATIME_NOW else atime * 10**9 + atimensec
        if valid & (fp.FATTR_MTIME | fp.FATTR_MTIME_NOW):
            bits |= _SET_MTIME
            m_ns = now if valid & fp.FATTR_MTIME_NOW else mtime * 10**9 + mtimensec
        path = self._path(nodeid)
        if not bits:
            return self._attr_out(self._stat(path))
        (a,) = self._call(Op.SETATTR, path, bits, mode & 0o7777, size, a_ns, m_ns)
        assert isinstance(a, Attr)
        return self._attr_out(a)

    def _readlink(self, nodeid: int, args: bytes) -> bytes:
        (target,) = self._call(Op.READLINK, self._path(nodeid))
        assert isinstance(target, bytes)
        return target

    def _symlink(self, nodeid: int, args: bytes) -> bytes:
        name, target = _two_names(args)
        path = self._child(nodeid, name)
        (a,) = self._call(Op.SYMLINK, target, path)
        assert isinstance(a, Attr)
        return self._entry(path, a)

    def _mknod(self, nodeid: int, args: bytes) -> bytes:
        mode, _rdev, _umask, _ = fp.MKNOD_IN.unpack_from(args, 0)
        if not stat.S_ISREG(mode):
            raise FsError(errno.EPERM)  # no device node, FIFO or socket on a volume
        path = self._child(nodeid, _name(args[fp.MKNOD_IN.size :]))
        handle, a = self._call(Op.CREATE, path, os.O_WRONLY | os.O_EXCL, mode & 0o777)
        self._call(Op.RELEASE, handle)
        assert isinstance(a, Attr)
        return self._entry(path, a)

    def _mkdir(self, nodeid: int, args: bytes) -> bytes:
        mode, _umask = fp.MKDIR_IN.unpack_from(args, 0)
        path = self._child(nodeid, _name(args[fp.MKDIR_IN.size :]))
        (a,) = self._call(Op.MKDIR, path, mode & 0o1777)
        assert isinstance(a, Attr)
        return self._entry(path, a)

    def _unlink(self, nodeid: int, args: bytes) -> bytes:
        path = self._child(nodeid, _name(args))
        self._call(Op.UNLINK, path)
        self._detach(path)
        return b""

    def _rmdir(self, nodeid: int, args: bytes) -> bytes:
        path = self._child(nodeid, _name(args))
        self._call(Op.RMDIR, path)
        self._detach(path)
        return b""

    def _do_rename(self, nodeid: int, newdir: int, names: bytes) -> bytes:
        old_name, new_name = _two_names(names)
        old, new = self._child(nodeid, old_name), self._child(newdir, new_name)
        self._call(Op.RENAME, old, new, 0)
        self._move(old, new)
        return b""

    def _rename(self, nodeid: int, args: bytes) -> bytes:
        (newdir,) = fp.RENAME_IN.unpack_from(args, 0)
        return self._do_rename(nodeid, newdir, args[fp.RENAME_IN.size :])

    def _rename2(self, nodeid: int, args: bytes) -> bytes:
        newdir, flags, _ = fp.RENAME2_IN.unpack_from(args, 0)
        if flags:
            raise FsError(errno.EINVAL)  # RENAME_NOREPLACE / EXCHANGE / WHITEOUT
        return self._do_rename(nodeid, newdir, args[fp.RENAME2_IN.size :])

    def _link(self, nodeid: int, args: bytes) -> bytes:
        (old_node,) = fp.LINK_IN.unpack_from(args, 0)
        path = self._child(nodeid, _name(args[fp.LINK_IN.size :]))
        (a,) = self._call(Op.LINK, self._path(old_node), path)
        assert isinstance(a, Attr)
        return self._entry(path, a)

    def _add_file(self, nodeid: int, flags: int, handle: int) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self.files[fh] = OpenFile(nodeid, flags & _OPEN_KEEP & ~os.O_TRUNC, handle)
        return fh

    def _open(self, nodeid: int, args: bytes) -> bytes:
        flags, _ = fp.OPEN_IN.unpack_from(args, 0)
        (handle,) = self._call(Op.OPEN, self._path(nodeid), flags & _OPEN_KEEP)
        assert isinstance(handle, int)
        return fp.OPEN_OUT.pack(self._add_file(nodeid, flags, handle), 0, 0)

    def _create(self, nodeid: int, args: bytes) -> bytes:
        flags, mode, _umask, _ = fp.CREATE_IN.unpack_from(args, 0)
        path = self._child(nodeid, _name(args[fp.CREATE_IN.size :]))
        keep = flags & (_OPEN_KEEP | os.O_EXCL)
        handle, a = self._call(Op.CREATE, path, keep, mode & 0o777)
        assert isinstance(handle, int) and isinstance(a, Attr)
        entry = self._entry(path, a)
        fh = self._add_file(self._by_path[path], flags, handle)
        return entry + fp.OPEN_OUT.pack(fh, 0, 0)

    def _file(self, fh: int) -> OpenFile:
        f = self.files.get(fh)
        if f is None:
            raise FsError(errno.EBADF)
        return f

    def _on_handle(self, fh: int, op: Op, *rest: object) -> tuple[object, ...]:
        """``op(handle, *rest)``; after EBADF (a new host session) the file is opened
        again by its path and the call made once more."""
        f = self._file(fh)
        try:
            return self._call(op, f.handle, *rest)
        except RemoteError as exc:
            if exc.errno != errno.EBADF:
                raise
        node = self.nodes.get(f.node)
        if node is None or node.path is None:
            raise FsError(errno.EBADF)  # unlinked since: nothing to open again
        try:
            (handle,) = self._call(Op.OPEN, node.path, f.flags)
        except RemoteError as exc:
            if exc.errno == errno.ENOENT:  # removed by another sandbox meanwhile
                raise FsError(errno.EBADF) from exc
            raise
        assert isinstance(handle, int)
        f.handle = handle
        log.info("sharefs: reopened %r after a new host session", node.path)
        return self._call(op, f.handle, *rest)

    def _read(self, nodeid: int, args: bytes) -> bytes:
        fh, offset, size, *_ = fp.READ_IN.unpack_from(args, 0)
        (data,) = self._on_handle(fh, Op.READ, offset, min(size, MAX_IO))
        assert isinstance(data, bytes)
        return data

    def _write(self, nodeid: int, args: bytes) -> bytes:
        fh, offset, size, *_ = fp.WRITE_IN.unpack_from(args, 0)
        data = args[fp.WRITE_IN.size : fp.WRITE_IN.size + size]
        done = 0
        while done < len(data):  # the host takes at most MAX_IO per call
            (n,) = self._on_handle(fh, Op.WRITE, offset + done, data[done : done + MAX_IO])
            assert isinstance(n, int)
            if n == 0:
                break
            done += n
        return fp.WRITE_OUT.pack(done, 0)

    def _release(self, nodeid: int, args: bytes) -> bytes:
        (fh, *_) = fp.RELEASE_IN.unpack_from(args, 0)
        f = self.files.pop(fh, None)
        if f is not None:
            try:
                self._call(Op.RELEASE, f.handle)
            except RemoteError as exc:
                if exc.errno != errno.EBADF:  # EBADF: its session is gone, and with it
                    raise
        return b""

    def _fsync(self, nodeid: int, args: bytes) -> bytes:
        fh, flags, _ = fp.FSYNC_IN.unpack_from(args, 0)
        self._on_handle(fh, Op.FSYNC, flags & 1)
        return b""

    def _opendir(self, nodeid: int, args: bytes) -> bytes:
        self._path(nodeid)
        return fp.OPEN_OUT.pack(0, 0, 0)

    def _readdir(self, nodeid: int, args: bytes) -> bytes:
        _fh, offset, size, *_ = fp.READ_IN.unpack_from(args, 0)
        path = self._path(nodeid)
        out: list[bytes] = []
        used = 0

        def add(ino: int, off: int, mode: int, name: bytes) -> bool:
            nonlocal used
            d = fp.dirent(ino, off, (mode >> 12) & 0o17, name)
            if used + len(d) > size:
                return False
            out.append(d)
            used += len(d)
            return True

        # Cookies: 1 after ".", 2 after "..", then 2 + the host's own offsets.
        if offset < 1 and not add(1, 1, stat.S_IFDIR, b"."):
            return b""
        if offset < 2 and not add(1, 2, stat.S_IFDIR, b".."):
            return b"".join(out)
        host_off = max(offset - 2, 0)
        while True:
            (entries,) = self._call(Op.READDIR, path, host_off)
            assert isinstance(entries, tuple)
            if not entries:
                return b"".join(out)
            for e in entries:
                assert isinstance(e, DirEntry)
                if not add(e.ino, e.next_offset + 2, e.mode, e.name):
                    return b"".join(out)
                host_off = e.next_offset

    def _statfs(self, nodeid: int, args: bytes) -> bytes:
        bsize, blocks, bfree, bavail, files, ffree, namemax = self._call(Op.STATFS)
        return fp.STATFS_OUT.pack(blocks, bfree, bavail, files, ffree, bsize, namemax, bsize, 0)
