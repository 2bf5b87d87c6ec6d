"""``hutch mcp``: run the MCP server (stdio for a local agent, or streamable HTTP)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys

import click

from hutch.cli._env import get_env

__all__ = ["mcp"]

DEFAULT_PORT = 7071


@click.command("mcp")
@click.option(
    "--transport",
    type=click.Choice(["stdio", "http"]),
    default="stdio",
    show_default=True,
    help="stdio: one session on stdin/stdout (what MCP clients spawn); http: streamable "
    "HTTP at http://HOST:PORT/mcp.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="HTTP listen address.")
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=DEFAULT_PORT,
    show_default=True,
    help="HTTP listen port.",
)
def mcp(transport: str, host: str, port: int) -> None:
    """Serve hutch's sandboxes as MCP tools to an AI agent.

    The server talks to the daemon at --url / HUTCH_URL with the API key from --api-key,
    HUTCH_API_KEY or $HUTCH_STATE_DIR/api-key, in the project of --project /
    HUTCH_PROJECT (a project key: its own). Over HTTP, clients must send
    'Authorization: Bearer <that key>'.
    """
    # Imported here: the MCP SDK is only needed by this command.
    from hutch.mcp.server import serve_http, serve_stdio
    from hutch.sdk import AsyncClient

    env = get_env()
    # stdout is the MCP channel under stdio: logs go to stderr only.
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="hutch mcp: %(message)s")

    async def run() -> None:
        async with AsyncClient(
            base_url=env.url, api_key=env.api_key, project=env.project
        ) as client:
            if transport == "stdio":
                await serve_stdio(client)
            else:
                await serve_http(
                    client,
                    host,
                    port,
                    announce=lambda url: click.echo(f"hutch MCP server on {url}", err=True),
                )

    # Ctrl-C is how an HTTP server is stopped: not an error.
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
