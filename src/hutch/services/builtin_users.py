"""What on this host uses a built-in image's directory (:class:`HostBuiltinUsers`),
asked before ``builtin_blobs`` replaces the directory's bytes by the blob store's: a
disk opened over other bytes than it was written on is silently corrupt.

A user is anything on this host whose qcow2 chain ends in the directory's
``rootfs.ext4``, found on disk rather than in rows (a sandbox arriving from another
host has its files here before its row names this host):

- a sandbox directory (``<state>/sandboxes/<id>/disk.qcow2``: running, paused in
  either mode, being created, or left by one that moved away and not yet dropped);
- a frozen directory (``<state>/snapshots/<id>/``: a fork, a named snapshot, a
  fetched copy of one);
- a fetch under way (``<state>/blob-fetch/*``: a cross-host resume, a fork's or a
  snapshot's fetch, relinked onto this host's base before it is renamed in; the fetch
  itself holds the directory shared, ``builtin_blobs.hold``);
- a named snapshot of this host whose files here were evicted (the blob cache): its
  upload's index records the rootfs it was frozen over and its identity; frozen over
  this copy's bytes, it would open nowhere once the bytes are replaced.

Derived state is not a user: the image's templates (retired by the adoption) and its
pooled VMs (the pool is held off meanwhile: ``WarmPool.held_off``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from hutch.errors import HutchError
from hutch.images import identity
from hutch.services.blob_dirs import DISK
from hutch.services.pool import WarmPool
from hutch.services.registry import SandboxRegistry
from hutch.store.hosts import HostStore
from hutch.vm.disk_chain import disk_chain

__all__ = ["HostBuiltinUsers"]

log = logging.getLogger("hutch.services.builtin_users")

#: A named snapshot's upload: the raw image it was frozen over and its identity.
FrozenBase = Callable[[str], "tuple[str, str | None] | None"]


class HostBuiltinUsers:
    """``builtin_blobs.BuiltinUsers`` of this host (see the module docstring)."""

    def __init__(
        self, core: SandboxRegistry, pool: WarmPool, frozen_base: FrozenBase | None = None
    ) -> None:
        """``frozen_base(snapshot_id)``: what its upload's index records (None: no
        upload); unset: evicted snapshots are not looked at."""
        self.core = core
        self.pool = pool
        self.frozen_base = frozen_base
        self.hosts = HostStore(core.store)

    def user(self, name: str, digest: str) -> str | None:
        """What uses ``<images>/<name>/<digest>/`` on this host (None: nothing).
        Blocking: a qcow2 header read per disk, a row read per snapshot of the image,
        and an index read per snapshot of this host whose files were evicted."""
        rootfs = (self.core.settings.images_dir / name / digest / "rootfs.ext4").resolve()
        backend = self.core.backend
        sandboxes = backend.disk_path("x").parent.parent
        disk_name = backend.disk_path("x").name
        roots = (
            (sandboxes, disk_name, "sandbox"),
            (backend.fork_dir("x").parent, DISK, "frozen fork or snapshot"),
            (self.core.settings.state_dir / "blob-fetch", DISK, "a fetch under way:"),
        )
        for root, disk, what in roots:
            for d in sorted(root.iterdir()) if root.is_dir() else ():
                if (d / disk).is_file() and _ends_in(d / disk, rootfs):
                    return f"{what} {d.name}"
        return self._evicted_snapshot_on(name, rootfs)

    def _evicted_snapshot_on(self, name: str, rootfs: Path) -> str | None:
        if self.frozen_base is None:
            return None
        mine: str | None = None
        for snap in self.core.store.list_snapshots(ready=None):
            if snap.image != name or self.core.backend.fork_dir(snap.id).exists():
                continue
            if Path(snap.path).exists():
                continue  # its files are here: their chain is looked at above
            if self.hosts.host_of_snapshot(snap.id) != self.core.host_id:
                continue  # another host's: that host keeps its bytes for it
            if mine is None:
                with contextlib.suppress(OSError):
                    mine = identity.identity(rootfs)
            try:
                frozen = self.frozen_base(snap.id)
            except HutchError as exc:  # the store away: not known, so kept
                return f"snapshot {snap.id} (its upload could not be read: {exc})"
            if frozen is None:
                continue  # no upload: it is nowhere to be opened anyway
            base, sha = frozen
            if Path(base).resolve() == rootfs and (sha is None or sha == mine):
                return f"snapshot {snap.id} (in the blob store)"
        return None

    def held_off(self, name: str, digest: str) -> contextlib.AbstractAsyncContextManager[None]:
        return self.pool.held_off(name, digest)

    def retire_templates(self, name: str, digest: str) -> list[str]:
        return self.core.backend.templates.retire(name, digest)


def _ends_in(disk: Path, rootfs: Path) -> bool:
    """``disk``'s qcow2 chain ends in ``rootfs``; an unreadable chain counts as ending
    there (kept rather than corrupted)."""
    try:
        _layers, base = disk_chain(disk)
    except HutchError:
        return True
    return base is not None and base == rootfs
