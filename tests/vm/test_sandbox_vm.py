"""Sandboxes as real QEMU micro-VMs, through the service (no HTTP): the guest is a
real machine with its own kernel, shapes are honoured, errors leave the VM usable, and
destroy leaves nothing behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from hutch.errors import InvalidArgument, NotFound, UnknownImage
from hutch.images.build import ImageArtifacts
from hutch.models import SandboxSpec, SandboxState, Shape
from hutch.runtime.qemu.backend import QemuBackend
from hutch.services.sandboxes import SandboxService
from tests.conftest import ensure_image
from tests.vm.services import qemu_pids_mentioning, real_service

pytestmark = [pytest.mark.vm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SandboxService]:
    # These tests prove the cold-boot path; test_templates proves the other.
    async with real_service(tmp_path_factory.mktemp("vmstate"), templates=False) as svc:
        yield svc


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sandbox(service: SandboxService) -> str:
    rec = await service.create(
        SandboxSpec(
            image="base",
            shape=Shape(vcpus=2, memory_mib=384, disk_gib=3),
            name="vmtest",
            env={"SANDBOX_VAR": "from-create"},
        )
    )
    return rec.id


async def run(service: SandboxService, sid: str, cmd: list[str] | str, **kw: object) -> str:
    stream = await service.exec(sid, cmd, **kw)  # type: ignore[arg-type]
    result = await stream.collect()
    assert result.exit_code == 0, (cmd, result)
    return result.stdout.decode()


async def test_guest_runs_its_own_kernel(service: SandboxService, sandbox: str) -> None:
    image = ensure_image("base")
    assert isinstance(image, ImageArtifacts)
    guest = (await run(service, sandbox, ["uname", "-r"])).strip()
    host = os.uname().release
    assert guest == image.kernel_release
    assert guest != host


async def test_shape_identity_and_env(service: SandboxService, sandbox: str) -> None:
    assert (await run(service, sandbox, ["nproc"])).strip() == "2"
    meminfo = await run(service, sandbox, ["cat", "/proc/meminfo"])
    total_kib = int(meminfo.split()[1])
    assert 300 * 1024 < total_kib <= 384 * 1024
    df = await run(service, sandbox, ["df", "--output=size", "-B1M", "/"])
    size_mib = int(df.split()[-1])
    assert 2600 < size_mib <= 3 * 1024, "the root filesystem was not grown to disk_gib"
    assert (await run(service, sandbox, ["hostname"])).strip() == "vmtest"
    assert (await run(service, sandbox, "echo $SANDBOX_VAR")).strip() == "from-create"
    year = int((await run(service, sandbox, ["date", "+%Y"])).strip())
    assert abs(year - time.gmtime().tm_year) <= 1, "the guest clock was not set"


async def test_output_streams_while_the_command_runs(service: SandboxService, sandbox: str) -> None:
    stream = await service.exec(sandbox, "for i in 1 2 3 4; do echo $i; sleep 1; done")
    start = time.monotonic()
    arrivals = []
    async for chunk in stream:
        arrivals.append((time.monotonic() - start, chunk.data))
    done = await stream.wait()
    assert done.exit_code == 0
    assert b"".join(d for _, d in arrivals) == b"1\n2\n3\n4\n"
    assert arrivals[0][0] < arrivals[-1][0] - 2.0, f"not streamed: {arrivals}"


async def test_bad_input_leaves_the_vm_usable(service: SandboxService, sandbox: str) -> None:
    with pytest.raises(InvalidArgument, match="no-such-cmd"):
        await service.exec(sandbox, ["no-such-cmd"])
    with pytest.raises(InvalidArgument):
        await service.stat(sandbox, "/proc/1/environ")
    with pytest.raises(InvalidArgument):
        await service.write_file(sandbox, "../../etc/passwd", b"x")
    with pytest.raises(NotFound):
        await service.stat(sandbox, "/no/such/file")
    stream = await service.exec(sandbox, ["sleep", "60"], timeout_s=1)
    done = await stream.wait()
    assert done.timed_out
    with pytest.raises(UnknownImage, match="available"):
        await service.create(SandboxSpec(image="nope"))
    with pytest.raises(InvalidArgument, match="memory_mib"):
        SandboxSpec(image="base", shape=Shape(memory_mib=32 * 1024))
    assert (await run(service, sandbox, ["echo", "ok"])) == "ok\n"


async def test_files_in_the_guest(service: SandboxService, sandbox: str) -> None:
    entry = await service.write_file(sandbox, "/home/user/x/y.txt", b"data", mode=0o600)
    assert entry.size == 4
    assert (await run(service, sandbox, ["cat", "/home/user/x/y.txt"])) == "data"
    chunks = [c async for c in await service.read_file(sandbox, "/etc/os-release")]
    assert b"bookworm" in b"".join(chunks)


async def test_destroy_leaves_nothing(service: SandboxService) -> None:
    rec = await service.create(SandboxSpec(image="base", shape=Shape(memory_mib=256)))
    backend = service.backend
    assert isinstance(backend, QemuBackend)
    paths = backend.paths(rec.id)
    assert paths.disk.exists() and paths.agent_socket.exists()
    pids = qemu_pids_mentioning(str(paths.run))
    assert len(pids) == 1
    await service.delete(rec.id)
    assert service.get(rec.id).state is SandboxState.DESTROYED
    assert qemu_pids_mentioning(str(paths.run)) == []
    assert not paths.state.exists() and not paths.run.exists()
    await service.delete(rec.id)  # twice is fine


async def test_vm_killed_from_outside_is_detected(service: SandboxService) -> None:
    rec = await service.create(SandboxSpec(image="base", shape=Shape(memory_mib=256)))
    assert isinstance(service.backend, QemuBackend)
    paths = service.backend.paths(rec.id)
    (pid,) = qemu_pids_mentioning(str(paths.run))
    os.kill(pid, signal.SIGKILL)
    for _ in range(200):
        if service.get(rec.id).state is SandboxState.FAILED:
            break
        await asyncio.sleep(0.05)
    got = service.get(rec.id)
    assert got.state is SandboxState.FAILED and "unexpectedly" in (got.error or "")
    assert not paths.state.exists()
