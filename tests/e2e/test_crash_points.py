"""Crash safety at every on-disk step of pause, resume, fork and named snapshot, and of a
create from the warm pool.

The daemon runs with ``HUTCH_TEST_CRASH_AT=<point>`` (:mod:`hutch.crashpoints`): it
SIGKILLs itself at exactly that step of the request under test and is restarted on the
same state. After every kill:

- every acknowledged sandbox is usable (running, or paused and resumable) with its disk
  and its memory (a process started before) as they were;
- every acknowledged snapshot is listed and a sandbox started from it is as it was;
- what the cut request made (fork children, a snapshot) is usable, or failed with a
  reason, or not listed;
- the host matches the store: a QEMU per running sandbox, a directory per running or
  paused one, no consumed pause snapshot beside a running VM, and no snapshot directory
  that nothing reaches.

One daemon and one cold boot for the whole module: every case works on the same parent
sandbox and leaves it running for the next.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from hutch.crashpoints import ENV, POINTS
from hutch.errors import HutchError
from hutch.images.build import ImageArtifacts
from hutch.sdk import Client, SandboxInfo, SnapshotInfo
from hutch.vm.disk_chain import disk_chain
from tests.e2e.conftest import _LIVE, Daemon, finalize_daemon, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.vm, pytest.mark.timeout(900)]

SETTLED = {"running", "paused", "failed", "destroyed"}
ENDED = {"failed", "destroyed"}
# A file on disk and a process that lives in memory only: a cold boot would lose it.
PREPARE = (
    "echo disk-kept > /root/marker && "
    "setsid -f sh -c 'echo $$ > /root/sleeper.pid.new && mv /root/sleeper.pid.new "
    "/root/sleeper.pid && exec sleep 1000000' && "
    "while [ ! -s /root/sleeper.pid ]; do sleep 0.05; done && sync"
)
CHECK = "cat /root/marker && kill -0 $(cat /root/sleeper.pid) && echo ram-kept"
EXPECTED = "disk-kept\nram-kept\n"

#: The name a create cut at a crash point asks for (its guest must take it if adopted).
CUT_CREATE = "cut-create"
_SAVE = ["save.stopped", "save.migrated", "save.pending", "save.quit", "save.manifest"]
_FREEZE = ["freeze.config", "freeze.disk_moved", "freeze.done", "clone.disk"]
#: Points of the rebase on a memory file (HUTCH_FORK_RAM_IN_FILE, off by default), which
#: this lab does not turn on: the commit's crash window is checked by the unit tests of
#: hutch.vm.snapshot_rebase (tests/unit/test_vm_snapshot.py). The points of a fetch from
#: the blob store (this lab has none) are killed at by
#: tests/component/test_template_blobs.py::test_a_fetch_killed_at_any_step_leaves_no_template.
NOT_DRIVEN = {"rebase.staged", "rebase.swapped", "fetch.blob", "template.staged"}
#: Points of a built-in image's adoption (services/builtin_blobs.py), which this lab's
#: single daemon never makes: killed at in tests/component/test_builtin_blobs.py.
NOT_DRIVEN |= {"adopt.staged", "adopt.retired", "adopt.swapped"}
_RESTORE = ["restore.launched", "restore.loaded", "restore.running"]
CASES: list[tuple[str, str]] = [
    *(("pause", p) for p in ["pause.row", *_SAVE]),
    *(("resume", p) for p in ["resume.row", *_RESTORE, "resume.agent", "resume.cleaned"]),
    # The first restore of a fork brings the parent back; the second is a child's.
    *(
        ("fork", p)
        for p in [
            "fork.rows",
            "save.pending",
            "save.quit",
            "save.manifest",
            *_FREEZE,
            *_RESTORE,
            "fork.parent",
            "clone.disk:2",
            "restore.launched:2",
            "restore.running:2",
        ]
    ),
    *(
        ("snapshot", p)
        for p in [
            "snapshot.row",
            "save.quit",
            "save.manifest",
            *_FREEZE,
            *_RESTORE,
            "snapshot.frozen",
        ]
    ),
    # A create served by the warm pool: handed out before its row, and the row written
    # before the guest took its name.
    *(("create", p) for p in ["pool.taken", "pool.row"]),
]


@dataclass
class Lab:
    d: Daemon
    parent: str = ""  # acknowledged: created, prepared
    child: str = ""  # acknowledged: a fork of the parent
    keep: str = ""  # acknowledged: a named snapshot of the parent

    def ensure(self) -> None:
        """Make (again) what a case needs: a running parent, its child and the kept
        snapshot. After a passing case nothing is made again; a failing one costs a
        boot here instead of failing every case after it."""
        with self.d.client(timeout=300.0) as c:
            states = {s.id: s.state for s in c.list_sandboxes()}
            if states.get(self.parent) != "running":
                if states.get(self.parent) not in (None, *ENDED):
                    c.delete_sandbox(self.parent)
                # The default shape: a clone of the template the fixture built (and the
                # shape the warm pool serves).
                self.parent = c.create_sandbox().id
                c.exec(self.parent, ["sh", "-c", PREPARE])
            if states.get(self.child) != "running":
                if states.get(self.child) not in (None, *ENDED):
                    c.delete_sandbox(self.child)
                (child,) = c.fork_sandbox(self.parent, 1)
                self.child = child.id
            if self.keep not in {s.id for s in c.list_snapshots()}:
                self.keep = c.create_snapshot(self.parent, "keep").id


@pytest.fixture(scope="module")
def lab(base_image: ImageArtifacts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    d = Daemon(tmp_path_factory.mktemp("crash-points") / "state")
    # No pooled VMs in the background (but in the pool cases) and the one template built
    # before any case: only the request under test reaches a crash point. Every fork
    # adds a layer to the parent's disk chain; no compaction job may make snapshot
    # directories unreachable behind the test's back.
    d.daemon_env.update(HUTCH_TEMPLATES="1", HUTCH_POOL_SIZE="0", HUTCH_MAX_DISK_LAYERS="32")
    # Two restarts per case: each takes an interpreter that imported hutch meanwhile.
    d.warm_restarts = True
    _LIVE.append(d)
    problems: list[str] = []
    try:
        d.start()
        with d.client(timeout=300.0) as c:
            first = c.create_sandbox()  # cold: builds the default shape's template
            built = wait_for(lambda: any(_templates(d)), 600, 0.5)
            c.delete_sandbox(first.id)
        assert built, "the template was never built"
        lab = Lab(d)
        lab.ensure()
        yield lab
        with d.client(timeout=300.0) as c:
            for snap in c.list_snapshots():
                c.delete_snapshot(snap.id)
    finally:
        problems += finalize_daemon(d)
        left = sorted(p.name for p in (d.state_dir / "snapshots").glob("*"))
        if left:
            problems.append(f"snapshot directories left after everything was deleted: {left}")
    assert not problems, "\n".join(problems)


def _templates(d: Daemon) -> list[Path]:
    root = d.state_dir / "templates"
    found = sorted(root.glob("*/vm.json")) if root.is_dir() else []
    return [p.parent for p in found if not p.parent.name.endswith(".build")]


def _pool_fills(d: Daemon) -> int:
    """How many VMs the daemon's warm pool took in, by its log (every start appends)."""
    try:
        text = d.log_path.read_text(errors="replace")
    except OSError:
        return 0
    return sum(1 for line in text.splitlines() if "warm pool for " in line and "ready" in line)


