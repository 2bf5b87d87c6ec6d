"""From an egress log to a policy (suggest) and a policy against a log (dry run)."""

from __future__ import annotations

from hutch.contract.egress_policy_parse import parse_policy_document
from hutch.contract.egress_suggest import dry_run, list_as_policy, suggest_policy
from hutch.contract.views import EgressEvent


def ev(
    name: str,
    port: int,
    protocol: str,
    method: str | None = None,
    path: str | None = None,
    verdict: str = "allow",
) -> EgressEvent:
    return EgressEvent(
        1.0, "sb-1", "198.18.0.10", port, protocol, name, verdict,  # type: ignore[arg-type]
        None, "learn: would be denied", method, path,
    )  # fmt: skip


LOG = [
    ev("api.test", 443, "https", "GET", "/docs/a"),
    ev("api.test", 443, "https", "HEAD", "/docs/a"),
    ev("api.test", 443, "https", "POST", "/v1/chat"),
    ev("Pypi.test.", 443, "tls"),  # TLS passed through: the destination alone
    ev("plain.test", 80, "http", "GET", "/x"),
    ev("dns.test", 53, "dns"),  # not proxied: not suggested
    ev("api.test", 443, "https", "GET", "/a/../b"),  # ambiguous: no path rule from it
    ev("bad.test", 443, "https", "GET", "/", verdict="deny"),  # denied: not suggested
]


def test_suggest_allows_exactly_what_was_used() -> None:
    doc = suggest_policy(LOG)
    assert doc == {
        "default": "deny",
        "inspection": "full",
        "dry_run": False,
        "rules": [
            {"action": "allow", "host": "api.test:443"},
            {"action": "allow", "host": "pypi.test:443"},
            {"action": "allow", "host": "plain.test:80", "methods": ["GET"], "path": "/x"},
        ],
    }
    precise = suggest_policy(LOG[:3])
    assert precise["rules"] == [
        {"action": "allow", "host": "api.test:443", "methods": ["GET", "HEAD"], "path": "/docs/a"},
        {"action": "allow", "host": "api.test:443", "methods": ["POST"], "path": "/v1/chat"},
    ]
    policy = parse_policy_document(precise)
    results = dry_run(policy, LOG)
    assert [(r.name, r.method, r.path, r.would) for r in results] == [
        ("api.test", "GET", "/docs/a", "allow"),
        ("api.test", "HEAD", "/docs/a", "allow"),
        ("api.test", "POST", "/v1/chat", "allow"),
        ("Pypi.test.", None, None, "deny"),
        ("plain.test", "GET", "/x", "deny"),
        ("api.test", "GET", "/a/../b", "deny"),
        ("bad.test", "GET", "/", "deny"),
    ]
    assert results[0].rule == "rules[0] allow GET,HEAD api.test:443/docs/a"
    assert results[-1].was == "deny" and "default is deny" in results[-1].why
    assert suggest_policy([])["rules"] == []


def test_a_rule_list_means_the_same_policy() -> None:
    assert list_as_policy([]).default == "allow"
    assert list_as_policy(["deny-all"]).rules == ()
    listed = list_as_policy(["api.test:443"])
    results = dry_run(listed, LOG[:4])
    assert [r.would for r in results] == ["allow", "allow", "allow", "deny"]
