from __future__ import annotations

import pytest

from hutch.errors import InvalidArgument, VmError
from hutch.vm.accel import decide_accel, detect_accel, parse_tsc_khz

INTEL_VMX = "processor\t: 0\nflags\t\t: fpu vme de pse tsc msr vmx sse2\ncpu MHz\t\t: 2400.000\n"
NESTED_NO_FLAGS = (
    "processor\t: 0\nflags\t\t: fpu tsc constant_tsc nonstop_tsc hypervisor\n"
    "cpu MHz\t\t: 2445.404\n"
)
AMD_SVM = "flags\t\t: fpu svm lm\n"


def test_auto_uses_kvm_only_with_flag_and_device() -> None:
    assert decide_accel("auto", INTEL_VMX, kvm_opens=True) == "kvm"
    assert decide_accel("auto", AMD_SVM, kvm_opens=True) == "kvm"
    assert decide_accel("auto", INTEL_VMX, kvm_opens=False) == "tcg"
    # Our hosts: /dev/kvm opens but the CPU shows no vmx/svm (software nested KVM).
    assert decide_accel("auto", NESTED_NO_FLAGS, kvm_opens=True) == "tcg"


def test_tcg_is_always_allowed() -> None:
    assert decide_accel("tcg", INTEL_VMX, kvm_opens=True) == "tcg"


def test_forced_kvm_says_why() -> None:
    with pytest.raises(VmError, match="neither vmx nor svm"):
        decide_accel("kvm", NESTED_NO_FLAGS, kvm_opens=True)
    with pytest.raises(VmError, match="/dev/kvm cannot be opened"):
        decide_accel("kvm", INTEL_VMX, kvm_opens=False)


def test_unknown_choice_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="auto, kvm, tcg"):
        decide_accel("hvf", INTEL_VMX, kvm_opens=True)


def test_this_host_runs_tcg() -> None:
    # design.md §3: the build hosts have no vmx/svm; auto must not pick KVM there.
    from hutch.vm.accel import CPUINFO, cpu_flags

    if cpu_flags(CPUINFO.read_text()) & {"vmx", "svm"}:
        pytest.skip("this host exposes hardware virtualization")
    assert detect_accel("auto") == "tcg"


def test_tsc_khz_needs_an_invariant_tsc() -> None:
    assert parse_tsc_khz(NESTED_NO_FLAGS) == 2445404
    assert parse_tsc_khz(INTEL_VMX) is None
    assert parse_tsc_khz("flags : constant_tsc nonstop_tsc\n") is None
