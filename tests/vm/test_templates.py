"""Create from a template snapshot: the hot path restores instead of booting, and every
sandbox restored from one template still gets its own identity."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from hutch.images.build import ImageArtifacts
from hutch.models import SandboxSpec, Shape
from hutch.runtime.qemu.backend import QemuBackend
from hutch.services.composed import Services
from tests.conftest import ensure_image
from tests.vm.services import real_service
from tests.vm.test_sandbox_vm import run

pytestmark = [pytest.mark.vm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

SHAPE = Shape(vcpus=1, memory_mib=256, disk_gib=2)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Services]:
    async with real_service(tmp_path_factory.mktemp("tplstate"), pool_size=1) as svc:
        yield svc


async def test_second_create_restores_the_template(service: Services) -> None:
    image = ensure_image("base")
    assert isinstance(image, ImageArtifacts)
    backend = service.backend
    assert isinstance(backend, QemuBackend)
    assert backend.templates.find(image, SHAPE) is None

    start = time.monotonic()
    cold = await service.sandboxes.create(SandboxSpec(image="base", shape=SHAPE))
    cold_s = time.monotonic() - start
    for _ in range(600):  # the template is built in the background
        if backend.templates.find(image, SHAPE):
            break
        await asyncio.sleep(0.2)
    assert backend.templates.find(image, SHAPE), "the template was never built"

    start = time.monotonic()
    warm = [
        await service.sandboxes.create(SandboxSpec(image="base", shape=SHAPE)) for _ in range(2)
    ]
    warm_s = (time.monotonic() - start) / 2
    print(f"cold create {cold_s:.2f} s, create from template {warm_s:.2f} s")

    everyone = [cold.id, *(w.id for w in warm)]
    assert len({await run(service, s, ["hostname"]) for s in everyone}) == 3
    assert len({await run(service, s, ["cat", "/etc/machine-id"]) for s in everyone}) == 3
    rand = "head -c 16 /dev/urandom | od -An -tx1"
    assert len({await run(service, s, rand) for s in everyone}) == 3
    for sid in everyone:
        guest_now = float(await run(service, sid, ["date", "+%s"]))
        assert abs(guest_now - time.time()) < 5
    df = await run(service, warm[0].id, ["df", "--output=size", "-B1M", "/"])
    assert 1700 < int(df.split()[-1]) <= 2048
    await run(service, warm[0].id, ["sh", "-c", "echo a > /root/x"])
    assert "absent" in await run(service, warm[1].id, "cat /root/x 2>/dev/null || echo absent")
    for sid in everyone:
        await service.sandboxes.delete(sid)


async def test_warm_pool_hands_out_ready_sandboxes(service: Services) -> None:
    image = ensure_image("base")
    assert isinstance(image, ImageArtifacts)
    default = Shape()
    first = await service.sandboxes.create(SandboxSpec(image="base"))  # builds the template
    for _ in range(900):
        if service.pool._ready.get((image.name, image.digest)):
            break
        await asyncio.sleep(0.2)
    ready = service.pool._ready.get((image.name, image.digest))
    assert ready, "the pool was never filled"
    pooled_id = ready[0][0]
    start = time.monotonic()
    got = await service.sandboxes.create(SandboxSpec(image="base", name="from-pool"))
    took = time.monotonic() - start
    print(f"create from the warm pool: {took:.3f} s")
    assert got.id == pooled_id and got.shape == default
    assert await run(service, got.id, ["hostname"]) == "from-pool\n"
    assert await run(service, got.id, ["echo", "ok"]) == "ok\n"
    for sid in (first.id, got.id):
        await service.sandboxes.delete(sid)
