"""Pure value types shared by every layer. No I/O here."""

from __future__ import annotations

import enum
import re
import secrets
from dataclasses import dataclass, field

from hutch.errors import InvalidArgument

VCPUS_RANGE = (1, 8)
MEMORY_MIB_RANGE = (128, 16 * 1024)
DISK_GIB_RANGE = (1, 60)
TIMEOUT_S_RANGE = (1, 30 * 24 * 3600)

SANDBOX_ID_RE = re.compile(r"^sb-[0-9a-f]{12}$")
NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def new_sandbox_id() -> str:
    return "sb-" + secrets.token_hex(6)


class NetworkMode(enum.StrEnum):
    """``default``: a tap, an address and NAT, filtered by egress rules.
    ``none``: a NIC that leads nowhere."""

    DEFAULT = "default"
    NONE = "none"


class SandboxState(enum.StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    #: Saving to disk (memory mode) or shutting down (disk mode).
    PAUSING = "pausing"
    #: No QEMU process; memory state (memory mode) and disk kept.
    PAUSED = "paused"
    RESUMING = "resuming"
    STOPPING = "stopping"
    DESTROYED = "destroyed"
    #: The VM died on its own or could not be started; resources are cleaned.
    FAILED = "failed"

    @property
    def is_live(self) -> bool:
        """Not ended: it holds resources and can be deleted."""
        return self not in (SandboxState.DESTROYED, SandboxState.FAILED)


class PauseMode(enum.StrEnum):
    #: CPU, memory and device state saved; processes continue after resume.
    MEMORY = "memory"
    #: Only the disk kept; the guest boots again on resume.
    DISK = "disk"


FORK_COUNT_RANGE = (1, 100)
AUTO_PAUSE_S_RANGE = (60, 24 * 3600)
AUTO_DELETE_S_RANGE = (60, 30 * 24 * 3600)
SNAPSHOT_ID_RE = re.compile(r"^snap-[0-9a-f]{12}$")


def new_snapshot_id() -> str:
    return "snap-" + secrets.token_hex(6)


def _check_range(name: str, value: int, bounds: tuple[int, int], unit: str = "") -> None:
    lo, hi = bounds
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidArgument(f"{name}={value!r} is out of range; accepted: {lo}-{hi}{unit}")


@dataclass(frozen=True)
class Shape:
    """How big a sandbox is. Validated on construction."""

    vcpus: int = 1
    memory_mib: int = 512
    disk_gib: int = 4

    def __post_init__(self) -> None:
        _check_range("vcpus", self.vcpus, VCPUS_RANGE)
        _check_range("memory_mib", self.memory_mib, MEMORY_MIB_RANGE, " MiB")
        _check_range("disk_gib", self.disk_gib, DISK_GIB_RANGE, " GiB")


def validate_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise InvalidArgument(
            f"name={name!r} is not valid; use 1-63 lowercase letters, digits and '-', "
            "starting and ending with a letter or digit"
        )
    return name


def validate_metadata(metadata: dict[str, str]) -> dict[str, str]:
    if len(metadata) > 64:
        raise InvalidArgument("metadata has more than 64 keys")
    for key, value in metadata.items():
        if not isinstance(key, str) or not 1 <= len(key) <= 128:
            raise InvalidArgument(f"metadata key {key!r} must be a string of 1-128 characters")
        if not isinstance(value, str) or len(value) > 1024:
            raise InvalidArgument(f"metadata[{key!r}] must be a string of at most 1024 characters")
    return metadata


def validate_env(env: dict[str, str]) -> dict[str, str]:
    for key, value in env.items():
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            raise InvalidArgument(
                f"env name {key!r} is not valid; use letters, digits and '_', not starting "
                "with a digit"
            )
        if "\0" in value:
            raise InvalidArgument(f"env[{key!r}] contains a NUL byte")
    return env


@dataclass(frozen=True)
class SandboxSpec:
    """What a user asked for at create."""

    image: str
    shape: Shape = field(default_factory=Shape)
    env: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    name: str | None = None
    timeout_s: int | None = None
    auto_resume: bool = False
    auto_pause_s: int | None = None
    auto_delete_s: int | None = None
    snapshot_id: str | None = None
    network: NetworkMode = NetworkMode.DEFAULT
    #: Egress rules (``hutch.net.rules``); None or [] = open egress.
    egress: list[str] | None = None
    #: Private networks (ids or names) to join at create.
    networks: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.auto_pause_s is not None:
            _check_range("auto_pause_s", self.auto_pause_s, AUTO_PAUSE_S_RANGE, " seconds")
        if self.auto_delete_s is not None:
            _check_range("auto_delete_s", self.auto_delete_s, AUTO_DELETE_S_RANGE, " seconds")
        validate_env(self.env)
        validate_metadata(self.metadata)
        if self.name is not None:
            validate_name(self.name)
        if self.timeout_s is not None:
            _check_range("timeout_s", self.timeout_s, TIMEOUT_S_RANGE, " seconds")


@dataclass
class SandboxRecord:
    """A sandbox as the store keeps it. Times are UNIX epoch seconds (float)."""

    id: str
    image: str
    state: SandboxState
    shape: Shape
    created_at: float
    name: str | None = None
    image_digest: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    timeout_s: int | None = None
    started_at: float | None = None
    expires_at: float | None = None
    ended_at: float | None = None
    error: str | None = None
    pause_mode: PauseMode | None = None
    paused_at: float | None = None
    #: Snapshot directory the next resume restores from, and whether as a clone
    #: (a frozen fork snapshot) or by consuming it (its own pause snapshot).
    resume_from: str | None = None
    resume_clone: bool = False
    parent_id: str | None = None
    #: exec and file calls to this sandbox while paused resume it first.
    auto_resume: bool = False
    #: Pause (memory mode) after this many idle seconds; delete after this long paused.
    auto_pause_s: int | None = None
    auto_delete_s: int | None = None
    #: The named snapshot this sandbox was created from.
    snapshot_id: str | None = None
    network: NetworkMode = NetworkMode.DEFAULT


@dataclass(frozen=True)
class SnapshotRecord:
    """A named snapshot: memory, device state and disk of a sandbox at one moment."""

    id: str
    name: str
    sandbox_id: str
    image: str
    shape: Shape
    path: str
    size_bytes: int
    created_at: float
