"""The inbound port forwarder over real loopback sockets (the "guest" is 127.0.0.30)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
from collections.abc import AsyncIterator, Iterator

import pytest

from hutch.errors import InvalidArgument, NetworkError
from hutch.net.inbound import PortForwarder

GUEST = "127.0.0.30"


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.close()


@pytest.fixture
async def guest() -> AsyncIterator[int]:
    server = await asyncio.start_server(echo, GUEST, 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


@pytest.fixture
async def forwarder() -> AsyncIterator[PortForwarder]:
    fwd = PortForwarder("127.0.0.1", connect_timeout_s=2)
    yield fwd
    await fwd.shutdown()


async def roundtrip(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.readexactly(len(payload)), 10)
    finally:
        writer.close()


async def test_expose_forwards_and_close_stops(forwarder: PortForwarder, guest: int) -> None:
    host_port = await forwarder.expose("sb-1", GUEST, guest)
    assert forwarder.exposed("sb-1") == {guest: host_port}
    assert await forwarder.expose("sb-1", GUEST, guest) == host_port  # idempotent
    assert await roundtrip(host_port, b"ping") == b"ping"
    # A connection open while the port is closed is cut, and new ones are refused.
    reader, writer = await asyncio.open_connection("127.0.0.1", host_port)
    writer.write(b"x")
    assert await reader.readexactly(1) == b"x"
    await forwarder.close("sb-1", guest)
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", host_port)
    assert forwarder.exposed("sb-1") == {}
    await forwarder.close("sb-1", guest)  # twice is fine


async def test_big_transfer_is_intact(forwarder: PortForwarder, guest: int) -> None:
    host_port = await forwarder.expose("sb-1", GUEST, guest)
    payload = random.Random(3).randbytes(8 * 1024 * 1024)
    reader, writer = await asyncio.open_connection("127.0.0.1", host_port)

    async def send() -> None:
        writer.write(payload)
        await writer.drain()

    sender = asyncio.create_task(send())
    got = await asyncio.wait_for(reader.readexactly(len(payload)), 30)
    await sender
    writer.close()
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()


async def test_close_all_and_per_sandbox_listing(forwarder: PortForwarder, guest: int) -> None:
    a = await forwarder.expose("sb-1", GUEST, guest)
    b = await forwarder.expose("sb-2", GUEST, guest)
    assert a != b
    await forwarder.close_all("sb-1")
    assert forwarder.exposed("sb-1") == {}
    assert forwarder.exposed("sb-2") == {guest: b}
    assert await roundtrip(b, b"still") == b"still"
    await forwarder.close_all("sb-1")


async def test_unreachable_guest_closes_the_client(forwarder: PortForwarder) -> None:
    host_port = await forwarder.expose("sb-1", "127.0.0.31", 9)  # nothing listens there
    reader, writer = await asyncio.open_connection("127.0.0.1", host_port)
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_requested_host_port_and_errors(forwarder: PortForwarder, guest: int) -> None:
    first = await forwarder.expose("sb-1", GUEST, guest)
    await forwarder.close("sb-1", guest)
    assert await forwarder.expose("sb-1", GUEST, guest, host_port=first) == first
    with pytest.raises(NetworkError, match="cannot listen"):
        await forwarder.expose("sb-2", GUEST, guest, host_port=first)  # taken
    with pytest.raises(InvalidArgument):
        await forwarder.expose("sb-1", GUEST, 0)


async def test_an_open_connection_counts_as_activity(forwarder: PortForwarder, guest: int) -> None:
    """auto_pause_s must not pause a sandbox while someone is connected to it."""
    open_now: list[str] = []

    @contextlib.contextmanager
    def activity(sandbox_id: str) -> Iterator[None]:
        open_now.append(sandbox_id)
        try:
            yield
        finally:
            open_now.remove(sandbox_id)

    forwarder.activity = activity
    host_port = await forwarder.expose("sb-1", GUEST, guest)
    reader, writer = await asyncio.open_connection("127.0.0.1", host_port)
    writer.write(b"x")
    assert await reader.readexactly(1) == b"x"
    assert open_now == ["sb-1"]
    writer.close()
    for _ in range(100):
        if not open_now:
            break
        await asyncio.sleep(0.02)
    assert open_now == []
