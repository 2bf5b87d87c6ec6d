"""Templates through the blob store, without a VM (``tests/component/template_kit.py``
makes a template the way a build leaves one): host A uploads it, host B (its own state
directory, the same images directory, the same database) fetches it instead of booting.
Real parts: the local blob store and SeaweedFS (``tests/s3server.py``), the database as
SQLite and PostgreSQL (``db_target``), qemu-img, the real ``QemuTemplates`` (key, find,
install, seal). The real VMs: ``tests/e2e/test_template_sharing.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hutch.crashpoints import ENV
from hutch.errors import Conflict
from hutch.images.build import ImageArtifacts
from hutch.models import NetworkMode, SandboxRecord, SandboxState, Shape
from hutch.runtime.qemu.backend import QemuBackend
from hutch.runtime.qemu.host import SandboxPaths, read_config, write_config
from hutch.services.blob_dirs import INDEX
from hutch.services.template_blobs import TemplateBlobs, template_prefix
from hutch.services.templates import TemplateService
from hutch.storage.blobs import BlobInfo, BlobStore, LocalBlobStore, Progress
from hutch.storage.blobs.s3 import S3BlobStore, S3Options
from hutch.store.db import Store
from hutch.store.image_uploads import ImageUploadStore
from hutch.vm.snapshot import create_clone_disk, verify_snapshot
from hutch.vm.snapshot_dir import load_manifest
from hutch.vm.snapshot_manifest import MEMORY_FILE
from tests.component.frozen_kit import qemu_tool
from tests.component.template_kit import SHAPE, ZEROS_AT, host, make_image, make_template
from tests.component.test_blob_store_reach import closed_port
from tests.s3server import BUCKET, S3Server, s3_server

__all__ = ["s3_server"]

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class Lab:
    root: Path
    images: Path
    image: ImageArtifacts
    store: BlobStore
    database: Path | str
    records: ImageUploadStore
    a: QemuBackend
    b: QemuBackend
    blobs_a: TemplateBlobs
    blobs_b: TemplateBlobs

    def prefix(self) -> str:
        info = self.a.templates.describe(self.image, SHAPE)
        assert info.content is not None
        return template_prefix(info.content, info.key)

    def uploaded(self) -> str:
        """A's template made and uploaded; its prefix."""
        make_template(self.a, self.image)
        assert self.blobs_a.upload(self.a.templates.describe(self.image, SHAPE))
        return self.prefix()

    def leftovers(self) -> list[str]:
        root = self.b.layout.templates_root
        return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def blobs_of(backend: QemuBackend, store: BlobStore, records: ImageUploadStore) -> TemplateBlobs:
    return TemplateBlobs(
        backend.templates, store, records, backend.settings, retry_s=(0.05,), fetch_retry_s=0.0
    )


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    if request.param == "local":
        return LocalBlobStore(tmp_path / "bucket")
    server: S3Server = request.getfixturevalue("s3_server")
    return server.blob_store(tmp_path / "journal", prefix=f"tpl-{tmp_path.name}")


def _lab(tmp_path: Path, store: BlobStore, database: Path | str) -> Iterator[Lab]:
    images = tmp_path / "images"
    image = make_image(images)
    records = ImageUploadStore(Store(database))
    a, b = host(tmp_path, images, "a"), host(tmp_path, images, "b")
    yield Lab(tmp_path, images, image, store, database, records, a, b,
              blobs_of(a, store, records), blobs_of(b, store, records))  # fmt: skip
    a.close()
    b.close()


@pytest.fixture
def lab(tmp_path: Path, store: BlobStore, db_target: Path | str) -> Iterator[Lab]:
    """Every store on every database."""
    yield from _lab(tmp_path, store, db_target)


@pytest.fixture
def local_lab(tmp_path: Path) -> Iterator[Lab]:
    """The local store on SQLite (for what no store or database changes)."""
    yield from _lab(tmp_path, LocalBlobStore(tmp_path / "bucket"), tmp_path / "hutch.db")


def _blob(store: BlobStore, key: str, tmp: Path) -> bytes:
    found = store.stat(key)
    assert found is not None, key
    out = tmp / f"blob-{hashlib.sha256(key.encode()).hexdigest()[:8]}"
    out.unlink(missing_ok=True)
    store.get(key, out, expect=BlobInfo(key, found.size))
    return out.read_bytes()


