"""One directory of the images directory under one prefix of the blob store, the part
imported images (``image_blobs``) and built-in images (``builtin_blobs``) share
(:class:`PrefixBlobs`): the upload with a claim and a record, and the verified download
into place.

Upload (:meth:`PrefixBlobs.upload`): claim the prefix for this host in the database
(``ImageUploadStore.claim``: one statement, one winner; another host's claim that is
not stale is a ``Conflict``, which the caller's background task retries), send every
file (``BlobStore.put``: streamed, multipart and resumable on S3), renewing the claim
per file and every ``CLAIM_RENEW_S``, record what was sent in the database
(``image_uploads``) just before the index, then the index (``put_flat``), then release
the claim. An upload is complete when both the record and the index are there
(:meth:`PrefixBlobs.complete`); the record, not the bucket, is what a fetch trusts.

Download (:meth:`PrefixBlobs.stage`): into a fresh ``.<name>.fetch-*`` directory beside
the final one (the same file system), the index and every file checked against the
database's record as it is written (``get_flat``), holes punched back into the sparse
disk images, their identity recorded from the record (no re-hash), the caller's check of
meaning (``image_blob_checks``), read-only. :meth:`PrefixBlobs.install` then puts it in
place with ``replace_dir`` (an atomic exchange with what is there: a crash leaves the old
directory or the new one).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from hutch.errors import BlobError
from hutch.images import identity
from hutch.images.cache import replace_dir
from hutch.services.image_blob_checks import SPARSE, dig_holes
from hutch.services.upload_claims import UploadClaim
from hutch.storage.blobs import BlobStore
from hutch.storage.blobs.flat import FileSum, flat_complete, get_flat, put_flat
from hutch.store.image_uploads import ImageUploadStore, UploadRecord

__all__ = ["PrefixBlobs", "Staged", "image_prefix"]

log = logging.getLogger("hutch.services.blob_prefixes")

T = TypeVar("T")


def image_prefix(rel: str) -> str:
    """The store prefix of the directory ``rel`` under the images directory."""
    return f"images/{rel}/"


@dataclass(frozen=True)
class Staged:
    """A directory downloaded and checked beside its final place, not yet in it."""

    path: Path
    index: dict[str, Any]


class PrefixBlobs:
    """Directories of ``images_dir`` in ``store``, recorded in ``records`` by ``host``."""

    def __init__(
        self,
        store: BlobStore,
        records: ImageUploadStore,
        images_dir: Path,
        scratch: Path,
        host: str,
        *,
        under: str = "",
        closed: Callable[[], bool] = lambda: False,
    ) -> None:
        """``scratch``: where indexes are written before they go; ``under``: what the
        store's names put before a directory's path (``builtin/`` for built-in
        images); ``closed()``: the daemon stops (an upload ends between two parts)."""
        self.store = store
        self.records = records
        self.images_dir = images_dir
        self.scratch = scratch
        self.host = host
        self._under = under
        self._closed = closed

    def rel(self, d: Path) -> str:
        """What names ``d`` in the store: its path under the images directory (after
        ``under``)."""
        return self._under + d.relative_to(self.images_dir).as_posix()

    def prefix(self, d: Path) -> str:
        return image_prefix(self.rel(d))

    def record(self, d: Path) -> UploadRecord | None:
        """The database's record of the upload of ``d`` (no store request)."""
        return self.records.get(self.prefix(d))

    def complete(self, d: Path) -> bool:
        """The upload of ``d`` is complete: its record and its index are there.
        Blocking (a stat in the store); ``BlobError`` when the store cannot be asked."""
        prefix = self.prefix(d)
        return self.records.get(prefix) is not None and flat_complete(self.store, prefix)

    # -- upload ---------------------------------------------------------------------------

    def upload(self, d: Path, meta: Mapping[str, Any]) -> int | None:
        """Upload every file of ``d`` (dot files and directories are this host's own)
        under its prefix with ``meta`` in the index; the bytes sent, None when its
        upload is complete already. Blocking; ``BlobError``, and ``Conflict`` while
        another host's claim holds the prefix."""
        rel, prefix = self.rel(d), self.prefix(d)
        if self.complete(d):
            return None
        claim = UploadClaim(self.records, prefix, self.host, rel)
        claim.take()
        files = {
            f.name: f for f in sorted(d.iterdir()) if f.is_file() and not f.name.startswith(".")
        }

        def record(sent: dict[str, FileSum]) -> None:
            # Still ours (renewed): a claim taken over as stale is another's upload now.
            claim.take()
            self.records.put(prefix, sent, dict(meta))

        index = put_flat(
            self.store,
            prefix,
            files,
            owner=rel,
            scratch=self.scratch,
            meta=meta,
            put=lambda key, path: self._put(key, path, claim),
            before_index=record,
        )
        claim.release()  # complete: the record and index are the truth
        return sum(int(r["size"]) for r in index["files"].values())

    def _put(self, key: str, path: Path, claim: UploadClaim) -> Any:
        """One blob; stops between parts once the daemon closes (a thread cannot be
        cancelled); renews ``claim`` now and then (a large file)."""
        claim.take()

        def still_wanted(_sent: int) -> None:
            if self._closed():
                raise BlobError(f"the daemon stopped during the upload of {key}")
            claim.renew_soon()

        return self.store.put(key, path, progress=still_wanted)

    def delete(self, d: Path) -> None:
        """Remove the blobs under ``d``'s prefix: the index first (it stops counting as
        uploaded), the files, then the record (one a crash leaves is replaced by the
        next upload) and this host's claim. Blocking."""
        prefix = self.prefix(d)
        self.store.delete(prefix + "index.json")
        for blob in self.store.list_prefix(prefix):
            self.store.delete(blob.key)
        self.records.delete(prefix)
        # An upload of it cut short here leaves no claim to hold another host off.
        self.records.release(prefix, self.host)

    # -- download -------------------------------------------------------------------------

    def stage(
        self, final: Path, what: str, record: UploadRecord, check: Callable[[Path], None]
    ) -> Staged | None:
        """Download ``final``'s upload into a new directory beside it, verified against
        ``record`` (its index and every file), ``check`` it and make it read-only; None:
        not in the store (no index). ``BlobError`` (naming ``what``) when the store
        fails or a blob or ``check`` refuses it; nothing is left behind then."""
        store, rel = self.store, self.rel(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.fetch-", dir=final.parent))
        try:
            index = self.wrapped(
                what,
                lambda: get_flat(store, image_prefix(rel), staging, owner=rel, expect=record.files),
            )
            if index is None:
                shutil.rmtree(staging, ignore_errors=True)
                return None
            for f in staging.iterdir():
                if f.name in SPARSE:
                    dig_holes(f)
                    # Its identity, from the record it was checked against: no re-hash.
                    identity.record(f, record.files[f.name].sha256)
            check(staging)
            for f in staging.iterdir():
                if not f.name.startswith("."):
                    os.chmod(f, 0o444)
            staging.chmod(0o755)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return Staged(staging, index)

    def install(self, staged: Staged, final: Path, *, keep: tuple[str, ...] = ()) -> None:
        """Put ``staged`` at ``final`` (the caller holds ``final``'s lock): exchanged in
        one step with what is there (an incomplete copy, or one being adopted), whose
        entries ``keep`` (an imported image's ``refs/``: this host's rows on it) move
        over first; the old directory is then removed."""
        moved: list[str] = []
        try:
            for name in keep:
                if (final / name).exists():
                    os.rename(final / name, staged.path / name)
                    moved.append(name)
            old = replace_dir(staged.path, final)
        except BaseException:
            for name in moved:  # back where they were: the old copy stays whole
                with contextlib.suppress(OSError):
                    os.rename(staged.path / name, final / name)
            shutil.rmtree(staged.path, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def wrapped(self, what: str, call: Callable[[], T]) -> T:
        """``call()``, its ``BlobError`` (unreachable store, a blob failing its check)
        re-raised naming the image it was for."""
        try:
            return call()
        except BlobError as exc:
            raise BlobError(f"{what}: fetching it from the blob store failed: {exc}") from exc
