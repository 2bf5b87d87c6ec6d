"""The proxy's protocol-level relay (hutch.net.relay) over real loopback sockets: a
client (the guest), the relay's two endpoints, a server (upstream). Nothing is mocked:
what the relay does is read back at the client and the server."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
import uvloop

from hutch.net.http_head import parse_request_head
from hutch.net.http_relay import OneRequest
from hutch.net.relay import HOLD_LIMIT, Endpoint, Relay

# The data path's code, on the data path's loop (tests/conftest.py).
pytestmark = pytest.mark.datapath_loop

#: Far more than every socket and transport buffer on the way can hold.
FLOOD = 32 << 20


@dataclass
class Wire:
    """client ⇄ guest endpoint ⇄ (relay) ⇄ upstream endpoint ⇄ server."""

    client: tuple[asyncio.StreamReader, asyncio.StreamWriter]
    server: tuple[asyncio.StreamReader, asyncio.StreamWriter]
    guest: Endpoint
    upstream: Endpoint
    sent: list[int] = field(default_factory=list)

    def relay(self, **kw: object) -> Relay:
        return Relay(self.guest, self.upstream, sent=self.sent.append, **kw)  # type: ignore[arg-type]


@pytest.fixture
async def wire() -> AsyncIterator[Wire]:
    loop = asyncio.get_running_loop()
    servers: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
    guests: asyncio.Queue[Endpoint] = asyncio.Queue()

    async def on_server(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await servers.put((r, w))

    upstream_server = await asyncio.start_server(on_server, "127.0.0.1", 0)
    guest_server = await loop.create_server(lambda: Endpoint(guests.put_nowait), "127.0.0.1", 0)
    try:
        client = await asyncio.open_connection(
            "127.0.0.1", guest_server.sockets[0].getsockname()[1]
        )
        guest = await guests.get()
        _, upstream = await loop.create_connection(
            Endpoint, "127.0.0.1", upstream_server.sockets[0].getsockname()[1]
        )
        server = await servers.get()
        wire = Wire(client, server, guest, upstream)
        yield wire
        for _, w in (wire.client, wire.server):
            w.close()
            with contextlib.suppress(OSError):
                await w.wait_closed()
        for ep in (guest, upstream):
            ep.abort()
            await ep.wait_closed()
    finally:
        upstream_server.close()
        guest_server.close()
        await upstream_server.wait_closed()
        await guest_server.wait_closed()


async def until(check: Callable[[], bool]) -> None:
    """Wait for a condition the loop will make true (bounded only by the test timeout).
    Polled: a transport's reading state and buffers have no event to wait on."""
    while not check():  # noqa: ASYNC110
        await asyncio.sleep(0.005)


async def test_bytes_go_both_ways_and_the_upstream_ones_are_counted(wire: Wire) -> None:
    relay = wire.relay()
    relay.start(b"first:")
    done = asyncio.ensure_future(relay.wait())
    (c_reader, c_writer), (s_reader, s_writer) = wire.client, wire.server
    up = os.urandom(300_000)
    c_writer.write(up)
    assert await s_reader.readexactly(6 + len(up)) == b"first:" + up
    down = os.urandom(500_000)
    s_writer.write(down)
    assert await c_reader.readexactly(len(down)) == down
    c_writer.close()  # a full close: both directions end
    assert await s_reader.read() == b""
    s_writer.close()
    assert await done is None
    assert sum(wire.sent) == 6 + len(up)  # what went upstream, nothing of the answer


async def test_held_bytes_and_an_eof_before_the_start_are_passed_on(wire: Wire) -> None:
    (c_reader, c_writer), (s_reader, s_writer) = wire.client, wire.server
    c_writer.write(b"early bytes")
    c_writer.write_eof()
    await until(lambda: wire.guest.eof)
    assert bytes(wire.guest.buffer) == b"early bytes"
    relay = wire.relay()
    relay.start()
    done = asyncio.ensure_future(relay.wait())
    assert await s_reader.read() == b"early bytes"  # then EOF: the half-close
    s_writer.write(b"answer after the guest's EOF")
    s_writer.close()
    assert await c_reader.read() == b"answer after the guest's EOF"
    assert await done is None


async def test_half_close_keeps_the_other_direction_open(wire: Wire) -> None:
    relay = wire.relay()
    relay.start()
    done = asyncio.ensure_future(relay.wait())
    (c_reader, c_writer), (s_reader, s_writer) = wire.client, wire.server
    c_writer.write(b"request")
    c_writer.write_eof()
    assert await s_reader.read() == b"request"  # the server sees the guest's EOF
    for i in range(5):  # and still talks to the guest, which still reads
        s_writer.write(b"part %d;" % i)
        assert await c_reader.readexactly(7) == b"part %d;" % i
    assert not done.done()
    s_writer.write_eof()
    assert await c_reader.read() == b""
    assert await done is None  # both directions ended: the relay closed both sockets


async def test_a_slow_server_stops_the_guest_side_reading(wire: Wire) -> None:
    relay = wire.relay()
    relay.start()
    done = asyncio.ensure_future(relay.wait())
    (_, c_writer), (s_reader, s_writer) = wire.client, wire.server
    guest_t, up_t = wire.guest.transport, wire.upstream.transport
    assert guest_t is not None and up_t is not None
    payload = os.urandom(FLOOD)
    c_writer.write(payload)  # the server reads nothing yet
    await until(lambda: not guest_t.is_reading())
    # Paused at the high-water mark: the relay holds at most one read beyond it.
    high = up_t.get_write_buffer_limits()[1]
    assert up_t.get_write_buffer_size() <= high + 256 * 1024
    got = await s_reader.readexactly(FLOOD)
    assert got == payload
    assert guest_t.is_reading()
    assert sum(wire.sent) == FLOOD
    c_writer.close()
    s_writer.close()
    assert await done is None


