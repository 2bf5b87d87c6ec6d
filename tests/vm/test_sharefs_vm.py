"""Shared volumes on real micro-VMs, at the driver level: the guest kernel's FUSE, the
agent's loop (``guest_agent/hutch_agent/ops_sharefs.py``) and the host server over a
virtio-serial port per mount (``SharePort``), with a host-loop-mounted volume image.

Proves: the guest has /dev/fuse; files written on either side are seen on the other;
escapes from the guest (a symlink to /etc, device nodes, FIFOs, setuid) stay inside or
are refused; a full volume answers ENOSPC and the mount goes on serving; a memory-mode
pause and restore keeps the mount and a file held open across it (the new session is
told by its HELLO, the handle is opened again by path); two fork clones of one frozen
VM each open their own session to the same volume and see each other's writes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import stat
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from hutch.guest.client import AgentClient
from hutch.storage.overlay import create_overlay
from hutch.storage.shared_mounts import SharedMounts
from hutch.storage.sharefs_link import ShareLink
from hutch.storage.volumes import VolumeFiles
from hutch.vm.argv import SharePort, VmConfig, share_port_name
from hutch.vm.process import QemuVm
from hutch.vm.snapshot import create_clone_disk, restore, save_snapshot

if TYPE_CHECKING:
    from tests.vm.conftest import GuestFiles

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]

MIB = 1024**2
VOLUME_BYTES = 64 * MIB
MOUNT = "/mnt/shared"


async def sh(agent: AgentClient, script: str, timeout_s: float = 120) -> str:
    res = await agent.run(shell=script, timeout_s=timeout_s)
    assert res.exit_code == 0, f"{script!r}: {res.exit_code} {res.stderr!r}"
    return res.stdout.decode()


async def sh_fails(agent: AgentClient, script: str) -> str:
    res = await agent.run(shell=script, timeout_s=120)
    assert res.exit_code != 0, f"{script!r} succeeded: {res.stdout!r}"
    return res.stderr.decode()


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


@pytest.fixture
def volume(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB shared volume image, host loop-mounted like hutchd does; the stand-in
    host /etc beside it must stay untouched."""
    files = VolumeFiles(tmp_path / "volumes")
    mounts = SharedMounts(tmp_path / "shared")
    image = files.create("vol-test", VOLUME_BYTES)
    tree = mounts.mount("vol-test", image)
    try:
        yield tree
    finally:
        mounts.sweep(set())


@pytest.fixture
async def cleanup() -> AsyncIterator[list[QemuVm | AgentClient | ShareLink]]:
    things: list[QemuVm | AgentClient | ShareLink] = []
    yield things
    for thing in reversed(things):
        if isinstance(thing, AgentClient | ShareLink):
            await thing.close()
        else:
            await thing.kill()


def _config(
    make_vm_config: Callable[..., VmConfig], image: GuestFiles, tmp_path: Path, name: str
) -> VmConfig:
    disk = tmp_path / f"{name}.qcow2"
    create_overlay(image.rootfs, disk, 2)
    cfg = make_vm_config(image, disk, name=name, memory_mib=256)
    share = SharePort(0, cfg.agent_socket.parent / "share0.sock")
    return dataclasses.replace(cfg, memory_file=tmp_path / f"{name}.ram", shares=(share,))


async def _boot(
    cfg: VmConfig, volume: Path, cleanup: list[QemuVm | AgentClient | ShareLink]
) -> tuple[QemuVm, ShareLink, AgentClient]:
    """``cfg``'s VM booted with its share port served from ``volume``, and its agent."""
    link = ShareLink(cfg.shares[0].socket, volume, read_only=False)
    vm = await QemuVm.launch(cfg, ready_timeout_s=30)
    cleanup.append(vm)
    link.start()
    cleanup.append(link)
    agent = await AgentClient.connect(cfg.agent_socket, timeout_s=120)
    cleanup.append(agent)
    return vm, link, agent


