"""``GET /metrics``: Prometheus text format 0.0.4, for a scraper holding the daemon's
scrape token (``<state>/metrics-token``, 0600, created on first start) or the admin key,
as ``Authorization: Bearer <token>``. The scrape token reads metrics and nothing else."""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from hutch.api.deps import services
from hutch.errors import Unauthorized

__all__ = ["CONTENT_TYPE", "router"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def router(metrics_token: str, api_key: str) -> APIRouter:
    accepted = [t.encode() for t in (metrics_token, api_key) if t]
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
        given = token.encode(errors="surrogatepass")
        # Each compared in constant time, all of them always.
        if not any([hmac.compare_digest(given, t) for t in accepted]):
            raise Unauthorized("wrong metrics token (see <state_dir>/metrics-token)")
        body = services(request).usage.metrics_text()
        return PlainTextResponse(body, media_type=CONTENT_TYPE)

    return r
