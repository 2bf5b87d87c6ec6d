"""Create from a template snapshot: the hot path restores instead of booting, and every
sandbox restored from one template still gets its own identity."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from hutch.images.build import ImageArtifacts
from hutch.models import PauseMode, SandboxSpec, Shape
from hutch.runtime.qemu.backend import QemuBackend
from hutch.runtime.qemu.boot import identity_of
from hutch.services.composed import Services
from hutch.vm.disk_chain import qcow2_backing_file
from hutch.vm.snapshot import MEMORY_FILE
from hutch.vm.snapshot_dir import load_manifest
from hutch.vm.snapshot_manifest import fd_digest
from tests.conftest import ensure_image
from tests.vm.services import real_service
from tests.vm.test_sandbox_vm import run

pytestmark = [pytest.mark.vm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

SHAPE = Shape(vcpus=1, memory_mib=256, disk_gib=2)
COUNTER = (
    "setsid -f sh -c 'i=0; while :; do i=$((i+1)); "
    "echo $i > /tmp/c.new; mv /tmp/c.new /tmp/c; sleep 0.2; done'"
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Services]:
    async with real_service(
        tmp_path_factory.mktemp("tplstate"), pool_size=1, fork_ram_in_file=True
    ) as svc:
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

    # Copy-on-write memory: the template keeps guest RAM in memory.ram (sealed: its
    # digest recorded) and a state-only stream; each clone maps that file privately.
    tpl = backend.templates.find(image, SHAPE)
    assert tpl is not None
    manifest = load_manifest(tpl)
    assert manifest.ram_in_file and manifest.memory is not None
    assert manifest.memory.digest is not None and manifest.state_size < 4 << 20
    for w in warm:
        assert _maps_privately(backend, w.id, tpl / MEMORY_FILE)
    # A clone's RAM content and processes survive a memory pause (a full stream: its RAM
    # is private; the resumed clone maps the template's file privately again, the stream
    # rewrote every page) and a fork of it. The fork's snapshot is rebased: its RAM
    # written once into a memory.ram of its own (sealed) and a state-only stream, which
    # the parent and both children map privately; the children are distinct.
    ram = "mkdir -p /mnt/ram && mount -t tmpfs -o size=64m ram /mnt/ram"
    await run(service, warm[0].id, f"{ram} && head -c 8M /dev/urandom > /mnt/ram/r")
    await run(service, warm[0].id, COUNTER)
    digest = await run(service, warm[0].id, "md5sum < /mnt/ram/r")
    await service.lifecycle.pause(warm[0].id, PauseMode.MEMORY)
    await service.lifecycle.resume(warm[0].id)
    assert await run(service, warm[0].id, "md5sum < /mnt/ram/r") == digest
    assert _maps_privately(backend, warm[0].id, tpl / MEMORY_FILE)
    children = await service.snapshots.fork(warm[0].id, 2)
    backing = qcow2_backing_file(backend.paths(children[0].id).disk)
    assert backing is not None
    fork_dir = Path(backing).parent
    rebased = load_manifest(fork_dir)
    assert rebased.ram_in_file and rebased.memory is not None and rebased.memory.digest
    assert rebased.state_size < 4 << 20, "the fork's stream still carries the RAM"
    for sid in (warm[0].id, *(c.id for c in children)):
        assert await run(service, sid, "md5sum < /mnt/ram/r") == digest
        first = int(await run(service, sid, ["cat", "/tmp/c"]))
        await asyncio.sleep(0.6)
        assert int(await run(service, sid, ["cat", "/tmp/c"])) > first, "the counter stopped"
        assert _maps_privately(backend, sid, fork_dir / MEMORY_FILE)
    forked = [warm[0].id, *(c.id for c in children)]
    assert len({await run(service, s, ["hostname"]) for s in forked}) == 3
    assert len({await run(service, s, rand) for s in forked}) == 3
    fd = os.open(fork_dir / MEMORY_FILE, os.O_RDONLY)
    try:
        assert fd_digest(fd, "xxh3_128")[0] == rebased.memory.digest, "a clone wrote the file"
    finally:
        os.close(fd)
    # After clones wrote their memory, the template's file still has its sealed bytes.
    fd = os.open(tpl / MEMORY_FILE, os.O_RDONLY)
    try:
        assert fd_digest(fd, "xxh3_128")[0] == manifest.memory.digest
    finally:
        os.close(fd)
    for sid in [*everyone, *(c.id for c in children)]:
        await service.sandboxes.delete(sid)


def _maps_privately(backend: QemuBackend, sandbox_id: str, memory_file: Path) -> bool:
    """The sandbox's QEMU maps ``memory_file``, and only privately (copy-on-write)."""
    pid = int(backend.paths(sandbox_id).pidfile.read_text())
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    mapped = [m.split()[1] for m in maps if m.endswith(str(memory_file))]
    return bool(mapped) and all(perms[3] == "p" for perms in mapped)


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
    pooled_id, pooled = ready[0]
    agent = pooled.agent
    start = time.monotonic()
    got = await service.sandboxes.create(SandboxSpec(image="base", name="from-pool"))
    took = time.monotonic() - start
    print(f"create from the warm pool: {took:.3f} s")
    assert got.id == pooled_id and got.shape == default
    assert await run(service, got.id, ["hostname"]) == "from-pool\n"
    # Renamed in one request on the connection it had (no reconnect), its own
    # machine-id kept.
    assert pooled.agent is agent and not agent.closed
    machine_id = identity_of(got.id, "from-pool").machine_id
    assert await run(service, got.id, ["cat", "/etc/machine-id"]) == machine_id + "\n"
    assert await run(service, got.id, ["echo", "ok"]) == "ok\n"
    for sid in (first.id, got.id):
        await service.sandboxes.delete(sid)
