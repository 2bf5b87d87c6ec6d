"""The content identity of an image file (``hutch.images.identity``): the sha256 of its
bytes, recorded beside it once and trusted while the file's size and mtime match, so a
create never hashes an image; recomputed when the file changed under its record. And
the error a mismatch is (409 ``image_mismatch``, mapped back by the SDK's table)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import hutch
from hutch.contract.http_errors import error_for, status_for
from hutch.errors import Conflict, ImageMismatch
from hutch.images import identity


def _file(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_the_identity_is_the_sha256_of_the_bytes_and_is_recorded_beside_the_file(
    tmp_path: Path,
) -> None:
    rootfs = _file(tmp_path / "img" / "rootfs.ext4", b"ext4" * 1000)
    want = hashlib.sha256(b"ext4" * 1000).hexdigest()
    assert identity.known(rootfs) is None  # nothing recorded yet
    assert identity.identity(rootfs) == want
    kept = json.loads((tmp_path / "img" / ".rootfs.ext4.sha256").read_text())
    assert kept["sha256"] == want and kept["size"] == 4000
    assert identity.known(rootfs) == want


def test_a_fresh_record_is_trusted_without_reading_the_file(tmp_path: Path) -> None:
    """What makes it free on a create: the record, not the bytes, answers."""
    rootfs = _file(tmp_path / "rootfs.ext4", b"a" * 100)
    identity.record(rootfs, "f" * 64)  # the caller's word (it just hashed the bytes)
    assert identity.identity(rootfs) == "f" * 64
    assert identity.known(rootfs) == "f" * 64


def test_a_record_whose_file_changed_is_stale_and_recomputed(tmp_path: Path) -> None:
    rootfs = _file(tmp_path / "rootfs.ext4", b"a" * 100)
    identity.record(rootfs, "f" * 64)
    rootfs.write_bytes(b"b" * 101)  # another size
    assert identity.known(rootfs) is None
    assert identity.identity(rootfs) == hashlib.sha256(b"b" * 101).hexdigest()
    # Same size, another mtime: stale too.
    identity.record(rootfs, "e" * 64)
    st = rootfs.stat()
    os.utime(rootfs, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert identity.known(rootfs) is None
    assert identity.identity(rootfs) == hashlib.sha256(b"b" * 101).hexdigest()


def test_a_corrupt_record_is_ignored(tmp_path: Path) -> None:
    rootfs = _file(tmp_path / "rootfs.ext4", b"abc")
    identity.record_path(rootfs).write_text("{not json")
    assert identity.known(rootfs) is None
    assert identity.identity(rootfs) == hashlib.sha256(b"abc").hexdigest()
    st = rootfs.stat()
    identity.record_path(rootfs).write_text(
        json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": "../etc"})
    )
    assert identity.known(rootfs) is None


def test_a_directory_that_cannot_be_written_still_gets_the_identity(tmp_path: Path) -> None:
    """A read-only images directory: no record, the hash all the same."""
    rootfs = _file(tmp_path / "ro" / "rootfs.ext4", b"xyz")
    blocker = identity.record_path(rootfs)
    blocker.mkdir()  # a directory where the record would go: the write fails
    assert identity.identity(rootfs) == hashlib.sha256(b"xyz").hexdigest()
    assert identity.known(rootfs) is None


def test_image_mismatch_is_a_conflict_answered_409_and_mapped_back() -> None:
    exc = ImageMismatch("snap-1 was frozen over other bytes of image 'app'")
    assert isinstance(exc, Conflict)
    assert exc.code == "image_mismatch"
    assert status_for(exc) == 409
    back = error_for("image_mismatch", 409, exc.message)
    assert type(back) is ImageMismatch and back.message == exc.message
    assert hutch.ImageMismatch is ImageMismatch
