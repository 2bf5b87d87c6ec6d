"""Request and response bodies of the image part of the REST API (imports, pulls, builds)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

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
    labels: dict[str, str] = Field(default_factory=dict, description="LABEL key=value pairs")


class ImageSourceModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["builtin", "registry", "archive", "dockerfile"]
    ref: str | None = None
    digest: str | None = Field(
        None,
        description="The manifest digest (sha256:...); of a Dockerfile build: the digest of "
        "its inputs (every step's key, the base image and the config)",
    )
    format: str | None = Field(None, description="oci-archive | docker-archive")
    filename: str | None = None
    dockerfile: str | None = Field(None, description="Dockerfile builds: its path in the context")
    base: str | None = Field(None, description="Dockerfile builds: the FROM image")
    base_digest: str | None = Field(None, description="Dockerfile builds: the FROM image's digest")
    steps: int | None = Field(None, description="Dockerfile builds: instructions built")

    @model_serializer(mode="wrap")
    def _drop_build_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # The Dockerfile fields appear on builds only (imports and pulls stay as they were).
        data: dict[str, Any] = handler(self)
        for key in _BUILD_FIELDS:
            if data.get(key) is None:
                data.pop(key, None)
        return data


_BUILD_FIELDS = ("dockerfile", "base", "base_digest", "steps")


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
    """One NDJSON line of ``POST /v1/images?progress=true``: ``progress`` lines (imports
    and pulls), ``status``, ``step`` and ``output`` lines (builds), then one ``image``
    (success) or ``error`` line."""

    type: Literal["progress", "status", "step", "output", "image", "error"]
    stage: str | None = None
    message: str | None = None
    done: int | None = None
    total: int | None = None
    layer: int | None = None
    layers: int | None = None
    step: int | None = Field(None, description="step and output: the step's number (FROM is 1)")
    steps: int | None = Field(None, description="step: how many steps the build has")
    line: int | None = Field(None, description="step: the instruction's line in the Dockerfile")
    instruction: str | None = Field(None, description="step: the instruction as written")
    state: Literal["running", "cached", "done", "config"] | None = Field(
        None,
        description="step: running (it starts), cached (its layer was reused), done (it "
        "ran), config (it only changes the image config)",
    )
    seconds: float | None = Field(None, description="step: how long it took")
    stream: Literal["stdout", "stderr"] | None = Field(None, description="output: which")
    data: str | None = Field(None, description="output: RUN output (UTF-8, invalid bytes replaced)")
    image: dict[str, Any] | None = None
    error: dict[str, str] | None = None
    status: int | None = None
