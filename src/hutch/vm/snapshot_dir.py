"""A snapshot directory's state on disk: its manifest and its ``consumed`` / ``frozen``
markers (see the design note in :mod:`hutch.vm.snapshot`).

Its own module so that :mod:`hutch.vm.snapshot` (save, restore, checks) and
:mod:`hutch.vm.snapshot_seal` (the memory file's digest) share these without importing
each other.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from hutch.errors import SnapshotError
from hutch.vm.snapshot_manifest import (
    MANIFEST_FILE,
    MEMORY_FILE,
    READ_ONLY,
    STATE_FILE,
    SnapshotManifest,
)
from hutch.vm.snapshot_rebase import settle_rebase

__all__ = ["CONSUMED_MARKER", "FROZEN_MARKER", "freeze", "load_manifest"]

CONSUMED_MARKER = "consumed"
FROZEN_MARKER = "frozen"


def load_manifest(snapshot_dir: Path) -> SnapshotManifest:
    """Read ``manifest.json``; SnapshotError if absent (incomplete snapshot) or bad.
    A rebase on a memory file cut between its two renames is settled first."""
    settle_rebase(snapshot_dir)
    path = snapshot_dir / MANIFEST_FILE
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise SnapshotError(
            f"{snapshot_dir} has no {MANIFEST_FILE}: the snapshot is incomplete or missing"
        ) from exc
    except OSError as exc:
        raise SnapshotError(f"cannot read {path}: {exc.strerror}") from exc
    return SnapshotManifest.from_json(text, path)


def freeze(snapshot_dir: Path, manifest: SnapshotManifest) -> None:
    """Mark the snapshot as a template: read-only files, no resume from now on."""
    marker = snapshot_dir / FROZEN_MARKER
    if marker.exists():
        return
    files = [snapshot_dir / STATE_FILE, Path(manifest.disk.path)]
    if manifest.ram_in_file:
        files.append(snapshot_dir / MEMORY_FILE)
    for path in files:
        # Changes ctime only (size/mtime stamps stay valid); skipped when already
        # read-only, since a sealed memory file's ctime must not move.
        if path.stat().st_mode & 0o777 != READ_ONLY:
            os.chmod(path, READ_ONLY)
    marker.write_text(f"{time.time_ns()}\n")
