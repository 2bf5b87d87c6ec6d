"""Pause, resume and fork of real micro-VMs through the service.

Memory mode keeps running processes exactly where they were; disk mode keeps files only;
a fork gives independent children with their own identity and disk.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from hutch.errors import SnapshotError
from hutch.models import PauseMode, SandboxSpec, SandboxState, Shape
from hutch.runtime.qemu.backend import QemuBackend
from hutch.services.sandboxes import SandboxService
from hutch.vm.disk_chain import disk_chain
from tests.vm.services import qemu_pids_mentioning
from tests.vm.test_sandbox_vm import run, service  # noqa: F401

pytestmark = [pytest.mark.vm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

# Written to a new file and renamed: a reader never sees the file truncated and empty.
COUNTER = (
    "setsid -f sh -c 'i=0; while :; do i=$((i+1)); "
    "echo $i > /tmp/c.new; mv /tmp/c.new /tmp/c; sleep 0.2; done'"
)
# A Python process holding a value in memory only; it answers on a FIFO.
HOLDER = (
    'mkfifo /tmp/q /tmp/a && setsid -f python3 -c "'
    "import random\n"
    "secret = random.getrandbits(64)\n"
    "open('/tmp/secret-at-start', 'w').write(str(secret))\n"
    "while True:\n"
    "    open('/tmp/q').read()\n"
    "    open('/tmp/a', 'w').write(str(secret))\n"
    '"'
)


# A TCP listener that keeps a file open from before the pause and appends to it for
# every client: after resume the same socket must accept and the same fd must write.
LISTENER = (
    'setsid -f python3 -c "'
    "import socket\n"
    "log = open('/tmp/served.log', 'a', buffering=1)\n"
    "s = socket.socket()\n"
    "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', 7777))\n"
    "s.listen()\n"
    "while True:\n"
    "    c, _ = s.accept()\n"
    "    log.write('served\\n')\n"
    "    c.sendall(b'pong')\n"
    "    c.close()\n"
    '"'
)
PING = (
    'python3 -c "import socket; '
    "print(socket.create_connection(('127.0.0.1', 7777), timeout=10).recv(4).decode())\""
)


async def ask_holder(svc: SandboxService, sid: str) -> str:
    return await run(svc, sid, "echo x > /tmp/q; cat /tmp/a", timeout_s=30)


async def counter(svc: SandboxService, sid: str) -> int:
    return int((await run(svc, sid, ["cat", "/tmp/c"])).strip())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def parent(service: SandboxService) -> AsyncIterator[str]:  # noqa: F811
    rec = await service.create(SandboxSpec(image="base", shape=Shape(memory_mib=256), name="dad"))
    await run(service, rec.id, COUNTER)
    await run(service, rec.id, HOLDER)
    for _ in range(50):
        if (await run(service, rec.id, "test -e /tmp/secret-at-start && echo y || true")) == "y\n":
            break
        await asyncio.sleep(0.2)
    yield rec.id


async def test_memory_pause_keeps_processes(service: SandboxService, parent: str) -> None:  # noqa: F811
    await run(service, parent, ["sh", "-c", "echo keep > /root/file"])
    await run(service, parent, LISTENER)
    for _ in range(50):  # the listener binds a moment after setsid returns
        if "pong" in await run(service, parent, PING + " 2>/dev/null || true"):
            break
        await asyncio.sleep(0.2)
    secret = await ask_holder(service, parent)
    before = await counter(service, parent)
    rec = await service.pause(parent, PauseMode.MEMORY)
    assert rec.state is SandboxState.PAUSED
    assert isinstance(service.backend, QemuBackend)
    assert qemu_pids_mentioning(str(service.backend.paths(parent).run)) == [], (
        "a paused sandbox must not keep a QEMU process"
    )
    await asyncio.sleep(2)
    await service.resume(parent)
    after = await counter(service, parent)
    assert before <= after < before + 8, (
        f"the counter restarted or ran while paused: {before}->{after}"
    )
    await asyncio.sleep(1)
    assert await counter(service, parent) > after, "the counter does not run after resume"
    assert await ask_holder(service, parent) == secret
    assert await run(service, parent, ["cat", "/root/file"]) == "keep\n"
    # The same listening socket and the same open file, not new ones.
    assert await run(service, parent, PING) == "pong\n"
    assert await run(service, parent, ["cat", "/tmp/served.log"]) == "served\nserved\n"
    guest_now = float(await run(service, parent, ["date", "+%s.%N"]))
    assert abs(guest_now - time.time()) < 5, "the guest clock was not corrected after resume"


async def test_fork_gives_independent_children(service: SandboxService, parent: str) -> None:  # noqa: F811
    secret = await ask_holder(service, parent)
    children = await service.fork(parent, 3)
    ids = [c.id for c in children]
    assert all(c.state is SandboxState.RUNNING and c.parent_id == parent for c in children)
    everyone = [parent, *ids]

    hostnames = {await run(service, s, ["hostname"]) for s in everyone}
    assert len(hostnames) == 4
    machine_ids = {await run(service, s, ["cat", "/etc/machine-id"]) for s in everyone}
    assert len(machine_ids) == 4, "children share a machine-id"
    randoms = {await run(service, s, "head -c 16 /dev/urandom | od -An -tx1") for s in everyone}
    assert len(randoms) == 4, "children return the same random bytes"
    # Memory was copied: every child still has the parent's Python value and counter.
    for child in ids:
        assert await ask_holder(service, child) == secret
        assert await counter(service, child) > 0

    await run(service, ids[0], ["sh", "-c", "echo mine > /root/only-in-child"])
    for other in (parent, ids[1], ids[2]):
        out = await run(service, other, "cat /root/only-in-child 2>/dev/null || echo absent")
        assert out == "absent\n"
    assert service.get(parent).state is SandboxState.RUNNING
    for child in ids:
        await service.delete(child)
    assert await ask_holder(service, parent) == secret


async def test_disk_pause_keeps_files_not_processes(service: SandboxService) -> None:  # noqa: F811
    rec = await service.create(SandboxSpec(image="base", shape=Shape(memory_mib=256)))
    await run(service, rec.id, COUNTER)
    await run(service, rec.id, ["sh", "-c", "echo on-disk > /root/kept; sync"])
    await asyncio.sleep(0.5)
    paused = await service.pause(rec.id, PauseMode.DISK)
    assert paused.pause_mode is PauseMode.DISK
    await service.resume(rec.id)
    assert await run(service, rec.id, ["cat", "/root/kept"]) == "on-disk\n"
    procs = await run(service, rec.id, "ps -eo args | grep -c 'i=\\$((i+1))' || true")
    assert procs.strip() in ("0", "1"), procs  # 1 = the grep itself
    assert "while" not in await run(
        service, rec.id, "ps -eo args | grep -v grep | grep while || true"
    )
    await service.delete(rec.id)


async def test_named_snapshot_starts_new_sandboxes(
    service: SandboxService,  # noqa: F811
    parent: str,
) -> None:
    secret = await ask_holder(service, parent)
    snap = await service.snapshot(parent, "with-holder")
    assert snap.size_bytes > 0
    assert service.get(parent).state is SandboxState.RUNNING
    child = await service.create(SandboxSpec(image="base", snapshot_id=snap.id))
    assert child.shape == service.get(parent).shape
    assert await ask_holder(service, child.id) == secret
    assert await run(service, child.id, ["hostname"]) != await run(service, parent, ["hostname"])
    # A snapshot of the child is built on this one too (snapshots delete in any order:
    # tests/e2e/test_crash_points.py).
    grandchild_snap = await service.snapshot(child.id, "of-the-child")
    await service.delete(child.id)
    await service.delete_snapshot(grandchild_snap.id)
    child = await service.create(SandboxSpec(image="base", snapshot_id=snap.id))

    # A snapshot whose bytes changed is refused, never restored.
    state_file = Path(snap.path) / "state.mig"
    state_file.chmod(0o600)
    with state_file.open("r+b") as f:
        f.seek(state_file.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(SnapshotError):
        await service.create(SandboxSpec(image="base", snapshot_id=snap.id))
    failed = service.list_sandboxes(state=SandboxState.FAILED)
    assert any("sha256" in (r.error or "") or "checksum" in (r.error or "") for r in failed)
    assert await run(service, parent, ["echo", "still-fine"]) == "still-fine\n"
    await service.delete(child.id)


async def _chain_settles(disk: Path, layers: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(disk_chain(disk)[0]) != layers:
        assert time.monotonic() < deadline, f"{disk}: chain {disk_chain(disk)} not compacted"
        await asyncio.sleep(0.2)


async def test_deep_disk_chains_are_compacted_while_running(service: SandboxService) -> None:  # noqa: F811
    backend = service.backend
    assert isinstance(backend, QemuBackend)
    allowed = backend.settings
    backend.settings = dataclasses.replace(allowed, max_disk_layers=1)
    try:
        rec = await service.create(SandboxSpec(image="base", shape=Shape(memory_mib=256)))
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
        (child,) = await service.fork(rec.id, 1)
        (ours,) = set(snapshots.glob("fork-*")) - earlier
        # Both now sit on two layers (their own + the frozen fork disk): each streams
        # the frozen layer into its own and ends up on the raw image again.
        child_disk = backend.paths(child.id).disk
        # A pause while the stream may still run cancels it; the resume starts it again.
        await service.pause(child.id, PauseMode.MEMORY)
        await service.resume(child.id)
        for sid, d in ((rec.id, disk), (child.id, child_disk)):
            await _chain_settles(d, 1)
            assert disk_chain(d)[1] is not None, "the raw image is the only backing file"
            assert "OK" in await run(service, sid, "cd /root && sha256sum -c sum")
            first = await counter(service, sid)
            await asyncio.sleep(0.5)
            assert await counter(service, sid) > first, "processes kept running"
        assert ours.exists()
        await service.delete(child.id)
        # Nothing references the frozen fork disk any more: it is removed.
        assert not ours.exists()
        await service.pause(rec.id, PauseMode.MEMORY)
        await service.resume(rec.id)
        assert "OK" in await run(service, rec.id, "cd /root && sha256sum -c sum")
        await service.delete(rec.id)
    finally:
        backend.settings = allowed