def crash_at(
    d: Daemon, point: str, call: Callable[[Client], object], *, pool: bool = False
) -> None:
    """Restart ``d`` with the crash point armed, make the request, and wait for the
    daemon to die there. The request must not have been acknowledged. ``pool``: the
    daemon keeps a warm pool of one this time, filled before the request."""
    d.stop()
    d.daemon_env[ENV] = point
    if pool:
        d.daemon_env["HUTCH_POOL_SIZE"] = "1"
    outcome: list[object] = []
    try:
        fills = _pool_fills(d)
        d.start()
        if pool:
            assert wait_for(lambda: _pool_fills(d) > fills, 120), "the warm pool never filled"

        def target() -> None:
            try:
                with d.client(timeout=300.0) as c:
                    outcome.append(call(c))
            except (HutchError, httpx.HTTPError) as exc:
                outcome.append(exc)

        worker = threading.Thread(target=target)
        worker.start()
        deadline = time.monotonic() + 300
        while worker.is_alive() and d.running and time.monotonic() < deadline:
            time.sleep(0.05)
        code = d.wait_exit(10)
        worker.join(60)
    finally:
        d.daemon_env.pop(ENV, None)
        d.daemon_env["HUTCH_POOL_SIZE"] = "0"
    assert code == -signal.SIGKILL, f"the daemon did not die at {point}: exit {code}, {outcome}"
    assert outcome and isinstance(outcome[0], HutchError | httpx.HTTPError), outcome


def usable(c: Client, sandbox_id: str) -> str:
    return c.exec(sandbox_id, ["sh", "-c", CHECK], timeout_s=60).stdout


