"""What the sandbox service needs from a VM backend.

The production backend (:mod:`hutch.services.qemu_backend`) boots QEMU micro-VMs. Tests of
the service and API may use a verified fake that runs the real guest agent without a VM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from hutch.guest.client import AgentClient
from hutch.images.build import ImageArtifacts
from hutch.models import PauseMode, SandboxRecord, Shape


class Runtime(Protocol):
    """A live sandbox: its VM and a connected guest agent."""

    sandbox_id: str
    agent: AgentClient

    async def wait_exited(self) -> None:
        """Return when the VM has stopped for any reason."""

    def exit_reason(self) -> str | None:
        """Why the VM stopped, once it has, when known: "out of memory: ..." (the host
        killed it at its memory limit), "exit status N", "signal SIGx"."""

    async def destroy(self) -> None:
        """Stop the VM and close the agent. Idempotent; never raises if already gone."""

    def console_tail(self, max_bytes: int = 4096) -> str:
        """The end of the guest's serial console, for error messages."""

    async def cont(self) -> None:
        """Let a VM stopped by an interrupted pause run again."""


class VmBackend(Protocol):
    @property
    def accel(self) -> str:
        """The accelerator VMs run with (kvm, tcg)."""

    async def start(self, rec: SandboxRecord, image: ImageArtifacts) -> Runtime:
        """Create the sandbox's disk, boot it and connect to its agent.

        On failure everything acquired so far is released before raising.
        """

    async def adopt(self, rec: SandboxRecord) -> Runtime | None:
        """Reattach to a sandbox left running by an earlier daemon; None if it is gone
        (or was only half restored: then it is ended, and its snapshot left whole)."""

    async def cleanup(self, sandbox_id: str) -> None:
        """Remove every trace of a sandbox (process, sockets, disk). Idempotent."""

    async def kill_vm(self, sandbox_id: str) -> None:
        """End the sandbox's VM process if one is left (its files stay). Idempotent."""

    def close(self) -> None:
        """Give back what the backend holds for itself (its cgroup sub-tree once empty);
        VMs keep running, for the next start to adopt."""

    def leftover_ids(self) -> set[str]:
        """Sandbox ids that still have a process or files on this host."""

    async def pause(self, runtime: Any, mode: PauseMode) -> str | None:
        """Stop the VM keeping memory (returns the snapshot dir) or only the disk (None).

        On failure the VM keeps running with a fresh agent connection.
        """

    async def resume(self, rec: SandboxRecord, resume_from: str | None, *, clone: bool) -> Runtime:
        """Start a paused sandbox from its snapshot (or boot its disk); ``clone``: as one
        more clone of the frozen snapshot ``resume_from``."""

    def pause_dir(self, sandbox_id: str) -> Path:
        """Where a memory-mode pause of this sandbox is saved."""

    def fork_dir(self, snapshot_id: str) -> Path:
        """Where a fork snapshot lives."""

    async def freeze_for_fork(self, runtime: Any, snapshot_dir: Path) -> None:
        """Save the VM into ``snapshot_dir`` as the frozen template of a fork; QEMU exits."""

    async def start_clone(self, rec: SandboxRecord, snapshot_dir: Path) -> Runtime:
        """Start ``rec`` as a copy-on-write clone of a frozen snapshot."""

    async def retake_identity(self, runtime: Any, rec: SandboxRecord) -> None:
        """Reconnect the agent so the guest takes ``rec``'s identity (name, machine-id)."""

    def find_template(self, image: ImageArtifacts, shape: Shape) -> Path | None:
        """The ready template snapshot for (image, shape), if one was built."""

    async def build_template(self, image: ImageArtifacts, shape: Shape) -> Path:
        """Boot once and freeze the template for (image, shape)."""

    def discard_unfinished_templates(self) -> None:
        """Remove template builds a stopped daemon left half done."""

    async def recover_snapshot(self, sandbox_id: str, snapshot_dir: str, *, clone: bool) -> bool:
        """A restorable snapshot (complete and not consumed) is there, once a save that
        the daemon's death cut short is finished (the sandbox's VM is ended first); with
        ``clone`` (a fork or named snapshot) once its freeze is finished too."""

    def snapshot_complete(self, snapshot_dir: Path) -> bool:
        """The frozen snapshot has everything a clone of it needs."""

    def collect_snapshots(self, live_ids: set[str], keep: set[str]) -> list[str]:
        """Remove snapshots nothing reaches: not in ``keep`` (kept whole) and not under
        any live sandbox's or kept snapshot's disk."""

    def snapshot_size(self, snapshot_dir: Path) -> int:
        """Bytes the snapshot holds on disk."""
