"""The cgroup file-system half of the per-sandbox limits (the pure half, the layout and
the limits, is :mod:`hutch.vm.cgroups`).

- :class:`CgroupDriver` (one per daemon): finds the layout, prepares hutch's sub-tree
  (``hutch-<tag>`` under the daemon's cgroup; on v2 the controllers enabled along the
  way), plans a group per QEMU and reclaims groups left by earlier daemons.
- :class:`SandboxCgroup`: one QEMU's group(s): created with their limits before QEMU
  runs (QEMU joins them between fork and exec: ``hutch.vm.argv.in_cgroups``), recorded
  in ``cgroup.json`` beside the VM's pidfile (a restarted daemon adopts the VM with its
  group), asked for OOM kills when QEMU exits, removed once QEMU is gone.
- :class:`CgroupFs`: the kernel interface, the one thing tests replace (with a fake
  tree that behaves like cgroupfs: control files appear with a group).

Removal never touches a directory that is not a direct child of a ``hutch-<hex>`` group.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hutch.config import CGROUP_MODES
from hutch.errors import VmError
from hutch.vm.argv import VmConfig
from hutch.vm.cgroups import (
    DAEMON_LEAF,
    QEMU_DEFAULT_TB_MIB,
    WANTED_V2,
    Hierarchy,
    Layout,
    Limits,
    Policy,
    find_layout,
    group_name_ok,
    limits_for,
    oom_kills,
    subtree_name,
    v1_writes,
    v2_writes,
)

__all__ = [
    "RECORD_FILE",
    "CgroupDriver",
    "CgroupFs",
    "MemoryUsage",
    "SandboxCgroup",
    "record_path",
]

log = logging.getLogger(__name__)

#: Beside the VM's pidfile: the groups its QEMU runs in (adoption, cleanup).
RECORD_FILE = "cgroup.json"
_RECORD_FORMAT = 1
_SUBTREE_RE = re.compile(r"^hutch-[0-9a-f]{1,16}$")
#: Seconds removal waits for the processes left in a group to die after SIGKILL.
_REMOVE_WAIT_S = 5.0


def record_path(pidfile: Path) -> Path:
    return pidfile.with_name(RECORD_FILE)


class CgroupFs:
    """cgroupfs as the kernel offers it. Writes never create files: a control file the
    kernel lacks is an error (callers check :meth:`exists` for optional ones)."""

    def read(self, path: Path) -> str:
        return path.read_text()

    def write(self, path: Path, value: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)

    def exists(self, path: Path) -> bool:
        return path.exists()

    def mkdir(self, path: Path) -> None:
        with contextlib.suppress(FileExistsError):
            path.mkdir()

    def rmdir(self, path: Path) -> None:
        path.rmdir()

    def children(self, path: Path) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            return []

    def pids(self, group: Path) -> list[int]:
        try:
            text = self.read(group / "cgroup.procs")
        except FileNotFoundError:
            return []
        return [int(p) for p in text.split() if p.isdigit()]

    def kill(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclass(frozen=True)
class MemoryUsage:
    """Bytes charged to a QEMU's memory group: now, the most ever, and the limit."""

    current: int
    peak: int
    limit: int


