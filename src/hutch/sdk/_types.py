"""What the SDK returns: frozen value objects parsed from the API's JSON.

Each type keeps the API's field names, and ``to_dict()`` gives back the API form (the
CLI's ``--json`` prints exactly that, so scripts see the contract, not Python reprs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from hutch.models import PauseMode
from hutch.sdk._errors import ProtocolError

__all__ = [
    "ExecEvent",
    "ExecExit",
    "ExecOutput",
    "ExecResult",
    "FileEntry",
    "Health",
    "ImageInfo",
    "PauseModeArg",
    "SandboxInfo",
    "SandboxNetInfo",
    "SnapshotInfo",
    "WrittenFile",
]

#: What ``pause(mode=...)`` takes: ``"memory"`` (processes keep running after resume) or
#: ``"disk"`` (only the disk is kept; the guest boots again on resume).
PauseModeArg = PauseMode | Literal["memory", "disk"]


def _get(obj: Any, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: expected a JSON object, got {type(obj).__name__}")
    value = obj.get(key)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # JSON true is not a number, though Python's bool subclasses int.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ProtocolError(
            f"{what}: field {key!r} is {value!r}; the daemon may be a "
            "different version than this SDK"
        )
    return value


def _opt(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if obj.get(key) is None:
        return None
    return _get(obj, key, kind, what)


def _time(obj: dict[str, Any], key: str, what: str) -> datetime | None:
    raw = _opt(obj, key, str, what)
    if raw is None:
        return None
    try:
        return datetime.fromisoformat(raw)
    except ValueError as exc:
        raise ProtocolError(f"{what}: field {key!r}={raw!r} is not an ISO 8601 time") from exc


def _iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    text = value.isoformat(timespec="milliseconds")
    return text[:-6] + "Z" if text.endswith("+00:00") else text


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
        ids = _get(obj, "networks", list, w)
        if not all(isinstance(i, str) for i in ids):
            raise ProtocolError(f"{w}: networks must be a list of strings, got {ids!r}")
        return cls(
            mode=_get(obj, "mode", str, w), address=_opt(obj, "address", str, w), networks=ids
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

    @property
    def is_paused(self) -> bool:
        return self.state == "paused"

    @classmethod
    def from_dict(cls, obj: Any) -> SandboxInfo:
        w = "sandbox"
        meta = _opt(obj, "metadata", dict, w) or {}
        return cls(
            id=_get(obj, "id", str, w),
            name=_opt(obj, "name", str, w),
            image=_get(obj, "image", str, w),
            state=_get(obj, "state", str, w),
            vcpus=_get(obj, "vcpus", int, w),
            memory_mib=_get(obj, "memory_mib", int, w),
            disk_gib=_get(obj, "disk_gib", int, w),
            metadata={str(k): str(v) for k, v in meta.items()},
            timeout_s=_opt(obj, "timeout_s", int, w),
            created_at=_time(obj, "created_at", w),
            started_at=_time(obj, "started_at", w),
            expires_at=_time(obj, "expires_at", w),
            ended_at=_time(obj, "ended_at", w),
            error=_opt(obj, "error", str, w),
            pause_mode=_opt(obj, "pause_mode", str, w),
            paused_at=_time(obj, "paused_at", w),
            parent_id=_opt(obj, "parent_id", str, w),
            auto_resume=bool(_opt(obj, "auto_resume", bool, w)),
            auto_pause_s=_opt(obj, "auto_pause_s", int, w),
            auto_delete_s=_opt(obj, "auto_delete_s", int, w),
            snapshot_id=_opt(obj, "snapshot_id", str, w),
            network=(
                None
                if _opt(obj, "network", dict, w) is None
                else SandboxNetInfo.from_dict(obj["network"])
            ),
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
            "created_at": _iso(self.created_at),
            "started_at": _iso(self.started_at),
            "expires_at": _iso(self.expires_at),
            "ended_at": _iso(self.ended_at),
            "error": self.error,
            "pause_mode": self.pause_mode,
            "paused_at": _iso(self.paused_at),
            "parent_id": self.parent_id,
            "auto_resume": self.auto_resume,
            "auto_pause_s": self.auto_pause_s,
            "auto_delete_s": self.auto_delete_s,
            "snapshot_id": self.snapshot_id,
            "network": None if self.network is None else self.network.to_dict(),
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
            id=_get(obj, "id", str, w),
            name=_get(obj, "name", str, w),
            sandbox_id=_get(obj, "sandbox_id", str, w),
            image=_get(obj, "image", str, w),
            vcpus=_get(obj, "vcpus", int, w),
            memory_mib=_get(obj, "memory_mib", int, w),
            disk_gib=_get(obj, "disk_gib", int, w),
            size_bytes=_get(obj, "size_bytes", int, w),
            created_at=_time(obj, "created_at", w),
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
            "created_at": _iso(self.created_at),
        }


@dataclass(frozen=True)
class ExecResult:
    """A finished command. ``exit_code`` is None when a signal (``signal``) ended it."""

    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    duration_ms: int

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @classmethod
    def from_dict(cls, obj: Any) -> ExecResult:
        w = "exec result"
        return cls(
            exit_code=_opt(obj, "exit_code", int, w),
            signal=_opt(obj, "signal", int, w),
            stdout=_get(obj, "stdout", str, w),
            stderr=_get(obj, "stderr", str, w),
            duration_ms=_get(obj, "duration_ms", int, w),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "signal": self.signal,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "duration_ms": self.duration_ms,
        }


@dataclass(frozen=True)
class ExecOutput:
    """A chunk of a running command's output, in arrival order."""

    stream: Literal["stdout", "stderr"]
    data: str


