"""Imported images in the blob cache (``services/blob_cache.py`` through
``SnapshotBlobs.evict``, the one budget): a copy whose upload is complete is evicted
least recently used first when over ``HUTCH_BLOB_CACHE_BYTES``, never while a live
sandbox row, a snapshot row, a template, a build cache, a create or an import/fetch may
read it, never when its upload is not complete; the image stays listed and its next use
fetches and verifies it again. Over a real S3 server (tests/s3server.py), a real SQLite
database and real directories; the registry is a stand-in exposing the real store and
the real template lookup (``QemuTemplates.of_image``)."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from hutch.errors import BlobError
from hutch.images.cache import file_lock
from hutch.images.oci.importer import content_dir, load_content
from hutch.models import SandboxRecord, SandboxState, Shape, SnapshotRecord
from hutch.runtime.qemu.templates import QemuTemplates
from hutch.services.blob_cache import ImageCache
from hutch.services.image_blobs import ImageBlobs, image_prefix
from hutch.services.images import HostImages, LocalImages, resolve
from hutch.services.registry import SandboxRegistry
from hutch.services.snapshot_blobs import SnapshotBlobs
from hutch.store.db import Store
from hutch.store.image_uploads import ImageUploadStore
from hutch.store.images import ImageRow, ImageStore
from tests.s3server import S3Server, s3_server
from tests.unit.test_image_blobs import _Boot, _boot, _content

__all__ = ["s3_server"]


@dataclass
class Host:
    images_dir: Path
    db: Store
    rows: ImageStore
    blobs: ImageBlobs
    images: HostImages
    cache: SnapshotBlobs
    templates_root: Path
    old: str  # the least recently used image's digest (named "old")
    new: str  # "new"

    def copy(self, digest: str) -> Path:
        return content_dir(self.images_dir, digest)

    def evict(self, budget: int) -> list[str]:
        self.cache.cache_bytes = budget
        return asyncio.run(self.cache.evict())

    def leftovers(self) -> list[str]:
        return sorted(p.name for p in (self.images_dir / "oci").iterdir() if ".evict-" in p.name)


def _size(d: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in d.rglob("*") if f.is_file())


def _collect(evict: str) -> bool:
    """Collection's answer for a snapshot copy no sandbox uses: removed."""
    shutil.rmtree(evict)
    return True


@pytest.fixture
def host(tmp_path: Path, s3_server: S3Server) -> Host:
    images_dir = tmp_path / "images"
    _boot(images_dir)
    old, new = _content(images_dir, "old"), _content(images_dir, "new")
    db = Store(tmp_path / "hutch.db")
    rows = ImageStore(db)
    store = s3_server.blob_store(tmp_path / "journal", prefix="c" + secrets.token_hex(4))
    blobs = ImageBlobs(store, images_dir, tmp_path / "state", ImageUploadStore(db))
    for name, digest in (("old", old), ("new", new)):
        rows.insert(ImageRow(name, digest, {"type": "archive"}, {}, False, 4 << 20, 1.0))
        assert blobs.upload(digest) is not None
    os.utime(content_dir(images_dir, old), (1000, 1000))
    os.utime(content_dir(images_dir, new), (2000, 2000))
    images = HostImages(LocalImages(images_dir), rows, images_dir, _Boot(images_dir), blobs)
    templates_root = tmp_path / "templates"
    layout = SimpleNamespace(templates_root=templates_root)  # all that of_image reads
    core = SimpleNamespace(
        store=db,
        settings=SimpleNamespace(state_dir=tmp_path / "state"),
        collect_snapshots=_collect,
        backend=SimpleNamespace(
            fork_dir=lambda sid: tmp_path / "snapshots" / sid,
            snapshots=SimpleNamespace(
                complete=lambda d: (d / "manifest.json").is_file(), size=_size
            ),
            templates=QemuTemplates(cast(Any, layout), cast(Any, None)),
        ),
    )
    registry = cast(SandboxRegistry, cast(Any, core))
    cache = SnapshotBlobs(registry, store, 1)
    cache.images = ImageCache(registry, images)
    return Host(images_dir, db, rows, blobs, images, cache, templates_root, old, new)


def test_the_least_recently_used_image_over_the_budget_is_evicted_and_stays_listed(
    host: Host,
) -> None:
    budget = _size(host.copy(host.new))  # room for one of the two
    assert host.evict(budget) == [host.old]
    assert not host.copy(host.old).exists() and load_content(host.copy(host.new)) is not None
    assert host.leftovers() == []
    # The row is untouched: listed, not built here, its upload still recorded.
    assert host.rows.get("old", "default") is not None
    views = {v.name: v for v in host.images.list("default")}
    assert views["old"].built is False and views["new"].built is True
    assert host.blobs.uploaded(host.old)
    assert host.evict(budget) == []  # under the budget now


def test_a_use_renews_the_order(host: Host) -> None:
    asyncio.run(host.images.ensure_local("old", "default"))  # found here: touched
    assert host.evict(_size(host.copy(host.old))) == [host.new]


def _live_sandbox(state: SandboxState) -> Callable[[Host], AbstractContextManager[None]]:
    @contextmanager
    def use(h: Host) -> Iterator[None]:
        rec = SandboxRecord("sb-" + secrets.token_hex(6), "old", state, Shape(), 1.0)
        h.db.insert_sandbox(rec)
        yield

    return use


def _snapshot(ready: bool) -> Callable[[Host], AbstractContextManager[None]]:
    @contextmanager
    def use(h: Host) -> Iterator[None]:
        snap = SnapshotRecord(
            "snap-" + secrets.token_hex(6), "s", "sb-gone", "old", Shape(), "/nowhere", 1, 1.0
        )
        h.db.insert_snapshot(snap, ready=ready)
        yield

    return use


