"""Background processes and terminals in a real micro-VM, across a memory pause/resume.

The pause closes the agent connection and the resume opens a new session (the agent
resets its streams); the processes and terminals must not notice, and the output they
wrote meanwhile must still be there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from hutch.errors import Conflict, NotFound
from hutch.models import PauseMode, SandboxSpec, Shape
from hutch.services.processes import ProcessService, PtySession
from hutch.services.sandboxes import SandboxService
from tests.vm.services import real_service

pytestmark = [pytest.mark.vm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

TICKER = "i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.2; done"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SandboxService]:
    async with real_service(tmp_path_factory.mktemp("procstate")) as svc:
        yield svc


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sid(service: SandboxService) -> str:
    rec = await service.create(SandboxSpec(image="base", shape=Shape(memory_mib=256)))
    return rec.id


async def _output(procs: ProcessService, sid: str, pid: int) -> bytes:
    out = bytearray()
    async with procs.output(sid, pid) as stream:
        async for chunk in stream:
            out += chunk.data
    return bytes(out)


async def _read_until(session: PtySession, needle: bytes, within: float = 60) -> bytes:
    seen = b""
    async with asyncio.timeout(within):
        async for data in session.output():
            seen += data
            if needle in seen:
                return seen
    raise AssertionError(f"{needle!r} never appeared; the terminal showed {seen[-2000:]!r}")


async def test_process_and_terminal_survive_memory_pause(service: SandboxService, sid: str) -> None:
    procs = ProcessService(service)
    ticker = await procs.start(sid, TICKER)
    assert ticker.state == "running"
    for _ in range(300):
        if b"tick 3\n" in await _output(procs, sid, ticker.pid):
            break
        await asyncio.sleep(0.2)
    else:
        raise AssertionError("the background process printed nothing in 60 s")

    session = await procs.open_pty(sid, rows=20, cols=70)
    await _read_until(session, b"#")  # root's prompt
    session.send(b"export V=set-before-pause; echo marker-$((6*7))\n")
    await _read_until(session, b"marker-42")
    pty_id = session.pty_id
    await session.detach()

    await service.pause(sid, PauseMode.MEMORY)
    await asyncio.sleep(1)
    await service.resume(sid)

    after = await procs.get(sid, ticker.pid)
    assert after.state == "running", after
    await asyncio.sleep(1)
    later = await procs.get(sid, ticker.pid)
    assert later.output_bytes > after.output_bytes, "the process stopped after the resume"
    out = await _output(procs, sid, ticker.pid)
    assert out.startswith(b"tick 1\ntick 2\ntick 3\n"), out[:200]

    session = await procs.attach_pty(sid, pty_id)
    await _read_until(session, b"marker-42")  # the scrollback from before the pause
    session.send(b"echo V=$V\n")
    await _read_until(session, b"V=set-before-pause")
    await session.detach()
    closed = await procs.close_pty(sid, pty_id)
    assert closed.state == "exited"

    killed = await procs.kill(sid, ticker.pid)
    assert (killed.state, killed.signal) == ("exited", 9)


async def test_signal_to_finished_process_and_unknown_ids(
    service: SandboxService, sid: str
) -> None:
    procs = ProcessService(service)
    p = await procs.start(sid, ["sh", "-c", "echo bye; exit 5"])
    done = await procs.wait(sid, p.pid, timeout_s=60)
    assert (done.state, done.exit_code) == ("exited", 5)
    with pytest.raises(Conflict, match=f"^process {p.pid} already exited with code 5$"):
        await procs.signal(sid, p.pid, 15)
    with pytest.raises(NotFound, match="no background process 4000000"):
        await procs.get(sid, 4000000)
    with pytest.raises(NotFound, match="no terminal 'pty-nope'"):
        await procs.attach_pty(sid, "pty-nope")
