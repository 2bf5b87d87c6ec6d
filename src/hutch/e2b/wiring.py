"""The one place the E2B face meets hutch's services.

Every route of the face reaches hutch through a :class:`Hutch`: the same service objects
the REST API uses (no second copy of any logic), built from the daemon's sandbox service
here and nowhere else. When the services are recomposed (the daemon as composition root,
services split by concern), this module is what is re-pointed.
"""

from __future__ import annotations

from dataclasses import dataclass

from hutch.services.files_extra import FilesExtraService
from hutch.services.interpreter import InterpreterService
from hutch.services.processes import ProcessService
from hutch.services.sandboxes import SandboxService

__all__ = ["Hutch"]


@dataclass(frozen=True)
class Hutch:
    sandboxes: SandboxService
    processes: ProcessService
    interpreter: InterpreterService
    files: FilesExtraService

    @classmethod
    def of(cls, sandboxes: SandboxService) -> Hutch:
        return cls(
            sandboxes=sandboxes,
            processes=ProcessService(sandboxes),
            interpreter=InterpreterService(sandboxes),
            files=FilesExtraService(sandboxes),
        )
