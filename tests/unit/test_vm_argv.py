from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hutch.errors import InvalidArgument
from hutch.runtime.qemu.host import SandboxPaths
from hutch.vm.argv import SharePort, VmConfig, build_argv, guest_cmdline

CFG = VmConfig(
    name="sb-0123456789ab",
    vcpus=2,
    memory_mib=512,
    kernel=Path("/img/vmlinux"),
    initrd=Path("/img/initrd.img"),
    cmdline="console=ttyS0 quiet",
    disk=Path("/state/sandboxes/sb/disk.qcow2"),
    accel="tcg",
    qmp_socket=Path("/run/hutch/abc/sb/qmp.sock"),
    agent_socket=Path("/run/hutch/abc/sb/agent.sock"),
    console_log=Path("/state/sandboxes/sb/console.log"),
    pidfile=Path("/state/sandboxes/sb/qemu.pid"),
    qemu_log=Path("/state/sandboxes/sb/qemu.log"),
    tsc_khz=2445404,
)


def _opt(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_machine_accel_shape() -> None:
    argv = build_argv(CFG)
    assert argv[0] == "qemu-system-x86_64"
    assert _opt(argv, "-M") == ["microvm,x-option-roms=off,isa-serial=on,rtc=off"]
    assert _opt(argv, "-accel") == ["tcg,thread=multi"]
    assert _opt(argv, "-cpu") == ["max,-erms,-fsrm"]
    assert _opt(argv, "-smp") == ["2"]
    assert _opt(argv, "-m") == ["512M"]
    for flag in ("-nodefaults", "-no-user-config", "-nographic", "-no-reboot"):
        assert flag in argv
    assert _opt(argv, "-display") == ["none"]
    kvm = build_argv(replace(CFG, accel="kvm"))
    assert _opt(kvm, "-accel") == ["kvm"]
    assert _opt(kvm, "-cpu") == ["host"]


def test_devices_and_sockets() -> None:
    argv = build_argv(CFG)
    drive = _opt(argv, "-drive")[0]
    assert drive.startswith("id=root,if=none,file=/state/sandboxes/sb/disk.qcow2,format=qcow2")
    assert "discard=unmap" in drive
    devices = _opt(argv, "-device")
    assert "virtio-blk-device,drive=root" in devices
    assert "virtserialport,chardev=agent,name=org.hutch.agent" in devices
    assert "virtio-rng-device,rng=rng0" in devices
    assert "rng-random,id=rng0,filename=/dev/urandom" in _opt(argv, "-object")
    chardevs = _opt(argv, "-chardev")
    assert "socket,id=agent,path=/run/hutch/abc/sb/agent.sock,server=on,wait=off" in chardevs
    assert "socket,id=qmp,path=/run/hutch/abc/sb/qmp.sock,server=on,wait=off" in chardevs
    # The console goes into the FIFO pair console.in/.out, drained by the daemon into
    # the capped console.log (hutch.vm.console); QEMU never writes the log itself.
    assert "pipe,id=console,path=/state/sandboxes/sb/console" in chardevs
    assert not any("console.log" in a for a in argv)
    assert _opt(argv, "-mon") == ["chardev=qmp,mode=control"]
    assert "-monitor" not in argv
    assert _opt(argv, "-pidfile") == ["/state/sandboxes/sb/qemu.pid"]
    assert _opt(argv, "-sandbox") == [
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
    ]
    assert not any("netdev" in a for a in argv)


def test_kernel_and_cmdline() -> None:
    argv = build_argv(CFG)
    assert _opt(argv, "-kernel") == ["/img/vmlinux"]
    assert _opt(argv, "-initrd") == ["/img/initrd.img"]
    assert _opt(argv, "-append") == ["console=ttyS0 quiet tsc_early_khz=2445404 tsc=reliable"]
    # KVM guests have kvmclock; no TSC hint.
    assert guest_cmdline(replace(CFG, accel="kvm")) == "console=ttyS0 quiet"
    assert guest_cmdline(replace(CFG, tsc_khz=None)) == "console=ttyS0 quiet"


def test_commas_in_paths_are_escaped() -> None:
    argv = build_argv(replace(CFG, disk=Path("/a,b/disk.qcow2")))
    assert "file=/a,,b/disk.qcow2," in _opt(argv, "-drive")[0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vcpus": 0}, "vcpus=0"),
        ({"vcpus": 64}, "vcpus=64"),
        ({"vcpus": True}, "vcpus=True"),
        ({"memory_mib": 64}, "memory_mib=64"),
        ({"memory_mib": 1 << 20}, "memory_mib="),
        ({"accel": "auto"}, "detect_accel"),
        ({"name": "a,b"}, "VM name"),
        ({"qmp_socket": Path("/run/" + "x" * 120)}, "longer than 107"),
        ({"cmdline": "a\nb"}, "newline"),
        ({"tsc_khz": 5}, "tsc_khz"),
        ({"console_log_bytes": 100}, "console_log_bytes=100"),
    ],
)
def test_absurd_values_are_refused(change: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        build_argv(replace(CFG, **change))  # type: ignore[arg-type]


def test_qemu_drops_to_an_unprivileged_user() -> None:
    argv = build_argv(replace(CFG, run_as="hutch-qemu"))
    assert _opt(argv, "-runas") == ["hutch-qemu"]
    # QEMU's own setuid needs elevateprivileges=allow; the rest of the filter stays.
    assert _opt(argv, "-sandbox") == [
        "on,obsolete=deny,elevateprivileges=allow,spawn=deny,resourcecontrol=deny"
    ]
    assert _opt(build_argv(replace(CFG, run_as="999:995")), "-runas") == ["999:995"]
    assert "-runas" not in build_argv(CFG)
    for bad in ("root;rm", "Hutch", "", "a" * 40, "999:", ":995", "999:995:1", "-1:0"):
        with pytest.raises(InvalidArgument, match="run_as"):
            build_argv(replace(CFG, run_as=bad))


def test_shared_volumes_get_a_port_each_and_nothing_changes_without_them() -> None:
    from hutch.vm.argv import VolumeDrive

    plain = build_argv(CFG)
    # No share: the device set of every sandbox, template and snapshot made before.
    assert "virtio-serial-device,max_ports=2" in _opt(plain, "-device")
    assert not any("share" in c for c in _opt(plain, "-chardev"))
    cfg = replace(
        CFG,
        volumes=(VolumeDrive(Path("/v/vol-a.img"), "vol-a", slot=1),),
        shares=(SharePort(0, Path("/run/s/share0.sock")), SharePort(2, Path("/run/s/share2.sock"))),
    )
    argv = build_argv(cfg)
    devices = _opt(argv, "-device")
    assert "virtio-serial-device,max_ports=4" in devices
    assert "virtserialport,chardev=share0,name=org.hutch.vol.0" in devices
    assert "virtserialport,chardev=share2,name=org.hutch.vol.2" in devices
    assert "socket,id=share2,path=/run/s/share2.sock,server=on,wait=off" in _opt(argv, "-chardev")
    # The exclusive volume keeps its mount slot as its drive name (what block_resize takes).
    assert any(d.startswith("id=vol1,") for d in _opt(argv, "-drive"))
    with pytest.raises(InvalidArgument, match="distinct"):
        build_argv(replace(cfg, shares=(SharePort(1, Path("/run/s/x.sock")),)))
    with pytest.raises(InvalidArgument, match="distinct"):
        build_argv(replace(cfg, shares=(SharePort(8, Path("/run/s/x.sock")),)))


def test_relocate_gives_a_config_the_sandboxs_own_files_and_keeps_the_rest() -> None:
    """Fork children, configurations fetched from another host and the rebase helper
    all take a config whose files are another sandbox's (SandboxPaths.relocate)."""
    shares = (SharePort(1, Path("/run/x/share1.sock")), SharePort(3, Path("/y")))
    other = replace(CFG, shares=shares, name="sb-other", memory_mib=256)
    p = SandboxPaths(state=Path("/s/sb-new"), run=Path("/r/sb-new"))
    moved = p.relocate(other)
    assert (moved.disk, moved.qmp_socket, moved.agent_socket) == (
        Path("/s/sb-new/disk.qcow2"), Path("/r/sb-new/qmp.sock"), Path("/r/sb-new/agent.sock"),
    )  # fmt: skip
    assert (moved.console_log, moved.pidfile, moved.qemu_log) == (
        Path("/s/sb-new/console.log"), Path("/s/sb-new/qemu.pid"), Path("/s/sb-new/qemu.log"),
    )  # fmt: skip
    assert moved.shares == (
        SharePort(1, Path("/r/sb-new/share1.sock")), SharePort(3, Path("/r/sb-new/share3.sock")),
    )  # fmt: skip
    relocated = {"disk", "qmp_socket", "agent_socket", "console_log", "pidfile", "qemu_log"}
    for field in CFG.__dataclass_fields__:
        if field not in relocated | {"shares"}:
            assert getattr(moved, field) == getattr(other, field), field
