"""Host mounts of shared volumes: each shared volume is a sparse ext4 image (made like an
exclusive one, :class:`~hutch.storage.volumes.VolumeFiles`) that the *host* loop-mounts
at ``<mount_root>/<id>`` and serves with :mod:`hutch.storage.sharefs_server`.

Why a host-mounted image and not a plain directory: the image's size is the volume's
size, so the host kernel's ext4 answers ENOSPC (a 1 GiB volume never holds a 1 GiB + 1st
byte) and one volume cannot fill the state directory. Why that is safe: no guest ever
writes the image's bytes (a shared volume is never a virtio-blk device; a volume's kind
is fixed at create), only the host kernel's ext4 does, so no guest-written filesystem is
parsed by the host. Mounted ``nodev,nosuid,noexec``: the server creates no device or
setuid file, and the mount would not honour one anyway.

Crash safety: the mounts are the kernel's state, not ours. :meth:`mounted` reads them
from ``/proc/self/mountinfo``, so a restarted daemon finds what an earlier one mounted;
:meth:`sweep` unmounts every one no running sandbox uses. ``mount -o loop`` sets the loop
device's autoclear flag, so an unmount releases the loop device too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
from pathlib import Path

from hutch.errors import StoreError

__all__ = ["MOUNT_OPTIONS", "SharedMounts", "mount_points"]

log = logging.getLogger(__name__)

MOUNT_OPTIONS = "loop,nodev,nosuid,noexec,noatime"


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_points(mountinfo: str) -> list[Path]:
    """Every mount point in a ``/proc/<pid>/mountinfo`` text (field 5)."""
    points: list[Path] = []
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) > 4:
            points.append(Path(_unescape(fields[4])))
    return points


def _run(argv: list[str], what: str) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StoreError(f"{what}: cannot run {argv[0]}: {exc}") from exc
    if done.returncode != 0:
        raise StoreError(f"{what} failed: {' '.join(argv)}: {(done.stderr or done.stdout).strip()}")


class SharedMounts:
    """The host mounts of shared volumes under ``mount_root`` (one directory per id)."""

    def __init__(self, mount_root: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> None:
        self.mount_root = mount_root
        self._mountinfo = mountinfo

    def path(self, volume_id: str) -> Path:
        return self.mount_root / volume_id

    def mounted(self) -> set[str]:
        """Ids of the volumes mounted under ``mount_root`` now (by anyone: an earlier
        daemon's mounts are found too)."""
        root = self.mount_root.resolve() if self.mount_root.exists() else self.mount_root
        return {p.name for p in mount_points(self._mountinfo.read_text()) if p.parent == root}

    def mount(self, volume_id: str, image: Path) -> Path:
        """Mount ``image`` at :meth:`path` unless it is mounted already; idempotent."""
        target = self.path(volume_id)
        if volume_id in self.mounted():
            return target
        self.mount_root.mkdir(parents=True, exist_ok=True, mode=0o700)
        target.mkdir(exist_ok=True, mode=0o700)
        _run(
            ["mount", "-t", "ext4", "-o", MOUNT_OPTIONS, str(image), str(target)],
            f"mounting shared volume {volume_id}",
        )
        return target

    def unmount(self, volume_id: str) -> None:
        """Unmount (releasing the loop device) and remove the mount point; a volume not
        mounted is fine. A mount still busy (a server thread mid-call) is detached
        lazily: the kernel finishes it when the last descriptor closes."""
        target = self.path(volume_id)
        if volume_id in self.mounted():
            try:
                _run(["umount", str(target)], f"unmounting shared volume {volume_id}")
            except StoreError as exc:
                log.warning("%s; detaching it lazily", exc)
                _run(["umount", "-l", str(target)], f"detaching shared volume {volume_id}")
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(target)

    def sweep(self, in_use: set[str]) -> list[str]:
        """Unmount every shared volume no running sandbox uses (a daemon start, or
        teardown); remove leftover empty mount points. Returns the ids unmounted."""
        released: list[str] = []
        for vid in sorted(self.mounted() - in_use):
            self.unmount(vid)
            released.append(vid)
        if self.mount_root.is_dir():
            for entry in self.mount_root.iterdir():
                if entry.name not in in_use and entry.name not in self.mounted():
                    with contextlib.suppress(OSError):
                        os.rmdir(entry)
        return released
