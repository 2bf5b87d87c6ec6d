"""One image, two hosts, other bytes (issue 14): images are built or imported on each
host on its own and mkfs is not reproducible, so a frozen disk taken on host A must not
be opened over host B's different ``rootfs.ext4`` (or runtime disk). Real parts: the
suite's SeaweedFS (``tests/s3server.py``) as the bucket, qemu-img for the qcow2 chains,
and the one database of the hosts as a real SQLite file and on the suite's PostgreSQL
(``db_target``). No VM: hosts are images directories and blob store clients.

Two machines see their images directory at the same path; here the two directories
take turns at one path (``Machines.be``), so the index's absolute base path means on B
what it would on B's own machine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from hutch.errors import Conflict, ImageMismatch
from hutch.images import identity
from hutch.images.oci.importer import content_dir, find_content
from hutch.services.blob_dirs import INDEX, fetch_dir, upload_dir
from hutch.services.image_blobs import ImageBlobs, image_prefix
from hutch.storage.blobs import BlobStore
from hutch.store.db import Store
from hutch.store.image_uploads import ImageUploadStore
from hutch.vm.disk_chain import disk_chain
from tests.component.frozen_kit import qemu_tool, seal_frozen
from tests.ocikit import E, Image, Layer, layer_tar
from tests.s3server import S3Server, s3_server

__all__ = ["s3_server"]

MiB = 1 << 20
RUNTIME = "oci-boot/0123456789abcdef/runtime.ext4"


class Machines:
    """Host A's and host B's images directories, each at ``path`` in its turn."""

    def __init__(self, tmp: Path) -> None:
        self.path = tmp / "images"
        self.parked = {"a": tmp / "a-images", "b": tmp / "b-images"}
        self.current: str | None = None
        for d in self.parked.values():
            d.mkdir()

    def be(self, host: str) -> Path:
        if self.current == host:
            return self.path
        if self.current is not None:
            os.rename(self.path, self.parked[self.current])
        os.rename(self.parked[host], self.path)
        self.current = host
        return self.path


def _disk_image(path: Path, fill: bytes) -> Path:
    """A raw image (sparse, 64 MiB, data at its head), as a build leaves it: its
    identity recorded beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as out:
        out.write(fill * (2 * MiB // len(fill)))
        out.truncate(64 * MiB)
    os.chmod(path, 0o444)
    identity.record(path)
    return path


def _frozen(state: Path, base: Path, runtime: Path | None = None) -> Path:
    """A named snapshot's frozen directory on ``base``: disk.qcow2 with data of its own,
    state.mig, a manifest, vm.json naming ``runtime`` as the runtime disk."""
    snap = state / "snapshots" / "snap-0123456789ab"
    snap.mkdir(parents=True)
    disk = snap / "disk.qcow2"
    qemu_tool("qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(base), str(disk))
    qemu_tool("qemu-io", "-f", "qcow2", "-c", "write -P 0xcd 1M 64k", str(disk))
    vm = {"runtime_disk": str(runtime)} if runtime is not None else {}
    (snap / "vm.json").write_text(json.dumps(vm))
    seal_frozen(snap, MiB)
    return snap


@pytest.fixture
def store(s3_server: S3Server, tmp_path: Path) -> Iterator[BlobStore]:
    yield s3_server.blob_store(tmp_path / "journal", prefix=f"id-{tmp_path.name}")


def _fetch_on(images: Path, store: BlobStore, tmp: Path, prefix: str = "snapshots/s/") -> Path:
    staging = tmp / "b-state" / "blob-fetch" / "x"
    staging.mkdir(parents=True, exist_ok=True)
    final = tmp / "b-state" / "snapshots" / "snap-0123456789ab"
    fetch_dir(store, prefix, staging, final, owner="s", images_dir=images, image="app")
    final.parent.mkdir(parents=True, exist_ok=True)
    os.rename(staging, final)
    return final


# -- frozen directories over the base and the runtime disk ----------------------------------


def test_a_frozen_dir_over_other_base_bytes_is_refused_and_nothing_changes(
    tmp_path: Path, store: BlobStore
) -> None:
    hosts = Machines(tmp_path)
    images = hosts.be("a")
    base = _disk_image(images / "base" / "d1" / "rootfs.ext4", b"A-build ")
    snap = _frozen(tmp_path / "a-state", base)
    upload_dir(store, "snapshots/s/", snap, owner="s", scratch=tmp_path)
    index = json.loads(_read_blob(store, "snapshots/s/" + INDEX, tmp_path))
    assert index["base_sha256"] == identity.identity(base) == identity.compute(base)
    assert index["depends"] == {}

    images = hosts.be("b")  # B built "the same" image: same name, size, other bytes
    b_base = _disk_image(images / "base" / "d1" / "rootfs.ext4", b"B-build ")
    b_bytes = b_base.read_bytes()
    in_bucket = sorted((b.key, b.sha256) for b in store.list_prefix("snapshots/s/"))
    staging = tmp_path / "b-state" / "blob-fetch" / "x"
    with pytest.raises(ImageMismatch) as err:
        _fetch_on(images, store, tmp_path)
    msg = str(err.value)
    assert "image 'app'" in msg and "base/d1/rootfs.ext4" in msg
    assert identity.short(identity.identity(b_base)) in msg
    assert identity.short(index["base_sha256"]) in msg
    assert "uploaded first to the blob store" in msg  # a built-in image: they converge
    # Nothing downloaded, renamed or changed: B's image, B's state, the bucket.
    assert list(staging.iterdir()) == []
    assert not (tmp_path / "b-state" / "snapshots").exists()
    assert b_base.read_bytes() == b_bytes
    assert sorted((b.key, b.sha256) for b in store.list_prefix("snapshots/s/")) == in_bucket


def test_the_same_base_bytes_open_on_the_other_host(tmp_path: Path, store: BlobStore) -> None:
    hosts = Machines(tmp_path)
    images = hosts.be("a")
    base = _disk_image(images / "base" / "d1" / "rootfs.ext4", b"one build")
    snap = _frozen(tmp_path / "a-state", base)
    upload_dir(store, "snapshots/s/", snap, owner="s", scratch=tmp_path)
    original = base.read_bytes()

    images = hosts.be("b")  # the same bytes (a shared build, or fetched): no record yet
    (images / "base" / "d1").mkdir(parents=True)
    (images / "base" / "d1" / "rootfs.ext4").write_bytes(original)
    final = _fetch_on(images, store, tmp_path)
    _layers, got = disk_chain(final / "disk.qcow2")
    assert got == (images / "base" / "d1" / "rootfs.ext4").resolve()
    assert identity.known(got) == identity.compute(got)  # hashed once, kept
    qemu_tool("qemu-img", "compare", "-f", "qcow2", "-F", "qcow2",
         str(snap / "disk.qcow2"), str(final / "disk.qcow2"))  # fmt: skip


def test_an_index_written_before_identities_is_fetched_as_before(
    tmp_path: Path, store: BlobStore
) -> None:
    """No ``base_sha256`` nor ``depends``: nothing to compare, so it opens as it did
    (documented: such uploads are not checked)."""
    hosts = Machines(tmp_path)
    images = hosts.be("a")
    base = _disk_image(images / "base" / "d1" / "rootfs.ext4", b"A-build ")
    snap = _frozen(tmp_path / "a-state", base)
    upload_dir(store, "snapshots/s/", snap, owner="s", scratch=tmp_path)
    old = json.loads(_read_blob(store, "snapshots/s/" + INDEX, tmp_path))
    del old["base_sha256"], old["depends"]
    (tmp_path / "old-index.json").write_text(json.dumps(old))
    store.put("snapshots/s/" + INDEX, tmp_path / "old-index.json")

    images = hosts.be("b")
    _disk_image(images / "base" / "d1" / "rootfs.ext4", b"B-build ")
    final = _fetch_on(images, store, tmp_path)
    assert (final / "disk.qcow2").is_file()


def test_a_runtime_disk_of_other_bytes_is_refused(tmp_path: Path, store: BlobStore) -> None:
    hosts = Machines(tmp_path)
    images = hosts.be("a")
    base = _disk_image(images / "oci" / "sha256-ab" / "rootfs.ext4", b"same base")
    runtime = _disk_image(images / RUNTIME, b"A-runtime ")
    snap = _frozen(tmp_path / "a-state", base, runtime)
    upload_dir(store, "snapshots/s/", snap, owner="s", scratch=tmp_path)
    index = json.loads(_read_blob(store, "snapshots/s/" + INDEX, tmp_path))
    assert index["depends"] == {str(runtime): identity.identity(runtime)}
    base_bytes, runtime_bytes = base.read_bytes(), runtime.read_bytes()

    images = hosts.be("b")
    (images / "oci" / "sha256-ab").mkdir(parents=True)
    (images / "oci" / "sha256-ab" / "rootfs.ext4").write_bytes(base_bytes)
    b_runtime = _disk_image(images / RUNTIME, b"B-runtime ")
    with pytest.raises(ImageMismatch, match=r"oci-boot/0123456789abcdef/runtime\.ext4"):
        _fetch_on(images, store, tmp_path)
    assert not (tmp_path / "b-state" / "snapshots").exists()
    # The runtime's bytes made the same here (its record goes stale with it): it opens.
    os.chmod(b_runtime, 0o644)
    b_runtime.write_bytes(runtime_bytes)
    assert (_fetch_on(images, store, tmp_path) / "vm.json").is_file()


def _read_blob(store: BlobStore, key: str, tmp: Path) -> str:
    info = store.stat(key)
    assert info is not None
    dest = tmp / f".read-{key.replace('/', '_')}"
    store.get(key, dest, expect=info)
    try:
        return dest.read_text()
    finally:
        dest.unlink()


# -- two hosts importing one digest -------------------------------------------------------


def _import(images: Path, rootfs: bytes) -> str:
    """The content directory an import of one OCI image leaves (the same manifest on
    every host), its rootfs ``rootfs`` (what this host's mkfs made) with its identity
    in image.json and beside it, a boot set; the digest."""
    img = Image(layers=[Layer(layer_tar([E("etc", "dir"), E("etc/tag", data=b"app")]))])
    manifest = img.manifest()
    d = content_dir(images, img.digest)
    (d / "refs").mkdir(parents=True)
    (d / "refs" / "host-app").touch()
    (d / "manifest.json").write_bytes(manifest)
    (d / "config.json").write_bytes(img.config())
    with (d / "rootfs.ext4").open("wb") as f:
        f.write(rootfs)
        f.seek(4 * MiB)
        f.write(b"tail")
    meta = {
        "format": "oci-rootfs-v1",
        "digest": img.digest,
        "config_digest": json.loads(manifest)["config"]["digest"],
        "size_bytes": 4 * MiB + 4,
        "layers": 1,
        "added": [],
        "built_at": 1.0,
        "rootfs_sha256": identity.record(d / "rootfs.ext4"),
    }
    (d / "image.json").write_text(json.dumps(meta))
    boot = images / "oci-boot" / "0123456789abcdef"
    boot.mkdir(parents=True, exist_ok=True)
    for name in ("vmlinux", "initrd.img", "runtime.ext4"):
        (boot / name).write_bytes(name.encode() * 100)
    (boot / "boot.json").write_text(
        json.dumps({"key": boot.name, "kernel_release": "6.1.0-test", "cmdline": ""})
    )
    (images / "oci-boot" / "current").write_text(boot.name + "\n")
    return img.digest


@pytest.fixture
def records(db_target: Path | str) -> ImageUploadStore:
    """The hosts' one database (an SQLite file, then PostgreSQL)."""
    return ImageUploadStore(Store(db_target))


def _host(
    name: str, images: Path, tmp: Path, store: BlobStore, records: ImageUploadStore
) -> ImageBlobs:
    return ImageBlobs(store, images, tmp / f"{name}-state", records, host=name)


def _files(d: Path) -> dict[str, bytes]:
    return {
        f.name: f.read_bytes() for f in d.iterdir() if f.is_file() and not f.name.startswith(".")
    }


def test_two_hosts_importing_one_digest_end_with_the_same_bytes_and_a_snapshot_moves(
    tmp_path: Path, store: BlobStore, records: ImageUploadStore
) -> None:
    hosts = Machines(tmp_path)
    images = hosts.be("a")
    digest = _import(images, b"mkfs on A")
    a = _host("a", images, tmp_path, store, records)
    b = _host("b", images, tmp_path, store, records)
    assert a.upload(digest) is not None  # the first complete upload: it wins
    assert records.claimant(image_prefix(f"oci/{digest.replace(':', '-')}")) is None
    a_content = _files(content_dir(images, digest))
    a_rootfs = content_dir(images, digest) / "rootfs.ext4"
    snap = _frozen(tmp_path / "a-state", a_rootfs)
    upload_dir(store, "snapshots/s/", snap, owner="s", scratch=tmp_path)

    images = hosts.be("b")
    _import(images, b"mkfs on B")  # the same digest, other bytes
    assert _files(content_dir(images, digest))["rootfs.ext4"] != a_content["rootfs.ext4"]
    # Before B adopts: its copy is not the bytes the snapshot was taken on.
    with pytest.raises(ImageMismatch, match="image 'app'"):
        _fetch_on(images, store, tmp_path)
    assert not b.same_as_uploaded(digest)

    assert b.upload(digest) is None  # complete already: B adopts, sends nothing
    assert _files(content_dir(images, digest)) == a_content
    assert (content_dir(images, digest) / "refs" / "host-app").exists()  # its own rows
    assert identity.known(content_dir(images, digest) / "rootfs.ext4") == identity.compute(
        content_dir(images, digest) / "rootfs.ext4"
    )
    assert b.same_as_uploaded(digest)
    assert b.upload(digest) is None  # nothing more to do
    assert find_content(images, digest) is not None
    assert not [p for p in (images / "oci").iterdir() if ".evict-" in p.name or ".fetch-" in p.name]
    # Now the snapshot opens on B over the very bytes it was taken on.
    final = _fetch_on(images, store, tmp_path)
    qemu_tool("qemu-img", "compare", "-f", "qcow2", "-F", "qcow2",
         str(snap / "disk.qcow2"), str(final / "disk.qcow2"))  # fmt: skip


def test_a_claimed_upload_holds_off_the_second_host_until_it_completes(
    tmp_path: Path, store: BlobStore, records: ImageUploadStore
) -> None:
    hosts = Machines(tmp_path)
    images = hosts.be("a")
    digest = _import(images, b"mkfs on A")
    a = _host("a", images, tmp_path, store, records)
    prefix = image_prefix(f"oci/{digest.replace(':', '-')}")
    assert records.claim(prefix, "a")  # A is uploading (its first blobs under way)

    images = hosts.be("b")
    _import(images, b"mkfs on B")
    b = _host("b", images, tmp_path, store, records)
    b_rootfs = (content_dir(images, digest) / "rootfs.ext4").read_bytes()
    with pytest.raises(Conflict, match="host a claimed its upload"):
        b.upload(digest)
    assert store.stat(prefix + INDEX) is None  # B sent no index, recorded nothing
    assert records.get(prefix) is None
    assert records.claimant(prefix) is not None and records.claimant(prefix).host == "a"  # type: ignore[union-attr]
    assert (content_dir(images, digest) / "rootfs.ext4").read_bytes() == b_rootfs

    hosts.be("a")
    assert a.upload(digest) is not None
    a_rootfs = (content_dir(hosts.path, digest) / "rootfs.ext4").read_bytes()
    hosts.be("b")
    assert b.upload(digest) is None  # B's retry: complete now, so B adopts A's bytes
    assert (content_dir(hosts.path, digest) / "rootfs.ext4").read_bytes() == a_rootfs


def test_a_copy_in_use_here_is_adopted_only_once_nothing_uses_it(
    tmp_path: Path, store: BlobStore, records: ImageUploadStore
) -> None:
    hosts = Machines(tmp_path)
    images = hosts.be("a")
    digest = _import(images, b"mkfs on A")
    _host("a", images, tmp_path, store, records).upload(digest)
    a_rootfs = (content_dir(images, digest) / "rootfs.ext4").read_bytes()

    images = hosts.be("b")
    _import(images, b"mkfs on B")
    b = _host("b", images, tmp_path, store, records)
    b_rootfs = (content_dir(images, digest) / "rootfs.ext4").read_bytes()
    b.in_use = lambda _digest: "sandbox sb-1"
    with pytest.raises(Conflict, match="sandbox sb-1 here uses it"):
        b.upload(digest)
    assert (content_dir(images, digest) / "rootfs.ext4").read_bytes() == b_rootfs
    b.in_use = lambda _digest: None
    assert b.upload(digest) is None
    assert (content_dir(images, digest) / "rootfs.ext4").read_bytes() == a_rootfs


def test_a_claim_goes_stale_after_an_hour_and_is_taken_over(records: ImageUploadStore) -> None:
    prefix = "images/oci/sha256-ab/"
    assert records.claim(prefix, "a", now=1000.0)
    assert records.claim(prefix, "a", now=1500.0)  # renewed by its holder
    assert not records.claim(prefix, "b", now=1500.0 + 3599.0)  # an hour not yet over
    claim = records.claimant(prefix)
    assert claim is not None and (claim.host, claim.claimed_at) == ("a", 1500.0)
    assert records.claim(prefix, "b", now=1500.0 + 3601.0)  # stale: taken over
    assert not records.claim(prefix, "a", now=1500.0 + 3602.0)  # A's is gone
    records.release(prefix, "a")  # not A's to release any more
    assert records.claimant(prefix).host == "b"  # type: ignore[union-attr]
    records.release(prefix, "b")
    assert records.claimant(prefix) is None
    assert records.claim(prefix, "a", now=9999.0)
