"""Who is calling and what they may do: roles, permissions, and the one table between them.

Pure data, no I/O. The API's auth layer turns a request's key into a :class:`Principal`;
services take the principal (or its project) and record it as the actor of what it did.
The route table in the API names one :class:`Permission` per route, so "may a viewer
delete a sandbox?" is answered here and nowhere else.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "ADMIN_KEY_ID",
    "DEFAULT_PROJECT",
    "ROLE_PERMISSIONS",
    "Permission",
    "Principal",
    "Role",
    "allows",
]

#: The project every existing resource migrates into and admin requests act in by default.
DEFAULT_PROJECT = "default"
#: The key id of the instance-wide key created on first start (``<state>/api-key``).
ADMIN_KEY_ID = "admin"


class Role(enum.StrEnum):
    #: Everything in its project, keys included.
    OWNER = "owner"
    #: Create, use and delete sandboxes, snapshots, networks and images.
    DEVELOPER = "developer"
    #: Use existing sandboxes (exec, files, terminals, processes, pause/resume); read all.
    OPERATOR = "operator"
    #: Read only: lists, inspect, usage, logs, events.
    VIEWER = "viewer"
    #: Instance-wide: manages projects, and acts as owner in any project.
    ADMIN = "admin"


class Permission(enum.StrEnum):
    SANDBOX_READ = "sandbox.read"  # list, inspect, egress rules and log, ports, processes list
    SANDBOX_CREATE = "sandbox.create"
    SANDBOX_USE = "sandbox.use"  # exec, files, terminals, processes, contexts, watch
    SANDBOX_LIFECYCLE = "sandbox.lifecycle"  # pause, resume, timeout changes
    SANDBOX_FORK = "sandbox.fork"
    SANDBOX_DELETE = "sandbox.delete"
    PORT_WRITE = "port.write"  # expose and close ports
    EGRESS_WRITE = "egress.write"  # replace a sandbox's egress rules
    SNAPSHOT_READ = "snapshot.read"
    SNAPSHOT_CREATE = "snapshot.create"
    SNAPSHOT_DELETE = "snapshot.delete"
    NETWORK_READ = "network.read"
    NETWORK_WRITE = "network.write"  # create, delete, attach
    IMAGE_READ = "image.read"
    IMAGE_WRITE = "image.write"  # import, pull, build, delete
    SECRET_READ = "secret.read"  # names, versions, timestamps; never a value
    SECRET_WRITE = "secret.write"
    VOLUME_READ = "volume.read"
    VOLUME_WRITE = "volume.write"
    USAGE_READ = "usage.read"
    EVENTS_READ = "events.read"
    KEY_MANAGE = "key.manage"  # create, list, revoke the project's keys
    PROJECT_READ = "project.read"  # one's own project and its quotas
    PROJECT_MANAGE = "project.manage"  # create, change, delete projects (admin only)
    HOST_MANAGE = "host.manage"  # list the hosts of a cluster, drain one (admin only)


_P = Permission

_READ = frozenset(
    {
        _P.SANDBOX_READ,
        _P.SNAPSHOT_READ,
        _P.NETWORK_READ,
        _P.IMAGE_READ,
        _P.SECRET_READ,
        _P.VOLUME_READ,
        _P.USAGE_READ,
        _P.EVENTS_READ,
        _P.PROJECT_READ,
    }
)
_OPERATE = _READ | {_P.SANDBOX_USE, _P.SANDBOX_LIFECYCLE}
_DEVELOP = _OPERATE | {
    _P.SANDBOX_CREATE,
    _P.SANDBOX_FORK,
    _P.SANDBOX_DELETE,
    _P.PORT_WRITE,
    _P.EGRESS_WRITE,
    _P.SNAPSHOT_CREATE,
    _P.SNAPSHOT_DELETE,
    _P.NETWORK_WRITE,
    _P.IMAGE_WRITE,
    _P.SECRET_WRITE,
    _P.VOLUME_WRITE,
}
_OWN = _DEVELOP | {_P.KEY_MANAGE}

#: The one table: what each role may do inside its project.
ROLE_PERMISSIONS: dict[Role, frozenset[Permission]] = {
    Role.VIEWER: _READ,
    Role.OPERATOR: frozenset(_OPERATE),
    Role.DEVELOPER: frozenset(_DEVELOP),
    Role.OWNER: frozenset(_OWN),
    Role.ADMIN: frozenset(Permission),
}


def allows(role: Role, permission: Permission) -> bool:
    return permission in ROLE_PERMISSIONS[role]


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller of one request, as the auth layer established it.

    ``project`` is the project the request acts in (for admin: ``default`` unless the
    request names another). ``source`` is the client's address, for the audit trail.
    """

    key_id: str
    project: str
    role: Role
    source: str = ""

    def may(self, permission: Permission) -> bool:
        return allows(self.role, permission)

    @classmethod
    def admin(cls, project: str = DEFAULT_PROJECT, source: str = "") -> Principal:
        """The instance key's principal; also what internal work (the reaper, the
        reconciler, idle pause) acts as."""
        return cls(ADMIN_KEY_ID, project, Role.ADMIN, source)
