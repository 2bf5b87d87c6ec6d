"""What every sandbox use case shares: the store and its state machine, the backend,
the network, activity, and the books of the sandboxes this daemon has live (their
runtimes, watchers, per-sandbox locks and teardown).

One :class:`SandboxRegistry` is built per daemon (:func:`hutch.daemon.build_services`)
and handed to each service's constructor; the services hold no sandbox books of their
own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path

from hutch.config import Settings
from hutch.errors import Capacity, HutchError, StateError
from hutch.models import SandboxRecord, SandboxState
from hutch.net.proxy_decide import inspects_tls
from hutch.runtime.backend import Runtime, VmBackend
from hutch.services.activity import Activity
from hutch.services.egress_meter import EgressMeter
from hutch.services.egress_trust import trust_env
from hutch.services.events import EventLog, internal
from hutch.services.image_defaults import run_start_command
from hutch.services.images import ImageDefaults, ImageSource
from hutch.services.metrics import Metrics
from hutch.services.network import NetworkService
from hutch.services.projects import check_quota
from hutch.services.secret_box import SecretKey
from hutch.services.secrets import SecretService
from hutch.services.shared_volumes import HostMounts, SharedVolumes
from hutch.services.state import SandboxStates
from hutch.storage.shared_mounts import SharedMounts
from hutch.storage.volumes import VolumeFiles
from hutch.store import Store
from hutch.store.db import LIVE_STATES
from hutch.store.hosts import HostStore
from hutch.store.meter import MeterStore
from hutch.store.projects import ProjectStore
from hutch.store.secrets import SecretStore
from hutch.store.volumes import VolumeStore
from hutch.teardown import TeardownStack
from hutch.vm.process import OUT_OF_MEMORY

__all__ = ["SandboxRegistry"]

log = logging.getLogger("hutch.services.sandboxes")


class SandboxRegistry:
    """The shared core of the sandbox services (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        backend: VmBackend,
        images: ImageSource,
        net: NetworkService | None = None,
        secrets: SecretService | None = None,
        host_mounts: HostMounts | None = None,
    ) -> None:
        """``net`` None (tests without root): every sandbox gets network "none";
        ``secrets`` None: the state dir's (``SecretService`` on ``secrets.key``);
        ``host_mounts`` None: shared volumes are loop-mounted under the state dir
        (``SharedMounts``; component tests pass directories)."""
        self.settings = settings
        self.secrets = secrets or SecretService(
            SecretStore(store), SecretKey(settings.secrets_key_path)
        )
        self.store = store
        self.meter = MeterStore(store)
        #: The event log (traces, audit trail); its lifecycle events are the state
        #: writer's, in the same transaction as the state.
        self.events = EventLog(
            self.meter,
            retention_s=settings.meter.events_retention_days * 86400,
            max_events=settings.meter.events_max,
            enabled=settings.meter.events,
        )
        self.states = SandboxStates(store, self.events)
        #: This hutchd's host in the cluster (``local`` on one host): the sandboxes it
        #: creates run here, and its sweeps (reconcile, reaper, network) see only those.
        self.host_id = settings.host_id
        self.hosts = HostStore(store)
        self.states.host = self.host_id
        self.metrics = Metrics()
        self.events.listeners.append(self.metrics.on_event)
        self.projects = ProjectStore(store)  # quotas, read under create_gate
        self.backend = backend
        self.image_source = images
        self.net = net
        #: Volumes: their rows and mounts, and their files (``hutch.services.volumes``).
        self.volumes = VolumeStore(store)
        self.volume_files = VolumeFiles(settings.state_dir / "volumes")
        #: Shared volumes' host mounts and per-sandbox links (``services/shared_volumes``).
        self.shared = SharedVolumes(
            self.volumes,
            self.volume_files,
            host_mounts or SharedMounts(settings.state_dir / "shared-mounts"),
            backend.share_socket,
        )
        # ``clock``: the wall clock of activity, pauses and the reaper (tests move it).
        self.clock: Callable[[], float] = time.time
        # Idle tracking for auto_pause_s and the calls in flight that pause, snapshot and
        # fork wait for.
        self.activity = Activity(clock=lambda: self.clock())
        if net is not None:
            net.forwarder.activity = self.activity.in_use  # an open inbound connection is use
        #: Egress bytes into the meter, denials into ``egress.denied`` events.
        self.egress_meter = EgressMeter(
            store,
            self.events,
            lambda: self.net.enforcer if self.net is not None else None,
            lambda: self.clock(),
        )
        self.runtimes: dict[str, Runtime] = {}
        self._booting: dict[str, Runtime] = {}
        self._teardowns: dict[str, TeardownStack] = {}
        self._owned: dict[str, set[str]] = {}
        self._monitors: dict[str, asyncio.Task[None]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        #: Capacity checks and the rows they admit, as one step (creates, forks, resumes,
        #: image removal).
        self.create_gate = asyncio.Lock()
        # Snapshot directories an operation is about to clone (kept from collection).
        self._snapshot_holds: Counter[str] = Counter()

    # -- reads -------------------------------------------------------------------------

    def get(self, sandbox_id: str, project: str | None = None) -> SandboxRecord:
        return self.states.get(sandbox_id, project)

    def own_rows(self, states: Iterable[SandboxState] = LIVE_STATES) -> list[SandboxRecord]:
        """The rows in ``states`` of the sandboxes on this host (the engine's sweeps:
        another host's sandboxes are that host's to adopt, reap or clean)."""
        wanted = list(states)
        mine = self.hosts.ids_on(self.host_id, wanted)
        return [r for r in self.store.list_sandboxes(states=wanted) if r.id in mine]

    def guest_defaults(self, rec: SandboxRecord) -> ImageDefaults:
        """What ``rec`` takes from its image config (env, cwd, user, start command)."""
        return self.image_source.defaults(rec.image, rec.project)

    def secret_env(self, rec: SandboxRecord) -> dict[str, str]:
        """What the daemon adds to each command of ``rec``: while its TLS is inspected
        (egress ``inspection: full``) the CA variables (:func:`egress_trust.trust_env`),
        and its env_secrets as variables, each secret's current version, read now for the
        one command being built (never stored with the sandbox)."""
        trust = (
            trust_env() if self.net is not None and inspects_tls(self.net.policy_of(rec.id)) else {}
        )
        if not rec.env_secrets:
            return trust
        return trust | self.secrets.env_for(rec.env_secrets, rec.project, sandbox_id=rec.id)

    def running(self, sandbox_id: str) -> Runtime:
        """The runtime of a running sandbox; StateError (with a hint) otherwise."""
        rec = self.get(sandbox_id)
        runtime = self.runtimes.get(sandbox_id)
        if rec.state is not SandboxState.RUNNING or runtime is None:
            hint = ""
            if rec.state is SandboxState.PAUSED:
                hint = "resume it, or create sandboxes with auto_resume=true"
            raise StateError(f"sandbox {sandbox_id}", str(rec.state), ["running"], hint)
        return runtime

    async def run_image_start(self, rec: SandboxRecord, runtime: Runtime) -> None:
        """The image's start command, in a sandbox that just booted (or came from a
        template, which never runs it); fork children and snapshot clones carry theirs
        over in memory."""
        await run_start_command(
            runtime.agent, rec, self.guest_defaults(rec), lambda: self.secret_env(rec)
        )

    # -- admission ---------------------------------------------------------------------

    def check_capacity(
        self, memory_mib: int, extra_sandboxes: int, *, project: str | None = None, vcpus: int = 0
    ) -> None:
        """The host's limits, then ``project``'s quotas (QuotaExceeded names the quota).
        Called under ``create_gate`` with the row write that follows it, so concurrent
        creates, resumes and forks cannot pass a limit together; sandboxes still
        starting count."""
        if project is not None:
            check_quota(
                self.projects,
                project,
                sandboxes=extra_sandboxes,
                vcpus=vcpus,
                memory_mib=memory_mib,
            )
        use = self.hosts.usage().get(self.host_id)
        count, memory = (use.sandboxes, use.memory_mib) if use is not None else (0, 0)
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

    def lock(self, sandbox_id: str) -> asyncio.Lock:
        """The sandbox's lock: one lifecycle change (create, delete, pause, resume, fork,
        snapshot, a watcher's cleanup) at a time."""
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    # -- live runtimes -----------------------------------------------------------------

    def attach(self, sandbox_id: str, runtime: Runtime) -> None:
        """``runtime`` is the sandbox's now, watched for a VM that stops on its own."""
        self.runtimes[sandbox_id] = runtime
        self._booting.pop(sandbox_id, None)
        self._monitors[sandbox_id] = asyncio.create_task(
            self._watch(sandbox_id, runtime), name=f"hutch-watch-{sandbox_id}"
        )

    def detach(self, sandbox_id: str) -> Runtime | None:
        """Stop watching the sandbox's runtime and drop it from the books (its VM is
        being paused, frozen or destroyed by the caller); the runtime, or None."""
        self.stop_watching(sandbox_id)
        return self.runtimes.pop(sandbox_id, None)

    def stop_watching(self, sandbox_id: str) -> None:
        monitor = self._monitors.pop(sandbox_id, None)
        if monitor is not None and monitor is not asyncio.current_task():
            monitor.cancel()

    async def _watch(self, sandbox_id: str, runtime: Runtime) -> None:
        """Notice a VM that stops on its own, record why, and clean up after it."""
        internal()  # not the work of the request that started the VM
        await runtime.wait_exited()
        rec = self.store.get_sandbox(sandbox_id)
        if rec is None or rec.state is not SandboxState.RUNNING:
            return
        tail = runtime.console_tail(2000)
        log.warning("sandbox %s stopped on its own; console tail:\n%s", sandbox_id, tail)
        async with self.lock(sandbox_id):
            current = self.states.current(sandbox_id)
            if current is None or current.state is not SandboxState.RUNNING:
                return  # paused, deleted or failed meanwhile: that call cleaned up
            # A failed sandbox is never deleted again: everything of it goes now.
            await self.teardown(sandbox_id, deleted=False)
            self.finish(sandbox_id, SandboxState.FAILED, _stopped_error(runtime.exit_reason()))

    # -- the end of a sandbox ----------------------------------------------------------

    # Every resource of a sandbox is registered on its TeardownStack the moment it is
    # about to exist (before the call that makes it, so that a call cut half way is
    # undone too); the end of a sandbox is closing that stack, once. The steps, in the
    # order they are registered and undone last-first:
    #   "files"   its overlay, run dir and sandbox dir (``backend.cleanup``, which also
    #             SIGKILLs a QEMU still named by its pidfile)      row inserted
    #   "volumes" its mount rows (the volumes are free again once its VM is gone)
    #                                                               before mounts written
    #   "network" its tap, address lease and nft entry (``net.detach``)  before attach
    #   "vm"      its QEMU process: the runtime held, else the pidfile's  before boot
    # A sandbox found in the store at a start (adopted, paused, or to be cleaned) owns
    # all three (:meth:`own_all`).

    def _stack(self, sandbox_id: str) -> TeardownStack:
        stack = self._teardowns.get(sandbox_id)
        if stack is None:
            stack = self._teardowns[sandbox_id] = TeardownStack()
            self._owned[sandbox_id] = set()
        return stack

    def _own(self, sandbox_id: str, name: str, undo: Callable[[], Awaitable[None]]) -> None:
        if sandbox_id not in self._teardowns and name != "files":
            # Not made in this daemon's life (a row found at the start): all it may own.
            self.own_all(sandbox_id)
            return
        stack = self._stack(sandbox_id)
        if name not in self._owned[sandbox_id]:
            self._owned[sandbox_id].add(name)
            stack.register(f"{name} of {sandbox_id}", undo)

    def own_files(self, sandbox_id: str) -> None:
        """The sandbox's files on the host are about to exist (its row is written)."""
        self._own(sandbox_id, "files", lambda: self.backend.cleanup(sandbox_id))

    def own_volumes(self, sandbox_id: str) -> None:
        """Mount rows of the sandbox are about to be written: its end releases them
        (after its VM, registered later, is gone)."""
        self._own(sandbox_id, "volumes", lambda: self.release_volumes(sandbox_id))

    async def release_volumes(self, sandbox_id: str) -> None:
        await self.shared.stop(sandbox_id)  # its VM is gone: nothing reads the sockets
        released = self.volumes.release(sandbox_id)
        if released:
            log.info("sandbox %s released %d volume(s)", sandbox_id, released)

    def own_network(self, sandbox_id: str) -> None:
        """The sandbox is about to be attached to the network (tap, lease, nft entry)."""
        if self.net is not None:
            self._own(sandbox_id, "network", lambda: self.release_network(sandbox_id))

    def own_vm(self, sandbox_id: str) -> None:
        """A QEMU is about to be started for the sandbox (boot, clone, resume)."""
        self._own(sandbox_id, "vm", lambda: self._end_vm(sandbox_id))

    def own_all(self, sandbox_id: str) -> None:
        """A sandbox whose resources may all exist already (found in the store at a
        start, or a pooled VM handed out)."""
        self.own_files(sandbox_id)
        self.own_volumes(sandbox_id)
        self.own_network(sandbox_id)
        self.own_vm(sandbox_id)

    def booted(self, sandbox_id: str, runtime: Runtime) -> None:
        """``runtime`` exists for the sandbox but is not attached yet (a create or a
        pool that just booted it): a teardown before :meth:`attach` ends it too."""
        self._booting[sandbox_id] = runtime

    def _held(self, sandbox_id: str) -> list[Runtime]:
        found = (self.runtimes.get(sandbox_id), self._booting.get(sandbox_id))
        return list({id(r): r for r in found if r is not None}.values())

    async def _end_vm(self, sandbox_id: str) -> None:
        self.stop_watching(sandbox_id)
        held = self._held(sandbox_id)
        self.runtimes.pop(sandbox_id, None)
        self._booting.pop(sandbox_id, None)
        if not held:
            await self.backend.kill_vm(sandbox_id)
        for runtime in held:
            await runtime.destroy()

    async def teardown(self, sandbox_id: str, *, deleted: bool = True) -> None:
        """Everything of the sandbox on this host goes (its stack is closed): its VM,
        its network, its files. ``deleted``: streams still open end saying the sandbox
        was deleted (not for a VM that stopped on its own: they say that).

        Every step runs even if one fails; the first failure is then raised.
        """
        # Here, in the caller's task: the stack runs its steps in a task of its own, and
        # a watcher tearing down after its VM must not be cancelled by them.
        self.stop_watching(sandbox_id)
        if deleted:
            for runtime in self._held(sandbox_id):
                runtime.agent.close_reason = f"sandbox {sandbox_id} was deleted while this call ran"
        if sandbox_id not in self._teardowns:
            self.own_all(sandbox_id)  # nothing registered it in this daemon's life
        stack = self._teardowns.pop(sandbox_id)
        self._owned.pop(sandbox_id, None)
        failures = await stack.close()
        if failures:
            raise failures[0][1]

    def held_ids(self) -> set[str]:
        """Sandboxes this host keeps something of: a teardown stack or files."""
        return set(self._teardowns) | self.backend.leftover_ids()

    async def moved_away(self, sandbox_id: str) -> None:
        """The paused sandbox now lives on another host (its row says so): what this
        host kept of it goes (files, tap, nft entry), and none of the shared rows."""
        self.stop_watching(sandbox_id)
        self._teardowns.pop(sandbox_id, None)
        self._owned.pop(sandbox_id, None)
        if self.net is not None:
            try:
                await self.net.moved_away(sandbox_id)
            except HutchError as exc:
                log.warning("sandbox %s moved: its network here stays: %s", sandbox_id, exc)
        await self.backend.cleanup(sandbox_id)
        self.activity.forget(sandbox_id)

    async def release_network(self, sandbox_id: str) -> None:
        if self.net is not None:
            try:
                await self.net.detach(sandbox_id)
            except HutchError as exc:
                log.warning("could not release the network of %s: %s", sandbox_id, exc)

    def finish(
        self,
        sandbox_id: str,
        state: SandboxState,
        error: str | None = None,
        *,
        lost: bool = False,
    ) -> None:
        """The sandbox ended ``state`` (destroyed or failed): its books go. ``lost``: its
        VM was found gone after a restart (billed to its last heartbeat)."""
        self.states.ended(sandbox_id, state, error, lost=lost)
        self._locks.pop(sandbox_id, None)
        self._teardowns.pop(sandbox_id, None)  # closed by a teardown, or nothing on it
        self._owned.pop(sandbox_id, None)
        self.activity.forget(sandbox_id)

    def finish_create(self, sandbox_id: str, state: SandboxState, error: str | None = None) -> None:
        """A create that did not get its sandbox running ends it ``state``, or destroyed
        if a delete asked for that meanwhile (the delete, waiting for the lock, then
        finds nothing left to do)."""
        current = self.states.current(sandbox_id)
        if current is not None and current.state is SandboxState.STOPPING:
            state, error = SandboxState.DESTROYED, None
        self.finish(sandbox_id, state, error)

    def heartbeat(self) -> None:
        """The meter's heartbeat: every VM this daemon watches is alive now; the egress
        counted since the last one is written (bytes; denials every egress_event_s)."""
        self.meter.heartbeat(list(self.runtimes), self.clock())
        self.egress_meter.flush_bytes()
        self.egress_meter.flush_denials(self.settings.meter.egress_event_s)

    async def close(self) -> None:
        """Stop watching and drop every agent connection. The VMs keep running."""
        monitors = list(self._monitors.values())
        for task in monitors:
            task.cancel()
        await asyncio.gather(*monitors, return_exceptions=True)
        for runtime in list(self.runtimes.values()):
            with contextlib.suppress(Exception):
                await runtime.agent.close()
        self.runtimes.clear()
        self._monitors.clear()
        await self.shared.close()  # the host mounts stay for the next daemon to serve

    # -- snapshot files ----------------------------------------------------------------

    def collect_snapshots(self, evict: str | None = None) -> bool:
        """Remove the snapshot directories nothing reaches any more. Synchronous on
        purpose: no step of another operation runs between reading the references and
        removing, and each operation writes its reference (a snapshot row, ``resume_from``,
        a hold) before it creates the directory.

        ``evict``: a named snapshot's local copy (its upload to the blob store has
        completed) that its row alone does not keep; removed too unless something else
        reaches it (a sandbox's disk chain or ``resume_from``, a hold). True if it was.
        """
        live = self.store.list_sandboxes(states=LIVE_STATES)
        rows = self.store.list_snapshots(ready=None)
        # A snapshot's directory on this host: where it was saved, or where it was
        # fetched to from the blob store (another host's path may be in the row).
        keep = {snap.path for snap in rows} | {str(self.backend.fork_dir(s.id)) for s in rows}
        if evict is not None:
            keep = {k for k in keep if Path(k).resolve() != Path(evict).resolve()}
        keep |= {rec.resume_from for rec in live if rec.resume_from is not None}
        keep |= set(self._snapshot_holds)
        removed = self.backend.snapshots.collect({rec.id for rec in live}, keep)
        for name in removed:
            log.info("removed snapshot %s: nothing is built on it any more", name)
        return evict is not None and Path(evict).name in removed

    @contextlib.contextmanager
    def holding(self, snapshot_path: str) -> Iterator[None]:
        """Keep ``snapshot_path`` from collection while a clone of it is being made (its
        overlay, which then keeps it, does not exist yet)."""
        self._snapshot_holds[snapshot_path] += 1
        try:
            yield
        finally:
            self._snapshot_holds[snapshot_path] -= 1
            if self._snapshot_holds[snapshot_path] <= 0:
                del self._snapshot_holds[snapshot_path]


def _stopped_error(reason: str | None) -> str:
    """The error of a sandbox whose VM stopped on its own: an OOM kill says so first."""
    if reason is not None and reason.startswith(OUT_OF_MEMORY):
        return reason
    return "the VM stopped unexpectedly" + (f" ({reason})" if reason else "")
