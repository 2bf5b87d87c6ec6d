"""This hutchd as one host of a cluster: its registration and lease, the watch on the
other hosts' leases, placement, and drain.

Every hutchd registers itself in the ``hosts`` table (a single host too, as ``local``)
and renews its lease every third of ``HUTCH_HOST_LEASE_S``. At each renewal it also
marks down every host whose lease ended (a conditional ``UPDATE``: with several live
hosts exactly one marks each) and sweeps the down hosts nobody swept yet: their
sandboxes that had a VM (creating, running, pausing, resuming, stopping) end ``failed``
with an error that starts ``lost:`` and names the host and why, in the event log as
``sandbox.failed`` with reason ``host_down``, billed up to their last heartbeat.
Paused sandboxes keep their row and files: they hold no VM, so nothing of them was
lost. A host that finds its own lease taken (it was marked down while alive: a stall
longer than the lease) stops every VM whose row says lost, so a sandbox is never both
reported lost and still running, and registers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import httpx

from hutch.config import Settings
from hutch.contract.auth import Principal
from hutch.contract.placement import Placement
from hutch.errors import Conflict, HutchError, InvalidArgument, NotFound, Unavailable
from hutch.models import PauseMode, SandboxRecord, SandboxState
from hutch.services.cluster_auth import ClusterSigner, load_or_create_secret
from hutch.services.events import because, internal, project_of
from hutch.services.frozen_source import frozen_sandbox
from hutch.services.lifecycle import LifecycleService
from hutch.services.placement import (
    Frozen,
    choose_host,
    keep_labels,
    require_known,
    shown_labels,
)
from hutch.services.registry import SandboxRegistry
from hutch.store.db import RUNNING_STATES
from hutch.store.hosts import HostRow, HostStore, HostUse
from hutch.store.image_uploads import ImageUploadStore
from hutch.vm.host_facts import cpu_model, qemu_build

__all__ = ["ClusterService", "HostRow", "HostView", "host_facts"]

log = logging.getLogger("hutch.services.cluster")


@dataclass(frozen=True)
class HostView:
    """A host with what it holds now (``hutch host ls``, ``GET /v1/hosts``)."""

    row: HostRow
    use: HostUse
    this: bool


async def host_facts(settings: Settings, accel: str, now: float) -> HostRow:
    """This host's row as it registers: capacity read from the machine and limits."""
    disk = shutil.disk_usage(settings.state_dir)
    lease = settings.cluster.lease_s
    return HostRow(
        id=settings.host_id,
        address=settings.host_address,
        role=settings.cluster.role,
        state="up",
        vcpus=os.cpu_count() or 1,
        memory_mib=settings.limits.memory_budget_mib,
        disk_gib=disk.free >> 30,
        max_sandboxes=settings.limits.max_sandboxes,
        accel=accel,
        # The build (version and package), as a snapshot manifest records it: placement
        # then compares what a restore will check.
        qemu_version=await asyncio.to_thread(qemu_build),
        cpu_model=cpu_model(),
        labels=dict(settings.cluster.labels),
        started_at=now,
        renewed_at=now,
        lease_until=now + lease,
        net_pool=str(settings.net_pool),
    )


