"""Per-sandbox cgroups on real QEMU (ARCHITECTURE.md, "Resource limits").

Every QEMU runs in its own group under hutch's sub-tree with the limits its shape gives;
the limits hold against a hostile guest: filling guest RAM never pushes QEMU past its
memory limit, a QEMU that does exceed it is killed alone and its sandbox reported
``failed: out of memory`` while the daemon and its neighbours carry on, a fork bomb in
the guest stays in the guest, a guest cannot grow its disk past its size, and every
group goes with its sandbox (delete, pause; a daemon crash: test_cgroups_crash.py).

Needs root and a cgroup hierarchy with the memory controller (v1 or v2); skipped
elsewhere, with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from hutch.images.build import ImageArtifacts
from hutch.models import PauseMode, SandboxSpec, SandboxState, Shape
from hutch.runtime.qemu.backend import QemuBackend
from hutch.services.composed import Services
from hutch.vm.cgroup_driver import SandboxCgroup, record_path
from hutch.vm.cgroups import PIDS_BASE
from tests.conftest import ensure_image, qemu_pids_mentioning
from tests.vm.services import real_service

pytestmark = [pytest.mark.vm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

SHAPE = Shape(vcpus=1, memory_mib=256, disk_gib=1)
OVERHEAD_MIB = 64
TB_MIB = 64
LIMIT = (SHAPE.memory_mib + TB_MIB + OVERHEAD_MIB) << 20
#: Fills guest RAM 16 MiB at a time with written (not just reserved) pages until the
#: guest kernel refuses or kills it.
HOG = "l=[]\nwhile True: l.append(b'x' * (16 << 20))"


def _settings() -> dict[str, object]:
    return dict(
        cgroups="on",
        cgroup_memory_overhead_mib=OVERHEAD_MIB,
        tcg_tb_mib=TB_MIB,
        cgroup_cpu_quota_pct=100,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Services]:
    if os.geteuid() != 0:
        pytest.skip("per-sandbox cgroups need root")
    # Templates on: creates are restores from the shape's template (a restored QEMU is
    # placed in its group like a booted one); the template build itself boots one.
    async with real_service(tmp_path_factory.mktemp("cgstate"), **_settings()) as svc:
        yield svc


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def neighbour(service: Services) -> str:
    return (await service.sandboxes.create(SandboxSpec(image="base", shape=SHAPE, name="quiet"))).id


def backend_of(service: Services) -> QemuBackend:
    assert isinstance(service.backend, QemuBackend)
    return service.backend


def group_of(service: Services, sid: str) -> SandboxCgroup:
    rec = record_path(backend_of(service).paths(sid).pidfile)
    cg = SandboxCgroup.load(rec)
    assert cg is not None, f"no cgroup record at {rec}"
    return cg


def control(cg: SandboxCgroup, name: str) -> str:
    for d in cg.dirs:
        if (d / name).exists():
            return (d / name).read_text().strip()
    raise AssertionError(f"no {name} in {cg.dirs}")


def qemu_pid(service: Services, sid: str) -> int:
    (pid,) = qemu_pids_mentioning(str(backend_of(service).paths(sid).run))
    return pid


def assert_in_its_group(service: Services, sid: str) -> SandboxCgroup:
    """QEMU of ``sid`` and all its threads are in the group named after it, in every
    hierarchy hutch limits, under the daemon's sub-tree; the limits are its shape's."""
    cg = group_of(service, sid)
    pid = qemu_pid(service, sid)
    tag = f"hutch-{service.settings.daemon_tag}"
    for d in cg.dirs:
        assert d.name == sid and d.parent.name == tag and d.is_dir()
        assert pid in {int(p) for p in (d / "cgroup.procs").read_text().split()}
        threads = {int(t) for t in os.listdir(f"/proc/{pid}/task")}
        assert threads <= {
            int(t)
            for t in (d / "tasks" if cg.version == 1 else d / "cgroup.threads").read_text().split()
        }
    own = (Path(f"/proc/{pid}/cgroup")).read_text()
    assert f"/{tag}/{sid}\n" in own, own
    if cg.version == 1:
        assert int(control(cg, "memory.limit_in_bytes")) == LIMIT
        assert int(control(cg, "memory.memsw.limit_in_bytes")) == LIMIT  # no swap
        assert control(cg, "cpu.cfs_quota_us") == str(SHAPE.vcpus * 100_000)
        assert control(cg, "cpu.shares") == str(SHAPE.vcpus * 1024)
    else:
        assert int(control(cg, "memory.max")) == LIMIT
        assert control(cg, "memory.swap.max") == "0"
        assert control(cg, "cpu.max") == f"{SHAPE.vcpus * 100_000} 100000"
    assert control(cg, "pids.max") == str(PIDS_BASE + SHAPE.vcpus)
    return cg


def memory_file(cg: SandboxCgroup, v1: str, v2: str) -> Path:
    name = v1 if cg.version == 1 else v2
    return next(d / name for d in cg.dirs if (d / name).exists())


async def sh(service: Services, sid: str, script: str, timeout_s: float = 120) -> str:
    stream = await service.guest.exec(sid, ["sh", "-c", script], timeout_s=timeout_s)
    result = await stream.collect()
    assert result.exit_code == 0, (script, result)
    return result.stdout.decode()


def proc_status(pid: int) -> dict[str, str]:
    status = Path(f"/proc/{pid}/status").read_text()
    return dict(line.split(":", 1) for line in status.splitlines() if ":" in line)


async def test_qemu_runs_as_the_unprivileged_user(service: Services, neighbour: str) -> None:
    """QEMU drops to the QEMU user (given to it as uid:gid, so it looks nothing up) with
    no supplementary group but that user's own."""
    if os.geteuid() != 0:
        pytest.skip("needs root: only a root daemon has a user to drop QEMU to")
    user = pwd.getpwnam(service.settings.qemu_user)
    fields = proc_status(qemu_pid(service, neighbour))
    assert fields["Uid"].split() == [str(user.pw_uid)] * 4, fields["Uid"]
    assert fields["Gid"].split() == [str(user.pw_gid)] * 4, fields["Gid"]
    assert fields["Groups"].split() in ([], [str(user.pw_gid)]), fields["Groups"]


