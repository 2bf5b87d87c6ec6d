"""``hutch volume ...``, ``hutch create --volume`` and ``hutch grow`` through click's
CliRunner against the real daemon app on loopback (the fake backend records the mounts;
tests/vm/test_volumes_vm.py proves them in guests)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from click.testing import CliRunner, Result

from hutch.agent_tools.tools import HutchTools, ToolError
from hutch.cli.main import cli
from hutch.sdk import AsyncClient
from hutch.services.composed import Services
from tests.component.conftest import API_KEY
from tests.component.fake_backend import FakeBackend

pytestmark = pytest.mark.timeout(120)


async def hutch(api: httpx.AsyncClient, *args: str) -> Result:
    argv = ["--url", str(api.base_url).rstrip("/"), "--api-key", API_KEY, *args]
    # The CLI is blocking and the server runs on this loop: the CLI gets a thread.
    return await asyncio.to_thread(CliRunner().invoke, cli, argv)


async def test_volume_commands_and_create_volume(api: httpx.AsyncClient, service: Services) -> None:
    made = await hutch(api, "volume", "create", "data", "--size", "64M")
    assert made.exit_code == 0, made.output
    vid = made.stdout.strip()
    assert vid.startswith("vol-")
    listed = await hutch(api, "volume", "ls")
    assert "data" in listed.stdout and "64.0MiB" in listed.stdout

    created = await hutch(api, "create", "--volume", "data:/data:ro")
    assert created.exit_code == 0, created.output
    sid = created.stdout.strip()
    backend = service.backend
    assert isinstance(backend, FakeBackend)
    assert backend.mounted[sid] == [(vid, "/data", True)]
    shown = await hutch(api, "volume", "inspect", "data", "--json")
    assert json.loads(shown.stdout)["mounted_by"] == [
        {"sandbox_id": sid, "path": "/data", "read_only": True}
    ]
    refused = await hutch(api, "volume", "rm", "data")
    assert refused.exit_code == 1 and sid in refused.stderr

    grown = await hutch(api, "volume", "grow", "data", "96M")
    assert grown.exit_code == 0 and grown.stdout.strip() == str(96 * 1024**2), grown.output
    disk = await hutch(api, "grow", sid, "--disk", "5")
    assert disk.exit_code == 0 and disk.stdout.strip() == f"{sid} 5", disk.output

    bad = await hutch(api, "create", "--volume", "data")
    assert bad.exit_code == 2 and "NAME:/path" in bad.stderr
    assert (await hutch(api, "rm", sid)).exit_code == 0
    removed = await hutch(api, "volume", "rm", "data")
    assert removed.exit_code == 0 and removed.stdout.strip() == "data"


async def test_mcp_tools_mount_and_list_volumes(api: httpx.AsyncClient, service: Services) -> None:
    await service.volumes.create("data", 64 * 1024**2)
    async with AsyncClient(base_url=str(api.base_url).rstrip("/"), api_key=API_KEY) as client:
        tools = HutchTools(client)
        created = await tools.call("create_sandbox", {"volumes": ["data:/data"]})
        sid = created.data["id"]
        listed = await tools.call("list_volumes", {})
        assert f"{sid} at /data" in listed.text
        assert listed.data["volumes"][0]["mounted_by"][0]["sandbox_id"] == sid
        with pytest.raises(ToolError, match="inside /etc"):
            await tools.call("create_sandbox", {"volumes": ["data:/etc/x"]})
        await tools.call("delete_sandbox", {"sandbox_id": sid})
