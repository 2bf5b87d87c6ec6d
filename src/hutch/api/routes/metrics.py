"""``GET /metrics``: Prometheus text format 0.0.4, for a scraper holding the daemon's
scrape token (``<state>/metrics-token``, 0600, created on first start) or the admin key,
as ``Authorization: Bearer <token>``. The scrape token reads metrics and nothing else."""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from hutch.api.deps import authenticate, services
from hutch.contract.auth import Permission
from hutch.errors import Forbidden, Unauthorized

__all__ = ["CONTENT_TYPE", "router"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def router(metrics_token: str) -> APIRouter:
    scrape = metrics_token.encode()
    r = APIRouter(tags=["meta"])

    @r.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"content": {CONTENT_TYPE: {}}}},
    )
    async def metrics(request: Request) -> PlainTextResponse:
        """Sandboxes by state, create/pause/resume/fork/snapshot latency histograms,
        creates by origin (template and pool hit ratios), execs, egress decisions, host
        capacity, events by type."""
        scheme, sep, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not sep or not token:
            raise Unauthorized(
                "missing scrape token: send 'Authorization: Bearer <token>' (the token is "
                "in <state_dir>/metrics-token; the admin key is accepted too)"
            )
        if not (scrape and hmac.compare_digest(token.encode(errors="surrogatepass"), scrape)):
            # Not the scrape token: a key, which must be the instance's admin key.
            try:
                who = authenticate(request, token)
            except Unauthorized:
                raise Unauthorized(
                    "wrong metrics token (see <state_dir>/metrics-token; the admin key "
                    "is accepted too)"
                ) from None
            if not who.may(Permission.PROJECT_MANAGE):
                raise Forbidden(f"role {who.role} may not read /metrics (the admin key may)")
        body = services(request).usage.metrics_text()
        return PlainTextResponse(body, media_type=CONTENT_TYPE)

    return r
