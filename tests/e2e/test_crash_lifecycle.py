"""Crash safety of pause and fork: the daemon is SIGKILLed in the middle and restarted;
the sandbox is never lost and nothing is left half-done or orphaned."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from hutch.errors import HutchError
from tests.e2e.conftest import Daemon, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.vm]

SETTLED = {"running", "paused", "failed", "destroyed"}


def states(d: Daemon) -> dict[str, str]:
    with d.client() as c:
        return {s.id: s.state for s in c.list_sandboxes()}


def assert_consistent(d: Daemon) -> dict[str, str]:
    now = states(d)
    assert set(now.values()) <= SETTLED, now
    running = {i for i, s in now.items() if s == "running"}
    paused = {i for i, s in now.items() if s == "paused"}
    assert set(d.sandbox_qemus()) == running, (d.sandbox_qemus(), now)
    assert d.sandbox_dirs() == running | paused, (d.sandbox_dirs(), now)
    return now


def run_and_kill(d: Daemon, call: Callable[[], object], started: Callable[[], bool]) -> None:
    outcome: list[object] = []

    def target() -> None:
        try:
            outcome.append(call())
        except HutchError as exc:  # the daemon vanished under the request
            outcome.append(exc)

    worker = threading.Thread(target=target)
    worker.start()
    wait_for(started, 5.0, interval_s=0.02)
    time.sleep(0.3)
    d.kill9()
    worker.join(60)
    assert not worker.is_alive() and outcome


def test_daemon_killed_mid_fork_and_mid_pause(make_daemon: Callable[[], Daemon]) -> None:
    d = make_daemon()
    with d.client() as c:
        parent = c.create_sandbox(memory_mib=256)
        c.exec(parent.id, ["sh", "-c", "echo kept > /root/f; sync"])
    snapshots = d.state_dir / "snapshots"

    def fork() -> object:
        with d.client() as c:
            return c.fork_sandbox(parent.id, 3)

    run_and_kill(d, fork, lambda: snapshots.is_dir() and any(snapshots.iterdir()))
    d.start()
    now = assert_consistent(d)
    assert now[parent.id] in ("running", "paused"), now
    with d.client() as c:
        if now[parent.id] == "paused":
            c.resume_sandbox(parent.id)
        assert c.exec(parent.id, ["cat", "/root/f"]).stdout == "kept\n"
        for child in c.list_sandboxes():
            if child.parent_id == parent.id and child.state == "running":
                assert c.exec(child.id, ["cat", "/root/f"]).stdout == "kept\n"

    pause_dir = d.sandboxes_dir / parent.id / "pause"

    def pause() -> object:
        with d.client() as c:
            return c.pause_sandbox(parent.id)

    run_and_kill(d, pause, pause_dir.exists)
    d.start()
    now = assert_consistent(d)
    assert now[parent.id] in ("running", "paused"), now
    with d.client() as c:
        c.resume_sandbox(parent.id)
        assert c.exec(parent.id, ["cat", "/root/f"]).stdout == "kept\n"
    assert_consistent(d)


def test_many_concurrent_creates_and_execs(make_daemon: Callable[[], Daemon]) -> None:
    """Tens of creates and hundreds of execs at once leave a consistent store."""
    from concurrent.futures import ThreadPoolExecutor

    d = make_daemon()
    with d.client() as c:
        c.delete_sandbox(c.create_sandbox(memory_mib=256).id)  # the template for the shape
    # Finished, not being built (a "<key>.build" directory has its vm.json early).
    assert wait_for(
        lambda: any(
            not p.parent.name.endswith(".build")
            for p in (d.state_dir / "templates").glob("*/vm.json")
        ),
        300,
    )

    def create(_: int) -> str:
        with d.client() as c:
            return c.create_sandbox(memory_mib=256).id

    with ThreadPoolExecutor(10) as pool:
        ids = list(pool.map(create, range(10)))
    assert len(set(ids)) == 10

    def run(i: int) -> str:
        with d.client() as c:
            return c.exec(ids[i % 10], ["echo", str(i)]).stdout

    with ThreadPoolExecutor(20) as pool:
        outputs = list(pool.map(run, range(200)))
    assert outputs == [f"{i}\n" for i in range(200)]
    now = assert_consistent(d)
    assert all(now[i] == "running" for i in ids)
