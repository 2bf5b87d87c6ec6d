"""``POST /v1/images`` (import an archive, pull from a registry, or build a Dockerfile)
and ``DELETE /v1/images/{name}``; the listing is in ``meta.py``.

One endpoint, three bodies, told apart by Content-Type and ``?dockerfile=``:

- ``application/json`` (:class:`ImagePullRequest`): pull ``ref`` from a registry;
- ``application/x-tar`` / ``application/octet-stream`` (``?name=``): the archive itself
  (oci-archive, docker-archive; gzip or zstd compressed is fine), streamed to disk as it
  arrives, capped at ``HUTCH_MAX_IMAGE_BYTES``;
- the same tar types with ``?dockerfile=PATH``: a *build context* (the Dockerfile at
  PATH inside it), built as ``?name=`` with ``build_arg``, ``egress``, ``network``,
  ``vcpus``/``memory_mib``/``disk_gib`` (the build sandbox), ``timeout_s``, ``no_cache``.

Without ``progress`` the answer is 201 with the image, or the error with its status.
With ``progress=true`` it is NDJSON (:class:`ImageProgressEvent`): ``progress`` lines
while layers are applied (a build: ``status``, ``step`` and ``output`` lines), then one
``image`` or ``error`` line (the error line carries the status the plain request would
have had).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from hutch.api.deps import Caller
from hutch.api.errors import status_for
from hutch.api.image_schemas import IMAGE_NAME_PATTERN, ImagePullRequest
from hutch.api.schemas import Image
from hutch.contract.limits import (
    BUILD_ARGS_MAX,
    BUILD_TIMEOUT_S_RANGE,
    DEFAULT_BUILD_TIMEOUT_S,
    DEFAULT_DISK_GIB,
    DEFAULT_MEMORY_MIB,
    DEFAULT_VCPUS,
    MAX_EGRESS_RULES,
)
from hutch.errors import Conflict, HutchError, InvalidArgument
from hutch.models import NetworkMode, Shape
from hutch.services.image_builder import BuildOptions, BuildProgress, ImageBuilder
from hutch.services.image_import import Credentials, ImageImporter, ImportProgress
from hutch.services.images import ImageView

router = APIRouter(tags=["images"])

ARCHIVE_TYPES = ("application/x-tar", "application/octet-stream", "application/gzip",
                 "application/zstd")  # fmt: skip
_PULL_BODY_LIMIT = 64 << 10


def image_model(i: ImageView) -> Image:
    return Image.model_validate(
        {
            "name": i.name,
            "description": i.description,
            "built": i.built,
            "digest": i.digest,
            "size_bytes": i.size_bytes,
            "kernel_release": i.kernel_release,
            "source": i.source,
            "config": i.config,
            "start": i.start,
            "created_at": dt.datetime.fromtimestamp(i.created_at, dt.UTC)
            if i.created_at is not None
            else None,
            "project": i.project,
        }
    )


def _importer(request: Request) -> ImageImporter:
    importer: ImageImporter | None = getattr(request.app.state, "importer", None)
    if importer is None:
        raise Conflict("this daemon's image source does not take imports")
    return importer


def _builder(request: Request) -> ImageBuilder:
    builder: ImageBuilder | None = getattr(request.app.state, "builder", None)
    if builder is None:
        raise Conflict("this daemon's image source does not build Dockerfiles")
    return builder


def _build_args(items: list[str]) -> dict[str, str]:
    if len(items) > BUILD_ARGS_MAX:
        raise InvalidArgument(f"{len(items)} build_arg values; at most {BUILD_ARGS_MAX}")
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise InvalidArgument(f"build_arg {item!r} is not NAME=value")
        out[name] = value
    return out


Progress = Callable[[Any], None]


_REQUEST_BODY: dict[str, Any] = {
    "required": True,
    "content": {
        "application/json": {"schema": ImagePullRequest.model_json_schema()},
        "application/x-tar": {"schema": {"type": "string", "format": "binary"}},
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
    },
}


@router.post(
    "/v1/images",
    status_code=201,
    response_model=Image,
    responses={
        201: {"content": {"application/x-ndjson": {}}, "description": "The image"},
        422: {
            "description": "A build step failed (code build_failed): the message has its "
            "line, exit code and the end of its output"
        },
        502: {"description": "The registry failed or could not be reached"},
    },
    openapi_extra={"requestBody": _REQUEST_BODY},
)
async def create_image(
    request: Request,
    who: Caller,
    name: Annotated[
        str | None,
        Query(pattern=IMAGE_NAME_PATTERN, description="The new image's name (archive uploads)"),
    ] = None,
    start: Annotated[
        bool, Query(description="Archive uploads: run Entrypoint + Cmd at boot")
    ] = False,
    progress: Annotated[bool, Query(description="Answer NDJSON progress events")] = False,
    dockerfile: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=4096,
            description="Build: the Dockerfile's path in the build context (the body). "
            "Its presence makes the request a build",
        ),
    ] = None,
    build_arg: Annotated[
        list[str] | None, Query(description="Build: NAME=value for an ARG (repeat it)")
    ] = None,
    egress: Annotated[
        list[str] | None,
        Query(
            max_length=MAX_EGRESS_RULES,
            description="Build: egress rules of the build sandbox (repeat it; none: open)",
        ),
    ] = None,
    network: Annotated[
        NetworkMode, Query(description="Build: the build sandbox's network")
    ] = NetworkMode.DEFAULT,
    vcpus: Annotated[int, Query(description="Build: the build sandbox's vCPUs")] = DEFAULT_VCPUS,
    memory_mib: Annotated[
        int, Query(description="Build: the build sandbox's memory, MiB")
    ] = DEFAULT_MEMORY_MIB,
    disk_gib: Annotated[
        int,
        Query(
            description="Build: the build sandbox's disk, GiB (the image's size: sandboxes "
            "from it need at least this)"
        ),
    ] = DEFAULT_DISK_GIB,
    timeout_s: Annotated[
        int,
        Query(
            ge=BUILD_TIMEOUT_S_RANGE[0],
            le=BUILD_TIMEOUT_S_RANGE[1],
            description="Build: seconds the whole build may take",
        ),
    ] = DEFAULT_BUILD_TIMEOUT_S,
    no_cache: Annotated[bool, Query(description="Build: run every step again")] = False,
) -> Response:
    importer = _importer(request)
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if dockerfile is not None:
        if ctype not in ARCHIVE_TYPES:
            raise InvalidArgument(
                f"a build's body is its context as a tar ({' or '.join(ARCHIVE_TYPES[:2])}); "
                f"Content-Type {ctype or '(none)'!r} is not accepted"
            )
        if name is None:
            raise InvalidArgument("a build needs ?name=<new image name>")
        builder = _builder(request)
        options = BuildOptions(
            dockerfile=dockerfile,
            build_args=_build_args(build_arg or []),
            egress=list(egress) if egress else None,
            network=network,
            shape=Shape(vcpus=vcpus, memory_mib=memory_mib, disk_gib=disk_gib),
            timeout_s=timeout_s,
            no_cache=no_cache,
            start=start,
            filename=request.headers.get("x-hutch-filename"),
            project=who.project,
        )
        builder.check(options)
        spool = await _spool(request, importer)
        build_name = name

        def run(report: Progress) -> Awaitable[ImageView]:
            return builder.build(build_name, spool, options, progress=report)

    elif ctype == "application/json":
        raw = await _read_limited(request, _PULL_BODY_LIMIT)
        try:
            body = ImagePullRequest.model_validate_json(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
            )
            raise InvalidArgument(problems or "invalid pull request") from exc
        if name is not None and name != body.name:
            raise InvalidArgument("give the name in the body or in ?name=, not two different ones")
        creds = Credentials(username=body.username, password=body.password, token=body.token)

        def run(report: Progress) -> Awaitable[ImageView]:
            return importer.pull(
                body.name,
                body.ref,
                credentials=creds,
                start=body.start,
                progress=report,
                project=who.project,
            )

    elif ctype in ARCHIVE_TYPES:
        if name is None:
            raise InvalidArgument("an archive upload needs ?name=<new image name>")
        spool = await _spool(request, importer)
        filename = request.headers.get("x-hutch-filename")
        image_name = name

        def run(report: Progress) -> Awaitable[ImageView]:
            return importer.import_archive(
                image_name,
                spool,
                filename=filename,
                start=start,
                progress=report,
                project=who.project,
            )

    else:
        raise InvalidArgument(
            f"Content-Type {ctype or '(none)'!r} is not accepted; send application/json "
            f"(a pull: {{name, ref}}) or the archive as {' or '.join(ARCHIVE_TYPES[:2])}"
        )
    if not progress:
        view = await run(lambda _: None)
        return JSONResponse(image_model(view).model_dump(mode="json"), status_code=201)
    return StreamingResponse(_events(run), media_type="application/x-ndjson", status_code=201)


def _event(event: ImportProgress | BuildProgress) -> dict[str, Any]:
    if isinstance(event, BuildProgress):
        line: dict[str, Any] = {"type": event.type, "message": event.message}
        if event.type == "step":
            line |= {"step": event.step, "steps": event.steps, "line": event.line,
                     "instruction": event.instruction, "state": event.status,
                     "seconds": event.seconds}  # fmt: skip
        elif event.type == "output":
            line |= {"step": event.step, "stream": event.stream, "data": event.data}
        return line
    return {
        "type": "progress",
        "stage": event.stage,
        "message": event.message,
        "done": event.done,
        "total": event.total,
        "layer": event.layer,
        "layers": event.layers,
    }


async def _events(run: Callable[[Progress], Awaitable[ImageView]]) -> AsyncIterator[bytes]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[ImportProgress | BuildProgress | None] = asyncio.Queue()

    def report(p: ImportProgress | BuildProgress) -> None:  # from a worker thread or the loop
        loop.call_soon_threadsafe(queue.put_nowait, p)

    def line(obj: dict[str, Any]) -> bytes:
        return json.dumps(obj).encode() + b"\n"

    task = asyncio.ensure_future(run(report))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        while (event := await queue.get()) is not None:
            yield line(_event(event))
        try:
            view = task.result()
        except HutchError as exc:
            yield line(
                {
                    "type": "error",
                    "error": {"code": exc.code, "message": exc.message},
                    "status": status_for(exc),
                }
            )
            return
        yield line({"type": "image", "image": image_model(view).model_dump(mode="json")})
    finally:
        if not task.done():
            # The client left: the import (or build) runs to its end (an import cannot
            # be cut mid-write safely) and cleans up after itself.
            task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)


async def _read_limited(request: Request, limit: int) -> bytes:
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise InvalidArgument(f"a pull request body is at most {limit} bytes")
    return bytes(data)


async def _spool(request: Request, importer: ImageImporter) -> Any:
    """Write the upload to a file under the state dir as it arrives."""
    limit = importer.settings.max_image_bytes
    path = importer.new_spool()
    written = 0
    try:
        with path.open("wb") as f:
            async for chunk in request.stream():
                written += len(chunk)
                if written > limit:
                    raise InvalidArgument(
                        f"the archive is larger than {limit} bytes (HUTCH_MAX_IMAGE_BYTES)"
                    )
                f.write(chunk)
        if written == 0:
            raise InvalidArgument("the upload is empty; send the archive as the request body")
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        raise
    return path


@router.delete(
    "/v1/images/{name}",
    status_code=204,
    responses={409: {"description": "Built in, or used by sandboxes or snapshots (named)"}},
)
async def delete_image(name: str, request: Request, who: Caller) -> Response:
    """The caller's project's image (another project's is not found)."""
    await _importer(request).delete(name, who.project)
    return Response(status_code=204)
