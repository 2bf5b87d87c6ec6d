"""Two hosts in one process sharing one database (an SQLite file, and a PostgreSQL
database of the suite's server: ``db_target``), each its own REST app on a real
uvicorn: placement, forwarding (collected and streamed exec, files), volumes (where
their files are), the signature
check, a host whose lease expired (its sandboxes lost, its own VMs fenced), and each
host's E2B face serving the other's sandboxes (the same server, its own port)."""

from __future__ import annotations

import asyncio
import secrets
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest
import uvicorn

from hutch.api import create_app
from hutch.config import ClusterSettings, Limits, Settings
from hutch.contract.volumes import VolumeMount
from hutch.daemon import ByListener, build_services
from hutch.e2b import create_e2b_app
from hutch.e2b.keys import e2b_form
from hutch.errors import Conflict, Unavailable
from hutch.services.composed import Services
from hutch.store import Store
from hutch.store.hosts import HostRow
from tests.component.conftest import API_KEY, FakeImages
from tests.component.fake_backend import FakeBackend


@dataclass
class Host:
    id: str
    svc: Services
    backend: FakeBackend
    url: str
    client: httpx.AsyncClient
    #: Its E2B face (control and data plane).
    e2b_url: str


@pytest.fixture
async def hosts(tmp_path: Path, db_target: Path | str) -> AsyncIterator[dict[str, Host]]:
    secret = tmp_path / "cluster-secret"
    secret.write_text(secrets.token_hex(32) + "\n")
    token_secret = secrets.token_bytes(32)  # one per cluster, as the admin key
    made: dict[str, Host] = {}
    servers: list[tuple[uvicorn.Server, asyncio.Task[None], list[socket.socket]]] = []
    forwarders = []
    faces = []
    try:
        for host_id in ("h1", "h2"):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            settings = Settings(
                state_dir=tmp_path / host_id,
                limits=Limits(max_sandboxes=10),
                cluster=ClusterSettings(
                    role="worker",
                    host_id=host_id,
                    address=url,
                    labels=(("name", host_id),),
                    lease_s=5.0,
                    secret_path=secret,
                    shared_db=db_target if isinstance(db_target, Path) else None,
                ),
                database_url=db_target if isinstance(db_target, str) else None,
            )
            backend = FakeBackend(tmp_path / f"run-{host_id}")
            svc = build_services(settings, Store(settings.database), backend, FakeImages(tmp_path))
            await svc.start()
            app = create_app(svc, API_KEY, manage_service=False)
            forwarders.append(app.state.forwarder)  # closed by the lifespan, off here
            e2b_sock = socket.socket()
            e2b_sock.bind(("127.0.0.1", 0))
            e2b = create_e2b_app(svc, API_KEY, token_secret, app.state.forwarder)
            app.state.e2b = e2b
            faces.append(e2b)
            routed = ByListener(app, {e2b_sock.getsockname()[1]: e2b})
            server = uvicorn.Server(
                uvicorn.Config(routed, log_config=None, access_log=False, lifespan="off")
            )
            task = asyncio.create_task(server.serve(sockets=[sock, e2b_sock]))
            servers.append((server, task, [sock, e2b_sock]))
            while not server.started:  # noqa: ASYNC110 (uvicorn has no started event)
                await asyncio.sleep(0.01)
            client = httpx.AsyncClient(
                base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
            )
            e2b_url = f"http://127.0.0.1:{e2b_sock.getsockname()[1]}"
            made[host_id] = Host(host_id, svc, backend, url, client, e2b_url)
        yield made
    finally:
        for h in made.values():
            await h.client.aclose()
            for rec in h.svc.core.own_rows():
                await h.svc.sandboxes.delete(rec.id)
        for server, task, socks in servers:
            server.should_exit = True
            await task
            for sock in socks:
                sock.close()
        for face in faces:
            await face.close()
        for forwarder in forwarders:
            await forwarder.close()
        for h in made.values():
            await h.svc.close()
            assert h.backend.leftover_ids() == set(), f"{h.id} leaked sandbox resources"


