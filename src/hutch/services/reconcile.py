"""Start-up reconcile (:class:`Reconciler`): make the database and the host agree after
a start or a crash.

Live rows whose VM still runs are adopted; the rest are finished as their row says (a
save cut short: paused) or cleaned and marked failed (or destroyed, if a delete was
under way). Snapshots whose save was cut short are finished or dropped; processes and
files on the host that no live row owns are removed. The quick half (:meth:`host`) runs
before the API serves; the daemon runs the rest (:meth:`rows`) in the background, while
the sandboxes still being checked answer 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

from hutch.errors import HutchError
from hutch.models import PauseMode, SandboxRecord, SandboxState, SnapshotRecord
from hutch.runtime.backend import Runtime
from hutch.services.events import internal
from hutch.services.registry import SandboxRegistry
from hutch.store.db import LIVE_STATES

__all__ = ["RECONCILE_PARALLELISM", "ReconcilePlan", "Reconciler"]

log = logging.getLogger("hutch.services.sandboxes")

#: Sandboxes a restarted daemon checks at once (each mostly waits on its VM's sockets).
RECONCILE_PARALLELISM = 16


class Reconciler:
    def __init__(self, core: SandboxRegistry) -> None:
        self.core = core
        #: False until every row found at the start has been checked.
        self.reconciled = False

    async def finish_start(self, plan: ReconcilePlan) -> None:
        """The second half after a start: never raises (a restart retries what failed);
        ``reconciled`` once it is over."""
        try:
            await self.rows(plan)
        except Exception:
            log.exception("reconcile failed; a restart retries it")
        finally:
            self.core.states.checking.clear()
            self.reconciled = True

    @property
    def reconciling(self) -> int:
        """Sandboxes still being checked after the start."""
        return len(self.core.states.checking)

    async def host(self) -> ReconcilePlan:
        """The quick half, before the API serves: half-built templates and leftovers of
        sandboxes with no live row go; the rows to check are marked as being checked."""
        self.core.backend.templates.discard_unfinished()
        # Listed before the rows are read: a sandbox's row is written before its files.
        leftovers = self.core.backend.leftover_ids()
        live = self.core.own_rows(LIVE_STATES)
        for rec in live:
            self.core.own_all(rec.id)  # whatever of it is on the host, its teardown ends
        for orphan in sorted(leftovers - {rec.id for rec in live}):
            log.info("removing leftovers of sandbox %s", orphan)
            await self.core.backend.cleanup(orphan)
        # Mounts of sandboxes that ended (a crash between the end and its teardown) free
        # their volumes; volume files no row names (a create or delete cut short) go.
        # Every host's live sandboxes: a mount row of another host's is that host's.
        live_ids = {rec.id for rec in self.core.store.list_sandboxes(states=LIVE_STATES)}
        for sandbox_id in sorted(self.core.volumes.mounting_sandboxes() - live_ids):
            await self.core.release_volumes(sandbox_id)
        # Volumes made before hosts were recorded belong to the host holding the file.
        claimed = self.core.volumes.claim_unhomed(self.core.host_id, self.core.volume_files.ids())
        if claimed:
            log.info("volumes %s: their files are here, recorded as this host's", claimed)
        for name in self.core.volume_files.sweep(self.core.volumes.all_ids()):
            log.info("removed the volume file %s: no volume row names it", name)
        # Shared volumes: serve the live sandboxes again (a running guest's FUSE waits
        # for its next session; a paused one's link waits for the resume), then unmount
        # what an earlier daemon left mounted for sandboxes that are gone.
        for rec in live:
            try:
                await self.core.shared.serve(rec.id)
            except HutchError as exc:
                log.error("sandbox %s: cannot serve its shared volumes: %s", rec.id, exc)
        await self.core.shared.sweep()
        rows = [rec for rec in live if rec.state is not SandboxState.PAUSED]
        self.core.states.checking = {rec.id for rec in rows}
        # Read now: a snapshot started after this point is not a leftover.
        unfinished = [
            snap
            for snap in self.core.store.list_snapshots(ready=False)
            if self.core.hosts.host_of_snapshot(snap.id) in (self.core.host_id, None)
        ]
        return ReconcilePlan(rows, unfinished)

    async def rows(self, plan: ReconcilePlan) -> None:
        """Check every row concurrently (a slow VM holds up only itself), then finish
        the snapshots cut short and collect what nothing reaches any more."""
        gate = asyncio.Semaphore(RECONCILE_PARALLELISM)

        async def check(rec: SandboxRecord) -> None:
            async with gate, self.core.lock(rec.id):
                try:
                    await self._reconcile_one(rec)
                except Exception:
                    log.exception("could not reconcile sandbox %s; a restart retries", rec.id)
                finally:
                    self.core.states.checking.discard(rec.id)

        await asyncio.gather(*(check(rec) for rec in plan.rows))
        for snap in plan.unfinished_snapshots:
            if await asyncio.to_thread(self.core.backend.snapshots.complete, Path(snap.path)):
                size = await asyncio.to_thread(self.core.backend.snapshots.size, Path(snap.path))
                self.core.store.finish_snapshot(snap.id, size)
                log.info("snapshot %s (%s): finished the save cut short", snap.id, snap.name)
            else:
                self.core.store.delete_snapshot(snap.id)
                log.info("snapshot %s (%s): its save was cut short; dropped", snap.id, snap.name)
        self.core.collect_snapshots()

    async def _reconcile_one(self, rec: SandboxRecord) -> None:
        internal("restart")
        runtime: Runtime | None = None
        if rec.state is not SandboxState.STOPPING:
            try:
                runtime = await self.core.backend.adopt(rec)
            except HutchError as exc:
                log.warning("could not adopt %s: %s", rec.id, exc)
        if runtime is not None:
            self.core.attach(rec.id, runtime)
            if rec.state is SandboxState.CREATING:
                self.core.states.running(rec)
            elif rec.state is not SandboxState.RUNNING:
                # A pause that had not finished (the VM still runs) or a resume that
                # had: either way the VM is running now.
                with contextlib.suppress(HutchError):
                    await runtime.cont()
                self.core.states.running_again(rec.id)
            log.info("adopted running sandbox %s", rec.id)
            return
        # Not adopted: a QEMU still there (one that did not answer) must be gone before
        # the row can say paused, or a resume would start a second one on the same disk.
        await self.core.backend.kill_vm(rec.id)
        if rec.state in (SandboxState.PAUSING, SandboxState.RESUMING) and (
            rec.resume_from is not None
            and await self.core.backend.snapshots.recover(
                rec.id, rec.resume_from, clone=rec.resume_clone
            )
        ):
            self.core.states.move(rec.id, SandboxState.PAUSED, lost=True)
            log.info("sandbox %s recovered as paused", rec.id)
            return
        if (
            rec.state in (SandboxState.PAUSING, SandboxState.RESUMING)
            and rec.pause_mode is PauseMode.DISK
        ):
            # Disk mode keeps only the disk (synced by the guest before QEMU ended, and
            # untouched by a boot that had not got its agent up): paused, boots again.
            self.core.states.move(rec.id, SandboxState.PAUSED, lost=True)
            return
        await self.core.teardown(rec.id)
        if rec.state is SandboxState.STOPPING:
            self.core.finish(rec.id, SandboxState.DESTROYED, lost=True)
        elif rec.state is SandboxState.CREATING:
            self.core.finish(
                rec.id,
                SandboxState.FAILED,
                "the daemon stopped before the sandbox had started; create (or fork) again",
                lost=True,
            )
        else:
            self.core.finish(
                rec.id, SandboxState.FAILED, "the VM was gone when the daemon restarted", lost=True
            )


@dataclass(frozen=True)
class ReconcilePlan:
    """What the quick half of reconcile leaves to the second: the rows to check and the
    snapshots whose save was under way when the daemon stopped."""

    rows: list[SandboxRecord]
    unfinished_snapshots: list[SnapshotRecord]
