"""Sealing a ram_in_file snapshot's memory file, and checking a sealed one before a
restore maps it (see "What is checked before a restore" in :mod:`hutch.vm.snapshot`).

Sealing hashes ``memory.ram`` once, after making it read-only, and records the digest
with the ctime the file then has. A restore whose file still has that ctime has the
digested bytes (any write, chmod or rename changes ctime, and user space cannot set it
back), so the hot path is one ``stat``; a changed ctime costs one full re-hash,
remembered per process by what any change to the file changes.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from hutch.errors import SnapshotError
from hutch.vm.snapshot_dir import freeze, load_manifest
from hutch.vm.snapshot_manifest import (
    MANIFEST_FILE,
    MEMORY_FILE,
    STATE_DIGEST,
    SnapshotManifest,
    fd_digest,
    write_atomic,
)

__all__ = ["check_memory", "seal_memory"]

# Memory files whose content matched their sealed digest in this process, by what any
# change to them changes: a re-hash after a ctime change is paid once.
_memory_verified: set[tuple[int, int, int, int, int]] = set()


def _stat_key(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def check_memory(snapshot_dir: Path, manifest: SnapshotManifest) -> None:
    """The sealed memory file's content: a ``stat`` while its ctime is the sealed one,
    else one full hash; SnapshotError on a mismatch. Unsealed (older) manifests: the
    size and mtime check of ``hutch.vm.snapshot`` only."""
    stamp = manifest.memory
    if not manifest.ram_in_file or stamp is None or stamp.digest is None:
        return
    path = snapshot_dir / MEMORY_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise SnapshotError(f"snapshot {snapshot_dir}: cannot open {MEMORY_FILE}: {exc}") from exc
    try:
        before = os.fstat(fd)
        if before.st_ctime_ns == stamp.ctime_ns or _stat_key(before) in _memory_verified:
            return
        digest, size = fd_digest(fd, stamp.digest.partition(":")[0])
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if size != stamp.size or digest != stamp.digest:
        raise SnapshotError(
            f"snapshot {snapshot_dir}: {MEMORY_FILE} does not match its recorded checksum "
            f"({size} bytes, {digest[:26]}…; recorded {stamp.size} bytes, "
            f"{stamp.digest[:26]}…); it will not be mapped. Take a new snapshot"
        )
    if _stat_key(after) == _stat_key(before):
        _memory_verified.add(_stat_key(after))


def seal_memory(snapshot_dir: Path, *, fsync: bool = True) -> SnapshotManifest:
    """Freeze a ram_in_file snapshot for clones and record its memory file's digest.

    Makes the files read-only (``frozen``: no resume from now on), makes the memory file
    durable (``fsync``: the guest wrote it through the page cache while it ran), hashes
    it and records the digest with the ctime it now has (see the module note). Idempotent;
    a snapshot already sealed is re-hashed only if its ctime moved, and refused
    (SnapshotError) if its content no longer matches. Returns the manifest.
    """
    manifest = load_manifest(snapshot_dir)
    stamp = manifest.memory
    if not manifest.ram_in_file or stamp is None:
        return manifest
    path = snapshot_dir / MEMORY_FILE
    why = stamp.changed(path)
    if why:
        raise SnapshotError(f"snapshot {snapshot_dir}: memory file: {why}")
    freeze(snapshot_dir, manifest)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        before = os.fstat(fd)
        if stamp.digest is not None and before.st_ctime_ns == stamp.ctime_ns:
            return manifest
        if fsync:
            os.fsync(fd)
        digest, _ = fd_digest(fd, STATE_DIGEST)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if stamp.digest is not None and digest != stamp.digest:
        raise SnapshotError(
            f"snapshot {snapshot_dir}: {MEMORY_FILE} does not match its recorded checksum"
        )
    if _stat_key(after) != _stat_key(before) or stamp.changed(path):
        raise SnapshotError(f"snapshot {snapshot_dir}: {MEMORY_FILE} changed while sealed")
    sealed = dataclasses.replace(
        manifest,
        memory=dataclasses.replace(stamp, digest=digest, ctime_ns=after.st_ctime_ns),
    )
    manifest_path = snapshot_dir / MANIFEST_FILE
    os.chmod(manifest_path, 0o600)
    write_atomic(manifest_path, sealed.to_json(), fsync=fsync)
    return sealed
