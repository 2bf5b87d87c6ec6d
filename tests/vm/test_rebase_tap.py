"""The rebase of a full-stream snapshot (``hutch.vm.snapshot_rebase``) of a VM whose NIC
is on a tap, as every networked sandbox's is.

QEMU records in the stream that the tap gave the NIC a vnet header, and refuses to load
it into a NIC on a hub port ("saved image requires vnet_hdr=on"): a helper without the
tap failed every rebase of a networked sandbox (and the fork went on with the full
stream). No guest needs to boot: the NIC's backend state is the host's side.

The taps are QEMU's own (an ``ifname`` that does not exist yet is created by QEMU, still
root when it opens it, and is gone when QEMU exits): nothing is left on the host.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from hutch.storage.overlay import create_overlay
from hutch.vm.argv import VmConfig
from hutch.vm.process import QemuVm
from hutch.vm.snapshot import MEMORY_FILE, create_clone_disk, restore, save_snapshot
from hutch.vm.snapshot_dir import load_manifest
from hutch.vm.snapshot_rebase import rebase_memory
from tests.vm.conftest import GuestFiles

pytestmark = [pytest.mark.vm, pytest.mark.asyncio, pytest.mark.timeout(120)]

MIB = 256


@pytest.fixture
async def vms() -> AsyncIterator[list[QemuVm]]:
    """Every QEMU the test starts, killed in the finalizer."""
    made: list[QemuVm] = []
    yield made
    for vm in made:
        await vm.kill(grace_s=0)


def _tap(label: str) -> str:
    # [a-z0-9]{1,15}, unique on the host while the test runs.
    return f"hrb{label}{os.getpid() % 1_000_000}"


async def test_a_snapshot_of_a_vm_on_a_tap_rebases_and_its_clone_loads(
    make_vm_config: Callable[..., VmConfig],
    real_image: GuestFiles,
    tmp_path: Path,
    vms: list[QemuVm],
) -> None:
    template_ram = tmp_path / "template.ram"
    with template_ram.open("wb") as f:
        f.truncate(MIB << 20)
    disk = tmp_path / "src.qcow2"
    create_overlay(real_image.rootfs, disk, 2)
    # A template clone as the daemon runs one: RAM a private mapping of a memory file
    # (so the stream names a memory-backend block), NIC on its own tap.
    src = dataclasses.replace(
        make_vm_config(real_image, disk, name="src", memory_mib=MIB),
        memory_file=template_ram,
        memory_shared=False,
        nic=True,
        tap=_tap("s"),
    )
    vm = await QemuVm.launch(src, ready_timeout_s=20)
    vms.append(vm)
    snap = tmp_path / "snap"
    full = await save_snapshot(vm, snap, ram_in_file=False)
    assert not full.ram_in_file

    helper_disk = tmp_path / "helper.qcow2"
    create_clone_disk(snap, helper_disk)
    helper = dataclasses.replace(
        make_vm_config(real_image, helper_disk, name="helper", memory_mib=MIB),
        memory_file=template_ram,
        memory_shared=False,
        nic=True,
        tap=src.tap,  # free: the VM it belongs to has ended
    )
    rebased = await rebase_memory(snap, full, helper, qemu_version=full.qemu_version)
    assert rebased.ram_in_file
    assert rebased.state_size < 4 << 20, "the stream still carries the RAM"
    assert (snap / MEMORY_FILE).stat().st_size == MIB << 20
    assert load_manifest(snap).ram_in_file

    # A child restores from it on a tap of its own: the rebased stream loads.
    child_disk = tmp_path / "child.qcow2"
    create_clone_disk(snap, child_disk)
    child_cfg = dataclasses.replace(
        make_vm_config(real_image, child_disk, name="child", memory_mib=MIB),
        memory_file=snap / MEMORY_FILE,
        memory_shared=False,
        nic=True,
        tap=_tap("c"),
    )
    child = await restore(child_cfg, snap, clone=True)
    vms.append(child)
    assert await child.query_status() == "running"
