"""The shared-volume server against a real directory: it serves only that tree, whatever
the guest sends (symlinks to the host's /etc, '..', hostile frames), creates no device or
setuid file, bounds its handles, and answers every failure with an errno."""

from __future__ import annotations

import asyncio
import errno
import os
import random
import socket
import stat
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from hutch.storage.sharefs_resolve import ConfinedRoot, openat2
from hutch.storage.sharefs_server import (
    SET_MODE,
    SET_MTIME,
    SET_SIZE,
    ShareFsSession,
    serve_stream,
)
from hutch.storage.sharefs_wire import (
    HELLO,
    MAGIC,
    MAX_FRAME,
    MAX_IO,
    Attr,
    FrameDecoder,
    Op,
    decode_reply,
    encode_request,
    frame,
)


class Guest:
    """Drives a session as the guest side would: one request, one reply."""

    def __init__(self, session: ShareFsSession) -> None:
        self.s = session
        self.next_id = 1

    def raw(self, data: bytes, op: Op) -> tuple[int, tuple[object, ...]]:
        out = FrameDecoder().feed(self.s.feed(data))
        assert len(out) == 1 and isinstance(out[0], bytes)
        _, err, results = decode_reply(op, out[0])
        return err, results

    def __call__(self, op: Op, *args: object) -> tuple[int, tuple[object, ...]]:
        self.next_id += 1
        return self.raw(encode_request(self.next_id, op, *args), op)

    def ok(self, op: Op, *args: object) -> tuple[object, ...]:
        err, results = self(op, *args)
        assert err == 0, os.strerror(err)
        return results

    def err(self, op: Op, *args: object) -> int:
        err, _ = self(op, *args)
        assert err != 0
        return err


