"""Named snapshots mirrored to the blob store (``HUTCH_BLOB_URL``), so that one is
usable from any host once its upload completes (:class:`SnapshotBlobs`).

Layout in the store, per snapshot::

    snapshots/<snap-id>/state.mig, disk.qcow2, vm.json, manifest.json, frozen, ...
    snapshots/<snap-id>/layer-1.qcow2 ... layer-N.qcow2   the qcow2 layers under its
                                                           disk (a template's, a fork's)
    snapshots/<snap-id>/index.json   written last: every file's size and sha256, the
                                     chain, the raw image at its bottom. Its presence
                                     means the upload is complete.

Upload: after the snapshot is saved (its files are frozen: never written again), in
the background, retried with backoff until it succeeds or the snapshot is deleted.
Fetch (a create from a snapshot whose local copy is gone): every file downloaded and
checked against the index (size + sha256), the migration stream also against the
snapshot manifest's own ``state_digest``; the layers re-pointed at each other and at
the local raw image (``qemu-img rebase -u``); the manifest's disk stamp renewed; the
staging directory renamed into place last. A blob that fails a check is never used:
the create fails with a ``BlobError`` naming it.

Local copies are a cache: past ``HUTCH_BLOB_CACHE_BYTES`` the least recently used
uploaded snapshots are removed from this host, except those any sandbox, snapshot or
clone in progress reaches (collection's own rule: ``SandboxRegistry.collect_snapshots``).
Uploaded images' content counts in the same budget and the same LRU order
(:mod:`hutch.services.blob_cache`, :attr:`SnapshotBlobs.images`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hutch.errors import HutchError, SnapshotError
from hutch.models import SnapshotRecord
from hutch.services.background_uploads import RETRY_S, BackgroundUploads
from hutch.services.blob_cache import CachedImage, ImageCache
from hutch.services.blob_dirs import INDEX, BaseImages, fetch_dir, frozen_base, upload_dir
from hutch.services.registry import SandboxRegistry
from hutch.storage.blobs import BlobInfo, BlobStore
from hutch.vm.snapshot_dir import FROZEN_MARKER

__all__ = ["INDEX", "SnapshotBlobs"]

log = logging.getLogger("hutch.services.snapshot_blobs")

#: Uploads in the bucket older than this that no journal of ours names are abandoned.
ORPHAN_UPLOAD_AGE_S = 24 * 3600.0


def _prefix(snapshot_id: str) -> str:
    return f"snapshots/{snapshot_id}/"


class SnapshotBlobs:
    """The blob store side of named snapshots; ``store`` None: snapshots stay on this
    host only (nothing is uploaded, nothing evicted)."""

    def __init__(
        self,
        core: SandboxRegistry,
        store: BlobStore | None,
        cache_bytes: int,
        *,
        retry_s: Sequence[float] = RETRY_S,
    ) -> None:
        """``cache_bytes``: the local copies' budget (0: no eviction); ``retry_s``: the
        delays between upload attempts."""
        self.core = core
        self.store = store
        self.cache_bytes = cache_bytes
        self.uploads: BackgroundUploads[SnapshotRecord] = BackgroundUploads(
            "snapshot",
            self._upload_once,
            lambda snap: self.core.store.get_snapshot(snap.id) is not None,
            key=lambda snap: snap.id,
            log=log,
            task_prefix="hutch-upload-",
            retry_s=retry_s,
        )
        self._fetching: dict[str, asyncio.Lock] = {}
        self._evictions: set[asyncio.Task[list[str]]] = set()
        # Snapshots deleted while their upload's thread may still run: it stops at its
        # next file (a thread cannot be cancelled), so no index appears after a delete.
        self._deleted: set[str] = set()
        self._starter: asyncio.Task[None] | None = None
        #: This host's copies of uploaded images, evicted within the same budget
        #: (``hutch.services.blob_cache``; set where the services are composed).
        self.images: ImageCache | None = None
        #: This host's images under fetched chains: a built-in one it lacks fetched
        #: first, each held from an adoption meanwhile (``builtin_blobs``; set where
        #: the services are composed).
        self.base_images: BaseImages | None = None

    @classmethod
    def from_settings(cls, core: SandboxRegistry, store: BlobStore | None) -> SnapshotBlobs:
        """``store``: the daemon's (``blob_store_from_settings``: none when
        ``HUTCH_BLOB_URL`` is unset, and snapshots stay on this host, whose snapshots/
        directory already is their copy); the cache budget from the settings."""
        if store is None:
            return cls(core, None, 0)
        return cls(core, store, core.settings.blob_cache_bytes)

    @property
    def enabled(self) -> bool:
        return self.store is not None

    # -- start and close ----------------------------------------------------------------

    async def start(self) -> None:
        """Continue the uploads a stopped daemon left (their multipart journals make
        them resume where they were) and abandon orphaned ones, in the background: a
        store that cannot be reached (each request retried up to a minute) delays
        nothing else, and is logged."""
        # Fetches a stopped daemon cut short (never renamed into place: never used).
        await asyncio.to_thread(shutil.rmtree, self._staging_root(), True)
        if self.store is None or self.uploads.closed:
            return
        self._starter = asyncio.create_task(self._resume_uploads(), name="hutch-blob-start")

    async def _resume_uploads(self) -> None:
        assert self.store is not None
        store = self.store
        try:
            await asyncio.to_thread(store.check)
            aborted = await asyncio.to_thread(store.abort_uploads, ORPHAN_UPLOAD_AGE_S)
            if aborted:
                log.info("blob store %s: abandoned unfinished uploads %s", store.url, aborted)
        except HutchError as exc:
            log.warning("blob store: %s (uploads will retry)", exc)
        for snap in self.core.store.list_snapshots():
            # Only where the files are (another host saved the others).
            if await asyncio.to_thread(Path(snap.path).is_dir):
                self.schedule(snap)

    def _staging_root(self) -> Path:
        return self.core.settings.state_dir / "blob-fetch"

    async def close(self) -> None:
        tasks: list[asyncio.Task[Any]] = [*self._evictions]
        if self._starter is not None:
            tasks.append(self._starter)
        for task in tasks:
            task.cancel()
        await self.uploads.close()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- upload -------------------------------------------------------------------------

    def schedule(self, snap: SnapshotRecord) -> None:
        """Upload ``snap`` in the background, retried until it succeeds or the snapshot
        is deleted (no-op without a store or if under way)."""
        if self.store is None:
            return
        self.uploads.schedule(snap)

    async def wait_uploaded(self, snapshot_id: str) -> None:
        """Until the snapshot's upload under way (if any) has ended."""
        await self.uploads.wait(snapshot_id)

    def uploaded(self, snapshot_id: str) -> bool:  # blocking (a stat in the store)
        """The snapshot's index is in the store (its upload completed)."""
        return self.store is not None and self.store.stat(_prefix(snapshot_id) + INDEX) is not None

    async def _upload_once(self, snap: SnapshotRecord) -> None:
        started = time.monotonic()
        size = await asyncio.to_thread(self._upload, snap)
        if size is None:
            return  # uploaded before
        took = time.monotonic() - started
        log.info(
            "snapshot %s uploaded to %s: %d bytes in %.1f s",
            snap.id,
            self.store.url if self.store else "",
            size,
            took,
        )
        self.core.events.record(
            "snapshot.uploaded",
            project=snap.project,
            sandbox_id=snap.sandbox_id,
            data={"snapshot": snap.id, "bytes": size, "seconds": round(took, 3)},
        )
        await self.evict()

    def _upload(self, snap: SnapshotRecord) -> int | None:
        """Upload the snapshot's files and chain, then its index; the bytes sent (None:
        its index was there already)."""
        assert self.store is not None
        prefix = _prefix(snap.id)
        if self.store.stat(prefix + INDEX) is not None:
            return None
        d = Path(snap.path)
        if not self.core.backend.snapshots.complete(d):
            raise SnapshotError(f"snapshot {snap.id}: {d} is not a complete snapshot")
        return upload_dir(
            self.store,
            prefix,
            d,
            owner=snap.id,
            scratch=self.core.settings.state_dir,
            put=self._put,
        )

    def _put(self, key: str, path: Path) -> BlobInfo:
        """One blob of an upload; stops (between parts) once the snapshot is deleted or
        the daemon closes, since the thread running it cannot be cancelled."""
        assert self.store is not None
        snapshot_id = key.split("/")[1]

        def still_wanted(_sent: int) -> None:
            if snapshot_id in self._deleted:
                raise SnapshotError(f"snapshot {snapshot_id} was deleted during its upload")
            if self.uploads.closed:
                raise SnapshotError(f"the daemon stopped during the upload of {snapshot_id}")

        still_wanted(0)
        return self.store.put(key, path, progress=still_wanted)

    # -- fetch --------------------------------------------------------------------------

    async def local_dir(self, snap: SnapshotRecord) -> Path:
        """This host's directory of ``snap``: its own, or else a copy fetched from the
        blob store (checked against the index; ``BlobError`` naming a blob that fails)."""
        for d in self._candidates(snap):
            if self.core.backend.snapshots.complete(d):
                _touch(d)
                return d
        if self.store is None:
            raise SnapshotError(
                f"snapshot {snap.id}: its files ({snap.path}) are not on this host and no "
                "blob store is configured (HUTCH_BLOB_URL)"
            )
        lock = self._fetching.setdefault(snap.id, asyncio.Lock())
        async with lock:
            target = self.core.backend.fork_dir(snap.id)
            if not self.core.backend.snapshots.complete(target):
                with self.core.holding(str(target)):
                    await asyncio.to_thread(self._fetch, snap, target)
        _touch(target)
        return target

    def evict_soon(self) -> None:
        """Evict (:meth:`evict`) in a thread, in the background."""
        if self.store is None or self.cache_bytes <= 0 or self.uploads.closed:
            return
        task = asyncio.create_task(self.evict(), name="hutch-blob-evict")
        self._evictions.add(task)
        task.add_done_callback(self._evictions.discard)

    def _candidates(self, snap: SnapshotRecord) -> Iterator[Path]:
        own = self.core.backend.fork_dir(snap.id)
        yield own
        saved = Path(snap.path)
        # Where it was saved, when that is this host's (another host's state dir is
        # not this host's to read, even where the path resolves: workers sharing one
        # machine, as in the tests).
        if saved != own and saved.resolve().is_relative_to(self.core.settings.state_dir.resolve()):
            yield saved

    def _fetch(self, snap: SnapshotRecord, target: Path) -> None:
        self.fetch_frozen(_prefix(snap.id), snap.id, target, image=snap.image)

    def fetch_frozen(self, prefix: str, owner: str, target: Path, *, image: str = "") -> None:
        """Fetch the frozen directory :func:`upload_dir` stored under ``prefix`` (a named
        snapshot's, a fork's) into ``target`` (blocking; checked as described above).
        ``ImageMismatch`` (nothing fetched) when it was frozen over other bytes of its
        ``image`` than this host holds."""
        assert self.store is not None
        store = self.store
        # Staged outside snapshots/ (collection removes what no row names there), on
        # the same file system, so the rename into place is atomic.
        staging = self._staging_root() / f"{owner}-{secrets.token_hex(4)}"
        staging.mkdir(parents=True, mode=0o700)
        try:
            fetch_dir(
                store,
                prefix,
                staging,
                target,
                owner=owner,
                images_dir=self.core.settings.images_dir,
                image=image,
                images=self.base_images,
            )
            if target.exists():
                shutil.rmtree(target)  # an incomplete copy (evicted or fetched half way)
            target.parent.mkdir(parents=True, exist_ok=True)  # a host's first snapshot
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        log.info("%s fetched from %s into %s", owner, store.url, target)

    def frozen_base(self, snapshot_id: str) -> tuple[str, str | None] | None:
        """The raw image the snapshot's upload was frozen over and its recorded
        identity (``blob_dirs.frozen_base``); None: no upload, or no store. Blocking."""
        if self.store is None:
            return None
        return frozen_base(self.store, _prefix(snapshot_id), self._staging_root())

    async def local_frozen(self, prefix: str, owner: str, target: Path, *, image: str = "") -> Path:
        """``target`` complete on this host: as it is, or fetched (one fetch at a time
        per owner; the caller holds ``target`` from collection)."""
        lock = self._fetching.setdefault(owner, asyncio.Lock())
        async with lock:
            if not self.core.backend.snapshots.complete(target):
                await asyncio.to_thread(self.fetch_frozen, prefix, owner, target, image=image)
        return target

    # -- delete and the cache -----------------------------------------------------------

    async def delete(self, snapshot_id: str) -> None:
        """Remove the snapshot's blobs (its row is gone). Failures are logged: a blob
        left behind costs storage, nothing else (no row names it)."""
        if self.store is None:
            return
        self._deleted.add(snapshot_id)
        await self.uploads.cancel(snapshot_id)
        store = self.store

        def remove() -> None:
            # The index first: from then on the snapshot is no longer "uploaded".
            store.delete(_prefix(snapshot_id) + INDEX)
            for blob in store.list_prefix(_prefix(snapshot_id)):
                store.delete(blob.key)

        try:
            await asyncio.to_thread(remove)
        except HutchError as exc:
            log.warning("snapshot %s: its blobs were not all removed: %s", snapshot_id, exc)

    async def evict(self) -> list[str]:
        """Remove the least recently used local copies of uploaded snapshots and
        uploaded images (:attr:`images`, :mod:`hutch.services.blob_cache`) until they
        hold at most ``cache_bytes`` together; never a snapshot a sandbox, snapshot or
        clone in progress reaches (each removal is collection's own synchronous check,
        on the event loop), never an image anything here may read (checked again under
        its locks, in a thread). Returns the snapshot ids and image digests removed."""
        if self.store is None or self.cache_bytes <= 0:
            return []
        dirs = {s.id: self.core.backend.fork_dir(s.id) for s in self.core.store.list_snapshots()}
        copies = await asyncio.to_thread(self._local_copies, dirs)
        cached: list[tuple[float, str, CachedImage | Path, int, bool]] = [*copies]
        if self.images is not None:
            found = await asyncio.to_thread(self.images.copies)
            cached += [(c.last_used, c.digest, c, c.size, True) for c in found]
        total = sum(size for _used, _id, _d, size, _up in cached)
        removed: list[str] = []
        for _used, key, what, size, uploaded in sorted(cached, key=lambda c: (c[0], c[1])):
            if total <= self.cache_bytes:
                break
            if not uploaded:
                continue  # the only copy: never evicted
            if isinstance(what, CachedImage):
                assert self.images is not None
                gone = await asyncio.to_thread(self.images.evict, what)
            else:
                gone = self.core.collect_snapshots(evict=str(what))
                if gone:
                    log.info(
                        "snapshot %s: local copy evicted (%d bytes; in %s)",
                        key,
                        size,
                        self.store.url,
                    )
            if gone:
                removed.append(key)
                total -= size
        return removed

    def _local_copies(self, dirs: dict[str, Path]) -> list[tuple[float, str, Path, int, bool]]:
        """(last used, id, dir, bytes, uploaded) of each complete local copy."""
        out = []
        for snap_id, d in dirs.items():
            if d.is_dir() and self.core.backend.snapshots.complete(d):
                try:
                    up = self.uploaded(snap_id)
                except HutchError:
                    up = False
                size = self.core.backend.snapshots.size(d)
                out.append((_last_used(d), snap_id, d, size, up))
        return out


def _touch(d: Path) -> None:
    """Mark ``d`` used now (the cache's LRU order: the frozen marker's mtime)."""
    with contextlib.suppress(OSError):
        os.utime(d / FROZEN_MARKER)


def _last_used(d: Path) -> float:
    try:
        return (d / FROZEN_MARKER).stat().st_mtime
    except OSError:
        return 0.0
