"""Blobs in a local directory (``file:///path``; the default is ``<state>/blobs``).

A blob is the file ``<root>/<key>``; a put writes ``.<name>.part-<pid>`` beside it,
fsyncs and renames, so a crash leaves the old blob or the new one, never half of one
(leftover ``.part-`` files are what :meth:`LocalBlobStore.abort_uploads` removes).

Every method raises ``BlobError`` for what the file system refuses (never a raw
``OSError``); a root that is not a directory is named as such, whatever call met it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
from pathlib import Path

from hutch.errors import BlobError
from hutch.storage.blobs.base import (
    CHUNK,
    BlobInfo,
    Progress,
    check_key,
    iter_chunks,
    verified_write,
)

__all__ = ["LocalBlobStore"]


class LocalBlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"file://{root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _failed(self, doing: str, exc: OSError) -> BlobError:
        """``exc`` (met while ``doing``) as a ``BlobError``: a root that exists but is
        not a directory is the cause worth naming, not the errno of the call."""
        if self._root_not_a_directory():
            return BlobError(
                f"blob store {self.url}: {self.root} is not a directory ({doing} failed); "
                "HUTCH_BLOB_URL must name a directory (or a path where one can be created)"
            )
        return BlobError(f"{doing} at {self.url} failed: {exc}")

    def _root_not_a_directory(self) -> bool:
        return self.root.exists() and not self.root.is_dir()

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise self._failed("creating the directory", exc) from exc
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise BlobError(f"blob store {self.url}: the directory is not writable")

    def put(self, key: str, source: Path, *, progress: Progress | None = None) -> BlobInfo:
        dest = self._path(key)
        tmp = dest.with_name(f".{dest.name}.part-{os.getpid()}")
        digest = hashlib.sha256()
        size = 0
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with source.open("rb") as src, tmp.open("wb") as out:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    if progress is not None:
                        progress(size)
                out.flush()
                os.fsync(out.fileno())
            os.rename(tmp, dest)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise self._failed(f"storing blob {key}", exc) from exc
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        return BlobInfo(key, size, digest.hexdigest())

    def get(
        self, key: str, dest: Path, *, expect: BlobInfo, progress: Progress | None = None
    ) -> BlobInfo:
        path = self._path(key)
        try:
            with path.open("rb") as f:
                return verified_write(
                    iter_chunks(f),
                    dest,
                    key=key,
                    where=self.url,
                    expect=expect,
                    progress=progress,
                )
        except FileNotFoundError as exc:
            raise BlobError(f"blob {key} is missing from {self.url}") from exc
        except OSError as exc:
            raise self._failed(f"reading blob {key}", exc) from exc

    def stat(self, key: str) -> BlobInfo | None:
        path = self._path(key)
        try:
            return BlobInfo(key, path.stat().st_size)
        except FileNotFoundError:
            return None
        except NotADirectoryError as exc:
            if self._root_not_a_directory():
                raise self._failed(f"looking up blob {key}", exc) from exc
            return None  # a blob where a directory of the key would be: no such blob
        except OSError as exc:
            raise self._failed(f"looking up blob {key}", exc) from exc

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink(missing_ok=True)
        except NotADirectoryError as exc:
            if self._root_not_a_directory():
                raise self._failed(f"deleting blob {key}", exc) from exc
            return  # a blob where a directory of the key would be: nothing to delete
        except OSError as exc:
            raise self._failed(f"deleting blob {key}", exc) from exc
        # Empty directories left by the delete go too (never the root).
        parent = path.parent
        while parent != self.root and parent.is_relative_to(self.root):
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def list_prefix(self, prefix: str) -> list[BlobInfo]:
        if self._root_not_a_directory():
            raise self._failed(f"listing {prefix!r}", NotADirectoryError(str(self.root)))
        if not self.root.is_dir():
            return []  # nothing stored yet
        out = []
        try:
            for path in self.root.rglob("*"):
                if path.name.startswith(".") or not path.is_file():
                    continue
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                        out.append(BlobInfo(key, path.stat().st_size))
        except OSError as exc:
            raise self._failed(f"listing {prefix!r}", exc) from exc
        return sorted(out, key=lambda b: b.key)

    def abort_uploads(self, older_than_s: float) -> list[str]:
        if self._root_not_a_directory():
            raise self._failed("removing stale uploads", NotADirectoryError(str(self.root)))
        if not self.root.is_dir():
            return []
        cutoff = time.time() - older_than_s
        removed = []
        try:
            for path in self.root.rglob(".*.part-*"):
                with contextlib.suppress(FileNotFoundError):  # renamed in meanwhile
                    if path.stat().st_mtime < cutoff:
                        path.unlink(missing_ok=True)
                        removed.append(path.relative_to(self.root).as_posix())
        except OSError as exc:
            raise self._failed("removing stale uploads", exc) from exc
        return removed

    def remove_all(self) -> None:
        """Tests: the whole directory."""
        shutil.rmtree(self.root, ignore_errors=True)
