"""``/v1/usage`` (metered usage and cost) and the event log: ``/v1/events`` (the
project's audit trail) and ``/v1/sandboxes/{id}/events`` (one sandbox's trace, paged or
followed as NDJSON)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query
from fastapi.responses import StreamingResponse

from hutch.api.deps import Caller, usage
from hutch.api.meter_schemas import Event, EventList, Prices, UsageReport
from hutch.api.streaming import TrackedStream
from hutch.services.usage import EVENTS_PAGE_MAX, UsageService, parse_time

__all__ = ["router"]

router = APIRouter(tags=["usage"])
Service = Annotated[UsageService, Depends(usage)]
Types = Annotated[
    list[str] | None,
    Query(
        alias="type",
        description="Only these types (repeat, or comma-separate); a family as sandbox.*",
    ),
]


def _split(types: list[str] | None) -> list[str]:
    return [t for item in types or [] for t in item.split(",") if t.strip()]


@router.get("/v1/usage", response_model=UsageReport)
async def get_usage(
    svc: Service,
    who: Caller,
    project: Annotated[str | None, Query(description="Admin only: another project.")] = None,
    start: Annotated[
        str | None,
        Query(
            alias="from",
            description="Epoch seconds or ISO 8601 (default: start of this UTC month).",
        ),
    ] = None,
    end: Annotated[
        str | None, Query(alias="to", description="Epoch seconds or ISO 8601 (default: now).")
    ] = None,
    group_by: Literal["sandbox", "day", "project"] = "sandbox",
) -> UsageReport:
    """Quantities (per second) and cost over [from, to), grouped by sandbox, UTC day or
    project (admin only)."""
    scope, result = svc.usage(
        who,
        project=project,
        start=None if start is None else parse_time(start, "from"),
        end=None if end is None else parse_time(end, "to"),
        group_by=group_by,
    )
    p = svc.prices
    return UsageReport(
        project=scope,
        start=result.start,
        end=result.end,
        group_by=group_by,
        prices=Prices(
            vcpu_hour=p.vcpu_hour,
            gib_hour=p.gib_hour,
            storage_gb_hour=p.storage_gb_hour,
            egress_gb=p.egress_gb,
        ),
        rows=result.rows,
        total=result.total,
    )


After = Annotated[int, Query(ge=0, le=2**63 - 1, description="Only events with a greater seq.")]
Limit = Annotated[int, Query(ge=1, le=EVENTS_PAGE_MAX)]


@router.get("/v1/events", response_model=EventList)
async def list_events(
    svc: Service,
    who: Caller,
    types: Types = None,
    sandbox: Annotated[str | None, Query(description="Only this sandbox's.")] = None,
    after: After = 0,
    limit: Limit = 100,
) -> EventList:
    """The project's audit trail, oldest first: who (key id, address) did what."""
    rows = svc.events(who, sandbox_id=sandbox, types=_split(types), after=after, limit=limit)
    return EventList(events=[Event.of(r) for r in rows], next_after=rows[-1].seq if rows else after)


@router.get(
    "/v1/sandboxes/{sandbox_id}/events",
    response_model=EventList,
    responses={200: {"content": {"application/x-ndjson": {}}}},
)
async def sandbox_events(
    sandbox_id: str,
    svc: Service,
    who: Caller,
    types: Types = None,
    after: After = 0,
    limit: Limit = 100,
    follow: Annotated[
        bool,
        Query(
            description="Stream NDJSON: the events after `after`, then each as it happens, "
            "until the sandbox has ended."
        ),
    ] = False,
) -> EventList | StreamingResponse:
    """One sandbox's trace (ended sandboxes' too, while retention keeps them)."""
    if not follow:
        rows = svc.events(who, sandbox_id=sandbox_id, types=_split(types), after=after, limit=limit)
        return EventList(
            events=[Event.of(r) for r in rows], next_after=rows[-1].seq if rows else after
        )
    stream = svc.follow(who, sandbox_id, types=_split(types), after=after)

    async def lines() -> AsyncIterator[bytes]:
        async for row in stream:
            yield json.dumps(Event.of(row).model_dump(mode="json")).encode() + b"\n"

    return TrackedStream(
        lines(), what=f"event stream of {sandbox_id}", media_type="application/x-ndjson"
    )
