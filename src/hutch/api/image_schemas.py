"""Request and response bodies of the image part of the REST API (imports and pulls)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "IMAGE_NAME_PATTERN",
    "ImageConfigModel",
    "ImageProgressEvent",
    "ImagePullRequest",
    "ImageSourceModel",
]

IMAGE_NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,31}$"


class ImageConfigModel(BaseModel):
    """The image config's defaults a sandbox takes (imported images)."""

    env: dict[str, str] = Field(default_factory=dict)
    working_dir: str | None = None
    user: str | None = None
    entrypoint: list[str] = Field(default_factory=list)
    cmd: list[str] = Field(default_factory=list)
    exposed_ports: list[str] = Field(
        default_factory=list,
        description="From the image's ExposedPorts. hutch opens no inbound port by "
        "itself: expose them with POST /v1/sandboxes/{id}/ports.",
    )


class ImageSourceModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["builtin", "registry", "archive"]
    ref: str | None = None
    digest: str | None = Field(None, description="The manifest digest (sha256:...)")
    format: str | None = Field(None, description="oci-archive | docker-archive")
    filename: str | None = None


class ImagePullRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(pattern=IMAGE_NAME_PATTERN, description="The new image's name")]
    ref: Annotated[
        str,
        Field(
            min_length=1,
            max_length=1024,
            description="[registry[:port]/]repository[:tag][@sha256:...]; registries on "
            "loopback are spoken to over HTTP, others over HTTPS",
        ),
    ]
    username: Annotated[str | None, Field(max_length=256)] = None
    password: Annotated[str | None, Field(max_length=4096)] = None
    token: Annotated[
        str | None,
        Field(max_length=8192, description="A bearer token (instead of username/password)"),
    ] = None
    start: bool = Field(
        False,
        description="Run the image's Entrypoint + Cmd as a background process in every "
        "sandbox created from it (after boot; not again in fork children)",
    )


class ImageProgressEvent(BaseModel):
    """One NDJSON line of ``POST /v1/images?progress=true``: ``progress`` lines, then
    one ``image`` (success) or ``error`` line."""

    type: Literal["progress", "image", "error"]
    stage: str | None = None
    message: str | None = None
    done: int | None = None
    total: int | None = None
    layer: int | None = None
    layers: int | None = None
    image: dict[str, Any] | None = None
    error: dict[str, str] | None = None
    status: int | None = None
