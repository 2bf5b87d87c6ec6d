"""``timeout_s`` on create: the daemon destroys the sandbox by itself."""

from __future__ import annotations

import time

import pytest

from hutch.sdk import Sandbox
from tests.e2e.conftest import Daemon, pid_alive, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.vm]


def test_sandbox_with_timeout_destroys_itself(daemon: Daemon) -> None:
    with daemon.client() as client:
        sb = Sandbox.create(memory_mib=256, timeout_s=5, client=client)
        ready_at = time.monotonic()
        try:
            pid = daemon.qemu_pid_of(sb.id)
            assert sb.info.timeout_s == 5
            assert sb.info.expires_at is not None and sb.info.started_at is not None
            assert 4.5 <= (sb.info.expires_at - sb.info.started_at).total_seconds() <= 5.5
            assert sb.exec("echo alive").stdout == "alive\n"

            assert wait_for(lambda: client.get_sandbox(sb.id).state == "destroyed", 15), (
                f"still {client.get_sandbox(sb.id).state} {time.monotonic() - ready_at:.1f} s "
                "after it booted with timeout_s=5"
            )
            gone_after = time.monotonic() - ready_at
            # Its timeout runs from the end of boot; the reaper looks once a second.
            assert gone_after <= 10, gone_after
            assert wait_for(lambda: not pid_alive(pid), 5), "QEMU outlived the timeout"
            assert sb.id not in daemon.sandbox_dirs()
            assert client.get_sandbox(sb.id).ended_at is not None
        finally:
            sb.kill()
