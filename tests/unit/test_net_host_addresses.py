"""The route-lookup messages behind "is this the host?" (hutch.net.host_addresses), built
and parsed without a kernel; tests/privileged asks a real one."""

from __future__ import annotations

import errno
import socket
import struct
from ipaddress import IPv4Address

import pytest

from hutch.errors import NetworkError
from hutch.net.host_addresses import NoRoute, parse_route_reply, route_request


def reply(kind: int, payload: bytes, seq: int = 1) -> bytes:
    return struct.pack("=IHHII", 16 + len(payload), kind, 0, seq, 0) + payload


def rtmsg(route_type: int) -> bytes:
    return struct.pack("=BBBBBBBBI", socket.AF_INET, 32, 0, 0, 255, 2, 254, route_type, 0)


def test_route_request_asks_for_one_ipv4_destination() -> None:
    msg = route_request(IPv4Address("198.18.0.7"), seq=9)
    length, kind, flags, seq, _ = struct.unpack_from("=IHHII", msg)
    assert (length, kind, flags, seq) == (len(msg), 26, 1, 9)
    assert msg[16] == socket.AF_INET and msg[17] == 32
    assert msg[-8:] == struct.pack("=HH", 8, 1) + bytes([198, 18, 0, 7])


def test_route_reply_gives_the_route_type() -> None:
    assert parse_route_reply(reply(24, rtmsg(2) + b"\x08\x00\x01\x00\x7f\x00\x00\x01")) == 2
    # Another message first (other sequence number), then ours.
    two = reply(24, rtmsg(1), seq=5) + reply(24, rtmsg(3))
    assert parse_route_reply(two) == 3


def test_route_reply_errors() -> None:
    unreachable = reply(2, struct.pack("=i", -errno.ENETUNREACH) + b"\0" * 16)
    with pytest.raises(NoRoute):
        parse_route_reply(unreachable)
    other = reply(2, struct.pack("=i", -errno.EINVAL) + b"\0" * 16)
    with pytest.raises(NetworkError, match="EINVAL") as info:
        parse_route_reply(other)
    assert not isinstance(info.value, NoRoute)
    for junk in (b"", b"\x01\x02", reply(24, b"\x02")):
        with pytest.raises(NetworkError):
            parse_route_reply(junk)
