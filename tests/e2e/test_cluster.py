"""Three hutchd workers on this machine sharing one database: placement, routing
through any worker, and a worker SIGKILLed (its running sandboxes reported lost within
the lease, nothing else touched). One module-scoped cluster; every sandbox is 128 MiB
and restored from each worker's template of the base image.

The workers share one PostgreSQL database of the suite's server (``tests/pgserver.py``,
Debian's PostgreSQL), as hosts on many machines would.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from hutch import errors
from hutch.images.build import ImageArtifacts
from hutch.sdk import Sandbox
from tests.e2e.cluster_lab import LEASE_S, MEMORY_MIB, Worker, cluster_of, create_on, owners
from tests.e2e.conftest import pid_alive, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.vm]

LABELS = {"w1": "zone=a", "w2": "zone=a", "w3": "zone=b"}


@pytest.fixture(scope="module")
def cluster(
    base_image: ImageArtifacts, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Worker]]:
    with cluster_of(
        tmp_path_factory.mktemp("cluster"), ("w1", "w2", "w3"), labels=LABELS
    ) as workers:
        yield workers


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
    # Deletes through a worker that is not the owner; the VM goes on its own host.
    for sandbox_id in ids[10:]:
        host = owners[sandbox_id]
        via = next(w for w in cluster if w.host_id != host)
        with via.client() as c:
            c.delete_sandbox(sandbox_id)
    assert wait_for(lambda: not set(ids[10:]) & set(_owners(cluster)), 20)
    assert set(ids[:10]) <= set(_owners(cluster))
    for w in cluster:  # every worker lists the whole cluster
        with w.client() as c:
            assert {s.id for s in c.list_sandboxes() if s.state == "running"} >= set(ids[:10])


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


def test_a_killed_worker_reports_its_running_sandboxes_lost(cluster: list[Worker]) -> None:
    w1, w2, w3 = cluster
    on_w3 = [_create(w1, placement={"host": "w3"}) for _ in range(2)]
    paused = _create(w2, placement={"host": "w3"})
    with w1.client() as c:
        c.pause_sandbox(paused.id)
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
    # The worker comes back: up again, and the VMs of the sandboxes reported lost go.
    w3.start()
    assert wait_for(lambda: not any(pid_alive(p) for p in qemus.values() if p), 30)
    with w3.client() as c:
        assert {h.id: h.state for h in c.hosts.list()}["w3"] == "up"
        assert c.get_sandbox(paused.id).state == "paused"
