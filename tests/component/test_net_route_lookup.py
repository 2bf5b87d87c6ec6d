"""The kept route-lookup sockets behind "is this the host?" (hutch.net.host_addresses),
against this machine's kernel (no privileges needed to ask a route): every question is
answered by the kernel, a late answer is never taken for the next question's, and each
thread asks over its own socket. tests/privileged follows addresses as they change."""

from __future__ import annotations

import threading
from ipaddress import IPv4Address

from hutch.net import host_addresses
from hutch.net.host_addresses import (
    RTN_LOCAL,
    is_host_address,
    route_request,
    route_type,
)

LOOPBACK = IPv4Address("127.0.0.1")
#: TEST-NET-3, never this host's (the default route, or no route at all).
ELSEWHERE = IPv4Address("203.0.113.9")


def test_repeated_questions_reuse_one_socket_per_thread() -> None:
    assert route_type(LOOPBACK) == RTN_LOCAL
    kept = host_addresses._local.route
    assert kept is not None
    for _ in range(50):
        assert is_host_address(LOOPBACK) is True
        assert is_host_address(ELSEWHERE) is False
    assert host_addresses._local.route is kept

    seen: list[object] = []

    def other_thread() -> None:
        seen.append(is_host_address(LOOPBACK))
        seen.append(host_addresses._local.route)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert seen[0] is True
    assert seen[1] is not None and seen[1] is not kept


def test_a_late_answer_is_not_taken_for_the_next_question() -> None:
    assert route_type(LOOPBACK) == RTN_LOCAL
    kept = host_addresses._local.route
    assert kept is not None and kept._sock is not None
    # An answer nobody waits for any more (as after a question that timed out): the
    # loopback's, left in the socket ahead of the next question's.
    kept._sock.send(route_request(LOOPBACK, seq=kept._seq))
    assert is_host_address(ELSEWHERE) is False
    assert is_host_address(LOOPBACK) is True


def test_a_broken_socket_is_replaced() -> None:
    assert route_type(LOOPBACK) == RTN_LOCAL
    kept = host_addresses._local.route
    assert kept is not None and kept._sock is not None
    kept._sock.close()  # any OSError on it: closed, a fresh one next time
    assert is_host_address(LOOPBACK) is True  # fail closed: "the host" while it failed
    assert route_type(LOOPBACK) == RTN_LOCAL
    assert kept._sock is not None
