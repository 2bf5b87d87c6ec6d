"""What the sandbox services need from the machine of a sandbox.

Two roles. A :class:`Runtime` is one live machine with its connected guest agent: it
is paused, frozen, continued or destroyed through its own methods, so nothing outside a
backend ever hands a backend's runtime back to it. A :class:`VmBackend` makes runtimes
(boot, clone, restore, adopt) and keeps the host side of sandboxes: their files and
processes, the templates it restores creates from (:class:`Templates`) and the frozen
snapshot directories forks, named snapshots and pauses leave (:class:`SnapshotFiles`).

The production backend (:mod:`hutch.runtime.qemu`) boots QEMU micro-VMs. The component
tests use a verified fake that runs the real guest agent without a VM
(``tests/component/fake_backend.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hutch.guest.client import AgentClient
from hutch.images.build import ImageArtifacts
from hutch.models import PauseMode, SandboxRecord, Shape
from hutch.vm.argv import VolumeDrive

__all__ = ["Runtime", "SnapshotFiles", "TemplateInfo", "Templates", "VmBackend"]


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

    async def pause(self, mode: PauseMode) -> str | None:
        """Stop the VM keeping memory (returns the snapshot dir a resume restores from)
        or only the disk (None: the guest boots again). On success the VM is gone; on
        failure it keeps running with a fresh agent connection."""

    async def freeze(self, snapshot_dir: Path) -> None:
        """Save the VM into ``snapshot_dir`` as the frozen template of a fork or named
        snapshot (state, device config and the disk taken in); the VM is gone after. On
        failure it keeps running with a fresh agent connection."""

    async def retake_identity(self, rec: SandboxRecord) -> None:
        """Reconnect the agent so the guest takes ``rec``'s identity (name, machine-id,
        network): a pooled VM handed out under a name."""

    async def mount_volume(self, serial: str, path: str, *, read_only: bool) -> None:
        """Mount the attached volume disk ``serial`` at ``path`` in the guest."""

    async def mount_shared(self, slot: int, path: str, *, read_only: bool) -> None:
        """Mount the shared volume served on the port of mount ``slot`` at ``path`` in
        the guest (a no-op if it is mounted there: a fork child or a resume has it)."""

    async def freeze_volumes(self, guest_paths: list[str]) -> None:
        """Flush and freeze the volume filesystems at ``guest_paths`` before the VM is
        killed, so each is left clean (its journal checkpointed)."""

    async def grow_disk(self, drive: str, guest_path: str, size_bytes: int) -> None:
        """Grow the disk ``drive`` (``root`` or a volume's ``vol<slot>``) to
        ``size_bytes`` while the VM runs, and the ext4 mounted at ``guest_path`` with it.
        Raises ``VmError``/``GuestError``; on failure the disk may be larger, its
        filesystem not yet (a repeat finishes it)."""


@dataclass(frozen=True)
class TemplateInfo:
    """A template's identity: where it lives (or would) on this host and the key over
    everything it restores only into, which any host that would build it computes the
    same (``hutch.runtime.qemu.template_key``)."""

    #: sha256 hex over the template's inputs (the image's bytes, shape, QEMU build, ...).
    key: str
    #: The directory of the image it is built on, relative to the images directory
    #: (``base/<digest>``, ``oci/sha256-<hex>``); None: not under it (never shared).
    content: str | None
    #: The template's directory on this host.
    path: Path
    #: What the key covers (for messages and the upload's record).
    inputs: Mapping[str, Any] = field(default_factory=dict)
    #: The image's name and the shape, for messages.
    image: str = ""
    shape: str = ""


class Templates(Protocol):
    """Per (image, shape), a frozen snapshot of a booted guest that creates restore."""

    def find(self, image: ImageArtifacts, shape: Shape) -> Path | None:
        """The ready template for (image, shape), if one was built or fetched with the
        key this host would build it with (None too when the image's files are gone).
        Blocking (the key: a few ``stat`` calls, image files hashed once if they carry
        no identity record)."""

    async def build(self, image: ImageArtifacts, shape: Shape) -> Path:
        """Boot once and freeze the template for (image, shape)."""

    def describe(self, image: ImageArtifacts, shape: Shape) -> TemplateInfo:
        """The key and the place of the template for (image, shape), built or not.
        Blocking, as :meth:`find`; ``OSError`` when an image file cannot be read."""

    def local(self) -> list[TemplateInfo]:
        """Every complete template on this host, as recorded beside it. Blocking."""

    def staging(self, image: ImageArtifacts, shape: Shape) -> Path:
        """A new empty directory on the templates' file system, for a fetch of the
        template of (image, shape); removed at the next start if never installed."""

    def install(self, image: ImageArtifacts, shape: Shape, staging: Path) -> Path:
        """Make the fetched template in ``staging`` this host's template for (image,
        shape) and return its directory: checked (its key, QEMU build and VM config
        are this host's), its recorded paths rewritten for this host, its memory file
        sealed, then renamed into place in one step. Blocking. Raises
        ``SnapshotError`` naming what differs; ``staging`` is the caller's to remove."""

    def discard_unfinished(self) -> None:
        """Remove template builds and fetches a stopped daemon left half done."""

    def remove(self, image_name: str) -> list[str]:
        """Remove every template of image ``image_name``; return what was removed."""

    def of_image(self, image_name: str) -> list[str]:
        """The templates of image ``image_name`` on this host (their directory names;
        built or being built): each reads the image's files."""

    def retire(self, image_name: str, digest: str) -> list[str]:
        """Take every finished template of image ``image_name`` at ``digest`` out of
        use at once (before its image's bytes are replaced: a built-in image adopted
        from the blob store) and remove it; return their directory names."""


class SnapshotFiles(Protocol):
    """The frozen snapshot directories on the host (forks, named snapshots, pauses)."""

    async def recover(self, sandbox_id: str, snapshot_dir: str, *, clone: bool) -> bool:
        """A restorable snapshot (complete and not consumed) is there, once a save that
        the daemon's death cut short is finished (the sandbox's VM is ended first); with
        ``clone`` (a fork or named snapshot) once its freeze is finished too."""

    def complete(self, snapshot_dir: Path) -> bool:
        """The frozen snapshot has everything a clone of it needs."""

    def collect(self, live_ids: set[str], keep: set[str]) -> list[str]:
        """Remove snapshots nothing reaches: not in ``keep`` (kept whole) and not under
        any live sandbox's or kept snapshot's disk. Returns their names."""

    def size(self, snapshot_dir: Path) -> int:
        """Bytes the snapshot holds on disk."""

    def estimate(self, rec: SandboxRecord) -> int:
        """Bytes a named snapshot of ``rec`` taken now is expected to hold (what a save
        reserves against the project's quota before its size is known)."""


class VmBackend(Protocol):
    @property
    def templates(self) -> Templates:
        """The templates creates restore from."""

    @property
    def snapshots(self) -> SnapshotFiles:
        """The frozen snapshot directories."""

    @property
    def accel(self) -> str:
        """The accelerator VMs run with (kvm, tcg)."""

    async def start(
        self,
        rec: SandboxRecord,
        image: ImageArtifacts,
        volumes: Sequence[VolumeDrive] = (),
        shares: Sequence[int] = (),
    ) -> Runtime:
        """Create the sandbox's disk, boot it with ``volumes`` attached and a shared
        volume's port for each slot in ``shares``, and connect to its agent.

        On failure everything acquired so far is released before raising.
        """

    async def start_clone(self, rec: SandboxRecord, snapshot_dir: Path) -> Runtime:
        """Start ``rec`` as a copy-on-write clone of a frozen snapshot."""

    async def resume(self, rec: SandboxRecord, resume_from: str | None, *, clone: bool) -> Runtime:
        """Start a paused sandbox from its snapshot (or boot its disk); ``clone``: as one
        more clone of the frozen snapshot ``resume_from``."""

    async def adopt(self, rec: SandboxRecord) -> Runtime | None:
        """Reattach to a sandbox left running by an earlier daemon; None if it is gone
        (or was only half restored: then it is ended, and its snapshot left whole)."""

    def pause_dir(self, sandbox_id: str) -> Path:
        """Where a memory-mode pause of this sandbox is saved."""

    def rehome(self, rec: SandboxRecord) -> None:
        """The sandbox's files came from another host (a cross-host resume): point its
        recorded VM configuration at this host's paths (disk, sockets, logs, tap, RAM
        file). Raises VmError when there is no configuration to rewrite."""

    def share_socket(self, sandbox_id: str, slot: int) -> Path:
        """The socket hutchd connects to for the shared volume in mount ``slot``."""

    def disk_path(self, sandbox_id: str) -> Path:
        """The sandbox's own disk (a qcow2 overlay on its image)."""

    def fork_dir(self, snapshot_id: str) -> Path:
        """Where a fork or named snapshot lives."""

    async def kill_vm(self, sandbox_id: str) -> None:
        """End the sandbox's VM process if one is left (its files stay). Idempotent."""

    async def cleanup(self, sandbox_id: str) -> None:
        """Remove every trace of a sandbox (process, sockets, disk). Idempotent."""

    def close(self) -> None:
        """Give back what the backend holds for itself (its cgroup sub-tree once empty);
        VMs keep running, for the next start to adopt."""

    def leftover_ids(self) -> set[str]:
        """Sandbox ids that still have a process or files on this host."""
