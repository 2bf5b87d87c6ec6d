"""The snapshot quota (``max_snapshot_bytes``) holds for one save whose size is known
only once saved and for concurrent saves: a save reserves its estimated size in the
transaction that inserts its row, and its real size must fit when it is finished (real
service, store and REST app; the component tier's fake VMs, whose snapshot sizes the
tests set)."""

from __future__ import annotations

import asyncio

import httpx

from hutch.services.composed import Services
from tests.component.fake_backend import FakeBackend

TEAM = {"Hutch-Project": "snaps"}


async def _project(api: httpx.AsyncClient, limit: int) -> None:
    r = await api.post(
        "/v1/projects", json={"name": "snaps", "quotas": {"max_snapshot_bytes": limit}}
    )
    assert r.status_code == 201, r.text


async def _sandbox(api: httpx.AsyncClient) -> str:
    r = await api.post("/v1/sandboxes", json={}, headers=TEAM)
    assert r.status_code == 201, r.text
    sid: str = r.json()["id"]
    return sid


async def _save(api: httpx.AsyncClient, sid: str, name: str) -> httpx.Response:
    return await api.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": name}, headers=TEAM)


async def _used(api: httpx.AsyncClient) -> int:
    used: int = (await api.get("/v1/projects/snaps")).json()["usage"]["snapshot_bytes"]
    return used


def _files(service: Services) -> FakeBackend:
    backend = service.core.backend
    assert isinstance(backend, FakeBackend)
    return backend


async def test_a_second_save_that_would_pass_the_quota_is_refused(
    api: httpx.AsyncClient, service: Services
) -> None:
    await _project(api, 6000)  # one 4096-byte snapshot fits, two do not
    sid = await _sandbox(api)
    assert (await _save(api, sid, "one")).status_code == 201
    r = await _save(api, sid, "two")
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "quota_exceeded"
    assert "max_snapshot_bytes" in r.json()["error"]["message"]
    assert await _used(api) == 4096
    names = [s["name"] for s in (await api.get("/v1/snapshots", headers=TEAM)).json()["snapshots"]]
    assert names == ["one"]


async def test_a_save_larger_than_its_reservation_is_discarded_past_the_quota(
    api: httpx.AsyncClient, service: Services
) -> None:
    await _project(api, 6000)
    files = _files(service).snapshots
    files.estimate_bytes, files.size_bytes = 4096, 8192  # the guest wrote more meanwhile
    sid = await _sandbox(api)
    r = await _save(api, sid, "big")
    assert r.status_code == 429, r.text
    assert "discarded" in r.json()["error"]["message"]
    assert await _used(api) == 0
    assert (await api.get("/v1/snapshots", headers=TEAM)).json()["snapshots"] == []
    # The sandbox runs on and a save that fits still works.
    files.size_bytes = 4096
    assert (await _save(api, sid, "small")).status_code == 201
    assert (await api.get(f"/v1/sandboxes/{sid}", headers=TEAM)).json()["state"] == "running"


async def test_concurrent_saves_never_pass_the_quota_together(
    api: httpx.AsyncClient, service: Services
) -> None:
    await _project(api, 3 * 4096 - 1)  # two fit, the third does not
    sids = [await _sandbox(api) for _ in range(4)]
    answers = await asyncio.gather(*(_save(api, sid, f"s{i}") for i, sid in enumerate(sids)))
    codes = sorted(r.status_code for r in answers)
    assert codes == [201, 201, 429, 429], [r.text for r in answers]
    assert await _used(api) == 2 * 4096
