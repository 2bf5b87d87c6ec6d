"""Request-scoped access to the services: each route depends on the one it uses, taken
from the daemon's :class:`~hutch.services.composed.Services`; and :func:`principal`, the
caller of the request, authenticated and allowed the route's permission."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends
from starlette.requests import HTTPConnection

from hutch.api.auth import PROJECT_HEADER, Authenticator, bearer_token, requested_project
from hutch.api.permissions import permission_for
from hutch.contract.auth import Permission, Principal, Role
from hutch.errors import Forbidden, HutchError, NotFound
from hutch.services.cluster_auth import ClusterSigner
from hutch.services.composed import Services
from hutch.services.events import act_as
from hutch.services.files_extra import FilesExtraService
from hutch.services.guest_ops import GuestOps
from hutch.services.interpreter import InterpreterService
from hutch.services.lifecycle import LifecycleService
from hutch.services.networking import NetworkingService
from hutch.services.processes import ProcessService
from hutch.services.projects import ProjectService
from hutch.services.reaper import Reaper
from hutch.services.sandboxes import SandboxService
from hutch.services.secrets import SecretService
from hutch.services.snapshots import SnapshotService
from hutch.services.usage import UsageService
from hutch.services.volumes import VolumeService


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


def projects(conn: HTTPConnection) -> ProjectService:
    return services(conn).projects


def interpreter(conn: HTTPConnection) -> InterpreterService:
    return services(conn).interpreter


def files_extra(conn: HTTPConnection) -> FilesExtraService:
    return services(conn).files


def authenticate(conn: HTTPConnection, presented: str) -> Principal:
    """The principal of the key ``presented`` on ``conn`` (REST or WebSocket)."""
    auth: Authenticator = conn.app.state.auth
    client = conn.client
    source = client.host if client is not None else ""
    return auth.principal(presented, requested_project(conn.headers.get(PROJECT_HEADER)), source)


def forwarded(conn: HTTPConnection) -> Principal | None:
    """The principal another host of the cluster vouches for (it authenticated the
    caller's key and forwarded the request here, :mod:`hutch.services.cluster_auth`);
    None for a request that came straight from a client. Unauthorized for a forward
    not signed with this cluster's secret."""
    if not ClusterSigner.is_forward(conn.headers):
        return None
    method = "WS" if conn.scope["type"] == "websocket" else conn.scope["method"]
    signer: ClusterSigner = services(conn).cluster.signer
    return signer.verify(conn.headers, method, conn.scope["path"])


def route_permission(conn: HTTPConnection) -> Permission:
    """The permission of the route ``conn`` was matched to (``hutch.api.permissions``)."""
    route = conn.scope.get("route")
    path = getattr(route, "path", None)
    method = "WS" if conn.scope["type"] == "websocket" else conn.scope["method"]
    found = permission_for(method, path) if isinstance(path, str) else None
    if found is None:
        # Refused rather than served open; tests/unit/test_permissions.py catches it first.
        raise HutchError(f"route {method} {path} has no permission in hutch.api.permissions")
    return found


def authorize(conn: HTTPConnection, who: Principal) -> Principal:
    """Check that ``who`` may use the route of ``conn`` and that the ids in its path are
    of ``who``'s project: another project's sandbox or snapshot is not found, exactly as
    a missing one (checked after the permission, so a refusal discloses no id)."""
    permission = route_permission(conn)
    if not who.may(permission):
        raise Forbidden(f"role {who.role} lacks permission {permission} for this request")
    params = conn.path_params
    if "project" in params and who.role is not Role.ADMIN and params["project"] != who.project:
        raise NotFound(f"no project {params['project']!r}")
    if "sandbox_id" in params:
        services(conn).sandboxes.get(params["sandbox_id"], who.project)
    if "snapshot_id" in params:
        services(conn).snapshots.get_snapshot(params["snapshot_id"], who.project)
    conn.state.principal = who
    return who


def principal(conn: HTTPConnection) -> Principal:
    """The caller of a REST request (``Authorization: Bearer <key>``), allowed the route's
    permission in its project. Every authenticated router depends on it; a route takes
    it as a parameter (:data:`Caller`) to pass the principal (or its project) on."""
    found = getattr(conn.state, "principal", None)
    if isinstance(found, Principal):
        return found
    who = forwarded(conn) or authenticate(conn, bearer_token(conn.headers.get("authorization", "")))
    return authorize(conn, who)


#: A route's parameter for the request's principal.
Caller = Annotated[Principal, Depends(principal)]


async def acting(who: Caller) -> None:
    """The request's events record its caller (key id, address) as their actor. Async on
    purpose: it runs in the request's own task, so the context it sets is the route's
    (a sync dependency runs in a worker thread and its context is lost)."""
    act_as(who)


def usage(conn: HTTPConnection) -> UsageService:
    """Usage, cost and the event log."""
    return services(conn).usage


def volumes(conn: HTTPConnection) -> VolumeService:
    return services(conn).volumes


def secrets(conn: HTTPConnection) -> SecretService:
    return services(conn).secrets
