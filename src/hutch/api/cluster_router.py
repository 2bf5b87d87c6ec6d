"""Any hutchd serves the whole API: requests for another host's sandbox are forwarded.

An ASGI layer in front of the REST app. For a request that came from a client (not a
forward from another host):

- ``/v1/sandboxes/{id}...`` (HTTP and WebSocket: exec, files, terminals, processes and
  their streams, ports, egress and its log, pause/resume/fork/snapshot/delete): when the
  row names another host that is not down, the request goes there. A resume of a
  paused sandbox whose host is draining or down goes where placement puts it (that
  host fetches the pause from the blob store: :mod:`hutch.services.moves`).
- ``POST /v1/sandboxes``: the create's ``placement`` picks the host
  (:func:`hutch.services.placement.choose_host`); another host's create goes there, and
  that host creates it (each host manages only its own VMs and address pool). A create
  that mounts volumes runs on the host holding their files.
- ``/v1/volumes/{id or name}`` (inspect, grow, delete): to the host holding the file.
- ``POST /v1/hosts/{id}/drain|undrain``: to that host.
- ``/v1/hosts/{this host}/e2b/...``: an E2B request another host forwarded (its
  sandbox runs here) goes to this host's E2B app; the E2B face forwards through
  :func:`relay_http` too (:mod:`hutch.e2b.cluster`), the one forwarding path.

The caller's key is checked here, where it arrived, and not sent on: the forward carries
the principal signed with the cluster secret (:mod:`hutch.services.cluster_auth`), and
the owner host checks permission and project as for any request. A request whose key
fails here is answered here, by the REST app, exactly as on one host. Bodies and
answers are streamed both ways (NDJSON exec streams, file downloads, watch, follow);
WebSockets are relayed message by message. A terminal WebSocket that sends its key in
its first message (browsers cannot set headers) is relayed unsigned, and the owner
checks that message itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import httpx
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from hutch.api.auth import PROJECT_HEADER, Authenticator, bearer_token, requested_project
from hutch.api.errors import response_for
from hutch.api.schemas import CreateSandbox, ResumeRequest
from hutch.contract.auth import Principal
from hutch.contract.placement import parse_placement
from hutch.errors import HutchError, InvalidArgument, Unavailable
from hutch.services.cluster import ClusterService, HostRow
from hutch.services.cluster_auth import FORWARD_HEADERS, ClusterSigner

__all__ = [
    "E2B_FORWARD", "FORWARDED_PATH", "FORWARD_KEEP_ALIVE_S", "MAX_CREATE_BODY",
    "SERVER_KEEP_ALIVE_S", "ClusterRouter", "Forwarder",
    "body_once", "read_body", "relay_http", "replay_body", "stream_body",
]  # fmt: skip

log = logging.getLogger("hutch.api.cluster")

_SANDBOX = re.compile(r"^/v1/sandboxes/(sb-[0-9a-f]{12})(?:/.*)?$")
_RESUME = re.compile(r"^/v1/sandboxes/(sb-[0-9a-f]{12})/resume$")
_HOST_ACTION = re.compile(r"^/v1/hosts/([^/]+)/(?:drain|undrain)$")
#: One volume (inspect, grow, delete): its file is on its host, so they go there.
_VOLUME = re.compile(r"^/v1/volumes/([^/]+)$")
#: A request of the E2B face forwarded to the host that runs its sandbox arrives on that
#: host's API port under this prefix (``/v1/hosts/{host}/e2b`` + the E2B path), and goes
#: to its E2B app (:mod:`hutch.e2b.cluster`). Not in the public schema.
E2B_FORWARD = re.compile(r"^/v1/hosts/([^/]+)/e2b(/.*)$")
#: The scope key under which the E2B app sees the path the forward was signed for.
FORWARDED_PATH = "hutch.forwarded_path"
#: A create body is read whole to place it; larger ones are the REST app's to refuse.
MAX_CREATE_BODY = 1 << 20
#: Not passed on: per hop, or the caller's credential (the forward is signed instead).
_DROP_REQUEST = {
    "host", "authorization", "x-api-key", "connection", "keep-alive",
    "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade", *FORWARD_HEADERS,
}  # fmt: skip
#: A forward that vouches for no caller (its credential is the target's to check, as an
#: E2B sandbox's access token, with ``Authorization: Basic`` naming the guest user).
_DROP_UNSIGNED = _DROP_REQUEST - {"authorization", "x-api-key"}
_DROP_RESPONSE = {
    "connection", "keep-alive", "proxy-authenticate", "te", "trailer", "transfer-encoding",
    "upgrade", "date", "server",  # the last two: this server adds its own
}  # fmt: skip
_WS_DROP = _DROP_REQUEST | {
    "sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
    "sec-websocket-protocol",
}  # fmt: skip


#: How long hutchd keeps an idle client connection open (uvicorn's default is 5 s), and
#: how long the forwarder keeps one in its pool: well under it. Equal, a forward sent on
#: a pooled connection just as the other host closed it met "Server disconnected without
#: sending a response" (a drain failed so in CI); SDK clients (httpx, 5 s) stay under too.
SERVER_KEEP_ALIVE_S = 30
FORWARD_KEEP_ALIVE_S = 10.0


class Forwarder:
    """The HTTP client of host-to-host calls (one connection pool, closed with the app)."""

    def __init__(self) -> None:
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=5.0),
            limits=httpx.Limits(keepalive_expiry=FORWARD_KEEP_ALIVE_S),
            follow_redirects=False,
        )

    async def close(self) -> None:
        await self.client.aclose()


class ClusterRouter:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        services = getattr(scope["app"].state, "services", None)
        cluster: ClusterService | None = getattr(services, "cluster", None)
        headers = Headers(scope=scope)
        path: str = scope["path"]
        if (
            cluster is not None
            and scope["type"] == "http"
            and (found_e2b := E2B_FORWARD.match(path))
            and found_e2b.group(1) == cluster.host_id
        ):
            await _to_e2b(scope, receive, send, found_e2b.group(2))
            return
        if cluster is None or ClusterSigner.is_forward(headers):
            await self.app(scope, receive, send)  # a forward: the REST app checks it
            return
        method = "WS" if scope["type"] == "websocket" else scope["method"]
        if method == "POST" and path == "/v1/sandboxes":
            await self._create(cluster, scope, receive, send, headers)
            return
        if method == "POST" and (found := _RESUME.match(path)):
            await self._resume(cluster, found.group(1), scope, receive, send, headers)
            return
        target: HostRow | None = None
        try:
            if found := _SANDBOX.match(path):
                target = cluster.owner(found.group(1))
            elif method == "POST" and (found := _HOST_ACTION.match(path)):
                target = cluster.live_other(found.group(1))
            elif method in ("GET", "PATCH", "DELETE") and (found := _VOLUME.match(path)):
                caller = _edge_principal(scope, headers)
                if caller is not None:
                    target = cluster.volume_owner(caller.project, unquote(found.group(1)))
        except HutchError as exc:
            await _error(exc, scope, receive, send)
            return
        if target is None:
            await self.app(scope, receive, send)
            return
        who = _edge_principal(scope, headers)
        if who is None and "authorization" in headers:
            await self.app(scope, receive, send)  # the REST app answers the key's error
            return
        if scope["type"] == "websocket":
            await _relay_ws(cluster, target, who, scope, receive, send)
            return
        if who is None:
            await self.app(scope, receive, send)  # no key: the REST app says so
            return
        forwarder: Forwarder = scope["app"].state.forwarder
        await relay_http(forwarder, cluster, target, who, scope, stream_body(receive), send)

    async def _create(
        self, cluster: ClusterService, scope: Scope, receive: Receive, send: Send, headers: Headers
    ) -> None:
        body, complete = await read_body(receive, MAX_CREATE_BODY)
        replay = replay_body(body, receive)
        who = _edge_principal(scope, headers)
        if who is None or not complete:
            await self.app(scope, replay, send)  # the REST app refuses the key or the size
            return
        try:
            create = CreateSandbox.model_validate_json(body or b"{}")
        except ValueError:
            await self.app(scope, replay, send)  # the REST app explains the bad body
            return
        try:
            placement = parse_placement(
                create.placement.model_dump() if create.placement is not None else None
            )
            # A sandbox runs where the volumes it mounts are (their files are there).
            home = cluster.volumes_home(who.project, [m.volume for m in create.volumes])
            if (
                home in (None, cluster.host_id)
                and cluster.alone()
                and placement.host is None
                and not placement.labels
            ):
                # One host: its own admission answers (HUTCH_MAX_SANDBOXES, quotas, ...).
                await self.app(scope, replay, send)
                return
            host = await cluster.place_create(
                placement, create.memory_mib, create.snapshot, volumes_home=home
            )
        except HutchError as exc:
            await _error(exc, scope, replay, send)
            return
        if host.id == cluster.host_id:
            await self.app(scope, replay, send)
            return
        log.info("create placed on host %s (%s)", host.id, placement.strategy)
        forwarder: Forwarder = scope["app"].state.forwarder
        await relay_http(forwarder, cluster, host, who, scope, body_once(body), send)

    async def _resume(
        self,
        cluster: ClusterService,
        sandbox_id: str,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: Headers,
    ) -> None:
        """A resume goes where its ``placement`` puts it; without one, to the sandbox's
        host, or where placement puts it when that host is draining or down."""
        body, complete = await read_body(receive, MAX_CREATE_BODY)
        replay = replay_body(body, receive)
        if not complete:
            too_big = InvalidArgument(
                f"a resume body is at most {MAX_CREATE_BODY} bytes: "
                '{"placement": {"host": ID, "labels": {K: V}}}'
            )
            await _error(too_big, scope, replay, send)
            return
        try:
            asked = ResumeRequest.model_validate_json(body) if body.strip() else ResumeRequest()
        except ValueError:
            await self.app(scope, replay, send)  # the REST app explains the bad body
            return
        who = _edge_principal(scope, headers)
        if who is None:
            await self.app(scope, replay, send)  # the REST app answers the key's error
            return
        try:
            placement = parse_placement(asked.placement.model_dump()) if asked.placement else None
            target = cluster.resume_host(sandbox_id, placement)
        except HutchError as exc:
            await _error(exc, scope, replay, send)
            return
        if target is None:
            await self.app(scope, replay, send)
            return
        forwarder: Forwarder = scope["app"].state.forwarder
        await relay_http(forwarder, cluster, target, who, scope, body_once(body), send)


async def _to_e2b(scope: Scope, receive: Receive, send: Send, path: str) -> None:
    """An E2B request another host forwarded here (its sandbox runs here): to this
    host's E2B app, with the E2B path; the app checks the signature (control plane) or
    the sandbox's access token (data plane) itself."""
    e2b: ASGIApp | None = getattr(scope["app"].state, "e2b", None)
    if e2b is None:
        host = scope["app"].state.services.cluster.host_id
        refused = Unavailable(
            f"host {host} does not serve the E2B API (HUTCH_E2B_LISTEN is off there); "
            "turn it on on every host of the cluster"
        )
        await _error(refused, scope, receive, send)
        return
    inner = {k: v for k, v in scope.items() if k != "app"}
    inner.update({"path": path, "raw_path": path.encode("latin-1"), FORWARDED_PATH: scope["path"]})
    await e2b(inner, receive, send)


