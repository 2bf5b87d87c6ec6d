"""The one table from error class to HTTP status and stable error ``code``.

The SDK maps the codes back to the same classes (``hutch.sdk``).
"""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hutch import errors as e

log = logging.getLogger(__name__)

# Most specific first: the first matching class wins.
STATUS_BY_ERROR: tuple[tuple[type[e.HutchError], int], ...] = (
    (e.UnknownImage, 400),
    (e.InvalidArgument, 400),
    (e.Unauthorized, 401),
    (e.NotFound, 404),
    (e.StateError, 409),
    (e.Conflict, 409),
    (e.Capacity, 429),
    (e.Unavailable, 503),
    (e.Timeout, 504),
    (e.AgentVersionMismatch, 502),
    (e.GuestError, 502),
    (e.VmError, 500),
    (e.ImageBuildError, 500),
    (e.NetworkError, 500),
    (e.SnapshotError, 500),
    (e.StoreError, 500),
    (e.HutchError, 500),
)


def status_for(exc: e.HutchError) -> int:
    for cls, status in STATUS_BY_ERROR:
        if isinstance(exc, cls):
            return status
    return 500


def error_body(code: str, message: str) -> dict[str, dict[str, str]]:
    return {"error": {"code": code, "message": message}}


def error_response(code: str, message: str, status: int) -> JSONResponse:
    return JSONResponse(error_body(code, message), status_code=status)


async def handle_hutch_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, e.HutchError)
    status = status_for(exc)
    if isinstance(exc, e.Unavailable):
        response = error_response(exc.code, exc.message, status)
        response.headers["Retry-After"] = str(exc.retry_after_s)
        return response
    if status >= 500:
        log.error("%s: %s", type(exc).__name__, exc.message)
    return error_response(exc.code, exc.message, status)


async def handle_validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        problems.append(f"{where}: {err.get('msg', 'invalid')}")
    return error_response("invalid_argument", "; ".join(problems) or "invalid request", 400)


async def handle_http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    codes = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}
    code = codes.get(exc.status_code, "invalid_argument" if exc.status_code < 500 else "internal")
    return error_response(code, str(exc.detail), exc.status_code)


async def handle_unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error", exc_info=exc)
    return error_response("internal", f"internal error ({type(exc).__name__}); see hutchd.log", 500)
