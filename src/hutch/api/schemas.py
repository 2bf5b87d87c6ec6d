"""Request and response bodies of the REST API (the OpenAPI spec is generated from these)."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from hutch.api.net_schemas import (
    MAX_EGRESS_RULES,
    MAX_NETWORKS_PER_SANDBOX,
    EgressRuleText,
    NetworkRef,
    SandboxNet,
)
from hutch.models import (
    AUTO_DELETE_S_RANGE,
    AUTO_PAUSE_S_RANGE,
    DISK_GIB_RANGE,
    FORK_COUNT_RANGE,
    MEMORY_MIB_RANGE,
    TIMEOUT_S_RANGE,
    VCPUS_RANGE,
    NetworkMode,
    PauseMode,
    SandboxRecord,
    SandboxState,
    SnapshotRecord,
)

MAX_EXEC_TIMEOUT_S = 24 * 3600


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateSandbox(Strict):
    image: Annotated[str, Field(min_length=1, max_length=64)] = "base"
    vcpus: Annotated[int, Field(ge=VCPUS_RANGE[0], le=VCPUS_RANGE[1], strict=True)] = 1
    memory_mib: Annotated[
        int, Field(ge=MEMORY_MIB_RANGE[0], le=MEMORY_MIB_RANGE[1], strict=True)
    ] = 512
    disk_gib: Annotated[int, Field(ge=DISK_GIB_RANGE[0], le=DISK_GIB_RANGE[1], strict=True)] = 4
    env: dict[str, str] = Field(default_factory=dict, max_length=256)
    metadata: dict[str, str] = Field(default_factory=dict, max_length=64)
    name: Annotated[str, Field(min_length=1, max_length=63)] | None = None
    timeout_s: (
        Annotated[int, Field(ge=TIMEOUT_S_RANGE[0], le=TIMEOUT_S_RANGE[1], strict=True)] | None
    ) = None
    auto_resume: Annotated[bool, Field(strict=True)] = False
    auto_pause_s: (
        Annotated[int, Field(ge=AUTO_PAUSE_S_RANGE[0], le=AUTO_PAUSE_S_RANGE[1], strict=True)]
        | None
    ) = None
    auto_delete_s: (
        Annotated[int, Field(ge=AUTO_DELETE_S_RANGE[0], le=AUTO_DELETE_S_RANGE[1], strict=True)]
        | None
    ) = None
    snapshot: Annotated[str, Field(min_length=1, max_length=64)] | None = Field(
        default=None,
        description="Start from this snapshot (its image and shape are used).",
    )
    # -- networking (issue 5; bodies in api/net_schemas.py) --
    network: NetworkMode = Field(
        default=NetworkMode.DEFAULT,
        description="`default`: an address and NAT, filtered by `egress`; `none`: no network.",
    )
    egress: list[EgressRuleText] | None = Field(
        default=None,
        max_length=MAX_EGRESS_RULES,
        description="Egress rules (see PUT /v1/sandboxes/{id}/egress); null or []: open.",
    )
    networks: list[NetworkRef] = Field(
        default_factory=list,
        max_length=MAX_NETWORKS_PER_SANDBOX,
        description="Private networks (ids or names) to join.",
    )


def _iso(ts: float | None) -> dt.datetime | None:
    return None if ts is None else dt.datetime.fromtimestamp(ts, dt.UTC)


class Sandbox(BaseModel):
    id: str
    name: str | None
    image: str
    state: SandboxState
    vcpus: int
    memory_mib: int
    disk_gib: int
    metadata: dict[str, str]
    timeout_s: int | None
    created_at: dt.datetime
    started_at: dt.datetime | None
    expires_at: dt.datetime | None
    ended_at: dt.datetime | None
    error: str | None
    pause_mode: PauseMode | None
    paused_at: dt.datetime | None
    parent_id: str | None
    auto_resume: bool
    auto_pause_s: int | None
    auto_delete_s: int | None
    snapshot_id: str | None
    network: SandboxNet

    @classmethod
    def of(cls, rec: SandboxRecord, net: SandboxNet | None = None) -> Sandbox:
        """``net``: the sandbox's network block (``service.sandbox_net``); without it,
        only the mode the record holds."""
        if net is None:
            net = SandboxNet(mode=rec.network, address=None, networks=[])
        created = _iso(rec.created_at)
        assert created is not None
        return cls(
            id=rec.id,
            name=rec.name,
            image=rec.image,
            state=rec.state,
            vcpus=rec.shape.vcpus,
            memory_mib=rec.shape.memory_mib,
            disk_gib=rec.shape.disk_gib,
            metadata=rec.metadata,
            timeout_s=rec.timeout_s,
            created_at=created,
            started_at=_iso(rec.started_at),
            expires_at=_iso(rec.expires_at),
            ended_at=_iso(rec.ended_at),
            error=rec.error,
            pause_mode=rec.pause_mode,
            paused_at=_iso(rec.paused_at),
            parent_id=rec.parent_id,
            auto_resume=rec.auto_resume,
            auto_pause_s=rec.auto_pause_s,
            auto_delete_s=rec.auto_delete_s,
            snapshot_id=rec.snapshot_id,
            network=net,
        )


class SandboxList(BaseModel):
    sandboxes: list[Sandbox]


class Snapshot(BaseModel):
    id: str
    name: str
    sandbox_id: str
    image: str
    vcpus: int
    memory_mib: int
    disk_gib: int
    size_bytes: int
    created_at: dt.datetime

    @classmethod
    def of(cls, snap: SnapshotRecord) -> Snapshot:
        created = _iso(snap.created_at)
        assert created is not None
        return cls(
            id=snap.id,
            name=snap.name,
            sandbox_id=snap.sandbox_id,
            image=snap.image,
            vcpus=snap.shape.vcpus,
            memory_mib=snap.shape.memory_mib,
            disk_gib=snap.shape.disk_gib,
            size_bytes=snap.size_bytes,
            created_at=created,
        )


class SnapshotList(BaseModel):
    snapshots: list[Snapshot]


class SnapshotRequest(Strict):
    name: Annotated[str, Field(min_length=1, max_length=63)]


class PauseRequest(Strict):
    mode: PauseMode = PauseMode.MEMORY


class ForkRequest(Strict):
    count: Annotated[int, Field(ge=FORK_COUNT_RANGE[0], le=FORK_COUNT_RANGE[1], strict=True)] = 1


class ExecRequest(Strict):
    cmd: (
        Annotated[list[Annotated[str, Field(max_length=65536)]], Field(min_length=1)]
        | Annotated[str, Field(min_length=1, max_length=262144)]
    )
    env: dict[str, str] = Field(default_factory=dict, max_length=256)
    cwd: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    user: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    timeout_s: Annotated[float, Field(gt=0, le=MAX_EXEC_TIMEOUT_S)] | None = None
    stdin: Annotated[str, Field(max_length=8 * 1024 * 1024)] | None = None
    stream: bool = False
    background: bool = Field(
        default=False,
        description="Start detached and answer 201 with the process (see .../processes)",
    )


class ExecResult(BaseModel):
    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    duration_ms: int


class FileEntry(BaseModel):
    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: str
    mtime: dt.datetime


class FileList(BaseModel):
    entries: list[FileEntry]


class WriteResult(BaseModel):
    path: str
    size: int


class MkdirRequest(Strict):
    path: Annotated[str, Field(min_length=1, max_length=4096)]


class RenameRequest(Strict):
    source: Annotated[str, Field(min_length=1, max_length=4096)]
    destination: Annotated[str, Field(min_length=1, max_length=4096)]


class Image(BaseModel):
    name: str
    description: str
    built: bool
    digest: str | None
    size_bytes: int | None
    kernel_release: str | None


class ImageList(BaseModel):
    images: list[Image]


class Health(BaseModel):
    #: "reconciling" while a restarted daemon still checks the VMs it found (it serves
    #: meanwhile; those sandboxes answer 503 until checked), then "ok".
    status: Literal["ok", "reconciling"]
    version: str
    accel: str
    #: Sandboxes still being checked.
    reconciling: int = 0


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorBody(BaseModel):
    error: ErrorDetail
