from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from hutch.api.deps import sandboxes, services
from hutch.api.routes.images import image_model
from hutch.api.schemas import Health, ImageList
from hutch.services.composed import Services
from hutch.services.sandboxes import SandboxService
from hutch.version import __version__

router = APIRouter(tags=["meta"])
health_router = APIRouter(tags=["meta"])


@router.get("/v1/images", response_model=ImageList)
async def list_images(svc: Annotated[SandboxService, Depends(sandboxes)]) -> ImageList:
    return ImageList(images=[image_model(i) for i in svc.images()])


@health_router.get("/healthz", response_model=Health)
async def healthz(request: Request) -> Health:
    svc: Services = services(request)
    return Health(
        status="ok" if svc.reconciled else "reconciling",
        version=__version__,
        accel=svc.backend.accel,
        reconciling=svc.reconciling,
    )
