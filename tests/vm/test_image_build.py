"""The built ``base`` image, booted for real: what its init promises the rest of hutch.

Builds the image if missing or stale (cached: seconds), boots it with the QEMU driver on
a qcow2 overlay bigger than the image, and checks through the agent what the image
contract says: mounts, hostname from the command line, root fs grown to the disk, the
``user`` account, the agent file, the named virtio-serial port.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hutch.guest.client import AgentClient
from hutch.images.build import DEFAULT_AGENT_PATH, agent_files, build_image
from hutch.storage.overlay import create_overlay
from hutch.vm.argv import VmConfig
from hutch.vm.process import QemuVm
from tests.conftest import test_images_dir
from tests.vm.conftest import GuestFiles as _GuestFiles

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(900)]

DISK_GIB = 3


async def _sh(agent: AgentClient, script: str) -> str:
    result = await agent.run(shell=script, timeout_s=60)
    assert result.exit_code == 0, (script, result.stdout, result.stderr)
    return result.stdout.decode()


async def test_base_image_boots_with_its_contract(
    make_vm_config: Callable[..., VmConfig], tmp_path: Path
) -> None:
    arts = build_image("base", test_images_dir())
    assert arts.rootfs.stat().st_mode & 0o777 == 0o444
    assert arts.size_bytes < DISK_GIB << 30
    cmdline = f"{arts.cmdline} hutch.hostname=imgtest hutch.dns=10.0.2.3,10.0.2.4"
    guest = _GuestFiles(arts.kernel, arts.initrd, arts.rootfs, cmdline)
    disk = tmp_path / "disk.qcow2"
    create_overlay(arts.rootfs, disk, DISK_GIB)
    cfg = make_vm_config(guest, disk, memory_mib=512)
    t0 = time.monotonic()
    vm = await QemuVm.launch(cfg, ready_timeout_s=30)
    try:
        agent = await AgentClient.connect(cfg.agent_socket, timeout_s=120)
        print(f"\nbase image: launch -> agent handshake {time.monotonic() - t0:.2f}s")
        try:
            assert (await _sh(agent, "hostname")).strip() == "imgtest"
            assert "127.0.1.1\timgtest" in await _sh(agent, "cat /etc/hosts")
            assert (await _sh(agent, "cat /etc/resolv.conf")) == (
                "nameserver 10.0.2.3\nnameserver 10.0.2.4\n"
            ), await _sh(agent, "cat /proc/cmdline")
            mounts = {
                line.split()[1]: line.split()[2]
                for line in (await _sh(agent, "cat /proc/mounts")).splitlines()
            }
            assert mounts["/"] == "ext4"
            for path, fstype in {
                "/proc": "proc",
                "/sys": "sysfs",
                "/dev": "devtmpfs",
                "/dev/pts": "devpts",
                "/run": "tmpfs",
                "/tmp": "tmpfs",
            }.items():
                assert mounts.get(path) == fstype, (path, mounts)
            assert (await _sh(agent, "id -u user; echo ~user")).split() == ["1000", "/home/user"]
            assert (await _sh(agent, "pwd")).strip() == "/root"
            for rel in agent_files(DEFAULT_AGENT_PATH):  # the launcher and the package
                guest_sha = (await _sh(agent, f"sha256sum /opt/hutch/{rel}")).split()[0]
                host_sha = hashlib.sha256((DEFAULT_AGENT_PATH / rel).read_bytes()).hexdigest()
                assert guest_sha == host_sha, rel
            assert (await _sh(agent, "readlink /dev/virtio-ports/org.hutch.agent")).startswith(
                "../vport"
            )
            assert "UP" in await _sh(agent, "ip -o link show lo")
            # resize2fs runs in the background at boot: wait for the fs to reach the disk.
            deadline = time.monotonic() + 120
            while True:
                size = int(await _sh(agent, "df -B1 --output=size / | tail -1"))
                if size > (DISK_GIB << 30) * 9 // 10 or time.monotonic() > deadline:
                    break
                await agent.run(["sleep", "1"])
            assert size > (DISK_GIB << 30) * 9 // 10, await _sh(agent, "cat /run/resize2fs.log")
        finally:
            await agent.close()
    finally:
        await vm.kill()
