"""Bodies of the projects and keys API (issue 10)."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from hutch.contract.names import NAME_PATTERN
from hutch.services.projects import KeyRow, ProjectRow, ProjectUse

ProjectName = Annotated[str, Field(pattern=NAME_PATTERN, max_length=63)]
QuotaValue = Annotated[int | None, Field(ge=0, strict=True)]
KeyRole = Literal["owner", "developer", "operator", "viewer"]


def _time(t: float | None) -> dt.datetime | None:
    return None if t is None else dt.datetime.fromtimestamp(t, dt.UTC)


class Quotas(BaseModel):
    """A project's quotas; null (or absent) is unlimited."""

    model_config = ConfigDict(extra="forbid")
    max_sandboxes: QuotaValue = None
    max_vcpus: QuotaValue = None
    max_memory_mib: QuotaValue = None
    max_snapshot_bytes: QuotaValue = None


class Usage(BaseModel):
    """What the project holds now, in the quotas' units."""

    sandboxes: int
    vcpus: int
    memory_mib: int
    snapshot_bytes: int

    @classmethod
    def of(cls, use: ProjectUse) -> Usage:
        return cls(
            sandboxes=use.sandboxes,
            vcpus=use.vcpus,
            memory_mib=use.memory_mib,
            snapshot_bytes=use.snapshot_bytes,
        )


class CreateProject(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: ProjectName
    quotas: Quotas | None = None


class UpdateProject(BaseModel):
    """Only the quotas named change; null lifts one."""

    model_config = ConfigDict(extra="forbid")
    quotas: Quotas


class Project(BaseModel):
    name: str
    created_at: dt.datetime
    quotas: Quotas
    usage: Usage

    @classmethod
    def of(cls, row: ProjectRow, use: ProjectUse) -> Project:
        created = _time(row.created_at)
        assert created is not None
        return cls(
            name=row.name,
            created_at=created,
            quotas=Quotas(**row.quotas),
            usage=Usage.of(use),
        )


class ProjectList(BaseModel):
    projects: list[Project]


class CreateKey(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: ProjectName
    role: KeyRole
    expires_at: dt.datetime | None = None
    ttl_s: Annotated[int | None, Field(gt=0, strict=True)] = None


class Key(BaseModel):
    """A key as listed: never its secret nor its hash."""

    id: str
    project: str
    name: str
    role: KeyRole
    created_at: dt.datetime
    created_by: str | None
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None
    last_used_at: dt.datetime | None

    @classmethod
    def of(cls, row: KeyRow) -> Key:
        created = _time(row.created_at)
        assert created is not None
        return cls(
            id=row.id,
            project=row.project,
            name=row.name,
            role=row.role,  # type: ignore[arg-type]
            created_at=created,
            created_by=row.created_by,
            expires_at=_time(row.expires_at),
            revoked_at=_time(row.revoked_at),
            last_used_at=_time(row.last_used_at),
        )


class CreatedKey(Key):
    """The new key, with its secret: shown this once, stored only as a hash."""

    secret: str


class KeyList(BaseModel):
    keys: list[Key]