@dataclass(frozen=True)
class ExecExit:
    """The last event of a command: how it ended."""

    exit_code: int | None
    signal: int | None
    duration_ms: int


ExecEvent = ExecOutput | ExecExit


@dataclass(frozen=True)
class FileEntry:
    """A file in a sandbox. ``mode`` is the permission bits as an int (0o644)."""

    name: str
    path: str
    type: str
    size: int
    mode: int
    mtime: datetime | None

    @classmethod
    def from_dict(cls, obj: Any) -> FileEntry:
        w = "file entry"
        raw_mode = _get(obj, "mode", (str, int), w)
        try:
            mode = raw_mode if isinstance(raw_mode, int) else int(raw_mode, 8)
        except ValueError as exc:
            raise ProtocolError(f"{w}: mode {raw_mode!r} is not octal") from exc
        return cls(
            name=_get(obj, "name", str, w),
            path=_get(obj, "path", str, w),
            type=_get(obj, "type", str, w),
            size=_get(obj, "size", int, w),
            mode=mode,
            mtime=_time(obj, "mtime", w),
        )

    @property
    def is_dir(self) -> bool:
        return self.type == "dir"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "type": self.type,
            "size": self.size,
            "mode": format(self.mode, "04o"),
            "mtime": _iso(self.mtime),
        }


@dataclass(frozen=True)
class WrittenFile:
    """What ``files.write`` stored: the absolute path and its size in bytes."""

    path: str
    size: int

    @classmethod
    def from_dict(cls, obj: Any) -> WrittenFile:
        return cls(path=_get(obj, "path", str, "write"), size=_get(obj, "size", int, "write"))


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

    @classmethod
    def from_dict(cls, obj: Any) -> ImageInfo:
        w = "image"
        return cls(
            name=_get(obj, "name", str, w),
            description=_opt(obj, "description", str, w) or "",
            built=_get(obj, "built", bool, w),
            digest=_opt(obj, "digest", str, w),
            size_bytes=_opt(obj, "size_bytes", int, w),
            kernel_release=_opt(obj, "kernel_release", str, w),
            source=_opt(obj, "source", dict, w) or {"type": "builtin"},
            config=_opt(obj, "config", dict, w),
            start=bool(_opt(obj, "start", bool, w)),
            created_at=_time(obj, "created_at", w),
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
            "created_at": self.created_at.isoformat() if self.created_at else None,
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
            status=_get(obj, "status", str, w),
            version=_get(obj, "version", str, w),
            accel=_opt(obj, "accel", str, w),
            raw=dict(obj),
        )