def _edge_principal(scope: Scope, headers: Headers) -> Principal | None:
    """The caller of the request, by its key checked here; None when there is no valid
    key in the ``Authorization`` header (the REST app answers why, or the owner checks a
    terminal's first message)."""
    header = headers.get("authorization")
    if header is None:
        return None
    auth: Authenticator = scope["app"].state.auth
    client = scope.get("client")
    try:
        return auth.principal(
            bearer_token(header),
            requested_project(headers.get(PROJECT_HEADER)),
            client[0] if client else "",
        )
    except HutchError:
        return None


async def _error(exc: HutchError, scope: Scope, receive: Receive, send: Send) -> None:
    await response_for(exc)(scope, receive, send)


async def read_body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """The request body up to ``limit`` bytes; complete False when it is longer (what
    was read is replayed, then the rest follows from ``receive``)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), False
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), True
        if size > limit:
            return b"".join(chunks), False


def replay_body(body: bytes, receive: Receive) -> Receive:
    done = False

    async def replay() -> Message:
        nonlocal done
        if not done:
            done = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def body_once(body: bytes) -> AsyncIterator[bytes]:
    yield body


async def stream_body(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return


def _forward_headers(
    scope: Scope,
    drop: set[str],
    cluster: ClusterService,
    who: Principal | None,
    method: str,
    path: str | None = None,
) -> list[tuple[str, str]]:
    kept = [
        (k.decode("latin-1"), v.decode("latin-1"))
        for k, v in scope["headers"]
        if k.decode("latin-1").lower() not in drop
    ]
    if who is not None:
        kept.extend(cluster.signer.sign(who, method, path or scope["path"]).items())
    return kept


def _url(target: HostRow, scope: Scope, ws: bool = False, path: str | None = None) -> str:
    base = target.address
    if ws:
        base = "ws" + base[len("http") :]
    query = scope.get("query_string", b"").decode("latin-1")
    return f"{base}{path or scope['path']}" + (f"?{query}" if query else "")


Answer = Callable[[HutchError, Scope, Receive, Send], Awaitable[None]]


async def relay_http(
    forwarder: Forwarder,
    cluster: ClusterService,
    target: HostRow,
    who: Principal | None,
    scope: Scope,
    body: AsyncIterator[bytes],
    send: Send,
    *,
    path: str | None = None,
    error: Answer | None = None,
) -> None:
    """Forward the HTTP request of ``scope`` (its body from ``body``) to ``target`` and
    stream the answer back: the one forwarding path of the cluster (the REST API's and
    the E2B face's). ``who``: the caller authenticated here, signed into the forward
    (None: the request carries a credential the target checks itself, such as an E2B
    sandbox's access token). ``path``: the path on ``target`` (default the request's);
    ``error``: how a refusal is answered (default the REST API's error shape)."""
    answer = error or _error
    method = scope["method"]
    request = forwarder.client.build_request(
        method,
        _url(target, scope, path=path),
        headers=_forward_headers(
            scope, _DROP_REQUEST if who is not None else _DROP_UNSIGNED, cluster, who, method, path
        ),
        content=body,
    )
    try:
        response = await forwarder.client.send(request, stream=True)
    except httpx.HTTPError as exc:
        unavailable = Unavailable(
            f"host {target.id} ({target.address}), which runs this sandbox, did not answer: "
            f"{exc!r}; retry in a moment (if it stays away its lease expires and it is "
            "marked down)"
        )
        await answer(unavailable, scope, _no_body, send)
        return
    try:
        await send(
            {
                "type": "http.response.start",
                "status": response.status_code,
                "headers": [
                    (k, v)
                    for k, v in response.headers.raw
                    if k.lower().decode("latin-1") not in _DROP_RESPONSE
                ],
            }
        )
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except httpx.HTTPError as exc:
        # The answer had started: all that can be said now is that it stopped.
        log.warning("forward to host %s cut short: %r", target.id, exc)
        with contextlib.suppress(Exception):
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        await response.aclose()


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _relay_ws(
    cluster: ClusterService,
    target: HostRow,
    who: Principal | None,
    scope: Scope,
    receive: Receive,
    send: Send,
) -> None:
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    try:
        upstream = await connect(
            _url(target, scope, ws=True),
            additional_headers=_forward_headers(scope, _WS_DROP, cluster, who, "WS"),
            subprotocols=scope.get("subprotocols") or None,
            max_size=None,
            open_timeout=10,
            compression=None,
        )
    except (OSError, TimeoutError, InvalidStatus, WebSocketException) as exc:
        log.warning("websocket forward to host %s failed: %r", target.id, exc)
        await send({"type": "websocket.close", "code": 1011, "reason": "sandbox host unreachable"})
        return
    await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
    async with upstream:
        up = asyncio.create_task(_client_to_upstream(receive, upstream))
        down = asyncio.create_task(_upstream_to_client(upstream, send))
        try:
            await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (up, down):
                task.cancel()
            await asyncio.gather(up, down, return_exceptions=True)


async def _client_to_upstream(receive: Receive, upstream: ClientConnection) -> None:
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            await upstream.close(code=message.get("code", 1000) or 1000)
            return
        if message["type"] != "websocket.receive":
            continue
        data: Any = message.get("text")
        if data is None:
            data = message.get("bytes") or b""
        try:
            await upstream.send(data)
        except ConnectionClosed:
            return


async def _upstream_to_client(upstream: ClientConnection, send: Send) -> None:
    try:
        async for data in upstream:
            if isinstance(data, str):
                await send({"type": "websocket.send", "text": data})
            else:
                await send({"type": "websocket.send", "bytes": data})
    except ConnectionClosed:
        pass
    # 1005 (no code) and 1006 (no close frame) are never sent on the wire.
    code = {None: 1000, 1005: 1000, 1006: 1011}.get(upstream.close_code, upstream.close_code)
    reason = upstream.close_reason or ""
    with contextlib.suppress(Exception):
        await send({"type": "websocket.close", "code": code, "reason": reason})
