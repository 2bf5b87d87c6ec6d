"""Templates in the blob store (``HUTCH_BLOB_URL``), by key, so that a host that lacks
the template of an (image, shape) fetches it instead of cold-booting the guest again
(:class:`TemplateBlobs`).

Layout in the store, per template (``<image dir>``: the image's directory under the
images directory, ``base/<digest>`` or ``oci/sha256-<hex>``; ``<key>``: the template's
key, ``hutch.runtime.qemu.template_key``)::

    templates/<image dir>/<key>/state.mig, disk.qcow2, manifest.json, vm.json, frozen,
                                template.json            as the template's directory
    templates/<image dir>/<key>/memory.ram.data          the non-zero extents of its
                                                         memory.ram (hutch.storage.sparse)
    templates/<image dir>/<key>/index.json               LAST (services/blob_dirs.py):
                                                         sizes, sha256s, the extents, the
                                                         image's identity under the disk

Upload (after a build here, and at the daemon's start for every template here whose
upload is not complete): in the background (``BackgroundUploads``, retried 2, 5, 15,
60 s), under the prefix's claim (``services/upload_claims.py``: two hosts that built
the same key do not both send it), with ``blob_dirs.upload_dir``: each blob streamed,
multipart and resumable (the S3 journal; the packed memory kept in
``<state>/templates/.upload/<key>/`` until the index is sent, so a retry sends the same
file). Just before the index goes, the uploader records in the database
(``image_uploads``, the row of the prefix) every file's size and sha256 and the sha256 of
the index's own bytes: the record, not the bucket, is what a fetch trusts.

Fetch (a create or the warm pool needs the template, or a background build is about to
boot one): only when the database records an upload of this host's key (no request to
the bucket otherwise), one at a time per key: ``blob_dirs.fetch_dir`` into
``templates/.fetch-<name>-<rand>/`` (the index must hash to the record's, every blob to
the index, the disk's image to its recorded identity, the stream to its manifest), then
``Templates.install`` (the key, QEMU build and VM config must be this host's; vm.json
rewritten for this host; memory.ram sealed again, which refuses other bytes than the
saving host sealed; renamed into place in one step). Any failure leaves nothing, is
logged with its reason, and the caller cold-boots as without a blob store; a key whose
fetch failed is not tried again for ``FETCH_RETRY_S`` (a bucket away costs a create up to
``HUTCH_S3_CONNECT_TIMEOUT_S`` once, not every time).

Delete (the last image row naming an imported image's content went): every template of
that content in the store (indexes first) and their records.

Fetched templates are not counted in ``HUTCH_BLOB_CACHE_BYTES``: a template is in use as
long as any clone's disk chain (running, paused, a snapshot or fork of it) reaches its
disk, which the cache has no cheap way to know; they go with their image.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from hutch.config import Settings
from hutch.errors import BlobError, HutchError
from hutch.images.build import ImageArtifacts
from hutch.models import FileSum, Shape
from hutch.runtime.backend import TemplateInfo, Templates
from hutch.services.background_uploads import RETRY_S, BackgroundUploads
from hutch.services.blob_dirs import INDEX, fetch_dir, upload_dir
from hutch.services.upload_claims import UploadClaim
from hutch.storage.blobs import BlobInfo, BlobStore
from hutch.store.image_uploads import ImageUploadStore, UploadRecord
from hutch.vm.snapshot_manifest import MEMORY_FILE

__all__ = ["FETCH_RETRY_S", "TemplateBlobs", "template_prefix"]

log = logging.getLogger("hutch.services.template_blobs")

#: Seconds a key whose fetch failed is not fetched again (creates cold-boot meanwhile,
#: and the background build that follows makes the template here).
FETCH_RETRY_S = 60.0


def template_prefix(content: str, key: str) -> str:
    """The store prefix of the template ``key`` built on the image directory ``content``."""
    return f"templates/{content}/{key}/"


class TemplateBlobs:
    """The blob store side of templates; ``store`` None: each host builds its own."""

    def __init__(
        self,
        templates: Templates,
        store: BlobStore | None,
        records: ImageUploadStore | None,
        settings: Settings,
        *,
        retry_s: Sequence[float] = RETRY_S,
        fetch_retry_s: float = FETCH_RETRY_S,
    ) -> None:
        """``records``: where uploads are recorded and fetches verified (the database);
        ``retry_s``: the delays between upload attempts; ``fetch_retry_s``: how long a
        key whose fetch failed is left alone."""
        self.templates = templates
        self.store = store if records is not None else None
        self.records = records
        self.settings = settings
        self.host = settings.host_id
        self.fetch_retry_s = fetch_retry_s
        self.uploads: BackgroundUploads[TemplateInfo] = BackgroundUploads(
            "template",
            self._upload_once,
            self._wanted,
            key=lambda info: info.key,
            log=log,
            task_prefix="hutch-template-upload-",
            retry_s=retry_s,
        )
        self._fetching: dict[str, asyncio.Lock] = {}
        self._failed: dict[str, float] = {}
        #: Image directories whose templates' blobs are being deleted: uploads stop.
        self._deleting: set[str] = set()
        self._scheduled: dict[str, TemplateInfo] = {}
        self._starter: asyncio.Task[None] | None = None

    @classmethod
    def from_settings(
        cls,
        templates: Templates,
        store: BlobStore | None,
        records: ImageUploadStore,
        settings: Settings,
    ) -> TemplateBlobs:
        return cls(templates, store, records if store is not None else None, settings)

    @property
    def enabled(self) -> bool:
        return self.store is not None

    @property
    def _scratch_root(self) -> Path:
        return self.settings.state_dir / "templates" / ".upload"

    # -- start and close ----------------------------------------------------------------

    def start(self) -> None:
        """On the event loop: upload, in the background, every template here whose
        upload is not complete (a stop cut it short, or it was built before a blob
        store was configured); remove packed files no such upload needs."""
        self.uploads.start()
        if self.store is None or self.uploads.closed:
            return
        self._starter = asyncio.create_task(self._resume_uploads(), name="hutch-template-start")

    async def _resume_uploads(self) -> None:
        local = await asyncio.to_thread(self.templates.local)
        keep = {info.key[:16] for info in local}
        root = self._scratch_root
        for d in await asyncio.to_thread(lambda: sorted(root.iterdir()) if root.is_dir() else []):
            if d.name not in keep:
                await asyncio.to_thread(shutil.rmtree, d, True)
        for info in local:
            if info.content is None:
                continue
            try:
                done = await asyncio.to_thread(self.uploaded, info)
            except HutchError as exc:
                log.warning("template %s: cannot tell whether it is uploaded: %s", info.key, exc)
                done = False
            if not done:
                self.schedule(info)

    async def close(self) -> None:
        if self._starter is not None:
            self._starter.cancel()
            await asyncio.gather(self._starter, return_exceptions=True)
        await self.uploads.close()

    # -- upload -------------------------------------------------------------------------

    def schedule(self, info: TemplateInfo) -> None:
        """Upload the template ``info`` in the background (no-op without a store, for a
        template of an image outside the images directory, or while it runs)."""
        if self.store is None or info.content is None:
            return
        self._scheduled[info.key] = info
        self.uploads.schedule(info)

    async def wait_uploaded(self, key: str) -> None:
        """Until the upload of ``key`` under way (if any) has ended."""
        await self.uploads.wait(key)

    def _wanted(self, info: TemplateInfo) -> bool:
        return info.content not in self._deleting and info.path.is_dir()

    def uploaded(self, info: TemplateInfo) -> bool:
        """Its upload is complete: recorded in the database and its index in the store.
        Blocking; ``BlobError`` when the store cannot be asked."""
        if self.store is None or self.records is None or info.content is None:
            return False
        prefix = template_prefix(info.content, info.key)
        return self.records.get(prefix) is not None and self.store.stat(prefix + INDEX) is not None

    async def _upload_once(self, info: TemplateInfo) -> None:
        started = time.monotonic()
        sent = await asyncio.to_thread(self.upload, info)
        if sent is not None:
            log.info(
                "template of %s at %s (key %s) uploaded to %s: %d bytes in %.1f s",
                info.image,
                info.shape,
                info.key[:16],
                self.store.url if self.store else "",
                sent,
                time.monotonic() - started,
            )

    def upload(self, info: TemplateInfo) -> int | None:
        """Upload the template's directory under its prefix, the record in the database
        just before the index; the bytes sent (None: complete already, by this host or
        another). Blocking; ``BlobError``, ``Conflict`` while another host's claim holds
        the prefix (the caller retries), ``OSError``."""
        assert self.store is not None and self.records is not None
        assert info.content is not None
        if self.uploaded(info):
            return None
        store, records = self.store, self.records
        prefix = template_prefix(info.content, info.key)
        claim = UploadClaim(records, prefix, self.host, f"template {prefix}")
        claim.take()
        scratch = self._scratch_root / info.key[:16]
        scratch.mkdir(parents=True, exist_ok=True)

        def put(key: str, path: Path) -> BlobInfo:
            claim.take()

            def still_wanted(_sent: int) -> None:
                if self.uploads.stopping(info.key) or info.content in self._deleting:
                    raise BlobError(f"the upload of template {prefix} was stopped")
                claim.renew_soon()

            still_wanted(0)
            return store.put(key, path, progress=still_wanted)

        def record(index: bytes) -> None:
            claim.take()  # still ours: a claim taken over as stale is another's upload now
            doc = json.loads(index)
            sent = {
                n: FileSum(int(r["size"]), str(r["sha256"]))
                for n, r in [*doc["files"].items(), *((r["name"], r) for r in doc["layers"])]
            }
            meta = {
                "index_sha256": hashlib.sha256(index).hexdigest(),
                "image": info.image,
                "shape": info.shape,
                "inputs": dict(info.inputs),
                "host": self.host,
            }
            records.put(prefix, sent, meta)

        sent = upload_dir(
            store,
            prefix,
            info.path,
            owner=info.key,
            scratch=scratch,
            put=put,
            sparse={MEMORY_FILE},
            before_index=record,
        )
        claim.release()
        shutil.rmtree(scratch, ignore_errors=True)
        return sent

    # -- fetch --------------------------------------------------------------------------

    async def fetch(self, image: ImageArtifacts, shape: Shape) -> Path | None:
        """This host's template for (image, shape) fetched from the store, if the
        database records an upload of this host's key; None (logged when a fetch was
        tried and failed) otherwise: the caller cold-boots. Never raises a store's or
        a check's failure."""
        if self.store is None or self.records is None:
            return None
        try:
            info = await asyncio.to_thread(self.templates.describe, image, shape)
        except OSError as exc:  # the image's files are gone: the create will say so
            log.warning("template of %s: no key for its files: %s", image.name, exc)
            return None
        if info.content is None:
            return None
        failed = self._failed.get(info.key)
        if failed is not None and time.monotonic() - failed < self.fetch_retry_s:
            return None
        prefix = template_prefix(info.content, info.key)
        try:
            record = await asyncio.to_thread(self.records.get, prefix)
        except HutchError as exc:
            log.warning("template of %s at %s: its upload record cannot be read: %s",
                        image.name, info.shape, exc)  # fmt: skip
            return None
        if record is None:
            return None
        lock = self._fetching.setdefault(info.key, asyncio.Lock())
        async with lock:
            found = await asyncio.to_thread(self.templates.find, image, shape)
            if found is not None:
                return found
            started = time.monotonic()
            try:
                path, size = await asyncio.to_thread(self._fetch, image, shape, info, record)
            except (HutchError, OSError) as exc:
                self._failed[info.key] = time.monotonic()
                log.warning(
                    "template of %s at %s (key %s): fetching it from %s failed, so it is "
                    "built here by a cold boot instead: %s",
                    image.name, info.shape, info.key[:16], self.store.url, exc,
                )  # fmt: skip
                return None
        self._failed.pop(info.key, None)
        log.info(
            "template of %s at %s (key %s) fetched from %s: %d bytes in %.2f s, uploaded "
            "by host %s",
            image.name, info.shape, info.key[:16], self.store.url, size,
            time.monotonic() - started, record.meta.get("host", "?"),
        )  # fmt: skip
        return path

    def _fetch(
        self, image: ImageArtifacts, shape: Shape, info: TemplateInfo, record: UploadRecord
    ) -> tuple[Path, int]:
        """Download, check and install (blocking); the template's directory and the
        bytes downloaded."""
        assert self.store is not None and info.content is not None
        index_sha256 = record.meta.get("index_sha256")
        prefix = template_prefix(info.content, info.key)
        if not isinstance(index_sha256, str):
            raise BlobError(f"template {prefix}: its upload record names no index digest")
        staging = self.templates.staging(image, shape)
        try:
            index = fetch_dir(
                self.store,
                prefix,
                staging,
                info.path,
                owner=info.key,
                images_dir=self.settings.images_dir,
                image=image.name,
                index_sha256=index_sha256,
            )
            path = self.templates.install(image, shape, staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return path, sum(int(r["size"]) for r in index["files"].values())

    # -- delete -------------------------------------------------------------------------

    async def delete_content(self, content: str) -> list[str]:
        """Remove every template built on the image directory ``content`` from the store
        and their records (the image's last row is gone); the prefixes removed.
        Uploads of them here stop first. Failures (``HutchError``) are the caller's to
        log: a blob left behind costs storage, and no record names it."""
        if self.store is None or self.records is None:
            return []
        self._deleting.add(content)
        try:
            for key, info in list(self._scheduled.items()):
                if info.content == content:
                    await self.uploads.stop(key)
            return await asyncio.to_thread(self._delete, content)
        finally:
            self._deleting.discard(content)

    def _delete(self, content: str) -> list[str]:
        assert self.store is not None and self.records is not None
        under = f"templates/{content}/"
        blobs = self.store.list_prefix(under)
        # Indexes first: from then on none of them counts as uploaded.
        for blob in sorted(blobs, key=lambda b: not b.key.endswith("/" + INDEX)):
            self.store.delete(blob.key)
        prefixes = sorted({r.prefix for r in self.records.under(under)})
        for prefix in prefixes:
            self.records.delete(prefix)
            self.records.release(prefix, self.host)
        return prefixes