def _put(store: BlobStore, key: str, data: bytes, tmp: Path) -> None:
    src = tmp / "put-src"
    src.write_bytes(data)
    store.put(key, src)


# -- upload and fetch ------------------------------------------------------------------------


async def test_a_template_built_on_one_host_is_fetched_by_another(lab: Lab) -> None:
    tpl_a = make_template(lab.a, lab.image)
    info = lab.a.templates.describe(lab.image, SHAPE)
    sent = lab.blobs_a.upload(info)
    prefix = lab.prefix()
    memory_size = (tpl_a / MEMORY_FILE).stat().st_size
    # The memory goes as its non-zero pages only: 2 x 256 KiB of 128 MiB.
    keys = {b.key.removeprefix(prefix): b.size for b in lab.store.list_prefix(prefix)}
    assert MEMORY_FILE not in keys and keys[MEMORY_FILE + ".data"] == 512 << 10
    assert sent is not None and sent < memory_size // 10
    assert {"index.json", "state.mig", "disk.qcow2", "manifest.json", "vm.json",
            "template.json", "frozen"} <= set(keys)  # fmt: skip
    record = lab.records.get(prefix)
    assert record is not None and record.meta["host"] == "a"
    index = _blob(lab.store, prefix + INDEX, lab.root)
    assert record.meta["index_sha256"] == hashlib.sha256(index).hexdigest()
    assert lab.records.claimant(prefix) is None  # released once complete
    assert lab.blobs_a.upload(info) is None  # complete: nothing sent again

    assert lab.b.templates.find(lab.image, SHAPE) is None
    got = await lab.blobs_b.fetch(lab.image, SHAPE)
    assert got is not None and got == lab.b.templates.find(lab.image, SHAPE)
    assert got.is_relative_to(lab.b.settings.state_dir) and got.name == tpl_a.name
    assert [t.key for t in lab.b.templates.local()] == [info.key]
    # The same bytes, holes where A had holes or zeros, sealed with A's digest.
    assert (got / MEMORY_FILE).read_bytes() == (tpl_a / MEMORY_FILE).read_bytes()
    assert (got / MEMORY_FILE).stat().st_blocks * 512 <= (
        tpl_a / MEMORY_FILE
    ).stat().st_blocks * 512
    fd = os.open(got / MEMORY_FILE, os.O_RDONLY)
    try:
        assert os.lseek(fd, ZEROS_AT * MiB, os.SEEK_HOLE) == ZEROS_AT * MiB
    finally:
        os.close(fd)
    sealed_a, sealed_b = load_manifest(tpl_a).memory, load_manifest(got).memory
    assert sealed_a is not None and sealed_b is not None and sealed_b.digest == sealed_a.digest
    assert sealed_b.ctime_ns == (got / MEMORY_FILE).stat().st_ctime_ns
    qemu_tool("qemu-img", "compare", "-f", "qcow2", "-F", "qcow2",
              str(tpl_a / "disk.qcow2"), str(got / "disk.qcow2"))  # fmt: skip
    # Nothing of A's state directory is named on B; the files are B's.
    vm_json = (got / "vm.json").read_text()
    assert str(lab.a.settings.state_dir) not in vm_json
    cfg = read_config(got / "vm.json")
    assert (
        cfg is not None and cfg.memory_file == got / MEMORY_FILE and cfg.disk == got / "disk.qcow2"
    )
    assert str(lab.a.settings.state_dir) not in (got / "manifest.json").read_text()
    # A clone restores from it with every check a restore makes (before QEMU starts).
    p = SandboxPaths(state=lab.root / "clone", run=lab.root / "clone-run")
    p.state.mkdir()
    create_clone_disk(got, p.disk)
    clone_cfg = dataclasses.replace(
        lab.b.templates.vm_config(p, lab.image, SHAPE),
        memory_file=got / MEMORY_FILE,
        memory_shared=False,
    )
    verify_snapshot(got, clone_cfg, clone=True)
    assert lab.leftovers() == [got.name]


