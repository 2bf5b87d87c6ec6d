"""Shared fixtures for tests that boot real QEMU guests (``@pytest.mark.vm``).

- ``real_image``: the current build of the ``base`` image (built when missing).
- ``fixture_guest``: a tiny guest built here, for driver-level tests that must not wait
  for the real image: Debian's cloud kernel (``apt-get download``, vmlinux extracted from
  the bzImage's LZ4 payload) and a busybox initramfs whose /init prints
  ``HUTCH-FIXTURE-READY`` to the serial console, echoes lines on the agent port and powers
  off on ``poweroff``. Built once per session.
- ``vm_paths``: a short run dir (unix socket paths are limited to 107 bytes) plus a
  state dir; ``make_vm_config`` turns them into a ``VmConfig``.
- When a test fails, the console and QEMU logs of every VM config it made are printed.
- The VM ladder (``tests/vm/ladder.py``): ``ladder``, ``sandbox_booted``,
  ``sandbox_paused``, ``sandbox_restored``, ``sandbox_forked`` and ``guest`` (each of
  booted, restored, forked); its tests run rung by rung, and a failing one gets every
  ladder sandbox's console and QEMU log.
- ``qemu_census`` (session, autouse): the QEMU boots and restores of the run, per module,
  in the terminal summary (see ``tests/vm/qemu_census.py``).
"""

from __future__ import annotations

import gzip
import io
import os
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hutch.vm.accel import detect_accel, host_tsc_khz
from hutch.vm.argv import VmConfig
from tests.conftest import ensure_image
from tests.e2e.conftest import _LIVE
from tests.netfake import FakeInternet
from tests.vm import ladder as _ladder
from tests.vm.ladder import (  # noqa: F401 (fixtures)
    guest,
    ladder,
    sandbox_booted,
    sandbox_forked,
    sandbox_paused,
    sandbox_restored,
)
from tests.vm.qemu_census import Census

REPO = Path(__file__).resolve().parents[2]
READY_MARKER = "HUTCH-FIXTURE-READY"
AGENT_HELLO = b"HUTCH-FIXTURE-AGENT-HELLO\n"

# Modules the fixture's /init loads, in dependency order (paths under kernel/).
_FIXTURE_MODULES = (
    "drivers/virtio/virtio_ring",
    "drivers/virtio/virtio",
    "drivers/virtio/virtio_mmio",
    "drivers/block/virtio_blk",
    "drivers/char/virtio_console",
    "drivers/char/hw_random/virtio-rng",
)

_FIXTURE_INIT = """#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in virtio_ring virtio virtio_mmio virtio_blk virtio_console virtio-rng; do
  insmod /lib/modules/$m.ko || echo "HUTCH-FIXTURE: insmod $m failed"
done
for i in $(seq 50); do [ -e /sys/class/virtio-ports/vport0p1 ] && break; sleep 0.1; done
echo "HUTCH-FIXTURE: disks: $(ls /sys/block | tr '\\n' ' ')"
echo "HUTCH-FIXTURE: rng: $(cat /sys/class/misc/hw_random/rng_current 2>/dev/null)"
echo "HUTCH-FIXTURE: ports: $(cat /sys/class/virtio-ports/*/name 2>/dev/null)"
cs=/sys/devices/system/clocksource/clocksource0/current_clocksource
echo "HUTCH-FIXTURE: clocksource: $(cat $cs)"
echo "HUTCH-FIXTURE-READY"
for p in /sys/class/virtio-ports/*; do
  if [ "$(cat $p/name)" = org.hutch.agent ]; then
    # A virtio-serial port is opened once, read-write, for the guest's whole life.
    (exec 3<>/dev/$(basename $p); echo "HUTCH-FIXTURE-AGENT-HELLO" >&3
     while read -r line <&3; do
       case "$line" in
         poweroff) echo "HUTCH-FIXTURE: powering off"; reboot -f ;;
         *) echo "echo:$line" >&3 ;;
       esac
     done) &
  fi
done
while true; do sleep 3600; done
"""


@dataclass(frozen=True)
class GuestFiles:
    kernel: Path
    initrd: Path
    rootfs: Path
    cmdline: str


def _extract_vmlinux(bzimage: Path, out: Path) -> None:
    """The bzImage payload is a legacy LZ4 frame at (setup_sects+1)*512+payload_offset."""
    data = bzimage.read_bytes()
    setup_sects = data[0x1F1] or 4
    payload_offset, payload_length = struct.unpack_from("<II", data, 0x248)
    start = (setup_sects + 1) * 512 + payload_offset
    payload = data[start : start + payload_length]
    with out.open("wb") as f:
        # lz4 exits 1 on the size trailer that follows the legacy frame; the ELF check
        # below is what tells a good extraction.
        subprocess.run(
            ["lz4", "-dc"], input=payload, stdout=f, stderr=subprocess.DEVNULL, check=False
        )
    if out.read_bytes()[:4] != b"\x7fELF":
        raise RuntimeError(f"{bzimage}: payload did not decompress to an ELF vmlinux")


