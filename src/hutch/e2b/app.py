"""The E2B face of hutchd: one ASGI app on its own listen address
(``HUTCH_E2B_LISTEN``) that is both ``E2B_API_URL`` and ``E2B_SANDBOX_URL``.

```
request ─► E2bApp ─┬─ E2b-Sandbox-Id header, or a signed /files URL ─► data plane
                   │     sandbox resolved (gone → 502 "was not found") ─► token checked
                   │     (X-Access-Token / E2B-Traffic-Access-Token, or the URL's
                   │     signature) ─► by E2b-Sandbox-Port:
                   │       49983 envd: /process.Process/*, /filesystem.Filesystem/*
                   │               (Connect), /files, /health
                   │       49999 code interpreter: /execute, /contexts[/{id}[/restart]]
                   └─ otherwise ─► control plane: X-API-KEY checked ─► control.py routes,
                         else unsupported.py (E2B's error shape, what hutch offers)
   every route ─► wiring.Hutch: the daemon's own services (nothing of their logic here)
```
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from hutch.api.auth import Authenticator
from hutch.api.cluster_router import Forwarder
from hutch.e2b import control, envd_files, unsupported
from hutch.e2b.cluster import E2bRouter
from hutch.e2b.envd_filesystem import FilesystemRpc
from hutch.e2b.envd_process import ProcessRpc
from hutch.e2b.errors import E2bError, e2b_error_for, error_response, sandbox_gone
from hutch.e2b.face import Face
from hutch.e2b.interpreter import Interpreter
from hutch.e2b.keys import TokenIssuer, signature_matches
from hutch.e2b.rpc import RpcService, serve_rpc
from hutch.e2b.views import e2b_state
from hutch.e2b.wiring import Hutch
from hutch.errors import HutchError, NotFound, Unauthorized
from hutch.services.cluster import ClusterService
from hutch.services.composed import Services

__all__ = ["E2bApp", "create_e2b_app"]

log = logging.getLogger(__name__)

ENVD_PORT = 49983
INTERPRETER_PORT = 49999
SANDBOX_HEADER = "e2b-sandbox-id"
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


def _handlers(app: FastAPI) -> None:
    async def on_e2b(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, E2bError)
        return error_response(exc)

    async def on_hutch(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HutchError)
        return error_response(e2b_error_for(exc))

    async def on_validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(E2bError(400, f"invalid request: {exc.errors()}"))

    async def on_http(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(E2bError(exc.status_code, str(exc.detail)))

    async def on_unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unexpected error in the E2B face", exc_info=exc)
        return error_response(
            E2bError(500, f"internal error ({type(exc).__name__}); see hutchd.log")
        )

    app.add_exception_handler(E2bError, on_e2b)
    app.add_exception_handler(HutchError, on_hutch)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)


class DataPlane:
    """Routes a sandbox-bound request to envd's services or the code interpreter."""

    def __init__(self, face: Face) -> None:
        self.face = face
        self.processes = ProcessRpc(face.hutch)
        self.filesystem = FilesystemRpc(face.hutch)
        self.interpreter = Interpreter(face.hutch)
        self.rpc: dict[str, RpcService] = {
            s.name: s for s in (self.processes.service(), self.filesystem.service())
        }

    async def close(self) -> None:
        await self.processes.close()
        await self.filesystem.close()

    def _sandbox(self, sandbox_id: str) -> None:
        try:
            rec = self.face.hutch.sandboxes.get(sandbox_id)
        except NotFound:
            raise sandbox_gone(sandbox_id) from None
        if e2b_state(rec) is None:
            raise sandbox_gone(sandbox_id)

    def signed_sandbox(self, request: Request, sandbox_id: str | None) -> str:
        """The sandbox a signed /files URL was made for (its signature checked)."""
        q = request.query_params
        signature, path = q.get("signature", ""), q.get("path", "")
        expiration: int | None = None
        if q.get("signature_expiration"):
            raw = q["signature_expiration"]
            if not raw.isdigit():
                raise E2bError(400, "signature_expiration must be a UNIX time")
            expiration = int(raw)
            if expiration < self.face.hutch.clock():
                raise E2bError(401, "this signed URL has expired")
        operation = "read" if request.method == "GET" else "write"
        candidates = (
            [sandbox_id]
            if sandbox_id
            else [
                r.id for r in self.face.hutch.sandboxes.list_sandboxes(project=None) if e2b_state(r)
            ]
        )
        for candidate in candidates:
            token = self.face.tokens.envd_token(candidate)
            if signature_matches(signature, path, operation, q.get("username"), token, expiration):
                return candidate
        raise E2bError(401, "the URL's signature is not valid for any sandbox")

    async def __call__(self, request: Request) -> Response:
        sandbox_id = request.headers.get(SANDBOX_HEADER)
        path = request.url.path
        if request.query_params.get("signature") and path == "/files":
            sandbox_id = self.signed_sandbox(request, sandbox_id)
            self._sandbox(sandbox_id)
        else:
            if not sandbox_id:
                raise E2bError(400, "no E2b-Sandbox-Id header")
            self._sandbox(sandbox_id)
            token = request.headers.get("x-access-token") or request.headers.get(
                "e2b-traffic-access-token"
            )
            if not self.face.tokens.accepts(sandbox_id, token):
                raise Unauthorized(
                    f"missing or wrong access token for sandbox {sandbox_id}: send the "
                    "envdAccessToken the control plane returned as X-Access-Token"
                )
        port = request.headers.get("e2b-sandbox-port", str(ENVD_PORT))
        if port == str(ENVD_PORT):
            return await self._envd(request, sandbox_id, path)
        if port == str(INTERPRETER_PORT):
            return await self._interpreter(request, sandbox_id, path)
        raise E2bError(
            502,
            f"port {port} of sandbox {sandbox_id} is not open through hutch's E2B API (it "
            f"serves envd, {ENVD_PORT}, and the code interpreter, {INTERPRETER_PORT}); "
            "reach other ports with `hutch port expose`",
        )

    async def _envd(self, request: Request, sandbox_id: str, path: str) -> Response:
        if path == "/health":
            return await envd_files.health()
        if path == "/files":
            if request.method == "GET":
                file_path = request.query_params.get("path")
                if not file_path:
                    raise E2bError(400, "path is required")
                return await envd_files.download(self.face.hutch, sandbox_id, file_path)
            if request.method == "POST":
                return await envd_files.upload(self.face.hutch, sandbox_id, request)
        elif request.method == "POST" and path.strip("/").split("/")[0] in self.rpc:
            return await serve_rpc(self.rpc, request, sandbox_id)
        raise E2bError(404, f"{request.method} {path} is not a route of envd")

    async def _interpreter(self, request: Request, sandbox_id: str, path: str) -> Response:
        interp, method = self.interpreter, request.method
        parts = path.strip("/").split("/")
        if path == "/health":
            return Response(status_code=200)
        if path == "/execute" and method == "POST":
            return await interp.execute(sandbox_id, request)
        if parts[0] == "contexts":
            if len(parts) == 1 and method == "POST":
                return await interp.create_context(sandbox_id, request)
            if len(parts) == 1 and method == "GET":
                return await interp.list_contexts(sandbox_id)
            if len(parts) == 2 and method == "DELETE":
                return await interp.remove_context(sandbox_id, parts[1])
            if len(parts) == 3 and parts[2] == "restart" and method == "POST":
                return await interp.restart_context(sandbox_id, parts[1])
        raise E2bError(404, f"{method} {path} is not a route of the code interpreter")


