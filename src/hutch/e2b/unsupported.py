"""E2B calls hutch does not offer: answered in E2B's error shape (400,
``error_code: not_supported_by_hutch``) with what hutch offers instead, never a 500.
Anything else the control plane does not know is a 404 naming the path."""

from __future__ import annotations

from fastapi import APIRouter, Request

from hutch.e2b.errors import E2bError, unsupported
from hutch.e2b.templates import ALIASES

__all__ = ["INSTEAD", "router"]

router = APIRouter()

#: Path prefix → (what it is in E2B, what hutch offers instead). Longest prefix first.
INSTEAD: tuple[tuple[str, str, str], ...] = (
    (
        "/templates",
        "E2B templates and their builds",
        "hutch builds images from Debian packages (`hutch image build`) and imports any "
        "OCI image (`hutch image import NAME ARCHIVE`, `hutch image pull NAME REF`); "
        "create sandboxes from them by name as the template. Templates served here: "
        + ", ".join(sorted(ALIASES))
        + " and every hutch image by name",
    ),
    ("/v2/templates", "E2B template builds", "see /templates: hutch images are the templates"),
    ("/v3/templates", "E2B template builds", "see /templates: hutch images are the templates"),
    ("/default-templates", "E2B's default templates", "hutch images are the templates"),
    (
        "/teams",
        "E2B teams",
        "hutch has API keys (projects and roles with issue 10) in place of teams",
    ),
    (
        "/volume",
        "E2B volumes",
        "a hutch sandbox keeps its disk across pause and resume, and snapshots keep disk "
        "and memory; move files with sandbox.files or `hutch cp`",
    ),
    (
        "/secrets",
        "E2B secrets",
        "pass secrets as envVars at create, and limit where they can be sent with egress "
        "rules (network.allowOut)",
    ),
    (
        "/access-tokens",
        "E2B access tokens",
        "hutch authenticates every call with its API key (E2B_API_KEY)",
    ),
    (
        "/api-keys",
        "E2B API key management",
        "hutch's keys live in its state dir (issue 10: `hutch key`)",
    ),
    (
        "/sandboxes/metrics",
        "metrics of many sandboxes at once",
        "ask each sandbox: GET /sandboxes/{id}/metrics",
    ),
    ("/nodes", "E2B cluster nodes", "one hutchd serves its host's sandboxes"),
)


def _logs(path: str) -> bool:
    return path.rstrip("/").endswith("/logs")


@router.api_route(
    "/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False
)
async def not_offered(path: str, request: Request) -> None:
    full = "/" + path
    if full.startswith(("/sandboxes/", "/v2/sandboxes/")) and _logs(full):
        raise unsupported(
            "sandbox logs",
            "hutch keeps each sandbox's serial console in its state dir and each "
            "background command's output (commands.connect, `hutch logs`)",
        )
    for prefix, what, instead in INSTEAD:
        if full.startswith(prefix):
            raise unsupported(what, instead)
    raise E2bError(404, f"{request.method} {full} is not an endpoint of E2B's API served by hutch")
