"""Errors as E2B clients expect them.

Control plane (``E2B_API_URL``): a JSON body ``{"code": <HTTP status>, "message": ...}``
(E2B's ``Error`` model) with the HTTP status; ``Should-Retry``/``Retry-After`` where a
retry helps (the SDKs retry 429/502/503/504, and anything marked ``Should-Retry: true``,
waiting for ``Retry-After``). Data plane (``E2B_SANDBOX_URL``): Connect error codes for
the RPC services (:mod:`hutch.e2b.connect`), and the same JSON body for the plain HTTP
routes (``/files``, the code interpreter), with the message patterns the SDKs read (a
502 naming a sandbox that "was not found" is ``SandboxNotRunningException``).

Every hutch error maps here; nothing the face refuses on purpose is a 500.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi.responses import JSONResponse

from hutch import errors as e
from hutch.contract.http_errors import status_for

__all__ = [
    "E2bError",
    "connect_code_for",
    "e2b_error_for",
    "error_response",
    "sandbox_gone",
    "unsupported",
]


@dataclass
class E2bError(Exception):
    """An answer in E2B's error shape. ``error_code``: E2B's machine-readable reason."""

    status: int
    message: str
    error_code: str | None = None
    retry_after_s: int | None = None
    should_retry: bool | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.status}: {self.message}"


def error_response(err: E2bError) -> JSONResponse:
    body: dict[str, object] = {"code": err.status, "message": err.message}
    if err.error_code:
        body["error_code"] = err.error_code
    headers = dict(err.headers)
    if err.should_retry is not None:
        headers["Should-Retry"] = "true" if err.should_retry else "false"
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(err.retry_after_s)
    return JSONResponse(body, status_code=err.status, headers=headers)


def e2b_error_for(exc: e.HutchError) -> E2bError:
    """The E2B answer for a hutch error: hutch's status table, E2B's body and retry
    hints (a sandbox still being checked after a restart, a pause waiting for calls in
    flight: retry; a full host: do not hammer it)."""
    status = status_for(exc)
    if isinstance(exc, e.Unavailable):
        return E2bError(503, exc.message, retry_after_s=exc.retry_after_s, should_retry=True)
    if isinstance(exc, e.Busy):
        return E2bError(409, exc.message, retry_after_s=1, should_retry=True)
    if isinstance(exc, e.Capacity):
        return E2bError(429, exc.message, should_retry=False)
    if isinstance(exc, e.UnknownImage):
        return E2bError(404, exc.message)
    return E2bError(status, exc.message)


#: hutch error class → Connect code, most specific first.
_CONNECT_CODES: tuple[tuple[type[e.HutchError], str], ...] = (
    (e.InvalidArgument, "invalid_argument"),
    (e.Unauthorized, "unauthenticated"),
    (e.NotFound, "not_found"),
    (e.StateError, "failed_precondition"),
    (e.Busy, "unavailable"),
    (e.Conflict, "failed_precondition"),
    (e.Capacity, "resource_exhausted"),
    (e.Unavailable, "unavailable"),
    (e.Timeout, "deadline_exceeded"),
    (e.GuestError, "unavailable"),
)


def connect_code_for(exc: e.HutchError) -> str:
    for cls, code in _CONNECT_CODES:
        if isinstance(exc, cls):
            return code
    return "internal"


def sandbox_gone(sandbox_id: str) -> E2bError:
    """A data-plane call to a sandbox that does not exist (any more): the 502 E2B's
    proxy answers, whose message the SDKs turn into ``SandboxNotRunningException``."""
    return E2bError(
        502,
        f"The sandbox {sandbox_id} was not found (killed, timed out, or never created)",
        headers={"Content-Type": "application/json"},
    )


def unsupported(what: str, instead: str, status: int = 400) -> E2bError:
    """A call hutch does not offer through the E2B face, with what it offers instead."""
    return E2bError(
        status,
        f"{what} is not supported by hutch's E2B-compatible API. {instead}",
        error_code="not_supported_by_hutch",
        should_retry=False,
    )
