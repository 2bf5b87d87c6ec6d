"""QEMU ``microvm`` driver: accelerator choice, command line, process + QMP."""

from hutch.vm.accel import detect_accel, host_tsc_khz
from hutch.vm.argv import VmConfig, build_argv
from hutch.vm.process import QemuVm, VmState

__all__ = ["QemuVm", "VmConfig", "VmState", "build_argv", "detect_accel", "host_tsc_khz"]
