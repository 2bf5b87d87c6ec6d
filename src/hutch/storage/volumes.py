"""Volume files: one sparse raw ext4 image per volume, ``<state_dir>/volumes/<id>.img``.

Raw, not qcow2: a volume is never a backing file or snapshotted, and raw is the fastest
virtio-blk backend (no metadata lookups); its apparent size *is* the device size the
guest sees, so the size limit is the block device's end (ENOSPC in the guest). Sparse:
a new volume costs the blocks ext4's metadata takes (a few MiB).

Crash safety: a volume file is made as ``.new-<id>.img`` (truncate, mkfs, fsync) and
renamed into place; a daemon killed before the rename leaves only a ``.new-`` file, which
:meth:`VolumeFiles.sweep` removes at the next start together with files no row names.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

from hutch.errors import StoreError

__all__ = ["GUEST_ROOT_OWNER", "VolumeFiles"]

#: The volume's root directory belongs to the ``user`` account of hutch's images (uid
#: 1000): code run as that user can write to a fresh volume; root can anyway.
GUEST_ROOT_OWNER = "1000:1000"


def _run(argv: list[str], what: str, timeout_s: float = 300) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StoreError(f"{what}: cannot run {argv[0]}: {exc} (install e2fsprogs)") from exc
    if done.returncode != 0:
        raise StoreError(f"{what} failed: {' '.join(argv)}\n{(done.stderr or done.stdout).strip()}")


class VolumeFiles:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, volume_id: str) -> Path:
        return self.root / f"{volume_id}.img"

    def create(self, volume_id: str, size_bytes: int) -> Path:
        """Make the volume's file (an empty ext4 of exactly ``size_bytes``), atomically."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        final = self.path(volume_id)
        if final.exists():
            raise StoreError(f"{final} exists already; refusing to overwrite a volume")
        tmp = self.root / f".new-{volume_id}.img"
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, size_bytes)
            finally:
                os.close(fd)
            # lazy_itable_init: the guest kernel zeroes inode tables in the background
            # instead of mkfs writing them all (a sparse file stays sparse).
            _run(
                ["mkfs.ext4", "-q", "-F", "-m", "0", "-L", volume_id[:16],
                 "-E", f"root_owner={GUEST_ROOT_OWNER},lazy_itable_init=1,lazy_journal_init=1",
                 str(tmp)],
                f"formatting volume {volume_id}",
            )  # fmt: skip
            fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        return final

    def remove(self, volume_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(volume_id).unlink()

    def size(self, volume_id: str) -> int:
        return self.path(volume_id).stat().st_size

    def used_bytes(self, volume_id: str) -> int | None:
        """Bytes the file occupies on the host (allocated blocks): what was written,
        plus ext4's metadata. None if the file is missing."""
        try:
            return self.path(volume_id).stat().st_blocks * 512
        except OSError:
            return None

    def grow_offline(self, volume_id: str, size_bytes: int) -> None:
        """Grow a volume no VM has open: the file only. Its ext4 grows in the guest at
        the next read-write mount (the agent's ``volume_mount``): the host never runs
        e2fsck or resize2fs on a filesystem a guest wrote, which is hostile input."""
        path = self.path(volume_id)
        if size_bytes <= path.stat().st_size:
            return
        os.truncate(path, size_bytes)

    def ids(self) -> set[str]:
        """The volumes whose complete file is here."""
        if not self.root.is_dir():
            return set()
        return {
            e.name[: -len(".img")]
            for e in self.root.iterdir()
            if e.name.endswith(".img") and not e.name.startswith(".")
        }

    def sweep(self, known_ids: set[str]) -> list[str]:
        """Remove unfinished creates and files of volumes no row names (a crash between a
        delete's row and its file, or between a create's rename and its row)."""
        removed: list[str] = []
        if not self.root.is_dir():
            return removed
        for entry in self.root.iterdir():
            name = entry.name
            vid = name[: -len(".img")] if name.endswith(".img") else None
            if name.startswith(".new-") or (vid is not None and vid not in known_ids):
                with contextlib.suppress(OSError):
                    entry.unlink()
                    removed.append(name)
        return removed


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