async def _create(via: Host, **placement: object) -> str:
    r = await via.client.post("/v1/sandboxes", json={"placement": placement})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def test_a_create_lands_where_placed_and_any_host_reaches_it(
    hosts: dict[str, Host],
) -> None:
    h1, h2 = hosts["h1"], hosts["h2"]
    listed = (await h1.client.get("/v1/hosts")).json()["hosts"]
    assert [(h["id"], h["state"], h["this"]) for h in listed] == [
        ("h1", "up", True),
        ("h2", "up", False),
    ]
    on_h2 = await _create(h1, host="h2")
    by_label = await _create(h2, labels={"name": "h1"})
    assert set(h2.svc.core.runtimes) == {on_h2} and set(h1.svc.core.runtimes) == {by_label}
    # Through the host that does not run it: exec, a streamed exec, files, a delete.
    r = await h1.client.post(f"/v1/sandboxes/{on_h2}/exec", json={"cmd": ["echo", "hi"]})
    assert r.status_code == 200 and r.json()["stdout"] == "hi\n", r.text
    async with h1.client.stream(
        "POST",
        f"/v1/sandboxes/{on_h2}/exec",
        json={"cmd": ["sh", "-c", "echo a; sleep 0.2; echo b"], "stream": True},
    ) as streamed:
        lines = [line async for line in streamed.aiter_lines() if line]
    assert streamed.status_code == 200 and len(lines) >= 3  # a, b, the exit
    put = await h1.client.put(
        f"/v1/sandboxes/{on_h2}/files", params={"path": "/tmp/x"}, content=b"data"
    )
    assert put.status_code in (200, 201), put.text
    got = await h1.client.get(f"/v1/sandboxes/{on_h2}/files", params={"path": "/tmp/x"})
    assert got.content == b"data"
    # Unknown host, unknown labels: a 400 naming what is there.
    bad = await h1.client.post("/v1/sandboxes", json={"placement": {"host": "h9"}})
    assert bad.status_code == 400 and "hosts: h1, h2" in bad.json()["error"]["message"]
    deleted = await h1.client.delete(f"/v1/sandboxes/{on_h2}")
    assert deleted.status_code == 204
    assert set(h2.svc.core.runtimes) == set()


async def test_a_forged_forward_is_refused_and_a_key_is_needed(hosts: dict[str, Host]) -> None:
    h1, h2 = hosts["h1"], hosts["h2"]
    sandbox_id = await _create(h1, host="h2")
    forged = {
        "hutch-cluster-principal": "e30=",
        "hutch-cluster-time": "0",
        "hutch-cluster-from": "h1",
        "hutch-cluster-signature": "0" * 64,
    }
    async with httpx.AsyncClient(base_url=h2.url) as bare:
        r = await bare.post(
            f"/v1/sandboxes/{sandbox_id}/exec", json={"cmd": ["true"]}, headers=forged
        )
        assert r.status_code == 401 and "signature" in r.json()["error"]["message"]
        # Through h1 with no key: refused where it arrived, exactly as on one host.
        r = await bare.post(f"{h1.url}/v1/sandboxes/{sandbox_id}/exec", json={"cmd": ["true"]})
        assert r.status_code == 401
        r = await bare.post(
            f"{h1.url}/v1/sandboxes/{sandbox_id}/exec",
            json={"cmd": ["true"]},
            headers={"Authorization": "Bearer hk_wrong"},
        )
        assert r.status_code == 401


