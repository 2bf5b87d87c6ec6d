"""Ordered egress policies: validation, the evaluator and the address-level lowering
(``hutch.contract.egress_policy``, ``hutch.net.rules.lower_policy``)."""

from __future__ import annotations

import re
from ipaddress import IPv4Network, ip_address
from typing import Any

import pytest

from hutch.contract.egress_policy import (
    HttpRequest,
    OrderedPolicy,
    normalize_request_path,
    parse_template,
)
from hutch.contract.egress_policy_parse import parse_policy_document, require_available
from hutch.errors import InvalidArgument
from hutch.net.rules import EgressPolicy, lower_policy, parse_policy, policy_from_stored


def _policy(
    *rules: dict[str, Any], default: str = "deny", inspection: str = "full"
) -> OrderedPolicy:
    return parse_policy_document(
        {"default": default, "inspection": inspection, "rules": list(rules)}
    )


def _req(name: str, method: str = "GET", target: str = "/", port: int = 443) -> HttpRequest:
    return HttpRequest(name, None, port, method, target)


# ---- the evaluator ---------------------------------------------------------------------

DOCS_ADMIN = (
    {"action": "deny", "host": "api.test", "methods": ["POST"], "path": "/admin"},
    {"action": "allow", "host": "api.test", "methods": ["GET", "HEAD"], "path": "/docs"},
    {"action": "allow", "host": "api.test", "path": "/public/*.json"},
)


def test_first_match_wins_and_the_default_decides_the_rest() -> None:
    p = _policy(*DOCS_ADMIN)
    get_docs = p.decide(_req("api.test", "GET", "/docs/intro?x=1"))
    assert get_docs.allowed and get_docs.rule is not None and get_docs.rule.index == 1
    post_admin = p.decide(_req("api.test", "POST", "/admin"))
    assert not post_admin.allowed and post_admin.rule is not None and post_admin.rule.index == 0
    assert "rules[0] deny POST api.test/admin" in post_admin.why
    # Matches no rule: the default (deny), named as such.
    other = p.decide(_req("api.test", "DELETE", "/docs"))
    assert other.action == "deny" and other.rule is None
    assert "default is deny" in other.why
    assert p.decide(_req("api.test", "GET", "/public/a/b.json")).allowed  # glob: * spans /
    assert not p.decide(_req("api.test", "GET", "/public/a.txt")).allowed
    assert not p.decide(_req("other.test", "GET", "/docs")).allowed


def test_deny_before_allow_wins_and_allow_before_deny_wins() -> None:
    deny_first = _policy(
        {"action": "deny", "host": "api.test", "path": "/docs/secret"},
        {"action": "allow", "host": "api.test", "path": "/docs"},
    )
    assert not deny_first.decide(_req("api.test", target="/docs/secret/x")).allowed
    assert deny_first.decide(_req("api.test", target="/docs/open")).allowed
    allow_first = _policy(
        {"action": "allow", "host": "api.test", "path": "/docs"},
        {"action": "deny", "host": "api.test", "path": "/docs/secret"},
    )
    assert allow_first.decide(_req("api.test", target="/docs/secret/x")).allowed


def test_default_allow_lets_unmatched_requests_through() -> None:
    p = _policy({"action": "deny", "host": "*.evil.test"}, default="allow")
    assert p.decide(_req("ok.test")).allowed
    assert not p.decide(_req("a.evil.test")).allowed
    assert p.decide(_req("evil.test")).allowed  # *.name never matches the apex


def test_path_prefixes_are_whole_segments() -> None:
    p = _policy({"action": "allow", "host": "api.test", "path": "/docs"})
    assert p.decide(_req("api.test", target="/docs")).allowed
    assert p.decide(_req("api.test", target="/docs/")).allowed
    assert p.decide(_req("api.test", target="/docs?q=1")).allowed
    assert not p.decide(_req("api.test", target="/docsearch")).allowed
    below = _policy({"action": "allow", "host": "api.test", "path": "/docs/"})
    assert not below.decide(_req("api.test", target="/docs")).allowed
    assert below.decide(_req("api.test", target="/docs/a")).allowed


