"""Bodies of ``/v1/secrets``. A secret's view has no value field: nothing the API
answers can carry one."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from hutch.contract.limits import SECRET_VALUE_MAX_BYTES
from hutch.contract.names import SECRET_NAME_PATTERN
from hutch.services.secrets import SecretInfo

__all__ = ["PutSecret", "Secret", "SecretList"]


class PutSecret(BaseModel):
    model_config = ConfigDict(extra="forbid")

    value: Annotated[str, Field(strict=True)] = Field(
        description=(
            f"The value: UTF-8 text without NUL, 1-{SECRET_VALUE_MAX_BYTES} bytes. Stored "
            "encrypted; never returned by any call."
        ),
        json_schema_extra={"writeOnly": True},
    )


class Secret(BaseModel):
    name: str = Field(pattern=SECRET_NAME_PATTERN)
    project: str
    version: int = Field(description="1 at create, +1 at each replace.")
    created_at: dt.datetime
    updated_at: dt.datetime = Field(description="When the current version was stored.")

    @classmethod
    def of(cls, info: SecretInfo) -> Secret:
        return cls(
            name=info.name,
            project=info.project,
            version=info.version,
            created_at=dt.datetime.fromtimestamp(info.created_at, dt.UTC),
            updated_at=dt.datetime.fromtimestamp(info.updated_at, dt.UTC),
        )


class SecretList(BaseModel):
    secrets: list[Secret]