@contextmanager
def _template(h: Host) -> Iterator[None]:
    (h.templates_root / ("old-" + "0" * 16 + "-1c-256m-4g-n1")).mkdir(parents=True)
    yield


@contextmanager
def _template_build(h: Host) -> Iterator[None]:
    (h.templates_root / ("old-" + "0" * 16 + "-1c-256m-4g-n1.build")).mkdir(parents=True)
    yield


@contextmanager
def _build_cache(h: Host) -> Iterator[None]:
    (h.copy(h.old) / "refs" / "hutchd-1-build-cache").touch()
    yield


@contextmanager
def _create(h: Host) -> Iterator[None]:
    with h.images.using("old", "default"):  # a create between its fetch and its row
        yield


@contextmanager
def _import(h: Host) -> Iterator[None]:
    d = h.copy(h.old)
    with file_lock(d.parent / f"{d.name}.lock"):  # an import or a fetch in a daemon
        yield


@contextmanager
def _other_daemon_create(h: Host) -> Iterator[None]:
    """Another daemon's create holds the shared ``.use`` lock (its own open file)."""
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with h.images.using("old", "default"):
            held.set()
            done.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(30)
    try:
        yield
    finally:
        done.set()
        t.join()


USERS: dict[str, Callable[[Host], AbstractContextManager[None]]] = {
    "running sandbox": _live_sandbox(SandboxState.RUNNING),
    "creating sandbox": _live_sandbox(SandboxState.CREATING),
    "paused sandbox": _live_sandbox(SandboxState.PAUSED),
    "snapshot": _snapshot(True),
    "snapshot being saved": _snapshot(False),
    "template": _template,
    "template build": _template_build,
    "build cache": _build_cache,
    "create": _create,
    "create in another thread": _other_daemon_create,
    "import or fetch": _import,
}


@pytest.mark.parametrize("user", sorted(USERS))
def test_an_image_something_may_read_is_kept(host: Host, user: str) -> None:
    with USERS[user](host):
        # Over any budget: only "new" (nothing uses it) may go.
        assert host.evict(1) == [host.new]
        assert load_content(host.copy(host.old)) is not None
    assert host.leftovers() == []


@pytest.mark.parametrize("state", [SandboxState.DESTROYED, SandboxState.FAILED])
def test_an_ended_sandbox_keeps_nothing(host: Host, state: SandboxState) -> None:
    with _live_sandbox(state)(host):
        assert sorted(host.evict(1)) == sorted([host.old, host.new])


def test_an_evicted_image_is_fetched_again_and_verified_on_next_use(host: Host) -> None:
    rootfs_key = image_prefix(f"oci/{host.copy(host.old).name}") + "rootfs.ext4"
    good = host.images_dir.parent / "good"
    shutil.copyfile(host.copy(host.old) / "rootfs.ext4", good)  # what was uploaded
    assert host.evict(1) == [host.old, host.new]
    with pytest.raises(Exception, match="its files are missing on this host"):
        resolve(host.images, "old", "default")
    # A blob swapped in the bucket meanwhile is refused: the fetch verifies.
    assert host.blobs.store is not None
    swapped = host.images_dir.parent / "swapped"
    swapped.write_bytes(b"not the rootfs")
    host.blobs.store.put(rootfs_key, swapped)
    with pytest.raises(BlobError, match="image 'old'"):
        asyncio.run(host.images.ensure_local("old", "default"))
    assert not host.copy(host.old).exists()
    host.blobs.store.put(rootfs_key, good)
    cached: list[bool] = []
    host.blobs.on_cached = lambda: cached.append(True)  # the daemon: evict_soon
    asyncio.run(host.images.ensure_local("old", "default"))
    assert cached == [True]
    asyncio.run(host.images.ensure_local("old", "default"))  # here now: no fetch
    assert cached == [True]
    image = resolve(host.images, "old", "default")
    assert image.rootfs == host.copy(host.old) / "rootfs.ext4"
    assert image.rootfs.read_bytes().startswith(b"ext4-headold")
    # Fetched now: the most recently used copy.
    assert host.copy(host.old).stat().st_mtime > 2000


def test_a_copy_whose_upload_is_not_complete_is_never_evicted(host: Host) -> None:
    local = _content(host.images_dir, "local")
    host.rows.insert(ImageRow("local", local, {"type": "archive"}, {}, False, 4 << 20, 1.0))
    os.utime(host.copy(local), (1, 1))  # the least recently used of all
    assert sorted(host.evict(1)) == sorted([host.old, host.new])
    assert load_content(host.copy(local)) is not None
    # Uploaded now: it may go like the others.
    assert host.blobs.upload(local) is not None
    assert host.evict(1) == [local]


def test_images_and_snapshots_share_one_budget_and_one_order(host: Host, tmp_path: Path) -> None:
    """A snapshot copy used between the two images goes between them."""
    d = tmp_path / "snapshots" / "snap-00000000000a"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text("{}")
    (d / "state.mig").write_bytes(b"x" * 5000)
    (d / "frozen").write_text("")
    os.utime(d / "frozen", (1500, 1500))
    host.db.insert_snapshot(
        SnapshotRecord("snap-00000000000a", "s", "sb-1", "base", Shape(), str(d), 1, 1.0)
    )
    index = tmp_path / "index.json"
    index.write_text("{}")
    assert host.blobs.store is not None
    host.blobs.store.put("snapshots/snap-00000000000a/index.json", index)  # uploaded
    budget = _size(host.copy(host.new))
    assert host.evict(budget) == [host.old, "snap-00000000000a"]
    assert load_content(host.copy(host.new)) is not None
