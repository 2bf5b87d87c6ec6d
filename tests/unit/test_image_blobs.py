"""Imported images through the blob store (``services/image_blobs.py``), with the local
blob backend: an image imported on host A is uploaded by digest, host B (its own
images directory) fetches it once, verified against the digest before anything sees
it and against the uploader's record in the database (real SQLite and PostgreSQL: the
``db_target`` pass), into a temporary path renamed in; corrupt, partial, missing and
unrecorded uploads, and a file swapped in the bucket with its index, are refused with
errors that name the image and the file and leave nothing behind."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hutch.contract.http_errors import status_for
from hutch.errors import BlobError, Conflict, ImageMissing
from hutch.images.oci.boot import find_boot_set
from hutch.images.oci.importer import content_dir, find_content
from hutch.services.image_blobs import ImageBlobs, image_prefix
from hutch.services.images import HostImages, LocalImages, resolve
from hutch.storage.blobs import BlobInfo, LocalBlobStore, Progress, S3BlobStore, S3Options
from hutch.storage.blobs.flat import FileSum, file_sums
from hutch.store.db import Store
from hutch.store.image_uploads import ImageUploadStore
from hutch.store.images import ImageRow, ImageStore
from tests.ocikit import E, Image, Layer, layer_tar

BOOT_KEY = "0123456789abcdef"


def _content(images_dir: Path, tag: str = "one") -> str:
    """A complete content directory as an import leaves it (small files; the rootfs
    sparse, with data at both ends); its digest."""
    img = Image(layers=[Layer(layer_tar([E("etc", "dir"), E("etc/tag", data=tag.encode())]))])
    manifest, config = img.manifest(), img.config()
    d = content_dir(images_dir, img.digest)
    (d / "refs").mkdir(parents=True)
    (d / "refs" / "host-a-app").touch()
    (d / "manifest.json").write_bytes(manifest)
    (d / "config.json").write_bytes(config)
    with (d / "rootfs.ext4").open("wb") as f:
        f.write(b"ext4-head" + tag.encode())
        f.seek(4 << 20)
        f.write(b"ext4-tail")
    meta = {
        "format": "oci-rootfs-v1",
        "digest": img.digest,
        "config_digest": json.loads(manifest)["config"]["digest"],
        "size_bytes": (4 << 20) + 9,
        "layers": 1,
        "added": [],
        "built_at": 1.0,
    }
    (d / "image.json").write_text(json.dumps(meta))
    return img.digest


def _boot(images_dir: Path) -> None:
    d = images_dir / "oci-boot" / BOOT_KEY
    d.mkdir(parents=True)
    for name in ("vmlinux", "initrd.img", "runtime.ext4"):
        (d / name).write_bytes(name.encode() * 100)
    meta = {"key": BOOT_KEY, "kernel_release": "6.1.0-test", "cmdline": "console=ttyS0"}
    (d / "boot.json").write_text(json.dumps(meta))
    (images_dir / "oci-boot" / "current").write_text(BOOT_KEY + "\n")


class CountingStore(LocalBlobStore):
    """The local backend, counting downloads per key (and able to hold one back)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gets: dict[str, int] = {}
        self.hold: threading.Event | None = None
        self.entered = threading.Event()

    def get(
        self, key: str, dest: Path, *, expect: BlobInfo, progress: Progress | None = None
    ) -> BlobInfo:
        self.gets[key] = self.gets.get(key, 0) + 1
        if key.endswith("rootfs.ext4") and self.hold is not None:
            self.entered.set()
            self.hold.wait(30)
        return super().get(key, dest, expect=expect, progress=progress)


@pytest.fixture
def records(db_target: Path | str) -> ImageUploadStore:
    """The cluster's one database (SQLite file, then PostgreSQL)."""
    return ImageUploadStore(Store(db_target))


@pytest.fixture
def hosts(
    tmp_path: Path, records: ImageUploadStore
) -> tuple[ImageBlobs, ImageBlobs, CountingStore, str]:
    """Host A (with an imported image and a boot set, uploaded) and host B (an empty
    images directory), one store and one database; the digest."""
    store = CountingStore(tmp_path / "blobs")
    a_dir, b_dir = tmp_path / "a-images", tmp_path / "b-images"
    _boot(a_dir)
    digest = _content(a_dir)
    a = ImageBlobs(store, a_dir, tmp_path / "a-state", records)
    b = ImageBlobs(store, b_dir, tmp_path / "b-state", records)
    sent = a.upload(digest)
    assert sent is not None and sent > 4 << 20
    assert a.upload(digest) is None  # once: the index is there
    assert a.uploaded(digest)
    return a, b, store, digest


