"""One contract suite, run against both implementations of the REST API v1: the in-memory
fake users test with (``hutch.testing.FakeHutch``) and the real app (real service, store,
NetworkManager on its in-memory dataplane, and the real guest agent in bubblewrap; served
in-process through httpx's ASGI transport).

Every test runs twice (``[fake]``, ``[real]``) through the SDK's ``AsyncClient`` (and raw
requests where the SDK would refuse to send), and every JSON answer is checked against
the committed ``openapi.json`` (``openapi_check.CheckedTransport``). Whatever the fake
answers here, the daemon answers too, so tests written against the fake test the
contract, not a fiction.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from hutch.api import create_app
from hutch.config import Settings
from hutch.contract.limits import EGRESS_LOG_MAX, MAX_EGRESS_RULES
from hutch.daemon import build_services
from hutch.errors import (
    Conflict,
    InvalidArgument,
    NotFound,
    StateError,
    Unauthorized,
    UnknownImage,
)
from hutch.net.dataplane import MemoryDataplane
from hutch.sdk import AsyncClient, AsyncSandbox, ExecExit, ExecOutput
from hutch.services.composed import Services
from hutch.services.network import NetworkService as NetworkManager
from hutch.store import Store
from hutch.testing import FakeHutch
from tests.component.conftest import API_KEY, FakeImages
from tests.component.fake_backend import FakeBackend
from tests.component.openapi_check import CheckedTransport

pytestmark = pytest.mark.timeout(120)

BASE_URL = "http://hutch.test"


@dataclass
class Target:
    """One implementation under test: an SDK client and a raw client on one checked
    transport."""

    kind: str
    #: The component tier's backend runs the agent without a disk (tmpfs /root, /tmp):
    #: files do not reach fork children or snapshot copies there. Real VMs prove that
    #: (tests/vm/test_pause_fork.py); the fake models it, and is checked here.
    has_disk: bool
    client: AsyncClient
    raw: httpx.AsyncClient
    checked: CheckedTransport

    async def sandbox(self, **kw: Any) -> AsyncSandbox:
        return await AsyncSandbox.create(client=self.client, **kw)


@contextlib.asynccontextmanager
async def real_service(settings: Settings, tmp_path: Path) -> AsyncIterator[Services]:
    settings = replace(settings, dns_upstream=("127.0.0.1", 9))  # forwards nowhere
    store = Store(settings.database)

    def name_of(sandbox_id: str) -> str | None:
        rec = store.get_sandbox(sandbox_id)
        return rec.name if rec else None

    net = NetworkManager(settings, store, names=name_of, dataplane=MemoryDataplane())
    backend = FakeBackend(tmp_path / "run")
    svc = build_services(settings, store, backend, FakeImages(tmp_path), net=net)
    await svc.start()
    try:
        yield svc
    finally:
        for rec in svc.sandboxes.list_sandboxes():
            if rec.state.is_live:
                await svc.sandboxes.delete(rec.id)
        await svc.close()
        assert backend.leftover_ids() == set(), "a test leaked sandbox resources"


#: The one host's labels (HUTCH_HOST_LABELS) on both targets.
HOST_LABELS = {"zone": "eu-1", "tier": "gpu"}


@pytest.fixture(params=["fake", "real"])
async def target(
    request: pytest.FixtureRequest, settings: Settings, tmp_path: Path
) -> AsyncIterator[Target]:
    async with contextlib.AsyncExitStack() as stack:
        inner: httpx.AsyncBaseTransport
        if request.param == "fake":
            fake = FakeHutch(api_key=API_KEY)
            fake.host_labels = dict(HOST_LABELS)
            inner = fake.transport
        else:
            labelled = replace(settings.cluster, labels=tuple(HOST_LABELS.items()))
            settings = replace(settings, cluster=labelled)
            svc = await stack.enter_async_context(real_service(settings, tmp_path))
            inner = httpx.ASGITransport(app=create_app(svc, API_KEY, manage_service=False))
        checked = CheckedTransport(inner)
        client = AsyncClient(base_url=BASE_URL, api_key=API_KEY, transport=checked)
        stack.push_async_callback(client.aclose)
        raw = httpx.AsyncClient(
            base_url=BASE_URL, transport=checked, headers={"Authorization": f"Bearer {API_KEY}"}
        )
        stack.push_async_callback(raw.aclose)
        yield Target(request.param, request.param == "fake", client, raw, checked)
        assert checked.checked > 0, "no JSON answer was checked against openapi.json"


def error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["code"] == code, body
    message: str = body["message"]
    return message


# -- meta ---------------------------------------------------------------------------------


async def test_health_and_images(target: Target) -> None:
    health = await target.client.health()
    assert health.status == "ok"
    images = {i.name: i for i in await target.client.list_images()}
    assert images["base"].built and not images["devbox"].built


async def test_a_missing_or_wrong_key_is_unauthorized(target: Target) -> None:
    wrong = AsyncClient(base_url=BASE_URL, api_key="nope", transport=target.checked)
    try:
        with pytest.raises(Unauthorized):
            await wrong.list_sandboxes()
    finally:
        await wrong.aclose()
    r = await target.raw.get("/v1/sandboxes", headers={"Authorization": ""})
    error(r, 401, "unauthorized")


# -- sandboxes ------------------------------------------------------------------------------


async def test_create_get_list_delete(target: Target) -> None:
    sb = await target.sandbox(metadata={"team": "a"}, name="one", env={"A": "1"})
    info = sb.info
    assert (info.state, info.image, info.vcpus, info.memory_mib, info.disk_gib) == (
        "running",
        "base",
        1,
        512,
        4,
    )
    assert (info.name, info.metadata, info.parent_id, info.auto_resume) == (
        "one",
        {"team": "a"},
        None,
        False,
    )
    assert info.network is not None and info.network.mode == "default"
    assert info.network.address is not None
    other = await target.sandbox(metadata={"team": "b"})
    assert (await target.client.get_sandbox(sb.id)).id == sb.id
    assert {s.id for s in await target.client.list_sandboxes()} == {sb.id, other.id}
    assert [s.id for s in await target.client.list_sandboxes(metadata={"team": "a"})] == [sb.id]
    assert [s.id for s in await target.client.list_sandboxes(state="paused")] == []
    await target.client.delete_sandbox(other.id)
    await target.client.delete_sandbox(other.id)  # deleting a gone sandbox is a no-op
    gone = await target.client.get_sandbox(other.id)
    assert gone.state == "destroyed" and gone.ended_at is not None
    assert [s.id for s in await target.client.list_sandboxes()] == [sb.id]
    await sb.kill()


async def test_bad_creates_are_refused_with_the_right_class(target: Target) -> None:
    with pytest.raises(UnknownImage, match="unknown image 'nope'"):
        await target.sandbox(image="nope")
    with pytest.raises(Conflict, match="image 'devbox' is not built"):
        await target.sandbox(image="devbox")
    with pytest.raises(InvalidArgument, match="vcpus"):
        await target.sandbox(vcpus=9)
    with pytest.raises(InvalidArgument, match="memory_mib"):
        await target.sandbox(memory_mib=64)
    with pytest.raises(NotFound, match="no snapshot"):
        await target.sandbox(snapshot="snap-000000000999")
    with pytest.raises(NotFound, match="no network 'nope'"):
        await target.sandbox(networks=["nope"])
    with pytest.raises(InvalidArgument, match=r"egress rule 'bad_host!' is invalid"):
        await target.sandbox(egress=["good.test", "bad_host!"])
    with pytest.raises(InvalidArgument, match='network "none" has no egress rules'):
        await target.sandbox(network="none", egress=["good.test"])
    r = await target.raw.post("/v1/sandboxes", json={"image": "base", "colour": "red"})
    assert "colour" in error(r, 400, "invalid_argument")
    r = await target.raw.post("/v1/sandboxes", json={"auto_pause_s": 5})
    assert "auto_pause_s" in error(r, 400, "invalid_argument")
    assert await target.client.list_sandboxes() == []


async def test_unknown_and_malformed_ids_are_not_found(target: Target) -> None:
    with pytest.raises(NotFound, match="no sandbox sb-000000000999"):
        await target.client.get_sandbox("sb-000000000999")
    with pytest.raises(NotFound, match="malformed"):
        await target.client.get_sandbox("nope")
    with pytest.raises(NotFound):
        await target.client.exec("sb-000000000999", ["true"])


# -- exec and files ----------------------------------------------------------------------


async def test_exec_collected_and_streamed(target: Target) -> None:
    sb = await target.sandbox()
    result = await sb.exec(["echo", "hello", "contract"])
    assert (result.exit_code, result.stdout, result.stderr) == (0, "hello contract\n", "")
    events = [e async for e in sb.exec_stream(["echo", "streamed"])]
    assert events[:-1] == [ExecOutput("stdout", "streamed\n")]
    assert isinstance(events[-1], ExecExit) and events[-1].exit_code == 0
    r = await target.raw.post(f"/v1/sandboxes/{sb.id}/exec", json={"cmd": []})
    error(r, 400, "invalid_argument")
    await sb.kill()


async def test_files(target: Target) -> None:
    sb = await target.sandbox()
    written = await sb.files.write("/tmp/deep/a.txt", b"alpha", mode=0o600)
    assert (written.path, written.size) == ("/tmp/deep/a.txt", 5)
    assert await sb.files.read("/tmp/deep/a.txt") == b"alpha"
    entry = await sb.files.stat("/tmp/deep/a.txt")
    assert (entry.name, entry.type, entry.size, entry.mode) == ("a.txt", "file", 5, 0o600)
    made = await sb.files.mkdir("/tmp/deep/sub/dir")
    assert (made.path, made.type) == ("/tmp/deep/sub/dir", "dir")
    moved = await sb.files.rename("/tmp/deep/a.txt", "/tmp/deep/b.txt")
    assert moved.path == "/tmp/deep/b.txt"
    names = sorted(e.name for e in await sb.files.list("/tmp/deep"))
    assert names == ["b.txt", "sub"]
    relative = await sb.files.write("notes.txt", "in home")
    assert relative.path == "/root/notes.txt"
    with pytest.raises(NotFound):
        await sb.files.read("/tmp/deep/a.txt")
    with pytest.raises(NotFound):
        await sb.files.stat("/tmp/nothing-here")
    with pytest.raises(Conflict):
        await sb.files.remove("/tmp/deep")  # not empty, not recursive
    await sb.files.remove("/tmp/deep", recursive=True)
    with pytest.raises(NotFound):
        await sb.files.list("/tmp/deep")
    await sb.kill()


# -- lifecycle ------------------------------------------------------------------------------


async def test_pause_resume_and_states(target: Target) -> None:
    sb = await target.sandbox()
    paused = await sb.pause()
    assert (paused.state, paused.pause_mode) == ("paused", "memory")
    assert paused.paused_at is not None
    with pytest.raises(StateError, match=f"sandbox {sb.id} is paused; this needs it"):
        await sb.pause()
    with pytest.raises(StateError):
        await sb.exec(["true"])
    resumed = await sb.resume()
    assert (resumed.state, resumed.pause_mode) == ("running", None)
    assert (await sb.resume()).state == "running"  # a no-op when running
    r = await target.raw.post(f"/v1/sandboxes/{sb.id}/pause", json={"mode": "frozen"})
    error(r, 400, "invalid_argument")
    await sb.kill()
    with pytest.raises(StateError):
        await sb.pause()


async def test_auto_resume(target: Target) -> None:
    sb = await target.sandbox(auto_resume=True)
    assert sb.info.auto_resume
    await sb.pause(mode="disk")
    assert (await sb.exec(["echo", "awake"])).stdout == "awake\n"
    assert (await sb.refresh()).state == "running"
    await sb.kill()


async def test_fork(target: Target) -> None:
    sb = await target.sandbox(name="parent")
    await sb.files.write("/root/state.txt", "parent")
    children = await sb.fork(count=2)
    assert len(children) == 2
    for child in children:
        assert (child.info.parent_id, child.info.state) == (sb.id, "running")
        if target.has_disk:
            assert await child.files.read("/root/state.txt") == b"parent"
        assert child.id != sb.id
    assert (await sb.refresh()).state == "running"
    r = await target.raw.post(f"/v1/sandboxes/{sb.id}/fork", json={"count": 0})
    error(r, 400, "invalid_argument")
    for child in children:
        await child.kill()
    await sb.kill()


async def test_named_snapshots(target: Target) -> None:
    sb = await target.sandbox(vcpus=2)
    await sb.files.write("/root/model.bin", b"weights")
    snap = await sb.snapshot("ready")
    assert (snap.name, snap.sandbox_id, snap.vcpus, snap.image) == ("ready", sb.id, 2, "base")
    assert (await target.client.get_snapshot(snap.id)).id == snap.id
    assert [s.id for s in await target.client.list_snapshots()] == [snap.id]
    copy = await target.sandbox(snapshot=snap.id)
    assert (copy.info.snapshot_id, copy.info.vcpus) == (snap.id, 2)
    if target.has_disk:
        assert await copy.files.read("/root/model.bin") == b"weights"
    with pytest.raises(NotFound, match="no snapshot"):
        await target.client.get_snapshot("snap-000000000999")
    r = await target.raw.post(f"/v1/sandboxes/{sb.id}/snapshots", json={"name": "Bad Name"})
    assert "name" in error(r, 400, "invalid_argument")
    # Any order: a snapshot a live sandbox was started from deletes, and the copy runs on.
    await target.client.delete_snapshot(snap.id)
    assert await target.client.list_snapshots() == []
    with pytest.raises(NotFound, match="no snapshot"):
        await target.client.get_snapshot(snap.id)
    assert (await copy.refresh()).state == "running"
    if target.has_disk:
        assert await copy.files.read("/root/model.bin") == b"weights"
    await copy.kill()
    await sb.kill()


# -- networking ------------------------------------------------------------------------------


async def test_egress_rules(target: Target) -> None:
    sb = await target.sandbox()
    info = await sb.egress.get()
    assert (info.rules, info.mode) == ([], "open")
    info = await sb.egress.set(["Good.Test.", "*.cdn.test:443", "198.18.0.0/15", "good.test"])
    assert (info.rules, info.mode) == (["good.test", "*.cdn.test:443", "198.18.0.0/15"], "rules")
    for bad, why in [
        ("good.test:99999", "port 99999 is out of 1-65535"),
        ("10.0.0.1/8", "has host bits set"),
        ("http://good.test", "without a scheme"),
    ]:
        r = await target.raw.put(f"/v1/sandboxes/{sb.id}/egress", json={"rules": [bad]})
        assert why in error(r, 400, "invalid_argument"), bad
    r = await target.raw.put(
        f"/v1/sandboxes/{sb.id}/egress", json={"rules": ["deny-all", "good.test"]}
    )
    assert '"deny-all" must be the only egress rule' in error(r, 400, "invalid_argument")
    too_many = [f"h{i}.test" for i in range(MAX_EGRESS_RULES + 1)]
    r = await target.raw.put(f"/v1/sandboxes/{sb.id}/egress", json={"rules": too_many})
    error(r, 400, "invalid_argument")
    assert (await sb.egress.get()).rules == ["good.test", "*.cdn.test:443", "198.18.0.0/15"]
    assert (await sb.egress.set(["deny-all"])).mode == "deny-all"
    assert (await sb.egress.clear()).mode == "open"
    assert await sb.egress.log() == []
    r = await target.raw.get(
        f"/v1/sandboxes/{sb.id}/egress/log", params={"limit": EGRESS_LOG_MAX + 1}
    )
    error(r, 400, "invalid_argument")
    await sb.kill()


DOCS_POLICY: dict[str, Any] = {
    "default": "deny",
    "rules": [
        {"action": "deny", "host": "evil.good.test"},
        {"action": "allow", "host": "*.Good.Test:443"},
        {"action": "allow", "host": "198.18.0.0/24"},
    ],
}
DOCS_CANONICAL: dict[str, Any] = {
    "default": "deny",
    "inspection": "none",
    "dry_run": False,
    "rules": [
        {"action": "deny", "host": "evil.good.test"},
        {"action": "allow", "host": "*.good.test:443"},
        {"action": "allow", "host": "198.18.0.0/24"},
    ],
}


async def test_ordered_egress_policies(target: Target) -> None:
    sb = await target.sandbox()
    info = await sb.set_egress(policy=DOCS_POLICY)
    assert info.policy == DOCS_CANONICAL and info.mode == "rules"
    assert info.rules == [
        "rules[0] deny evil.good.test",
        "rules[1] allow *.good.test:443",
        "rules[2] allow 198.18.0.0/24",
        "default deny",
    ]
    assert (await sb.egress.get()).policy == DOCS_CANONICAL
    url = f"/v1/sandboxes/{sb.id}/egress"
    for body, why in [
        ({"default": "deny", "rules": [{"action": "allow", "host": "a.test", "path": "/x"}]},
         "egress policy rules[0].path: needs the HTTP request"),
        ({"rules": [{"action": "allow", "host": "a.test"}, {"action": "permit", "host": "b"}]},
         "egress policy rules[1].action: 'permit' is not accepted; accepted: allow, deny"),
        ({"default": "allow", "inspection": "learn"}, 'default: "allow" with inspection'),
        ({"default": "allow", "rules": [{"action": "deny", "host": "a.test:22"}]},
         'a name cannot be denied on port 22 alone'),
        ({"default": "deny", "rules": ["good.test"]}, "rules[0]: 'good.test' is not an object"),
        ({"policy": "nope"}, "egress policy 'nope' does not exist"),
        ({}, 'give "rules" (a list), a policy'),
    ]:  # fmt: skip
        r = await target.raw.put(url, json=body)
        status, code = (404, "not_found") if "does not exist" in why else (400, "invalid_argument")
        assert why in error(r, status, code), body
    # Nothing changed; a plain list still means what it meant.
    assert (await sb.egress.get()).policy == DOCS_CANONICAL
    plain = await sb.egress.set(["good.test"])
    assert (plain.rules, plain.mode, plain.policy) == (["good.test"], "rules", None)
    assert (await sb.set_egress(policy={"default": "deny"})).mode == "deny-all"
    assert (await sb.set_egress(policy={"default": "allow"})).mode == "open"
    deny_list = {
        "default": "allow",
        "rules": [
            {"action": "deny", "host": "evil.test"},
            {"action": "deny", "host": "198.18.0.0/24"},
        ],
    }
    shown = await sb.set_egress(policy=deny_list)  # fmt: skip
    assert (shown.mode, shown.rules[-1]) == ("rules", "default allow"), shown
    with pytest.raises(InvalidArgument, match=r"rules\[0\]\.host"):  # checked before sending
        await sb.set_egress(policy={"rules": [{"action": "allow", "host": "a b"}]})
    await sb.kill()


async def test_named_egress_policies(target: Target) -> None:
    policies = target.client.egress_policies
    assert await policies.list() == []
    made = await policies.put("web", DOCS_POLICY)
    assert (made.name, made.project, made.policy) == ("web", "default", DOCS_CANONICAL)
    r = await target.raw.put("/v1/egress-policies/web", json={"default": "allow"})
    assert r.status_code == 200  # replaced (201 was the create)
    r = await target.raw.put("/v1/egress-policies/web", json=DOCS_POLICY)
    assert r.status_code == 200
    bad = {"rules": [{"action": "allow", "host": "a.test", "methods": ["G3T"]}]}
    r = await target.raw.put("/v1/egress-policies/web", json=bad)
    assert "rules[0].methods[0]" in error(r, 400, "invalid_argument")
    r = await target.raw.put("/v1/egress-policies/Bad_Name", json=DOCS_POLICY)
    error(r, 400, "invalid_argument")
    assert [p.name for p in await policies.list()] == ["web"]
    assert (await policies.get("web")).policy == DOCS_CANONICAL
    # Attached at create, and by PUT: a copy.
    sb = await target.sandbox(egress_policy="web")
    assert (await sb.egress.get()).policy == DOCS_CANONICAL
    other = await target.sandbox(egress={"default": "deny"})
    assert (await other.egress.get()).mode == "deny-all"
    assert (await other.set_egress(policy="web")).policy == DOCS_CANONICAL
    await policies.put("web", {"default": "allow"})
    assert (await sb.egress.get()).policy == DOCS_CANONICAL  # the copy stays
    await policies.delete("web")
    assert (await other.egress.get()).policy == DOCS_CANONICAL
    with pytest.raises(NotFound, match="egress policy 'web' does not exist"):
        await policies.get("web")
    with pytest.raises(NotFound):
        await target.sandbox(egress_policy="web")
    r = await target.raw.post("/v1/sandboxes", json={"egress": ["a.test"], "egress_policy": "web"})
    assert "not both" in error(r, 400, "invalid_argument")
    await sb.kill()
    await other.kill()


async def test_ports(target: Target) -> None:
    sb = await target.sandbox()
    port = await sb.ports.expose(8000)
    assert (port.port, port.host) == (8000, "127.0.0.1")
    assert port.url == f"http://127.0.0.1:{port.host_port}"
    assert [p.port for p in await sb.ports.list()] == [8000]
    await sb.ports.close(8000)
    with pytest.raises(NotFound, match=f"port 8000 of sandbox {sb.id} is not exposed"):
        await sb.ports.close(8000)
    # A paused sandbox keeps its network: a port can be exposed (it answers on resume).
    await sb.pause()
    assert (await sb.ports.expose(8001)).port == 8001
    offline = await target.sandbox(network="none")
    assert offline.info.network is not None and offline.info.network.address is None
    with pytest.raises(Conflict, match='has no network \\(created with network "none"\\)'):
        await offline.ports.expose(8000)
    with pytest.raises(Conflict, match='has no network \\(created with network "none"\\)'):
        await offline.egress.set(["good.test"])
    r = await target.raw.post(f"/v1/sandboxes/{sb.id}/ports", json={"port": 0})
    error(r, 400, "invalid_argument")
    await offline.kill()
    await sb.kill()


async def test_private_networks(target: Target) -> None:
    nets = target.client.networks
    team = await nets.create("team")
    assert (team.name, team.members) == ("team", [])
    assert team.id.startswith("net-")
    with pytest.raises(Conflict, match="a network named 'team' already exists"):
        await nets.create("team")
    r = await target.raw.post("/v1/networks", json={"name": "Not Valid"})
    assert "is not valid" in error(r, 400, "invalid_argument")
    with pytest.raises(NotFound, match="no network 'nope'"):
        await nets.get("nope")
    a = await target.sandbox(networks=["team"])
    b = await target.sandbox()
    assert (await b.networks.join(team.id)).members == sorted([a.id, b.id])
    assert (await nets.get("team")).members == sorted([a.id, b.id])
    assert await a.networks.list() == [team.id]
    with pytest.raises(Conflict, match=f"network {team.id} is in use by "):
        await nets.delete(team.id)
    await b.networks.leave("team")
    with pytest.raises(NotFound, match=f"sandbox {b.id} is not on network {team.id}"):
        await b.networks.leave("team")
    await a.kill()
    await b.kill()
    await nets.delete("team")
    assert await nets.list() == []


async def test_fork_keeps_rules_and_networks(target: Target) -> None:
    await target.client.networks.create("crew")
    sb = await target.sandbox(egress=["good.test"], networks=["crew"])
    (child,) = await sb.fork()
    assert (await child.egress.get()).rules == ["good.test"]
    assert child.info.network is not None and sb.info.network is not None
    assert child.info.network.networks == sb.info.network.networks
    assert child.info.network.address != sb.info.network.address
    await child.kill()
    await sb.kill()


async def test_a_sandbox_shows_the_placement_labels_it_was_created_with(target: Target) -> None:
    """The labels a create was placed by stay on the sandbox's view (create answer, get,
    list) and on its fork children: on a cluster they bound where it may move."""
    labels = dict(HOST_LABELS)
    sb = await target.sandbox(placement={"labels": labels})
    plain = await target.sandbox()
    assert sb.info.placement_labels == labels and plain.info.placement_labels == {}
    assert (await target.client.get_sandbox(sb.id)).placement_labels == labels
    listed = {s.id: s.placement_labels for s in await target.client.list_sandboxes()}
    assert listed[sb.id] == labels and listed[plain.id] == {}
    assert sb.info.to_dict()["placement_labels"] == labels
    children = await sb.fork(1)
    assert [c.info.placement_labels for c in children] == [labels]
    for each in (*children, sb, plain):
        await each.kill()
    r = await target.raw.post("/v1/sandboxes", json={"placement": {"labels": {"zone": "us-2"}}})
    assert error(r, 400, "invalid_argument") == (
        "no host has the labels zone=us-2; the hosts' labels: local: tier=gpu, zone=eu-1"
    )


async def test_secrets_are_write_only_and_env_secrets_name_them(target: Target) -> None:
    value = "contract-secret-value-93b1"
    info = await target.client.secrets.set("tok", value)
    assert (info.name, info.project, info.version) == ("tok", "default", 1)
    assert (await target.client.secrets.set("tok", value + "2")).version == 2
    assert [s.name for s in await target.client.secrets.list()] == ["tok"]
    assert (await target.client.secrets.get("tok")).version == 2
    with pytest.raises(NotFound):
        await target.client.secrets.get("nope")
    r = await target.raw.put("/v1/secrets/bad%20name", json={"value": "v"})
    assert "1-128 letters" in error(r, 400, "invalid_argument")
    r = await target.raw.put("/v1/secrets/tok", json={"value": ""})
    assert "1-65536 bytes" in error(r, 400, "invalid_argument")

    sb = await target.sandbox(env_secrets={"TOKEN": "tok"})
    assert sb.info.env_secrets == {"TOKEN": "tok"}
    r = await target.raw.post("/v1/sandboxes", json={"env_secrets": {"T": "missing"}})
    assert "names secret 'missing', which does not exist" in error(r, 400, "invalid_argument")
    r = await target.raw.delete("/v1/secrets/tok")
    assert sb.id in error(r, 409, "conflict")
    for answer in (r, await target.raw.get("/v1/secrets"), await target.raw.get("/v1/sandboxes")):
        assert value not in answer.text
    await sb.kill()
    await target.client.secrets.delete("tok")
    with pytest.raises(NotFound):
        await target.client.secrets.delete("tok")


async def test_wrong_calls_get_the_same_status_and_code(target: Target) -> None:
    sb = await target.sandbox()
    cases: list[tuple[str, str, dict[str, Any] | None, int, str]] = [
        ("GET", "/v1/sandboxes/sb-000000000999", None, 404, "not_found"),
        ("GET", "/v1/snapshots/snap-000000000999", None, 404, "not_found"),
        ("GET", "/v1/networks/net-000000000999", None, 404, "not_found"),
        ("POST", "/v1/sandboxes", {"vcpus": "two"}, 400, "invalid_argument"),
        ("POST", f"/v1/sandboxes/{sb.id}/files/mkdir", {}, 400, "invalid_argument"),
        ("GET", f"/v1/sandboxes/{sb.id}/files", None, 400, "invalid_argument"),
        ("DELETE", f"/v1/sandboxes/{sb.id}/ports/9", None, 404, "not_found"),
    ]
    for method, path, body, status, code in cases:
        r = await target.raw.request(method, path, json=body)
        error(r, status, code)
    await sb.kill()


async def test_the_checker_refuses_what_the_spec_does_not_allow() -> None:
    """The check above can fail: a body missing a field, an undocumented status."""
    answers = {
        "/v1/sandboxes/sb-000000000001": httpx.Response(200, json={"id": "sb-000000000001"}),
        "/v1/sandboxes": httpx.Response(418, json={"error": {"code": "x", "message": "y"}}),
    }
    checked = CheckedTransport(httpx.MockTransport(lambda r: answers[r.url.path]))
    async with httpx.AsyncClient(base_url=BASE_URL, transport=checked) as http:
        with pytest.raises(AssertionError, match=r"does not match openapi\.json: '\w+' is a requi"):
            await http.get("/v1/sandboxes/sb-000000000001")
        with pytest.raises(AssertionError, match=r"answered 418, which openapi\.json does not"):
            await http.get("/v1/sandboxes")
        with pytest.raises(AssertionError, match=r"is not an operation of openapi\.json"):
            await http.get("/v2/nothing")
