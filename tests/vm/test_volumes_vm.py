"""Exclusive volumes on real micro-VMs: data outlives its sandbox and mounts in the next
one, the size is the device's end, a memory-mode pause keeps the mount and its data (a
disk-mode resume mounts it again),
fork and named snapshots are refused, and a volume and the sandbox's own disk grow live
(``df`` in the guest sees it).

Three boots in all: the first sandbox runs through the module (and boots again once, for
its disk-mode resume); the second mounts the volume after the first is deleted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from hutch.contract.volumes import VolumeMount
from hutch.errors import Conflict
from hutch.models import PauseMode, SandboxSpec, SandboxState, Shape
from hutch.services.composed import Services
from tests.vm.test_sandbox_vm import run, service  # noqa: F401

pytestmark = [pytest.mark.vm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

GIB = 1024**3


async def sh(svc: Services, sid: str, script: str) -> str:
    return await run(svc, sid, ["sh", "-c", script], timeout_s=300)


async def df_total(svc: Services, sid: str, path: str) -> int:
    """The filesystem size at ``path`` as ``df`` in the guest reports it (bytes)."""
    out = await sh(svc, sid, f"df -B1 --output=size {path} | tail -1")
    return int(out.strip())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def volume(service: Services) -> AsyncIterator[str]:  # noqa: F811
    info = await service.volumes.create("data", GIB)
    await service.volumes.create("logs", 64 * 1024**2)
    yield info.volume.id


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def first(service: Services, volume: str) -> AsyncIterator[str]:  # noqa: F811
    rec = await service.sandboxes.create(
        SandboxSpec(
            image="base",
            shape=Shape(memory_mib=256),
            volumes=[VolumeMount("data", "/data"), VolumeMount("logs", "/var/log/app")],
        )
    )
    await sh(service, rec.id, "echo hello-from-first > /data/hello && sync")
    await sh(service, rec.id, "echo log-line > /var/log/app/log")  # no sync: the delete
    yield rec.id


async def test_the_volume_is_mounted_and_recorded(
    service: Services,  # noqa: F811
    volume: str,
    first: str,
) -> None:
    mounts = await sh(service, first, "grep ' /data ' /proc/mounts")
    assert " ext4 " in mounts and "rw," in mounts, mounts
    info = service.volumes.get("data")
    assert [(m.sandbox_id, m.path) for m in info.mounts] == [(first, "/data")]
    assert " /var/log/app " in await sh(service, first, "cat /proc/mounts")
    assert info.used_bytes is not None and 0 < info.used_bytes < GIB
    # Exclusive: a second sandbox is refused before anything boots.
    with pytest.raises(Conflict, match="mounted by sandbox"):
        await service.sandboxes.create(
            SandboxSpec(image="base", volumes=[VolumeMount(volume, "/v")])
        )
    # In use: the delete is refused and names the sandbox.
    with pytest.raises(Conflict, match=first):
        await service.volumes.delete("data")


async def test_a_1gib_volume_refuses_the_next_byte(
    service: Services,  # noqa: F811
    first: str,
) -> None:
    # The device ends at exactly 1 GiB: writing its 1 GiB + 1st byte fails.
    dev = (await sh(service, first, "grep ' /data ' /proc/mounts | cut -d' ' -f1")).strip()
    assert (await sh(service, first, f"blockdev --getsize64 {dev}")).strip() == str(GIB)
    beyond = await service.guest.exec(
        first,
        ["dd", "if=/dev/zero", f"of={dev}", "bs=1", "count=1", f"seek={GIB}", "oflag=direct"],
    )
    result = await beyond.collect()
    assert result.exit_code != 0
    assert b"No space left on device" in result.stderr, result.stderr
    # Through the filesystem: filling it stops short of 1 GiB with ENOSPC.
    fill = await service.guest.exec(
        first, ["sh", "-c", "dd if=/dev/zero of=/data/fill bs=1M 2>&1; stat -c %s /data/fill"]
    )
    out = (await fill.collect()).stdout.decode()
    assert "No space left on device" in out, out
    assert int(out.strip().splitlines()[-1]) < GIB
    await sh(service, first, "rm /data/fill && sync")


async def test_memory_pause_keeps_the_mount_and_its_data(
    service: Services,  # noqa: F811
    first: str,
) -> None:
    # A process holds a file open on the volume across the pause.
    await sh(service, first, "setsid -f sh -c 'exec 3>/data/held; sleep 100000' && sleep 0.3")
    await service.lifecycle.pause(first, PauseMode.MEMORY)
    assert service.sandboxes.get(first).state is SandboxState.PAUSED
    assert service.volumes.get("data").mounts[0].sandbox_id == first  # still attached
    await service.lifecycle.resume(first)
    assert await sh(service, first, "cat /data/hello") == "hello-from-first\n"
    assert " /data " in await sh(service, first, "cat /proc/mounts")
    await sh(service, first, "echo after-resume > /data/after && sync")
    assert await sh(service, first, "cat /data/after") == "after-resume\n"


async def test_disk_pause_mounts_the_volume_again(
    service: Services,  # noqa: F811
    first: str,
) -> None:
    await service.lifecycle.pause(first, PauseMode.DISK)
    await service.lifecycle.resume(first)  # a boot: the volume is attached and mounted
    assert " /data " in await sh(service, first, "cat /proc/mounts")
    assert await sh(service, first, "cat /data/after") == "after-resume\n"


async def test_fork_and_snapshot_are_refused(
    service: Services,  # noqa: F811
    first: str,
) -> None:
    with pytest.raises(Conflict, match="fork is refused for sandboxes with exclusive volumes"):
        await service.snapshots.fork(first, 1)
    with pytest.raises(Conflict, match="a named snapshot is refused"):
        await service.snapshots.snapshot(first, "with-volume")
    assert service.sandboxes.get(first).state is SandboxState.RUNNING


async def test_a_volume_and_the_disk_grow_live(
    service: Services,  # noqa: F811
    first: str,
) -> None:
    before = await df_total(service, first, "/data")
    info = await service.volumes.grow("data", 2 * GIB)
    assert info.volume.size_bytes == 2 * GIB
    after = await df_total(service, first, "/data")
    assert after > before + GIB // 2, (before, after)
    assert await sh(service, first, "cat /data/hello") == "hello-from-first\n"

    root_before = await df_total(service, first, "/")
    rec = await service.volumes.grow_sandbox_disk(
        first, service.sandboxes.get(first).shape.disk_gib + 2
    )
    root_after = await df_total(service, first, "/")
    assert root_after > root_before + GIB, (root_before, root_after)
    assert service.sandboxes.get(first).shape.disk_gib == rec.shape.disk_gib


async def test_data_outlives_its_sandbox_and_mounts_in_a_new_one(
    service: Services,  # noqa: F811
    volume: str,
    first: str,
) -> None:
    await service.sandboxes.delete(first)  # flushes and freezes both volumes first
    assert service.volumes.get("data").mounts == []
    # Unattached: the file grows; the guest grows its ext4 at the next read-write mount.
    await service.volumes.grow("data", 3 * GIB)
    second = await service.sandboxes.create(
        SandboxSpec(
            image="base",
            shape=Shape(memory_mib=256),
            volumes=[
                VolumeMount(volume, "/mnt/data"),
                # Read-only on a read-only device: only a clean journal mounts, so this
                # proves the delete left the volume clean (its last write was not synced).
                VolumeMount("logs", "/mnt/logs", read_only=True),
            ],
        )
    )
    try:
        assert await sh(service, second.id, "cat /mnt/data/hello") == "hello-from-first\n"
        assert await sh(service, second.id, "cat /mnt/data/after") == "after-resume\n"
        assert await df_total(service, second.id, "/mnt/data") > 2 * GIB + GIB // 2
        assert await sh(service, second.id, "cat /mnt/logs/log") == "log-line\n"
        write = await service.guest.exec(second.id, ["sh", "-c", "echo x > /mnt/logs/new"])
        result = await write.collect()
        assert result.exit_code != 0 and b"Read-only file system" in result.stderr
    finally:
        await service.sandboxes.delete(second.id)
    await service.volumes.delete("data")
    await service.volumes.delete("logs")
    assert not service.core.volume_files.path(volume).exists()
