"""Where the state is kept besides the state directory: the database (SQLite or a
PostgreSQL URL) and the blob store named snapshots are mirrored to (file:// or s3://)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from hutch.config.env import _number
from hutch.errors import InvalidArgument

if TYPE_CHECKING:
    from hutch.config.settings import Settings

DATABASE_URL_FORMS = (
    "postgresql://USER[:PASSWORD]@HOST[:PORT]/DBNAME, "
    "postgresql://USER@/DBNAME?host=/SOCKET/DIR (a unix socket directory), "
    "or unset for SQLite in the state directory"
)


def parse_database_url(value: str, name: str = "HUTCH_DATABASE_URL") -> str | None:
    """A PostgreSQL URL as libpq takes it (``postgres://`` too), or None for "" (SQLite).
    Checked here for its shape only; the server is asked when the store opens."""
    raw = value.strip()
    if not raw:
        return None
    shown = _redacted(raw)
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError as exc:
        raise InvalidArgument(f"{name}={shown!r} is not a URL ({exc}); accepted: "
                              f"{DATABASE_URL_FORMS}") from exc  # fmt: skip
    if parts.scheme not in ("postgresql", "postgres"):
        raise InvalidArgument(
            f"{name}={shown!r}: the scheme must be postgresql:// (the only database besides "
            f"the default SQLite); accepted: {DATABASE_URL_FORMS}"
        )
    query = parse_qs(parts.query)
    if not parts.hostname and not query.get("host"):
        raise InvalidArgument(
            f"{name}={shown!r} names no server: give a host (and port) or ?host=<socket "
            f"directory>; accepted: {DATABASE_URL_FORMS}"
        )
    if not parts.path.strip("/") and not query.get("dbname"):
        raise InvalidArgument(
            f"{name}={shown!r} names no database (the path after the host); accepted: "
            f"{DATABASE_URL_FORMS}"
        )
    if port is not None and not 1 <= port <= 65535:
        raise InvalidArgument(f"{name}={shown!r}: port {port} is out of 1-65535")
    return raw


def _redacted(url: str) -> str:
    """``url`` with any password replaced by ``***`` (it goes into error messages)."""
    return re.sub(r"(://[^:/@?#]*:)[^@/?#]*@", r"\1***@", url)


#: An S3 bucket name (the rules AWS, MinIO and R2 share).
S3_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
#: Seconds HUTCH_S3_CONNECT_TIMEOUT_S may be (a first contact's whole wait).
S3_CONNECT_TIMEOUT_S_RANGE = (0.5, 300.0)
#: What HUTCH_BLOB_URL may be (hutch.storage.blobs.open_blob_store reads it).
ACCEPTED_BLOB_URLS = "unset (<state_dir>/blobs), file:///absolute/path, s3://bucket[/prefix]"


def check_blob_url(url: str) -> str:
    """``url`` if the blob store accepts it, else ``InvalidArgument`` naming what is
    accepted (checked when the settings are read, before anything starts)."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise InvalidArgument(
                f"HUTCH_BLOB_URL={url!r}: a file URL names an absolute path "
                f"(file:///var/lib/hutch-blobs); accepted: {ACCEPTED_BLOB_URLS}"
            )
        return url
    if parts.scheme == "s3":
        if not parts.netloc or parts.query or parts.fragment:
            raise InvalidArgument(
                f"HUTCH_BLOB_URL={url!r}: an s3 URL is s3://bucket[/prefix] (the endpoint "
                f"goes in HUTCH_S3_ENDPOINT); accepted: {ACCEPTED_BLOB_URLS}"
            )
        if not S3_BUCKET_RE.match(parts.netloc):
            raise InvalidArgument(
                f"HUTCH_BLOB_URL={url!r}: bucket name {parts.netloc!r} is not valid; "
                "accepted: 3-63 characters of lower-case letters, digits, '.' and '-', "
                "starting and ending with a letter or digit"
            )
        return url
    raise InvalidArgument(
        f"HUTCH_BLOB_URL={url!r} is not supported; accepted: {ACCEPTED_BLOB_URLS}"
    )


def _blob_settings(s: Settings, values: dict[str, Any], source: str) -> Settings:
    if "blob_url" in values:
        raw = str(values["blob_url"]).strip()
        s = replace(s, blob_url=check_blob_url(raw) if raw else None)
    if "s3_endpoint" in values:
        raw = str(values["s3_endpoint"]).strip()
        if raw and not raw.startswith(("http://", "https://")):
            shown = "HUTCH_S3_ENDPOINT" if source == "environment" else f"{source}: s3_endpoint"
            raise InvalidArgument(
                f"{shown}={raw!r} is not valid; accepted: an http:// or https:// URL "
                "(https://<account>.r2.cloudflarestorage.com, http://127.0.0.1:9000)"
            )
        s = replace(s, s3_endpoint=raw or None)
    if "s3_connect_timeout_s" in values:
        shown = (
            "HUTCH_S3_CONNECT_TIMEOUT_S"
            if source == "environment"
            else f"{source}: s3_connect_timeout_s"
        )
        try:
            seconds = float(values["s3_connect_timeout_s"])
        except (TypeError, ValueError):
            seconds = float("nan")
        lo, hi = S3_CONNECT_TIMEOUT_S_RANGE
        if not lo <= seconds <= hi:  # NaN fails too
            raise InvalidArgument(
                f"{shown}={values['s3_connect_timeout_s']!r} is not valid; accepted: "
                f"{lo:g} to {hi:g} seconds (how long a request waits for an S3 endpoint "
                "that has not answered yet)"
            )
        s = replace(s, s3_connect_timeout_s=seconds)
    if "blob_cache_bytes" in values:
        s = replace(s, blob_cache_bytes=_number(values, "blob_cache_bytes", int, source))
        if s.blob_cache_bytes < 0:
            raise InvalidArgument(f"{source}: blob_cache_bytes must be 0 (no limit) or more")
    return s
