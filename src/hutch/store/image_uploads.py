"""The image uploads table (migration 15). Same database and transactions as
``hutch.store.db``.

A row is what a host put in the blob store under one prefix (an image's content,
``images/oci/sha256-<hex>/``, a boot set, ``images/oci-boot/<key>/``, or a template,
``templates/<image dir>/<key>/``): each file's size and sha256 as that host computed
them while sending its own files, and the meta of the index it wrote. It is the trusted
side of a fetch: the index in the bucket must say the same, so that whoever can write
the bucket alone cannot swap a file and its index.

A claim (migration 17) is which host uploads under a prefix now: :meth:`claim` is one
statement, so of two hosts asking at once exactly one gets it; its holder renews it
while it sends and releases it once the upload is complete (the record and the index
are then the truth). A claim not renewed for ``CLAIM_STALE_S`` (an hour) is stale: its
host died or lost the store mid-upload, and another host may take it over.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from hutch.models import FileSum
from hutch.store.db import Store

__all__ = ["CLAIM_STALE_S", "Claim", "ImageUploadStore", "UploadRecord"]

#: Seconds after which a claim that was not renewed may be taken over by another host.
CLAIM_STALE_S = 3600.0


@dataclass(frozen=True)
class UploadRecord:
    prefix: str
    files: dict[str, FileSum]
    meta: dict[str, Any]
    uploaded_at: float


@dataclass(frozen=True)
class Claim:
    prefix: str
    host: str
    claimed_at: float  # epoch seconds, renewed by its holder while it uploads


class ImageUploadStore:
    def __init__(self, store: Store) -> None:
        self._store = store

    def put(self, prefix: str, files: dict[str, FileSum], meta: dict[str, Any]) -> None:
        """Record (or replace: the last upload's bytes are the ones in the bucket) what
        was sent under ``prefix``."""
        files_json = json.dumps(
            {n: {"size": f.size, "sha256": f.sha256} for n, f in sorted(files.items())}
        )
        with self._store.transaction() as db:
            db.execute(
                "INSERT INTO image_uploads (prefix, files_json, meta_json, uploaded_at) "
                "VALUES (?, ?, ?, ?) ON CONFLICT (prefix) DO UPDATE SET "
                "files_json = excluded.files_json, meta_json = excluded.meta_json, "
                "uploaded_at = excluded.uploaded_at",
                (prefix, files_json, json.dumps(meta, sort_keys=True), time.time()),
            )

    def get(self, prefix: str) -> UploadRecord | None:
        with self._store.transaction() as db:
            r = db.execute(
                "SELECT prefix, files_json, meta_json, uploaded_at FROM image_uploads "
                "WHERE prefix = ?",
                (prefix,),
            ).fetchone()
        if r is None:
            return None
        files = {n: FileSum(int(f["size"]), str(f["sha256"])) for n, f in json.loads(r[1]).items()}
        return UploadRecord(r[0], files, json.loads(r[2]), float(r[3]))

    def under(self, prefix: str) -> list[UploadRecord]:
        """Every record whose prefix starts with ``prefix`` (the templates of one
        image's content: ``templates/<image dir>/``), by prefix."""
        with self._store.transaction() as db:
            rows = db.execute(
                "SELECT prefix FROM image_uploads WHERE substr(prefix, 1, ?) = ? ORDER BY prefix",
                (len(prefix), prefix),
            ).fetchall()
        found = [self.get(str(r[0])) for r in rows]
        return [r for r in found if r is not None]

    def delete(self, prefix: str) -> None:
        with self._store.transaction() as db:
            db.execute("DELETE FROM image_uploads WHERE prefix = ?", (prefix,))

    # -- claims ---------------------------------------------------------------------------

    def claim(
        self, prefix: str, host: str, *, now: float | None = None, stale_s: float = CLAIM_STALE_S
    ) -> bool:
        """Claim the upload under ``prefix`` for ``host`` (or renew its own claim); True
        when ``host`` holds it now. Another host's claim younger than ``stale_s`` keeps
        it (False); an older one is taken over. ``now``: epoch seconds (tests)."""
        at = time.time() if now is None else now
        with self._store.transaction() as db:
            db.execute(
                "INSERT INTO image_upload_claims (prefix, host, claimed_at) VALUES (?, ?, ?) "
                "ON CONFLICT (prefix) DO UPDATE SET host = excluded.host, "
                "claimed_at = excluded.claimed_at "
                "WHERE image_upload_claims.host = excluded.host "
                "OR image_upload_claims.claimed_at < ?",
                (prefix, host, at, at - stale_s),
            )
            r = db.execute(
                "SELECT host FROM image_upload_claims WHERE prefix = ?", (prefix,)
            ).fetchone()
        return r is not None and str(r[0]) == host

    def claimant(self, prefix: str) -> Claim | None:
        """Who claims the upload under ``prefix`` (None: nobody)."""
        with self._store.transaction() as db:
            r = db.execute(
                "SELECT prefix, host, claimed_at FROM image_upload_claims WHERE prefix = ?",
                (prefix,),
            ).fetchone()
        return None if r is None else Claim(str(r[0]), str(r[1]), float(r[2]))

    def release(self, prefix: str, host: str) -> None:
        """Drop ``host``'s claim on ``prefix`` (another host's stays)."""
        with self._store.transaction() as db:
            db.execute(
                "DELETE FROM image_upload_claims WHERE prefix = ? AND host = ?", (prefix, host)
            )
