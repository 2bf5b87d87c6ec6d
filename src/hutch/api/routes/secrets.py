"""``/v1/secrets``: write-only values of the caller's project.

PUT creates or replaces (a new version); GET lists and inspects names, versions and
timestamps; DELETE removes (409 while a live sandbox's env_secrets names it). Each acts
in the caller's project (another project's secret is not found, as a missing one). No route
returns a value: the daemon uses them itself (a sandbox's env_secrets, egress injection).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response

from hutch.api.deps import Caller, secrets
from hutch.api.secret_schemas import PutSecret, Secret, SecretList
from hutch.services.secrets import SecretService

__all__ = ["router"]

router = APIRouter(prefix="/v1/secrets", tags=["secrets"])
Service = Annotated[SecretService, Depends(secrets)]


@router.put(
    "/{name}",
    response_model=Secret,
    responses={201: {"model": Secret, "description": "Created (version 1)"}},
)
async def put_secret(
    name: str, body: PutSecret, svc: Service, who: Caller, response: Response
) -> Secret:
    """Create the secret (201, version 1) or replace its value (200, the next version).
    Sandboxes whose env_secrets name it get the new value at their next command."""
    info, created = svc.put(name, body.value, who.project)
    if created:
        response.status_code = 201
    return Secret.of(info)


@router.get("", response_model=SecretList)
async def list_secrets(svc: Service, who: Caller) -> SecretList:
    return SecretList(secrets=[Secret.of(i) for i in svc.list(who.project)])


@router.get("/{name}", response_model=Secret)
async def get_secret(name: str, svc: Service, who: Caller) -> Secret:
    """Name, version and timestamps; never the value."""
    return Secret.of(svc.get(name, who.project))


@router.delete("/{name}", status_code=204)
async def delete_secret(name: str, svc: Service, who: Caller) -> Response:
    """404 if there is none; 409 naming the live sandboxes whose env_secrets use it."""
    svc.delete(name, who.project)
    return Response(status_code=204)
