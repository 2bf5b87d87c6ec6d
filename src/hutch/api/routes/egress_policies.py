"""``/v1/egress-policies``: named egress policies of the project, reusable by sandboxes
(attached as a copy: ``egress_policy`` at create, ``{"policy": name}`` on PUT …/egress)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Response

from hutch.api.deps import Caller, networking
from hutch.api.net_schemas import NamedPolicy, NamedPolicyList, PolicyDocument
from hutch.contract.names import NAME_PATTERN
from hutch.services.networking import NetworkingService

__all__ = ["router"]

router = APIRouter(prefix="/v1/egress-policies", tags=["network"])
Service = Annotated[NetworkingService, Depends(networking)]
PolicyName = Annotated[str, Path(pattern=NAME_PATTERN, description="The policy's name.")]


@router.get("", response_model=NamedPolicyList)
async def list_policies(svc: Service, who: Caller) -> NamedPolicyList:
    """The project's named policies, by name."""
    found = svc.policies.list(who.project)
    return NamedPolicyList(policies=[NamedPolicy.of(v) for v in found])


@router.put(
    "/{name}",
    response_model=NamedPolicy,
    responses={201: {"model": NamedPolicy, "description": "Created."}},
)
async def put_policy(
    name: PolicyName, body: PolicyDocument, svc: Service, who: Caller, response: Response
) -> NamedPolicy:
    """Create (201) or replace (200) a named policy. It is validated as a sandbox's
    policy is (400 naming `rules[i].field`); sandboxes that got a copy keep theirs."""
    doc = body.model_dump(exclude_none=True)
    view, created = svc.policies.put(name, doc, who.project)
    response.status_code = 201 if created else 200
    return NamedPolicy.of(view)


@router.get("/{name}", response_model=NamedPolicy)
async def get_policy(name: PolicyName, svc: Service, who: Caller) -> NamedPolicy:
    return NamedPolicy.of(svc.policies.get(name, who.project))


@router.delete("/{name}", status_code=204)
async def delete_policy(name: PolicyName, svc: Service, who: Caller) -> Response:
    """Delete it; sandboxes that got a copy keep it."""
    svc.policies.delete(name, who.project)
    return Response(status_code=204)
