"""E2B's control plane (``E2B_API_URL``): sandboxes' lifecycle, listing, snapshots,
fork, timeouts, network, metrics — each a call to hutch's sandbox service.

Timeouts: E2B's ``timeout`` is a deadline from now (create, connect, ``set_timeout``,
fork), after which the sandbox is killed: hutch's ``timeout_s`` and ``expires_at``. With
``autoPause`` E2B pauses at the deadline instead; hutch pauses a sandbox (memory) once it
has been *idle* that long (``auto_pause_s``), which needs 60 s at least and never pauses
a sandbox in use. ``autoResume`` is hutch's ``auto_resume`` (calls to a paused sandbox
resume it).
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
import secrets
import urllib.parse
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from hutch.contract.auth import Permission, Principal
from hutch.contract.limits import AUTO_PAUSE_S_RANGE
from hutch.e2b import metrics
from hutch.e2b.errors import E2bError, unsupported
from hutch.e2b.face import (
    Face,
    face,
    needs,
    opt_bool,
    opt_int,
    read_json,
    str_map,
)
from hutch.e2b.network import egress_rules
from hutch.e2b.templates import resolve_template
from hutch.e2b.views import (
    e2b_state,
    listed_sandbox,
    sandbox_created,
    sandbox_detail,
    snapshot_info,
)
from hutch.errors import NotFound
from hutch.models import PauseMode, SandboxRecord, SandboxSpec, SandboxState, SnapshotRecord

__all__ = ["router"]

router = APIRouter()
FaceDep = Annotated[Face, Depends(face)]
P = Permission
#: Every route gets the caller's principal, allowed the route's permission (the same
#: permissions as the REST API's; GET /sandboxes/{id} hands out the data plane's access
#: tokens, so it needs sandbox.use); sandboxes are looked up in its project only.
Reader = Annotated[Principal, Depends(needs(P.SANDBOX_READ))]
Creator = Annotated[Principal, Depends(needs(P.SANDBOX_CREATE))]
User = Annotated[Principal, Depends(needs(P.SANDBOX_USE))]
Lifecycle = Annotated[Principal, Depends(needs(P.SANDBOX_LIFECYCLE))]
Deleter = Annotated[Principal, Depends(needs(P.SANDBOX_DELETE))]
Forker = Annotated[Principal, Depends(needs(P.SANDBOX_FORK))]
EgressWriter = Annotated[Principal, Depends(needs(P.EGRESS_WRITE))]
SnapshotCreator = Annotated[Principal, Depends(needs(P.SNAPSHOT_CREATE))]
SnapshotReader = Annotated[Principal, Depends(needs(P.SNAPSHOT_READ))]
SnapshotDeleter = Annotated[Principal, Depends(needs(P.SNAPSHOT_DELETE))]

DEFAULT_TIMEOUT_S = 300
#: E2B's default time to live of fork children (its API's default).
DEFAULT_FORK_TIMEOUT_S = 15
MAX_FORK_COUNT = 20
DEFAULT_LIST_LIMIT = 100
MAX_LIST_LIMIT = 1000


# -- helpers ---------------------------------------------------------------------------


def _live(f: Face, sandbox_id: str, project: str) -> SandboxRecord:
    """The sandbox, or 404 in E2B's words when it does not exist, has ended or is
    another project's."""
    try:
        rec = f.hutch.sandboxes.get(sandbox_id, project)
    except NotFound as exc:
        raise E2bError(404, f"sandbox {sandbox_id!r} not found") from exc
    if e2b_state(rec) is None:
        raise E2bError(404, f"sandbox {sandbox_id!r} not found ({rec.state})")
    return rec


def _settled(rec: SandboxRecord) -> None:
    """Refuse, with a retry hint, a sandbox between two states."""
    if rec.state in (SandboxState.CREATING, SandboxState.PAUSING, SandboxState.RESUMING):
        raise E2bError(
            409,
            f"sandbox {rec.id} is {rec.state}; retry in a moment",
            retry_after_s=1,
            should_retry=True,
        )


