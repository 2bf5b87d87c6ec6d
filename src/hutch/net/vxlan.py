"""Creating the overlay's VXLAN device over rtnetlink, with the kernel's *local bypass*
turned off (``IFLA_VXLAN_LOCALBYPASS = 0``; Linux >= 6.6).

Why our own netlink call: with the bypass on (the kernel's default), a packet whose
tunnel destination is an address of this machine is handed straight to the VXLAN
device listening on that port, skipping the UDP path and keeping its route, so on a
one-machine cluster (every worker's end on 127.0.0.1) it went back into the sender's
device until its TTL ran out (measured: 63 passes, then "No route to host"). With the
bypass off the packet is encapsulated and received like one from another machine.
Debian 12's iproute2 (6.1) cannot set ``nolocalbypass``, so the device is created here
with one ``RTM_NEWLINK`` (stdlib ``socket.AF_NETLINK``) and read back with
``RTM_GETLINK``: a kernel that does not know the attribute ignores it silently, and
only the read-back tells (:func:`create_vxlan` returns whether the bypass is off).

Message layout (``linux/netlink.h``, ``linux/rtnetlink.h``, ``linux/if_link.h``):
``nlmsghdr`` + ``ifinfomsg`` + attributes; the VXLAN settings are nested in
``IFLA_LINKINFO`` / ``IFLA_INFO_DATA``. Pure encoders/decoders plus one blocking
round trip per message (a few microseconds; run it off the event loop if that matters).
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Iterator
from ipaddress import IPv4Address

from hutch.errors import NetworkError

__all__ = ["create_vxlan", "encode_newlink", "localbypass_of", "parse_attrs"]

# linux/netlink.h
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_EXCL, _NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_NLA_F_NESTED = 0x8000
_NLA_TYPE_MASK = 0x3FFF
# linux/rtnetlink.h
_RTM_NEWLINK, _RTM_GETLINK = 16, 18
# linux/if_link.h
_IFLA_ADDRESS, _IFLA_IFNAME, _IFLA_LINKINFO = 1, 3, 18
_IFLA_INFO_KIND, _IFLA_INFO_DATA = 1, 2
_VXLAN_ID, _VXLAN_LOCAL, _VXLAN_LEARNING, _VXLAN_PORT = 1, 4, 7, 15
_VXLAN_LOCALBYPASS = 31

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_IFINFOMSG = struct.Struct("=BxHiII")  # family, type, index, flags, change
_NLATTR = struct.Struct("=HH")  # len, type


def _attr(kind: int, data: bytes) -> bytes:
    size = _NLATTR.size + len(data)
    return _NLATTR.pack(size, kind) + data + b"\0" * (-size % 4)


def _message(kind: int, flags: int, body: bytes, seq: int) -> bytes:
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), kind, flags, seq, 0) + body


def encode_newlink(
    name: str, *, mac: str, vni: int, local: IPv4Address, port: int, seq: int = 1
) -> bytes:
    """``ip link add NAME address MAC type vxlan id VNI local LOCAL dstport PORT
    nolearning nolocalbypass`` as one RTM_NEWLINK (create, fail if it exists, ack)."""
    data = (
        _attr(_VXLAN_ID, struct.pack("=I", vni))
        + _attr(_VXLAN_LOCAL, local.packed)
        + _attr(_VXLAN_PORT, struct.pack("!H", port))  # network byte order
        + _attr(_VXLAN_LEARNING, b"\0")
        + _attr(_VXLAN_LOCALBYPASS, b"\0")
    )
    info = _attr(_IFLA_INFO_KIND, b"vxlan") + _attr(_IFLA_INFO_DATA | _NLA_F_NESTED, data)
    body = (
        _IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        + _attr(_IFLA_IFNAME, name.encode() + b"\0")
        + _attr(_IFLA_ADDRESS, bytes.fromhex(mac.replace(":", "")))
        + _attr(_IFLA_LINKINFO | _NLA_F_NESTED, info)
    )
    flags = _NLM_F_REQUEST | _NLM_F_ACK | _NLM_F_CREATE | _NLM_F_EXCL
    return _message(_RTM_NEWLINK, flags, body, seq)


def parse_attrs(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(type without the nested/byte-order flags, payload) of each attribute."""
    at = 0
    while at + _NLATTR.size <= len(data):
        size, kind = _NLATTR.unpack_from(data, at)
        if size < _NLATTR.size:
            return
        yield kind & _NLA_TYPE_MASK, data[at + _NLATTR.size : at + size]
        at += size + (-size % 4)


def localbypass_of(link_attrs: bytes) -> int | None:
    """IFLA_VXLAN_LOCALBYPASS of a link's attributes (what follows its ifinfomsg), or
    None when the kernel does not report it (older than 6.6: the bypass is always on)."""
    for kind, value in parse_attrs(link_attrs):
        if kind != _IFLA_LINKINFO:
            continue
        for inner, payload in parse_attrs(value):
            if inner != _IFLA_INFO_DATA:
                continue
            for vx, setting in parse_attrs(payload):
                if vx == _VXLAN_LOCALBYPASS and setting:
                    return setting[0]
    return None


def _replies(sock: socket.socket, seq: int) -> Iterator[tuple[int, bytes]]:
    """(type, payload) of the kernel's messages answering ``seq``, until an ack/error."""
    while True:
        data = sock.recv(65536)
        at = 0
        while at + _NLMSGHDR.size <= len(data):
            size, kind, _, got, _ = _NLMSGHDR.unpack_from(data, at)
            if size < _NLMSGHDR.size:
                return
            if got == seq:
                yield kind, data[at + _NLMSGHDR.size : at + size]
                if kind in (_NLMSG_ERROR, _NLMSG_DONE):
                    return
            at += size + (-size % 4)


def _check(kind: int, payload: bytes, what: str) -> None:
    if kind == _NLMSG_ERROR:
        (code,) = struct.unpack_from("=i", payload)
        if code:
            raise NetworkError(f"{what} failed: {os.strerror(-code)} (errno {-code})")


def create_vxlan(name: str, *, mac: str, vni: int, local: IPv4Address, port: int) -> bool:
    """Create the device (down; the caller sets it up). Returns True when the kernel
    turned the local bypass off, False when it kept it on (it does not know the
    attribute). Raises NetworkError with the kernel's reason (e.g. the device exists,
    the port is taken, no CAP_NET_ADMIN)."""
    what = f"creating VXLAN device {name} (local {local}, port {port}) over rtnetlink"
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
    except OSError as exc:
        raise NetworkError(f"{what}: no netlink socket ({exc})") from exc
    with sock:
        try:
            sock.settimeout(5.0)
            sock.send(encode_newlink(name, mac=mac, vni=vni, local=local, port=port, seq=1))
            for kind, payload in _replies(sock, 1):
                _check(kind, payload, what)
            query = _IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0) + _attr(
                _IFLA_IFNAME, name.encode() + b"\0"
            )
            sock.send(_message(_RTM_GETLINK, _NLM_F_REQUEST, query, 2))
            for kind, payload in _replies(sock, 2):
                _check(kind, payload, f"reading back {name}")
                if kind == _RTM_NEWLINK:
                    return localbypass_of(payload[_IFINFOMSG.size :]) == 0
        except OSError as exc:
            code = exc.errno or errno.EIO
            raise NetworkError(f"{what} failed: {os.strerror(code)}") from exc
    raise NetworkError(f"reading back {name}: the kernel sent no link")