@pytest.mark.parametrize(
    "target",
    ["/docs/../admin", "/docs/%2e%2e/admin", "/docs/.%2E/admin", "/docs%2fadmin", "/docs\\x",
     "/docs/%zz", "docs", "/docs/./a"],
)  # fmt: skip
def test_ambiguous_paths_match_no_path_rule(target: str) -> None:
    p = _policy({"action": "allow", "host": "api.test", "path": "/docs"})
    assert normalize_request_path(target) is None
    assert not p.decide(_req("api.test", target=target)).allowed
    # A deny that names no path still matches it (the host decides).
    d = _policy({"action": "deny", "host": "api.test"}, default="allow")
    assert not d.decide(_req("api.test", target=target)).allowed


def test_unreserved_escapes_are_decoded_before_matching() -> None:
    assert normalize_request_path("/%64ocs/%7Ea?x") == "/docs/~a"
    assert normalize_request_path("/a%20b") == "/a%20b"
    p = _policy({"action": "allow", "host": "api.test", "path": "/docs"})
    assert p.decide(_req("api.test", target="/%64ocs/x")).allowed


def test_host_forms_with_ports_and_addresses() -> None:
    p = _policy(
        {"action": "allow", "host": "api.test:443"},
        {"action": "allow", "host": "*.cdn.test"},
        {"action": "allow", "host": "198.18.0.0/24:8080"},
    )
    assert p.decide(_req("API.test.", port=443)).allowed  # names are normalized
    assert not p.decide(_req("api.test", port=80)).allowed
    assert p.decide(_req("x.cdn.test", port=8443)).allowed
    by_addr = HttpRequest(None, ip_address("198.18.0.9"), 8080, "GET", "/")
    assert p.decide(by_addr).allowed
    assert not p.decide(HttpRequest(None, ip_address("198.18.0.9"), 80, "GET", "/")).allowed


def test_transform_allows_and_names_its_secrets() -> None:
    p = _policy(
        {
            "action": "transform",
            "host": "llm.test",
            "set_headers": {"Authorization": "Bearer {secret:openai}", "X-Org": "acme"},
            "remove_headers": ["Cookie"],
        }
    )
    decision = p.decide(_req("llm.test", "POST", "/v1/chat"))
    assert decision.allowed and decision.action == "transform"
    assert p.secrets == ("openai",)
    assert decision.rule is not None
    (name, tpl), _ = decision.rule.set_headers
    assert name == "Authorization" and tpl.render({"openai": "sk-1"}.__getitem__) == "Bearer sk-1"


def test_connection_level_decisions() -> None:
    p = _policy(
        {"action": "deny", "host": "bad.test"},
        {"action": "allow", "host": "api.test", "path": "/docs"},
        {"action": "allow", "host": "*.test:443"},
    )
    assert p.decide_connection("bad.test", None, 443).verdict == "deny"
    inspect = p.decide_connection("api.test", None, 443)
    assert inspect.verdict == "inspect" and inspect.rule is not None and inspect.rule.index == 1
    assert p.decide_connection("x.test", None, 443).verdict == "allow"
    assert p.decide_connection("x.test", None, 22).verdict == "deny"  # the default