async def test_an_expired_host_is_marked_down_its_sandboxes_lost_and_fenced(
    hosts: dict[str, Host],
) -> None:
    h1, h2 = hosts["h1"], hosts["h2"]
    await h2.svc.cluster.close()  # h2 renews when this test says (it stalls meanwhile)
    # h1 too: its own loop, ticking on the clock moved below, would mark h2 down again
    # right after h2 registers again (a race the assertions below would lose).
    await h1.svc.cluster.close()
    running = await _create(h1, host="h2")
    paused = await _create(h1, host="h2")
    r = await h1.client.post(f"/v1/sandboxes/{paused}/pause", json={})
    assert r.status_code == 200, r.text
    mine = await _create(h1, host="h1")
    # h1's clock passes h2's lease: h1 marks it down and sweeps it.
    later = h1.svc.cluster.clock() + 60
    h1.svc.cluster.clock = lambda: later
    await h1.svc.cluster.tick()
    row = (await h1.client.get(f"/v1/sandboxes/{running}")).json()
    assert row["state"] == "failed" and row["error"].startswith("lost: host h2 is down")
    assert (await h1.client.get(f"/v1/sandboxes/{paused}")).json()["state"] == "paused"
    assert (await h1.client.get(f"/v1/sandboxes/{mine}")).json()["state"] == "running"
    host = (await h1.client.get("/v1/hosts/h2")).json()
    assert host["state"] == "down" and "lease expired" in host["down_reason"]
    # A create now lands on h1 (h2 is down) even when asked for anywhere.
    fresh = await _create(h2)
    assert fresh in h1.svc.core.runtimes
    # h2 learns at its next renewal that it was marked down: its lost VM goes, and it
    # registers again.
    assert running in h2.svc.core.runtimes
    await h2.svc.cluster.tick()
    assert running not in h2.svc.core.runtimes
    assert (await h1.client.get("/v1/hosts/h2")).json()["state"] == "up"
    h1.svc.cluster.clock = lambda: later - 60
    # The lost sandbox's row answers from any host; its files are gone from h2.
    assert running not in h2.backend.leftover_ids()


def test_settings_replace_keeps_cluster(tmp_path: Path) -> None:
    s = Settings(state_dir=tmp_path, cluster=ClusterSettings(role="worker", host_id="x"))
    assert replace(s, listen_port=1).host_id == "x"


async def test_volumes_live_on_one_host_and_their_sandboxes_and_calls_go_there(
    hosts: dict[str, Host],
) -> None:
    """Issue 14: a volume's file is on the host that made it. A create mounting it,
    through either host, runs there; inspect, grow and delete through either host act
    on that file; a create that would need two hosts' volumes, or pins another host, is
    refused naming them, and nothing of it is made."""
    h1, h2 = hosts["h1"], hosts["h2"]
    mib = 1 << 20
    r = await h2.client.post("/v1/volumes", json={"name": "data", "size": 64 * mib})
    assert r.status_code == 201 and r.json()["host"] == "h2", r.text
    vol = r.json()["id"]
    assert h2.svc.core.volume_files.path(vol).is_file()
    assert not h1.svc.core.volume_files.path(vol).exists()
    # Inspect through h1: forwarded to h2, which reads the file's use.
    seen = (await h1.client.get("/v1/volumes/data")).json()
    assert (seen["host"], seen["id"]) == ("h2", vol) and 0 < seen["used"] < 64 * mib, seen
    listed = (await h1.client.get("/v1/volumes")).json()["volumes"]
    assert [(v["name"], v["host"]) for v in listed] == [("data", "h2")]
    r = await h1.client.post("/v1/volumes", json={"name": "mine", "size": 64 * mib})
    assert r.status_code == 201 and r.json()["host"] == "h1", r.text

    async def create(via: Host, body: dict[str, object]) -> httpx.Response:
        return await via.client.post("/v1/sandboxes", json=body)

    data_at = [{"volume": "data", "path": "/data"}]
    refusals: list[tuple[dict[str, object], int, str]] = [
        (
            {"volumes": [*data_at, {"volume": "mine", "path": "/mine"}]},
            409,
            "are on different hosts (mine on h1; data on h2)",
        ),
        (
            {"volumes": data_at, "placement": {"host": "h1"}},
            400,
            "placement.host 'h1': the volumes this create mounts are on host h2",
        ),
    ]
    for via in (h1, h2):
        for body, status, words in refusals:
            r = await create(via, body)
            assert r.status_code == status and words in r.text, (via.id, body, r.text)
    assert not h1.svc.core.runtimes and not h2.svc.core.runtimes
    # A create through h1 (spread would pick either) runs on h2, the volume's host.
    r = await create(h1, {"volumes": data_at})
    assert r.status_code == 201, r.text
    sb = r.json()["id"]
    assert sb in h2.svc.core.runtimes and sb not in h1.svc.core.runtimes
    # A service asked directly on the wrong host refuses before anything is made.
    with pytest.raises(Conflict, match=f"volume 'data' \\({vol}\\) is on host h2, not on host h1"):
        h1.svc.volumes.plan("sb-000000000099", [VolumeMount("data", "/d")])
    with pytest.raises(Unavailable, match="forwards it there"):
        await h1.svc.volumes.grow("data", 128 * mib)
    # Grow and delete through h1 act on h2's file.
    r = await h1.client.patch("/v1/volumes/data", json={"size": 128 * mib})
    assert r.status_code == 200 and r.json()["size"] == 128 * mib, r.text
    assert h2.backend.grown == [(sb, "vol0", "/data", 128 * mib)]  # live, in h2's VM
    assert h1.backend.grown == []
    r = await h1.client.delete("/v1/volumes/data")
    assert r.status_code == 409 and sb in r.text, r.text
    assert (await h1.client.delete(f"/v1/sandboxes/{sb}")).status_code == 204
    assert (await h1.client.delete("/v1/volumes/data")).status_code == 204
    assert not h2.svc.core.volume_files.path(vol).exists()
    assert (await h2.client.get("/v1/volumes/data")).status_code == 404


