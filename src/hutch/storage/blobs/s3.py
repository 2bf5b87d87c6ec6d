"""Blobs in an S3-compatible bucket (``s3://bucket/prefix``): AWS S3, MinIO, R2,
SeaweedFS, Ceph RGW, ...

Client: boto3, for its low-level multipart calls. A resumable upload needs the upload
id and the parts the server holds (CreateMultipartUpload, UploadPart, ListParts,
CompleteMultipartUpload, AbortMultipartUpload, ListMultipartUploads), which boto3
exposes one to one; obstore's multipart writer keeps the upload id to itself, so an
upload cut by a crash could only start again from byte 0.

Uploads (``put``):
```
  source file ─► size < part_size? ─► PutObject (streamed from the file)
      else ─► journal <journal_dir>/<hash(bucket/key)>.json {upload_id, source, size,
              mtime_ns, part_size, parts}: written (fsync) before the first part
           ─► for each part (read from the file, part_size bytes at a time, hashed
              into the object's sha256 as read; up to parallel_parts (4) in flight,
              the journal and progress updated as they complete, in order):
                 the server lists it (ListParts) with this size and ETag = md5 of our
                 bytes? skip it : UploadPart (retried while the server is away, up to
                 retry_s), journal updated
           ─► CompleteMultipartUpload ─► HeadObject: size checked ─► journal removed
```
Downloads (``get``): one streamed GET up to ``range_size`` (8 MiB); larger objects in
ranged GETs side by side (``parallel_parts`` at a time), hashed in order and verified
before the rename (:mod:`hutch.storage.blobs.s3_ranges`).

First contact (``_reach``): while the endpoint has not answered since the store was
opened or since a request last failed to connect, each operation first sends one HEAD
of the bucket through a second, impatient client (connect timeout at most 2 s, no
botocore retries), retried for up to ``connect_timeout_s`` (5 s): a wrong
``HUTCH_S3_ENDPOINT`` or a server that is down fails a user's request within seconds
instead of after ``retry_s`` plus botocore's own retries. Any answer (403 and 404
included) or a slow one (a read timeout: the connection was accepted) ends it, and the
operation's own requests then get the full patience: a server that restarts during a
transfer, or answers slowly, is waited for as before. Background uploads retry in their
own loops (``hutch.services.snapshot_blobs``, ``image_blobs``).

A ``put`` of the same key and unchanged file (size, mtime) after a crash, or after the
server went away for longer than ``retry_s``, finds the journal and continues the same
upload: the parts already there are checked against the file (md5 = their ETag) and not
sent again. ``abort_uploads`` ends uploads nobody finished (journals whose file is gone,
uploads in the bucket older than the given age: another host may be uploading the
younger ones).

Credentials and region come from boto3's standard chain (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``/``AWS_DEFAULT_REGION``,
``~/.aws``, instance roles); the endpoint from ``HUTCH_S3_ENDPOINT`` (else AWS). With an
endpoint, path-style addressing (MinIO, SeaweedFS and R2 accept it; no DNS per bucket).
Request checksums are sent only where S3 requires them: botocore's default CRC32
trailers (aws-chunked bodies) are refused by several S3-compatible servers.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from hutch.config import S3_BUCKET_RE
from hutch.errors import BlobError
from hutch.storage.blobs.base import (
    CHUNK,
    BlobInfo,
    Progress,
    check_key,
    verified_write,
)
from hutch.storage.blobs.s3_multipart import UploadJournal, put_multipart
from hutch.storage.blobs.s3_ranges import DEFAULT_RANGE_SIZE, content_range_total, ranged_get

__all__ = ["DEFAULT_PART_SIZE", "MIN_PART_SIZE", "S3BlobStore", "S3Options", "UploadJournal"]

log = logging.getLogger(__name__)

#: S3's smallest part (all but the last); its largest part count is 10,000.
MIN_PART_SIZE = 5 << 20
DEFAULT_PART_SIZE = 16 << 20
DEFAULT_PARALLEL_PARTS = 4
MAX_PARTS = 10_000
#: Seconds one first-contact attempt waits for the TCP connection (at most).
_PROBE_CONNECT_S = 2.0
#: botocore's own retries: the requests' (4 attempts), first contact's (1: ours decide).
_RETRIES: Any = {"max_attempts": 3, "mode": "standard"}
_PROBE_RETRIES: Any = {"total_max_attempts": 1, "mode": "standard"}
_T = TypeVar("_T")


@dataclass(frozen=True)
class S3Options:
    """How to reach the bucket. ``endpoint`` None: AWS. ``retry_s``: how long one
    request is retried while the server cannot be reached or answers 5xx, once it has
    answered. ``connect_timeout_s``: how long an operation waits, in all, for an
    endpoint that has not answered yet (or whose last request failed to connect)
    before it fails with a ``BlobError`` naming the endpoint."""

    endpoint: str | None = None
    region: str | None = None
    part_size: int = DEFAULT_PART_SIZE
    #: Parts of one multipart upload sent at the same time (each holds one part in
    #: memory), and byte ranges of one large download fetched at the same time.
    parallel_parts: int = DEFAULT_PARALLEL_PARTS
    #: Bytes per ranged GET of a download larger than this (``s3_ranges``).
    range_size: int = DEFAULT_RANGE_SIZE
    retry_s: float = 60.0
    connect_timeout_s: float = 5.0
    access_key: str | None = None
    secret_key: str | None = None


class S3BlobStore:
    def __init__(
        self, bucket: str, prefix: str, journal_dir: Path, options: S3Options | None = None
    ) -> None:
        if not S3_BUCKET_RE.match(bucket):
            raise BlobError(
                f"s3 bucket name {bucket!r} is not valid; accepted: 3-63 characters of "
                "lower-case letters, digits, '.' and '-', starting and ending with a letter "
                "or digit"
            )
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.journal_dir = journal_dir
        self.options = options or S3Options()
        if self.options.part_size < MIN_PART_SIZE:
            raise BlobError(
                f"s3 part size {self.options.part_size} is below S3's minimum {MIN_PART_SIZE}"
            )
        if not self.options.connect_timeout_s > 0:
            raise BlobError(
                f"s3 first-contact timeout {self.options.connect_timeout_s:g} s: it must be "
                "more than 0 (HUTCH_S3_CONNECT_TIMEOUT_S)"
            )
        where = f" at {self.options.endpoint}" if self.options.endpoint else ""
        self.url = f"s3://{bucket}/{self.prefix}{where}"
        self._client = self._make_client()
        #: First contact only (``_reach``): one attempt per request, a short connect.
        self._probe_connect_s = min(_PROBE_CONNECT_S, self.options.connect_timeout_s)
        self._probe = self._make_client(probe=True)
        # Whether the endpoint answered the last request sent to it. Worker threads
        # share the store (boto3 clients are thread-safe); the flag is theirs too.
        self._lock = threading.Lock()
        self._answered = False

    def _make_client(self, *, probe: bool = False) -> Any:
        """boto3's client; ``probe``: the impatient one of first contact (one attempt,
        the connect and the answer each bounded by the first-contact budget)."""
        import boto3  # imported here: the daemon without S3 never loads it (~0.3 s)
        from botocore.config import Config

        opts = self.options
        config = Config(
            s3={"addressing_style": "path" if opts.endpoint else "auto"},
            retries=_PROBE_RETRIES if probe else _RETRIES,
            connect_timeout=self._probe_connect_s if probe else 5,
            read_timeout=opts.connect_timeout_s if probe else 60,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        session = boto3.session.Session()
        region = opts.region or session.region_name or "us-east-1"
        return session.client(
            "s3",
            endpoint_url=opts.endpoint,
            region_name=region,
            aws_access_key_id=opts.access_key,
            aws_secret_access_key=opts.secret_key,
            config=config,
        )

    # -- plumbing -----------------------------------------------------------------------

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        """Run one request; retried while the server is unreachable or failing (5xx),
        for up to ``retry_s``; every failure becomes a ``BlobError`` saying what to do."""
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectionError,
            NoCredentialsError,
            ReadTimeoutError,
        )

        started = time.monotonic()
        deadline = started + self.options.retry_s
        delay = 0.2
        while True:
            try:
                answer = fn()
                self._set_answered(True)
                return answer
            except NoCredentialsError as exc:
                raise BlobError(
                    f"{what}: no S3 credentials; set AWS_ACCESS_KEY_ID and "
                    f"AWS_SECRET_ACCESS_KEY for {self.url}"
                ) from exc
            except ClientError as exc:
                code = str(exc.response.get("Error", {}).get("Code", ""))
                status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
                self._set_answered(True)
                if status >= 500 and time.monotonic() < deadline:
                    time.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                raise BlobError(f"{what}: {self._explain(code, status, exc)}") from exc
            except (ConnectionError, ReadTimeoutError) as exc:
                if isinstance(exc, ConnectionError):
                    self._set_answered(False)  # the next operation makes first contact
                if time.monotonic() < deadline:
                    time.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                waited = time.monotonic() - started
                raise BlobError(self._unreachable(what, exc, waited)) from exc
            except BotoCoreError as exc:
                raise BlobError(f"{what}: {exc}") from exc

    def _set_answered(self, answered: bool) -> None:
        with self._lock:
            self._answered = answered

    def _reach(self, what: str) -> None:
        """First contact: return at once if the endpoint answered the last request;
        else HEAD the bucket with the impatient client until it answers (any status) or
        accepts the connection and is slow (a read timeout), retried for up to
        ``connect_timeout_s`` in all; past that, a ``BlobError`` naming the endpoint.
        Errors other than not connecting are left to the operation's own requests,
        which say what to change (credentials, bucket)."""
        with self._lock:
            if self._answered:
                return
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectionError,
            HTTPClientError,
        )

        started = time.monotonic()
        deadline = started + self.options.connect_timeout_s
        delay = 0.1
        while True:
            try:
                self._probe.head_bucket(Bucket=self.bucket)
            except (ClientError, HTTPClientError):
                pass  # an answer (403, 404, ...) or a connection accepted and then slow
            except ConnectionError as exc:
                # Another attempt only if it can end within the budget: the whole wait
                # is at most connect_timeout_s, whatever the endpoint does.
                if time.monotonic() + delay + self._probe_connect_s <= deadline:
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                waited = time.monotonic() - started
                raise BlobError(self._unreachable(what, exc, waited)) from exc
            except BotoCoreError:
                return  # no credentials, ...: the operation's own request names it
            self._set_answered(True)
            return

    def _unreachable(self, what: str, exc: Exception, waited_s: float) -> str:
        endpoint = self.options.endpoint or "AWS S3 (HUTCH_S3_ENDPOINT is unset)"
        return (
            f"{what}: cannot reach the S3 endpoint {endpoint} (tried for {waited_s:.1f} s: "
            f"{exc}); check HUTCH_S3_ENDPOINT and that the server is up and listening there"
        )

    def _explain(self, code: str, status: int, exc: Exception) -> str:
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied") or status in (
            401,
            403,
        ):
            return (
                f"{self.url} refused the credentials ({code or status}); check "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY and the bucket's policy"
            )
        if code == "NoSuchBucket":
            return f"there is no bucket {self.bucket!r} at {self.url}; create it first"
        return str(exc)

    @staticmethod
    def _missing(exc: BaseException) -> bool:
        cause = exc.__cause__
        response = getattr(cause, "response", None)
        if not isinstance(response, dict):
            return False
        code = str(response.get("Error", {}).get("Code", ""))
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
        return code in ("404", "NoSuchKey", "NotFound", "NoSuchUpload") or status == 404

    # -- the store ----------------------------------------------------------------------

    def check(self) -> None:
        self._reach(f"checking the blob store {self.url}")
        self._call(
            f"checking the blob store {self.url}",
            lambda: self._client.head_bucket(Bucket=self.bucket),
        )

    def put(self, key: str, source: Path, *, progress: Progress | None = None) -> BlobInfo:
        full = self._key(key)
        try:
            st = source.stat()
        except OSError as exc:
            raise BlobError(f"storing blob {key}: cannot read {source}: {exc}") from exc
        self._reach(f"storing blob {key} in {self.url}")
        part_size = self._part_size(st.st_size)
        if st.st_size < part_size:
            return self._put_small(key, full, source, progress)
        return self._put_multipart(key, full, source, st, part_size, progress)

    def _part_size(self, size: int) -> int:
        part = self.options.part_size
        if size > part * MAX_PARTS:
            part = -(-size // MAX_PARTS)
            part = -(-part // (1 << 20)) << 20
        return part

    def _put_small(self, key: str, full: str, source: Path, progress: Progress | None) -> BlobInfo:
        digest = hashlib.sha256()
        with source.open("rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        size = source.stat().st_size

        def send() -> Any:
            with source.open("rb") as f:
                return self._client.put_object(Bucket=self.bucket, Key=full, Body=f)

        self._call(f"storing blob {key} in {self.url}", send)
        if progress is not None:
            progress(size)
        return BlobInfo(key, size, digest.hexdigest())

    def journal_path(self, full: str) -> Path:
        name = hashlib.sha256(f"{self.bucket}/{full}".encode()).hexdigest()[:32]
        return self.journal_dir / f"{name}.json"

    def _put_multipart(
        self,
        key: str,
        full: str,
        source: Path,
        st: os.stat_result,
        part_size: int,
        progress: Progress | None,
    ) -> BlobInfo:
        return put_multipart(self, key, full, source, st, part_size, progress)

    def _list_parts(self, full: str, upload_id: str, what: str) -> dict[int, tuple[int, str]]:
        parts: dict[int, tuple[int, str]] = {}
        marker = 0
        while True:
            page = self._call(
                what,
                lambda m=marker: self._client.list_parts(  # type: ignore[misc]
                    Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumberMarker=m
                ),
            )
            for p in page.get("Parts", []):
                parts[int(p["PartNumber"])] = (int(p["Size"]), str(p["ETag"]).strip('"'))
            if not page.get("IsTruncated"):
                return parts
            marker = int(page["NextPartNumberMarker"])

    def _abort(self, full: str, upload_id: str) -> None:
        with contextlib.suppress(BlobError):
            self._call(
                f"abandoning the upload of {full}",
                lambda: self._client.abort_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id
                ),
            )

    def get(
        self, key: str, dest: Path, *, expect: BlobInfo, progress: Progress | None = None
    ) -> BlobInfo:
        full = self._key(key)
        what = f"reading blob {key} from {self.url}"
        from botocore.exceptions import ConnectionError, ReadTimeoutError, ResponseStreamingError

        self._reach(what)

        if expect.size > self.options.range_size and self.options.parallel_parts > 1:
            return ranged_get(
                lambda first, last: self._range(key, first, last),
                dest,
                key=key,
                where=self.url,
                expect=expect,
                range_size=self.options.range_size,
                parallel=self.options.parallel_parts,
                progress=progress,
            )
        deadline = time.monotonic() + self.options.retry_s
        while True:
            try:
                answer = self._call(
                    what, lambda: self._client.get_object(Bucket=self.bucket, Key=full)
                )
            except BlobError as exc:
                if self._missing(exc):
                    raise BlobError(f"blob {key} is missing from {self.url}") from exc
                raise
            body = answer["Body"]
            try:
                return verified_write(
                    body.iter_chunks(CHUNK),
                    dest,
                    key=key,
                    where=self.url,
                    expect=expect,
                    progress=progress,
                )
            except (ConnectionError, ReadTimeoutError, ResponseStreamingError) as exc:
                if time.monotonic() >= deadline:
                    raise BlobError(f"{what}: the download broke off: {exc}") from exc
                time.sleep(0.5)
            finally:
                body.close()

    def _range(self, key: str, first: int, last: int) -> tuple[bytes, int | None]:
        """Bytes ``first..last`` of blob ``key`` and its size as the server states it
        (:func:`ranged_get`'s fetch); a stream that breaks off is asked for again, for
        up to ``retry_s``."""
        from botocore.exceptions import ConnectionError, ReadTimeoutError, ResponseStreamingError

        full = self._key(key)
        what = f"reading bytes {first}-{last} of blob {key} from {self.url}"
        deadline = time.monotonic() + self.options.retry_s
        while True:
            try:
                answer = self._call(
                    what,
                    lambda: self._client.get_object(
                        Bucket=self.bucket, Key=full, Range=f"bytes={first}-{last}"
                    ),
                )
            except BlobError as exc:
                if self._missing(exc):
                    raise BlobError(f"blob {key} is missing from {self.url}") from exc
                if self._status(exc) == 416:
                    raise BlobError(
                        f"blob {key} at {self.url} is truncated: it ends before byte {first}; "
                        "it is not used"
                    ) from exc
                raise
            body = answer["Body"]
            try:
                data: bytes = body.read()
            except (ConnectionError, ReadTimeoutError, ResponseStreamingError) as exc:
                if time.monotonic() >= deadline:
                    raise BlobError(f"{what}: the download broke off: {exc}") from exc
                time.sleep(0.5)
                continue
            finally:
                body.close()
            total = content_range_total(answer.get("ContentRange"))
            if total is None and "ContentRange" not in answer:
                raise BlobError(
                    f"{what}: the server answered without a Content-Range (it ignored the "
                    "Range request); hutch needs an S3 server that serves byte ranges"
                )
            return data, total

    @staticmethod
    def _status(exc: BaseException) -> int:
        response = getattr(exc.__cause__, "response", None)
        if not isinstance(response, dict):
            return 0
        return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))

    def stat(self, key: str) -> BlobInfo | None:
        self._key(key)  # a bad key fails before any request
        self._reach(f"looking up blob {key} in {self.url}")
        return self._stat(key)

    def _stat(self, key: str) -> BlobInfo | None:
        full = self._key(key)
        try:
            head = self._call(
                f"looking up blob {key} in {self.url}",
                lambda: self._client.head_object(Bucket=self.bucket, Key=full),
            )
        except BlobError as exc:
            if self._missing(exc):
                return None
            raise
        return BlobInfo(key, int(head["ContentLength"]))

    def delete(self, key: str) -> None:
        full = self._key(key)
        self._reach(f"deleting blob {key} from {self.url}")
        self._call(
            f"deleting blob {key} from {self.url}",
            lambda: self._client.delete_object(Bucket=self.bucket, Key=full),
        )

    def list_prefix(self, prefix: str) -> list[BlobInfo]:
        self._reach(f"listing {prefix!r} in {self.url}")
        base = f"{self.prefix}/" if self.prefix else ""
        out: list[BlobInfo] = []
        token: str | None = None
        while True:
            args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base + prefix}
            if token:
                args["ContinuationToken"] = token
            page = self._call(
                f"listing {prefix!r} in {self.url}",
                lambda a=args: self._client.list_objects_v2(**a),  # type: ignore[misc]
            )
            for obj in page.get("Contents", []):
                out.append(BlobInfo(str(obj["Key"])[len(base) :], int(obj["Size"])))
            if not page.get("IsTruncated"):
                return sorted(out, key=lambda b: b.key)
            token = str(page["NextContinuationToken"])

    def pending_uploads(self) -> list[UploadJournal]:
        """The uploads this host began and has not finished (its journals)."""
        if not self.journal_dir.is_dir():
            return []
        found = (UploadJournal.load(p) for p in sorted(self.journal_dir.glob("*.json")))
        return [j for j in found if j is not None and j.bucket == self.bucket]

    def abort_uploads(self, older_than_s: float) -> list[str]:
        self._reach(f"listing unfinished uploads in {self.url}")
        aborted: list[str] = []
        ours = {j.upload_id for j in self.pending_uploads()}
        for journal in self.pending_uploads():
            try:
                st = os.stat(journal.source)
                unchanged = (st.st_size, st.st_mtime_ns) == (journal.size, journal.mtime_ns)
            except OSError:
                unchanged = False
            if not unchanged:
                # Its file is gone or changed: the upload can never be finished.
                self._abort(journal.key, journal.upload_id)
                self.journal_path(journal.key).unlink(missing_ok=True)
                aborted.append(journal.key)
        cutoff = datetime.now(UTC).timestamp() - older_than_s
        base = f"{self.prefix}/" if self.prefix else ""
        page = self._call(
            f"listing unfinished uploads in {self.url}",
            lambda: self._client.list_multipart_uploads(Bucket=self.bucket, Prefix=base),
        )
        for upload in page.get("Uploads", []):
            started = upload["Initiated"].timestamp()
            if upload["UploadId"] in ours or started > cutoff:
                continue
            self._abort(str(upload["Key"]), str(upload["UploadId"]))
            aborted.append(str(upload["Key"]))
        return aborted

    def create_bucket(self) -> None:
        """Tests and ``make cluster-up``: make the bucket (no error if it exists)."""
        from botocore.exceptions import ClientError

        try:
            self._client.create_bucket(Bucket=self.bucket)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise BlobError(f"creating bucket {self.bucket}: {exc}") from exc
