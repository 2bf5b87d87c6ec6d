"""Lifecycle policies: ``timeout_s``, ``auto_pause_s`` and ``auto_delete_s``, set here and
applied by the reaper (:class:`Reaper`) once a second."""

from __future__ import annotations

import asyncio
import logging
import time

from hutch.contract.names import check_range
from hutch.errors import HutchError, StateError
from hutch.models import (
    AUTO_PAUSE_S_RANGE,
    TIMEOUT_S_RANGE,
    PauseMode,
    SandboxRecord,
    SandboxState,
)
from hutch.services.events import because
from hutch.services.lifecycle import LifecycleService
from hutch.services.registry import SandboxRegistry
from hutch.services.sandboxes import SandboxService

__all__ = ["REAPER_INTERVAL_S", "Reaper"]

log = logging.getLogger("hutch.services.sandboxes")

REAPER_INTERVAL_S = 1.0
#: Seconds between two passes of the event log's retention.
EVENTS_PRUNE_EVERY_S = 60.0


class Reaper:
    """The policies of each sandbox, and the task that applies them (``start``)."""

    def __init__(
        self, core: SandboxRegistry, sandboxes: SandboxService, lifecycle: LifecycleService
    ) -> None:
        self.core = core
        self.sandboxes = sandboxes
        self.lifecycle = lifecycle
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._reap_expired(), name="hutch-reaper")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def _live(self, sandbox_id: str) -> SandboxRecord:
        rec = self.core.get(sandbox_id)
        if not rec.state.is_live or rec.state is SandboxState.STOPPING:
            raise StateError(f"sandbox {sandbox_id}", str(rec.state), ["running", "paused"])
        return rec

    def set_timeout(self, sandbox_id: str, timeout_s: int | None) -> SandboxRecord:
        """Delete the sandbox ``timeout_s`` seconds from now (None: no deadline). The
        deadline is checked while it runs; a paused sandbox keeps it for after resume."""
        self._live(sandbox_id)
        if timeout_s is not None:
            check_range("timeout_s", timeout_s, TIMEOUT_S_RANGE, " seconds")
        expires = None if timeout_s is None else self.core.clock() + timeout_s
        self.core.store.update_sandbox(sandbox_id, timeout_s=timeout_s, expires_at=expires)
        return self.core.get(sandbox_id)

    def set_auto_pause(self, sandbox_id: str, auto_pause_s: int | None) -> SandboxRecord:
        """Pause the sandbox (memory) once idle for ``auto_pause_s`` (None: never)."""
        self._live(sandbox_id)
        if auto_pause_s is not None:
            check_range("auto_pause_s", auto_pause_s, AUTO_PAUSE_S_RANGE, " seconds")
        self.core.store.update_sandbox(sandbox_id, auto_pause_s=auto_pause_s)
        return self.core.get(sandbox_id)

    async def _auto_pause(self, sandbox_id: str) -> None:
        """Pause an idle sandbox, checking again once it is quiesced: a call that started
        since the check above (or waits at the gate) keeps it running."""

        def still_idle(rec: SandboxRecord) -> bool:
            return bool(rec.auto_pause_s) and self.core.activity.idle_for(
                rec, self.core.clock()
            ) >= (rec.auto_pause_s or 0)

        rec = await self.lifecycle.pause(sandbox_id, PauseMode.MEMORY, only_if=still_idle)
        if rec.state is SandboxState.PAUSED:
            log.info("sandbox %s idle for %ss; paused", sandbox_id, rec.auto_pause_s)

    async def _reap_expired(self) -> None:
        beat = prune = 0.0
        while True:
            await asyncio.sleep(REAPER_INTERVAL_S)
            await self.apply_policies()
            now = time.monotonic()
            try:
                if now - beat >= self.core.settings.meter.heartbeat_s:
                    beat = now
                    self.core.heartbeat()
                if now - prune >= EVENTS_PRUNE_EVERY_S:
                    prune = now
                    self.core.events.prune()
            except HutchError as exc:
                log.error("meter heartbeat or event retention failed: %s", exc)

    async def apply_policies(self) -> None:
        """timeout_s, auto_pause_s and auto_delete_s: one pass (the reaper runs it every
        second)."""
        now = self.core.clock()
        for rec in self.core.own_rows([SandboxState.RUNNING]):
            try:
                if rec.expires_at is not None and rec.expires_at <= now:
                    log.info("sandbox %s reached timeout_s=%s; deleting", rec.id, rec.timeout_s)
                    with because("timeout"):
                        await self.sandboxes.delete(rec.id)
                elif rec.auto_pause_s and self.core.activity.idle_for(rec, now) >= rec.auto_pause_s:
                    with because("idle"):
                        await self._auto_pause(rec.id)
            except HutchError as exc:
                log.error("lifecycle policy on sandbox %s failed: %s", rec.id, exc)
        for rec in self.core.own_rows([SandboxState.PAUSED]):
            if rec.auto_delete_s and rec.paused_at and now - rec.paused_at >= rec.auto_delete_s:
                log.info("sandbox %s paused for %ss; deleting", rec.id, rec.auto_delete_s)
                try:
                    with because("auto_delete"):
                        await self.sandboxes.delete(rec.id)
                except HutchError as exc:
                    log.error("could not delete sandbox %s: %s", rec.id, exc)
