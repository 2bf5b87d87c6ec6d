"""The agent tools (hutch.agent_tools.tools) and the MCP server, against the SDK's FakeHutch.

The server tests use the MCP SDK's in-process client (``mcp.Client(server)``): the real
protocol (initialize, tools/list, tools/call) without a subprocess.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import mcp
import mcp_types
import pytest
import uvicorn
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

from hutch.agent_tools._output import OutputCapture
from hutch.agent_tools._validate import SUPPORTED_KEYWORDS, check_arguments
from hutch.agent_tools.specs import TOOLS, TOOLS_BY_NAME
from hutch.agent_tools.tools import HutchTools, ToolError
from hutch.errors import InvalidArgument
from hutch.mcp.server import build_server, http_app
from hutch.sdk import AsyncClient
from hutch.testing import FakeHutch, FakeRun, FakeSandbox

REPO = Path(__file__).resolve().parents[2]


def mcp_http_client(headers: dict[str, str]) -> httpx2.AsyncClient:
    """What an MCP client sends its HTTP requests with (the MCP SDK's HTTP library);
    a create boots a VM, so reads may take minutes."""
    return httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=300.0))


@pytest.fixture
def fake() -> FakeHutch:
    return FakeHutch()


@pytest.fixture
async def tools(fake: FakeHutch) -> AsyncIterator[HutchTools]:
    async with AsyncClient(
        base_url="http://hutch.test", api_key=fake.api_key, transport=fake.transport
    ) as client:
        yield HutchTools(client)


def last_body(fake: FakeHutch) -> Any:
    request = fake.requests[-1]
    return json.loads(request.content) if request.content else None


# -- specs and validation ------------------------------------------------------------------


def _keywords(schema: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(schema, dict):
        found |= set(schema)
        for key in ("items", "additionalProperties"):
            if isinstance(schema.get(key), dict):
                found |= _keywords(schema[key])
        for sub in schema.get("properties", {}).values():
            found |= _keywords(sub)
    return found


def test_every_spec_is_a_closed_object_schema_the_validator_understands() -> None:
    assert len(TOOLS) == len(TOOLS_BY_NAME) == 15
    for spec in TOOLS:
        schema = spec.parameters
        assert schema["type"] == "object" and schema["additionalProperties"] is False
        assert set(spec.required) <= set(schema["properties"]), spec.name
        assert _keywords(schema) <= SUPPORTED_KEYWORDS, spec.name
        for name, prop in schema["properties"].items():
            assert prop.get("description"), f"{spec.name}.{name} has no description"
            if "default" in prop:  # defaults must pass their own schema
                alone = {"type": "object", "properties": {name: prop}}
                assert check_arguments(alone, {name: prop["default"]}) == {name: prop["default"]}


def test_validation_messages_name_the_argument_and_what_is_accepted() -> None:
    schema = TOOLS_BY_NAME["run_command"].parameters
    cases: dict[str, dict[str, Any]] = {
        "missing required argument 'command'": {"sandbox_id": "sb-0123456789ab"},
        "timeout_s=0 is out of range; accepted: 1-3600": {"timeout_s": 0},
        "timeout_s must be an integer, got 'soon'": {"timeout_s": "soon"},
        "unknown argument 'cmd'; accepted: sandbox_id, command,": {"cmd": "ls"},
        "env.A must be a string, got 1": {"env": {"A": 1}},
        "sandbox_id='42' is not valid": {"sandbox_id": "42"},
        "command is empty": {"command": ""},
    }
    for expected, change in cases.items():
        args: dict[str, Any] = {"sandbox_id": "sb-0123456789ab", "command": "ls", **change}
        if expected.startswith("missing"):
            args = change
        with pytest.raises(InvalidArgument) as info:
            check_arguments(schema, args)
        assert expected in str(info.value), (expected, str(info.value))
    pause = TOOLS_BY_NAME["pause_sandbox"].parameters
    with pytest.raises(InvalidArgument, match=r"mode='hot' is not accepted; use one of: 'memory'"):
        check_arguments(pause, {"sandbox_id": "sb-0123456789ab", "mode": "hot"})


def test_validation_fills_defaults_drops_nulls_and_accepts_integral_floats() -> None:
    schema = TOOLS_BY_NAME["run_command"].parameters
    args = check_arguments(
        schema, {"sandbox_id": "sb-0123456789ab", "command": "ls", "cwd": None, "timeout_s": 5.0}
    )
    assert args["timeout_s"] == 5 and isinstance(args["timeout_s"], int)
    assert "cwd" not in args and args["max_output_chars"] == 20_000
    with pytest.raises(InvalidArgument, match="must be an integer"):
        check_arguments(
            schema, {"sandbox_id": "sb-0123456789ab", "command": "x", "timeout_s": True}
        )


def test_output_capture_keeps_head_and_tail_with_an_exact_marker() -> None:
    small = OutputCapture(10)
    small.add("hello")
    small.add("12345")
    assert small.text() == "hello12345" and not small.truncated
    cap = OutputCapture(10)
    for _ in range(100):
        cap.add("abcdefghij")  # 1000 chars
    text = cap.text()
    assert cap.truncated
    assert text == "abcde\n[output truncated: 10 of 1000 bytes shown]\nfghij"
    multi = OutputCapture(4)
    multi.add("ééééé")  # 5 chars, 10 bytes
    assert "[output truncated: 8 of 10 bytes shown]" in multi.text()


# -- tools against the fake daemon -----------------------------------------------------------


async def test_create_list_and_delete(tools: HutchTools, fake: FakeHutch) -> None:
    created = await tools.call(
        "create_sandbox", {"memory_mib": 256, "metadata": {"task": "t1"}, "name": "box"}
    )
    sandbox_id = created.data["id"]
    assert created.data["state"] == "running" and created.data["memory_mib"] == 256
    assert f"Created sandbox {sandbox_id} (box): running" in created.text
    assert last_body(fake)["memory_mib"] == 256
    listed = await tools.call("list_sandboxes", {"metadata": {"task": "t1"}})
    assert [s["id"] for s in listed.data["sandboxes"]] == [sandbox_id]
    assert (await tools.call("list_sandboxes", {"metadata": {"task": "nope"}})).text == (
        "No sandboxes."
    )
    deleted = await tools.call("delete_sandbox", {"sandbox_id": sandbox_id})
    assert deleted.data == {"sandbox_id": sandbox_id, "deleted": True}
    again = await tools.call("delete_sandbox", {"sandbox_id": "sb-0000000000ff"})
    assert "already deleted" in again.text


async def test_create_with_env_secrets_and_list_secrets_never_show_a_value(
    tools: HutchTools, fake: FakeHutch
) -> None:
    value = "tok-mcp-4c1d9e"
    fake.secrets.values["openai"], fake.secrets.versions["openai"] = value, 3
    listed = await tools.call("list_secrets", {})
    assert listed.text == "1 secret(s): openai (version 3)."
    assert [s["name"] for s in listed.data["secrets"]] == ["openai"]
    created = await tools.call("create_sandbox", {"env_secrets": {"OPENAI_API_KEY": "openai"}})
    assert last_body(fake)["env_secrets"] == {"OPENAI_API_KEY": "openai"}
    assert created.data["env_secrets"] == {"OPENAI_API_KEY": "openai"}
    for result in (listed, created):
        assert value not in json.dumps(result.data) + result.text
    with pytest.raises(ToolError, match="does not exist in project 'default'"):
        await tools.call("create_sandbox", {"env_secrets": {"X": "missing"}})
    with pytest.raises(ToolError, match="env_secrets"):
        await tools.call("create_sandbox", {"env_secrets": {"X": "bad name"}})
    # No tool reads a value: the only secret tool is a read-only listing of names.
    assert [t.name for t in TOOLS if "secret" in t.name] == ["list_secrets"]


async def test_run_command_returns_exit_code_and_streams(
    tools: HutchTools, fake: FakeHutch
) -> None:
    sb = fake.add_sandbox()
    fake.exec_handler = lambda _sb, body: FakeRun(
        [("stdout", "out\n"), ("stderr", "warn\n")], exit_code=3
    )
    result = await tools.call(
        "run_command",
        {"sandbox_id": sb.id, "command": "make", "cwd": "/tmp", "env": {"A": "1"}},
    )
    assert result.data["exit_code"] == 3 and result.data["timed_out"] is False
    assert result.data["stdout"] == "out\n" and result.data["stderr"] == "warn\n"
    assert result.text.startswith("Exit code 3.\nstdout:\nout\n")
    body = last_body(fake)
    assert body["cmd"] == "make" and body["cwd"] == "/tmp" and body["env"] == {"A": "1"}
    assert body["timeout_s"] == 60 and body["stream"] is True


async def test_run_command_truncates_with_marker(tools: HutchTools, fake: FakeHutch) -> None:
    sb = fake.add_sandbox()
    fake.exec_handler = lambda _sb, body: FakeRun([("stdout", "x" * 999 + "END")])
    result = await tools.call(
        "run_command", {"sandbox_id": sb.id, "command": "yes", "max_output_chars": 100}
    )
    assert result.data["stdout_truncated"] is True
    assert "[output truncated: 100 of 1002 bytes shown]" in result.data["stdout"]
    assert result.data["stdout"].endswith("END")


async def test_run_command_timeout_keeps_partial_output(tools: HutchTools, fake: FakeHutch) -> None:
    sb = fake.add_sandbox()
    fake.exec_handler = lambda _sb, body: FakeRun(
        [("stdout", "started\n")], error=("timeout", "the command ran longer than 2 s")
    )
    result = await tools.call(
        "run_command", {"sandbox_id": sb.id, "command": "sleep 100", "timeout_s": 2}
    )
    assert result.data["timed_out"] is True and result.data["exit_code"] is None
    assert result.data["stdout"] == "started\n"
    assert result.text.startswith("Timed out: the command was still running after 2 s")


async def test_errors_are_tool_errors_a_model_can_act_on(
    tools: HutchTools, fake: FakeHutch
) -> None:
    with pytest.raises(ToolError) as info:
        await tools.call("run_command", {"sandbox_id": "sb-00000000dead", "command": "ls"})
    assert info.value.code == "not_found"
    assert "call list_sandboxes" in str(info.value) and str(info.value).startswith("run_command:")
    sb = fake.add_sandbox()
    await tools.call("pause_sandbox", {"sandbox_id": sb.id})
    with pytest.raises(ToolError, match="resume_sandbox wakes a paused one"):
        await tools.call("run_command", {"sandbox_id": sb.id, "command": "ls"})
    with pytest.raises(ToolError, match="no such tool; available: create_sandbox"):
        await tools.call("rm_rf", {})
    with pytest.raises(ToolError, match="vcpus=99 is out of range; accepted: 1-8"):
        await tools.call("create_sandbox", {"vcpus": 99})
    # What the daemon refuses comes back with its message.
    with pytest.raises(ToolError, match="unknown image 'nope'; available: base, devbox") as info:
        await tools.call("create_sandbox", {"image": "nope"})
    assert info.value.code == "unknown_image"


async def test_files_roundtrip_text_and_binary(tools: HutchTools, fake: FakeHutch) -> None:
    sb = fake.add_sandbox()
    written = await tools.call(
        "write_file",
        {"sandbox_id": sb.id, "path": "/root/a.py", "content": "print('hé')\n", "mode": "0755"},
    )
    assert written.data == {"path": "/root/a.py", "size": 13}
    read = await tools.call("read_file", {"sandbox_id": sb.id, "path": "/root/a.py"})
    assert read.data["content"] == "print('hé')\n" and read.data["truncated"] is False
    assert read.text == "print('hé')\n"
    blob = bytes(range(256))
    await tools.call(
        "write_file",
        {
            "sandbox_id": sb.id,
            "path": "/root/b.bin",
            "content": base64.b64encode(blob).decode(),
            "encoding": "base64",
        },
    )
    with pytest.raises(ToolError, match=r"not UTF-8 text .*encoding=base64"):
        await tools.call("read_file", {"sandbox_id": sb.id, "path": "/root/b.bin"})
    raw = await tools.call(
        "read_file", {"sandbox_id": sb.id, "path": "/root/b.bin", "encoding": "base64"}
    )
    assert base64.b64decode(raw.data["content"]) == blob
    listing = await tools.call("list_files", {"sandbox_id": sb.id, "path": "/root"})
    names = {e["name"]: e for e in listing.data["entries"]}
    assert names["a.py"]["mode"] == "0755" and names["b.bin"]["size"] == 256
    assert "0755" in listing.text and "a.py" in listing.text
    with pytest.raises(ToolError, match="content is not valid base64"):
        await tools.call(
            "write_file",
            {"sandbox_id": sb.id, "path": "x", "content": "%%%", "encoding": "base64"},
        )


async def test_read_file_truncates_at_max_bytes(tools: HutchTools, fake: FakeHutch) -> None:
    sb: FakeSandbox = fake.add_sandbox()
    await tools.call("write_file", {"sandbox_id": sb.id, "path": "log", "content": "é" * 100})
    read = await tools.call("read_file", {"sandbox_id": sb.id, "path": "log", "max_bytes": 11})
    # 11 bytes cut a 2-byte character: 5 whole characters (10 bytes) are shown.
    assert read.data["content"] == "é" * 5 and read.data["truncated"] is True
    assert read.text.endswith("\n[output truncated: 10 of 200 bytes shown]")


async def test_pause_resume_fork(tools: HutchTools, fake: FakeHutch) -> None:
    sb = fake.add_sandbox()
    paused = await tools.call("pause_sandbox", {"sandbox_id": sb.id, "mode": "disk"})
    assert paused.data["state"] == "paused" and paused.data["pause_mode"] == "disk"
    resumed = await tools.call("resume_sandbox", {"sandbox_id": sb.id})
    assert resumed.data["state"] == "running"
    forked = await tools.call("fork_sandbox", {"sandbox_id": sb.id, "count": 2})
    children = forked.data["sandboxes"]
    assert len(children) == 2 and all(c["parent_id"] == sb.id for c in children)
    assert forked.text.startswith(f"Forked {sb.id} into 2: ")


async def test_egress_tools_go_through_the_sdk_accessor(tools: HutchTools, fake: FakeHutch) -> None:
    sb = fake.add_sandbox()
    result = await tools.call(
        "set_egress", {"sandbox_id": sb.id, "rules": ["pypi.org:443", "*.debian.org"]}
    )
    assert result.data["rules"] == ["pypi.org:443", "*.debian.org"]
    assert result.data["mode"] == "rules"
    assert result.text.startswith(f"Egress of {sb.id} is now rules: pypi.org:443, *.debian.org")
    got = await tools.call("get_egress", {"sandbox_id": sb.id})
    assert got.data["rules"] == ["pypi.org:443", "*.debian.org"]
    assert (await tools.call("set_egress", {"sandbox_id": sb.id, "rules": []})).data["mode"] == (
        "open"
    )
    with pytest.raises(ToolError, match='"deny-all" must be the only egress rule') as info:
        await tools.call("set_egress", {"sandbox_id": sb.id, "rules": ["deny-all", "x.org"]})
    assert info.value.code == "invalid_argument"


async def test_set_egress_takes_an_ordered_policy(tools: HutchTools, fake: FakeHutch) -> None:
    sb = fake.add_sandbox()
    policy = {
        "default": "deny",
        "rules": [
            {"action": "deny", "host": "evil.example.com"},
            {"action": "allow", "host": "*.example.com:443"},
        ],
    }
    result = await tools.call("set_egress", {"sandbox_id": sb.id, "policy": policy})
    assert result.data["policy"]["rules"] == policy["rules"]
    assert "rules[0] deny evil.example.com" in result.text
    with pytest.raises(ToolError, match=r"rules\[1\]\.action"):
        bad = {"rules": [policy["rules"][0], {"action": "permit", "host": "x.org"}]}
        await tools.call("set_egress", {"sandbox_id": sb.id, "policy": bad})
    with pytest.raises(ToolError, match="give one of rules"):
        await tools.call("set_egress", {"sandbox_id": sb.id})


# -- the MCP server, in process ----------------------------------------------------------------


async def test_mcp_server_lists_tools_and_runs_them(tools: HutchTools, fake: FakeHutch) -> None:
    server = build_server(tools)
    async with mcp.Client(server) as client:
        listed = await client.list_tools()
        by_name = {t.name: t for t in listed.tools}
        assert set(by_name) == set(TOOLS_BY_NAME)
        run = by_name["run_command"]
        assert run.input_schema == TOOLS_BY_NAME["run_command"].parameters
        assert run.annotations is not None and run.annotations.read_only_hint is False
        assert by_name["delete_sandbox"].annotations.destructive_hint is True  # type: ignore[union-attr]

        created = await client.call_tool("create_sandbox", {})
        assert not created.is_error
        sandbox_id = created.structured_content["id"]
        ran = await client.call_tool("run_command", {"sandbox_id": sandbox_id, "command": "echo"})
        assert not ran.is_error and ran.structured_content["exit_code"] == 0
        assert isinstance(ran.content[0], mcp_types.TextContent)
        assert ran.content[0].text.startswith("Exit code 0.")

        bad = await client.call_tool("run_command", {"sandbox_id": sandbox_id, "timeout_s": -1})
        assert bad.is_error
        text = bad.content[0].text  # type: ignore[union-attr]
        assert text.startswith("run_command: missing required argument 'command'")
        assert "Traceback" not in text
        assert bad.structured_content["error"]["code"] == "invalid_argument"


async def test_mcp_server_reports_an_unreachable_daemon_readably() -> None:
    async with AsyncClient(base_url="http://127.0.0.1:9", api_key="k") as client:
        server = build_server(HutchTools(client))
        async with mcp.Client(server) as session:
            result = await session.call_tool("list_sandboxes", {})
    assert result.is_error
    text = result.content[0].text  # type: ignore[union-attr]
    assert text.startswith("list_sandboxes: ") and "daemon is not running" in text


# -- the transports ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def _serving_http(tools: HutchTools, token: str) -> AsyncIterator[str]:
    """The real streamable HTTP app on uvicorn on a loopback port; yields its URL."""
    port = _free_port()
    app = http_app(tools.client, "127.0.0.1", token)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(200):
            if server.started:
                break
            await asyncio.sleep(0.02)
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def test_http_transport_needs_the_api_key_and_serves_tools(
    tools: HutchTools, fake: FakeHutch
) -> None:
    async with _serving_http(tools, fake.api_key) as url:
        async with httpx.AsyncClient() as plain:
            refused = await plain.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
        assert refused.status_code == 401
        assert "Authorization: Bearer" in refused.json()["error"]["message"]
        headers = {"Authorization": f"Bearer {fake.api_key}"}
        async with (
            mcp_http_client(headers) as http,
            streamable_http_client(url, http_client=http) as (read, write),
            mcp.ClientSession(read, write) as session,
        ):
            await session.initialize()
            listed = await session.list_tools()
            assert len(listed.tools) == len(TOOLS)
            created = await session.call_tool("create_sandbox", {"name": "via-http"})
            assert not created.is_error and created.structured_content["name"] == "via-http"


async def test_stdio_transport_in_a_subprocess_without_a_daemon(tmp_path: Path) -> None:
    """``hutch mcp`` over stdio lists its tools with no daemon, and says so when a call
    needs one (nothing listens on port 9 of loopback)."""
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
        "HUTCH_URL": "http://127.0.0.1:9",
        "HUTCH_API_KEY": "k",
    }
    params = mcp.StdioServerParameters(
        command=sys.executable, args=["-m", "hutch", "mcp"], env=env, cwd=tmp_path
    )
    with (tmp_path / "stderr.log").open("w") as errlog:
        async with (
            stdio_client(params, errlog=errlog) as (read, write),
            mcp.ClientSession(read, write) as session,
        ):
            init = await session.initialize()
            assert init.server_info.name == "hutch"
            listed = await session.list_tools()
            assert [t.name for t in listed.tools] == [s.name for s in TOOLS]
            result = await session.call_tool("list_sandboxes", {})
    assert result.is_error
    assert "daemon is not running" in result.content[0].text  # type: ignore[union-attr]
    assert "Traceback" not in (tmp_path / "stderr.log").read_text()
