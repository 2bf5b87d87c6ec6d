"""Background processes: start detached, list, output (fetched or followed), stdin,
signals, kill.

Output offsets count stdout and stderr bytes together, in the order the guest read them;
the guest keeps the newest 2 MiB per process, and ``dropped_bytes`` says how much is gone.
"""

from __future__ import annotations

import codecs
import datetime as dt
import json
import signal as _signal
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from hutch.api.deps import processes
from hutch.contract.limits import (
    CMD_ARG_MAX_CHARS,
    CMD_MAX_CHARS,
    ENV_MAX_VARS,
    PATH_MAX_CHARS,
    PROCESS_TIMEOUT_S_MAX,
    STDIN_MAX_CHARS,
    USER_MAX_CHARS,
)
from hutch.errors import HutchError, InvalidArgument
from hutch.services.processes import ProcessInfo, ProcessService

__all__ = ["ProcessModel", "parse_signal", "process_model", "router"]

router = APIRouter(prefix="/v1/sandboxes", tags=["processes"])
Procs = Annotated[ProcessService, Depends(processes)]
MAX_TIMEOUT_S = PROCESS_TIMEOUT_S_MAX


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StartProcess(_Strict):
    cmd: (
        Annotated[list[Annotated[str, Field(max_length=CMD_ARG_MAX_CHARS)]], Field(min_length=1)]
        | Annotated[str, Field(min_length=1, max_length=CMD_MAX_CHARS)]
    ) = Field(description="argv list (run directly) or a string (run with /bin/sh -c)")
    env: dict[str, str] = Field(default_factory=dict, max_length=ENV_MAX_VARS)
    cwd: Annotated[str, Field(min_length=1, max_length=PATH_MAX_CHARS)] | None = None
    user: Annotated[str, Field(min_length=1, max_length=USER_MAX_CHARS)] | None = None
    timeout_s: Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S)] | None = Field(
        default=None, description="Kill it after this long; no deadline when absent"
    )
    stdin: Annotated[str, Field(max_length=STDIN_MAX_CHARS)] | None = Field(
        default=None, description="Written to its stdin at start"
    )
    keep_stdin: bool = Field(
        default=False,
        description="Leave stdin open for POST .../stdin (else it is closed after `stdin`)",
    )


class ProcessModel(BaseModel):
    pid: int
    argv: list[str]
    state: Literal["running", "exited"]
    exit_code: int | None
    signal: int | None
    timed_out: bool
    started_at: dt.datetime
    ended_at: dt.datetime | None
    output_bytes: int = Field(description="Output produced so far (stdout + stderr), bytes")
    dropped_bytes: int = Field(description="Oldest output no longer buffered, bytes")
    stdin_open: bool


class ProcessList(BaseModel):
    processes: list[ProcessModel]


class ProcessOutput(BaseModel):
    stdout: str
    stderr: str
    next_offset: int = Field(description="Pass as ?offset= to read only what comes after")
    dropped_bytes: int = Field(description="Bytes at or after ?offset= no longer buffered")
    process: ProcessModel


class SignalRequest(_Strict):
    signal: int | str = Field(description="Number (15) or name (SIGTERM, TERM)")


def _time(ts: float | None) -> dt.datetime | None:
    return None if ts is None else dt.datetime.fromtimestamp(ts, dt.UTC)


def process_model(p: ProcessInfo) -> ProcessModel:
    return ProcessModel(
        pid=p.pid,
        argv=list(p.argv),
        state=p.state,
        exit_code=p.exit_code,
        signal=p.signal,
        timed_out=p.timed_out,
        started_at=_time(p.started_at) or dt.datetime.now(dt.UTC),
        ended_at=_time(p.ended_at),
        output_bytes=p.output_bytes,
        dropped_bytes=p.dropped_bytes,
        stdin_open=p.stdin_open,
    )


def parse_signal(value: int | str) -> int:
    """15, "15", "SIGTERM" or "term" → 15."""
    if isinstance(value, int):
        return value
    text = value.strip().upper()
    if text.isdigit():
        return int(text)
    name = text if text.startswith("SIG") else "SIG" + text
    try:
        return int(_signal.Signals[name])
    except KeyError:
        raise InvalidArgument(
            f"signal {value!r} is not a signal name or number (try TERM, KILL, INT or 15)"
        ) from None


@router.post("/{sandbox_id}/processes", response_model=ProcessModel, status_code=201)
async def start_process(sandbox_id: str, body: StartProcess, procs: Procs) -> ProcessModel:
    info = await procs.start(
        sandbox_id,
        body.cmd,
        env=body.env,
        cwd=body.cwd,
        user=body.user,
        stdin=body.stdin.encode() if body.stdin is not None else None,
        keep_stdin=body.keep_stdin,
        timeout_s=body.timeout_s,
    )
    return process_model(info)


@router.get("/{sandbox_id}/processes", response_model=ProcessList)
async def list_processes(sandbox_id: str, procs: Procs) -> ProcessList:
    return ProcessList(processes=[process_model(p) for p in await procs.list(sandbox_id)])


