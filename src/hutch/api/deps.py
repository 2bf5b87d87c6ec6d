"""Request-scoped access to the services."""

from __future__ import annotations

from fastapi import Request

from hutch.services.sandboxes import SandboxService


def service(request: Request) -> SandboxService:
    svc: SandboxService = request.app.state.service
    return svc
