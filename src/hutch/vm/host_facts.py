"""What this host's VMs are, as far as a saved VM state is concerned: the QEMU build
that runs them and the CPU under them. Read once per process (a QEMU package upgrade
takes effect at the daemon's next start, as the binary a running daemon starts does).

A migration stream loads only into the QEMU build that wrote it (``hutch.vm.snapshot``
compares :func:`qemu_build`'s string with ``query-version`` in the new QEMU), and a KVM
guest saw the host CPU's CPUID. The template key (``hutch.runtime.qemu.template_key``)
and the hosts table (``services/cluster.py::host_facts``) read these.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

__all__ = ["QEMU_BINARY", "cpu_model", "parse_qemu_version", "qemu_build", "qemu_version"]

#: The emulator every VM runs (``hutch.vm.argv.build_argv``'s default).
QEMU_BINARY = "qemu-system-x86_64"
_VERSION = re.compile(r"version ([0-9]+\.[0-9.]+)(?: \(([^)]*)\))?")


def parse_qemu_version(text: str) -> tuple[str, str]:
    """``(version, build)`` from ``qemu-system-x86_64 --version``: ``("7.2.22",
    "7.2.22 Debian 1:7.2+dfsg-7+deb12u18+b3")``. The build is in the form a snapshot
    manifest records (QMP ``query-version``: version, space, package). ``("unknown",
    "unknown")`` when the text names none."""
    found = _VERSION.search(text)
    if found is None:
        return "unknown", "unknown"
    version, package = found.group(1), (found.group(2) or "").strip()
    return version, f"{version} {package}".strip()


@functools.cache
def _qemu() -> tuple[str, str]:
    try:
        done = subprocess.run(
            [QEMU_BINARY, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown", "unknown"
    return parse_qemu_version(done.stdout)


def qemu_version() -> str:
    """The QEMU version (``7.2.22``), "unknown" when QEMU does not answer. Blocking
    (one ``--version`` per process)."""
    return _qemu()[0]


def qemu_build() -> str:
    """The QEMU build: version and distribution package (``7.2.22 Debian
    1:7.2+dfsg-7+deb12u18+b3``), as snapshot manifests record it; "unknown" when QEMU
    does not answer. Blocking (one ``--version`` per process)."""
    return _qemu()[1]


@functools.cache
def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The host CPU's model name (``/proc/cpuinfo``), "unknown" when not readable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return "unknown"
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    return found.group(1).strip() if found else "unknown"
