"""REST API behaviour: lifecycle, listing, auth, validation, errors, capacity."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from hutch.errors import VmError
from hutch.services.composed import Services
from tests.component.conftest import API_KEY

pytestmark = pytest.mark.timeout(120)


async def create(api: httpx.AsyncClient, **body: object) -> dict[str, object]:
    r = await api.post("/v1/sandboxes", json=body)
    assert r.status_code == 201, r.text
    data: dict[str, object] = r.json()
    return data


async def test_create_get_list_delete(api: httpx.AsyncClient) -> None:
    sb = await create(api, metadata={"team": "a"}, name="web", env={"GREETING": "hi"})
    assert sb["state"] == "running"
    assert (sb["vcpus"], sb["memory_mib"], sb["disk_gib"]) == (1, 512, 4)
    assert sb["name"] == "web" and sb["created_at"] and sb["started_at"]
    assert "env" not in sb  # env may hold secrets; it is never echoed back
    other = await create(api, metadata={"team": "b"})

    r = await api.get(f"/v1/sandboxes/{sb['id']}")
    assert r.status_code == 200 and r.json()["id"] == sb["id"]

    r = await api.get("/v1/sandboxes", params={"metadata": "team=a"})
    assert [s["id"] for s in r.json()["sandboxes"]] == [sb["id"]]
    r = await api.get("/v1/sandboxes", params={"state": "running"})
    assert {s["id"] for s in r.json()["sandboxes"]} == {sb["id"], other["id"]}

    assert (await api.delete(f"/v1/sandboxes/{sb['id']}")).status_code == 204
    assert (await api.delete(f"/v1/sandboxes/{sb['id']}")).status_code == 204  # idempotent
    r = await api.get(f"/v1/sandboxes/{sb['id']}")
    assert r.json()["state"] == "destroyed" and r.json()["ended_at"]
    r = await api.get("/v1/sandboxes")
    assert [s["id"] for s in r.json()["sandboxes"]] == [other["id"]]
    r = await api.get("/v1/sandboxes", params={"state": "destroyed"})
    assert [s["id"] for s in r.json()["sandboxes"]] == [sb["id"]]


async def test_names_are_unique_among_live_sandboxes(api: httpx.AsyncClient) -> None:
    await create(api, name="dup")
    r = await api.post("/v1/sandboxes", json={"name": "dup"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"


async def test_auth(api: httpx.AsyncClient) -> None:
    r = await api.get("/v1/sandboxes", headers={"Authorization": ""})
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    r = await api.get("/v1/sandboxes", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["message"] == "wrong API key"
    r = await api.get("/healthz", headers={"Authorization": ""})
    assert r.status_code == 200 and r.json()["status"] == "ok"
    lower = await api.get("/v1/sandboxes", headers={"Authorization": f"bearer {API_KEY}"})
    assert lower.is_success  # the scheme is case-insensitive (RFC 9110), the key is not


@pytest.mark.parametrize(
    "header",
    [
        f"Bearer  {API_KEY}",  # a space before the key is part of what was sent
        f"Bearer \t{API_KEY}",
        f"Bearer {API_KEY} x",
        f"Bearer {API_KEY}\tx",
        f"Bearer {API_KEY[:-1]}",
        f"Bearer {API_KEY}x",
        f"Basic {API_KEY}",
        f"Bearer{API_KEY}",
        API_KEY,
    ],
)
async def test_the_key_is_compared_exactly(api: httpx.AsyncClient, header: str) -> None:
    """Nothing is stripped or normalized: only `Bearer`, one space, the key. (Whitespace
    around the whole header value is not part of it: HTTP removes it, RFC 9110 §5.5.)"""
    r = await api.get("/v1/sandboxes", headers={"Authorization": header})
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "unauthorized"
    assert API_KEY not in r.text


async def test_a_key_in_the_query_string_is_no_key(api: httpx.AsyncClient) -> None:
    r = await api.get("/v1/sandboxes", params={"token": API_KEY}, headers={"Authorization": ""})
    assert r.status_code == 401


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"vcpus": 0}, "vcpus"),
        ({"vcpus": 9}, "vcpus"),
        ({"memory_mib": 64}, "memory_mib"),
        ({"memory_mib": 99999}, "memory_mib"),
        ({"disk_gib": 61}, "disk_gib"),
        ({"vcpus": "2"}, "vcpus"),
        ({"colour": "red"}, "colour"),
        ({"name": "Not Valid"}, "name"),
        ({"env": {"1BAD": "x"}}, "env name"),
        ({"timeout_s": -1}, "timeout_s"),
    ],
)
async def test_bad_create_is_400_naming_the_field(
    api: httpx.AsyncClient, body: dict[str, object], fragment: str
) -> None:
    r = await api.post("/v1/sandboxes", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_argument" and fragment in err["message"]
    assert (await api.get("/v1/sandboxes")).json()["sandboxes"] == []


async def test_unknown_and_unbuilt_images(api: httpx.AsyncClient) -> None:
    r = await api.post("/v1/sandboxes", json={"image": "windows"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "unknown_image"
    assert "available: base, devbox" in r.json()["error"]["message"]
    r = await api.post("/v1/sandboxes", json={"image": "devbox"})
    assert r.status_code == 409 and "hutch image build devbox" in r.json()["error"]["message"]


async def test_malformed_and_huge_bodies(api: httpx.AsyncClient) -> None:
    r = await api.post(
        "/v1/sandboxes", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_argument"
    r = await api.post(
        "/v1/sandboxes", content=b"[1, 2]", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    huge = json.dumps({"metadata": {"k": "x" * (17 * 1024 * 1024)}})
    r = await api.post("/v1/sandboxes", content=huge, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"


async def test_unknown_ids(api: httpx.AsyncClient) -> None:
    for sid in ("sb-000000000000", "nope", "sb-../../etc"):
        r = await api.get(f"/v1/sandboxes/{sid}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["true"]})
        assert r.status_code == 404


async def test_capacity(api: httpx.AsyncClient, service: Services) -> None:
    from tests.component.conftest import with_limits

    service.core.settings = with_limits(service.settings, max_sandboxes=1)
    await create(api)
    r = await api.post("/v1/sandboxes", json={})
    assert r.status_code == 429 and r.json()["error"]["code"] == "capacity"
    service.core.settings = with_limits(service.settings, max_sandboxes=10, max_memory_mib=600)
    r = await api.post("/v1/sandboxes", json={"memory_mib": 256})
    assert r.status_code == 429 and "HUTCH_MAX_MEMORY_MIB" in r.json()["error"]["message"]


async def test_failed_boot_is_recorded_and_cleaned(
    api: httpx.AsyncClient, service: Services
) -> None:
    backend = service.backend
    backend.fail_next_start = VmError("qemu said no", argv=["qemu"], stderr="boom")  # type: ignore[attr-defined]
    r = await api.post("/v1/sandboxes", json={})
    assert r.status_code == 500 and r.json()["error"]["code"] == "vm_error"
    assert "boom" in r.json()["error"]["message"]
    failed = (await api.get("/v1/sandboxes", params={"state": "failed"})).json()["sandboxes"]
    assert len(failed) == 1 and "qemu said no" in failed[0]["error"]
    assert backend.leftover_ids() == set()
    await create(api)  # the daemon keeps serving


async def test_vm_that_dies_is_marked_failed(api: httpx.AsyncClient, service: Services) -> None:
    sb = await create(api)
    runtime = service.backend.procs[str(sb["id"])]  # type: ignore[attr-defined]
    runtime.proc.kill()
    for _ in range(100):
        state = (await api.get(f"/v1/sandboxes/{sb['id']}")).json()
        if state["state"] == "failed":
            break
        await asyncio.sleep(0.05)
    assert state["state"] == "failed" and "stopped unexpectedly" in state["error"]
    r = await api.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": ["true"]})
    assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state"


async def test_timeout_s_destroys_the_sandbox(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    sb = await create(api, timeout_s=1)
    assert sb["expires_at"]
    for _ in range(60):
        if (await api.get(f"/v1/sandboxes/{sb['id']}")).json()["state"] == "destroyed":
            break
        await asyncio.sleep(0.1)
    assert (await api.get(f"/v1/sandboxes/{sb['id']}")).json()["state"] == "destroyed"


async def test_concurrent_creates_and_execs(api: httpx.AsyncClient) -> None:
    made = await asyncio.gather(*(create(api) for _ in range(10)))
    ids = [str(s["id"]) for s in made]
    assert len(set(ids)) == 10

    async def run(i: int) -> None:
        sid = ids[i % len(ids)]
        r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["echo", str(i)]})
        assert r.status_code == 200, r.text
        assert r.json()["stdout"] == f"{i}\n"

    await asyncio.gather(*(run(i) for i in range(200)))
    listed = (await api.get("/v1/sandboxes")).json()["sandboxes"]
    assert sorted(s["id"] for s in listed) == sorted(ids)
