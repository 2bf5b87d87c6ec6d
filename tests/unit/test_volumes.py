"""Volumes: the request checks (contract), the store's rows and mounts, the volume files
(made whole or not at all), and how they reach QEMU's command line and ``vm.json``."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import replace
from pathlib import Path

import pytest

from hutch.contract.volumes import (
    VolumeKind,
    VolumeMount,
    parse_size,
    parse_volume_flag,
    validate_mount_path,
    validate_mounts,
    validate_size,
)
from hutch.errors import Conflict, InvalidArgument, StoreError
from hutch.models import SandboxSpec
from hutch.runtime.qemu.host import read_config, write_config
from hutch.storage.volumes import VolumeFiles
from hutch.store import Store
from hutch.store.volumes import MountRow, VolumeRow, VolumeStore
from hutch.vm.argv import SharePort, VmConfig, VolumeDrive, build_argv

MIB = 1024**2


@pytest.mark.parametrize("path", ["/data", "/mnt/x", "/home/user/work", "/var/lib/db", "/tmp/v"])
def test_accepted_mount_paths(path: str) -> None:
    assert validate_mount_path(path) == path
    assert validate_mount_path(path + "/") == path


@pytest.mark.parametrize(
    ("path", "needle"),
    [
        ("data", "absolute"),
        ("", "absolute"),
        ("/", "system directory"),
        ("/var", "system directory"),
        ("/tmp", "system directory"),
        ("/etc", "inside /etc"),
        ("/usr/local/x", "inside /usr"),
        ("/proc/x", "inside /proc"),
        ("/run/.hutch", "inside /run"),
        ("/data/../etc", "not normalized"),
        ("/data//x", "not normalized"),
        ("/a\0b", "NUL"),
    ],
)
def test_refused_mount_paths(path: str, needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle.replace(".", r"\.")):
        validate_mount_path(path)


def test_mount_lists_refuse_duplicates_and_nesting() -> None:
    ok = validate_mounts([VolumeMount("a", "/a/"), VolumeMount("b", "/b", True)])
    assert ok == [VolumeMount("a", "/a"), VolumeMount("b", "/b", True)]
    with pytest.raises(InvalidArgument, match="mounted twice"):
        validate_mounts([VolumeMount("a", "/a"), VolumeMount("a", "/b")])
    with pytest.raises(InvalidArgument, match="two volumes are mounted at '/a'"):
        validate_mounts([VolumeMount("a", "/a"), VolumeMount("b", "/a")])
    with pytest.raises(InvalidArgument, match="nested"):
        validate_mounts([VolumeMount("a", "/a"), VolumeMount("b", "/a/b")])
    with pytest.raises(InvalidArgument, match="at most 8"):
        validate_mounts([VolumeMount(f"v{i}", f"/v{i}") for i in range(9)])
    # The create spec checks them too.
    with pytest.raises(InvalidArgument, match="inside /etc"):
        SandboxSpec(image="base", volumes=[VolumeMount("a", "/etc")])


def test_sizes_and_the_cli_flag() -> None:
    assert parse_size("1G") == parse_size("1GiB") == 1024**3
    assert parse_size("512m") == 512 * MIB
    assert parse_size("4096") == parse_size(4096) == 4096
    with pytest.raises(InvalidArgument, match="not understood"):
        parse_size("1 gallon")
    assert validate_size(16 * MIB) == 16 * MIB
    with pytest.raises(InvalidArgument, match="out of range"):
        validate_size(16 * MIB - 1)
    with pytest.raises(InvalidArgument, match="not a number"):
        validate_size(True)
    assert parse_volume_flag("data:/data") == VolumeMount("data", "/data", False)
    assert parse_volume_flag("data:/data:ro") == VolumeMount("data", "/data", True)
    assert parse_volume_flag("data:/data:rw") == VolumeMount("data", "/data", False)
    with pytest.raises(InvalidArgument, match="NAME:/path"):
        parse_volume_flag("data")


def _row(vid: str, name: str, project: str = "default") -> VolumeRow:
    return VolumeRow(vid, project, name, VolumeKind.EXCLUSIVE, 64 * MIB, time.time())


def test_store_rows_mounts_and_refusals(tmp_path: Path) -> None:
    store = VolumeStore(Store(tmp_path / "hutch.db"))
    store.insert(_row("vol-00000000000a", "data"))
    store.insert(_row("vol-00000000000b", "data", project="other"))  # per project
    with pytest.raises(Conflict, match="already exists in project 'default'"):
        store.insert(_row("vol-00000000000c", "data"))
    assert store.get("default", "data") == store.get("default", "vol-00000000000a")
    assert store.get("other", "vol-00000000000a") is None  # another project's: not found
    assert [r.id for r in store.list_volumes("default")] == ["vol-00000000000a"]

    mount = MountRow("vol-00000000000a", "sb-00000000000a", "/data", False, 0)
    store.attach("sb-00000000000a", [mount], "local")
    with pytest.raises(Conflict, match="mounted by sandbox sb-00000000000a"):
        store.attach(
            "sb-00000000000b",
            [MountRow("vol-00000000000a", "sb-00000000000b", "/d", False, 0)],
            "local",
        )
    assert store.mounts_of_sandbox("sb-00000000000b") == []  # rolled back whole
    with pytest.raises(Conflict, match="sb-00000000000a; delete them first"):
        store.delete("vol-00000000000a")
    assert store.release("sb-00000000000a") == 1
    assert store.release("sb-00000000000a") == 0  # twice is fine
    store.delete("vol-00000000000a")
    assert store.get_by_id("vol-00000000000a") is None
    with pytest.raises(Conflict, match="deleted meanwhile"):
        store.attach("sb-00000000000c", [mount], "local")


def test_a_volume_is_mounted_only_on_its_host_and_old_rows_are_claimed(tmp_path: Path) -> None:
    """Several hosts share the rows: a volume's file is on one of them (``host``), a
    sandbox on another cannot mount it (in the attach's own transaction), and a row
    from before hosts were recorded belongs to the first host claiming its file."""
    store = VolumeStore(Store(tmp_path / "hutch.db"))
    store.insert(replace(_row("vol-00000000000a", "a"), host="w1"))
    store.insert(_row("vol-00000000000b", "b"))  # host None: an old row
    assert store.get("default", "a").host == "w1"  # type: ignore[union-attr]
    mount = MountRow("vol-00000000000a", "sb-00000000000a", "/data", False, 0)
    with pytest.raises(Conflict, match="volume vol-00000000000a is on host w1, not on host w2"):
        store.attach("sb-00000000000a", [mount], "w2")
    assert store.mounts_of_sandbox("sb-00000000000a") == []
    store.attach("sb-00000000000a", [mount], "w1")
    # Claims: only unclaimed rows, only the files named, one winner.
    assert store.claim_unhomed("w2", {"vol-00000000000a", "vol-00000000000b"}) == [
        "vol-00000000000b"
    ]
    assert store.claim_unhomed("w3", {"vol-00000000000b"}) == []
    assert store.get("default", "b").host == "w2"  # type: ignore[union-attr]
    assert store.get("default", "a").host == "w1"  # type: ignore[union-attr]


def test_a_volume_file_is_whole_or_absent(tmp_path: Path) -> None:
    files = VolumeFiles(tmp_path / "volumes")
    path = files.create("vol-00000000000a", 32 * MIB)
    assert path.stat().st_size == 32 * MIB and path.stat().st_mode & 0o777 == 0o600
    assert path.read_bytes()[1024 + 0x38 : 1024 + 0x3A] == b"\x53\xef"  # ext4 magic
    used = files.used_bytes("vol-00000000000a")
    assert used is not None and used < 32 * MIB
    with pytest.raises(StoreError, match="refusing to overwrite"):
        files.create("vol-00000000000a", 32 * MIB)
    before = path.read_bytes()[: 32 * MIB]
    files.grow_offline("vol-00000000000a", 48 * MIB)
    assert files.size("vol-00000000000a") == 48 * MIB
    # The file only: the filesystem a guest wrote is not touched on the host.
    assert path.read_bytes()[: 32 * MIB] == before
    # A size mkfs refuses: nothing is left behind.
    with pytest.raises(StoreError):
        files.create("vol-00000000000b", 4096)
    assert sorted(p.name for p in files.root.iterdir()) == ["vol-00000000000a.img"]
    (files.root / ".new-vol-00000000000c.img").write_bytes(b"")
    (files.root / "vol-00000000000d.img").write_bytes(b"")
    assert sorted(files.sweep({"vol-00000000000a"})) == [
        ".new-vol-00000000000c.img",
        "vol-00000000000d.img",
    ]
    assert [p.name for p in files.root.iterdir()] == ["vol-00000000000a.img"]


def _cfg(tmp_path: Path, volumes: tuple[VolumeDrive, ...]) -> VmConfig:
    return VmConfig(
        name="sb-00000000000a", vcpus=1, memory_mib=256, kernel=tmp_path / "k",
        initrd=tmp_path / "i", cmdline="console=ttyS0", disk=tmp_path / "d.qcow2",
        accel="tcg", qmp_socket=tmp_path / "q", agent_socket=tmp_path / "a",
        console_log=tmp_path / "c", pidfile=tmp_path / "p", qemu_log=tmp_path / "l",
        volumes=volumes,
    )  # fmt: skip


def test_volumes_on_the_command_line_and_in_vm_json(tmp_path: Path) -> None:
    drives = (
        VolumeDrive(tmp_path / "a,b.img", "vol-00000000000a"),
        VolumeDrive(tmp_path / "c.img", "vol-00000000000c", read_only=True),
    )
    argv = build_argv(_cfg(tmp_path, drives))
    joined = " ".join(argv)
    assert f"id=vol0,if=none,file={tmp_path}/a,,b.img,format=raw,readonly=off" in joined
    assert f"id=vol1,if=none,file={tmp_path}/c.img,format=raw,readonly=on" in joined
    assert "virtio-blk-device,drive=vol0,serial=vol-00000000000a" in argv
    assert "virtio-blk-device,drive=vol1,serial=vol-00000000000c" in argv
    # After the root disk: the guest's /dev/vda stays the root.
    assert argv.index("virtio-blk-device,drive=root") < argv.index(
        "virtio-blk-device,drive=vol0,serial=vol-00000000000a"
    )
    write_config(tmp_path / "vm.json", _cfg(tmp_path, drives))
    assert read_config(tmp_path / "vm.json") == _cfg(tmp_path, drives)
    # Slots and shared volumes' ports are part of vm.json (a resume restores the same set).
    with_shares = dataclasses.replace(
        _cfg(tmp_path, (VolumeDrive(tmp_path / "v", "vol-1", slot=1),)),
        shares=(SharePort(0, tmp_path / "share0.sock"),),
    )
    write_config(tmp_path / "vm.json", with_shares)
    assert read_config(tmp_path / "vm.json") == with_shares
    with pytest.raises(InvalidArgument, match="serial"):
        build_argv(_cfg(tmp_path, (VolumeDrive(tmp_path / "x", "a" * 21),)))
