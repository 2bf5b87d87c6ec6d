"""Built-in images through the blob store (``services/builtin_blobs.py``): two hosts
whose ``base`` of one digest holds other rootfs bytes end with one content, a copy in
use is kept until it is free, a kill at any step of an adoption leaves a complete
directory, a digest a host lacks is fetched under a frozen state that needs it, and a
bucket object swapped or truncated is refused with nothing kept.

Real parts: the bucket is a local directory (``file://``) and the suite's SeaweedFS
(``tests/s3server.py``); the hosts' one database a real SQLite file and the suite's
PostgreSQL (``db_target``); qcow2 chains made by qemu-img. No VM: a host is an images
directory, a state directory and a :class:`BuiltinBlobs`. Frozen directories record
their base by absolute path, as on machines whose images directory is at one path:
the two hosts' directories take turns at one path there (``Machines``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from hutch.config import Settings
from hutch.crashpoints import ENV
from hutch.errors import BlobError, Conflict, ImageMismatch, ImageMissing
from hutch.images import identity
from hutch.images.build import find_image, image_at
from hutch.models import SandboxRecord, SandboxState, Shape, SnapshotRecord
from hutch.services.blob_dirs import fetch_dir, upload_dir
from hutch.services.builtin_blobs import BuiltinBlobs, builtin_prefix, uploaded_identity
from hutch.services.builtin_users import HostBuiltinUsers
from hutch.services.image_blobs import ImageBlobs
from hutch.services.image_compat import compatible_image, frozen_identity
from hutch.services.images import HostImages, LocalBootSets, LocalImages
from hutch.services.pool import WarmPool
from hutch.services.registry import SandboxRegistry
from hutch.storage.blobs import BlobStore, LocalBlobStore
from hutch.store.db import Store
from hutch.store.hosts import HostRow, HostStore, place_in
from hutch.store.image_uploads import ImageUploadStore
from hutch.store.images import ImageStore
from tests.component.builtin_kit import DIGEST, built, differing_copy, files_of
from tests.component.frozen_kit import qemu_tool
from tests.component.test_image_identity_hosts import Machines, _frozen
from tests.s3server import BUCKET, S3Server, s3_server

__all__ = ["s3_server"]

REPO = Path(__file__).resolve().parents[2]
OTHER = "fedcba9876543210"


@dataclass
class Bucket:
    """One store both hosts use, and how a child process opens it."""

    store: BlobStore
    env: dict[str, str]


@pytest.fixture(params=["local", "seaweedfs"])
def bucket(request: pytest.FixtureRequest, tmp_path: Path) -> Bucket:
    if request.param == "local":
        root = tmp_path / "bucket"
        return Bucket(LocalBlobStore(root), {"HUTCH_BLOB_URL": f"file://{root}"})
    server: S3Server = request.getfixturevalue("s3_server")
    prefix = f"bi-{tmp_path.name}"
    store = server.blob_store(tmp_path / "journal", prefix=prefix)
    return Bucket(store, {**server.env(prefix), "HUTCH_BLOB_URL": f"s3://{BUCKET}/{prefix}"})


@pytest.fixture
def db(db_target: Path | str) -> Store:
    """The hosts' one database (an SQLite file, then PostgreSQL), both hosts registered."""
    store = Store(db_target)
    for host in ("a", "b"):
        HostStore(store).register(
            HostRow(host, f"127.0.0.1:{host}", "worker", "up", 2, 1024, 10, 10, "tcg", "8", "x")
        )
    return store


def _host(name: str, images: Path, tmp: Path, bucket: Bucket, db: Store) -> BuiltinBlobs:
    return BuiltinBlobs(
        bucket.store,
        ImageUploadStore(db),
        images,
        tmp / f"{name}-state",
        host=name,
        hosts=HostStore(db),
        retry_s=(0.05,),
    )


def _uploaded_by_a(images: Path, tmp: Path, bucket: Bucket, db: Store) -> Path:
    """Host A's build of ``base`` in ``images``, its upload complete (the first: it wins)."""
    a_dir = built(images, b"A-build ")
    asyncio.run(_host("a", images, tmp, bucket, db)._attempt(f"base/{DIGEST}"))
    return a_dir


def _sha(d: Path) -> str:
    return identity.identity(d / "rootfs.ext4")


