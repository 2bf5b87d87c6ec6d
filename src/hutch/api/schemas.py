"""Request and response bodies of the REST API (the OpenAPI spec is generated from these)."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from hutch.api.image_schemas import ImageConfigModel, ImageSourceModel
from hutch.api.net_schemas import EgressRuleText, NetworkRef, PolicyDocument, SandboxNet
from hutch.api.volume_schemas import MAX_VOLUMES_PER_SANDBOX, VolumeMountBody
from hutch.contract.enums import DEFAULT_NETWORK_MODE, DEFAULT_PAUSE_MODE
from hutch.contract.limits import (
    AUTO_DELETE_S_RANGE,
    AUTO_PAUSE_S_RANGE,
    CMD_ARG_MAX_CHARS,
    CMD_MAX_CHARS,
    DEFAULT_DISK_GIB,
    DEFAULT_FORK_COUNT,
    DEFAULT_IMAGE,
    DEFAULT_MEMORY_MIB,
    DEFAULT_VCPUS,
    DISK_GIB_RANGE,
    ENV_MAX_VARS,
    ENV_SECRETS_MAX,
    EXEC_TIMEOUT_S_MAX,
    FORK_COUNT_RANGE,
    ID_MAX_CHARS,
    IMAGE_NAME_MAX_CHARS,
    MAX_EGRESS_RULES,
    MAX_NETWORKS_PER_SANDBOX,
    MEMORY_MIB_RANGE,
    METADATA_MAX_KEYS,
    NAME_MAX_CHARS,
    PATH_MAX_CHARS,
    STDIN_MAX_CHARS,
    TIMEOUT_S_RANGE,
    USER_MAX_CHARS,
    VCPUS_RANGE,
)
from hutch.contract.placement import LABEL_RE, MAX_LABELS
from hutch.models import (
    NetworkMode,
    PauseMode,
    SandboxRecord,
    SandboxState,
    SnapshotRecord,
)

MAX_EXEC_TIMEOUT_S = EXEC_TIMEOUT_S_MAX


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


_LABEL = Annotated[str, Field(pattern=LABEL_RE.pattern)]


class PlacementBody(Strict):
    """``hutch.contract.placement``: where a create lands in a cluster."""

    host: _LABEL | None = None
    labels: dict[_LABEL, _LABEL] = Field(default_factory=dict, max_length=MAX_LABELS)
    strategy: Literal["spread", "pack"] = "spread"


class CreateSandbox(Strict):
    image: Annotated[str, Field(min_length=1, max_length=IMAGE_NAME_MAX_CHARS)] = DEFAULT_IMAGE
    vcpus: Annotated[int, Field(ge=VCPUS_RANGE[0], le=VCPUS_RANGE[1], strict=True)] = DEFAULT_VCPUS
    memory_mib: Annotated[
        int, Field(ge=MEMORY_MIB_RANGE[0], le=MEMORY_MIB_RANGE[1], strict=True)
    ] = DEFAULT_MEMORY_MIB
    disk_gib: Annotated[int, Field(ge=DISK_GIB_RANGE[0], le=DISK_GIB_RANGE[1], strict=True)] = (
        DEFAULT_DISK_GIB
    )
    env: dict[str, str] = Field(default_factory=dict, max_length=ENV_MAX_VARS)
    metadata: dict[str, str] = Field(default_factory=dict, max_length=METADATA_MAX_KEYS)
    name: Annotated[str, Field(min_length=1, max_length=NAME_MAX_CHARS)] | None = None
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
    snapshot: Annotated[str, Field(min_length=1, max_length=ID_MAX_CHARS)] | None = Field(
        default=None,
        description="Start from this snapshot (its image and shape are used).",
    )
    # -- networking (issue 5; bodies in api/net_schemas.py) --
    network: NetworkMode = Field(
        default=DEFAULT_NETWORK_MODE,
        description="`default`: an address and NAT, filtered by `egress`; `none`: no network.",
    )
    egress: (
        Annotated[list[EgressRuleText], Field(max_length=MAX_EGRESS_RULES)] | PolicyDocument | None
    ) = Field(
        default=None,
        description="Egress rules, or an ordered policy `{default, inspection, rules}` (see "
        "PUT /v1/sandboxes/{id}/egress); null or []: open.",
    )
    egress_policy: Annotated[str, Field(min_length=1, max_length=NAME_MAX_CHARS)] | None = Field(
        default=None,
        description="A named policy of the project (`/v1/egress-policies`) to copy "
        "(instead of `egress`).",
    )
    networks: list[NetworkRef] = Field(
        default_factory=list,
        max_length=MAX_NETWORKS_PER_SANDBOX,
        description="Private networks (ids or names) to join.",
    )
    volumes: list[VolumeMountBody] = Field(
        default_factory=list,
        max_length=MAX_VOLUMES_PER_SANDBOX,
        description="Volumes of the project to mount at create (mounting on a running "
        "sandbox is not supported: microvm has no device hot-plug).",
    )
    env_secrets: dict[str, str] = Field(
        default_factory=dict,
        max_length=ENV_SECRETS_MAX,
        description=(
            "Environment variables whose values are the project's secrets, {VAR: secret "
            "name}: every command gets each secret's current value (code in the guest sees "
            "it). Only the names are stored with the sandbox and shown."
        ),
    )
    placement: PlacementBody | None = Field(
        default=None,
        description="Where in a cluster (GET /v1/hosts): `host` pins one host, `labels` "
        "the hosts with all of them; `strategy` `spread` (default: most memory free) or "
        "`pack` (fill hosts one after another).",
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
    env_secrets: dict[str, str] = Field(
        description="{VAR: secret name}; the values are never shown."
    )
    placement_labels: dict[str, str] = Field(
        description="The placement.labels it was created with: every host it moves to "
        "(drain, resume elsewhere) and its fork children's hosts carry them too."
    )

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
            env_secrets=dict(rec.env_secrets),
            placement_labels=dict(rec.placement_labels),
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
    name: Annotated[str, Field(min_length=1, max_length=NAME_MAX_CHARS)]


class PauseRequest(Strict):
    mode: PauseMode = DEFAULT_PAUSE_MODE


class ResumeRequest(Strict):
    placement: PlacementBody | None = Field(
        default=None,
        description="Where in a cluster a paused sandbox resumes (GET /v1/hosts): `host` "
        "pins one host, `labels` the hosts with all of them (the labels it was created "
        "with still bind it). Another host than the one it paused on fetches its pause "
        "from the blob store (HUTCH_BLOB_URL). Without it: its own host, or another when "
        "that one is draining or down. A running sandbox is answered as it is.",
    )


class ForkRequest(Strict):
    count: Annotated[int, Field(ge=FORK_COUNT_RANGE[0], le=FORK_COUNT_RANGE[1], strict=True)] = (
        DEFAULT_FORK_COUNT
    )


class ExecRequest(Strict):
    cmd: (
        Annotated[list[Annotated[str, Field(max_length=CMD_ARG_MAX_CHARS)]], Field(min_length=1)]
        | Annotated[str, Field(min_length=1, max_length=CMD_MAX_CHARS)]
    )
    env: dict[str, str] = Field(default_factory=dict, max_length=ENV_MAX_VARS)
    cwd: Annotated[str, Field(min_length=1, max_length=PATH_MAX_CHARS)] | None = None
    user: Annotated[str, Field(min_length=1, max_length=USER_MAX_CHARS)] | None = None
    timeout_s: Annotated[float, Field(gt=0, le=MAX_EXEC_TIMEOUT_S)] | None = None
    stdin: Annotated[str, Field(max_length=STDIN_MAX_CHARS)] | None = None
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
    path: Annotated[str, Field(min_length=1, max_length=PATH_MAX_CHARS)]


class RenameRequest(Strict):
    source: Annotated[str, Field(min_length=1, max_length=PATH_MAX_CHARS)]
    destination: Annotated[str, Field(min_length=1, max_length=PATH_MAX_CHARS)]


class Image(BaseModel):
    name: str
    description: str
    built: bool
    digest: str | None
    size_bytes: int | None
    kernel_release: str | None
    source: ImageSourceModel = Field(
        default_factory=lambda: ImageSourceModel.model_validate({"type": "builtin"})
    )
    config: ImageConfigModel | None = None
    start: bool = False
    created_at: dt.datetime | None = None
    project: str | None = Field(
        default=None,
        description="The project the image belongs to (only it sees and boots it); null: "
        "a built-in image, every project's",
    )


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
