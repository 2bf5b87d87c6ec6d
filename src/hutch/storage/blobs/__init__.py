"""Blob stores: immutable files by key in a local directory or an S3-compatible bucket.

``HUTCH_BLOB_URL`` picks one (:func:`open_blob_store`; the daemon's services share the
one :func:`blob_store_from_settings` opens):

- unset: ``<state_dir>/blobs`` (a directory on this host);
- ``file:///absolute/path``: a directory (several daemons on one machine may share it);
- ``s3://bucket[/prefix]``: a bucket, with ``HUTCH_S3_ENDPOINT`` (MinIO, R2, SeaweedFS;
  unset: AWS) and the standard ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
  ``AWS_REGION`` (see :mod:`hutch.storage.blobs.s3`).

The seam is :class:`BlobStore` (``base.py``); what is stored where is the caller's
(``hutch.services.snapshot_blobs`` for named snapshots).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from hutch.config import ACCEPTED_BLOB_URLS as ACCEPTED_URLS
from hutch.config import Settings, check_blob_url
from hutch.storage.blobs.base import BlobInfo, BlobStore, Progress, check_key, file_sha256
from hutch.storage.blobs.local import LocalBlobStore
from hutch.storage.blobs.s3 import DEFAULT_PART_SIZE, S3BlobStore, S3Options

__all__ = [
    "ACCEPTED_URLS",
    "DEFAULT_PART_SIZE",
    "BlobInfo",
    "BlobStore",
    "LocalBlobStore",
    "Progress",
    "S3BlobStore",
    "S3Options",
    "blob_store_from_settings",
    "check_blob_url",
    "check_key",
    "file_sha256",
    "open_blob_store",
]


def open_blob_store(
    url: str | None,
    *,
    state_dir: Path,
    s3_endpoint: str | None = None,
    part_size: int = DEFAULT_PART_SIZE,
    retry_s: float = 60.0,
    connect_timeout_s: float = 5.0,
) -> BlobStore:
    """The store ``url`` names (None or empty: ``<state_dir>/blobs``). S3 upload
    journals go in ``<state_dir>/blob-uploads``. Raises ``InvalidArgument`` for a URL
    it does not accept and ``BlobError`` for an invalid bucket name; it does not
    contact the store (:meth:`BlobStore.check` does). ``connect_timeout_s``
    (``HUTCH_S3_CONNECT_TIMEOUT_S``): how long an S3 operation waits for an endpoint that
    has not answered yet before it fails; ``retry_s``: its patience once it has."""
    if not url:
        return LocalBlobStore(state_dir / "blobs")
    check_blob_url(url)
    parts = urlsplit(url)
    if parts.scheme == "file":
        return LocalBlobStore(Path(parts.path))
    return S3BlobStore(
        parts.netloc,
        parts.path.strip("/"),
        state_dir / "blob-uploads",
        S3Options(
            endpoint=s3_endpoint or None,
            part_size=part_size,
            retry_s=retry_s,
            connect_timeout_s=connect_timeout_s,
        ),
    )


def blob_store_from_settings(settings: Settings) -> BlobStore | None:
    """The store ``HUTCH_BLOB_URL`` names, with ``HUTCH_S3_ENDPOINT`` and
    ``HUTCH_S3_CONNECT_TIMEOUT_S``; None when it is unset: images, snapshots and pauses
    then stay on their host (not mirrored to ``<state_dir>/blobs`` on the same disk,
    which would only double them). Raises as :func:`open_blob_store`."""
    if not settings.blob_url:
        return None
    return open_blob_store(
        settings.blob_url,
        state_dir=settings.state_dir,
        s3_endpoint=settings.s3_endpoint,
        connect_timeout_s=settings.s3_connect_timeout_s,
    )