async def test_each_qemu_is_in_its_own_group_with_its_limits(
    service: Services, neighbour: str
) -> None:
    cg = assert_in_its_group(service, neighbour)
    other = await service.sandboxes.create(SandboxSpec(image="base", shape=SHAPE))
    other_cg = assert_in_its_group(service, other.id)
    assert set(cg.dirs).isdisjoint(other_cg.dirs)
    await service.sandboxes.delete(other.id)
    assert not any(d.exists() for d in other_cg.dirs)
    assert not record_path(backend_of(service).paths(other.id).pidfile).exists()


async def test_filling_guest_ram_stays_inside_qemus_limit(
    service: Services, neighbour: str
) -> None:
    cg = group_of(service, neighbour)
    stream = await service.guest.exec(neighbour, ["python3", "-c", HOG], timeout_s=300)
    result = await stream.collect()
    assert result.exit_code != 0  # the guest's kernel stopped it, not the host's
    peak = int(memory_file(cg, "memory.max_usage_in_bytes", "memory.peak").read_text())
    stat = dict(
        line.split()
        for line in memory_file(cg, "memory.stat", "memory.stat").read_text().splitlines()
    )
    anon = int(stat.get("rss", stat.get("anon", "0")))
    print(
        f"QEMU with guest RAM full: peak {peak >> 20} MiB of {LIMIT >> 20} MiB, "
        f"anon {anon >> 20} MiB"
    )
    # The hog did fill guest RAM (QEMU's charge grew to about it) ...
    assert peak > (SHAPE.memory_mib - 64) << 20, peak
    # ... and QEMU stayed within its limit: no OOM kill, the sandbox still answers.
    assert cg.oom_kills() == 0
    assert service.sandboxes.get(neighbour).state is SandboxState.RUNNING
    assert (await sh(service, neighbour, "echo alive")).strip() == "alive"


async def test_qemu_over_its_limit_is_killed_alone_and_reported_out_of_memory(
    service: Services, neighbour: str
) -> None:
    rec = await service.sandboxes.create(SandboxSpec(image="base", shape=SHAPE))
    cg = assert_in_its_group(service, rec.id)
    # Make the limit tighter than this guest's RAM (as if the overhead had been
    # underestimated): what the guest touches next must be refused by the host.
    usage = int(memory_file(cg, "memory.usage_in_bytes", "memory.current").read_text())
    tight = str(usage + (24 << 20))
    if cg.version == 1:
        memory_file(cg, "memory.limit_in_bytes", "").write_text(tight)
        memory_file(cg, "memory.memsw.limit_in_bytes", "").write_text(tight)
    else:
        memory_file(cg, "", "memory.max").write_text(tight)
    with contextlib.suppress(Exception):
        stream = await service.guest.exec(rec.id, ["python3", "-c", HOG], timeout_s=300)
        await stream.collect()
    for _ in range(600):
        if service.sandboxes.get(rec.id).state is SandboxState.FAILED:
            break
        await asyncio.sleep(0.1)
    got = service.sandboxes.get(rec.id)
    assert got.state is SandboxState.FAILED, got
    assert (got.error or "").startswith("out of memory"), got.error
    # Confined: the neighbour and the daemon carry on; the group went with the sandbox.
    assert (await sh(service, neighbour, "echo alive")).strip() == "alive"
    assert qemu_pids_mentioning(str(backend_of(service).paths(rec.id).run)) == []
    assert not any(d.exists() for d in cg.dirs)


