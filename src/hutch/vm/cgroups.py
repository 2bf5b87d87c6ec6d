"""Resource limits per sandbox: every QEMU runs in a cgroup of its own.

The pure half (no I/O) reads the host's layout from the text of ``/proc/self/cgroup``
and ``/proc/self/mountinfo``, computes a VM's limits from its vCPUs and RAM
(:func:`limits_for`) and turns them into the control-file writes of cgroup v1 or v2
(:func:`v1_writes`, :func:`v2_writes`). The I/O half lives in
:mod:`hutch.vm.cgroup_driver`.

Where the groups are: under hutch's own sub-tree of the daemon's cgroup, one group per
QEMU, named after the sandbox (or template build)::

    v2:  <cgroup2 mount>/<daemon's cgroup>/hutch-<tag>/<name>/     (one directory)
    v1:  <mount of ctrl>/<daemon's cgroup in ctrl>/hutch-<tag>/<name>/   (per hierarchy)

``<tag>`` is the daemon's tag (4 hex of its state dir), so two daemons in one cgroup
never share a sub-tree. Nothing outside ``hutch-<tag>`` is written, except on v2, where
a daemon whose own cgroup must become an inner node first moves itself into the leaf
``<daemon's cgroup>/hutchd`` (what systemd's ``DelegateSubgroup=`` does for a service).

What each limit is (ARCHITECTURE.md, "Resource limits"): CPU weight 100 per vCPU (v1:
``cpu.shares`` 1024 per vCPU), a CPU quota of ``cpu_quota_pct`` of one core per vCPU,
memory = guest RAM + the TCG translation cache (``tb-size``) + a measured overhead, an
I/O weight of 100 per vCPU (up to 1000), and a pids limit for QEMU's threads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from hutch.errors import InvalidArgument

__all__ = [
    "CPU_PERIOD_US",
    "DAEMON_LEAF",
    "QEMU_DEFAULT_TB_MIB",
    "Hierarchy",
    "Layout",
    "Limits",
    "Policy",
    "find_layout",
    "group_name_ok",
    "limits_for",
    "oom_kills",
    "parse_mountinfo",
    "parse_proc_cgroup",
    "subtree_name",
    "v1_writes",
    "v2_writes",
]

#: Controllers hutch limits, per version (v1 calls the I/O controller ``blkio``).
WANTED_V1 = ("memory", "cpu", "pids", "blkio")
WANTED_V2 = ("memory", "cpu", "pids", "io")
#: v2: the leaf hutchd moves itself into when its own cgroup must hold the sub-tree
#: (processes may only live in leaves once controllers are enabled below a group).
DAEMON_LEAF = "hutchd"
#: The CFS period the quota is a share of (the kernel's default: 100 ms).
CPU_PERIOD_US = 100_000
#: QEMU's threads: up to 64 block I/O workers (``aio=threads``: QEMU's thread pool
#: limit), one thread per vCPU, and the fixed ones (main loop, RCU, QMP monitor I/O,
#: migration, signal handling; 6-10 measured). A thread QEMU cannot create aborts it, so
#: the limit is far above what it uses and only stops an escaped QEMU from forking.
PIDS_BASE = 128

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class Policy:
    """The host-wide knobs (``Settings``): how limits follow from a VM's shape.

    ``memory_overhead_mib``: host memory QEMU needs beyond guest RAM and the TCG
    translation cache (its heap, thread stacks, device buffers, page cache of the disk
    writes in flight). ``cpu_quota_pct``: percent of one core per vCPU (0: weight only,
    no quota).
    """

    memory_overhead_mib: int
    cpu_quota_pct: int


@dataclass(frozen=True)
class Limits:
    """One QEMU's limits, in version-neutral units (v2's scales)."""

    cpu_weight: int  # 1-10000, default 100 (v1 shares = weight * 1024 / 100)
    cpu_quota_us: int | None  # per CPU_PERIOD_US; None: no quota
    memory_bytes: int
    io_weight: int  # 1-1000 (the range both versions' BFQ weights accept)
    pids_max: int

    def describe(self) -> str:
        quota = (
            "no quota"
            if self.cpu_quota_us is None
            else f"quota {self.cpu_quota_us / CPU_PERIOD_US:.2f} cores"
        )
        return (
            f"memory {self.memory_bytes >> 20} MiB, cpu weight {self.cpu_weight} ({quota}), "
            f"io weight {self.io_weight}, pids {self.pids_max}"
        )


#: QEMU 7.2's TCG translation cache when ``tb-size`` is not given (MiB).
QEMU_DEFAULT_TB_MIB = 1024


def limits_for(vcpus: int, memory_mib: int, tb_mib: int, policy: Policy) -> Limits:
    """The limits of a VM with ``vcpus``, ``memory_mib`` of guest RAM and a TCG
    translation cache of ``tb_mib`` (0 under KVM).

    Memory: guest RAM + the translation cache + the overhead. The guest can touch all
    of its RAM, and TCG fills its cache up to ``tb-size`` before it flushes it
    (ARCHITECTURE.md has the measurements behind the overhead).
    """
    tb = tb_mib
    quota = vcpus * CPU_PERIOD_US * policy.cpu_quota_pct // 100 if policy.cpu_quota_pct else None
    return Limits(
        cpu_weight=min(10_000, 100 * vcpus),
        cpu_quota_us=quota,
        memory_bytes=(memory_mib + tb + policy.memory_overhead_mib) << 20,
        io_weight=min(1000, 100 * vcpus),
        pids_max=PIDS_BASE + vcpus,
    )


def group_name_ok(name: str) -> bool:
    """A sandbox id or a template build's run name: one path component, no dots alone."""
    return bool(_NAME_RE.match(name))


