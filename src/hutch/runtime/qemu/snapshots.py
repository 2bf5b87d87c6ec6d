"""The frozen snapshot directories on the host: finishing saves a daemon's death cut
short, checking and sizing them, and collecting those nothing reaches any more."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from pathlib import Path

from hutch.errors import HutchError
from hutch.models import SandboxRecord, SandboxState
from hutch.runtime.qemu.host import HostLayout, read_config
from hutch.runtime.qemu.templates import finish_template, template_complete
from hutch.vm.disk_chain import disk_chain
from hutch.vm.process import kill_verified
from hutch.vm.snapshot import MANIFEST_FILE, finish_interrupted_save
from hutch.vm.snapshot_dir import CONSUMED_MARKER, FROZEN_MARKER, load_manifest
from hutch.vm.snapshot_pending import PENDING_FILE

__all__ = ["QemuSnapshotFiles", "discard_stale_saves", "save_written"]

log = logging.getLogger(__name__)


class QemuSnapshotFiles:
    def __init__(self, layout: HostLayout) -> None:
        self.layout = layout

    async def recover(self, sandbox_id: str, snapshot_dir: str, *, clone: bool) -> bool:
        d = Path(snapshot_dir)
        p = self.layout.paths(sandbox_id)
        if not (d / MANIFEST_FILE).is_file():
            # A save cut short after QEMU was told to end: make sure it has, then
            # finish the save the way it would have finished.
            await asyncio.to_thread(kill_verified, p.pidfile, str(p.run))
            if await asyncio.to_thread(finish_interrupted_save, d):
                log.info("sandbox %s: finished the interrupted save in %s", sandbox_id, d)
        if not (d / MANIFEST_FILE).is_file():
            return False
        if clone:
            # A fork or named snapshot cut short after its save: finish the freeze
            # (vm.json, then the disk taken in) as the freeze would have. Until the disk
            # has moved, the sandbox's own vm.json is the snapshot's configuration.
            source = read_config(d / "vm.json") or read_config(p.vm_json)
            if source is None:
                log.warning("sandbox %s: %s has no VM configuration to finish", sandbox_id, d)
                return False
            try:
                await asyncio.to_thread(finish_template, d, source)
            except (OSError, HutchError) as exc:
                log.warning("sandbox %s: cannot finish the snapshot %s: %s", sandbox_id, d, exc)
                return False
        return not (d / CONSUMED_MARKER).exists()

    def complete(self, snapshot_dir: Path) -> bool:
        return template_complete(snapshot_dir)

    def size(self, snapshot_dir: Path) -> int:
        """Bytes the snapshot holds on disk (allocated, not apparent: disks are sparse)."""
        return sum(f.stat().st_blocks * 512 for f in snapshot_dir.rglob("*") if f.is_file())

    def estimate(self, rec: SandboxRecord) -> int:
        """The disk overlay as allocated now plus the guest's RAM (the saved state holds at
        most that): what the save takes in, short of what the guest writes meanwhile."""
        try:
            disk = self.layout.paths(rec.id).disk.stat().st_blocks * 512
        except OSError:
            disk = 0
        return disk + rec.shape.memory_mib * (1 << 20)

    def collect(self, live_ids: set[str], keep: set[str]) -> list[str]:
        """Remove the snapshot directories nothing reaches; return their names.

        Reached: a directory in ``keep`` (a snapshot row, ready or being saved; a live
        sandbox's ``resume_from``), and every qcow2 layer under a live sandbox's disk,
        its pause snapshot's disk or a kept directory's disk. A chain that cannot be read
        stops the collection (nothing is removed on a guess).
        """
        root = self.layout.snapshots_root
        if not root.is_dir():
            return []
        kept = {Path(k).resolve() for k in keep}
        try:
            used = self._disks_used_by(live_ids)
            for d in kept:
                used |= _chain(d / "disk.qcow2")
        except HutchError as exc:
            log.warning("snapshot collection skipped: %s", exc)
            return []
        removed = []
        for snap in root.iterdir():
            if snap.resolve() in kept or (snap / "disk.qcow2").resolve() in used:
                continue
            shutil.rmtree(snap, ignore_errors=True)
            removed.append(snap.name)
        return removed

    def _disks_used_by(self, live_ids: set[str]) -> set[Path]:
        used: set[Path] = set()
        for sandbox_id in live_ids:
            used |= _chain(self.layout.paths(sandbox_id).disk)
            pause = self.layout.pause_dir(sandbox_id)
            if (pause / MANIFEST_FILE).exists():
                with contextlib.suppress(HutchError):
                    used |= _chain(Path(load_manifest(pause).disk.path))
        return used


def _chain(disk: Path | None) -> set[Path]:
    return {p.resolve() for p in disk_chain(disk)[0]} if disk is not None else set()


def save_written(snapshot_dir: str | None) -> bool:
    """The save into ``snapshot_dir`` got as far as its pending record (or further)."""
    if snapshot_dir is None:
        return False
    d = Path(snapshot_dir)
    return (d / PENDING_FILE).is_file() or (d / MANIFEST_FILE).is_file()


def discard_stale_saves(layout: HostLayout, rec: SandboxRecord) -> None:
    """A VM adopted running makes what was being saved of it, and the pause snapshot it
    was restored from, unrestorable: they go before the guest runs on."""
    shutil.rmtree(layout.pause_dir(rec.id), ignore_errors=True)
    snapshots = layout.snapshots_root.resolve()
    if rec.state is SandboxState.PAUSING and rec.resume_from is not None:
        target = Path(rec.resume_from).resolve()
        # Only a fork or snapshot directory of this very save (never a frozen one:
        # a save in progress has not ended QEMU, so nothing was restored from it).
        if target.parent == snapshots and not (target / FROZEN_MARKER).exists():
            shutil.rmtree(target, ignore_errors=True)
