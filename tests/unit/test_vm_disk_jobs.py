"""Stopping a VM's block jobs before a save (hutch.vm.disk_chain.stop_disk_jobs), against
a QMP that answers as QEMU 7.2 does, including the race CI met (2026-12-06): the
compaction stream ended between the query and the cancel."""

from __future__ import annotations

from typing import Any, cast

import pytest

from hutch.errors import SnapshotError, VmError
from hutch.vm.disk_chain import stop_disk_jobs
from hutch.vm.process import QemuVm


class FakeQmp:
    """``jobs``: what query-block-jobs lists; a cancel ends the job at the next query
    unless ``refuse`` names it; ``ends_before_cancel`` jobs finish on their own just
    before their cancel arrives (QEMU then answers "not found")."""

    def __init__(
        self,
        jobs: list[str],
        *,
        ends_before_cancel: frozenset[str] = frozenset(),
        refuse: frozenset[str] = frozenset(),
    ) -> None:
        self.jobs = list(jobs)
        self.ends_before_cancel = set(ends_before_cancel)
        self.refuse = set(refuse)
        self.cancelling: set[str] = set()
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def qmp(self, cmd: str, **args: Any) -> object:
        self.calls.append((cmd, args))
        if cmd == "query-block-jobs":
            self.jobs = [j for j in self.jobs if j not in self.cancelling]
            return [{"device": j, "type": "stream", "status": "running"} for j in self.jobs]
        assert cmd == "block-job-cancel", cmd
        name = args["device"]
        if name in self.ends_before_cancel:
            self.jobs.remove(name)
            raise VmError(f"QMP block-job-cancel failed: Block job '{name}' not found")
        if name in self.refuse:
            raise VmError(f"QMP block-job-cancel failed: job {name} cannot be cancelled")
        self.cancelling.add(name)
        return {}


def _vm(fake: FakeQmp) -> QemuVm:
    fake.cfg = type("Cfg", (), {"name": "sb-test"})()  # type: ignore[attr-defined]
    return cast(QemuVm, fake)


async def test_running_jobs_are_cancelled_and_waited_for() -> None:
    fake = FakeQmp(["hutch-compact"])
    await stop_disk_jobs(_vm(fake))
    assert ("block-job-cancel", {"device": "hutch-compact", "force": True}) in fake.calls
    assert fake.jobs == []


async def test_a_job_that_ends_before_its_cancel_is_not_an_error() -> None:
    fake = FakeQmp(["hutch-compact"], ends_before_cancel=frozenset({"hutch-compact"}))
    await stop_disk_jobs(_vm(fake))
    assert fake.jobs == []


async def test_a_cancel_refused_for_a_job_still_there_is_raised() -> None:
    fake = FakeQmp(["hutch-compact"], refuse=frozenset({"hutch-compact"}))
    with pytest.raises(VmError, match="cannot be cancelled"):
        await stop_disk_jobs(_vm(fake))


async def test_a_job_that_never_goes_away_ends_in_an_error_naming_the_vm() -> None:
    fake = FakeQmp(["hutch-compact"])
    fake.cancelling = set()  # the cancel is accepted but the job keeps running

    async def stubborn(cmd: str, **args: Any) -> object:
        if cmd == "block-job-cancel":
            return {}
        return [{"device": "hutch-compact", "status": "running"}]

    fake.qmp = stubborn  # type: ignore[method-assign]
    with pytest.raises(SnapshotError, match="sb-test: disk jobs still running"):
        await stop_disk_jobs(_vm(fake), timeout_s=0.05)
