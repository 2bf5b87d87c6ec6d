"""``/v1/networks`` (private networks) and ``/v1/sandboxes/{id}/networks`` (membership).

Sandboxes on one network reach each other (by name through hutch's resolver); traffic
between different networks stays denied.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response

from hutch.api.deps import Caller, networking
from hutch.api.net_schemas import JoinNetwork, Network, NetworkList, NetworkRequest
from hutch.services.networking import NetworkingService

__all__ = ["membership_router", "router"]

router = APIRouter(prefix="/v1/networks", tags=["network"])
membership_router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/networks", tags=["network"])
Service = Annotated[NetworkingService, Depends(networking)]


@router.post("", status_code=201, response_model=Network)
async def create_network(body: NetworkRequest, svc: Service, who: Caller) -> Network:
    """A new, empty private network. 409 if the name is taken."""
    return Network.of(await svc.create_network(body.name, who.project))


@router.get("", response_model=NetworkList)
async def list_networks(svc: Service, who: Caller) -> NetworkList:
    return NetworkList(networks=[Network.of(n) for n in svc.list_networks(who.project)])


@router.get("/{network_id}", response_model=Network)
async def get_network(network_id: str, svc: Service, who: Caller) -> Network:
    """By id (`net-...`) or name."""
    return Network.of(svc.get_network(network_id, who.project))


@router.delete("/{network_id}", status_code=204, response_class=Response)
async def delete_network(network_id: str, svc: Service, who: Caller) -> Response:
    """Refused (409) while sandboxes are on it; the message names them."""
    await svc.delete_network(network_id, who.project)
    return Response(status_code=204)


@membership_router.post("", response_model=Network)
async def join_network(sandbox_id: str, body: JoinNetwork, svc: Service, who: Caller) -> Network:
    """Put the sandbox on a network (by id or name); the answer is the network."""
    return Network.of(await svc.join_network(sandbox_id, body.network, who.project))


@membership_router.delete("/{network_id}", status_code=204, response_class=Response)
async def leave_network(sandbox_id: str, network_id: str, svc: Service, who: Caller) -> Response:
    await svc.leave_network(sandbox_id, network_id, who.project)
    return Response(status_code=204)
