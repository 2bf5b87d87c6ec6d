from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response

from hutch.api.deps import service
from hutch.api.schemas import CreateSandbox, Sandbox, SandboxList
from hutch.errors import InvalidArgument
from hutch.models import SandboxSpec, SandboxState, Shape
from hutch.services.sandboxes import SandboxService

router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"])
Service = Annotated[SandboxService, Depends(service)]


@router.post("", status_code=201, response_model=Sandbox)
async def create_sandbox(body: CreateSandbox, svc: Service) -> Sandbox:
    spec = SandboxSpec(
        image=body.image,
        shape=Shape(vcpus=body.vcpus, memory_mib=body.memory_mib, disk_gib=body.disk_gib),
        env=body.env,
        metadata=body.metadata,
        name=body.name,
        timeout_s=body.timeout_s,
    )
    return Sandbox.of(await svc.create(spec))


@router.get("", response_model=SandboxList)
async def list_sandboxes(
    svc: Service,
    state: SandboxState | None = None,
    metadata: Annotated[
        list[str] | None,
        Query(description="Filter by metadata, as key=value; repeat to require several."),
    ] = None,
) -> SandboxList:
    wanted: dict[str, str] = {}
    for item in metadata or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidArgument(f"metadata filter {item!r} is not key=value")
        wanted[key] = value
    return SandboxList(sandboxes=[Sandbox.of(r) for r in svc.list_sandboxes(state, wanted)])


@router.get("/{sandbox_id}", response_model=Sandbox)
async def get_sandbox(sandbox_id: str, svc: Service) -> Sandbox:
    return Sandbox.of(svc.get(sandbox_id))


@router.delete("/{sandbox_id}", status_code=204, response_class=Response)
async def delete_sandbox(sandbox_id: str, svc: Service) -> Response:
    await svc.delete(sandbox_id)
    return Response(status_code=204)
