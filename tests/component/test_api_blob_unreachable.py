"""A daemon whose S3 endpoint cannot be reached (``HUTCH_S3_ENDPOINT`` names a closed
loopback port), over the REST API with the real services: a create that needs the blob
store (a named snapshot whose local copy is gone) is a quick ``blob_error`` naming the
endpoint and what to check, and the daemon goes on serving everything else; a create
that would fetch its template from it boots cold instead."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
from pathlib import Path

import httpx
import pytest

from hutch.config import Settings
from hutch.models import FileSum, Shape
from hutch.services.composed import Services
from hutch.services.template_blobs import template_prefix
from hutch.store.image_uploads import ImageUploadStore
from tests.component.fake_backend import FakeBackend
from tests.component.test_api_lifecycle import create
from tests.component.test_blob_store_reach import closed_port


@pytest.fixture
def endpoint() -> str:
    return f"http://127.0.0.1:{closed_port()}"


@pytest.fixture
def settings(  # overrides the component conftest's
    settings: Settings, endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> Settings:
    # Credentials are there (no "no credentials" error first); the server is not.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "hutch")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-checked")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    return dataclasses.replace(
        settings,
        blob_url="s3://hutch-test/unreachable",
        s3_endpoint=endpoint,
        s3_connect_timeout_s=1.0,
    )


async def test_a_create_needing_an_unreachable_store_is_a_quick_blob_error(
    api: httpx.AsyncClient, service: Services, endpoint: str
) -> None:
    sid = await create(api, memory_mib=256)
    r = await api.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "nowhere"})
    assert r.status_code == 201, r.text  # its upload fails in the background, and retries
    snap = r.json()["id"]
    record = service.core.store.get_snapshot(snap)
    assert record is not None
    # The local copy is gone (evicted): a create from it must fetch it from the store.
    for d in {Path(record.path), service.core.backend.fork_dir(snap)}:
        shutil.rmtree(d, ignore_errors=True)

    # retry_s is 60 s; the client gives up at 30: an answer at all is the quick one.
    r = await api.post("/v1/sandboxes", json={"snapshot": snap}, timeout=30)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "blob_error"
    assert f"cannot reach the S3 endpoint {endpoint} " in error["message"]
    assert "check HUTCH_S3_ENDPOINT" in error["message"]

    # The daemon serves on: the sandbox it had, a new one, the snapshot's record.
    r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["echo", "still"]})
    assert r.status_code == 200 and r.json()["stdout"] == "still\n", r.text
    other = await create(api)
    assert (await api.get(f"/v1/sandboxes/{other}")).json()["state"] == "running"
    assert (await api.get(f"/v1/snapshots/{snap}")).status_code == 200
    listed = {s["id"]: s["state"] for s in (await api.get("/v1/sandboxes")).json()["sandboxes"]}
    assert {i for i, state in listed.items() if state == "running"} == {sid, other}


async def test_a_create_whose_template_upload_is_unreachable_boots_cold(
    api: httpx.AsyncClient, service: Services, caplog: pytest.LogCaptureFixture
) -> None:
    """The database records a template upload of this host's key, but the store is
    away: the create does not fail, it boots cold (logging why) and the template is
    built here in the background."""
    backend = service.core.backend
    assert isinstance(backend, FakeBackend)
    backend.templates.content = "base/" + "0" * 16
    prefix = template_prefix(backend.templates.content, backend.templates.key)
    ImageUploadStore(service.core.store).put(
        prefix, {"index.json": FileSum(1, "0" * 64)}, {"index_sha256": "0" * 64}
    )
    with caplog.at_level(logging.WARNING):
        sid = await create(api, memory_mib=256)
    assert (await api.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"
    assert (
        "built here by a cold boot" in caplog.text and "cannot reach the S3 endpoint" in caplog.text
    )
    events = (await api.get("/v1/events", params={"type": "sandbox.created"})).json()["events"]
    assert [e["data"]["from"] for e in events] == ["cold"]
    for _ in range(100):  # the background build (its fetch is not tried again so soon)
        if backend.templates.built:
            break
        await asyncio.sleep(0.05)
    assert backend.templates.built == [("base", Shape(memory_mib=256))]
