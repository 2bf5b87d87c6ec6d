from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request

from hutch.api.deps import Caller, sandboxes, services
from hutch.api.routes.images import image_model
from hutch.api.schemas import Health, ImageList
from hutch.contract.auth import Role
from hutch.errors import NotFound
from hutch.services.composed import Services
from hutch.services.sandboxes import SandboxService
from hutch.version import __version__

router = APIRouter(tags=["meta"])
health_router = APIRouter(tags=["meta"])


@router.get("/v1/images", response_model=ImageList)
async def list_images(
    svc: Annotated[SandboxService, Depends(sandboxes)],
    who: Caller,
    project: Annotated[
        str | None, Query(description="Admin: only this project's (default: every project's)")
    ] = None,
) -> ImageList:
    """The built-in images and the caller's project's (the admin key: every project's,
    each naming its project)."""
    if who.role is Role.ADMIN:
        scope = project
    elif project is not None and project != who.project:
        raise NotFound(f"no project {project!r}")  # another project's: as if none
    else:
        scope = who.project
    return ImageList(images=[image_model(i) for i in svc.images(scope)])


@health_router.get("/healthz", response_model=Health)
async def healthz(request: Request) -> Health:
    svc: Services = services(request)
    return Health(
        status="ok" if svc.reconciled else "reconciling",
        version=__version__,
        accel=svc.backend.accel,
        reconciling=svc.reconciling,
    )
