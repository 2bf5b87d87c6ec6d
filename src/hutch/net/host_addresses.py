"""Is an address the host itself? Asked of the kernel when it matters, not remembered.

The host's addresses change while hutchd runs (a new bridge, a VPN, a DHCP lease), so a
list read at start goes stale. Two mechanisms keep "the host" current:

- :func:`is_host_address` asks the kernel's routing table (``RTM_GETROUTE``, what
  ``ip route get ADDR`` does) each time the resolver or the proxy checks an answer: a
  route of type ``local``, ``broadcast``, ``anycast`` or ``multicast`` means a packet
  to it would stay on this host. A failed lookup counts as "the host" (fail closed).
  Each thread keeps one netlink socket for its lookups (two syscalls a question instead
  of five: socket, bind, send, recv, close); nothing is cached, every question is
  answered by the kernel's table as it is at that moment.
- :class:`HostAddressWatcher` listens to the kernel's IPv4 address events
  (``RTMGRP_IPV4_IFADDR``) and, after any of them, re-reads the addresses and hands the
  new set to a callback (the enforcer rewrites nft's ``host_addrs`` set with it).

Wire format (linux/rtnetlink.h): nlmsghdr (host order), rtmsg (family, dst_len, src_len,
tos, table, protocol, scope, type, flags u32), attributes (u16 len, u16 type, 4-aligned).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import struct
import threading
from collections.abc import Awaitable, Callable
from ipaddress import IPv4Address

from hutch.errors import HutchError, NetworkError

__all__ = [
    "HostAddressWatcher",
    "NoRoute",
    "is_host_address",
    "parse_route_reply",
    "route_request",
]

log = logging.getLogger(__name__)

RTM_NEWROUTE = 24
RTM_GETROUTE = 26
NLMSG_ERROR = 2
NLM_F_REQUEST = 0x1
RTA_DST = 1
RTMGRP_IPV4_IFADDR = 0x10
# Route types (linux/rtnetlink.h) whose packets are delivered to this host.
RTN_LOCAL, RTN_BROADCAST, RTN_ANYCAST, RTN_MULTICAST = 2, 3, 4, 5
_HOST_TYPES = frozenset({RTN_LOCAL, RTN_BROADCAST, RTN_ANYCAST, RTN_MULTICAST})

_NLMSGHDR = struct.Struct("=IHHII")
_RTMSG = struct.Struct("=BBBBBBBBI")
# A re-read that fails (ip missing, nft refusing) is tried again after this long.
RETRY_S = 2.0


def route_request(addr: IPv4Address, seq: int = 1) -> bytes:
    """The RTM_GETROUTE message asking how the kernel would route to ``addr``."""
    attr = struct.pack("=HH", 8, RTA_DST) + addr.packed
    body = _RTMSG.pack(socket.AF_INET, 32, 0, 0, 0, 0, 0, 0, 0) + attr
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), RTM_GETROUTE, NLM_F_REQUEST, seq, 0) + body


class NoRoute(NetworkError):
    """The kernel has no route to the address (ENETUNREACH, EHOSTUNREACH): not the host."""


def parse_route_reply(data: bytes, seq: int = 1) -> int:
    """The route type (``RTN_*``) in the kernel's answer to :func:`route_request`.

    Raises ``NoRoute`` when there is no route, ``NetworkError`` for any other error
    answer or one that does not parse."""
    found = _find_reply(data, seq)
    if found is None:
        raise NetworkError("route lookup: no answer from the kernel")
    return found


def _find_reply(data: bytes, seq: int) -> int | None:
    """The route type answering ``seq`` in ``data``; None when no message of ``data``
    answers it (a late answer to an earlier question on a kept socket). Raises as
    :func:`parse_route_reply`."""
    offset = 0
    while offset + _NLMSGHDR.size <= len(data):
        length, kind, _flags, got_seq, _pid = _NLMSGHDR.unpack_from(data, offset)
        if length < _NLMSGHDR.size:
            break
        payload = data[offset + _NLMSGHDR.size : offset + length]
        if got_seq == seq:
            if kind == NLMSG_ERROR and len(payload) >= 4:
                code = -struct.unpack_from("=i", payload, 0)[0]
                name = errno.errorcode.get(code, str(code))
                if code in (errno.ENETUNREACH, errno.EHOSTUNREACH):
                    raise NoRoute(f"no route: {name}")
                raise NetworkError(f"route lookup failed: {name}")
            if kind == RTM_NEWROUTE and len(payload) >= _RTMSG.size:
                return int(_RTMSG.unpack_from(payload, 0)[7])
            raise NetworkError(f"route lookup: unexpected answer (type {kind})")
        offset += (length + 3) & ~3
    return None


class _RouteSocket:
    """One thread's kept netlink socket for route lookups. Each question carries a new
    sequence number and only the answer with that number counts, so an answer left over
    from a question that timed out is skipped, never taken for the next one's. A socket
    that failed is closed and a new one opened at the next question. The kernel answers
    in the namespace the socket was opened in: the thread's when it first asked (hutch
    does not move threads between namespaces)."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._pid = 0
        self._seq = 0

    def ask(self, addr: IPv4Address) -> int:
        if self._sock is None or self._pid != os.getpid():  # a fork's child opens its own
            self._sock = None
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
            try:
                # The kernel answers within send(); the timeout only guards against a bug.
                sock.settimeout(1.0)
                sock.bind((0, 0))
            except OSError:
                sock.close()
                raise
            self._sock, self._pid = sock, os.getpid()
        self._seq = self._seq % 0xFFFFFFFF + 1
        seq = self._seq
        try:
            self._sock.send(route_request(addr, seq))
            while True:
                found = _find_reply(self._sock.recv(65536), seq)
                if found is not None:
                    return found
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __del__(self) -> None:  # the thread ended: its socket goes with it
        self.close()


