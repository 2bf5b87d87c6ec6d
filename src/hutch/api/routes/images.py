"""``POST /v1/images`` (import an archive, or pull from a registry) and
``DELETE /v1/images/{name}``; the listing is in ``meta.py``.

One endpoint, two bodies, told apart by Content-Type:

- ``application/json`` (:class:`ImagePullRequest`): pull ``ref`` from a registry;
- ``application/x-tar`` / ``application/octet-stream`` (``?name=``): the archive itself
  (oci-archive, docker-archive; gzip or zstd compressed is fine), streamed to disk as it
  arrives, capped at ``HUTCH_MAX_IMAGE_BYTES``.

Without ``progress`` the answer is 201 with the image, or the error with its status.
With ``progress=true`` it is NDJSON (:class:`ImageProgressEvent`): ``progress`` lines
while layers are applied, then one ``image`` or ``error`` line (the error line carries
the status the plain request would have had).
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

from hutch.api.errors import status_for
from hutch.api.image_schemas import IMAGE_NAME_PATTERN, ImagePullRequest
from hutch.api.schemas import Image
from hutch.errors import Conflict, HutchError, InvalidArgument
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
        }
    )


def _importer(request: Request) -> ImageImporter:
    importer: ImageImporter | None = getattr(request.app.state, "importer", None)
    if importer is None:
        raise Conflict("this daemon's image source does not take imports")
    return importer


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
        502: {"description": "The registry failed or could not be reached"},
    },
    openapi_extra={"requestBody": _REQUEST_BODY},
)
async def create_image(
    request: Request,
    name: Annotated[
        str | None,
        Query(pattern=IMAGE_NAME_PATTERN, description="The new image's name (archive uploads)"),
    ] = None,
    start: Annotated[
        bool, Query(description="Archive uploads: run Entrypoint + Cmd at boot")
    ] = False,
    progress: Annotated[bool, Query(description="Answer NDJSON progress events")] = False,
) -> Response:
    importer = _importer(request)
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "application/json":
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

        def run(report: Callable[[ImportProgress], None]) -> Awaitable[ImageView]:
            return importer.pull(
                body.name, body.ref, credentials=creds, start=body.start, progress=report
            )

    elif ctype in ARCHIVE_TYPES:
        if name is None:
            raise InvalidArgument("an archive upload needs ?name=<new image name>")
        spool = await _spool(request, importer)
        filename = request.headers.get("x-hutch-filename")
        image_name = name

        def run(report: Callable[[ImportProgress], None]) -> Awaitable[ImageView]:
            return importer.import_archive(
                image_name, spool, filename=filename, start=start, progress=report
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


async def _events(
    run: Callable[[Callable[[ImportProgress], None]], Awaitable[ImageView]],
) -> AsyncIterator[bytes]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[ImportProgress | None] = asyncio.Queue()

    def report(p: ImportProgress) -> None:  # called from the worker thread
        loop.call_soon_threadsafe(queue.put_nowait, p)

    def line(obj: dict[str, Any]) -> bytes:
        return json.dumps(obj).encode() + b"\n"

    task = asyncio.ensure_future(run(report))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        while (event := await queue.get()) is not None:
            yield line(
                {
                    "type": "progress",
                    "stage": event.stage,
                    "message": event.message,
                    "done": event.done,
                    "total": event.total,
                    "layer": event.layer,
                    "layers": event.layers,
                }
            )
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
            # The client left: the import runs to its end in its thread (it cannot be
            # cut mid-write safely) and cleans up after itself.
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
async def delete_image(name: str, request: Request) -> Response:
    await _importer(request).delete(name)
    return Response(status_code=204)
