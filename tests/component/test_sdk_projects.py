"""The SDK's ``client.projects`` / ``client.keys`` / ``project=`` and the CLI's
``hutch project`` / ``hutch key`` against the real app (component tier)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from click.testing import CliRunner

from hutch.cli._env import CliEnv
from hutch.cli.main import cli
from hutch.errors import Conflict, Forbidden, InvalidArgument, NotFound, QuotaExceeded, Unauthorized
from hutch.sdk import AsyncClient
from hutch.sdk._config import resolve_config
from tests.component.conftest import API_KEY


async def test_sdk_projects_keys_and_the_project_header(api: httpx.AsyncClient) -> None:
    url = str(api.base_url)
    async with AsyncClient(base_url=url, api_key=API_KEY) as admin:
        made = await admin.projects.create("team", {"max_sandboxes": 1})
        assert made.quotas["max_sandboxes"] == 1 and made.usage["sandboxes"] == 0
        with pytest.raises(Conflict):
            await admin.projects.create("team")
        created = await admin.keys.create("dev", "developer", project="team", ttl_s=3600)
        assert created.secret.startswith(f"hk_{created.id}_") and created.secret not in repr(
            created
        )
        assert [k.id for k in await admin.keys.list(project="team")] == [created.id]
        assert (await admin.projects.set_quotas("team", max_vcpus=2)).quotas["max_vcpus"] == 2
    async with AsyncClient(base_url=url, api_key=created.secret) as dev:
        sb = await dev.create_sandbox()
        with pytest.raises(QuotaExceeded, match="max_sandboxes"):
            await dev.create_sandbox()
        with pytest.raises(Forbidden, match=r"key\.manage"):
            await dev.keys.list()
        assert [p.name for p in await dev.projects.list()] == ["team"]
    async with AsyncClient(base_url=url, api_key=API_KEY, project="team") as admin_in_team:
        assert admin_in_team.project == "team"
        assert [s.id for s in await admin_in_team.list_sandboxes()] == [sb.id]
        await admin_in_team.delete_sandbox(sb.id)
    async with AsyncClient(base_url=url, api_key=API_KEY) as admin:
        assert await admin.list_sandboxes() == []
        with pytest.raises(NotFound):
            await admin.get_sandbox(sb.id)
        revoked = await admin.keys.revoke(created.id, project="team")
        assert revoked.revoked_at is not None
    async with AsyncClient(base_url=url, api_key=created.secret) as dev:
        with pytest.raises(Unauthorized, match="revoked"):
            await dev.list_sandboxes()
    # HUTCH_PROJECT is the default of project=; a bad name is refused before sending.
    env = {"HUTCH_URL": url, "HUTCH_API_KEY": API_KEY, "HUTCH_PROJECT": "team"}
    assert resolve_config(env=env).project == "team"
    assert resolve_config(env=env, project="other").project == "other"
    with pytest.raises(InvalidArgument, match="HUTCH_PROJECT"):
        resolve_config(env={**env, "HUTCH_PROJECT": "Bad Name"})


async def test_cli_project_and_key_commands(api: httpx.AsyncClient) -> None:
    url = str(api.base_url)

    def hutch(*args: str, key: str = API_KEY) -> tuple[int, str, str]:
        runner = CliRunner()
        result = runner.invoke(cli, ["--url", url, "--api-key", key, *args], obj=CliEnv())
        return result.exit_code, result.stdout, result.stderr

    async def run(*args: str, key: str = API_KEY) -> tuple[int, str, str]:
        return await asyncio.to_thread(hutch, *args, key=key)

    assert await run("project", "create", "team", "--max-sandboxes", "2") == (0, "team\n", "")
    code, out, _ = await run("project", "ls")
    assert code == 0 and [line.split()[0] for line in out.splitlines()[1:]] == ["default", "team"]
    code, out, _ = await run("project", "quota", "team", "--max-vcpus", "4", "--json")
    assert code == 0 and json.loads(out)["quotas"] == {
        "max_sandboxes": 2,
        "max_vcpus": 4,
        "max_memory_mib": None,
        "max_snapshot_bytes": None,
    }
    code, out, _ = await run("project", "quota", "team", "--max-sandboxes", "none", "--json")
    assert json.loads(out)["quotas"]["max_sandboxes"] is None
    code, secret, _ = await run("key", "create", "ci", "--role", "viewer", "--project", "team")
    secret = secret.strip()
    assert code == 0 and secret.startswith("hk_")
    code, out, _ = await run("project", "inspect", "team", key=secret)
    assert code == 0 and "max_vcpus:" in out and "0 used of 4" in out, out
    code, out, err = await run("create", key=secret)
    assert code == 1 and "viewer" in err and "sandbox.create" in err, err
    code, out, _ = await run("key", "ls", "--project", "team", "--json")
    keys = json.loads(out)
    assert [k["name"] for k in keys] == ["ci"] and "secret" not in keys[0]
    # A project key's keys commands default to its own project.
    code, owner, _ = await run("key", "create", "boss", "--role", "owner", "--project", "team")
    code, out, err = await run("key", "ls", "--json", key=owner.strip())
    assert code == 0, err
    assert sorted(k["name"] for k in json.loads(out)) == ["boss", "ci"]
    code, _, _ = await run("key", "revoke", json.loads(out)[-1]["id"], key=owner.strip())
    assert code == 0
    assert (await run("key", "revoke", keys[0]["id"], "--project", "team"))[0] == 0
    code, _, err = await run("project", "ls", key=secret)
    assert code == 1 and "revoked" in err
    assert await run("project", "rm", "team") == (0, "team\n", "")
    code, _, err = await run("project", "rm", "default")
    assert code == 1 and "cannot be deleted" in err
