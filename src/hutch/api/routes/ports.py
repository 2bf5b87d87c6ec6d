"""``/v1/sandboxes/{id}/ports``: guest ports exposed on the host (inbound is closed until
a port is exposed)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Response

from hutch.api.deps import networking
from hutch.api.net_schemas import Port, PortList, PortRequest
from hutch.contract.limits import PORT_RANGE
from hutch.services.networking import NetworkingService

__all__ = ["router"]

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/ports", tags=["network"])
Service = Annotated[NetworkingService, Depends(networking)]


@router.post("", status_code=201, response_model=Port)
async def expose_port(sandbox_id: str, body: PortRequest, svc: Service) -> Port:
    """Expose one guest port through a host-side proxy; the answer carries its URL.
    409 if the sandbox has network `none` or is not running."""
    return Port.of(await svc.expose_port(sandbox_id, body.port))


@router.get("", response_model=PortList)
async def list_ports(sandbox_id: str, svc: Service) -> PortList:
    return PortList(ports=[Port.of(p) for p in svc.list_ports(sandbox_id)])


@router.delete("/{port}", status_code=204, response_class=Response)
async def close_port(
    sandbox_id: str, port: Annotated[int, Path(ge=PORT_RANGE[0], le=PORT_RANGE[1])], svc: Service
) -> Response:
    """Stop forwarding the port (404 if it is not exposed)."""
    await svc.close_port(sandbox_id, port)
    return Response(status_code=204)