async def test_a_fork_bomb_stays_in_the_guest(service: Services, neighbour: str) -> None:
    rec = await service.sandboxes.create(SandboxSpec(image="base", shape=SHAPE))
    cg = assert_in_its_group(service, rec.id)
    pids_max = int(control(cg, "pids.max"))
    pids_dir = next(d for d in cg.dirs if (d / "pids.current").exists())
    # Detached, so the exec returns; the guest's kernel is all that bounds it in there.
    await sh(service, rec.id, "setsid sh -c 'f() { f | f & }; f' >/dev/null 2>&1 < /dev/null &")
    most = 0
    for _ in range(20):
        await asyncio.sleep(1)
        try:
            most = max(most, int((pids_dir / "pids.current").read_text()))
        except FileNotFoundError:
            # The guest's kernel gave up (out of memory with nothing left to kill: it
            # panics, and a panicking guest ends its VM): that is the guest's own end.
            break
    # The host saw QEMU's threads only (up to 64 of them block I/O workers, which a guest
    # thrashing its disk cache keeps busy), never the guest's processes.
    print(f"QEMU's group during the fork bomb: at most {most} of {pids_max} pids")
    assert 0 < most <= pids_max
    assert (await sh(service, neighbour, "echo alive", timeout_s=300)).strip() == "alive"
    if service.sandboxes.get(rec.id).state is SandboxState.RUNNING:
        await service.sandboxes.delete(rec.id)
    else:
        for _ in range(300):
            if service.sandboxes.get(rec.id).state is SandboxState.FAILED:
                break
            await asyncio.sleep(0.1)
        assert service.sandboxes.get(rec.id).state is SandboxState.FAILED
    assert not any(d.exists() for d in cg.dirs)


async def test_a_guest_cannot_grow_its_disk_past_its_size(service: Services) -> None:
    rec = await service.sandboxes.create(SandboxSpec(image="base", shape=SHAPE))
    fill = "dd if=/dev/zero of=/var/tmp/fill bs=1M 2>&1; sync; df -k / | tail -1"
    stream = await service.guest.exec(rec.id, ["sh", "-c", fill], timeout_s=600)
    result = await stream.collect()
    assert b"No space left on device" in result.stdout, result
    disk = backend_of(service).paths(rec.id).disk
    info = json.loads(
        subprocess.run(  # noqa: ASYNC221 (a quick read of the image header)
            ["qemu-img", "info", "-U", "--output=json", str(disk)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    size = SHAPE.disk_gib << 30
    assert info["virtual-size"] == size
    # Data can only land inside the virtual size; qcow2 adds its tables (under 1%).
    assert info["actual-size"] <= size + (16 << 20), info
    assert disk.stat().st_size <= size + (16 << 20)
    assert (await sh(service, rec.id, "rm /var/tmp/fill; echo ok")).strip() == "ok"
    await service.sandboxes.delete(rec.id)


async def test_pause_resume_and_fork_put_restored_qemus_in_their_groups(
    service: Services, neighbour: str
) -> None:
    before = group_of(service, neighbour)
    await service.lifecycle.pause(neighbour, PauseMode.MEMORY)
    # No QEMU while paused: no group either.
    assert not any(d.exists() for d in before.dirs)
    await service.lifecycle.resume(neighbour)
    assert_in_its_group(service, neighbour)
    (child,) = await service.snapshots.fork(neighbour, 1)
    child_cg = assert_in_its_group(service, child.id)
    assert (await sh(service, child.id, "echo forked")).strip() == "forked"
    await service.sandboxes.delete(child.id)
    assert not any(d.exists() for d in child_cg.dirs)


async def test_pooled_sandboxes_wait_and_serve_in_their_groups(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    image = ensure_image("base")
    assert isinstance(image, ImageArtifacts)
    state = tmp_path_factory.mktemp("cgpool")
    async with real_service(state, pool_size=1, **_settings()) as svc:
        backend = backend_of(svc)
        first = await svc.sandboxes.create(SandboxSpec(image="base"))  # builds the default template
        for _ in range(900):
            if svc.pool._ready.get((image.name, image.digest)):
                break
            await asyncio.sleep(0.2)
        ready = svc.pool._ready.get((image.name, image.digest))
        assert ready, "the pool was never filled"
        pooled_id = ready[0][0]
        # Waiting in the pool, before it has a row: already in its group.
        assert pooled_id in backend.booter.cgroups.group_names()
        got = await svc.sandboxes.create(SandboxSpec(image="base"))
        assert got.id == pooled_id
        cg = group_of(svc, got.id)
        pid = qemu_pid(svc, got.id)
        assert all(
            pid in {int(p) for p in (d / "cgroup.procs").read_text().split()} for d in cg.dirs
        )
        assert (await sh(svc, got.id, "echo pooled")).strip() == "pooled"
        for sid in (first.id, got.id):
            await svc.sandboxes.delete(sid)
        assert not any(d.exists() for d in cg.dirs)
    # The pool's refill is destroyed at close, with its group; then the sub-tree goes.
    assert not any(d.parent.exists() for d in cg.dirs)
