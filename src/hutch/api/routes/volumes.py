"""``/v1/volumes``: volumes of the caller's project (create, list, inspect, grow, delete)
(``PATCH /v1/sandboxes/{id}``, growing a sandbox's own disk, is in ``sandboxes``).

Until the auth branch's principal lands every call acts in project ``default``.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response

from hutch.api.deps import volumes
from hutch.api.volume_schemas import Volume, VolumeGrow, VolumeList, VolumeRequest
from hutch.contract.auth import DEFAULT_PROJECT
from hutch.services.volumes import VolumeService

__all__ = ["router"]

router = APIRouter(prefix="/v1/volumes", tags=["volumes"])
Service = Annotated[VolumeService, Depends(volumes)]


@router.post("", status_code=201, response_model=Volume)
async def create_volume(body: VolumeRequest, svc: Service) -> Volume:
    """A new, empty ext4 volume of exactly `size` bytes. 409 if the name is taken."""
    return Volume.of(await svc.create(body.name, body.size, body.kind, DEFAULT_PROJECT))


@router.get("", response_model=VolumeList)
async def list_volumes(svc: Service) -> VolumeList:
    return VolumeList(volumes=[Volume.of(v) for v in svc.list_volumes(DEFAULT_PROJECT)])


@router.get("/{volume}", response_model=Volume)
async def get_volume(volume: str, svc: Service) -> Volume:
    """By id (`vol-...`) or name: its size, bytes used, and the sandboxes mounting it."""
    return Volume.of(svc.get(volume, DEFAULT_PROJECT))


@router.patch("/{volume}", response_model=Volume)
async def grow_volume(volume: str, body: VolumeGrow, svc: Service) -> Volume:
    """Grow to `size` bytes; live (with its filesystem) when a running sandbox mounts it."""
    return Volume.of(await svc.grow(volume, body.size, DEFAULT_PROJECT))


@router.delete("/{volume}", status_code=204, response_class=Response)
async def delete_volume(volume: str, svc: Service) -> Response:
    """Refused (409) while sandboxes mount it; the message names them."""
    await svc.delete(volume, DEFAULT_PROJECT)
    return Response(status_code=204)
