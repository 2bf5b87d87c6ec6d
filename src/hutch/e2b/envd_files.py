"""envd's plain HTTP routes: ``/files`` (download, upload: multipart with one or many
files, or ``application/octet-stream``, optionally gzip) and ``/health``.

Downloads and uploads are calls in flight like hutch's own (pause, snapshot and fork
wait for them); a download the daemon cannot finish is aborted, never passed off as a
shorter file. Parent directories are made on upload (as envd does). Paths relative to
the user's home are taken from ``/root``, hutch's home for file calls; file calls run as
root in the guest whatever ``username`` says.
"""

from __future__ import annotations

import posixpath
import zlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile

from hutch.api.streaming import TrackedStream
from hutch.e2b.errors import E2bError
from hutch.e2b.wiring import Hutch

__all__ = ["download", "health", "upload"]

_READ = 1 << 20
#: Files one multipart upload may carry (E2B's write_files).
MAX_FILES = 1000


async def health() -> Response:
    return Response(status_code=204)


async def download(hutch: Hutch, sandbox_id: str, path: str) -> Response:
    # A missing file is a 404, not a broken stream: the service reads the first chunk
    # before it hands the stream out, which holds its lease until its last byte.
    chunks = await hutch.guest.read_file(sandbox_id, path)
    return TrackedStream(
        chunks,
        what=f"download of {path} from {sandbox_id}",
        media_type="application/octet-stream",
    )


async def _gunzip(source: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        async for chunk in source:
            out = inflate.decompress(chunk)
            if out:
                yield out
        tail = inflate.flush()
    except zlib.error as exc:
        raise E2bError(400, f"the gzip body is corrupt: {exc}") from exc
    if not inflate.eof:
        raise E2bError(400, "the gzip body ends before its end")
    if tail:
        yield tail


async def _upload_chunks(up: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await up.read(_READ):
        yield chunk


async def _write(hutch: Hutch, sandbox_id: str, path: str, data: AsyncIterator[bytes]) -> Any:
    written = await hutch.guest.write_file(sandbox_id, path, data)
    return {"name": posixpath.basename(written.path), "type": "file", "path": written.path}


async def upload(hutch: Hutch, sandbox_id: str, request: Request) -> JSONResponse:
    path = request.query_params.get("path")
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        form = await request.form(max_files=MAX_FILES, max_fields=MAX_FILES)
        try:
            parts = [p for p in form.getlist("file") if isinstance(p, UploadFile)]
            if not parts:
                raise E2bError(400, "the multipart body has no 'file' part")
            results = []
            for part in parts:
                target = path if path and len(parts) == 1 else part.filename
                if not target:
                    raise E2bError(400, "each file part needs its path as its filename")
                results.append(await _write(hutch, sandbox_id, target, _upload_chunks(part)))
        finally:
            await form.close()
        return JSONResponse(results)
    if not path:
        raise E2bError(400, "path is required for an application/octet-stream upload")
    data: AsyncIterator[bytes] = request.stream()
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding == "gzip":
        data = _gunzip(data)
    elif encoding not in ("identity", ""):
        raise E2bError(400, f"Content-Encoding {encoding!r}: accepted gzip or none")
    return JSONResponse([await _write(hutch, sandbox_id, path, data)])
