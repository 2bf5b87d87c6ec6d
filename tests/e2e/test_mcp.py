"""``hutch mcp`` against a real daemon and real VMs, driven by the MCP SDK's own client.

Over stdio (the server a subprocess, as agents spawn it) and over streamable HTTP (the
server a subprocess listening on loopback): list the tools, create a sandbox, run a
command in it, and see a bad call come back as a readable tool error. Every sandbox a
test creates is deleted in a finalizer through the SDK, and every server process is
stopped.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import mcp
import mcp_types
import pytest
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

from hutch.agent_tools.specs import TOOLS
from hutch.errors import NotFound
from tests.e2e.conftest import Daemon, free_port, tail

# Creating a VM under TCG, first one included, stays well inside this.
CALL_TIMEOUT_S = 300.0


def mcp_http_client(headers: dict[str, str]) -> httpx2.AsyncClient:
    """What an MCP client sends its HTTP requests with (the MCP SDK's HTTP library);
    a create boots a VM, so reads may take minutes."""
    return httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=300.0))


@pytest.fixture
def created(daemon: Daemon) -> Iterator[list[str]]:
    """Sandbox ids a test made through MCP; deleted after the test whatever happened."""
    ids: list[str] = []
    yield ids
    with daemon.client(timeout=120.0) as client:
        for sandbox_id in ids:
            with contextlib.suppress(NotFound):
                client.delete_sandbox(sandbox_id)


def text_of(result: mcp_types.CallToolResult) -> str:
    block = result.content[0]
    assert isinstance(block, mcp_types.TextContent)
    return block.text


async def exercise(session: mcp.ClientSession, created: list[str], label: str) -> None:
    """The flow an agent runs: list tools, create, run, read back, a mistake, delete."""
    await session.initialize()
    listed = await session.list_tools()
    assert [t.name for t in listed.tools] == [s.name for s in TOOLS]

    made = await session.call_tool(
        "create_sandbox", {"metadata": {"test": f"mcp-{label}"}}, CALL_TIMEOUT_S
    )
    assert not made.is_error, text_of(made)
    data: dict[str, Any] = made.structured_content
    sandbox_id = data["id"]
    created.append(sandbox_id)
    assert data["state"] == "running"

    ran = await session.call_tool(
        "run_command",
        {"sandbox_id": sandbox_id, "command": "echo hello-$((6*7)); echo oops >&2; exit 3"},
        CALL_TIMEOUT_S,
    )
    assert not ran.is_error, text_of(ran)
    out = ran.structured_content
    assert out["exit_code"] == 3 and out["timed_out"] is False
    assert out["stdout"] == "hello-42\n" and out["stderr"] == "oops\n"
    assert text_of(ran).startswith("Exit code 3.\nstdout:\nhello-42\n")

    big = await session.call_tool(
        "run_command",
        {"sandbox_id": sandbox_id, "command": "seq 1 20000", "max_output_chars": 200},
        CALL_TIMEOUT_S,
    )
    assert "[output truncated: 200 of 108894 bytes shown]" in big.structured_content["stdout"]
    assert big.structured_content["stdout"].endswith("19999\n20000\n")

    wrote = await session.call_tool(
        "write_file",
        {"sandbox_id": sandbox_id, "path": "notes/a.txt", "content": f"from {label}\n"},
        CALL_TIMEOUT_S,
    )
    assert not wrote.is_error, text_of(wrote)
    read = await session.call_tool(
        "read_file", {"sandbox_id": sandbox_id, "path": "/root/notes/a.txt"}, CALL_TIMEOUT_S
    )
    assert read.structured_content["content"] == f"from {label}\n"

    # Bad input: a model gets one line that names the problem and what is accepted.
    bad = await session.call_tool(
        "run_command", {"sandbox_id": sandbox_id, "command": "ls", "timeout_s": 0}
    )
    assert bad.is_error
    assert text_of(bad) == "run_command: timeout_s=0 is out of range; accepted: 1-3600"
    unknown = await session.call_tool(
        "run_command", {"sandbox_id": "sb-000000000000", "command": "ls"}, CALL_TIMEOUT_S
    )
    assert unknown.is_error and "call list_sandboxes" in text_of(unknown)
    assert "Traceback" not in text_of(unknown)

    gone = await session.call_tool("delete_sandbox", {"sandbox_id": sandbox_id}, CALL_TIMEOUT_S)
    assert not gone.is_error and gone.structured_content["deleted"] is True


async def test_mcp_over_stdio(daemon: Daemon, created: list[str], tmp_path: Path) -> None:
    params = mcp.StdioServerParameters(
        command=sys.executable, args=["-m", "hutch", "mcp"], env=daemon.env, cwd=tmp_path
    )
    errlog_path = tmp_path / "mcp-stderr.log"
    with errlog_path.open("w") as errlog:
        async with (
            stdio_client(params, errlog=errlog) as (read, write),
            mcp.ClientSession(read, write) as session,
        ):
            await exercise(session, created, "stdio")
    assert "Traceback" not in errlog_path.read_text()


@pytest.fixture
def http_server(daemon: Daemon, tmp_path: Path) -> Iterator[str]:
    """``hutch mcp --transport http`` as a subprocess; yields its endpoint URL."""
    port = free_port()
    log_path = tmp_path / "mcp-http.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hutch", "mcp", "--transport", "http", "--port", str(port)],
            env=daemon.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"hutch mcp exited with {proc.returncode}:\n{tail(log_path)}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"hutch mcp did not listen within 30 s:\n{tail(log_path)}")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log_path.read_text(), tail(log_path)


async def test_mcp_over_streamable_http(
    daemon: Daemon, created: list[str], http_server: str
) -> None:
    headers = {"Authorization": f"Bearer {daemon.api_key}"}
    async with (
        mcp_http_client(headers) as http,
        streamable_http_client(http_server, http_client=http) as (read, write),
        mcp.ClientSession(read, write) as session,
    ):
        await exercise(session, created, "http")