def _timeout(value: int | None, default: int) -> int:
    timeout = default if value is None else value
    if timeout < 1:
        raise E2bError(400, f"timeout={timeout}: give seconds >= 1")
    return timeout


def _apply_timeout(f: Face, rec: SandboxRecord, timeout: int) -> SandboxRecord:
    """E2B's deadline on a hutch sandbox: an idle auto-pause window for autoPause
    sandboxes, a delete deadline for the others."""
    if rec.auto_pause_s is not None and rec.timeout_s is None:
        lo, hi = AUTO_PAUSE_S_RANGE
        return f.hutch.policies.set_auto_pause(rec.id, min(max(timeout, lo), hi))
    return f.hutch.policies.set_timeout(rec.id, timeout)


def _rules_of(f: Face, rec: SandboxRecord) -> list[str] | None:
    if f.hutch.networking.net is None or str(rec.network) == "none":
        return None
    return list(f.hutch.networking.egress_get(rec.id).rules)


def _created(f: Face, rec: SandboxRecord, status: int = 201) -> JSONResponse:
    return JSONResponse(sandbox_created(rec, f.tokens, f.envd_version), status_code=status)


def _refuse_unsupported_create_fields(body: dict[str, Any]) -> None:
    if body.get("mcp") not in (None, {}):
        raise unsupported(
            "mcp (E2B's MCP gateway template)",
            "hutch serves its own MCP server: run `hutch mcp` (sandboxes as tools)",
        )
    iam = body.get("iam")
    if isinstance(iam, dict) and iam.get("tokens"):
        raise unsupported(
            "iam (workload identity tokens)",
            "pass credentials as envVars, and limit where they can be sent with egress rules",
        )
    if body.get("volumeMounts"):
        raise unsupported(
            "volumeMounts",
            "a hutch sandbox keeps its disk across pause and resume, and snapshots keep "
            "disk and memory; move files with sandbox.files or `hutch cp`",
        )


# -- create / inspect / list -----------------------------------------------------------


@router.post("/sandboxes")
@router.post("/v2/sandboxes")
async def create_sandbox(request: Request, f: FaceDep, who: Creator) -> JSONResponse:
    body = await read_json(request, required=True)
    template_id = body.get("templateID")
    if not isinstance(template_id, str) or not template_id:
        raise E2bError(400, "templateID is required (a template name such as 'base')")
    _refuse_unsupported_create_fields(body)
    svc = f.hutch.sandboxes
    template = resolve_template(template_id, [i.name for i in svc.images(who.project)])
    timeout = _timeout(opt_int(body, "timeout"), DEFAULT_TIMEOUT_S)
    auto_pause = opt_bool(body, "autoPause", False)
    if auto_pause and opt_bool(body, "autoPauseMemory", True) is False:
        raise unsupported(
            "autoPauseMemory=false (a filesystem-only auto-pause)",
            "hutch's auto-pause keeps memory; pause with mode='filesystem' explicitly "
            "(hutch's disk pause) when only the disk should be kept",
        )
    resume_cfg = body.get("autoResume")
    auto_resume = bool(resume_cfg.get("enabled")) if isinstance(resume_cfg, dict) else False
    allow_internet = opt_bool(body, "allow_internet_access")
    rules = egress_rules(body.get("network"), allow_internet)
    if auto_pause:
        lo, hi = AUTO_PAUSE_S_RANGE
        if not lo <= timeout <= hi:
            raise E2bError(
                400,
                f"timeout={timeout} with autoPause: hutch pauses a sandbox once it is idle "
                f"that long, which takes {lo}-{hi} seconds",
            )
    spec = SandboxSpec(
        image=template.image or svc.core.settings.default_image,
        env=str_map(body, "envVars"),
        metadata=str_map(body, "metadata"),
        timeout_s=None if auto_pause else timeout,
        auto_resume=auto_resume,
        auto_pause_s=timeout if auto_pause else None,
        snapshot_id=template.snapshot_id,
        egress=rules,
        project=who.project,
    )
    return _created(f, await svc.create(spec))


@router.get("/sandboxes/{sandbox_id}")
async def get_sandbox(sandbox_id: str, f: FaceDep, who: User) -> JSONResponse:
    rec = _live(f, sandbox_id, who.project)
    return JSONResponse(sandbox_detail(rec, f.tokens, f.envd_version, _rules_of(f, rec)))


