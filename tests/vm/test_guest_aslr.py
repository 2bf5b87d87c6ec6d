"""``HUTCH_GUEST_ASLR``: an operator who wants address-space randomization inside the
guests under TCG too gets it, from the boot on and after a memory resume (the hello
carries ``aslr``; ``test_ladder.py`` proves the default, one layout under TCG)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from hutch.models import PauseMode, SandboxSpec, Shape
from hutch.services.composed import Services
from tests.vm.services import real_service

pytestmark = [pytest.mark.vm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Services]:
    state = tmp_path_factory.mktemp("aslr")
    async with real_service(state, templates=False, guest_aslr=True) as svc:
        yield svc


async def out(service: Services, sid: str, cmd: list[str]) -> str:
    stream = await service.guest.exec(sid, cmd)
    result = await stream.collect()
    assert result.exit_code == 0, (cmd, result)
    return result.stdout.decode()


async def libc_start(service: Services, sid: str) -> str:
    maps = (await out(service, sid, ["cat", "/proc/self/maps"])).splitlines()
    return next(line.split("-")[0] for line in maps if "libc.so" in line)


async def test_randomization_stays_on_from_boot_and_after_a_resume(service: Services) -> None:
    rec = await service.sandboxes.create(SandboxSpec(image="base", shape=Shape(memory_mib=256)))
    setting = "/proc/sys/kernel/randomize_va_space"
    assert (await out(service, rec.id, ["cat", setting])).strip() == "2"
    # Really random: eight commands never all map libc at one address.
    starts = {await libc_start(service, rec.id) for _ in range(8)}
    assert len(starts) > 1, starts
    await service.lifecycle.pause(rec.id, PauseMode.MEMORY)
    await service.lifecycle.resume(rec.id)
    assert (await out(service, rec.id, ["cat", setting])).strip() == "2"