def subtree_name(tag: str) -> str:
    """hutch's own group under the daemon's cgroup (one per daemon: its tag)."""
    if not re.fullmatch(r"[0-9a-f]{1,16}", tag):
        raise InvalidArgument(f"daemon tag {tag!r} is not hex")
    return f"hutch-{tag}"


# -- the writes each version needs ---------------------------------------------------

#: (file, value) in the order they must be written; ``optional`` files are skipped when
#: the kernel lacks them (no swap accounting, no BFQ), the others must exist.
Write = tuple[str, str, bool]


def v2_writes(limits: Limits) -> list[Write]:
    quota = "max" if limits.cpu_quota_us is None else str(limits.cpu_quota_us)
    return [
        ("memory.max", str(limits.memory_bytes), False),
        # No swap: a sandbox over its limit is killed and reported, never slowed to a
        # crawl by swapping (and another's memory is not pushed out for it).
        ("memory.swap.max", "0", True),
        # An OOM kill takes the whole group (QEMU), never a thread of it.
        ("memory.oom.group", "1", True),
        ("cpu.weight", str(limits.cpu_weight), True),
        ("cpu.max", f"{quota} {CPU_PERIOD_US}", True),
        ("io.weight", f"default {limits.io_weight}", True),
        ("io.bfq.weight", str(limits.io_weight), True),
        ("pids.max", str(limits.pids_max), True),
    ]


