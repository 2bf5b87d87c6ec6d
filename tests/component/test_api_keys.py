"""Projects, quotas, keys and roles through the REST API (real service and store, the
component tier's fake VMs). The real-daemon versions are tests/e2e/test_roles.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from hutch.services.composed import Services


def err(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["code"] == code, body
    message: str = body["message"]
    return message


async def project(api: httpx.AsyncClient, name: str, **quotas: int) -> dict[str, Any]:
    r = await api.post("/v1/projects", json={"name": name, "quotas": quotas})
    assert r.status_code == 201, r.text
    data: dict[str, Any] = r.json()
    return data


async def key(api: httpx.AsyncClient, proj: str, role: str, **kw: object) -> dict[str, Any]:
    r = await api.post(f"/v1/projects/{proj}/keys", json={"name": f"k-{role}", "role": role, **kw})
    assert r.status_code == 201, r.text
    data: dict[str, Any] = r.json()
    return data


def as_key(api: httpx.AsyncClient, secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def test_projects_crud_and_deletion_refused_while_holding(api: httpx.AsyncClient) -> None:
    made = await project(api, "team", max_sandboxes=3)
    assert made["quotas"] == {
        "max_sandboxes": 3,
        "max_vcpus": None,
        "max_memory_mib": None,
        "max_snapshot_bytes": None,
    }
    assert made["usage"] == {"sandboxes": 0, "vcpus": 0, "memory_mib": 0, "snapshot_bytes": 0}
    names = [p["name"] for p in (await api.get("/v1/projects")).json()["projects"]]
    assert names == ["default", "team"]
    err(await api.post("/v1/projects", json={"name": "team"}), 409, "conflict")
    err(await api.post("/v1/projects", json={"name": "Bad Name"}), 400, "invalid_argument")
    r = await api.patch("/v1/projects/team", json={"quotas": {"max_vcpus": 4}})
    assert r.status_code == 200, r.text
    assert r.json()["quotas"]["max_vcpus"] == 4 and r.json()["quotas"]["max_sandboxes"] == 3
    team = {"Hutch-Project": "team"}
    assert (await api.post("/v1/sandboxes", json={}, headers=team)).status_code == 201
    k = await key(api, "team", "viewer")
    assert (await api.get("/v1/projects/team")).json()["usage"]["sandboxes"] == 1
    msg = err(await api.delete("/v1/projects/team"), 409, "conflict")
    assert "1 sandboxes" in msg and "1 keys" in msg, msg
    assert "cannot be deleted" in err(await api.delete("/v1/projects/default"), 409, "conflict")
    err(await api.delete("/v1/projects/nope"), 404, "not_found")
    sid = (await api.get("/v1/sandboxes", headers=team)).json()["sandboxes"][0]["id"]
    assert (await api.delete(f"/v1/sandboxes/{sid}", headers=team)).status_code == 204
    assert (await api.delete(f"/v1/projects/team/keys/{k['id']}")).status_code == 200
    assert (await api.delete("/v1/projects/team")).status_code == 204
    err(await api.get("/v1/projects/team"), 404, "not_found")


async def test_a_key_acts_in_its_project_with_its_role(api: httpx.AsyncClient) -> None:
    await project(api, "team")
    await project(api, "rival")
    dev = await key(api, "team", "developer")
    viewer = await key(api, "team", "viewer")
    owner = await key(api, "team", "owner")
    assert dev["secret"].startswith(f"hk_{dev['id']}_") and len(dev["secret"]) == 3 + 12 + 1 + 43
    listed = (await api.get("/v1/projects/team/keys")).json()["keys"]
    assert {k["id"] for k in listed} == {dev["id"], viewer["id"], owner["id"]}
    assert all("secret" not in k and "secret_sha256" not in k for k in listed)
    sb = await api.post("/v1/sandboxes", json={}, headers=as_key(api, dev["secret"]))
    assert sb.status_code == 201, sb.text
    sid = sb.json()["id"]
    # The admin sees it in project team only.
    assert (await api.get("/v1/sandboxes")).json()["sandboxes"] == []
    r = await api.get(f"/v1/sandboxes/{sid}", headers={"Hutch-Project": "team"})
    assert r.status_code == 200
    # A viewer reads but may not create: 403 names the role and the permission.
    v = as_key(api, viewer["secret"])
    assert (await api.get(f"/v1/sandboxes/{sid}", headers=v)).status_code == 200
    msg = err(await api.post("/v1/sandboxes", json={}, headers=v), 403, "forbidden")
    assert "viewer" in msg and "sandbox.create" in msg, msg
    run = {"cmd": ["echo", "hi"]}
    msg = err(await api.post(f"/v1/sandboxes/{sid}/exec", json=run, headers=v), 403, "forbidden")
    assert msg == "role viewer lacks permission sandbox.use for this request"
    r = await api.post(f"/v1/sandboxes/{sid}/exec", json=run, headers=as_key(api, dev["secret"]))
    assert r.status_code == 200 and "hi" in r.text, r.text
    # Another project's key: the id is not found; naming the other project is 403.
    rival = await key(api, "rival", "owner")
    rv = as_key(api, rival["secret"])
    err(await api.get(f"/v1/sandboxes/{sid}", headers=rv), 404, "not_found")
    err(await api.get("/v1/projects/team/keys", headers=rv), 404, "not_found")
    err(await api.get("/v1/sandboxes", headers={**rv, "Hutch-Project": "team"}), 403, "forbidden")
    # Keys are the owner's (and the admin's): a developer may not list them.
    err(
        await api.get("/v1/projects/team/keys", headers=as_key(api, dev["secret"])),
        403,
        "forbidden",
    )
    o = as_key(api, owner["secret"])
    assert (await api.get("/v1/projects/team/keys", headers=o)).status_code == 200
    err(await api.post("/v1/projects", json={"name": "x"}, headers=o), 403, "forbidden")
    mine = (await api.get("/v1/projects", headers=o)).json()["projects"]
    assert [p["name"] for p in mine] == ["team"]
    # last_used_at is recorded.
    listed = (await api.get("/v1/projects/team/keys")).json()["keys"]
    assert next(k for k in listed if k["id"] == viewer["id"])["last_used_at"] is not None


async def test_revoked_and_expired_keys_are_refused_on_the_next_request(
    api: httpx.AsyncClient, service: Services
) -> None:
    await project(api, "team")
    k = await key(api, "team", "developer")
    h = as_key(api, k["secret"])
    assert (await api.get("/v1/sandboxes", headers=h)).status_code == 200
    assert (await api.delete(f"/v1/projects/team/keys/{k['id']}")).json()["revoked_at"]
    assert "revoked" in err(await api.get("/v1/sandboxes", headers=h), 401, "unauthorized")
    # A forged secret with a real id learns nothing about the key.
    forged = k["secret"][:-4] + ("AAAA" if not k["secret"].endswith("AAAA") else "BBBB")
    assert err(
        await api.get("/v1/sandboxes", headers=as_key(api, forged)), 401, "unauthorized"
    ) == ("wrong API key")
    short = await key(api, "team", "viewer", ttl_s=60)
    hs = as_key(api, short["secret"])
    assert (await api.get("/v1/sandboxes", headers=hs)).status_code == 200
    service.core.clock = lambda: time.time() + 61
    assert "expired" in err(await api.get("/v1/sandboxes", headers=hs), 401, "unauthorized")
    for bad in ({"role": "admin"}, {"role": "owner", "ttl_s": 0}):
        r = await api.post("/v1/projects/team/keys", json={"name": "x", **bad})
        err(r, 400, "invalid_argument")


@pytest.mark.parametrize("quota", ["max_sandboxes", "max_vcpus", "max_memory_mib"])
async def test_concurrent_creates_never_pass_a_quota(api: httpx.AsyncClient, quota: str) -> None:
    limit = {"max_sandboxes": 3, "max_vcpus": 3, "max_memory_mib": 3 * 256}[quota]
    await project(api, "team", **{quota: limit})
    team = {"Hutch-Project": "team"}
    body = {"vcpus": 1, "memory_mib": 256}
    answers = await asyncio.gather(
        *(api.post("/v1/sandboxes", json=body, headers=team) for _ in range(20))
    )
    made = [r for r in answers if r.status_code == 201]
    refused = [r for r in answers if r.status_code != 201]
    assert len(made) == 3, [r.text for r in answers]
    for r in refused:
        msg = err(r, 429, "quota_exceeded")
        assert quota in msg and f"limit {limit}" in msg, msg
    usage = (await api.get("/v1/projects/team")).json()["usage"]
    assert usage["sandboxes"] == 3
    # Other projects are not held by it.
    assert (await api.post("/v1/sandboxes", json=body)).status_code == 201


async def test_resume_and_fork_count_against_the_quotas(api: httpx.AsyncClient) -> None:
    await project(api, "team", max_vcpus=1, max_sandboxes=2)
    team = {"Hutch-Project": "team"}
    body = {"vcpus": 1, "memory_mib": 256}
    first = (await api.post("/v1/sandboxes", json=body, headers=team)).json()["id"]
    r = await api.post(f"/v1/sandboxes/{first}/fork", json={"count": 1}, headers=team)
    assert "max_vcpus" in err(r, 429, "quota_exceeded")
    r = await api.post(f"/v1/sandboxes/{first}/pause", headers=team)
    assert r.status_code == 200, r.text
    # A paused sandbox holds no vCPU but still counts as live.
    second = await api.post("/v1/sandboxes", json=body, headers=team)
    assert second.status_code == 201, second.text
    r = await api.post(f"/v1/sandboxes/{first}/resume", headers=team)
    assert "max_vcpus" in err(r, 429, "quota_exceeded")
    assert "max_sandboxes" in err(
        await api.post("/v1/sandboxes", json=body, headers=team), 429, "quota_exceeded"
    )
    r = await api.get(f"/v1/sandboxes/{first}", headers=team)
    assert r.json()["state"] == "paused"
