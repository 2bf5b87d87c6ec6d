"""Content directories of Dockerfile builds are made once, under a lock, and a failed
make leaves nothing behind (hutch.images.build_layers)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hutch.errors import ImageBuildError
from hutch.images import build_layers
from hutch.images.build_layers import scratch_base
from hutch.images.oci.importer import content_dir

pytestmark = pytest.mark.skipif(
    shutil.which("mke2fs") is None, reason="needs mke2fs (e2fsprogs, installed by make deps)"
)


def test_the_scratch_base_is_made_once(tmp_path: Path) -> None:
    first = scratch_base(tmp_path)
    assert first.rootfs.is_file() and first.rootfs.stat().st_mode & 0o777 == 0o444
    stamp = first.rootfs.stat().st_mtime_ns
    again = scratch_base(tmp_path)
    assert again.digest == first.digest and again.rootfs.stat().st_mtime_ns == stamp


def test_a_failed_make_leaves_nothing(tmp_path: Path) -> None:
    def fill(work: Path) -> None:
        (work / "rootfs.ext4").write_bytes(b"half")
        raise ImageBuildError("the step failed")

    digest = "sha256:" + "ab" * 32
    with pytest.raises(ImageBuildError, match="the step failed"):
        build_layers._content_once(tmp_path, digest, "a test image", fill)
    left = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    assert left == []
    assert not content_dir(tmp_path, digest).exists()
