"""Sandboxes as real QEMU micro-VMs, through the service (no HTTP): destroy leaves
nothing behind on the host, and a VM killed from outside is noticed.

What the guest itself shows (its own kernel, shape, identity, clock, files, streams,
errors that leave it usable) is checked on every rung of the VM ladder: booted,
restored and forked (tests/vm/test_ladder.py)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import pytest_asyncio

from hutch.errors import Timeout
from hutch.models import SandboxSpec, SandboxState, Shape
from hutch.runtime.qemu.backend import QemuBackend
from hutch.services.composed import Services
from tests.conftest import qemu_pids_mentioning
from tests.vm.services import real_service

pytestmark = [pytest.mark.vm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Services]:
    # These tests prove the cold-boot path; test_templates proves the other.
    async with real_service(tmp_path_factory.mktemp("vmstate"), templates=False) as svc:
        yield svc


async def run(service: Services, sid: str, cmd: list[str] | str, **kw: object) -> str:
    stream = await service.guest.exec(sid, cmd, **kw)  # type: ignore[arg-type]
    result = await stream.collect()
    assert result.exit_code == 0, (cmd, result)
    return result.stdout.decode()


async def test_destroy_leaves_nothing(service: Services) -> None:
    rec = await service.sandboxes.create(SandboxSpec(image="base", shape=Shape(memory_mib=256)))
    backend = service.backend
    assert isinstance(backend, QemuBackend)
    paths = backend.paths(rec.id)
    assert paths.disk.exists() and paths.agent_socket.exists()
    pids = qemu_pids_mentioning(str(paths.run))
    assert len(pids) == 1
    await service.sandboxes.delete(rec.id)
    assert service.sandboxes.get(rec.id).state is SandboxState.DESTROYED
    assert qemu_pids_mentioning(str(paths.run)) == []
    assert not paths.state.exists() and not paths.run.exists()
    await service.sandboxes.delete(rec.id)  # twice is fine


async def test_vm_killed_from_outside_is_detected(service: Services) -> None:
    rec = await service.sandboxes.create(SandboxSpec(image="base", shape=Shape(memory_mib=256)))
    assert isinstance(service.backend, QemuBackend)
    paths = service.backend.paths(rec.id)
    (pid,) = qemu_pids_mentioning(str(paths.run))
    os.kill(pid, signal.SIGKILL)
    for _ in range(200):
        if service.sandboxes.get(rec.id).state is SandboxState.FAILED:
            break
        await asyncio.sleep(0.05)
    got = service.sandboxes.get(rec.id)
    assert got.state is SandboxState.FAILED and "unexpectedly" in (got.error or "")
    assert not paths.state.exists()


async def test_a_boot_whose_agent_never_answers_says_what_the_guest_was_doing(
    service: Services,
) -> None:
    # Once in CI a guest's agent never answered its boot (2026-12-06, devbox, 120 s) and
    # the run directory with the console log was swept before anyone read it: the error
    # itself has to carry what the guest did.
    backend = service.backend
    assert isinstance(backend, QemuBackend)
    normal = backend.booter.settings
    backend.booter.settings = replace(normal, boot_timeout_s=1.0)
    every_state = list(SandboxState)
    before = {r.id for r in service.core.store.list_sandboxes(states=every_state)}
    try:
        with pytest.raises(Timeout) as caught:
            await service.sandboxes.create(SandboxSpec(image="base", shape=Shape(memory_mib=256)))
    finally:
        backend.booter.settings = normal
    message = str(caught.value)
    assert "did not answer within 1 s" in message
    # Booting, so running and burning CPU: a halted guest would show next to none.
    assert re.search(r"QEMU \d+: running, \d+\.\d s of CPU used, 1 s waited", message), message
    assert "console tail:" in message
    after = service.core.store.list_sandboxes(states=every_state)
    [failed] = [r for r in after if r.id not in before]
    assert failed.state in (SandboxState.FAILED, SandboxState.DESTROYED), failed.state
    assert qemu_pids_mentioning(str(backend.paths(failed.id).run)) == []
