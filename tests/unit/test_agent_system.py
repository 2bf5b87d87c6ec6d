"""The agent's TCG fix-up of the guest's address layout (``hutch_agent.system``), on
stand-in files for ``/proc/cpuinfo`` and the sysctl. The real guest is checked in
``tests/vm/test_ladder.py::test_commands_reuse_one_address_layout_under_tcg``."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

AGENT_DIR = str(Path(__file__).resolve().parents[2] / "guest_agent")
if AGENT_DIR not in sys.path:
    sys.path.insert(0, AGENT_DIR)

from hutch_agent.system import (  # noqa: E402
    keep_translations_reusable,
    randomize_addresses,
    under_tcg,
)

TCG_CPUINFO = "processor\t: 0\nmodel name\t: QEMU TCG CPU version 2.5+\n"
KVM_CPUINFO = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\n"


def _files(tmp_path: Path, cpuinfo: str) -> tuple[str, Path]:
    info = tmp_path / "cpuinfo"
    info.write_text(cpuinfo)
    sysctl = tmp_path / "randomize_va_space"
    sysctl.write_text("2\n")
    return str(info), sysctl


def test_under_tcg_the_layout_is_fixed(tmp_path: Path) -> None:
    info, sysctl = _files(tmp_path, TCG_CPUINFO)
    keep_translations_reusable(info, str(sysctl))
    assert sysctl.read_text() == "0\n"


def test_under_kvm_randomization_stays(tmp_path: Path) -> None:
    info, sysctl = _files(tmp_path, KVM_CPUINFO)
    keep_translations_reusable(info, str(sysctl))
    assert sysctl.read_text() == "2\n"


def test_an_unreadable_cpuinfo_counts_as_not_tcg(tmp_path: Path) -> None:
    assert under_tcg(str(tmp_path / "missing")) is False


def test_a_sysctl_that_cannot_be_written_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    info, _ = _files(tmp_path, TCG_CPUINFO)
    with caplog.at_level(logging.WARNING, logger="hutch-agent"):
        keep_translations_reusable(info, str(tmp_path / "no-such-dir" / "randomize_va_space"))
    assert "could not fix the address layout for TCG" in caplog.text


def test_the_operator_can_keep_randomization_on(tmp_path: Path) -> None:
    sysctl = tmp_path / "randomize_va_space"
    sysctl.write_text("0\n")
    randomize_addresses(str(sysctl))
    assert sysctl.read_text() == "2\n"