def _metadata_filter(raw: str | None) -> dict[str, str]:
    """The SDKs send ``metadata=urlencode({quote(k): quote(v)})`` (encoded once more as a
    query value): decode both layers."""
    if not raw:
        return {}
    return {
        urllib.parse.unquote(k): urllib.parse.unquote(v)
        for k, v in urllib.parse.parse_qsl(raw, keep_blank_values=True)
    }


def _states_filter(raw: str | None) -> set[str]:
    if not raw:
        return {"running", "paused"}
    states = {s.strip() for s in raw.split(",") if s.strip()}
    bad = states - {"running", "paused"}
    if bad:
        raise E2bError(400, f"state {sorted(bad)}: accepted: running, paused")
    return states


def _token(rec_key: tuple[float, str]) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(rec_key)).encode()).decode()


def _cursor(token: str | None) -> tuple[float, str] | None:
    if not token:
        return None
    try:
        created, ident = json.loads(base64.urlsafe_b64decode(token.encode()))
        return float(created), str(ident)
    except (ValueError, TypeError, binascii.Error) as exc:
        raise E2bError(400, "nextToken is not one this API returned") from exc


def _page(
    items: list[Any], key: Any, limit: int, token: str | None, descending: bool
) -> tuple[list[Any], str | None]:
    """One page after the cursor, and the cursor of the next page (None: last page)."""
    items = sorted(items, key=key, reverse=descending)
    after = _cursor(token)
    if after is not None:
        items = [i for i in items if (key(i) < after if descending else key(i) > after)]
    page = items[:limit]
    more = len(items) > limit
    return page, (_token(key(page[-1])) if more and page else None)


def _limit(request: Request) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return DEFAULT_LIST_LIMIT
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIST_LIMIT:
        raise E2bError(400, f"limit={raw!r}: accepted 1-{MAX_LIST_LIMIT}")
    return int(raw)


def _started(rec: SandboxRecord) -> tuple[float, str]:
    return (rec.started_at or rec.created_at, rec.id)


def _listed(f: Face, request: Request, states: set[str], project: str) -> list[SandboxRecord]:
    q = request.query_params
    recs = f.hutch.sandboxes.list_sandboxes(
        metadata=_metadata_filter(q.get("metadata")), project=project
    )
    recs = [r for r in recs if e2b_state(r) in states]
    template = q.get("template")
    if template:
        names = [i.name for i in f.hutch.sandboxes.images(project)]
        image = resolve_template(template, names).image
        recs = [r for r in recs if r.image == image]
    after = q.get("startedAfter")
    if after:
        try:
            since = dt.datetime.fromisoformat(after.replace("Z", "+00:00")).timestamp()
        except ValueError as exc:
            raise E2bError(400, f"startedAfter={after!r} is not an ISO 8601 time") from exc
        recs = [r for r in recs if _started(r)[0] >= since]
    return recs


@router.get("/v2/sandboxes")
async def list_sandboxes(request: Request, f: FaceDep, who: Reader) -> JSONResponse:
    q = request.query_params
    order = q.get("order", "asc")
    if order not in ("asc", "desc"):
        raise E2bError(400, f"order={order!r}: accepted asc, desc")
    recs = _listed(f, request, _states_filter(q.get("state")), who.project)
    page, next_token = _page(recs, _started, _limit(request), q.get("nextToken"), order == "desc")
    headers = {"X-Next-Token": next_token} if next_token else {}
    return JSONResponse([listed_sandbox(r, f.envd_version) for r in page], headers=headers)


@router.get("/sandboxes")
async def list_sandboxes_v1(request: Request, f: FaceDep, who: Reader) -> JSONResponse:
    """The first list endpoint: running sandboxes, no pages."""
    recs = _listed(f, request, {"running"}, who.project)
    return JSONResponse([listed_sandbox(r, f.envd_version) for r in recs])


# -- lifecycle -------------------------------------------------------------------------


