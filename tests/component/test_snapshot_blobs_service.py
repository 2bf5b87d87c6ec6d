"""The daemon's side of snapshots in the blob store, over the REST API with the real
service (the bubblewrap agent for a VM) and a real S3 server: a named snapshot is
uploaded in the background (its index appears, `snapshot.uploaded` is recorded) and its
blobs go with it; refused credentials fail only the upload, never the API, and the next
start with working credentials uploads it."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from hutch.config import Settings
from hutch.services.composed import Services
from hutch.services.snapshot_blobs import SnapshotBlobs
from hutch.storage.blobs import blob_store_from_settings
from tests.component.test_api_lifecycle import create
from tests.s3server import BUCKET, SECRET_KEY, S3Server, s3_server

__all__ = ["s3_server"]


@pytest.fixture(params=["good", "refused"])
def credentials(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, s3_server: S3Server
) -> Iterator[str]:
    env = s3_server.env()
    for k, v in env.items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    if request.param == "refused":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY + "-wrong")
    yield str(request.param)


@pytest.fixture
def settings(  # overrides the component conftest's
    settings: Settings, s3_server: S3Server, credentials: str, request: pytest.FixtureRequest
) -> Settings:
    return dataclasses.replace(
        settings,
        blob_url=f"s3://{BUCKET}/svc-{request.node.name.replace('[', '-').strip(']')}",
        s3_endpoint=s3_server.endpoint,
    )


@pytest.fixture
async def prefix(settings: Settings) -> AsyncIterator[str]:
    assert settings.blob_url is not None
    yield settings.blob_url.split("/", 3)[3]


def _keys(server: S3Server, prefix: str) -> list[str]:
    listed = server.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
    return sorted(o["Key"][len(prefix) + 1 :] for o in listed.get("Contents", []))


async def test_snapshot_is_uploaded_and_its_blobs_go_with_it(
    api: httpx.AsyncClient,
    service: Services,
    s3_server: S3Server,
    credentials: str,
    prefix: str,
) -> None:
    sid = await create(api, memory_mib=256)
    r = await api.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "to-s3"})
    assert r.status_code == 201, r.text
    snap = r.json()["id"]
    if credentials == "good":
        await service.snapshots.blobs.wait_uploaded(snap)
        assert f"snapshots/{snap}/index.json" in await asyncio.to_thread(_keys, s3_server, prefix)
        events = (await api.get("/v1/events", params={"type": "snapshot.uploaded"})).json()
        assert [e["data"]["snapshot"] for e in events["events"]] == [snap]
    else:
        await asyncio.sleep(0.5)  # the upload has been refused (and waits to retry)
        assert await asyncio.to_thread(_keys, s3_server, prefix) == []
        r = await api.get(f"/v1/sandboxes/{sid}")
        assert r.status_code == 200 and r.json()["state"] == "running"
        r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["echo", "serving"]})
        assert r.status_code == 200 and r.json()["stdout"] == "serving\n"
        # The next start with credentials that work uploads what this one could not.
        os.environ["AWS_SECRET_ACCESS_KEY"] = SECRET_KEY  # monkeypatch restores it
        # (A store of its own: the credentials are read as it opens.)
        store = blob_store_from_settings(service.core.settings)
        restarted = SnapshotBlobs.from_settings(service.core, store)
        await restarted.start()
        assert restarted._starter is not None
        await restarted._starter
        await restarted.wait_uploaded(snap)
        keys = await asyncio.to_thread(_keys, s3_server, prefix)
        assert f"snapshots/{snap}/index.json" in keys
        # As the restarted daemon would: its store deletes the snapshot's blobs below.
        await service.snapshots.blobs.close()
        service.snapshots.blobs = restarted
    assert (await api.delete(f"/v1/snapshots/{snap}")).status_code == 204
    assert await asyncio.to_thread(_keys, s3_server, prefix) == []