def assert_host_matches(
    d: Daemon, found: dict[str, SandboxInfo], snaps: dict[str, SnapshotInfo], *, leaks: bool
) -> None:
    running = {i for i, s in found.items() if s.state == "running"}
    paused = {i for i, s in found.items() if s.state == "paused"}
    assert set(d.sandbox_qemus()) == running, (d.sandbox_qemus(), found)
    assert d.sandbox_dirs() == running | paused, (d.sandbox_dirs(), found)
    for sid in running:
        left = d.sandboxes_dir / sid / "pause"
        assert not left.exists(), f"running {sid} keeps a pause snapshot: {os.listdir(left)}"
    if not leaks:
        return
    reached: set[Path] = set()
    for sid in running | paused:
        reached |= {p.resolve() for p in disk_chain(d.sandboxes_dir / sid / "disk.qcow2")[0]}
    for snap in snaps.values():
        path = d.state_dir / "snapshots" / snap.id / "disk.qcow2"
        reached |= {p.resolve() for p in disk_chain(path)[0]}
    for snap_dir in sorted((d.state_dir / "snapshots").iterdir()):
        disk = (snap_dir / "disk.qcow2").resolve()
        assert disk in reached, f"snapshot directory {snap_dir.name} is reached by nothing"


def check_lab(lab: Lab) -> None:
    """Everything acknowledged is usable, everything cut is usable or gone; the lab is
    left with the parent running, its fork child and the kept snapshot, nothing else."""
    d = lab.d
    with d.client(timeout=300.0) as c:
        found = {s.id: s for s in c.list_sandboxes()}
        for s in found.values():
            assert s.state in SETTLED, s
            assert s.state != "failed" or s.error, f"{s.id} failed without a reason"
        assert found[lab.parent].state in ("running", "paused"), found[lab.parent]
        assert found[lab.child].state == "running", found[lab.child]
        snaps = {s.id: s for s in c.list_snapshots()}
        assert lab.keep in snaps, f"acknowledged snapshot {lab.keep} is not listed: {snaps}"
        assert_host_matches(d, found, snaps, leaks=False)
        if found[lab.parent].state == "paused":
            c.resume_sandbox(lab.parent)
        assert usable(c, lab.parent) == EXPECTED
        assert usable(c, lab.child) == EXPECTED
        for s in found.values():
            if s.id in (lab.parent, lab.child) or s.state in ENDED:
                continue
            if s.name == CUT_CREATE:
                # A cut create from the pool that was adopted: running under its name.
                assert s.state == "running", s
                assert c.exec(s.id, ["hostname"]).stdout == f"{CUT_CREATE}\n"
                c.delete_sandbox(s.id)
                continue
            # A child of the cut fork that was adopted: a clone of the parent.
            assert s.state == "running" and s.parent_id == lab.parent, s
            assert usable(c, s.id) == EXPECTED
            c.delete_sandbox(s.id)
        for snap in snaps.values():
            if snap.id == lab.keep:
                continue
            # The cut snapshot request was finished: the snapshot is whole.
            started = c.create_sandbox(snapshot=snap.id)
            assert usable(c, started.id) == EXPECTED
            c.delete_sandbox(started.id)
            c.delete_snapshot(snap.id)
        found = {s.id: s for s in c.list_sandboxes()}
        snaps = {s.id: s for s in c.list_snapshots()}
    assert set(snaps) == {lab.keep}
    assert_host_matches(d, found, snaps, leaks=True)


OPS: dict[str, Callable[[Client, str], object]] = {
    "pause": lambda c, sid: c.pause_sandbox(sid),
    "resume": lambda c, sid: c.resume_sandbox(sid),
    "fork": lambda c, sid: c.fork_sandbox(sid, 2),
    "snapshot": lambda c, sid: c.create_snapshot(sid, "cut"),
    "create": lambda c, sid: c.create_sandbox(name=CUT_CREATE),
}


def test_every_crash_point_is_driven() -> None:
    driven = {p.partition(":")[0] for _, p in CASES} | {"pause.disk_quit"}
    assert driven | NOT_DRIVEN == set(POINTS) and not driven & NOT_DRIVEN


@pytest.mark.parametrize(("op", "point"), CASES, ids=[f"{o}@{p}" for o, p in CASES])
def test_kill_at_step(lab: Lab, op: str, point: str) -> None:
    lab.ensure()
    if op == "resume":
        with lab.d.client(timeout=300.0) as c:
            c.pause_sandbox(lab.parent)
    crash_at(lab.d, point, lambda c: OPS[op](c, lab.parent), pool=op == "create")
    lab.d.start()
    check_lab(lab)


