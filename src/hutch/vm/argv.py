"""The QEMU command line for one sandbox (pure: no I/O).

Every choice here was measured on our hosts (QEMU 7.2, Debian cloud kernel 6.1, TCG);
see ARCHITECTURE.md "vm/" for the numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from hutch.config import TCG_TB_MIB_RANGE
from hutch.errors import InvalidArgument
from hutch.models import MEMORY_MIB_RANGE, VCPUS_RANGE
from hutch.vm.console import DEFAULT_LOG_BYTES, MIN_LOG_BYTES, console_fifo

__all__ = [
    "AGENT_PORT_NAME",
    "MACHINE",
    "MEMORY_BACKEND_ID",
    "SANDBOX",
    "SharePort",
    "VmConfig",
    "VolumeDrive",
    "build_argv",
    "guest_cmdline",
    "in_cgroups",
    "share_port_name",
    "volume_drive_id",
]

#: The virtio-serial port name the guest agent looks for.
AGENT_PORT_NAME = "org.hutch.agent"

# ACPI stays on: the cloud kernel has no CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES, so ACPI
# (DSDT) is the only way it finds the virtio-mmio devices. The PIT and PIC stay on (the
# default): with pit=off or pic=off the TCG guest has no tick and hangs at boot.
MACHINE = "microvm,x-option-roms=off,isa-serial=on,rtc=off"

#: The ``-object`` id of the file-backed guest RAM (``VmConfig.memory_file``).
MEMORY_BACKEND_ID = "mem"

#: seccomp policy. spawn=deny means ``exec:`` migration URIs kill QEMU (use ``fd:``).
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
# With -runas QEMU itself calls setgid/setuid once set up, which elevateprivileges=deny
# forbids; afterwards it has no privilege left to elevate to.
SANDBOX_RUNAS = SANDBOX.replace("elevateprivileges=deny", "elevateprivileges=allow")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_TAP_RE = re.compile(r"^[a-z0-9]{1,15}$")
#: A user name, or ``uid:gid`` (what hutchd gives: QEMU then looks nothing up).
_USER_RE = re.compile(r"^(?:[a-z_][a-z0-9_-]{0,31}|[0-9]{1,10}:[0-9]{1,10})$")
# sun_path is 108 bytes including the NUL.
_MAX_SOCKET_PATH = 107
# khz range of any x86 TSC we would believe (100 MHz - 10 GHz).
_TSC_KHZ_RANGE = (100_000, 10_000_000)

#: Without the fast-string flags the guest kernel and libc copy memory with SSE loops;
#: TCG emulates `rep movsb` 10-30x slower (64 KiB copies: 50 vs 1800 MiB/s measured).
TCG_CPU = "max,-erms,-fsrm"


@dataclass(frozen=True)
class VolumeDrive:
    """A volume attached as a virtio-blk device: a raw file, found in the guest by its
    ``serial`` (the volume id, at most 20 bytes: virtio-blk's limit)."""

    path: Path
    serial: str
    read_only: bool = False
    #: The mount slot (its drive is ``vol<slot>``); None: its index in
    #: ``VmConfig.volumes`` (configurations saved before shared volumes had slots).
    slot: int | None = None


def volume_drive_id(slot: int) -> str:
    """The QEMU drive (block backend) name of volume ``slot``: what ``block_resize`` takes."""
    return f"vol{slot}"


_SERIAL_RE = re.compile(r"^[A-Za-z0-9-]{1,20}$")


@dataclass(frozen=True)
class SharePort:
    """A shared volume's channel: a virtserialport named ``share_port_name(slot)`` whose
    chardev is a unix socket server at ``socket`` that hutchd connects to (and connects
    to again after a restart). Only a virtio-serial port: nothing of the volume is QEMU
    device state, so a VM with it pauses with memory, forks and restores."""

    slot: int
    socket: Path


def share_port_name(slot: int) -> str:
    """The port name the guest agent opens for the shared mount in ``slot``."""
    return f"org.hutch.vol.{slot}"


#: Mount slots (exclusive and shared together) a sandbox may have.
MAX_MOUNT_SLOTS = 8


@dataclass(frozen=True)
class VmConfig:
    """Everything QEMU needs to run one sandbox. Paths should be absolute.

    ``tsc_khz`` (TCG only): the host TSC rate. Under TCG the guest TSC *is* the host TSC,
    and the guest kernel's own calibration against the PIT fails at random under TCG
    ("tsc: Unable to calibrate against PIT"), after which the guest hangs without a
    tick. Passing the rate on the kernel command line makes boot deterministic.

    ``memory_file`` (default None: anonymous RAM): guest RAM is this file, mapped by a
    ``memory-backend-file``; ``memory_shared`` picks MAP_SHARED (guest writes land in the
    file: the fast snapshot path, see ``hutch.vm.snapshot``) or MAP_PRIVATE
    (copy-on-write over a frozen template file: clones). ``incoming`` adds
    ``-incoming defer``: QEMU starts paused and waits for ``migrate-incoming``.

    ``console_log``: where the daemon keeps the serial console, rotated at
    ``console_log_bytes`` (``hutch.vm.console``); QEMU itself writes into the FIFO
    beside it (``console.out``), never into the log.
    """

    name: str
    vcpus: int
    memory_mib: int
    kernel: Path
    initrd: Path
    cmdline: str
    disk: Path
    accel: str
    qmp_socket: Path
    agent_socket: Path
    console_log: Path
    pidfile: Path
    qemu_log: Path
    tsc_khz: int | None = None
    memory_file: Path | None = None
    memory_shared: bool = True
    incoming: bool = False
    # A virtio-net NIC. False only in configurations saved before NICs existed: a
    # snapshot restores only into the same set of devices.
    nic: bool = False
    #: The host tap the NIC is plugged into; None: a hub port that leads nowhere
    #: (network "none", templates). Backends are not part of the migrated state, so a
    #: clone of a template can be given its own tap.
    tap: str | None = None
    #: The unprivileged user QEMU drops to (``-runas``) once it has opened everything it
    #: needs (disk, kernel, tap, sockets, log files), as ``uid:gid`` or a name; None: it
    #: keeps the daemon's user.
    run_as: str | None = None
    #: A second, read-only raw disk with the guest agent's own runtime (imported OCI
    #: images, see ``hutch.images.agent_runtime``), found by the guest by its serial.
    runtime_disk: Path | None = None
    #: Bytes of serial console kept per log file (``console.log`` and ``.1``).
    console_log_bytes: int = DEFAULT_LOG_BYTES
    #: TCG's translation cache in MiB (``tb-size``); None: QEMU's default, 1 GiB, which
    #: a busy guest fills and which is host memory that is not guest RAM.
    tcg_tb_mib: int | None = None
    #: Volumes, in slot order (``vol0``, ``vol1``, ...). Part of the device set: a VM
    #: saved with them restores only with them (pause/resume keeps them attached).
    volumes: tuple[VolumeDrive, ...] = ()
    #: Shared volumes' ports, one per shared mount. Part of the device set like
    #: ``volumes`` (the port count is in ``max_ports``): a VM saved with them restores
    #: only with them. None of them: the same command line as before they existed.
    shares: tuple[SharePort, ...] = ()


def _opt(path: Path) -> str:
    """A path as a QEMU option value: commas are separators, so double them."""
    return str(path).replace(",", ",,")


def _validate(cfg: VmConfig) -> None:
    if not _NAME_RE.match(cfg.name):
        raise InvalidArgument(
            f"VM name {cfg.name!r} is not valid; use 1-64 letters, digits, '_', '.', '-'"
        )
    for field, value, bounds in (
        ("vcpus", cfg.vcpus, VCPUS_RANGE),
        ("memory_mib", cfg.memory_mib, MEMORY_MIB_RANGE),
    ):
        lo, hi = bounds
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise InvalidArgument(f"{field}={value!r} is out of range; accepted: {lo}-{hi}")
    if cfg.accel not in ("kvm", "tcg"):
        raise InvalidArgument(f"accel={cfg.accel!r}; resolve 'auto' with detect_accel() first")
    for field, sock in (("qmp_socket", cfg.qmp_socket), ("agent_socket", cfg.agent_socket)):
        if len(str(sock).encode()) > _MAX_SOCKET_PATH:
            raise InvalidArgument(
                f"{field} {str(sock)!r} is longer than {_MAX_SOCKET_PATH} bytes; "
                "use a shorter run directory"
            )
    if "\0" in cfg.cmdline or "\n" in cfg.cmdline:
        raise InvalidArgument("kernel cmdline contains a NUL or newline")
    if cfg.tsc_khz is not None and not _TSC_KHZ_RANGE[0] <= cfg.tsc_khz <= _TSC_KHZ_RANGE[1]:
        raise InvalidArgument(f"tsc_khz={cfg.tsc_khz} is not a plausible TSC rate")
    if cfg.tap is not None and not _TAP_RE.match(cfg.tap):
        raise InvalidArgument(f"tap {cfg.tap!r} is not a valid interface name (1-15 [a-z0-9])")
    if cfg.memory_file is not None and not cfg.memory_file.is_absolute():
        raise InvalidArgument(f"memory_file {str(cfg.memory_file)!r} must be an absolute path")
    if cfg.runtime_disk is not None and not cfg.runtime_disk.is_absolute():
        raise InvalidArgument(f"runtime_disk {str(cfg.runtime_disk)!r} must be an absolute path")
    for vol in cfg.volumes:
        if not vol.path.is_absolute():
            raise InvalidArgument(f"volume file {str(vol.path)!r} must be an absolute path")
        if not _SERIAL_RE.match(vol.serial):
            raise InvalidArgument(f"volume serial {vol.serial!r}: 1-20 letters, digits, '-'")
    slots = [v.slot if v.slot is not None else i for i, v in enumerate(cfg.volumes)]
    slots += [p.slot for p in cfg.shares]
    if len(set(slots)) != len(slots) or any(
        isinstance(n, bool) or not 0 <= n < MAX_MOUNT_SLOTS for n in slots
    ):
        raise InvalidArgument(
            f"mount slots {slots} (volumes, then shares): distinct, 0-{MAX_MOUNT_SLOTS - 1}"
        )
    for share in cfg.shares:
        if len(str(share.socket).encode()) > _MAX_SOCKET_PATH:
            raise InvalidArgument(
                f"share socket {str(share.socket)!r} is longer than {_MAX_SOCKET_PATH} "
                "bytes; use a shorter run directory"
            )
    if cfg.run_as is not None and not _USER_RE.match(cfg.run_as):
        raise InvalidArgument(f"run_as {cfg.run_as!r} is neither a user name nor uid:gid")
    if (
        isinstance(cfg.console_log_bytes, bool)
        or not isinstance(cfg.console_log_bytes, int)
        or cfg.console_log_bytes < MIN_LOG_BYTES
    ):
        raise InvalidArgument(
            f"console_log_bytes={cfg.console_log_bytes!r}; give at least {MIN_LOG_BYTES}"
        )
    if cfg.tcg_tb_mib is not None:
        lo, hi = TCG_TB_MIB_RANGE
        if (
            isinstance(cfg.tcg_tb_mib, bool)
            or not isinstance(cfg.tcg_tb_mib, int)
            or not (lo <= cfg.tcg_tb_mib <= hi)
        ):
            raise InvalidArgument(
                f"tcg_tb_mib={cfg.tcg_tb_mib!r} is out of range; accepted: {lo}-{hi}"
            )


def guest_cmdline(cfg: VmConfig) -> str:
    """The kernel command line: the image's, plus the TCG clock settings (see VmConfig)."""
    parts = [cfg.cmdline.strip()]
    if cfg.accel == "tcg" and cfg.tsc_khz is not None:
        # tsc=reliable: TCG's jittery timing must not get the TSC marked unstable by the
        # clocksource watchdog, which would leave the guest on jiffies again.
        parts.append(f"tsc_early_khz={cfg.tsc_khz} tsc=reliable")
    return " ".join(p for p in parts if p)


#: The serial of the runtime disk (``hutch.images.agent_runtime.SERIAL``).
RUNTIME_DISK_SERIAL = "hutch-agent-rt"


def _runtime_disk(cfg: VmConfig) -> list[str]:
    if cfg.runtime_disk is None:
        return []
    return [
        "-drive",
        f"id=rt,if=none,file={_opt(cfg.runtime_disk)},format=raw,readonly=on,"
        "cache=writeback,aio=threads",
        "-device",
        f"virtio-blk-device,drive=rt,serial={RUNTIME_DISK_SERIAL}",
    ]


def _volume_disks(cfg: VmConfig) -> list[str]:
    out: list[str] = []
    for index, vol in enumerate(cfg.volumes):
        drive = volume_drive_id(vol.slot if vol.slot is not None else index)
        ro = "on" if vol.read_only else "off"
        # raw + cache=writeback like the root disk; the guest's flushes reach the file.
        out += [
            "-drive",
            f"id={drive},if=none,file={_opt(vol.path)},format=raw,readonly={ro},"
            "cache=writeback,auto-read-only=off,aio=threads,discard=unmap,detect-zeroes=unmap",
            "-device",
            f"virtio-blk-device,drive={drive},serial={vol.serial}",
        ]
    return out


def _serial_ports(cfg: VmConfig) -> list[str]:
    # max_ports: port 0 is reserved for a console, port 1 is the agent, then one per
    # shared volume (a sandbox without one keeps max_ports=2: the same device set, so
    # its snapshots and templates stay valid).
    out = [
        "-device",
        f"virtio-serial-device,max_ports={2 + len(cfg.shares)}",
        "-chardev",
        f"socket,id=agent,path={_opt(cfg.agent_socket)},server=on,wait=off",
        "-device",
        f"virtserialport,chardev=agent,name={AGENT_PORT_NAME}",
    ]
    for share in cfg.shares:
        chardev = f"share{share.slot}"
        out += [
            "-chardev",
            f"socket,id={chardev},path={_opt(share.socket)},server=on,wait=off",
            "-device",
            f"virtserialport,chardev={chardev},name={share_port_name(share.slot)}",
        ]
    return out


def build_argv(cfg: VmConfig, qemu_binary: str = "qemu-system-x86_64") -> list[str]:
    """The full argv for ``cfg``. Raises ``InvalidArgument`` for values out of range."""
    _validate(cfg)
    if cfg.accel == "kvm":
        accel = ["-accel", "kvm", "-cpu", "host"]
    else:
        tb = f",tb-size={cfg.tcg_tb_mib}" if cfg.tcg_tb_mib is not None else ""
        accel = ["-accel", f"tcg,thread=multi{tb}", "-cpu", TCG_CPU]
    machine = MACHINE
    memory: list[str] = []
    if cfg.memory_file is not None:
        # Only memory-backend-file: QEMU 7.2's x-ignore-shared also skips memfd/shm
        # backends, whose content would then be lost (design.md).
        machine += f",memory-backend={MEMORY_BACKEND_ID}"
        share = "on" if cfg.memory_shared else "off"
        memory = [
            "-object",
            f"memory-backend-file,id={MEMORY_BACKEND_ID},size={cfg.memory_mib}M,"
            f"mem-path={_opt(cfg.memory_file)},share={share}",
        ]
    nic: list[str] = []
    if cfg.nic:
        netdev = (
            f"tap,id=net0,ifname={cfg.tap},script=no,downscript=no"
            if cfg.tap
            else "hubport,id=net0,hubid=0"
        )
        nic = ["-netdev", netdev, "-device", "virtio-net-device,netdev=net0"]
    return [
        qemu_binary,
        "-name",
        f"{cfg.name},debug-threads=on",
        "-M",
        machine,
        *accel,
        "-smp",
        str(cfg.vcpus),
        "-m",
        f"{cfg.memory_mib}M",
        *memory,
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-display",
        "none",
        # A guest reboot ends the sandbox: the daemon sees QEMU exit and decides.
        "-no-reboot",
        "-kernel",
        str(cfg.kernel),
        "-initrd",
        str(cfg.initrd),
        "-append",
        guest_cmdline(cfg),
        # cache=writeback (host page cache, guest flushes honoured): works on every host
        # filesystem (cache=none needs O_DIRECT, which tmpfs lacks), and the read-only
        # base image is shared in the page cache by all sandboxes on it. discard and
        # detect-zeroes=unmap give freed guest blocks back to the host.
        # auto-read-only=off: a migration's end drops the disk's write permission, and
        # with auto-read-only QEMU would reopen the file by path to match; after -runas
        # it no longer may (the state dir is root's), and the save fails.
        "-drive",
        f"id=root,if=none,file={_opt(cfg.disk)},format=qcow2,cache=writeback,"
        "auto-read-only=off,aio=threads,discard=unmap,detect-zeroes=unmap",
        "-device",
        "virtio-blk-device,drive=root",
        *_runtime_disk(cfg),
        *_volume_disks(cfg),
        *_serial_ports(cfg),
        # Entropy from the host: without it early userspace blocks on getrandom().
        "-object",
        "rng-random,id=rng0,filename=/dev/urandom",
        "-device",
        "virtio-rng-device,rng=rng0",
        *nic,
        # The console goes into a FIFO pair (console.in/.out) the daemon drains into a
        # capped, rotated log; QEMU opens them read-write, so a daemon that is down
        # never makes its writes fail (hutch.vm.console).
        "-chardev",
        f"pipe,id=console,path={_opt(console_fifo(cfg.console_log))}",
        "-serial",
        "chardev:console",
        "-chardev",
        f"socket,id=qmp,path={_opt(cfg.qmp_socket)},server=on,wait=off",
        "-mon",
        "chardev=qmp,mode=control",
        "-pidfile",
        str(cfg.pidfile),
        "-sandbox",
        SANDBOX_RUNAS if cfg.run_as else SANDBOX,
        *(["-runas", cfg.run_as] if cfg.run_as else []),
        # Restore: start paused and take the state from ``migrate-incoming`` (an fd
        # passed with ``getfd``; ``exec:`` would be killed by spawn=deny).
        *(["-incoming", "defer"] if cfg.incoming else []),
    ]


#: Joins the cgroups listed before ``--`` and execs the rest. QEMU is placed in its
#: group between fork and exec, so it never runs outside it (not even its start-up),
#: without a ``preexec_fn`` (unsafe in the daemon, which has threads). Exit status 125:
#: a group could not be joined (the shell's message is in qemu.log).
_JOIN_SCRIPT = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


def in_cgroups(procs_files: list[Path], argv: list[str]) -> list[str]:
    """``argv`` run inside the cgroups whose ``cgroup.procs`` files are given."""
    if not procs_files:
        return argv
    if any(str(p) == "--" for p in procs_files):
        raise InvalidArgument("a cgroup.procs path cannot be '--'")
    return ["/bin/sh", "-c", _JOIN_SCRIPT, "hutch-cgroup-join", *map(str, procs_files), "--", *argv]
