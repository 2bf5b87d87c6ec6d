"""The warm pool's own rules (services/pool.py), with fakes for what it drives: each
pooled VM runs the warm-up command before it can be handed out, an image without that
command still fills the pool, and a refill after a hand-out waits before it starts.
The real pool is proven in tests/vm/test_templates.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from hutch.errors import InvalidArgument
from hutch.images.build import ImageArtifacts
from hutch.services.pool import WARM_UP, WarmPool

IMAGE = ImageArtifacts(
    name="base",
    digest="0" * 16,
    kernel=Path("/k"),
    initrd=Path("/i"),
    rootfs=Path("/r"),
    kernel_release="6.1",
    cmdline="",
    size_bytes=1,
)


class FakeAgent:
    def __init__(self, missing: bool) -> None:
        self.closed = False
        self.ran: list[list[str]] = []
        self.missing = missing

    async def run(self, argv: list[str], **_: Any) -> None:
        self.ran.append(argv)
        if self.missing:
            raise InvalidArgument(f"command not found: {argv[0]}")


class FakeRuntime:
    def __init__(self, missing: bool) -> None:
        self.agent = FakeAgent(missing)


class FakeTemplates:
    def find(self, image: ImageArtifacts, shape: object) -> Path:
        return Path("/tpl")


class FakeBackend:
    def __init__(self, missing: bool = False) -> None:
        self.templates = FakeTemplates()
        self.clones: list[FakeRuntime] = []
        self.missing = missing

    async def start_clone(self, rec: object, template: Path) -> FakeRuntime:
        runtime = FakeRuntime(self.missing)
        self.clones.append(runtime)
        return runtime


class FakeCore:
    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend
        self.booted_order: list[str] = []

    def own_files(self, sandbox_id: str) -> None: ...
    def own_network(self, sandbox_id: str) -> None: ...
    def own_vm(self, sandbox_id: str) -> None: ...

    def booted(self, sandbox_id: str, runtime: object) -> None:
        self.booted_order.append(sandbox_id)

    async def teardown(self, sandbox_id: str, deleted: bool = True) -> None: ...


def _pool(backend: FakeBackend) -> WarmPool:
    return WarmPool(FakeCore(backend), 2)  # type: ignore[arg-type]


async def test_each_pooled_vm_is_warmed_up_before_it_is_ready() -> None:
    backend = FakeBackend()
    pool = _pool(backend)
    pool.refill(IMAGE)
    await pool._refills[(IMAGE.name, IMAGE.digest)]
    assert len(backend.clones) == 2
    assert all(r.agent.ran == [WARM_UP] for r in backend.clones)
    taken = pool.take(IMAGE, WarmPool.SHAPE)
    assert taken is not None and taken[1] is backend.clones[0]  # type: ignore[comparison-overlap]


async def test_an_image_without_the_warm_up_command_still_fills_the_pool() -> None:
    backend = FakeBackend(missing=True)
    pool = _pool(backend)
    pool.refill(IMAGE)
    await pool._refills[(IMAGE.name, IMAGE.digest)]
    assert pool.take(IMAGE, WarmPool.SHAPE) is not None


async def test_a_delayed_refill_starts_nothing_before_its_delay() -> None:
    backend = FakeBackend()
    pool = _pool(backend)
    pool.refill(IMAGE, delay_s=3600)
    task = pool._refills[(IMAGE.name, IMAGE.digest)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert backend.clones == [] and not task.done()
    await pool.close()
    assert task.cancelled()


async def test_a_held_off_pool_destroys_its_ready_vms_and_refills_only_after() -> None:
    """An adoption of the image's bytes (services/builtin_blobs.py): no pooled VM of
    it may live on, and none may start, while its files change."""
    backend = FakeBackend()
    core = FakeCore(backend)
    torn: list[str] = []

    async def teardown(sandbox_id: str, deleted: bool = True) -> None:
        torn.append(sandbox_id)

    core.teardown = teardown  # type: ignore[method-assign]
    pool = WarmPool(core, 2)  # type: ignore[arg-type]
    pool.refill(IMAGE)
    await pool._refills[(IMAGE.name, IMAGE.digest)]
    assert len(backend.clones) == 2
    async with pool.held_off(IMAGE.name, IMAGE.digest):
        assert len(torn) == 2 and pool.take(IMAGE, WarmPool.SHAPE) is None
        pool.refill(IMAGE)  # e.g. a create's hand-out: nothing starts
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(backend.clones) == 2
    pool.refill(IMAGE)
    await pool._refills[(IMAGE.name, IMAGE.digest)]
    assert len(backend.clones) == 4 and pool.take(IMAGE, WarmPool.SHAPE) is not None