@router.get("/{sandbox_id}/processes/{pid}", response_model=ProcessModel)
async def get_process(sandbox_id: str, pid: int, procs: Procs) -> ProcessModel:
    return process_model(await procs.get(sandbox_id, pid))


@router.get(
    "/{sandbox_id}/processes/{pid}/output",
    response_model=ProcessOutput,
    responses={200: {"content": {"application/x-ndjson": {}}}},
)
async def process_output(
    sandbox_id: str,
    pid: int,
    procs: Procs,
    offset: Annotated[int, Query(ge=0)] = 0,
    follow: bool = False,
) -> ProcessOutput | StreamingResponse:
    """Buffered output from ``offset``. With ``follow=true``: NDJSON events, live until the
    process exits: ``{"type": "stdout"|"stderr", "offset", "data"}``, ``{"type":
    "dropped", "bytes"}`` when the buffer overran, and last ``{"type": "end",
    "next_offset", "process"}`` (or ``{"type": "error", "code", "message"}``)."""
    if follow:
        # Open before answering, so an unknown sandbox or pid is a plain 404.
        await procs.get(sandbox_id, pid)
        return StreamingResponse(
            _follow(procs, sandbox_id, pid, offset), media_type="application/x-ndjson"
        )
    out = {"stdout": bytearray(), "stderr": bytearray()}
    async with procs.output(sandbox_id, pid, offset) as stream:
        first: int | None = None
        async for chunk in stream:
            first = chunk.offset if first is None else first
            out[chunk.stream] += chunk.data
        end = stream.end
    assert end is not None
    dropped = first - offset if first is not None else max(0, end.next_offset - offset)
    return ProcessOutput(
        stdout=out["stdout"].decode(errors="replace"),
        stderr=out["stderr"].decode(errors="replace"),
        next_offset=end.next_offset,
        dropped_bytes=dropped,
        process=process_model(end.process),
    )


async def _follow(
    procs: ProcessService, sandbox_id: str, pid: int, offset: int
) -> AsyncIterator[bytes]:
    def line(obj: dict[str, object]) -> bytes:
        return json.dumps(obj).encode() + b"\n"

    decoders = {
        "stdout": codecs.getincrementaldecoder("utf-8")("replace"),
        "stderr": codecs.getincrementaldecoder("utf-8")("replace"),
    }
    pos = offset
    try:
        async with procs.output(sandbox_id, pid, offset, follow=True) as stream:
            async for chunk in stream:
                if chunk.offset > pos:
                    yield line({"type": "dropped", "bytes": chunk.offset - pos})
                pos = chunk.offset + len(chunk.data)
                text = decoders[chunk.stream].decode(chunk.data)
                if text:
                    yield line({"type": chunk.stream, "offset": chunk.offset, "data": text})
            end = stream.end
        assert end is not None
    except HutchError as exc:
        yield line({"type": "error", "code": exc.code, "message": exc.message})
        return
    for name, decoder in decoders.items():
        rest = decoder.decode(b"", final=True)
        if rest:
            yield line({"type": name, "offset": pos, "data": rest})
    yield line(
        {
            "type": "end",
            "next_offset": end.next_offset,
            "process": process_model(end.process).model_dump(mode="json"),
        }
    )


@router.post(
    "/{sandbox_id}/processes/{pid}/stdin",
    response_model=ProcessModel,
    openapi_extra={"requestBody": {"content": {"application/octet-stream": {}}, "required": False}},
)
async def write_stdin(
    sandbox_id: str,
    pid: int,
    request: Request,
    procs: Procs,
    eof: Annotated[bool, Query(description="Close stdin after writing the body")] = False,
) -> ProcessModel:
    """Write the raw request body to the process's stdin (it needs ``keep_stdin``)."""
    data = await request.body()
    return process_model(await procs.write_stdin(sandbox_id, pid, data, eof=eof))


@router.post("/{sandbox_id}/processes/{pid}/signal", response_model=ProcessModel)
async def signal_process(
    sandbox_id: str, pid: int, body: SignalRequest, procs: Procs
) -> ProcessModel:
    """Signal the process's group. 409 if it has already exited."""
    return process_model(await procs.signal(sandbox_id, pid, parse_signal(body.signal)))


@router.post("/{sandbox_id}/processes/{pid}/wait", response_model=ProcessModel)
async def wait_process(
    sandbox_id: str,
    pid: int,
    procs: Procs,
    timeout_s: Annotated[float | None, Query(ge=0, le=MAX_TIMEOUT_S)] = None,
) -> ProcessModel:
    """Wait for the exit; after ``timeout_s`` the process is returned still running."""
    return process_model(await procs.wait(sandbox_id, pid, timeout_s))


@router.delete("/{sandbox_id}/processes/{pid}", response_model=ProcessModel)
async def kill_process(sandbox_id: str, pid: int, procs: Procs) -> ProcessModel:
    """SIGKILL the process group (a no-op for an exited process) and return it."""
    return process_model(await procs.kill(sandbox_id, pid))
