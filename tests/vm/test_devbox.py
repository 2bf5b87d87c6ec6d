"""The devbox image: the languages agents ask for, inside a real guest."""

from __future__ import annotations

import pytest

from hutch.models import SandboxSpec, Shape
from hutch.services.composed import Services
from tests.conftest import ensure_image
from tests.vm.test_sandbox_vm import run, service  # noqa: F401

pytestmark = [pytest.mark.vm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]


async def test_languages(service: Services) -> None:  # noqa: F811
    ensure_image("devbox")
    rec = await service.sandboxes.create(
        SandboxSpec(image="devbox", shape=Shape(vcpus=2, memory_mib=1024, disk_gib=6))
    )
    try:
        assert (await run(service, rec.id, ["python3", "-c", "print(6*7)"])) == "42\n"
        assert (await run(service, rec.id, ["node", "-e", "console.log(6*7)"])) == "42\n"
        assert "go1." in await run(service, rec.id, ["go", "version"])
        assert "cargo" in await run(service, rec.id, ["cargo", "--version"])
        assert "git version" in await run(service, rec.id, ["git", "--version"])
        script = "printf 'int main(){return 0;}' > /tmp/a.c && gcc /tmp/a.c -o /tmp/a && /tmp/a"
        await run(service, rec.id, script, timeout_s=300)
        await run(service, rec.id, ["python3", "-m", "venv", "/tmp/venv"], timeout_s=300)
        await run(
            service, rec.id, ["python3", "-c", "import pandas, numpy, matplotlib"], timeout_s=300
        )
    finally:
        await service.sandboxes.delete(rec.id)