# ---- validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "where", "says"),
    [
        ({"default": "maybe"}, "default", "accepted: allow, deny"),
        ({"inspection": "deep"}, "inspection", "accepted: none, partial, full, learn"),
        ({"dry_run": "yes"}, "dry_run", "accepted: true, false"),
        ({"rules": "x"}, "rules", "list of rule objects"),
        ({"mode": "x"}, "mode", "unknown field; accepted: default, inspection"),
        ({"rules": ["good.test"]}, "rules[0]", "not an object with action and host"),
        ({"rules": [{"host": "a.test"}]}, "rules[0].action", "is missing; accepted: allow"),
        ({"rules": [{"action": "permit", "host": "a"}]}, "rules[0].action",
         "accepted: allow, deny, transform"),
        ({"rules": [{"action": "allow"}]}, "rules[0].host", "name, *.name, ip, cidr"),
        ({"rules": [{"action": "allow", "host": "a.test"}, {"action": "allow", "host": "a b"}]},
         "rules[1].host", "white space"),
        ({"rules": [{"action": "allow", "host": "a.test", "methods": ["G3T"]}]},
         "rules[0].methods[0]", "not an HTTP method"),
        ({"rules": [{"action": "allow", "host": "a.test", "methods": []}]},
         "rules[0].methods", "non-empty list"),
        ({"rules": [{"action": "allow", "host": "a.test", "methods": ["CONNECT"]}]},
         "rules[0].methods[0]", "never relayed"),
        ({"rules": [{"action": "allow", "host": "a.test", "path": "docs"}]},
         "rules[0].path", "starts with '/'"),
        ({"rules": [{"action": "allow", "host": "a.test", "path": "/a/../b"}]},
         "rules[0].path", "normal form"),
        ({"rules": [{"action": "allow", "host": "a.test", "verb": "GET"}]},
         "rules[0].verb", "unknown field"),
        ({"rules": [{"action": "allow", "host": "a.test", "set_headers": {"X": "1"}}]},
         "rules[0].set_headers", 'only a "transform" rule'),
        ({"rules": [{"action": "transform", "host": "a.test"}]},
         "rules[0]", "needs set_headers or remove_headers"),
        ({"rules": [{"action": "transform", "host": "10.0.0.1", "remove_headers": ["X"]}]},
         "rules[0].host", "needs a name"),
        ({"rules": [{"action": "allow", "host": "10.0.0.0/8", "path": "/x"}]},
         "rules[0].path", "needs a host name"),
        ({"rules": [{"action": "transform", "host": "a.test", "set_headers": {"Host": "b"}}]},
         "rules[0].set_headers.Host", "belongs to the proxy"),
        ({"rules": [{"action": "transform", "host": "a.test", "set_headers": {"X": "{secret:}"}}]},
         "rules[0].set_headers.X", "does not name a secret"),
        ({"rules": [{"action": "transform", "host": "a.test", "set_headers": {"X": "{a}"}}]},
         "rules[0].set_headers.X", "brace outside"),
        ({"rules": [{"action": "transform", "host": "a.test", "set_headers": {"X": "a\r\nY: b"}}]},
         "rules[0].set_headers.X", "control character"),
        ({"rules": [{"action": "transform", "host": "a.test", "set_headers": {"X": "1"},
                     "remove_headers": ["x"]}]},
         "rules[0].remove_headers", "also in set_headers"),
    ],
)  # fmt: skip
def test_validation_names_the_field_and_what_is_accepted(doc: Any, where: str, says: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        parse_policy_document({"inspection": "full", **doc})
    assert f"egress policy {where}: " in str(err.value)
    assert says in str(err.value)


def test_request_rules_open_only_the_web_ports() -> None:
    """A path rule is enforced where requests are read (80/443 through the proxy): for
    the address level it opens those ports only, so HTTP on another port cannot skip it."""
    p = policy_from_stored(
        {
            "inspection": "full",
            "rules": [
                {"action": "deny", "host": "api.test", "methods": ["POST"], "path": "/admin"},
                {"action": "allow", "host": "api.test", "path": "/docs"},
                {"action": "deny", "host": "*.test:22"},
                {"action": "allow", "host": "web.test:443", "path": "/"},
            ],
        }
    )
    assert p.name_ports("api.test") == (80, 443)
    assert p.name_ports("web.test") == (443,)
    with pytest.raises(InvalidArgument, match=r"rules\[0\]\.host: port 8080: requests are read"):
        parse_policy_document(
            {
                "inspection": "partial",
                "rules": [{"action": "allow", "host": "a.test:8080", "path": "/"}],
            }
        )


def test_request_rules_need_inspection() -> None:
    for rule, where in [
        ({"action": "allow", "host": "a.test", "path": "/x"}, "rules[0].path"),
        ({"action": "deny", "host": "a.test", "methods": ["POST"]}, "rules[0].methods"),
        ({"action": "transform", "host": "a.test", "remove_headers": ["X"]}, "rules[0].action"),
    ]:
        with pytest.raises(
            InvalidArgument,
            match=re.escape(where) + ".*inspection partial or full",
        ):
            parse_policy_document({"inspection": "none", "rules": [rule]})


def test_every_port_but_one_is_refused_for_non_web_ports() -> None:
    with pytest.raises(
        InvalidArgument, match=r"rules\[1\]\.host: allows every port.*rules\[0\] denied port 22"
    ):
        _policy({"action": "deny", "host": "*.a.test:22"}, {"action": "allow", "host": "x.a.test"})
    with pytest.raises(InvalidArgument, match=r"rules\[1\]\.host"):
        _policy(
            {"action": "deny", "host": "10.1.0.0/16:22"}, {"action": "allow", "host": "10.0.0.0/8"}
        )
    with pytest.raises(InvalidArgument, match=r"rules\[1\]\.host"):  # ip rules skip the proxy
        _policy(
            {"action": "deny", "host": "10.1.0.1:443"}, {"action": "allow", "host": "10.0.0.0/8"}
        )
    # The proxy decides 80/443 by name, so that order is fine; so are unrelated names.
    _policy({"action": "deny", "host": "a.test:443"}, {"action": "allow", "host": "a.test"})
    _policy({"action": "deny", "host": "b.test:22"}, {"action": "allow", "host": "a.test"})


def test_templates() -> None:
    tpl = parse_template("Bearer {secret:openai} / {secret:org.id}")
    assert tpl.secrets == ("openai", "org.id")
    assert tpl.text == "Bearer {secret:openai} / {secret:org.id}"
    assert parse_template("plain").parts == ("plain",)


def test_the_document_round_trips_in_canonical_form() -> None:
    raw = {
        "inspection": "full",
        "rules": [
            {"action": "allow", "host": "API.Test:443", "methods": ["get", "GET"], "path": "/d"},
            {"action": "transform", "host": "llm.test", "set_headers": {"A": "{secret:k}"}},
        ],
    }
    p = parse_policy_document(raw)
    doc = p.document()
    assert doc == {
        "default": "deny",
        "inspection": "full",
        "dry_run": False,
        "rules": [
            {"action": "allow", "host": "api.test:443", "methods": ["GET"], "path": "/d"},
            {"action": "transform", "host": "llm.test", "set_headers": {"A": "{secret:k}"}},
        ],
    }
    assert parse_policy_document(doc) == p


# ---- what this daemon enforces, and the address-level lowering --------------------------


def test_what_is_not_enforceable_is_refused_by_name() -> None:
    partial = {
        "inspection": "partial",
        "rules": [{"action": "allow", "host": "a.test", "path": "/d"}],
    }
    require_available(parse_policy_document(partial))  # plain HTTP by method and path
    literal = {"action": "transform", "host": "a.test", "set_headers": {"X-Key": "v"}}
    require_available(parse_policy_document({"inspection": "partial", "rules": [literal]}))
    secret = {"action": "transform", "host": "a.test", "set_headers": {"A": "B {secret:k}"}}
    require_available(parse_policy_document({"inspection": "full", "rules": [secret]}))
    https_path = {"action": "allow", "host": "a.test:443", "path": "/d"}
    require_available(parse_policy_document({"inspection": "full", "rules": [https_path]}))
    require_available(parse_policy_document({"inspection": "learn"}))
    require_available(
        parse_policy_document({"dry_run": True, "inspection": "full", "rules": [https_path]})
    )
    # HTTPS requests under partial: TLS is terminated for the names such a rule matches.
    require_available(parse_policy_document({"inspection": "partial", "rules": [https_path]}))
    # Default allow with denies (by name and address) and with request rules or full.
    accepted: list[dict[str, Any]] = [
        {"default": "allow", "rules": [{"action": "deny", "host": "a.test"},
                                       {"action": "deny", "host": "b.test:443"},
                                       {"action": "deny", "host": "10.0.0.0/8:22"}]},
        {"default": "allow", "inspection": "full"},
        {"default": "allow", "inspection": "partial", "rules": [
            {"action": "deny", "host": "a.test", "methods": ["POST"], "path": "/admin"}]},
    ]  # fmt: skip
    for ok in accepted:
        require_available(parse_policy_document(ok))
    for doc, says in [
        ({"default": "allow", "inspection": "learn"},
         'default: "allow" with inspection "learn" is not accepted'),
        ({"default": "allow", "rules": [{"action": "deny", "host": "a.test:22"}]},
         "rules[0].host: a.test:22: under default \"allow\" addresses are open"),
        ({"inspection": "full", "rules": [{"action": "allow", "host": "10.0.0.0/8"}]},
         'rules[0].host: 10.0.0.0/8: inspection "full" decides by name'),
        ({"inspection": "full", "rules": [{"action": "allow", "host": "a.test:22"}]},
         'rules[0].host: a.test:22: inspection "full" reads HTTP and HTTPS only'),
    ]:  # fmt: skip
        with pytest.raises(
            InvalidArgument,
            match=re.escape(says),
        ):
            require_available(parse_policy_document(doc))


def _lowered(
    *rules: dict[str, Any], default: str = "deny", inspection: str = "none"
) -> EgressPolicy:
    return policy_from_stored({"default": default, "inspection": inspection, "rules": list(rules)})


def test_modes_of_lowered_policies() -> None:
    assert _lowered().mode == "deny-all"
    assert _lowered({"action": "deny", "host": "a.test"}).mode == "deny-all"
    assert _lowered({"action": "allow", "host": "a.test"}).mode == "rules"
    assert _lowered(default="allow").mode == "open"
    assert _lowered({"action": "allow", "host": "a.test"}, default="allow").mode == "open"


def test_names_first_match_at_the_address_level() -> None:
    p = _lowered(
        {"action": "deny", "host": "evil.good.test"},
        {"action": "deny", "host": "*.good.test:8443"},
        {"action": "allow", "host": "*.good.test:443"},
        {"action": "allow", "host": "*.good.test:8443"},
        {"action": "allow", "host": "api.good.test:22"},
    )
    assert p.name_allowed_any_port("evil.good.test") is None  # DNS: NXDOMAIN
    assert p.match_name("evil.good.test", 443) is None
    hit = p.match_name("www.good.test", 443)
    assert hit is not None and hit.canonical == "rules[2] allow *.good.test:443"
    assert p.match_name("www.good.test", 8443) is None  # the deny came first
    assert p.name_ports("www.good.test") == (443,)
    assert p.name_ports("api.good.test") == (22, 443)
    assert p.name_ports("evil.good.test") == ()
    assert p.name_allowed_any_port("other.test") is None
    # An allow only on a port denied before it allows nothing: no DNS answer either.
    shadowed = _lowered(
        {"action": "deny", "host": "*.test:8443"}, {"action": "allow", "host": "a.test:8443"}
    )
    assert shadowed.name_allowed_any_port("a.test") is None and shadowed.name_ports("a.test") == ()


def test_ip_rules_are_lowered_with_earlier_denials_cut_out() -> None:
    p = _lowered(
        {"action": "deny", "host": "198.18.0.128/25"},
        {"action": "deny", "host": "198.18.1.0/24:443"},
        {"action": "allow", "host": "198.18.0.0/24"},
        {"action": "allow", "host": "198.18.1.0/24:443"},
        {"action": "allow", "host": "198.18.1.0/24:80"},
    )
    assert p.ip_networks() == [IPv4Network("198.18.0.0/25")]
    assert p.ip_port_networks() == [(IPv4Network("198.18.1.0/24"), 80)]
    assert p.match_ip(ip_address("198.18.0.200"), 22) is None
    assert p.match_ip(ip_address("198.18.0.5"), 22) is not None
    assert p.match_ip(ip_address("198.18.1.5"), 443) is None


def test_lists_keep_their_meaning_and_storage() -> None:
    legacy = policy_from_stored(["good.test", "*.cdn.test:443"])
    assert legacy == parse_policy(["good.test", "*.cdn.test:443"])
    assert legacy.stored() == ["good.test", "*.cdn.test:443"] and legacy.ordered is None
    ordered = _lowered({"action": "allow", "host": "good.test"})
    assert policy_from_stored(ordered.stored()) == ordered
    assert ordered.texts() == ["rules[0] allow good.test", "default deny"]
    with pytest.raises(InvalidArgument, match="list of rules or a policy object"):
        policy_from_stored("good.test")
    assert lower_policy(parse_policy_document({})).mode == "deny-all"


def test_rewrite_fields_sets_and_removes_and_keeps_connection_close_last() -> None:
    from hutch.net.http_head import HeadError, parse_request_head, rewrite_fields

    req = parse_request_head(
        b"GET / HTTP/1.1\r\nHost: a.test\r\nCookie: c\r\nX-Key: old\r\nAccept: */*\r\n\r\n"
    )
    assert req is not None
    head = rewrite_fields(req.head, [("X-Key", "new")], ["cookie"])
    assert head == (
        b"GET / HTTP/1.1\r\nHost: a.test\r\nAccept: */*\r\nX-Key: new\r\nConnection: close\r\n\r\n"
    )
    again = parse_request_head(head)
    assert again is not None and again.head == head  # still a strictly valid head
    with pytest.raises(HeadError, match="control character"):
        rewrite_fields(req.head, [("X-Key", "a\r\nEvil: 1")], [])


def test_full_inspection_opens_only_the_web_ports_of_allowed_names() -> None:
    """Under inspection full every request is read by the proxy (80/443), so an allow
    rule without a port opens only those at the address level: nothing else leaves."""
    full = policy_from_stored(
        {"inspection": "full", "rules": [{"action": "allow", "host": "a.test"}]}
    )
    assert full.name_ports("a.test") == (80, 443)
    none = policy_from_stored({"rules": [{"action": "allow", "host": "a.test"}]})
    assert none.name_ports("a.test") == (None,)


# ---- default allow: denies at the address level and by name ----------------------------


def test_default_allow_lowers_to_open_less_its_ip_denies_in_rule_order() -> None:
    """Default allow is open at the address level; ip/cidr denies are dropped after the
    allow rules before them are accepted (first match wins: the allow's network less the
    earlier denies)."""
    p = _lowered(
        {"action": "allow", "host": "198.18.0.5"},
        {"action": "deny", "host": "198.18.0.0/24"},
        {"action": "deny", "host": "198.18.1.0/24:22"},
        {"action": "allow", "host": "198.18.0.0/16:80"},
        default="allow",
    )
    assert p.mode == "open" and p.observe is None
    assert p.ip_denied() == [(IPv4Network("198.18.0.0/24"), None),
                             (IPv4Network("198.18.1.0/24"), 22)]  # fmt: skip
    assert p.ip_networks() == [IPv4Network("198.18.0.5/32")]
    on_80 = [net for net, port in p.ip_port_networks() if port == 80]
    assert on_80 and not any(net.overlaps(IPv4Network("198.18.0.0/24")) for net in on_80)
    # Only ip denies: nothing is decided by name, so nothing is screened.
    assert not p.screened and not p.web_only
    assert _lowered(default="allow").ip_denied() == []


def test_default_allow_with_name_denies_is_screened_by_dns_sni_and_host() -> None:
    from hutch.net.proxy_decide import Denied, decide_destination, still_allowed

    p = _lowered(
        {"action": "allow", "host": "ok.evil.test"},
        {"action": "deny", "host": "*.evil.test"},
        {"action": "deny", "host": "mail.test:443"},
        default="allow",
    )
    assert p.mode == "open" and p.screened and not p.web_only
    assert p.ordered is not None
    # DNS: a name denied on every port is not answered; one denied on 443 only is.
    denier = p.ordered.name_denied_by("www.evil.test")
    assert denier is not None and denier.index == 1
    assert p.ordered.name_denied_by("ok.evil.test") is None
    assert p.ordered.name_denied_by("mail.test") is None
    # The proxy: SNI / Host in rule order, the default allows the rest.
    with pytest.raises(Denied, match=r"rules\[1\] deny \*\.evil\.test denies www\.evil"):
        decide_destination(p, "www.evil.test", 443)
    with pytest.raises(Denied, match=r"rules\[2\]"):
        decide_destination(p, "mail.test", 443)
    assert decide_destination(p, "mail.test", 80).rule is None
    assert decide_destination(p, "ok.evil.test", 443).index == 0
    assert decide_destination(p, "other.test", 443).rule is None
    # A rule change cuts what is now denied, keeps the rest.
    assert still_allowed(p, "www.evil.test", 443) is not None
    assert still_allowed(p, "other.test", 443) is None


def test_default_allow_decides_the_proxys_addresses_in_rule_order() -> None:
    """The proxy connects to what it resolved: under default allow each address is
    decided with the name (``decide_connection(name, addr, port)``), so an ip deny
    holds for names no earlier rule decided."""
    p = _policy(
        {"action": "allow", "host": "good.test"},
        {"action": "deny", "host": "198.18.0.0/24"},
        default="allow",
        inspection="none",
    )
    addr = ip_address("198.18.0.7")
    assert p.decide_connection("good.test", addr, 443).verdict == "allow"
    denied = p.decide_connection("other.test", addr, 443)
    assert (denied.verdict, denied.rule and denied.rule.index) == ("deny", 1)
    assert p.decide_connection("other.test", ip_address("198.18.1.7"), 443).verdict == "allow"


def test_default_allow_with_request_rules_denies_one_method_and_path() -> None:
    """Deny rules on method and path of an otherwise open egress: the connection to the
    host is inspected, the request decides, everything else is open."""
    from hutch.net.http_head import parse_request_head
    from hutch.net.proxy_decide import Denied, decide_destination, decide_request

    p = _lowered(
        {"action": "deny", "host": "api.test", "methods": ["POST"], "path": "/admin"},
        default="allow",
        inspection="partial",
    )
    assert p.mode == "open" and p.screened and not p.web_only
    assert decide_destination(p, "api.test", 443).inspect
    assert not decide_destination(p, "other.test", 443).inspect
    post = parse_request_head(b"POST /admin/x HTTP/1.1\r\nHost: api.test\r\n\r\n")
    get = parse_request_head(b"GET /admin/x HTTP/1.1\r\nHost: api.test\r\n\r\n")
    assert post is not None and get is not None
    with pytest.raises(Denied, match=r"rules\[0\] deny POST api.test/admin denies POST"):
        decide_request(p, "api.test", 443, post, None)
    assert decide_request(p, "api.test", 443, get, None).rule is None  # the default
    assert p.ordered is not None and p.ordered.name_denied_by("api.test") is None  # DNS


def test_partial_terminates_tls_only_where_a_request_rule_needs_it() -> None:
    from hutch.net.proxy_decide import inspects_tls, terminates_tls

    doc = {
        "inspection": "partial",
        "rules": [
            {"action": "transform", "host": "llm.test", "set_headers": {"A": "{secret:k}"}},
            {"action": "deny", "host": "api.test:443", "methods": ["POST"]},
            {"action": "allow", "host": "api.test"},
            {"action": "allow", "host": "plain.test"},
        ],
    }
    p = policy_from_stored(doc)
    assert inspects_tls(p)  # the guest trusts the project's CA
    assert terminates_tls(p, "llm.test", 443) and terminates_tls(p, "api.test", 443)
    assert not terminates_tls(p, "plain.test", 443)  # passed with its SNI checked
    assert not terminates_tls(p, "api.test", 8443)
    # Non-HTTP to a plainly allowed destination stays open; request rules open web ports.
    assert p.name_ports("plain.test") == (None,)
    assert p.name_ports("llm.test") == (80, 443)
    plain_http = policy_from_stored(
        {"inspection": "partial",
         "rules": [{"action": "allow", "host": "a.test:80", "path": "/d"}]}
    )  # fmt: skip
    assert not inspects_tls(plain_http) and not terminates_tls(plain_http, "a.test", 443)
    full = policy_from_stored({"default": "allow", "inspection": "full"})
    assert full.screened and full.web_only and inspects_tls(full)
    assert terminates_tls(full, "any.test", 443)
