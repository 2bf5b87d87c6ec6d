"""Hosts of a cluster: the requests of ``client.hosts`` and :class:`HostInfo`. Admin
keys only (permission ``host.manage``). No I/O here."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import quote

from hutch.sdk._core import Call, ClientCore, check_path, list_of, one
from hutch.sdk._values import iso, maybe, moment, need

__all__ = ["HostCalls", "HostInfo"]


@dataclass(frozen=True)
class HostInfo:
    """A host: ``state`` up, draining or down (``down_reason`` says why); capacity
    (``vcpus``, ``memory_mib`` its sandboxes may reserve, ``disk_gib`` free,
    ``max_sandboxes``) and use (``sandboxes`` live, ``running`` with a VM,
    ``used_vcpus``, ``used_memory_mib``); ``this``: the host that answered."""

    id: str
    address: str
    role: str
    state: str
    this: bool
    accel: str
    qemu_version: str
    cpu_model: str
    vcpus: int
    memory_mib: int
    disk_gib: int
    max_sandboxes: int
    sandboxes: int
    running: int
    used_vcpus: int
    used_memory_mib: int
    labels: dict[str, str] = field(default_factory=dict)
    lease_until: datetime | None = None
    down_at: datetime | None = None
    down_reason: str | None = None

    @classmethod
    def from_dict(cls, obj: Any) -> HostInfo:
        w = "host"
        cap = need(obj, "capacity", dict, w)
        use = need(obj, "use", dict, w)
        return cls(
            id=need(obj, "id", str, w),
            address=need(obj, "address", str, w),
            role=need(obj, "role", str, w),
            state=need(obj, "state", str, w),
            this=bool(maybe(obj, "this", bool, w)),
            accel=need(obj, "accel", str, w),
            qemu_version=need(obj, "qemu_version", str, w),
            cpu_model=need(obj, "cpu_model", str, w),
            vcpus=need(cap, "vcpus", int, w),
            memory_mib=need(cap, "memory_mib", int, w),
            disk_gib=need(cap, "disk_gib", int, w),
            max_sandboxes=need(cap, "max_sandboxes", int, w),
            sandboxes=need(use, "sandboxes", int, w),
            running=need(use, "running", int, w),
            used_vcpus=need(use, "vcpus", int, w),
            used_memory_mib=need(use, "memory_mib", int, w),
            labels={str(k): str(v) for k, v in (maybe(obj, "labels", dict, w) or {}).items()},
            lease_until=moment(obj, "lease_until", w),
            down_at=moment(obj, "down_at", w),
            down_reason=maybe(obj, "down_reason", str, w),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "address": self.address,
            "role": self.role,
            "state": self.state,
            "this": self.this,
            "accel": self.accel,
            "qemu_version": self.qemu_version,
            "cpu_model": self.cpu_model,
            "labels": dict(self.labels),
            "capacity": {
                "vcpus": self.vcpus,
                "memory_mib": self.memory_mib,
                "disk_gib": self.disk_gib,
                "max_sandboxes": self.max_sandboxes,
            },
            "use": {
                "sandboxes": self.sandboxes,
                "running": self.running,
                "vcpus": self.used_vcpus,
                "memory_mib": self.used_memory_mib,
            },
            "lease_until": iso(self.lease_until),
            "down_at": iso(self.down_at),
            "down_reason": self.down_reason,
        }


class HostCalls:
    """Builds the ``/v1/hosts`` requests. No I/O."""

    def __init__(self, core: ClientCore) -> None:
        self.core = core

    @staticmethod
    def _path(host_id: str) -> str:
        return f"/v1/hosts/{quote(check_path(host_id, 'host id'), safe='')}"

    def list(self) -> Call[list[HostInfo]]:
        return Call(self.core.request("GET", "/v1/hosts"), list_of("hosts", HostInfo.from_dict))

    def get(self, host_id: str) -> Call[HostInfo]:
        return Call(self.core.request("GET", self._path(host_id)), one(HostInfo.from_dict))

    def drain(self, host_id: str, *, undo: bool = False) -> Call[HostInfo]:
        action = "undrain" if undo else "drain"
        req = self.core.request(
            "POST", f"{self._path(host_id)}/{action}", read_timeout=self.core.config.timeouts.create
        )
        return Call(req, one(HostInfo.from_dict))
