"""Per-sandbox cgroups across a daemon crash: hutchd killed with SIGKILL leaves its VM
running in its group; the next start adopts both, and removes a group no sandbox owns.
A real hutchd subprocess (``tests.e2e.conftest.Daemon``); needs root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hutch.config import load_settings
from hutch.sdk import Sandbox
from hutch.vm.cgroup_driver import SandboxCgroup, record_path
from tests.conftest import ensure_image
from tests.e2e.conftest import _LIVE, Daemon, finalize_daemon

pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]

OVERHEAD_MIB = 64
TB_MIB = 64


def test_a_crashed_daemons_groups_are_adopted_or_removed(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """hutchd killed with SIGKILL: its VM lives on in its group, which the next start
    adopts with the VM; a group no sandbox owns (a crash between group and row) goes."""
    if os.geteuid() != 0:
        pytest.skip("per-sandbox cgroups need root")
    ensure_image("base")
    d = Daemon(tmp_path_factory.mktemp("cgcrash") / "state")
    d.daemon_env.update(
        {
            "HUTCH_CGROUPS": "on",
            "HUTCH_TEMPLATES": "0",
            "HUTCH_CGROUP_MEMORY_OVERHEAD_MIB": str(OVERHEAD_MIB),
            "HUTCH_TCG_TB_MIB": str(TB_MIB),
        }
    )
    d.settings = load_settings(d.daemon_env)
    _LIVE.append(d)
    try:
        d.start()
        with d.client(timeout=300.0) as c:
            sb = Sandbox.create("base", vcpus=1, memory_mib=256, client=c)
        record = record_path(d.settings.sandboxes_dir / sb.id / "qemu.pid")
        cg = SandboxCgroup.load(record)
        assert cg is not None, f"no cgroup record at {record}"
        pid = int((d.settings.sandboxes_dir / sb.id / "qemu.pid").read_text())
        assert all(pid in procs(g) for g in cg.dirs)
        d.kill9()
        orphans = [g.parent / "sb-0000deadbeef" for g in cg.dirs]
        for o in orphans:
            o.mkdir()
        d.start()
        with d.client(timeout=300.0) as c:
            again = Sandbox.connect(sb.id, client=c)
            assert again.exec(["echo", "adopted"]).stdout == "adopted\n"
            assert not any(o.exists() for o in orphans)
            assert all(pid in procs(g) for g in cg.dirs)  # same QEMU, same group
            again.kill()
        assert not any(g.exists() for g in cg.dirs)
    finally:
        problems = finalize_daemon(d)
    assert not problems, "\n".join(problems)
    # The sub-tree goes with the daemon once it is empty.
    assert not any(g.parent.exists() for g in cg.dirs)


def procs(group: Path) -> set[int]:
    return {int(p) for p in (group / "cgroup.procs").read_text().split()}
