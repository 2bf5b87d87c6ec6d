"""``hutch mcp``: hutch's sandboxes as MCP tools, over stdio or streamable HTTP.

Built on the low-level ``mcp.server.lowlevel.Server`` rather than ``MCPServer``
(ex-FastMCP): our tool schemas are written by hand once (:mod:`hutch.agent_tools.specs`) and
shared with the LangChain/OpenAI wrappers, so nothing here should derive a schema from
Python signatures. The server holds no logic: each call goes to
:class:`hutch.agent_tools.tools.HutchTools`, which talks to the daemon through the async SDK.

Results carry structured content (the JSON data) and a text block (a summary for the
model). A failed call is a tool result with ``isError`` and a message that says what to
change, never a JSON-RPC error with a traceback.

The HTTP transport listens on loopback by default and requires
``Authorization: Bearer <hutch API key>`` — the key the server itself uses for the
daemon — because whoever reaches it can run code in sandboxes.
"""

from __future__ import annotations

import hmac
import logging
import socket
from collections.abc import Callable
from typing import Any

import mcp_types as types
import uvicorn
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from hutch.agent_tools.specs import TOOLS, TOOLS_BY_NAME, ToolSpec
from hutch.agent_tools.tools import HutchTools, ToolError
from hutch.errors import InvalidArgument
from hutch.sdk import AsyncClient
from hutch.version import __version__

__all__ = ["DEFAULT_HTTP_PORT", "build_server", "http_app", "mcp_tool", "serve_http", "serve_stdio"]

log = logging.getLogger(__name__)

DEFAULT_HTTP_PORT = 7071
MCP_PATH = "/mcp"

INSTRUCTIONS = (
    "hutch runs code in isolated Linux sandboxes (one micro-VM each). Typical flow: "
    "create_sandbox, then run_command / write_file / read_file with its id, and "
    "delete_sandbox when done. pause_sandbox and resume_sandbox keep a sandbox without "
    "using CPU; fork_sandbox copies a live one; set_egress limits where it may connect."
)


def mcp_tool(spec: ToolSpec) -> types.Tool:
    """The MCP description of one tool."""
    return types.Tool(
        name=spec.name,
        title=spec.title,
        description=spec.description,
        input_schema=spec.parameters,
        annotations=types.ToolAnnotations(
            title=spec.title,
            read_only_hint=spec.read_only,
            destructive_hint=spec.destructive,
            idempotent_hint=spec.idempotent,
            # Sandboxes reach the network only as their egress rules allow; the tools
            # themselves act on this hutch daemon only.
            open_world_hint=False,
        ),
    )


def build_server(tools: HutchTools) -> Server[Any]:
    """An MCP server exposing :data:`hutch.agent_tools.specs.TOOLS`, run by ``tools``."""
    listed = types.ListToolsResult(tools=[mcp_tool(spec) for spec in TOOLS])

    async def list_tools(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return listed

    async def call_tool(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        try:
            result = await tools.call(params.name, params.arguments)
        except ToolError as exc:
            return types.CallToolResult(
                content=[types.TextContent(text=str(exc))],
                structured_content={"error": {"code": exc.code, "message": str(exc)}},
                is_error=True,
            )
        return types.CallToolResult(
            content=[types.TextContent(text=result.text)],
            structured_content=result.data,
        )

    def input_schema(name: str) -> dict[str, Any] | None:
        spec = TOOLS_BY_NAME.get(name)
        return spec.parameters if spec else None

    return Server(
        "hutch",
        version=__version__,
        title="hutch sandboxes",
        instructions=INSTRUCTIONS,
        get_tool_input_schema=input_schema,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


async def serve_stdio(client: AsyncClient) -> None:
    """Serve one MCP session on this process's stdin/stdout until stdin closes."""
    server = build_server(HutchTools(client))
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


class _BearerAuth:
    """ASGI middleware: HTTP requests need ``Authorization: Bearer <token>``."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = JSONResponse(
                    {
                        "error": {
                            "code": "unauthorized",
                            "message": "send 'Authorization: Bearer <hutch API key>' "
                            "(the daemon's key: $HUTCH_STATE_DIR/api-key)",
                        }
                    },
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def http_app(client: AsyncClient, host: str, token: str) -> ASGIApp:
    """The streamable HTTP app (endpoint :data:`MCP_PATH`), behind bearer auth."""
    server = build_server(HutchTools(client))
    # ``host`` turns on the SDK's DNS-rebinding protection for loopback addresses.
    app = server.streamable_http_app(streamable_http_path=MCP_PATH, host=host)
    return _BearerAuth(app, token)


class _AnnouncingServer(uvicorn.Server):
    """Calls ``announce()`` once its socket listens (a port in use is never announced)."""

    def __init__(self, config: uvicorn.Config, announce: Callable[[], None]) -> None:
        super().__init__(config)
        self._announce = announce

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._announce()


async def serve_http(
    client: AsyncClient,
    host: str,
    port: int,
    announce: Callable[[str], None] | None = None,
) -> None:
    """Serve MCP over streamable HTTP at ``http://host:port/mcp`` until cancelled;
    ``announce(url)`` is called once it listens."""
    if not 0 < port < 65536:
        raise InvalidArgument(f"port={port} is out of range; accepted: 1-65535")
    token = client.core.config.require_key()
    config = uvicorn.Config(
        http_app(client, host, token), host=host, port=port, log_level="warning", lifespan="on"
    )
    url = f"http://{host}:{port}{MCP_PATH}"

    def listening() -> None:
        log.info("hutch MCP server on %s", url)
        if announce is not None:
            announce(url)

    await _AnnouncingServer(config, listening).serve()
