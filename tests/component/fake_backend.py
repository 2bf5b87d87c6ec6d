"""A verified fake VM backend: the real guest agent, run without a VM.

The agent runs as a host process inside a bubblewrap sandbox (private /root and /tmp,
no network), speaking the real protocol over a unix socket in ``--listen-unix`` mode. It
lets service and API tests run in milliseconds; tests/vm and tests/e2e prove the same
behaviour with real QEMU guests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from collections.abc import Sequence
from pathlib import Path

from hutch.errors import SnapshotError
from hutch.guest.client import AgentClient
from hutch.images.build import ImageArtifacts
from hutch.models import SANDBOX_ID_RE, PauseMode, SandboxRecord
from hutch.runtime.backend import TemplateInfo
from hutch.vm.argv import VolumeDrive

AGENT = Path(__file__).resolve().parents[2] / "guest_agent" / "agent.py"
# The agent is stdlib-only; the system Python is used because a virtualenv's interpreter
# may live under /root, which the sandbox hides.
AGENT_PYTHON = "/usr/bin/python3"


class FakeRuntime:
    def __init__(
        self,
        sandbox_id: str,
        proc: asyncio.subprocess.Process,
        agent: AgentClient,
        log: Path,
        backend: FakeBackend,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.proc = proc
        self.agent = agent
        self.log = log
        self._backend = backend

    async def wait_exited(self) -> None:
        await self.proc.wait()

    def exit_reason(self) -> str | None:
        rc = self.proc.returncode
        if rc is None:
            return None
        return f"signal {-rc}" if rc < 0 else f"exit status {rc}"

    async def destroy(self) -> None:
        with contextlib.suppress(Exception):
            await self.agent.close()
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()

    async def cont(self) -> None:
        return None

    def console_tail(self, max_bytes: int = 4096) -> str:
        try:
            return self.log.read_bytes()[-max_bytes:].decode(errors="replace")
        except OSError:
            return ""

    # Pause keeps the agent process stopped (SIGSTOP), which keeps its memory like a
    # memory-mode pause; disk mode ends it. A fork starts fresh agents: only real VMs
    # clone memory (tests/vm prove that).

    async def pause(self, mode: PauseMode) -> str | None:
        await self.agent.close()
        if mode is PauseMode.DISK:
            await self.destroy()
            self._backend.procs.pop(self.sandbox_id, None)
            return None
        os.killpg(self.proc.pid, signal.SIGSTOP)
        self._backend.stopped[self.sandbox_id] = self
        return str(self._backend.pause_dir(self.sandbox_id))

    async def freeze(self, snapshot_dir: Path) -> None:
        # As the real freeze does, the agent connection goes (the parent's clone makes a
        # new one): whatever still streamed through it is cut.
        await self.agent.close()
        snapshot_dir.mkdir(parents=True)  # noqa: ASYNC240 - a test fake, instant

    async def retake_identity(self, rec: SandboxRecord) -> None:
        return None

    # Volumes: the fake has no block devices; it records what the services asked for
    # (tests/vm prove the real mounts and growth).
    async def mount_volume(self, serial: str, path: str, *, read_only: bool) -> None:
        self._backend.mounted.setdefault(self.sandbox_id, []).append((serial, path, read_only))

    async def mount_shared(self, slot: int, path: str, *, read_only: bool) -> None:
        self._backend.mounted.setdefault(self.sandbox_id, []).append(
            (f"share{slot}", path, read_only)
        )

    async def freeze_volumes(self, guest_paths: list[str]) -> None:
        self._backend.frozen.append((self.sandbox_id, list(guest_paths)))

    async def grow_disk(self, drive: str, guest_path: str, size_bytes: int) -> None:
        self._backend.grown.append((self.sandbox_id, drive, guest_path, size_bytes))


class FakeTemplates:
    """No template is ever ready: creates always "cold boot" a fresh agent. A build is
    recorded; the key of every (image, shape) is ``key`` and its image directory
    ``content`` (None: never shared through the blob store), so a test can record an
    upload that a create's fetch then tries (``install`` refuses: no real template)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.built: list[tuple[str, object]] = []
        self.key = "f" * 64
        self.content: str | None = None

    def find(self, image: ImageArtifacts, shape: object) -> Path | None:
        return None

    async def build(self, image: ImageArtifacts, shape: object) -> Path:
        self.built.append((image.name, shape))
        return self.root / "templates"

    def describe(self, image: ImageArtifacts, shape: object) -> TemplateInfo:
        return TemplateInfo(
            key=self.key,
            content=self.content,
            path=self.root / "templates" / f"{image.name}-{self.key[:16]}",
            image=image.name,
            shape=str(shape),
        )

    def local(self) -> list[TemplateInfo]:
        return []

    def staging(self, image: ImageArtifacts, shape: object) -> Path:
        d = self.root / "templates" / f".fetch-{image.name}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def install(self, image: ImageArtifacts, shape: object, staging: Path) -> Path:
        raise SnapshotError("the fake backend installs no template")

    def discard_unfinished(self) -> None:
        return None

    def remove(self, image_name: str) -> list[str]:
        return []

    def of_image(self, image_name: str) -> list[str]:
        return []

    def retire(self, image_name: str, digest: str) -> list[str]:
        return []