@dataclass
class SandboxCgroup:
    """The group(s) of one QEMU: one directory on v2, one per hierarchy on v1."""

    version: int
    dirs: tuple[Path, ...]
    controllers: tuple[tuple[str, ...], ...]  # per directory (v1: what it carries)
    limits: Limits
    fs: CgroupFs = field(default_factory=CgroupFs, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.dirs[0].name

    def procs_files(self) -> list[Path]:
        """Where QEMU's pid is written to join every group."""
        return [d / "cgroup.procs" for d in self.dirs]

    def _memory_dir(self) -> Path:
        if self.version == 2:
            return self.dirs[0]
        return next(d for d, c in zip(self.dirs, self.controllers, strict=True) if "memory" in c)

    def create(self) -> None:
        """Make the group(s) and write the limits. Raises ``VmError`` (what failed and
        the file) after removing what it made."""
        try:
            for d, controllers in zip(self.dirs, self.controllers, strict=True):
                self.fs.mkdir(d)
                writes = (
                    v2_writes(self.limits)
                    if self.version == 2
                    else [w for c in controllers for w in v1_writes(c, self.limits)]
                )
                for name, value, optional in writes:
                    path = d / name
                    if optional and not self.fs.exists(path):
                        continue
                    self.fs.write(path, value)
        except OSError as exc:
            with contextlib.suppress(VmError):
                self.remove()
            raise VmError(
                f"cannot set up the cgroup of {self.name} ({self.limits.describe()}): {exc}; "
                "set HUTCH_CGROUPS=off to run sandboxes without host limits"
            ) from exc

    def oom_kills(self) -> int:
        """How often the kernel's OOM killer killed a process of this group (0 when
        the group is gone or has no memory controller)."""
        d = self._memory_dir()
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            return oom_kills(self.fs.read(d / name))
        except (OSError, StopIteration):
            return 0

    def memory_usage(self) -> MemoryUsage:
        d = self._memory_dir()
        if self.version == 2:
            names = ("memory.current", "memory.peak", "memory.max")
        else:
            names = ("memory.usage_in_bytes", "memory.max_usage_in_bytes", "memory.limit_in_bytes")
        values = []
        for name in names:
            try:
                text = self.fs.read(d / name).strip()
            except FileNotFoundError:  # memory.peak is new in Linux 5.19
                text = "0"
            values.append(int(text) if text.isdigit() else self.limits.memory_bytes)
        return MemoryUsage(*values)

    def remove(self, wait_s: float = _REMOVE_WAIT_S) -> None:
        """Remove the group(s). Processes still in one (there should be none: QEMU has
        exited) are SIGKILLed first: only hutch puts processes into these groups.
        Idempotent; raises ``VmError`` if a group is still busy after ``wait_s``."""
        busy = []
        for d in self.dirs:
            if not _removable(d) or not self.fs.exists(d):
                continue
            deadline = time.monotonic() + wait_s
            while True:
                for pid in self.fs.pids(d):
                    self.fs.kill(pid)
                try:
                    self.fs.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        busy.append(f"{d}: {exc.strerror}")
                        break
                time.sleep(0.01)
        if busy:
            raise VmError(f"cannot remove cgroup(s): {'; '.join(busy)}")

    # -- the record beside the pidfile --------------------------------------------------
    def save(self, path: Path) -> None:
        data = {
            "format": _RECORD_FORMAT,
            "version": self.version,
            "dirs": [str(d) for d in self.dirs],
            "controllers": [list(c) for c in self.controllers],
            "limits": asdict(self.limits),
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, fs: CgroupFs | None = None) -> SandboxCgroup | None:
        """The record at ``path``; None when there is none or it is not one hutch wrote
        (a directory that is not a group under ``hutch-<hex>`` is never trusted)."""
        try:
            data = json.loads(path.read_text())
            if data.get("format") != _RECORD_FORMAT:
                return None
            dirs = tuple(Path(d) for d in data["dirs"])
            cg = cls(
                version=int(data["version"]),
                dirs=dirs,
                controllers=tuple(tuple(str(c) for c in cs) for cs in data["controllers"]),
                limits=Limits(**data["limits"]),
                fs=fs or CgroupFs(),
            )
        except (OSError, ValueError, TypeError, KeyError):
            return None
        if not dirs or len(cg.controllers) != len(dirs) or not all(map(_removable, dirs)):
            log.warning("ignoring %s: it names cgroups hutch does not make", path)
            return None
        return cg


def _removable(d: Path) -> bool:
    """A QEMU's group: ``<...>/hutch-<hex>/<name>``, absolute, nothing odd in it."""
    return (
        d.is_absolute()
        and ".." not in d.parts
        and group_name_ok(d.name)
        and bool(_SUBTREE_RE.match(d.parent.name))
    )


class CgroupDriver:
    """The daemon's cgroup sub-tree. Create with :meth:`detect`; disabled (``enabled``
    False, ``reason`` says why) when cgroups are off or cannot be used: groups recorded
    by an earlier daemon are still released."""

    def __init__(
        self,
        layout: Layout | None,
        subtrees: tuple[Path, ...],
        policy: Policy,
        fs: CgroupFs,
        reason: str | None = None,
        controllers: tuple[tuple[str, ...], ...] = (),
    ) -> None:
        self.layout = layout
        self.subtrees = subtrees
        self.policy = policy
        self.fs = fs
        self.reason = reason
        self._controllers = controllers

    @property
    def enabled(self) -> bool:
        return self.layout is not None

    @property
    def version(self) -> int | None:
        return self.layout.version if self.layout else None

    @classmethod
    def detect(
        cls,
        mode: str,
        tag: str,
        policy: Policy,
        *,
        fs: CgroupFs | None = None,
        proc: Path = Path("/proc"),
        pid: int | None = None,
    ) -> CgroupDriver:
        """The driver for ``mode`` (``auto``: use cgroups when the host lets hutch, else
        log why and go without; ``on``: raise ``VmError`` instead; ``off``: never)."""
        fs = fs or CgroupFs()
        if mode not in CGROUP_MODES:
            raise VmError(f"HUTCH_CGROUPS={mode!r}; accepted: {', '.join(CGROUP_MODES)}")
        if mode == "off":
            log.warning(
                "cgroups: off (HUTCH_CGROUPS=off): sandboxes run without host limits (CPU, "
                "memory, I/O, pids); one guest can starve the others and the host"
            )
            return cls(None, (), policy, fs, "HUTCH_CGROUPS=off")
        try:
            found = find_layout(
                (proc / "self" / "cgroup").read_text(), (proc / "self" / "mountinfo").read_text()
            )
            if isinstance(found, str):
                raise _Unusable(found)
            subtrees, controllers = _prepare(found, subtree_name(tag), fs, pid or os.getpid())
        except (_Unusable, OSError) as exc:
            reason = str(exc) if isinstance(exc, _Unusable) else f"{exc.strerror}: {exc.filename}"
            if mode == "on":
                raise VmError(
                    f"HUTCH_CGROUPS=on, but cgroups cannot be used: {reason}. Run hutchd "
                    "as root in a cgroup it may manage (systemd: Delegate=yes), or set "
                    "HUTCH_CGROUPS=auto|off"
                ) from None
            log.warning(
                "cgroups: not used (%s); sandboxes run without host limits (CPU, memory, "
                "I/O, pids). HUTCH_CGROUPS=off silences this, =on refuses to start",
                reason,
            )
            return cls(None, (), policy, fs, reason)
        log.info(
            "cgroups v%d: sandboxes get their groups under %s",
            found.version,
            ", ".join(map(str, subtrees)),
        )
        return cls(found, subtrees, policy, fs, None, controllers)

    def for_vm(self, name: str, cfg: VmConfig) -> SandboxCgroup | None:
        """The group the QEMU of ``cfg`` will run in, named ``name`` (a sandbox id, a
        template build's run name), not created yet (``QemuVm.launch`` creates it);
        None when cgroups are not used."""
        tb = 0
        if cfg.accel == "tcg":
            tb = cfg.tcg_tb_mib if cfg.tcg_tb_mib is not None else QEMU_DEFAULT_TB_MIB
        return self.plan(name, limits_for(cfg.vcpus, cfg.memory_mib, tb, self.policy))

    def plan(self, name: str, limits: Limits) -> SandboxCgroup | None:
        """A group named ``name`` with ``limits`` (not created); None when not used."""
        if self.layout is None:
            return None
        if not group_name_ok(name):
            raise VmError(f"{name!r} cannot name a cgroup")
        return SandboxCgroup(
            version=self.layout.version,
            dirs=tuple(s / name for s in self.subtrees),
            controllers=self._controllers,
            limits=limits,
            fs=self.fs,
        )

    def group_names(self) -> set[str]:
        """Names of the groups in this daemon's sub-tree (QEMUs running or left)."""
        return {n for s in self.subtrees for n in self.fs.children(s) if group_name_ok(n)}

    def release(self, name: str, record: Path | None = None) -> None:
        """Remove the group(s) of ``name``: the ones its record names (made by whichever
        daemon launched it) and the one in this daemon's sub-tree. Idempotent; never
        raises (a group still busy is logged and left for the next start)."""
        groups: list[SandboxCgroup] = []
        if record is not None:
            recorded = SandboxCgroup.load(record, self.fs)
            if recorded is not None:
                groups.append(recorded)
        if self.layout is not None and group_name_ok(name):
            # remove() does not read the limits: any will do.
            planned = self.plan(name, limits_for(1, 128, 0, self.policy))
            if planned is not None:
                groups.append(planned)
        for cg in groups:
            try:
                cg.remove()
            except VmError as exc:
                log.warning("%s", exc)
        if record is not None:
            with contextlib.suppress(FileNotFoundError):
                record.unlink()

    def close(self) -> None:
        """Remove this daemon's sub-tree when no group is left in it (a QEMU that
        outlives the daemon keeps it, for the next start to adopt). Never raises."""
        for s in self.subtrees:
            if not _SUBTREE_RE.match(s.name) or self.fs.children(s):
                continue
            try:
                self.fs.rmdir(s)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cgroups: cannot remove %s: %s", s, exc.strerror)

    def reclaim(self, stray: Callable[[str], bool]) -> list[str]:
        """Remove the groups of this sub-tree whose name ``stray`` accepts; their names."""
        removed = [n for n in sorted(self.group_names()) if stray(n)]
        for n in removed:
            self.release(n)
        return removed


class _Unusable(Exception):
    pass


def _prepare(
    layout: Layout, subtree: str, fs: CgroupFs, pid: int
) -> tuple[tuple[Path, ...], tuple[tuple[str, ...], ...]]:
    """Make hutch's sub-tree in every hierarchy; return its directories and the
    controllers each carries."""
    if layout.version == 1:
        dirs = []
        for h in layout.hierarchies:
            d = h.daemon_dir / subtree
            fs.mkdir(d)
            dirs.append(d)
        return tuple(dirs), tuple(h.controllers for h in layout.hierarchies)
    (h,) = layout.hierarchies
    d, controllers = _prepare_v2(h, subtree, fs, pid)
    return (d,), (controllers,)


def _tokens(text: str) -> set[str]:
    return {t.lstrip("+") for t in text.split()}


def _prepare_v2(h: Hierarchy, subtree: str, fs: CgroupFs, pid: int) -> tuple[Path, tuple[str, ...]]:
    """v2: the controllers must be enabled in the daemon's cgroup and in the sub-tree.
    A cgroup that enables controllers for its children may hold no processes (unless it
    is the root), so a daemon alone in its cgroup first moves into ``hutchd`` below it."""
    base = h.daemon_dir.parent if h.daemon_dir.name == DAEMON_LEAF else h.daemon_dir
    available = _tokens(fs.read(base / "cgroup.controllers"))
    if "memory" not in available:
        raise _Unusable(f"the memory controller is not available in {base} (cgroup.controllers)")
    wanted = tuple(c for c in WANTED_V2 if c in available)
    missing = [c for c in wanted if c not in _tokens(fs.read(base / "cgroup.subtree_control"))]
    if missing and base != h.mount:
        procs = fs.pids(base)
        others = [p for p in procs if p != pid]
        if others:
            shown = " ".join(map(str, others[:8])) + (" ..." if len(others) > 8 else "")
            raise _Unusable(
                f"cgroup v2: hutchd's cgroup {base} holds other processes ({shown}), so "
                "controllers cannot be enabled below it; give hutchd a cgroup of its own"
            )
        if procs:
            leaf = base / DAEMON_LEAF
            fs.mkdir(leaf)
            fs.write(leaf / "cgroup.procs", str(pid))
            log.info("cgroups: hutchd moved into %s so that %s can hold the sub-tree", leaf, base)
    if missing:
        fs.write(base / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing))
    d = base / subtree
    fs.mkdir(d)
    enabled = _tokens(fs.read(d / "cgroup.subtree_control"))
    todo = [c for c in wanted if c not in enabled]
    if todo:
        fs.write(d / "cgroup.subtree_control", " ".join(f"+{c}" for c in todo))
    return d, wanted
