"""The REST layer's error handlers. The table from error class to HTTP status and
stable error ``code`` is the contract's (:mod:`hutch.contract.http_errors`); the SDK maps
the codes back to the same classes with it.
"""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hutch import errors as e
from hutch.contract.http_errors import FRAMEWORK_CODES, STATUS_BY_ERROR, error_body, status_for

__all__ = [
    "STATUS_BY_ERROR",
    "error_body",
    "error_response",
    "handle_http_error",
    "handle_hutch_error",
    "handle_unexpected",
    "handle_validation_error",
    "response_for",
    "status_for",
]

log = logging.getLogger(__name__)


def error_response(code: str, message: str, status: int) -> JSONResponse:
    return JSONResponse(error_body(code, message), status_code=status)


def response_for(exc: e.HutchError) -> JSONResponse:
    """The answer to ``exc``: its status and code from the one table, and Retry-After
    for ``Unavailable`` (also where the cluster router answers before the REST app)."""
    status = status_for(exc)
    response = error_response(exc.code, exc.message, status)
    if isinstance(exc, e.Unavailable):
        response.headers["Retry-After"] = str(exc.retry_after_s)
    elif status >= 500:
        log.error("%s: %s", type(exc).__name__, exc.message)
    return response


async def handle_hutch_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, e.HutchError)
    return response_for(exc)


async def handle_validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        problems.append(f"{where}: {err.get('msg', 'invalid')}")
    return error_response("invalid_argument", "; ".join(problems) or "invalid request", 400)


async def handle_http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = FRAMEWORK_CODES.get(
        exc.status_code, "invalid_argument" if exc.status_code < 500 else "internal"
    )
    return error_response(code, str(exc.detail), exc.status_code)


async def handle_unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error", exc_info=exc)
    return error_response("internal", f"internal error ({type(exc).__name__}); see hutchd.log", 500)
