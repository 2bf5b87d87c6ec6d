"""The QMP steps every migration to or from a file shares: the QEMU build string a
stream is tied to, the ``x-ignore-shared`` capability, and waiting for the migration to
end. Used by saving and restoring snapshots (:mod:`hutch.vm.snapshot`) and by the
rebase onto a memory file (:mod:`hutch.vm.snapshot_rebase`)."""

from __future__ import annotations

import asyncio
import time

from hutch.errors import SnapshotError, VmError
from hutch.vm.process import QemuVm

__all__ = ["elapsed_ms", "query_qemu_version", "set_ignore_shared", "wait_migration"]

_POLL_S = 0.002


def elapsed_ms(since: float) -> float:
    """Milliseconds since ``since`` (a ``time.perf_counter()`` reading), for timings."""
    return round((time.perf_counter() - since) * 1000, 2)


async def query_qemu_version(vm: QemuVm) -> str:
    """``query-version`` as one string, build (package) included: a stream loads only
    into the build that wrote it. VmError on an unexpected reply."""
    reply = await vm.qmp("query-version")
    if not isinstance(reply, dict):
        raise VmError(f"unexpected query-version reply: {reply!r}")
    q = reply.get("qemu", {})
    return f"{q.get('major')}.{q.get('minor')}.{q.get('micro')} {reply.get('package', '')}".strip()


async def set_ignore_shared(vm: QemuVm, *, ignore_shared: bool) -> None:
    """Set ``x-ignore-shared`` (skip RAM in a shared memory file) one way or the other:
    capabilities live for the process, so each migration sets it explicitly."""
    await vm.qmp(
        "migrate-set-capabilities",
        capabilities=[{"capability": "x-ignore-shared", "state": ignore_shared}],
    )


async def wait_migration(vm: QemuVm, what: str, timeout_s: float) -> None:
    """Poll ``query-migrate`` until completed; SnapshotError (its message starting with
    ``what``) when it fails, is cancelled, outlasts ``timeout_s`` or QEMU exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not vm.is_alive():
            raise SnapshotError(f"{what}: QEMU exited ({vm.exit_reason}) during migration")
        info = await vm.qmp("query-migrate")
        status = info.get("status") if isinstance(info, dict) else None
        if status == "completed":
            return
        if status in ("failed", "cancelled"):
            detail = info.get("error-desc", "") if isinstance(info, dict) else ""
            raise SnapshotError(f"{what}: migration {status}: {detail or 'no detail'}")
        if time.monotonic() > deadline:
            raise SnapshotError(f"{what}: migration not done after {timeout_s:g}s ({status})")
        await asyncio.sleep(_POLL_S)