def _leftovers(images: Path) -> list[str]:
    return sorted(p.name for p in (images / "base").glob(".*"))


def _open_on(host: BuiltinBlobs, tmp: Path, prefix: str = "snapshots/s/") -> Path:
    """Fetch the frozen directory under ``prefix`` on ``host`` (as a create from a
    snapshot, a resume or a fork child does), with its built-in base images."""
    staging = tmp / "b-state" / "blob-fetch" / "x"
    staging.mkdir(parents=True, exist_ok=True)
    final = tmp / "b-state" / "snapshots" / "snap-0123456789ab"
    fetch_dir(
        host.store, prefix, staging, final, owner="s", images_dir=host.images_dir,
        image="base", images=host,
    )  # fmt: skip
    final.parent.mkdir(parents=True, exist_ok=True)
    os.rename(staging, final)
    return final


# -- two hosts, one digest --------------------------------------------------------------------


def test_two_hosts_converge_on_one_content_and_a_frozen_dir_moves(
    tmp_path: Path, bucket: Bucket, db: Store
) -> None:
    hosts = Machines(tmp_path)
    images = hosts.be("a")
    a_dir = built(images, b"A-build ")
    a = _host("a", images, tmp_path, bucket, db)
    a_files, a_sha = files_of(a_dir), _sha(a_dir)
    prefix = builtin_prefix("base", DIGEST)
    records = ImageUploadStore(db)
    assert records.claim(prefix, "a")  # A's upload under way: B must wait for it

    images = hosts.be("b")
    b_dir = differing_copy(hosts.parked["a"] / "base" / DIGEST, images, b"B-build ")
    b = _host("b", images, tmp_path, bucket, db)
    b_sha = _sha(b_dir)
    assert b_sha != a_sha and files_of(b_dir)["manifest.json"] != a_files["manifest.json"]
    with pytest.raises(Conflict, match="host a claimed its upload"):
        asyncio.run(b._attempt(f"base/{DIGEST}"))
    assert records.get(prefix) is None and bucket.store.stat(prefix + "index.json") is None

    hosts.be("a")
    asyncio.run(a._attempt(f"base/{DIGEST}"))  # the first complete upload: it wins
    assert records.claimant(prefix) is None
    assert uploaded_identity(records, "base", DIGEST) == a_sha
    snap = _frozen(tmp_path / "a-state", a_dir / "rootfs.ext4")
    upload_dir(bucket.store, "snapshots/s/", snap, owner="s", scratch=tmp_path)
    a.publish()

    images = hosts.be("b")
    b.publish()
    b_row = HostStore(db).get("b")
    a_row = HostStore(db).get("a")
    assert a_row is not None and b_row is not None
    assert b_row.images == {"base": {DIGEST: b_sha}}
    sha = frozen_identity(a_row, "base", DIGEST)
    assert sha == a_sha
    assert not compatible_image(b_row, "base", DIGEST, sha, uploaded=a_sha)
    # Before B converges, the frozen state is refused over B's bytes, with the advice.
    with pytest.raises(ImageMismatch, match="uploaded first to the blob store"):
        _open_on(b, tmp_path)

    assert asyncio.run(b.converge("base", DIGEST))
    assert files_of(b_dir) == a_files  # the very directory A uploaded
    assert identity.known(b_dir / "rootfs.ext4") == identity.compute(b_dir / "rootfs.ext4")
    assert find_image("base", images) is not None and _leftovers(images) == []
    assert not asyncio.run(b.converge("base", DIGEST))  # nothing more to do
    b_row = HostStore(db).get("b")
    assert b_row is not None and b_row.images == {"base": {DIGEST: a_sha}}
    assert compatible_image(b_row, "base", DIGEST, sha, uploaded=a_sha)
    final = _open_on(b, tmp_path)
    qemu_tool("qemu-img", "compare", "-f", "qcow2", "-F", "qcow2",
         str(snap / "disk.qcow2"), str(final / "disk.qcow2"))  # fmt: skip


