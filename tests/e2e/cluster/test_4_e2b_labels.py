"""The E2B face and placement labels across hosts (issue 14's leftovers)."""

from __future__ import annotations

import httpx
import pytest
from e2b import Sandbox as E2bSandbox
from e2b import SandboxQuery

from hutch import errors
from tests.e2e.cluster_lab import Worker, create_on, owners
from tests.e2e.conftest import wait_for
from tests.s3server import S3Server

pytestmark = [pytest.mark.e2e, pytest.mark.vm]

_owners = owners
_create = create_on


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
