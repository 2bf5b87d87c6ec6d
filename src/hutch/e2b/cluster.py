"""The E2B face in a cluster: a request for a sandbox another host runs goes there.

The E2B face of every hutchd serves every sandbox of the cluster, as its REST API does,
through the REST API's one forwarding path (:func:`hutch.api.cluster_router.relay_http`):

```
 E2B client ─► any hutchd's E2B listener (w1) ─► E2bRouter
   control plane, /sandboxes/{id}[/...] and /v2/sandboxes/{id}/connect:
     X-API-KEY checked here (else this host's face answers the 401, as on one host)
     owner = the row's host (connect/resume: where a resume runs, placement when the
     row's host is draining or down, with the sandbox's stored labels)
   data plane (E2b-Sandbox-Id, or a signed /files URL):
     the sandbox's access token (or the URL's signature) checked here, else answered here
   owner is another live host ─► relay_http to <owner>/v1/hosts/<owner>/e2b<path>
     control plane: X-API-KEY dropped, the principal signed (cluster secret), as the
       REST API's forwards; data plane: the token travels, the owner checks it again
   owner's API port: ClusterRouter hands /v1/hosts/<me>/e2b/... to its E2B app, with
     the E2B path (the signature checked against the path it was signed for)
 POST /sandboxes (a create), X-API-KEY checked here:
     placement (spread, the template's snapshot's hosts for snap-...) picks the host;
     another host ─► relay_http to <host>/v1/hosts/<host>/e2b/sandboxes, signed
     (one host alone, a bad key, body or template: this host's face answers)
 everything else (lists, snapshots): here, from the shared database
```
The access tokens are HMACs under ``<state>/e2b-token-secret``, which every host of a
cluster holds the same copy of (as the admin key and the cluster secret), so a token
handed out by one host is good on all of them and after a move.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from hutch.api.cluster_router import (
    FORWARDED_PATH,
    MAX_CREATE_BODY,
    Forwarder,
    body_once,
    read_body,
    relay_http,
    replay_body,
    stream_body,
)
from hutch.contract.auth import Principal
from hutch.contract.limits import DEFAULT_MEMORY_MIB
from hutch.contract.placement import Placement
from hutch.e2b.errors import E2bError, e2b_error_for, error_response
from hutch.e2b.face import Face, presented_key
from hutch.e2b.keys import verify_api_key
from hutch.e2b.templates import template_snapshot
from hutch.errors import HutchError
from hutch.services.cluster import ClusterService, HostRow

__all__ = ["E2bRouter"]

log = logging.getLogger("hutch.e2b.cluster")

SANDBOX_HEADER = "e2b-sandbox-id"
#: Control-plane routes that name a sandbox; group 2 is the action, if any.
_CONTROL = re.compile(r"^(?:/v2)?/sandboxes/([^/]+)(?:/([a-z]+))?$")
#: Those that resume a paused sandbox (placed like a REST resume).
_RESUMING = {"connect", "resume"}
_CREATES = {"/sandboxes", "/v2/sandboxes"}


async def _answer(exc: HutchError, scope: Scope, receive: Receive, send: Send) -> None:
    await error_response(e2b_error_for(exc))(scope, receive, send)


class E2bRouter:
    """Forwards an E2B request to the host that runs its sandbox (see the module
    docstring); everything else goes to ``app``, this host's face."""

    def __init__(
        self,
        app: ASGIApp,
        face: Face,
        cluster: ClusterService,
        forwarder: Forwarder,
        signed_sandbox: Callable[[Request, str | None], str],
    ) -> None:
        self.app = app
        self.face = face
        self.cluster = cluster
        self.forwarder = forwarder
        #: The sandbox a signed /files URL was made for (raises when it fits none).
        self.signed_sandbox = signed_sandbox

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or FORWARDED_PATH in scope:
            await self.app(scope, receive, send)  # forwarded here: this host's to serve
            return
        if scope["method"] == "POST" and scope["path"] in _CREATES:
            await self._create(scope, receive, send)
            return
        try:
            routed = self._route(scope)
        except HutchError as exc:
            await _answer(exc, scope, receive, send)
            return
        if routed is None:
            await self.app(scope, receive, send)
            return
        target, who = routed
        await relay_http(
            self.forwarder,
            self.cluster,
            target,
            who,
            scope,
            stream_body(receive),
            send,
            path=f"/v1/hosts/{target.id}/e2b{scope['path']}",
            error=_answer,
        )

    async def _create(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A create lands where placement puts it (spread over the hosts that are up,
        as a REST create without a placement); this host's face answers what it would
        refuse (the key, the body, the template) and every create of a lone host."""
        body, complete = await read_body(receive, MAX_CREATE_BODY)
        replay = replay_body(body, receive)
        who = self._caller(Request(scope))
        template_id: object = None
        if complete:
            try:
                doc = json.loads(body or b"{}")
            except ValueError:
                doc = None
            template_id = doc.get("templateID") if isinstance(doc, dict) else None
        if who is None or not isinstance(template_id, str) or not template_id:
            await self.app(scope, replay, send)
            return
        try:
            if self.cluster.alone():
                await self.app(scope, replay, send)
                return
            host = await self.cluster.place_create(
                Placement(), DEFAULT_MEMORY_MIB, template_snapshot(template_id)
            )
        except HutchError as exc:
            await _answer(exc, scope, replay, send)
            return
        if host.id == self.cluster.host_id:
            await self.app(scope, replay, send)
            return
        log.info("E2B create placed on host %s", host.id)
        await relay_http(
            self.forwarder,
            self.cluster,
            host,
            who,
            scope,
            body_once(body),
            send,
            path=f"/v1/hosts/{host.id}/e2b{scope['path']}",
            error=_answer,
        )

    def _caller(self, request: Request) -> Principal | None:
        """The caller by its E2B API key, checked here; None when it fails (this
        host's face answers the 401, as on one host)."""
        client = request.client
        try:
            return verify_api_key(
                presented_key(request.headers), self.face.auth, client.host if client else ""
            )
        except HutchError:
            return None

    def _route(self, scope: Scope) -> tuple[HostRow, Principal | None] | None:
        """The other host and the signed caller (None on the data plane) of a request
        to forward; None: answered here (this host's sandbox, unknown, its host down,
        or a credential that fails: this host's face says why, as on one host)."""
        request = Request(scope)
        headers = request.headers
        path: str = scope["path"]
        signed = path == "/files" and "signature" in request.query_params
        if SANDBOX_HEADER in headers or signed:
            sandbox_id = headers.get(SANDBOX_HEADER)
            if signed:
                try:
                    sandbox_id = self.signed_sandbox(request, sandbox_id)
                except (E2bError, HutchError):
                    return None
            else:
                token = headers.get("x-access-token") or headers.get("e2b-traffic-access-token")
                if sandbox_id and not self.face.tokens.accepts(sandbox_id, token):
                    sandbox_id = None
            if not sandbox_id:
                return None
            target = self.cluster.owner(sandbox_id)
            return None if target is None else (target, None)
        found = _CONTROL.match(path)
        if found is None:
            return None
        sandbox_id, action = found.group(1), found.group(2)
        who = self._caller(request)
        if who is None:
            return None
        if request.method == "POST" and action in _RESUMING:
            target = self.cluster.resume_host(sandbox_id)
        else:
            target = self.cluster.owner(sandbox_id)
        return None if target is None else (target, who)