async def test_a_shared_mount_serves_the_guest_and_keeps_it_across_pause(
    real_image: GuestFiles,
    make_vm_config: Callable[..., VmConfig],
    tmp_path: Path,
    volume: Path,
    cleanup: list[QemuVm | AgentClient | ShareLink],
) -> None:
    cfg = _config(make_vm_config, real_image, tmp_path, "sh0")
    vm, link, agent = await _boot(cfg, volume, cleanup)
    assert "fuse" in await sh(agent, "test -c /dev/fuse && cat /proc/filesystems")
    await agent.mount_shared(share_port_name(0), MOUNT)
    await agent.mount_shared(share_port_name(0), MOUNT)  # again: a no-op
    mounts = await sh(agent, f"grep ' {MOUNT} ' /proc/mounts")
    assert "fuse.hutchshare" in mounts and "nosuid" in mounts and "nodev" in mounts, mounts

    # Both ways.
    await sh(agent, f"echo from-guest > {MOUNT}/g && mkdir -p {MOUNT}/d/e && ls -la {MOUNT}")
    assert (volume / "g").read_text() == "from-guest\n"
    assert (volume / "d" / "e").is_dir()
    (volume / "h").write_text("from-host\n")
    assert await sh(agent, f"cat {MOUNT}/h") == "from-host\n"
    await sh(agent, f"mv {MOUNT}/d {MOUNT}/moved && test -d {MOUNT}/moved/e")
    assert (volume / "moved" / "e").is_dir()

    # Throughput, for the log (numbers belong to bench/: `python -m bench volumes`).
    t0 = time.perf_counter()
    await sh(agent, f"dd if=/dev/zero of={MOUNT}/big bs=128k count=128 conv=fsync 2>/dev/null")
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    await sh(agent, f"echo 3 > /proc/sys/vm/drop_caches; cat {MOUNT}/big > /dev/null")
    read_s = time.perf_counter() - t0
    print(f"\nsharefs 16 MiB: write+fsync {16 / write_s:.1f} MiB/s, read {16 / read_s:.1f} MiB/s")
    await sh(agent, f"rm {MOUNT}/big")

    # Escapes: a symlink is text the guest follows in the guest; nothing reaches the host.
    host_passwd = _read("/etc/passwd")
    await sh(agent, f"ln -s /etc {MOUNT}/etc && ln -s ../../.. {MOUNT}/up")
    assert os.readlink(volume / "etc") == "/etc" and os.readlink(volume / "up") == "../../.."
    # Followed in the guest, to the guest's own files; the host never follows them.
    await sh(agent, f"echo guest-only >> {MOUNT}/etc/hutch-probe && cat {MOUNT}/up/etc/hutch-probe")
    assert _read("/etc/passwd") == host_passwd
    assert _read("/etc/hutch-probe") is None
    err = await sh_fails(agent, f"mknod {MOUNT}/null c 1 3")
    assert "not permitted" in err, err
    await sh_fails(agent, f"mkfifo {MOUNT}/fifo")
    assert not (volume / "null").exists() and not (volume / "fifo").exists()
    await sh(agent, f"cp /bin/true {MOUNT}/suid && chmod 4755 {MOUNT}/suid")
    assert stat.S_IMODE((volume / "suid").stat().st_mode) == 0o755
    assert await sh(agent, f"stat -c %a {MOUNT}/suid") == "755\n"
    await sh_fails(agent, f"chown 1000 {MOUNT}/g")

    # Full: ENOSPC before the volume's size, and the mount goes on serving.
    err = await sh_fails(agent, f"dd if=/dev/zero of={MOUNT}/fill bs=1M count=65")
    assert "No space left" in err, err
    assert (volume / "fill").stat().st_size < VOLUME_BYTES
    await sh(agent, f"rm {MOUNT}/fill && echo after-full > {MOUNT}/after")
    assert (volume / "after").read_text() == "after-full\n"

    # A file held open across a memory-mode pause and restore.
    await sh(
        agent,
        f"setsid -f sh -c 'exec 3>{MOUNT}/held; echo before >&3; "
        "while [ ! -e /tmp/go ]; do sleep 0.1; done; echo after >&3; touch /tmp/done' "
        "</dev/null >/dev/null 2>&1",
    )
    for _ in range(100):
        if (volume / "held").exists() and (volume / "held").read_text() == "before\n":
            break
        await asyncio.sleep(0.1)
    await agent.close()
    snap = tmp_path / "snap"
    await save_snapshot(vm, snap, ram_in_file=True)
    sessions_before = link.connections
    vm = await restore(cfg, snap, clone=False)
    cleanup.append(vm)
    agent = await AgentClient.connect(cfg.agent_socket, timeout_s=60)
    cleanup.append(agent)
    await sh(
        agent, "touch /tmp/go; for i in $(seq 100); do [ -e /tmp/done ] && break; sleep 0.1; done"
    )
    assert (volume / "held").read_text() == "before\nafter\n"
    assert link.connections > sessions_before  # a new session served the resumed guest
    assert await sh(agent, f"cat {MOUNT}/g {MOUNT}/h") == "from-guest\nfrom-host\n"
    await sh(agent, f"echo resumed > {MOUNT}/r")
    assert (volume / "r").read_text() == "resumed\n"


async def test_fork_clones_share_one_volume_each_with_its_own_session(
    real_image: GuestFiles,
    make_vm_config: Callable[..., VmConfig],
    tmp_path: Path,
    volume: Path,
    cleanup: list[QemuVm | AgentClient | ShareLink],
) -> None:
    cfg = _config(make_vm_config, real_image, tmp_path, "tpl")
    vm, link, agent = await _boot(cfg, volume, cleanup)
    await agent.mount_shared(share_port_name(0), MOUNT)
    await sh(agent, f"echo template > {MOUNT}/t")
    await agent.close()
    snap = tmp_path / "tpl-snap"
    await save_snapshot(vm, snap, ram_in_file=True)
    await link.close()

    agents = []
    for i in range(2):
        disk = tmp_path / f"c{i}.qcow2"
        await asyncio.to_thread(create_clone_disk, snap, disk)
        c = make_vm_config(real_image, disk, name=f"c{i}", memory_mib=256)
        c = dataclasses.replace(c, shares=(SharePort(0, c.agent_socket.parent / "share0.sock"),))
        child_link = ShareLink(c.shares[0].socket, volume, read_only=False)
        child = await restore(c, snap, clone=True)
        cleanup.append(child)
        child_link.start()
        cleanup.append(child_link)
        a = await AgentClient.connect(c.agent_socket, timeout_s=60)
        cleanup.append(a)
        agents.append(a)
    a0, a1 = agents
    assert await sh(a0, f"cat {MOUNT}/t") == "template\n"
    await sh(a0, f"echo from-c0 > {MOUNT}/c0")
    assert await sh(a1, f"cat {MOUNT}/c0") == "from-c0\n"
    await sh(a1, f"echo from-c1 >> {MOUNT}/c0")
    assert await sh(a0, f"cat {MOUNT}/c0") == "from-c0\nfrom-c1\n"
    assert (volume / "c0").read_text() == "from-c0\nfrom-c1\n"