def _newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A cpio newc archive of (name, mode, data); directories have empty data."""
    buf = io.BytesIO()
    for ino, (name, mode, data) in enumerate([*entries, ("TRAILER!!!", 0, b"")], 1):
        nameb = name.encode() + b"\0"
        header = "070701" + "".join(
            f"{v:08x}" for v in (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nameb), 0)
        )
        buf.write(header.encode() + nameb)
        buf.write(b"\0" * (-(110 + len(nameb)) % 4))
        buf.write(data)
        buf.write(b"\0" * (-len(data) % 4))
    return buf.getvalue()


def _build_fixture_guest(work: Path) -> GuestFiles:
    deps = subprocess.run(
        ["apt-cache", "depends", "linux-image-cloud-amd64"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    package = next(
        line.split(":", 1)[1].strip()
        for line in deps.splitlines()
        if line.strip().startswith("Depends:") and "linux-image-" in line
    )
    debs = work / "debs"
    debs.mkdir()
    subprocess.run(
        ["apt-get", "download", "-q", package], cwd=debs, check=True, capture_output=True
    )
    tree = work / "pkg"
    subprocess.run(["dpkg-deb", "-x", str(next(debs.glob("*.deb"))), str(tree)], check=True)
    bzimage = next((tree / "boot").glob("vmlinuz-*"))
    release = bzimage.name.removeprefix("vmlinuz-")
    kernel = work / "vmlinux"
    _extract_vmlinux(bzimage, kernel)
    moddir = tree / "lib" / "modules" / release / "kernel"
    entries: list[tuple[str, int, bytes]] = [
        (d, 0o40755, b"") for d in ("bin", "dev", "proc", "sys", "lib", "lib/modules")
    ]
    busybox = shutil.which("busybox") or "/bin/busybox"
    entries.append(("bin/busybox", 0o100755, Path(busybox).read_bytes()))
    entries.append(("init", 0o100755, _FIXTURE_INIT.encode()))
    for mod in _FIXTURE_MODULES:
        ko = moddir / f"{mod}.ko"
        entries.append((f"lib/modules/{ko.name}", 0o100644, ko.read_bytes()))
    initrd = work / "initrd.img"
    initrd.write_bytes(gzip.compress(_newc(entries), compresslevel=1))
    rootfs = work / "rootfs.raw"
    with rootfs.open("wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(rootfs)], check=True)
    shutil.rmtree(tree)
    shutil.rmtree(debs)
    return GuestFiles(kernel, initrd, rootfs, "console=ttyS0 panic=-1 reboot=t")


@pytest.fixture(scope="module")
def fakenet() -> Iterator[FakeInternet]:
    """The fake internet of a network module (its own netns hosts, removed after)."""
    with FakeInternet() as net:
        yield net


@pytest.fixture(scope="session")
def fixture_guest(tmp_path_factory: pytest.TempPathFactory) -> GuestFiles:
    for tool in ("apt-get", "dpkg-deb", "lz4", "mkfs.ext4"):
        if shutil.which(tool) is None:
            pytest.skip(f"building the fixture guest needs {tool}")
    return _build_fixture_guest(tmp_path_factory.mktemp("fixture-guest"))


@pytest.fixture(scope="session")
def real_image() -> GuestFiles:
    """The current build of the ``base`` image (built if missing: never skipped)."""
    from hutch.images.build import ImageArtifacts

    art = ensure_image("base")
    assert isinstance(art, ImageArtifacts)
    return GuestFiles(art.kernel, art.initrd, art.rootfs, art.cmdline)


@dataclass(frozen=True)
class VmPaths:
    run_dir: Path
    state_dir: Path


@pytest.fixture
def vm_paths(tmp_path: Path) -> Iterator[VmPaths]:
    run_dir = Path(tempfile.mkdtemp(prefix="hvm-", dir="/tmp"))
    try:
        yield VmPaths(run_dir, tmp_path)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


_CONFIGS_KEY = pytest.StashKey[list[VmConfig]]()


@pytest.fixture
def make_vm_config(request: pytest.FixtureRequest, vm_paths: VmPaths) -> Callable[..., VmConfig]:
    """``make_vm_config(files, disk, name="t0", vcpus=1, memory_mib=256)``."""
    made = request.node.stash.setdefault(_CONFIGS_KEY, [])
    accel = detect_accel(os.environ.get("HUTCH_ACCEL", "auto"))

    def make(
        files: GuestFiles, disk: Path, name: str = "t0", vcpus: int = 1, memory_mib: int = 256
    ) -> VmConfig:
        sock_dir = vm_paths.run_dir / name
        sock_dir.mkdir(exist_ok=True)
        state = vm_paths.state_dir / name
        state.mkdir(exist_ok=True)
        cfg = VmConfig(
            name=name,
            vcpus=vcpus,
            memory_mib=memory_mib,
            kernel=files.kernel,
            initrd=files.initrd,
            cmdline=files.cmdline,
            disk=disk,
            accel=accel,
            qmp_socket=sock_dir / "qmp.sock",
            agent_socket=sock_dir / "agent.sock",
            console_log=state / "console.log",
            pidfile=state / "qemu.pid",
            qemu_log=state / "qemu.log",
            tsc_khz=host_tsc_khz(),
        )
        made.append(cfg)
        return cfg

    return make


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and (ladder_ := _ladder.ladder_of(item)) is not None:
        report.sections.extend(ladder_.diagnostics())
    if report.failed:
        # The daemons the network modules started (tests/vm/netlab.network_daemon).
        for d in _LIVE:
            report.sections.append((f"hutchd {d.url}", d.diagnostics()))
        for cfg in item.stash.get(_CONFIGS_KEY, []):
            for label, path in (("console", cfg.console_log), ("qemu", cfg.qemu_log)):
                try:
                    text = path.read_text(errors="replace")[-6000:]
                except OSError:
                    continue
                report.sections.append((f"VM {cfg.name} {label} log ({path})", text))
    return report


_CENSUS = Census()


@pytest.fixture(scope="session", autouse=True)
def qemu_census() -> Iterator[Census]:
    _CENSUS.start()
    yield _CENSUS
    _CENSUS.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _CENSUS.boots or _CENSUS.restores:
        terminalreporter.section("QEMU launches (tests/vm/qemu_census.py)")
        for line in _CENSUS.report():
            terminalreporter.line(line)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    _ladder.order_items(items)