class ClusterService:
    """See the module docstring; ``lifecycle`` pauses this host's sandboxes in a drain."""

    def __init__(
        self,
        core: SandboxRegistry,
        lifecycle: LifecycleService,
        snapshot_uploaded: Callable[[str], bool] | None = None,
    ) -> None:
        self.core = core
        self.lifecycle = lifecycle
        #: A named snapshot's upload to the blob store is complete (blocking: a stat).
        self.snapshot_uploaded = snapshot_uploaded or (lambda _id: False)
        self.settings = core.settings
        self.host_id = core.host_id
        self.hosts = HostStore(core.store)
        self.uploads = ImageUploadStore(core.store)
        self.signer = ClusterSigner(
            load_or_create_secret(self.settings.cluster_secret_path), self.host_id
        )
        self.clock = time.time
        self.me: HostRow | None = None
        self._task: asyncio.Task[None] | None = None
        self._drop: asyncio.Task[None] | None = None

    @property
    def lease_s(self) -> float:
        return self.settings.cluster.lease_s

    # -- lifecycle of the host ---------------------------------------------------------------

    async def start(self) -> None:
        """Register (up, a fresh lease) and keep the lease and the watch going."""
        self.me = await host_facts(self.settings, self.core.backend.accel, self.clock())
        self.hosts.register(self.me)
        log.info(
            "host %s registered (%s, lease %.0f s)", self.host_id, self.me.address, self.lease_s
        )
        self._task = asyncio.create_task(self._run(), name="hutch-host-lease")

    async def close(self) -> None:
        """Stop renewing. The host stays registered: a restart within the lease keeps
        its sandboxes; past it, the other hosts mark it down."""
        for task in (self._task, self._drop):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._task = self._drop = None

    async def _run(self) -> None:
        internal("host_lease")
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await self.tick()
            except HutchError as exc:
                log.error("host lease or watch failed (retried): %s", exc)

    async def tick(self) -> None:
        """One renewal and one watch: renew, mark expired hosts down, sweep them."""
        now = self.clock()
        if not self.hosts.renew(self.host_id, now, now + self.lease_s):
            await self._fenced()
        for host in self.hosts.expire(self.clock()):
            log.warning("host %s missed its lease: marked down", host)
        for host in self.hosts.unswept():
            if host != self.host_id and self.hosts.claim_sweep(host):
                self.sweep(host)
        # Paused sandboxes another host resumed: their files here go, in a task of its
        # own (it takes sandbox locks; the lease must never wait for a resume or boot).
        if self.lifecycle.moves.enabled and (self._drop is None or self._drop.done()):
            self._drop = asyncio.create_task(self._drop_moved(), name="hutch-drop-moved")

    async def _drop_moved(self) -> None:
        try:
            await self.lifecycle.moves.drop_moved()
        except (HutchError, OSError) as exc:
            log.error("host %s: dropping moved sandboxes failed (retried): %s", self.host_id, exc)

    def sweep(self, host: str) -> list[str]:
        """Report the sandboxes of down ``host`` that had a VM as lost; their ids."""
        row = self.hosts.get(host)
        why = (row.down_reason if row else None) or "it is down"
        lost: list[str] = []
        for sandbox_id in sorted(self.hosts.ids_on(host, RUNNING_STATES)):
            try:
                with because("host_down"):
                    self.core.states.ended(
                        sandbox_id,
                        SandboxState.FAILED,
                        f"lost: host {host} is down ({why}); the sandbox's VM and memory "
                        "are gone with it",
                        lost=True,
                    )
                lost.append(sandbox_id)
            except HutchError as exc:  # it moved meanwhile (e.g. deleted): not lost
                log.info("sandbox %s of down host %s not marked lost: %s", sandbox_id, host, exc)
        if lost:
            log.warning("host %s is down: %d sandbox(es) lost: %s", host, len(lost), lost)
        return lost

    async def _fenced(self) -> None:
        """This host was marked down while alive: drop every VM whose row ended."""
        log.error(
            "host %s was marked down while alive (lease missed); re-registering", self.host_id
        )
        for sandbox_id in list(self.core.runtimes):
            rec = self.core.states.current(sandbox_id)
            if rec is not None and not rec.state.is_live:
                async with self.core.lock(sandbox_id):
                    with contextlib.suppress(HutchError):
                        await self.core.teardown(sandbox_id, deleted=False)
        if self.me is not None:
            now = self.clock()
            self.me = replace(self.me, renewed_at=now, lease_until=now + self.lease_s)
            self.hosts.register(self.me)

    # -- placement and routing ---------------------------------------------------------------

    def place(
        self,
        placement: Placement,
        memory_mib: int,
        frozen: Frozen | None = None,
        *,
        exclude: str | None = None,
    ) -> HostRow:
        """The host a sandbox of ``memory_mib`` (restored from ``frozen``, if any) lands
        on; ``exclude``: never that host."""
        return choose_host(
            self.hosts.all(),
            self.hosts.usage(),
            placement,
            memory_mib=memory_mib,
            now=self.clock(),
            frozen=frozen,
            exclude=exclude,
        )

    async def place_create(
        self,
        placement: Placement,
        memory_mib: int,
        snapshot: str | None,
        volumes_home: str | None = None,
    ) -> HostRow:
        """:meth:`place` for a create: a snapshot uploaded to the blob store may be
        created from on any compatible host (it fetches the files); one that mounts
        volumes runs on their host (``volumes_home``, :meth:`volumes_home`)."""
        if volumes_home is not None:
            placement = self._pinned_to_volumes(placement, volumes_home)
        frozen = None
        if snapshot is not None:
            anywhere = False
            try:
                anywhere = await asyncio.to_thread(self.snapshot_uploaded, snapshot)
            except HutchError as exc:  # the store away: the saving host still has it
                log.warning("snapshot %s: upload state unknown: %s", snapshot, exc)
            host = self.hosts.host_of_snapshot(snapshot)
            if host is not None:
                frozen = self._snapshot(snapshot, host, anywhere)
        return self.place(placement, memory_mib, frozen)

    def volumes_home(self, project: str, refs: Sequence[str]) -> str | None:
        """The host whose disk holds the volumes ``refs`` (ids or names in ``project``)
        that a create mounts: it runs there. None: no volume, only unknown ones (the
        create's own checks answer), or volumes no host has claimed yet. Conflict when
        they are on different hosts (a sandbox mounts the volumes of its own host)."""
        homes: dict[str, list[str]] = {}
        for ref in refs:
            row = self.core.volumes.get(project, ref)
            if row is not None and row.host is not None:
                homes.setdefault(row.host, []).append(row.name)
        if len(homes) > 1:
            where = "; ".join(f"{', '.join(names)} on {h}" for h, names in sorted(homes.items()))
            raise Conflict(
                f"the volumes this create mounts are on different hosts ({where}); a sandbox "
                "mounts volumes of the host it runs on: use volumes of one host"
            )
        return next(iter(homes), None)

    def _pinned_to_volumes(self, placement: Placement, home: str) -> Placement:
        """``placement`` bound to ``home``, the host holding the create's volumes;
        InvalidArgument when it asks for another host, Unavailable while ``home`` is
        down (the volumes' files are there)."""
        if placement.host not in (None, home):
            raise InvalidArgument(
                f"placement.host {placement.host!r}: the volumes this create mounts are on "
                f"host {home}, and a sandbox runs where its volumes are; leave "
                f"placement.host out or set it to {home!r}"
            )
        row = self.hosts.get(home)
        if row is None or row.state == "down" or row.lease_until < self.clock():
            raise Unavailable(
                f"the volumes this create mounts are on host {home}, which is "
                f"{row.state if row is not None else 'gone'}; a sandbox runs where its volumes "
                "are: retry once it is up",
                retry_after_s=15,
            )
        return replace(placement, host=home)

    def volume_owner(self, project: str, ref: str) -> HostRow | None:
        """The other live host a request on volume ``ref`` of ``project`` goes to (its
        file is there); None: served here (this host's, unknown, or its host is down)."""
        row = self.core.volumes.get(project, ref)
        if row is None or row.host is None:
            return None
        return self.live_other(row.host)

    def resume_host(self, sandbox_id: str, placement: Placement | None = None) -> HostRow | None:
        """Where a resume of ``sandbox_id`` runs; None: here. Without ``placement``: its
        own host while that host is up; a paused sandbox whose host is draining or down
        moves: placement picks a host (this one, maybe), which fetches its pause from
        the blob store. With one, a paused sandbox resumes where it puts it
        (:meth:`place_resume`); a sandbox that is not paused is its host's to answer."""
        host = self.hosts.host_of(sandbox_id)
        if host is None:
            return None
        if placement is not None and (placement.host is not None or placement.labels):
            rec = self.core.store.get_sandbox(sandbox_id)
            if rec is not None and rec.state is SandboxState.PAUSED:
                return self.place_resume(rec, host, placement)
            return self.live_other(host)
        row = self.hosts.get(host)
        if row is not None and row.state == "up" and row.lease_until >= self.clock():
            return self.live_other(host)
        rec = self.core.store.get_sandbox(sandbox_id)
        if rec is None or rec.state is not SandboxState.PAUSED or not self.lifecycle.moves.enabled:
            return self.live_other(host)
        chosen = self.place_move(rec, exclude=host)
        log.info("resume of %s (host %s is %s) placed on %s", sandbox_id, host,
                 row.state if row else "gone", chosen.id)  # fmt: skip
        return None if chosen.id == self.host_id else chosen

    def place_resume(self, rec: SandboxRecord, host: str, placement: Placement) -> HostRow | None:
        """The host a resume of paused ``rec`` (paused on ``host``) asked to go where
        ``placement`` says runs on; None: here. The labels it was created with still
        bind it (a placement naming other values for them is refused, InvalidArgument);
        another host than its own needs the blob store (Conflict naming
        ``HUTCH_BLOB_URL``)."""
        require_known(self.hosts.all(), placement)
        clash = {
            k: v
            for k, v in placement.labels.items()
            if k in rec.placement_labels and rec.placement_labels[k] != v
        }
        if clash:
            raise InvalidArgument(
                f"placement.labels {shown_labels(clash)} contradict the labels sandbox {rec.id} "
                f"was created with ({shown_labels(rec.placement_labels)}); it runs only on hosts "
                "carrying those: leave them out or give the same values"
            )
        labels = {**rec.placement_labels, **placement.labels}
        chosen = keep_labels(
            rec.id,
            rec.placement_labels,
            "the resume",
            lambda: self.place(
                Placement(host=placement.host, labels=labels, strategy=placement.strategy),
                rec.shape.memory_mib,
                # Anywhere: another host than its own fetches the pause from the blob
                # store (without one the refusal below names HUTCH_BLOB_URL).
                self._paused(rec, host),
            ),
        )
        if chosen.id != host and not self.lifecycle.moves.enabled:
            raise Conflict(
                f"sandbox {rec.id} is paused on host {host}; resuming it on host {chosen.id} "
                "moves its pause through the blob store, and none is configured "
                "(HUTCH_BLOB_URL); resume it without a placement, or set HUTCH_BLOB_URL on "
                "every host"
            )
        log.info("resume of %s (paused on %s) placed on %s", rec.id, host, chosen.id)
        return None if chosen.id == self.host_id else chosen

    def place_move(self, rec: SandboxRecord, exclude: str) -> HostRow:
        """The host a paused ``rec`` moves to off host ``exclude`` (where it paused):
        placement with the labels it was created with (fails naming them when no such
        host can take it), on a host that can restore its pause (that host's QEMU and
        CPU)."""
        return keep_labels(
            rec.id,
            rec.placement_labels,
            "the move",
            lambda: self.place(
                Placement(labels=rec.placement_labels),
                rec.shape.memory_mib,
                self._paused(rec, exclude),
                exclude=exclude,
            ),
        )

    def _snapshot(self, snapshot_id: str, host: str, anywhere: bool) -> Frozen:
        """Named snapshot ``snapshot_id`` saved on ``host``: restorable where that host's
        QEMU and CPU run and, for a built-in image, where the bytes it was saved over are
        (held, or fetched from the blob store's upload of that digest)."""
        what = f"snapshot {snapshot_id}"
        snap = self.core.store.get_snapshot(snapshot_id)
        rec = self.core.states.current(snap.sandbox_id) if snap is not None else None
        if rec is None:
            return Frozen(host, anywhere, what)
        return frozen_sandbox(self.hosts, self.uploads, rec, host, what, anywhere=anywhere)

    def _paused(self, rec: SandboxRecord, host: str) -> Frozen:
        """The pause of ``rec`` taken on ``host``: restorable where that host's QEMU and
        CPU run and its image bytes are (in the blob store: another host fetches it)."""
        return frozen_sandbox(self.hosts, self.uploads, rec, host, f"the pause of {rec.id}")

    def alone(self) -> bool:
        """No other host is up (one host, or the others down): creates land here."""
        return all(h.id == self.host_id or h.state != "up" for h in self.hosts.all())

    def owner(self, sandbox_id: str) -> HostRow | None:
        """The other live host a request for ``sandbox_id`` goes to; None: served here
        (this host's, unknown, or its host is down: the row answers)."""
        host = self.hosts.host_of(sandbox_id)
        return self.live_other(host) if host is not None else None

    def live_other(self, host_id: str) -> HostRow | None:
        if host_id == self.host_id:
            return None
        row = self.hosts.get(host_id)
        if row is None or row.state == "down":
            return None
        return row

    # -- what the API shows and does --------------------------------------------------------

    def views(self) -> list[HostView]:
        use = self.hosts.usage()
        return [
            HostView(h, use.get(h.id, HostUse()), h.id == self.host_id) for h in self.hosts.all()
        ]

    def view(self, host_id: str) -> HostView:
        for v in self.views():
            if v.row.id == host_id:
                return v
        raise NotFound(f"no host {host_id!r}; see GET /v1/hosts")

    async def drain(self) -> HostView:
        """This host takes no new sandboxes; each running one is paused (memory mode)
        and, with a blob store, resumed at once on another host once its pause is
        uploaded (it keeps running there with its processes; placement picks the
        host). Paused ones stay paused, and resume elsewhere when asked. Without a blob
        store, or when no other host has room, they stay paused here."""
        self.hosts.set_state(self.host_id, "draining")
        paused: list[SandboxRecord] = []
        for rec in self.core.own_rows([SandboxState.RUNNING]):
            try:
                with because("drain"):
                    paused.append(await self.lifecycle.pause(rec.id, PauseMode.MEMORY))
            except HutchError as exc:
                log.error("drain of host %s: could not pause %s: %s", self.host_id, rec.id, exc)
        moves = self.lifecycle.moves
        if moves.enabled:
            # The moves one after the other: each is a download and a restore on the
            # host placement picks, which then counts it when placing the next.
            for rec in paused:
                await moves.wait_uploaded(rec.id)
                try:
                    await self._move_off(rec)
                except HutchError as exc:
                    log.error("drain of host %s: %s stays paused: %s", self.host_id, rec.id, exc)
        return self.view(self.host_id)

    async def _move_off(self, rec: SandboxRecord) -> None:
        """Resume ``rec`` (paused here, uploaded) on the host placement picks, as the
        admin of its project (a signed forward, as the router's)."""
        target = self.place_move(rec, exclude=self.host_id)
        path = f"/v1/sandboxes/{rec.id}/resume"
        headers = self.signer.sign(Principal.admin(project_of(rec)), "POST", path)
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0)) as client:
                answer = await client.post(target.address + path, headers=headers)
        except httpx.HTTPError as exc:
            why = f"host {target.id} did not answer the move of {rec.id}: {exc!r}"
            raise Unavailable(why) from exc
        if answer.status_code != 200:
            raise Conflict(
                f"host {target.id} refused the move of {rec.id}: {answer.status_code} "
                f"{answer.text[:500]}"
            )
        log.info("drain of host %s: %s moved to %s", self.host_id, rec.id, target.id)

    def undrain(self) -> HostView:
        self.hosts.set_state(self.host_id, "up")
        return self.view(self.host_id)