@router.delete("/sandboxes/{sandbox_id}")
async def kill_sandbox(sandbox_id: str, f: FaceDep, who: Deleter) -> Response:
    _live(f, sandbox_id, who.project)
    await f.hutch.sandboxes.delete(sandbox_id)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout")
async def set_timeout(sandbox_id: str, request: Request, f: FaceDep, who: Lifecycle) -> Response:
    body = await read_json(request, required=True)
    timeout = opt_int(body, "timeout")
    if timeout is None:
        raise E2bError(400, "timeout is required (seconds from now)")
    _apply_timeout(f, _live(f, sandbox_id, who.project), _timeout(timeout, DEFAULT_TIMEOUT_S))
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/refreshes")
async def refresh(sandbox_id: str, request: Request, f: FaceDep, who: Lifecycle) -> Response:
    """Keep-alive: the deadline moves to ``duration`` seconds from now if that is later."""
    body = await read_json(request)
    duration = _timeout(opt_int(body, "duration"), 60)
    rec = _live(f, sandbox_id, who.project)
    now = f.hutch.clock()
    if rec.expires_at is None or rec.expires_at < now + duration:
        _apply_timeout(f, rec, duration)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/pause")
async def pause_sandbox(sandbox_id: str, request: Request, f: FaceDep, who: Lifecycle) -> Response:
    body = await read_json(request)
    memory = opt_bool(body, "memory", True)
    rec = _live(f, sandbox_id, who.project)
    if rec.state in (SandboxState.PAUSED, SandboxState.PAUSING):
        raise E2bError(409, f"sandbox {sandbox_id} is already paused")
    _settled(rec)
    await f.hutch.lifecycle.pause(sandbox_id, PauseMode.MEMORY if memory else PauseMode.DISK)
    return Response(status_code=204)


async def _connect(f: Face, sandbox_id: str, body: dict[str, Any], project: str) -> JSONResponse:
    """Running: 200 (the deadline only ever moves later). Paused: resumed, 201."""
    timeout = _timeout(opt_int(body, "timeout"), DEFAULT_TIMEOUT_S)
    memory = opt_bool(body, "memory", True)
    rec = _live(f, sandbox_id, project)
    _settled(rec)
    now = f.hutch.clock()
    if rec.state is SandboxState.RUNNING:
        if rec.timeout_s is not None and (rec.expires_at or 0) < now + timeout:
            rec = f.hutch.policies.set_timeout(rec.id, timeout)
        return _created(f, rec, 200)
    if memory is False and rec.pause_mode is PauseMode.MEMORY:
        raise unsupported(
            "on_resume='reboot' (resuming a memory pause without its memory)",
            "hutch resumes a memory pause as it was; pause with mode='filesystem' to "
            "have the sandbox boot again from its disk on resume",
        )
    # The deadline first: the reaper only looks at running sandboxes.
    _apply_timeout(f, rec, timeout)
    return _created(f, await f.hutch.lifecycle.resume(sandbox_id), 201)


@router.post("/sandboxes/{sandbox_id}/connect")
@router.post("/v2/sandboxes/{sandbox_id}/connect")
async def connect_sandbox(sandbox_id: str, request: Request, f: FaceDep, who: User) -> JSONResponse:
    return await _connect(f, sandbox_id, await read_json(request), who.project)


@router.post("/sandboxes/{sandbox_id}/resume")
async def resume_sandbox(
    sandbox_id: str, request: Request, f: FaceDep, who: Lifecycle
) -> JSONResponse:
    """The deprecated resume: like connect, but a running sandbox is a 409."""
    body = await read_json(request)
    if _live(f, sandbox_id, who.project).state is SandboxState.RUNNING:
        raise E2bError(409, f"sandbox {sandbox_id} is already running")
    return await _connect(f, sandbox_id, body, who.project)


