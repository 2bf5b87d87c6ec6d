"""A warm pool: sandboxes restored from an image's template ahead of time, so that a
create at the default shape only has to hand one out.

Pooled VMs have no database row until they are handed out (a daemon restart therefore
cleans them like any leftover and refills). They hold memory while they wait, so the
pool is small and off by default (``HUTCH_POOL_SIZE``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from hutch.images.build import ImageArtifacts
from hutch.models import NetworkMode, SandboxRecord, SandboxState, Shape, new_sandbox_id
from hutch.runtime.backend import Runtime, VmBackend

log = logging.getLogger(__name__)

PoolKey = tuple[str, str]  # image name, image digest


class WarmPool:
    #: Only creates at this shape are served from the pool.
    SHAPE = Shape()

    def __init__(
        self,
        backend: VmBackend,
        size: int,
        prepare: Callable[[SandboxRecord], Awaitable[None]] | None = None,
        release: Callable[[str], Awaitable[None]] | None = None,
        network: NetworkMode = NetworkMode.DEFAULT,
    ) -> None:
        """``prepare`` runs before a pooled VM starts (its network), ``release`` after
        one is discarded; pooled VMs have ``network`` (only creates asking for it get one)."""
        self.backend = backend
        self.network = network
        self.size = size
        self._prepare = prepare
        self._release = release
        self._ready: dict[PoolKey, list[tuple[str, Runtime]]] = {}
        self._refills: dict[PoolKey, asyncio.Task[None]] = {}

    def take(self, image: ImageArtifacts, shape: Shape) -> tuple[str, Runtime] | None:
        """A ready sandbox (its id and runtime), or None."""
        if self.size <= 0 or shape != self.SHAPE:
            return None
        ready = self._ready.get((image.name, image.digest), [])
        while ready:
            sandbox_id, runtime = ready.pop(0)
            if not runtime.agent.closed:
                return sandbox_id, runtime
        return None

    def give_back(self, image: ImageArtifacts, item: tuple[str, Runtime]) -> None:
        self._ready.setdefault((image.name, image.digest), []).insert(0, item)

    def refill(self, image: ImageArtifacts) -> None:
        """Top the pool for ``image`` up in the background (once its template exists)."""
        key = (image.name, image.digest)
        if self.size <= 0 or (key in self._refills and not self._refills[key].done()):
            return
        self._refills[key] = asyncio.create_task(self._fill(image), name=f"hutch-pool-{key}")

    async def _fill(self, image: ImageArtifacts) -> None:
        key = (image.name, image.digest)
        ready = self._ready.setdefault(key, [])
        while len(ready) < self.size:
            template = self.backend.templates.find(image, self.SHAPE)
            if template is None:
                return
            stub = SandboxRecord(
                id=new_sandbox_id(), image=image.name, state=SandboxState.CREATING,
                shape=self.SHAPE, created_at=time.time(), image_digest=image.digest,
                network=self.network,
            )  # fmt: skip
            try:
                if self._prepare is not None:
                    await self._prepare(stub)
                runtime = await self.backend.start_clone(stub, template)
            except Exception as exc:
                log.warning("warm pool for %s: %s", image.name, exc)
                await self._discard(stub.id)
                return
            ready.append((stub.id, runtime))
            log.info("warm pool for %s: %d ready", image.name, len(ready))

    async def close(self) -> None:
        """Stop refilling and destroy every pooled VM (they have no rows to adopt)."""
        for task in self._refills.values():
            task.cancel()
        await asyncio.gather(*self._refills.values(), return_exceptions=True)
        for ready in self._ready.values():
            for sandbox_id, runtime in ready:
                with contextlib.suppress(Exception):
                    await runtime.destroy()
                await self._discard(sandbox_id)
        self._ready.clear()

    async def _discard(self, sandbox_id: str) -> None:
        await self.backend.cleanup(sandbox_id)
        if self._release is not None:
            await self._release(sandbox_id)
