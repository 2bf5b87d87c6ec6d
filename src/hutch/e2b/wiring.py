"""The one place the E2B face meets hutch's services.

Every route of the face reaches hutch through a :class:`Hutch`: the same service objects
the REST API uses (no second copy of any logic), taken from the daemon's composed
:class:`~hutch.services.composed.Services` here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hutch.services.composed import Services
from hutch.services.files_extra import FilesExtraService
from hutch.services.guest_ops import GuestOps
from hutch.services.interpreter import InterpreterService
from hutch.services.lifecycle import LifecycleService
from hutch.services.networking import NetworkingService
from hutch.services.processes import ProcessService
from hutch.services.reaper import Reaper
from hutch.services.sandboxes import SandboxService
from hutch.services.snapshots import SnapshotService

__all__ = ["Hutch"]


@dataclass(frozen=True)
class Hutch:
    sandboxes: SandboxService
    lifecycle: LifecycleService
    snapshots: SnapshotService
    guest: GuestOps
    networking: NetworkingService
    policies: Reaper
    processes: ProcessService
    interpreter: InterpreterService
    files: FilesExtraService
    #: The wall clock of the sandboxes' deadlines (tests move it).
    clock: Callable[[], float]

    @classmethod
    def of(cls, services: Services) -> Hutch:
        core = services.core
        return cls(
            sandboxes=services.sandboxes,
            lifecycle=services.lifecycle,
            snapshots=services.snapshots,
            guest=services.guest,
            networking=services.networking,
            policies=services.reaper,
            processes=services.processes,
            interpreter=services.interpreter,
            files=services.files,
            clock=lambda: core.clock(),
        )