def _leftovers(images_dir: Path) -> list[str]:
    return sorted(
        p.name for p in images_dir.rglob(".*") if ".fetch-" in p.name or p.suffix == ".part"
    )


def test_an_uploaded_image_is_fetched_verified_and_renamed_in_on_another_host(
    hosts: tuple[ImageBlobs, ImageBlobs, CountingStore, str], tmp_path: Path
) -> None:
    a, b, store, digest = hosts
    keys = {i.key for i in store.list_prefix("images/")}
    rel = f"oci/{digest.replace(':', '-')}"
    assert f"{image_prefix(rel)}index.json" in keys
    assert f"{image_prefix(rel)}rootfs.ext4" in keys
    assert not any("refs" in k for k in keys)  # each host's own record of its users
    assert f"images/oci-boot/{BOOT_KEY}/index.json" in keys
    asyncio.run(b.ensure(digest, "image 'app'", boot=True))
    found = find_content(b.images_dir, digest)
    assert found is not None
    src = content_dir(a.images_dir, digest)
    for name in ("rootfs.ext4", "manifest.json", "config.json", "image.json"):
        assert (found.path / name).read_bytes() == (src / name).read_bytes()
        assert (found.path / name).stat().st_mode & 0o222 == 0  # read-only
    assert not (found.path / "refs").exists()
    boot = find_boot_set(b.images_dir)
    assert boot is not None and boot.key == BOOT_KEY  # none here before: it is current
    assert _leftovers(b.images_dir) == []
    # Present now: a second ensure downloads nothing.
    before = dict(store.gets)
    asyncio.run(b.ensure(digest, "image 'app'", boot=True))
    assert store.gets == before


def test_concurrent_fetches_of_one_image_download_it_once(
    hosts: tuple[ImageBlobs, ImageBlobs, CountingStore, str],
) -> None:
    _a, b, store, digest = hosts
    store.hold = threading.Event()

    async def both() -> None:
        first = asyncio.create_task(b.ensure(digest, "image 'app'", boot=False))
        second = asyncio.create_task(b.ensure(digest, "image 'app'", boot=False))
        await asyncio.to_thread(store.entered.wait, 30)
        assert store.hold is not None
        store.hold.set()
        await asyncio.gather(first, second)

    asyncio.run(both())
    rootfs = [k for k in store.gets if k.endswith("rootfs.ext4")]
    assert [store.gets[k] for k in rootfs] == [1]
    assert find_content(b.images_dir, digest) is not None


def test_two_daemons_sharing_an_images_directory_fetch_once(
    hosts: tuple[ImageBlobs, ImageBlobs, CountingStore, str], tmp_path: Path
) -> None:
    _a, b, store, digest = hosts
    # Another daemon on B's images directory: the content's flock serializes them.
    b2 = ImageBlobs(store, b.images_dir, tmp_path / "b2-state", b.records)
    store.hold = threading.Event()
    errors: list[BaseException] = []

    def run(blobs: ImageBlobs) -> None:
        try:
            blobs.fetch_content(digest, "image 'app'")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    one = threading.Thread(target=run, args=(b,))
    one.start()
    assert store.entered.wait(30)  # the first is downloading, holding the content's lock
    two = threading.Thread(target=run, args=(b2,))
    two.start()
    assert _blocks_on_a_lock(two), "the second fetch waits for the first"
    store.hold.set()
    one.join(30)
    two.join(30)
    assert errors == []
    assert sum(n for k, n in store.gets.items() if k.endswith("rootfs.ext4")) == 1


def _blocks_on_a_lock(thread: threading.Thread) -> bool:
    """Until ``thread`` sleeps in the kernel's file lock wait (flock), or ends first."""
    wchan = Path(f"/proc/self/task/{thread.native_id}/wchan")
    deadline = time.monotonic() + 30
    while thread.is_alive() and time.monotonic() < deadline:
        if "lock" in wchan.read_text():
            return True
        time.sleep(0.01)
    return False


