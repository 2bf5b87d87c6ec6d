"""Whole directories as tar: ``GET``/``PUT /v1/sandboxes/{id}/files/archive``."""

from __future__ import annotations

import posixpath
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from hutch.api.deps import files_extra
from hutch.api.streaming import TrackedStream
from hutch.contract.limits import ARCHIVE_MAX_BYTES, PATH_MAX_CHARS
from hutch.errors import InvalidArgument
from hutch.services.files_extra import FilesExtraService

router = APIRouter(prefix="/v1/sandboxes", tags=["files"])
Service = Annotated[FilesExtraService, Depends(files_extra)]
PathParam = Annotated[
    str,
    Query(
        min_length=1, max_length=PATH_MAX_CHARS, description="Directory: absolute or under /root."
    ),
]

#: An upload larger than this is refused while it streams (the sandbox disk is the real
#: bound; this keeps one request from filling the host's pipes for hours).
MAX_ARCHIVE_BYTES = ARCHIVE_MAX_BYTES


class ArchiveResult(BaseModel):
    path: str
    entries: int
    bytes: int


@router.get(
    "/{sandbox_id}/files/archive",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-tar": {}}}},
)
async def download_archive(sandbox_id: str, path: PathParam, svc: Service) -> StreamingResponse:
    """The directory's content as an uncompressed tar stream (names relative to it;
    symlinks stored as links; sockets and devices skipped)."""
    # A missing directory is a 404, not a broken stream: the service reads the first
    # chunk before it hands the stream out.
    chunks = await svc.read_archive(sandbox_id, path)
    name = posixpath.basename(path.rstrip("/")) or "root"
    # A tar the daemon cannot finish aborts the connection (never a clean, short end).
    return TrackedStream(
        chunks,
        what=f"archive download of {path} from {sandbox_id}",
        media_type="application/x-tar",
        headers={"Content-Disposition": f'attachment; filename="{name}.tar"'},
    )


@router.put(
    "/{sandbox_id}/files/archive",
    response_model=ArchiveResult,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
async def upload_archive(
    sandbox_id: str, path: PathParam, request: Request, svc: Service
) -> ArchiveResult:
    """Unpack a tar stream (plain or gzip) into directory ``path`` (created if missing;
    existing files are replaced, directories merged). All or nothing: an absolute name,
    ``..``, a link pointing outside ``path`` or a device file is refused with 400 naming
    the member, and nothing is written."""

    async def limited() -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > MAX_ARCHIVE_BYTES:
                raise InvalidArgument(
                    f"the archive is larger than {MAX_ARCHIVE_BYTES} bytes; "
                    "split it into several uploads"
                )
            if chunk:
                yield chunk

    written = await svc.write_archive(sandbox_id, path, limited())
    return ArchiveResult(path=written.path, entries=written.entries, bytes=written.bytes)
