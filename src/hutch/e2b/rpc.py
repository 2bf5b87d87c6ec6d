"""Serving Connect RPC services: method registry, request parsing, answers.

A service module declares its methods on an :class:`RpcService`; :func:`serve_rpc`
answers one request for the sandbox the data plane resolved (``Call``). Every hutch
error becomes a Connect error (``errors.connect_code_for``); a stream always ends with
its end-of-stream envelope (``{}`` or the error), however it ends.
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers

from hutch.api.streaming import TrackedStream
from hutch.e2b.connect import (
    MAX_MESSAGE_BYTES,
    STREAM_CONTENT_TYPE,
    UNARY_CONTENT_TYPE,
    ConnectError,
    EnvelopeReader,
    Keepalive,
    deadline_of,
    encode_envelope,
    end_of_stream,
    error_json,
    paced,
    parse_message,
)
from hutch.e2b.errors import connect_code_for
from hutch.errors import HutchError

__all__ = ["Call", "RpcService", "as_connect_error", "serve_rpc"]

log = logging.getLogger(__name__)

Message = dict[str, Any]
#: Header naming the seconds between keepalive messages of a stream (E2B SDKs send 50).
KEEPALIVE_HEADER = "keepalive-ping-interval"


@dataclass(frozen=True)
class Call:
    """One RPC to one sandbox: who (the user commands run as), with which headers."""

    sandbox_id: str
    headers: Headers
    #: From ``Authorization: Basic base64(user:)``; None: the image's default user.
    user: str | None


UnaryHandler = Callable[[Call, Message], Awaitable[Message]]
ServerStreamHandler = Callable[[Call, Message], AsyncIterator[Message]]
ClientStreamHandler = Callable[[Call, AsyncIterator[Message]], Awaitable[Message]]


@dataclass
class _Method:
    kind: Literal["unary", "server_stream", "client_stream"]
    handler: Any
    keepalive: Message | None = None


@dataclass
class RpcService:
    """``name`` is the fully qualified service (``process.Process``)."""

    name: str
    methods: dict[str, _Method] = field(default_factory=dict)

    def unary(self, name: str, handler: UnaryHandler) -> None:
        self.methods[name] = _Method("unary", handler)

    def server_stream(
        self, name: str, handler: ServerStreamHandler, keepalive: Message | None = None
    ) -> None:
        self.methods[name] = _Method("server_stream", handler, keepalive)

    def client_stream(self, name: str, handler: ClientStreamHandler) -> None:
        self.methods[name] = _Method("client_stream", handler)


def as_connect_error(exc: BaseException) -> ConnectError:
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, HutchError):
        return ConnectError(connect_code_for(exc), exc.message)
    log.exception("unexpected error in an E2B RPC", exc_info=exc)
    return ConnectError("internal", f"internal error ({type(exc).__name__}); see hutchd.log")


def user_of(headers: Headers) -> str | None:
    """The user an E2B client asks for: ``Authorization: Basic base64("user:")``."""
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "basic" or not token:
        return None
    try:
        decoded = base64.b64decode(token, validate=True).decode()
    except (binascii.Error, ValueError) as exc:
        raise ConnectError("invalid_argument", "Authorization: Basic is not base64") from exc
    user = decoded.partition(":")[0]
    return user or None


def _unary_error(err: ConnectError) -> JSONResponse:
    return JSONResponse(error_json(err), status_code=err.status)


async def serve_rpc(services: dict[str, RpcService], request: Request, sandbox_id: str) -> Response:
    """Answer ``POST /<service>/<method>`` for ``sandbox_id``."""
    service_name, _, method_name = request.url.path.strip("/").partition("/")
    service = services.get(service_name)
    method = service.methods.get(method_name) if service else None
    streaming = request.headers.get("content-type", "").startswith(STREAM_CONTENT_TYPE)
    if method is None:
        err = ConnectError("unimplemented", f"unknown method /{service_name}/{method_name}")
        return _stream_error(err) if streaming else _unary_error(err)
    try:
        call = Call(sandbox_id, request.headers, user_of(request.headers))
        deadline = deadline_of(request.headers)
    except ConnectError as bad:
        return _stream_error(bad) if streaming else _unary_error(bad)
    if method.kind == "unary":
        return await _serve_unary(method, call, request)
    if not streaming:
        return _unary_error(
            ConnectError(
                "invalid_argument", f"a streaming method needs Content-Type {STREAM_CONTENT_TYPE}"
            )
        )
    if method.kind == "client_stream":
        return await _serve_client_stream(method, call, request)
    return await _serve_server_stream(method, call, request, deadline)


async def _serve_unary(method: _Method, call: Call, request: Request) -> Response:
    content_type = request.headers.get("content-type", "").split(";")[0].strip()
    if content_type != UNARY_CONTENT_TYPE:
        return _unary_error(
            ConnectError(
                "unimplemented", f"only JSON ({UNARY_CONTENT_TYPE}) is served, not {content_type!r}"
            )
        )
    try:
        body = await _read_body(request)
        answer = await method.handler(call, parse_message(body))
    except Exception as exc:
        return _unary_error(as_connect_error(exc))
    return JSONResponse(answer)


async def _read_body(request: Request) -> bytes:
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_MESSAGE_BYTES:
            raise ConnectError("resource_exhausted", f"request over {MAX_MESSAGE_BYTES} bytes")
    return bytes(data)


def _stream_error(err: ConnectError) -> Response:
    return Response(end_of_stream(err), media_type=STREAM_CONTENT_TYPE)


async def _request_messages(request: Request) -> AsyncIterator[Message]:
    reader = EnvelopeReader()
    async for chunk in request.stream():
        for message in reader.feed(chunk):
            yield message
    reader.finish()


async def _serve_client_stream(method: _Method, call: Call, request: Request) -> Response:
    try:
        answer = await method.handler(call, _request_messages(request))
    except Exception as exc:
        return _stream_error(as_connect_error(exc))
    return Response(encode_envelope(answer) + end_of_stream(), media_type=STREAM_CONTENT_TYPE)


def _keepalive(method: _Method, headers: Headers) -> Keepalive | None:
    raw = headers.get(KEEPALIVE_HEADER)
    if method.keepalive is None or raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        return None
    return Keepalive(max(1.0, seconds), method.keepalive) if seconds > 0 else None


async def _serve_server_stream(
    method: _Method, call: Call, request: Request, deadline: float | None
) -> Response:
    reader = EnvelopeReader()
    try:
        messages = reader.feed(await _read_body(request))
        reader.finish()
        if len(messages) != 1:
            raise ConnectError(
                "invalid_argument", f"a server stream takes one message, not {len(messages)}"
            )
    except ConnectError as err:
        return _stream_error(err)
    source = method.handler(call, messages[0])
    keepalive = _keepalive(method, request.headers)

    async def body() -> AsyncIterator[bytes]:
        try:
            async for message in paced(source, keepalive, deadline):
                yield encode_envelope(message)
        except Exception as exc:
            yield end_of_stream(as_connect_error(exc))
            return
        yield end_of_stream()

    return TrackedStream(
        body(),
        on_close=lambda: None,
        what=f"{request.url.path} stream of {call.sandbox_id}",
        media_type=STREAM_CONTENT_TYPE,
    )
