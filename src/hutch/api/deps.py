"""Request-scoped access to the services: each route depends on the one it uses, taken
from the daemon's :class:`~hutch.services.composed.Services`."""

from __future__ import annotations

from starlette.requests import HTTPConnection

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
from hutch.services.usage import UsageService


def services(conn: HTTPConnection) -> Services:
    found: Services = conn.app.state.services
    return found


def sandboxes(conn: HTTPConnection) -> SandboxService:
    return services(conn).sandboxes


def lifecycle(conn: HTTPConnection) -> LifecycleService:
    return services(conn).lifecycle


def snapshots(conn: HTTPConnection) -> SnapshotService:
    return services(conn).snapshots


def guest(conn: HTTPConnection) -> GuestOps:
    return services(conn).guest


def networking(conn: HTTPConnection) -> NetworkingService:
    return services(conn).networking


def reaper(conn: HTTPConnection) -> Reaper:
    return services(conn).reaper


def processes(conn: HTTPConnection) -> ProcessService:
    """Background processes and terminals (HTTP and WebSocket routes alike)."""
    return services(conn).processes


def interpreter(conn: HTTPConnection) -> InterpreterService:
    return services(conn).interpreter


def files_extra(conn: HTTPConnection) -> FilesExtraService:
    return services(conn).files


def usage(conn: HTTPConnection) -> UsageService:
    """Usage, cost and the event log."""
    return services(conn).usage