@router.post("/sandboxes/{sandbox_id}/fork")
async def fork_sandbox(sandbox_id: str, request: Request, f: FaceDep, who: Forker) -> JSONResponse:
    """Each child gets its own deadline; E2B reports per child, hutch forks all or none
    (a failure answers for the whole request)."""
    body = await read_json(request)
    timeout = _timeout(opt_int(body, "timeout"), DEFAULT_FORK_TIMEOUT_S)
    count = opt_int(body, "count", 1) or 1
    if not 1 <= count <= MAX_FORK_COUNT:
        raise E2bError(400, f"count={count}: accepted 1-{MAX_FORK_COUNT}")
    _settled(_live(f, sandbox_id, who.project))
    children = await f.hutch.snapshots.fork(sandbox_id, count)
    results = []
    for child in children:
        child = _apply_timeout(f, child, timeout)
        results.append({"sandbox": sandbox_created(child, f.tokens, f.envd_version)})
    return JSONResponse(results, status_code=201)


@router.put("/sandboxes/{sandbox_id}/network")
async def update_network(
    sandbox_id: str, request: Request, f: FaceDep, who: EgressWriter
) -> Response:
    """Replaces the egress rules at once (hutch changes them live; connections the new
    rules refuse are cut)."""
    body = await read_json(request)
    _live(f, sandbox_id, who.project)
    rules = egress_rules(body, opt_bool(body, "allow_internet_access"))
    await f.hutch.networking.egress_set(sandbox_id, rules or [])
    return Response(status_code=204)


@router.get("/sandboxes/{sandbox_id}/metrics")
async def sandbox_metrics(sandbox_id: str, f: FaceDep, who: Reader) -> JSONResponse:
    """One sample, measured in the guest now (a paused sandbox has none)."""
    rec = _live(f, sandbox_id, who.project)
    if rec.state is not SandboxState.RUNNING:
        return JSONResponse([])
    return JSONResponse([await metrics.sample(f.hutch.guest, rec)])


# -- snapshots -------------------------------------------------------------------------


@router.post("/sandboxes/{sandbox_id}/snapshots")
async def create_snapshot(
    sandbox_id: str, request: Request, f: FaceDep, who: SnapshotCreator
) -> JSONResponse:
    body = await read_json(request)
    if opt_bool(body, "memory", True) is False:
        raise unsupported(
            "a filesystem-only snapshot (mode='filesystem')",
            "hutch snapshots keep memory and disk; a sandbox created from one continues "
            "where the snapshot was taken",
        )
    name = body.get("name")
    if name is None:
        name = "snapshot-" + secrets.token_hex(4)
    if not isinstance(name, str):
        raise E2bError(400, "name must be a string")
    _settled(_live(f, sandbox_id, who.project))
    snap = await f.hutch.snapshots.snapshot(sandbox_id, name)
    return JSONResponse(snapshot_info(snap), status_code=201)


def _snap_key(snap: SnapshotRecord) -> tuple[float, str]:
    return (snap.created_at, snap.id)


@router.get("/snapshots")
async def list_snapshots(request: Request, f: FaceDep, who: SnapshotReader) -> JSONResponse:
    q = request.query_params
    snaps = f.hutch.snapshots.list_snapshots(who.project)
    if q.get("sandboxID"):
        snaps = [s for s in snaps if s.sandbox_id == q["sandboxID"]]
    if q.get("name"):
        snaps = [s for s in snaps if s.name == q["name"]]
    page, next_token = _page(snaps, _snap_key, _limit(request), q.get("nextToken"), False)
    headers = {"X-Next-Token": next_token} if next_token else {}
    return JSONResponse([snapshot_info(s) for s in page], headers=headers)


@router.delete("/templates/{template_id:path}")
async def delete_template(template_id: str, f: FaceDep, who: SnapshotDeleter) -> Response:
    """E2B deletes snapshots through its templates endpoint (``delete_snapshot``)."""
    snapshot_id = template_id.removesuffix(":default").removesuffix(":latest")
    if not snapshot_id.startswith("snap-"):
        raise unsupported(
            "deleting a template",
            "hutch images are removed with `hutch image rm NAME`; snapshots (snap-...) "
            "are deleted here",
        )
    try:
        f.hutch.snapshots.get_snapshot(snapshot_id, who.project)
        await f.hutch.snapshots.delete_snapshot(snapshot_id)
    except NotFound as exc:
        raise E2bError(404, f"snapshot {snapshot_id!r} not found") from exc
    return Response(status_code=204)
