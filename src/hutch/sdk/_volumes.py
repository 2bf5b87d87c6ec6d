"""Volumes, sans-IO: the requests of ``/v1/volumes`` and of growing a sandbox's disk, and
what they answer (:class:`VolumeInfo`). The shells are ``_async/volumes.py`` and,
generated from it, ``_sync/volumes.py``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote

from hutch.contract.names import validate_name
from hutch.contract.volumes import (
    VolumeKind,
    VolumeMount,
    parse_size,
    parse_volume_flag,
    validate_mounts,
    validate_size,
)
from hutch.errors import InvalidArgument
from hutch.sdk._core import Call, ClientCore, list_of, nothing, one
from hutch.sdk._values import iso, maybe, moment, need

__all__ = ["MountArg", "VolumeCalls", "VolumeInfo", "VolumeUser", "mounts_body"]

#: What ``volumes=[...]`` of a create takes per volume: a :class:`VolumeMount`, a dict
#: ``{"volume", "path", "read_only"}`` or the CLI form ``"NAME:/path[:ro]"``.
MountArg = VolumeMount | Mapping[str, Any] | str


def _mount(arg: MountArg) -> VolumeMount:
    if isinstance(arg, VolumeMount):
        return arg
    if isinstance(arg, str):
        return parse_volume_flag(arg)
    if isinstance(arg, Mapping):
        unknown = sorted(set(arg) - {"volume", "path", "read_only"})
        if unknown or "volume" not in arg or "path" not in arg:
            raise InvalidArgument(
                f"volume mount {dict(arg)!r}: give 'volume' and 'path' (and 'read_only')"
            )
        return VolumeMount(str(arg["volume"]), str(arg["path"]), bool(arg.get("read_only")))
    raise InvalidArgument(f"volume mount {arg!r}: give a VolumeMount, a dict or 'NAME:/path'")


def mounts_body(mounts: Sequence[MountArg]) -> list[dict[str, Any]]:
    """The create body's ``volumes``, checked before sending."""
    if isinstance(mounts, str | Mapping):
        raise InvalidArgument("volumes must be a list of mounts")
    checked = validate_mounts(_mount(m) for m in mounts)
    return [{"volume": m.volume, "path": m.path, "read_only": m.read_only} for m in checked]


@dataclass(frozen=True)
class VolumeUser:
    sandbox_id: str
    path: str
    read_only: bool


@dataclass(frozen=True)
class VolumeInfo:
    """A volume: ``size`` (bytes, the device the guest sees), ``used`` (bytes its file
    takes on the host, None if unknown), the sandboxes that mount it and ``host``, the
    host whose disk holds its file (sandboxes that mount it run there)."""

    id: str
    name: str
    project: str
    kind: str
    size: int
    used: int | None
    created_at: datetime | None
    mounted_by: list[VolumeUser]
    host: str | None = None

    @classmethod
    def from_dict(cls, obj: Any) -> VolumeInfo:
        w = "volume"
        users = need(obj, "mounted_by", list, w)
        return cls(
            id=need(obj, "id", str, w),
            name=need(obj, "name", str, w),
            project=need(obj, "project", str, w),
            kind=need(obj, "kind", str, w),
            size=need(obj, "size", int, w),
            used=maybe(obj, "used", int, w),
            created_at=moment(obj, "created_at", w),
            mounted_by=[
                VolumeUser(
                    need(u, "sandbox_id", str, "volume user"),
                    need(u, "path", str, "volume user"),
                    bool(u.get("read_only")),
                )
                for u in users
            ],
            host=maybe(obj, "host", str, w),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "project": self.project,
            "kind": self.kind,
            "size": self.size,
            "used": self.used,
            "created_at": iso(self.created_at),
            "mounted_by": [
                {"sandbox_id": u.sandbox_id, "path": u.path, "read_only": u.read_only}
                for u in self.mounted_by
            ],
            "host": self.host,
        }


class VolumeCalls:
    """Builds every volume request of API v1 and reads every answer. No I/O."""

    def __init__(self, core: ClientCore) -> None:
        self.core = core

    def _path(self, volume: str) -> str:
        if not isinstance(volume, str) or not volume or "/" in volume:
            raise InvalidArgument(f"volume {volume!r}: give its id or name")
        return f"/v1/volumes/{quote(volume, safe='')}"

    def create(self, name: str, size: int | str, kind: str = "exclusive") -> Call[VolumeInfo]:
        try:
            kind = VolumeKind(kind).value
        except ValueError:
            raise InvalidArgument(
                f"volume kind {kind!r}; accepted: {', '.join(k.value for k in VolumeKind)}"
            ) from None
        body = {"name": validate_name(name), "size": validate_size(parse_size(size)), "kind": kind}
        return Call(
            self.core.request("POST", "/v1/volumes", json_body=body), one(VolumeInfo.from_dict)
        )

    def list(self) -> Call[list[VolumeInfo]]:
        return Call(
            self.core.request("GET", "/v1/volumes"), list_of("volumes", VolumeInfo.from_dict)
        )

    def get(self, volume: str) -> Call[VolumeInfo]:
        return Call(self.core.request("GET", self._path(volume)), one(VolumeInfo.from_dict))

    def grow(self, volume: str, size: int | str) -> Call[VolumeInfo]:
        body = {"size": validate_size(parse_size(size))}
        req = self.core.request("PATCH", self._path(volume), json_body=body)
        return Call(req, one(VolumeInfo.from_dict))

    def delete(self, volume: str) -> Call[None]:
        return Call(self.core.request("DELETE", self._path(volume)), nothing)
