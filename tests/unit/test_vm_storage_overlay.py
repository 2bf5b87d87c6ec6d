from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hutch.errors import InvalidArgument, StoreError
from hutch.storage.overlay import create_overlay, overlay_info

pytestmark = pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-utils")


def test_overlay_is_larger_than_base_and_copies_nothing(tmp_path: Path) -> None:
    base = tmp_path / "rootfs.ext4"
    base.write_bytes(b"\x01" * (8 << 20))
    disk = tmp_path / "disk.qcow2"
    create_overlay(base, disk, 2)
    info = overlay_info(disk)
    assert info["format"] == "qcow2"
    assert info["virtual-size"] == 2 << 30
    assert info["backing-filename"] == str(base)
    assert info["backing-filename-format"] == "raw"
    assert info["actual-size"] < 1 << 20


def test_errors_name_what_to_change(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="does not exist"):
        create_overlay(tmp_path / "nope", tmp_path / "d.qcow2", 1)
    base = tmp_path / "b"
    base.write_bytes(b"x")
    with pytest.raises(InvalidArgument, match="out of range"):
        create_overlay(base, tmp_path / "d.qcow2", 0)
    (tmp_path / "d.qcow2").write_bytes(b"")
    with pytest.raises(StoreError, match="already exists"):
        create_overlay(base, tmp_path / "d.qcow2", 1)
    with pytest.raises(StoreError, match="qemu-img"):
        overlay_info(tmp_path / "missing.qcow2")
