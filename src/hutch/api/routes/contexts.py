"""Code interpreter: ``/v1/sandboxes/{id}/contexts`` (stateful Python contexts)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from hutch.api.deps import interpreter
from hutch.api.streaming import TrackedStream
from hutch.contract.limits import (
    CODE_MAX_CHARS,
    COLLECTED_RUN_MAX_BYTES,
    ENV_MAX_VARS,
    PATH_MAX_CHARS,
    RUN_TIMEOUT_S_MAX,
)
from hutch.errors import HutchError
from hutch.services.interpreter import CodeRun, ContextInfo, InterpreterService

router = APIRouter(prefix="/v1/sandboxes", tags=["contexts"])
Service = Annotated[InterpreterService, Depends(interpreter)]

MAX_RUN_TIMEOUT_S = RUN_TIMEOUT_S_MAX
#: A collected (non-streamed) run is held in the daemon's memory; past this, outputs are
#: dropped and a note says so. Stream (``?stream=1``) for more.
MAX_COLLECTED_BYTES = COLLECTED_RUN_MAX_BYTES


class CreateContext(BaseModel):
    model_config = ConfigDict(extra="forbid")
    language: Literal["python"] = "python"
    cwd: Annotated[str, Field(min_length=1, max_length=PATH_MAX_CHARS)] | None = None
    env: dict[str, str] = Field(default_factory=dict, max_length=ENV_MAX_VARS)


class Context(BaseModel):
    id: str
    language: str
    cwd: str
    state: Literal["idle", "busy", "dead"]
    pid: int | None
    created_at: dt.datetime
    runs: int


class ContextList(BaseModel):
    contexts: list[Context]


class RunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: Annotated[str, Field(max_length=CODE_MAX_CHARS)]
    timeout_s: Annotated[float, Field(gt=0, le=MAX_RUN_TIMEOUT_S)] | None = None


class RunError(BaseModel):
    ename: str
    evalue: str
    traceback: list[str]


class RunResult(BaseModel):
    outputs: list[dict[str, Any]] = Field(
        description="In order: {type: stdout|stderr, text}, {type: display|result, data: "
        "{mime: value}} (image/png and image/jpeg base64), {type: error, ename, evalue, "
        "traceback}."
    )
    stdout: str
    stderr: str
    result: dict[str, Any] | None = Field(description="Mime bundle of the last expression.")
    error: RunError | None
    status: Literal["ok", "error", "interrupted", "timeout"]
    duration_ms: int


def _context(info: ContextInfo) -> Context:
    state: Any = info.state if info.state in ("idle", "busy", "dead") else "dead"
    return Context(
        id=info.id,
        language=info.language,
        cwd=info.cwd,
        state=state,
        pid=info.pid,
        created_at=dt.datetime.fromtimestamp(info.created_at, dt.UTC),
        runs=info.runs,
    )


@router.post("/{sandbox_id}/contexts", response_model=Context, status_code=201)
async def create_context(sandbox_id: str, body: CreateContext, svc: Service) -> Context:
    """A new Python context: its own long-lived interpreter in the sandbox, where
    variables, imports and functions persist from one run to the next."""
    info = await svc.create(sandbox_id, language=body.language, cwd=body.cwd, env=body.env)
    return _context(info)


@router.get("/{sandbox_id}/contexts", response_model=ContextList)
async def list_contexts(sandbox_id: str, svc: Service) -> ContextList:
    return ContextList(contexts=[_context(c) for c in await svc.list(sandbox_id)])


@router.get("/{sandbox_id}/contexts/{context_id}", response_model=Context)
async def get_context(sandbox_id: str, context_id: str, svc: Service) -> Context:
    return _context(await svc.get(sandbox_id, context_id))


@router.delete("/{sandbox_id}/contexts/{context_id}", status_code=204, response_class=Response)
async def delete_context(sandbox_id: str, context_id: str, svc: Service) -> Response:
    await svc.delete(sandbox_id, context_id)
    return Response(status_code=204)


@router.post("/{sandbox_id}/contexts/{context_id}/interrupt", response_model=Context)
async def interrupt_context(sandbox_id: str, context_id: str, svc: Service) -> Context:
    """SIGINT to the running code: its run ends with a KeyboardInterrupt error and the
    context keeps its variables."""
    return _context(await svc.interrupt(sandbox_id, context_id))


@router.post("/{sandbox_id}/contexts/{context_id}/restart", response_model=Context)
async def restart_context(sandbox_id: str, context_id: str, svc: Service) -> Context:
    """A fresh interpreter under the same id: every variable is gone."""
    return _context(await svc.restart(sandbox_id, context_id))


@router.post(
    "/{sandbox_id}/contexts/{context_id}/run",
    response_model=RunResult,
    responses={200: {"content": {"application/x-ndjson": {}}}},
)
async def run_code(
    sandbox_id: str,
    context_id: str,
    body: RunRequest,
    svc: Service,
    stream: Annotated[bool, Query(description="NDJSON outputs as they come.")] = False,
) -> RunResult | StreamingResponse:
    """Run ``code`` in the context. The value of the last expression is the ``result``;
    an exception is the ``error`` (the call still succeeds: the code failed, not the
    request). Runs in one context are queued. With ``stream=1`` each output is a JSON
    line, then ``{"type": "end", "status", "duration_ms"}``."""
    run = await svc.run(sandbox_id, context_id, body.code, timeout_s=body.timeout_s)
    if stream:
        return TrackedStream(
            _ndjson(run),
            on_close=run.close,
            what=f"code run stream of {sandbox_id}",
            media_type="application/x-ndjson",
        )
    try:
        return await _collect(run)
    finally:
        run.close()


async def _collect(run: CodeRun) -> RunResult:
    outputs: list[dict[str, Any]] = []
    stdout: list[str] = []
    stderr: list[str] = []
    result: dict[str, Any] | None = None
    error: RunError | None = None
    size = 0
    dropped = False
    async for item in run.outputs():
        kind = item["type"]
        if kind == "result":
            result = item.get("data")
        elif kind == "error":
            error = RunError(
                ename=str(item.get("ename", "")),
                evalue=str(item.get("evalue", "")),
                traceback=[str(t) for t in item.get("traceback") or []],
            )
        elif kind in ("stdout", "stderr"):
            (stdout if kind == "stdout" else stderr).append(str(item.get("text", "")))
        size += len(json.dumps(item))
        if size > MAX_COLLECTED_BYTES:
            dropped = True
            continue
        outputs.append(item)
    if dropped:
        note = "[hutch: outputs past 64 MiB were dropped; run with stream=1 for all of them]\n"
        outputs.append({"type": "stderr", "text": note})
    end = run.end
    return RunResult(
        outputs=outputs,
        stdout="".join(stdout)[:MAX_COLLECTED_BYTES],
        stderr="".join(stderr)[:MAX_COLLECTED_BYTES],
        result=result,
        error=error,
        status=_status(end.status if end else "error"),
        duration_ms=end.duration_ms if end else 0,
    )


def _status(value: str) -> Any:
    return value if value in ("ok", "error", "interrupted", "timeout") else "error"


async def _ndjson(run: CodeRun) -> AsyncIterator[bytes]:
    def line(obj: dict[str, Any]) -> bytes:
        return json.dumps(obj).encode() + b"\n"

    try:
        async for item in run.outputs():
            yield line(item)
        end = run.end
        yield line(
            {
                "type": "end",
                "status": end.status if end else "error",
                "duration_ms": end.duration_ms if end else 0,
            }
        )
    except HutchError as exc:
        yield line({"type": "error", "code": exc.code, "message": exc.message})
    finally:
        run.close()
