"""Choosing the accelerator: KVM where the CPU really has hardware virtualization, TCG
otherwise.

``/dev/kvm`` alone proves nothing: on our hosts it exists as a software nested KVM under
which a stock guest kernel never reaches init (design.md §3). So KVM needs both the
``vmx``/``svm`` CPU flag and a ``/dev/kvm`` that opens read-write.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from hutch.errors import InvalidArgument, VmError

Accel = Literal["kvm", "tcg"]

CPUINFO = Path("/proc/cpuinfo")
KVM_DEVICE = Path("/dev/kvm")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The ``flags`` of the first CPU in ``/proc/cpuinfo`` text."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return set(value.split())
    return set()


def decide_accel(requested: str, cpuinfo: str, kvm_opens: bool) -> Accel:
    """Pure decision behind :func:`detect_accel` (testable with fake inputs).

    Raises ``VmError`` when ``kvm`` is forced on a host that cannot run it, and
    ``InvalidArgument`` for anything other than ``auto``, ``kvm`` or ``tcg``.
    """
    if requested not in ("auto", "kvm", "tcg"):
        raise InvalidArgument(f"accel={requested!r}; accepted: auto, kvm, tcg")
    if requested == "tcg":
        return "tcg"
    has_hw = bool(cpu_flags(cpuinfo) & {"vmx", "svm"})
    if has_hw and kvm_opens:
        return "kvm"
    if requested == "kvm":
        if not has_hw:
            why = "the CPU flags in /proc/cpuinfo show neither vmx nor svm"
        else:
            why = f"{KVM_DEVICE} cannot be opened read-write"
        raise VmError(f"accel=kvm was requested but {why}; set HUTCH_ACCEL=tcg or auto")
    return "tcg"


def kvm_opens(device: Path = KVM_DEVICE) -> bool:
    """True when ``device`` opens read-write (exists, permitted, module loaded)."""
    try:
        fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


def detect_accel(requested: str = "auto") -> Accel:
    """``auto`` → ``kvm`` only when cpuinfo shows vmx/svm and ``/dev/kvm`` opens, else
    ``tcg``. ``kvm`` on a host without it raises ``VmError`` saying why.

    The caller passes ``Settings.accel`` (``HUTCH_ACCEL``); this never reads the
    environment itself.
    """
    return decide_accel(requested, CPUINFO.read_text(), kvm_opens())


def parse_tsc_khz(cpuinfo: str) -> int | None:
    """The host TSC frequency in kHz, when the TSC is invariant (``constant_tsc`` and
    ``nonstop_tsc``) so that ``cpu MHz`` is its rate; else None."""
    if not {"constant_tsc", "nonstop_tsc"} <= cpu_flags(cpuinfo):
        return None
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "cpu MHz":
            try:
                khz = round(float(value.strip()) * 1000)
            except ValueError:
                return None
            return khz if khz > 0 else None
    return None


def host_tsc_khz() -> int | None:
    """See :func:`parse_tsc_khz`; reads this host's ``/proc/cpuinfo``."""
    return parse_tsc_khz(CPUINFO.read_text())
