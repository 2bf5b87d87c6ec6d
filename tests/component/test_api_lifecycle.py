"""Pause, resume and fork through the REST API: states, errors, auto_resume.

The memory semantics (processes continue, clones differ) are proven with real VMs in
tests/vm/test_pause_fork.py; here the agent is a bubblewrap process held with SIGSTOP.
"""

from __future__ import annotations

import time

import httpx
import pytest

from hutch.errors import SnapshotError
from hutch.services.composed import Services

pytestmark = pytest.mark.timeout(120)


async def create(api: httpx.AsyncClient, **body: object) -> str:
    r = await api.post("/v1/sandboxes", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def test_pause_resume_memory_keeps_the_process(api: httpx.AsyncClient) -> None:
    sid = await create(api)
    await api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/f"}, content=b"kept")
    r = await api.post(f"/v1/sandboxes/{sid}/pause", json={"mode": "memory"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["state"] == "paused" and body["pause_mode"] == "memory" and body["paused_at"]

    r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["true"]})
    assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state"
    assert "resume it" in r.json()["error"]["message"]
    r = await api.post(f"/v1/sandboxes/{sid}/pause", json={})
    assert r.status_code == 409

    r = await api.post(f"/v1/sandboxes/{sid}/resume")
    assert r.status_code == 200 and r.json()["state"] == "running"
    assert r.json()["pause_mode"] is None
    r = await api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/root/f"})
    assert r.content == b"kept"
    r = await api.post(f"/v1/sandboxes/{sid}/resume")  # running already: a no-op
    assert r.status_code == 200 and r.json()["state"] == "running"


async def test_pause_disk_mode_and_delete_while_paused(api: httpx.AsyncClient) -> None:
    sid = await create(api)
    r = await api.post(f"/v1/sandboxes/{sid}/pause", json={"mode": "disk"})
    assert r.json()["pause_mode"] == "disk"
    assert (await api.delete(f"/v1/sandboxes/{sid}")).status_code == 204
    assert (await api.get(f"/v1/sandboxes/{sid}")).json()["state"] == "destroyed"


async def test_bad_pause_and_fork_input(api: httpx.AsyncClient) -> None:
    sid = await create(api)
    r = await api.post(f"/v1/sandboxes/{sid}/pause", json={"mode": "hibernate"})
    assert r.status_code == 400 and "mode" in r.json()["error"]["message"]
    for count in (0, 101, "3", 2.5):
        r = await api.post(f"/v1/sandboxes/{sid}/fork", json={"count": count})
        assert r.status_code == 400, (count, r.text)
        assert "count" in r.json()["error"]["message"]
    r = await api.post("/v1/sandboxes/sb-000000000000/fork", json={"count": 1})
    assert r.status_code == 404


async def test_auto_resume(api: httpx.AsyncClient) -> None:
    sid = await create(api, auto_resume=True)
    await api.post(f"/v1/sandboxes/{sid}/pause")
    r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["echo", "back"]})
    assert r.status_code == 200 and r.json()["stdout"] == "back\n"
    assert (await api.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"


async def test_fork_makes_children_and_leaves_the_parent(api: httpx.AsyncClient) -> None:
    sid = await create(api, metadata={"team": "a"})
    r = await api.post(f"/v1/sandboxes/{sid}/fork", json={"count": 3})
    assert r.status_code == 201, r.text
    children = r.json()["sandboxes"]
    assert len(children) == 3 and len({c["id"] for c in children}) == 3
    for child in children:
        assert child["parent_id"] == sid and child["state"] == "running"
        assert child["metadata"] == {"team": "a"}
        r = await api.post(f"/v1/sandboxes/{child['id']}/exec", json={"cmd": ["true"]})
        assert r.status_code == 200
    assert (await api.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"

    await api.post(f"/v1/sandboxes/{sid}/pause")
    r = await api.post(f"/v1/sandboxes/{sid}/fork", json={"count": 1})
    assert r.status_code == 201
    assert (await api.get(f"/v1/sandboxes/{sid}")).json()["state"] == "paused"


async def test_a_fork_names_each_child_that_failed_and_keeps_the_others(
    api: httpx.AsyncClient, service: Services
) -> None:
    sid = await create(api)
    service.backend.fail_clones = [  # type: ignore[attr-defined]
        SnapshotError("clone one broke"),
        SnapshotError("clone two broke"),
    ]
    r = await api.post(f"/v1/sandboxes/{sid}/fork", json={"count": 4})
    assert r.status_code >= 400, r.text
    message = r.json()["error"]["message"]
    assert "2 of 4 clones failed" in message, message
    failed = (await api.get("/v1/sandboxes", params={"state": "failed"})).json()["sandboxes"]
    assert sorted(f["error"] for f in failed) == ["clone one broke", "clone two broke"]
    for f in failed:
        assert f["id"] in message and f["parent_id"] == sid
    running = (await api.get("/v1/sandboxes", params={"state": "running"})).json()["sandboxes"]
    children = [c for c in running if c.get("parent_id") == sid]
    assert len(children) == 2
    for child in children:
        r = await api.post(f"/v1/sandboxes/{child['id']}/exec", json={"cmd": ["true"]})
        assert r.status_code == 200
    assert (await api.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"


async def test_fork_respects_capacity(api: httpx.AsyncClient) -> None:
    sid = await create(api)
    r = await api.post(f"/v1/sandboxes/{sid}/fork", json={"count": 100})
    assert r.status_code == 429 and r.json()["error"]["code"] == "capacity"
    assert (await api.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"


async def test_named_snapshots(api: httpx.AsyncClient) -> None:
    sid = await create(api, memory_mib=256)
    r = await api.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "base-ready"})
    assert r.status_code == 201, r.text
    snap = r.json()
    assert snap["id"].startswith("snap-") and snap["sandbox_id"] == sid
    assert snap["size_bytes"] > 0 and snap["memory_mib"] == 256
    assert (await api.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"

    listed = (await api.get("/v1/snapshots")).json()["snapshots"]
    assert [s["id"] for s in listed] == [snap["id"]]
    assert (await api.get(f"/v1/snapshots/{snap['id']}")).json()["name"] == "base-ready"

    r = await api.post("/v1/sandboxes", json={"snapshot": snap["id"]})
    assert r.status_code == 201, r.text
    child = r.json()
    assert child["snapshot_id"] == snap["id"] and child["memory_mib"] == 256

    # Deleted while a sandbox started from it runs: gone for the API at once; the
    # sandbox runs on (its disk layers stay until nothing is built on them).
    assert (await api.delete(f"/v1/snapshots/{snap['id']}")).status_code == 204
    assert (await api.get(f"/v1/snapshots/{snap['id']}")).status_code == 404
    assert (await api.get("/v1/snapshots")).json()["snapshots"] == []
    r = await api.post("/v1/sandboxes", json={"snapshot": snap["id"]})
    assert r.status_code == 404, r.text
    r = await api.post(f"/v1/sandboxes/{child['id']}/exec", json={"cmd": ["echo", "on"]})
    assert r.status_code == 200 and r.json()["stdout"] == "on\n", r.text
    assert (await api.delete(f"/v1/snapshots/{snap['id']}")).status_code == 404
    assert (await api.delete(f"/v1/sandboxes/{child['id']}")).status_code == 204
    assert (await api.delete(f"/v1/sandboxes/{sid}")).status_code == 204


async def test_bad_snapshot_input(api: httpx.AsyncClient) -> None:
    sid = await create(api)
    r = await api.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "Has Spaces"})
    assert r.status_code == 400 and "name" in r.json()["error"]["message"]
    r = await api.post("/v1/sandboxes", json={"snapshot": "snap-000000000000"})
    assert r.status_code == 404
    r = await api.post("/v1/sandboxes", json={"snapshot": "../etc"})
    assert r.status_code == 404
    r = await api.delete("/v1/snapshots/nope")
    assert r.status_code == 404


@pytest.mark.parametrize(
    "body",
    [{"auto_pause_s": 59}, {"auto_pause_s": 86401}, {"auto_delete_s": 1}, {"auto_pause_s": "60"}],
)
async def test_policy_ranges(api: httpx.AsyncClient, body: dict[str, object]) -> None:
    r = await api.post("/v1/sandboxes", json=body)
    assert r.status_code == 400 and next(iter(body)) in r.json()["error"]["message"]


async def test_auto_pause_then_auto_delete(api: httpx.AsyncClient, service: object) -> None:
    from hutch.services.composed import Services

    assert isinstance(service, Services)
    offset = 0.0
    service.core.clock = lambda: time.time() + offset
    idle = await create(api, auto_pause_s=60, auto_delete_s=120)
    busy = await create(api, auto_pause_s=60)
    async with api.stream(
        "POST", f"/v1/sandboxes/{busy}/exec", json={"cmd": "sleep 3; echo done", "stream": True}
    ) as r:
        offset = 61.0
        await service.reaper.apply_policies()
        assert (await api.get(f"/v1/sandboxes/{idle}")).json()["state"] == "paused"
        # An exec in progress keeps a sandbox from being idle.
        assert (await api.get(f"/v1/sandboxes/{busy}")).json()["state"] == "running"
        assert [line async for line in r.aiter_lines() if line][-1].startswith('{"type": "exit"')
    offset = 61.0 + 121.0
    await service.reaper.apply_policies()
    assert (await api.get(f"/v1/sandboxes/{idle}")).json()["state"] == "destroyed"
    assert (await api.get(f"/v1/sandboxes/{busy}")).json()["state"] == "paused"
