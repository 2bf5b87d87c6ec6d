"""Paused sandboxes that move between hosts through the blob store (:class:`SandboxMoves`).

With a blob store (``HUTCH_BLOB_URL``) every pause is uploaded in the background, as a
frozen directory (:mod:`hutch.services.blob_dirs`) under a prefix of its own::

    pauses/<sandbox-id>/<paused-at, ms>/state.mig, manifest.json   (memory mode)
                                        vm.json, disk.qcow2, layer-1.qcow2 ...
                                        index.json   written last: the upload is complete

The prefix names the pause by its ``paused_at`` (the row's), so a host resuming the
sandbox reads exactly the upload of the pause its row records: a stale index of an
earlier pause (its deletion failed, or a host died before it) is never paired with a
later disk. Before a pause's upload the blobs of earlier pauses are deleted; after any
resume the pause's blobs go (in the background: a failure only costs storage).

The upload runs on :class:`~hutch.services.background_uploads.BackgroundUploads` (as
images' and snapshots' do), retried while the row still records that pause.

Resume on the same host (its files are here): the upload under way is stopped (at its
next part) and waited for, nothing is downloaded, and the resume is as before. Resume on
another host (the row names another host: it is down or draining, or the router placed
the resume here): the upload must be complete; every blob is fetched into a staging
directory and checked (size + sha256 against the index, the stream against the
manifest's digest), the chain re-pointed at this host's image, renamed to this host's
sandbox directory, ``vm.json`` re-pointed at this host's paths (``Backend.rehome``),
the row taken over (``UPDATE ... WHERE host = <from>``: one host wins), the network
attached here with the sandbox's stored rules. The old host, when alive, drops what it
kept of the sandbox at its next lease renewal (:meth:`SandboxMoves.drop_moved`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hutch.errors import Conflict, HutchError, SnapshotError
from hutch.models import NetworkMode, PauseMode, SandboxRecord, SandboxState
from hutch.services.background_uploads import RETRY_S, BackgroundUploads
from hutch.services.blob_dirs import DISK, INDEX, BaseImages, fetch_dir, upload_dir
from hutch.services.placement import require_labels
from hutch.services.registry import SandboxRegistry
from hutch.storage.blobs import BlobInfo, BlobStore
from hutch.store.hosts import HostStore

__all__ = ["SandboxMoves", "pause_prefix"]

log = logging.getLogger("hutch.services.moves")

VM_JSON = "vm.json"
#: How often (seconds) an upload's thread asks the row whether the pause is still there.
_ROW_CHECK_S = 5.0


def pause_prefix(rec: SandboxRecord) -> str:
    """Where the pause ``rec`` records (its ``paused_at``) is kept in the blob store."""
    if rec.paused_at is None:
        raise SnapshotError(f"sandbox {rec.id} has no pause time; it is not paused")
    return f"pauses/{rec.id}/{round(rec.paused_at * 1000)}/"


class SandboxMoves:
    """See the module docstring; ``store`` None: pauses stay on their host."""

    def __init__(
        self,
        core: SandboxRegistry,
        store: BlobStore | None,
        *,
        retry_s: Sequence[float] = RETRY_S,
    ) -> None:
        """``store``: the daemon's (``blob_store_from_settings``); ``retry_s``: the
        delays between upload attempts."""
        self.core = core
        self.store = store
        self.hosts = HostStore(core.store)
        self.uploads: BackgroundUploads[SandboxRecord] = BackgroundUploads(
            "sandbox",
            self._upload_once,
            lambda rec: self._current(rec) is not None,
            key=lambda rec: rec.id,
            log=log,
            task_prefix="hutch-pause-up-",
            retry_s=retry_s,
            what="pause upload",
        )
        self._background: set[asyncio.Task[Any]] = set()
        #: This host's images under a fetched pause's chain: a built-in one it lacks
        #: fetched first, held from an adoption meanwhile (``builtin_blobs``; set where
        #: the services are composed).
        self.base_images: BaseImages | None = None

    @property
    def enabled(self) -> bool:
        return self.store is not None

    async def close(self) -> None:
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await self.uploads.close()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- upload after a pause -------------------------------------------------------------

    def paused(self, rec: SandboxRecord) -> None:
        """``rec`` was just paused on this host: upload it in the background (on the
        event loop; a no-op while an upload of the sandbox is under way)."""
        if self.store is None:
            return
        self.uploads.schedule(rec)

    async def wait_uploaded(self, sandbox_id: str, timeout_s: float = 600.0) -> None:
        """Until the upload of the sandbox's pause under way (if any) has ended, or
        ``timeout_s`` (a store away that long: the upload goes on retrying)."""
        await self.uploads.wait(sandbox_id, timeout_s)

    def uploaded(self, rec: SandboxRecord) -> bool:
        """The upload of the pause ``rec`` records is complete."""
        return self.store is not None and (
            rec.paused_at is not None and self.store.stat(pause_prefix(rec) + INDEX) is not None
        )

    async def _upload_once(self, rec: SandboxRecord) -> None:
        """One attempt (``BackgroundUploads`` retries it while the row records the
        pause and no resume here stopped it)."""
        started = time.monotonic()
        try:
            size = await asyncio.to_thread(self._upload, rec)
        except (HutchError, OSError):
            # Deleted (or ended) during the attempt: what it wrote after the delete's
            # own removal goes too. The failure is the retry loop's to judge.
            now = self.core.store.get_sandbox(rec.id)
            if now is None or not now.state.is_live:
                self.forget_soon(rec.id)
            raise
        took = time.monotonic() - started
        log.info("sandbox %s: pause uploaded (%d bytes in %.1f s)", rec.id, size, took)

    def _current(self, rec: SandboxRecord) -> SandboxRecord | None:
        """The row, while it still records the pause ``rec`` on this host."""
        now = self.core.store.get_sandbox(rec.id)
        if now is None or now.state is not SandboxState.PAUSED or now.paused_at != rec.paused_at:
            return None
        return now

    def _upload(self, rec: SandboxRecord) -> int:
        assert self.store is not None
        store = self.store
        prefix = pause_prefix(rec)
        # Earlier pauses' blobs first (never paired with this one: another prefix).
        for blob in store.list_prefix(f"pauses/{rec.id}/"):
            if not blob.key.startswith(prefix):
                store.delete(blob.key)
        sandbox_dir = self.core.backend.disk_path(rec.id).parent
        memory = rec.pause_mode is PauseMode.MEMORY and rec.resume_from is not None
        return upload_dir(
            store,
            prefix,
            Path(rec.resume_from) if memory and rec.resume_from else None,
            owner=rec.id,
            scratch=self.core.settings.state_dir,
            disk=self.core.backend.disk_path(rec.id),
            extra={VM_JSON: sandbox_dir / VM_JSON},
            put=lambda key, path: self._put(rec, key, path),
        )

    def _put(self, rec: SandboxRecord, key: str, path: Path) -> BlobInfo:
        """One blob of a pause's upload; stops between parts once the sandbox resumed
        here, was deleted, or the daemon closes (the thread cannot be cancelled)."""
        assert self.store is not None
        checked = time.monotonic()

        def still_wanted(_sent: int) -> None:
            nonlocal checked
            if self.uploads.stopping(rec.id):
                raise SnapshotError(f"the upload of sandbox {rec.id}'s pause was stopped")
            if time.monotonic() - checked > _ROW_CHECK_S:  # the row, now and then (a query)
                checked = time.monotonic()
                if self._current(rec) is None:  # no retry either: it is not wanted
                    raise SnapshotError(f"sandbox {rec.id} is no longer paused there")

        still_wanted(0)
        return self.store.put(key, path, progress=still_wanted)

    async def stop_upload(self, sandbox_id: str) -> None:
        """The sandbox resumes here: its files change from now on, so the upload under
        way stops (at its next part) and is waited for, its thread included."""
        await self.uploads.stop(sandbox_id)

    def forget_soon(self, sandbox_id: str, rec: SandboxRecord | None = None) -> None:
        """The blobs of the pause ``rec`` records (it was resumed: it can never be
        restored again) go, in the background; ``rec`` None: every pause of the sandbox
        (it was deleted). Only that prefix: a pause taken since has its own."""
        if self.store is None or self.uploads.closed:
            return
        if rec is not None and rec.paused_at is None:
            return
        store = self.store
        prefix = pause_prefix(rec) if rec is not None else f"pauses/{sandbox_id}/"

        def remove() -> None:
            found = store.list_prefix(prefix)
            for blob in sorted(found, key=lambda b: not b.key.endswith("/" + INDEX)):
                store.delete(blob.key)  # each index first: no longer "complete"

        async def run() -> None:
            try:
                await asyncio.to_thread(remove)
            except HutchError as exc:
                log.warning("sandbox %s: its pause blobs were not all removed: %s", sandbox_id, exc)

        task = asyncio.create_task(run(), name=f"hutch-pause-forget-{sandbox_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- resume on another host -----------------------------------------------------------

    def here(self, rec: SandboxRecord) -> bool:
        """The sandbox's files are this host's (its row names this host)."""
        return self.hosts.host_of(rec.id) in (None, self.core.host_id)

    async def arrive(self, rec: SandboxRecord) -> SandboxRecord:
        """Fetch the pause of ``rec`` (on another host) and take the sandbox over; the
        row as it is now (this host's, still paused, ``resume_from`` this host's).
        Conflict when the upload is not complete or another host took it first."""
        source = self.hosts.host_of(rec.id) or "?"
        if self.store is None:
            raise Conflict(
                f"sandbox {rec.id} is paused on host {source}, and no blob store is "
                "configured (HUTCH_BLOB_URL) to move it here; resume it there"
            )
        if rec.pause_mode is None:
            raise Conflict(f"sandbox {rec.id} is not paused; it cannot move to another host")
        require_labels(
            rec.id,
            rec.placement_labels,
            self.core.host_id,
            dict(self.core.settings.cluster.labels),
            "the move",
        )
        if self.core.volumes.mounts_of_sandbox(rec.id):
            raise Conflict(
                f"sandbox {rec.id} has volumes attached (their files are on host {source}); "
                "resume it there"
            )
        if not await asyncio.to_thread(self.uploaded, rec):
            raise Conflict(
                f"sandbox {rec.id} is paused on host {source}, whose upload of its pause to "
                f"{self.store.url} has not completed; retry once it has (or once {source} "
                "is back)"
            )
        memory = rec.pause_mode is PauseMode.MEMORY and rec.resume_from is not None
        # The image at the bottom of its disk's chain, fetched first if this host lacks it.
        await self.core.image_source.ensure_local(rec.image, rec.project)
        self.core.own_files(rec.id)
        await asyncio.to_thread(self._fetch, rec, memory)
        self.core.backend.rehome(rec)
        resume_from = str(self.core.backend.pause_dir(rec.id)) if memory else None
        if not self.hosts.move_sandbox(rec.id, source, self.core.host_id, resume_from):
            await self.core.teardown(rec.id, deleted=False)  # the files fetched here
            raise Conflict(f"sandbox {rec.id} was taken over by another host meanwhile")
        log.info("sandbox %s: moved from host %s to %s", rec.id, source, self.core.host_id)
        net = self.core.net
        if net is not None and rec.network is NetworkMode.DEFAULT:
            # Its stored rules and networks, a lease from this host's pool (the row's
            # host moves with it); the guest takes the new address at its restore.
            self.core.own_network(rec.id)
            await net.attach(rec.id, net.policy_of(rec.id), net.networks_of(rec.id))
        return self.core.get(rec.id)

    def _fetch(self, rec: SandboxRecord, memory: bool) -> None:
        assert self.store is not None
        final = self.core.backend.disk_path(rec.id).parent
        staging = self.core.settings.state_dir / "blob-fetch" / f"{rec.id}-{secrets.token_hex(4)}"
        staging.mkdir(parents=True, mode=0o700)
        started = time.monotonic()
        try:
            fetch_dir(
                self.store,
                pause_prefix(rec),
                staging,
                final,
                owner=rec.id,
                images_dir=self.core.settings.images_dir,
                memory=memory,
                image=rec.image,
                images=self.base_images,
            )
            # The sandbox's own disk and config are written from here on; the layers
            # under it (templates, forks) stay read-only.
            os.chmod(staging / DISK, 0o600)
            os.chmod(staging / VM_JSON, 0o600)
            pause = staging / "pause"
            if memory:
                pause.mkdir(mode=0o700)
                for f in list(staging.iterdir()):
                    if (
                        f.is_file()
                        and f.name not in (DISK, VM_JSON)
                        and not f.name.startswith("layer-")
                    ):
                        os.chmod(f, 0o600)
                        os.rename(f, pause / f.name)
            if final.exists():
                shutil.rmtree(final)  # a leftover of an earlier stay on this host
            final.parent.mkdir(parents=True, exist_ok=True)
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        log.info(
            "sandbox %s: pause fetched from %s in %.1f s",
            rec.id,
            self.store.url,
            time.monotonic() - started,
        )

    # -- the host it left ------------------------------------------------------------------

    def _elsewhere(self, sandbox_id: str) -> bool:
        """A sandbox whose row names another host (live there, or ended there since)."""
        return self.hosts.host_of(sandbox_id) not in (None, self.core.host_id)

    async def drop_moved(self) -> list[str]:
        """Drop what this host keeps of sandboxes that now live on another host (a
        cross-host resume took them): files, tap and nft entry; the shared rows stay
        (they are the new host's now). The ids dropped."""
        if self.store is None:
            return []
        dropped: list[str] = []
        candidates = self.core.held_ids() - self.hosts.ids_on(self.core.host_id)
        for sandbox_id in sorted(candidates):
            if sandbox_id in self.core.runtimes or self.core.lock(sandbox_id).locked():
                continue  # running, or an arrival or resume under way: a later round
            if not self._elsewhere(sandbox_id):
                continue
            async with self.core.lock(sandbox_id):
                if not self._elsewhere(sandbox_id):  # checked again: an arrival is locked
                    continue
                await self.core.moved_away(sandbox_id)
            host = self.hosts.host_of(sandbox_id)
            dropped.append(sandbox_id)
            log.info("sandbox %s moved to host %s: its files here are removed", sandbox_id, host)
        return dropped
