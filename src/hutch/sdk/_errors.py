"""Errors only a client can hit, and reading an API error answer back into its class
(with the contract's table, :mod:`hutch.contract.http_errors`).

The server-side hierarchy lives in :mod:`hutch.errors`; the classes here join it so one
``except HutchError`` still catches everything::

    HutchError
    ├── Unauthorized
    │   └── ApiKeyMissing       no key in the argument, HUTCH_API_KEY or the key file
    ├── DaemonUnreachable       nothing answers at the base URL (connection refused, ...)
    ├── ClientClosed            the client (or the Sandbox owning it) was closed
    └── ProtocolError           the daemon answered something this SDK cannot read
"""

from __future__ import annotations

import json
from typing import Any

from hutch.contract.http_errors import error_for
from hutch.errors import HutchError, Unauthorized

__all__ = [
    "ApiKeyMissing",
    "ClientClosed",
    "DaemonUnreachable",
    "ProtocolError",
    "error_for",
    "error_from_body",
]


class ApiKeyMissing(Unauthorized):
    """No API key was given and none could be discovered."""

    code = "api_key_missing"


class DaemonUnreachable(HutchError):
    """The daemon does not answer at the configured URL."""

    code = "daemon_unreachable"


class ClientClosed(HutchError):
    """A request on a closed client: make a new one, or ``Sandbox.connect(id)`` again."""

    code = "client_closed"


class ProtocolError(HutchError):
    """The daemon's answer does not follow the API contract (version skew, proxy, ...)."""

    code = "protocol_error"


def error_from_body(status: int, body: bytes) -> HutchError:
    """Map an HTTP error response (status >= 400) to a typed exception."""
    code: str | None = None
    message = ""
    try:
        payload: Any = json.loads(body) if body else None
    except ValueError:
        payload = None
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        err = payload["error"]
        code = err.get("code") if isinstance(err.get("code"), str) else None
        message = err.get("message") if isinstance(err.get("message"), str) else ""
    elif isinstance(payload, dict) and isinstance(payload.get("detail"), str):
        # A bare framework error (e.g. a route the daemon does not have).
        message = payload["detail"]
    if not message:
        text = body.decode("utf-8", "replace").strip()[:500]
        message = f"HTTP {status}" + (f": {text}" if text else "")
    return error_for(code, status, message)
