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

from typing import Any

import httpx
import pytest

from hutch.errors import (
    Conflict,
    InvalidArgument,
    NotFound,
    StateError,
    Unauthorized,
    UnknownImage,
)
from hutch.sdk import AsyncClient, ExecExit, ExecOutput
from tests.component.contract_target import BASE_URL, HOST_LABELS, Target, error
from tests.component.contract_target import target as target  # the fixture
from tests.component.openapi_check import CheckedTransport

pytestmark = pytest.mark.timeout(120)


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
