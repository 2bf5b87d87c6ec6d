"""Shared volumes on the host, for real: a sparse ext4 image loop-mounted by the host and
served by the sharefs session. The size is the host kernel's ENOSPC, a restarted daemon
finds and releases the mounts, and nothing (mount, loop device) is left behind."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from hutch.storage.shared_mounts import SharedMounts
from hutch.storage.sharefs_server import ShareFsSession
from hutch.storage.sharefs_wire import MAX_IO, FrameDecoder, Op, decode_reply, encode_request
from hutch.storage.volumes import VolumeFiles

pytestmark = pytest.mark.privileged

GIB = 1 << 30


def _loops_of(image: Path) -> str:
    return subprocess.run(
        ["losetup", "-j", str(image)], capture_output=True, text=True, check=True
    ).stdout.strip()


def _call(s: ShareFsSession, req_id: int, op: Op, *args: object) -> tuple[int, tuple[object, ...]]:
    (body,) = FrameDecoder().feed(s.feed(encode_request(req_id, op, *args)))
    assert isinstance(body, bytes)
    _, err, results = decode_reply(op, body)
    return err, results


@pytest.fixture
def state(tmp_path: Path) -> Iterator[tuple[VolumeFiles, SharedMounts]]:
    if os.geteuid() != 0:
        pytest.fail("the privileged tier runs as root (loop mounts)")
    files = VolumeFiles(tmp_path / "volumes")
    mounts = SharedMounts(tmp_path / "shared")
    yield files, mounts
    mounts.sweep(set())
    assert mounts.mounted() == set()
    for image in (tmp_path / "volumes").glob("*.img"):
        assert _loops_of(image) == "", f"loop device left on {image}"


def test_a_1_gib_shared_volume_refuses_the_next_byte(
    state: tuple[VolumeFiles, SharedMounts],
) -> None:
    files, mounts = state
    image = files.create("vshared1", GIB)
    root = mounts.mount("vshared1", image)
    assert mounts.mount("vshared1", image) == root  # idempotent
    s = ShareFsSession(root)
    try:
        err, (handle, _) = _call(s, 1, Op.CREATE, b"fill", os.O_WRONLY, 0o644)
        assert err == 0
        chunk = b"\xa5" * MAX_IO
        written, req = 0, 2
        while True:
            err, results = _call(s, req, Op.WRITE, handle, written, chunk)
            req += 1
            if err:
                break
            assert isinstance(results[0], int)
            written += results[0]
            assert written <= GIB
        assert err == errno.ENOSPC  # an errno to the guest, not an exception
        assert 0.9 * GIB < written <= GIB  # ext4's own metadata takes the rest
        err, _ = _call(s, req, Op.FSYNC, handle, 0)
        assert err in (0, errno.ENOSPC)
        # The server keeps serving after ENOSPC: read back what landed.
        err, (reader,) = _call(s, req + 1, Op.OPEN, b"fill", os.O_RDONLY)
        assert err == 0
        err, (data,) = _call(s, req + 2, Op.READ, reader, written - 3, 3)
        assert err == 0 and data == b"\xa5" * 3
        err, (bsize, blocks, *_) = _call(s, req + 3, Op.STATFS)
        assert isinstance(bsize, int) and isinstance(blocks, int)
        assert bsize * blocks <= GIB  # what df shows in the guest
    finally:
        s.close()
    assert os.stat(image).st_size == GIB  # the image never grew past the volume's size


def test_a_restarted_daemon_finds_the_mounts_and_releases_unused_ones(
    state: tuple[VolumeFiles, SharedMounts], tmp_path: Path
) -> None:
    files, mounts = state
    for vid in ("vkeep", "vdrop"):
        root = mounts.mount(vid, files.create(vid, 64 << 20))
        (root / "data").write_text(vid)
    # A new daemon: a fresh object over the same directory, nothing in memory.
    again = SharedMounts(tmp_path / "shared")
    assert again.mounted() == {"vkeep", "vdrop"}
    assert again.sweep({"vkeep"}) == ["vdrop"]
    assert again.mounted() == {"vkeep"}
    assert _loops_of(files.path("vdrop")) == ""
    assert not (tmp_path / "shared" / "vdrop").exists()
    # The released volume's data is in its image: mounted again, it is there.
    root = again.mount("vdrop", files.path("vdrop"))
    assert (root / "data").read_text() == "vdrop"
    opts = next(
        line.split(" ")[5]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split(" ")[4] == str(root)
    )
    assert {"nodev", "nosuid", "noexec"} <= set(opts.split(","))
