"""The one table of routes and the permission each needs.

Every route the REST app serves is a key here, ``(METHOD, path template)`` (``WS`` for a
WebSocket), and maps to exactly one :class:`~hutch.contract.auth.Permission`; what a role
may do is ``hutch.contract.auth.ROLE_PERMISSIONS``'s, never decided here. A route missing
from the table is refused at request time (500, so it cannot slip through open) and fails
``tests/unit/test_permissions.py`` before it ships; the real-daemon table test
(``tests/e2e/test_roles.py``) walks this table for every role.

``PUBLIC`` routes need no key at all (health, the spec).
"""

from __future__ import annotations

from hutch.contract.auth import Permission

__all__ = ["PUBLIC", "ROUTE_PERMISSIONS", "SELF_CHECKED", "permission_for"]

P = Permission
_SB = "/v1/sandboxes/{sandbox_id}"

#: Routes served without a key.
PUBLIC: frozenset[tuple[str, str]] = frozenset(
    {
        ("GET", "/healthz"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("GET", "/docs/oauth2-redirect"),
        ("GET", "/redoc"),
        # The web console's static files: they hold no data (every datum comes from
        # /v1 with the signed-in key), so fetching them needs none.
        ("GET", "/ui"),
        ("GET", "/ui/"),
        ("GET", "/ui/{name:path}"),
    }
)

#: Routes that check a credential of their own instead of a role's permission:
#: ``GET /metrics`` takes the scrape token (``<state>/metrics-token``) or the admin key
#: (``hutch.api.routes.metrics``).
SELF_CHECKED: frozenset[tuple[str, str]] = frozenset({("GET", "/metrics")})

ROUTE_PERMISSIONS: dict[tuple[str, str], Permission] = {
    # who am I: any key may learn its own id, project and role (the console's buttons)
    ("GET", "/v1/whoami"): P.PROJECT_READ,
    # secrets: reading is names, versions and times; no route reads a value
    ("GET", "/v1/secrets"): P.SECRET_READ,
    ("GET", "/v1/secrets/{name}"): P.SECRET_READ,
    ("PUT", "/v1/secrets/{name}"): P.SECRET_WRITE,
    ("DELETE", "/v1/secrets/{name}"): P.SECRET_WRITE,
    # images
    ("GET", "/v1/images"): P.IMAGE_READ,
    ("POST", "/v1/images"): P.IMAGE_WRITE,
    ("DELETE", "/v1/images/{name}"): P.IMAGE_WRITE,
    # sandboxes
    ("POST", "/v1/sandboxes"): P.SANDBOX_CREATE,
    ("GET", "/v1/sandboxes"): P.SANDBOX_READ,
    ("GET", _SB): P.SANDBOX_READ,
    ("DELETE", _SB): P.SANDBOX_DELETE,
    ("POST", f"{_SB}/pause"): P.SANDBOX_LIFECYCLE,
    ("POST", f"{_SB}/resume"): P.SANDBOX_LIFECYCLE,
    ("POST", f"{_SB}/fork"): P.SANDBOX_FORK,
    ("POST", f"{_SB}/snapshots"): P.SNAPSHOT_CREATE,
    # snapshots
    ("GET", "/v1/snapshots"): P.SNAPSHOT_READ,
    ("GET", "/v1/snapshots/{snapshot_id}"): P.SNAPSHOT_READ,
    ("DELETE", "/v1/snapshots/{snapshot_id}"): P.SNAPSHOT_DELETE,
    # exec and files: using the sandbox (what runs there may read anything in it)
    ("POST", f"{_SB}/exec"): P.SANDBOX_USE,
    ("GET", f"{_SB}/files/watch"): P.SANDBOX_USE,
    ("GET", f"{_SB}/files/archive"): P.SANDBOX_USE,
    ("PUT", f"{_SB}/files/archive"): P.SANDBOX_USE,
    ("PUT", f"{_SB}/files"): P.SANDBOX_USE,
    ("GET", f"{_SB}/files"): P.SANDBOX_USE,
    ("GET", f"{_SB}/files/list"): P.SANDBOX_USE,
    ("GET", f"{_SB}/files/stat"): P.SANDBOX_USE,
    ("DELETE", f"{_SB}/files"): P.SANDBOX_USE,
    ("POST", f"{_SB}/files/mkdir"): P.SANDBOX_USE,
    ("POST", f"{_SB}/files/rename"): P.SANDBOX_USE,
    # code contexts: listing them is reading; running code is using
    ("POST", f"{_SB}/contexts"): P.SANDBOX_USE,
    ("GET", f"{_SB}/contexts"): P.SANDBOX_READ,
    ("GET", f"{_SB}/contexts/{{context_id}}"): P.SANDBOX_READ,
    ("DELETE", f"{_SB}/contexts/{{context_id}}"): P.SANDBOX_USE,
    ("POST", f"{_SB}/contexts/{{context_id}}/interrupt"): P.SANDBOX_USE,
    ("POST", f"{_SB}/contexts/{{context_id}}/restart"): P.SANDBOX_USE,
    ("POST", f"{_SB}/contexts/{{context_id}}/run"): P.SANDBOX_USE,
    # background processes: the list is reading; output, stdin, signals are using
    ("POST", f"{_SB}/processes"): P.SANDBOX_USE,
    ("GET", f"{_SB}/processes"): P.SANDBOX_READ,
    ("GET", f"{_SB}/processes/{{pid}}"): P.SANDBOX_READ,
    ("GET", f"{_SB}/processes/{{pid}}/output"): P.SANDBOX_USE,
    ("POST", f"{_SB}/processes/{{pid}}/stdin"): P.SANDBOX_USE,
    ("POST", f"{_SB}/processes/{{pid}}/signal"): P.SANDBOX_USE,
    ("POST", f"{_SB}/processes/{{pid}}/wait"): P.SANDBOX_USE,
    ("DELETE", f"{_SB}/processes/{{pid}}"): P.SANDBOX_USE,
    # terminals
    ("GET", f"{_SB}/ptys"): P.SANDBOX_READ,
    ("DELETE", f"{_SB}/ptys/{{pty_id}}"): P.SANDBOX_USE,
    ("WS", f"{_SB}/pty"): P.SANDBOX_USE,
    # egress and ports
    ("GET", f"{_SB}/egress"): P.SANDBOX_READ,
    ("PUT", f"{_SB}/egress"): P.EGRESS_WRITE,
    ("GET", f"{_SB}/egress/log"): P.SANDBOX_READ,
    ("GET", f"{_SB}/egress/suggest"): P.SANDBOX_READ,
    ("POST", f"{_SB}/egress/dry-run"): P.SANDBOX_READ,
    # named egress policies of the project (issue 12): reading them is reading the
    # network setup; writing them is writing egress (no new permission)
    ("GET", "/v1/egress-policies"): P.NETWORK_READ,
    ("GET", "/v1/egress-policies/{name}"): P.NETWORK_READ,
    ("PUT", "/v1/egress-policies/{name}"): P.EGRESS_WRITE,
    ("DELETE", "/v1/egress-policies/{name}"): P.EGRESS_WRITE,
    ("POST", f"{_SB}/ports"): P.PORT_WRITE,
    ("GET", f"{_SB}/ports"): P.SANDBOX_READ,
    ("DELETE", f"{_SB}/ports/{{port}}"): P.PORT_WRITE,
    # private networks
    ("POST", "/v1/networks"): P.NETWORK_WRITE,
    ("GET", "/v1/networks"): P.NETWORK_READ,
    ("GET", "/v1/networks/{network_id}"): P.NETWORK_READ,
    ("DELETE", "/v1/networks/{network_id}"): P.NETWORK_WRITE,
    ("POST", f"{_SB}/networks"): P.NETWORK_WRITE,
    ("DELETE", f"{_SB}/networks/{{network_id}}"): P.NETWORK_WRITE,
    # usage and the event log
    ("GET", "/v1/usage"): P.USAGE_READ,
    ("GET", "/v1/events"): P.EVENTS_READ,
    ("GET", f"{_SB}/events"): P.EVENTS_READ,
    # projects (admin) and their keys (owner)
    ("POST", "/v1/projects"): P.PROJECT_MANAGE,
    ("GET", "/v1/projects"): P.PROJECT_READ,
    ("GET", "/v1/projects/{project}"): P.PROJECT_READ,
    ("PATCH", "/v1/projects/{project}"): P.PROJECT_MANAGE,
    ("DELETE", "/v1/projects/{project}"): P.PROJECT_MANAGE,
    # the hosts of a cluster: instance-wide, admin only
    ("GET", "/v1/hosts"): P.HOST_MANAGE,
    ("GET", "/v1/hosts/{host_id}"): P.HOST_MANAGE,
    ("POST", "/v1/hosts/{host_id}/drain"): P.HOST_MANAGE,
    ("POST", "/v1/hosts/{host_id}/undrain"): P.HOST_MANAGE,
    # Host to host: a fork's children placed on that host (signed as the project's admin).
    ("POST", "/v1/hosts/{host_id}/clones"): P.HOST_MANAGE,
    ("POST", "/v1/projects/{project}/keys"): P.KEY_MANAGE,
    ("GET", "/v1/projects/{project}/keys"): P.KEY_MANAGE,
    ("DELETE", "/v1/projects/{project}/keys/{key_id}"): P.KEY_MANAGE,
    # volumes (a create that mounts one also needs volume.write, or volume.read for
    # read-only mounts: checked by the create route)
    ("POST", "/v1/volumes"): P.VOLUME_WRITE,
    ("GET", "/v1/volumes"): P.VOLUME_READ,
    ("GET", "/v1/volumes/{volume}"): P.VOLUME_READ,
    ("PATCH", "/v1/volumes/{volume}"): P.VOLUME_WRITE,
    ("DELETE", "/v1/volumes/{volume}"): P.VOLUME_WRITE,
    # growing a sandbox's own disk takes host storage, as a create does
    ("PATCH", _SB): P.SANDBOX_CREATE,
}


def permission_for(method: str, path: str) -> Permission | None:
    """The permission of a route (``path`` is its template), None if it has none."""
    return ROUTE_PERMISSIONS.get((method, path))
