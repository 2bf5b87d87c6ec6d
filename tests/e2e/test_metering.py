"""Metering with the real daemon and a real VM: every phase of one sandbox (running,
paused in memory mode, running again, ...) is billed within 1 s of the wall-clock truth,
with the daemon SIGKILLed and restarted twice in the middle (once while the sandbox
runs, once while it is paused), and what is billed survives another restart.

One sandbox, one boot: pause and resume are restores, restarts adopt the running VM.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from hutch.images.build import ImageArtifacts
from hutch.sdk import Client, Usage
from tests.e2e.conftest import _LIVE, Daemon, finalize_daemon

pytestmark = [pytest.mark.e2e, pytest.mark.vm, pytest.mark.timeout(600)]

VCPUS, MEMORY_MIB = 1, 256
GIB = MEMORY_MIB / 1024
#: The promise: each phase billed within this of what the client measured.
TOLERANCE_S = 1.0


@pytest.fixture(scope="module")
def d(base_image: ImageArtifacts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    daemon = Daemon(tmp_path_factory.mktemp("metering") / "state")
    # Nothing in the background competes for the two cores (no template VM, no pool).
    daemon.daemon_env.update(HUTCH_TEMPLATES="0", HUTCH_POOL_SIZE="0", HUTCH_METER_HEARTBEAT_S="1")
    _LIVE.append(daemon)
    try:
        daemon.start()
        yield daemon
    finally:
        problems = finalize_daemon(daemon)
    assert not problems, "\n".join(problems)


def usage_of(c: Client, sandbox_id: str, start: float, end: float) -> tuple[float, float]:
    """(vCPU-seconds / vCPUs, paused GiB-seconds / GiB) billed to the sandbox in the
    window: seconds of running and of paused memory."""
    report: Usage = c.usage(start, end)
    rows = [r for r in report.rows if r.key == sandbox_id]
    if not rows:
        return 0.0, 0.0
    return rows[0].vcpu_seconds / VCPUS, rows[0].paused_memory_gib_seconds / GIB


def restart_killed(d: Daemon) -> None:
    d.kill9()
    time.sleep(1.0)  # down for a while: the VM (or its saved state) is still billed
    d.start()


def test_each_phase_is_billed_to_the_second_across_two_sigkills(d: Daemon) -> None:
    marks: list[tuple[str, float, float]] = []  # (phase, start, end), client wall clock
    with d.client(timeout=300.0) as c:
        sid = c.create_sandbox(vcpus=VCPUS, memory_mib=MEMORY_MIB).id
        t = time.time()  # the create returned: the row says running

        time.sleep(3.0)
        c.pause_sandbox(sid)
        marks.append(("running", t, t := time.time()))  # pausing is billed as running

        time.sleep(3.0)
        resume_at = time.time()
        c.resume_sandbox(sid)  # resuming is billed as running: it starts at the call
        marks.append(("paused", t, resume_at))
        t = resume_at

        time.sleep(1.0)
    restart_killed(d)  # 1: the sandbox runs while no daemon is there
    with d.client(timeout=300.0) as c:
        assert c.get_sandbox(sid).state == "running"  # adopted
        time.sleep(1.0)
        c.pause_sandbox(sid)
        marks.append(("running", t, t := time.time()))
        time.sleep(1.0)
    restart_killed(d)  # 2: paused while no daemon is there
    with d.client(timeout=300.0) as c:
        assert c.get_sandbox(sid).state == "paused"
        time.sleep(1.0)
        resume_at = time.time()
        c.resume_sandbox(sid)
        marks.append(("paused", t, resume_at))
        t = resume_at
        assert c.exec(sid, ["true"]).exit_code == 0
        time.sleep(2.0)
        delete_at = time.time()
        c.delete_sandbox(sid)  # stopping ends the VM's bill at the call
        marks.append(("running", t, delete_at))
        deleted = time.time()

        def check(c: Client) -> None:
            for phase, start, end in marks:
                running, paused = usage_of(c, sid, start, end)
                truth = end - start
                billed, other = (running, paused) if phase == "running" else (paused, running)
                assert abs(billed - truth) <= TOLERANCE_S, (phase, start, end, billed, truth)
                # The neighbouring phase leaks in only at the edges of the window.
                assert other <= TOLERANCE_S, (phase, start, end, other)
            running, paused = usage_of(c, sid, marks[0][1] - 60, deleted + 60)
            run_truth = sum(e - s for p, s, e in marks if p == "running")
            pause_truth = sum(e - s for p, s, e in marks if p == "paused")
            # Nothing lost, nothing counted twice, over all of it.
            assert abs(running - run_truth) <= TOLERANCE_S, (running, run_truth)
            assert abs(paused - pause_truth) <= TOLERANCE_S, (paused, pause_truth)

        check(c)
        before = c.usage(marks[0][1] - 60, deleted + 60)
        events = [e.type for e in c.sandbox_events(sid).events]
    assert events == [
        "sandbox.created", "sandbox.started", "sandbox.paused", "sandbox.resumed",
        "sandbox.paused", "sandbox.resumed", "sandbox.exec", "sandbox.deleted",
    ], events  # fmt: skip

    d.stop()  # what is billed survives a restart, to the microsecond
    d.start()
    with d.client(timeout=300.0) as c:
        after = c.usage(marks[0][1] - 60, deleted + 60)
        check(c)
    assert [r for r in after.rows if r.key == sid] == [r for r in before.rows if r.key == sid]
