"""The REST app factory."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hutch.api import errors, spec
from hutch.api.auth import BearerAuth
from hutch.api.limits import BodyLimit
from hutch.api.routes import exec as exec_routes
from hutch.api.routes import files, meta, sandboxes
from hutch.errors import HutchError
from hutch.services.sandboxes import SandboxService
from hutch.version import __version__


def create_app(svc: SandboxService, api_key: str, *, manage_service: bool = True) -> FastAPI:
    """Build the app. With ``manage_service`` the app starts and closes ``svc``."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_service:
            await svc.start()
        try:
            yield
        finally:
            if manage_service:
                await svc.close()

    app = FastAPI(
        title="hutch",
        version=__version__,
        description="Micro-VM sandboxes for code written by AI agents.",
        lifespan=lifespan,
    )
    app.state.service = svc
    auth = [Depends(BearerAuth(api_key))]
    app.include_router(meta.health_router)
    app.include_router(meta.router, dependencies=auth)
    app.include_router(sandboxes.router, dependencies=auth)
    app.include_router(sandboxes.snapshots_router, dependencies=auth)
    app.include_router(exec_routes.router, dependencies=auth)
    app.include_router(files.router, dependencies=auth)
    app.add_exception_handler(HutchError, errors.handle_hutch_error)
    app.add_exception_handler(RequestValidationError, errors.handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, errors.handle_http_error)
    app.add_exception_handler(Exception, errors.handle_unexpected)
    app.add_middleware(BodyLimit)
    spec.install(app)
    return app
