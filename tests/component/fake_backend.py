"""A verified fake VM backend: the real guest agent, run without a VM.

The agent runs as a host process inside a bubblewrap sandbox (private /root and /tmp,
no network), speaking the real protocol over a unix socket in ``--listen-unix`` mode. It
lets service and API tests run in milliseconds; tests/vm and tests/e2e prove the same
behaviour with real QEMU guests.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from pathlib import Path

from hutch.guest.client import AgentClient
from hutch.images.build import ImageArtifacts
from hutch.models import SANDBOX_ID_RE, SandboxRecord

AGENT = Path(__file__).resolve().parents[2] / "guest_agent" / "hutch_agent.py"
# The agent is stdlib-only; the system Python is used because a virtualenv's interpreter
# may live under /root, which the sandbox hides.
AGENT_PYTHON = "/usr/bin/python3"


class FakeRuntime:
    def __init__(
        self, sandbox_id: str, proc: asyncio.subprocess.Process, agent: AgentClient, log: Path
    ) -> None:
        self.sandbox_id = sandbox_id
        self.proc = proc
        self.agent = agent
        self.log = log

    async def wait_exited(self) -> None:
        await self.proc.wait()

    async def destroy(self) -> None:
        with contextlib.suppress(Exception):
            await self.agent.close()
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()

    def console_tail(self, max_bytes: int = 4096) -> str:
        try:
            return self.log.read_bytes()[-max_bytes:].decode(errors="replace")
        except OSError:
            return ""


class FakeBackend:
    accel = "fake"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[str] = []
        self.procs: dict[str, FakeRuntime] = {}
        self.fail_next_start: Exception | None = None

    async def start(self, rec: SandboxRecord, image: ImageArtifacts) -> FakeRuntime:
        if self.fail_next_start is not None:
            exc, self.fail_next_start = self.fail_next_start, None
            raise exc
        run = self.root / rec.id
        run.mkdir(parents=True)
        sock = run / "agent.sock"
        log = run / "agent.log"
        argv = [
            "bwrap",
            "--die-with-parent",
            "--unshare-all",
            "--new-session",
            "--ro-bind",
            "/",
            "/",
            "--tmpfs",
            "/root",
            "--tmpfs",
            "/tmp",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--bind",
            str(run),
            str(run),
            AGENT_PYTHON,
            "-I",
            str(AGENT),
            "--listen-unix",
            str(sock),
        ]
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out
            )
        try:
            agent = await AgentClient.connect(sock, timeout_s=10.0)
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
        runtime = FakeRuntime(rec.id, proc, agent, log)
        self.started.append(rec.id)
        self.procs[rec.id] = runtime
        return runtime

    async def adopt(self, rec: SandboxRecord) -> FakeRuntime | None:
        # A bubblewrap child dies with the test's daemon, so there is never anything to adopt.
        return None

    async def cleanup(self, sandbox_id: str) -> None:
        runtime = self.procs.pop(sandbox_id, None)
        if runtime is not None:
            await runtime.destroy()
        shutil.rmtree(self.root / sandbox_id, ignore_errors=True)

    def leftover_ids(self) -> set[str]:
        if not self.root.is_dir():
            return set()
        return {d.name for d in self.root.iterdir() if SANDBOX_ID_RE.match(d.name)}
