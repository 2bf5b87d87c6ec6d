"""Request body limits, enforced while the body streams in (not after buffering it)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hutch.api.errors import error_body
from hutch.contract.limits import JSON_BODY_MAX_BYTES

# JSON bodies (exec stdin included) are parsed in memory, so they are capped. File uploads
# stream to the guest and are not.
MAX_JSON_BODY = JSON_BODY_MAX_BYTES


class BodyLimit:
    def __init__(self, app: ASGIApp, limit: int = MAX_JSON_BODY) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _is_upload(scope):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await _reject(send, self.limit)
                return
        seen = 0
        started = False
        rejected = False

        async def limited_receive() -> Message:
            nonlocal seen, rejected
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    # Answer 413 now and tell the app the client went away, so nothing
                    # downstream turns this into a parse error or buffers the rest.
                    if not started and not rejected:
                        rejected = True
                        await _reject(send, self.limit)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if rejected:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, limited_receive, guarded_send)


def _is_upload(scope: Scope) -> bool:
    path = str(scope.get("path", ""))
    # File and archive uploads stream to the guest; the archive route bounds its own size.
    if scope.get("method") == "PUT" and path.endswith(("/files", "/files/archive")):
        return True
    # Image archives stream to disk, capped by HUTCH_MAX_IMAGE_BYTES (routes/images.py).
    return bool(scope.get("method") == "POST" and path == "/v1/images" and not _is_json(scope))


def _is_json(scope: Scope) -> bool:
    for name, value in scope.get("headers", []):
        if name == b"content-type":
            return bool(value.split(b";")[0].strip().lower() == b"application/json")
    return False


async def _reject(send: Send, limit: int) -> None:
    import json

    body = json.dumps(
        error_body("payload_too_large", f"request body is larger than {limit} bytes")
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
