"""What the sandbox service needs from a VM backend.

The production backend (:mod:`hutch.services.qemu_backend`) boots QEMU micro-VMs. Tests of
the service and API may use a verified fake that runs the real guest agent without a VM.
"""

from __future__ import annotations

from typing import Protocol

from hutch.guest.client import AgentClient
from hutch.images.build import ImageArtifacts
from hutch.models import SandboxRecord


class Runtime(Protocol):
    """A live sandbox: its VM and a connected guest agent."""

    sandbox_id: str
    agent: AgentClient

    async def wait_exited(self) -> None:
        """Return when the VM has stopped for any reason."""

    async def destroy(self) -> None:
        """Stop the VM and close the agent. Idempotent; never raises if already gone."""

    def console_tail(self, max_bytes: int = 4096) -> str:
        """The end of the guest's serial console, for error messages."""


class VmBackend(Protocol):
    @property
    def accel(self) -> str:
        """The accelerator VMs run with (kvm, tcg)."""

    async def start(self, rec: SandboxRecord, image: ImageArtifacts) -> Runtime:
        """Create the sandbox's disk, boot it and connect to its agent.

        On failure everything acquired so far is released before raising.
        """

    async def adopt(self, rec: SandboxRecord) -> Runtime | None:
        """Reattach to a sandbox left running by an earlier daemon; None if it is gone."""

    async def cleanup(self, sandbox_id: str) -> None:
        """Remove every trace of a sandbox (process, sockets, disk). Idempotent."""

    def leftover_ids(self) -> set[str]:
        """Sandbox ids that still have a process or files on this host."""
