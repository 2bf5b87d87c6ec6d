"""Imported and built images in the blob store (``HUTCH_BLOB_URL``), by content digest,
so that a host asked to run an image it lacks fetches it (:class:`ImageBlobs`).

Layout in the store (the path under the images directory, which names the content)::

    images/oci/sha256-<hex>/rootfs.ext4, manifest.json, config.json, image.json
    images/oci/sha256-<hex>/index.json     written last (``storage/blobs/flat.py``):
                                           every file's size and sha256, and the key
                                           of the boot set it was imported with
    images/oci-boot/<key>/vmlinux, initrd.img, runtime.ext4, boot.json, index.json

Upload: once an image is recorded (``ImageImporter.record``: an import or a Dockerfile
build), in the background, retried with backoff; the boot set first, the content's
index last, so an index in the store means everything it names can be fetched. Before
each index goes, the uploading host records in the database (``image_uploads``,
``hutch.store.image_uploads``) every file's size and sha256 as it sent them and the
index's meta: the record, not the bucket, is what a fetch trusts. An upload is complete
when both the index and the record are there; at the daemon's start every recorded
image whose content is here and whose upload is not complete is scheduled again (an S3
upload resumes where it stopped: its journal), which is also how an upload made before
the record existed (migration 15) gets one: a host holding the content sends it again.
The same check runs every ``RESYNC_S`` while the daemon runs, so an upload undone by a
deletion elsewhere is made again without waiting for a restart.

Delete (the last image record naming a digest went): the index, the files, then the
record, under the digest's guard, which its upload here holds too, and only if still no
image names the digest once the guard is held. An import recorded meanwhile on this host
waits for the guard and then uploads everything again; one recorded on another host
while the blobs went is found by its host's next resync (its index or its record is
missing), and until then a fetch of it is refused (``ImageMissing``), never given files
that are not there.

Fetch (a create, a resume or a fork child on a host without the content): one at a
time per image on this host (an asyncio lock per digest in the daemon, the content's
``oci/sha256-<hex>.lock`` flock across daemons sharing the directory, the one imports
take): downloaded into ``.sha256-<hex>.fetch-*`` beside the final directory (on the
same file system; ``discard_partial`` removes what a crash left), the index checked
against the database's record (the same files, each of the recorded size and sha256:
a bucket writer cannot swap a file and its index) and every file against the record as
it is written, then against the digest the image is recorded with: ``manifest.json``
must hash to it, ``image.json`` must name it and the config the manifest names, and
the directory must load as complete content; only then is it
renamed into place. A failed check leaves nothing behind and is a ``BlobError``
naming the image and the blob; no index in the store, or no record of the upload in
the database (never uploaded, not complete, or uploaded by a hutch before migration 15:
refused, never fetched unverified), is ``ImageMissing``. The boot set is fetched the
same way (into ``oci-boot/.<key>.fetch-*``, its own record, its ``boot.json`` naming its
key) when this host has none, and becomes ``current`` only if there still is none; its
key is the one the content's record names, not the bucket's index.

The per-prefix machinery (claims, the record before the index, the verified download
and its exchange into place) is ``blob_prefixes.PrefixBlobs``, which built-in images
(``builtin_blobs``) share; the checks of what a fetched directory means are
``image_blob_checks``; adoption is ``image_adoption.ContentAdoption``.

Two hosts, one digest (issue 14): the rootfs an import derives is not byte-identical
from host to host (mkfs), and a frozen VM state opens only over the exact bytes it was
taken on. So one upload per prefix wins and every host ends up holding it:

- before it sends anything under a prefix, a host claims it in the database
  (``ImageUploadStore.claim``: one statement, one winner; renewed while it sends,
  released once the upload is complete). Another host's claim means "wait": the attempt
  fails (retried with the usual backoff) until that upload completes, or until the claim
  is stale (``CLAIM_STALE_S``, an hour without renewal: its host died), when it is taken
  over;
- an upload attempt that finds the prefix's upload complete compares the record's
  ``rootfs.ext4`` sha256 with this host's copy's identity (``hutch.images.identity``:
  recorded at import, never re-hashed); if they differ, this host **adopts** the
  bucket's content (:meth:`ImageBlobs.adopt`): fetched and checked as any fetch, then
  exchanged in for the local copy (its ``refs/`` kept) under the content's lock and its
  ``.use`` lock, and only while nothing on this host uses the copy (``in_use``: a live
  sandbox here, a snapshot whose files are here, a template, a build cache); while
  something does, the attempt fails and is retried, so it is adopted once it is free.
  Boot sets are claimed the same way but never adopted (every imported image shares
  one; a frozen guest that read another host's runtime disk is refused, not healed).

Cache: content whose upload is complete is a copy, counted in ``HUTCH_BLOB_CACHE_BYTES``
and evicted least recently used first when nothing on this host may read it
(:mod:`hutch.services.blob_cache`); ``ensure`` marks it used (the directory's mtime)
and calls ``on_cached`` after a fetch or a completed upload (the daemon: eviction).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from hutch.config import Settings
from hutch.errors import BlobError, HutchError, ImageMissing
from hutch.images.cache import atomic_write_text, file_lock
from hutch.images.oci.boot import BootSet, find_boot_set, load_boot_set
from hutch.images.oci.importer import content_dir, find_content, load_content
from hutch.services.background_uploads import RETRY_S, BackgroundUploads
from hutch.services.blob_cache import touch_content
from hutch.services.blob_prefixes import PrefixBlobs, image_prefix
from hutch.services.image_adoption import ContentAdoption
from hutch.services.image_blob_checks import CONTENT_FILES, check_boot, check_content
from hutch.storage.blobs import BlobStore
from hutch.store.image_uploads import ImageUploadStore, UploadRecord

__all__ = ["CONTENT_FILES", "RESYNC_S", "ImageBlobs", "image_prefix"]

log = logging.getLogger("hutch.services.image_blobs")

#: Seconds between two checks that every image whose content is here is uploaded.
RESYNC_S = 300.0


class ImageBlobs:
    """The blob store side of images; ``store`` None: images stay on the host that
    imported them (nothing uploaded, nothing fetched)."""

    def __init__(
        self,
        store: BlobStore | None,
        images_dir: Path,
        scratch: Path,
        records: ImageUploadStore | None = None,
        *,
        retry_s: Sequence[float] = RETRY_S,
        resync_s: float = RESYNC_S,
        host: str = "local",
    ) -> None:
        """``records``: where uploads are recorded and fetches verified (the database);
        required with a ``store``. ``retry_s``: the delays between upload attempts;
        ``resync_s``: between two checks of every image's upload; ``host``: this
        host's id, under which it claims the prefixes it uploads."""
        if store is not None and records is None:
            raise ValueError("ImageBlobs with a blob store needs the upload records")
        self.store = store
        self.records = records
        self.images_dir = images_dir
        self.host = host
        #: Where indexes are written and read before they go on (the state dir).
        self.scratch = scratch
        self._fetching: dict[str, asyncio.Lock] = {}
        #: Per digest: its upload or the deletion of its blobs, never both at once.
        self._guards: dict[str, asyncio.Lock] = {}
        self._resync_s = resync_s
        self._resync_task: asyncio.Task[None] | None = None
        self.uploads: BackgroundUploads[str] = BackgroundUploads(
            "image",
            self._upload_once,
            lambda digest: find_content(self.images_dir, digest) is not None,
            key=lambda digest: digest,
            log=log,
            task_prefix="hutch-image-",
            retry_s=retry_s,
        )
        #: Directories under their prefixes (None without a store).
        self.prefixes = (
            PrefixBlobs(
                store, records, images_dir, scratch, host, closed=lambda: self.uploads.closed
            )
            if store is not None and records is not None
            else None
        )
        self.adoption = (
            ContentAdoption(self.prefixes, self._missing) if self.prefixes is not None else None
        )
        #: Called with (event type, data) after an upload (the daemon's event log).
        self.on_uploaded: Callable[[str, dict[str, Any]], None] | None = None
        #: Called on the event loop once a copy here became evictable or grew the
        #: cache (an upload completed, a fetch): the blob cache's eviction.
        self.on_cached: Callable[[], None] | None = None

    @classmethod
    def from_settings(
        cls, settings: Settings, records: ImageUploadStore, store: BlobStore | None
    ) -> ImageBlobs:
        """``store``: the daemon's (``blob_store_from_settings``); None: images stay on
        the host that imported them."""
        if store is None:
            return cls(None, settings.images_dir, settings.state_dir)
        return cls(store, settings.images_dir, settings.state_dir, records, host=settings.host_id)

    @property
    def enabled(self) -> bool:
        return self.store is not None

    @property
    def in_use(self) -> Callable[[str], str | None] | None:
        """What on this host uses a digest's content (None: nothing), asked before an
        adoption replaces it; unset: nothing is known to (a test, one host's images)."""
        return self.adoption.in_use if self.adoption is not None else None

    @in_use.setter
    def in_use(self, value: Callable[[str], str | None] | None) -> None:
        if self.adoption is not None:
            self.adoption.in_use = value

    def _pre(self) -> PrefixBlobs:
        assert self.prefixes is not None, "no blob store"
        return self.prefixes

    # -- start and close ----------------------------------------------------------------

    def start(self, digests: Callable[[], Iterable[str]]) -> None:
        """On the event loop: remember it (imports record from worker threads),
        schedule the upload of each recorded digest (``digests()``: every image
        record's) whose content is here, and check them again every ``resync_s``."""
        self.uploads.start()
        if self.store is None:
            return
        for digest in dict.fromkeys(digests()):
            if find_content(self.images_dir, digest) is not None:
                self.schedule(digest)
        self._resync_task = asyncio.create_task(
            self._resync_forever(digests), name="hutch-image-resync"
        )

    async def close(self) -> None:
        if self._resync_task is not None:
            self._resync_task.cancel()
            await asyncio.gather(self._resync_task, return_exceptions=True)
        await self.uploads.close()

    async def _resync_forever(self, digests: Callable[[], Iterable[str]]) -> None:
        while not self.uploads.closed:
            await asyncio.sleep(self._resync_s)
            try:
                await self.resync(list(digests()))
            except (HutchError, OSError) as exc:  # the store or the database away
                log.warning("checking the images' uploads failed (again in %.0f s): %s",
                            self._resync_s, exc)  # fmt: skip

    async def resync(self, digests: Iterable[str]) -> list[str]:
        """Schedule the upload of each of ``digests`` whose content is here, whose
        upload is not under way and not complete (its index or its record is not
        there); the digests scheduled."""
        scheduled = []
        for digest in dict.fromkeys(digests):
            if self.uploads.running(digest) or find_content(self.images_dir, digest) is None:
                continue
            if not await asyncio.to_thread(self.uploaded, digest):
                log.info("image %s: its upload is not complete; uploading it again", digest)
                self.schedule(digest)
                scheduled.append(digest)
        return scheduled

    # -- upload -------------------------------------------------------------------------

    def schedule(self, digest: str) -> None:
        """Upload the content ``digest`` (and the boot set) in the background, retried
        while its content is here; callable from any thread; a no-op without a store,
        before :meth:`start` or while its upload runs."""
        if self.store is None or not self.uploads.started:
            return
        self.uploads.schedule(digest)

    async def wait_uploaded(self, digest: str) -> None:
        """Until the upload of ``digest`` under way (if any) has ended."""
        await self.uploads.wait(digest)

    def _guard(self, digest: str) -> asyncio.Lock:
        return self._guards.setdefault(digest, asyncio.Lock())

    async def _upload_once(self, digest: str) -> None:
        started = time.monotonic()
        async with self._guard(digest):
            sent = await asyncio.to_thread(self.upload, digest)
        if sent is not None:
            took = time.monotonic() - started
            log.info("image %s uploaded: %d bytes in %.1f s", digest, sent, took)
            if self.on_uploaded is not None:
                data = {"digest": digest, "bytes": sent, "seconds": round(took, 3)}
                self.on_uploaded("image.uploaded", data)
            if self.on_cached is not None:
                self.on_cached()

    def uploaded(self, digest: str) -> bool:  # blocking (a stat in the store)
        """The content's upload is complete (its record and its index are there)."""
        return self.prefixes is not None and self.prefixes.complete(
            content_dir(self.images_dir, digest)
        )

    def recorded(self, digest: str) -> bool:
        """The database records an upload of the content (no store request)."""
        return (
            self.prefixes is not None
            and self.prefixes.record(content_dir(self.images_dir, digest)) is not None
        )

    def fetching(self, digest: str) -> bool:
        """A fetch (or the check before one) of ``digest`` runs in this daemon."""
        lock = self._fetching.get(digest)
        return lock is not None and lock.locked()

    def upload(self, digest: str) -> int | None:
        """Upload this host's boot set, then the content ``digest`` naming it; the bytes
        sent (None: its upload was complete already: this host's copy is the uploaded
        one, or is replaced by it, :meth:`adopt`). Blocking; ``BlobError``, and
        ``Conflict`` while another host's claim or a user of a copy to adopt holds it
        (the caller retries)."""
        prefixes = self._pre()
        content = find_content(self.images_dir, digest)
        if content is None:
            raise BlobError(f"image {digest}: its content is not on this host to upload")
        if prefixes.complete(content.path):
            if not self.same_as_uploaded(digest):
                self.adopt(digest, f"image {digest}")
            return None
        boot = find_boot_set(self.images_dir)
        sent = 0
        if boot is not None:
            sent += prefixes.upload(boot.kernel.parent, {"key": boot.key}) or 0
        meta = {"digest": digest, "boot": boot.key if boot is not None else None}
        return sent + (prefixes.upload(content.path, meta) or 0)

    # -- one content on every host (image_adoption) ---------------------------------------

    def same_as_uploaded(self, digest: str) -> bool:
        """This host's copy of ``digest`` holds the bytes of the complete upload
        recorded in the database (its ``rootfs.ext4``'s identity: recorded when it was
        made, so no re-hash), or there is no record to compare with. Blocking."""
        assert self.adoption is not None, "no blob store"
        return self.adoption.same_as_uploaded(digest)

    def adopt(self, digest: str, what: str) -> bool:
        """:meth:`ContentAdoption.adopt`: this host's copy of ``digest`` replaced by the
        complete upload (True), unless it is that upload (False). Blocking;
        ``Conflict`` while something here uses it."""
        assert self.adoption is not None, "no blob store"
        return self.adoption.adopt(digest, what)

    async def delete_unused(self, digest: str, unused: Callable[[], bool]) -> bool:
        """Remove the content's blobs if ``unused()`` (no image record names
        ``digest``) still holds once no upload of it runs here (see the module
        docstring); True: they were removed. Failures (``HutchError``) are the
        caller's to log."""
        if self.store is None:
            return False
        async with self._guard(digest):
            if not unused():
                return False
            await asyncio.to_thread(self.delete, digest)
        if not unused():
            # Recorded again while its blobs went (on another host: its resync uploads
            # it; here: its upload waited for the guard). A copy here goes up now.
            log.info("image %s was recorded again while its blobs were removed", digest)
            self.schedule(digest)
        return True

    def delete(self, digest: str) -> None:
        """Remove the content's blobs (call :meth:`delete_unused`, which holds the
        digest's guard): the index first, so it stops counting as uploaded. Boot sets
        stay (every imported image shares them). The record goes last: one left by a
        crash is replaced by the next upload. Blocking."""
        if self.prefixes is not None:
            self.prefixes.delete(content_dir(self.images_dir, digest))

    # -- fetch --------------------------------------------------------------------------

    async def ensure(self, digest: str, what: str, *, boot: bool) -> None:
        """The content ``digest`` on this host (and, with ``boot``, a boot set): as it
        is, or fetched and verified (one fetch per digest at a time). ``what`` names
        the image in errors. Raises ``ImageMissing`` when the store has no complete
        upload of it and ``BlobError`` when the store fails or a blob fails a check."""
        if self.store is None:
            return
        lock = self._fetching.setdefault(digest, asyncio.Lock())
        async with lock:
            fetched = await asyncio.to_thread(self._ensure, digest, what, boot)
        if fetched and self.on_cached is not None:
            self.on_cached()

    def _ensure(self, digest: str, what: str, boot: bool) -> bool:
        """True: the content was fetched (it was not here)."""
        fetched = False
        if find_content(self.images_dir, digest) is None:
            fetched = self.fetch_content(digest, what) is not None
        touch_content(content_dir(self.images_dir, digest))  # the blob cache's LRU
        if boot and find_boot_set(self.images_dir) is None:
            # The key the uploader recorded, never the bucket's index's word for it.
            key = self._record(content_dir(self.images_dir, digest), digest, what).meta.get("boot")
            if not isinstance(key, str) or not key:
                raise ImageMissing(
                    f"{what}: this host has no boot set for imported images and the "
                    "image's upload names none; import any image here once to build it"
                )
            self.fetch_boot(key, what)
        return fetched

    def _record(self, final: Path, digest: str, what: str) -> UploadRecord:
        """The database's record of the content's upload; ``ImageMissing`` without."""
        found = self._pre().record(final)
        if found is None:
            raise self._missing(digest, what)
        return found

    def fetch_content(self, digest: str, what: str) -> dict[str, Any] | None:
        """Fetch the content ``digest`` into place (blocking, checked as the module
        says); return its index's meta. None: found complete meanwhile (another daemon
        fetched or imported it), nothing downloaded."""
        prefixes = self._pre()
        final = content_dir(self.images_dir, digest)
        final.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(final.parent / f"{final.name}.lock"):
            if load_content(final) is not None:
                return None
            started = time.monotonic()
            record = self._record(final, digest, what)
            staged = prefixes.stage(final, what, record, lambda d: check_content(d, digest, what))
            if staged is None:
                raise self._missing(digest, what)
            prefixes.install(staged, final, keep=("refs",))
        log.info("%s (%s) fetched from %s in %.1f s", what, digest, prefixes.store.url,
                 time.monotonic() - started)  # fmt: skip
        meta: dict[str, Any] = staged.index["meta"]
        return meta

    def fetch_boot(self, key: str, what: str) -> BootSet:
        """Fetch the boot set ``key`` into ``oci-boot/<key>/`` (blocking, checked); it
        becomes ``current`` if this host still has none."""
        prefixes = self._pre()
        root = self.images_dir / "oci-boot"
        final = root / key
        root.mkdir(parents=True, exist_ok=True)
        with file_lock(self.images_dir / "oci-boot.lock"):
            if load_boot_set(final) is None:
                record = prefixes.record(final)
                staged = (
                    None
                    if record is None
                    else prefixes.stage(final, what, record, lambda d: check_boot(d, key))
                )
                if staged is None:
                    raise ImageMissing(
                        f"{what}: the boot set {key} it was imported with is not in the blob "
                        f"store {prefixes.store.url} with a record of its upload in the "
                        "database, and this host has none; import any image here once to "
                        "build one"
                    )
                prefixes.install(staged, final)
                log.info("boot set %s fetched from %s", key, prefixes.store.url)
            if find_boot_set(self.images_dir) is None:
                atomic_write_text(root / "current", key + "\n")
        found = load_boot_set(final)
        assert found is not None, final
        return found

    def _missing(self, digest: str, what: str) -> ImageMissing:
        assert self.store is not None
        return ImageMissing(
            f"{what} ({digest}) is not on this host and not in the blob store "
            f"{self.store.url} with a record of its upload in the database (its upload "
            "from the host that imported it has not completed, it was never uploaded, or "
            "it was uploaded by a hutch that kept no record: a host holding it uploads it "
            "again when its daemon starts); retry once it has, or import it again"
        )
