"""A flat directory of immutable files as blobs under one prefix, with an index written
last: :func:`put_flat`, :func:`get_flat`. Each file goes through :meth:`BlobStore.put`
(streamed; multipart and resumable on S3) and comes back through :meth:`BlobStore.get`
(checked against the index's size and sha256 as it is written).

Index (``<prefix>index.json``; its presence means the upload is complete)::

    {"format": 1, "owner": "<what the files are>",
     "files": {"rootfs.ext4": {"size": n, "sha256": h}, ...},
     "meta":  {...}}                                  # the caller's, as given

An index read back is trusted for nothing on its own: whoever can write the bucket can
write a file and an index that agree. :func:`get_flat` takes what the caller trusts (the
uploader's record of each file's size and sha256, kept outside the bucket) and refuses
an index that differs from it in any file; the names are checked too (no path can leave
the staging directory), its owner must be the one asked for (a blob under another prefix
cannot stand in), and what the files mean (a manifest's digest, say) is the caller's to
verify before it uses them.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hutch.errors import BlobError
from hutch.models import FileSum
from hutch.storage.blobs.base import BlobInfo, BlobStore

__all__ = [
    "FILE_NAME",
    "FLAT_FORMAT",
    "INDEX",
    "FileSum",
    "Put",
    "file_sums",
    "flat_complete",
    "get_flat",
    "get_flat_index",
    "put_flat",
    "read_small",
]

INDEX = "index.json"
FLAT_FORMAT = 1
#: A file name a blob directory may hold (no path, no dot first): snapshots and images alike.
FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

Put = Callable[[str, Path], BlobInfo]


def file_sums(index: Mapping[str, Any]) -> dict[str, FileSum]:
    """The files an index (as :func:`put_flat` returns it) names."""
    return {n: FileSum(int(r["size"]), str(r["sha256"])) for n, r in index["files"].items()}


def put_flat(
    store: BlobStore,
    prefix: str,
    files: Mapping[str, Path],
    *,
    owner: str,
    scratch: Path,
    meta: Mapping[str, Any] | None = None,
    put: Put | None = None,
    before_index: Callable[[dict[str, FileSum]], None] | None = None,
) -> dict[str, Any]:
    """Upload ``files`` (name in the store -> local path), then the index naming their
    sizes and sha256 and ``meta``; return the index. ``put`` (default ``store.put``)
    lets a caller stop between blobs; ``before_index`` is called with what was sent
    before the index goes (to record it where the bucket cannot write); ``scratch``:
    where the index is written before it is sent. The files must not change meanwhile.
    Raises ``BlobError``; until the index is in the store, nothing of the upload counts
    as there."""
    send = put or store.put
    records: dict[str, dict[str, Any]] = {}
    for name, path in sorted(files.items()):
        if not FILE_NAME.match(name) or name == INDEX:
            raise BlobError(f"{owner}: {name!r} cannot be stored as a blob name")
        got = send(prefix + name, path)
        records[name] = {"size": got.size, "sha256": got.sha256}
    if before_index is not None:
        before_index({n: FileSum(int(r["size"]), str(r["sha256"])) for n, r in records.items()})
    index = {"format": FLAT_FORMAT, "owner": owner, "files": records, "meta": dict(meta or {})}
    tmp = scratch / f".index-{secrets.token_hex(6)}.json"
    try:
        scratch.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(index, indent=2, sort_keys=True))
        send(prefix + INDEX, tmp)
    finally:
        tmp.unlink(missing_ok=True)
    return index


def flat_complete(store: BlobStore, prefix: str) -> bool:
    """The upload under ``prefix`` completed (its index is there). Blocking; raises
    ``BlobError`` when the store cannot be asked."""
    return store.stat(prefix + INDEX) is not None


def read_small(store: BlobStore, key: str, scratch: Path) -> bytes | None:
    """The bytes of the (small: an index) blob ``key``, read through a temporary file
    in ``scratch`` (checked against the store's own size and sha256); None: no such
    blob. Blocking; ``BlobError`` when it cannot be read."""
    found = store.stat(key)
    if found is None:
        return None
    scratch.mkdir(parents=True, exist_ok=True)
    path = scratch / f".read-{secrets.token_hex(6)}"
    try:
        store.get(key, path, expect=found)
        return path.read_bytes()
    finally:
        path.unlink(missing_ok=True)


def get_flat_index(
    store: BlobStore, prefix: str, scratch: Path, *, owner: str
) -> dict[str, Any] | None:
    """The index :func:`put_flat` wrote under ``prefix`` (None: there is none: never
    uploaded, or not complete yet), read through ``scratch`` and checked. Raises
    ``BlobError`` for an index that is not valid or cannot be read."""
    raw = read_small(store, prefix + INDEX, scratch)
    if raw is None:
        return None
    try:
        return _parse(raw, owner)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise BlobError(
            f"blob {prefix}{INDEX} at {store.url} is not a valid index ({exc}); "
            f"{owner} cannot be fetched"
        ) from exc


def get_flat(
    store: BlobStore,
    prefix: str,
    staging: Path,
    *,
    owner: str,
    expect: Mapping[str, FileSum],
) -> dict[str, Any] | None:
    """Download what :func:`put_flat` stored under ``prefix`` into ``staging`` (an empty
    directory); return the index, or None when there is no index (never uploaded, or
    not complete yet). ``expect``: the files as the uploader recorded them where the
    bucket cannot write; the index must name exactly these, each of that size and
    sha256, and each blob is checked against it as it is written. Raises ``BlobError``
    naming the file whose index entry differs from the record, the blob that is
    missing, truncated or corrupt, or an index that is not valid; the caller removes
    ``staging`` then."""
    index = get_flat_index(store, prefix, staging, owner=owner)
    if index is None:
        return None
    listed = file_sums(index)
    for name in sorted(set(listed) | set(expect)):
        if listed.get(name) != expect.get(name):
            raise BlobError(
                f"blob {prefix}{name} at {store.url}: the index says "
                f"{_describe(listed.get(name))}, the uploader recorded "
                f"{_describe(expect.get(name))}; {owner} is not fetched"
            )
    for name, want in expect.items():
        key = prefix + name
        store.get(key, staging / name, expect=BlobInfo(key, want.size, want.sha256))
    return index


def _describe(found: FileSum | None) -> str:
    if found is None:
        return "no such file"
    return f"{found.size} bytes of sha256 {found.sha256}"


def _parse(raw: bytes, owner: str) -> dict[str, Any]:
    index: dict[str, Any] = json.loads(raw)
    if index.get("format") != FLAT_FORMAT or index.get("owner") != owner:
        raise ValueError(f"format {index.get('format')!r}, owner {index.get('owner')!r}")
    files = index["files"]
    if not isinstance(files, dict) or not isinstance(index.get("meta", {}), dict):
        raise ValueError("files and meta must be objects")
    for name, rec in files.items():
        if not FILE_NAME.match(name) or name == INDEX:
            raise ValueError(f"file name {name!r}")
        if not _SHA256.match(str(rec["sha256"])) or int(rec["size"]) < 0:
            raise ValueError(f"record {rec!r}")
    index.setdefault("meta", {})
    return index
