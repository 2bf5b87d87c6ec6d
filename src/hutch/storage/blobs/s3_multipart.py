"""Resumable multipart uploads to S3 (:func:`put_multipart`, for ``S3BlobStore.put``):
the journal that lets a crashed or cut upload continue, and the parts, sent side by side
and recorded in order (see ``s3.py``'s docstring for the whole flow)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hutch.errors import BlobError
from hutch.storage.blobs.base import BlobInfo, Progress

if TYPE_CHECKING:
    from hutch.storage.blobs.s3 import S3BlobStore

__all__ = ["UploadJournal", "put_multipart"]

log = logging.getLogger("hutch.storage.blobs.s3")


@dataclass
class UploadJournal:
    """The durable record of one multipart upload in progress (one JSON file)."""

    bucket: str
    key: str
    upload_id: str
    source: str
    size: int
    mtime_ns: int
    part_size: int
    started: float
    parts: dict[int, str] = field(default_factory=dict)  # part number -> ETag

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        data = {**self.__dict__, "parts": {str(n): e for n, e in self.parts.items()}}
        with tmp.open("w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)

    @classmethod
    def load(cls, path: Path) -> UploadJournal | None:
        try:
            data = json.loads(path.read_text())
            data["parts"] = {int(n): str(e) for n, e in data.get("parts", {}).items()}
            return cls(**data)
        except (OSError, ValueError, TypeError):
            return None


def put_multipart(
    store: S3BlobStore,
    key: str,
    full: str,
    source: Path,
    st: os.stat_result,
    part_size: int,
    progress: Progress | None,
) -> BlobInfo:
    what = f"storing blob {key} in {store.url}"
    store.journal_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    jpath = store.journal_path(full)
    journal = UploadJournal.load(jpath)
    server_parts: dict[int, tuple[int, str]] = {}
    if journal is not None:
        same = (
            journal.key == full
            and journal.bucket == store.bucket
            and journal.source == str(source)
            and journal.size == st.st_size
            and journal.mtime_ns == st.st_mtime_ns
            and journal.part_size == part_size
        )
        if same:
            try:
                server_parts = store._list_parts(full, journal.upload_id, what)
                log.info(
                    "blob %s: continuing upload %s (%d parts on the server)",
                    key,
                    journal.upload_id,
                    len(server_parts),
                )
            except BlobError as exc:
                if not store._missing(exc):
                    raise
                journal = None  # the server no longer has it: start again
        else:
            store._abort(full, journal.upload_id)
            journal = None
    if journal is None:
        created = store._call(
            what,
            lambda: store._client.create_multipart_upload(Bucket=store.bucket, Key=full),
        )
        journal = UploadJournal(
            bucket=store.bucket,
            key=full,
            upload_id=str(created["UploadId"]),
            source=str(source),
            size=st.st_size,
            mtime_ns=st.st_mtime_ns,
            part_size=part_size,
            started=time.time(),
        )
        journal.save(jpath)
    digest = hashlib.sha256()
    done: list[dict[str, Any]] = []
    sent = 0
    # Parts go up side by side (one request leaves the server and the network idle
    # between parts); they are read and hashed in order here, and the journal and
    # ``progress`` see them complete in order, so a crash or a stop resumes as before.
    in_flight: deque[tuple[int, int, Future[str]]] = deque()
    ahead = max(1, store.options.parallel_parts)

    def finish_oldest() -> None:
        nonlocal sent
        number, size, future = in_flight.popleft()
        etag = future.result()
        if etag != journal.parts.get(number):
            journal.parts[number] = etag
            journal.save(jpath)
        done.append({"PartNumber": number, "ETag": etag})
        sent += size
        if progress is not None:
            progress(sent)

    pool = ThreadPoolExecutor(ahead, thread_name_prefix="hutch-s3-part")
    try:
        with source.open("rb") as f:
            number = 0
            while True:
                body = f.read(part_size)
                if not body and number > 0:
                    break
                number += 1
                digest.update(body)
                on_server = server_parts.get(number)
                in_flight.append(
                    (
                        number,
                        len(body),
                        pool.submit(_part, store, full, journal, number, body, on_server, what),
                    )
                )
                while len(in_flight) >= ahead:
                    finish_oldest()
                if len(body) < part_size:
                    break
        while in_flight:
            finish_oldest()
    finally:
        # A failed part (or a stop) ends the upload: parts not begun are dropped, the
        # ones under way are waited for (their thread cannot be cut).
        pool.shutdown(wait=True, cancel_futures=True)
    upload_id = journal.upload_id
    store._call(
        what,
        lambda: store._client.complete_multipart_upload(
            Bucket=store.bucket,
            Key=full,
            UploadId=upload_id,
            MultipartUpload={"Parts": done},
        ),
    )
    stored = store._stat(key)  # part of this transfer: no first contact again
    if stored is None or stored.size != st.st_size:
        raise BlobError(
            f"{what}: the server holds {stored.size if stored else 'no'} bytes after the "
            f"upload, {st.st_size} were sent"
        )
    jpath.unlink(missing_ok=True)
    return BlobInfo(key, st.st_size, digest.hexdigest())


def _part(
    store: S3BlobStore,
    full: str,
    journal: UploadJournal,
    number: int,
    body: bytes,
    on_server: tuple[int, str] | None,
    what: str,
) -> str:
    md5 = hashlib.md5(body, usedforsecurity=False).hexdigest()
    if on_server is not None and on_server == (len(body), md5):
        return f'"{md5}"'
    upload_id = journal.upload_id
    answer = store._call(
        f"{what} (part {number})",
        lambda: store._client.upload_part(
            Bucket=store.bucket,
            Key=full,
            UploadId=upload_id,
            PartNumber=number,
            Body=body,
        ),
    )
    return str(answer["ETag"])
