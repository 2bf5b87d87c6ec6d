"""Fork children on other hosts (:class:`RemoteClones`).

With a blob store and other hosts up, a fork's children are placed like creates
(``spread``: each on the host with the most memory free, counting the children placed
before it; the parent's host is a candidate too). The parent's host inserts every
child's row (``host`` = where it goes) and freezes the parent as for any fork; then, for
the children placed elsewhere::

    parent host: upload_dir(snapshots/<fork>/ -> forks/<fork>/...)   once, index last
                 POST <host>/v1/hosts/<host>/clones {fork, parent, children}  signed
    other host:  fetch forks/<fork>/ into its snapshots/<fork>/ (checked: index,
                 sha256 of every blob, the stream against the manifest), then each child
                 as a local fork child: network with the parent's stored rules and
                 networks, start_clone, running; a child that fails ends failed with why
    parent host: the fork's blobs are deleted (the copies on the hosts stay while their
                 children's disks are built on them, as a fork directory always does)

A parent with volumes (their files are this host's) forks on its own host only. The
other host checks each child it is asked for: a ``creating`` row placed on it whose
parent is the one named.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from pathlib import Path

import httpx

from hutch.contract.auth import Principal
from hutch.contract.placement import Placement
from hutch.errors import Capacity, HutchError, InvalidArgument, NotFound
from hutch.models import NetworkMode, SandboxRecord, SandboxState
from hutch.services.blob_dirs import upload_dir
from hutch.services.cluster_auth import ClusterSigner, load_or_create_secret
from hutch.services.events import project_of
from hutch.services.frozen_source import frozen_sandbox
from hutch.services.placement import choose_host, require_labels
from hutch.services.registry import SandboxRegistry
from hutch.services.snapshot_blobs import SnapshotBlobs
from hutch.store.hosts import HostStore, HostUse
from hutch.store.image_uploads import ImageUploadStore

__all__ = ["FORK_NAME_RE", "RemoteClones"]

log = logging.getLogger("hutch.services.remote_clones")

FORK_NAME_RE = re.compile(r"^fork-[0-9a-f]{12}$")
#: Clones one host starts at once for a remote fork (as a local fork bounds them).
REMOTE_PARALLEL = 4


def _prefix(fork: str) -> str:
    return f"forks/{fork}/"


class RemoteClones:
    def __init__(self, core: SandboxRegistry, blobs: SnapshotBlobs) -> None:
        self.core = core
        self.blobs = blobs
        self.hosts = HostStore(core.store)
        self._signer: ClusterSigner | None = None

    @property
    def signer(self) -> ClusterSigner:
        if self._signer is None:
            secret = load_or_create_secret(self.core.settings.cluster_secret_path)
            self._signer = ClusterSigner(secret, self.core.host_id)
        return self._signer

    # -- the parent's host ------------------------------------------------------------------

    def place(self, parent: SandboxRecord, count: int) -> list[str]:
        """The host of each of ``count`` children (all this host's without a blob
        store, with no other host up, or for a parent with volumes)."""
        me = self.core.host_id
        labels = parent.placement_labels
        # The children keep the parent's placement labels: this host, when it is to
        # take them, must carry them too (it may have restarted with other labels).
        mine = dict(self.core.settings.cluster.labels)
        if (
            not self.blobs.enabled
            or self.core.volumes.mounts_of_sandbox(parent.id)
            or self.core.shared.shared_mounts(parent.id)
        ):
            require_labels(parent.id, labels, me, mine, "the fork")
            return [me] * count
        hosts = self.hosts.all()
        if all(h.id == me or h.state != "up" for h in hosts):
            require_labels(parent.id, labels, me, mine, "the fork")
            return [me] * count
        use = dict(self.hosts.usage())
        shape = parent.shape
        frozen = frozen_sandbox(
            self.hosts, ImageUploadStore(self.core.store), parent, me, f"the fork of {parent.id}"
        )
        out: list[str] = []
        for _ in range(count):
            try:
                chosen = choose_host(
                    hosts,
                    use,
                    Placement(labels=labels),
                    memory_mib=shape.memory_mib,
                    now=time.time(),
                    frozen=frozen,
                )
            except (Capacity, InvalidArgument):
                # This host's own check then says why (room, quota), or, for a parent
                # with labels this host lacks, the refusal names them.
                require_labels(parent.id, labels, me, mine, "the fork")
                out.append(me)
                continue
            out.append(chosen.id)
            held = use.get(chosen.id, HostUse())
            use[chosen.id] = dataclasses.replace(
                held,
                sandboxes=held.sandboxes + 1,
                running=held.running + 1,
                vcpus=held.vcpus + shape.vcpus,
                memory_mib=held.memory_mib + shape.memory_mib,
            )
        return out

    async def start(
        self, parent: SandboxRecord, snapshot_dir: Path, groups: dict[str, list[SandboxRecord]]
    ) -> None:
        """Start the children of ``groups`` (host -> children) on their hosts from the
        frozen ``snapshot_dir``. A child that did not start ends failed with why; the
        rows say which (the caller reads them)."""
        store = self.blobs.store
        assert store is not None
        fork = snapshot_dir.name
        try:
            started = time.monotonic()
            size = await asyncio.to_thread(
                upload_dir,
                store,
                _prefix(fork),
                snapshot_dir,
                owner=fork,
                scratch=self.core.settings.state_dir,
            )
            log.info(
                "fork %s of %s uploaded for hosts %s: %d bytes in %.1f s",
                fork,
                parent.id,
                sorted(groups),
                size,
                time.monotonic() - started,
            )
            await asyncio.gather(*(self._ask(h, parent, fork, kids) for h, kids in groups.items()))
        except (HutchError, OSError) as exc:
            for kids in groups.values():
                self._failed(kids, f"the fork could not reach the child's host: {exc}")
        finally:
            await self._forget(fork)

    async def _ask(
        self, host_id: str, parent: SandboxRecord, fork: str, kids: list[SandboxRecord]
    ) -> None:
        row = self.hosts.get(host_id)
        if row is None:
            self._failed(kids, f"host {host_id} is gone")
            return
        path = f"/v1/hosts/{host_id}/clones"
        headers = self.signer.sign(Principal.admin(project_of(parent)), "POST", path)
        body = {"fork": fork, "parent": parent.id, "children": [k.id for k in kids]}
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0)) as client:
                answer = await client.post(row.address + path, headers=headers, json=body)
        except httpx.HTTPError as exc:
            self._failed(kids, f"host {host_id} did not answer: {exc!r}")
            return
        if answer.status_code != 200:
            self._failed(kids, f"host {host_id} refused: {answer.status_code} {answer.text[:300]}")

    def _failed(self, kids: list[SandboxRecord], why: str) -> None:
        """Children still ``creating`` end failed with ``why`` (those their host ended
        or started keep what it wrote)."""
        for kid in kids:
            current = self.core.states.current(kid.id)
            if current is not None and current.state is SandboxState.CREATING:
                try:
                    self.core.states.ended(kid.id, SandboxState.FAILED, f"fork failed: {why}")
                except HutchError as exc:
                    log.info("fork child %s not marked failed: %s", kid.id, exc)

    async def _forget(self, fork: str) -> None:
        store = self.blobs.store
        assert store is not None

        def remove() -> None:
            store.delete(_prefix(fork) + "index.json")
            for blob in store.list_prefix(_prefix(fork)):
                store.delete(blob.key)

        try:
            await asyncio.to_thread(remove)
        except HutchError as exc:
            log.warning("fork %s: its blobs were not all removed: %s", fork, exc)

    # -- a child's host ---------------------------------------------------------------------

    async def clone_here(self, fork: str, parent_id: str, child_ids: list[str]) -> list[str]:
        """Start the children ``child_ids`` (rows placed on this host, ``creating``, of
        ``parent_id``) from the fork ``fork`` in the blob store; the ids of those that
        failed (their rows say why)."""
        if not FORK_NAME_RE.match(fork):
            raise InvalidArgument(f"fork {fork!r} is not a fork name (fork-<12 hex digits>)")
        if not self.blobs.enabled:
            raise InvalidArgument("this host has no blob store (HUTCH_BLOB_URL) to fetch from")
        parent = self.core.store.get_sandbox(parent_id)
        if parent is None:
            raise NotFound(f"no sandbox {parent_id!r}")
        kids: list[SandboxRecord] = []
        for child_id in child_ids:
            rec = self.core.store.get_sandbox(child_id)
            if (
                rec is None
                or rec.state is not SandboxState.CREATING
                or rec.parent_id != parent_id
                or self.hosts.host_of(child_id) != self.core.host_id
            ):
                raise InvalidArgument(
                    f"{child_id!r} is not a child of {parent_id} being created on this host"
                )
            kids.append(rec)
        target = self.core.backend.fork_dir(fork)
        failed: list[str] = []
        # The image the fork's chain ends in, fetched first if this host lacks it.
        await self.core.image_source.ensure_local(parent.image, parent.project)
        with self.core.holding(str(target)):
            await self.blobs.local_frozen(_prefix(fork), fork, target, image=parent.image)
            gate = asyncio.Semaphore(REMOTE_PARALLEL)

            async def one(child: SandboxRecord) -> None:
                async with gate, self.core.lock(child.id):
                    try:
                        await self._start(parent, child, target)
                    except BaseException as exc:
                        await self.core.teardown(child.id)
                        self.core.finish(child.id, SandboxState.FAILED, str(exc))
                        failed.append(child.id)
                        if not isinstance(exc, Exception):
                            raise

            await asyncio.gather(*(one(k) for k in kids))
        return failed

    async def _start(self, parent: SandboxRecord, child: SandboxRecord, snapshot_dir: Path) -> None:
        current = self.core.states.current(child.id)
        if current is None or current.state is not SandboxState.CREATING:
            return  # deleted before its turn came
        self.core.own_files(child.id)
        net = self.core.net
        if net is not None and child.network is NetworkMode.DEFAULT:
            # The parent's stored rules and networks; an address from this host's pool.
            self.core.own_network(child.id)
            await net.attach(child.id, net.policy_of(parent.id), net.networks_of(parent.id))
        await self.core.shared.serve(child.id)
        self.core.own_vm(child.id)
        runtime = await self.core.backend.start_clone(child, snapshot_dir)
        self.core.attach(child.id, runtime)
        self.core.states.running(child)
