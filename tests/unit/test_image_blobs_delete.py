"""Deleting an image's blobs against uploads of the same digest
(``ImageBlobs.delete_unused``: one guard per digest) and the periodic resync that makes
again an upload a deletion elsewhere undid; the local blob backend, the database real
(SQLite, then PostgreSQL)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from hutch.images.oci.importer import find_content
from hutch.services.image_blobs import ImageBlobs
from hutch.storage.blobs import BlobInfo, LocalBlobStore, Progress
from hutch.store.image_uploads import ImageUploadStore
from tests.unit.test_image_blobs import _boot, _content, records

__all__ = ["records"]


def _host(
    tmp_path: Path,
    store: LocalBlobStore,
    records: ImageUploadStore,
    *tags: str,
    resync_s: float = 300.0,
) -> tuple[ImageBlobs, list[str]]:
    """Host A with a boot set and one image per tag (default one); its digests."""
    a_dir = tmp_path / "a-images"
    _boot(a_dir)
    digests = [_content(a_dir, tag) for tag in (tags or ("one",))]
    return ImageBlobs(store, a_dir, tmp_path / "a-state", records, resync_s=resync_s), digests


class HeldPuts(LocalBlobStore):
    """The local backend, able to hold back the upload of a rootfs."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.hold: threading.Event | None = None
        self.entered = threading.Event()

    def put(self, key: str, path: Path, *, progress: Progress | None = None) -> BlobInfo:
        if key.endswith("rootfs.ext4") and self.hold is not None:
            self.entered.set()
            self.hold.wait(30)
        return super().put(key, path, progress=progress)


def _fetchable(
    tmp_path: Path, store: LocalBlobStore, records: ImageUploadStore, digest: str
) -> None:
    """Another host fetches ``digest`` complete and verified."""
    other = ImageBlobs(store, tmp_path / f"other-{time.monotonic_ns()}", tmp_path / "o", records)
    asyncio.run(other.ensure(digest, "image 'app'", boot=True))
    assert find_content(other.images_dir, digest) is not None


def test_a_deletion_waits_for_the_upload_under_way_and_keeps_an_image_named_again(
    tmp_path: Path, records: ImageUploadStore
) -> None:
    """The last image naming a digest is deleted while the digest's upload (of a new
    import of it) runs: the deletion waits for it, sees the digest named again and
    removes nothing."""
    store = HeldPuts(tmp_path / "blobs")
    a, [digest] = _host(tmp_path, store, records)
    named = {"uses": 1}

    async def run() -> bool:
        a.start(lambda: [])
        store.hold = threading.Event()
        a.schedule(digest)
        await asyncio.to_thread(store.entered.wait, 30)
        deleting = asyncio.create_task(a.delete_unused(digest, lambda: named["uses"] == 0))
        await asyncio.sleep(0.05)
        assert not deleting.done(), "the deletion waits for the upload of the digest"
        store.hold.set()
        await a.wait_uploaded(digest)
        removed = await deleting
        await a.close()
        return removed

    assert asyncio.run(run()) is False
    assert a.uploaded(digest)
    _fetchable(tmp_path, store, records, digest)


def test_an_import_recorded_while_the_blobs_go_is_uploaded_again_whole(
    tmp_path: Path, records: ImageUploadStore
) -> None:
    """The digest is unused when its deletion begins and named again (an import on
    this host) before it ends: the import's upload, waiting for the deletion, sends
    everything again, and another host can fetch it."""
    store = LocalBlobStore(tmp_path / "blobs")
    a, [digest] = _host(tmp_path, store, records)
    assert a.upload(digest) is not None
    answers = iter([True])  # unused at the check under the guard; named again after

    def unused() -> bool:
        first = next(answers, False)
        if first:
            a.schedule(digest)  # the import records (and schedules) meanwhile
        return first

    async def run() -> bool:
        a.start(lambda: [])
        removed = await a.delete_unused(digest, unused)
        await asyncio.sleep(0)
        await a.wait_uploaded(digest)
        await a.close()
        return removed

    assert asyncio.run(run()) is True
    assert a.uploaded(digest)
    _fetchable(tmp_path, store, records, digest)


def test_an_upload_undone_elsewhere_is_made_again_by_the_periodic_resync(
    tmp_path: Path, records: ImageUploadStore
) -> None:
    """Another host removed the digest's blobs (its last image went there) while an
    import here named it: this daemon's resync finds the upload incomplete and sends
    it again, without a restart; complete uploads are left alone."""
    store = LocalBlobStore(tmp_path / "blobs")
    a, [gone, kept] = _host(tmp_path, store, records, "gone", "kept", resync_s=0.05)
    for digest in (gone, kept):
        assert a.upload(digest) is not None
    ImageBlobs(store, tmp_path / "b-images", tmp_path / "b-state", records).delete(gone)
    assert not a.uploaded(gone)
    seen: list[str] = []
    a.on_uploaded = lambda _type, data: seen.append(data["digest"])

    async def run() -> None:
        a.start(lambda: [gone, kept])  # (start schedules both; the resync finds none left)
        for _ in range(200):
            await asyncio.sleep(0.02)
            if a.uploaded(gone) and not a.uploads.running(gone):
                break
        assert await a.resync([gone, kept]) == []
        await a.close()

    asyncio.run(run())
    assert a.uploaded(gone) and seen == [gone]
    _fetchable(tmp_path, store, records, gone)


def test_the_resync_schedules_only_incomplete_uploads_of_content_here(
    tmp_path: Path, records: ImageUploadStore
) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    a, [done, undone] = _host(tmp_path, store, records, "done", "undone", resync_s=3600)
    assert a.upload(done) is not None
    elsewhere = "sha256:" + "ee" * 32

    async def run() -> list[str]:
        a.start(lambda: [])
        scheduled = await a.resync([done, undone, elsewhere])
        await a.wait_uploaded(undone)
        await a.close()
        return scheduled

    assert asyncio.run(run()) == [undone]
    assert a.uploaded(undone)
