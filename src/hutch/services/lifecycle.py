"""Pause, resume, fork and named snapshots of sandboxes; mixed into
:class:`hutch.services.sandboxes.SandboxService` (which owns the state used here).

Pause, snapshot and fork first quiesce the sandbox (:mod:`hutch.services.activity`):
new calls wait, and calls in flight are waited for up to ``Settings.lifecycle_wait_s``
(then :class:`~hutch.errors.Busy`), so none is cut. Resume needs no quiescing (a paused
sandbox has nothing in flight); delete cuts what runs, and the cut calls say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from hutch.config import Settings
from hutch.crashpoints import crash_point
from hutch.errors import Busy, HutchError, InvalidArgument, NotFound, StateError
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
from hutch.runtime.backend import Runtime, VmBackend
from hutch.services.activity import Activity
from hutch.services.state import SandboxStates, require
from hutch.store import Store

if TYPE_CHECKING:
    from hutch.services.network import NetworkService as NetworkManager

__all__ = ["FORK_PARALLELISM", "LifecycleMixin"]

log = logging.getLogger("hutch.services.sandboxes")

#: Clones restored at once during a fork (each reads the snapshot and boots a QEMU).
FORK_PARALLELISM = 4


class LifecycleMixin:
    settings: Settings
    store: Store
    states: SandboxStates
    backend: VmBackend
    activity: Activity
    net: NetworkManager | None
    clock: Callable[[], float]
    _runtimes: dict[str, Runtime]
    _create_gate: asyncio.Lock

    if TYPE_CHECKING:

        def get(self, sandbox_id: str) -> SandboxRecord: ...

        def _lock(self, sandbox_id: str) -> asyncio.Lock: ...

        def _attach(self, sandbox_id: str, runtime: Runtime) -> None: ...

        def _stop_watching(self, sandbox_id: str) -> None: ...

        def _finish(
            self, sandbox_id: str, state: SandboxState, error: str | None = None
        ) -> None: ...

        def _check_capacity(self, memory_mib: int, extra_sandboxes: int) -> None: ...

        async def _release_network(self, sandbox_id: str) -> None: ...

        async def _run_image_start(self, rec: SandboxRecord, runtime: Runtime) -> None: ...

        def _collect_snapshots(self) -> None: ...

    # -- pause / resume / fork ---------------------------------------------------------

    def _quiesced(
        self, sandbox_id: str, action: str, wait_s: float | None = None
    ) -> contextlib.AbstractAsyncContextManager[None]:
        wait = self.settings.lifecycle_wait_s if wait_s is None else wait_s
        return self.activity.inflight.quiesce(sandbox_id, action, wait)

    async def pause(
        self,
        sandbox_id: str,
        mode: PauseMode = PauseMode.MEMORY,
        *,
        only_if: Callable[[SandboxRecord], bool] | None = None,
    ) -> SandboxRecord:
        """Pause once the calls in flight are over (Busy if they outlast the wait).

        ``only_if`` (auto-pause): pause only if it holds for the sandbox once quiesced
        and nothing is in flight, without waiting; otherwise leave it running.
        """
        rec = self.get(sandbox_id)
        async with self._lock(sandbox_id):
            try:
                async with self._quiesced(sandbox_id, "pause", 0.0 if only_if else None):
                    rec = self.get(rec.id)
                    if only_if is not None and not (
                        rec.state is SandboxState.RUNNING and only_if(rec)
                    ):
                        return rec
                    return await self._pause_locked(rec, mode)
            except Busy:
                if only_if is None:
                    raise
                return self.get(rec.id)

    async def _pause_locked(self, rec: SandboxRecord, mode: PauseMode) -> SandboxRecord:
        require(rec, SandboxState.RUNNING)
        if rec.id not in self._runtimes:
            raise StateError(f"sandbox {rec.id}", str(rec.state), ["running"])
        runtime = self._runtimes[rec.id]
        self._stop_watching(rec.id)
        # Only open-ended streams are left (terminals, followed output, watches): they
        # end with this message; what they read keeps running in the guest.
        runtime.agent.close_reason = (
            f"sandbox {rec.id} was paused (memory): this stream ended, but what runs in "
            "the guest keeps running; attach or read again after resume"
            if mode is PauseMode.MEMORY
            else f"sandbox {rec.id} was paused (disk): the guest was shut down"
        )
        planned = str(self.backend.pause_dir(rec.id)) if mode is PauseMode.MEMORY else None
        self.states.move(
            rec.id, SandboxState.PAUSING, pause_mode=mode, resume_from=planned, resume_clone=False
        )
        crash_point("pause.row")
        try:
            resume_from = await runtime.pause(mode)
        except BaseException:
            self._attach(rec.id, runtime)
            self.states.move(rec.id, SandboxState.RUNNING, pause_mode=None, resume_from=None)
            raise
        self._runtimes.pop(rec.id, None)
        self.states.move(
            rec.id,
            SandboxState.PAUSED,
            pause_mode=mode,
            paused_at=self.clock(),
            resume_from=resume_from,
            resume_clone=False,
        )
        return self.get(rec.id)

    async def resume(self, sandbox_id: str) -> SandboxRecord:
        rec = self.get(sandbox_id)
        async with self._lock(sandbox_id):
            return await self._resume_locked(self.get(rec.id))

    async def _resume_locked(self, rec: SandboxRecord) -> SandboxRecord:
        if rec.state is SandboxState.RUNNING:
            return rec
        require(rec, SandboxState.PAUSED, SandboxState.RUNNING)
        async with self._create_gate:
            self._check_capacity(rec.shape.memory_mib, extra_sandboxes=0)
            self.states.move(rec.id, SandboxState.RESUMING)
        crash_point("resume.row")
        try:
            runtime = await self.backend.resume(rec, rec.resume_from, clone=rec.resume_clone)
        except BaseException:
            self.states.move(rec.id, SandboxState.PAUSED)
            raise
        self._attach(rec.id, runtime)
        self.states.running_again(rec.id)
        if rec.resume_from is None:  # a disk-mode resume booted again
            try:
                await self._run_image_start(rec, runtime)
            except HutchError as exc:
                log.warning("sandbox %s: the image's start command: %s", rec.id, exc)
        return self.get(rec.id)

    async def fork(self, sandbox_id: str, count: int = 1) -> list[SandboxRecord]:
        """``count`` new sandboxes, each a copy-on-write clone of this one as it is now.

        The parent is left as it was (running, or paused again if it was paused).
        """
        lo, hi = FORK_COUNT_RANGE
        if isinstance(count, bool) or not isinstance(count, int) or not lo <= count <= hi:
            raise InvalidArgument(f"count={count!r} is out of range; accepted: {lo}-{hi}")
        async with self._running_as_it_was(sandbox_id, "fork") as parent:
            return await self._fork_locked(parent, count)

    @contextlib.asynccontextmanager
    async def _running_as_it_was(
        self, sandbox_id: str, action: str
    ) -> AsyncIterator[SandboxRecord]:
        """Hold the sandbox's lock with it running and quiesced (nothing in flight, new
        calls waiting); a paused one is resumed for the block and paused again after it,
        so the caller leaves it as it was."""
        self.get(sandbox_id)
        async with self._lock(sandbox_id), self._quiesced(sandbox_id, action):
            rec = require(self.get(sandbox_id), SandboxState.RUNNING, SandboxState.PAUSED)
            was_paused = rec.state is SandboxState.PAUSED
            if was_paused:
                rec = await self._resume_locked(rec)
            try:
                yield rec
            finally:
                if was_paused and self.get(rec.id).state is SandboxState.RUNNING:
                    await self._pause_locked(self.get(rec.id), PauseMode.MEMORY)

    async def _fork_locked(self, parent: SandboxRecord, count: int) -> list[SandboxRecord]:
        async with self._create_gate:
            self._check_capacity(parent.shape.memory_mib * count, extra_sandboxes=count)
            children = []
            for _ in range(count):
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
                self.states.insert(child)
                children.append(child)
        crash_point("fork.rows")
        snapshot_dir = self.backend.fork_dir("fork-" + secrets.token_hex(6))
        try:
            await self._freeze_parent(parent, snapshot_dir)
        except BaseException as exc:
            for child in children:
                self._finish(child.id, SandboxState.FAILED, f"fork failed: {exc}")
            raise
        crash_point("fork.parent")
        gate = asyncio.Semaphore(FORK_PARALLELISM)

        async def start(child: SandboxRecord) -> SandboxRecord | BaseException:
            async with gate, self._lock(child.id):
                current = self.states.current(child.id)
                if current is not None and current.state is not SandboxState.CREATING:
                    return current  # deleted before its turn came: as the delete left it
                try:
                    if self.net is not None and child.network is NetworkMode.DEFAULT:
                        # Same rules and networks as the parent; its own address and name.
                        await self.net.attach(
                            child.id,
                            self.net.policy_of(parent.id),
                            self.net.networks_of(parent.id),
                        )
                    runtime = await self.backend.start_clone(child, snapshot_dir)
                except BaseException as exc:
                    await self.backend.cleanup(child.id)
                    await self._release_network(child.id)
                    self._finish(child.id, SandboxState.FAILED, str(exc))
                    return exc
                self._attach(child.id, runtime)
                return self.states.running(child)

        results = await asyncio.gather(*(start(c) for c in children))
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise failures[0]
        return [r for r in results if isinstance(r, SandboxRecord)]

    async def _freeze_parent(self, parent: SandboxRecord, snapshot_dir: Path) -> None:
        """Save the running ``parent`` into ``snapshot_dir`` and bring it back as a clone
        of it. On failure the parent is running (or, if it cannot come back, paused on
        the snapshot) and the error is raised."""
        runtime = self._runtimes[parent.id]
        self._stop_watching(parent.id)
        runtime.agent.close_reason = (
            f"sandbox {parent.id} was frozen for a fork or snapshot: this stream ended, but "
            "what runs in the guest keeps running; attach or read again"
        )
        self.states.move(
            parent.id,
            SandboxState.PAUSING,
            pause_mode=PauseMode.MEMORY,
            resume_from=str(snapshot_dir),
            resume_clone=True,
        )
        try:
            await runtime.freeze(snapshot_dir)
        except BaseException:
            self._attach(parent.id, runtime)
            self.states.running_again(parent.id)
            raise
        self._runtimes.pop(parent.id, None)
        self.states.move(parent.id, SandboxState.RESUMING)
        try:
            self._attach(parent.id, await self.backend.start_clone(parent, snapshot_dir))
        except BaseException:
            self.states.move(parent.id, SandboxState.PAUSED)
            raise
        self.states.running_again(parent.id)

    # -- named snapshots ----------------------------------------------------------------

    async def snapshot(self, sandbox_id: str, name: str) -> SnapshotRecord:
        """Save the sandbox's memory, devices and disk under ``name``. The sandbox is
        paused for the moment of the save and then runs on (or stays paused).

        The snapshot's row is written (not ready: unlisted) before any of its files, so
        a daemon killed during the save finds it and finishes or drops it.
        """
        validate_name(name)
        async with self._running_as_it_was(sandbox_id, "snapshot") as parent:
            snap_id = new_snapshot_id()
            snapshot_dir = self.backend.fork_dir(snap_id)
            snap = SnapshotRecord(
                id=snap_id,
                name=name,
                sandbox_id=parent.id,
                image=parent.image,
                shape=parent.shape,
                path=str(snapshot_dir),
                size_bytes=0,
                created_at=time.time(),
            )
            self.store.insert_snapshot(snap, ready=False)
            crash_point("snapshot.row")
            try:
                await self._freeze_parent(parent, snapshot_dir)
            except BaseException:
                # Its files, if any, go with collection (unless the parent is paused on them).
                self.store.delete_snapshot(snap_id)
                raise
            crash_point("snapshot.frozen")
            snap = replace(
                snap, size_bytes=await asyncio.to_thread(self.backend.snapshots.size, snapshot_dir)
            )
            self.store.finish_snapshot(snap_id, snap.size_bytes)
        return snap

    def get_snapshot(self, snapshot_id: str) -> SnapshotRecord:
        snap = self.store.get_snapshot(snapshot_id) if SNAPSHOT_ID_RE.match(snapshot_id) else None
        if snap is None:
            raise NotFound(f"no snapshot {snapshot_id!r}; ids look like snap-0123456789ab")
        return snap

    def list_snapshots(self) -> list[SnapshotRecord]:
        return self.store.list_snapshots()

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete the snapshot, in any order with the sandboxes and snapshots built on
        it: it is no longer listed nor restorable at once; its files go now, or, while
        another disk is built on its disk, when the last of those goes."""
        self.get_snapshot(snapshot_id)
        self.store.delete_snapshot(snapshot_id)
        self._collect_snapshots()