async def test_a_slow_guest_stops_the_upstream_side_reading(wire: Wire) -> None:
    relay = wire.relay()
    relay.start()
    done = asyncio.ensure_future(relay.wait())
    (c_reader, c_writer), (_, s_writer) = wire.client, wire.server
    guest_t, up_t = wire.guest.transport, wire.upstream.transport
    assert guest_t is not None and up_t is not None
    payload = os.urandom(FLOOD)
    s_writer.write(payload)  # the guest reads nothing yet
    await until(lambda: not up_t.is_reading())
    assert guest_t.get_write_buffer_size() <= guest_t.get_write_buffer_limits()[1] + 256 * 1024
    assert await c_reader.readexactly(FLOOD) == payload
    assert up_t.is_reading()
    assert wire.sent == []  # nothing went upstream
    c_writer.close()
    s_writer.close()
    assert await done is None


async def test_aborting_one_side_cuts_both(wire: Wire) -> None:
    relay = wire.relay()
    relay.start()
    done = asyncio.ensure_future(relay.wait())
    (c_reader, c_writer), (s_reader, _) = wire.client, wire.server
    c_writer.write(b"hello")
    assert await s_reader.readexactly(5) == b"hello"
    assert wire.upstream.transport is not None
    wire.upstream.transport.abort()  # what EgressProxy.revalidate does
    assert await done is None
    with contextlib.suppress(ConnectionError):
        assert await c_reader.read() == b""  # closed (or reset) for the guest too
    assert wire.guest.lost and wire.upstream.lost


async def test_a_cancelled_wait_aborts_both(wire: Wire) -> None:
    relay = wire.relay()
    relay.start()
    waiting = asyncio.ensure_future(relay.wait())
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await wire.guest.wait_closed()
    await wire.upstream.wait_closed()
    (c_reader, _), (s_reader, _) = wire.client, wire.server
    for reader in (c_reader, s_reader):
        with contextlib.suppress(ConnectionError):
            assert await reader.read() == b""


def _request(raw: bytes) -> OneRequest:
    head = parse_request_head(raw)
    assert head is not None
    return OneRequest(head)


async def test_one_request_sends_exactly_the_framed_body_and_the_answer_ends_it(
    wire: Wire,
) -> None:
    head = b"POST /x HTTP/1.1\r\nHost: good.test\r\nContent-Length: 10\r\n\r\n"
    relay = wire.relay(upload=_request(head), answer_ends=True)
    relay.start(head)
    done = asyncio.ensure_future(relay.wait())
    (c_reader, c_writer), (s_reader, s_writer) = wire.client, wire.server
    c_writer.write(b"0123456789GET /smuggled HTTP/1.1\r\nHost: evil.test\r\n\r\n")
    assert await s_reader.readexactly(len(head) + 10) == head + b"0123456789"
    s_writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    s_writer.close()  # the guest never closed: the server's end ends the relay
    assert await c_reader.read() == b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    assert await done is None
    assert await s_reader.read() == b""  # nothing after the body ever reached the server
    assert sum(wire.sent) == len(head) + 10


async def test_a_malformed_chunked_body_cuts_the_relay(wire: Wire) -> None:
    head = b"POST /x HTTP/1.1\r\nHost: good.test\r\nTransfer-Encoding: chunked\r\n\r\n"
    relay = wire.relay(upload=_request(head), answer_ends=True)
    relay.start(head)
    done = asyncio.ensure_future(relay.wait())
    (c_reader, c_writer), (s_reader, _) = wire.client, wire.server
    c_writer.write(b"zz\r\nnot a chunk size\r\n")
    cut = await done
    assert cut is not None and cut.startswith("request body:")
    assert await s_reader.read() == head  # the head went, no byte of the bad body
    with contextlib.suppress(ConnectionError):
        assert await c_reader.read() == b""


async def test_an_endpoint_holds_until_the_limit_then_stops_reading(wire: Wire) -> None:
    (_, c_writer), (s_reader, s_writer) = wire.client, wire.server
    c_writer.write(os.urandom(FLOOD))
    guest_t = wire.guest.transport
    assert guest_t is not None
    await until(lambda: not guest_t.is_reading())
    assert HOLD_LIMIT <= len(wire.guest.buffer) < HOLD_LIMIT + 256 * 1024
    relay = wire.relay()
    relay.start()  # what was held goes first, then the rest
    done = asyncio.ensure_future(relay.wait())
    assert len(await s_reader.readexactly(FLOOD)) == FLOOD
    c_writer.close()
    s_writer.close()
    assert await done is None


async def test_a_connection_handed_over_to_streams_keeps_its_bytes_and_eof(wire: Wire) -> None:
    (c_reader, c_writer), _ = wire.client, wire.server
    c_writer.write(b"client hello")
    await until(lambda: len(wire.guest.buffer) == 12)
    held, reader, writer = wire.guest.to_streams()
    assert held == b"client hello" and wire.guest.buffer == b""
    c_writer.write(b" and more")
    assert await reader.readexactly(9) == b" and more"  # what came after, through the reader
    c_writer.write_eof()
    assert await reader.read() == b""
    writer.write(b"answer")  # the other direction still works
    writer.close()
    await writer.wait_closed()
    assert await c_reader.read() == b"answer"
    assert wire.guest.streams is writer


async def test_these_tests_run_on_the_data_path_s_loop() -> None:
    # The datapath_loop mark (tests/conftest.py): what hutchd's data path runs.
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
