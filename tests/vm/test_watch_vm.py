"""File watch and directory archives in a real guest: a watch sees a file created by
exec; a directory tree survives a tar round trip byte for byte."""

from __future__ import annotations

import asyncio
import hashlib
import io
import tarfile
from collections.abc import AsyncGenerator, AsyncIterator

import pytest
import pytest_asyncio

from hutch.models import SandboxSpec, Shape
from hutch.services.files_extra import FilesExtraService
from hutch.services.sandboxes import SandboxService
from tests.vm.services import real_service
from tests.vm.test_sandbox_vm import run

pytestmark = [pytest.mark.vm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SandboxService]:
    async with real_service(tmp_path_factory.mktemp("watch"), templates=False) as svc:
        yield svc


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sandbox(service: SandboxService) -> str:
    rec = await service.create(
        SandboxSpec(image="base", shape=Shape(vcpus=1, memory_mib=384, disk_gib=3))
    )
    return rec.id


async def test_watch_sees_a_file_created_by_exec(service: SandboxService, sandbox: str) -> None:
    files = FilesExtraService(service)
    await run(service, sandbox, ["mkdir", "-p", "/root/watched/sub"])
    watch = await files.watch(sandbox, "/root/watched")
    events = watch.events()
    assert isinstance(events, AsyncGenerator)
    try:
        await run(service, sandbox, "echo hi > /root/watched/sub/new.txt")
        seen: list[tuple[str, str]] = []
        async with asyncio.timeout(30):
            while ("modified", "/root/watched/sub/new.txt") not in seen:
                event = await anext(events)
                seen.append((event.type, event.path))
        assert seen[0] == ("created", "/root/watched/sub/new.txt")
        await run(service, sandbox, "mv /root/watched/sub/new.txt /root/watched/moved.txt")
        async with asyncio.timeout(30):
            event = await anext(events)
        assert (event.type, event.from_path, event.to_path) == (
            "renamed",
            "/root/watched/sub/new.txt",
            "/root/watched/moved.txt",
        )
    finally:
        await events.aclose()


async def test_tar_round_trip_keeps_every_byte(service: SandboxService, sandbox: str) -> None:
    files = FilesExtraService(service)
    await run(
        service,
        sandbox,
        "mkdir -p /root/tree/a/b/c /root/tree/empty && cd /root/tree && "
        "head -c 3000000 /dev/urandom > a/big.bin && "
        "for i in $(seq 1 40); do head -c $((i * 997)) /dev/urandom > a/b/c/f$i; done && "
        "echo text > top.txt && ln -s a/big.bin link",
    )
    want = await run(service, sandbox, "cd /root/tree && find . -type f | sort | xargs sha256sum")

    chunks = await files.read_archive(sandbox, "/root/tree")
    data = b"".join([c async for c in chunks])
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        local = {
            m.name: hashlib.sha256(tar.extractfile(m).read()).hexdigest()  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.isreg()
        }
        assert tar.getmember("link").linkname == "a/big.bin"
    expected = {line.split()[1][2:]: line.split()[0] for line in want.splitlines()}
    assert local == expected

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(data), 100_000):
            yield data[i : i + 100_000]

    written = await files.write_archive(sandbox, "/root/copy", pieces())
    assert written.entries == len(local) + 5  # files + 4 directories + the symlink
    got = await run(service, sandbox, "cd /root/copy && find . -type f | sort | xargs sha256sum")
    assert got == want
    assert (await run(service, sandbox, ["readlink", "/root/copy/link"])).strip() == "a/big.bin"
