"""Named snapshots in S3-compatible storage, with real VMs and a real S3 server
(SeaweedFS, tests/s3server.py): a snapshot is uploaded once saved; with its local copy
gone (evicted by the cache limit, never while a sandbox uses it) a create from it
fetches it, checks it and keeps the files and processes the snapshot promised; an
object corrupted in the bucket is refused, never restored."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from hutch.errors import BlobError
from hutch.models import SandboxSpec, SandboxState, Shape
from hutch.services.composed import Services
from hutch.services.snapshot_blobs import INDEX
from tests.s3server import BUCKET, S3Server, s3_server
from tests.vm import guest_programs as gp
from tests.vm.services import real_service
from tests.vm.test_sandbox_vm import run

__all__ = ["s3_server"]

pytestmark = [pytest.mark.vm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def s3_env(s3_server: S3Server) -> Iterator[dict[str, str]]:
    """The AWS_* variables boto3 reads, for the in-process service; restored after."""
    env = s3_server.env(f"vm-{secrets.token_hex(4)}")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(
    tmp_path_factory: pytest.TempPathFactory, s3_env: dict[str, str]
) -> AsyncIterator[Services]:
    state = tmp_path_factory.mktemp("blobs-state")
    async with real_service(
        state,
        templates=False,
        blob_url=s3_env["HUTCH_BLOB_URL"],
        s3_endpoint=s3_env["HUTCH_S3_ENDPOINT"],
        blob_cache_bytes=1,  # every local copy is over the limit once nothing uses it
    ) as svc:
        yield svc


async def _isdir(path: str) -> bool:
    return await asyncio.to_thread(os.path.isdir, path)


async def test_snapshot_fetched_from_s3_after_its_local_copy_is_evicted(
    service: Services, s3_server: S3Server, s3_env: dict[str, str]
) -> None:
    rec = await service.sandboxes.create(SandboxSpec(image="base", shape=Shape(memory_mib=256)))
    marker = secrets.token_hex(8)
    await run(service, rec.id, ["sh", "-c", f"echo {marker} > /root/kept; sync"])
    await run(service, rec.id, gp.HOLDER)
    for _ in range(50):
        if (await run(service, rec.id, gp.HOLDER_UP)) == "y\n":
            break
    secret = await run(service, rec.id, gp.ASK_HOLDER, timeout_s=30)

    snap = await service.snapshots.snapshot(rec.id, "to-s3")
    await service.snapshots.blobs.wait_uploaded(snap.id)
    prefix = s3_env["HUTCH_BLOB_URL"].split("/", 3)[3]
    client = s3_server.client()
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/snapshots/{snap.id}/")
    names = {o["Key"].rsplit("/", 1)[1] for o in listed.get("Contents", [])}
    assert {INDEX, "state.mig", "disk.qcow2", "manifest.json", "vm.json"} <= names

    # The parent runs on a clone of the snapshot's disk: its local copy is in use.
    local = snap.path
    assert await service.snapshots.blobs.evict() == []
    assert await _isdir(local)
    await service.sandboxes.delete(rec.id)
    assert await service.snapshots.blobs.evict() == [snap.id]
    assert not await _isdir(local)

    child = await service.sandboxes.create(SandboxSpec(image="base", snapshot_id=snap.id))
    assert await _isdir(local)  # fetched back
    assert await run(service, child.id, ["cat", "/root/kept"]) == f"{marker}\n"
    assert await run(service, child.id, gp.ASK_HOLDER, timeout_s=30) == secret
    # In use by the child: not evicted.
    assert await service.snapshots.blobs.evict() == []
    await service.sandboxes.delete(child.id)
    assert await service.snapshots.blobs.evict() == [snap.id]

    # A byte flipped in the bucket's copy of the migration stream: refused, never loaded.
    key = f"{prefix}/snapshots/{snap.id}/state.mig"
    data = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    with pytest.raises(BlobError, match=rf"blob snapshots/{snap.id}/state.mig .* is corrupt"):
        await service.sandboxes.create(SandboxSpec(image="base", snapshot_id=snap.id))
    assert not await _isdir(local)
    failed = service.sandboxes.list_sandboxes(state=SandboxState.FAILED)
    assert any("is corrupt" in (r.error or "") for r in failed)

    # Deleting the snapshot removes its blobs.
    await service.snapshots.delete_snapshot(snap.id)
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/snapshots/{snap.id}/")
    assert listed.get("Contents", []) == []
