"""Secrets: the requests of ``client.secrets`` and the one value type, :class:`SecretInfo`.

Write-only by design: ``set`` sends a value, nothing reads one back (the daemon has no
route that answers a value; it uses them itself, as a sandbox's ``env_secrets`` and for
egress credential injection). No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote

from hutch.contract.names import validate_secret_name, validate_secret_value
from hutch.sdk._core import Call, ClientCore, list_of, nothing, one
from hutch.sdk._values import iso, maybe, moment, need

__all__ = ["SecretCalls", "SecretInfo"]


@dataclass(frozen=True)
class SecretInfo:
    """A secret as the daemon describes it: never its value. ``version`` is 1 at create
    and grows by one at each replace; ``updated_at`` is when the current one was set."""

    name: str
    project: str
    version: int
    created_at: datetime | None
    updated_at: datetime | None

    @classmethod
    def from_dict(cls, obj: Any) -> SecretInfo:
        w = "secret"
        return cls(
            name=need(obj, "name", str, w),
            project=maybe(obj, "project", str, w) or "default",
            version=need(obj, "version", int, w),
            created_at=moment(obj, "created_at", w),
            updated_at=moment(obj, "updated_at", w),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "project": self.project,
            "version": self.version,
            "created_at": iso(self.created_at),
            "updated_at": iso(self.updated_at),
        }


class SecretCalls:
    """Builds the ``/v1/secrets`` requests, checked before sending. No I/O."""

    def __init__(self, core: ClientCore) -> None:
        self.core = core

    @staticmethod
    def _path(name: str) -> str:
        return f"/v1/secrets/{quote(validate_secret_name(name), safe='')}"

    def set(self, name: str, value: str) -> Call[SecretInfo]:
        path = self._path(name)
        validate_secret_value(value)
        req = self.core.request("PUT", path, json_body={"value": value})
        return Call(req, one(SecretInfo.from_dict))

    def list(self) -> Call[list[SecretInfo]]:
        return Call(
            self.core.request("GET", "/v1/secrets"), list_of("secrets", SecretInfo.from_dict)
        )

    def get(self, name: str) -> Call[SecretInfo]:
        return Call(self.core.request("GET", self._path(name)), one(SecretInfo.from_dict))

    def delete(self, name: str) -> Call[None]:
        return Call(self.core.request("DELETE", self._path(name)), nothing)