@pytest.fixture
def host_etc(tmp_path: Path) -> Path:
    """A stand-in for the host's /etc, outside the volume. Never the real /etc: if the
    resolver were broken these tests would unlink and truncate what the links name."""
    etc = tmp_path / "host_etc"
    etc.mkdir()
    (etc / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    return etc


@pytest.fixture
def tree(tmp_path: Path, host_etc: Path) -> Iterator[Path]:
    root = tmp_path / "vol"
    root.mkdir()
    (root / "d").mkdir()
    (root / "d" / "f").write_bytes(b"hello")
    # A guest made these (through SYMLINK) hoping the host would follow them.
    os.symlink(host_etc, root / "etc_link")
    os.symlink("..", root / "d" / "up")
    os.symlink(host_etc / "passwd", root / "passwd_link")
    (tmp_path / "outside").write_text("host secret")
    yield root
    # Whatever a test sent, nothing outside the volume changed.
    assert sorted(p.name for p in host_etc.iterdir()) == ["passwd"]
    assert (host_etc / "passwd").read_text() == "root:x:0:0::/root:/bin/sh\n"
    assert (tmp_path / "outside").read_text() == "host secret"


@pytest.fixture
def guest(tree: Path) -> Iterator[Guest]:
    s = ShareFsSession(tree, max_handles=4)
    yield Guest(s)
    s.close()


def test_write_read_list_rename_unlink(guest: Guest, tree: Path) -> None:
    handle, attr = guest.ok(Op.CREATE, b"d/new", os.O_RDWR, 0o644)
    assert isinstance(attr, Attr) and stat.S_ISREG(attr.mode)
    assert guest.ok(Op.WRITE, handle, 0, b"abc") == (3,)
    assert guest.ok(Op.READ, handle, 1, 10) == (b"bc",)
    guest.ok(Op.FSYNC, handle, 0)
    guest.ok(Op.RELEASE, handle)
    assert (tree / "d" / "new").read_bytes() == b"abc"
    (entries,) = guest.ok(Op.READDIR, b"d", 0)
    assert [e.name for e in entries] == [b"f", b"new", b"up"]  # type: ignore[attr-defined]
    guest.ok(Op.MKDIR, b"d/sub", 0o755)
    guest.ok(Op.RENAME, b"d/new", b"d/sub/moved", 0)
    assert (tree / "d" / "sub" / "moved").read_bytes() == b"abc"
    guest.ok(Op.UNLINK, b"d/sub/moved")
    guest.ok(Op.RMDIR, b"d/sub")
    assert guest.err(Op.STAT, b"d/sub") == errno.ENOENT


def test_readdir_pages_resume_at_the_cookie(guest: Guest, tree: Path) -> None:
    for i in range(600):
        (tree / "d" / f"n{i:04}").touch()
    names: list[bytes] = []
    offset = 0
    pages = 0
    while True:
        (entries,) = guest.ok(Op.READDIR, b"d", offset)
        if not entries:
            break
        pages += 1
        names += [e.name for e in entries]  # type: ignore[attr-defined]
        offset = entries[-1].next_offset  # type: ignore[index]
    assert pages >= 3  # bounded pages (256 entries at most)
    assert len(names) == 602 and len(set(names)) == 602  # f, up and the 600


@pytest.mark.parametrize(
    "path",
    [b"etc_link/passwd", b"etc_link", b"passwd_link", b"d/up/etc_link", b"d/up/d/f"],
)
def test_no_symlink_is_followed_on_the_host(guest: Guest, path: bytes) -> None:
    assert guest.err(Op.OPEN, path, os.O_RDONLY) in (errno.ELOOP, errno.EXDEV)
    if path.count(b"/"):
        # Through a symlink in the middle: refused by the kernel's resolver.
        assert guest.err(Op.STAT, path) in (errno.ELOOP, errno.EXDEV)


def test_a_symlink_as_the_last_name_is_the_link_itself(guest: Guest, host_etc: Path) -> None:
    (attr,) = guest.ok(Op.STAT, b"etc_link")
    assert stat.S_ISLNK(attr.mode)  # type: ignore[attr-defined]
    assert guest.ok(Op.READLINK, b"etc_link") == (os.fsencode(host_etc),)  # the guest follows it
    assert guest.err(Op.READDIR, b"etc_link", 0) in (errno.ELOOP, errno.ENOTDIR)
    assert guest.err(Op.SETATTR, b"passwd_link", SET_MODE, 0o777, 0, 0, 0) == errno.EOPNOTSUPP
    assert guest.err(Op.CREATE, b"passwd_link", os.O_WRONLY | os.O_TRUNC, 0o644) == errno.ELOOP
    # Hard-linking the symlink links the link, not its target.
    (attr,) = guest.ok(Op.LINK, b"passwd_link", b"d/hard")
    assert stat.S_ISLNK(attr.mode)  # type: ignore[attr-defined]
    guest.ok(Op.UNLINK, b"passwd_link")
    assert (host_etc / "passwd").exists()


def test_removing_or_renaming_through_a_symlinked_dir_is_refused(guest: Guest) -> None:
    assert guest.err(Op.UNLINK, b"etc_link/passwd") in (errno.ELOOP, errno.EXDEV)
    assert guest.err(Op.RENAME, b"d/f", b"etc_link/f", 0) in (errno.ELOOP, errno.EXDEV)
    assert guest.err(Op.MKDIR, b"etc_link/x", 0o755) in (errno.ELOOP, errno.EXDEV)
    assert guest.err(Op.SYMLINK, b"x", b"etc_link/x") in (errno.ELOOP, errno.EXDEV)


def test_dotdot_and_absolute_paths_from_a_hostile_frame(guest: Guest, tree: Path) -> None:
    for path in (b"..", b"../outside", b"d/../../outside", b"/etc/passwd", b"d//f"):
        body = struct.pack("<IH", 5, Op.OPEN) + len(path).to_bytes(2, "little") + path
        body += struct.pack("<I", os.O_RDONLY)
        err, _ = guest.raw(frame(body), Op.OPEN)
        assert err == errno.EINVAL, path


@pytest.mark.parametrize("use_openat2", [True, False])
def test_the_resolver_itself_refuses_escapes(tree: Path, use_openat2: bool) -> None:
    """Both resolvers (openat2, and the O_PATH walk for kernels without it), called with
    paths the wire codec would have refused: the second line of defence holds alone."""
    root = ConfinedRoot(tree, use_openat2=use_openat2)
    try:
        for bad in (b"..", b"d/../..", b"/tmp", b"etc_link/passwd", b"d/up/d"):
            with pytest.raises(OSError) as info:
                os.close(root.open(bad, os.O_RDONLY))
            assert info.value.errno in (errno.EINVAL, errno.ELOOP, errno.EXDEV, errno.ENOTDIR)
        fd = root.open(b"d/f", os.O_RDONLY)
        assert os.read(fd, 5) == b"hello"
        os.close(fd)
    finally:
        root.close()
        root.close()  # twice is safe


def test_openat2_with_resolve_beneath_refuses_dotdot_in_the_kernel(tree: Path) -> None:
    rootfd = os.open(tree, os.O_PATH | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError) as info:
            openat2(rootfd, b"../outside", os.O_RDONLY)
        assert info.value.errno == errno.EXDEV
        with pytest.raises(OSError) as info:
            openat2(rootfd, b"etc_link/passwd", os.O_RDONLY)
        assert info.value.errno == errno.ELOOP
    finally:
        os.close(rootfd)


def test_no_setuid_or_setgid_bit_is_ever_set(guest: Guest, tree: Path) -> None:
    handle, _ = guest.ok(Op.CREATE, b"suid", os.O_WRONLY, 0o6755)
    guest.ok(Op.RELEASE, handle)
    assert stat.S_IMODE((tree / "suid").stat().st_mode) == 0o755
    guest.ok(Op.SETATTR, b"suid", SET_MODE, 0o4777, 0, 0, 0)
    assert stat.S_IMODE((tree / "suid").stat().st_mode) == 0o777
    guest.ok(Op.MKDIR, b"sgid", 0o3777)
    assert stat.S_IMODE((tree / "sgid").stat().st_mode) == 0o1777  # sticky kept, setgid not


def test_owner_changes_and_directory_hard_links_are_refused(guest: Guest) -> None:
    assert guest.err(Op.SETATTR, b"d/f", 0x100, 0, 0, 0, 0) == errno.EPERM
    assert guest.err(Op.LINK, b"d", b"dlink") == errno.EPERM
    assert guest.err(Op.RENAME, b"d/f", b"g", 1) == errno.EINVAL  # rename flags


def test_setattr_truncates_and_sets_times(guest: Guest, tree: Path) -> None:
    (attr,) = guest.ok(Op.SETATTR, b"d/f", SET_SIZE | SET_MTIME, 0, 2, 0, 10**18)
    assert attr.size == 2 and attr.mtime_ns == 10**18  # type: ignore[attr-defined]
    assert (tree / "d" / "f").read_bytes() == b"he"
    guest.ok(Op.SETATTR, b"", SET_MTIME, 0, 0, 0, 10**18)
    assert tree.stat().st_mtime_ns == 10**18


def test_special_files_are_never_opened(guest: Guest, tree: Path) -> None:
    os.mkfifo(tree / "fifo")  # got there some other way: opening must not hang
    assert guest.err(Op.OPEN, b"fifo", os.O_RDONLY) == errno.EPERM
    assert guest.err(Op.OPEN, b"d", os.O_RDONLY) == errno.EISDIR
    # Flags a guest must not choose are dropped: O_CREAT through OPEN creates nothing.
    assert guest.err(Op.OPEN, b"nope", os.O_RDWR | os.O_CREAT) == errno.ENOENT


def test_handles_are_bounded_never_reused_and_closed_with_the_session(tree: Path) -> None:
    before = len(os.listdir("/proc/self/fd"))
    s = ShareFsSession(tree, max_handles=4)
    g = Guest(s)
    handles = [g.ok(Op.OPEN, b"d/f", os.O_RDONLY)[0] for _ in range(4)]
    assert g.err(Op.OPEN, b"d/f", os.O_RDONLY) == errno.EMFILE
    g.ok(Op.RELEASE, handles[0])
    assert g.err(Op.READ, handles[0], 0, 1) == errno.EBADF  # stale
    assert g.err(Op.RELEASE, handles[0]) == errno.EBADF
    (again,) = g.ok(Op.OPEN, b"d/f", os.O_RDONLY)
    assert again not in handles
    assert s.open_handles == 4
    # A new session (after a reconnect) never accepts the old one's handles.
    s2 = ShareFsSession(tree)
    g2 = Guest(s2)
    for h in handles:
        assert g2.err(Op.READ, h, 0, 1) == errno.EBADF
    s2.close()
    s.close()
    s.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_bounds_on_sizes_and_offsets(guest: Guest) -> None:
    (handle,) = guest.ok(Op.OPEN, b"d/f", os.O_RDONLY)
    assert guest.err(Op.READ, handle, 0, MAX_IO + 1) == errno.EINVAL
    assert guest.err(Op.READ, handle, 2**64 - 1, 1) == errno.EINVAL  # past off_t
    assert guest.err(Op.WRITE, handle, 0, b"x") == errno.EBADF  # opened read-only
    assert guest.err(Op.SYMLINK, b"", b"emptylink") == errno.EINVAL


def test_an_oversize_frame_gets_emsgsize_and_the_session_goes_on(guest: Guest) -> None:
    huge = MAX_FRAME + 1
    head = MAGIC + huge.to_bytes(4, "little") + b"crc!" + struct.pack("<IH", 41, Op.WRITE)
    out = guest.s.feed(head)
    (reply,) = FrameDecoder().feed(out)
    assert decode_reply(Op.WRITE, reply) == (41, errno.EMSGSIZE, ())  # type: ignore[arg-type]
    assert guest.s.feed(b"\0" * (huge - 6)) == b""
    assert guest.ok(Op.STAT, b"d/f")[0].size == 5  # type: ignore[attr-defined]


def test_read_only_sessions_refuse_every_write(tree: Path) -> None:
    s = ShareFsSession(tree, read_only=True)
    g = Guest(s)
    try:
        assert g.err(Op.CREATE, b"x", os.O_WRONLY, 0o644) == errno.EROFS
        assert g.err(Op.OPEN, b"d/f", os.O_RDWR) == errno.EROFS
        assert g.err(Op.OPEN, b"d/f", os.O_RDONLY | os.O_TRUNC) == errno.EROFS
        assert (tree / "d" / "f").read_bytes() == b"hello"  # not truncated on the way
        assert g.err(Op.UNLINK, b"d/f") == errno.EROFS
        assert g.err(Op.SETATTR, b"d/f", SET_SIZE, 0, 0, 0, 0) == errno.EROFS
        assert g.ok(Op.READ, g.ok(Op.OPEN, b"d/f", os.O_RDONLY)[0], 0, 5) == (b"hello",)
        assert s.open_handles == 1
    finally:
        s.close()


def test_random_frames_never_kill_the_session(guest: Guest, tree: Path) -> None:
    rng = random.Random(99)
    for _ in range(3000):
        op = rng.choice(list(Op))
        body = struct.pack("<IH", rng.randrange(2**32), op)
        body += bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
        guest.s.feed(MAGIC + len(body).to_bytes(4, "little") + body)
    assert guest.ok(Op.STAT, b"d/f")[0].size == 5  # type: ignore[attr-defined]
    assert (tree.parent / "outside").read_text() == "host secret"
    bsize = guest.ok(Op.STATFS)[0]
    assert isinstance(bsize, int) and bsize > 0


async def test_serve_stream_answers_pipelined_requests_and_closes_handles(tree: Path) -> None:
    host, guest_sock = socket.socketpair()
    session = ShareFsSession(tree)
    reader, writer = await asyncio.open_unix_connection(sock=host)
    task = asyncio.create_task(serve_stream(reader, writer, session))
    g_reader, g_writer = await asyncio.open_unix_connection(sock=guest_sock)
    dec = FrameDecoder()

    async def replies(n: int) -> list[bytes]:
        got: list[bytes] = []
        while len(got) < n:
            got += [r for r in dec.feed(await g_reader.read(65536)) if isinstance(r, bytes)]
        return got

    (hello,) = await replies(1)
    assert frame(hello) == HELLO  # a new connection starts with the server's HELLO
    g_writer.write(encode_request(1, Op.OPEN, b"d/f", os.O_RDONLY) + b"junk")
    await g_writer.drain()
    (opened,) = await replies(1)
    req_id, err, (handle,) = decode_reply(Op.OPEN, opened)
    assert (req_id, err) == (1, 0)
    g_writer.write(encode_request(2, Op.READ, handle, 0, 5) + encode_request(3, Op.STATFS))
    await g_writer.drain()
    read, statfs = await replies(2)
    assert decode_reply(Op.READ, read) == (2, 0, (b"hello",))
    assert decode_reply(Op.STATFS, statfs)[:2] == (3, 0)
    assert session.open_handles == 1
    g_writer.close()
    await g_writer.wait_closed()
    await asyncio.wait_for(task, 10)
    assert session.open_handles == 0


def test_a_repeat_of_the_last_request_is_answered_without_running_it_again(tree: Path) -> None:
    # The guest repeats the request it waited on when a new session says HELLO; when
    # this session had served it already, running it again would create twice.
    s = ShareFsSession(tree)
    req = encode_request(7, Op.MKDIR, b"once", 0o755)
    first = s.feed(req)
    assert decode_reply(Op.MKDIR, FrameDecoder().feed(first)[0])[1] == 0  # type: ignore[arg-type]
    assert s.feed(req) == first  # the saved reply, not EEXIST
    other = s.feed(encode_request(8, Op.MKDIR, b"once", 0o755))
    assert decode_reply(Op.MKDIR, FrameDecoder().feed(other)[0])[1] == errno.EEXIST  # type: ignore[arg-type]
    # Only the last one is saved: an older id runs again.
    again = s.feed(req)
    assert decode_reply(Op.MKDIR, FrameDecoder().feed(again)[0])[1] == errno.EEXIST  # type: ignore[arg-type]
    s.close()
