from __future__ import annotations

import codecs
import json
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, StreamingResponse

from hutch.api.deps import guest, processes
from hutch.api.routes.processes import ProcessModel, process_model
from hutch.api.schemas import ExecRequest, ExecResult
from hutch.api.streaming import TrackedStream
from hutch.contract.limits import COLLECTED_EXEC_MAX_BYTES
from hutch.errors import HutchError, InvalidArgument, Timeout
from hutch.services.guest_ops import ExecCall, GuestOps
from hutch.services.processes import ProcessService

router = APIRouter(prefix="/v1/sandboxes", tags=["exec"])
Service = Annotated[GuestOps, Depends(guest)]
Procs = Annotated[ProcessService, Depends(processes)]

# A non-streamed result is held in the daemon's memory; past this it is cut (the command
# keeps running to its end). Stream for more.
MAX_COLLECTED_BYTES = COLLECTED_EXEC_MAX_BYTES
TRUNCATION_NOTE = "\n[hutch: output truncated at 16 MiB; use stream=true for all of it]\n"


def _timeout_message(timeout_s: float | None) -> str:
    return f"the command ran longer than timeout_s={timeout_s} and was killed"


@router.post(
    "/{sandbox_id}/exec",
    response_model=ExecResult,
    responses={
        200: {"content": {"application/x-ndjson": {}}},
        201: {"model": ProcessModel, "description": "background=true: the started process"},
    },
)
async def exec_command(
    sandbox_id: str, body: ExecRequest, svc: Service, procs: Procs
) -> ExecResult | StreamingResponse | JSONResponse:
    if body.background:
        if body.stream:
            raise InvalidArgument("background and stream exclude each other; pick one")
        info = await procs.start(
            sandbox_id,
            body.cmd,
            env=body.env,
            cwd=body.cwd,
            user=body.user,
            stdin=body.stdin.encode() if body.stdin is not None else None,
            timeout_s=body.timeout_s,
        )
        return JSONResponse(process_model(info).model_dump(mode="json"), status_code=201)
    # The call holds its lease (in flight: pause/snapshot/fork wait for it; busy: no
    # auto-pause) until the command's exit is read or the answer is closed.
    call = await svc.exec(
        sandbox_id,
        body.cmd,
        env=body.env,
        cwd=body.cwd,
        user=body.user,
        stdin=body.stdin.encode() if body.stdin is not None else None,
        timeout_s=body.timeout_s,
    )
    if body.stream:
        return TrackedStream(
            _events(call, body.timeout_s),
            on_close=call.close,
            what=f"exec stream of {sandbox_id}",
            media_type="application/x-ndjson",
        )
    async with call:
        return await _collect(call, body.timeout_s)


async def _collect(stream: ExecCall, timeout_s: float | None) -> ExecResult:
    buffers = {"stdout": bytearray(), "stderr": bytearray()}
    truncated = {"stdout": False, "stderr": False}
    async for chunk in stream:
        buf = buffers[chunk.stream]
        room = MAX_COLLECTED_BYTES - len(buf)
        if room > 0:
            buf += chunk.data[:room]
        if len(chunk.data) > room:
            truncated[chunk.stream] = True
    done = await stream.wait()
    if done.timed_out:
        raise Timeout(_timeout_message(timeout_s))

    def text(name: str) -> str:
        out = buffers[name].decode(errors="replace")
        return out + TRUNCATION_NOTE if truncated[name] else out

    return ExecResult(
        exit_code=done.exit_code,
        signal=done.signal,
        stdout=text("stdout"),
        stderr=text("stderr"),
        duration_ms=done.duration_ms,
    )


async def _events(stream: ExecCall, timeout_s: float | None) -> AsyncIterator[bytes]:
    """NDJSON events; whatever ends the command's output, the last line says how (an
    ``exit``, or an ``error`` the SDK raises): the stream never just stops."""
    # Incremental decoders: a chunk boundary may split a multi-byte UTF-8 character.
    decoders = {
        "stdout": codecs.getincrementaldecoder("utf-8")("replace"),
        "stderr": codecs.getincrementaldecoder("utf-8")("replace"),
    }

    def line(obj: dict[str, object]) -> bytes:
        return json.dumps(obj).encode() + b"\n"

    try:
        async for chunk in stream:
            text = decoders[chunk.stream].decode(chunk.data)
            if text:
                yield line({"type": chunk.stream, "data": text})
        for name, decoder in decoders.items():
            rest = decoder.decode(b"", final=True)
            if rest:
                yield line({"type": name, "data": rest})
        done = await stream.wait()
    except HutchError as exc:
        yield line({"type": "error", "code": exc.code, "message": exc.message})
        return
    if done.timed_out:
        yield line({"type": "error", "code": "timeout", "message": _timeout_message(timeout_s)})
        return
    yield line(
        {
            "type": "exit",
            "exit_code": done.exit_code,
            "signal": done.signal,
            "duration_ms": done.duration_ms,
        }
    )