def test_a_daemon_start_uploads_then_the_other_converges_before_anything_else(
    tmp_path: Path, bucket: Bucket, db: Store
) -> None:
    """``start`` (what the daemon runs before its pool): A uploads in the background,
    B's start finds the complete upload and replaces its copy at once."""
    a_dir = built(tmp_path / "a-images", b"A-build ")
    b_dir = differing_copy(a_dir, tmp_path / "b-images", b"B-build ")
    a = _host("a", tmp_path / "a-images", tmp_path, bucket, db)
    b = _host("b", tmp_path / "b-images", tmp_path, bucket, db)

    async def run() -> None:
        await a.start()
        await a.wait_uploaded("base", DIGEST)
        await b.start()
        await a.close()
        await b.close()

    asyncio.run(run())
    assert files_of(b_dir) == files_of(a_dir)
    rows = {h.id: h.images for h in HostStore(db).all()}
    assert rows["a"] == rows["b"] == {"base": {DIGEST: _sha(a_dir)}}


# -- a copy in use -------------------------------------------------------------------------------


@dataclass
class FakePool:
    held: list[tuple[str, str]] = field(default_factory=list)

    @contextlib.asynccontextmanager
    async def held_off(self, name: str, digest: str) -> AsyncIterator[None]:
        self.held.append((name, digest))
        yield


@dataclass
class FakeTemplates:
    retired: list[tuple[str, str]] = field(default_factory=list)

    def retire(self, name: str, digest: str) -> list[str]:
        self.retired.append((name, digest))
        return [f"{name}-{digest}-1c-128m-1g-n1"]


def _users(state: Path, images: Path, db: Store, host: str) -> tuple[HostBuiltinUsers, Any]:
    """This host's users as the daemon sees them: its sandboxes' and frozen dirs' disk
    chains in ``state`` (the QEMU backend's layout), its rows in ``db``."""
    templates = FakeTemplates()
    backend = SimpleNamespace(
        disk_path=lambda i: state / "sandboxes" / i / "disk.qcow2",
        fork_dir=lambda i: state / "snapshots" / i,
        templates=templates,
    )
    settings = Settings(state_dir=state, images_dir_override=images)
    core = SimpleNamespace(settings=settings, backend=backend, store=db, host_id=host)
    pool = FakePool()
    users = HostBuiltinUsers(
        cast(SandboxRegistry, core), cast(WarmPool, pool), frozen_base=lambda _i: None
    )
    return users, SimpleNamespace(pool=pool, templates=templates)


