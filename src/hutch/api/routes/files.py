from __future__ import annotations

import datetime as dt
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import StreamingResponse

from hutch.api.deps import guest
from hutch.api.schemas import FileEntry, FileList, MkdirRequest, RenameRequest, WriteResult
from hutch.api.streaming import TrackedStream
from hutch.contract.limits import DEFAULT_FILE_MODE, PATH_MAX_CHARS
from hutch.errors import InvalidArgument
from hutch.services.guest_ops import GuestOps
from hutch.services.sandboxes import FileEntry as GuestFileEntry

router = APIRouter(prefix="/v1/sandboxes", tags=["files"])
Service = Annotated[GuestOps, Depends(guest)]
_DEFAULT_MODE = format(DEFAULT_FILE_MODE, "04o")
PathParam = Annotated[
    str,
    Query(min_length=1, max_length=PATH_MAX_CHARS, description="Absolute, or relative to /root."),
]


def entry(e: GuestFileEntry) -> FileEntry:
    return FileEntry(
        name=e.name,
        path=e.path,
        type=e.type,
        size=e.size,
        mode=f"{e.mode & 0o7777:04o}",
        mtime=dt.datetime.fromtimestamp(e.mtime, dt.UTC),
    )


def parse_mode(mode: str) -> int:
    try:
        value = int(mode, 8)
    except ValueError:
        value = -1
    if not 0 <= value <= 0o7777:
        raise InvalidArgument(f"mode={mode!r} is not an octal file mode like 0644")
    return value


@router.put("/{sandbox_id}/files", response_model=WriteResult)
async def write_file(
    sandbox_id: str,
    path: PathParam,
    request: Request,
    svc: Service,
    mode: Annotated[str, Query(pattern=r"^[0-7]{3,4}$")] = _DEFAULT_MODE,
) -> WriteResult:
    written = await svc.write_file(sandbox_id, path, request.stream(), mode=parse_mode(mode))
    return WriteResult(path=written.path, size=written.size)


@router.get(
    "/{sandbox_id}/files",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
async def read_file(sandbox_id: str, path: PathParam, svc: Service) -> StreamingResponse:
    """The file's bytes. A download the daemon cannot finish (the sandbox was deleted or
    its VM died half way) is aborted, never ended cleanly short: the client sees an
    incomplete chunked body. Pause, snapshot and fork wait for it to finish."""
    # A missing file is a 404, not a broken stream: the service reads the first chunk
    # before it hands the stream out.
    chunks = await svc.read_file(sandbox_id, path)
    return TrackedStream(
        chunks,
        what=f"download of {path} from {sandbox_id}",
        media_type="application/octet-stream",
    )


@router.get("/{sandbox_id}/files/list", response_model=FileList)
async def list_files(sandbox_id: str, path: PathParam, svc: Service) -> FileList:
    return FileList(entries=[entry(e) for e in await svc.list_dir(sandbox_id, path)])


@router.get("/{sandbox_id}/files/stat", response_model=FileEntry)
async def stat_file(sandbox_id: str, path: PathParam, svc: Service) -> FileEntry:
    return entry(await svc.stat(sandbox_id, path))


@router.delete("/{sandbox_id}/files", status_code=204, response_class=Response)
async def remove_file(
    sandbox_id: str, path: PathParam, svc: Service, recursive: bool = False
) -> Response:
    await svc.remove(sandbox_id, path, recursive=recursive)
    return Response(status_code=204)


@router.post("/{sandbox_id}/files/mkdir", response_model=FileEntry)
async def make_dir(sandbox_id: str, body: MkdirRequest, svc: Service) -> FileEntry:
    return entry(await svc.mkdir(sandbox_id, body.path))


@router.post("/{sandbox_id}/files/rename", response_model=FileEntry)
async def rename_file(sandbox_id: str, body: RenameRequest, svc: Service) -> FileEntry:
    return entry(await svc.rename(sandbox_id, body.source, body.destination))
