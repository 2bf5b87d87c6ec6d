"""One content per digest on every host, for imported images (:class:`ContentAdoption`):
a host whose copy of ``oci/sha256-<hex>/`` holds other ``rootfs.ext4`` bytes than the
complete upload recorded in the database replaces it by that upload.

Why: two hosts importing one digest derive other rootfs bytes (mkfs is not
reproducible), and a frozen VM state opens only over the bytes it was taken on
(``blob_dirs``: ``ImageMismatch``). The first complete upload of a prefix wins (the
claims of ``blob_prefixes``), every other host adopts it.

An adoption holds the content's lock (imports and fetches of it) and its ``.use`` lock
without waiting (a create between its fetch and its row: ``Conflict``), asks
``in_use`` (a live sandbox here, a snapshot whose files are here, a template, a build
cache: ``Conflict`` naming it, the copy untouched), then fetches and checks the upload
as any fetch and exchanges it in (its ``refs/`` kept: this host's rows on it).
Built-in images converge by their own rules (``builtin_blobs``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from hutch.errors import Conflict, ImageMissing
from hutch.images import identity
from hutch.images.cache import file_lock
from hutch.images.oci.importer import content_dir, load_content
from hutch.services.blob_cache import unused_content
from hutch.services.blob_prefixes import PrefixBlobs
from hutch.services.image_blob_checks import check_content
from hutch.store.image_uploads import UploadRecord

__all__ = ["ContentAdoption", "differs_from_upload"]

log = logging.getLogger("hutch.services.image_adoption")


def differs_from_upload(rootfs: Path, record: UploadRecord | None) -> bool:
    """``rootfs`` (this host's copy) holds other bytes than the upload ``record`` names
    (its identity: recorded when the copy was made, so no re-hash); False without a
    record to compare with. ``OSError`` when the file cannot be read."""
    theirs = record.files.get("rootfs.ext4") if record is not None else None
    return theirs is not None and identity.identity(rootfs) != theirs.sha256


class ContentAdoption:
    """Imported content on this host made the upload's (see the module docstring)."""

    def __init__(self, prefixes: PrefixBlobs, missing: Callable[[str, str], ImageMissing]) -> None:
        """``missing(digest, what)``: the error for a content with no complete upload."""
        self.prefixes = prefixes
        self._missing = missing
        #: What on this host uses a digest's content (None: nothing), asked before an
        #: adoption replaces it; unset: nothing is known to (a test, one host's images).
        self.in_use: Callable[[str], str | None] | None = None

    @property
    def images_dir(self) -> Path:
        return self.prefixes.images_dir

    def same_as_uploaded(self, digest: str) -> bool:
        """This host's copy of ``digest`` holds the bytes of the upload recorded in the
        database, or there is no record (or no copy) to compare with. Blocking."""
        final = content_dir(self.images_dir, digest)
        if load_content(final) is None:
            return True
        return not differs_from_upload(final / "rootfs.ext4", self.prefixes.record(final))

    def adopt(self, digest: str, what: str) -> bool:
        """Replace this host's copy of ``digest`` by the complete upload in the blob
        store (fetched and checked as any fetch), keeping its ``refs/``; True if
        replaced, False if it is that upload already. Blocking. ``Conflict`` while
        something on this host uses the copy (``in_use``, or a create holding its
        ``.use`` lock): nothing is changed then; ``ImageMissing`` / ``BlobError`` as a
        fetch, the copy kept."""
        prefixes = self.prefixes
        final = content_dir(self.images_dir, digest)
        final.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(final.parent / f"{final.name}.lock"), unused_content(final) as free:
            if self.same_as_uploaded(digest):
                return False
            user = "a create" if not free else (self.in_use(digest) if self.in_use else None)
            if user is not None:
                raise Conflict(
                    f"{what}: this host's copy holds other bytes than its upload in the "
                    f"blob store {prefixes.store.url}, and {user} here uses it; it is "
                    "replaced by the uploaded copy once nothing here does"
                )
            record = prefixes.record(final)
            if record is None:
                raise self._missing(digest, what)
            staged = prefixes.stage(final, what, record, lambda d: check_content(d, digest, what))
            if staged is None:
                raise self._missing(digest, what)
            prefixes.install(staged, final, keep=("refs",))
        log.info("%s (%s): this host's copy replaced by the upload in %s (the same bytes "
                 "on every host)", what, digest, prefixes.store.url)  # fmt: skip
        return True
