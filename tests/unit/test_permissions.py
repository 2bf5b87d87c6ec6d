"""Every route of the REST app has exactly one permission in the one route table
(``hutch.api.permissions``), and is behind the principal dependency: a new route without
an entry fails here before it can ship open."""

from __future__ import annotations

from typing import cast

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute, APIWebSocketRoute, iter_route_contexts

from hutch.api import deps
from hutch.api.app import create_app
from hutch.api.permissions import PUBLIC, ROUTE_PERMISSIONS, SELF_CHECKED
from hutch.contract.auth import Permission
from hutch.services.composed import Services


def app_routes() -> dict[tuple[str, str], object]:
    """(METHOD, path template) -> route context, ``WS`` for WebSockets, as the app
    serves them (the context carries the dependencies of the routers it is in)."""
    app = create_app(cast(Services, None), api_key="unused", manage_service=False)
    found: dict[tuple[str, str], object] = {}
    for context in iter_route_contexts(app.routes):
        route = context.original_route
        if isinstance(route, APIRoute):
            for method in route.methods or ():
                assert (method, route.path) not in found, f"{method} {route.path} twice"
                found[(method, route.path)] = context
        elif isinstance(route, APIWebSocketRoute):
            found[("WS", route.path)] = route
        else:
            path = getattr(route, "path", "?")
            found[("GET", path)] = route
    return found


def test_every_route_has_exactly_one_permission_and_no_entry_is_stale() -> None:
    routes = app_routes()
    guarded = {key for key in routes if key not in PUBLIC | SELF_CHECKED}
    missing = sorted(guarded - set(ROUTE_PERMISSIONS))
    assert not missing, f"routes without a permission in hutch.api.permissions: {missing}"
    stale = sorted(set(ROUTE_PERMISSIONS) - guarded)
    assert not stale, f"hutch.api.permissions names routes the app does not serve: {stale}"
    assert all(isinstance(p, Permission) for p in ROUTE_PERMISSIONS.values())
    assert not PUBLIC & set(ROUTE_PERMISSIONS), "a public route cannot need a permission"


def _calls(dependant: Dependant) -> set[object]:
    out: set[object] = {dependant.call}
    for sub in dependant.dependencies:
        out |= _calls(sub)
    return out


def test_every_guarded_http_route_depends_on_the_principal() -> None:
    """The table alone guards nothing: each route must run deps.principal."""
    for key, context in app_routes().items():
        if key in PUBLIC | SELF_CHECKED or key[0] == "WS":
            continue
        dependant = cast(Dependant, getattr(context, "dependant"))  # noqa: B009
        assert deps.principal in _calls(dependant), f"{key} skips deps.principal"


def test_public_routes_are_only_health_the_spec_and_the_console_files() -> None:
    """The console's static files (/ui) hold no data; every datum they show comes from
    /v1 with the signed-in key."""
    assert {path for _, path in PUBLIC} == {
        "/healthz",
        "/openapi.json",
        "/docs",
        "/docs/oauth2-redirect",
        "/redoc",
        "/ui",
        "/ui/",
        "/ui/{name:path}",
    }
