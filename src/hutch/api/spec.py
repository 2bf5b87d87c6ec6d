"""Post-processing of the generated OpenAPI document.

FastAPI documents 422 for validation errors; hutch answers 400 with its own error body,
and every operation can fail with the errors of the one table in ``hutch.api.errors``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from hutch.api.schemas import ErrorBody
from hutch.contract.names import NAME_PATTERN

ERROR_STATUSES = {
    "400": "Invalid argument (the message names the field and what is accepted)",
    "401": "Missing, wrong, revoked or expired API key",
    "403": "The key's role lacks the route's permission (the message names both), or "
    "the key is another project's",
    "404": "No such sandbox, snapshot, network, process, context, file or port (one of "
    "another project is not found either)",
    "409": (
        "The sandbox is in the wrong state, a name is taken, or calls in flight outlasted "
        "the wait of a pause, snapshot or fork (code busy)"
    ),
    "413": "Request body too large",
    "429": "The host is at capacity, or a quota of the project would be exceeded "
    "(code quota_exceeded; the message names the quota, the use and the limit)",
    "500": "Internal error (VM, image, store)",
    "502": "The guest agent failed",
    "503": "Not ready yet: the sandbox is still being checked after a daemon restart "
    "(see Retry-After)",
    "504": "The operation timed out",
}


#: Every authenticated operation takes the project it acts in (the admin key only;
#: a project key acts in its own project, and naming another is a 403).
PROJECT_PARAMETER = {
    "name": "Hutch-Project",
    "in": "header",
    "required": False,
    "description": "The project the request acts in (admin key; default: default).",
    "schema": {"type": "string", "pattern": NAME_PATTERN},
}


def install(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        spec = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        schemas.update(
            ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}").pop(
                "$defs", {}
            )
        )
        schemas["ErrorBody"] = {
            k: v
            for k, v in ErrorBody.model_json_schema(
                ref_template="#/components/schemas/{model}"
            ).items()
            if k != "$defs"
        }
        error_ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
        for path, ops in spec.get("paths", {}).items():
            for op in ops.values():
                responses = op.setdefault("responses", {})
                if responses.get("422", {}).get("description") == "Validation Error":
                    responses.pop("422")  # FastAPI's own; hutch answers 400 for those
                elif "422" in responses:
                    responses["422"].setdefault("content", error_ref)
                for status, description in ERROR_STATUSES.items():
                    if path == "/healthz" and status != "500":
                        continue
                    responses.setdefault(status, {"description": description, "content": error_ref})
                if path != "/healthz":
                    op["security"] = [{"bearer": []}]
                    op.setdefault("parameters", []).append(PROJECT_PARAMETER)
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = spec
        return spec

    app.openapi = openapi  # type: ignore[method-assign]
