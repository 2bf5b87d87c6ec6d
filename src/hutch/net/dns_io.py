"""DNS on the wire, below the resolver's decisions (:mod:`hutch.net.dns`): the UDP and
TCP listeners, the one-shot UDP and TCP queries to the upstream, and the two replies
built from a query's header alone, without parsing it (REFUSED for a sender over its
rate, FORMERR for a packet dnspython cannot read).

Apart from the resolver because none of it looks at a name, a rule or a sandbox: it
moves length-prefixed or datagram bytes, with the timeouts and errors of a socket
(NetworkError naming the server).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Awaitable, Callable

import dns.rcode

from hutch.errors import NetworkError

__all__ = [
    "formerr_reply",
    "query_tcp",
    "query_udp",
    "refused_reply",
    "serve_tcp_dns",
    "start_udp_dns",
]


def refused_reply(wire: bytes) -> bytes | None:
    """REFUSED for the query ``wire``, built from its header and first question only (a
    reply must repeat the question or stub resolvers ignore it). None (drop) for a
    response, or a packet whose question cannot be read without more work."""
    if len(wire) < 12 or wire[2] & 0x80:
        return None
    qdcount = struct.unpack_from("!H", wire, 4)[0]
    end = 12
    if qdcount:
        while True:
            if end >= len(wire) or end > 12 + 255:
                return None
            length = wire[end]
            if length == 0:
                break
            if length & 0xC0:  # compression in a question: not worth reading
                return None
            end += 1 + length
        end += 1 + 4  # root label, type, class
        if end > len(wire):
            return None
    flags = 0x8000 | (wire[2] & 0x79) << 8 | 0x80 | dns.rcode.REFUSED  # QR, opcode, RD, RA
    return (
        struct.pack("!HHHHHH", *struct.unpack_from("!H", wire), flags, min(qdcount, 1), 0, 0, 0)
        + wire[12:end]
    )


def formerr_reply(wire: bytes) -> bytes | None:
    """FORMERR for a packet with a readable header, None (drop) otherwise."""
    if len(wire) < 12:
        return None
    qid = struct.unpack("!H", wire[:2])[0]
    flags = 0x8000 | (wire[2] & 0x78) << 8 | dns.rcode.FORMERR  # QR, same opcode
    return struct.pack("!HHHHHH", qid, flags, 0, 0, 0, 0)


# ---- sockets (asyncio; dnspython only parses and builds, in hutch.net.dns) ---------------


class _UdpServer(asyncio.DatagramProtocol):
    def __init__(self, on_datagram: Callable[[bytes, tuple[str, int]], None]) -> None:
        self._on_datagram = on_datagram

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self._on_datagram(data, addr)


async def start_udp_dns(
    host: str, port: int, on_datagram: Callable[[bytes, tuple[str, int]], None]
) -> asyncio.DatagramTransport:
    """Listen for UDP queries on ``host:port``, each datagram to ``on_datagram(data,
    addr)``; NetworkError when the port cannot be bound."""
    loop = asyncio.get_running_loop()
    try:
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _UdpServer(on_datagram), local_addr=(host, port)
        )
    except OSError as exc:
        raise NetworkError(f"DNS resolver cannot listen on {host}:{port} (UDP): {exc}") from exc
    return transport


class _UdpClient(asyncio.DatagramProtocol):
    def __init__(self, qid: bytes) -> None:
        self._qid = qid
        self.answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if data[:2] == self._qid and not self.answer.done():  # stray packets are ignored
            self.answer.set_result(data)

    def error_received(self, exc: Exception) -> None:
        if not self.answer.done():
            self.answer.set_exception(exc)


async def query_udp(server: tuple[str, int], wire: bytes, timeout_s: float) -> bytes:
    """One UDP query from a fresh socket (a fresh random source port per query)."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout_s):
            transport, proto = await loop.create_datagram_endpoint(
                lambda: _UdpClient(wire[:2]), remote_addr=server
            )
            try:
                transport.sendto(wire)
                return await proto.answer
            finally:
                transport.close()
    except TimeoutError as exc:
        raise NetworkError(f"upstream DNS {server[0]}:{server[1]} timed out") from exc
    except OSError as exc:
        raise NetworkError(f"upstream DNS {server[0]}:{server[1]}: {exc}") from exc


async def query_tcp(server: tuple[str, int], wire: bytes, timeout_s: float) -> bytes:
    """One length-prefixed query over a fresh TCP connection."""
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(server[0], server[1])
            try:
                writer.write(struct.pack("!H", len(wire)) + wire)
                await writer.drain()
                (size,) = struct.unpack("!H", await reader.readexactly(2))
                return await reader.readexactly(size)
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except TimeoutError as exc:
        raise NetworkError(f"upstream DNS {server[0]}:{server[1]} (TCP) timed out") from exc
    except (OSError, asyncio.IncompleteReadError) as exc:
        raise NetworkError(f"upstream DNS {server[0]}:{server[1]} (TCP): {exc}") from exc


async def serve_tcp_dns(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    handler: Callable[[bytes], Awaitable[bytes | None]],
    idle_s: float,
) -> None:
    """Answer length-prefixed queries on one connection until EOF or ``idle_s`` of quiet."""
    try:
        while True:
            async with asyncio.timeout(idle_s):
                (size,) = struct.unpack("!H", await reader.readexactly(2))
                query = await reader.readexactly(size)
            reply = await handler(query)
            if reply is None:
                break
            writer.write(struct.pack("!H", len(reply)) + reply)
            await writer.drain()
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
