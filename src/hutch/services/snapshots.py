"""Fork and named snapshots of sandboxes (:class:`SnapshotService`).

A fork pauses the parent into a frozen snapshot, then restores the parent and every
child from it as copy-on-write clones (``start_clone``); a named snapshot is the same
freeze with a row of its own. Both hold the parent running and quiesced
(:meth:`LifecycleService.running_as_it_was`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from dataclasses import replace
from pathlib import Path

from hutch.crashpoints import crash_point
from hutch.errors import HutchError, InvalidArgument, NotFound, QuotaExceeded, SnapshotError
from hutch.models import (
    FORK_COUNT_RANGE,
    SNAPSHOT_ID_RE,
    NetworkMode,
    PauseMode,
    SandboxRecord,
    SandboxState,
    SnapshotRecord,
    new_sandbox_id,
    new_snapshot_id,
    validate_name,
)
from hutch.services.events import because, project_of
from hutch.services.lifecycle import LifecycleService
from hutch.services.projects import check_quota
from hutch.services.registry import SandboxRegistry
from hutch.services.remote_clones import RemoteClones
from hutch.services.snapshot_blobs import SnapshotBlobs
from hutch.services.volumes import refuse_copy

__all__ = ["CLONES_PER_CPU", "SnapshotService", "fork_parallelism", "mem_available_mib"]

log = logging.getLogger("hutch.services.sandboxes")

#: Clone restores in flight per host CPU during a fork. A restore is partly CPU (QEMU's
#: start, loading the stream, the guest's first instructions under TCG) and partly
#: waiting (QMP round trips, the agent's hello), so a little more than one per CPU keeps
#: the CPUs busy without queueing every clone's agent timeout behind the others. Not
#: "all at once": restores are CPU-bound, and measured on 2 CPUs under TCG a fork of 50
#: with every clone started at once took 38.3 s against 33.4 s with 8 in flight (more
#: QEMUs sharing the caches; ARCHITECTURE.md, "Fork: where the time goes").
CLONES_PER_CPU = 4
#: Host memory a clone may need while it starts beyond its guest RAM (QEMU itself).
CLONE_OVERHEAD_MIB = 64


def fork_parallelism(count: int, cpus: int, mem_available_mib: int | None, clone_mib: int) -> int:
    """How many of a fork's ``count`` clones start at once: bounded by the host's CPUs
    (``CLONES_PER_CPU`` each) and by the memory available now (``mem_available_mib``,
    None when unknown) over what one clone may take (``clone_mib``: its RAM plus
    overhead, the most a clone restored from a full stream fills). At least 1."""
    limit = min(count, max(1, cpus) * CLONES_PER_CPU)
    if mem_available_mib is not None:
        limit = min(limit, mem_available_mib // max(1, clone_mib))
    return max(1, limit)


def mem_available_mib() -> int | None:
    """The host's MemAvailable in MiB (None when /proc/meminfo cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class SnapshotService:
    def __init__(
        self,
        core: SandboxRegistry,
        lifecycle: LifecycleService,
        blobs: SnapshotBlobs | None = None,
    ) -> None:
        self.core = core
        self.lifecycle = lifecycle
        #: Named snapshots in the blob store (none configured: a disabled one).
        self.blobs = blobs if blobs is not None else SnapshotBlobs(core, None, 0)
        #: Fork children on other hosts (through the same blob store).
        self.remote = RemoteClones(core, self.blobs)

    async def fork(self, sandbox_id: str, count: int = 1) -> list[SandboxRecord]:
        """``count`` new sandboxes, each a copy-on-write clone of this one as it is now.

        The parent is left as it was (running, or paused again if it was paused).
        """
        lo, hi = FORK_COUNT_RANGE
        if isinstance(count, bool) or not isinstance(count, int) or not lo <= count <= hi:
            raise InvalidArgument(f"count={count!r} is out of range; accepted: {lo}-{hi}")
        refuse_copy(self.core, sandbox_id, "fork", shared_ok=True)
        with because("fork"), self.core.metrics.timed("fork"):
            async with self.lifecycle.running_as_it_was(sandbox_id, "fork") as parent:
                children = await self._fork_locked(parent, count)
        self.core.events.record(
            "sandbox.forked",
            project=project_of(parent),
            sandbox_id=parent.id,
            data={"children": [c.id for c in children]},
        )
        return children

    async def _fork_locked(self, parent: SandboxRecord, count: int) -> list[SandboxRecord]:
        shared = self.core.shared.shared_mounts(parent.id)
        me = self.core.host_id
        async with self.core.create_gate:
            # Where each child goes (other hosts only with a blob store to reach them).
            hosts_for = self.remote.place(parent, count)
            here = hosts_for.count(me)
            check_quota(
                self.core.projects,
                parent.project,
                sandboxes=count,
                vcpus=parent.shape.vcpus * count,
                memory_mib=parent.shape.memory_mib * count,
            )
            if here:
                self.core.check_capacity(
                    parent.shape.memory_mib * here,
                    extra_sandboxes=here,
                    vcpus=parent.shape.vcpus * here,
                )
            children = []
            remote: dict[str, list[SandboxRecord]] = {}
            for host in hosts_for:
                child = replace(
                    parent,
                    id=new_sandbox_id(),
                    name=None,
                    state=SandboxState.CREATING,
                    created_at=time.time(),
                    started_at=None,
                    expires_at=None,
                    ended_at=None,
                    error=None,
                    pause_mode=None,
                    paused_at=None,
                    resume_from=None,
                    resume_clone=False,
                    parent_id=parent.id,
                )
                self.core.states.insert(child, origin="fork", host=host)
                if host != me:
                    remote.setdefault(host, []).append(child)
                    continue
                self.core.own_files(child.id)
                if shared:
                    # The children mount the parent's shared volumes, at the same slots
                    # (their guests have them mounted already, in the memory they share).
                    self.core.own_volumes(child.id)
                    self.core.volumes.attach(
                        child.id, [replace(m, sandbox_id=child.id) for m in shared], me
                    )
                children.append(child)
        crash_point("fork.rows")
        snapshot_dir = self.core.backend.fork_dir("fork-" + secrets.token_hex(6))
        parallel = fork_parallelism(
            count,
            os.cpu_count() or 1,
            mem_available_mib(),
            parent.shape.memory_mib + CLONE_OVERHEAD_MIB,
        )
        gate = asyncio.Semaphore(parallel)
        # Each child's network is made while the parent freezes (the save keeps one CPU
        # busy; networks are made one at a time, under the network's lock), and each
        # child starts once the freeze is done and its own network is up; the parent
        # comes back beside its children (one more clone of the same snapshot).
        freeze = asyncio.ensure_future(self._freeze(parent, snapshot_dir))

        async def frozen() -> bool:
            await asyncio.wait({freeze})  # never cancels the freeze
            return not freeze.cancelled() and freeze.exception() is None

        async def start(child: SandboxRecord) -> SandboxRecord | BaseException | None:
            unwired = await self._wire(parent, child)
            if not await frozen():
                return None  # the fork fails whole (below)
            if unwired is not None:
                return unwired  # its network failed: FAILED already, with the reason
            async with gate, self.core.lock(child.id):
                current = self.core.states.current(child.id)
                if current is not None and current.state is not SandboxState.CREATING:
                    return current  # deleted before its turn came: as the delete left it
                try:
                    await self.core.shared.serve(child.id)  # its own sessions
                    self.core.own_vm(child.id)
                    runtime = await self.core.backend.start_clone(child, snapshot_dir)
                except BaseException as exc:
                    await self.core.teardown(child.id)
                    self.core.finish(child.id, SandboxState.FAILED, str(exc))
                    return exc
                self.core.attach(child.id, runtime)
                return self.core.states.running(child)

        async def back() -> BaseException | None:
            if not await frozen():
                return None
            try:
                await self._bring_back(parent, snapshot_dir)
            except BaseException as exc:
                return exc
            crash_point("fork.parent")
            return None

        async def elsewhere() -> None:
            if remote and await frozen():
                await self.remote.start(parent, snapshot_dir, remote)

        try:
            unback, results, _ = await asyncio.gather(
                back(), asyncio.gather(*(start(c) for c in children)), elsewhere()
            )
        finally:
            if not freeze.done():  # cancelled meanwhile: so is the freeze
                freeze.cancel()
                await asyncio.wait({freeze})
        failure = asyncio.CancelledError() if freeze.cancelled() else freeze.exception()
        failure = failure or unback
        if failure is not None:
            # The freeze failed (the parent runs on), or the parent cannot come back (it
            # is paused on the snapshot; a resume brings it back): the fork fails whole.
            for child in [*children, *(k for kids in remote.values() for k in kids)]:
                await self.core.teardown(child.id)
                self.core.finish(child.id, SandboxState.FAILED, f"fork failed: {failure}")
            raise failure
        failed = [
            (c.id, r)
            for c, r in zip(children, results, strict=True)
            if isinstance(r, BaseException)
        ]
        for kid in (k for kids in remote.values() for k in kids):
            row = self.core.states.current(kid.id)
            if row is not None and row.state is SandboxState.RUNNING:
                results.append(row)
            elif row is None or row.state is not SandboxState.DESTROYED:
                failed.append((kid.id, SnapshotError((row.error if row else None) or "gone")))
        children = [*children, *(k for kids in remote.values() for k in kids)]
        if failed:
            for child_id, err in failed:
                log.warning("fork of %s: clone %s failed: %s", parent.id, child_id, err)
            first = failed[0][1]
            if len(failed) == 1 or not isinstance(first, HutchError):
                raise first
            # Each failed clone by id (they are FAILED rows with their reason); the ones
            # that started keep running. The first failure's class picks the status.
            detail = "; ".join(f"{cid}: {err}" for cid, err in failed)
            try:
                summary = type(first)(f"{len(failed)} of {count} clones failed to start: {detail}")
            except TypeError:  # a class whose constructor takes more than a message
                raise first from None
            raise summary from first
        return [r for r in results if isinstance(r, SandboxRecord)]

    async def _wire(self, parent: SandboxRecord, child: SandboxRecord) -> BaseException | None:
        """Give a local ``child`` its network: the parent's rules and networks, its own
        address and name. A failure ends the child FAILED with the reason, which is
        returned (never raised: the fork goes on with the others)."""
        net = self.core.net
        if net is None or child.network is not NetworkMode.DEFAULT:
            return None
        async with self.core.lock(child.id):
            current = self.core.states.current(child.id)
            if current is not None and current.state is not SandboxState.CREATING:
                return None  # deleted meanwhile: as the delete left it
            try:
                self.core.own_network(child.id)
                await net.attach(child.id, net.policy_of(parent.id), net.networks_of(parent.id))
            except BaseException as exc:
                await self.core.teardown(child.id)
                self.core.finish(child.id, SandboxState.FAILED, str(exc))
                return exc
        return None

    async def _freeze_parent(self, parent: SandboxRecord, snapshot_dir: Path) -> None:
        """Save the running ``parent`` into ``snapshot_dir`` and bring it back as a clone
        of it. On failure the parent is running (or, if it cannot come back, paused on
        the snapshot) and the error is raised."""
        await self._freeze(parent, snapshot_dir)
        await self._bring_back(parent, snapshot_dir)

    async def _freeze(self, parent: SandboxRecord, snapshot_dir: Path) -> None:
        """Save the running ``parent`` into ``snapshot_dir``; its QEMU ends, its row is
        RESUMING. On failure the parent runs on and the error is raised."""
        runtime = self.core.runtimes[parent.id]
        self.core.stop_watching(parent.id)
        runtime.agent.close_reason = (
            f"sandbox {parent.id} was frozen for a fork or snapshot: this stream ended, but "
            "what runs in the guest keeps running; attach or read again"
        )
        self.core.states.move(
            parent.id,
            SandboxState.PAUSING,
            pause_mode=PauseMode.MEMORY,
            resume_from=str(snapshot_dir),
            resume_clone=True,
        )
        try:
            await runtime.freeze(snapshot_dir)
        except BaseException:
            self.core.attach(parent.id, runtime)
            self.core.states.running_again(parent.id)
            raise
        self.core.runtimes.pop(parent.id, None)
        self.core.states.move(parent.id, SandboxState.RESUMING)

    async def _bring_back(self, parent: SandboxRecord, snapshot_dir: Path) -> None:
        """The frozen ``parent`` restored as a clone of ``snapshot_dir``; on failure it
        is paused on the snapshot (a resume brings it back) and the error is raised."""
        try:
            self.core.own_vm(parent.id)
            self.core.attach(parent.id, await self.core.backend.start_clone(parent, snapshot_dir))
        except BaseException:
            self.core.states.move(parent.id, SandboxState.PAUSED)
            raise
        self.core.states.running_again(parent.id)

    # -- named snapshots ----------------------------------------------------------------

    async def snapshot(self, sandbox_id: str, name: str) -> SnapshotRecord:
        """Save the sandbox's memory, devices and disk under ``name``. The sandbox is
        paused for the moment of the save and then runs on (or stays paused).

        The snapshot's row is written (not ready: unlisted) before any of its files, so
        a daemon killed during the save finds it and finishes or drops it.
        """
        validate_name(name)
        self._snapshot_quota(self.core.get(sandbox_id).project)  # fail fast, before any work
        refuse_copy(self.core, sandbox_id, "a named snapshot")
        with because("snapshot"), self.core.metrics.timed("snapshot"):
            snap = await self._snapshot(sandbox_id, name)
        self.core.events.record(
            "snapshot.created",
            project=snap.project,
            sandbox_id=snap.sandbox_id,
            data={"snapshot": snap.id, "name": snap.name, "size_bytes": snap.size_bytes},
        )
        # Usable from any host once this upload completes (event snapshot.uploaded).
        self.blobs.schedule(snap)
        return snap

    async def _snapshot(self, sandbox_id: str, name: str) -> SnapshotRecord:
        async with self.lifecycle.running_as_it_was(sandbox_id, "snapshot") as parent:
            snap_id = new_snapshot_id()
            snapshot_dir = self.core.backend.fork_dir(snap_id)
            snap = SnapshotRecord(
                id=snap_id,
                name=name,
                sandbox_id=parent.id,
                image=parent.image,
                shape=parent.shape,
                path=str(snapshot_dir),
                # Reserved against the quota until the save's real size replaces it.
                size_bytes=self.core.backend.snapshots.estimate(parent),
                created_at=time.time(),
                project=parent.project,
            )
            quota = self._snapshot_quota(parent.project)
            self.core.store.insert_snapshot(snap, ready=False, quota=quota)
            crash_point("snapshot.row")
            try:
                await self._freeze_parent(parent, snapshot_dir)
            except BaseException:
                # Its files, if any, go with collection (unless the parent is paused on them).
                self.core.store.delete_snapshot(snap_id)
                raise
            crash_point("snapshot.frozen")
            snap = replace(
                snap,
                size_bytes=await asyncio.to_thread(self.core.backend.snapshots.size, snapshot_dir),
            )
            quota = self._snapshot_quota(parent.project)
            if not self.core.store.finish_snapshot(snap_id, snap.size_bytes, quota=quota):
                self.core.collect_snapshots()
                raise QuotaExceeded(
                    f"project {parent.project!r} quota max_snapshot_bytes exceeded: the "
                    f"snapshot came to {snap.size_bytes} bytes, more than the quota of "
                    f"{quota} leaves; it was discarded (the sandbox runs on). Delete "
                    "snapshots or raise the quota"
                )
        return snap

    def _snapshot_quota(self, project: str) -> int | None:
        """The project's ``max_snapshot_bytes`` (None: none), refused at once when the
        project is at it already. The hold itself is the store's: a save reserves its
        estimated size in the transaction that inserts its row, and its real size must
        fit when it is finished (:meth:`hutch.store.db.Store.insert_snapshot`)."""
        row = self.core.projects.get(project)
        limit = row.quotas.get("max_snapshot_bytes") if row is not None else None
        if limit is None:
            return None
        used = self.core.projects.use(project).snapshot_bytes
        if used >= limit:
            raise QuotaExceeded(
                f"project {project!r} quota max_snapshot_bytes exceeded: {used} in use or "
                f"reserved >= limit {limit}; delete snapshots or raise the quota"
            )
        return limit

    def get_snapshot(self, snapshot_id: str, project: str | None = None) -> SnapshotRecord:
        """The snapshot; with ``project``, one of another project is not found, exactly
        as a missing one (its id is not disclosed)."""
        snap = (
            self.core.store.get_snapshot(snapshot_id) if SNAPSHOT_ID_RE.match(snapshot_id) else None
        )
        if snap is None or (project is not None and snap.project != project):
            raise NotFound(f"no snapshot {snapshot_id!r}; ids look like snap-0123456789ab")
        return snap

    def list_snapshots(self, project: str | None = None) -> list[SnapshotRecord]:
        """``project``'s snapshots (None: every project's, for the daemon's own use)."""
        return self.core.store.list_snapshots(project=project)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete the snapshot, in any order with the sandboxes and snapshots built on
        it: it is no longer listed nor restorable at once; its files go now, or, while
        another disk is built on its disk, when the last of those goes."""
        snap = self.get_snapshot(snapshot_id)
        self.core.store.delete_snapshot(snapshot_id)
        self.core.events.record(
            "snapshot.deleted",
            project=snap.project,
            sandbox_id=snap.sandbox_id,
            data={"snapshot": snap.id, "name": snap.name},
        )
        self.core.collect_snapshots()
        await self.blobs.delete(snapshot_id)
