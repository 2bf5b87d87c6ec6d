"""A directory that behaves like cgroupfs for ``hutch.vm.cgroup_driver`` unit tests.

``FakeCgroupFs`` is a second implementation of :class:`~hutch.vm.cgroup_driver.CgroupFs`
on a plain temporary directory: a new group gets its control files at once (the ones of
its version and controllers), writes to files that do not exist fail as the kernel's
do, ``cgroup.procs`` holds the pids written to it (a pid is in one group per hierarchy),
and ``rmdir`` of a group that still has processes or children fails with EBUSY.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from hutch.vm.cgroup_driver import CgroupFs

V1_FILES = {
    "memory": (
        "memory.limit_in_bytes",
        "memory.memsw.limit_in_bytes",
        "memory.usage_in_bytes",
        "memory.max_usage_in_bytes",
        "memory.oom_control",
    ),
    "cpu": ("cpu.shares", "cpu.cfs_period_us", "cpu.cfs_quota_us"),
    "pids": ("pids.max",),
    "blkio": ("blkio.weight",),
}
V2_FILES = {
    "memory": (
        "memory.max",
        "memory.swap.max",
        "memory.oom.group",
        "memory.events",
        "memory.current",
        "memory.peak",
    ),
    "cpu": ("cpu.weight", "cpu.max"),
    "io": ("io.weight",),
    "pids": ("pids.max",),
}
_DEFAULTS = {
    "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n",
    "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
    "memory.current": "0\n",
    "memory.peak": "0\n",
    "memory.usage_in_bytes": "0\n",
    "memory.max_usage_in_bytes": "0\n",
}


class FakeCgroupFs(CgroupFs):
    """``roots``: hierarchy mount point -> (version, controllers it carries)."""

    def __init__(self, roots: dict[Path, tuple[int, tuple[str, ...]]]) -> None:
        self.roots = roots
        self.written: list[tuple[Path, str]] = []
        self.killed: list[int] = []
        for root, (version, controllers) in roots.items():
            root.mkdir(parents=True, exist_ok=True)
            self._populate(root, version, controllers, is_root=True)

    # -- building the tree -----------------------------------------------------------
    def _hierarchy(self, path: Path) -> tuple[Path, int, tuple[str, ...]]:
        for root, (version, controllers) in self.roots.items():
            if path == root or root in path.parents:
                return root, version, controllers
        raise AssertionError(f"{path} is in no fake hierarchy")

    def _populate(self, d: Path, version: int, controllers: tuple[str, ...], is_root: bool) -> None:
        (d / "cgroup.procs").write_text("")
        if version == 1:
            for c in controllers:
                for name in V1_FILES.get(c, ()):
                    (d / name).write_text(_DEFAULTS.get(name, "0\n"))
            return
        parent_enabled = controllers if is_root else self._enabled(d.parent)
        (d / "cgroup.controllers").write_text(" ".join(parent_enabled) + "\n")
        (d / "cgroup.subtree_control").write_text("\n")
        if not is_root:
            for c in parent_enabled:
                for name in V2_FILES.get(c, ()):
                    (d / name).write_text(_DEFAULTS.get(name, "max\n"))

    def _enabled(self, d: Path) -> tuple[str, ...]:
        return tuple((d / "cgroup.subtree_control").read_text().split())

    def add_process(self, group: Path, pid: int) -> None:
        """Put ``pid`` in ``group`` (what a fork into it would do)."""
        self.write(group / "cgroup.procs", str(pid))

    def procs(self, group: Path) -> list[int]:
        return self.pids(group)

    # -- CgroupFs ----------------------------------------------------------------------
    def write(self, path: Path, value: str) -> None:
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
        self.written.append((path, value))
        if path.name == "cgroup.procs":
            root, _, _ = self._hierarchy(path)
            pid = int(value)
            for procs in root.rglob("cgroup.procs"):
                kept = [p for p in procs.read_text().split() if p != str(pid)]
                procs.write_text("".join(f"{p}\n" for p in kept))
            path.write_text(path.read_text() + f"{pid}\n")
            return
        if path.name == "cgroup.subtree_control":
            _, version, _ = self._hierarchy(path)
            assert version == 2
            d = path.parent
            available = set((d / "cgroup.controllers").read_text().split())
            enabled = self._enabled(d)
            if self.pids(d) and d not in self.roots:
                # The kernel's "no internal processes" rule.
                raise OSError(errno.EBUSY, "Device or resource busy", str(path))
            for token in value.split():
                name = token.lstrip("+-")
                if name not in available:
                    raise OSError(errno.ENOENT, "No such file or directory", str(path))
                if token.startswith("+") and name not in enabled:
                    enabled = (*enabled, name)
            path.write_text(" ".join(enabled) + "\n")
            return
        path.write_text(value + "\n")

    def mkdir(self, path: Path) -> None:
        if path.exists():
            return
        _, version, controllers = self._hierarchy(path)
        path.mkdir()
        self._populate(path, version, controllers, is_root=False)

    def rmdir(self, path: Path) -> None:
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
        if self.pids(path) or any(e.is_dir() for e in path.iterdir()):
            raise OSError(errno.EBUSY, "Device or resource busy", str(path))
        for f in path.iterdir():
            f.unlink()
        os.rmdir(path)

    def kill(self, pid: int) -> None:
        # The killed process leaves every group (it died).
        self.killed.append(pid)
        for root in self.roots:
            for procs in root.rglob("cgroup.procs"):
                kept = [p for p in procs.read_text().split() if p != str(pid)]
                procs.write_text("".join(f"{p}\n" for p in kept))
