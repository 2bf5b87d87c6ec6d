"""AsyncSandbox against the same fake: the same core, awaited."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from hutch import AsyncSandbox
from hutch.errors import NotFound, Timeout
from hutch.sdk import AsyncClient, DaemonUnreachable, ExecExit, ExecOutput
from hutch.testing import FakeHutch, FakeRun


@pytest.fixture
def fake() -> FakeHutch:
    return FakeHutch()


@pytest.fixture
async def sb(fake: FakeHutch) -> AsyncIterator[AsyncSandbox]:
    sandbox = await AsyncSandbox.create(api_key=fake.api_key, transport=fake.transport)
    yield sandbox
    await sandbox.kill()
    await sandbox.close()


async def test_create_connect_list_and_kill(fake: FakeHutch) -> None:
    async with await AsyncSandbox.create(
        "base", vcpus=2, metadata={"k": "v"}, api_key=fake.api_key, transport=fake.transport
    ) as sb:
        assert json.loads(fake.requests[-1].content)["vcpus"] == 2
        assert sb.info.state == "running"
        listed = await AsyncSandbox.list(
            metadata={"k": "v"}, api_key=fake.api_key, transport=fake.transport
        )
        assert [s.id for s in listed] == [sb.id]
        async with AsyncClient(api_key=fake.api_key, transport=fake.transport) as client:
            same = await AsyncSandbox.connect(sb.id, client=client)
            fake.sandboxes[sb.id].state = "stopping"
            assert (await same.refresh()).state == "stopping"
            fake.sandboxes[sb.id].state = "running"
    assert fake.sandboxes[sb.id].state == "destroyed"
    await sb.kill()


async def test_exec_plain_and_with_sync_and_async_callbacks(
    fake: FakeHutch, sb: AsyncSandbox
) -> None:
    fake.exec_handler = lambda s, body: FakeRun(
        [("stdout", "o1"), ("stderr", "e1"), ("stdout", "o2")], exit_code=4
    )
    plain = await sb.exec(["x"], cwd="/tmp")
    assert (plain.stdout, plain.stderr, plain.exit_code) == ("o1o2", "e1", 4)
    out: list[str] = []
    err: list[str] = []

    async def on_err(data: str) -> None:
        err.append(data)

    streamed = await sb.exec("x", on_stdout=out.append, on_stderr=on_err)
    assert (out, err) == (["o1", "o2"], ["e1"])
    assert streamed == plain


async def test_exec_stream(fake: FakeHutch, sb: AsyncSandbox) -> None:
    fake.exec_handler = lambda s, body: FakeRun([("stdout", "a\n")], exit_code=None, signal=15)
    events = [event async for event in sb.exec_stream(["x"])]
    assert events == [ExecOutput("stdout", "a\n"), ExecExit(None, 15, 7)]


async def test_exec_stream_error_line_raises(fake: FakeHutch, sb: AsyncSandbox) -> None:
    fake.exec_handler = lambda s, body: FakeRun([], error=("timeout", "too slow"))
    with pytest.raises(Timeout, match="too slow"):
        async for _ in sb.exec_stream("x", timeout_s=1):
            pass


async def test_files(fake: FakeHutch, sb: AsyncSandbox) -> None:
    fake.download_chunk = 3
    await sb.files.write("a", b"abcdefg")
    assert await sb.files.read("a") == b"abcdefg"
    assert [c async for c in sb.files.read_stream("a")] == [b"abc", b"def", b"g"]

    async def agen() -> AsyncIterator[bytes]:
        yield b"x"
        yield b"y"

    await sb.files.write("b", agen())
    await sb.files.write("c", io.BytesIO(b"z" * (3 << 20)), mode=0o640)  # read in a thread
    await sb.files.write("d", iter([b"1", b"2"]))
    await sb.files.write("e", "text")
    assert [await sb.files.read(p) for p in "bde"] == [b"xy", b"12", b"text"]
    assert (await sb.files.stat("c")).size == 3 << 20
    await sb.files.mkdir("/w")
    await sb.files.rename("/root/a", "/w/a")
    assert [e.path for e in await sb.files.list("/w")] == ["/w/a"]
    await sb.files.remove("/w", recursive=True)
    with pytest.raises(NotFound):
        await sb.files.stat("/w")


async def test_async_file_object_upload(sb: AsyncSandbox) -> None:
    class AsyncReader:
        def __init__(self) -> None:
            self.parts = [b"as", b"ync", b""]

        async def read(self, n: int) -> bytes:
            return self.parts.pop(0)

    await sb.files.write("f", AsyncReader())
    assert await sb.files.read("f") == b"async"


async def test_connection_refused() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(DaemonUnreachable, match="hutch daemon"):
        await AsyncSandbox.create(api_key="k", transport=httpx.MockTransport(refuse))
