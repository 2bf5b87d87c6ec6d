"""The production VM backend: one QEMU ``microvm`` per sandbox, a qcow2 overlay on the
image's read-only root filesystem, and the guest agent over virtio-serial.

Where things live is described in ARCHITECTURE.md ("State on disk"). ``vm.json`` in the
sandbox directory records the exact VM configuration so that a restarted daemon can adopt
the VM without guessing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hutch.config import Settings
from hutch.errors import GuestError, HutchError, Timeout, VmError
from hutch.guest.client import AgentClient
from hutch.images.build import ImageArtifacts
from hutch.models import SANDBOX_ID_RE, SandboxRecord
from hutch.storage.overlay import create_overlay
from hutch.vm.accel import detect_accel, host_tsc_khz
from hutch.vm.argv import VmConfig
from hutch.vm.process import QemuVm

log = logging.getLogger(__name__)

_PATH_FIELDS = (
    "kernel",
    "initrd",
    "disk",
    "qmp_socket",
    "agent_socket",
    "console_log",
    "pidfile",
    "qemu_log",
)


@dataclass(frozen=True)
class SandboxPaths:
    state: Path  # <state_dir>/sandboxes/<id>
    run: Path  # /run/hutch/<hash>/<id> (sockets)

    @property
    def disk(self) -> Path:
        return self.state / "disk.qcow2"

    @property
    def console_log(self) -> Path:
        return self.state / "console.log"

    @property
    def qemu_log(self) -> Path:
        return self.state / "qemu.log"

    @property
    def pidfile(self) -> Path:
        return self.state / "qemu.pid"

    @property
    def vm_json(self) -> Path:
        return self.state / "vm.json"

    @property
    def qmp_socket(self) -> Path:
        return self.run / "qmp.sock"

    @property
    def agent_socket(self) -> Path:
        return self.run / "agent.sock"


def tail(path: Path, max_bytes: int) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class QemuRuntime:
    def __init__(self, sandbox_id: str, vm: QemuVm, agent: AgentClient, paths: SandboxPaths):
        self.sandbox_id = sandbox_id
        self.vm = vm
        self.agent = agent
        self.paths = paths

    async def wait_exited(self) -> None:
        await self.vm.wait_exited()

    async def destroy(self) -> None:
        with contextlib.suppress(Exception):
            await self.agent.close()
        await self.vm.kill()

    def console_tail(self, max_bytes: int = 4096) -> str:
        return tail(self.paths.console_log, max_bytes)


class QemuBackend:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.accel = detect_accel(settings.accel)

    def paths(self, sandbox_id: str) -> SandboxPaths:
        return SandboxPaths(
            state=self.settings.sandboxes_dir / sandbox_id,
            run=self.settings.run_dir / sandbox_id,
        )

    def vm_config(self, rec: SandboxRecord, image: ImageArtifacts) -> VmConfig:
        p = self.paths(rec.id)
        hostname = rec.name or rec.id
        return VmConfig(
            name=rec.id,
            vcpus=rec.shape.vcpus,
            memory_mib=rec.shape.memory_mib,
            kernel=image.kernel,
            initrd=image.initrd,
            cmdline=f"{image.cmdline} hutch.hostname={hostname}",
            disk=p.disk,
            accel=self.accel,
            qmp_socket=p.qmp_socket,
            agent_socket=p.agent_socket,
            console_log=p.console_log,
            pidfile=p.pidfile,
            qemu_log=p.qemu_log,
            # Under TCG the guest's TSC is the host's; telling the kernel its rate avoids
            # a calibration that hangs boot at random (ARCHITECTURE.md, vm/).
            tsc_khz=host_tsc_khz() if self.accel == "tcg" else None,
        )

    async def start(self, rec: SandboxRecord, image: ImageArtifacts) -> QemuRuntime:
        p = self.paths(rec.id)
        p.state.mkdir(parents=True, mode=0o700)
        p.run.mkdir(parents=True, mode=0o700)
        await asyncio.to_thread(create_overlay, image.rootfs, p.disk, rec.shape.disk_gib)
        cfg = self.vm_config(rec, image)
        _write_config(p.vm_json, cfg)
        vm = await QemuVm.launch(cfg)
        try:
            agent = await self._connect_agent(vm, p)
        except BaseException:
            await vm.kill()
            raise
        return QemuRuntime(rec.id, vm, agent, p)

    async def _connect_agent(self, vm: QemuVm, p: SandboxPaths) -> AgentClient:
        """Wait for the guest agent, failing fast if the VM dies while booting."""
        connect = asyncio.ensure_future(
            AgentClient.connect(p.agent_socket, timeout_s=self.settings.boot_timeout_s)
        )
        died = asyncio.ensure_future(vm.wait_exited())
        try:
            done, _ = await asyncio.wait({connect, died}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            died.cancel()
        if connect in done:
            return connect.result()
        connect.cancel()
        with contextlib.suppress(BaseException):
            await connect
        raise VmError(
            "the VM stopped while booting; console tail:\n" + tail(p.console_log, 3000),
            stderr=tail(p.qemu_log, 2000),
        )

    async def adopt(self, rec: SandboxRecord) -> QemuRuntime | None:
        p = self.paths(rec.id)
        cfg = _read_config(p.vm_json)
        if cfg is None:
            return None
        vm = await QemuVm.adopt(cfg)
        if vm is None:
            return None
        try:
            agent = await AgentClient.connect(p.agent_socket, timeout_s=10.0)
        except (GuestError, Timeout) as exc:
            log.warning("sandbox %s: VM alive but its agent does not answer: %s", rec.id, exc)
            await vm.kill()
            return None
        return QemuRuntime(rec.id, vm, agent, p)

    async def cleanup(self, sandbox_id: str) -> None:
        p = self.paths(sandbox_id)
        cfg = _read_config(p.vm_json)
        if cfg is not None:
            try:
                vm = await QemuVm.adopt(cfg)
            except HutchError:
                vm = None
            if vm is not None:
                await vm.kill()
        # A pidfile without vm.json (crash between the two writes) still names a process
        # that must not outlive its sandbox; _kill_verified checks it really is ours.
        _kill_verified(p.pidfile, str(p.run))
        await asyncio.to_thread(shutil.rmtree, p.run, True)
        await asyncio.to_thread(shutil.rmtree, p.state, True)

    def leftover_ids(self) -> set[str]:
        found: set[str] = set()
        for root in (self.settings.sandboxes_dir, self.settings.run_dir):
            if root.is_dir():
                found.update(d.name for d in root.iterdir() if SANDBOX_ID_RE.match(d.name))
        return found


def _write_config(path: Path, cfg: VmConfig) -> None:
    data = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def _read_config(path: Path) -> VmConfig | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        for key in _PATH_FIELDS:
            data[key] = Path(data[key])
        return VmConfig(**data)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _kill_verified(pidfile: Path, marker: str) -> None:
    try:
        pid = int(pidfile.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError):
        return
    if marker in cmdline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
