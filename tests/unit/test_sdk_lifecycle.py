"""Pause, resume, fork and auto-resume in the SDK (sync and async) against the fake."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from hutch import AsyncSandbox, Sandbox
from hutch.errors import InvalidArgument, StateError
from hutch.sdk import (
    AsyncClient,
    Client,
    ClientClosed,
    PauseMode,
    ProtocolError,
    SandboxInfo,
    Timeouts,
)
from hutch.testing import FakeHutch


@pytest.fixture
def fake() -> FakeHutch:
    return FakeHutch()


@pytest.fixture
def sb(fake: FakeHutch) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(api_key=fake.api_key, transport=fake.transport)
    yield sandbox
    sandbox.kill()
    sandbox.close()


@pytest.fixture
async def asb(fake: FakeHutch) -> AsyncIterator[AsyncSandbox]:
    sandbox = await AsyncSandbox.create(api_key=fake.api_key, transport=fake.transport)
    yield sandbox
    await sandbox.kill()
    await sandbox.close()


def _last(fake: FakeHutch) -> tuple[str, str, Any]:
    request = fake.requests[-1]
    body = json.loads(request.content) if request.content else None
    return request.method, request.url.path, body


# -- sync ---------------------------------------------------------------------------


def test_pause_defaults_to_memory_and_updates_info(fake: FakeHutch, sb: Sandbox) -> None:
    info = sb.pause()
    assert _last(fake) == ("POST", f"/v1/sandboxes/{sb.id}/pause", {"mode": "memory"})
    assert info is sb.info
    assert (sb.info.state, sb.info.pause_mode, sb.info.is_paused) == ("paused", "memory", True)
    assert sb.info.paused_at is not None and sb.info.paused_at.tzinfo is not None
    # Saving guest memory can take long: the wait is the `lifecycle` bound, not `read`.
    assert fake.requests[-1].extensions["timeout"]["read"] == 600.0
    assert fake.sandboxes[sb.id].state == "paused"


def test_pause_disk_mode_takes_the_enum_or_a_string(fake: FakeHutch, sb: Sandbox) -> None:
    assert sb.pause(PauseMode.DISK).pause_mode == "disk"
    assert _last(fake)[2] == {"mode": "disk"}
    sb.resume()
    assert sb.pause("disk").pause_mode == "disk"


def test_pause_rejects_a_bad_mode_before_sending(fake: FakeHutch, sb: Sandbox) -> None:
    count = len(fake.requests)
    with pytest.raises(InvalidArgument, match=r"'hibernate' is not one of 'memory', 'disk'"):
        sb.pause("hibernate")  # type: ignore[arg-type]
    assert len(fake.requests) == count


def test_pause_needs_a_running_sandbox(fake: FakeHutch, sb: Sandbox) -> None:
    sb.pause()
    with pytest.raises(StateError, match="is paused; this needs it to be running"):
        sb.pause()
    assert sb.info.state == "paused"  # a failed call leaves the last known info alone


def test_resume_runs_again_and_is_a_no_op_when_running(fake: FakeHutch, sb: Sandbox) -> None:
    sb.pause()
    info = sb.resume()
    assert _last(fake)[:2] == ("POST", f"/v1/sandboxes/{sb.id}/resume")
    assert fake.requests[-1].content == b""  # the contract's resume has no body
    assert fake.requests[-1].extensions["timeout"]["read"] == 600.0
    assert (info.state, info.pause_mode, info.paused_at, info.is_paused) == (
        "running",
        None,
        None,
        False,
    )
    assert sb.resume().state == "running"
    assert fake.sandboxes[sb.id].resumes == 1  # the second resume did nothing


def test_resume_of_a_destroyed_sandbox_is_a_state_error(fake: FakeHutch, sb: Sandbox) -> None:
    fake.sandboxes[sb.id].state = "destroyed"
    with pytest.raises(StateError, match="destroyed"):
        sb.resume()


def test_exec_and_files_on_a_paused_sandbox_fail_without_auto_resume(
    fake: FakeHutch, sb: Sandbox
) -> None:
    sb.pause()
    with pytest.raises(StateError, match="is paused"):
        sb.exec("echo hi")
    with pytest.raises(StateError, match="is paused"):
        sb.files.write("f", b"x")
    assert fake.sandboxes[sb.id].state == "paused"
    sb.resume()
    assert sb.exec(["echo", "hi"]).stdout == "hi\n"


def test_auto_resume_is_sent_and_resumes_on_exec_and_files(fake: FakeHutch) -> None:
    with Sandbox.create(auto_resume=True, api_key=fake.api_key, transport=fake.transport) as sb:
        assert _last(fake)[2]["auto_resume"] is True
        assert sb.info.auto_resume is True
        sb.pause()
        assert sb.exec(["echo", "back"]).stdout == "back\n"
        assert sb.refresh().state == "running"
        sb.pause("disk")
        sb.files.write("f", b"data")
        assert fake.sandboxes[sb.id].resumes == 2
        assert sb.files.read("f") == b"data"


def test_fork_returns_child_handles_and_leaves_the_parent(fake: FakeHutch, sb: Sandbox) -> None:
    sb.files.write("state.txt", b"before fork")
    children = sb.fork(count=3)
    assert _last(fake) == ("POST", f"/v1/sandboxes/{sb.id}/fork", {"count": 3})
    assert fake.requests[-1].extensions["timeout"]["read"] == 600.0
    assert len({c.id for c in children} | {sb.id}) == 4
    for child in children:
        assert isinstance(child, Sandbox)
        assert (child.info.parent_id, child.info.state) == (sb.id, "running")
        assert child.files.read("state.txt") == b"before fork"
    assert sb.refresh().state == "running" and sb.info.parent_id is None
    # Children are full handles on the shared client: each one acts on itself only.
    children[0].files.write("state.txt", b"child 0")
    assert sb.files.read("state.txt") == b"before fork"
    with children[1]:
        pass
    assert fake.sandboxes[children[1].id].state == "destroyed"
    assert children[2].exec(["echo", "ok"]).stdout == "ok\n"  # the with did not close it
    assert fake.sandboxes[sb.id].state == "running"


def test_fork_default_count_and_a_paused_parent_stays_paused(fake: FakeHutch, sb: Sandbox) -> None:
    sb.pause()
    (child,) = sb.fork()
    assert _last(fake)[2] == {"count": 1}
    assert child.info.parent_id == sb.id and child.info.state == "running"
    assert fake.sandboxes[sb.id].state == "paused"


@pytest.mark.parametrize("count", [0, 101, True, 2.0])
def test_fork_rejects_a_bad_count_before_sending(fake: FakeHutch, sb: Sandbox, count: Any) -> None:
    sent = len(fake.requests)
    with pytest.raises(InvalidArgument, match="accepted: 1-100"):
        sb.fork(count)
    assert len(fake.requests) == sent


def test_fork_children_stop_working_when_the_owning_parent_closes(fake: FakeHutch) -> None:
    parent = Sandbox.create(api_key=fake.api_key, transport=fake.transport)
    (child,) = parent.fork()
    parent.close()
    with pytest.raises(ClientClosed, match=r"Sandbox\.connect"):
        child.refresh()
    with Sandbox.connect(child.id, api_key=fake.api_key, transport=fake.transport) as own:
        assert own.info.parent_id == parent.id
    with Sandbox.connect(parent.id, api_key=fake.api_key, transport=fake.transport) as again:
        again.kill()


def test_fork_with_a_shared_client(fake: FakeHutch) -> None:
    with Client(api_key=fake.api_key, transport=fake.transport) as client:
        sb = Sandbox.create(client=client)
        kids = sb.fork(2)
        sb.close()  # does not own the client: the children keep working
        assert [k.refresh().parent_id for k in kids] == [sb.id, sb.id]
        assert [s.id for s in Sandbox.list(client=client)] == [sb.id, *(k.id for k in kids)]


def test_a_malformed_fork_answer_is_a_protocol_error() -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(201, json={"children": []}))
    with (
        Client(api_key="k", transport=transport) as client,
        pytest.raises(ProtocolError, match="'sandboxes'"),
    ):
        client.fork_sandbox("sb-000000000001", 2)


def test_lifecycle_timeout_is_configurable(fake: FakeHutch) -> None:
    assert Timeouts.coerce(7).lifecycle == 7.0
    with Client(
        api_key=fake.api_key, timeout=Timeouts(lifecycle=30.0), transport=fake.transport
    ) as client:
        sid = client.create_sandbox().id
        client.pause_sandbox(sid)
        assert fake.requests[-1].extensions["timeout"]["read"] == 30.0


def test_sandbox_info_pause_fields_round_trip_and_are_optional(fake: FakeHutch) -> None:
    raw = fake.add_sandbox(name="p").to_json()
    raw.update(state="paused", pause_mode="memory", paused_at="2026-11-30T03:05:00.000Z")
    raw.update(parent_id="sb-00000000000a", auto_resume=True)
    assert SandboxInfo.from_dict(raw).to_dict() == raw
    # A daemon from before pause/fork does not send the fields at all.
    new_fields = ("pause_mode", "paused_at", "parent_id", "auto_resume")
    old = {k: v for k, v in raw.items() if k not in new_fields}
    info = SandboxInfo.from_dict(old)
    assert (info.pause_mode, info.paused_at, info.parent_id, info.auto_resume) == (
        None,
        None,
        None,
        False,
    )
    with pytest.raises(ProtocolError, match="'parent_id'"):
        SandboxInfo.from_dict({**raw, "parent_id": 7})


# -- async: the same core, awaited ------------------------------------------------


async def test_async_pause_resume(fake: FakeHutch, asb: AsyncSandbox) -> None:
    info = await asb.pause("disk")
    assert _last(fake) == ("POST", f"/v1/sandboxes/{asb.id}/pause", {"mode": "disk"})
    assert (info.state, info.pause_mode) == ("paused", "disk") and asb.info is info
    with pytest.raises(StateError, match="is paused"):
        await asb.exec("true")
    assert (await asb.resume()).state == "running"
    assert asb.info.state == "running"
    assert (await asb.resume()).state == "running"
    with pytest.raises(InvalidArgument, match="pause mode"):
        await asb.pause("nope")  # type: ignore[arg-type]


async def test_async_fork(fake: FakeHutch, asb: AsyncSandbox) -> None:
    kids = await asb.fork(count=2)
    assert _last(fake)[2] == {"count": 2}
    assert all(isinstance(k, AsyncSandbox) for k in kids)
    assert [k.info.parent_id for k in kids] == [asb.id, asb.id]
    assert (await kids[0].exec(["echo", "kid"])).stdout == "kid\n"
    async with kids[1]:
        pass
    assert fake.sandboxes[kids[1].id].state == "destroyed"
    await kids[0].kill()
    with pytest.raises(InvalidArgument, match="fork count"):
        await asb.fork(0)


async def test_async_auto_resume(fake: FakeHutch) -> None:
    async with AsyncClient(api_key=fake.api_key, transport=fake.transport) as client:
        sb = await AsyncSandbox.create(auto_resume=True, client=client)
        async with sb:
            assert _last(fake)[2]["auto_resume"] is True
            await sb.pause()
            await sb.files.write("f", b"1")
            assert (await sb.refresh()).state == "running"
            assert fake.sandboxes[sb.id].resumes == 1
        assert fake.sandboxes[sb.id].state == "destroyed"
