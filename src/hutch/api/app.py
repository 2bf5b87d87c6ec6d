"""The REST app factory."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hutch.api import deps, errors, spec
from hutch.api.auth import Authenticator, load_or_create_key
from hutch.api.cluster_router import ClusterRouter, Forwarder
from hutch.api.limits import BodyLimit
from hutch.api.routes import archive as archive_routes
from hutch.api.routes import contexts as context_routes
from hutch.api.routes import (
    egress,
    egress_policies,
    files,
    images,
    meta,
    networks,
    ports,
    sandboxes,
)
from hutch.api.routes import exec as exec_routes
from hutch.api.routes import hosts as host_routes
from hutch.api.routes import metrics as metrics_routes
from hutch.api.routes import processes as process_routes
from hutch.api.routes import projects as project_routes
from hutch.api.routes import pty as pty_routes
from hutch.api.routes import secrets as secret_routes
from hutch.api.routes import ui as ui_routes
from hutch.api.routes import usage as usage_routes
from hutch.api.routes import volumes as volume_routes
from hutch.api.routes import watch as watch_routes
from hutch.api.routes import whoami as whoami_routes
from hutch.errors import HutchError
from hutch.services.composed import Services
from hutch.services.image_builder import ImageBuilder
from hutch.services.image_import import ImageImporter
from hutch.services.images import HostImages
from hutch.version import __version__


def create_app(services: Services, api_key: str, *, manage_service: bool = True) -> FastAPI:
    """Build the app. With ``manage_service`` the app starts and closes ``services``."""

    core = getattr(services, "core", None)  # None: only the spec is wanted
    metrics_token = (
        load_or_create_key(core.settings.metrics_token_path, prefix="hm_")
        if core is not None
        else None
    )
    source = getattr(core, "image_source", None)
    importer = (
        ImageImporter(core.settings, source, core, services.sandboxes.templates.blobs)
        if core is not None and isinstance(source, HostImages)
        else None
    )
    builder = (
        ImageBuilder(
            services.settings,
            source,
            importer,
            sandboxes=services.sandboxes,
            lifecycle=services.lifecycle,
            guest=services.guest,
            reconciler=services.reconciler,
        )
        if importer is not None and isinstance(source, HostImages)
        else None
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if importer is not None:
            importer.start()
        if manage_service:
            # The API serves while the VMs found on the host are checked.
            await services.start(background=True)
        if builder is not None:
            builder.start()
        try:
            yield
        finally:
            await forwarder.close()
            if builder is not None:
                await builder.close()
            if importer is not None:
                await importer.close()
            if manage_service:
                await services.close()

    app = FastAPI(
        title="hutch",
        version=__version__,
        description="Micro-VM sandboxes for code written by AI agents.",
        lifespan=lifespan,
    )
    app.state.services = services
    # Host-to-host forwards (hutch.api.cluster_router): one connection pool.
    forwarder = Forwarder()
    app.state.forwarder = forwarder
    app.state.importer = importer
    app.state.builder = builder
    app.state.auth = Authenticator(api_key, services.projects if core is not None else None)
    # Every route but health: the caller's principal, allowed the route's permission.
    auth = [Depends(deps.principal), Depends(deps.acting)]
    app.include_router(meta.health_router)
    app.include_router(meta.router, dependencies=auth)
    app.include_router(whoami_routes.router, dependencies=auth)
    # The web console's static files: no key (they hold no data), a strict CSP.
    app.include_router(ui_routes.router())
    app.include_router(images.router, dependencies=auth)
    app.include_router(secret_routes.router, dependencies=auth)
    app.include_router(sandboxes.router, dependencies=auth)
    app.include_router(sandboxes.snapshots_router, dependencies=auth)
    app.include_router(exec_routes.router, dependencies=auth)
    # Before files.router: /files/watch and /files/archive are more specific paths.
    app.include_router(watch_routes.router, dependencies=auth)
    app.include_router(archive_routes.router, dependencies=auth)
    app.include_router(files.router, dependencies=auth)
    app.include_router(context_routes.router, dependencies=auth)
    app.include_router(process_routes.router, dependencies=auth)
    app.include_router(pty_routes.router, dependencies=auth)
    app.include_router(pty_routes.ws_router())  # authenticates itself (first message)
    app.include_router(egress.router, dependencies=auth)
    app.include_router(egress_policies.router, dependencies=auth)
    app.include_router(ports.router, dependencies=auth)
    app.include_router(networks.router, dependencies=auth)
    app.include_router(networks.membership_router, dependencies=auth)
    app.include_router(usage_routes.router, dependencies=auth)
    app.include_router(metrics_routes.router(metrics_token or ""))
    app.include_router(project_routes.router, dependencies=auth)
    app.include_router(volume_routes.router, dependencies=auth)
    app.include_router(host_routes.router, dependencies=auth)
    app.add_exception_handler(HutchError, errors.handle_hutch_error)
    app.add_exception_handler(RequestValidationError, errors.handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, errors.handle_http_error)
    app.add_exception_handler(Exception, errors.handle_unexpected)
    app.add_middleware(BodyLimit)
    # Outermost: a request for another host's sandbox is forwarded before anything here.
    app.add_middleware(ClusterRouter)
    spec.install(app)
    return app