def test_a_corrupt_blob_is_refused_naming_the_image_and_nothing_is_left(
    hosts: tuple[ImageBlobs, ImageBlobs, CountingStore, str],
) -> None:
    _a, b, store, digest = hosts
    key = next(i.key for i in store.list_prefix("images/oci/") if i.key.endswith("rootfs.ext4"))
    path = store.root / key
    data = bytearray(path.read_bytes())
    data[3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BlobError, match=r"image 'app': fetching it .* is corrupt: sha256"):
        asyncio.run(b.ensure(digest, "image 'app'", boot=False))
    assert find_content(b.images_dir, digest) is None
    assert not content_dir(b.images_dir, digest).exists()
    assert _leftovers(b.images_dir) == []


def test_a_partial_upload_is_refused_and_a_truncated_blob_too(
    hosts: tuple[ImageBlobs, ImageBlobs, CountingStore, str],
) -> None:
    _a, b, store, digest = hosts
    prefix = next(
        i.key for i in store.list_prefix("images/oci/") if i.key.endswith("index.json")
    ).removesuffix("index.json")
    path = store.root / (prefix + "rootfs.ext4")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(BlobError, match="is truncated"):
        asyncio.run(b.ensure(digest, "image 'app'", boot=False))
    path.unlink()
    with pytest.raises(BlobError, match=r"rootfs\.ext4 is missing from"):
        asyncio.run(b.ensure(digest, "image 'app'", boot=False))
    assert not content_dir(b.images_dir, digest).exists()
    assert _leftovers(b.images_dir) == []


def _swap_in(store: LocalBlobStore, prefix: str, src: Path, scratch: Path) -> dict[str, Any]:
    """What a writer of the bucket alone can do: ``src``'s files under ``prefix``, and an
    index that agrees with them (every size and sha256 right). Returns the index."""
    index = json.loads((store.root / prefix / "index.json").read_text())
    for name in index["files"]:
        got = store.put(prefix + name, src / name)
        index["files"][name] = {"size": got.size, "sha256": got.sha256}
    (scratch / "index.json").write_text(json.dumps(index))
    store.put(prefix + "index.json", scratch / "index.json")
    return dict(index)


def test_a_rootfs_swapped_with_its_index_in_the_bucket_is_refused_naming_the_file(
    hosts: tuple[ImageBlobs, ImageBlobs, CountingStore, str], tmp_path: Path
) -> None:
    """The index is no longer the last word: the database's record of what host A sent
    is, and the bucket cannot write it."""
    _a, b, store, digest = hosts
    rel = f"oci/{digest.replace(':', '-')}"
    forged = tmp_path / "forged"
    shutil.copytree(
        content_dir(_a.images_dir, digest), forged, ignore=shutil.ignore_patterns("refs")
    )
    (forged / "rootfs.ext4").chmod(0o644)
    with (forged / "rootfs.ext4").open("r+b") as f:
        f.write(b"evil")
    _swap_in(store, image_prefix(rel), forged, tmp_path)
    with pytest.raises(
        BlobError,
        match=rf"image 'app': fetching it .*{rel}/rootfs\.ext4 .*: the index says .* the "
        "uploader recorded .*; .* is not fetched",
    ):
        asyncio.run(b.ensure(digest, "image 'app'", boot=False))
    assert not content_dir(b.images_dir, digest).exists()
    assert _leftovers(b.images_dir) == []


def test_a_boot_set_swapped_with_its_index_in_the_bucket_is_refused(
    hosts: tuple[ImageBlobs, ImageBlobs, CountingStore, str], tmp_path: Path
) -> None:
    a, b, store, digest = hosts
    forged = tmp_path / "forged-boot"
    shutil.copytree(a.images_dir / "oci-boot" / BOOT_KEY, forged)
    (forged / "runtime.ext4").write_bytes(b"a runtime that runs something else")
    _swap_in(store, f"images/oci-boot/{BOOT_KEY}/", forged, tmp_path)
    with pytest.raises(BlobError, match=rf"oci-boot/{BOOT_KEY}/runtime\.ext4 .*the index says"):
        asyncio.run(b.ensure(digest, "image 'app'", boot=True))
    assert find_boot_set(b.images_dir) is None
    assert _leftovers(b.images_dir) == []


def test_an_index_naming_a_file_the_record_does_not_is_refused(
    hosts: tuple[ImageBlobs, ImageBlobs, CountingStore, str], tmp_path: Path
) -> None:
    _a, b, store, digest = hosts
    prefix = image_prefix(f"oci/{digest.replace(':', '-')}")
    index = json.loads((store.root / prefix / "index.json").read_text())
    (tmp_path / "extra").write_bytes(b"more")
    got = store.put(prefix + "extra", tmp_path / "extra")
    index["files"]["extra"] = {"size": got.size, "sha256": got.sha256}
    (tmp_path / "index.json").write_text(json.dumps(index))
    store.put(prefix + "index.json", tmp_path / "index.json")
    with pytest.raises(BlobError, match=r"extra .*the uploader recorded no such file"):
        asyncio.run(b.ensure(digest, "image 'app'", boot=False))
    assert _leftovers(b.images_dir) == []