async def test_while_a_volumes_host_is_down_it_is_not_mounted_and_a_delete_leaves_the_file(
    hosts: dict[str, Host], monkeypatch: pytest.MonkeyPatch
) -> None:
    """h2 seen down from h1 (its rows answered as down, nothing else changed: marking it
    down for real would have h1 sweep it): a create mounting h2's volume is a 503 naming
    h2, growing it too; a delete removes the row and h2's next start removes the file."""
    h1, h2 = hosts["h1"], hosts["h2"]
    r = await h2.client.post("/v1/volumes", json={"name": "far", "size": 64 << 20})
    assert r.status_code == 201, r.text
    vol = r.json()["id"]
    for store in (h1.svc.cluster.hosts, h1.svc.core.hosts):
        real = store.get

        def seen_down(host_id: str, real: Callable[[str], HostRow | None] = real) -> HostRow | None:
            row = real(host_id)
            return replace(row, state="down") if row is not None and host_id == "h2" else row

        monkeypatch.setattr(store, "get", seen_down)
    r = await h1.client.post("/v1/sandboxes", json={"volumes": [{"volume": "far", "path": "/f"}]})
    assert r.status_code == 503 and "on host h2, which is down" in r.text, r.text
    assert r.headers["Retry-After"] == "15"
    r = await h1.client.patch("/v1/volumes/far", json={"size": 128 << 20})
    assert r.status_code == 503 and "retry once it is up" in r.text, r.text
    assert not h1.svc.core.runtimes and not h2.svc.core.runtimes
    assert (await h1.client.delete("/v1/volumes/far")).status_code == 204
    assert (await h2.client.get("/v1/volumes/far")).status_code == 404
    assert h2.svc.core.volume_files.path(vol).is_file()  # h2 was "down": not touched
    swept = h2.svc.core.volume_files.sweep(h2.svc.core.volumes.all_ids())  # h2's next start
    assert swept == [f"{vol}.img"] and not h2.svc.core.volume_files.path(vol).exists()


async def test_a_drain_reaches_its_host_pauses_its_sandboxes_and_stops_placement(
    hosts: dict[str, Host],
) -> None:
    h1, h2 = hosts["h1"], hosts["h2"]
    on_h1 = await _create(h2, host="h1")
    r = await h2.client.post("/v1/hosts/h1/drain")  # sent to h2, done by h1
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "draining" and r.json()["this"] is True  # h1 answered
    assert (await h2.client.get(f"/v1/sandboxes/{on_h1}")).json()["state"] == "paused"
    assert set(h1.svc.core.runtimes) == set()
    fresh = await _create(h1)  # anywhere: h1 is draining, so h2
    assert fresh in h2.svc.core.runtimes
    pinned = await h1.client.post("/v1/sandboxes", json={"placement": {"host": "h1"}})
    assert pinned.status_code == 429 and "h1 is draining" in pinned.json()["error"]["message"]
    r = await h1.client.post("/v1/hosts/h1/undrain")
    assert r.status_code == 200 and r.json()["state"] == "up"
    resumed = await h2.client.post(f"/v1/sandboxes/{on_h1}/resume")
    assert resumed.status_code == 200 and resumed.json()["state"] == "running"
    assert on_h1 in h1.svc.core.runtimes