def test_kill_at_a_disk_mode_pause(lab: Lab) -> None:
    """Killed after QEMU ended in a disk-mode pause: the disk is kept (paused, disk
    mode) and boots again; only processes are lost, as a disk pause promises."""
    lab.ensure()
    with lab.d.client(timeout=300.0) as c:
        (sb,) = c.fork_sandbox(lab.parent, 1)
    crash_at(lab.d, "pause.disk_quit", lambda c: c.pause_sandbox(sb.id, "disk"))
    lab.d.start()
    with lab.d.client(timeout=300.0) as c:
        info = c.get_sandbox(sb.id)
        assert (info.state, info.pause_mode) == ("paused", "disk"), info
        c.resume_sandbox(sb.id)
        assert c.exec(sb.id, ["cat", "/root/marker"]).stdout == "disk-kept\n"
        c.delete_sandbox(sb.id)
    check_lab(lab)


def test_snapshots_delete_in_any_order_and_are_collected_at_once(lab: Lab) -> None:
    """Snapshots built on each other delete in any order; a layer goes as soon as no
    sandbox or snapshot is built on it (a fork snapshot included)."""
    lab.ensure()
    snapshots = lab.d.state_dir / "snapshots"
    with lab.d.client(timeout=300.0) as c:
        (x,) = c.fork_sandbox(lab.child, 1)  # lab.child and x now run on fork F
        before = set(snapshots.iterdir())
        (y,) = c.fork_sandbox(x.id, 1)
        (fork_dir,) = set(snapshots.iterdir()) - before  # x and y run on it
        s1 = c.create_snapshot(y.id, "s1")  # s1 is built on the fork snapshot
        z = c.create_sandbox(snapshot=s1.id)
        s2 = c.create_snapshot(z.id, "s2")  # s2 is built on s1
        for sid in (x.id, y.id, z.id):
            c.delete_sandbox(sid)
        assert fork_dir.exists(), "the fork snapshot went while snapshots are built on it"

        c.delete_snapshot(s1.id)  # older first: allowed, s2 still needs its layers
        assert s1.id not in {s.id for s in c.list_snapshots()}
        w = c.create_sandbox(snapshot=s2.id)
        assert usable(c, w.id) == EXPECTED
        c.delete_sandbox(w.id)
        assert (snapshots / s1.id).exists() and fork_dir.exists()

        c.delete_snapshot(s2.id)
        # Collected by the delete itself, not by some later one.
        left = {p.name for p in snapshots.iterdir()} & {s1.id, s2.id, fork_dir.name}
        assert not left, f"nothing is built on {left} any more, yet they are still there"
    check_lab(lab)


def test_restart_checks_vms_concurrently_and_serves_meanwhile(lab: Lab) -> None:
    """A VM that is slow to check does not hold up the others nor the API: the daemon
    answers at once (reconciling), a sandbox still being checked answers 503 with
    Retry-After, and a half-restored VM found after it is settled while it is checked."""
    lab.ensure()
    d = lab.d
    with d.client(timeout=300.0) as c:
        slow, half = c.fork_sandbox(lab.parent, 2)
        c.pause_sandbox(half.id)
    # half: its resume is cut after QEMU started, before it loaded any state.
    crash_at(d, "restore.launched", lambda c: c.resume_sandbox(half.id))
    # slow: its QEMU does not answer QMP (stopped), so checking it takes the QMP timeout.
    slow_pid = d.qemu_pid_of(slow.id)
    os.kill(slow_pid, signal.SIGSTOP)
    try:
        d.start(reconciled=False)
        headers = {"Authorization": f"Bearer {d.api_key}"}
        health = httpx.get(f"{d.url}/healthz", timeout=5).json()
        assert health["status"] == "reconciling", health

        def half_settled_while_slow_is_checked() -> bool:
            slow_r = httpx.get(f"{d.url}/v1/sandboxes/{slow.id}", headers=headers, timeout=5)
            half_r = httpx.get(f"{d.url}/v1/sandboxes/{half.id}", headers=headers, timeout=5)
            if slow_r.status_code != 503:
                return False
            assert slow_r.headers.get("Retry-After", "").isdigit(), slow_r.headers
            assert slow_r.json()["error"]["code"] == "unavailable", slow_r.text
            return half_r.status_code == 200 and half_r.json()["state"] == "paused"

        assert wait_for(half_settled_while_slow_is_checked, 30, interval_s=0.1)
        assert wait_for(lambda: httpx.get(f"{d.url}/healthz").json()["status"] == "ok", 60)
    finally:
        # Only for a failure above: a check that ran out of time has killed it.
        subprocess.run(["kill", "-CONT", str(slow_pid)], capture_output=True, check=False)
    with d.client(timeout=300.0) as c:
        gone = c.get_sandbox(slow.id)
        assert gone.state == "failed" and gone.error, gone
        c.resume_sandbox(half.id)
        assert usable(c, half.id) == EXPECTED
        c.delete_sandbox(half.id)
    check_lab(lab)
