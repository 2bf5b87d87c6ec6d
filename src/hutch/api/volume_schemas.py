"""Request and response bodies of ``/v1/volumes`` and the ``volumes`` field of a create."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from hutch.contract.limits import DISK_GIB_RANGE, ID_MAX_CHARS, NAME_MAX_CHARS, PATH_MAX_CHARS
from hutch.contract.volumes import (
    DEFAULT_VOLUME_KIND,
    MAX_VOLUMES_PER_SANDBOX,
    VOLUME_SIZE_RANGE,
    VolumeKind,
    VolumeMount,
)
from hutch.services.volumes import VolumeInfo

__all__ = [
    "MAX_VOLUMES_PER_SANDBOX",
    "PatchSandbox",
    "Volume",
    "VolumeGrow",
    "VolumeList",
    "VolumeMountBody",
    "VolumeRequest",
    "VolumeUser",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class VolumeMountBody(_Strict):
    """One volume mounted at create (checked further by the daemon: an absolute path,
    not over a system directory, no volume or path twice)."""

    volume: Annotated[str, Field(min_length=1, max_length=ID_MAX_CHARS)] = Field(
        description="The volume's id (`vol-...`) or name in the project."
    )
    path: Annotated[str, Field(min_length=1, max_length=PATH_MAX_CHARS)] = Field(
        description="Absolute guest path to mount it at, e.g. /data."
    )
    read_only: Annotated[bool, Field(strict=True)] = False

    def to_mount(self) -> VolumeMount:
        return VolumeMount(volume=self.volume, path=self.path, read_only=self.read_only)


class VolumeRequest(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=NAME_MAX_CHARS)]
    size: Annotated[int, Field(ge=VOLUME_SIZE_RANGE[0], le=VOLUME_SIZE_RANGE[1], strict=True)] = (
        Field(description="Size in bytes, fixed at create (grow with PATCH).")
    )
    kind: VolumeKind = Field(
        default=DEFAULT_VOLUME_KIND,
        description="`exclusive`: a block device on one sandbox at a time (fastest; "
        "fork refused). `shared`: mounted by many sandboxes at once, writes of one seen by "
        "the others; fork children mount it too; its size cannot grow.",
    )


class VolumeGrow(_Strict):
    size: Annotated[int, Field(ge=VOLUME_SIZE_RANGE[0], le=VOLUME_SIZE_RANGE[1], strict=True)] = (
        Field(description="The new size in bytes (volumes only grow).")
    )


class PatchSandbox(_Strict):
    """Change a running sandbox in place. ``disk_gib``: grow its own disk (and root
    filesystem) live. ``volumes``: refused, volumes are mounted at create only."""

    disk_gib: (
        Annotated[int, Field(ge=DISK_GIB_RANGE[0], le=DISK_GIB_RANGE[1], strict=True)] | None
    ) = None
    volumes: list[VolumeMountBody] | None = Field(
        default=None,
        description="Not supported: QEMU microvm has no device hot-plug, so volumes are "
        "mounted at create only; a request with this field is answered 400.",
    )


class VolumeUser(BaseModel):
    sandbox_id: str
    path: str
    read_only: bool


class Volume(BaseModel):
    id: str
    name: str
    project: str
    kind: VolumeKind
    size: int = Field(description="Bytes: the device size the guest sees.")
    used: int | None = Field(
        description="Bytes the volume's file takes on the host (data written plus ext4 "
        "metadata); null when unknown."
    )
    created_at: dt.datetime
    mounted_by: list[VolumeUser]
    host: str | None = Field(
        default=None,
        description="The host whose disk holds the volume's file: sandboxes that mount it "
        "run there (null: not recorded yet).",
    )

    @classmethod
    def of(cls, info: VolumeInfo) -> Volume:
        v = info.volume
        return cls(
            id=v.id,
            name=v.name,
            project=v.project,
            kind=v.kind,
            size=v.size_bytes,
            used=info.used_bytes,
            created_at=dt.datetime.fromtimestamp(v.created_at, dt.UTC),
            mounted_by=[VolumeUser(sandbox_id=m.sandbox_id, path=m.path, read_only=m.read_only)
                        for m in info.mounts],
            host=v.host,
        )  # fmt: skip


class VolumeList(BaseModel):
    volumes: list[Volume]
