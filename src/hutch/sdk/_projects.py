"""Projects, their quotas and their API keys (issue 10): requests and answers. No I/O.

:class:`ProjectCalls` builds each request on a :class:`ClientCore` and says how to read
the answer; the async and sync shells (``client.projects``, ``client.keys``) send them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote

from hutch.contract.names import NAME_RE
from hutch.errors import InvalidArgument
from hutch.sdk._core import Call, ClientCore, check_path, list_of, one
from hutch.sdk._values import iso, maybe, moment, need

__all__ = ["QUOTAS", "CreatedKeyInfo", "KeyInfo", "ProjectCalls", "ProjectInfo", "check_project"]

#: The quotas a project has (null/None: unlimited).
QUOTAS = ("max_sandboxes", "max_vcpus", "max_memory_mib", "max_snapshot_bytes")
KEY_ROLES = ("owner", "developer", "operator", "viewer")
_PROJECT_KEY_RE = re.compile(r"^hk_[0-9a-f]{12}_[A-Za-z0-9_-]{43}$")


def check_project(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise InvalidArgument(
            f"project {name!r} is not a project name; use 1-63 lowercase letters, digits and "
            "'-', starting and ending with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class ProjectInfo:
    name: str
    created_at: datetime | None
    #: max_sandboxes, max_vcpus, max_memory_mib, max_snapshot_bytes (None: unlimited).
    quotas: dict[str, int | None]
    #: sandboxes (live), vcpus and memory_mib (of running ones), snapshot_bytes.
    usage: dict[str, int]

    @classmethod
    def from_dict(cls, obj: Any) -> ProjectInfo:
        w = "project"
        quotas = need(obj, "quotas", dict, w)
        usage = need(obj, "usage", dict, w)
        return cls(
            name=need(obj, "name", str, w),
            created_at=moment(obj, "created_at", w),
            quotas={q: maybe(quotas, q, int, w) for q in QUOTAS},
            usage={k: int(v) for k, v in usage.items()},
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "created_at": iso(self.created_at),
            "quotas": dict(self.quotas),
            "usage": dict(self.usage),
        }


@dataclass(frozen=True)
class KeyInfo:
    """A key as listed: never its secret."""

    id: str
    project: str
    name: str
    role: str
    created_at: datetime | None
    created_by: str | None
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None

    @classmethod
    def _fields(cls, obj: Any) -> dict[str, Any]:
        w = "key"
        return dict(
            id=need(obj, "id", str, w),
            project=need(obj, "project", str, w),
            name=need(obj, "name", str, w),
            role=need(obj, "role", str, w),
            created_at=moment(obj, "created_at", w),
            created_by=maybe(obj, "created_by", str, w),
            expires_at=moment(obj, "expires_at", w),
            revoked_at=moment(obj, "revoked_at", w),
            last_used_at=moment(obj, "last_used_at", w),
        )

    @classmethod
    def from_dict(cls, obj: Any) -> KeyInfo:
        return cls(**cls._fields(obj))

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "project": self.project,
            "name": self.name,
            "role": self.role,
            "created_at": iso(self.created_at),
            "created_by": self.created_by,
            "expires_at": iso(self.expires_at),
            "revoked_at": iso(self.revoked_at),
            "last_used_at": iso(self.last_used_at),
        }


@dataclass(frozen=True)
class CreatedKeyInfo(KeyInfo):
    """A new key with its ``secret``: the only time the daemon shows it."""

    secret: str = ""

    @classmethod
    def from_dict(cls, obj: Any) -> CreatedKeyInfo:
        return cls(**cls._fields(obj), secret=need(obj, "secret", str, "key"))

    def __repr__(self) -> str:  # the secret stays out of logs and tracebacks
        return f"CreatedKeyInfo(id={self.id!r}, project={self.project!r}, role={self.role!r})"


def _quotas(quotas: Mapping[str, int | None]) -> dict[str, int | None]:
    for quota, value in quotas.items():
        if quota not in QUOTAS:
            raise InvalidArgument(f"unknown quota {quota!r}; accepted: {', '.join(QUOTAS)}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InvalidArgument(f"quota {quota}={value!r}: a whole number, or None")
    return dict(quotas)


class ProjectCalls:
    def __init__(self, core: ClientCore) -> None:
        self.core = core

    @staticmethod
    def _path(project: str, suffix: str = "") -> str:
        return f"/v1/projects/{quote(check_project(project), safe='')}{suffix}"

    def holds_project_key(self) -> bool:
        """Whether the client's key is a project key (``hk_<12 hex>_<43 chars>``)."""
        return _PROJECT_KEY_RE.match(self.core.config.api_key or "") is not None

    def project_of(self, project: str | None) -> str:
        """``project``, else the client's, else ``default``."""
        return check_project(project or self.core.config.project or "default")

    def create(self, name: str, quotas: Mapping[str, int | None] | None) -> Call[ProjectInfo]:
        body: dict[str, Any] = {"name": check_project(name)}
        if quotas:
            body["quotas"] = _quotas(quotas)
        req = self.core.request("POST", "/v1/projects", json_body=body)
        return Call(req, one(ProjectInfo.from_dict))

    def list_all(self) -> Call[list[ProjectInfo]]:
        return Call(
            self.core.request("GET", "/v1/projects"), list_of("projects", ProjectInfo.from_dict)
        )

    def get(self, name: str) -> Call[ProjectInfo]:
        return Call(self.core.request("GET", self._path(name)), one(ProjectInfo.from_dict))

    def set_quotas(self, name: str, quotas: Mapping[str, int | None]) -> Call[ProjectInfo]:
        body = {"quotas": _quotas(quotas)}
        req = self.core.request("PATCH", self._path(name), json_body=body)
        return Call(req, one(ProjectInfo.from_dict))

    def delete(self, name: str) -> Call[None]:
        return Call(self.core.request("DELETE", self._path(name)), lambda _: None)

    def create_key(
        self,
        project: str | None,
        name: str,
        role: str,
        ttl_s: int | None,
        expires_at: datetime | None,
    ) -> Call[CreatedKeyInfo]:
        if role not in KEY_ROLES:
            raise InvalidArgument(f"role {role!r}: accepted {', '.join(KEY_ROLES)}")
        body: dict[str, Any] = {"name": check_project(name), "role": role}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        if expires_at is not None:
            body["expires_at"] = iso(expires_at)
        req = self.core.request(
            "POST", self._path(self.project_of(project), "/keys"), json_body=body
        )
        return Call(req, one(CreatedKeyInfo.from_dict))

    def list_keys(self, project: str | None) -> Call[list[KeyInfo]]:
        req = self.core.request("GET", self._path(self.project_of(project), "/keys"))
        return Call(req, list_of("keys", KeyInfo.from_dict))

    def revoke_key(self, project: str | None, key_id: str) -> Call[KeyInfo]:
        check_path(key_id, "key id")
        path = self._path(self.project_of(project), f"/keys/{quote(key_id, safe='')}")
        return Call(self.core.request("DELETE", path), one(KeyInfo.from_dict))
