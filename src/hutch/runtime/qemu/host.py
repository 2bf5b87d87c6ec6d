"""Where a QEMU sandbox lives on the host: the directory layout (ARCHITECTURE.md, "State
on disk") and ``vm.json``, the exact VM configuration, so a restarted daemon can adopt
a VM without guessing."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hutch.config import Settings
from hutch.models import SANDBOX_ID_RE
from hutch.vm.argv import SharePort, VmConfig, VolumeDrive

__all__ = ["HostLayout", "SandboxPaths", "read_config", "write_config"]

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

    def share_socket(self, slot: int) -> Path:
        """The chardev socket of the shared volume mounted in ``slot``."""
        return self.run / f"share{slot}.sock"

    def relocate(self, cfg: VmConfig) -> VmConfig:
        """``cfg`` with this sandbox's own files: disk, QMP and agent sockets, console and
        QEMU logs, pidfile, and each shared-volume port (the same slots: the device set
        a snapshot was taken with) on its own socket. Everything else is ``cfg``'s."""
        return replace(
            cfg,
            disk=self.disk,
            qmp_socket=self.qmp_socket,
            agent_socket=self.agent_socket,
            console_log=self.console_log,
            pidfile=self.pidfile,
            qemu_log=self.qemu_log,
            shares=tuple(SharePort(s.slot, self.share_socket(s.slot)) for s in cfg.shares),
        )


class HostLayout:
    """The directories of one daemon's sandboxes, snapshots and templates."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def paths(self, sandbox_id: str) -> SandboxPaths:
        return SandboxPaths(
            state=self.settings.sandboxes_dir / sandbox_id,
            run=self.settings.run_dir / sandbox_id,
        )

    def pause_dir(self, sandbox_id: str) -> Path:
        return self.paths(sandbox_id).state / "pause"

    @property
    def snapshots_root(self) -> Path:
        return self.settings.state_dir / "snapshots"

    @property
    def templates_root(self) -> Path:
        return self.settings.state_dir / "templates"

    def fork_dir(self, snapshot_id: str) -> Path:
        return self.snapshots_root / snapshot_id

    def leftover_ids(self) -> set[str]:
        """Sandbox ids with a directory (files or sockets) on this host."""
        found: set[str] = set()
        for root in (self.settings.sandboxes_dir, self.settings.run_dir):
            if root.is_dir():
                found.update(d.name for d in root.iterdir() if SANDBOX_ID_RE.match(d.name))
        return found


def write_config(path: Path, cfg: VmConfig) -> None:
    data = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))  # default: Paths in volumes
    os.replace(tmp, path)


def read_config(path: Path) -> VmConfig | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        for key in _PATH_FIELDS:
            data[key] = Path(data[key])
        for optional in ("runtime_disk", "memory_file"):
            if data.get(optional) is not None:
                data[optional] = Path(data[optional])
        data["volumes"] = tuple(
            VolumeDrive(Path(v["path"]), v["serial"], bool(v["read_only"]), v.get("slot"))
            for v in data.get("volumes", ())
        )
        data["shares"] = tuple(
            SharePort(int(v["slot"]), Path(v["socket"])) for v in data.get("shares", ())
        )
        return VmConfig(**data)
    except (OSError, ValueError, TypeError, KeyError):
        return None