async def test_placement_labels_show_through_every_host_and_survive_a_drain(
    hosts: dict[str, Host],
) -> None:
    """Issue 14: the labels a sandbox was placed by are in its view whichever host
    answers, and still there after a drain paused it and a resume brought it back."""
    h1, h2 = hosts["h1"], hosts["h2"]
    placed = await _create(h2, labels={"name": "h1"})
    assert placed in h1.svc.core.runtimes
    for via in (h1, h2):
        view = (await via.client.get(f"/v1/sandboxes/{placed}")).json()
        assert view["placement_labels"] == {"name": "h1"}, via.id
        listed = (await via.client.get("/v1/sandboxes")).json()["sandboxes"]
        assert {s["id"]: s["placement_labels"] for s in listed}[placed] == {"name": "h1"}
    r = await h2.client.post("/v1/hosts/h1/drain")
    assert r.status_code == 200, r.text
    paused = (await h2.client.get(f"/v1/sandboxes/{placed}")).json()
    assert (paused["state"], paused["placement_labels"]) == ("paused", {"name": "h1"})
    r = await h1.client.post("/v1/hosts/h1/undrain")
    assert r.status_code == 200, r.text
    resumed = await h2.client.post(f"/v1/sandboxes/{placed}/resume")
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["placement_labels"] == {"name": "h1"}
    assert placed in h1.svc.core.runtimes


async def test_the_e2b_face_of_either_host_serves_the_other_hosts_sandbox(
    hosts: dict[str, Host],
) -> None:
    h1, h2 = hosts["h1"], hosts["h2"]
    on_h2 = await _create(h1, host="h2")
    put = await h1.client.put(
        f"/v1/sandboxes/{on_h2}/files", params={"path": "/tmp/x"}, content=b"data"
    )
    assert put.status_code in (200, 201), put.text
    key = {"X-API-KEY": e2b_form(API_KEY)}
    async with httpx.AsyncClient(base_url=h1.e2b_url, timeout=60) as e2b:
        # The control plane through h1: details (its access token), the list, a pause
        # and a connect (resumed on h2, its host), all done by h2.
        got = await e2b.get(f"/sandboxes/{on_h2}", headers=key)
        assert got.status_code == 200, got.text
        token = got.json()["envdAccessToken"]
        listed = await e2b.get("/v2/sandboxes", headers=key)
        assert on_h2 in {s["sandboxID"] for s in listed.json()}
        assert (await e2b.post(f"/sandboxes/{on_h2}/pause", headers=key)).status_code == 204
        assert on_h2 not in h2.svc.core.runtimes
        connected = await e2b.post(f"/sandboxes/{on_h2}/connect", headers=key, json={})
        assert connected.status_code == 201, connected.text
        assert on_h2 in h2.svc.core.runtimes and on_h2 not in h1.svc.core.runtimes
        # The data plane through h1, with the token h2 handed out: the file on h2's VM.
        plane = {"E2b-Sandbox-Id": on_h2, "X-Access-Token": token}
        read = await e2b.get("/files", params={"path": "/tmp/x"}, headers=plane)
        assert read.status_code == 200 and read.content == b"data", read.text
        # Refused where it arrived, as on one host: a wrong key, a wrong token.
        bad = await e2b.get(f"/sandboxes/{on_h2}", headers={"X-API-KEY": "e2b_00"})
        assert bad.status_code == 401
        wrong = {**plane, "X-Access-Token": "wrong"}
        refused = await e2b.get("/files", params={"path": "/tmp/x"}, headers=wrong)
        assert refused.status_code == 401 and "access token" in refused.text
        # Killed through h1: gone from h2.
        assert (await e2b.delete(f"/sandboxes/{on_h2}", headers=key)).status_code == 204
    assert on_h2 not in h2.svc.core.runtimes
    # A forward to h2's E2B face must carry the cluster's signature.
    forged = {
        "hutch-cluster-principal": "e30=",
        "hutch-cluster-time": "0",
        "hutch-cluster-from": "h1",
        "hutch-cluster-signature": "0" * 64,
    }
    async with httpx.AsyncClient(base_url=h2.url) as bare:
        r = await bare.get("/v1/hosts/h2/e2b/v2/sandboxes", headers=forged)
        assert r.status_code == 401 and "signature" in r.text


