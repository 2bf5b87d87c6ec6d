"""Pause, resume, fork and snapshots of real micro-VMs through the service, beyond
what the VM ladder checks (tests/vm/test_ladder.py: a memory pause keeps processes,
memory, sockets and terminals; fork children are independent copies with their own
identity): disk mode keeps files only, a named snapshot starts new sandboxes and refuses
tampering, deep disk chains are compacted while the guest runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from hutch.errors import SnapshotError, VmError
from hutch.models import PauseMode, SandboxSpec, SandboxState, Shape
from hutch.runtime.qemu.backend import QemuBackend
from hutch.runtime.qemu.runtime import QemuRuntime
from hutch.services.composed import Services
from hutch.vm.disk_chain import COMPACT_JOB, disk_chain
from tests.vm import guest_programs as gp
from tests.vm.test_sandbox_vm import run, service  # noqa: F401

pytestmark = [pytest.mark.vm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

# Written to a new file and renamed: a reader never sees the file truncated and empty.
COUNTER = (
    "setsid -f sh -c 'i=0; while :; do i=$((i+1)); "
    "echo $i > /tmp/c.new; mv /tmp/c.new /tmp/c; sleep 0.2; done'"
)


async def ask_holder(svc: Services, sid: str) -> str:
    return await run(svc, sid, gp.ASK_HOLDER, timeout_s=30)


async def counter(svc: Services, sid: str) -> int:
    return int((await run(svc, sid, ["cat", "/tmp/c"])).strip())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def parent(service: Services) -> AsyncIterator[str]:  # noqa: F811
    rec = await service.sandboxes.create(
        SandboxSpec(image="base", shape=Shape(memory_mib=256), name="dad")
    )
    await run(service, rec.id, gp.HOLDER)
    for _ in range(50):
        if (await run(service, rec.id, gp.HOLDER_UP)) == "y\n":
            break
        await asyncio.sleep(0.2)
    yield rec.id


async def test_disk_pause_keeps_files_not_processes(service: Services) -> None:  # noqa: F811
    rec = await service.sandboxes.create(SandboxSpec(image="base", shape=Shape(memory_mib=256)))
    await run(service, rec.id, COUNTER)
    await run(service, rec.id, ["sh", "-c", "echo on-disk > /root/kept; sync"])
    await asyncio.sleep(0.5)
    paused = await service.lifecycle.pause(rec.id, PauseMode.DISK)
    assert paused.pause_mode is PauseMode.DISK
    await service.lifecycle.resume(rec.id)
    assert await run(service, rec.id, ["cat", "/root/kept"]) == "on-disk\n"
    procs = await run(service, rec.id, "ps -eo args | grep -c 'i=\\$((i+1))' || true")
    assert procs.strip() in ("0", "1"), procs  # 1 = the grep itself
    assert "while" not in await run(
        service, rec.id, "ps -eo args | grep -v grep | grep while || true"
    )
    await service.sandboxes.delete(rec.id)


async def test_named_snapshot_starts_new_sandboxes(
    service: Services,  # noqa: F811
    parent: str,
) -> None:
    secret = await ask_holder(service, parent)
    snap = await service.snapshots.snapshot(parent, "with-holder")
    assert snap.size_bytes > 0
    assert service.sandboxes.get(parent).state is SandboxState.RUNNING
    child = await service.sandboxes.create(SandboxSpec(image="base", snapshot_id=snap.id))
    assert child.shape == service.sandboxes.get(parent).shape
    assert await ask_holder(service, child.id) == secret
    assert await run(service, child.id, ["hostname"]) != await run(service, parent, ["hostname"])
    # A snapshot of the child is built on this one too (snapshots delete in any order:
    # tests/e2e/test_crash_points.py).
    grandchild_snap = await service.snapshots.snapshot(child.id, "of-the-child")
    await service.sandboxes.delete(child.id)
    await service.snapshots.delete_snapshot(grandchild_snap.id)
    child = await service.sandboxes.create(SandboxSpec(image="base", snapshot_id=snap.id))

    # A snapshot whose bytes changed is refused, never restored.
    state_file = Path(snap.path) / "state.mig"
    state_file.chmod(0o600)
    with state_file.open("r+b") as f:
        f.seek(state_file.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(SnapshotError):
        await service.sandboxes.create(SandboxSpec(image="base", snapshot_id=snap.id))
    failed = service.sandboxes.list_sandboxes(state=SandboxState.FAILED)
    assert any("sha256" in (r.error or "") or "checksum" in (r.error or "") for r in failed)
    assert await run(service, parent, ["echo", "still-fine"]) == "still-fine\n"
    await service.sandboxes.delete(child.id)


async def _chain_settles(disk: Path, layers: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(disk_chain(disk)[0]) != layers:
        assert time.monotonic() < deadline, f"{disk}: chain {disk_chain(disk)} not compacted"
        await asyncio.sleep(0.2)


async def test_deep_disk_chains_are_compacted_while_running(service: Services) -> None:  # noqa: F811
    backend = service.backend
    assert isinstance(backend, QemuBackend)
    allowed = backend.settings
    backend.settings = dataclasses.replace(allowed, max_disk_layers=1)
    try:
        rec = await service.sandboxes.create(SandboxSpec(image="base", shape=Shape(memory_mib=256)))
        await run(service, rec.id, COUNTER)
        await run(
            service,
            rec.id,
            "head -c 8M /dev/urandom > /root/blob && sha256sum /root/blob > /root/sum && sync",
        )
        disk = backend.paths(rec.id).disk
        assert len(disk_chain(disk)[0]) == 1
        snapshots = backend.settings.state_dir / "snapshots"
        earlier = set(snapshots.glob("fork-*"))
        (child,) = await service.snapshots.fork(rec.id, 1)
        (ours,) = set(snapshots.glob("fork-*")) - earlier
        # Both now sit on two layers (their own + the frozen fork disk): each streams
        # the frozen layer into its own and ends up on the raw image again.
        child_disk = backend.paths(child.id).disk
        # A pause while the stream may still run cancels it; the resume starts it again.
        await service.lifecycle.pause(child.id, PauseMode.MEMORY)
        await service.lifecycle.resume(child.id)
        for sid, d in ((rec.id, disk), (child.id, child_disk)):
            await _chain_settles(d, 1)
            assert disk_chain(d)[1] is not None, "the raw image is the only backing file"
            assert "OK" in await run(service, sid, "cd /root && sha256sum -c sum")
            first = await counter(service, sid)
            await asyncio.sleep(0.5)
            assert await counter(service, sid) > first, "processes kept running"
        assert ours.exists()
        await service.sandboxes.delete(child.id)
        # Nothing references the frozen fork disk any more: it is removed.
        assert not ours.exists()
        await service.lifecycle.pause(rec.id, PauseMode.MEMORY)
        await service.lifecycle.resume(rec.id)
        assert "OK" in await run(service, rec.id, "cd /root && sha256sum -c sum")
        await service.sandboxes.delete(rec.id)
    finally:
        backend.settings = allowed


async def test_a_pause_as_a_compaction_ends_on_its_own_succeeds(service: Services) -> None:  # noqa: F811
    """The race CI met (2026-12-06): the pause listed the compaction job, the job ended
    and QEMU dismissed it, and the cancel that followed was refused ("Block job ... not
    found"), failing the pause. Here the first job listing of the pause is held until
    the real job has ended and then answers what QEMU said a moment before; the cancel
    goes to this QEMU and gets its real refusal."""
    backend = service.backend
    assert isinstance(backend, QemuBackend)
    allowed = backend.settings
    backend.settings = dataclasses.replace(allowed, max_disk_layers=1)
    try:
        rec = await service.sandboxes.create(SandboxSpec(image="base", shape=Shape(memory_mib=256)))
        (child,) = await service.snapshots.fork(rec.id, 1)  # the child compacts its disk
        runtime = service.core.runtimes[child.id]
        assert isinstance(runtime, QemuRuntime)
        vm = runtime.vm
        real_qmp = vm.qmp
        refusals: list[str] = []

        async def racing_qmp(cmd: str, **args: Any) -> object:
            if cmd == "query-block-jobs" and not refusals:
                deadline = time.monotonic() + 120
                while await real_qmp(cmd):
                    assert time.monotonic() < deadline, "the compaction never ended"
                    await asyncio.sleep(0.05)
                return [{"device": COMPACT_JOB, "type": "stream", "status": "running"}]
            try:
                return await real_qmp(cmd, **args)
            except VmError as exc:
                refusals.append(str(exc))
                raise

        vm.qmp = racing_qmp  # type: ignore[method-assign]
        await service.lifecycle.pause(child.id, PauseMode.MEMORY)
        assert refusals and "not found" in refusals[0], refusals
        await service.lifecycle.resume(child.id)
        assert await run(service, child.id, ["echo", "fine"]) == "fine\n"
        for sid in (child.id, rec.id):
            await service.sandboxes.delete(sid)
    finally:
        backend.settings = allowed
