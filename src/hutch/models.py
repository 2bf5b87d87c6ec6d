"""Pure value types shared by every layer. No I/O here.

The API's limits, names and words (ranges, id patterns, ``PauseMode``, ``NetworkMode``)
are the contract's (:mod:`hutch.contract`); they are re-exported here for the daemon's
modules that import them from ``hutch.models``.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field
from typing import Any

from hutch.contract.auth import DEFAULT_PROJECT
from hutch.contract.enums import NetworkMode, PauseMode
from hutch.contract.limits import (
    AUTO_DELETE_S_RANGE,
    AUTO_PAUSE_S_RANGE,
    DEFAULT_DISK_GIB,
    DEFAULT_MEMORY_MIB,
    DEFAULT_VCPUS,
    DISK_GIB_RANGE,
    FORK_COUNT_RANGE,
    MEMORY_MIB_RANGE,
    TIMEOUT_S_RANGE,
    VCPUS_RANGE,
)
from hutch.contract.names import (
    NAME_RE,
    SANDBOX_ID_RE,
    SNAPSHOT_ID_RE,
    check_range,
    validate_env,
    validate_env_secrets,
    validate_metadata,
    validate_name,
)
from hutch.contract.volumes import VolumeMount, validate_mounts

__all__ = [
    "AUTO_DELETE_S_RANGE",
    "AUTO_PAUSE_S_RANGE",
    "DISK_GIB_RANGE",
    "FORK_COUNT_RANGE",
    "MEMORY_MIB_RANGE",
    "NAME_RE",
    "SANDBOX_ID_RE",
    "SNAPSHOT_ID_RE",
    "TIMEOUT_S_RANGE",
    "VCPUS_RANGE",
    "NetworkMode",
    "PauseMode",
    "SandboxRecord",
    "SandboxSpec",
    "SandboxState",
    "Shape",
    "SnapshotRecord",
    "new_sandbox_id",
    "new_snapshot_id",
    "validate_env",
    "validate_metadata",
    "validate_name",
]


def new_sandbox_id() -> str:
    return "sb-" + secrets.token_hex(6)


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


def new_snapshot_id() -> str:
    return "snap-" + secrets.token_hex(6)


@dataclass(frozen=True)
class Shape:
    """How big a sandbox is. Validated on construction."""

    vcpus: int = DEFAULT_VCPUS
    memory_mib: int = DEFAULT_MEMORY_MIB
    disk_gib: int = DEFAULT_DISK_GIB

    def __post_init__(self) -> None:
        check_range("vcpus", self.vcpus, VCPUS_RANGE)
        check_range("memory_mib", self.memory_mib, MEMORY_MIB_RANGE, " MiB")
        check_range("disk_gib", self.disk_gib, DISK_GIB_RANGE, " GiB")


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
    #: Egress rules (``hutch.contract.egress``) or a policy document
    #: (``hutch.contract.egress_policy``); None or [] = open egress.
    egress: list[str] | dict[str, Any] | None = None
    #: A named egress policy of the project to copy (instead of ``egress``).
    egress_policy: str | None = None
    #: Private networks (ids or names) to join at create.
    networks: list[str] = field(default_factory=list)
    #: Volumes (ids or names in the project) to mount at create.
    volumes: list[VolumeMount] = field(default_factory=list)
    #: The project the sandbox is created in (the caller's, issue 10).
    project: str = DEFAULT_PROJECT
    #: ``{VAR: secret name}``: environment variables whose values are the project's
    #: secrets, resolved (current version) each time a command's environment is built.
    env_secrets: dict[str, str] = field(default_factory=dict)
    #: ``placement.labels`` of the create: the hosts it may ever run on carry them all.
    placement_labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "volumes", validate_mounts(self.volumes))
        if self.auto_pause_s is not None:
            check_range("auto_pause_s", self.auto_pause_s, AUTO_PAUSE_S_RANGE, " seconds")
        if self.auto_delete_s is not None:
            check_range("auto_delete_s", self.auto_delete_s, AUTO_DELETE_S_RANGE, " seconds")
        validate_env(self.env)
        validate_env_secrets(self.env_secrets, self.env)
        validate_metadata(self.metadata)
        if self.name is not None:
            validate_name(self.name)
        if self.timeout_s is not None:
            check_range("timeout_s", self.timeout_s, TIMEOUT_S_RANGE, " seconds")


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
    #: The project it belongs to (issue 10); never changes.
    project: str = DEFAULT_PROJECT
    #: ``{VAR: secret name}`` (names only; values are resolved at each command).
    env_secrets: dict[str, str] = field(default_factory=dict)
    #: The create's ``placement.labels``: a move (resume off a draining or down host)
    #: and fork children keep to hosts carrying every one (fork children inherit them).
    placement_labels: dict[str, str] = field(default_factory=dict)


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
    project: str = DEFAULT_PROJECT


@dataclass(frozen=True)
class FileSum:
    """One file of a blob store upload as its uploader sent it (an index entry, and the
    database's record of it: ``hutch.store.image_uploads``)."""

    size: int
    sha256: str