async def test_a_resume_goes_where_its_placement_puts_it_and_refuses_what_it_cannot(
    hosts: dict[str, Host],
) -> None:
    """Issue 14: ``POST /resume {"placement": ...}``. Without a blob store a paused
    sandbox can resume only on the host holding its pause: placed there it does, placed
    elsewhere the answer names HUTCH_BLOB_URL; selectors no host meets, labels that
    contradict the ones it was created with, a host that cannot restore the pause (another
    QEMU build) and oversized bodies are refused; a running
    sandbox is answered as it is. Nothing refused changes the sandbox."""
    h1, h2 = hosts["h1"], hosts["h2"]
    sb = await _create(h2, host="h1")
    labelled = await _create(h2, labels={"name": "h1"})
    for paused in (sb, labelled):
        r = await h2.client.post(f"/v1/sandboxes/{paused}/pause", json={"mode": "memory"})
        assert r.status_code == 200, r.text

    async def resume(via: Host, sandbox: str, placement: object) -> httpx.Response:
        return await via.client.post(
            f"/v1/sandboxes/{sandbox}/resume", json={"placement": placement}
        )

    refusals = [
        (sb, {"host": "nope"}, 400, "placement.host 'nope' is not a host of this cluster"),
        (sb, {"labels": {"zone": "x"}}, 400, "no host has the labels zone=x"),
        (sb, {"host": "h2", "labels": {"name": "h1"}}, 400, "host h2 lacks the labels name=h1"),
        (sb, {"host": "h2"}, 409, "HUTCH_BLOB_URL"),
        (labelled, {"labels": {"name": "h2"}}, 400, "contradict the labels"),
        (labelled, {"host": "h2"}, 409, "placement.labels name=h1"),
        (sb, {"strategy": "nearest"}, 400, "placement.strategy"),
    ]
    for via in (h1, h2):
        for sandbox, placement, status, words in refusals:
            r = await resume(via, sandbox, placement)
            assert r.status_code == status and words in r.text, (via.id, placement, r.text)
    # A host on another QEMU build cannot restore the pause: placement says so (429,
    # naming both builds), before anything is fetched or changed.
    h2_row = h2.svc.cluster.hosts.get("h2")
    assert h2_row is not None
    h2.svc.cluster.hosts.register(replace(h2_row, qemu_version="0.0-other"))
    try:
        for via in (h1, h2):
            r = await resume(via, sb, {"host": "h2"})
            assert r.status_code == 429, (via.id, r.text)
            assert f"h2 cannot restore the pause of {sb}: it runs QEMU 0.0-other" in r.text
    finally:
        h2.svc.cluster.hosts.register(h2_row)
    huge = await h2.client.post(
        f"/v1/sandboxes/{sb}/resume",
        content=b" " * (2 << 20),
        headers={"Content-Type": "application/json"},
    )
    assert huge.status_code == 400 and "at most" in huge.text, huge.text
    for sandbox in (sb, labelled):
        assert (await h2.client.get(f"/v1/sandboxes/{sandbox}")).json()["state"] == "paused"
    assert set(h1.svc.core.runtimes) == set()
    # Placed on the host that holds its pause: resumed there, through either host.
    r = await resume(h2, sb, {"host": "h1"})
    assert r.status_code == 200 and r.json()["state"] == "running", r.text
    r = await resume(h1, labelled, {"labels": {"name": "h1"}})
    assert r.status_code == 200 and r.json()["state"] == "running", r.text
    assert set(h1.svc.core.runtimes) == {sb, labelled}
    # Running: its host answers as it is, wherever the placement points.
    r = await resume(h2, sb, {"host": "h2"})
    assert r.status_code == 200 and r.json()["state"] == "running", r.text
    assert sb in h1.svc.core.runtimes and sb not in h2.svc.core.runtimes


