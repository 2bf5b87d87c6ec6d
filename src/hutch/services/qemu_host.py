"""Where a QEMU sandbox lives on the host, and the file and process chores around it:
the directory layout, ``vm.json`` (the exact VM configuration, so a restarted daemon can
adopt a VM without guessing), finishing and publishing templates, and killing a QEMU
only after checking it is ours.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hutch.crashpoints import crash_point
from hutch.errors import HutchError
from hutch.vm.argv import VmConfig
from hutch.vm.snapshot import MANIFEST_FILE, load_manifest, move_disk
from hutch.vm.snapshot_pending import PENDING_FILE

__all__ = [
    "SandboxPaths",
    "discard_template_build",
    "finish_template",
    "kill_verified",
    "publish_template",
    "read_config",
    "save_written",
    "tail",
    "template_complete",
    "write_config",
]

log = logging.getLogger(__name__)

_KILL_WAIT_S = 5.0

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


def finish_template(snapshot_dir: Path, cfg: VmConfig) -> None:
    """Make a saved snapshot a template: record its VM config, then take its disk in.

    Idempotent, in an order a crash can resume from: ``vm.json`` first (``cfg`` is the
    sandbox's own, which stays in its directory until the disk has moved), then the disk
    (``move_disk`` finishes a move cut short). A ``vm.json`` already there is kept.
    """
    if not (snapshot_dir / "vm.json").is_file():
        write_config(snapshot_dir / "vm.json", cfg)
        crash_point("freeze.config")
    manifest = load_manifest(snapshot_dir)
    if Path(manifest.disk.path) != (snapshot_dir / "disk.qcow2").resolve():
        move_disk(snapshot_dir, snapshot_dir / "disk.qcow2")


def template_complete(snapshot_dir: Path) -> bool:
    """A frozen fork, named snapshot or template with everything a clone needs:
    manifest, vm.json and its disk inside, unchanged since the save."""
    try:
        manifest = load_manifest(snapshot_dir)
    except HutchError:
        return False
    disk = snapshot_dir / "disk.qcow2"
    return (
        (snapshot_dir / "vm.json").is_file()
        and Path(manifest.disk.path) == disk.resolve()
        and manifest.disk.changed(disk) is None
    )


def save_written(snapshot_dir: str | None) -> bool:
    """The save into ``snapshot_dir`` got as far as its pending record (or further)."""
    if snapshot_dir is None:
        return False
    d = Path(snapshot_dir)
    return (d / PENDING_FILE).is_file() or (d / MANIFEST_FILE).is_file()


def publish_template(snapshot_dir: Path, final: Path) -> None:
    """Move a finished template into place. Paths inside its manifest are absolute, so
    the disk is moved (and recorded) first, then the directory is renamed over."""
    final.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(snapshot_dir):
        if name not in ("disk.qcow2", MANIFEST_FILE, "vm.json"):
            os.rename(snapshot_dir / name, final / name)
    move_disk(snapshot_dir, final / "disk.qcow2")
    os.rename(snapshot_dir / MANIFEST_FILE, final / MANIFEST_FILE)
    # vm.json last: its presence marks the template complete.
    os.rename(snapshot_dir / "vm.json", final / "vm.json")


def discard_template_build(state: Path) -> None:
    kill_verified(state / "qemu.pid", "tpl-")
    shutil.rmtree(state, ignore_errors=True)


def write_config(path: Path, cfg: VmConfig) -> None:
    data = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def read_config(path: Path) -> VmConfig | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        for key in _PATH_FIELDS:
            data[key] = Path(data[key])
        if data.get("runtime_disk") is not None:
            data["runtime_disk"] = Path(data["runtime_disk"])
        return VmConfig(**data)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def kill_verified(pidfile: Path, marker: str) -> None:
    try:
        pid = int(pidfile.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError):
        return
    if marker not in cmdline:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    # Files it held (disk, sockets) are only safe to touch once it is really gone.
    deadline = time.monotonic() + _KILL_WAIT_S
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return
        if stat.rpartition(")")[2].split()[0] in ("Z", "X"):
            return
        time.sleep(0.01)
    log.warning("QEMU pid %d did not exit %.0f s after SIGKILL", pid, _KILL_WAIT_S)
