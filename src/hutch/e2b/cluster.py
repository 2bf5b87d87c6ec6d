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
 everything else (create, lists, snapshots): here, from the shared database
```
The access tokens are HMACs under ``<state>/e2b-token-secret``, which every host of a
cluster holds the same copy of (as the admin key and the cluster secret), so a token
handed out by one host is good on all of them and after a move.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from hutch.api.cluster_router import FORWARDED_PATH, Forwarder, relay_http, stream_body
from hutch.contract.auth import Principal
from hutch.e2b.errors import E2bError, e2b_error_for, error_response
from hutch.e2b.face import Face, presented_key
from hutch.e2b.keys import verify_api_key
from hutch.errors import HutchError
from hutch.services.cluster import ClusterService, HostRow

__all__ = ["E2bRouter"]

log = logging.getLogger("hutch.e2b.cluster")

SANDBOX_HEADER = "e2b-sandbox-id"
#: Control-plane routes that name a sandbox; group 2 is the action, if any.
_CONTROL = re.compile(r"^(?:/v2)?/sandboxes/([^/]+)(?:/([a-z]+))?$")
#: Those that resume a paused sandbox (placed like a REST resume).
_RESUMING = {"connect", "resume"}


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
        client = request.client
        try:
            who = verify_api_key(
                presented_key(headers), self.face.auth, client.host if client else ""
            )
        except HutchError:
            return None
        if request.method == "POST" and action in _RESUMING:
            target = self.cluster.resume_host(sandbox_id)
        else:
            target = self.cluster.owner(sandbox_id)
        return None if target is None else (target, who)
