"""Pause and resume of sandboxes (:class:`LifecycleService`).

Pause (and snapshot and fork, :mod:`hutch.services.snapshots`) first quiesce the sandbox
(:mod:`hutch.services.activity`): new calls wait, and calls in flight are waited for up
to ``Settings.lifecycle_wait_s`` (then :class:`~hutch.errors.Busy`), so none is cut.
Resume needs no quiescing (a paused sandbox has nothing in flight); delete cuts what
runs, and the cut calls say so.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from hutch.crashpoints import crash_point
from hutch.errors import Busy, HutchError, StateError
from hutch.models import PauseMode, SandboxRecord, SandboxState
from hutch.services.moves import SandboxMoves
from hutch.services.registry import SandboxRegistry
from hutch.services.state import require
from hutch.services.volumes import mount_all

__all__ = ["LifecycleService"]

log = logging.getLogger("hutch.services.sandboxes")


class LifecycleService:
    def __init__(self, core: SandboxRegistry, moves: SandboxMoves | None = None) -> None:
        self.core = core
        #: Pauses uploaded to the blob store and resumed on other hosts (none: a
        #: disabled one, pauses stay on their host).
        self.moves = moves if moves is not None else SandboxMoves(core, None)

    def quiesced(
        self, sandbox_id: str, action: str, wait_s: float | None = None
    ) -> contextlib.AbstractAsyncContextManager[None]:
        wait = self.core.settings.lifecycle_wait_s if wait_s is None else wait_s
        return self.core.activity.inflight.quiesce(sandbox_id, action, wait)

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
        rec = self.core.get(sandbox_id)
        async with self.core.lock(sandbox_id):
            if only_if is None:
                with self.core.metrics.timed("pause"):
                    async with self.quiesced(sandbox_id, "pause"):
                        return await self.pause_locked(self.core.get(rec.id), mode)
            try:
                async with self.quiesced(sandbox_id, "pause", 0.0):
                    rec = self.core.get(rec.id)
                    if not (rec.state is SandboxState.RUNNING and only_if(rec)):
                        return rec
                    return await self.pause_locked(rec, mode)
            except Busy:
                return self.core.get(rec.id)

    async def pause_locked(self, rec: SandboxRecord, mode: PauseMode) -> SandboxRecord:
        require(rec, SandboxState.RUNNING)
        if rec.id not in self.core.runtimes:
            raise StateError(f"sandbox {rec.id}", str(rec.state), ["running"])
        runtime = self.core.runtimes[rec.id]
        self.core.stop_watching(rec.id)
        # Only open-ended streams are left (terminals, followed output, watches): they
        # end with this message; what they read keeps running in the guest.
        runtime.agent.close_reason = (
            f"sandbox {rec.id} was paused (memory): this stream ended, but what runs in "
            "the guest keeps running; attach or read again after resume"
            if mode is PauseMode.MEMORY
            else f"sandbox {rec.id} was paused (disk): the guest was shut down"
        )
        planned = str(self.core.backend.pause_dir(rec.id)) if mode is PauseMode.MEMORY else None
        self.core.states.move(
            rec.id, SandboxState.PAUSING, pause_mode=mode, resume_from=planned, resume_clone=False
        )
        crash_point("pause.row")
        try:
            resume_from = await runtime.pause(mode)
        except BaseException:
            self.core.attach(rec.id, runtime)
            self.core.states.move(rec.id, SandboxState.RUNNING, pause_mode=None, resume_from=None)
            raise
        self.core.runtimes.pop(rec.id, None)
        self.core.states.move(
            rec.id,
            SandboxState.PAUSED,
            pause_mode=mode,
            paused_at=self.core.clock(),
            resume_from=resume_from,
            resume_clone=False,
        )
        paused = self.core.get(rec.id)
        self.moves.paused(paused)  # another host may resume it once this upload is done
        return paused

    async def resume(self, sandbox_id: str) -> SandboxRecord:
        rec = self.core.get(sandbox_id)
        async with self.core.lock(sandbox_id):
            with self.core.metrics.timed("resume"):
                return await self.resume_locked(self.core.get(rec.id))

    async def resume_locked(self, rec: SandboxRecord) -> SandboxRecord:
        if rec.state is SandboxState.RUNNING:
            return rec
        require(rec, SandboxState.PAUSED, SandboxState.RUNNING)
        if self.moves.here(rec):
            # Its files are here: resumed as on one host, nothing fetched. An upload of
            # its pause still under way stops first (the disk changes from now on).
            await self.moves.stop_upload(rec.id)
        else:
            # Paused on another host (down, draining, or the router placed it here).
            self._check_room(rec)
            rec = await self.moves.arrive(rec)
        async with self.core.create_gate:
            self.core.check_capacity(
                rec.shape.memory_mib,
                extra_sandboxes=0,
                project=rec.project,
                vcpus=rec.shape.vcpus,
            )
            self.core.states.move(rec.id, SandboxState.RESUMING)
        crash_point("resume.row")
        try:
            self.core.own_vm(rec.id)
            runtime = await self.core.backend.resume(rec, rec.resume_from, clone=rec.resume_clone)
        except BaseException:
            self.core.states.move(rec.id, SandboxState.PAUSED)
            raise
        self.core.attach(rec.id, runtime)
        self.core.states.running_again(rec.id)
        self.moves.forget_soon(rec.id, rec)  # that pause's blobs: never restored again
        if rec.resume_from is None:  # a disk-mode resume booted again
            # Its volumes are attached (vm.json) but the new guest has them unmounted.
            await mount_all(self.core, rec.id, runtime)
            try:
                await self.core.run_image_start(rec, runtime)
            except HutchError as exc:
                log.warning("sandbox %s: the image's start command: %s", rec.id, exc)
        return self.core.get(rec.id)

    def _check_room(self, rec: SandboxRecord) -> None:
        """Refused before anything is fetched when this host has no room for it."""
        # Its project's quotas count it already, wherever it is.
        self.core.check_capacity(rec.shape.memory_mib, extra_sandboxes=1)

    @contextlib.asynccontextmanager
    async def running_as_it_was(self, sandbox_id: str, action: str) -> AsyncIterator[SandboxRecord]:
        """Hold the sandbox's lock with it running and quiesced (nothing in flight, new
        calls waiting); a paused one is resumed for the block and paused again after it,
        so the caller leaves it as it was."""
        self.core.get(sandbox_id)
        async with self.core.lock(sandbox_id), self.quiesced(sandbox_id, action):
            rec = require(self.core.get(sandbox_id), SandboxState.RUNNING, SandboxState.PAUSED)
            was_paused = rec.state is SandboxState.PAUSED
            if was_paused:
                rec = await self.resume_locked(rec)
            try:
                yield rec
            finally:
                if was_paused and self.core.get(rec.id).state is SandboxState.RUNNING:
                    await self.pause_locked(self.core.get(rec.id), PauseMode.MEMORY)
