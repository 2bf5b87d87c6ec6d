"""The agent's rtnetlink messages (``hutch_agent.rtnl``), byte for byte: the requests are
the ones ``ip`` sends for the same commands (read with ``strace -e sendmsg ip ...``).
The real kernel answers them in ``tests/privileged/test_agent_netconfig.py``."""

from __future__ import annotations

import errno
import socket
import struct
import sys
from ipaddress import IPv4Address, IPv4Interface
from pathlib import Path

import pytest

AGENT_DIR = str(Path(__file__).resolve().parents[2] / "guest_agent")
if AGENT_DIR not in sys.path:
    sys.path.insert(0, AGENT_DIR)

from hutch_agent import rtnl  # noqa: E402


def test_attr_is_padded_to_four_bytes() -> None:
    assert rtnl.attr(3, b"eth0\0") == bytes.fromhex("0900 0300") + b"eth0\0" + b"\0\0\0"
    assert rtnl.attr(1, b"\x0a\x09\x00\x02") == bytes.fromhex("0800 0100 0a090002")


def test_attrs_round_trip_and_overrun_is_refused() -> None:
    data = rtnl.attr(3, b"eth0\0") + rtnl.attr(4, struct.pack("=I", 7))
    assert rtnl.parse_attrs(data) == {3: b"eth0\0", 4: struct.pack("=I", 7)}
    with pytest.raises(ValueError, match="overruns"):
        rtnl.parse_attrs(data[:-1])


def test_link_bodies_change_only_what_is_asked() -> None:
    # ifinfomsg: family, pad, type, index, flags, change (ip link set eth0 up / down)
    assert rtnl.link_body(3, up=True) == struct.pack("=BxHiII", 0, 0, 3, 1, 1)
    assert rtnl.link_body(3, up=False) == struct.pack("=BxHiII", 0, 0, 3, 0, 1)
    # ip link set eth0 address ...: no flag changed, IFLA_ADDRESS with the 6 bytes
    assert rtnl.link_body(3, mac="02:00:0a:00:00:07") == struct.pack(
        "=BxHiII", 0, 0, 3, 0, 0
    ) + bytes.fromhex("0a00 0100 02000a000007 0000")


def test_addr_body_is_what_ip_addr_add_sends() -> None:
    body = rtnl.addr_body(3, IPv4Interface("10.9.0.2/24"))
    # ifaddrmsg AF_INET /24 flags 0 scope universe index 3; IFA_LOCAL; IFA_ADDRESS
    assert body == bytes.fromhex("02180000 03000000 0800 0200 0a090002 0800 0100 0a090002")


def test_default_route_body_is_what_ip_route_replace_sends() -> None:
    body = rtnl.default_route_body(3, IPv4Address("10.9.0.1"))
    # rtmsg AF_INET dst/0 main table, proto boot, scope universe, unicast; gateway; oif
    assert body == bytes.fromhex("02000000 fe030001 00000000 0800 0500 0a090001 0800 0400 03000000")


def test_messages_of_one_datagram_are_split_and_overrun_is_refused() -> None:
    first = rtnl.message(rtnl.RTM_NEWADDR, rtnl.NLM_F_MULTI, 7, b"abcde")
    second = rtnl.message(rtnl.NLMSG_DONE, rtnl.NLM_F_MULTI, 7, b"\0\0\0\0")
    data = first + b"\0\0\0" + second  # each message starts 4-aligned
    assert [(r.kind, r.seq, r.body) for r in rtnl.parse_messages(data)] == [
        (rtnl.RTM_NEWADDR, 7, b"abcde"),
        (rtnl.NLMSG_DONE, 7, b"\0\0\0\0"),
    ]
    with pytest.raises(ValueError, match="overruns"):
        list(rtnl.parse_messages(first[:-1]))


def test_ack_errno_reads_acks_and_refusals() -> None:
    request = rtnl.message(rtnl.RTM_NEWADDR, 0, 1, b"")
    assert rtnl.ack_errno(struct.pack("=i", 0) + request) == 0
    assert rtnl.ack_errno(struct.pack("=i", -errno.EEXIST) + request) == errno.EEXIST
    with pytest.raises(ValueError, match="shorter"):
        rtnl.ack_errno(b"\0\0")


def test_error_names_the_operation_and_errno() -> None:
    exc = rtnl.NetlinkError("add address 10.9.0.2/24 to eth0", errno.EEXIST)
    assert exc.errno == errno.EEXIST and isinstance(exc, OSError)
    assert str(exc) == "[Errno 17] add address 10.9.0.2/24 to eth0: File exists"


def _route(family: int = socket.AF_INET, table: int = 254, flags: int = 0, oif: int = 3,
           table_attr: int | None = None) -> bytes:  # fmt: skip
    body = struct.pack("=BBBBBBBBI", family, 24, 0, 0, table, 2, 253, 1, flags)
    if table_attr is not None:
        body += rtnl.attr(rtnl.RTA_TABLE, struct.pack("=I", table_attr))
    return body + rtnl.attr(rtnl.RTA_OIF, struct.pack("=I", oif))


def test_route_flush_takes_main_table_ipv4_routes_of_the_nic_only() -> None:
    assert rtnl.route_to_flush(_route(), 3)
    assert rtnl.route_to_flush(_route(table=252, table_attr=254), 3)  # RTA_TABLE wins
    assert not rtnl.route_to_flush(_route(oif=4), 3)
    assert not rtnl.route_to_flush(_route(table=255), 3)  # local table: the kernel's own
    assert not rtnl.route_to_flush(_route(table=254, table_attr=1000), 3)
    assert not rtnl.route_to_flush(_route(family=socket.AF_INET6), 3)
    assert not rtnl.route_to_flush(_route(flags=rtnl.RTM_F_CLONED), 3)


def test_addr_flush_takes_every_address_of_the_nic() -> None:
    assert rtnl.addr_on_link(struct.pack("=BBBBI", socket.AF_INET, 24, 0, 0, 3), 3)
    assert rtnl.addr_on_link(struct.pack("=BBBBI", socket.AF_INET6, 64, 0, 253, 3), 3)
    assert not rtnl.addr_on_link(struct.pack("=BBBBI", socket.AF_INET, 24, 0, 0, 4), 3)
