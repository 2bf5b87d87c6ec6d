"""Sandbox lifecycle: create, inspect, exec, files, destroy; reconcile after a restart.

State machine (stored in SQLite, the source of truth)::

    creating ──► running ──► stopping ──► destroyed
        │           │
        └───────────┴──► failed   (VM would not boot, or died on its own; cleaned)

Every transition is written before the side effect it announces, so a daemon killed at
any point finds, on restart, a row that tells it what to finish (see ``reconcile``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import replace

from hutch.config import Settings
from hutch.errors import Capacity, Conflict, HutchError, NotFound, StateError
from hutch.guest.client import ExecStream
from hutch.guest.results import FileEntry
from hutch.models import (
    SANDBOX_ID_RE,
    SandboxRecord,
    SandboxSpec,
    SandboxState,
    new_sandbox_id,
    validate_env,
)
from hutch.services.backend import Runtime, VmBackend
from hutch.services.images import ImageSource, ImageView, resolve
from hutch.store import Store
from hutch.store.db import LIVE_STATES

__all__ = ["ExecStream", "FileEntry", "SandboxService"]

log = logging.getLogger(__name__)

REAPER_INTERVAL_S = 1.0


class SandboxService:
    def __init__(
        self, settings: Settings, store: Store, backend: VmBackend, images: ImageSource
    ) -> None:
        self.settings = settings
        self.store = store
        self.backend = backend
        self.image_source = images
        self._runtimes: dict[str, Runtime] = {}
        self._monitors: dict[str, asyncio.Task[None]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._create_gate = asyncio.Lock()
        self._reaper: asyncio.Task[None] | None = None

    # -- daemon lifecycle --------------------------------------------------------------

    async def start(self) -> None:
        await self.reconcile()
        self._reaper = asyncio.create_task(self._reap_expired(), name="hutch-reaper")

    async def close(self) -> None:
        """Stop background work and drop agent connections. VMs keep running."""
        tasks = [t for t in (self._reaper, *self._monitors.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for runtime in list(self._runtimes.values()):
            with contextlib.suppress(Exception):
                await runtime.agent.close()
        self._runtimes.clear()
        self._monitors.clear()

    async def reconcile(self) -> None:
        """Make the database and the host agree after a start or crash.

        Live rows whose VM still runs are adopted; the rest are cleaned and marked
        failed (or destroyed, if a delete was under way). Processes and files on the host
        that no live row owns are removed.
        """
        live = self.store.list_sandboxes(states=LIVE_STATES)
        for rec in live:
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
                log.info("adopted running sandbox %s", rec.id)
                continue
            await self.backend.cleanup(rec.id)
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
        image = resolve(self.image_source, spec.image)
        async with self._create_gate:
            # Capacity is checked and the row inserted under one lock so that concurrent
            # creates cannot overshoot the limits together.
            count, memory = self.store.live_usage()
            limits = self.settings.limits
            if count >= limits.max_sandboxes:
                raise Capacity(
                    f"this host runs {count} sandboxes, the limit (HUTCH_MAX_SANDBOXES); "
                    "delete some or raise the limit"
                )
            if memory + spec.shape.memory_mib > limits.memory_budget_mib:
                raise Capacity(
                    f"not enough memory: {memory} MiB reserved + {spec.shape.memory_mib} MiB "
                    f"asked > {limits.memory_budget_mib} MiB (HUTCH_MAX_MEMORY_MIB)"
                )
            rec = SandboxRecord(
                id=new_sandbox_id(),
                image=spec.image,
                image_digest=image.digest,
                state=SandboxState.CREATING,
                shape=spec.shape,
                created_at=time.time(),
                name=spec.name,
                env=dict(spec.env),
                metadata=dict(spec.metadata),
                timeout_s=spec.timeout_s,
            )
            self.store.insert_sandbox(rec)
        async with self._lock(rec.id):
            try:
                runtime = await self.backend.start(rec, image)
            except BaseException as exc:
                await self.backend.cleanup(rec.id)
                reason = str(exc) if isinstance(exc, HutchError) else repr(exc)
                self._finish(rec.id, SandboxState.FAILED, reason)
                raise
            current = self.store.get_sandbox(rec.id)
            if current is None or current.state is not SandboxState.CREATING:
                # Deleted while booting.
                await runtime.destroy()
                await self.backend.cleanup(rec.id)
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

    async def _teardown(self, sandbox_id: str) -> None:
        monitor = self._monitors.pop(sandbox_id, None)
        if monitor is not None and monitor is not asyncio.current_task():
            monitor.cancel()
        runtime = self._runtimes.pop(sandbox_id, None)
        if runtime is not None:
            await runtime.destroy()
        await self.backend.cleanup(sandbox_id)

    # -- guest operations --------------------------------------------------------------

    def runtime(self, sandbox_id: str) -> Runtime:
        rec = self.get(sandbox_id)
        runtime = self._runtimes.get(sandbox_id)
        if rec.state is not SandboxState.RUNNING or runtime is None:
            raise StateError(f"sandbox {sandbox_id}", str(rec.state), ["running"])
        return runtime

    async def exec(
        self,
        sandbox_id: str,
        cmd: list[str] | str,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: bytes | None = None,
        timeout_s: float | None = None,
    ) -> ExecStream:
        rec = self.get(sandbox_id)
        runtime = self.runtime(sandbox_id)
        merged_env = {**rec.env, **validate_env(env or {})}
        if isinstance(cmd, str):
            return await runtime.agent.exec(
                shell=cmd, env=merged_env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s
            )
        return await runtime.agent.exec(
            cmd, env=merged_env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s
        )

    def read_file(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        return self.runtime(sandbox_id).agent.read_file(path)

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes | AsyncIterable[bytes], mode: int = 0o644
    ) -> FileEntry:
        return await self.runtime(sandbox_id).agent.write_file(path, data, mode=mode)

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileEntry]:
        return await self.runtime(sandbox_id).agent.list_dir(path)

    async def stat(self, sandbox_id: str, path: str) -> FileEntry:
        return await self.runtime(sandbox_id).agent.stat(path)

    async def mkdir(self, sandbox_id: str, path: str) -> FileEntry:
        return await self.runtime(sandbox_id).agent.mkdir(path)

    async def remove(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        await self.runtime(sandbox_id).agent.remove(path, recursive=recursive)

    async def rename(self, sandbox_id: str, source: str, destination: str) -> FileEntry:
        return await self.runtime(sandbox_id).agent.rename(source, destination)

    # -- internals ---------------------------------------------------------------------

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
            self._finish(sandbox_id, SandboxState.FAILED, "the VM stopped unexpectedly")

    async def _reap_expired(self) -> None:
        while True:
            await asyncio.sleep(REAPER_INTERVAL_S)
            now = time.time()
            for rec in self.store.list_sandboxes(states=[SandboxState.RUNNING]):
                if rec.expires_at is not None and rec.expires_at <= now:
                    log.info("sandbox %s reached its timeout_s=%s; deleting", rec.id, rec.timeout_s)
                    try:
                        await self.delete(rec.id)
                    except HutchError as exc:
                        log.error("could not delete expired sandbox %s: %s", rec.id, exc)
