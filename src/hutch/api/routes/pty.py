"""Interactive terminals over a WebSocket: ``/v1/sandboxes/{id}/pty``.

Query: ``rows``, ``cols``, ``term``, ``cmd`` (a shell command; default a login shell), or
``pty_id`` to reattach to a terminal whose connection dropped (its scrollback is replayed
first). Auth: the API key as ``Authorization: Bearer <key>``; clients that cannot set
headers (browsers) send no header and make their first message the text frame
``{"type": "auth", "token": "<key>"}`` (within 10 s). The key is never accepted in the
URL: ``?token=`` (which earlier versions took) is refused with 4401, since a URL ends up
in access logs, proxies and browser history.

Frames: binary = terminal bytes, both ways. Text = JSON control. From the client:
``{"type": "resize", "rows", "cols"}``, ``{"type": "signal", "signal": 2}`` (to the
foreground job), ``{"type": "close"}`` (hang up the terminal for good). From the server:
``{"type": "ready", "pty_id", "pid"}`` first, ``{"type": "exit", "exit_code", "signal"}``
when the program ends, ``{"type": "detached"}`` when another client attached to the same
terminal, ``{"type": "error", "code", "message"}``. The server closes with 1000 after exit
or detach; with 4000 + the HTTP status (4401, 4404, 4409, ...) after an error that ends the
session. Closing the socket without ``close`` leaves the terminal running.

Also plain REST: ``GET .../ptys`` lists terminals, ``DELETE .../ptys/{pty_id}`` closes one.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, WebSocket
from pydantic import BaseModel
from starlette.websockets import WebSocketDisconnect, WebSocketState

from hutch.api.auth import bearer_token
from hutch.api.deps import authenticate, authorize, forwarded, processes
from hutch.api.errors import status_for
from hutch.api.routes.processes import parse_signal
from hutch.contract.limits import (
    DEFAULT_PTY_COLS,
    DEFAULT_PTY_ROWS,
    DEFAULT_TERM,
    PTY_CMD_MAX_CHARS,
    TERM_MAX_CHARS,
)
from hutch.errors import HutchError, InvalidArgument, Unauthorized
from hutch.services.processes import AttachedPty, ProcessService, PtyInfo

__all__ = ["router", "ws_router"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/sandboxes", tags=["pty"])
Procs = Annotated[ProcessService, Depends(processes)]

#: Seconds a client without an Authorization header has to send its auth message.
AUTH_TIMEOUT_S = 10.0
AUTH_MESSAGE_HINT = (
    "send 'Authorization: Bearer <key>', or (browsers) no header and the first message "
    '{"type": "auth", "token": "<key>"}; the key is in <state_dir>/api-key'
)


class PtyModel(BaseModel):
    pty_id: str
    pid: int
    argv: list[str]
    state: Literal["running", "exited"]
    exit_code: int | None
    signal: int | None
    rows: int
    cols: int
    attached: bool
    started_at: dt.datetime
    ended_at: dt.datetime | None


class PtyList(BaseModel):
    ptys: list[PtyModel]


def pty_model(t: PtyInfo) -> PtyModel:
    return PtyModel(
        pty_id=t.pty_id,
        pid=t.pid,
        argv=list(t.argv),
        state=t.state,
        exit_code=t.exit_code,
        signal=t.signal,
        rows=t.rows,
        cols=t.cols,
        attached=t.attached,
        started_at=dt.datetime.fromtimestamp(t.started_at, dt.UTC),
        ended_at=None if t.ended_at is None else dt.datetime.fromtimestamp(t.ended_at, dt.UTC),
    )


@router.get("/{sandbox_id}/ptys", response_model=PtyList)
async def list_ptys(sandbox_id: str, procs: Procs) -> PtyList:
    return PtyList(ptys=[pty_model(t) for t in await procs.list_ptys(sandbox_id)])


@router.delete("/{sandbox_id}/ptys/{pty_id}", response_model=PtyModel)
async def close_pty(sandbox_id: str, pty_id: str, procs: Procs) -> PtyModel:
    """Hang up the terminal (SIGHUP, then SIGKILL) and forget it."""
    return pty_model(await procs.close_pty(sandbox_id, pty_id))


def ws_router() -> APIRouter:
    """The WebSocket route; it checks the API key itself (header or first message)."""
    ws = APIRouter(prefix="/v1/sandboxes", tags=["pty"])

    @ws.websocket("/{sandbox_id}/pty")
    async def pty_socket(
        websocket: WebSocket,
        sandbox_id: str,
        procs: Procs,
        rows: Annotated[int, Query()] = DEFAULT_PTY_ROWS,
        cols: Annotated[int, Query()] = DEFAULT_PTY_COLS,
        term: Annotated[str, Query(max_length=TERM_MAX_CHARS)] = DEFAULT_TERM,
        cmd: Annotated[str | None, Query(max_length=PTY_CMD_MAX_CHARS)] = None,
        pty_id: Annotated[str | None, Query(max_length=64)] = None,
    ) -> None:
        await websocket.accept()
        try:
            who = forwarded(websocket)  # another host authenticated the caller
            if who is None:
                presented = await _presented_key(websocket)
                if presented is None:
                    return  # the client left before authenticating
                who = authenticate(websocket, presented)
            authorize(websocket, who)
            if pty_id is not None:
                session = await procs.attach_pty(sandbox_id, pty_id)
            else:
                session = await procs.open_pty(sandbox_id, cmd=cmd, rows=rows, cols=cols, term=term)
        except HutchError as exc:
            await _fail(websocket, exc)
            return
        async with session:  # attached (the sandbox is busy) until this block ends
            await _serve(websocket, procs, sandbox_id, session)

    return ws


async def _presented_key(websocket: WebSocket) -> str | None:
    """The key from the Authorization header, else from the first message. None when
    the client disconnected first; raises Unauthorized (never echoing what was sent)."""
    if "token" in websocket.query_params:
        raise Unauthorized(
            "the API key is not accepted in the URL (?token=): URLs end up in logs, proxies "
            "and browser history; " + AUTH_MESSAGE_HINT
        )
    header = websocket.headers.get("authorization")
    if header is not None:
        return bearer_token(header)
    try:
        message = await asyncio.wait_for(websocket.receive(), AUTH_TIMEOUT_S)
    except TimeoutError:
        raise Unauthorized(
            f"no API key within {AUTH_TIMEOUT_S:g} s: " + AUTH_MESSAGE_HINT
        ) from None
    if message["type"] == "websocket.disconnect":
        return None
    token = None
    with contextlib.suppress(ValueError, TypeError):
        obj = json.loads(message.get("text") or "")
        if isinstance(obj, dict) and obj.get("type") == "auth":
            token = obj.get("token")
    if not isinstance(token, str) or not token:
        raise Unauthorized("missing API key: " + AUTH_MESSAGE_HINT)
    return token


async def _send_json(websocket: WebSocket, obj: dict[str, Any]) -> None:
    await websocket.send_text(json.dumps(obj))


async def _fail(websocket: WebSocket, exc: HutchError) -> None:
    with contextlib.suppress(Exception):  # the client may be gone already
        await _send_json(websocket, {"type": "error", "code": exc.code, "message": exc.message})
        await websocket.close(code=4000 + status_for(exc), reason=exc.code)


async def _serve(
    websocket: WebSocket, procs: ProcessService, sandbox_id: str, session: AttachedPty
) -> None:
    await _send_json(websocket, {"type": "ready", "pty_id": session.pty_id, "pid": session.pid})

    async def output() -> None:
        async for data in session.output():
            await websocket.send_bytes(data)
        end = session.end
        if end is not None and end.detached:
            await _send_json(websocket, {"type": "detached"})
        elif end is not None:
            await _send_json(
                websocket, {"type": "exit", "exit_code": end.exit_code, "signal": end.signal}
            )
        await websocket.close(code=1000)

    async def control(message: str) -> bool:
        """Handle one text frame; False when the session should end."""
        try:
            msg = json.loads(message)
            if not isinstance(msg, dict):
                raise InvalidArgument("control frames are JSON objects with a 'type'")
            kind = msg.get("type")
            if kind == "resize":
                rows, cols = msg.get("rows"), msg.get("cols")
                if not isinstance(rows, int) or not isinstance(cols, int):
                    raise InvalidArgument("resize needs integer rows and cols")
                await procs.resize_pty(sandbox_id, session.pty_id, rows, cols)
            elif kind == "signal":
                signum = msg.get("signal")
                if not isinstance(signum, int | str):
                    raise InvalidArgument(f"signal {signum!r} is not a signal name or number")
                await procs.signal_pty(sandbox_id, session.pty_id, parse_signal(signum))
            elif kind == "close":
                await procs.close_pty(sandbox_id, session.pty_id)
                return True  # the exit arrives through the output
            else:
                raise InvalidArgument(
                    f"unknown control frame type {kind!r}; use resize, signal or close"
                )
        except ValueError as exc:
            await _send_json(
                websocket,
                {"type": "error", "code": "invalid_argument", "message": f"bad JSON: {exc}"},
            )
        except HutchError as exc:
            await _send_json(websocket, {"type": "error", "code": exc.code, "message": exc.message})
        return True

    async def inbound() -> None:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            if message.get("bytes") is not None:
                session.send(message["bytes"])
            elif message.get("text") is not None and not await control(message["text"]):
                return

    tasks = [asyncio.create_task(output()), asyncio.create_task(inbound())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            exc = task.exception()
            if isinstance(exc, HutchError):
                await _fail(websocket, exc)
            elif exc is not None and not isinstance(exc, WebSocketDisconnect | RuntimeError):
                log.error("pty session %s failed: %r", session.pty_id, exc)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # The terminal keeps running in the guest; only this attachment ends.
        await session.detach()
        if websocket.client_state is WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                await websocket.close(code=1000)
