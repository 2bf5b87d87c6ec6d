"""The code interpreter in a real ``devbox`` guest: state across runs, matplotlib PNGs,
pandas HTML tables, interrupt, restart, and a clear error for an unknown context."""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from hutch.errors import NotFound
from hutch.models import SandboxSpec, Shape
from hutch.services.composed import Services
from hutch.services.interpreter import InterpreterService
from tests.conftest import ensure_image
from tests.vm.services import real_service

pytestmark = [pytest.mark.vm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Services]:
    ensure_image("devbox")
    async with real_service(tmp_path_factory.mktemp("interp"), templates=False) as svc:
        yield svc


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sandbox(service: Services) -> str:
    rec = await service.sandboxes.create(
        SandboxSpec(image="devbox", shape=Shape(vcpus=2, memory_mib=1024, disk_gib=6))
    )
    return rec.id


async def run(
    interp: InterpreterService, sid: str, cid: str, code: str, timeout_s: float = 600
) -> tuple[list[dict[str, Any]], str]:
    r = await interp.run(sid, cid, code, timeout_s=timeout_s)
    outputs = [item async for item in r.outputs()]
    assert r.end is not None
    return outputs, r.end.status


def result_of(outputs: list[dict[str, Any]]) -> dict[str, Any]:
    results = [o["data"] for o in outputs if o["type"] == "result"]
    assert results, outputs
    last: dict[str, Any] = results[-1]
    return last


async def test_state_persists_across_runs(service: Services, sandbox: str) -> None:
    interp = service.interpreter
    ctx = await interp.create(sandbox)
    await run(interp, sandbox, ctx.id, "counter = 40")
    outputs, status = await run(interp, sandbox, ctx.id, "counter += 2\nprint('ok')\ncounter")
    assert status == "ok"
    assert {"type": "stdout", "text": "ok\n"} in outputs
    assert result_of(outputs)["text/plain"] == "42"


async def test_matplotlib_plot_is_a_png(service: Services, sandbox: str) -> None:
    interp = service.interpreter
    ctx = await interp.create(sandbox)
    code = (
        "import matplotlib.pyplot as plt\n"
        "fig, ax = plt.subplots(figsize=(4, 3))\n"
        "ax.plot([1, 2, 3], [1, 4, 9])\n"
        "plt.show()\n"
    )
    outputs, status = await run(interp, sandbox, ctx.id, code)
    assert status == "ok", outputs
    images = [o["data"]["image/png"] for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1, outputs
    png = base64.b64decode(images[0])
    assert png.startswith(PNG_SIGNATURE)
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    assert 200 < width < 1000 and 150 < height < 800 and len(png) > 2000

    # A figure left open at the end of a run is sent too.
    outputs, _ = await run(interp, sandbox, ctx.id, "plt.figure(); plt.bar([1, 2], [3, 4]); None")
    assert any("image/png" in o.get("data", {}) for o in outputs), outputs


async def test_pandas_dataframe_is_an_html_table(service: Services, sandbox: str) -> None:
    interp = service.interpreter
    ctx = await interp.create(sandbox)
    code = "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})"
    outputs, status = await run(interp, sandbox, ctx.id, code)
    assert status == "ok", outputs
    data = result_of(outputs)
    assert "<table" in data["text/html"] and "<td>x</td>" in data["text/html"]
    assert "a  b" in data["text/plain"]


async def test_interrupt_and_restart(service: Services, sandbox: str) -> None:
    interp = service.interpreter
    ctx = await interp.create(sandbox)
    await run(interp, sandbox, ctx.id, "kept = 'yes'")
    long_run = asyncio.create_task(run(interp, sandbox, ctx.id, "import time\ntime.sleep(300)"))
    for _ in range(600):
        if (await interp.get(sandbox, ctx.id)).state == "busy":
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)
    await interp.interrupt(sandbox, ctx.id)
    outputs, status = await asyncio.wait_for(long_run, 60)
    assert status == "interrupted"
    assert [o["ename"] for o in outputs if o["type"] == "error"] == ["KeyboardInterrupt"]
    outputs, _ = await run(interp, sandbox, ctx.id, "kept")
    assert result_of(outputs)["text/plain"] == "'yes'"

    info = await interp.restart(sandbox, ctx.id)
    assert info.id == ctx.id and info.state == "idle"
    outputs, status = await run(interp, sandbox, ctx.id, "kept")
    assert status == "error"
    assert [o["ename"] for o in outputs if o["type"] == "error"] == ["NameError"]


async def test_unknown_context_is_a_clear_404(service: Services, sandbox: str) -> None:
    interp = service.interpreter
    with pytest.raises(NotFound) as info:
        await interp.run(sandbox, "ctx-0123456789ab", "1")
    assert "ctx-0123456789ab" in info.value.message
    assert f"/v1/sandboxes/{sandbox}/contexts" in info.value.message
    ctx = await interp.create(sandbox)
    await interp.delete(sandbox, ctx.id)
    with pytest.raises(NotFound, match=ctx.id):
        await interp.restart(sandbox, ctx.id)