class E2bApp:
    """Sends each request to the data plane or the control plane (one ASGI app).
    ``close()`` ends what the face holds open (attached terminals, watchers)."""

    def __init__(self, control_app: FastAPI, data_app: FastAPI, data_plane: DataPlane) -> None:
        self.control_app = control_app
        self.data_app = data_app
        self.data_plane = data_plane
        #: In a cluster: requests for other hosts' sandboxes go there first.
        self.router: E2bRouter | None = None

    async def close(self) -> None:
        await self.data_plane.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.router is not None and scope["type"] == "http":
            await self.router(scope, receive, send)
            return
        await self.dispatch(scope, receive, send)

    async def dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        """This host's face: the data plane or the control plane."""
        if scope["type"] == "lifespan":
            await self.control_app(scope, receive, send)
            return
        target = self.control_app
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            query = scope.get("query_string", b"")
            if SANDBOX_HEADER.encode() in headers or (
                scope.get("path") == "/files" and b"signature=" in query
            ):
                target = self.data_app
        await target(scope, receive, send)


def create_e2b_app(
    services: Services, api_key: str, token_secret: bytes, forwarder: Forwarder | None = None
) -> E2bApp:
    """The face over the daemon's services (started and closed by the REST app).
    ``forwarder``: the REST app's host-to-host client; with it (and the daemon's
    cluster service) requests for other hosts' sandboxes are forwarded there."""
    cluster: ClusterService | None = getattr(services, "cluster", None)
    f = Face(
        hutch=Hutch.of(services),
        tokens=TokenIssuer(token_secret),
        auth=Authenticator(api_key, services.projects),
        signer=cluster.signer if cluster is not None else None,
    )
    data_plane = DataPlane(f)
    control_app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    control_app.state.e2b = f
    control_app.include_router(control.router)
    control_app.include_router(unsupported.router)
    _handlers(control_app)

    data_app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    data_app.state.e2b = f

    async def endpoint(request: Request) -> Response:
        return await data_plane(request)

    data_app.add_api_route("/{path:path}", endpoint, methods=_METHODS, include_in_schema=False)
    _handlers(data_app)
    e2b = E2bApp(control_app, data_app, data_plane)
    if cluster is not None and forwarder is not None:
        e2b.router = E2bRouter(e2b.dispatch, f, cluster, forwarder, data_plane.signed_sandbox)
    return e2b
