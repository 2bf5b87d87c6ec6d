"""Built-in image directories as ``hutch image build`` leaves them, made cheaply (no
mmdebstrap, no mkfs: a sparse rootfs with a recognisable head), another host's copy of
one with other rootfs bytes, and a child process that runs one adoption (killed at a
crash point by ``tests/component/test_builtin_blobs.py``):

    python -m tests.component.builtin_kit converge IMAGES STATE DB NAME DIGEST

with ``HUTCH_BLOB_URL`` (and S3 credentials) in its environment.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path

from hutch.images import identity
from hutch.services.builtin_blobs import BuiltinBlobs
from hutch.storage.blobs import BlobStore, open_blob_store
from hutch.store.db import Store
from hutch.store.image_uploads import ImageUploadStore

__all__ = ["DIGEST", "MiB", "built", "differing_copy", "files_of", "open_store"]

MiB = 1 << 20
DIGEST = "0123456789abcdef"
SIZE = 8 * MiB


def built(
    images: Path, fill: bytes, *, name: str = "base", digest: str = DIGEST, current: bool = True
) -> Path:
    """``<images>/<name>/<digest>/`` complete, its rootfs ``SIZE`` bytes (``fill`` at
    its head, holes after) with its identity recorded beside it and in the manifest;
    ``current`` names it."""
    d = images / name / digest
    d.mkdir(parents=True)
    _rootfs(d / "rootfs.ext4", fill)
    (d / "vmlinux").write_bytes(b"vmlinux " * 4096)
    (d / "initrd.img").write_bytes(b"initrd " * 4096)
    _manifest(d, name, digest)
    if current:
        (images / name / "current").write_text(digest + "\n")
    return d


def differing_copy(src: Path, images: Path, fill: bytes) -> Path:
    """Another host's copy of the image directory ``src`` (the same name and digest)
    in ``images``, its rootfs of other bytes (``fill``), identity re-recorded."""
    name, digest = src.parent.name, src.name
    d = images / name / digest
    shutil.copytree(src, d)
    (d / "rootfs.ext4").chmod(0o644)
    (d / "rootfs.ext4").unlink()
    (d / ".rootfs.ext4.sha256").unlink(missing_ok=True)
    _rootfs(d / "rootfs.ext4", fill)
    _manifest(d, name, digest)
    (images / name / "current").write_text(digest + "\n")
    return d


def files_of(d: Path) -> dict[str, bytes]:
    """The files of an image directory (dot files are this host's own)."""
    return {f.name: f.read_bytes() for f in d.iterdir() if f.is_file() and f.name[0] != "."}


def open_store(url: str, state: Path) -> BlobStore:
    """The store ``url`` names (its S3 endpoint and credentials from the environment)."""
    return open_blob_store(url, state_dir=state, s3_endpoint=os.environ.get("HUTCH_S3_ENDPOINT"))


def _rootfs(path: Path, fill: bytes) -> None:
    with path.open("wb") as f:
        f.write(fill * (MiB // len(fill)))
        f.truncate(SIZE)
    path.chmod(0o444)
    identity.record(path)


def _manifest(d: Path, name: str, digest: str) -> None:
    manifest = {
        "name": name,
        "digest": digest,
        "kernel_release": "6.1.0-test",
        "cmdline": "console=ttyS0",
        "size_bytes": SIZE,
        "rootfs_sha256": identity.known(d / "rootfs.ext4"),
        "built_at": time.time(),
    }
    (d / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def _main(argv: list[str]) -> int:
    """``converge IMAGES STATE DB NAME DIGEST``: one adoption, as a daemon's would run."""
    _, images, state, db, name, digest = argv
    store = open_store(os.environ["HUTCH_BLOB_URL"], Path(state))
    records = ImageUploadStore(Store(db if "://" in db else Path(db)))
    blobs = BuiltinBlobs(store, records, Path(images), Path(state), host="b")
    replaced = asyncio.run(blobs.converge(name, digest))
    print("replaced" if replaced else "kept", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
