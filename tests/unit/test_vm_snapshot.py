"""Snapshot manifest, compatibility checks and the argv of file-backed RAM / restore
(pure parts; the real pause/resume/fork runs in tests/vm/test_snapshot.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import xxhash

import hutch.vm.snapshot as snapshot_module
from hutch.errors import InvalidArgument, SnapshotError
from hutch.runtime.qemu.host import read_config, write_config
from hutch.runtime.qemu.templates import finish_template, template_complete
from hutch.vm.argv import VmConfig, build_argv
from hutch.vm.disk_chain import disk_chain, qcow2_backing_file
from hutch.vm.snapshot import (
    MANIFEST_FILE,
    MEMORY_FILE,
    STATE_FILE,
    create_clone_disk,
    finish_interrupted_save,
    move_disk,
    verify_snapshot,
)
from hutch.vm.snapshot_dir import CONSUMED_MARKER, FROZEN_MARKER, load_manifest
from hutch.vm.snapshot_manifest import (
    MANIFEST_FORMAT,
    FileStamp,
    SnapshotManifest,
    TailHasher,
    compat_fields,
    compat_mismatches,
    fd_digest,
    file_sha256,
)
from hutch.vm.snapshot_pending import PENDING_FILE, write_pending
from hutch.vm.snapshot_rebase import REBASE_MANIFEST
from hutch.vm.snapshot_seal import seal_memory


def _cfg(tmp: Path, **kw: object) -> VmConfig:
    kernel = tmp / "vmlinux"
    if not kernel.exists():
        kernel.write_bytes(b"\x7fELF kernel")
        (tmp / "initrd.img").write_bytes(b"initrd")
    base = dict(
        name="sb-1",
        vcpus=1,
        memory_mib=256,
        kernel=kernel,
        initrd=tmp / "initrd.img",
        cmdline="console=ttyS0",
        disk=tmp / "disk.qcow2",
        accel="tcg",
        qmp_socket=tmp / "qmp.sock",
        agent_socket=tmp / "agent.sock",
        console_log=tmp / "console.log",
        pidfile=tmp / "qemu.pid",
        qemu_log=tmp / "qemu.log",
        tsc_khz=2_445_404,
    )
    base.update(kw)
    return VmConfig(**base)  # type: ignore[arg-type]


def _opt(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_default_argv_has_no_memory_backend_or_incoming(tmp_path: Path) -> None:
    argv = build_argv(_cfg(tmp_path))
    assert _opt(argv, "-M") == ["microvm,x-option-roms=off,isa-serial=on,rtc=off"]
    assert not any("memory-backend" in a for a in argv)
    assert "-incoming" not in argv


@pytest.mark.parametrize(("shared", "share"), [(True, "on"), (False, "off")])
def test_memory_file_argv(tmp_path: Path, shared: bool, share: str) -> None:
    cfg = _cfg(tmp_path, memory_file=Path("/s/a,b/mem.ram"), memory_shared=shared)
    argv = build_argv(cfg)
    assert _opt(argv, "-M") == [
        "microvm,x-option-roms=off,isa-serial=on,rtc=off,memory-backend=mem"
    ]
    assert _opt(argv, "-m") == ["256M"]
    assert f"memory-backend-file,id=mem,size=256M,mem-path=/s/a,,b/mem.ram,share={share}" in _opt(
        argv, "-object"
    )


def test_incoming_argv_and_relative_memory_file(tmp_path: Path) -> None:
    argv = build_argv(_cfg(tmp_path, incoming=True))
    assert argv[-2:] == ["-incoming", "defer"]
    with pytest.raises(InvalidArgument, match="absolute"):
        build_argv(_cfg(tmp_path, memory_file=Path("mem.ram")))


def test_compat_mismatch_names_each_field(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    saved = compat_fields(cfg)
    assert compat_mismatches(saved, compat_fields(cfg)) == []
    other = compat_fields(
        dataclasses.replace(
            cfg, memory_mib=512, vcpus=2, tsc_khz=1_000_000, memory_file=tmp_path / "m"
        )
    )
    problems = " ".join(compat_mismatches(saved, other))
    for name in ("memory_mib", "vcpus", "tsc_khz", "memory_backend"):
        assert name in problems
    (tmp_path / "k2").write_bytes(b"another kernel")
    assert "kernel_sha256" in " ".join(
        compat_mismatches(saved, compat_fields(dataclasses.replace(cfg, kernel=tmp_path / "k2")))
    )


def test_file_digest_cache_sees_rewrites(tmp_path: Path) -> None:
    f = tmp_path / "k"
    f.write_bytes(b"one")
    first = file_sha256(f)
    assert file_sha256(f) == first
    f.write_bytes(b"two")
    assert file_sha256(f) != first


def _fake_snapshot(tmp: Path, cfg: VmConfig, *, ram_in_file: bool = False) -> Path:
    """A snapshot directory as save_snapshot leaves it (no QEMU needed for the checks)."""
    snap = tmp / "snap"
    snap.mkdir()
    (snap / STATE_FILE).write_bytes(b"QEVM" + bytes(range(256)) * 10)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(cfg.disk), "1G"], check=True)
    memory = None
    if ram_in_file:
        (snap / MEMORY_FILE).write_bytes(b"\0" * 4096)
        memory = FileStamp.of(snap / MEMORY_FILE)
    fd = os.open(snap / STATE_FILE, os.O_RDONLY)
    digest, size = fd_digest(fd)
    os.close(fd)
    manifest = SnapshotManifest(
        format=MANIFEST_FORMAT,
        name=cfg.name,
        created_ns=1,
        qemu_version="7.2.22 test",
        compat=compat_fields(cfg),
        cmdline="console=ttyS0",
        initrd_sha256=file_sha256(cfg.initrd),
        state_size=size,
        state_digest=digest,
        ram_in_file=ram_in_file,
        memory=memory,
        disk=FileStamp.of(cfg.disk.resolve()),
    )
    (snap / MANIFEST_FILE).write_text(manifest.to_json())
    return snap


@pytest.fixture
def qemu_img() -> None:
    if shutil.which("qemu-img") is None:
        pytest.skip("qemu-img (qemu-utils) is not installed")


@pytest.mark.usefixtures("qemu_img")
def test_manifest_round_trip_and_verify(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    snap = _fake_snapshot(tmp_path, cfg)
    manifest = verify_snapshot(snap, cfg)
    assert load_manifest(snap) == manifest
    assert manifest.memory is None


@pytest.mark.usefixtures("qemu_img")
def test_verify_refuses_tampering_and_wrong_disks(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    snap = _fake_snapshot(tmp_path, cfg)
    state = snap / STATE_FILE
    data = bytearray(state.read_bytes())
    data[100] ^= 1
    state.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match="checksum"):
        verify_snapshot(snap, cfg)
    data[100] ^= 1
    state.write_bytes(bytes(data))
    verify_snapshot(snap, cfg)
    with pytest.raises(SnapshotError, match="own disk"):
        verify_snapshot(snap, dataclasses.replace(cfg, disk=tmp_path / "x.qcow2"))
    with pytest.raises(SnapshotError, match="overlay on the snapshot's disk"):
        verify_snapshot(snap, cfg, clone=True)  # its own disk is not an overlay of itself
    with pytest.raises(SnapshotError, match="memory_mib"):
        verify_snapshot(snap, dataclasses.replace(cfg, memory_mib=512))
    with cfg.disk.open("ab") as f:
        f.write(b"written after the snapshot")
    with pytest.raises(SnapshotError, match="disk"):
        verify_snapshot(snap, cfg)


@pytest.mark.usefixtures("qemu_img")
def test_clone_disk_freezes_and_markers_gate_restores(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, memory_file=tmp_path / "mem.ram")
    snap = _fake_snapshot(tmp_path, cfg, ram_in_file=True)
    with pytest.raises(SnapshotError, match="memory_file"):
        verify_snapshot(snap, dataclasses.replace(cfg, memory_file=None))
    clone_disk = tmp_path / "clone.qcow2"
    create_clone_disk(snap, clone_disk)
    assert qcow2_backing_file(clone_disk) == str(cfg.disk.resolve())
    assert (snap / FROZEN_MARKER).exists()
    for path in (snap / STATE_FILE, snap / MEMORY_FILE, cfg.disk):
        assert path.stat().st_mode & 0o222 == 0, f"{path} left writable"
    # The clone's config carries no memory file: the snapshot's is used.
    clone_cfg = dataclasses.replace(cfg, name="c1", disk=clone_disk, memory_file=None)
    verify_snapshot(snap, clone_cfg, clone=True)
    with pytest.raises(SnapshotError, match="frozen"):
        verify_snapshot(snap, cfg)
    (snap / CONSUMED_MARKER).write_text("1\n")
    with pytest.raises(SnapshotError, match="already resumed"):
        verify_snapshot(snap, clone_cfg, clone=True)


def _flip_keeping_mtime(path: Path, offset: int) -> None:
    """Change one byte of ``path`` the way corruption at rest would: the mtime stamp is
    set back, so only the content (and the ctime, which user space cannot set) differ."""
    os.chmod(path, 0o600)
    mtime = path.stat().st_mtime_ns
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(mtime, mtime))


@pytest.mark.usefixtures("qemu_img")
def test_a_verified_stream_is_hashed_once_until_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg(tmp_path)
    snap = _fake_snapshot(tmp_path, cfg)
    hashed: list[int] = []

    def counting(fd: int, algorithm: str = "xxh3_128") -> tuple[str, int]:
        hashed.append(fd)
        return fd_digest(fd, algorithm)

    monkeypatch.setattr(snapshot_module, "fd_digest", counting)
    verify_snapshot(snap, cfg)
    verify_snapshot(snap, cfg)  # the clones of one snapshot: one hash
    assert len(hashed) == 1
    # Corruption at rest with the mtime set back: the ctime moved, so it is read again.
    _flip_keeping_mtime(snap / STATE_FILE, 100)
    with pytest.raises(SnapshotError, match="checksum"):
        verify_snapshot(snap, cfg)
    assert len(hashed) == 2


@pytest.mark.usefixtures("qemu_img")
def test_sealed_memory_file_is_checked_by_ctime_and_a_corrupt_one_refused(
    tmp_path: Path,
) -> None:
    cfg = _cfg(tmp_path, memory_file=tmp_path / "mem.ram")
    snap = _fake_snapshot(tmp_path, cfg, ram_in_file=True)
    memory = snap / MEMORY_FILE
    memory.write_bytes(os.urandom(3 * 4096))
    # The fake's stamp was taken of the zero page it wrote; restamp the new content.
    raw = json.loads((snap / MANIFEST_FILE).read_text())
    raw["memory"] = dataclasses.asdict(FileStamp.of(memory))
    (snap / MANIFEST_FILE).write_text(json.dumps(raw))
    clone_disk = tmp_path / "clone.qcow2"
    create_clone_disk(snap, clone_disk)
    clone_cfg = dataclasses.replace(cfg, name="c1", disk=clone_disk, memory_file=None)

    sealed = seal_memory(snap, fsync=False)
    assert sealed.memory is not None and sealed.memory.digest is not None
    assert sealed.memory.digest == fd_digest(os.open(memory, os.O_RDONLY))[0]
    assert sealed.memory.ctime_ns == memory.stat().st_ctime_ns
    assert memory.stat().st_mode & 0o222 == 0
    assert load_manifest(snap) == sealed
    assert seal_memory(snap, fsync=False) == sealed, "sealing twice changes nothing"
    verify_snapshot(snap, clone_cfg, clone=True)
    # A second clone disk (the freeze is done) leaves the seal's ctime alone.
    create_clone_disk(snap, tmp_path / "clone2.qcow2")
    assert memory.stat().st_ctime_ns == sealed.memory.ctime_ns

    # A moved ctime with the same bytes (a chmod; a copy back from a blob store): one
    # full re-hash, accepted.
    os.chmod(memory, 0o400)
    assert memory.stat().st_ctime_ns != sealed.memory.ctime_ns
    verify_snapshot(snap, clone_cfg, clone=True)

    # One byte changed, size and mtime as recorded: refused.
    _flip_keeping_mtime(memory, 5000)
    with pytest.raises(SnapshotError, match=r"memory\.ram does not match its recorded checksum"):
        verify_snapshot(snap, clone_cfg, clone=True)
    with pytest.raises(SnapshotError, match="checksum"):
        seal_memory(snap, fsync=False)


def test_manifests_without_a_memory_seal_still_load(tmp_path: Path) -> None:
    """Backward reading: a manifest written before sealing (no digest/ctime_ns in its
    memory stamp) loads, and its memory file is checked by size and mtime as before."""
    cfg = _cfg(tmp_path, memory_file=tmp_path / "mem.ram")
    snap = _fake_snapshot(tmp_path, cfg, ram_in_file=True)
    raw = json.loads((snap / MANIFEST_FILE).read_text())
    del raw["memory"]["digest"], raw["memory"]["ctime_ns"]
    (snap / MANIFEST_FILE).write_text(json.dumps(raw))
    manifest = load_manifest(snap)
    assert manifest.memory is not None and manifest.memory.digest is None
    verify_snapshot(snap, cfg)


def test_missing_or_foreign_manifest(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="incomplete"):
        load_manifest(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text('{"format": 99}')
    with pytest.raises(SnapshotError, match="format 99"):
        load_manifest(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text('{"format": 1, "memory": null}')
    with pytest.raises(SnapshotError, match="malformed"):
        load_manifest(tmp_path)


def test_qcow2_backing_file_rejects_non_qcow2(tmp_path: Path) -> None:
    raw = tmp_path / "raw.img"
    raw.write_bytes(b"\0" * 64)
    with pytest.raises(SnapshotError, match="not a qcow2"):
        qcow2_backing_file(raw)


def test_tail_hasher_hashes_a_file_while_it_is_written(tmp_path: Path) -> None:
    path = tmp_path / "state.mig"
    path.write_bytes(b"")
    blocks = [os.urandom(1 << 16) * (i % 5 + 1) for i in range(40)]
    hasher = TailHasher(path)

    def write() -> None:
        with path.open("ab") as f:
            for block in blocks:
                f.write(block)
                f.flush()
                time.sleep(0.001)

    writer = threading.Thread(target=write)
    writer.start()
    writer.join()
    data = b"".join(blocks)
    assert hasher.finish() == ("xxh3_128:" + xxhash.xxh3_128(data).hexdigest(), len(data))


def test_tail_hasher_abandon_stops_it(tmp_path: Path) -> None:
    path = tmp_path / "state.mig"
    path.write_bytes(b"x" * 10)
    hasher = TailHasher(path)
    hasher.abandon()


@pytest.mark.usefixtures("qemu_img")
def test_a_save_cut_short_after_qemu_ended_is_finished_later(tmp_path: Path) -> None:
    """The daemon died between ending QEMU and writing the manifest: the pending record
    lets the next start finish the save (memory file moved in, disk stamped)."""
    cfg = _cfg(tmp_path, memory_file=tmp_path / "mem.ram")
    snap = _fake_snapshot(tmp_path, cfg, ram_in_file=True)
    manifest = load_manifest(snap)
    (snap / MEMORY_FILE).rename(tmp_path / "mem.ram")  # QEMU had not let go of it yet
    (snap / MANIFEST_FILE).unlink()
    write_pending(snap, dataclasses.replace(manifest, memory=None), tmp_path / "mem.ram")
    with cfg.disk.open("ab") as f:
        f.write(b"\0" * 512)  # QEMU's last flush on quit, after the pending stamp
    assert finish_interrupted_save(snap)
    assert not (snap / PENDING_FILE).exists() and not (tmp_path / "mem.ram").exists()
    verify_snapshot(snap, cfg)
    assert finish_interrupted_save(snap)  # already complete: nothing to do


def test_an_interrupted_save_without_its_pending_record_stays_incomplete(
    tmp_path: Path,
) -> None:
    (tmp_path / STATE_FILE).write_bytes(b"QEVM")
    assert not finish_interrupted_save(tmp_path)
    (tmp_path / PENDING_FILE).write_text("{not json")
    assert not finish_interrupted_save(tmp_path)
    assert not (tmp_path / MANIFEST_FILE).exists()


@pytest.mark.usefixtures("qemu_img")
def test_disk_chain_lists_qcow2_layers_top_first_and_the_raw_base(tmp_path: Path) -> None:
    base = tmp_path / "rootfs.img"
    base.write_bytes(b"\0" * (1 << 20))
    below = tmp_path / "l0.qcow2"
    create = ["qemu-img", "create", "-q", "-f", "qcow2", "-F"]
    subprocess.run([*create, "raw", "-b", str(base), str(below)], check=True)
    for n in (1, 2):
        top = tmp_path / f"l{n}.qcow2"
        subprocess.run([*create, "qcow2", "-b", str(below), str(top)], check=True)
        below = top
    layers, raw = disk_chain(below)
    assert [p.name for p in layers] == ["l2.qcow2", "l1.qcow2", "l0.qcow2"]
    assert raw == base.resolve()
    (tmp_path / "l1.qcow2").unlink()  # a broken chain ends where the file is missing
    assert [p.name for p in disk_chain(below)[0]] == ["l2.qcow2"]
    assert disk_chain(below)[1] is None


@pytest.mark.usefixtures("qemu_img")
def test_format_1_manifests_with_sha256_still_verify(tmp_path: Path) -> None:
    """Templates and paused sandboxes saved before the checksum changed keep working."""
    cfg = _cfg(tmp_path)
    snap = _fake_snapshot(tmp_path, cfg)
    old = json.loads((snap / MANIFEST_FILE).read_text())
    old["format"] = 1
    del old["state_digest"]
    old["state_sha256"] = hashlib.sha256((snap / STATE_FILE).read_bytes()).hexdigest()
    (snap / MANIFEST_FILE).write_text(json.dumps(old))
    assert load_manifest(snap).state_digest.startswith("sha256:")
    verify_snapshot(snap, cfg)
    old["state_sha256"] = "0" * 64
    (snap / MANIFEST_FILE).write_text(json.dumps(old))
    with pytest.raises(SnapshotError, match="checksum"):
        verify_snapshot(snap, cfg)
    old["format"], old["state_digest"] = 2, "md5:00"
    del old["state_sha256"]
    (snap / MANIFEST_FILE).write_text(json.dumps(old))
    with pytest.raises(SnapshotError, match="accepted: xxh3_128, sha256"):
        verify_snapshot(snap, cfg)


@pytest.mark.usefixtures("qemu_img")
@pytest.mark.parametrize("cut", ["before_config", "after_config", "after_rename"])
def test_a_freeze_cut_short_is_finished_from_where_it_stopped(tmp_path: Path, cut: str) -> None:
    """finish_template (a fork's or snapshot's freeze: vm.json, then the disk taken in)
    finishes from any step a killed daemon left, and the result is a complete template."""
    cfg = _cfg(tmp_path)
    snap = _fake_snapshot(tmp_path, cfg)
    inside = snap / "disk.qcow2"
    if cut != "before_config":
        write_config(snap / "vm.json", cfg)
    if cut == "after_rename":
        cfg.disk.rename(inside)  # the manifest still names the sandbox's disk
    assert not template_complete(snap)
    finish_template(snap, cfg)
    assert template_complete(snap)
    assert load_manifest(snap).disk.path == str(inside.resolve()) and not cfg.disk.exists()
    assert read_config(snap / "vm.json") == cfg
    finish_template(snap, cfg)  # idempotent
    assert template_complete(snap)


@pytest.mark.usefixtures("qemu_img")
def test_a_disk_move_refuses_a_disk_that_changed(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    snap = _fake_snapshot(tmp_path, cfg)
    cfg.disk.rename(snap / "disk.qcow2")
    with (snap / "disk.qcow2").open("ab") as f:
        f.write(b"written after the snapshot")
    with pytest.raises(SnapshotError, match="disk"):
        move_disk(snap, snap / "disk.qcow2")


def test_vm_json_round_trips_a_memory_file_as_a_path(tmp_path: Path) -> None:
    """A template clone's vm.json names the RAM file it maps; read back, it is a Path
    (a str there once broke every resume of a template clone)."""
    cfg = _cfg(tmp_path, memory_file=tmp_path / "tpl" / MEMORY_FILE, memory_shared=False)
    write_config(tmp_path / "vm.json", cfg)
    back = read_config(tmp_path / "vm.json")
    assert back == cfg and isinstance(back.memory_file, Path)
    assert read_config(tmp_path / "vm.json") is not None


# -- rebase on a memory file (hutch.vm.snapshot_rebase): the commit's crash window ------


def _staged(snap: Path, state: bytes) -> SnapshotManifest:
    """What a rebase stages: the manifest of a state-only stream ``state``."""
    old = load_manifest(snap)
    (snap / MEMORY_FILE).write_bytes(b"\0" * 4096)
    staged = dataclasses.replace(
        old,
        ram_in_file=True,
        state_size=len(state),
        state_digest="xxh3-128:" + xxhash.xxh3_128_hexdigest(state),
        memory=FileStamp.of(snap / MEMORY_FILE),
    )
    (snap / REBASE_MANIFEST).write_text(staged.to_json())
    return staged


@pytest.mark.usefixtures("qemu_img")
def test_a_rebase_cut_after_its_stream_swap_is_finished_on_read(tmp_path: Path) -> None:
    snap = _fake_snapshot(tmp_path, _cfg(tmp_path))
    state = b"device state only"
    staged = _staged(snap, state)
    (snap / STATE_FILE).write_bytes(state)  # the swap happened, the rename did not
    assert load_manifest(snap) == staged
    assert not (snap / REBASE_MANIFEST).exists()


@pytest.mark.usefixtures("qemu_img")
def test_a_rebase_cut_before_its_stream_swap_keeps_the_full_stream(tmp_path: Path) -> None:
    snap = _fake_snapshot(tmp_path, _cfg(tmp_path))
    before = load_manifest(snap)
    _staged(snap, b"device state only")  # state.mig is still the full stream
    assert load_manifest(snap) == before and not before.ram_in_file
    assert not (snap / REBASE_MANIFEST).exists()
