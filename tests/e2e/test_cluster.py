"""Three hutchd workers on this machine sharing one database and one S3 bucket:
placement, routing through any worker, a named snapshot created from on a worker that
never had it, a memory pause on one worker resumed on another with its processes, a
drain that moves every running sandbox off its host, and a worker SIGKILLed (its
running sandboxes reported lost within the lease, nothing else touched, its paused
ones resumed elsewhere). One module-scoped cluster; every sandbox is 128 MiB and
restored from each worker's template of the base image.

The workers share one PostgreSQL database of the suite's server (``tests/pgserver.py``,
Debian's PostgreSQL) and one SeaweedFS (``tests/s3server.py``) as their blob store, as
hosts on many machines would.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox as E2bSandbox
from e2b import SandboxQuery

from hutch import errors
from hutch.images.build import ImageArtifacts
from hutch.sdk import Client, Sandbox, SandboxInfo
from tests.e2e.cluster_lab import LEASE_S, MEMORY_MIB, Worker, cluster_of, create_on, owners
from tests.e2e.conftest import pid_alive, wait_for
from tests.s3server import S3Server, s3_server

__all__ = ["s3_server"]  # the module-scoped SeaweedFS fixture, used by ``cluster``

pytestmark = [pytest.mark.e2e, pytest.mark.vm]

LABELS = {"w1": "zone=a", "w2": "zone=a", "w3": "zone=b"}


# Written to a new file and renamed: a reader never sees the file truncated and empty.
COUNTER = (
    "setsid -f sh -c 'i=0; while :; do i=$((i+1)); "
    "echo $i > /tmp/c.new; mv /tmp/c.new /tmp/c; sleep 0.2; done'"
)


@pytest.fixture(scope="module")
def cluster(
    base_image: ImageArtifacts, tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server
) -> Iterator[list[Worker]]:
    with cluster_of(
        tmp_path_factory.mktemp("cluster"),
        ("w1", "w2", "w3"),
        labels=LABELS,
        s3=s3_server,
        e2b=True,
    ) as workers:
        yield workers


def _counter(c: Client, sandbox_id: str) -> int:
    return int(c.exec(sandbox_id, ["cat", "/tmp/c"]).stdout.strip())


def _with_state(c: Client, **options: object) -> tuple[Sandbox, int]:
    """A sandbox (created through ``c``) running a counter process and holding a Python
    variable (x = 41) in its interpreter; the handle (its context) and the counter."""
    info = c.create_sandbox(memory_mib=MEMORY_MIB, **options)  # type: ignore[arg-type]
    c.exec(info.id, ["sh", "-c", COUNTER])
    assert wait_for(lambda: c.exec(info.id, ["test", "-s", "/tmp/c"]).exit_code == 0, 30)
    sb = Sandbox(c, info)
    assert sb.run_code("x = 41\nx").text == "41"
    return sb, _counter(c, info.id)


def _kept_state(c: Client, sb: Sandbox, before: int, context: str | None = None) -> None:
    """The counter process ran on (past ``before``) and the variable is there (in the
    handle's context, or ``context``: a fork child's is its parent's)."""
    first = _counter(c, sb.id)
    assert first >= before
    assert wait_for(lambda: _counter(c, sb.id) > first, 20), "the counter process runs on"
    assert sb.run_code("x + 1", context).text == "42"


_owners = owners
_create = create_on


def test_every_worker_lists_the_three_hosts(cluster: list[Worker]) -> None:
    for w in cluster:
        listed = w.cli("host", "ls", "--json")
        assert listed.returncode == 0, listed.stderr
        hosts = {h["id"]: h for h in json.loads(listed.stdout)}
        assert set(hosts) == {"w1", "w2", "w3"}
        assert {h for h, v in hosts.items() if v["this"]} == {w.host_id}
        for h in hosts.values():
            assert h["state"] == "up" and h["capacity"]["memory_mib"] > 0
            assert h["address"].startswith("http://127.0.0.1:")
        assert hosts["w3"]["labels"] == {"zone": "b"}


def test_twenty_creates_spread_and_any_worker_reaches_the_right_vm(
    cluster: list[Worker],
) -> None:
    # One after another (through each worker in turn), so each placement sees the last:
    # equal hosts then take them in turn.
    ids = [_create(cluster[i % 3], metadata={"n": str(i)}).id for i in range(20)]
    owners = _owners(cluster)
    assert set(owners) >= set(ids)
    per_host = {h: sum(1 for i in ids if owners[i] == h) for h in ("w1", "w2", "w3")}
    assert sorted(per_host.values()) == [6, 7, 7], per_host  # spread evenly
    # Each sandbox: a file written through one worker, read through another and seen by
    # a command run through the third; none of them need be the owner.
    for n, sandbox_id in enumerate(ids):
        wa, wb, wc = cluster[n % 3], cluster[(n + 1) % 3], cluster[(n + 2) % 3]
        with wa.client() as ca:
            ca.write_file(sandbox_id, "/tmp/who", sandbox_id.encode())
        with wb.client() as cb:
            assert cb.read_file(sandbox_id, "/tmp/who") == sandbox_id.encode()
        with wc.client() as cc:
            assert cc.exec(sandbox_id, ["cat", "/tmp/who"]).stdout == sandbox_id
    # A streamed exec and a terminal WebSocket through a worker that is not the owner.
    first = ids[0]
    other = next(w for w in cluster if w.host_id != owners[first])
    with other.client() as c:
        seen: list[str] = []
        result = c.exec(first, ["sh", "-c", "echo one; echo two"], on_stdout=seen.append)
        assert result.stdout == "one\ntwo\n" and "".join(seen) == "one\ntwo\n"
        term = Sandbox(c, c.get_sandbox(first)).pty.open(rows=24, cols=80)
        try:
            term.send("cat /tmp/who; exit\n")
            assert first.encode() in term.read_until(first, timeout=60.0)
        finally:
            term.close()
    # Deletes through a worker that is not the owner; the VM goes on its own host. The
    # first three (one per host) stay for the tests after this one.
    kept = ids[:3]
    for sandbox_id in ids[3:]:
        host = owners[sandbox_id]
        via = next(w for w in cluster if w.host_id != host)
        with via.client() as c:
            c.delete_sandbox(sandbox_id)
    assert wait_for(lambda: not set(ids[3:]) & set(_owners(cluster)), 20)
    assert set(kept) <= set(_owners(cluster))
    for w in cluster:  # every worker lists the whole cluster
        with w.client() as c:
            assert {s.id for s in c.list_sandboxes() if s.state == "running"} >= set(kept)


def test_placement_pins_by_host_and_label_and_refuses_bad_selectors(
    cluster: list[Worker],
) -> None:
    pinned = _create(cluster[0], placement={"host": "w2"})
    labelled = _create(cluster[1], placement={"labels": {"zone": "b"}})
    owners = _owners(cluster)
    assert owners[pinned.id] == "w2" and owners[labelled.id] == "w3"
    with cluster[2].client() as c:
        with pytest.raises(errors.InvalidArgument, match="not a host of this cluster"):
            c.create_sandbox(memory_mib=MEMORY_MIB, placement={"host": "nowhere"})
        with pytest.raises(errors.InvalidArgument, match="no host has the labels zone=c"):
            c.create_sandbox(memory_mib=MEMORY_MIB, placement={"labels": {"zone": "c"}})
        with pytest.raises(errors.InvalidArgument, match="placement"):
            c.create_sandbox(memory_mib=MEMORY_MIB, placement={"hots": "w1"})
        c.delete_sandbox(pinned.id)
        c.delete_sandbox(labelled.id)


def test_a_fork_on_one_worker_gives_children_on_the_others(cluster: list[Worker]) -> None:
    w1, w2, w3 = cluster
    with w2.client(timeout=300.0) as c:
        parent, _ = _with_state(c, placement={"host": "w1"})
        # One sandbox per worker runs already (the twenty-create test kept them): the
        # parent's host holds the most, so spread puts the children on the others.
        children = c.fork_sandbox(parent.id, count=2)
        owners = _owners(cluster)
        assert owners[parent.id] == "w1"
        assert sorted(owners[k.id] for k in children) == ["w2", "w3"]
        assert "fork fork-" in w1.log_path.read_text()  # uploaded for the other hosts
        # Each child is a live copy: the counter process runs on in each, the Python
        # variable is there, and each has its own disk from then on.
        context = parent.contexts.default().id
        for kid in children:
            _kept_state(c, Sandbox(c, kid), 0, context)
            c.write_file(kid.id, "/root/mine", kid.id.encode())
        assert c.exec(children[0].id, ["cat", "/root/mine"]).stdout == children[0].id
        assert c.exec(parent.id, ["test", "-e", "/root/mine"]).exit_code == 1
        for sandbox_id in (*(k.id for k in children), parent.id):
            c.delete_sandbox(sandbox_id)
    kids = {k.id for k in children}
    assert wait_for(lambda: not (w2.sandbox_dirs() | w3.sandbox_dirs()) & kids, 20)


def test_a_named_snapshot_is_created_from_on_a_worker_without_its_files(
    cluster: list[Worker], s3_server: S3Server
) -> None:
    w1, w2, w3 = cluster
    source = _create(w1, placement={"host": "w2"})
    with w1.client(timeout=300.0) as c:
        c.write_file(source.id, "/root/made-on", b"w2")
        snap = c.create_snapshot(source.id, "xhost")
        index = f"snapshots/{snap.id}/index.json"
        assert wait_for(lambda: index in w2.blob_keys(s3_server, "snapshots/"), 120)
        assert not (w3.state_dir / "snapshots" / snap.id).exists()  # w3 never had it
        # Pinned to w3 (before the upload only w2, which holds the files, would do).
        child = c.create_sandbox(snapshot=snap.id, placement={"host": "w3"})
        assert _owners(cluster)[child.id] == "w3"
        assert c.read_file(child.id, "/root/made-on") == b"w2"
        assert "fetched from" in w3.log_path.read_text()
        c.delete_sandbox(child.id)
        # Its local copy gone from w3 (the cache): a create there fetches it again.
        assert wait_for(lambda: not (w3.sandboxes_dir / child.id).exists(), 20)
        shutil.rmtree(w3.state_dir / "snapshots" / snap.id)
        again = c.create_sandbox(snapshot=snap.id, placement={"host": "w3"})
        assert c.read_file(again.id, "/root/made-on") == b"w2"
        for sandbox_id in (again.id, source.id):
            c.delete_sandbox(sandbox_id)
        c.delete_snapshot(snap.id)


def test_pause_on_one_worker_resumes_on_another_and_drain_moves_all_off(
    cluster: list[Worker], s3_server: S3Server
) -> None:
    w2 = cluster[1]
    # Created through w2, driven through w3: neither is its host.
    with w2.client(timeout=300.0) as c2:
        sb, before = _with_state(c2, placement={"host": "w1"})
        _paused_on_one_resumed_on_another(cluster, s3_server, sb, before)


def _paused_on_one_resumed_on_another(
    cluster: list[Worker], s3_server: S3Server, sb: Sandbox, before: int
) -> None:
    w1, w2, w3 = cluster
    # Same host first: paused and resumed on w1 with nothing fetched.
    with w3.client(timeout=300.0) as c:
        # One more running on w1 for the drain to move (with a file in its memory).
        extra = c.create_sandbox(memory_mib=MEMORY_MIB, placement={"host": "w1"})
        c.write_file(extra.id, "/tmp/who", extra.id.encode())
        c.pause_sandbox(sb.id)
        assert c.resume_sandbox(sb.id).state == "running"
        assert _owners(cluster)[sb.id] == "w1"
        assert "pause fetched" not in w1.log_path.read_text()
        _kept_state(c, sb, before)
        before = _counter(c, sb.id)
        c.pause_sandbox(sb.id)
        assert wait_for(lambda: w1.pause_uploaded(s3_server, sb.id), 120)
        running = {s.id for s in c.list_sandboxes() if s.state == "running"}
        running_on_w1 = [s for s, h in _owners(cluster).items() if h == "w1" and s in running]
        assert extra.id in running_on_w1
    # Drain w1: its running sandboxes are paused and resumed on the others at once.
    drained = w2.cli("host", "drain", "w1", "--json")
    assert drained.returncode == 0, drained.stderr
    owners = _owners(cluster)
    assert not any(h == "w1" for h in owners.values()), owners
    assert {owners[s] for s in running_on_w1} <= {"w2", "w3"}
    with w3.client(timeout=300.0) as c:
        for s in running_on_w1:
            assert c.get_sandbox(s).state == "running"
            assert c.exec(s, ["cat", "/tmp/who"]).stdout == s  # its disk moved with it
        # The paused one stays paused; its resume lands on another worker, whose
        # restore keeps the counter process and the Python variable.
        assert c.get_sandbox(sb.id).state == "paused"
        assert c.resume_sandbox(sb.id).state == "running"
        assert _owners(cluster)[sb.id] in ("w2", "w3")
        _kept_state(c, sb, before)
        # w1 drops the files of the sandboxes that left (at its next lease renewal).
        gone = {sb.id, *running_on_w1}
        assert wait_for(lambda: not gone & w1.sandbox_dirs(), LEASE_S * 2)
        # The moved pauses' blobs are removed (in the background).
        assert wait_for(lambda: not any(w1.pause_uploaded(s3_server, s) for s in gone), 20)
        for sandbox_id in (sb.id, extra.id):
            c.delete_sandbox(sandbox_id)
    undrained = w2.cli("host", "undrain", "w1")
    assert undrained.returncode == 0, undrained.stderr


def test_a_killed_worker_reports_its_running_sandboxes_lost_and_its_paused_resume_elsewhere(
    cluster: list[Worker], s3_server: S3Server
) -> None:
    w1, w2 = cluster[:2]
    on_w3 = [_create(w1, placement={"host": "w3"}) for _ in range(2)]
    _create(w1, placement={"host": "w2"})  # one that must stay untouched
    with w2.client(timeout=300.0) as c2:
        paused, before = _with_state(c2, placement={"host": "w3"})
        _killed_worker(cluster, s3_server, on_w3, paused, before)


def _killed_worker(
    cluster: list[Worker],
    s3_server: S3Server,
    on_w3: list[SandboxInfo],
    paused: Sandbox,
    before: int,
) -> None:
    w1, w2, w3 = cluster
    on_disk = _create(w2, placement={"host": "w3"})
    with w1.client(timeout=300.0) as c:
        c.write_file(on_disk.id, "/root/kept", b"on disk")
        c.exec(on_disk.id, ["sync"])
        c.pause_sandbox(paused.id)
        c.pause_sandbox(on_disk.id, "disk")
        assert wait_for(lambda: w3.pause_uploaded(s3_server, paused.id), 120)
        assert wait_for(lambda: w3.pause_uploaded(s3_server, on_disk.id), 120)
        others = [s for s in c.list_sandboxes() if s.state == "running"]
    others = [s for s in others if _owners(cluster).get(s.id) in ("w1", "w2")]
    assert others, "the other workers hold running sandboxes"
    qemus = w3.sandbox_qemus()
    w3.kill9()
    killed_at = time.monotonic()

    def lost() -> bool:
        with w2.client() as c:
            try:
                return all(c.get_sandbox(s.id).state == "failed" for s in on_w3)
            except errors.Unavailable:
                return False  # w3 not marked down yet: its sandboxes' requests say so

    # Marked down at the first renewal after the lease ends (a third of it later).
    assert wait_for(lost, LEASE_S * 2.5)
    assert time.monotonic() - killed_at <= LEASE_S * 2.5
    with w1.client() as c:
        for s in on_w3:
            info = c.get_sandbox(s.id)
            assert info.error is not None and info.error.startswith("lost: host w3 is down")
        assert c.get_sandbox(paused.id).state == "paused"  # nothing of it was lost
        hosts = {h.id: h for h in c.hosts.list()}
        assert hosts["w3"].state == "down" and "lease expired" in (hosts["w3"].down_reason or "")
        # Nothing else is touched: the other workers' sandboxes answer as before.
        for s in others:
            assert c.exec(s.id, ["echo", "ok"]).stdout == "ok\n"
            assert c.get_sandbox(s.id).state == "running"
        # A create lands on a live worker.
        fresh = c.create_sandbox(memory_mib=MEMORY_MIB)
        assert _owners(cluster).get(fresh.id) in ("w1", "w2")
        # An exec on a lost sandbox says so.
        with pytest.raises(errors.StateError, match="failed"):
            c.exec(on_w3[0].id, ["true"])
        # The paused ones resume on a live worker from their uploads: the memory one
        # with its processes and variables, the disk one with its files.
        assert c.resume_sandbox(paused.id).state == "running"
        assert c.resume_sandbox(on_disk.id).state == "running"
        owners = _owners(cluster)
        assert owners[paused.id] in ("w1", "w2") and owners[on_disk.id] in ("w1", "w2")
        _kept_state(c, paused, before)
        assert c.read_file(on_disk.id, "/root/kept") == b"on disk"
    # The worker comes back: up again, and the VMs of the sandboxes reported lost go,
    # and the files of those that moved off.
    w3.start()
    assert wait_for(lambda: not any(pid_alive(p) for p in qemus.values() if p), 30)
    assert not {paused.id, on_disk.id} & w3.sandbox_dirs()
    with w3.client() as c:
        assert {h.id: h.state for h in c.hosts.list()}["w3"] == "up"
        assert c.get_sandbox(paused.id).state == "running"
        assert c.exec(paused.id, ["true"]).exit_code == 0  # through w3, to its new host


# -- The E2B face and placement labels across hosts (issue 14's leftovers) -------------


def _e2b_key(w: Worker) -> str:
    return (w.state_dir / "e2b-api-key").read_text().strip()


def _e2b_connect(w: Worker, sandbox_id: str) -> E2bSandbox:
    """The E2B SDK's handle of ``sandbox_id`` through ``w``'s E2B face (both planes)."""
    url = w.e2b_url
    return E2bSandbox.connect(sandbox_id, api_key=_e2b_key(w), api_url=url, sandbox_url=url)


def _e2b_listed(w: Worker, metadata: dict[str, str]) -> list[str]:
    url = w.e2b_url
    found = E2bSandbox.list(
        query=SandboxQuery(metadata=metadata), api_key=_e2b_key(w), api_url=url, sandbox_url=url
    )
    return [s.sandbox_id for s in found.next_items()]


def _e2b_answer(w: Worker, method: str, path: str, **kw: object) -> tuple[int, object]:
    assert w.e2b_url is not None
    answer = httpx.request(method, w.e2b_url + path, timeout=60.0, **kw)  # type: ignore[arg-type]
    return answer.status_code, answer.json() if answer.content else None


def test_the_e2b_face_of_any_worker_serves_every_workers_sandboxes(
    cluster: list[Worker],
) -> None:
    w1, w2, w3 = cluster
    info = _create(w1, placement={"host": "w2"}, metadata={"block": "e2b"})
    assert _owners(cluster)[info.id] == "w2"
    with w1.client() as c:
        c.write_file(info.id, "/tmp/who", info.id.encode())
    # Through w3, neither its creator nor its host: the control plane (connect) and the
    # data plane (commands, files) reach the VM on w2.
    sb = _e2b_connect(w3, info.id)
    assert sb.commands.run("cat /tmp/who").stdout == info.id
    assert sb.files.read("/tmp/who") == info.id
    sb.files.write("/tmp/from-e2b", "via w3")
    with w1.client() as c:
        assert c.read_file(info.id, "/tmp/from-e2b") == b"via w3"
    # Every worker's list shows it (the rows are shared).
    for w in (w1, w3):
        assert _e2b_listed(w, {"block": "e2b"}) == [info.id]
    # Paused through w3, resumed (connect) through w1: on its own host, w2.
    assert sb.pause() is True
    with w1.client() as c:
        assert c.get_sandbox(info.id).state == "paused"
    again = _e2b_connect(w1, info.id)
    assert _owners(cluster)[info.id] == "w2"
    assert again.commands.run("cat /tmp/who").stdout == info.id
    # Same auth, same errors as on the owner: a wrong key, a wrong access token.
    bad_key = {"X-API-KEY": "e2b_" + "00" * 20}
    via, owner = (_e2b_answer(w, "GET", f"/sandboxes/{info.id}", headers=bad_key) for w in (w3, w2))
    assert via == owner and via[0] == 401
    stat = {
        "headers": {
            "E2b-Sandbox-Id": info.id,
            "X-Access-Token": "wrong",
            "Connect-Protocol-Version": "1",
        },
        "json": {"path": "/tmp/who"},
    }
    via, owner = (_e2b_answer(w, "POST", "/filesystem.Filesystem/Stat", **stat) for w in (w3, w2))
    assert via == owner and via[0] == 401
    # Killed through w3: the VM goes on w2.
    assert sb.kill() is True
    assert wait_for(lambda: info.id not in _owners(cluster), 20)


def test_a_move_and_fork_children_keep_the_sandboxs_placement_labels(
    cluster: list[Worker], s3_server: S3Server
) -> None:
    w1, w2, w3 = cluster
    # zone=a is w1 and w2: the children of a fork stay there, whichever host has the
    # most room (w3 holds the fewest sandboxes here: spread alone would pick it).
    a = _create(w1, placement={"labels": {"zone": "a"}})
    b = _create(w1, placement={"labels": {"zone": "b"}})
    with w2.client(timeout=300.0) as c:
        kids = c.fork_sandbox(a.id, count=2)
        owners = _owners(cluster)
        assert owners[a.id] in ("w1", "w2") and owners[b.id] == "w3"
        assert {owners[k.id] for k in kids} <= {"w1", "w2"}, owners
        for sandbox_id in (*(k.id for k in kids), a.id):
            c.delete_sandbox(sandbox_id)
        c.pause_sandbox(b.id)
        assert wait_for(lambda: w3.pause_uploaded(s3_server, b.id), 120)
    # zone=b is w3 alone: while it drains, the resume has nowhere to go and says why.
    drained = w1.cli("host", "drain", "w3", "--json")
    assert drained.returncode == 0, drained.stderr
    try:
        with w1.client() as c:
            with pytest.raises(errors.Capacity, match=r"placement\.labels zone=b"):
                c.resume_sandbox(b.id)
            assert c.get_sandbox(b.id).state == "paused"
        status, body = _e2b_answer(
            w2, "POST", f"/sandboxes/{b.id}/connect", headers={"X-API-KEY": _e2b_key(w2)}, json={}
        )
        assert status == 429 and "zone=b" in str(body), body
        assert b.id not in _owners(cluster)
    finally:
        undrained = w1.cli("host", "undrain", "w3")
        assert undrained.returncode == 0, undrained.stderr
    with w1.client(timeout=300.0) as c:
        assert c.resume_sandbox(b.id).state == "running"
        assert _owners(cluster)[b.id] == "w3"
        c.delete_sandbox(b.id)
