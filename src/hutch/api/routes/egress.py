"""``/v1/sandboxes/{id}/egress``: a sandbox's outbound rules, counters and decision log."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Annotated

from fastapi import APIRouter, Depends, Query

from hutch.api.deps import Caller, networking
from hutch.api.net_schemas import (
    DryRunEvent,
    Egress,
    EgressDryRun,
    EgressEvent,
    EgressLog,
    EgressRules,
    EgressSuggestion,
)
from hutch.contract.limits import DEFAULT_EGRESS_LOG_LIMIT, EGRESS_LOG_MAX
from hutch.services.networking import NetworkingService

__all__ = ["EGRESS_LOG_MAX", "router"]

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/egress", tags=["network"])
Service = Annotated[NetworkingService, Depends(networking)]


@router.get("", response_model=Egress)
async def get_egress(sandbox_id: str, svc: Service) -> Egress:
    """The rules in force, the mode they make (`open` with no rules, `rules`, or
    `deny-all`) and the allowed/denied counters."""
    return Egress.of(svc.egress_get(sandbox_id))


@router.put("", response_model=Egress)
async def set_egress(sandbox_id: str, body: EgressRules, svc: Service, who: Caller) -> Egress:
    """Replace the rules with a rule list, an ordered policy or a copy of a named policy.
    They apply at once (no restart) to new connections and requests; open connections
    the new rules no longer allow by destination are cut, and a request already relayed
    is not evaluated again. An invalid rule rejects the whole request (400 naming the
    rule and field) and the previous rules stay."""
    rules, name = body.requested()
    return Egress.of(await svc.egress_set(sandbox_id, rules, name, who.project))


@router.get("/log", response_model=EgressLog)
async def egress_log(
    sandbox_id: str,
    svc: Service,
    limit: Annotated[
        int, Query(ge=1, le=EGRESS_LOG_MAX, description="At most this many, the newest.")
    ] = DEFAULT_EGRESS_LOG_LIMIT,
) -> EgressLog:
    """Recent egress decisions (DNS answers, proxied connections, packet denials)."""
    return EgressLog(events=[EgressEvent.of(e) for e in svc.egress_log(sandbox_id, limit)])


@router.get("/suggest", response_model=EgressSuggestion)
async def egress_suggest(sandbox_id: str, svc: Service) -> EgressSuggestion:
    """The smallest ordered policy that would have allowed exactly the proxied
    connections and requests in the egress log (run the sandbox under `inspection:
    learn` first: everything passes and is logged, HTTPS requests included). PUT the
    answer's `policy` to apply it."""
    policy, used = svc.egress_suggest(sandbox_id)
    return EgressSuggestion(policy=policy, events=used)


@router.post("/dry-run", response_model=EgressDryRun)
async def egress_dry_run(
    sandbox_id: str, body: EgressRules, svc: Service, who: Caller
) -> EgressDryRun:
    """Decide every proxied connection and request in the egress log again under the
    given rules, policy or named policy (the body of a PUT); nothing changes."""
    rules, name = body.requested()
    results = svc.egress_dry_run(sandbox_id, rules, name, who.project)
    events = [
        DryRunEvent.model_validate(
            {**dataclasses.asdict(r), "time": dt.datetime.fromtimestamp(r.time, dt.UTC)}
        )
        for r in results
    ]
    return EgressDryRun(results=events, would_deny=sum(r.would == "deny" for r in results))
