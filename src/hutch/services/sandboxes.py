"""Sandbox lifecycle: create, inspect, exec, files, destroy; reconcile after a restart.

State machine (stored in SQLite, the source of truth)::

    creating ──► running ──► stopping ──► destroyed
        │          │  ▲
        │   pausing│  │resuming
        │          ▼  │
        │         paused ──────► stopping
        └──────────┴──► failed   (VM would not boot, or died on its own; cleaned)

A fork pauses the parent into a frozen snapshot, then restores the parent and every
child from it as copy-on-write clones (``start_clone``).

Every transition is written before the side effect it announces, so a daemon killed at
any point finds, on restart, a row that tells it what to finish (see ``reconcile``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from hutch.config import Settings
from hutch.errors import Capacity, Conflict, HutchError, NotFound
from hutch.guest.client import ExecStream
from hutch.guest.results import FileEntry
from hutch.images.build import ImageArtifacts
from hutch.models import (
    SANDBOX_ID_RE,
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
from hutch.services.backend import Runtime, VmBackend
from hutch.services.guest_ops import GuestOpsMixin
from hutch.services.images import ImageSource, ImageView, resolve
from hutch.services.inflight import InFlight
from hutch.services.lifecycle import LifecycleMixin
from hutch.services.networking import NetPlan, NetworkingMixin
from hutch.services.policies import PoliciesMixin
from hutch.services.pool import WarmPool
from hutch.store import Store
from hutch.store.db import LIVE_STATES

if TYPE_CHECKING:
    from hutch.net.manager import NetworkManager

__all__ = ["ExecStream", "FileEntry", "SandboxService"]

log = logging.getLogger(__name__)


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
        if net is not None:
            net.forwarder.activity = self.activity  # an open inbound connection is use
        self.store = store
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
        # Idle tracking for auto_pause_s: in memory, since after a restart every sandbox
        # counts as freshly active (never paused early).
        self.clock: Callable[[], float] = time.time
        self._last_active: dict[str, float] = {}
        self._busy: dict[str, int] = {}
        # Calls in flight per sandbox, which pause, snapshot and fork wait for.
        self.inflight = InFlight()

    # -- daemon lifecycle --------------------------------------------------------------

    async def start(self) -> None:
        if self.net is not None:
            # Before adoption: adopted guests are told their network again.
            await self.net.start({r.id for r in self.store.list_sandboxes(states=LIVE_STATES)})
        await self.reconcile()
        default = self.image_source.find(self.settings.default_image)
        if default is not None:
            self.pool.refill(default)
        self._reaper = asyncio.create_task(self._reap_expired(), name="hutch-reaper")

    async def close(self) -> None:
        """Stop background work and drop agent connections. VMs keep running (pooled
        ones, which have no row to be adopted by, are destroyed)."""
        await self.pool.close()
        tasks = [
            t
            for t in (self._reaper, *self._monitors.values(), *self._template_tasks.values())
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

    async def reconcile(self) -> None:
        """Make the database and the host agree after a start or crash.

        Live rows whose VM still runs are adopted; the rest are cleaned and marked
        failed (or destroyed, if a delete was under way). Processes and files on the host
        that no live row owns are removed.
        """
        self.backend.discard_unfinished_templates()
        live = self.store.list_sandboxes(states=LIVE_STATES)
        for rec in live:
            if rec.state is SandboxState.PAUSED:
                continue
            runtime: Runtime | None = None
            if rec.state is not SandboxState.STOPPING:
                try:
                    runtime = await self.backend.adopt(rec)
                except HutchError as exc:
                    log.warning("could not adopt %s: %s", rec.id, exc)
            if runtime is not None:
                self._attach(rec.id, runtime)
                if rec.state is SandboxState.CREATING:
                    self._mark_running(rec)
                elif rec.state is not SandboxState.RUNNING:
                    # A pause that had not finished (the VM still runs) or a resume that
                    # had: either way the VM is running now.
                    with contextlib.suppress(HutchError):
                        await runtime.cont()
                    self._set_running_after_resume(rec.id)
                log.info("adopted running sandbox %s", rec.id)
                continue
            if rec.state in (SandboxState.PAUSING, SandboxState.RESUMING) and (
                rec.resume_from is not None
                and await self.backend.recover_snapshot(rec.id, rec.resume_from)
            ):
                self.store.update_sandbox(rec.id, state=SandboxState.PAUSED)
                log.info("sandbox %s recovered as paused", rec.id)
                continue
            if rec.state is SandboxState.RESUMING and rec.pause_mode is PauseMode.DISK:
                self.store.update_sandbox(rec.id, state=SandboxState.PAUSED)
                continue
            await self.backend.cleanup(rec.id)
            await self._release_network(rec.id)
            if rec.state is SandboxState.STOPPING:
                self._finish(rec.id, SandboxState.DESTROYED)
            else:
                self._finish(
                    rec.id, SandboxState.FAILED, "the VM was gone when the daemon restarted"
                )
        owned = {rec.id for rec in self.store.list_sandboxes(states=LIVE_STATES)}
        for orphan in self.backend.leftover_ids() - owned:
            log.info("removing leftovers of sandbox %s", orphan)
            await self.backend.cleanup(orphan)
        self._collect_snapshots()

    # -- queries -----------------------------------------------------------------------

    def get(self, sandbox_id: str) -> SandboxRecord:
        if not SANDBOX_ID_RE.match(sandbox_id):
            raise NotFound(f"sandbox id {sandbox_id!r} is malformed; ids look like sb-0123456789ab")
        rec = self.store.get_sandbox(sandbox_id)
        if rec is None:
            raise NotFound(f"no sandbox {sandbox_id}")
        return rec

    def list_sandboxes(
        self, state: SandboxState | None = None, metadata: dict[str, str] | None = None
    ) -> list[SandboxRecord]:
        states = [state] if state else [s for s in SandboxState if s is not SandboxState.DESTROYED]
        return self.store.list_sandboxes(states=states, metadata=metadata)

    def images(self) -> list[ImageView]:
        return self.image_source.list()

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
            self.store.insert_sandbox(rec)
        async with self._lock(rec.id):
            try:
                template = (
                    self.backend.find_template(image, spec.shape)
                    if self.settings.templates
                    else None
                )
                await self._network_for(rec, plan, pooled=pooled is not None)
                if pooled is not None:
                    runtime = pooled[1]
                    if rec.name is not None:
                        # The pooled guest took its id as hostname; a name replaces it.
                        await self.backend.retake_identity(runtime, rec)
                elif source is not None:
                    runtime = await self.backend.start_clone(rec, Path(source.path))
                elif template is not None:
                    runtime = await self.backend.start_clone(rec, template)
                else:
                    runtime = await self.backend.start(rec, image)
                    if self.settings.templates:
                        self._schedule_template(image, spec.shape)
                self.pool.refill(image)
            except BaseException as exc:
                await self.backend.cleanup(rec.id)
                await self._release_network(rec.id)
                reason = str(exc) if isinstance(exc, HutchError) else repr(exc)
                self._finish(rec.id, SandboxState.FAILED, reason)
                raise
            current = self.store.get_sandbox(rec.id)
            if current is None or current.state is not SandboxState.CREATING:
                # Deleted while booting.
                await runtime.destroy()
                await self.backend.cleanup(rec.id)
                await self._release_network(rec.id)
                raise Conflict(f"sandbox {rec.id} was deleted while it was being created")
            self._attach(rec.id, runtime)
            return self._mark_running(rec)

    async def delete(self, sandbox_id: str) -> None:
        rec = self.get(sandbox_id)
        if rec.state in (SandboxState.DESTROYED, SandboxState.FAILED):
            return
        if rec.state is SandboxState.CREATING:
            # The create holds the lock while it boots; mark the row so it gives up.
            self.store.update_sandbox(rec.id, state=SandboxState.STOPPING)
        async with self._lock(rec.id):
            self.store.update_sandbox(rec.id, state=SandboxState.STOPPING)
            await self._teardown(rec.id)
            self._finish(rec.id, SandboxState.DESTROYED)
        self._collect_snapshots()

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
                    where = await self.backend.build_template(image, shape)
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
        live = {r.id for r in self.store.list_sandboxes(states=LIVE_STATES)}
        named = {snap.path for snap in self.store.list_snapshots()}
        for name in self.backend.collect_snapshots(live, named):
            log.info("removed snapshot %s: no sandbox uses it any more", name)

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def _mark_running(self, rec: SandboxRecord) -> SandboxRecord:
        now = time.time()
        expires = now + rec.timeout_s if rec.timeout_s else None
        self.store.update_sandbox(
            rec.id, state=SandboxState.RUNNING, started_at=now, expires_at=expires
        )
        return replace(rec, state=SandboxState.RUNNING, started_at=now, expires_at=expires)

    def _finish(self, sandbox_id: str, state: SandboxState, error: str | None = None) -> None:
        self.store.update_sandbox(sandbox_id, state=state, ended_at=time.time(), error=error)
        self._locks.pop(sandbox_id, None)
        self.inflight.forget(sandbox_id)

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
            self._monitors.pop(sandbox_id, None)
            self._runtimes.pop(sandbox_id, None)
            await runtime.destroy()
            await self.backend.cleanup(sandbox_id)
            # A failed sandbox is never deleted again: its tap and address go now.
            await self._release_network(sandbox_id)
            self._finish(sandbox_id, SandboxState.FAILED, "the VM stopped unexpectedly")
