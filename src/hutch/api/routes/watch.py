"""``GET /v1/sandboxes/{id}/files/watch``: file changes as NDJSON, as they happen."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import StreamingResponse

from hutch.api.deps import files_extra
from hutch.contract.limits import PATH_MAX_CHARS, WATCH_S_MAX
from hutch.errors import HutchError
from hutch.services.files_extra import FilesExtraService, FileWatch

router = APIRouter(prefix="/v1/sandboxes", tags=["files"])
Service = Annotated[FilesExtraService, Depends(files_extra)]
MAX_WATCH_S = WATCH_S_MAX


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"


@router.get(
    "/{sandbox_id}/files/watch",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}}},
)
async def watch_files(
    sandbox_id: str,
    svc: Service,
    path: Annotated[
        str, Query(min_length=1, max_length=PATH_MAX_CHARS, description="Directory to watch.")
    ] = "/root",
    recursive: bool = True,
    timeout_s: Annotated[
        float | None,
        Query(gt=0, le=MAX_WATCH_S, description="End the stream after this many seconds."),
    ] = None,
) -> StreamingResponse:
    """Stream changes under ``path``, one JSON object per line.

    The first line is ``{"type": "watching", "path", "watches"}``: from then on no change
    is missed. Then ``{"type": "created"|"modified"|"deleted"|"renamed"|"overflow",
    "path", "is_dir", "time"}``; ``renamed`` adds ``from`` and ``to``. Bursts of writes
    to a file are coalesced into one ``modified``. The stream ends when the client
    disconnects, with ``{"type": "end", "reason": "deleted"}`` when the directory goes
    away, or ``{"type": "end", "reason": "timeout"}`` after ``timeout_s``; a failure
    ends it with ``{"type": "error", "code", "message"}``.
    """
    watch = await svc.watch(sandbox_id, path, recursive=recursive)
    return StreamingResponse(_events(watch, timeout_s), media_type="application/x-ndjson")


async def _events(watch: FileWatch, timeout_s: float | None) -> AsyncIterator[bytes]:
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    events = watch.events()
    try:
        yield _line({"type": "watching", "path": watch.path, "watches": watch.watches})
        while True:
            # Per event, not around the loop: a timeout spanning the yields would cancel
            # whatever the server does between them.
            remaining = None if deadline is None else deadline - loop.time()
            try:
                if remaining is not None and remaining <= 0:
                    raise TimeoutError
                event = await asyncio.wait_for(anext(events), remaining)
            except StopAsyncIteration:
                yield _line({"type": "end", "reason": watch.end_reason or "closed"})
                return
            except TimeoutError:
                yield _line({"type": "end", "reason": "timeout"})
                return
            yield _line(event.to_dict())
    except HutchError as exc:
        yield _line({"type": "error", "code": exc.code, "message": exc.message})
    finally:
        await events.aclose()
        watch.close()
