"""The composed sandbox services of one daemon (:class:`Services`), built by
:func:`hutch.daemon.build_services`, and their start and stop.

Each service takes what it needs in its constructor::

    SandboxRegistry(settings, store, backend, images, net)     the shared core
    LifecycleService(core)                                      pause, resume
    SnapshotService(core, lifecycle)                            fork, snapshots
    GuestOps(core, lifecycle)                                   exec, files
    NetworkingService(core)                                     egress, ports, networks
    TemplateService(backend.templates, TemplateBlobs(...), images_dir)  templates: here,
                                                     fetched from the blob store, or built
    WarmPool(core, size, networking.prepare_pooled, mode, templates.for_create)
    VolumeService(core)                                         volumes, live disk growth
    SandboxService(core, networking, snapshots, pool, volumes, templates)
                                                                create, get, list, delete
    Reaper(core, sandboxes, lifecycle)                          timeout/auto-pause/delete
    Reconciler(core)                                            start-up reconcile
    ProcessService(guest), InterpreterService(guest), FilesExtraService(guest)
    UsageService(core)                                          usage, cost, event log
    SecretService(SecretStore(store), SecretKey(<state>/secrets.key))   also core.secrets
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from functools import cached_property

from hutch.config import Settings
from hutch.contract.auth import DEFAULT_PROJECT
from hutch.errors import HutchError
from hutch.runtime.backend import VmBackend
from hutch.services.builtin_blobs import BuiltinBlobs
from hutch.services.cluster import ClusterService
from hutch.services.files_extra import FilesExtraService
from hutch.services.guest_ops import GuestOps
from hutch.services.interpreter import InterpreterService
from hutch.services.lifecycle import LifecycleService
from hutch.services.networking import NetworkingService
from hutch.services.pool import WarmPool
from hutch.services.processes import ProcessService
from hutch.services.projects import ProjectService
from hutch.services.reaper import Reaper
from hutch.services.reconcile import ReconcilePlan, Reconciler
from hutch.services.registry import SandboxRegistry
from hutch.services.sandboxes import SandboxService
from hutch.services.secrets import SecretService
from hutch.services.snapshots import SnapshotService
from hutch.services.usage import UsageService
from hutch.services.volumes import VolumeService
from hutch.store.db import LIVE_STATES
from hutch.store.projects import ProjectStore

__all__ = ["Services"]


@dataclass
class Services:
    core: SandboxRegistry
    sandboxes: SandboxService
    lifecycle: LifecycleService
    snapshots: SnapshotService
    guest: GuestOps
    networking: NetworkingService
    pool: WarmPool
    reaper: Reaper
    reconciler: Reconciler
    processes: ProcessService
    interpreter: InterpreterService
    files: FilesExtraService
    usage: UsageService
    volumes: VolumeService
    secrets: SecretService
    #: This hutchd as a host: registration, lease, the watch on the others, placement.
    cluster: ClusterService
    #: The built-in images in the blob store (None without one): uploaded, converged on
    #: one content per digest, published for placement.
    builtins: BuiltinBlobs | None = None
    _reconcile_task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def settings(self) -> Settings:
        return self.core.settings

    @cached_property
    def projects(self) -> ProjectService:
        """Projects, quotas and keys (the same store as the sandboxes)."""
        return ProjectService(ProjectStore(self.core.store), clock=lambda: self.core.clock())

    @property
    def backend(self) -> VmBackend:
        return self.core.backend

    @property
    def reconciled(self) -> bool:
        return self.reconciler.reconciled

    @property
    def reconciling(self) -> int:
        """Sandboxes still being checked after the start."""
        return self.reconciler.reconciling

    async def start(self, *, background: bool = False) -> None:
        """Reconcile with the host, then start the warm pool and the reaper.

        ``background`` (the daemon): return once the quick part is done and check the
        VMs found on the host in a task, so the API serves meanwhile (``reconciled``
        False, the sandboxes still being checked answer 503); else wait for all of it.
        """
        # Registered first: the lease is renewed while the VMs found are checked.
        await self.cluster.start()
        if self.builtins is not None:
            # With its row: the built-in images it holds, for placement.
            with contextlib.suppress(HutchError):
                await asyncio.to_thread(self.builtins.publish)
        net = self.core.net
        if net is not None:
            # Before adoption: adopted guests are told their network again.
            await net.start({r.id for r in self.core.own_rows(LIVE_STATES)})
        plan = await self.reconciler.host()
        if background:
            self._reconcile_task = asyncio.create_task(
                self._after_start(plan), name="hutch-reconcile"
            )
        else:
            await self._after_start(plan)

    async def _after_start(self, plan: ReconcilePlan) -> None:
        await self.reconciler.finish_start(plan)
        # Uploads a stopped daemon left continue (the snapshot rows are settled now).
        await self.snapshots.blobs.start()
        self.reaper.start()
        if self.builtins is not None:
            # Before the pool (and so its templates): a copy of a built-in image unlike
            # the blob store's is replaced while nothing here uses it yet.
            await self.builtins.start()
        # Templates built here whose upload is not complete go up (in the background).
        self.sandboxes.templates.start()
        # The pool warms the default image of project default (a built-in by default).
        default = self.core.image_source.find(self.core.settings.default_image, DEFAULT_PROJECT)
        if default is not None:
            self.pool.refill(default)

    async def close(self) -> None:
        """Stop background work and drop agent connections. VMs keep running (pooled
        ones, which have no row to be adopted by, are destroyed)."""
        await self.cluster.close()
        if self.builtins is not None:
            await self.builtins.close()
        await self.pool.close()
        await self.snapshots.blobs.close()
        await self.lifecycle.moves.close()
        if self._reconcile_task is not None:
            self._reconcile_task.cancel()
            await asyncio.gather(self._reconcile_task, return_exceptions=True)
        await self.reaper.close()
        await self.sandboxes.close()
        await self.core.close()
        if self.core.net is not None:
            await self.core.net.close()
        with contextlib.suppress(HutchError):  # what was counted since the last heartbeat
            self.core.egress_meter.flush_bytes()
            self.core.egress_meter.flush_denials(0, force=True)
        self.core.backend.close()
