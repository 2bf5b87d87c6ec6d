"""Projects in the REST API with the admin key (``Hutch-Project`` names the project it
acts in): every list shows the project's own resources only, and an id of another
project answers 404 ``not_found`` exactly like an id that does not exist."""

from __future__ import annotations

from typing import Any

import httpx

OTHER = {"Hutch-Project": "other"}


async def create(api: httpx.AsyncClient, headers: dict[str, str] | None = None) -> dict[str, Any]:
    r = await api.post("/v1/sandboxes", json={}, headers=headers)
    assert r.status_code == 201, r.text
    data: dict[str, Any] = r.json()
    return data


def not_found(r: httpx.Response) -> str:
    assert r.status_code == 404, r.text
    body = r.json()["error"]
    assert body["code"] == "not_found", body
    message: str = body["message"]
    return message


async def test_lists_show_only_the_projects_own(api: httpx.AsyncClient) -> None:
    mine = await create(api)
    theirs = await create(api, OTHER)
    listed = (await api.get("/v1/sandboxes")).json()["sandboxes"]
    assert [s["id"] for s in listed] == [mine["id"]]
    listed = (await api.get("/v1/sandboxes", headers=OTHER)).json()["sandboxes"]
    assert [s["id"] for s in listed] == [theirs["id"]]
    # A sandbox name is unique per project: the other project may reuse it.
    r = await api.post("/v1/sandboxes", json={"name": "web"})
    assert r.status_code == 201, r.text
    r = await api.post("/v1/sandboxes", json={"name": "web"}, headers=OTHER)
    assert r.status_code == 201, r.text


async def test_another_projects_ids_are_not_found_like_missing_ones(
    api: httpx.AsyncClient,
) -> None:
    theirs = await create(api, OTHER)
    sid = theirs["id"]
    r = await api.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "s"}, headers=OTHER)
    assert r.status_code == 201, r.text
    snap = r.json()["id"]
    missing_sb, missing_snap = "sb-" + "0" * 12, "snap-" + "0" * 12
    for method, path, body in [
        ("GET", f"/v1/sandboxes/{sid}", None),
        ("DELETE", f"/v1/sandboxes/{sid}", None),
        ("POST", f"/v1/sandboxes/{sid}/exec", {"command": ["true"]}),
        ("GET", f"/v1/sandboxes/{sid}/files?path=/etc/hostname", None),
        ("POST", f"/v1/sandboxes/{sid}/pause", None),
        ("POST", f"/v1/sandboxes/{sid}/fork", None),
        ("GET", f"/v1/sandboxes/{sid}/processes", None),
        ("GET", f"/v1/sandboxes/{sid}/egress", None),
    ]:
        theirs_r = await api.request(method, path, json=body)
        missing_r = await api.request(method, path.replace(sid, missing_sb), json=body)
        assert not_found(theirs_r) == not_found(missing_r).replace(missing_sb, sid), path
    for method in ("GET", "DELETE"):
        theirs_r = await api.request(method, f"/v1/snapshots/{snap}")
        missing_r = await api.request(method, f"/v1/snapshots/{missing_snap}")
        assert not_found(theirs_r) == not_found(missing_r).replace(missing_snap, snap)
    # Nor can a sandbox be made from another project's snapshot.
    r = await api.post("/v1/sandboxes", json={"snapshot": snap})
    assert not_found(r) == f"no snapshot {snap!r}; ids look like snap-0123456789ab"
    assert (await api.get("/v1/snapshots")).json()["snapshots"] == []
    # Nothing was done to it: it still runs in its own project.
    r = await api.get(f"/v1/sandboxes/{sid}", headers=OTHER)
    assert r.status_code == 200 and r.json()["state"] == "running"


async def test_a_bad_project_header_is_refused(api: httpx.AsyncClient) -> None:
    r = await api.get("/v1/sandboxes", headers={"Hutch-Project": "Not A Name"})
    assert r.status_code == 400, r.text
    assert "Hutch-Project" in r.json()["error"]["message"]
