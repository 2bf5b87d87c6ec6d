"""Hosts listed by every worker, creates spread over them, pinning by host and label,
and exec, files, terminals and deletes reaching the VM through any worker."""

from __future__ import annotations

import json

import pytest

from hutch import errors
from hutch.sdk import Sandbox, SandboxInfo
from tests.e2e.cluster_lab import MEMORY_MIB, Worker, create_on, owners
from tests.e2e.conftest import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.vm]

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
    with cluster[0].client() as c:  # the address each guest has on its eth0
        guest = {s: _eth0(c.exec(s, ["ip", "-4", "-o", "addr", "show", "eth0"]).stdout)
                 for s in kept}  # fmt: skip
    for w in cluster:  # every worker lists the whole cluster, with each guest's address
        with w.client() as c:
            listed = {s.id: s for s in c.list_sandboxes() if s.state == "running"}
            assert set(listed) >= set(kept)
            for s in kept:
                assert _address(listed[s]) == guest[s], (w.host_id, s)
                assert _address(c.get_sandbox(s)) == guest[s], (w.host_id, s)


def _address(info: SandboxInfo) -> str | None:
    return info.network.address if info.network is not None else None


def _eth0(out: str) -> str:
    """The address in ``ip -4 -o addr show eth0`` (``... inet 10.x.y.z/30 ...``)."""
    words = out.split()
    return words[words.index("inet") + 1].split("/")[0]


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
