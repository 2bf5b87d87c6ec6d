"""The last step of a save, made crash-safe.

A save ends QEMU before it can stamp the disk and move the memory file, and only then
writes ``manifest.json``. A daemon killed in that window used to leave a snapshot with
no manifest and a VM that was gone: the sandbox was lost although its state was saved.
So before QEMU is ended the save writes ``manifest.pending.json`` (everything known,
plus where the memory file still is); whoever finds it later with QEMU gone finishes
the save exactly as the save would have (:func:`finish_interrupted_save`).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
from pathlib import Path

from hutch.errors import SnapshotError
from hutch.vm.snapshot_manifest import (
    MANIFEST_FILE,
    MEMORY_FILE,
    READ_ONLY,
    STATE_FILE,
    FileStamp,
    SnapshotManifest,
    fsync_path,
    write_atomic,
)

__all__ = ["PENDING_FILE", "finish_interrupted_save", "finish_save", "write_pending"]

PENDING_FILE = "manifest.pending.json"


def write_pending(dest_dir: Path, manifest: SnapshotManifest, memory_source: Path | None) -> None:
    """Record the save as done up to ending QEMU (the VM is stopped, the stream hashed)."""
    body = {
        "manifest": json.loads(manifest.to_json()),
        "memory_source": str(memory_source) if memory_source else None,
    }
    write_atomic(dest_dir / PENDING_FILE, json.dumps(body, sort_keys=True), fsync=False)


def finish_save(
    dest_dir: Path, pending: SnapshotManifest, memory_source: Path | None, *, fsync: bool
) -> SnapshotManifest:
    """With QEMU gone: take the memory file in, stamp the disk, write the manifest.

    A failure to move the memory file removes ``dest_dir`` (the memory file stays where
    it was) and raises ``SnapshotError``.
    """
    os.chmod(dest_dir / STATE_FILE, READ_ONLY)
    memory: FileStamp | None = None
    if pending.ram_in_file:
        target = dest_dir / MEMORY_FILE
        if memory_source is not None and not target.exists():
            _move_memory(memory_source, target, dest_dir)
        if fsync:
            fsync_path(target)
        memory = FileStamp.of(target)
    manifest = dataclasses.replace(
        pending, memory=memory, disk=FileStamp.of(Path(pending.disk.path))
    )
    write_atomic(dest_dir / MANIFEST_FILE, manifest.to_json(), fsync=fsync)
    (dest_dir / PENDING_FILE).unlink(missing_ok=True)
    return manifest


def _move_memory(source: Path, target: Path, dest_dir: Path) -> None:
    try:
        os.rename(source, target)
    except OSError as exc:
        shutil.rmtree(dest_dir, ignore_errors=True)
        hint = (
            "; put memory_file on the same file system as the snapshot directory"
            if exc.errno == errno.EXDEV
            else ""
        )
        raise SnapshotError(
            f"cannot move the memory file {source} into {dest_dir}: "
            f"{exc.strerror}{hint} (the VM has exited; its memory file is unchanged)"
        ) from exc


def finish_interrupted_save(dest_dir: Path) -> bool:
    """Complete a save whose process died after ending QEMU; True if ``dest_dir`` now
    holds a manifest. The caller makes sure the VM's QEMU is gone."""
    if (dest_dir / MANIFEST_FILE).is_file():
        return True
    try:
        body = json.loads((dest_dir / PENDING_FILE).read_text())
        pending = SnapshotManifest.from_json(json.dumps(body["manifest"]), dest_dir)
        source = Path(body["memory_source"]) if body.get("memory_source") else None
    except (OSError, ValueError, KeyError, TypeError, SnapshotError):
        return False
    if not (dest_dir / STATE_FILE).is_file():
        return False
    try:
        finish_save(dest_dir, pending, source, fsync=True)
    except (OSError, SnapshotError):
        return False
    return True
