"""The manager's memory of learned names (hutch.net.learned): a rule change carries over
exactly what the new rules still allow."""

from __future__ import annotations

from ipaddress import IPv4Address

from hutch.net.learned import LearnedNames
from hutch.net.nft_sandbox import KEEP_S, LearnedAddress
from hutch.net.rules import parse_policy

WEB, CDN = IPv4Address("198.18.0.10"), IPv4Address("198.18.0.20")


def test_names_still_allowed_come_back_with_their_time_left() -> None:
    memory = LearnedNames()
    memory.record("good.test", [WEB], ttl=60, now=1000.0)
    memory.record("cdn.test", [CDN], ttl=30, now=1000.0)
    kept = memory.carry_over(parse_policy(["good.test", "*.other.test"]), now=1010.0)
    assert kept == [LearnedAddress(WEB, None, 50, KEEP_S - 10)]
    # The new rules' ports, not the old ones'.
    ports = memory.carry_over(parse_policy(["good.test:443", "good.test:80"]), now=1010.0)
    assert [(k.address, k.port) for k in ports] == [(WEB, 80), (WEB, 443)]


def test_past_the_ttl_only_open_flows_are_kept_and_past_keep_nothing() -> None:
    memory = LearnedNames()
    memory.record("good.test", [WEB], ttl=30, now=0.0)
    [late] = memory.carry_over(parse_policy(["good.test"]), now=100.0)
    assert (late.ttl, late.keep) == (None, KEEP_S - 100)
    assert memory.carry_over(parse_policy(["good.test"]), now=KEEP_S + 1.0) == []
    assert len(memory) == 0  # forgotten for good


def test_open_deny_all_and_forbidden_carry_nothing() -> None:
    memory = LearnedNames()
    memory.record("good.test", [WEB, CDN], ttl=60, now=0.0)
    assert memory.carry_over(parse_policy([]), now=1.0) == []
    assert memory.carry_over(parse_policy(["deny-all"]), now=1.0) == []
    kept = memory.carry_over(parse_policy(["good.test"]), 1.0, lambda a: a == CDN or None)
    assert [k.address for k in kept] == [WEB]
    assert len(memory) == 1  # the address that became forbidden is dropped


def test_memory_is_bounded_oldest_first_and_relearning_refreshes() -> None:
    memory = LearnedNames(limit=2)
    memory.record("a.test", [WEB], 60, now=0.0)
    memory.record("b.test", [WEB], 60, now=1.0)
    memory.record("a.test", [WEB], 60, now=2.0)  # newest again
    memory.record("c.test", [WEB], 60, now=3.0)  # b.test goes
    names = {k.address for k in memory.carry_over(parse_policy(["a.test", "c.test"]), 4.0)}
    assert names == {WEB} and len(memory) == 2
    assert memory.carry_over(parse_policy(["b.test"]), 4.0) == []
