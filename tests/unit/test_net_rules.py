"""Egress rule parsing, normalization and matching (pure)."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

import pytest

from hutch.errors import InvalidArgument
from hutch.net import rules
from hutch.net.rules import (
    MAX_RULES,
    EgressPolicy,
    EgressRule,
    normalize_name,
    parse_policy,
    parse_rule,
)


@pytest.mark.parametrize(
    ("text", "kind", "host", "network", "port", "canonical"),
    [
        ("good.test", "host", "good.test", None, None, "good.test"),
        ("Good.TEST.", "host", "good.test", None, None, "good.test"),
        ("good.test:443", "host", "good.test", None, 443, "good.test:443"),
        ("*.good.test", "wildcard", "good.test", None, None, "*.good.test"),
        ("*.Good.Test.:8443", "wildcard", "good.test", None, 8443, "*.good.test:8443"),
        ("Bücher.example", "host", "xn--bcher-kva.example", None, None, "xn--bcher-kva.example"),
        ("XN--BCHER-KVA.example", "host", "xn--bcher-kva.example", None, None,
         "xn--bcher-kva.example"),
        ("localhost", "host", "localhost", None, None, "localhost"),
        ("198.18.0.7", "ip", None, IPv4Network("198.18.0.7/32"), None, "198.18.0.7"),
        ("198.18.0.7:80", "ip", None, IPv4Network("198.18.0.7/32"), 80, "198.18.0.7:80"),
        ("198.18.0.0/24", "cidr", None, IPv4Network("198.18.0.0/24"), None, "198.18.0.0/24"),
        ("198.18.0.0/24:443", "cidr", None, IPv4Network("198.18.0.0/24"), 443,
         "198.18.0.0/24:443"),
        ("2001:db8::1", "ip", None, IPv6Network("2001:db8::1/128"), None, "2001:db8::1"),
        ("2001:DB8:0::1", "ip", None, IPv6Network("2001:db8::1/128"), None, "2001:db8::1"),
        ("[2001:db8::1]:443", "ip", None, IPv6Network("2001:db8::1/128"), 443,
         "[2001:db8::1]:443"),
        ("[2001:db8::1]", "ip", None, IPv6Network("2001:db8::1/128"), None, "2001:db8::1"),
        ("2001:db8::/32", "cidr", None, IPv6Network("2001:db8::/32"), None, "2001:db8::/32"),
        ("[2001:db8::/32]:443", "cidr", None, IPv6Network("2001:db8::/32"), 443,
         "[2001:db8::/32]:443"),
        ("  good.test  ", "host", "good.test", None, None, "good.test"),
    ],
)  # fmt: skip
def test_rule_forms(
    text: str, kind: str, host: str | None, network: object, port: int | None, canonical: str
) -> None:
    rule = parse_rule(text)
    assert (rule.kind, rule.host, rule.network, rule.port) == (kind, host, network, port)
    assert rule.canonical == canonical
    assert parse_rule(canonical).canonical == canonical


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        ("good test", "white space"),
        ("*", "first label"),
        ("*.", "not a valid hostname"),
        ("a.*.test", "first label"),
        ("*good.test", "first label"),
        ("-bad.test", "not a valid hostname"),
        ("bad-.test", "not a valid hostname"),
        ("under_score.test", "not a valid hostname"),
        ("a" * 64 + ".test", "not a valid hostname"),
        (".".join(["a" * 60] * 5), "not a valid hostname"),  # 304 chars
        ("a..test", "not a valid hostname"),
        ("good.test:0", "out of 1-65535"),
        ("good.test:65536", "out of 1-65535"),
        ("good.test:https", "not a number"),
        ("good.test:", "not a number"),
        ("300.1.2.3", "not a valid IPv4"),
        ("1.2.3", "not a valid IPv4"),
        ("198.18.0.1/24", "host bits set (did you mean 198.18.0.0/24?)"),
        ("198.18.0.0/33", "not a valid IPv4"),
        ("2001:db8::1:443:x", "brackets"),
        ("[198.18.0.1]:80", "IPv6 only"),
        ("[2001:db8::1", "closing"),
        ("[2001:db8::1]443", "':port'"),
        ("[nope]:443", "not an IPv6"),
        ("[2001:db8::1/64]:443", "host bits set"),
        ("http://good.test", "without a scheme"),
        ("good.test/path", "not a valid hostname"),
    ],
)
def test_bad_rules_are_rejected_with_the_rule_and_the_accepted_forms(text: str, why: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_rule(text)
    message = str(info.value)
    assert repr(text) in message and why in message
    assert "accepted forms: host, host:port, *.host" in message


def test_policy_modes() -> None:
    assert parse_policy([]) == EgressPolicy("open", ())
    assert parse_policy([]).texts() == []
    assert parse_policy(["deny-all"]).mode == "deny-all"
    assert parse_policy(["DENY-ALL"]).texts() == ["deny-all"]
    assert parse_policy(["good.test"]).mode == "rules"
    with pytest.raises(InvalidArgument, match="must be the only egress rule"):
        parse_policy(["deny-all", "good.test"])


def test_one_bad_rule_rejects_the_whole_list_naming_it() -> None:
    with pytest.raises(InvalidArgument, match=r"'bad_name\.test'"):
        parse_policy(["good.test", "bad_name.test", "198.18.0.0/24"])


def test_limits_and_types() -> None:
    parse_policy([f"h{i}.test" for i in range(MAX_RULES)])
    with pytest.raises(InvalidArgument, match="at most 256"):
        parse_policy([f"h{i}.test" for i in range(MAX_RULES + 1)])
    with pytest.raises(InvalidArgument, match="not a string"):
        parse_policy(["good.test", 443])  # type: ignore[list-item]


def test_canonical_texts_round_trip_and_duplicates_collapse() -> None:
    policy = parse_policy(["Good.Test.", "good.test", "*.a.test:443", "[2001:db8::/32]:443",
                           "198.18.0.0/24", "Bücher.test"])  # fmt: skip
    assert policy.texts() == ["good.test", "*.a.test:443", "[2001:db8::/32]:443",
                              "198.18.0.0/24", "xn--bcher-kva.test"]  # fmt: skip
    assert parse_policy(policy.texts()).texts() == policy.texts()


def test_name_matching_case_dots_punycode_and_ports() -> None:
    policy = parse_policy(["good.test", "api.test:443", "api.test:8443", "Bücher.test"])
    assert policy.match_name("GOOD.test.", 80) is not None
    assert policy.match_name("good.test", None) is not None
    assert policy.match_name("sub.good.test", 443) is None  # host rule: exactly that name
    assert policy.match_name("api.test", 443) is not None
    assert policy.match_name("api.test", 80) is None
    assert policy.match_name("api.test", None) is not None  # DNS: some port is allowed
    assert policy.match_name("bücher.test", 443) is not None
    assert policy.match_name("xn--bcher-kva.TEST.", 443) is not None
    assert policy.match_name("bad_name.test", 443) is None
    assert policy.match_name("", 443) is None
    assert policy.name_ports("good.test") == (None,)
    assert policy.name_ports("API.test") == (443, 8443)
    assert policy.name_ports("evil.test") == ()


def test_wildcard_never_matches_the_apex() -> None:
    policy = parse_policy(["*.good.test"])
    assert policy.match_name("a.good.test", 443) is not None
    assert policy.match_name("a.b.good.test", 443) is not None
    assert policy.match_name("good.test", 443) is None
    assert policy.match_name("evilgood.test", 443) is None
    assert policy.name_allowed_any_port("good.test") is None
    both = parse_policy(["*.good.test", "good.test"])
    rule = both.match_name("good.test", 443)
    assert isinstance(rule, EgressRule) and rule.kind == "host"


def test_ip_matching_and_nft_views() -> None:
    policy = parse_policy(["198.18.0.7", "198.18.1.0/24:443", "2001:db8::/32", "good.test",
                           "[2001:db8::1]:80"])  # fmt: skip
    assert policy.match_ip(IPv4Address("198.18.0.7"), 22) is not None
    assert policy.match_ip(IPv4Address("198.18.1.9"), 443) is not None
    assert policy.match_ip(IPv4Address("198.18.1.9"), 80) is None
    assert policy.match_ip(IPv4Address("198.18.2.1"), None) is None
    assert policy.match_ip(IPv6Address("2001:db8::5"), 443) is not None
    assert policy.ip_networks() == [IPv4Network("198.18.0.7/32")]  # v4 only
    assert policy.ip_port_networks() == [(IPv4Network("198.18.1.0/24"), 443)]
    assert policy.names() == [("good.test", None)]
    assert parse_policy(["*.a.test:443"]).names() == [("*.a.test", 443)]


def test_normalize_name() -> None:
    assert normalize_name("WWW.Example.COM.") == "www.example.com"
    assert normalize_name("bücher.de") == "xn--bcher-kva.de"
    assert normalize_name("BÜCHER.de") == "xn--bcher-kva.de"
    assert normalize_name("a" * 63 + ".test") == "a" * 63 + ".test"
    for bad in ("", ".", "a..b", "a b", "a\\046b", "x" * 300, "_srv.test", "-a.test"):
        assert normalize_name(bad) is None, bad


def test_public_names() -> None:
    for name in rules.__all__:
        assert hasattr(rules, name)