class FakeSnapshotFiles:
    def __init__(self, root: Path, clone_of: dict[str, Path]) -> None:
        self.root = root
        self.clone_of = clone_of

    async def recover(self, sandbox_id: str, snapshot_dir: str, *, clone: bool) -> bool:
        return await asyncio.to_thread(Path(snapshot_dir).exists)

    def complete(self, snapshot_dir: Path) -> bool:
        return snapshot_dir.is_dir()

    def collect(self, live_ids: set[str], keep: set[str]) -> list[str]:
        """Snapshot directories nothing keeps and no live clone was started from."""
        root = self.root / "snapshots"
        if not root.is_dir():
            return []
        kept = {Path(k) for k in keep} | {self.clone_of[i] for i in live_ids if i in self.clone_of}
        removed = []
        for snap in root.iterdir():
            if snap not in kept:
                shutil.rmtree(snap, ignore_errors=True)
                removed.append(snap.name)
        return removed

    #: What size() and estimate() answer (tests change them).
    size_bytes = 4096
    estimate_bytes = 4096

    def size(self, snapshot_dir: Path) -> int:
        return self.size_bytes

    def estimate(self, rec: SandboxRecord) -> int:
        return self.estimate_bytes


class FakeBackend:
    accel = "fake"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[str] = []
        self.procs: dict[str, FakeRuntime] = {}
        self.fail_next_start: Exception | None = None
        #: Errors the next new clones (fork children) fail with, one each.
        self.fail_clones: list[Exception] = []
        self.stopped: dict[str, FakeRuntime] = {}
        self.clone_of: dict[str, Path] = {}
        self.templates = FakeTemplates(root)
        self.snapshots = FakeSnapshotFiles(root, self.clone_of)
        self.mounted: dict[str, list[tuple[str, str, bool]]] = {}
        self.grown: list[tuple[str, str, str, int]] = []
        self.frozen: list[tuple[str, list[str]]] = []
        self.volumes_of: dict[str, tuple[VolumeDrive, ...]] = {}
        self.shares_of: dict[str, tuple[int, ...]] = {}

    async def start(
        self,
        rec: SandboxRecord,
        image: ImageArtifacts,
        volumes: Sequence[VolumeDrive] = (),
        shares: Sequence[int] = (),
    ) -> FakeRuntime:
        self.volumes_of[rec.id] = tuple(volumes)
        self.shares_of[rec.id] = tuple(shares)
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
            # The checkout may itself live under /tmp, which the tmpfs above hides.
            "--ro-bind",
            str(AGENT.parent),
            str(AGENT.parent),
            AGENT_PYTHON,
            "-I",
            str(AGENT),
            "--listen-unix",
            str(sock),
        ]
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        try:
            agent = await AgentClient.connect(sock, timeout_s=10.0)
        except BaseException as exc:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await proc.wait()
            # What the jailed agent said is the only clue to why it did not answer.
            tail = log.read_bytes()[-2000:].decode(errors="replace") if log.exists() else ""
            exc.add_note(
                f"fake agent of {rec.id}: bwrap ended with {proc.returncode}; log {tail!r}"
            )
            raise
        runtime = FakeRuntime(rec.id, proc, agent, log, self)
        self.started.append(rec.id)
        self.procs[rec.id] = runtime
        return runtime

    def pause_dir(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id / "pause"

    def rehome(self, rec: SandboxRecord) -> None:
        """The fake's files name no host paths: nothing to rewrite."""

    def share_socket(self, sandbox_id: str, slot: int) -> Path:
        # Nothing listens there: a link waits for it, as for a VM that is not up yet.
        return self.root / sandbox_id / f"share{slot}.sock"

    def disk_path(self, sandbox_id: str) -> Path:
        """The fake has no disk image: its guest's files are a directory on the host."""
        return self.root / sandbox_id / "disk"

    async def resume(
        self, rec: SandboxRecord, resume_from: str | None, *, clone: bool
    ) -> FakeRuntime:
        stopped = self.stopped.pop(rec.id, None)
        if stopped is not None:
            os.killpg(stopped.proc.pid, signal.SIGCONT)
            stopped.agent = await AgentClient.connect(
                self.root / rec.id / "agent.sock", timeout_s=10.0
            )
            return stopped
        shutil.rmtree(self.root / rec.id, ignore_errors=True)
        return await self.start(rec, None)  # type: ignore[arg-type]

    def fork_dir(self, snapshot_id: str) -> Path:
        return self.root / "snapshots" / snapshot_id

    async def start_clone(self, rec: SandboxRecord, snapshot_dir: Path) -> FakeRuntime:
        self.clone_of[rec.id] = snapshot_dir
        if rec.id in self.procs:
            runtime = self.procs[rec.id]
            if runtime.agent.closed:
                runtime.agent = await AgentClient.connect(
                    self.root / rec.id / "agent.sock", timeout_s=10.0
                )
            return runtime
        if self.fail_clones:
            raise self.fail_clones.pop(0)
        return await self.start(rec, None)  # type: ignore[arg-type]

    async def adopt(self, rec: SandboxRecord) -> FakeRuntime | None:
        # A bubblewrap child dies with the test's daemon, so there is never anything to adopt.
        return None

    async def kill_vm(self, sandbox_id: str) -> None:
        runtime = self.procs.get(sandbox_id)
        if runtime is not None:
            await runtime.destroy()

    async def cleanup(self, sandbox_id: str) -> None:
        self.stopped.pop(sandbox_id, None)
        runtime = self.procs.pop(sandbox_id, None)
        if runtime is not None:
            await runtime.destroy()
        shutil.rmtree(self.root / sandbox_id, ignore_errors=True)

    def close(self) -> None:
        pass  # holds nothing of its own

    def leftover_ids(self) -> set[str]:
        if not self.root.is_dir():
            return set()
        return {d.name for d in self.root.iterdir() if SANDBOX_ID_RE.match(d.name)}
