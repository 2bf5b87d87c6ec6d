"""hutchd's listening sockets give every connection TCP_NODELAY.

Without it each HTTP response (uvicorn sends its head and body apart) waited for the
client's delayed ACK: 40 ms per request, half of an exec round trip under TCG. The
check is on the option itself, on a connection accepted the way uvicorn accepts them
(``loop.create_server(sock=...)``), not on a timing.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from hutch.daemon import listen_socket


async def _accepted_nodelay(host: str) -> int:
    """TCP_NODELAY of the server side of one connection to ``listen_socket(host, 0)``."""
    sock = listen_socket(host, 0, "test")
    seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = writer.get_extra_info("socket")
        seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(handle, sock=sock)
    try:
        port = sock.getsockname()[1]
        _reader, writer = await asyncio.open_connection(host, port)
        try:
            return await asyncio.wait_for(seen, 30)
        finally:
            writer.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_accepted_connections_have_nagle_off() -> None:
    assert await _accepted_nodelay("127.0.0.1") != 0


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


async def test_ipv6_connections_have_nagle_off_too() -> None:
    if not _has_ipv6_loopback():
        pytest.fail("this host has no ::1; the IPv6 listener cannot be checked")
    assert await _accepted_nodelay("::1") != 0


def test_a_port_in_use_names_the_setting() -> None:
    taken = listen_socket("127.0.0.1", 0, "HUTCH_LISTEN")
    try:
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"127.0.0.1:{port} \\(HUTCH_LISTEN\\)"):
            listen_socket("127.0.0.1", port, "HUTCH_LISTEN")
    finally:
        taken.close()