def test_an_upload_without_a_record_is_refused_and_recorded_by_the_next_upload(
    hosts: tuple[ImageBlobs, ImageBlobs, CountingStore, str],
) -> None:
    """An upload made before migration 15 (an index, no record): never fetched on the
    bucket's word (fail closed); the host holding the content sends it again (the start
    sweep schedules it: not complete) and records it, and then it is fetched."""
    a, b, _store, digest = hosts
    prefix = image_prefix(f"oci/{digest.replace(':', '-')}")
    assert b.records is not None
    b.records.delete(prefix)
    assert not a.uploaded(digest)
    with pytest.raises(ImageMissing, match="with a record of its upload in the database"):
        asyncio.run(b.ensure(digest, "image 'app'", boot=False))
    assert not content_dir(b.images_dir, digest).exists()
    assert a.upload(digest) is not None
    assert a.uploaded(digest)
    asyncio.run(b.ensure(digest, "image 'app'", boot=True))
    assert find_content(b.images_dir, digest) is not None


def test_a_boot_set_without_a_record_is_image_missing(
    hosts: tuple[ImageBlobs, ImageBlobs, CountingStore, str],
) -> None:
    _a, b, _store, digest = hosts
    assert b.records is not None
    b.records.delete(f"images/oci-boot/{BOOT_KEY}/")
    with pytest.raises(ImageMissing, match=f"boot set {BOOT_KEY} .* with a record of its"):
        asyncio.run(b.ensure(digest, "image 'app'", boot=True))
    assert find_boot_set(b.images_dir) is None


def test_content_that_does_not_match_its_digest_is_refused(
    hosts: tuple[ImageBlobs, ImageBlobs, CountingStore, str], tmp_path: Path
) -> None:
    """Even an upload its uploader recorded (a host that sent the wrong files) must
    match the digest the image is recorded with: another image's content cannot stand
    in."""
    _a, b, store, digest = hosts
    other_dir = tmp_path / "other"
    other = _content(other_dir, "two")
    prefix = image_prefix(f"oci/{digest.replace(':', '-')}")
    index = _swap_in(store, prefix, content_dir(other_dir, other), tmp_path)
    assert b.records is not None
    b.records.put(prefix, file_sums(index), index["meta"])
    with pytest.raises(BlobError, match=f"has a manifest.json of digest {other}"):
        asyncio.run(b.ensure(digest, "image 'app'", boot=False))
    assert not content_dir(b.images_dir, digest).exists()
    assert _leftovers(b.images_dir) == []


def test_an_index_naming_a_path_outside_is_refused(
    hosts: tuple[ImageBlobs, ImageBlobs, CountingStore, str], tmp_path: Path
) -> None:
    _a, b, store, digest = hosts
    rel = f"oci/{digest.replace(':', '-')}"
    index_path = store.root / image_prefix(rel) / "index.json"
    index = json.loads(index_path.read_text())
    index["files"]["../../escape"] = index["files"]["config.json"]
    (tmp_path / "bad.json").write_text(json.dumps(index))
    store.put(image_prefix(rel) + "index.json", tmp_path / "bad.json")
    with pytest.raises(BlobError, match="is not a valid index"):
        asyncio.run(b.ensure(digest, "image 'app'", boot=False))
    assert not (b.images_dir.parent / "escape").exists()


def test_an_image_in_the_store_nowhere_is_image_missing(
    tmp_path: Path, records: ImageUploadStore
) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    b = ImageBlobs(store, tmp_path / "b-images", tmp_path / "b-state", records)
    digest = "sha256:" + "ab" * 32
    with pytest.raises(ImageMissing, match=r"image 'app' \(sha256:abab.*not in the blob store"):
        asyncio.run(b.ensure(digest, "image 'app'", boot=False))
    assert isinstance(ImageMissing("x"), Conflict)
    assert status_for(ImageMissing("x")) == 409 and ImageMissing.code == "image_missing"


