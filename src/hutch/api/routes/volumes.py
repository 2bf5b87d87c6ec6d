"""``/v1/volumes``: volumes of the caller's project (create, list, inspect, grow, delete)
(``PATCH /v1/sandboxes/{id}``, growing a sandbox's own disk, is in ``sandboxes``).

Every call acts in the caller's project (``api/deps.principal``): another project's
volume is not found, exactly as a missing one.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response

from hutch.api.deps import Caller, volumes
from hutch.api.volume_schemas import Volume, VolumeGrow, VolumeList, VolumeRequest
from hutch.services.volumes import VolumeService

__all__ = ["router"]

router = APIRouter(prefix="/v1/volumes", tags=["volumes"])
Service = Annotated[VolumeService, Depends(volumes)]


@router.post("", status_code=201, response_model=Volume)
async def create_volume(body: VolumeRequest, svc: Service, who: Caller) -> Volume:
    """A new, empty ext4 volume of exactly `size` bytes. 409 if the name is taken."""
    return Volume.of(await svc.create(body.name, body.size, body.kind, who.project))


@router.get("", response_model=VolumeList)
async def list_volumes(svc: Service, who: Caller) -> VolumeList:
    return VolumeList(volumes=[Volume.of(v) for v in svc.list_volumes(who.project)])


@router.get("/{volume}", response_model=Volume)
async def get_volume(volume: str, svc: Service, who: Caller) -> Volume:
    """By id (`vol-...`) or name: its size, bytes used, and the sandboxes mounting it."""
    return Volume.of(svc.get(volume, who.project))


@router.patch("/{volume}", response_model=Volume)
async def grow_volume(volume: str, body: VolumeGrow, svc: Service, who: Caller) -> Volume:
    """Grow to `size` bytes; live (with its filesystem) when a running sandbox mounts it."""
    return Volume.of(await svc.grow(volume, body.size, who.project))


@router.delete("/{volume}", status_code=204, response_class=Response)
async def delete_volume(volume: str, svc: Service, who: Caller) -> Response:
    """Refused (409) while sandboxes mount it; the message names them."""
    await svc.delete(volume, who.project)
    return Response(status_code=204)
