"""The image uploads table (migration 15). Same database and transactions as
``hutch.store.db``.

A row is what a host put in the blob store under one prefix (an image's content,
``images/oci/sha256-<hex>/``, or a boot set, ``images/oci-boot/<key>/``): each file's
size and sha256 as that host computed them while sending its own files, and the meta of
the index it wrote. It is the trusted side of a fetch: the index in the bucket must say
the same, so that whoever can write the bucket alone cannot swap a file and its index.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from hutch.models import FileSum
from hutch.store.db import Store

__all__ = ["ImageUploadStore", "UploadRecord"]


@dataclass(frozen=True)
class UploadRecord:
    prefix: str
    files: dict[str, FileSum]
    meta: dict[str, Any]
    uploaded_at: float


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

    def delete(self, prefix: str) -> None:
        with self._store.transaction() as db:
            db.execute("DELETE FROM image_uploads WHERE prefix = ?", (prefix,))
