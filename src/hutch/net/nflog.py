"""Read the packets nftables logs with ``log group G`` (NFLOG), over raw netlink.

The ruleset (:mod:`hutch.net.nft`) logs every denial, rate-limited, with the prefix
``h<tag> <sandbox id | -> <reason>``. :class:`NflogReader` binds one NFLOG group on an
``AF_NETLINK``/``NETLINK_NETFILTER`` socket in the caller's network namespace and yields
:class:`LoggedPacket` objects from the asyncio loop. Only one socket per namespace can
bind a group: a second binder gets ``NetworkError`` (the kernel says EPERM).

Wire format (linux/netfilter/nfnetlink_log.h): nlmsghdr (host order), nfgenmsg (family,
version, res_id big-endian), then attributes (u16 len, u16 type, 4-byte aligned; numeric
payloads big-endian).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address
from types import TracebackType

from hutch.errors import NetworkError

__all__ = ["LoggedPacket", "NflogReader", "parse_packet_message", "split_prefix"]

NETLINK_NETFILTER = 12
NFNL_SUBSYS_ULOG = 4
NFULNL_MSG_PACKET = 0
NFULNL_MSG_CONFIG = 1
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLA_TYPE_MASK = 0x3FFF

NFULA_CFG_CMD = 1
NFULA_CFG_MODE = 2
NFULA_CFG_NLBUFSIZ = 3
NFULA_CFG_TIMEOUT = 4
NFULA_CFG_QTHRESH = 5
NFULNL_CFG_CMD_BIND = 1
NFULNL_CFG_CMD_UNBIND = 2
NFULNL_COPY_PACKET = 2

NFULA_PACKET_HDR = 1
NFULA_TIMESTAMP = 3
NFULA_IFINDEX_INDEV = 4
NFULA_PAYLOAD = 9
NFULA_PREFIX = 10

_NLMSGHDR = struct.Struct("=IHHII")
_NFGENMSG = struct.Struct("!BBH")
_PROTOCOLS = {1: "icmp", 6: "tcp", 17: "udp", 58: "icmpv6", 132: "sctp"}
# Enough of each packet for an IPv6 header plus ports; the rest is not needed.
_COPY_RANGE = 96


@dataclass(frozen=True)
class LoggedPacket:
    """One logged packet. ``src``/``dst``/ports are None when the payload is not IP or
    the protocol has no ports; ``indev`` is None when the interface is already gone."""

    prefix: str
    src: IPv4Address | IPv6Address | None
    dst: IPv4Address | IPv6Address | None
    protocol: str  # "tcp", "udp", "icmp", ... or the protocol number
    sport: int | None
    dport: int | None
    indev: str | None
    time: float  # UNIX epoch seconds (the kernel's timestamp when present)


def split_prefix(prefix: str) -> tuple[str, str | None, str]:
    """``"h<tag> <sid|-> <reason>"`` -> (``h<tag>``, sandbox id or None, reason)."""
    parts = prefix.strip().split(" ")
    if len(parts) != 3:
        return (parts[0] if parts else "", None, " ".join(parts[1:]))
    tag, sid, reason = parts
    return tag, (None if sid == "-" else sid), reason


def _attrs(data: bytes, offset: int, end: int) -> Iterator[tuple[int, bytes]]:
    while offset + 4 <= end:
        length, kind = struct.unpack_from("=HH", data, offset)
        if length < 4:
            return
        yield kind & NLA_TYPE_MASK, data[offset + 4 : offset + length]
        offset += (length + 3) & ~3


def _attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


_Addr = IPv4Address | IPv6Address | None


def _parse_ip(payload: bytes) -> tuple[_Addr, _Addr, str, int | None, int | None]:
    if not payload:
        return None, None, "", None, None
    version = payload[0] >> 4
    if version == 4 and len(payload) >= 20:
        ihl = (payload[0] & 0x0F) * 4
        proto = payload[9]
        src: IPv4Address | IPv6Address = IPv4Address(payload[12:16])
        dst: IPv4Address | IPv6Address = IPv4Address(payload[16:20])
        fragment_offset = struct.unpack_from("!H", payload, 6)[0] & 0x1FFF
        l4 = ihl if fragment_offset == 0 else -1
    elif version == 6 and len(payload) >= 40:
        proto = payload[6]
        src, dst = ip_address(payload[8:24]), ip_address(payload[24:40])
        l4 = 40  # extension headers are not walked; their ports stay None
    else:
        return None, None, "", None, None
    name = _PROTOCOLS.get(proto, str(proto))
    sport = dport = None
    if proto in (6, 17, 132) and l4 >= 0 and len(payload) >= l4 + 4:
        sport, dport = struct.unpack_from("!HH", payload, l4)
    return src, dst, name, sport, dport


def parse_packet_message(body: bytes) -> LoggedPacket:
    """Parse the part of an NFULNL_MSG_PACKET after nlmsghdr (nfgenmsg + attributes)."""
    prefix, indev, payload, stamp = "", None, b"", None
    for kind, value in _attrs(body, _NFGENMSG.size, len(body)):
        if kind == NFULA_PREFIX:
            prefix = value.split(b"\0", 1)[0].decode(errors="replace")
        elif kind == NFULA_IFINDEX_INDEV and len(value) >= 4:
            index = struct.unpack("!I", value[:4])[0]
            try:
                indev = socket.if_indextoname(index)
            except OSError:
                indev = None
        elif kind == NFULA_PAYLOAD:
            payload = value
        elif kind == NFULA_TIMESTAMP and len(value) >= 16:
            sec, usec = struct.unpack("!QQ", value[:16])
            stamp = sec + usec / 1e6
    src, dst, proto, sport, dport = _parse_ip(payload)
    return LoggedPacket(
        prefix=prefix,
        src=src,
        dst=dst,
        protocol=proto,
        sport=sport,
        dport=dport,
        indev=indev,
        time=stamp if stamp is not None else time.time(),
    )


class NflogReader:
    """Async iterator over the packets logged to NFLOG ``group``.

    Binds at construction (raises ``NetworkError``: not root, group taken, no
    nfnetlink_log). ``dropped`` counts kernel-side overruns (ENOBUFS): the reader keeps
    going, those packets are lost. ``close()`` is idempotent; iteration then stops.
    """

    def __init__(self, group: int) -> None:
        if not 0 <= group < 65536:
            raise NetworkError(f"NFLOG group {group} is not in 0..65535")
        self.group = group
        self.dropped = 0
        self._seq = 0
        self._pending: list[LoggedPacket] = []
        self._closed = False
        self._waiter: tuple[asyncio.AbstractEventLoop, int, Callable[[], None]] | None = None
        try:
            self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        except OSError as exc:
            raise NetworkError(f"cannot open a netfilter netlink socket: {exc}") from exc
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            self._sock.bind((0, 0))
            self._sock.settimeout(2.0)
            self._config(_attr(NFULA_CFG_CMD, bytes([NFULNL_CFG_CMD_BIND])), "bind")
            self._config(
                _attr(NFULA_CFG_MODE, struct.pack("!IBx", _COPY_RANGE, NFULNL_COPY_PACKET))
                # Deliver each packet at once instead of batching up to 100 of them.
                + _attr(NFULA_CFG_QTHRESH, struct.pack("!I", 1))
                + _attr(NFULA_CFG_TIMEOUT, struct.pack("!I", 1)),
                "configure",
            )
            self._sock.setblocking(False)
        except BaseException:
            self._sock.close()
            raise

    def _config(self, attrs: bytes, what: str) -> None:
        self._seq += 1
        body = _NFGENMSG.pack(socket.AF_UNSPEC, 0, self.group) + attrs
        kind = (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG
        header = _NLMSGHDR.pack(
            _NLMSGHDR.size + len(body), kind, NLM_F_REQUEST | NLM_F_ACK, self._seq, 0
        )
        try:
            self._sock.send(header + body)
            while True:
                data = self._sock.recv(65536)
                for kind_, _flags, seq, payload in self._messages(data):
                    if kind_ == NLMSG_ERROR and seq == self._seq:
                        code = -struct.unpack_from("=i", payload, 0)[0]
                        if code:
                            hint = (
                                # The kernel answers EPERM when another socket owns it.
                                "another socket in this network namespace reads this "
                                "group, or this process is not root"
                                if code in (errno.EPERM, errno.EBUSY)
                                else "the kernel refused; is nfnetlink_log available?"
                            )
                            name = errno.errorcode.get(code, str(code))
                            raise NetworkError(
                                f"cannot {what} NFLOG group {self.group}: {name} ({hint})"
                            )
                        return
        except OSError as exc:
            raise NetworkError(f"cannot {what} NFLOG group {self.group}: {exc}") from exc

    @staticmethod
    def _messages(data: bytes) -> Iterator[tuple[int, int, int, bytes]]:
        offset = 0
        while offset + _NLMSGHDR.size <= len(data):
            length, kind, flags, seq, _pid = _NLMSGHDR.unpack_from(data, offset)
            if length < _NLMSGHDR.size:
                return
            yield kind, flags, seq, data[offset + _NLMSGHDR.size : offset + length]
            offset += (length + 3) & ~3

    def __aiter__(self) -> NflogReader:
        return self

    async def __anext__(self) -> LoggedPacket:
        packet_kind = (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            try:
                data = self._sock.recv(65536)
            except BlockingIOError:
                await self._readable()
                continue
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    # The kernel dropped log messages (we were too slow); keep reading.
                    self.dropped += 1
                    continue
                raise NetworkError(f"reading NFLOG group {self.group} failed: {exc}") from exc
            for kind, _flags, _seq, payload in self._messages(data):
                if kind == packet_kind:
                    self._pending.append(parse_packet_message(payload))
        return self._pending.pop(0)

    async def _readable(self) -> None:
        """Wait until the socket has data or close() is called (which wakes us)."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not waiter.done():
                waiter.set_result(None)

        fd = self._sock.fileno()
        loop.add_reader(fd, wake)
        self._waiter = (loop, fd, wake)
        try:
            await waiter
        finally:
            self._waiter = None
            loop.remove_reader(fd)

    def close(self) -> None:
        """Unbind the group and close the socket; a pending iteration stops."""
        if self._closed:
            return
        self._closed = True
        if self._waiter is not None:
            loop, fd, wake = self._waiter
            loop.remove_reader(fd)
            wake()
        with contextlib.suppress(OSError, NetworkError):
            self._sock.setblocking(True)
            self._sock.settimeout(0.5)
            self._config(_attr(NFULA_CFG_CMD, bytes([NFULNL_CFG_CMD_UNBIND])), "unbind")
        self._sock.close()

    async def __aenter__(self) -> NflogReader:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
