"""A restarted daemon serves while reconcile checks the VMs it found: ``/healthz`` says
"reconciling", a sandbox still being checked answers 503 with ``Retry-After``, the others
answer as usual. tests/e2e/test_crash_points.py shows the same with real VMs."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from hutch.api import create_app
from hutch.config import Settings
from hutch.daemon import build_services
from hutch.models import PauseMode, SandboxRecord, SandboxState, Shape
from hutch.store import Store
from tests.component.conftest import API_KEY, FakeImages
from tests.component.fake_backend import FakeBackend

AUTH = {"Authorization": f"Bearer {API_KEY}"}


class SlowToAdopt(FakeBackend):
    """Checking a VM takes until the test says so (then it is found gone)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.release = asyncio.Event()

    async def adopt(self, rec: SandboxRecord) -> None:
        await self.release.wait()
        return None


def row(sid: str, state: SandboxState, **kw: Any) -> SandboxRecord:
    return SandboxRecord(
        id=sid, image="base", state=state, shape=Shape(1, 256, 4), created_at=time.time(), **kw
    )


async def test_the_api_serves_while_reconcile_checks(settings: Settings, tmp_path: Path) -> None:
    store = Store(settings.database)
    checked = row("sb-00000000000a", SandboxState.RUNNING)
    paused = row(
        "sb-00000000000b", SandboxState.PAUSED, pause_mode=PauseMode.DISK, paused_at=time.time()
    )
    store.insert_sandbox(checked)
    store.insert_sandbox(paused)
    backend = SlowToAdopt(tmp_path / "run")
    svc = build_services(settings, store, backend, FakeImages(tmp_path))
    app = create_app(svc, API_KEY, manage_service=False)
    await svc.start(background=True)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://hutch") as api:
            health = (await api.get("/healthz")).json()
            assert (health["status"], health["reconciling"]) == ("reconciling", 1)
            for method, path in (
                ("GET", ""),
                ("POST", "/exec"),
                ("POST", "/pause"),
                ("DELETE", ""),
            ):
                body = {"cmd": ["true"]} if path == "/exec" else None
                r = await api.request(
                    method, f"/v1/sandboxes/{checked.id}{path}", json=body, headers=AUTH
                )
                assert r.status_code == 503, (method, path, r.text)
                assert r.headers["Retry-After"] == "1"
                assert r.json()["error"]["code"] == "unavailable"
                assert "still being checked" in r.json()["error"]["message"]
            r = await api.get(f"/v1/sandboxes/{paused.id}", headers=AUTH)
            assert r.status_code == 200 and r.json()["state"] == "paused"
            r = await api.get("/v1/sandboxes", headers=AUTH)
            assert r.status_code == 200, r.text
            listed = r.json()["sandboxes"]
            assert {s["id"] for s in listed} == {checked.id, paused.id}

            backend.release.set()
            for _ in range(200):
                if (await api.get("/healthz")).json()["status"] == "ok":
                    break
                await asyncio.sleep(0.01)
            assert (await api.get("/healthz")).json() == {
                **health,
                "status": "ok",
                "reconciling": 0,
            }
            gone = (await api.get(f"/v1/sandboxes/{checked.id}", headers=AUTH)).json()
            assert gone["state"] == "failed" and "VM was gone" in gone["error"]
            assert (await api.delete(f"/v1/sandboxes/{paused.id}", headers=AUTH)).status_code == 204
    finally:
        await svc.close()
    assert backend.leftover_ids() == set()