async def test_a_key_that_differs_is_never_fetched(lab: Lab, tmp_path: Path) -> None:
    prefix = lab.uploaded()
    # Other bytes under the same image name and digest, another shape, RAM in the
    # stream: each is another key, whose upload nobody recorded.
    other_images = tmp_path / "other-images"
    other = make_image(other_images, fill=b"rootfs B")
    c = host(tmp_path, other_images, "c")
    try:
        blobs_c = blobs_of(c, lab.store, lab.records)
        assert await blobs_c.fetch(other, SHAPE) is None
        assert (
            c.templates.describe(other, SHAPE).key != lab.a.templates.describe(lab.image, SHAPE).key
        )
    finally:
        c.close()
    assert await lab.blobs_b.fetch(lab.image, Shape(vcpus=1, memory_mib=256, disk_gib=1)) is None
    d = host(tmp_path, lab.images, "d", template_ram_in_file=False)
    try:
        assert await blobs_of(d, lab.store, lab.records).fetch(lab.image, SHAPE) is None
    finally:
        d.close()
    # A's blobs copied under B's key of another shape, with a record: the index names
    # A's key as its owner, so it is refused before anything else is downloaded.
    shape = Shape(vcpus=2, memory_mib=128, disk_gib=1)
    info = lab.b.templates.describe(lab.image, shape)
    assert info.content is not None
    wrong = template_prefix(info.content, info.key)
    for blob in lab.store.list_prefix(prefix):
        _put(
            lab.store,
            wrong + blob.key.removeprefix(prefix),
            _blob(lab.store, blob.key, tmp_path),
            tmp_path,
        )
    record = lab.records.get(prefix)
    assert record is not None
    lab.records.put(wrong, record.files, record.meta)
    assert await lab.blobs_b.fetch(lab.image, shape) is None
    assert lab.b.templates.find(lab.image, shape) is None and lab.leftovers() == []


