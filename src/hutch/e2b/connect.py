"""The Connect protocol (connectrpc.com/docs/protocol), server side, JSON codec only:
what the E2B SDKs speak to envd (``useBinaryFormat: false`` in JS, a JSON codec in
Python). Pure framing and encoding here; the services are in ``envd_process`` and
``envd_filesystem``.

- Unary: ``POST /<package.Service>/<Method>``, ``Content-Type: application/json``, the
  message as the body; the answer is the message (200) or an error with the HTTP status
  of its code and the body ``{"code": "<code>", "message": "..."}``.
- Streaming (server or client): ``Content-Type: application/connect+json``; the body is
  a sequence of envelopes ``[flags:1][length:4 big-endian][payload]``; the answer is 200
  and envelopes, the last with flag ``0x02`` (end of stream) carrying ``{}`` or
  ``{"error": {...}}``: a stream always ends with that envelope, whatever ends it.
- ``Connect-Timeout-Ms``: the caller's deadline; a stream still open at it ends with
  ``deadline_exceeded``. Compression is refused (the SDKs never compress).

Protobuf's JSON mapping as used here: camelCase field names, ``bytes`` as base64,
64-bit integers as strings, enums by name, ``google.protobuf.Timestamp`` as RFC 3339.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import datetime as dt
import json
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CODE_STATUS",
    "STREAM_CONTENT_TYPE",
    "UNARY_CONTENT_TYPE",
    "ConnectError",
    "EnvelopeReader",
    "Keepalive",
    "b64decode",
    "b64encode",
    "deadline_of",
    "encode_envelope",
    "end_of_stream",
    "error_json",
    "paced",
    "timestamp",
]

UNARY_CONTENT_TYPE = "application/json"
STREAM_CONTENT_TYPE = "application/connect+json"
FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02
_HEADER = struct.Struct(">BI")
#: Largest message accepted in a request (SendInput carries stdin chunks).
MAX_MESSAGE_BYTES = 16 << 20

#: Connect code → HTTP status of a unary error (the protocol's table).
CODE_STATUS: dict[str, int] = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}


class ConnectError(Exception):
    """An RPC error with a Connect code (one of :data:`CODE_STATUS`)."""

    def __init__(self, code: str, message: str) -> None:
        assert code in CODE_STATUS, code
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def status(self) -> int:
        return CODE_STATUS[self.code]


def error_json(err: ConnectError) -> dict[str, str]:
    return {"code": err.code, "message": err.message}


def encode_envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(flags, len(payload)) + payload


def end_of_stream(error: ConnectError | None = None) -> bytes:
    return encode_envelope({"error": error_json(error)} if error else {}, FLAG_END_STREAM)


class EnvelopeReader:
    """Splits a streamed request body into messages (sans-IO: feed bytes, get dicts)."""

    def __init__(self, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_bytes
        self.ended = False

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        out: list[dict[str, Any]] = []
        while len(self._buf) >= _HEADER.size:
            flags, length = _HEADER.unpack_from(self._buf)
            if length > self._max:
                raise ConnectError(
                    "resource_exhausted", f"message of {length} bytes > {self._max} bytes"
                )
            if len(self._buf) < _HEADER.size + length:
                break
            payload = bytes(self._buf[_HEADER.size : _HEADER.size + length])
            del self._buf[: _HEADER.size + length]
            if flags & FLAG_COMPRESSED:
                raise ConnectError("unimplemented", "compressed messages are not supported")
            if flags & FLAG_END_STREAM:
                self.ended = True
                continue
            out.append(parse_message(payload))
        return out

    def finish(self) -> None:
        if self._buf:
            raise ConnectError("invalid_argument", "the request body ends inside a message")


def parse_message(payload: bytes) -> dict[str, Any]:
    try:
        message = json.loads(payload or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConnectError("invalid_argument", f"the message is not JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise ConnectError("invalid_argument", "the message must be a JSON object")
    return message


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode()


def b64decode(value: Any, field: str) -> bytes:
    """Protobuf JSON ``bytes``: standard or URL-safe base64, padding optional."""
    if not isinstance(value, str):
        raise ConnectError("invalid_argument", f"{field} must be a base64 string")
    text = value.replace("-", "+").replace("_", "/")
    text += "=" * (-len(text) % 4)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ConnectError("invalid_argument", f"{field} is not valid base64") from exc


def timestamp(epoch: float) -> str:
    """``google.protobuf.Timestamp`` in JSON: RFC 3339, UTC, "Z"."""
    moment = dt.datetime.fromtimestamp(epoch, dt.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond:06d}Z"


def deadline_of(headers: Any) -> float | None:
    """Seconds left before the caller's ``Connect-Timeout-Ms``, or None."""
    raw = headers.get("connect-timeout-ms")
    if raw is None:
        return None
    if not raw.isdigit() or len(raw) > 10:
        raise ConnectError("invalid_argument", f"Connect-Timeout-Ms {raw!r} is not a number")
    return int(raw) / 1000


@dataclass(frozen=True)
class Keepalive:
    """Sent by :func:`paced` when the source was quiet for ``interval_s``."""

    interval_s: float
    message: dict[str, Any]


async def paced(
    source: AsyncIterator[dict[str, Any]],
    keepalive: Keepalive | None,
    deadline_s: float | None,
) -> AsyncIterator[dict[str, Any]]:
    """``source``'s messages, plus ``keepalive.message`` whenever it is quiet (envd does
    this for ``Keepalive-Ping-Interval``, so proxies do not cut idle streams), ending
    with ``deadline_exceeded`` once ``deadline_s`` seconds have passed. The source is read
    in a task of its own (a deadline never cancels the code that sends the answer), and
    closed when this generator is."""
    loop = asyncio.get_running_loop()
    until = None if deadline_s is None else loop.time() + deadline_s
    pending: asyncio.Future[dict[str, Any]] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            waits = []
            if keepalive is not None:
                waits.append(keepalive.interval_s)
            if until is not None:
                waits.append(max(0.0, until - loop.time()))
            done, _ = await asyncio.wait({pending}, timeout=min(waits) if waits else None)
            if not done:
                if until is not None and loop.time() >= until:
                    raise ConnectError(
                        "deadline_exceeded", f"the stream's deadline ({deadline_s:g} s) passed"
                    )
                if keepalive is not None:
                    yield keepalive.message
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.wait({pending})
            if not pending.cancelled():
                pending.exception()  # retrieved: the stream is over either way
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
