"""The guest agent's shared-volume FUSE loop without a kernel: a fake ``/dev/fuse`` (a
SOCK_SEQPACKET pair: one read is one request, one write one reply) in front of
``ops_sharefs.serve``, and the real host server (``ShareFsSession``) behind a fake QEMU
chardev that can lose a request, cut a reply and reconnect. The VM test
(``tests/vm/test_shared_volumes_vm.py``) runs the same code against the guest kernel."""

from __future__ import annotations

import errno
import os
import socket
import stat
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from hutch.storage.sharefs_server import ShareFsSession

AGENT_DIR = str(Path(__file__).resolve().parents[2] / "guest_agent")
if AGENT_DIR not in sys.path:
    sys.path.insert(0, AGENT_DIR)

from hutch_agent import fuse_proto as fp  # noqa: E402
from hutch_agent.fuse_fs import ShareFs  # noqa: E402
from hutch_agent.ops_sharefs import serve  # noqa: E402
from hutch_agent.sharefs_client import ShareFsClient  # noqa: E402

S_IFREG, S_IFDIR = stat.S_IFREG, stat.S_IFDIR


class FakeQemu:
    """The host end of the volume's port: forwards to the current session; can drop
    the next request or send only half of the next reply, and reconnect."""

    def __init__(self, tree: Path) -> None:
        self.tree = tree
        self.host, self.guest = socket.socketpair()
        self.session = ShareFsSession(tree)
        self.sessions = [self.session]
        self.drop_next = False
        self.cut_next = False
        self.dropped = threading.Event()
        self.requests = 0
        self._lock = threading.Lock()
        self.host.sendall(self.session.hello())
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = self.host.recv(262144)
            except OSError:
                return
            if not data:
                return
            with self._lock:
                self.requests += 1
                if self.drop_next:
                    self.drop_next = False
                    self.dropped.set()
                    continue
                out = self.session.feed(data)
                if self.cut_next and out:
                    self.cut_next = False
                    out = out[: len(out) // 2]
                    self.dropped.set()
            try:
                self.host.sendall(out)
            except OSError:
                return

    def reconnect(self) -> None:
        """The old QEMU (or connection) is gone: a new session says HELLO."""
        with self._lock:
            self.session.close()
            self.session = ShareFsSession(self.tree)
            self.sessions.append(self.session)
            self.host.sendall(self.session.hello())

    def close(self) -> None:
        self.guest.shutdown(socket.SHUT_RDWR)  # the thread's recv ends
        self._thread.join(5)
        self.host.close()
        self.guest.close()
        for s in self.sessions:
            s.close()


class Kernel:
    """Plays the guest kernel's side of /dev/fuse."""

    def __init__(self, fs: ShareFs) -> None:
        self.dev, agent_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.fs = fs
        self.unique = 0
        self._thread = threading.Thread(target=serve, args=(agent_end.detach(), fs), daemon=True)
        self._thread.start()

    def send(self, opcode: int, nodeid: int = fp.ROOT_ID, payload: bytes = b"") -> int:
        self.unique += 1
        size = fp.IN_HEADER.size + len(payload)
        self.dev.send(fp.IN_HEADER.pack(size, opcode, self.unique, nodeid, 0, 0, 0, 0) + payload)
        return self.unique

    def answer(self, unique: int) -> tuple[int, bytes]:
        self.dev.settimeout(10)
        data = self.dev.recv(1 << 20)
        length, error, got = fp.OUT_HEADER.unpack_from(data, 0)
        assert got == unique and length == len(data)
        return -error, data[fp.OUT_HEADER.size :]

    def __call__(self, opcode: int, nodeid: int = fp.ROOT_ID, payload: bytes = b"") -> bytes:
        err, out = self.answer(self.send(opcode, nodeid, payload))
        assert err == 0, f"opcode {opcode}: {os.strerror(err)}"
        return out

    def err(self, opcode: int, nodeid: int = fp.ROOT_ID, payload: bytes = b"") -> int:
        err, _ = self.answer(self.send(opcode, nodeid, payload))
        return err

    def close(self) -> None:
        self.dev.close()
        self._thread.join(5)


def attr_of(entry: bytes) -> tuple[int, ...]:
    return fp.ATTR.unpack_from(entry, fp.ENTRY_HEAD.size)


def nodeid_of(entry: bytes) -> int:
    return int(fp.ENTRY_HEAD.unpack_from(entry, 0)[0])


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "vol"
    root.mkdir()
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text("host secret\n")
    return root


@pytest.fixture
def qemu(tree: Path) -> Iterator[FakeQemu]:
    q = FakeQemu(tree)
    yield q
    q.close()


@pytest.fixture
def kernel(qemu: FakeQemu) -> Iterator[Kernel]:
    k = Kernel(ShareFs(ShareFsClient(qemu.guest.fileno())))
    init = k(fp.Opcode.INIT, 0, fp.INIT_IN.pack(7, 36, 65536, 0xFFFFFFFF))
    major, minor, _, flags, *_rest = fp.INIT_OUT.unpack_from(init, 0)
    assert (major, minor) == (7, 31)
    assert flags == fp.FUSE_BIG_WRITES | fp.FUSE_AUTO_INVAL_DATA
    assert len(init) == fp.INIT_OUT.size == 64
    yield k
    k.close()


def create(k: Kernel, name: bytes, flags: int = os.O_RDWR, mode: int = 0o644) -> tuple[int, int]:
    out = k(
        fp.Opcode.CREATE,
        fp.ROOT_ID,
        fp.CREATE_IN.pack(flags, S_IFREG | mode, 0o22, 0) + name + b"\0",
    )
    fh = fp.OPEN_OUT.unpack_from(out, fp.ENTRY_HEAD.size + fp.ATTR.size)[0]
    return nodeid_of(out), fh


def write(k: Kernel, fh: int, offset: int, data: bytes) -> int:
    out = k(fp.Opcode.WRITE, 0, fp.WRITE_IN.pack(fh, offset, len(data), 0, 0, 0, 0) + data)
    return int(fp.WRITE_OUT.unpack(out)[0])


def read_in(fh: int, offset: int, size: int) -> bytes:
    return fp.READ_IN.pack(fh, offset, size, 0, 0, 0, 0)


def names_in(k: Kernel, nodeid: int = fp.ROOT_ID) -> list[bytes]:
    k(fp.Opcode.OPENDIR, nodeid, fp.OPEN_IN.pack(0, 0))
    names: list[bytes] = []
    offset = 0
    while True:
        out = k(fp.Opcode.READDIR, nodeid, read_in(0, offset, 4096))
        if not out:
            return names
        pos = 0
        while pos < len(out):
            _ino, offset, namelen, _type = fp.DIRENT.unpack_from(out, pos)
            names.append(out[pos + fp.DIRENT.size : pos + fp.DIRENT.size + namelen])
            pos += (fp.DIRENT.size + namelen + 7) & ~7


def test_create_write_read_and_getattr_reach_the_host_tree(kernel: Kernel, tree: Path) -> None:
    assert kernel.err(fp.Opcode.LOOKUP, fp.ROOT_ID, b"f\0") == errno.ENOENT
    node, fh = create(kernel, b"f")
    big = os.urandom(300_000)
    done = 0  # the kernel writes at most MAX_WRITE per request
    while done < len(big):
        done += write(kernel, fh, done, big[done : done + fp.MAX_WRITE])
    assert (tree / "f").read_bytes() == big
    got = b""
    while len(got) < len(big):
        got += kernel(fp.Opcode.READ, node, read_in(fh, len(got), fp.MAX_WRITE))
    assert got == big
    attr = fp.ATTR.unpack_from(kernel(fp.Opcode.GETATTR, node, fp.GETATTR_IN.pack(0, 0, 0)), 16)
    assert attr[1] == len(big) and attr[9] == S_IFREG | 0o644 and attr[11:13] == (0, 0)
    kernel(fp.Opcode.RELEASE, node, fp.RELEASE_IN.pack(fh, 0, 0, 0))
    assert kernel.fs.files == {}
    # Another sandbox's write shows: attributes are never cached (attr_valid 0).
    (tree / "f").write_bytes(b"changed")
    entry = kernel(fp.Opcode.LOOKUP, fp.ROOT_ID, b"f\0")
    assert attr_of(entry)[1] == 7 and fp.ENTRY_HEAD.unpack_from(entry, 0)[3] == 0


def test_directories_rename_moves_the_paths_of_nodes_under_it(kernel: Kernel, tree: Path) -> None:
    d = nodeid_of(kernel(fp.Opcode.MKDIR, fp.ROOT_ID, fp.MKDIR_IN.pack(0o755, 0) + b"d\0"))
    sub = nodeid_of(kernel(fp.Opcode.MKDIR, d, fp.MKDIR_IN.pack(0o700, 0) + b"sub\0"))
    (tree / "d" / "sub" / "x").write_text("x")
    assert names_in(kernel) == [b".", b"..", b"d"]
    assert names_in(kernel, sub) == [b".", b"..", b"x"]
    kernel(fp.Opcode.RENAME, fp.ROOT_ID, fp.RENAME_IN.pack(fp.ROOT_ID) + b"d\0e\0")
    assert (tree / "e" / "sub" / "x").exists() and not (tree / "d").exists()
    # The kernel still holds 'sub' by its node id: it must now mean e/sub.
    assert names_in(kernel, sub) == [b".", b"..", b"x"]
    assert (
        kernel.err(fp.Opcode.RENAME2, fp.ROOT_ID, fp.RENAME2_IN.pack(fp.ROOT_ID, 1, 0) + b"e\0g\0")
        == errno.EINVAL
    )
    e = nodeid_of(kernel(fp.Opcode.LOOKUP, fp.ROOT_ID, b"e\0"))
    assert kernel.err(fp.Opcode.RMDIR, e, b"sub\0") == errno.ENOTEMPTY
    kernel(fp.Opcode.UNLINK, sub, b"x\0")
    kernel(fp.Opcode.RMDIR, e, b"sub\0")
    assert kernel.err(fp.Opcode.GETATTR, sub, fp.GETATTR_IN.pack(0, 0, 0)) == errno.ESTALE
    assert list((tree / "e").iterdir()) == []


def test_many_entries_page_through_readdir(kernel: Kernel, tree: Path) -> None:
    want = sorted(f"file-{i:04d}".encode() for i in range(700))
    for name in want:
        (tree / name.decode()).write_bytes(b"")
    assert names_in(kernel) == [b".", b"..", *want]


def test_no_device_no_fifo_no_setuid_no_owner_change(kernel: Kernel, tree: Path) -> None:
    for mode in (
        stat.S_IFCHR | 0o666,
        stat.S_IFBLK | 0o666,
        stat.S_IFIFO | 0o644,
        stat.S_IFSOCK | 0o644,
    ):
        payload = fp.MKNOD_IN.pack(mode, os.makedev(1, 3), 0, 0) + b"node\0"
        assert kernel.err(fp.Opcode.MKNOD, fp.ROOT_ID, payload) == errno.EPERM
    assert not (tree / "node").exists()
    node, _fh = create(kernel, b"prog", mode=0o755)
    setattr_in = fp.SETATTR_IN.pack(
        fp.FATTR_MODE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, S_IFREG | 0o6755, 0, 0, 0, 0
    )
    attr = fp.ATTR.unpack_from(kernel(fp.Opcode.SETATTR, node, setattr_in), 16)
    assert attr[9] == S_IFREG | 0o755  # setuid and setgid dropped
    assert (tree / "prog").stat().st_mode & 0o7777 == 0o755
    chown = fp.SETATTR_IN.pack(fp.FATTR_UID, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1000, 0, 0)
    assert kernel.err(fp.Opcode.SETATTR, node, chown) == errno.EPERM
    same = fp.SETATTR_IN.pack(
        fp.FATTR_UID | fp.FATTR_GID, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
    )
    kernel(fp.Opcode.SETATTR, node, same)  # chown to the owner shown: a no-op (tar, cp -p)
    truncate = fp.SETATTR_IN.pack(fp.FATTR_SIZE, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    assert fp.ATTR.unpack_from(kernel(fp.Opcode.SETATTR, node, truncate), 16)[1] == 3
    assert kernel.err(fp.Opcode.SETXATTR, node, b"") == errno.ENOSYS


def test_a_symlink_is_text_the_host_never_follows(kernel: Kernel, tree: Path) -> None:
    link = nodeid_of(kernel(fp.Opcode.SYMLINK, fp.ROOT_ID, b"etc\0/etc\0"))
    assert kernel(fp.Opcode.READLINK, link) == b"/etc"
    up = nodeid_of(kernel(fp.Opcode.SYMLINK, fp.ROOT_ID, b"up\0../etc\0"))
    assert kernel(fp.Opcode.READLINK, up) == b"../etc"
    assert os.readlink(tree / "etc") == "/etc"
    # Through the link the host refuses (the guest kernel resolves links itself).
    assert kernel.err(fp.Opcode.LOOKUP, link, b"passwd\0") in (errno.ELOOP, errno.ENOTDIR)
    assert kernel.err(fp.Opcode.LOOKUP, up, b"passwd\0") in (errno.ELOOP, errno.ENOTDIR)
    assert (tree.parent / "etc" / "passwd").read_text() == "host secret\n"


def test_after_a_reconnect_open_files_are_opened_again_by_path(
    kernel: Kernel, qemu: FakeQemu, tree: Path
) -> None:
    node, fh = create(kernel, b"f")
    write(kernel, fh, 0, b"before")
    qemu.reconnect()  # a memory-mode resume: the new session knows no handle
    assert write(kernel, fh, 6, b"+after") == 6
    assert kernel(fp.Opcode.READ, node, read_in(fh, 0, 100)) == b"before+after"
    assert kernel.fs.client.sessions == 2
    assert qemu.sessions[-1].open_handles == 1
    # An unlinked file cannot be found again: EBADF, the mount goes on.
    os.unlink(tree / "f")
    qemu.reconnect()
    assert kernel.err(fp.Opcode.READ, node, read_in(fh, 0, 1)) == errno.EBADF
    kernel(fp.Opcode.RELEASE, node, fp.RELEASE_IN.pack(fh, 0, 0, 0))
    assert names_in(kernel) == [b".", b".."]


def test_a_request_lost_with_the_old_host_is_sent_again_and_runs_once(
    kernel: Kernel, qemu: FakeQemu, tree: Path
) -> None:
    qemu.drop_next = True
    unique = kernel.send(fp.Opcode.MKDIR, fp.ROOT_ID, fp.MKDIR_IN.pack(0o755, 0) + b"once\0")
    assert qemu.dropped.wait(5)
    qemu.reconnect()
    err, _ = kernel.answer(unique)
    assert err == 0 and (tree / "once").is_dir()


def test_a_reply_cut_by_a_reconnect_is_skipped_not_taken_for_another(
    kernel: Kernel, qemu: FakeQemu, tree: Path
) -> None:
    (tree / "data").write_bytes(bytes(range(256)) * 512)
    node = nodeid_of(kernel(fp.Opcode.LOOKUP, fp.ROOT_ID, b"data\0"))
    fh = fp.OPEN_OUT.unpack(kernel(fp.Opcode.OPEN, node, fp.OPEN_IN.pack(os.O_RDONLY, 0)))[0]
    qemu.cut_next = True
    unique = kernel.send(fp.Opcode.READ, node, read_in(fh, 0, 65536))
    assert qemu.dropped.wait(5)
    qemu.reconnect()  # its HELLO completes the cut frame: the CRC tells them apart
    err, data = kernel.answer(unique)
    assert err == 0 and data == (bytes(range(256)) * 512)[:65536]


def test_forget_drops_nodes_and_statfs_answers(kernel: Kernel, tree: Path) -> None:
    (tree / "a").write_text("a")
    a = nodeid_of(kernel(fp.Opcode.LOOKUP, fp.ROOT_ID, b"a\0"))
    assert nodeid_of(kernel(fp.Opcode.LOOKUP, fp.ROOT_ID, b"a\0")) == a
    kernel.send(fp.Opcode.FORGET, a, fp.FORGET_IN.pack(1))
    assert a in kernel.fs.nodes
    kernel.send(fp.Opcode.BATCH_FORGET, 0, fp.BATCH_FORGET_IN.pack(1, 0) + fp.FORGET_ONE.pack(a, 1))
    out = kernel(fp.Opcode.STATFS)  # answered after both forgets: requests run in order
    assert a not in kernel.fs.nodes and set(kernel.fs.nodes) == {fp.ROOT_ID}
    blocks, _bfree, _bavail, _files, _ffree, bsize, namelen, *_ = fp.STATFS_OUT.unpack(out)
    assert blocks > 0 and bsize > 0 and namelen == 255
    assert kernel.err(9999) == errno.ENOSYS


def test_the_agent_carries_the_host_wire_codec_unchanged() -> None:
    # The agent runs on the standard library alone, so it has its own copy: one codec.
    root = Path(__file__).resolve().parents[2]
    host = (root / "src/hutch/storage/sharefs_wire.py").read_bytes()
    assert (root / "guest_agent/hutch_agent/sharefs_wire.py").read_bytes() == host, (
        "copy src/hutch/storage/sharefs_wire.py to guest_agent/hutch_agent/"
    )