class _PerThread(threading.local):
    route: _RouteSocket | None = None


_local = _PerThread()


def route_type(addr: IPv4Address) -> int:
    """The kernel's route type for ``addr``, asked now over this thread's kept netlink
    socket. Raises ``NetworkError``."""
    route = _local.route
    if route is None:
        route = _local.route = _RouteSocket()
    try:
        return route.ask(addr)
    except OSError as exc:
        raise NetworkError(f"route lookup for {addr} failed: {exc}") from exc


def is_host_address(addr: IPv4Address) -> bool:
    """True when a packet to ``addr`` would be delivered to this host (its own address,
    a local broadcast or multicast). An unroutable address is not the host; a lookup
    that fails for any other reason counts as the host (fail closed)."""
    try:
        return route_type(addr) in _HOST_TYPES
    except NoRoute:
        return False
    except NetworkError as exc:
        log.warning("cannot tell whether %s is the host; treating it as the host: %s", addr, exc)
        return True


ReadAddresses = Callable[[], Awaitable[frozenset[IPv4Address]]]
OnChange = Callable[[frozenset[IPv4Address]], Awaitable[None]]


class HostAddressWatcher:
    """Calls ``on_change(addresses)`` whenever the host's IPv4 addresses change.

    ``start()`` subscribes to the kernel's address events *before* reading the current
    set (so a change in between is not missed) and returns that set. After each burst of
    events the set is read again with ``read`` and ``on_change`` is awaited when it
    differs; a failing read or callback is retried every :data:`RETRY_S` seconds until
    it succeeds. ``close()`` is idempotent.
    """

    def __init__(self, read: ReadAddresses, on_change: OnChange) -> None:
        self._read = read
        self._on_change = on_change
        self._sock: socket.socket | None = None
        self._dirty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.current: frozenset[IPv4Address] = frozenset()

    async def start(self) -> frozenset[IPv4Address]:
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        except OSError as exc:
            raise NetworkError(f"cannot open a route netlink socket: {exc}") from exc
        try:
            sock.bind((0, RTMGRP_IPV4_IFADDR))
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise NetworkError(f"cannot subscribe to address events: {exc}") from exc
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._drain)
        self.current = await self._read()
        self._task = asyncio.create_task(self._run(), name="hutch-host-addresses")
        return self.current

    def _drain(self) -> None:
        """Empty the socket; any message (or an overrun) means "read the set again"."""
        assert self._sock is not None
        while True:
            try:
                if not self._sock.recv(65536):
                    break
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:  # ENOBUFS: events were lost; re-read anyway
                    log.warning("reading address events failed: %s", exc)
                    break
        self._dirty.set()

    async def _run(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                fresh = await self._read()
                if fresh != self.current:
                    added, gone = sorted(fresh - self.current), sorted(self.current - fresh)
                    log.info("host addresses changed: +%s -%s", added, gone)
                    await self._on_change(fresh)
                    self.current = fresh
            except (HutchError, OSError) as exc:
                log.warning("updating the host's addresses failed (retrying): %s", exc)
                await asyncio.sleep(RETRY_S)
                self._dirty.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sock is not None:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
