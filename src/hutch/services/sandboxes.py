"""Sandboxes: create, inspect, list and delete (:class:`SandboxService`).

The states and the transitions between them are :mod:`hutch.services.state`, the only
writer of a sandbox's state; pause and resume are :mod:`hutch.services.lifecycle`, fork
and snapshots :mod:`hutch.services.snapshots`, start-up reconcile
:mod:`hutch.services.reconcile`.

Every transition is written before the side effect it announces, so a daemon killed at
any point finds, on restart, a row that tells it what to finish (see
:mod:`hutch.services.reconcile` and ARCHITECTURE.md, "Crash safety").
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

from hutch.crashpoints import crash_point
from hutch.errors import Capacity, Conflict, HutchError, InvalidArgument, NotFound, StateError
from hutch.guest.client import ExecStream
from hutch.guest.results import FileEntry
from hutch.models import (
    NetworkMode,
    PauseMode,
    SandboxRecord,
    SandboxSpec,
    SandboxState,
    SnapshotRecord,
    new_sandbox_id,
)
from hutch.services.images import ImageView, resolve
from hutch.services.networking import NetworkingService
from hutch.services.pool import REFILL_DELAY_S, WarmPool
from hutch.services.registry import SandboxRegistry
from hutch.services.snapshots import SnapshotService
from hutch.services.template_blobs import TemplateBlobs
from hutch.services.templates import TemplateService
from hutch.services.volumes import PlannedMount, VolumeService, mount_all

__all__ = ["ExecStream", "FileEntry", "SandboxService"]

log = logging.getLogger(__name__)

#: Seconds a delete waits for the guest to flush and freeze its volumes.
VOLUME_FREEZE_TIMEOUT_S = 10.0


class SandboxService:
    def __init__(
        self,
        core: SandboxRegistry,
        networking: NetworkingService,
        snapshots: SnapshotService,
        pool: WarmPool,
        volumes: VolumeService | None = None,
        templates: TemplateService | None = None,
    ) -> None:
        """``templates``: where creates get templates (None: this host's own only)."""
        self.core = core
        self.networking = networking
        self.snapshots = snapshots
        self.pool = pool
        self.volumes = volumes or VolumeService(core)
        self.templates = templates or TemplateService(
            core.backend.templates,
            TemplateBlobs(core.backend.templates, None, None, core.settings),
            core.settings.images_dir,
        )

    async def close(self) -> None:
        """Stop the template builds and uploads under way."""
        await self.templates.close()

    # -- queries -----------------------------------------------------------------------

    def get(self, sandbox_id: str, project: str | None = None) -> SandboxRecord:
        """With ``project``: another project's sandbox is not found (as a missing one)."""
        return self.core.states.get(sandbox_id, project)

    def list_sandboxes(
        self,
        state: SandboxState | None = None,
        metadata: dict[str, str] | None = None,
        *,
        project: str | None = None,
    ) -> list[SandboxRecord]:
        """``project``'s sandboxes (None: every project's, for the daemon's own use)."""
        states = [state] if state else [s for s in SandboxState if s is not SandboxState.DESTROYED]
        return self.core.store.list_sandboxes(states=states, metadata=metadata, project=project)

    def images(self, project: str | None) -> list[ImageView]:
        """The built-in images and ``project``'s (None: every project's: the admin)."""
        return self.core.image_source.list(project)

    # -- create / delete ---------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> SandboxRecord:
        """The volumes named in ``spec`` are those of ``spec.project``."""
        # Its image's files stay on this host (the blob cache) until its row names it.
        with (
            self.core.metrics.timed("create"),
            self.core.image_source.using(spec.image, spec.project),
        ):
            return await self._create(spec)

    async def _create(self, spec: SandboxSpec) -> SandboxRecord:
        source: SnapshotRecord | None = None
        if spec.snapshot_id is not None and spec.volumes:
            raise InvalidArgument(
                "volumes cannot be mounted on a sandbox created from a snapshot: a snapshot "
                "restores only into the devices it was saved with; create without 'snapshot'"
            )
        if spec.snapshot_id is not None:
            source = self.snapshots.get_snapshot(spec.snapshot_id, spec.project)
            # A snapshot fixes the machine: its image and shape come with it.
            spec = replace(spec, image=source.image, shape=source.shape)
        # An imported image whose content is elsewhere is fetched from the blob store.
        await self.core.image_source.ensure_local(spec.image, spec.project)
        image = resolve(self.core.image_source, spec.image, spec.project)
        # Names only are kept with the sandbox; each must exist (and decrypt) now.
        self.core.secrets.check_refs(spec.env_secrets, spec.project)
        plan = self.networking.plan_network(spec)
        if self.core.net is None:
            plan.mode = NetworkMode.NONE
        # Pooled VMs have the daemon's network mode; other sandboxes are restored. A
        # sandbox with volumes boots with them attached (neither a pooled VM nor a
        # template has them, and microvm cannot hot-plug a disk).
        use_pool = source is None and plan.mode is self.pool.network and not spec.volumes
        new_id = new_sandbox_id()
        mounts: list[PlannedMount] = self.volumes.plan(new_id, spec.volumes, spec.project)
        pooled = self.pool.take(image, spec.shape) if use_pool else None
        if pooled is not None:
            crash_point("pool.taken")
        # An ephemeral image (a build step's layer) boots once: no template.
        templates = self.core.settings.templates and not image.ephemeral
        # This host's template, or one fetched from the blob store now (a host's first
        # create of an image and shape: no cold boot if another host made it).
        template = (
            await self.templates.for_create(image, spec.shape)
            if templates and pooled is None and source is None and not mounts
            else None
        )
        origin = "pool" if pooled else "snapshot" if source else "template" if template else "cold"
        async with self.core.create_gate:
            # Capacity is checked and the row inserted under one lock so that concurrent
            # creates cannot overshoot the limits together.
            try:
                self.core.check_capacity(
                    spec.shape.memory_mib,
                    extra_sandboxes=1,
                    project=spec.project,
                    vcpus=spec.shape.vcpus,
                )
            except Capacity:
                if pooled is not None:
                    self.pool.give_back(image, pooled)
                raise
            rec = SandboxRecord(
                id=pooled[0] if pooled else new_id,
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
                project=spec.project,
                env_secrets=dict(spec.env_secrets),
                placement_labels=dict(spec.placement_labels),
            )
            self.core.states.insert(rec, origin=origin)
            if pooled is not None:
                crash_point("pool.row")
                self.core.own_all(rec.id)  # the pool registered them: a no-op
            else:
                self.core.own_files(rec.id)
        async with self.core.lock(rec.id):
            try:
                # Written here, under the sandbox's lock, re-checked in one transaction
                # (another daemon on the same database may have taken a volume meanwhile).
                self.volumes.attach(rec.id, mounts)
                self.core.own_network(rec.id)
                await self.networking.attach(rec, plan, pooled=pooled is not None)
                self.core.own_vm(rec.id)
                if pooled is not None:
                    runtime = pooled[1]
                    if rec.name is not None:
                        # The pooled guest took its id as hostname; a name replaces it.
                        await runtime.retake_identity(rec)
                elif source is not None:
                    # Checked and held with no await in between: a delete of the
                    # snapshot either came first (refused here) or keeps its files.
                    if self.core.store.get_snapshot(source.id) is None:
                        raise NotFound(f"snapshot {source.id} was deleted during the create")
                    with self.core.holding(source.path):
                        # This host's copy, fetched from the blob store if it has none.
                        snapshot_dir = await self.snapshots.blobs.local_dir(source)
                        with self.core.holding(str(snapshot_dir)):
                            runtime = await self.core.backend.start_clone(rec, snapshot_dir)
                    self.snapshots.blobs.evict_soon()
                elif template is not None:
                    runtime = await self.core.backend.start_clone(rec, template)
                else:
                    drives = self.volumes.drives(mounts)
                    shares = self.volumes.share_slots(mounts)
                    runtime = await self.core.backend.start(rec, image, drives, shares)
                    if templates and not mounts:
                        self.templates.schedule(image, spec.shape)
                self.core.booted(rec.id, runtime)
                await mount_all(self.core, rec.id, runtime)
                # Before any user command: the guest trusts the TLS-inspecting proxy.
                await self.networking.trust_ca(rec.id, runtime.agent, plan.policy)
                # Off the hot path: a hand-out refills once its first command had the
                # host to itself (pool.REFILL_DELAY_S).
                self.pool.refill(image, delay_s=REFILL_DELAY_S if pooled is not None else 0.0)
                if source is None:
                    await self.core.run_image_start(rec, runtime)
            except BaseException as exc:
                await self.core.teardown(rec.id)
                reason = str(exc) if isinstance(exc, HutchError) else repr(exc)
                self.core.finish_create(rec.id, SandboxState.FAILED, reason)
                raise
            current = self.core.store.get_sandbox(rec.id)
            if current is None or current.state is not SandboxState.CREATING:
                # Deleted while booting.
                await self.core.teardown(rec.id)
                self.core.finish_create(rec.id, SandboxState.DESTROYED)
                raise Conflict(f"sandbox {rec.id} was deleted while it was being created")
            self.core.attach(rec.id, runtime)
            return self.core.states.running(rec)

    async def delete(self, sandbox_id: str) -> None:
        rec = self.get(sandbox_id)
        if not rec.state.is_live:
            return
        if rec.state is SandboxState.CREATING:
            # The create holds the lock while it boots; mark the row so it gives up.
            self.core.states.move(rec.id, SandboxState.STOPPING)
        async with self.core.lock(rec.id):
            current = self.core.states.current(rec.id)
            # Ended meanwhile (the create gave up, or the VM died): nothing to do.
            if current is not None and current.state.is_live:
                moves = self.snapshots.lifecycle.moves
                was_paused = current.state is SandboxState.PAUSED
                if was_paused:
                    await moves.stop_upload(rec.id)  # it reads the files that go now
                if current.state is not SandboxState.STOPPING:
                    self.core.states.move(rec.id, SandboxState.STOPPING)
                await self._leave_volumes_clean(rec.id)
                await self.core.teardown(rec.id)
                self.core.finish(rec.id, SandboxState.DESTROYED)
                if was_paused:
                    moves.forget_soon(rec.id)  # its pause's blobs, if uploaded
        self.core.collect_snapshots()

    async def _leave_volumes_clean(self, sandbox_id: str) -> None:
        """Before a running sandbox with volumes is killed: flush and freeze their
        filesystems, so each is clean for the next sandbox (a read-only mount cannot
        replay a journal). Best effort, bounded: a guest that does not answer is killed
        anyway, and the next read-write mount replays the journal."""
        # Shared volumes need nothing: every write went to the host as it was made (the
        # guest's FUSE has no write-back cache), and the host's ext4 is not the guest's.
        shared = {(m.slot) for m in self.core.shared.shared_mounts(sandbox_id)}
        mounts = [
            m for m in self.core.volumes.mounts_of_sandbox(sandbox_id) if m.slot not in shared
        ]
        runtime = self.core.runtimes.get(sandbox_id)
        if not mounts or runtime is None:
            return
        try:
            async with asyncio.timeout(VOLUME_FREEZE_TIMEOUT_S):
                await runtime.freeze_volumes([m.path for m in mounts])
        except (HutchError, TimeoutError) as exc:
            log.warning("sandbox %s: could not freeze its volumes: %s", sandbox_id, exc)

    async def take_disk(self, sandbox_id: str, dest: Path) -> None:
        """Hard-link the disk of a sandbox paused in disk mode to ``dest`` (a copy if
        another filesystem), for the image builder, which keeps it as a step layer. The
        sandbox is unchanged; delete it afterwards."""
        async with self.core.lock(sandbox_id):
            rec = self.get(sandbox_id)
            if rec.state is not SandboxState.PAUSED or rec.pause_mode is not PauseMode.DISK:
                state = f"{rec.state} ({rec.pause_mode})" if rec.pause_mode else str(rec.state)
                raise StateError(f"sandbox {sandbox_id}", state, ["paused (disk)"])
            src = self.core.backend.disk_path(sandbox_id)

            def link() -> None:
                try:
                    os.link(src, dest)
                except OSError:
                    shutil.copyfile(src, dest)

            await asyncio.to_thread(link)
