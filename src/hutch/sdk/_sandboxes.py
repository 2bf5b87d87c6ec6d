"""Sandboxes in the SDK, sans-IO: create, list, get, delete, pause, resume, fork, named
snapshots, images and health. :class:`SandboxCalls` builds each request and says how to
read its answer; the value types are what the calls return (frozen, parsed from the API's
JSON; ``to_dict()`` gives back the API form, which the CLI's ``--json`` prints).

The 17 create fields are declared once, in the contract
(:class:`hutch.contract.requests.CreateRequest`); :class:`CreateArgs` types them as
keyword arguments for the handles and the clients, and :func:`create_body` checks them
and builds the body.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, TypedDict
from urllib.parse import quote

from hutch.contract.enums import DEFAULT_PAUSE_MODE, NetworkMode, PauseMode
from hutch.contract.limits import (
    AUTO_DELETE_S_RANGE,
    AUTO_PAUSE_S_RANGE,
    DEFAULT_FORK_COUNT,
    DISK_GIB_RANGE,
    FORK_COUNT_RANGE,
)
from hutch.contract.names import validate_env_secrets, validate_name
from hutch.contract.placement import parse_placement
from hutch.contract.requests import SHAPE_FIELDS, CreateRequest
from hutch.errors import InvalidArgument
from hutch.sdk._core import Call, ClientCore, check_path, list_of, nothing, one
from hutch.sdk._errors import ProtocolError
from hutch.sdk._net import NetworkModeArg, check_egress, check_ref, network_mode
from hutch.sdk._values import iso, maybe, moment, need
from hutch.sdk._volumes import MountArg, mounts_body

__all__ = [
    "CreateArgs",
    "Health",
    "ImageInfo",
    "PauseModeArg",
    "SandboxCalls",
    "SandboxInfo",
    "SandboxNetInfo",
    "SnapshotInfo",
    "create_body",
]

#: What ``pause(mode=...)`` takes: ``"memory"`` (processes keep running after resume) or
#: ``"disk"`` (only the disk is kept; the guest boots again on resume).
PauseModeArg = PauseMode | Literal["memory", "disk"]


class CreateArgs(TypedDict, total=False):
    """The create fields but ``image``, as keyword arguments (see ``Sandbox.create``);
    the same names and meaning as :class:`hutch.contract.requests.CreateRequest`."""

    vcpus: int
    memory_mib: int
    disk_gib: int
    env: Mapping[str, str] | None
    metadata: Mapping[str, str] | None
    name: str | None
    timeout_s: int | None
    auto_resume: bool
    auto_pause_s: int | None
    auto_delete_s: int | None
    snapshot: str | None
    network: NetworkModeArg
    egress: Sequence[str] | Mapping[str, Any] | None
    egress_policy: str | None
    networks: Sequence[str] | None
    volumes: Sequence[MountArg] | None
    env_secrets: Mapping[str, str] | None
    placement: Mapping[str, Any] | None


# -- checks before sending ------------------------------------------------------------


def _seconds(name: str, value: int | None, bounds: tuple[int, int]) -> None:
    lo, hi = bounds
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidArgument(f"{name}={value!r} is out of range; accepted: {lo}-{hi} seconds")


def pause_mode(mode: str) -> PauseMode:
    try:
        return PauseMode(mode)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in PauseMode)
        raise InvalidArgument(f"pause mode {mode!r} is not one of {choices}") from None


def fork_count(count: int) -> int:
    lo, hi = FORK_COUNT_RANGE
    if isinstance(count, bool) or not isinstance(count, int) or not lo <= count <= hi:
        raise InvalidArgument(f"fork count={count!r} is out of range; accepted: {lo}-{hi}")
    return count


def create_body(image: str, args: CreateArgs) -> dict[str, Any]:
    """The JSON body of a create, checked before sending.

    Image and shape are always sent (unless ``snapshot``: a snapshot fixes the machine,
    and asking for another one alongside is refused here rather than quietly booting
    something else than what was asked for); every other field only when it differs
    from the contract's default, so a daemon that predates a field still accepts
    creates that do not use it.
    """
    given: dict[str, Any] = {key: value for key, value in args.items() if value is not None}
    request = CreateRequest(image=image, **given)
    wanted = request.non_defaults()
    shape = {key: getattr(request, key) for key in SHAPE_FIELDS}
    if request.snapshot is not None:
        clashes = [f"{key}={wanted[key]!r}" for key in SHAPE_FIELDS if key in wanted]
        if clashes:
            raise InvalidArgument(
                "a sandbox started from a snapshot gets the snapshot's image and shape; "
                f"drop {', '.join(clashes)} or do not pass snapshot"
            )
        check_path(request.snapshot, "snapshot id")
        body: dict[str, Any] = {"snapshot": request.snapshot}
    else:
        body = shape
    for key, value in wanted.items():
        if key not in SHAPE_FIELDS and key != "snapshot":
            body[key] = dict(value) if isinstance(value, Mapping) else value
    _seconds("auto_pause_s", request.auto_pause_s, AUTO_PAUSE_S_RANGE)
    _seconds("auto_delete_s", request.auto_delete_s, AUTO_DELETE_S_RANGE)
    mode = network_mode(request.network)
    if mode is NetworkMode.DEFAULT:
        body.pop("network", None)
    else:
        body["network"] = mode.value
    if request.egress is not None:
        body["egress"] = check_egress(request.egress)
    if "networks" in body:
        networks = body["networks"]
        if isinstance(networks, str):
            raise InvalidArgument(f"networks must be a list of ids or names, got {networks!r}")
        body["networks"] = [check_ref(n, "networks item") for n in networks]
    if "volumes" in body:
        body["volumes"] = mounts_body(body["volumes"])
    if "env_secrets" in body:
        validate_env_secrets(body["env_secrets"], body.get("env"))
    if "placement" in body:
        parse_placement(body["placement"])  # a bad selector is refused before sending
        body["placement"] = dict(body["placement"])
    return body


# -- values ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SandboxNetInfo:
    """The network of a sandbox: ``mode`` ``"default"`` (an address, NAT, egress rules)
    or ``"none"``; the guest's IPv4 ``address`` (None with mode none or once it ended);
    ``networks``: ids of the private networks it is on."""

    mode: str
    address: str | None
    networks: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, obj: Any) -> SandboxNetInfo:
        w = "sandbox network"
        ids = need(obj, "networks", list, w)
        if not all(isinstance(i, str) for i in ids):
            raise ProtocolError(f"{w}: networks must be a list of strings, got {ids!r}")
        return cls(
            mode=need(obj, "mode", str, w), address=maybe(obj, "address", str, w), networks=ids
        )

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "address": self.address, "networks": list(self.networks)}


@dataclass(frozen=True)
class SandboxInfo:
    """A sandbox as the daemon last reported it. Times are timezone-aware UTC.

    ``state`` is one of ``creating running pausing paused resuming stopping destroyed
    failed``. ``pause_mode`` (``"memory"`` or ``"disk"``) and ``paused_at`` are set while
    it is paused; ``parent_id`` names the sandbox it was forked from; ``auto_resume``:
    exec and file calls resume it when paused. ``auto_pause_s``: it pauses after that many
    idle seconds; ``auto_delete_s``: it is deleted after that many seconds paused;
    ``snapshot_id``: the named snapshot it was started from; ``network``: its network
    (mode, address, private networks). A daemon older than these features does not send
    them: they read as None (``auto_resume`` as False).
    """

    id: str
    name: str | None
    image: str
    state: str
    vcpus: int
    memory_mib: int
    disk_gib: int
    metadata: dict[str, str]
    timeout_s: int | None
    created_at: datetime | None
    started_at: datetime | None
    expires_at: datetime | None
    ended_at: datetime | None
    error: str | None
    pause_mode: str | None = None
    paused_at: datetime | None = None
    parent_id: str | None = None
    auto_resume: bool = False
    auto_pause_s: int | None = None
    auto_delete_s: int | None = None
    snapshot_id: str | None = None
    network: SandboxNetInfo | None = None
    #: ``{VAR: secret name}``: the secrets every command gets as variables (names only).
    env_secrets: dict[str, str] = field(default_factory=dict)
    #: The ``placement={"labels": ...}`` it was created with: the hosts it may move to
    #: (and its fork children's hosts) carry them all.
    placement_labels: dict[str, str] = field(default_factory=dict)

    @property
    def is_paused(self) -> bool:
        return self.state == "paused"

    @classmethod
    def from_dict(cls, obj: Any) -> SandboxInfo:
        w = "sandbox"
        meta = maybe(obj, "metadata", dict, w) or {}
        return cls(
            id=need(obj, "id", str, w),
            name=maybe(obj, "name", str, w),
            image=need(obj, "image", str, w),
            state=need(obj, "state", str, w),
            vcpus=need(obj, "vcpus", int, w),
            memory_mib=need(obj, "memory_mib", int, w),
            disk_gib=need(obj, "disk_gib", int, w),
            metadata={str(k): str(v) for k, v in meta.items()},
            timeout_s=maybe(obj, "timeout_s", int, w),
            created_at=moment(obj, "created_at", w),
            started_at=moment(obj, "started_at", w),
            expires_at=moment(obj, "expires_at", w),
            ended_at=moment(obj, "ended_at", w),
            error=maybe(obj, "error", str, w),
            pause_mode=maybe(obj, "pause_mode", str, w),
            paused_at=moment(obj, "paused_at", w),
            parent_id=maybe(obj, "parent_id", str, w),
            auto_resume=bool(maybe(obj, "auto_resume", bool, w)),
            auto_pause_s=maybe(obj, "auto_pause_s", int, w),
            auto_delete_s=maybe(obj, "auto_delete_s", int, w),
            snapshot_id=maybe(obj, "snapshot_id", str, w),
            network=(
                None
                if maybe(obj, "network", dict, w) is None
                else SandboxNetInfo.from_dict(obj["network"])
            ),
            env_secrets={
                str(k): str(v) for k, v in (maybe(obj, "env_secrets", dict, w) or {}).items()
            },
            placement_labels={
                str(k): str(v) for k, v in (maybe(obj, "placement_labels", dict, w) or {}).items()
            },
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "image": self.image,
            "state": self.state,
            "vcpus": self.vcpus,
            "memory_mib": self.memory_mib,
            "disk_gib": self.disk_gib,
            "metadata": dict(self.metadata),
            "timeout_s": self.timeout_s,
            "created_at": iso(self.created_at),
            "started_at": iso(self.started_at),
            "expires_at": iso(self.expires_at),
            "ended_at": iso(self.ended_at),
            "error": self.error,
            "pause_mode": self.pause_mode,
            "paused_at": iso(self.paused_at),
            "parent_id": self.parent_id,
            "auto_resume": self.auto_resume,
            "auto_pause_s": self.auto_pause_s,
            "auto_delete_s": self.auto_delete_s,
            "snapshot_id": self.snapshot_id,
            "network": None if self.network is None else self.network.to_dict(),
            "env_secrets": dict(self.env_secrets),
            "placement_labels": dict(self.placement_labels),
        }


@dataclass(frozen=True)
class SnapshotInfo:
    """A named snapshot: a sandbox's memory, devices and disk at one moment.

    ``id`` looks like ``snap-0123456789ab``; ``sandbox_id`` is the sandbox it was taken
    of; ``image`` and the shape (``vcpus``, ``memory_mib``, ``disk_gib``) are what every
    sandbox started from it gets; ``size_bytes`` is the space it takes on the host.
    """

    id: str
    name: str
    sandbox_id: str
    image: str
    vcpus: int
    memory_mib: int
    disk_gib: int
    size_bytes: int
    created_at: datetime | None

    @classmethod
    def from_dict(cls, obj: Any) -> SnapshotInfo:
        w = "snapshot"
        return cls(
            id=need(obj, "id", str, w),
            name=need(obj, "name", str, w),
            sandbox_id=need(obj, "sandbox_id", str, w),
            image=need(obj, "image", str, w),
            vcpus=need(obj, "vcpus", int, w),
            memory_mib=need(obj, "memory_mib", int, w),
            disk_gib=need(obj, "disk_gib", int, w),
            size_bytes=need(obj, "size_bytes", int, w),
            created_at=moment(obj, "created_at", w),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "sandbox_id": self.sandbox_id,
            "image": self.image,
            "vcpus": self.vcpus,
            "memory_mib": self.memory_mib,
            "disk_gib": self.disk_gib,
            "size_bytes": self.size_bytes,
            "created_at": iso(self.created_at),
        }


@dataclass(frozen=True)
class ImageInfo:
    name: str
    description: str
    built: bool
    digest: str | None
    size_bytes: int | None
    kernel_release: str | None
    #: {"type": "builtin" | "registry" | "archive", "ref", "digest", "format", ...}
    source: dict[str, Any] = field(default_factory=lambda: {"type": "builtin"})
    #: Imported images: env, working_dir, user, entrypoint, cmd, exposed_ports.
    config: dict[str, Any] | None = None
    start: bool = False
    created_at: datetime | None = None
    #: The project it belongs to (only it sees and boots it); None: a built-in image.
    project: str | None = None

    @classmethod
    def from_dict(cls, obj: Any) -> ImageInfo:
        w = "image"
        return cls(
            name=need(obj, "name", str, w),
            description=maybe(obj, "description", str, w) or "",
            built=need(obj, "built", bool, w),
            digest=maybe(obj, "digest", str, w),
            size_bytes=maybe(obj, "size_bytes", int, w),
            kernel_release=maybe(obj, "kernel_release", str, w),
            source=maybe(obj, "source", dict, w) or {"type": "builtin"},
            config=maybe(obj, "config", dict, w),
            start=bool(maybe(obj, "start", bool, w)),
            created_at=moment(obj, "created_at", w),
            project=maybe(obj, "project", str, w),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "built": self.built,
            "digest": self.digest,
            "size_bytes": self.size_bytes,
            "kernel_release": self.kernel_release,
            "source": dict(self.source),
            "config": self.config,
            "start": self.start,
            "created_at": iso(self.created_at),
            "project": self.project,
        }


@dataclass(frozen=True)
class Health:
    status: str
    version: str
    accel: str | None
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, obj: Any) -> Health:
        w = "healthz"
        return cls(
            status=need(obj, "status", str, w),
            version=need(obj, "version", str, w),
            accel=maybe(obj, "accel", str, w),
            raw=dict(obj),
        )


# -- requests -------------------------------------------------------------------------


class SandboxCalls:
    """Builds every sandbox, snapshot, image and health request. No I/O."""

    def __init__(self, core: ClientCore) -> None:
        self.core = core

    def health(self) -> Call[Health]:
        return Call(self.core.request("GET", "/healthz", auth=False), one(Health.from_dict))

    def list_images(self) -> Call[builtins.list[ImageInfo]]:
        req = self.core.request("GET", "/v1/images")
        return Call(req, list_of("images", ImageInfo.from_dict))

    def create(self, image: str, args: CreateArgs) -> Call[SandboxInfo]:
        """Checked against the contract's ranges and the rule grammar before sending."""
        req = self.core.request(
            "POST",
            "/v1/sandboxes",
            json_body=create_body(image, args),
            read_timeout=self.core.config.timeouts.create,
        )
        return Call(req, one(SandboxInfo.from_dict))

    def list(
        self, state: str | None = None, metadata: Mapping[str, str] | None = None
    ) -> Call[builtins.list[SandboxInfo]]:
        params: builtins.list[tuple[str, str]] = []
        if state is not None:
            params.append(("state", state))
        for key, value in (metadata or {}).items():
            params.append(("metadata", f"{key}={value}"))
        req = self.core.request("GET", "/v1/sandboxes", params=params)
        return Call(req, list_of("sandboxes", SandboxInfo.from_dict))

    def get(self, sandbox_id: str) -> Call[SandboxInfo]:
        req = self.core.request("GET", self.core.sandbox_path(sandbox_id))
        return Call(req, one(SandboxInfo.from_dict))

    def delete(self, sandbox_id: str) -> Call[None]:
        return Call(self.core.request("DELETE", self.core.sandbox_path(sandbox_id)), nothing)

    def grow_disk(self, sandbox_id: str, disk_gib: int) -> Call[SandboxInfo]:
        """Grow the running sandbox's own disk (and root filesystem) to ``disk_gib`` GiB."""
        lo, hi = DISK_GIB_RANGE
        if isinstance(disk_gib, bool) or not isinstance(disk_gib, int) or not lo <= disk_gib <= hi:
            raise InvalidArgument(f"disk_gib={disk_gib!r} is out of range; accepted: {lo}-{hi}")
        req = self.core.request(
            "PATCH",
            self.core.sandbox_path(sandbox_id),
            json_body={"disk_gib": disk_gib},
            read_timeout=self.core.config.timeouts.lifecycle,
        )
        return Call(req, one(SandboxInfo.from_dict))

    def pause(self, sandbox_id: str, mode: str = DEFAULT_PAUSE_MODE) -> Call[SandboxInfo]:
        """Pause: ``memory`` keeps the running processes, ``disk`` only the disk."""
        req = self.core.request(
            "POST",
            self.core.sandbox_path(sandbox_id, "/pause"),
            json_body={"mode": pause_mode(mode).value},
            read_timeout=self.core.config.timeouts.lifecycle,
        )
        return Call(req, one(SandboxInfo.from_dict))

    def resume(
        self, sandbox_id: str, placement: Mapping[str, Any] | None = None
    ) -> Call[SandboxInfo]:
        """Resume a paused sandbox; a running one is left as it is. ``placement``
        (``{"host": ID}``, ``{"labels": {K: V}}``): where in a cluster it resumes."""
        body: dict[str, Any] | None = None
        if placement is not None:
            parse_placement(placement)  # a bad selector is refused before sending
            body = {"placement": dict(placement)}
        req = self.core.request(
            "POST",
            self.core.sandbox_path(sandbox_id, "/resume"),
            json_body=body,
            read_timeout=self.core.config.timeouts.lifecycle,
        )
        return Call(req, one(SandboxInfo.from_dict))

    def fork(
        self, sandbox_id: str, count: int = DEFAULT_FORK_COUNT
    ) -> Call[builtins.list[SandboxInfo]]:
        """Fork ``count`` children off a sandbox; the answer lists the children only."""
        req = self.core.request(
            "POST",
            self.core.sandbox_path(sandbox_id, "/fork"),
            json_body={"count": fork_count(count)},
            read_timeout=self.core.config.timeouts.lifecycle,
        )
        return Call(req, list_of("sandboxes", SandboxInfo.from_dict))

    # -- named snapshots ---------------------------------------------------------------

    def _snapshot_path(self, snapshot_id: str) -> str:
        check_path(snapshot_id, "snapshot id")
        return f"/v1/snapshots/{quote(snapshot_id, safe='')}"

    def create_snapshot(self, sandbox_id: str, name: str) -> Call[SnapshotInfo]:
        """Snapshot a running or paused sandbox under ``name``; it stays as it was."""
        if not isinstance(name, str):
            raise InvalidArgument(f"snapshot name must be a string, got {name!r}")
        req = self.core.request(
            "POST",
            self.core.sandbox_path(sandbox_id, "/snapshots"),
            json_body={"name": validate_name(name)},
            # Saving guest memory and disk takes as long as a pause does.
            read_timeout=self.core.config.timeouts.lifecycle,
        )
        return Call(req, one(SnapshotInfo.from_dict))

    def list_snapshots(self) -> Call[builtins.list[SnapshotInfo]]:
        req = self.core.request("GET", "/v1/snapshots")
        return Call(req, list_of("snapshots", SnapshotInfo.from_dict))

    def get_snapshot(self, snapshot_id: str) -> Call[SnapshotInfo]:
        req = self.core.request("GET", self._snapshot_path(snapshot_id))
        return Call(req, one(SnapshotInfo.from_dict))

    def delete_snapshot(self, snapshot_id: str) -> Call[None]:
        """Delete it, in any order with the sandboxes and snapshots built on it (they
        stay usable; its space is freed when nothing is built on it any more)."""
        return Call(self.core.request("DELETE", self._snapshot_path(snapshot_id)), nothing)
