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
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from hutch.errors import InvalidArgument
from hutch.images.build import ImageArtifacts
from hutch.models import NetworkMode, SandboxRecord, SandboxState, Shape, new_sandbox_id
from hutch.runtime.backend import Runtime
from hutch.services.registry import SandboxRegistry

log = logging.getLogger(__name__)

PoolKey = tuple[str, str]  # image name, image digest
#: The template a pooled VM of (image, shape) restores from (None: none yet).
TemplateSource = Callable[[ImageArtifacts, Shape], Awaitable[Path | None]]


#: What a pooled VM runs once before it is ready: the path of a first command (the
#: agent's exec: a thread, a fork and exec in the guest, pipes, output read and sent as
#: a DATA frame, the exit). Under TCG a restored QEMU starts with an empty translation
#: cache, so the first command in a fresh clone pays for translating that path; the
#: warm-up pays it before the hand-out. It writes output because most first commands do
#: (with ``true`` the first ``echo`` after a hand-out still took about twice a steady one).
WARM_UP = ["echo", "hi"]

#: Seconds a hand-out waits before the pool refills: the refill (a restore: QEMU start,
#: state load, agent hello, warm-up) would otherwise run on the daemon's event loop and
#: the host's CPUs beside the first command of the sandbox just handed out.
REFILL_DELAY_S = 0.5


class WarmPool:
    #: Only creates at this shape are served from the pool.
    SHAPE = Shape()

    def __init__(
        self,
        core: SandboxRegistry,
        size: int,
        prepare: Callable[[SandboxRecord], Awaitable[None]] | None = None,
        network: NetworkMode = NetworkMode.DEFAULT,
        templates: TemplateSource | None = None,
    ) -> None:
        """``prepare`` runs before a pooled VM starts (its network); pooled VMs have
        ``network`` (only creates asking for it get one). A pooled VM's resources are
        registered on its teardown stack in ``core`` as they are made, so a create
        that takes it goes on with that stack, and one discarded closes it.
        ``templates``: where a pooled VM's template comes from (the daemon's: this
        host's, or fetched from the blob store; None: this host's only)."""
        self.core = core
        self.backend = core.backend
        self.network = network
        self.size = size
        self._prepare = prepare
        self._templates: TemplateSource = templates or self._own_template
        self._ready: dict[PoolKey, list[tuple[str, Runtime]]] = {}
        self._refills: dict[PoolKey, asyncio.Task[None]] = {}
        self._discards: set[asyncio.Task[None]] = set()
        #: Images whose pool is held off (:meth:`held_off`): no refill starts.
        self._held: set[PoolKey] = set()

    def take(self, image: ImageArtifacts, shape: Shape) -> tuple[str, Runtime] | None:
        """A ready sandbox (its id and runtime), or None."""
        if self.size <= 0 or shape != self.SHAPE:
            return None
        ready = self._ready.get((image.name, image.digest), [])
        while ready:
            sandbox_id, runtime = ready.pop(0)
            if not runtime.agent.closed:
                return sandbox_id, runtime
            # Its VM died while it waited: everything of it goes (in the background).
            task = asyncio.create_task(self._discard(sandbox_id), name=f"hutch-pool-{sandbox_id}")
            self._discards.add(task)
            task.add_done_callback(self._discards.discard)
        return None

    def give_back(self, image: ImageArtifacts, item: tuple[str, Runtime]) -> None:
        self._ready.setdefault((image.name, image.digest), []).insert(0, item)

    def refill(self, image: ImageArtifacts, *, delay_s: float = 0.0) -> None:
        """Top the pool for ``image`` up in the background (once its template exists),
        starting in ``delay_s`` seconds (after a hand-out: :data:`REFILL_DELAY_S`)."""
        key = (image.name, image.digest)
        if self.size <= 0 or key in self._held:
            return
        if key in self._refills and not self._refills[key].done():
            return
        self._refills[key] = asyncio.create_task(
            self._fill(image, delay_s), name=f"hutch-pool-{key}"
        )

    async def _fill(self, image: ImageArtifacts, delay_s: float = 0.0) -> None:
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        key = (image.name, image.digest)
        ready = self._ready.setdefault(key, [])
        while len(ready) < self.size and key not in self._held:
            template = await self._templates(image, self.SHAPE)
            if template is None:
                return
            stub = SandboxRecord(
                id=new_sandbox_id(), image=image.name, state=SandboxState.CREATING,
                shape=self.SHAPE, created_at=time.time(), image_digest=image.digest,
                network=self.network,
            )  # fmt: skip
            self.core.own_files(stub.id)
            try:
                if self._prepare is not None:
                    self.core.own_network(stub.id)
                    await self._prepare(stub)
                self.core.own_vm(stub.id)
                runtime = await self.backend.start_clone(stub, template)
                self.core.booted(stub.id, runtime)
                # An image without `true` still ran the path up to the guest's execve.
                with contextlib.suppress(InvalidArgument):
                    await runtime.agent.run(WARM_UP, timeout_s=30)
            except Exception as exc:
                log.warning("warm pool for %s: %s", image.name, exc)
                await self._discard(stub.id)
                return
            ready.append((stub.id, runtime))
            log.info("warm pool for %s: %d ready", image.name, len(ready))

    @contextlib.asynccontextmanager
    async def held_off(self, name: str, digest: str) -> AsyncIterator[None]:
        """No pooled VM of image ``name`` at ``digest`` for the block (its files are
        about to change: a built-in image adopted from the blob store): refills stop
        (the one under way after the clone it is making, never cut mid-clone) and the
        ready VMs are destroyed. After the block the next ``refill`` fills it again."""
        key = (name, digest)
        self._held.add(key)
        try:
            task = self._refills.get(key)
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
            for sandbox_id, _ in self._ready.pop(key, []):
                await self._discard(sandbox_id)
            yield
        finally:
            self._held.discard(key)

    async def _own_template(self, image: ImageArtifacts, shape: Shape) -> Path | None:
        return await asyncio.to_thread(self.backend.templates.find, image, shape)

    async def close(self) -> None:
        """Stop refilling and destroy every pooled VM (they have no rows to adopt)."""
        for task in self._refills.values():
            task.cancel()
        await asyncio.gather(*self._refills.values(), *self._discards, return_exceptions=True)
        for ready in self._ready.values():
            for sandbox_id, _ in ready:
                await self._discard(sandbox_id)
        self._ready.clear()

    async def _discard(self, sandbox_id: str) -> None:
        with contextlib.suppress(Exception):
            await self.core.teardown(sandbox_id, deleted=False)
