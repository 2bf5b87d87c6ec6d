"""Request-scoped access to the services."""

from __future__ import annotations

from fastapi import Request
from starlette.requests import HTTPConnection

from hutch.services.files_extra import FilesExtraService
from hutch.services.interpreter import InterpreterService
from hutch.services.processes import ProcessService
from hutch.services.sandboxes import SandboxService


def service(request: Request) -> SandboxService:
    svc: SandboxService = request.app.state.service
    return svc


def processes(conn: HTTPConnection) -> ProcessService:
    """Background processes and terminals (HTTP and WebSocket routes alike)."""
    procs: ProcessService = conn.app.state.processes
    return procs


def interpreter(request: Request) -> InterpreterService:
    """Code-interpreter contexts (a stateless wrapper of the sandbox service)."""
    return InterpreterService(service(request))


def files_extra(request: Request) -> FilesExtraService:
    """File watch and directory archives (a stateless wrapper of the sandbox service)."""
    return FilesExtraService(service(request))
