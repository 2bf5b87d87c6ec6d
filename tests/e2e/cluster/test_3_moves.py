"""Fork children on other workers, a named snapshot created from on a worker that
never had it, a memory pause on one worker resumed on another with its processes (where
placement puts it, and where a resume asks for: there and back), a
drain that moves every running sandbox off its host, and a worker SIGKILLed (its
running sandboxes reported lost within the lease, nothing else touched, its paused
ones resumed elsewhere)."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from hutch import errors
from hutch.sdk import Client, Sandbox, SandboxInfo
from tests.e2e.cluster.guest_state import counter, kept_state, with_state
from tests.e2e.cluster.net_probe import (
    HTTP_PORT,
    LEARN_S,
    device,
    ip_rules_of,
    probe,
    tunnel_routes,
)
from tests.e2e.cluster_lab import LEASE_S, MEMORY_MIB, Worker, create_on, owners
from tests.e2e.conftest import pid_alive, wait_for
from tests.s3server import S3Server

pytestmark = [pytest.mark.e2e, pytest.mark.vm]

_owners = owners
_create = create_on
_counter = counter
_with_state = with_state
_kept_state = kept_state


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
        c.delete_sandbox(again.id)
        assert wait_for(lambda: not (w3.sandboxes_dir / again.id).exists(), 20)
        _refused_over_other_image_bytes(c, w3, s3_server, snap.id)
        c.delete_sandbox(source.id)
        c.delete_snapshot(snap.id)


def _refused_over_other_image_bytes(c: Client, w3: Worker, s3: S3Server, snap_id: str) -> None:
    """The snapshot as a host with its own build of the image would have uploaded it
    (the index records another identity of the base: these workers share one images
    directory, so the bucket's index stands in for the other bytes): w3 refuses it
    with 409 image_mismatch before downloading anything and keeps nothing."""
    shutil.rmtree(w3.state_dir / "snapshots" / snap_id, ignore_errors=True)
    bucket, _, prefix = w3.daemon_env["HUTCH_BLOB_URL"].removeprefix("s3://").partition("/")
    key = f"{prefix}/snapshots/{snap_id}/index.json"
    client = s3.client()
    good = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    index = json.loads(good)
    assert len(index["base_sha256"]) == 64  # recorded at its upload
    other = {**index, "base_sha256": "0" * 64}
    client.put_object(Bucket=bucket, Key=key, Body=json.dumps(other).encode())
    try:
        with pytest.raises(errors.ImageMismatch, match="was frozen over other bytes of image"):
            c.create_sandbox(snapshot=snap_id, placement={"host": "w3"})
        assert not (w3.state_dir / "snapshots" / snap_id).exists()
    finally:
        client.put_object(Bucket=bucket, Key=key, Body=good)


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
        # Asked for another host while its own is up: resumed on w2 from the upload,
        # its processes kept; then asked back to w1, which fetches it again.
        before = _resumed_where_asked(c, cluster, s3_server, sb, before, w1, w2)
        assert "pause fetched" in w2.log_path.read_text()
        before = _resumed_where_asked(c, cluster, s3_server, sb, before, w2, w1)
        at = c.pause_sandbox(sb.id).paused_at
        assert wait_for(lambda: w1.pause_uploaded(s3_server, sb.id, at), 120)
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


def _resumed_where_asked(
    c: Client, cluster: list[Worker], s3: S3Server, sb: Sandbox, before: int,
    paused_on: Worker, to: Worker,
) -> int:  # fmt: skip
    """Pause ``sb`` (running on ``paused_on``), wait for its upload, resume it with
    ``placement={"host": to}``: it runs there with its state kept. The counter then."""
    before = _counter(c, sb.id)
    at = c.pause_sandbox(sb.id).paused_at
    assert wait_for(lambda: paused_on.pause_uploaded(s3, sb.id, at), 120)
    assert c.resume_sandbox(sb.id, {"host": to.host_id}).state == "running"
    assert _owners(cluster)[sb.id] == to.host_id
    _kept_state(c, sb, before)
    return _counter(c, sb.id)


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
        # A private network with a member on w3 and its peer on w1, through the tunnel.
        net = c.networks.create("survives").id
        peer = _member(c, net, "peer", "w1")
        doomed = _member(c, net, "doomed", "w3")
        assert wait_for(lambda: _reaches(c, peer, "doomed", doomed), LEARN_S, interval_s=1.0)
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
        for s in [*on_w3, doomed]:
            info = c.get_sandbox(s.id)
            assert info.error is not None and info.error.startswith("lost: host w3 is down")
        # w1's tunnel forgets the down host's member (route, then device: none left).
        assert doomed.network is not None
        assert wait_for(lambda: device(w1.tunnel) is None, LEARN_S), tunnel_routes(w1)
        assert probe(c, peer.id, "doomed")["doomed"]["body"].startswith("ERR")
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
        # The restarted w3 rebuilds its end of the tunnel (the SIGKILL left its device and
        # rule): a new member there and w1's peer reach each other by name, both ways,
        # and w3 holds one device and one rule.
        back = _member(c, net, "back", "w3")
        assert wait_for(lambda: _reaches(c, peer, "back", back), LEARN_S, interval_s=1.0)
        assert _reaches(c, back, "peer", peer)
        assert device(w3.tunnel) is not None and ip_rules_of(w3) == 1
        for sb in (peer, back, doomed):
            c.delete_sandbox(sb.id)
        assert wait_for(lambda: device(w1.tunnel) is None and device(w3.tunnel) is None, 20)
        c.networks.delete(net)


def _member(c: Client, net: str, name: str, host: str) -> SandboxInfo:
    """A sandbox on ``host`` in network ``net`` serving its id at :HTTP_PORT/marker."""
    sb = c.create_sandbox(
        memory_mib=MEMORY_MIB, name=name, networks=[net], placement={"host": host}
    )
    c.exec(sb.id, ["sh", "-c", f"echo {sb.id} > /tmp/marker"])
    serve = f"python3 -m http.server {HTTP_PORT} --directory /tmp"
    c.exec(sb.id, ["sh", "-c", f"setsid -f {serve} >/dev/null 2>&1"])
    return sb


def _reaches(c: Client, source: SandboxInfo, name: str, target: SandboxInfo) -> bool:
    assert target.network is not None
    seen = probe(c, source.id, name)[name]
    return seen == {"ip": target.network.address, "body": target.id}
