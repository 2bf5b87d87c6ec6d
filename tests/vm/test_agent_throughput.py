"""Bulk file transfer through a real guest's agent: 100 MiB up and back down, byte-exact.

Uploads were once ~2.3 MB/s under TCG (the agent allocated a 256 KiB buffer per 4 KiB
read of the virtio-serial port); this test proves a 100 MiB round trip works end to end
and prints the rates (``-s``). Rates are reported, not asserted: they depend on the host's
load. The only time limit is a generous overall timeout, so a regression to the old rate
(~45 s per 100 MiB each way under TCG) still passes but shows in the printed numbers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from hutch.guest.client import AgentClient
from hutch.storage.overlay import create_overlay
from hutch.vm.argv import VmConfig
from hutch.vm.process import QemuVm

if TYPE_CHECKING:
    from tests.vm.conftest import GuestFiles

pytestmark = [pytest.mark.vm, pytest.mark.slow]

SIZE = 100 << 20
GUEST_PATH = "/root/big.bin"
TIMEOUT_S = 600.0


async def test_100_mib_round_trip_through_the_agent(
    real_image: GuestFiles, make_vm_config: Callable[..., VmConfig], tmp_path: Path
) -> None:
    disk = tmp_path / "disk.qcow2"
    create_overlay(real_image.rootfs, disk, 2)
    guest = dataclasses.replace(real_image, cmdline=real_image.cmdline + " hutch.hostname=tput")
    cfg = make_vm_config(guest, disk, name="tput", memory_mib=512)
    data = os.urandom(SIZE)
    want = hashlib.sha256(data).hexdigest()
    vm = await QemuVm.launch(cfg, ready_timeout_s=30)
    try:
        async with asyncio.timeout(TIMEOUT_S):
            client = await AgentClient.connect(cfg.agent_socket, timeout_s=120)
            try:
                started = time.monotonic()
                entry = await client.write_file(GUEST_PATH, data)
                up_s = time.monotonic() - started
                assert entry.size == SIZE

                # The guest's own view of the bytes, independent of the download path.
                check = await client.run(["sha256sum", GUEST_PATH])
                assert check.exit_code == 0, check.stderr
                assert check.stdout.split()[0].decode() == want

                started = time.monotonic()
                digest = hashlib.sha256()
                received = 0
                async for chunk in client.read_file(GUEST_PATH):
                    digest.update(chunk)
                    received += len(chunk)
                down_s = time.monotonic() - started
                assert received == SIZE
                assert digest.hexdigest() == want
            finally:
                await client.close()
    finally:
        await vm.kill()
    mib = SIZE / (1 << 20)
    print(
        f"\nupload {mib:.0f} MiB: {up_s:.2f}s ({mib / up_s:.1f} MiB/s); "
        f"download: {down_s:.2f}s ({mib / down_s:.1f} MiB/s)"
    )
