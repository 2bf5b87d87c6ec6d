"""What every route of the E2B face shares: the services (``wiring.Hutch``), the key
and token checks, and the reported ``envdVersion``; plus request helpers."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from hutch.api.auth import Authenticator
from hutch.api.cluster_router import FORWARDED_PATH
from hutch.contract.auth import Permission, Principal
from hutch.e2b.errors import E2bError
from hutch.e2b.keys import TokenIssuer, verify_api_key
from hutch.e2b.wiring import Hutch
from hutch.services.cluster_auth import ClusterSigner
from hutch.services.events import act_as

__all__ = [
    "ENVD_VERSION", "Face", "api_principal", "face", "needs", "presented_key", "read_json",
]  # fmt: skip

#: The envd version the face reports. The SDKs gate features on it (``e2b/envd/
#: versions.py``, and the same numbers in the JS SDK): 0.1.4 recursive watch, 0.1.5 and
#: 0.2.4 metrics, 0.3.0 stdin control, 0.4.0 default user, 0.5.2 closing stdin, 0.5.7
#: octet-stream uploads: all met. 0.6.2 (file metadata as user.e2b.* xattrs) is not:
#: hutch's agent does not set extended attributes, so the SDKs refuse metadata on
#: writes themselves (and with it, 0.6.3 entry info in watch events and 0.6.4 network
#: mounts, which hutch sandboxes do not have).
ENVD_VERSION = "0.6.1"


@dataclass
class Face:
    hutch: Hutch
    tokens: TokenIssuer
    auth: Authenticator
    envd_version: str = ENVD_VERSION
    #: Checks the principal of a request another host forwarded (None: one host).
    signer: ClusterSigner | None = None


def face(request: Request) -> Face:
    f: Face = request.app.state.e2b
    return f


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a control-plane request presents: ``X-API-KEY`` (what the E2B SDKs
    send), or ``Authorization: Bearer``."""
    presented = headers.get("x-api-key")
    if presented is None:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            presented = token
    return presented


def api_principal(request: Request) -> Principal:
    """Control-plane auth: the caller's key (:func:`presented_key`), or, for a request
    another host of the cluster forwarded here (``hutch.e2b.cluster``), the principal
    it signed. Raises Unauthorized (answered 401 in E2B's shape)."""
    f = face(request)
    signed_for = request.scope.get(FORWARDED_PATH)
    if (
        signed_for is not None
        and f.signer is not None
        and ClusterSigner.is_forward(request.headers)
    ):
        return f.signer.verify(request.headers, request.method, signed_for)
    client = request.client
    return verify_api_key(presented_key(request.headers), f.auth, client.host if client else "")


def needs(permission: Permission) -> Callable[[Request], Awaitable[Principal]]:
    """A route's dependency: the caller, allowed ``permission`` (else 403 naming the
    role and the permission, as the REST API says it)."""

    # Async so that it runs in the request's own task: the actor it sets is then the
    # route's (a sync dependency runs in a worker thread, whose context is lost).
    async def dependency(request: Request) -> Principal:
        who = api_principal(request)
        if not who.may(permission):
            raise E2bError(403, f"role {who.role} lacks permission {permission}")
        act_as(who)  # the events of this request record its caller
        return who

    return dependency


async def read_json(request: Request, *, required: bool = False) -> dict[str, Any]:
    """The request's JSON object body ({} when absent and not ``required``)."""
    raw = await request.body()
    if not raw.strip():
        if required:
            raise E2bError(400, "a JSON body is required")
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise E2bError(400, f"the body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise E2bError(400, "the body must be a JSON object")
    return body


def opt_int(body: dict[str, Any], key: str, default: int | None = None) -> int | None:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise E2bError(400, f"{key} must be an integer, not {value!r}")
    return value


def opt_bool(body: dict[str, Any], key: str, default: bool | None = None) -> bool | None:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise E2bError(400, f"{key} must be true or false, not {value!r}")
    return value


def str_map(body: dict[str, Any], key: str) -> dict[str, str]:
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise E2bError(400, f"{key} must be an object of string values")
    return dict(value)
