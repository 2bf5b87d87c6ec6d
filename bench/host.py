"""Facts about the host a run happened on, recorded next to every result."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["cpu_model", "foreign_qemu_count", "host_facts", "loadavg"]


def _first_line(argv: list[str]) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[0].strip() if lines else None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _mem_total_mib() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def loadavg() -> list[float]:
    """1, 5 and 15 minute load averages (noise indicator on a shared machine)."""
    return [round(x, 2) for x in os.getloadavg()]


def foreign_qemu_count(own_marker: str | None = None) -> int:
    """QEMU processes on the host that are not ours (other engineers' VMs compete for
    the same cores, so a result is only as quiet as this number)."""
    count = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if not cmdline.startswith("qemu-system"):
            continue
        if own_marker and own_marker in cmdline:
            continue
        count += 1
    return count


def _git_commit(repo: Path) -> str | None:
    return _first_line(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"])


def host_facts(repo: Path, accel: str | None) -> dict[str, Any]:
    """CPU, cores, acceleration, kernel, QEMU and tool versions; cheap to collect."""
    flags = _cpu_flags()
    return {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "cpu_virt_flags": sorted(flags & {"vmx", "svm"}),
        "mem_total_mib": _mem_total_mib(),
        "accel": accel,
        "kernel": platform.release(),
        "os": _first_line(["sh", "-c", ". /etc/os-release && echo $PRETTY_NAME"]),
        "qemu": _first_line(["qemu-system-x86_64", "--version"]),
        "bwrap": _first_line(["bwrap", "--version"]),
        "python": sys.version.split()[0],
        "hutch_commit": _git_commit(repo),
        "loadavg_start": loadavg(),
        "foreign_qemu_at_start": foreign_qemu_count(),
    }
