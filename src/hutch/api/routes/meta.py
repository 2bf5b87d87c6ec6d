from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from hutch.api.deps import service
from hutch.api.schemas import Health, Image, ImageList
from hutch.services.sandboxes import SandboxService
from hutch.version import __version__

router = APIRouter(tags=["meta"])
health_router = APIRouter(tags=["meta"])


@router.get("/v1/images", response_model=ImageList)
async def list_images(svc: Annotated[SandboxService, Depends(service)]) -> ImageList:
    return ImageList(
        images=[
            Image(
                name=i.name,
                description=i.description,
                built=i.built,
                digest=i.digest,
                size_bytes=i.size_bytes,
                kernel_release=i.kernel_release,
            )
            for i in svc.images()
        ]
    )


@health_router.get("/healthz", response_model=Health)
async def healthz(request: Request) -> Health:
    svc: SandboxService = request.app.state.service
    return Health(
        status="ok" if svc.reconciled else "reconciling",
        version=__version__,
        accel=svc.backend.accel,
        reconciling=svc.reconciling,
    )