async def test_a_create_from_an_uploaded_snapshot_goes_only_where_its_image_bytes_are(
    hosts: dict[str, Host],
) -> None:
    """A named snapshot of a built-in image, uploaded (any host may fetch it), is created
    from only on a host holding the rootfs bytes it was saved over: another host whose
    copy of that digest differs is refused by placement (429, naming the image), through
    either host, before anything is fetched; unpinned, the create goes where it can open."""
    h1, h2 = hosts["h1"], hosts["h2"]
    sb = await _create(h1, host="h1")
    r = await h1.client.post(f"/v1/sandboxes/{sb}/snapshots", json={"name": "saved"})
    assert r.status_code == 201, r.text
    snap = r.json()["id"]
    rec = h1.svc.core.states.current(sb)
    assert rec is not None and rec.image_digest is not None
    digest = rec.image_digest
    for h in (h1, h2):
        h.svc.cluster.snapshot_uploaded = lambda _id: True
    h1.svc.cluster.hosts.set_images("h1", {rec.image: {digest: "a" * 64}})
    h1.svc.cluster.hosts.set_images("h2", {rec.image: {digest: "b" * 64}})
    for via in (h1, h2):
        r = await via.client.post(
            "/v1/sandboxes", json={"snapshot": snap, "placement": {"host": "h2"}}
        )
        assert r.status_code == 429, (via.id, r.text)
        assert (
            f"h2 cannot restore snapshot {snap}: its image {rec.image} ({digest}) holds other "
            "bytes" in r.text
        ), r.text
    assert set(h2.svc.core.runtimes) == set()
    # Unpinned: spread would take h2 (fewer sandboxes); only h1 can open it.
    r = await h2.client.post("/v1/sandboxes", json={"snapshot": snap})
    assert r.status_code == 201, r.text
    assert r.json()["id"] in h1.svc.core.runtimes


async def test_e2b_creates_spread_over_the_hosts_and_bad_ones_are_answered_where_they_came(
    hosts: dict[str, Host],
) -> None:
    """Issue 14: an E2B ``Sandbox.create`` through one host's face lands where
    placement puts it (spread), as a REST create does, and the sandbox it returns works
    through either face; a bad key, a bad body or an unknown template is answered by
    the face it came to, in E2B's shape, and creates nothing."""
    h1, h2 = hosts["h1"], hosts["h2"]
    key = {"X-API-KEY": e2b_form(API_KEY)}
    made: list[str] = []
    async with httpx.AsyncClient(base_url=h1.e2b_url, timeout=60) as e2b:
        for path in ("/sandboxes", "/v2/sandboxes", "/sandboxes", "/sandboxes"):
            r = await e2b.post(path, headers=key, json={"templateID": "base", "timeout": 300})
            assert r.status_code == 201, r.text
            made.append(r.json()["sandboxID"])
        refused = [
            ({"X-API-KEY": "e2b_00"}, {"templateID": "base"}, 401),
            (key, {"templateID": "no-such-template"}, 404),
            (key, {"timeout": 300}, 400),
        ]
        for headers, body, status in refused:
            r = await e2b.post("/sandboxes", headers=headers, json=body)
            assert r.status_code == status and "message" in r.json(), (body, r.text)
        r = await e2b.post("/sandboxes", headers={**key, "Content-Type": "application/json"},
                           content=b"{not json")  # fmt: skip
        assert r.status_code == 400, r.text
    assert set(h1.svc.core.runtimes) | set(h2.svc.core.runtimes) == set(made)
    assert len(h1.svc.core.runtimes) == 2 and len(h2.svc.core.runtimes) == 2
    on_h2 = next(s for s in made if s in h2.svc.core.runtimes)
    async with httpx.AsyncClient(base_url=h2.e2b_url, timeout=60) as e2b:
        got = await e2b.get(f"/sandboxes/{on_h2}", headers=key)
        assert got.status_code == 200 and got.json()["templateID"] == "base", got.text
    async with httpx.AsyncClient(base_url=h1.e2b_url, timeout=60) as e2b:
        for sandbox_id in made:
            assert (await e2b.delete(f"/sandboxes/{sandbox_id}", headers=key)).status_code == 204
    assert not h1.svc.core.runtimes and not h2.svc.core.runtimes