def v1_writes(controller: str, limits: Limits) -> list[Write]:
    """The writes of one v1 hierarchy (``controller`` is one of :data:`WANTED_V1`)."""
    if controller == "memory":
        return [
            ("memory.limit_in_bytes", str(limits.memory_bytes), False),
            # memory+swap at the same limit: no swap beyond RAM (written after the
            # memory limit: the kernel refuses memsw below it).
            ("memory.memsw.limit_in_bytes", str(limits.memory_bytes), True),
        ]
    if controller == "cpu":
        quota = -1 if limits.cpu_quota_us is None else limits.cpu_quota_us
        return [
            ("cpu.shares", str(max(2, limits.cpu_weight * 1024 // 100)), True),
            ("cpu.cfs_period_us", str(CPU_PERIOD_US), True),
            ("cpu.cfs_quota_us", str(quota), True),
        ]
    if controller == "blkio":
        weight = max(10, limits.io_weight)  # CFQ's blkio.weight starts at 10
        return [
            ("blkio.bfq.weight", str(limits.io_weight), True),
            ("blkio.weight", str(weight), True),
        ]
    if controller == "pids":
        return [("pids.max", str(limits.pids_max), True)]
    raise InvalidArgument(f"cgroup v1 controller {controller!r} is not one hutch limits")


def oom_kills(text: str) -> int:
    """The ``oom_kill`` count of v2 ``memory.events`` or v1 ``memory.oom_control``."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return 0


# -- the host's layout ------------------------------------------------------------------


@dataclass(frozen=True)
class Mount:
    point: Path
    root: str  # the path inside the hierarchy that is mounted at ``point``
    fstype: str
    options: frozenset[str]  # super options: v1 names its controllers there


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """The cgroup (v1) and cgroup2 mounts in ``/proc/self/mountinfo``."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] not in ("cgroup", "cgroup2"):
            continue
        options = frozenset(tail[2].split(","))
        mounts.append(Mount(Path(_unescape(fields[4])), _unescape(fields[3]), tail[0], options))
    return mounts


def parse_proc_cgroup(text: str) -> list[tuple[str, frozenset[str], str]]:
    """``/proc/self/cgroup`` lines as (hierarchy id, controllers, path)."""
    out = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        out.append((hid, frozenset(c for c in controllers.split(",") if c), path))
    return out


@dataclass(frozen=True)
class Hierarchy:
    """One mounted hierarchy hutch writes to and the daemon's cgroup directory in it."""

    controllers: tuple[str, ...]  # the wanted controllers it carries (v2: all, checked later)
    daemon_dir: Path
    mount: Path  # where the hierarchy is mounted (its root cgroup)


@dataclass(frozen=True)
class Layout:
    version: int  # 1 or 2
    hierarchies: tuple[Hierarchy, ...]


def _inside(mount: Mount, path: str) -> Path | None:
    """The directory of cgroup ``path`` under ``mount`` (None when the mount does not
    reach it, e.g. a container that sees only a sub-tree of the hierarchy)."""
    root, target = PurePosixPath(mount.root), PurePosixPath(path)
    if not target.is_absolute() or ".." in target.parts:
        return None
    if root != target and root not in target.parents:
        return None
    return mount.point / target.relative_to(root)


def find_layout(proc_cgroup: str, mountinfo: str) -> Layout | str:
    """Where the daemon's cgroups are: v1 when the memory controller is on a v1
    hierarchy (hybrid hosts), else the cgroup2 hierarchy. A reason string when neither
    can be used."""
    mounts = parse_mountinfo(mountinfo)
    lines = parse_proc_cgroup(proc_cgroup)
    v1_mounts = [m for m in mounts if m.fstype == "cgroup"]
    if any("memory" in m.options for m in v1_mounts):
        by_dir: dict[Path, tuple[Path, list[str]]] = {}
        for controller in WANTED_V1:
            mount = next((m for m in v1_mounts if controller in m.options), None)
            line = next((ln for ln in lines if controller in ln[1]), None)
            if mount is None or line is None:
                if controller == "memory":
                    return "the memory controller's v1 hierarchy is not in /proc/self/cgroup"
                continue  # a controller this kernel lacks: its limit is skipped
            where = _inside(mount, line[2])
            if where is None:
                if controller == "memory":
                    return (
                        f"the daemon's memory cgroup {line[2]!r} is outside what is "
                        f"mounted at {mount.point}"
                    )
                continue
            by_dir.setdefault(where, (mount.point, []))[1].append(controller)
        return Layout(1, tuple(Hierarchy(tuple(c), d, m) for d, (m, c) in by_dir.items()))
    v2 = next((m for m in mounts if m.fstype == "cgroup2"), None)
    line = next((ln for ln in lines if ln[0] == "0" and not ln[1]), None)
    if v2 is None or line is None:
        return "no cgroup hierarchy with the memory controller is mounted"
    where = _inside(v2, line[2])
    if where is None:
        return f"the daemon's cgroup {line[2]!r} is outside what is mounted at {v2.point}"
    return Layout(2, (Hierarchy(WANTED_V2, where, v2.point),))
