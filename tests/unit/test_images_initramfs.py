"""The cpio writer and the initramfs contents."""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from hutch.errors import ImageBuildError
from hutch.images.initramfs import (
    BUSYBOX_APPLETS,
    CpioEntry,
    build_initramfs,
    init_script,
    initramfs_entries,
    write_cpio,
)


def parse_newc(data: bytes) -> list[tuple[str, int, bytes, int, int]]:
    """(name, mode, data, rdevmajor, rdevminor) per member: an independent reader."""
    out: list[tuple[str, int, bytes, int, int]] = []
    pos = 0
    while True:
        assert data[pos : pos + 6] == b"070701"
        f = [int(data[pos + 6 + 8 * i : pos + 14 + 8 * i], 16) for i in range(13)]
        namesize, filesize = f[11], f[6]
        name_start = pos + 110
        name = data[name_start : name_start + namesize - 1].decode()
        pos = (name_start + namesize + 3) & ~3
        body = data[pos : pos + filesize]
        pos = (pos + filesize + 3) & ~3
        if name == "TRAILER!!!":
            assert pos == len(data)
            return out
        out.append((name, f[1], body, f[9], f[10]))


def test_write_cpio_roundtrip_and_alignment() -> None:
    entries = [
        CpioEntry("dir", stat.S_IFDIR | 0o755),
        CpioEntry("dir/file", stat.S_IFREG | 0o644, b"hello"),
        CpioEntry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1)),
        CpioEntry("link", stat.S_IFLNK | 0o777, b"dir/file"),
    ]
    data = write_cpio(entries)
    assert len(data) % 4 == 0
    members = parse_newc(data)
    assert [m[0] for m in members] == ["dir", "dir/file", "dev/console", "link"]
    assert members[1][2] == b"hello"
    assert (members[2][3], members[2][4]) == (5, 1)
    assert write_cpio(entries) == data  # deterministic


@pytest.mark.skipif(shutil.which("cpio") is None, reason="host cpio not installed")
def test_host_cpio_reads_our_archive() -> None:
    data = write_cpio(
        [CpioEntry("a", stat.S_IFREG | 0o644, b"x" * 5), CpioEntry("b", stat.S_IFLNK | 0o777, b"a")]
    )
    listing = (
        subprocess.run(["cpio", "-t", "--quiet"], input=data, capture_output=True, check=True)
        .stdout.decode()
        .split()
    )
    assert listing == ["a", "b"]


def test_initramfs_entries_hold_what_init_needs() -> None:
    mods = [("virtio_ring.ko", b"\x7fELF1"), ("virtio.ko", b"\x7fELF2")]
    members = {m.name: m for m in initramfs_entries(b"BUSYBOX", mods)}
    assert members["init"].data == init_script()
    assert members["init"].mode & 0o111
    assert members["bin/busybox"].data == b"BUSYBOX"
    for applet in BUSYBOX_APPLETS:
        assert members[f"bin/{applet}"].data == b"busybox"
    assert members["lib/modules/load-order"].data == b"virtio_ring.ko\nvirtio.ko\n"
    assert members["dev/console"].rdev == (5, 1)
    assert {"newroot", "proc", "sys", "dev"} <= set(members)


def test_init_script_calls_only_linked_applets() -> None:
    script = init_script().decode()
    assert script.startswith("#!/bin/sh\n")
    for needed in ("insmod", "switch_root", "poweroff", "mount", "ln", "ip"):
        assert needed in BUSYBOX_APPLETS and needed in script
    assert "/sbin/hutch-init" in script


def test_build_initramfs_refuses_dynamic_busybox(tmp_path: Path) -> None:
    from tests.unit.test_images_elf import make_elf

    fake = tmp_path / "busybox"
    fake.write_bytes(make_elf(interp=True))
    with pytest.raises(ImageBuildError, match="static busybox"):
        build_initramfs(fake, [], tmp_path / "initrd.img")
    fake.write_bytes(make_elf())
    build_initramfs(fake, [], tmp_path / "initrd.img")
    names = [m[0] for m in parse_newc((tmp_path / "initrd.img").read_bytes())]
    assert "init" in names
