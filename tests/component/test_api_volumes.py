"""``/v1/volumes`` and the ``volumes`` field of a create, against the real service, store
and volume files with the fake VM backend (which records what would be attached and
mounted; tests/vm/test_volumes_vm.py proves the mounts, sizes and growth in real guests).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from hutch.config import Settings
from hutch.contract.volumes import VolumeMount
from hutch.daemon import build_services
from hutch.guest.client import AgentClient
from hutch.models import SandboxRecord, SandboxSpec, SandboxState
from hutch.services.composed import Services
from hutch.store import Store
from tests.component.conftest import FakeImages
from tests.component.fake_backend import FakeBackend, FakeRuntime

pytestmark = pytest.mark.timeout(120)

MIB = 1024**2


async def make_volume(api: httpx.AsyncClient, name: str = "data", size: int = 64 * MIB) -> Any:
    r = await api.post("/v1/volumes", json={"name": name, "size": size})
    assert r.status_code == 201, r.text
    return r.json()


async def test_create_list_inspect_delete(api: httpx.AsyncClient, service: Services) -> None:
    vol = await make_volume(api)
    assert vol["id"].startswith("vol-") and vol["kind"] == "exclusive"
    assert (vol["size"], vol["project"], vol["mounted_by"]) == (64 * MIB, "default", [])
    path = service.core.volume_files.path(vol["id"])
    assert path.stat().st_size == 64 * MIB  # the device size, exactly
    assert 0 < vol["used"] < 64 * MIB  # sparse: ext4's metadata only
    assert (await api.get("/v1/volumes/data")).json()["id"] == vol["id"]
    assert (await api.get(f"/v1/volumes/{vol['id']}")).json()["name"] == "data"
    assert [v["name"] for v in (await api.get("/v1/volumes")).json()["volumes"]] == ["data"]
    r = await api.post("/v1/volumes", json={"name": "data", "size": 64 * MIB})
    assert r.status_code == 409 and "already exists" in r.json()["error"]["message"]
    assert (await api.delete("/v1/volumes/data")).status_code == 204
    assert not path.exists()
    r = await api.get("/v1/volumes/data")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"name": "a", "size": 1}, "greater than or equal"),
        ({"name": "Bad_Name", "size": 64 * MIB}, "name="),
        ({"name": "a", "size": 64 * MIB, "kind": "shared"}, "'shared' is not available"),
        ({"name": "a", "size": 64 * MIB, "kind": "nfs"}, "exclusive"),
        ({"name": "a", "size": 64 * MIB, "extra": 1}, "Extra inputs"),
    ],
)
async def test_bad_volume_requests(api: httpx.AsyncClient, body: Any, needle: str) -> None:
    r = await api.post("/v1/volumes", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.text


async def test_a_sandbox_mounts_at_create_and_holds_the_volume(
    api: httpx.AsyncClient, service: Services
) -> None:
    vol = await make_volume(api)
    body = {"image": "base", "volumes": [{"volume": "data", "path": "/data/"}]}
    r = await api.post("/v1/sandboxes", json=body)
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    backend = service.backend
    assert isinstance(backend, FakeBackend)
    # Attached at boot (never a pooled VM or a template) and mounted, normalized path.
    [drive] = backend.volumes_of[sid]
    assert (drive.serial, drive.read_only) == (vol["id"], False)
    assert drive.path == service.core.volume_files.path(vol["id"])
    assert backend.mounted[sid] == [(vol["id"], "/data", False)]
    users = (await api.get("/v1/volumes/data")).json()["mounted_by"]
    assert users == [{"sandbox_id": sid, "path": "/data", "read_only": False}]

    # Exclusive: a second sandbox is refused, and nothing of it is left running.
    r = await api.post("/v1/sandboxes", json=body)
    assert r.status_code == 409 and f"mounted by sandbox {sid}" in r.text
    # In use: not deleted, and the answer names the sandbox.
    r = await api.delete("/v1/volumes/data")
    assert r.status_code == 409 and sid in r.json()["error"]["message"]
    # Fork and named snapshots are refused with the reason.
    r = await api.post(f"/v1/sandboxes/{sid}/fork", json={"count": 1})
    assert r.status_code == 409 and "fork is refused" in r.text
    r = await api.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "s"})
    assert r.status_code == 409 and "snapshot is refused" in r.text

    # The delete flushes and freezes the volume's filesystem first, then frees it.
    assert (await api.delete(f"/v1/sandboxes/{sid}")).status_code == 204
    assert backend.frozen == [(sid, ["/data"])]
    assert (await api.get("/v1/volumes/data")).json()["mounted_by"] == []
    assert (await api.delete("/v1/volumes/data")).status_code == 204


@pytest.mark.parametrize(
    ("volumes", "status", "needle"),
    [
        ([{"volume": "nope", "path": "/data"}], 404, "volume 'nope' not found"),
        ([{"volume": "data", "path": "data"}], 400, "must be an absolute path"),
        ([{"volume": "data", "path": "/etc/x"}], 400, "inside /etc"),
        ([{"volume": "data", "path": "/"}], 400, "would replace a system directory"),
        ([{"volume": "data", "path": "/a/../etc"}], 400, "not normalized"),
        (
            [{"volume": "data", "path": "/a"}, {"volume": "data", "path": "/b"}],
            400,
            "mounted twice",
        ),
    ],
)
async def test_bad_mounts_are_refused_before_anything_boots(
    api: httpx.AsyncClient, service: Services, volumes: Any, status: int, needle: str
) -> None:
    await make_volume(api)
    r = await api.post("/v1/sandboxes", json={"image": "base", "volumes": volumes})
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    backend = service.backend
    assert isinstance(backend, FakeBackend)
    assert backend.started == []


async def test_grow_a_volume_and_a_sandbox_disk(api: httpx.AsyncClient, service: Services) -> None:
    backend = service.backend
    assert isinstance(backend, FakeBackend)
    # Not mounted: grown on the host, file and filesystem.
    vol = await make_volume(api, size=32 * MIB)
    r = await api.patch("/v1/volumes/data", json={"size": 48 * MIB})
    assert r.status_code == 200 and r.json()["size"] == 48 * MIB, r.text
    assert service.core.volume_files.size(vol["id"]) == 48 * MIB
    r = await api.patch("/v1/volumes/data", json={"size": 40 * MIB})
    assert r.status_code == 400 and "only grow" in r.text
    # Mounted by a running sandbox: live, through the runtime (QMP + the guest agent).
    r = await api.post(
        "/v1/sandboxes", json={"image": "base", "volumes": [{"volume": "data", "path": "/v"}]}
    )
    sid = r.json()["id"]
    r = await api.patch("/v1/volumes/data", json={"size": 64 * MIB})
    assert r.status_code == 200, r.text
    assert backend.grown == [(sid, "vol0", "/v", 64 * MIB)]
    # The sandbox's own disk.
    r = await api.patch(f"/v1/sandboxes/{sid}", json={"disk_gib": 6})
    assert r.status_code == 200 and r.json()["disk_gib"] == 6, r.text
    assert backend.grown[-1] == (sid, "root", "/", 6 << 30)
    assert (await api.get(f"/v1/sandboxes/{sid}")).json()["disk_gib"] == 6
    r = await api.patch(f"/v1/sandboxes/{sid}", json={"disk_gib": 2})
    assert r.status_code == 400 and "disks only grow" in r.text
    # Mounting on a running sandbox: refused, saying why.
    r = await api.patch(f"/v1/sandboxes/{sid}", json={"volumes": [{"volume": "x", "path": "/x"}]})
    assert r.status_code == 400 and "no device hot-plug" in r.text
    # Paused in memory mode: the saved device state holds the old size.
    assert (await api.post(f"/v1/sandboxes/{sid}/pause", json={})).status_code == 200
    r = await api.patch("/v1/volumes/data", json={"size": 80 * MIB})
    assert r.status_code == 409 and "resume it" in r.text


class Adopting(FakeBackend):
    """A restarted daemon finds the agents of the last one still running."""

    async def adopt(self, rec: SandboxRecord) -> FakeRuntime | None:
        runtime = self.procs.get(rec.id)
        if runtime is None or runtime.proc.returncode is not None:
            return None
        runtime.agent = await AgentClient.connect(self.root / rec.id / "agent.sock", timeout_s=10)
        return runtime


async def test_a_restart_keeps_adopted_sandboxes_volumes(
    settings: Settings, tmp_path: Path
) -> None:
    backend = Adopting(tmp_path / "run")

    def start() -> Services:
        return build_services(settings, Store(settings.database), backend, FakeImages(tmp_path))

    first = start()
    await first.start()
    await first.volumes.create("data", 64 * MIB)
    rec = await first.sandboxes.create(
        SandboxSpec(image="base", volumes=[VolumeMount("data", "/data")])
    )
    # A create cut short after its volume file and before its row, and a stray file.
    files = first.core.volume_files
    (files.root / ".new-vol-00000000000a.img").write_bytes(b"half")
    (files.root / "vol-00000000000b.img").write_bytes(b"no row")
    await first.close()

    second = start()
    await second.start()
    try:
        assert second.sandboxes.get(rec.id).state is SandboxState.RUNNING
        info = second.volumes.get("data")
        assert [(m.sandbox_id, m.path) for m in info.mounts] == [(rec.id, "/data")]
        assert sorted(p.name for p in files.root.iterdir()) == [f"{info.volume.id}.img"]
        await second.sandboxes.delete(rec.id)
        assert second.volumes.get("data").mounts == []
    finally:
        await second.close()


async def test_a_sandbox_that_fails_releases_its_volumes(service: Services) -> None:
    await service.volumes.create("data", 64 * MIB)
    backend = service.backend
    assert isinstance(backend, FakeBackend)
    backend.fail_next_start = RuntimeError("boom")
    with pytest.raises(RuntimeError):
        await service.sandboxes.create(
            SandboxSpec(image="base", volumes=[VolumeMount("data", "/data")])
        )
    assert service.volumes.get("data").mounts == []
    # And the volume is usable by the next one.
    rec = await service.sandboxes.create(
        SandboxSpec(image="base", volumes=[VolumeMount("data", "/data")])
    )
    assert service.volumes.get("data").mounts[0].sandbox_id == rec.id


async def test_volumes_are_per_project(api: httpx.AsyncClient, service: Services) -> None:
    other = {"Hutch-Project": "other"}
    # A project must exist before the admin key can act in it (platform-auth phase 2).
    assert (await api.post("/v1/projects", json={"name": "other"})).status_code == 201
    mine = await make_volume(api)
    r = await api.post("/v1/volumes", json={"name": "data", "size": 64 * MIB}, headers=other)
    assert r.status_code == 201, r.text  # the name is free in another project
    theirs = r.json()
    assert theirs["project"] == "other"
    listed = (await api.get("/v1/volumes", headers=other)).json()["volumes"]
    assert [v["id"] for v in listed] == [theirs["id"]]
    # Another project's volume is not found, exactly as a missing one: by id, by delete,
    # and as a mount of a create.
    for r in (
        await api.get(f"/v1/volumes/{mine['id']}", headers=other),
        await api.delete(f"/v1/volumes/{mine['id']}", headers=other),
        await api.post(
            "/v1/sandboxes",
            json={"volumes": [{"volume": mine["id"], "path": "/d"}]},
            headers=other,
        ),
    ):
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    r = await api.post(
        "/v1/sandboxes", json={"volumes": [{"volume": "data", "path": "/d"}]}, headers=other
    )
    assert r.status_code == 201, r.text
    assert service.volumes.get(theirs["id"], "other").mounts[0].sandbox_id == r.json()["id"]
    assert service.volumes.get(mine["id"]).mounts == []
