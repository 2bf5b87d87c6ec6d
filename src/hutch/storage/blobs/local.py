"""Blobs in a local directory (``file:///path``; the default is ``<state>/blobs``).

A blob is the file ``<root>/<key>``; a put writes ``.<name>.part-<pid>`` beside it,
fsyncs and renames, so a crash leaves the old blob or the new one, never half of one
(leftover ``.part-`` files are what :meth:`LocalBlobStore.abort_uploads` removes).
"""

from __future__ import annotations

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

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise BlobError(f"blob store {self.url}: cannot create the directory: {exc}") from exc
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
            tmp.unlink(missing_ok=True)
            raise BlobError(f"storing blob {key} at {self.url} failed: {exc}") from exc
        except BaseException:
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
            raise BlobError(f"reading blob {key} from {self.url} failed: {exc}") from exc

    def stat(self, key: str) -> BlobInfo | None:
        try:
            return BlobInfo(key, self._path(key).stat().st_size)
        except FileNotFoundError:
            return None

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        # Empty directories left by the delete go too (never the root).
        parent = path.parent
        while parent != self.root and parent.is_relative_to(self.root):
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def list_prefix(self, prefix: str) -> list[BlobInfo]:
        if not self.root.is_dir():
            return []
        out = []
        for path in self.root.rglob("*"):
            if path.name.startswith(".") or not path.is_file():
                continue
            key = path.relative_to(self.root).as_posix()
            if key.startswith(prefix):
                out.append(BlobInfo(key, path.stat().st_size))
        return sorted(out, key=lambda b: b.key)

    def abort_uploads(self, older_than_s: float) -> list[str]:
        if not self.root.is_dir():
            return []
        cutoff = time.time() - older_than_s
        removed = []
        for path in self.root.rglob(".*.part-*"):
            if path.stat().st_mtime < cutoff:
                path.unlink(missing_ok=True)
                removed.append(path.relative_to(self.root).as_posix())
        return removed

    def remove_all(self) -> None:
        """Tests: the whole directory."""
        shutil.rmtree(self.root, ignore_errors=True)
