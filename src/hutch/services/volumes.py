"""Volumes: create, list, inspect, grow and delete (:class:`VolumeService`), the mounts a
create asks for (:meth:`VolumeService.plan`), and growing a sandbox's own disk live.

A volume belongs to a project and outlives sandboxes. Its file is made before its row
(``hutch.storage.volumes``), so a row always names a complete file. A sandbox's mounts
are rows written under the create gate with the sandbox's row and released by its
teardown (the "volumes" step of its TeardownStack, ``services/registry.py``); a volume
with mount rows cannot be deleted. Why exclusive volumes are block devices and shared
ones a file service, and what fork, snapshots and pause do with each: ARCHITECTURE.md
"Volumes". Shared volumes are served by ``services/shared_volumes.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hutch.contract.auth import DEFAULT_PROJECT
from hutch.contract.limits import DISK_GIB_RANGE
from hutch.contract.names import validate_name
from hutch.contract.volumes import VolumeKind, VolumeMount, validate_size
from hutch.errors import Conflict, InvalidArgument, NotFound, StateError, Unavailable
from hutch.models import PauseMode, SandboxRecord, SandboxState
from hutch.runtime.backend import Runtime
from hutch.services.registry import SandboxRegistry
from hutch.store.volumes import MountRow, VolumeRow, new_volume_id
from hutch.vm.argv import VolumeDrive, volume_drive_id

__all__ = [
    "PlannedMount",
    "QuotaCheck",
    "VolumeInfo",
    "VolumeService",
    "mount_all",
    "refuse_copy",
]

log = logging.getLogger(__name__)

#: Called before a volume is created or grown: (project, volumes the project will have,
#: bytes its volumes will add up to); raises (e.g. ``Capacity``) to refuse. The hook the
#: per-project quotas of the auth branch plug into; None: no quota.
QuotaCheck = Callable[[str, int, int], None]


@dataclass(frozen=True)
class VolumeInfo:
    volume: VolumeRow
    #: Bytes the file takes on the host (what was written plus ext4's metadata).
    used_bytes: int | None
    mounts: list[MountRow]


@dataclass(frozen=True)
class PlannedMount:
    volume: VolumeRow
    mount: MountRow


class VolumeService:
    def __init__(self, core: SandboxRegistry, quota: QuotaCheck | None = None) -> None:
        self.core = core
        self.quota = quota
        self._locks: dict[str, asyncio.Lock] = {}

    def _lock(self, key: str) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    # -- queries -----------------------------------------------------------------------

    def _row(self, project: str, ref: str) -> VolumeRow:
        row = self.core.volumes.get(project, ref)
        if row is None:
            raise NotFound(f"volume {ref!r} not found in project {project!r}")
        return row

    def _info(self, row: VolumeRow) -> VolumeInfo:
        return VolumeInfo(
            volume=row,
            # Only the host holding the file can tell (a lookup through any host is
            # forwarded there; a list shows None for other hosts' volumes).
            used_bytes=self.core.volume_files.used_bytes(row.id) if self._here(row) else None,
            mounts=self.core.volumes.mounts_of_volume(row.id),
        )

    def _here(self, row: VolumeRow) -> bool:
        return row.host in (None, self.core.host_id)

    def _require_here(self, row: VolumeRow, action: str) -> None:
        """``Unavailable`` unless the volume's file is on this host: ``action`` changes
        the file (requests through any host are forwarded to the volume's host; this is
        the guard for one that was not, or whose host is down)."""
        if self._here(row):
            return
        host = self.core.hosts.get(str(row.host))
        state = host.state if host is not None else "gone"
        then = (
            "send it through the cluster's API, which forwards it there"
            if state in ("up", "draining")
            else "retry once it is up"
        )
        raise Unavailable(
            f"volume {row.name!r} ({row.id}) is on host {row.host}, which is {state}; "
            f"{action} needs that host: {then}",
            retry_after_s=15,
        )

    def get(self, ref: str, project: str = DEFAULT_PROJECT) -> VolumeInfo:
        return self._info(self._row(project, ref))

    def list_volumes(self, project: str = DEFAULT_PROJECT) -> list[VolumeInfo]:
        return [self._info(row) for row in self.core.volumes.list_volumes(project)]

    # -- create / delete ---------------------------------------------------------------

    async def create(
        self,
        name: str,
        size_bytes: int,
        kind: VolumeKind = VolumeKind.EXCLUSIVE,
        project: str = DEFAULT_PROJECT,
    ) -> VolumeInfo:
        """A new, empty ext4 volume of exactly ``size_bytes``. ``Conflict`` if the name
        is taken in the project; the quota hook may refuse."""
        validate_name(name)
        validate_size(size_bytes)
        kind = VolumeKind(kind)
        async with self._lock(f"{project}/{name}"):
            if self.core.volumes.get(project, name) is not None:
                raise Conflict(
                    f"a volume named {name!r} already exists in project {project!r}; "
                    "delete it first or pick another name"
                )
            self._check_quota(project, extra_count=1, extra_bytes=size_bytes)
            row = VolumeRow(
                new_volume_id(), project, name, kind, size_bytes, time.time(), self.core.host_id
            )
            await asyncio.to_thread(self.core.volume_files.create, row.id, size_bytes)
            try:
                self.core.volumes.insert(row)
            except BaseException:
                self.core.volume_files.remove(row.id)
                raise
        log.info("created volume %s (%s, %d bytes) in %s", row.id, name, size_bytes, project)
        return self._info(row)

    async def delete(self, ref: str, project: str = DEFAULT_PROJECT) -> None:
        """Row first (refused while mounted, naming the sandboxes), then the file: a crash
        between leaves a file the next start removes. A volume of a host that is down
        loses its row here; that host removes the file at its next start."""
        row = self._row(project, ref)
        here = self._here(row)
        if not here:
            host = self.core.hosts.get(str(row.host))
            if host is not None and host.state != "down":
                self._require_here(row, "deleting it")
        async with self._lock(row.id):
            self.core.volumes.delete(row.id)
            if here:
                await asyncio.to_thread(self.core.volume_files.remove, row.id)

    def _check_quota(self, project: str, *, extra_count: int, extra_bytes: int) -> None:
        if self.quota is None:
            return
        rows = self.core.volumes.list_volumes(project)
        self.quota(project, len(rows) + extra_count, sum(r.size_bytes for r in rows) + extra_bytes)

    # -- mounts at create --------------------------------------------------------------

    def plan(
        self, sandbox_id: str, mounts: Sequence[VolumeMount], project: str = DEFAULT_PROJECT
    ) -> list[PlannedMount]:
        """Resolve the validated ``mounts`` of a create to volumes of ``project``, in slot
        order; ``NotFound`` for an unknown volume, ``Conflict`` for an exclusive one that
        another sandbox mounts. Rows are written by :meth:`attach`."""
        planned = []
        for slot, m in enumerate(mounts):
            row = self._row(project, m.volume)
            if not self._here(row):
                raise Conflict(
                    f"volume {row.name!r} ({row.id}) is on host {row.host}, not on host "
                    f"{self.core.host_id}; a sandbox mounts volumes of the host it runs on "
                    "(a create through the cluster's API is placed on the volume's host)"
                )
            if row.kind is VolumeKind.EXCLUSIVE:
                users = [u.sandbox_id for u in self.core.volumes.mounts_of_volume(row.id)]
                if users:
                    raise Conflict(
                        f"exclusive volume {row.name!r} ({row.id}) is mounted by sandbox "
                        f"{users[0]}; an exclusive volume is attached to one sandbox at a "
                        "time (delete that sandbox first)"
                    )
            planned.append(
                PlannedMount(row, MountRow(row.id, sandbox_id, m.path, m.read_only, slot))
            )
        return planned

    def attach(self, sandbox_id: str, planned: Sequence[PlannedMount]) -> None:
        """Write the mount rows (the sandbox's teardown releases them)."""
        if not planned:
            return
        self.core.own_volumes(sandbox_id)
        self.core.volumes.attach(sandbox_id, [p.mount for p in planned], self.core.host_id)

    def drives(self, planned: Sequence[PlannedMount]) -> list[VolumeDrive]:
        """The exclusive volumes' block devices, each at its mount slot."""
        return [
            VolumeDrive(
                self.core.volume_files.path(p.volume.id),
                p.volume.id,
                p.mount.read_only,
                p.mount.slot,
            )
            for p in planned
            if p.volume.kind is VolumeKind.EXCLUSIVE
        ]

    @staticmethod
    def share_slots(planned: Sequence[PlannedMount]) -> list[int]:
        """The mount slots of shared volumes: a virtio-serial port each."""
        return [p.mount.slot for p in planned if p.volume.kind is VolumeKind.SHARED]

    # -- growing -----------------------------------------------------------------------

    async def grow(self, ref: str, size_bytes: int, project: str = DEFAULT_PROJECT) -> VolumeInfo:
        """Grow a volume to ``size_bytes`` (never shrink). Mounted by a running sandbox:
        live (QMP ``block_resize``, then the guest grows its ext4; ``df`` sees it). Not
        mounted (or its sandbox paused in disk mode): the file only; the guest grows the
        ext4 at its next read-write mount (the host never parses a guest-written
        filesystem). A sandbox paused in memory mode holds the old size in its saved
        device state: resume it first."""
        row = self._row(project, ref)
        validate_size(size_bytes)
        if size_bytes < row.size_bytes:
            raise InvalidArgument(
                f"size={size_bytes} is smaller than volume {row.name!r} ({row.size_bytes} "
                "bytes); volumes only grow"
            )
        if size_bytes == row.size_bytes:
            return self._info(row)
        if row.kind is VolumeKind.SHARED:
            raise InvalidArgument(
                f"volume {row.name!r} is shared: growing a shared volume is not supported "
                "in this version (its size is fixed at create); create a larger one and "
                "copy the data"
            )
        self._require_here(row, "growing it")
        async with self._lock(row.id):
            self._check_quota(project, extra_count=0, extra_bytes=size_bytes - row.size_bytes)
            mounts = self.core.volumes.mounts_of_volume(row.id)
            if not mounts:
                await asyncio.to_thread(self.core.volume_files.grow_offline, row.id, size_bytes)
            else:
                m = mounts[0]
                async with self.core.lock(m.sandbox_id):
                    rec = self.core.get(m.sandbox_id)
                    if rec.state is SandboxState.PAUSED and rec.pause_mode is PauseMode.DISK:
                        await asyncio.to_thread(
                            self.core.volume_files.grow_offline, row.id, size_bytes
                        )
                    else:
                        runtime = self._running(rec, f"grow volume {row.name!r}")
                        await runtime.grow_disk(volume_drive_id(m.slot), m.path, size_bytes)
            self.core.volumes.set_size(row.id, size_bytes)
        return self._info(self._row(project, row.id))

    async def grow_sandbox_disk(self, sandbox_id: str, disk_gib: int) -> SandboxRecord:
        """Grow a running sandbox's own disk to ``disk_gib`` GiB, live, with its root
        filesystem."""
        lo, hi = DISK_GIB_RANGE
        if isinstance(disk_gib, bool) or not isinstance(disk_gib, int) or not lo <= disk_gib <= hi:
            raise InvalidArgument(f"disk_gib={disk_gib!r} is out of range; accepted: {lo}-{hi}")
        async with self.core.lock(sandbox_id):
            rec = self.core.get(sandbox_id)
            if disk_gib < rec.shape.disk_gib:
                raise InvalidArgument(
                    f"disk_gib={disk_gib} is smaller than the sandbox's disk "
                    f"({rec.shape.disk_gib} GiB); disks only grow"
                )
            if disk_gib == rec.shape.disk_gib:
                return rec
            runtime = self._running(rec, "grow its disk")
            await runtime.grow_disk("root", "/", disk_gib << 30)
            self.core.states.disk_grown(sandbox_id, disk_gib)  # the row and its meter
            return self.core.get(sandbox_id)

    def _running(self, rec: SandboxRecord, action: str) -> Runtime:
        runtime = self.core.runtimes.get(rec.id)
        if rec.state is not SandboxState.RUNNING or runtime is None:
            raise StateError(
                f"sandbox {rec.id}",
                str(rec.state),
                ["running"],
                f"resume it to {action} (a live grow needs the VM running)",
            )
        return runtime


async def mount_all(core: SandboxRegistry, sandbox_id: str, runtime: Runtime) -> None:
    """Mount the sandbox's volumes in its guest (after a boot: create, disk resume);
    shared ones are served from the host first."""
    await core.shared.serve(sandbox_id)
    for m in core.volumes.mounts_of_sandbox(sandbox_id):
        row = core.volumes.get_by_id(m.volume_id)
        if row is not None and row.kind is VolumeKind.SHARED:
            await runtime.mount_shared(m.slot, m.path, read_only=m.read_only)
        else:
            await runtime.mount_volume(m.volume_id, m.path, read_only=m.read_only)


def refuse_copy(
    core: SandboxRegistry, sandbox_id: str, action: str, *, shared_ok: bool = False
) -> None:
    """Fork of a sandbox with exclusive volumes, and named snapshots of one with any
    volume, are refused (see ARCHITECTURE.md "Volumes": one block device cannot be
    attached to several VMs, and a snapshot holds the sandbox's disk, not its volumes).
    ``shared_ok`` (fork): shared volumes are fine, the children mount them too."""
    mounts = core.volumes.mounts_of_sandbox(sandbox_id)
    names = []
    for m in mounts:
        row = core.volumes.get_by_id(m.volume_id)
        if shared_ok and row is not None and row.kind is VolumeKind.SHARED:
            continue
        kind = row.kind.value if row else "unknown"
        names.append(f"{row.name if row else m.volume_id} ({kind}) at {m.path}")
    if not names:
        return
    if shared_ok:
        raise Conflict(
            f"sandbox {sandbox_id} mounts exclusive volume(s) ({', '.join(names)}); "
            f"{action} is refused for sandboxes with exclusive volumes: an exclusive volume "
            "is attached to one sandbox at a time, and a copy would not hold its data. Use "
            "a shared volume (fork children mount it too), or copy the data into the "
            "sandbox's own disk first"
        )
    raise Conflict(
        f"sandbox {sandbox_id} mounts volume(s) ({', '.join(names)}); {action} is refused "
        "for sandboxes with volumes: a snapshot holds the sandbox's disk and memory, not "
        "its volumes, and a restore would pair its page cache with a volume that moved "
        "on. Copy the data into the sandbox's own disk first, or use a sandbox without "
        "volumes"
    )
