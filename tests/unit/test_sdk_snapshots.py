"""Named snapshots, create from a snapshot and the auto-pause/auto-delete policies in the
SDK (sync and async) against the fake REST contract."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

import hutch
from hutch import AsyncSandbox, Sandbox
from hutch.errors import InvalidArgument, NotFound, StateError
from hutch.sdk import AsyncClient, Client, ProtocolError, SandboxInfo, SnapshotInfo
from hutch.testing import FakeHutch


@pytest.fixture
def fake() -> FakeHutch:
    return FakeHutch()


@pytest.fixture
def conn(fake: FakeHutch) -> dict[str, Any]:
    """The connection kwargs every classmethod takes."""
    return {"api_key": fake.api_key, "transport": fake.transport}


@pytest.fixture
def sb(fake: FakeHutch, conn: dict[str, Any]) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(**conn)
    yield sandbox
    sandbox.kill()
    sandbox.close()


@pytest.fixture
async def asb(fake: FakeHutch, conn: dict[str, Any]) -> AsyncIterator[AsyncSandbox]:
    sandbox = await AsyncSandbox.create(**conn)
    yield sandbox
    await sandbox.kill()
    await sandbox.close()


def _last(fake: FakeHutch) -> tuple[str, str, Any]:
    request = fake.requests[-1]
    body = json.loads(request.content) if request.content else None
    return request.method, request.url.path, body


# -- sync: taking snapshots -------------------------------------------------------


def test_snapshot_saves_the_sandbox_and_leaves_it_running(fake: FakeHutch, sb: Sandbox) -> None:
    sb.files.write("state.txt", b"warm")
    snap = sb.snapshot("warm-1")
    assert _last(fake) == ("POST", f"/v1/sandboxes/{sb.id}/snapshots", {"name": "warm-1"})
    # Saving memory and disk takes as long as a pause: the `lifecycle` bound applies.
    assert fake.requests[-1].extensions["timeout"]["read"] == 600.0
    assert isinstance(snap, SnapshotInfo)
    assert snap.id.startswith("snap-") and len(snap.id) == len("snap-") + 12
    assert (snap.name, snap.sandbox_id, snap.image) == ("warm-1", sb.id, "base")
    assert (snap.vcpus, snap.memory_mib, snap.disk_gib) == (1, 512, 4)
    assert snap.size_bytes == (512 << 20) + len(b"warm")
    assert snap.created_at is not None and snap.created_at.tzinfo is not None
    assert sb.refresh().state == "running"
    assert fake.snapshots[snap.id].files["/root/state.txt"] == b"warm"


def test_a_paused_sandbox_stays_paused(fake: FakeHutch, sb: Sandbox) -> None:
    sb.pause()
    sb.snapshot("p")
    assert sb.refresh().state == "paused"


def test_snapshot_needs_running_or_paused(fake: FakeHutch, sb: Sandbox) -> None:
    fake.sandboxes[sb.id].state = "stopping"
    with pytest.raises(StateError, match="is stopping; this needs it to be running or paused"):
        sb.snapshot("late")
    assert fake.snapshots == {}


@pytest.mark.parametrize("name", ["", "Warm", "-x", "x-", "a_b", "x" * 64, 7])
def test_snapshot_rejects_a_bad_name_before_sending(
    sb: Sandbox, fake: FakeHutch, name: Any
) -> None:
    sent = len(fake.requests)
    with pytest.raises(InvalidArgument, match="name"):
        sb.snapshot(name)
    assert len(fake.requests) == sent


# -- sync: starting from a snapshot --------------------------------------------------


def test_create_from_a_snapshot_sends_only_the_snapshot(
    fake: FakeHutch, conn: dict[str, Any]
) -> None:
    fake.images[1]["built"] = True  # devbox: as on a host that built it
    with Sandbox.create("devbox", vcpus=2, memory_mib=1024, **conn) as src:
        src.files.write("/tmp/model.bin", b"weights", mode=0o600)
        snap = src.snapshot("ready")
        with Sandbox.create(snapshot=snap.id, **conn) as copy:
            # Image and shape come with the snapshot, so none are sent.
            assert _last(fake)[2] == {"snapshot": snap.id}
            info = copy.info
            assert (info.snapshot_id, info.image, info.vcpus, info.memory_mib) == (
                snap.id,
                "devbox",
                2,
                1024,
            )
            assert copy.files.read("/tmp/model.bin") == b"weights"
            assert copy.files.stat("/tmp/model.bin").mode == 0o600
            # The copy is its own: writes do not reach the source or the snapshot.
            copy.files.write("/tmp/model.bin", b"tuned")
            assert src.files.read("/tmp/model.bin") == b"weights"
            assert fake.snapshots[snap.id].files["/tmp/model.bin"] == b"weights"
        assert src.info.snapshot_id is None


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"image": "devbox"}, "image='devbox'"),
        ({"vcpus": 2}, "vcpus=2"),
        ({"memory_mib": 1024, "disk_gib": 8}, "memory_mib=1024, disk_gib=8"),
    ],
)
def test_create_from_a_snapshot_refuses_another_shape(
    fake: FakeHutch, conn: dict[str, Any], kwargs: dict[str, Any], named: str
) -> None:
    sent = len(fake.requests)
    with pytest.raises(InvalidArgument, match=f"snapshot's image and shape; drop {named}"):
        Sandbox.create(snapshot="snap-000000000001", **kwargs, **conn)
    assert len(fake.requests) == sent


def test_create_from_a_missing_snapshot_is_not_found(conn: dict[str, Any]) -> None:
    with pytest.raises(NotFound, match="no snapshot 'snap-00000000dead'"):
        Sandbox.create(snapshot="snap-00000000dead", **conn)
    with pytest.raises(InvalidArgument, match="snapshot id must be a non-empty string"):
        Sandbox.create(snapshot="", **conn)


# -- sync: policies ---------------------------------------------------------------


def test_policies_are_sent_only_when_set_and_read_back(
    fake: FakeHutch, conn: dict[str, Any]
) -> None:
    with Sandbox.create(auto_pause_s=300, auto_delete_s=86400, **conn) as sb:
        body = _last(fake)[2]
        assert (body["auto_pause_s"], body["auto_delete_s"]) == (300, 86400)
        assert (sb.info.auto_pause_s, sb.info.auto_delete_s) == (300, 86400)
    with Sandbox.create(**conn) as plain:
        # A daemon that predates the policies never sees the fields.
        assert not {"auto_pause_s", "auto_delete_s", "snapshot"} & set(_last(fake)[2])
        assert (plain.info.auto_pause_s, plain.info.auto_delete_s) == (None, None)
    with Sandbox.create(auto_delete_s=60, **conn):
        assert "auto_pause_s" not in _last(fake)[2] and _last(fake)[2]["auto_delete_s"] == 60


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"auto_pause_s": 59}, "auto_pause_s=59 is out of range; accepted: 60-86400 seconds"),
        ({"auto_pause_s": 86401}, "auto_pause_s=86401 is out of range"),
        ({"auto_pause_s": True}, "auto_pause_s=True is out of range"),
        ({"auto_delete_s": 30}, "auto_delete_s=30 is out of range; accepted: 60-2592000"),
        ({"auto_delete_s": 2592001}, "auto_delete_s=2592001 is out of range"),
        ({"auto_delete_s": 600.0}, "auto_delete_s=600.0 is out of range"),
    ],
)
def test_policies_out_of_range_are_refused_before_sending(
    fake: FakeHutch, conn: dict[str, Any], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        Sandbox.create(**kwargs, **conn)
    assert fake.requests == []


# -- sync: listing and deleting ------------------------------------------------------


def test_list_get_and_delete_snapshots(fake: FakeHutch, conn: dict[str, Any], sb: Sandbox) -> None:
    assert Sandbox.list_snapshots(**conn) == []
    first, second = sb.snapshot("a"), sb.snapshot("a")  # names need not be unique
    assert first.id != second.id
    listed = Sandbox.list_snapshots(**conn)
    assert _last(fake)[:2] == ("GET", "/v1/snapshots")
    assert listed == [first, second]
    assert Sandbox.get_snapshot(second.id, **conn) == second
    assert _last(fake)[:2] == ("GET", f"/v1/snapshots/{second.id}")
    Sandbox.delete_snapshot(first.id, **conn)  # while sb runs on from it
    assert _last(fake)[:2] == ("DELETE", f"/v1/snapshots/{first.id}")
    assert [s.id for s in Sandbox.list_snapshots(**conn)] == [second.id]
    with pytest.raises(NotFound, match=f"no snapshot '{first.id}'"):
        Sandbox.get_snapshot(first.id, **conn)
    with pytest.raises(NotFound):
        Sandbox.delete_snapshot(first.id, **conn)


def test_delete_works_while_sandboxes_and_snapshots_are_built_on_it(
    fake: FakeHutch, conn: dict[str, Any], sb: Sandbox
) -> None:
    snap = sb.snapshot("base-line")
    user = Sandbox.create(snapshot=snap.id, **conn)
    (child,) = user.fork()  # built on the same snapshot through its parent
    newer = user.snapshot("newer")  # built on the first one
    Sandbox.delete_snapshot(snap.id, **conn)  # older first: allowed
    assert [s.id for s in Sandbox.list_snapshots(**conn)] == [newer.id]
    with pytest.raises(NotFound):
        Sandbox.create(snapshot=snap.id, **conn)
    for running in (sb, user, child):
        assert running.refresh().state == "running"
    started = Sandbox.create(snapshot=newer.id, **conn)
    Sandbox.delete_snapshot(newer.id, **conn)
    assert fake.snapshots == {}
    for s in (started, child, user):
        s.kill()
        s.close()


def test_a_snapshot_of_a_copy_outlives_the_first_one(
    fake: FakeHutch, conn: dict[str, Any], sb: Sandbox
) -> None:
    first = sb.snapshot("one")
    sb.kill()
    with Sandbox.create(snapshot=first.id, **conn) as copy:
        copy.files.write("f", b"2")
        second = copy.snapshot("two")
    Sandbox.delete_snapshot(first.id, **conn)  # the one the second is built on
    with Sandbox.create(snapshot=second.id, **conn) as grandchild:
        assert grandchild.files.read("f") == b"2"
    Sandbox.delete_snapshot(second.id, **conn)


def test_classmethods_share_a_given_client(fake: FakeHutch) -> None:
    with Client(api_key=fake.api_key, transport=fake.transport) as client:
        sb = Sandbox.create(client=client)
        snap = sb.snapshot("s")
        assert Sandbox.list_snapshots(client=client) == [snap]
        assert Sandbox.get_snapshot(snap.id, client=client).name == "s"
        sb.kill()
        Sandbox.delete_snapshot(snap.id, client=client)
        # The client was lent, not owned: it still works.
        assert client.list_snapshots() == []


def test_client_snapshot_methods_and_quoted_ids(fake: FakeHutch) -> None:
    with Client(api_key=fake.api_key, transport=fake.transport) as client:
        sid = client.create_sandbox().id
        snap = client.create_snapshot(sid, "c")
        assert client.get_snapshot(snap.id) == snap
        assert client.list_snapshots() == [snap]
        with pytest.raises(NotFound):
            client.get_snapshot("a/b")
        assert fake.requests[-1].url.raw_path == b"/v1/snapshots/a%2Fb"
        with pytest.raises(InvalidArgument, match="snapshot id"):
            client.delete_snapshot("")
        client.delete_sandbox(sid)
        client.delete_snapshot(snap.id)


def test_malformed_snapshot_answers_are_protocol_errors() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/snapshots":
            return httpx.Response(200, json={"items": []})
        return httpx.Response(200, json={"id": "snap-000000000001", "name": "x"})

    with Client(api_key="k", transport=httpx.MockTransport(answer)) as client:
        with pytest.raises(ProtocolError, match="'snapshots'"):
            client.list_snapshots()
        with pytest.raises(ProtocolError, match="snapshot: field 'sandbox_id'"):
            client.get_snapshot("snap-000000000001")


def test_snapshot_info_round_trips_to_the_api_form(fake: FakeHutch) -> None:
    raw = fake.add_snapshot(fake.add_sandbox(vcpus=4), "r").to_json()
    info = SnapshotInfo.from_dict(raw)
    assert info.to_dict() == raw
    assert info.vcpus == 4
    with pytest.raises(ProtocolError, match="'size_bytes'"):
        SnapshotInfo.from_dict({**raw, "size_bytes": "big"})


def test_sandbox_info_policy_fields_round_trip_and_are_optional(fake: FakeHutch) -> None:
    raw = fake.add_sandbox(auto_pause_s=120, auto_delete_s=600, snapshot="snap-000000000009")
    as_json = raw.to_json()
    assert SandboxInfo.from_dict(as_json).to_dict() == as_json
    new_fields = ("auto_pause_s", "auto_delete_s", "snapshot_id")
    old = SandboxInfo.from_dict({k: v for k, v in as_json.items() if k not in new_fields})
    assert (old.auto_pause_s, old.auto_delete_s, old.snapshot_id) == (None, None, None)
    with pytest.raises(ProtocolError, match="'auto_pause_s'"):
        SandboxInfo.from_dict({**as_json, "auto_pause_s": "soon"})


def test_snapshot_info_is_exported_from_the_package_root() -> None:
    assert hutch.SnapshotInfo is SnapshotInfo
    assert "SnapshotInfo" in hutch.__all__ and "SnapshotInfo" in hutch.sdk.__all__


# -- async: the same core, awaited ------------------------------------------------


async def test_async_snapshot_and_create_from_it(
    fake: FakeHutch, conn: dict[str, Any], asb: AsyncSandbox
) -> None:
    await asb.files.write("f", b"1")
    snap = await asb.snapshot("a-1")
    assert _last(fake) == ("POST", f"/v1/sandboxes/{asb.id}/snapshots", {"name": "a-1"})
    assert (snap.sandbox_id, snap.name) == (asb.id, "a-1")
    assert (await asb.refresh()).state == "running"
    async with await AsyncSandbox.create(
        snapshot=snap.id, auto_pause_s=60, auto_delete_s=2592000, **conn
    ) as copy:
        assert _last(fake)[2] == {
            "snapshot": snap.id,
            "auto_pause_s": 60,
            "auto_delete_s": 2592000,
        }
        assert copy.info.snapshot_id == snap.id
        assert (copy.info.auto_pause_s, copy.info.auto_delete_s) == (60, 2592000)
        assert await copy.files.read("f") == b"1"
        await AsyncSandbox.delete_snapshot(snap.id, **conn)  # while both run on it
        assert await AsyncSandbox.list_snapshots(**conn) == []
        assert await copy.files.read("f") == b"1"
    with pytest.raises(InvalidArgument, match="name"):
        await asb.snapshot("UPPER")
    await asb.kill()
    with pytest.raises(InvalidArgument, match="auto_pause_s=10"):
        await AsyncSandbox.create(auto_pause_s=10, **conn)
    with pytest.raises(InvalidArgument, match="drop vcpus=2"):
        await AsyncSandbox.create(snapshot="snap-000000000001", vcpus=2, **conn)


async def test_async_list_get_with_a_shared_client(fake: FakeHutch) -> None:
    async with AsyncClient(api_key=fake.api_key, transport=fake.transport) as client:
        sb = await AsyncSandbox.create(client=client)
        snap = await client.create_snapshot(sb.id, "shared")
        assert await AsyncSandbox.list_snapshots(client=client) == [snap]
        assert await AsyncSandbox.get_snapshot(snap.id, client=client) == snap
        assert await client.get_snapshot(snap.id) == snap
        assert await client.list_snapshots() == [snap]
        with pytest.raises(NotFound):
            await AsyncSandbox.get_snapshot("snap-000000000bad", client=client)
        await sb.kill()
        await client.delete_snapshot(snap.id)
        assert fake.snapshots == {}
