"""Sandbox lifecycle: create, inspect, exec, files, destroy; reconcile after a restart.

The states and the transitions between them are :mod:`hutch.services.state`, the only
writer of a sandbox's state. A fork pauses the parent into a frozen snapshot, then
restores the parent and every child from it as copy-on-write clones (``start_clone``).

Every transition is written before the side effect it announces, so a daemon killed at
any point finds, on restart, a row that tells it what to finish (see ``reconcile`` and
ARCHITECTURE.md, "Crash safety").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from hutch.config import Settings
from hutch.errors import Capacity, Conflict, HutchError, NotFound, StateError
from hutch.guest.client import ExecStream
from hutch.guest.results import FileEntry
from hutch.images.build import ImageArtifacts
from hutch.models import (
    NetworkMode,
    PauseMode,
    SandboxRecord,
    SandboxSpec,
    SandboxState,
    Shape,
    SnapshotRecord,
    new_sandbox_id,
)
from hutch.net.rules import parse_policy
from hutch.runtime.backend import Runtime, VmBackend
from hutch.services.activity import Activity
from hutch.services.guest_ops import GuestOpsMixin
from hutch.services.image_defaults import run_start_command
from hutch.services.images import ImageDefaults, ImageSource, ImageView, resolve
from hutch.services.lifecycle import LifecycleMixin
from hutch.services.networking import NetPlan, NetworkingMixin
from hutch.services.policies import PoliciesMixin
from hutch.services.pool import WarmPool
from hutch.services.state import SandboxStates
from hutch.store import Store
from hutch.store.db import LIVE_STATES
from hutch.vm.process import OUT_OF_MEMORY

if TYPE_CHECKING:
    from hutch.services.network import NetworkService as NetworkManager

__all__ = ["ExecStream", "FileEntry", "SandboxService"]

log = logging.getLogger(__name__)

#: Sandboxes a restarted daemon checks at once (each mostly waits on its VM's sockets).
RECONCILE_PARALLELISM = 16


class SandboxService(LifecycleMixin, GuestOpsMixin, PoliciesMixin, NetworkingMixin):
    def __init__(
        self,
        settings: Settings,
        store: Store,
        backend: VmBackend,
        images: ImageSource,
        net: NetworkManager | None = None,
    ) -> None:
        """``net`` None (tests without root): every sandbox gets network "none"."""
        self.settings = settings
        self.net = net
        # Idle tracking for auto_pause_s and the calls in flight that pause, snapshot and
        # fork wait for. ``clock``: the wall clock of activity, pauses and the reaper.
        self.clock: Callable[[], float] = time.time
        self.activity = Activity(clock=lambda: self.clock())
        if net is not None:
            net.forwarder.activity = self.activity.in_use  # an open inbound connection is use
        self.store = store
        self.states = SandboxStates(store)
        self.backend = backend
        self.image_source = images
        self._runtimes: dict[str, Runtime] = {}
        self._monitors: dict[str, asyncio.Task[None]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._create_gate = asyncio.Lock()
        # One template build at a time: each boots a VM, and boots compete for CPU.
        self._template_gate = asyncio.Lock()
        self._template_tasks: dict[tuple[str, str, Shape], asyncio.Task[None]] = {}
        self.pool = WarmPool(
            backend,
            settings.pool_size if settings.templates else 0,
            prepare=self._prepare_pooled,
            release=self._release_network,
            network=NetworkMode.DEFAULT if net is not None else NetworkMode.NONE,
        )
        self._reaper: asyncio.Task[None] | None = None
        self._reconcile_task: asyncio.Task[None] | None = None
        self.reconciled = False
        # Snapshot directories an operation is about to clone (kept from collection).
        self._snapshot_holds: Counter[str] = Counter()

    # -- daemon lifecycle --------------------------------------------------------------

    async def start(self, *, background: bool = False) -> None:
        """Reconcile with the host, then start the warm pool and the reaper.

        ``background`` (the daemon): return once the quick part is done and check the
        VMs found on the host in a task, so the API serves meanwhile (``reconciled``
        False, the sandboxes still being checked answer 503); else wait for all of it.
        """
        if self.net is not None:
            # Before adoption: adopted guests are told their network again.
            await self.net.start({r.id for r in self.store.list_sandboxes(states=LIVE_STATES)})
        plan = await self._reconcile_host()
        if background:
            self._reconcile_task = asyncio.create_task(
                self._after_start(plan), name="hutch-reconcile"
            )
        else:
            await self._after_start(plan)

    async def _after_start(self, plan: _ReconcilePlan) -> None:
        try:
            await self._reconcile_rows(plan)
        except Exception:
            log.exception("reconcile failed; a restart retries it")
        finally:
            self.states.checking.clear()
            self.reconciled = True
        default = self.image_source.find(self.settings.default_image)
        if default is not None:
            self.pool.refill(default)
        self._reaper = asyncio.create_task(self._reap_expired(), name="hutch-reaper")

    @property
    def reconciling(self) -> int:
        """Sandboxes still being checked after the start."""
        return len(self.states.checking)

    async def close(self) -> None:
        """Stop background work and drop agent connections. VMs keep running (pooled
        ones, which have no row to be adopted by, are destroyed)."""
        await self.pool.close()
        tasks = [
            t
            for t in (
                self._reconcile_task,
                self._reaper,
                *self._monitors.values(),
                *self._template_tasks.values(),
            )
            if t is not None
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for runtime in list(self._runtimes.values()):
            with contextlib.suppress(Exception):
                await runtime.agent.close()
        self._runtimes.clear()
        self._monitors.clear()
        if self.net is not None:
            await self.net.close()
        self.backend.close()

    async def reconcile(self) -> None:
        """Make the database and the host agree after a start or crash (all of it; the
        daemon runs the second half in the background, see ``start``).

        Live rows whose VM still runs are adopted; the rest are finished as their row
        says (a save cut short: paused) or cleaned and marked failed (or destroyed, if a
        delete was under way). Snapshots whose save was cut short are finished or
        dropped; processes and files on the host that no live row owns are removed.
        """
        await self._reconcile_rows(await self._reconcile_host())

    async def _reconcile_host(self) -> _ReconcilePlan:
        """The quick half, before the API serves: half-built templates and leftovers of
        sandboxes with no live row go; the rows to check are marked as being checked."""
        self.backend.templates.discard_unfinished()
        # Listed before the rows are read: a sandbox's row is written before its files.
        leftovers = self.backend.leftover_ids()
        live = self.store.list_sandboxes(states=LIVE_STATES)
        for orphan in sorted(leftovers - {rec.id for rec in live}):
            log.info("removing leftovers of sandbox %s", orphan)
            await self.backend.cleanup(orphan)
        rows = [rec for rec in live if rec.state is not SandboxState.PAUSED]
        self.states.checking = {rec.id for rec in rows}
        # Read now: a snapshot started after this point is not a leftover.
        return _ReconcilePlan(rows, self.store.list_snapshots(ready=False))

    async def _reconcile_rows(self, plan: _ReconcilePlan) -> None:
        """Check every row concurrently (a slow VM holds up only itself), then finish
        the snapshots cut short and collect what nothing reaches any more."""
        gate = asyncio.Semaphore(RECONCILE_PARALLELISM)

        async def check(rec: SandboxRecord) -> None:
            async with gate, self._lock(rec.id):
                try:
                    await self._reconcile_one(rec)
                except Exception:
                    log.exception("could not reconcile sandbox %s; a restart retries", rec.id)
                finally:
                    self.states.checking.discard(rec.id)

        await asyncio.gather(*(check(rec) for rec in plan.rows))
        for snap in plan.unfinished_snapshots:
            if await asyncio.to_thread(self.backend.snapshots.complete, Path(snap.path)):
                size = await asyncio.to_thread(self.backend.snapshots.size, Path(snap.path))
                self.store.finish_snapshot(snap.id, size)
                log.info("snapshot %s (%s): finished the save cut short", snap.id, snap.name)
            else:
                self.store.delete_snapshot(snap.id)
                log.info("snapshot %s (%s): its save was cut short; dropped", snap.id, snap.name)
        self._collect_snapshots()

    async def _reconcile_one(self, rec: SandboxRecord) -> None:
        runtime: Runtime | None = None
        if rec.state is not SandboxState.STOPPING:
            try:
                runtime = await self.backend.adopt(rec)
            except HutchError as exc:
                log.warning("could not adopt %s: %s", rec.id, exc)
        if runtime is not None:
            self._attach(rec.id, runtime)
            if rec.state is SandboxState.CREATING:
                self.states.running(rec)
            elif rec.state is not SandboxState.RUNNING:
                # A pause that had not finished (the VM still runs) or a resume that
                # had: either way the VM is running now.
                with contextlib.suppress(HutchError):
                    await runtime.cont()
                self.states.running_again(rec.id)
            log.info("adopted running sandbox %s", rec.id)
            return
        # Not adopted: a QEMU still there (one that did not answer) must be gone before
        # the row can say paused, or a resume would start a second one on the same disk.
        await self.backend.kill_vm(rec.id)
        if rec.state in (SandboxState.PAUSING, SandboxState.RESUMING) and (
            rec.resume_from is not None
            and await self.backend.snapshots.recover(
                rec.id, rec.resume_from, clone=rec.resume_clone
            )
        ):
            self.states.move(rec.id, SandboxState.PAUSED)
            log.info("sandbox %s recovered as paused", rec.id)
            return
        if (
            rec.state in (SandboxState.PAUSING, SandboxState.RESUMING)
            and rec.pause_mode is PauseMode.DISK
        ):
            # Disk mode keeps only the disk (synced by the guest before QEMU ended, and
            # untouched by a boot that had not got its agent up): paused, boots again.
            self.states.move(rec.id, SandboxState.PAUSED)
            return
        await self.backend.cleanup(rec.id)
        await self._release_network(rec.id)
        if rec.state is SandboxState.STOPPING:
            self._finish(rec.id, SandboxState.DESTROYED)
        elif rec.state is SandboxState.CREATING:
            self._finish(
                rec.id,
                SandboxState.FAILED,
                "the daemon stopped before the sandbox had started; create (or fork) again",
            )
        else:
            self._finish(rec.id, SandboxState.FAILED, "the VM was gone when the daemon restarted")

    # -- queries -----------------------------------------------------------------------

    def get(self, sandbox_id: str) -> SandboxRecord:
        return self.states.get(sandbox_id)

    def list_sandboxes(
        self, state: SandboxState | None = None, metadata: dict[str, str] | None = None
    ) -> list[SandboxRecord]:
        states = [state] if state else [s for s in SandboxState if s is not SandboxState.DESTROYED]
        return self.store.list_sandboxes(states=states, metadata=metadata)

    def images(self) -> list[ImageView]:
        return self.image_source.list()

    def guest_defaults(self, rec: SandboxRecord) -> ImageDefaults:
        """What ``rec`` takes from its image config (env, cwd, user, start command)."""
        return self.image_source.defaults(rec.image)

    async def _run_image_start(self, rec: SandboxRecord, runtime: Runtime) -> None:
        """The image's start command, in a sandbox that just booted (or came from a
        template, which never runs it); fork children and snapshot clones carry theirs
        over in memory."""
        await run_start_command(runtime.agent, rec, self.guest_defaults(rec))

    # -- create / delete ---------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> SandboxRecord:
        source: SnapshotRecord | None = None
        if spec.snapshot_id is not None:
            source = self.get_snapshot(spec.snapshot_id)
            # A snapshot fixes the machine: its image and shape come with it.
            spec = replace(spec, image=source.image, shape=source.shape)
        image = resolve(self.image_source, spec.image)
        plan = self.plan_network(spec)
        if self.net is None:
            plan.mode = NetworkMode.NONE
        # Pooled VMs have the daemon's network mode; other sandboxes are restored.
        use_pool = source is None and plan.mode is self.pool.network
        pooled = self.pool.take(image, spec.shape) if use_pool else None
        async with self._create_gate:
            # Capacity is checked and the row inserted under one lock so that concurrent
            # creates cannot overshoot the limits together.
            try:
                self._check_capacity(spec.shape.memory_mib, extra_sandboxes=1)
            except Capacity:
                if pooled is not None:
                    self.pool.give_back(image, pooled)
                raise
            rec = SandboxRecord(
                id=pooled[0] if pooled else new_sandbox_id(),
                image=spec.image,
                image_digest=image.digest,
                state=SandboxState.CREATING,
                shape=spec.shape,
                created_at=time.time(),
                name=spec.name,
                env=dict(spec.env),
                metadata=dict(spec.metadata),
                timeout_s=spec.timeout_s,
                auto_resume=spec.auto_resume,
                auto_pause_s=spec.auto_pause_s,
                auto_delete_s=spec.auto_delete_s,
                snapshot_id=spec.snapshot_id,
                network=plan.mode,
            )
            self.states.insert(rec)
        async with self._lock(rec.id):
            try:
                # An ephemeral image (a build step's layer) boots once: no template.
                templates = self.settings.templates and not image.ephemeral
                template = self.backend.templates.find(image, spec.shape) if templates else None
                await self._network_for(rec, plan, pooled=pooled is not None)
                if pooled is not None:
                    runtime = pooled[1]
                    if rec.name is not None:
                        # The pooled guest took its id as hostname; a name replaces it.
                        await runtime.retake_identity(rec)
                elif source is not None:
                    # Checked and held with no await in between: a delete of the
                    # snapshot either came first (refused here) or keeps its files.
                    if self.store.get_snapshot(source.id) is None:
                        raise NotFound(f"snapshot {source.id} was deleted during the create")
                    with self._holding(source.path):
                        runtime = await self.backend.start_clone(rec, Path(source.path))
                elif template is not None:
                    runtime = await self.backend.start_clone(rec, template)
                else:
                    runtime = await self.backend.start(rec, image)
                    if templates:
                        self._schedule_template(image, spec.shape)
                self.pool.refill(image)
                if source is None:
                    await self._run_image_start(rec, runtime)
            except BaseException as exc:
                await self.backend.cleanup(rec.id)
                await self._release_network(rec.id)
                reason = str(exc) if isinstance(exc, HutchError) else repr(exc)
                self._finish_create(rec.id, SandboxState.FAILED, reason)
                raise
            current = self.store.get_sandbox(rec.id)
            if current is None or current.state is not SandboxState.CREATING:
                # Deleted while booting.
                await runtime.destroy()
                await self.backend.cleanup(rec.id)
                await self._release_network(rec.id)
                self._finish_create(rec.id, SandboxState.DESTROYED)
                raise Conflict(f"sandbox {rec.id} was deleted while it was being created")
            self._attach(rec.id, runtime)
            return self.states.running(rec)

    async def delete(self, sandbox_id: str) -> None:
        rec = self.get(sandbox_id)
        if not rec.state.is_live:
            return
        if rec.state is SandboxState.CREATING:
            # The create holds the lock while it boots; mark the row so it gives up.
            self.states.move(rec.id, SandboxState.STOPPING)
        async with self._lock(rec.id):
            current = self.states.current(rec.id)
            # Ended meanwhile (the create gave up, or the VM died): nothing to do.
            if current is not None and current.state.is_live:
                if current.state is not SandboxState.STOPPING:
                    self.states.move(rec.id, SandboxState.STOPPING)
                await self._teardown(rec.id)
                self._finish(rec.id, SandboxState.DESTROYED)
        self._collect_snapshots()

    async def take_disk(self, sandbox_id: str, dest: Path) -> None:
        """Hard-link the disk of a sandbox paused in disk mode to ``dest`` (a copy if
        another filesystem), for the image builder, which keeps it as a step layer. The
        sandbox is unchanged; delete it afterwards."""
        async with self._lock(sandbox_id):
            rec = self.get(sandbox_id)
            if rec.state is not SandboxState.PAUSED or rec.pause_mode is not PauseMode.DISK:
                state = f"{rec.state} ({rec.pause_mode})" if rec.pause_mode else str(rec.state)
                raise StateError(f"sandbox {sandbox_id}", state, ["paused (disk)"])
            src = self.backend.disk_path(sandbox_id)

            def link() -> None:
                try:
                    os.link(src, dest)
                except OSError:
                    shutil.copyfile(src, dest)

            await asyncio.to_thread(link)

    async def _teardown(self, sandbox_id: str) -> None:
        self._stop_watching(sandbox_id)
        runtime = self._runtimes.pop(sandbox_id, None)
        if runtime is not None:
            # Streams still open end with this, not with "the VM may have stopped".
            runtime.agent.close_reason = f"sandbox {sandbox_id} was deleted while this call ran"
            await runtime.destroy()
        await self.backend.cleanup(sandbox_id)
        await self._release_network(sandbox_id)

    # -- network plumbing of the lifecycle ----------------------------------------------

    async def _network_for(self, rec: SandboxRecord, plan: NetPlan, *, pooled: bool) -> None:
        """Attach ``rec`` as ``plan`` says (a pooled VM is attached already: its policy
        and networks are set instead)."""
        if self.net is None or plan.mode is NetworkMode.NONE:
            return
        if pooled:
            await self.net.set_policy(rec.id, plan.policy)
            for nid in plan.network_ids:
                await self.net.join(rec.id, nid)
        else:
            await self.net.attach(rec.id, plan.policy, plan.network_ids)

    async def _prepare_pooled(self, stub: SandboxRecord) -> None:
        """A pooled VM gets its tap and address now, and no egress until handed out."""
        if self.net is not None:
            await self.net.attach(stub.id, parse_policy(["deny-all"]), [])

    async def _release_network(self, sandbox_id: str) -> None:
        if self.net is not None:
            try:
                await self.net.detach(sandbox_id)
            except HutchError as exc:
                log.warning("could not release the network of %s: %s", sandbox_id, exc)

    # -- internals ---------------------------------------------------------------------

    def _check_capacity(self, memory_mib: int, extra_sandboxes: int) -> None:
        count, memory = self.store.live_usage()
        limits = self.settings.limits
        if count + extra_sandboxes > limits.max_sandboxes:
            raise Capacity(
                f"this host has {count} sandboxes and the limit is {limits.max_sandboxes} "
                "(HUTCH_MAX_SANDBOXES); delete some or raise the limit"
            )
        if memory + memory_mib > limits.memory_budget_mib:
            raise Capacity(
                f"not enough memory: {memory} MiB reserved + {memory_mib} MiB asked > "
                f"{limits.memory_budget_mib} MiB (HUTCH_MAX_MEMORY_MIB)"
            )

    def _schedule_template(self, image: ImageArtifacts, shape: Shape) -> None:
        """Build the template for (image, shape) in the background, once."""
        key = (image.name, image.digest, shape)
        if key in self._template_tasks:
            return

        async def build() -> None:
            async with self._template_gate:
                try:
                    where = await self.backend.templates.build(image, shape)
                    log.info("template ready for %s at %s: %s", image.name, shape, where)
                    self.pool.refill(image)
                except Exception as exc:
                    log.warning(
                        "could not build the template for %s %s: %s", image.name, shape, exc
                    )
                    self._template_tasks.pop(key, None)

        self._template_tasks[key] = asyncio.create_task(build(), name=f"hutch-template-{key}")

    def _stop_watching(self, sandbox_id: str) -> None:
        monitor = self._monitors.pop(sandbox_id, None)
        if monitor is not None and monitor is not asyncio.current_task():
            monitor.cancel()

    def _collect_snapshots(self) -> None:
        """Remove the snapshot directories nothing reaches any more. Synchronous on
        purpose: no step of another operation runs between reading the references and
        removing, and each operation writes its reference (a snapshot row, ``resume_from``,
        a hold) before it creates the directory."""
        live = self.store.list_sandboxes(states=LIVE_STATES)
        keep = {snap.path for snap in self.store.list_snapshots(ready=None)}
        keep |= {rec.resume_from for rec in live if rec.resume_from is not None}
        keep |= set(self._snapshot_holds)
        for name in self.backend.snapshots.collect({rec.id for rec in live}, keep):
            log.info("removed snapshot %s: nothing is built on it any more", name)

    @contextlib.contextmanager
    def _holding(self, snapshot_path: str) -> Iterator[None]:
        """Keep ``snapshot_path`` from collection while a clone of it is being made (its
        overlay, which then keeps it, does not exist yet)."""
        self._snapshot_holds[snapshot_path] += 1
        try:
            yield
        finally:
            self._snapshot_holds[snapshot_path] -= 1
            if self._snapshot_holds[snapshot_path] <= 0:
                del self._snapshot_holds[snapshot_path]

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def _finish(self, sandbox_id: str, state: SandboxState, error: str | None = None) -> None:
        self.states.ended(sandbox_id, state, error)
        self._locks.pop(sandbox_id, None)
        self.activity.forget(sandbox_id)

    def _finish_create(
        self, sandbox_id: str, state: SandboxState, error: str | None = None
    ) -> None:
        """A create that did not get its sandbox running ends it ``state``, or destroyed
        if a delete asked for that meanwhile (the delete, waiting for the lock, then
        finds nothing left to do)."""
        current = self.states.current(sandbox_id)
        if current is not None and current.state is SandboxState.STOPPING:
            state, error = SandboxState.DESTROYED, None
        self._finish(sandbox_id, state, error)

    def _attach(self, sandbox_id: str, runtime: Runtime) -> None:
        self._runtimes[sandbox_id] = runtime
        self._monitors[sandbox_id] = asyncio.create_task(
            self._watch(sandbox_id, runtime), name=f"hutch-watch-{sandbox_id}"
        )

    async def _watch(self, sandbox_id: str, runtime: Runtime) -> None:
        """Notice a VM that stops on its own, record why, and clean up after it."""
        await runtime.wait_exited()
        rec = self.store.get_sandbox(sandbox_id)
        if rec is None or rec.state is not SandboxState.RUNNING:
            return
        tail = runtime.console_tail(2000)
        log.warning("sandbox %s stopped on its own; console tail:\n%s", sandbox_id, tail)
        async with self._lock(sandbox_id):
            current = self.states.current(sandbox_id)
            if current is None or current.state is not SandboxState.RUNNING:
                return  # paused, deleted or failed meanwhile: that call cleaned up
            self._monitors.pop(sandbox_id, None)
            self._runtimes.pop(sandbox_id, None)
            await runtime.destroy()
            await self.backend.cleanup(sandbox_id)
            # A failed sandbox is never deleted again: its tap and address go now.
            await self._release_network(sandbox_id)
            self._finish(sandbox_id, SandboxState.FAILED, _stopped_error(runtime.exit_reason()))


def _stopped_error(reason: str | None) -> str:
    """The error of a sandbox whose VM stopped on its own: an OOM kill says so first."""
    if reason is not None and reason.startswith(OUT_OF_MEMORY):
        return reason
    return "the VM stopped unexpectedly" + (f" ({reason})" if reason else "")


@dataclass(frozen=True)
class _ReconcilePlan:
    """What the quick half of reconcile leaves to the second: the rows to check and the
    snapshots whose save was under way when the daemon stopped."""

    rows: list[SandboxRecord]
    unfinished_snapshots: list[SnapshotRecord]
