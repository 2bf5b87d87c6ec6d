"""A frozen snapshot directory with a two-layer qcow2 chain through the blob store and
back (real qemu-img, real files, no VM): the fetched copy is a complete snapshot at its
new place (the manifest's stamp renewed, template_complete), its chain points at its own
layers and at the images directory's raw image, and it reads the same bytes as the
original chain; a stream that fails the manifest's digest is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hutch.errors import BlobError
from hutch.runtime.qemu.templates import template_complete
from hutch.services.blob_dirs import fetch_dir, upload_dir
from hutch.storage.blobs import LocalBlobStore
from hutch.vm.disk_chain import disk_chain
from hutch.vm.snapshot_dir import load_manifest
from tests.component.frozen_kit import qemu_tool, seal_frozen

MiB = 1 << 20


def _snapshot(tmp_path: Path) -> tuple[Path, Path]:
    """images/base/rootfs.ext4 (raw) <- templates/t/disk.qcow2 <- snapshots/s/disk.qcow2,
    each layer with data of its own; the snapshot dir frozen with a manifest."""
    images = tmp_path / "images"
    base = images / "base" / "rootfs.ext4"
    base.parent.mkdir(parents=True)
    with base.open("wb") as out:
        out.write(os.urandom(2 * MiB))
        out.truncate(64 * MiB)
    middle = tmp_path / "templates" / "t" / "disk.qcow2"
    middle.parent.mkdir(parents=True)
    qemu_tool("qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(base), str(middle))
    qemu_tool("qemu-io", "-f", "qcow2", "-c", "write -P 0xab 4M 1M", str(middle))
    snap = tmp_path / "snapshots" / "snap-0123456789ab"
    snap.mkdir(parents=True)
    disk = snap / "disk.qcow2"
    qemu_tool(
        "qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(middle), str(disk)
    )
    qemu_tool("qemu-io", "-f", "qcow2", "-c", "write -P 0xcd 8M 1M", str(disk))
    (snap / "vm.json").write_text("{}")
    seal_frozen(snap, 3 * MiB)
    assert template_complete(snap)
    return snap, images


def test_a_chain_round_trips_and_lands_complete(tmp_path: Path) -> None:
    snap, images = _snapshot(tmp_path)
    store = LocalBlobStore(tmp_path / "blobs")
    sent = upload_dir(store, "snapshots/s/", snap, owner="s", scratch=tmp_path)
    assert {b.key for b in store.list_prefix("snapshots/s/")} >= {
        "snapshots/s/index.json",
        "snapshots/s/layer-1.qcow2",
        "snapshots/s/disk.qcow2",
        "snapshots/s/state.mig",
    }
    assert sent > 3 * MiB

    final = tmp_path / "other-host" / "snapshots" / "snap-0123456789ab"
    final.parent.mkdir(parents=True)
    staging = tmp_path / "other-host" / "blob-fetch" / "x"
    staging.mkdir(parents=True)
    fetch_dir(store, "snapshots/s/", staging, final, owner="s", images_dir=images)
    os.rename(staging, final)

    assert template_complete(final)
    assert load_manifest(final).disk.path == str(final.resolve() / "disk.qcow2")
    layers, base = disk_chain(final / "disk.qcow2")
    assert layers == [final.resolve() / "disk.qcow2", final.resolve() / "layer-1.qcow2"]
    assert base == (images / "base" / "rootfs.ext4").resolve()
    # The same guest-visible bytes as the original chain.
    qemu_tool(
        "qemu-img",
        "compare",
        "-f",
        "qcow2",
        "-F",
        "qcow2",
        str(snap / "disk.qcow2"),
        str(final / "disk.qcow2"),
    )
    assert all(not os.access(f, os.W_OK) or os.geteuid() == 0 for f in final.iterdir())
    assert {f.stat().st_mode & 0o777 for f in final.iterdir()} == {0o444}


def test_a_stream_that_fails_the_manifest_digest_is_refused(tmp_path: Path) -> None:
    snap, images = _snapshot(tmp_path)
    store = LocalBlobStore(tmp_path / "blobs")
    # The stream changed before the upload (so the index's sha256 matches it): only
    # the manifest's own digest can tell.
    state = snap / "state.mig"
    os.chmod(state, 0o644)
    with state.open("r+b") as f:
        f.seek(MiB)
        f.write(b"\x00")
    upload_dir(store, "snapshots/s/", snap, owner="s", scratch=tmp_path)
    staging = tmp_path / "staging"
    staging.mkdir()
    with pytest.raises(BlobError, match=r"the fetched state\.mig does not match its manifest"):
        fetch_dir(store, "snapshots/s/", staging, tmp_path / "final", owner="s", images_dir=images)


def test_a_disk_only_state_round_trips_with_its_extra_files(tmp_path: Path) -> None:
    """A disk-mode pause: no directory, the sandbox's disk and its vm.json."""
    snap, images = _snapshot(tmp_path)
    store = LocalBlobStore(tmp_path / "blobs")
    vm_json = tmp_path / "vm.json"
    vm_json.write_text('{"name": "sb"}')
    upload_dir(
        store,
        "pauses/sb/1/",
        None,
        owner="sb",
        scratch=tmp_path,
        disk=snap / "disk.qcow2",
        extra={"vm.json": vm_json},
    )
    assert {b.key for b in store.list_prefix("pauses/sb/1/")} == {
        "pauses/sb/1/disk.qcow2",
        "pauses/sb/1/index.json",
        "pauses/sb/1/layer-1.qcow2",
        "pauses/sb/1/vm.json",
    }
    staging = tmp_path / "staging"
    staging.mkdir()
    # Read as a memory state it is refused (no manifest, no stream) ...
    with pytest.raises(BlobError, match="not a valid index"):
        fetch_dir(store, "pauses/sb/1/", staging, tmp_path / "sb", owner="sb", images_dir=images)
    # ... and fetched as a disk-only one.
    final = tmp_path / "host-b" / "sb"
    final.parent.mkdir()
    fetch_dir(store, "pauses/sb/1/", staging, final, owner="sb", images_dir=images, memory=False)
    os.rename(staging, final)
    assert (final / "vm.json").read_text() == '{"name": "sb"}'
    layers, base = disk_chain(final / "disk.qcow2")
    assert layers == [final.resolve() / "disk.qcow2", final.resolve() / "layer-1.qcow2"]
    assert base == (images / "base" / "rootfs.ext4").resolve()
    qemu_tool(
        "qemu-img", "compare", "-f", "qcow2", "-F", "qcow2",
        str(snap / "disk.qcow2"), str(final / "disk.qcow2"),
    )  # fmt: skip
