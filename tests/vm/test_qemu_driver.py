"""The QEMU driver against real QEMU: boot, QMP, console, agent port, kill, crash,
adopt after a daemon restart, and no leftovers. Timings go to stdout (``-s``)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from hutch.errors import StateError, VmError
from hutch.storage.overlay import create_overlay
from hutch.vm.argv import VmConfig
from hutch.vm.process import QemuVm, VmState

if TYPE_CHECKING:
    from tests.vm.conftest import GuestFiles

# Printed by the fixture guest's /init (tests/vm/conftest.py).
READY_MARKER = "HUTCH-FIXTURE-READY"
AGENT_HELLO = b"HUTCH-FIXTURE-AGENT-HELLO\n"

pytestmark = [pytest.mark.vm, pytest.mark.slow]

BOOT_TIMEOUT_S = 90.0


async def _wait_console(cfg: VmConfig, marker: str, timeout_s: float = BOOT_TIMEOUT_S) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if marker in cfg.console_log.read_text(errors="replace"):
                return time.monotonic() - start
        except FileNotFoundError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"{marker!r} not on the console after {timeout_s}s")


async def _agent_connect(
    cfg: VmConfig, timeout_s: float = BOOT_TIMEOUT_S
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_unix_connection(str(cfg.agent_socket)), timeout_s)


def _no_leftovers(vm: QemuVm) -> None:
    assert not Path(f"/proc/{vm.pid}").exists() or not vm.is_alive()
    for path in (vm.cfg.qmp_socket, vm.cfg.agent_socket, vm.cfg.pidfile):
        assert not path.exists(), f"{path} left behind"


@pytest.fixture
async def launched(
    fixture_guest: GuestFiles, make_vm_config: Callable[..., VmConfig], tmp_path: Path
) -> AsyncIterator[QemuVm]:
    """A fixture guest launched (QMP ready), killed in the finalizer."""
    disk = tmp_path / "disk.qcow2"
    create_overlay(fixture_guest.rootfs, disk, 2)
    cfg = make_vm_config(fixture_guest, disk)
    t0 = time.monotonic()
    vm = await QemuVm.launch(cfg, ready_timeout_s=20)
    print(f"\nlaunch → QMP ready: {time.monotonic() - t0:.3f}s")
    try:
        yield vm
    finally:
        await vm.kill()


async def test_boot_console_agent_and_kill(launched: QemuVm) -> None:
    vm = launched
    assert vm.state is VmState.RUNNING
    assert await vm.query_status() == "running"
    assert int(vm.cfg.pidfile.read_text()) == vm.pid
    boot_s = await _wait_console(vm.cfg, READY_MARKER)
    print(f"QMP ready → console marker: {boot_s:.3f}s")
    console = vm.cfg.console_log.read_text()
    # Every device the argv adds is seen by the guest.
    assert "disks: vda" in console
    assert "rng: virtio_rng" in console
    assert "ports: org.hutch.agent" in console
    reader, writer = await _agent_connect(vm.cfg)
    try:
        assert await asyncio.wait_for(reader.readline(), 10) == AGENT_HELLO
        writer.write(b"ping\n")
        assert await asyncio.wait_for(reader.readline(), 10) == b"echo:ping\n"
    finally:
        writer.close()
    t0 = time.monotonic()
    await vm.kill()
    print(f"kill: {time.monotonic() - t0:.3f}s")
    assert vm.state.value == "exited"
    assert vm.exit_reason == "killed by hutch"
    _no_leftovers(vm)
    await vm.kill()  # idempotent
    with pytest.raises(StateError):
        await vm.query_status()


async def test_guest_poweroff_is_detected(launched: QemuVm) -> None:
    vm = launched
    reader, writer = await _agent_connect(vm.cfg)
    try:
        assert await asyncio.wait_for(reader.readline(), BOOT_TIMEOUT_S) == AGENT_HELLO
        writer.write(b"poweroff\n")
        t0 = time.monotonic()
        await asyncio.wait_for(vm.wait_exited(), 20)
        print(f"\nguest poweroff → wait_exited: {time.monotonic() - t0:.3f}s")
    finally:
        writer.close()
    assert not vm.is_alive()
    assert vm.returncode == 0
    assert vm.exit_reason == "exit status 0"
    await vm.kill()
    _no_leftovers(vm)


async def test_qemu_killed_from_outside_is_detected(launched: QemuVm) -> None:
    vm = launched
    os.kill(vm.pid, signal.SIGKILL)
    await asyncio.wait_for(vm.wait_exited(), 5)
    assert vm.exit_reason == "signal SIGKILL"
    assert vm.state is VmState.EXITED
    await vm.kill()
    _no_leftovers(vm)


async def test_sandbox_is_active(launched: QemuVm) -> None:
    status = await asyncio.to_thread(Path(f"/proc/{launched.pid}/status").read_text)
    assert "Seccomp:\t2" in status, "QEMU runs without its seccomp filter"


async def test_adopt_after_daemon_restart(
    fixture_guest: GuestFiles, make_vm_config: Callable[..., VmConfig], tmp_path: Path
) -> None:
    disk = tmp_path / "disk.qcow2"
    create_overlay(fixture_guest.rootfs, disk, 2)
    cfg = make_vm_config(fixture_guest, disk)
    first = await QemuVm.launch(cfg, ready_timeout_s=20)
    adopted: QemuVm | None = None
    try:
        # The "old daemon" goes away without killing QEMU: drop its QMP connection.
        await first._disconnect_qmp()
        adopted = await QemuVm.adopt(cfg)
        assert adopted is not None
        assert adopted.pid == first.pid
        assert await adopted.query_status() == "running"
        await adopted.kill()
        await asyncio.wait_for(first.wait_exited(), 5)
        assert adopted.state is VmState.EXITED
        _no_leftovers(adopted)
        assert await QemuVm.adopt(cfg) is None
    finally:
        if adopted is not None:
            await adopted.kill()
        await first.kill()


async def test_adopt_refuses_a_reused_pid(
    fixture_guest: GuestFiles, make_vm_config: Callable[..., VmConfig], tmp_path: Path
) -> None:
    cfg = make_vm_config(fixture_guest, tmp_path / "unused.qcow2")
    sleeper = await asyncio.create_subprocess_exec("sleep", "30")
    try:
        cfg.pidfile.write_text(f"{sleeper.pid}\n")
        assert await QemuVm.adopt(cfg) is None
        assert sleeper.returncode is None  # not signalled
    finally:
        sleeper.kill()
        await sleeper.wait()


async def test_launch_failure_reports_argv_and_stderr(
    fixture_guest: GuestFiles, make_vm_config: Callable[..., VmConfig], tmp_path: Path
) -> None:
    cfg = make_vm_config(fixture_guest, tmp_path / "missing.qcow2")
    with pytest.raises(VmError) as info:
        await QemuVm.launch(cfg, ready_timeout_s=10)
    assert "missing.qcow2" in info.value.stderr
    assert info.value.argv[0] == "qemu-system-x86_64"
    for path in (cfg.qmp_socket, cfg.agent_socket, cfg.pidfile):
        assert not path.exists()


async def test_real_image_boots_to_agent_socket(
    real_image: GuestFiles, make_vm_config: Callable[..., VmConfig], tmp_path: Path
) -> None:
    disk = tmp_path / "disk.qcow2"
    create_overlay(real_image.rootfs, disk, 4)
    cfg = make_vm_config(real_image, disk, memory_mib=512)
    t0 = time.monotonic()
    vm = await QemuVm.launch(cfg, ready_timeout_s=20)
    try:
        _reader, writer = await _agent_connect(cfg)
        writer.close()
        # The chardev accepts as soon as QEMU listens; the guest proves itself on the
        # console (its init execs the agent).
        print(f"\nreal image: launch → agent socket connected {time.monotonic() - t0:.3f}s")
        assert vm.is_alive()
        assert await vm.query_status() == "running"
    finally:
        await vm.kill()
    _no_leftovers(vm)