def _overlay(disk: Path, base: Path) -> None:
    disk.parent.mkdir(parents=True, exist_ok=True)
    qemu_tool("qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(base), str(disk))


def test_a_copy_in_use_here_is_kept_and_replaced_once_nothing_uses_it(
    tmp_path: Path, bucket: Bucket, db: Store, caplog: pytest.LogCaptureFixture
) -> None:
    a_dir = _uploaded_by_a(tmp_path / "a-images", tmp_path, bucket, db)
    b_images = tmp_path / "b-images"
    b_dir = differing_copy(a_dir, b_images, b"B-build ")
    b_bytes = files_of(b_dir)
    b = _host("b", b_images, tmp_path, bucket, db)
    state = tmp_path / "b-state"
    b.users, seen = _users(state, b_images, db, "b")
    rootfs = b_dir / "rootfs.ext4"

    _overlay(state / "sandboxes" / "sb-000000000001" / "disk.qcow2", rootfs)
    _overlay(state / "snapshots" / "fork-000000000001" / "disk.qcow2", rootfs)
    with caplog.at_level(logging.INFO, "hutch.services.builtin_blobs"):
        assert not asyncio.run(b.converge("base", DIGEST))
        assert not asyncio.run(b.converge("base", DIGEST))
    kept = [r.getMessage() for r in caplog.records if "kept while" in r.getMessage()]
    assert len(kept) == 1 and "sandbox sb-000000000001" in kept[0]  # logged once
    assert files_of(b_dir) == b_bytes and seen.pool.held == [] and seen.templates.retired == []

    os.remove(state / "sandboxes" / "sb-000000000001" / "disk.qcow2")
    with caplog.at_level(logging.INFO, "hutch.services.builtin_blobs"):
        assert not asyncio.run(b.converge("base", DIGEST))
    assert "frozen fork or snapshot fork-000000000001" in caplog.records[-1].getMessage()
    # A chain onto another image is no user of this one.
    os.remove(state / "snapshots" / "fork-000000000001" / "disk.qcow2")
    elsewhere = built(tmp_path / "c-images", b"C ", digest=OTHER) / "rootfs.ext4"
    _overlay(state / "sandboxes" / "sb-000000000002" / "disk.qcow2", elsewhere)

    assert asyncio.run(b.converge("base", DIGEST))
    assert files_of(b_dir) == files_of(a_dir)
    assert seen.pool.held == [("base", DIGEST)] and seen.templates.retired == [("base", DIGEST)]
    assert _leftovers(b_images) == []


def test_a_snapshot_of_this_host_frozen_over_the_copy_keeps_it_even_when_evicted(
    tmp_path: Path, bucket: Bucket, db: Store
) -> None:
    """Its files went (the blob cache); its upload says it was frozen over this copy's
    bytes: replacing them would leave it nowhere to open."""
    a_dir = _uploaded_by_a(tmp_path / "a-images", tmp_path, bucket, db)
    b_images = tmp_path / "b-images"
    b_dir = differing_copy(a_dir, b_images, b"B-build ")
    b = _host("b", b_images, tmp_path, bucket, db)
    users, _seen = _users(tmp_path / "b-state", b_images, db, "b")
    b.users = users
    db.insert_sandbox(SandboxRecord("sb-000000000003", "base", SandboxState.DESTROYED, Shape(), 1))
    with db.transaction() as tx:
        place_in(tx, "sb-000000000003", "b")
    db.insert_snapshot(
        SnapshotRecord("snap-00000000000a", "keep", "sb-000000000003", "base", Shape(),
                       "/gone", 1, 1.0), ready=True,
    )  # fmt: skip
    frozen = (str(b_dir / "rootfs.ext4"), _sha(b_dir))
    users.frozen_base = lambda _i: frozen
    assert not asyncio.run(b.converge("base", DIGEST))
    assert users.user("base", DIGEST) == "snapshot snap-00000000000a (in the blob store)"
    users.frozen_base = lambda _i: (frozen[0], _sha(a_dir))  # frozen over other bytes
    assert asyncio.run(b.converge("base", DIGEST))


def test_a_shared_images_directory_is_not_replaced(
    tmp_path: Path, bucket: Bucket, db: Store
) -> None:
    """Another hutchd on this machine uses the same directory: its sandboxes are not
    this daemon's to see, so the copy stays."""
    a_dir = _uploaded_by_a(tmp_path / "a-images", tmp_path, bucket, db)
    b_images = tmp_path / "b-images"
    b_dir = differing_copy(a_dir, b_images, b"B-build ")
    b = _host("b", b_images, tmp_path, bucket, db)
    other = _host("b2", b_images, tmp_path, bucket, db)
    other._open()  # started: holds the presence lock
    try:
        assert not asyncio.run(b.converge("base", DIGEST))
        assert files_of(b_dir)["rootfs.ext4"] != files_of(a_dir)["rootfs.ext4"]
    finally:
        asyncio.run(other.close())
    assert asyncio.run(b.converge("base", DIGEST))


# -- a kill mid-adoption --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("point", "replaced"),
    [("adopt.staged", False), ("adopt.retired", False), ("adopt.swapped", True)],
)
def test_a_kill_at_any_step_of_an_adoption_leaves_a_complete_directory(
    tmp_path: Path, bucket: Bucket, db: Store, point: str, replaced: bool
) -> None:
    a_dir = _uploaded_by_a(tmp_path / "a-images", tmp_path, bucket, db)
    b_images = tmp_path / "b-images"
    b_dir = differing_copy(a_dir, b_images, b"B-build ")
    b_files = files_of(b_dir)
    target = str(db.target)
    done = subprocess.run(
        [sys.executable, "-m", "tests.component.builtin_kit", "converge", str(b_images),
         str(tmp_path / "b-state"), target, "base", DIGEST],
        env={**os.environ, **bucket.env, ENV: point, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"},
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr
    # Killed: the directory is the old one or the new one, whole.
    assert image_at(b_dir) is not None
    assert files_of(b_dir) == (files_of(a_dir) if replaced else b_files)
    assert _sha(b_dir) == identity.compute(b_dir / "rootfs.ext4")
    assert _leftovers(b_images)  # what the kill left beside it

    b = _host("b", b_images, tmp_path, bucket, db)
    assert b.discard_partial()  # the next start
    assert _leftovers(b_images) == []
    assert files_of(b_dir) == (files_of(a_dir) if replaced else b_files)
    assert asyncio.run(b.converge("base", DIGEST)) is not replaced
    assert files_of(b_dir) == files_of(a_dir)


# -- a digest this host lacks ---------------------------------------------------------------------


def test_a_digest_this_host_lacks_is_fetched_under_a_frozen_dir_and_current_stays(
    tmp_path: Path, bucket: Bucket, db: Store
) -> None:
    hosts = Machines(tmp_path)
    a_dir = _uploaded_by_a(hosts.be("a"), tmp_path, bucket, db)
    snap = _frozen(tmp_path / "a-state", a_dir / "rootfs.ext4")
    upload_dir(bucket.store, "snapshots/s/", snap, owner="s", scratch=tmp_path)
    a_files = files_of(a_dir)

    images = hosts.be("b")  # another hutch version: another digest of base
    built(images, b"B-other ", digest=OTHER)
    b = _host("b", images, tmp_path, bucket, db)
    final = _open_on(b, tmp_path)
    assert files_of(images / "base" / DIGEST) == a_files
    assert (images / "base" / "current").read_text().strip() == OTHER  # unchanged
    assert _leftovers(images) == []
    qemu_tool("qemu-img", "compare", "-f", "qcow2", "-F", "qcow2",
         str(snap / "disk.qcow2"), str(final / "disk.qcow2"))  # fmt: skip
    row = HostStore(db).get("b")
    assert row is not None and set(row.images["base"]) == {DIGEST, OTHER}


def test_a_digest_nobody_uploaded_is_refused_naming_it_and_what_to_do(
    tmp_path: Path, bucket: Bucket, db: Store
) -> None:
    hosts = Machines(tmp_path)
    images = hosts.be("a")
    a_dir = built(images, b"A-build ")
    snap = _frozen(tmp_path / "a-state", a_dir / "rootfs.ext4")
    upload_dir(bucket.store, "snapshots/s/", snap, owner="s", scratch=tmp_path)

    images = hosts.be("b")
    built(images, b"B-other ", digest=OTHER)
    b = _host("b", images, tmp_path, bucket, db)
    with pytest.raises(ImageMissing) as err:
        _open_on(b, tmp_path)
    msg = str(err.value)
    assert f"built-in image 'base' of digest {DIGEST}" in msg and "hutch image build base" in msg
    assert not (images / "base" / DIGEST).exists() and _leftovers(images) == []


# -- what the bucket holds is checked ------------------------------------------------------------


@pytest.mark.parametrize("tamper", ["swapped", "truncated"])
@pytest.mark.parametrize("how", ["fetch", "adopt"])
def test_a_swapped_or_truncated_bucket_object_is_refused_and_nothing_is_kept(
    tmp_path: Path, bucket: Bucket, db: Store, tamper: str, how: str
) -> None:
    a_dir = _uploaded_by_a(tmp_path / "a-images", tmp_path, bucket, db)
    key = builtin_prefix("base", DIGEST) + "rootfs.ext4"
    bad = tmp_path / "bad.ext4"
    with bad.open("wb") as f:  # the same size and head, one byte else: or cut short
        f.write(b"X" + (a_dir / "rootfs.ext4").read_bytes()[1 : 1 << 20])
        if tamper == "swapped":
            f.truncate((a_dir / "rootfs.ext4").stat().st_size)
    bucket.store.put(key, bad)

    b_images = tmp_path / "b-images"
    b = _host("b", b_images, tmp_path, bucket, db)
    if how == "fetch":
        built(b_images, b"B-other ", digest=OTHER)
        with pytest.raises(BlobError, match=r"rootfs\.ext4"):
            b.fetch("base", DIGEST, "sb-000000000009")
        assert not (b_images / "base" / DIGEST).exists()
    else:
        b_dir = differing_copy(a_dir, b_images, b"B-build ")
        b_files = files_of(b_dir)
        with pytest.raises(BlobError, match=r"rootfs\.ext4"):
            asyncio.run(b.converge("base", DIGEST))
        assert files_of(b_dir) == b_files
    assert _leftovers(b_images) == []


# -- uploads come back -----------------------------------------------------------------------------


def test_a_resync_uploads_again_what_the_bucket_lost(
    tmp_path: Path, bucket: Bucket, db: Store
) -> None:
    a_dir = built(tmp_path / "a-images", b"A-build ")
    a = _host("a", tmp_path / "a-images", tmp_path, bucket, db)

    async def run() -> list[str]:
        await a.start()
        await a.wait_uploaded("base", DIGEST)
        assert a.prefixes.complete(a_dir)
        a.prefixes.delete(a_dir)  # lost (deleted by hand, another bucket)
        scheduled = await a.resync()
        await a.wait_uploaded("base", DIGEST)
        await a.close()
        return scheduled

    assert asyncio.run(run()) == [f"base/{DIGEST}"]
    assert a.prefixes.complete(a_dir)


def test_with_built_in_uploads_off_a_start_publishes_and_changes_nothing(
    tmp_path: Path, bucket: Bucket, db: Store
) -> None:
    """``HUTCH_BLOB_BUILTIN_IMAGES=0`` (hosts sharing one images directory): nothing
    uploaded, no copy replaced; what the host holds is published all the same."""
    a_dir = _uploaded_by_a(tmp_path / "a-images", tmp_path, bucket, db)
    b_images = tmp_path / "b-images"
    b_dir = differing_copy(a_dir, b_images, b"B-build ")
    built(b_images, b"B-other ", digest=OTHER, current=False)
    b_files = files_of(b_dir)
    b = _host("b", b_images, tmp_path, bucket, db)
    b.converging = False

    async def run() -> None:
        await b.start()
        await b.close()

    asyncio.run(run())
    assert files_of(b_dir) == b_files
    assert ImageUploadStore(db).get(builtin_prefix("base", OTHER)) is None
    row = HostStore(db).get("b")
    assert row is not None and row.images["base"][DIGEST] == _sha(b_dir)
    assert set(row.images["base"]) == {DIGEST, OTHER}


def test_a_create_of_the_image_holds_its_copy_from_an_adoption(
    tmp_path: Path, bucket: Bucket, db: Store
) -> None:
    """From before its image is resolved to its end, a create of ``base`` holds the
    directory (``HostImages.using``): an adoption waits for it, then goes ahead."""
    a_dir = _uploaded_by_a(tmp_path / "a-images", tmp_path, bucket, db)
    b_images = tmp_path / "b-images"
    b_dir = differing_copy(a_dir, b_images, b"B-build ")
    records = ImageUploadStore(db)
    blobs = ImageBlobs(bucket.store, b_images, tmp_path / "b-state", records, host="b")
    images = HostImages(LocalImages(b_images), ImageStore(db), b_images,
                        LocalBootSets(b_images), blobs)  # fmt: skip
    images.hold_builtins = True
    b = _host("b", b_images, tmp_path, bucket, db)
    with images.using("base", "default"):
        assert not asyncio.run(b.converge("base", DIGEST))
        assert b._waiting[f"base/{DIGEST}"] == "a create or a fetch of a frozen state"
    assert asyncio.run(b.converge("base", DIGEST))
    assert files_of(b_dir) == files_of(a_dir)


def test_an_identity_that_cannot_be_recorded_is_hashed_once_for_publication(
    tmp_path: Path, bucket: Bucket, db: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only images directory keeps no record beside the rootfs: the host's
    publications (at each resync) hash it once, not every time."""
    d = built(tmp_path / "images", b"A ")
    (d / ".rootfs.ext4.sha256").unlink()
    hashed: list[Path] = []
    compute = identity.compute

    def counted(path: Path) -> str:
        hashed.append(path)
        return compute(path)

    monkeypatch.setattr(identity, "compute", counted)
    monkeypatch.setattr(identity, "atomic_write_text", _refuse_write)
    a = _host("a", tmp_path / "images", tmp_path, bucket, db)
    first = a.publish()
    assert a.publish(changed_only=True) == first == {"base": {DIGEST: compute(d / "rootfs.ext4")}}
    assert hashed == [d / "rootfs.ext4"]


def _refuse_write(path: Path, text: str, mode: int = 0o644) -> None:
    raise PermissionError(13, "Read-only file system", str(path))
