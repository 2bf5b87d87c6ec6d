"""Which addresses a name may lead to (hutch.net.destinations): the check the resolver
and the proxy share, and the filtering of one DNS answer."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Network

import pytest

from hutch.net.destinations import (
    Forbidden,
    classify_destination,
    filter_answer,
    opened_by_ip_rule,
)
from hutch.net.rules import parse_policy

POOL = IPv4Network("10.213.0.0/16")
HOST = IPv4Address("203.0.113.9")


def check(addr: IPv4Address) -> Forbidden | None:
    return classify_destination(addr, POOL, lambda a: a == HOST)


@pytest.mark.parametrize(
    ("addr", "kind", "why"),
    [
        ("127.0.0.1", "always", "loopback"),
        ("127.9.9.9", "always", "loopback"),
        ("169.254.169.254", "always", "link-local"),
        ("0.0.0.0", "always", "unspecified"),
        ("0.1.2.3", "always", "unspecified"),
        ("224.0.0.1", "always", "multicast"),
        ("255.255.255.255", "always", "broadcast"),
        ("10.213.0.6", "always", "a sandbox address"),
        ("203.0.113.9", "always", "the host's own address"),
        ("10.1.2.3", "private", "10.0.0.0/8"),
        ("172.16.0.1", "private", "172.16.0.0/12"),
        ("172.31.255.255", "private", "172.16.0.0/12"),
        ("192.168.1.1", "private", "192.168.0.0/16"),
        ("100.64.0.1", "private", "100.64.0.0/10"),
        ("100.127.255.1", "private", "100.64.0.0/10"),
        ("240.0.0.1", "private", "240.0.0.0/4"),
        ("::1", "always", "IPv6"),
        ("::ffff:10.1.2.3", "private", "10.0.0.0/8"),
    ],
)
def test_forbidden_destinations(addr: str, kind: str, why: str) -> None:
    verdict = classify_destination(addr, POOL, lambda a: a == HOST)
    assert verdict is not None and verdict.kind == kind and why in verdict.why


@pytest.mark.parametrize("addr", ["198.18.0.10", "8.8.8.8", "172.32.0.1", "100.128.0.1"])
def test_public_destinations(addr: str) -> None:
    assert check(IPv4Address(addr)) is None


def test_the_host_is_asked_only_for_public_looking_addresses_in_order() -> None:
    asked: list[IPv4Address] = []

    def is_host(a: IPv4Address) -> bool:
        asked.append(a)
        return False

    classify_destination("127.0.0.1", POOL, is_host)
    classify_destination("198.18.0.10", POOL, is_host)
    assert asked == [IPv4Address("198.18.0.10")]


def test_opened_by_ip_rule() -> None:
    policy = parse_policy(["good.test", "10.1.0.0/16", "192.168.1.1:5432"])
    assert opened_by_ip_rule(policy, IPv4Address("10.1.2.3"))
    assert opened_by_ip_rule(policy, IPv4Address("192.168.1.1"))
    assert opened_by_ip_rule(policy, IPv4Address("192.168.1.1"), 5432)
    assert not opened_by_ip_rule(policy, IPv4Address("192.168.1.1"), 80)
    assert not opened_by_ip_rule(policy, IPv4Address("10.2.0.1"))
    assert not opened_by_ip_rule(parse_policy([]), IPv4Address("10.1.2.3"))


def A(text: str, ttl: int = 60) -> tuple[IPv4Address, int]:
    return IPv4Address(text), ttl


def test_filter_answer_sorts_out_one_answer() -> None:
    policy = parse_policy(["*.good.test", "10.1.2.0/24:5432"])
    answer = [A("198.18.0.10"), A("10.1.2.3"), A("10.9.9.9"), A("127.0.0.1"), A("203.0.113.9")]
    result = filter_answer(answer, policy, check)
    assert result.answer == [A("198.18.0.10"), A("10.1.2.3")]
    assert result.learn == [A("198.18.0.10")]  # the ip rule opens 10.1.2.3, not the name
    assert [str(a) for a, _ in result.refused] == ["10.9.9.9", "127.0.0.1", "203.0.113.9"]
    text = result.refusal()
    assert "10.9.9.9 (private range 10.0.0.0/8: a name never opens a private" in text
    assert "127.0.0.1 (loopback: no rule opens it)" in text
    assert "203.0.113.9 (the host's own address" in text


def test_filter_answer_never_opens_always_denied_even_under_a_cidr_rule() -> None:
    policy = parse_policy(["x.test", "127.0.0.0/8", "10.213.0.0/16"])
    result = filter_answer([A("127.0.0.1"), A("10.213.0.6")], policy, check)
    assert result.answer == [] and result.learn == [] and len(result.refused) == 2


def test_filter_answer_empty_and_open_mode() -> None:
    assert filter_answer([], parse_policy(["x.test"]), check).refusal() == ""
    # Open mode has no ip rules: a private answer is refused (the resolver forwards
    # open-mode queries untouched, so this only matters to the proxy).
    assert filter_answer([A("10.1.2.3")], parse_policy([]), check).answer == []
