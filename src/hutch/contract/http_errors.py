"""The one table between error classes and the REST API's (HTTP status, stable code).

The daemon answers a :class:`~hutch.errors.HutchError` with ``STATUS_BY_ERROR``'s status
and the class's ``code`` in ``{"error": {"code", "message"}}`` (``hutch.api.errors``); the
SDK (``hutch.sdk._errors``) and the in-memory fake (``hutch.testing``) read the same table
the other way round, so a code always comes back as the class it left as.
"""

from __future__ import annotations

from hutch import errors as e

__all__ = [
    "CLASS_BY_CODE",
    "CLASS_BY_STATUS",
    "FRAMEWORK_CODES",
    "STATUS_BY_ERROR",
    "error_body",
    "error_for",
    "status_for",
]

# Most specific first: the first matching class wins.
STATUS_BY_ERROR: tuple[tuple[type[e.HutchError], int], ...] = (
    (e.UnknownImage, 400),
    (e.InvalidImage, 400),
    (e.InvalidDockerfile, 400),
    (e.BuildFailed, 422),
    (e.InvalidArgument, 400),
    (e.Unauthorized, 401),
    (e.Forbidden, 403),
    (e.NotFound, 404),
    (e.StateError, 409),
    (e.Busy, 409),
    (e.ImageMissing, 409),
    (e.ImageMismatch, 409),
    (e.Conflict, 409),
    (e.QuotaExceeded, 429),
    (e.Capacity, 429),
    (e.Unavailable, 503),
    (e.Timeout, 504),
    (e.AgentVersionMismatch, 502),
    (e.GuestError, 502),
    (e.RegistryError, 502),
    (e.VmError, 500),
    (e.ImageBuildError, 500),
    (e.NetworkError, 500),
    (e.BlobError, 500),
    (e.SnapshotError, 500),
    (e.SecretError, 500),
    (e.StoreError, 500),
    (e.HutchError, 500),
)

#: Codes of errors the web framework answers itself (no hutch class raised them).
FRAMEWORK_CODES: dict[int, str] = {
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
}

#: A client reads the code first ...
CLASS_BY_CODE: dict[str, type[e.HutchError]] = {cls.code: cls for cls in e.ALL_ERRORS}
#: ... and falls back to the status when the code is unknown (a newer daemon, a proxy).
CLASS_BY_STATUS: dict[int, type[e.HutchError]] = {
    400: e.InvalidArgument,
    401: e.Unauthorized,
    403: e.Forbidden,
    404: e.NotFound,
    409: e.Conflict,
    # FastAPI's own request validation answers 422 when a route does not remap it.
    422: e.InvalidArgument,
    429: e.Capacity,
    503: e.Unavailable,
    507: e.Capacity,
    504: e.Timeout,
}


def status_for(exc: e.HutchError) -> int:
    """The HTTP status the daemon answers ``exc`` with."""
    for cls, status in STATUS_BY_ERROR:
        if isinstance(exc, cls):
            return status
    return 500


def error_body(code: str, message: str) -> dict[str, dict[str, str]]:
    """The JSON body of every error answer."""
    return {"error": {"code": code, "message": message}}


def error_for(code: str | None, status: int | None, message: str) -> e.HutchError:
    """The exception for an API error: by ``code`` first, else by HTTP status."""
    cls = CLASS_BY_CODE.get(code or "") or CLASS_BY_STATUS.get(status or 0) or e.HutchError
    if cls is e.StateError:
        # StateError's constructor composes its own message from parts the wire format
        # does not carry; keep the server's message verbatim instead.
        state_exc = e.StateError.__new__(e.StateError)
        e.HutchError.__init__(state_exc, message)
        state_exc.state = ""
        state_exc.required = ()
        return state_exc
    return cls(message)