async def test_a_corrupt_blob_is_refused_and_leaves_nothing(
    lab: Lab, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prefix = lab.uploaded()
    key = prefix + MEMORY_FILE + ".data"
    good = _blob(lab.store, key, tmp_path)
    _put(lab.store, key, bytes(b ^ 0xFF for b in good[:4096]) + good[4096:], tmp_path)
    with caplog.at_level(logging.WARNING):
        assert await lab.blobs_b.fetch(lab.image, SHAPE) is None
    assert "corrupt" in caplog.text and "built here by a cold boot" in caplog.text
    assert lab.b.templates.find(lab.image, SHAPE) is None and lab.leftovers() == []
    _put(lab.store, key, good, tmp_path)  # repaired: the next fetch works
    assert await lab.blobs_b.fetch(lab.image, SHAPE) is not None


async def test_a_blob_swapped_together_with_its_index_is_refused(
    lab: Lab, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Whoever can write the bucket alone cannot make a host take other bytes: the
    index is checked against the uploader's record in the database."""
    prefix = lab.uploaded()
    key = prefix + "state.mig"
    other = os.urandom(len(_blob(lab.store, key, tmp_path)))
    _put(lab.store, key, other, tmp_path)
    index = json.loads(_blob(lab.store, prefix + INDEX, tmp_path))
    index["files"]["state.mig"]["sha256"] = hashlib.sha256(other).hexdigest()
    _put(lab.store, prefix + INDEX, json.dumps(index, indent=2, sort_keys=True).encode(), tmp_path)
    with caplog.at_level(logging.WARNING):
        assert await lab.blobs_b.fetch(lab.image, SHAPE) is None
    assert "is not the index its uploader recorded" in caplog.text
    assert lab.b.templates.find(lab.image, SHAPE) is None and lab.leftovers() == []


async def test_memory_that_is_not_what_its_host_sealed_is_refused(
    local_lab: Lab, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Even with the index and the record rewritten to match (an uploader's bug, or the
    database written too), the recreated memory.ram must hash to the digest sealed in
    the manifest: sealing it on B refuses it."""
    lab = local_lab
    prefix = lab.uploaded()
    key = prefix + MEMORY_FILE + ".data"
    other = os.urandom(len(_blob(lab.store, key, tmp_path)))
    _put(lab.store, key, other, tmp_path)
    index = json.loads(_blob(lab.store, prefix + INDEX, tmp_path))
    index["files"][MEMORY_FILE + ".data"]["sha256"] = hashlib.sha256(other).hexdigest()
    text = json.dumps(index, indent=2, sort_keys=True).encode()
    _put(lab.store, prefix + INDEX, text, tmp_path)
    record = lab.records.get(prefix)
    assert record is not None
    files = dict(record.files)
    files[MEMORY_FILE + ".data"] = dataclasses.replace(
        files[MEMORY_FILE + ".data"], sha256=hashlib.sha256(other).hexdigest()
    )
    lab.records.put(
        prefix, files, {**record.meta, "index_sha256": hashlib.sha256(text).hexdigest()}
    )
    with caplog.at_level(logging.WARNING):
        assert await lab.blobs_b.fetch(lab.image, SHAPE) is None
    assert "does not match its recorded checksum" in caplog.text
    assert lab.b.templates.find(lab.image, SHAPE) is None and lab.leftovers() == []


_CHILD = """
import asyncio, sys
from pathlib import Path
from hutch.services.template_blobs import TemplateBlobs
from hutch.storage.blobs import LocalBlobStore
from hutch.store.db import Store
from hutch.store.image_uploads import ImageUploadStore
from tests.component.template_kit import SHAPE, host, make_image

root = Path(sys.argv[1])
b = host(root, root / "images", "b")
blobs = TemplateBlobs(b.templates, LocalBlobStore(root / "bucket"),
                      ImageUploadStore(Store(root / "hutch.db")), b.settings)
print(asyncio.run(blobs.fetch(make_image(root / "images"), SHAPE)))
"""


@pytest.mark.parametrize("point", ["fetch.blob:1", "fetch.blob:4", "template.staged"])
async def test_a_fetch_killed_at_any_step_leaves_no_template(local_lab: Lab, point: str) -> None:
    lab = local_lab
    lab.uploaded()
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", _CHILD, str(lab.root)],
        env={**os.environ, ENV: point, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert done.returncode == -9, done.stderr[-2000:]
    # Killed mid-way: its staging directory is there, no template a clone could map.
    assert lab.b.templates.find(lab.image, SHAPE) is None
    assert [n for n in lab.leftovers() if not n.startswith(".fetch-")] == []
    assert any(n.startswith(".fetch-") for n in lab.leftovers())
    lab.b.templates.discard_unfinished()  # the next start
    assert lab.leftovers() == []
    assert await lab.blobs_b.fetch(lab.image, SHAPE) is not None


async def test_a_store_that_cannot_be_reached_leaves_the_create_a_cold_boot(
    local_lab: Lab, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lab = local_lab
    prefix = lab.uploaded()
    away = S3BlobStore(
        BUCKET,
        "p",
        tmp_path / "journal",
        S3Options(
            endpoint=f"http://127.0.0.1:{closed_port()}",
            region="us-east-1",
            connect_timeout_s=0.5,
            access_key="k",
            secret_key="s",
        ),
    )
    blobs = blobs_of(lab.b, away, lab.records)
    service = TemplateService(lab.b.templates, blobs, lab.images)
    with caplog.at_level(logging.WARNING):
        assert await service.for_create(lab.image, SHAPE) is None
    assert (
        "built here by a cold boot" in caplog.text and "cannot reach the S3 endpoint" in caplog.text
    )
    assert lab.records.get(prefix) is not None and lab.leftovers() == []


# -- claims, start, delete --------------------------------------------------------------------


def test_two_hosts_with_the_same_template_upload_it_once(lab: Lab) -> None:
    make_template(lab.a, lab.image)
    make_template(lab.b, lab.image)
    info_a = lab.a.templates.describe(lab.image, SHAPE)
    info_b = lab.b.templates.describe(lab.image, SHAPE)
    assert info_a.key == info_b.key
    prefix = lab.prefix()
    assert lab.records.claim(prefix, "a")  # A's upload under way
    with pytest.raises(Conflict, match="host a claimed its upload"):
        lab.blobs_b.upload(info_b)
    assert lab.store.list_prefix(prefix) == [] and lab.records.get(prefix) is None
    assert lab.blobs_a.upload(info_a)
    assert lab.blobs_b.upload(info_b) is None  # complete: B holds an equal template
    record = lab.records.get(prefix)
    assert record is not None and record.meta["host"] == "a"


async def test_start_uploads_the_templates_here_whose_upload_is_not_complete(
    local_lab: Lab,
) -> None:
    lab = local_lab
    make_template(lab.a, lab.image)
    stale = lab.blobs_a._scratch_root / "0123456789abcdef"
    stale.mkdir(parents=True)
    lab.blobs_a.start()
    assert lab.blobs_a._starter is not None
    await lab.blobs_a._starter
    info = lab.a.templates.describe(lab.image, SHAPE)
    await lab.blobs_a.wait_uploaded(info.key)
    assert lab.blobs_a.uploaded(info)
    assert not stale.exists() and not (lab.blobs_a._scratch_root / info.key[:16]).exists()
    await lab.blobs_a.close()


def test_a_retried_upload_sends_the_same_packed_memory(
    local_lab: Lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The packed extents stay between attempts (an S3 upload's journal then continues
    it); they go once the index is sent."""
    lab = local_lab
    make_template(lab.a, lab.image)
    info = lab.a.templates.describe(lab.image, SHAPE)
    store = lab.store
    seen: list[tuple[int, int]] = []
    real_put = store.put

    def failing_put(key: str, path: Path, *, progress: Progress | None = None) -> BlobInfo:
        if key.endswith(MEMORY_FILE + ".data"):
            st = path.stat()
            seen.append((st.st_ino, st.st_mtime_ns))
            if len(seen) == 1:
                raise OSError("the network went away")
        return real_put(key, path, progress=progress)

    monkeypatch.setattr(store, "put", failing_put)
    with pytest.raises(OSError):
        lab.blobs_a.upload(info)
    assert lab.blobs_a.upload(info)
    assert len(seen) == 2 and seen[0] == seen[1]
    assert list((lab.blobs_a._scratch_root).iterdir()) == []


async def test_deleting_an_images_last_row_removes_its_templates_from_the_store(lab: Lab) -> None:
    prefix = lab.uploaded()
    second = Shape(vcpus=2, memory_mib=128, disk_gib=1)
    make_template(lab.a, lab.image, second)
    assert lab.blobs_a.upload(lab.a.templates.describe(lab.image, second))
    other = make_image(lab.images, name="devbox")
    make_template(lab.a, other)
    other_info = lab.a.templates.describe(other, SHAPE)
    assert lab.blobs_a.upload(other_info) and other_info.content is not None
    content = prefix.split("/", 1)[1].rsplit("/", 2)[0]
    removed = await lab.blobs_b.delete_content(content)
    assert len(removed) == 2 and prefix in removed
    assert lab.store.list_prefix(f"templates/{content}/") == []
    assert lab.records.under(f"templates/{content}/") == []
    kept = template_prefix(other_info.content, other_info.key)
    assert lab.records.get(kept) is not None and lab.store.stat(kept + INDEX) is not None


async def test_a_sandbox_moved_here_maps_this_hosts_template_of_the_same_key(
    local_lab: Lab,
) -> None:
    """A pause from host A names A's template memory.ram; on B, which fetched that
    template, the resume maps B's copy (pages shared with B's other clones) instead of
    a private file; a template B lacks still gets a private file."""
    lab = local_lab
    lab.uploaded()
    tpl_a = lab.a.templates.find(lab.image, SHAPE)
    assert tpl_a is not None
    rec = SandboxRecord(
        id="sb-0123456789ab", image="base", state=SandboxState.PAUSED, shape=SHAPE,
        created_at=0.0, network=NetworkMode.NONE,
    )  # fmt: skip
    p = lab.b.paths(rec.id)
    p.state.mkdir(parents=True)

    def moved(memory: Path) -> Path | None:
        cfg = lab.a.templates.vm_config(lab.a.paths(rec.id), lab.image, SHAPE)
        write_config(p.vm_json, dataclasses.replace(cfg, memory_file=memory, memory_shared=False))
        lab.b.rehome(rec)
        got = read_config(p.vm_json)
        assert got is not None
        return got.memory_file

    assert moved(tpl_a / MEMORY_FILE) == p.state / MEMORY_FILE  # B has no such template
    fetched = await lab.blobs_b.fetch(lab.image, SHAPE)
    assert fetched is not None
    assert moved(tpl_a / MEMORY_FILE) == fetched / MEMORY_FILE
    other = tpl_a.parent / (tpl_a.name[:-16] + "0" * 16) / MEMORY_FILE
    assert moved(other) == p.state / MEMORY_FILE  # another key: not this template


async def test_an_image_whose_files_are_gone_has_no_template(local_lab: Lab) -> None:
    """Its key cannot be computed: no template is found or fetched, nothing raises
    (a create then reports the image's own error)."""
    lab = local_lab
    lab.uploaded()
    gone = dataclasses.replace(lab.image, rootfs=lab.root / "deleted" / "rootfs.ext4")
    assert lab.a.templates.find(gone, SHAPE) is None
    assert await lab.blobs_b.fetch(gone, SHAPE) is None
