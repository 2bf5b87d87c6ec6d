"""Named crash points: a test-only hook that kills the daemon at one exact on-disk step.

Crash safety is a promise about every step of pause, resume, fork and named snapshot
(ARCHITECTURE.md, "Crash safety"), and a promise about a moment cannot be tested by
killing at random moments. So each step that leaves something new on disk calls
:func:`crash_point` with its name; with ``HUTCH_TEST_CRASH_AT=<name>`` in the daemon's
environment the process SIGKILLs itself right there (``<name>:<n>`` at the n-th time that
point is reached, counting from 1). Unset, a crash point costs one dictionary lookup and
does nothing. It is deliberately not a setting: no config file can turn it on.

:data:`POINTS` is the one catalogue of names (what the process has done when it dies
there); ``tests/e2e/test_crash_points.py`` kills at each of them.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

__all__ = ["ENV", "POINTS", "crash_point"]

ENV = "HUTCH_TEST_CRASH_AT"

#: name -> the state the process leaves when it dies at that point.
POINTS: dict[str, str] = {
    # pause (memory) and the save inside fork / snapshot
    "pause.row": "row pausing, the VM untouched",
    "save.stopped": "guest stopped, nothing saved",
    "save.migrated": "state.mig written and hashed, QEMU alive (migration completed)",
    "save.pending": "manifest.pending.json written, QEMU alive",
    "save.quit": "QEMU ended, no manifest yet",
    "save.manifest": "manifest.json written, row not yet paused",
    "pause.disk_quit": "disk mode: guest synced and QEMU ended, row still pausing",
    # resume (memory) and every restore (fork clones, create from a snapshot)
    "resume.row": "row resuming, nothing started",
    "restore.launched": "QEMU started with -incoming, no state loaded",
    "restore.loaded": "state loaded, guest not yet running",
    "restore.running": "guest running (cont), agent not connected",
    "resume.agent": "agent connected, the consumed pause snapshot still on disk",
    "resume.cleaned": "pause snapshot removed, row not yet running",
    # create from the warm pool
    "pool.taken": "a pooled VM handed out, no row written (the request unanswered)",
    "pool.row": "the row inserted (creating) for a pooled VM, not yet renamed or attached",
    # fork and named snapshot
    "fork.rows": "children's rows inserted (creating), parent untouched",
    "snapshot.row": "the snapshot's row inserted (not ready), parent untouched",
    "freeze.config": "saved; vm.json written into the snapshot, disk not moved",
    "freeze.disk_moved": "disk renamed into the snapshot, manifest not yet updated",
    "freeze.done": "snapshot complete (disk inside), row still pausing",
    "rebase.staged": "a clone's snapshot: RAM in its memory.ram, new manifest staged, "
    "the full stream still in place",
    "rebase.swapped": "the state-only stream in place, the staged manifest not yet renamed",
    "clone.disk": "a clone's overlay and vm.json written, QEMU not started",
    "fork.parent": "parent running again on its clone, children not started",
    "snapshot.frozen": "parent running again, the snapshot's row not yet ready",
    # a built-in image's copy replaced by the blob store's (services/builtin_blobs.py)
    "adopt.staged": "the upload fetched and verified beside this host's copy, nothing swapped",
    "adopt.retired": "the copy's templates retired, the copy not yet swapped",
    "adopt.swapped": "the upload exchanged in for the copy, the old copy not yet removed",
    # a frozen directory fetched from the blob store (a template, snapshot, fork, pause)
    "fetch.blob": "one blob of a frozen directory downloaded into its staging directory",
    "template.staged": "a fetched template checked, rehomed and sealed in its staging "
    "directory, not yet renamed into place",
}

_hits: dict[str, int] = {}
_lock = threading.Lock()
log = logging.getLogger(__name__)


def crash_point(name: str) -> None:
    """SIGKILL this process if ``HUTCH_TEST_CRASH_AT`` names this point (and hit count)."""
    if name not in POINTS:
        raise ValueError(f"unknown crash point {name!r}; add it to hutch.crashpoints.POINTS")
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    target, _, nth = wanted.partition(":")
    if target != name:
        return
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        hit = _hits[name]
    if hit != (int(nth) if nth else 1):
        return
    log.warning("crash point %s (hit %d): SIGKILL (%s is set)", name, hit, ENV)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)
