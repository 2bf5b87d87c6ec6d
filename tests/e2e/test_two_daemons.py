"""Two daemons on one host, with their own state dirs and ports, never touch each other."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from hutch import errors
from hutch.sdk import SandboxInfo
from tests.e2e.conftest import Daemon, pid_alive, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.vm]


def _create(d: Daemon) -> SandboxInfo:
    with d.client() as c:
        return c.create_sandbox(memory_mib=256, metadata={"owner": d.url})


def _ids(d: Daemon) -> set[str]:
    with d.client() as c:
        return {s.id for s in c.list_sandboxes() if s.state == "running"}


def _echo(d: Daemon, sandbox_id: str) -> str:
    with d.client() as c:
        return c.exec(sandbox_id, ["echo", "ok"]).stdout


def test_two_daemons_side_by_side(make_daemon: Callable[[], Daemon]) -> None:
    a, b = make_daemon(), make_daemon()
    assert a.run_dir != b.run_dir and a.port != b.port
    with ThreadPoolExecutor(2) as pool:
        sa, sb = pool.map(_create, [a, b])
    assert _ids(a) == {sa.id} and _ids(b) == {sb.id}
    with a.client() as c:
        assert c.list_sandboxes(metadata={"owner": b.url}) == []
    pid_a, pid_b = a.qemu_pid_of(sa.id), b.qemu_pid_of(sb.id)
    assert a.sandbox_qemus() == {sa.id: pid_a} and b.sandbox_qemus() == {sb.id: pid_b}

    # Stopping one daemon leaves every VM running: its own (adopted later) and the other's.
    a.stop()
    assert pid_alive(pid_a) and pid_alive(pid_b)
    assert _echo(b, sb.id) == "ok\n"
    a.start()
    assert _ids(a) == {sa.id}
    assert _echo(a, sa.id) == "ok\n"

    # Deleting in one does not affect the other; ids of the other are unknown to it.
    with a.client() as c:
        c.delete_sandbox(sa.id)
        assert {s.id for s in c.list_sandboxes()} == set()
        with pytest.raises(errors.NotFound):
            c.delete_sandbox(sb.id)
    assert wait_for(lambda: not pid_alive(pid_a), 10)
    assert pid_alive(pid_b)
    assert _ids(b) == {sb.id}
    assert _echo(b, sb.id) == "ok\n"
    assert a.sandbox_dirs() == set() and b.sandbox_dirs() == {sb.id}