def test_an_unreachable_store_is_a_blob_error_naming_the_image(
    tmp_path: Path, records: ImageUploadStore
) -> None:
    # An S3 endpoint where nothing listens (each request retried for half a second).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    options = S3Options(
        endpoint=f"http://127.0.0.1:{port}", retry_s=0.5, access_key="k", secret_key="s"
    )
    store = S3BlobStore("bucket", "hutch", tmp_path / "journal", options)
    b = ImageBlobs(store, tmp_path / "b", tmp_path / "s", records)
    records.put(image_prefix("oci/sha256-" + "cd" * 32), {}, {})  # recorded: the store is asked
    with pytest.raises(BlobError, match=r"image 'app': fetching it from the blob store failed"):
        asyncio.run(b.ensure("sha256:" + "cd" * 32, "image 'app'", boot=False))
    assert not content_dir(b.images_dir, "sha256:" + "cd" * 32).exists()


# -- the whole path: a recorded image, resolved on a host without its content -----------


class _Boot:
    def __init__(self, images_dir: Path) -> None:
        self.images_dir = images_dir

    def find(self):  # type: ignore[no-untyped-def]
        return find_boot_set(self.images_dir)

    def prepare(self):  # type: ignore[no-untyped-def]
        raise AssertionError("a fetch never builds a boot set")


def test_a_host_without_an_imported_image_fetches_it_and_resolves_it(
    hosts: tuple[ImageBlobs, ImageBlobs, CountingStore, str], tmp_path: Path
) -> None:
    a, b, _store, digest = hosts
    db = Store(tmp_path / "shared.db")  # the cluster's one database
    rows = ImageStore(db)
    rows.insert(ImageRow("app", digest, {"type": "archive"}, {}, False, 4 << 20, 1.0))
    on_b = HostImages(LocalImages(b.images_dir), rows, b.images_dir, _Boot(b.images_dir), b)
    unfetched = HostImages(
        LocalImages(b.images_dir), rows, b.images_dir, _Boot(b.images_dir)
    )  # no store
    with pytest.raises(Conflict, match="its files are missing on this host"):
        resolve(unfetched, "app", "default")
    asyncio.run(on_b.ensure_local("app", "default"))
    image = resolve(on_b, "app", "default")
    assert image.rootfs == content_dir(b.images_dir, digest) / "rootfs.ext4"
    assert image.kernel.parent.name == BOOT_KEY
    asyncio.run(on_b.ensure_local("nope", "default"))  # unknown: resolve() answers
    assert rows.uses(digest) == 1
    b.delete(digest)
    assert not a.uploaded(digest)


def test_a_recorded_image_is_uploaded_in_the_background_from_any_thread(
    tmp_path: Path, records: ImageUploadStore
) -> None:
    """``schedule`` from an import's worker thread, and ``start``'s sweep of the rows
    whose content is here but whose upload is not complete (a daemon stopped first)."""
    store = LocalBlobStore(tmp_path / "blobs")
    a_dir = tmp_path / "a-images"
    _boot(a_dir)
    first, second = _content(a_dir, "first"), _content(a_dir, "second")
    a = ImageBlobs(store, a_dir, tmp_path / "a-state", records)
    seen: list[tuple[str, str]] = []
    a.on_uploaded = lambda type, data: seen.append((type, data["digest"]))

    async def run() -> None:
        a.start(lambda: [second, second, "sha256:" + "ee" * 32])  # the last: not here
        await asyncio.to_thread(a.schedule, first)  # as ImageImporter.record does
        await asyncio.sleep(0)  # the loop runs what the thread handed it
        for digest in (first, second):
            await a.wait_uploaded(digest)
        await a.close()

    asyncio.run(run())
    assert a.uploaded(first) and a.uploaded(second)
    assert sorted(seen) == sorted([("image.uploaded", first), ("image.uploaded", second)])


def test_an_upload_record_round_trips_and_the_last_upload_replaces_it(
    records: ImageUploadStore,
) -> None:
    prefix = "images/oci-boot/" + BOOT_KEY + "/"
    assert records.get(prefix) is None
    first = {"vmlinux": FileSum(3, "a" * 64), "boot.json": FileSum(1 << 40, "b" * 64)}
    records.put(prefix, first, {"key": BOOT_KEY})
    got = records.get(prefix)
    assert got is not None and got.files == first and got.meta == {"key": BOOT_KEY}
    records.put(prefix, {"vmlinux": FileSum(4, "c" * 64)}, {})
    again = records.get(prefix)
    assert again is not None and again.files == {"vmlinux": FileSum(4, "c" * 64)}
    records.delete(prefix)
    assert records.get(prefix) is None
