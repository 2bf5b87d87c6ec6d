"""Usage, events and /metrics through the REST API (the real service, store and app; the
agent in bubblewrap). The per-second truth with real VMs and a killed daemon is
tests/e2e/test_metering.py."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from typing import Any

import httpx
import pytest

from hutch.services.composed import Services

pytestmark = pytest.mark.timeout(120)


async def create(api: httpx.AsyncClient, **body: object) -> str:
    r = await api.post("/v1/sandboxes", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def events(api: httpx.AsyncClient, sid: str, **params: str | int) -> list[dict[str, Any]]:
    r = await api.get(f"/v1/sandboxes/{sid}/events", params=params)
    assert r.status_code == 200, r.text
    return list(r.json()["events"])


async def test_a_sandbox_trace_records_each_step_and_no_secret(api: httpx.AsyncClient) -> None:
    sid = await create(api, env={"TOKEN": "s3cr3t-env-value"})
    r = await api.post(
        f"/v1/sandboxes/{sid}/exec",
        json={
            "cmd": [
                "sh",
                "-c",
                "echo printed-output; echo s3cr3t-env-value hk_abcdefgh12345678; exit 3",
            ]
        },
    )
    assert r.json()["exit_code"] == 3
    await api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/f"}, content=b"12345")
    assert (await api.post(f"/v1/sandboxes/{sid}/pause", json={})).status_code == 200
    assert (await api.post(f"/v1/sandboxes/{sid}/resume")).status_code == 200
    assert (await api.delete(f"/v1/sandboxes/{sid}")).status_code == 204

    got = await events(api, sid)
    assert [e["type"] for e in got] == [
        "sandbox.created", "sandbox.started", "sandbox.exec", "sandbox.file",
        "sandbox.paused", "sandbox.resumed", "sandbox.deleted",
    ]  # fmt: skip
    assert {(e["actor"], e["source"], e["project"]) for e in got} == {
        ("admin", "127.0.0.1", "default")
    }
    exec_ = got[2]["data"]
    assert exec_["exit_code"] == 3 and exec_["signal"] is None and exec_["duration_ms"] >= 0
    assert exec_["command"].startswith("sh -c 'echo printed-output;")
    assert got[3]["data"] == {"op": "write", "path": "/root/f", "bytes": 5}
    assert got[4]["data"] == {"reason": "api", "mode": "memory"}
    assert got[6]["data"] == {"reason": "api"}
    text = json.dumps(got)
    assert "s3cr3t-env-value" not in text and "hk_abcdefgh" not in text
    assert "printed-output\n" not in text  # no output, only the command

    # Paging and type filters.
    page = await events(api, sid, limit=2)
    assert [e["type"] for e in page] == ["sandbox.created", "sandbox.started"]
    rest = await events(api, sid, after=page[-1]["seq"], type="sandbox.exec,sandbox.file")
    assert [e["type"] for e in rest] == ["sandbox.exec", "sandbox.file"]
    assert len(await events(api, sid, type="sandbox.*")) == 7
    r = await api.get(f"/v1/sandboxes/{sid}/events", params={"type": "sandbox.nope"})
    assert r.status_code == 400 and "unknown event type 'sandbox.nope'" in r.text
    r = await api.get("/v1/sandboxes/sb-0123456789ab/events")
    assert r.status_code == 404

    # The project's audit trail holds the same, with the sandbox filter.
    r = await api.get("/v1/events", params={"sandbox": sid, "type": "sandbox.deleted"})
    body = r.json()
    assert [e["sandbox_id"] for e in body["events"]] == [sid]
    assert body["next_after"] == body["events"][-1]["seq"]


async def test_follow_streams_new_events_and_ends_with_the_sandbox(
    api: httpx.AsyncClient,
) -> None:
    sid = await create(api)
    seen: list[str] = []

    async def follow() -> None:
        async with api.stream("GET", f"/v1/sandboxes/{sid}/events", params={"follow": "true"}) as r:
            assert r.headers["content-type"].startswith("application/x-ndjson")
            async for line in r.aiter_lines():
                if line:
                    seen.append(json.loads(line)["type"])

    task = asyncio.create_task(follow())
    for _ in range(100):
        if seen == ["sandbox.created", "sandbox.started"]:
            break
        await asyncio.sleep(0.05)
    assert seen == ["sandbox.created", "sandbox.started"]
    await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["true"]})
    for _ in range(100):
        if len(seen) == 3:
            break
        await asyncio.sleep(0.05)
    assert seen[-1] == "sandbox.exec"  # arrived while the stream was open
    await api.delete(f"/v1/sandboxes/{sid}")
    await asyncio.wait_for(task, 10)  # the stream ends once the sandbox has
    assert seen[-1] == "sandbox.deleted"


async def test_usage_reports_quantities_and_cost(api: httpx.AsyncClient, service: Services) -> None:
    sid = await create(api)
    await asyncio.sleep(1.2)
    r = await api.get("/v1/usage")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["group_by"] == "sandbox" and body["project"] == "default"
    assert body["prices"] == {
        "vcpu_hour": 0.03616363,
        "gib_hour": 0.01159025,
        "storage_gb_hour": 0.0001584,
        "egress_gb": 0.0,
    }
    (row,) = [x for x in body["rows"] if x["key"] == sid]
    assert 1.0 <= row["vcpu_seconds"] <= 10.0 and row["cost_usd"] > 0
    assert body["total"]["key"] == "total"
    by_day = (await api.get("/v1/usage", params={"group_by": "day"})).json()
    assert len(by_day["rows"]) in (1, 2)  # 2 if the test ran across midnight UTC
    by_project = (await api.get("/v1/usage", params={"group_by": "project"})).json()
    assert [x["key"] for x in by_project["rows"]] == ["default"] and by_project["project"] is None
    # An explicit window before the sandbox existed holds nothing.
    early = await api.get("/v1/usage", params={"from": "2020-01-01", "to": "2020-01-02T00:00:00Z"})
    assert early.json()["rows"] == [] and early.json()["total"]["cost_usd"] == 0
    r = await api.get("/v1/usage", params={"from": "yesterday"})
    assert r.status_code == 400 and "from='yesterday' is not a time" in r.text
    r = await api.get("/v1/usage", params={"from": "200", "to": "100"})
    assert r.status_code == 400 and "must be before" in r.text
    r = await api.get("/v1/usage", params={"group_by": "week"})
    assert r.status_code == 400


async def test_metrics_take_the_scrape_token_or_the_admin_key(
    api: httpx.AsyncClient, service: Services
) -> None:
    path = service.settings.metrics_token_path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    token = path.read_text().strip()
    assert token.startswith("hm_")
    await create(api)
    r = await api.get("/metrics", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert 'hutch_sandboxes{state="running"} 1' in r.text.splitlines()
    assert "hutch_create_duration_seconds_count 1" in r.text.splitlines()
    assert (await api.get("/metrics")).status_code == 200  # the admin key (client default)
    r = await api.get("/metrics", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "metrics-token" in r.text
    r = await api.get("/metrics", headers={"Authorization": ""})
    assert r.status_code == 401
    # The scrape token reads metrics and nothing else.
    r = await api.get("/v1/sandboxes", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 401
