"""Parsing and validating an ordered egress policy document (pure, no I/O), and what
this daemon enforces of it (:func:`require_available`). The model and the evaluator are
:mod:`hutch.contract.egress_policy`; the document's shape is described there."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import cast

from hutch.contract.egress import EgressRule, parse_rule
from hutch.contract.egress_http import FieldError, Template, normalize_request_path, parse_template
from hutch.contract.egress_policy import (
    ACTIONS,
    DEFAULTS,
    INSPECTIONS,
    Action,
    DefaultAction,
    Inspection,
    OrderedPolicy,
    PolicyRule,
)
from hutch.contract.limits import MAX_EGRESS_RULES
from hutch.errors import InvalidArgument

__all__ = [
    "MAX_HEADERS_PER_RULE",
    "MAX_PATH",
    "is_policy_document",
    "parse_policy_document",
    "require_available",
]

_POLICY_KEYS = ("default", "inspection", "dry_run", "rules")
_RULE_KEYS = ("action", "host", "methods", "path", "set_headers", "remove_headers")
_METHOD = re.compile(r"^[A-Z][A-Z-]{0,15}$")
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,64}$")
_PATH_CHARS = re.compile(r"^/[\x21-\x7e]*$")
#: Headers a transform may not touch: framing, routing and hop-by-hop fields belong to
#: the proxy (a transform that set Host could send a request somewhere the rules never
#: looked at).
_RESERVED_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "upgrade",
        "te",
        "trailer",
    }
)
MAX_PATH = 1024
MAX_HEADERS_PER_RULE = 16


def require_available(policy: OrderedPolicy) -> None:
    """Refuse what the daemon does not enforce, each with a 400 saying what is accepted
    (the previous policy stays):

    - ``default: allow`` with inspection ``learn`` (learn allows everything and records
      it; its suggestion is a default-deny policy: write ``default: "deny"``);
    - ``default: allow`` with a deny rule for a *name* on a port other than 80/443: the
      address level is open then, and a name is seen only in DNS (any port) and in TLS
      SNI / HTTP Host (the web ports the proxy reads), so "this name but only on port 22"
      has nowhere to be enforced (an ip/cidr deny holds on every port);
    - under ``full``, an ip/cidr allow rule (nft would pass it without the proxy, so
      uninspected) and an allow rule on a port other than 80/443 (only HTTP(S) is
      inspected; every other port is closed).

    Under ``partial`` a request rule (methods, path, transform) on port 443 (or on no
    port) makes the proxy terminate TLS for the names that rule matches, and only those;
    other allowed TLS passes with its SNI checked."""
    if policy.default == "allow" and policy.inspection == "learn":
        raise InvalidArgument(
            'egress policy default: "allow" with inspection "learn" is not accepted: learn '
            'allows everything while it records; accepted: inspection "learn" with '
            'default "deny" (the default that its suggestion will have)'
        )
    for rule in policy.rules:
        where = f"egress policy rules[{rule.index}]"
        if (
            policy.default == "allow"
            and rule.action == "deny"
            and not rule.needs_http
            and rule.host.kind in ("host", "wildcard")
            and rule.host.port not in (None, 80, 443)
        ):
            raise InvalidArgument(
                f'{where}.host: {rule.host.canonical}: under default "allow" addresses are '
                "open and a name is seen only in DNS and in TLS SNI / HTTP Host on ports 80 "
                f"and 443, so a name cannot be denied on port {rule.host.port} alone; "
                "accepted: the name with no port (DNS, SNI and Host), :80 or :443, or an "
                "ip/cidr deny (every port it names, at the address level)"
            )
        if policy.inspection not in ("full", "learn") or rule.action == "deny":
            continue
        if rule.host.kind in ("ip", "cidr"):
            raise InvalidArgument(
                f'{where}.host: {rule.host.canonical}: inspection "full" decides by name '
                "(TLS server name and Host); an ip/cidr allow rule would pass uninspected; "
                "accepted: a host name or *.name"
            )
        if rule.host.port not in (None, 80, 443):
            raise InvalidArgument(
                f'{where}.host: {rule.host.canonical}: inspection "full" reads HTTP and '
                "HTTPS only (ports 80 and 443; every other port is closed); accepted: no "
                'port, :80 or :443, or inspection "partial" for other protocols'
            )


# ---- parsing ---------------------------------------------------------------------------


def is_policy_document(value: object) -> bool:
    """A policy is an object; a list is today's rule list."""
    return isinstance(value, Mapping)


def _choice(value: object, where: str, accepted: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in accepted:
        raise FieldError(where, f"{value!r} is not accepted; accepted: {', '.join(accepted)}")
    return value


def _parse_methods(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise FieldError(where, 'must be a non-empty list of HTTP methods, e.g. ["GET", "HEAD"]')
    out: list[str] = []
    for i, item in enumerate(value):
        if not isinstance(item, str) or not _METHOD.match(item.upper()):
            raise FieldError(
                f"{where}[{i}]",
                f"{item!r} is not an HTTP method (letters and '-', up to 16, e.g. GET, POST)",
            )
        method = item.upper()
        if method == "CONNECT":
            raise FieldError(f"{where}[{i}]", "CONNECT is never relayed; it cannot be allowed")
        if method not in out:
            out.append(method)
    return tuple(out)


def _parse_path(value: object, where: str) -> str:
    if not isinstance(value, str) or not _PATH_CHARS.match(value) or len(value) > MAX_PATH:
        raise FieldError(
            where,
            f"{value!r} is not accepted; a path starts with '/', is visible ASCII, at most "
            f"{MAX_PATH} characters: a prefix (/docs) or a glob with * or ? (/docs/*.json)",
        )
    if "#" in value:
        raise FieldError(where, "a path has no fragment ('#'); requests never carry one")
    plain = value.replace("*", "").replace("?", "")
    if normalize_request_path(plain or "/") != (plain or "/"):
        raise FieldError(
            where,
            f"{value!r} is not in normal form (no dot segments, no encoded '/', unreserved "
            "characters not percent-encoded, no query); write the path as servers see it",
        )
    return value


def _parse_headers(value: object, where: str) -> tuple[tuple[str, Template], ...]:
    if not isinstance(value, Mapping) or not value:
        raise FieldError(where, 'must be an object of header names to values, e.g. {"X-Key": "v"}')
    if len(value) > MAX_HEADERS_PER_RULE:
        raise FieldError(where, f"{len(value)} headers; at most {MAX_HEADERS_PER_RULE} per rule")
    out: list[tuple[str, Template]] = []
    seen: set[str] = set()
    for name, raw in value.items():
        hname = _header_name(name, f"{where}.{name}")
        if hname.lower() in seen:
            raise FieldError(f"{where}.{name}", "is set twice (header names ignore case)")
        seen.add(hname.lower())
        if not isinstance(raw, str):
            raise FieldError(f"{where}.{name}", f"{raw!r} is not a string")
        out.append((hname, parse_template(raw, f"{where}.{name}")))
    return tuple(out)


def _header_name(name: object, where: str) -> str:
    if not isinstance(name, str) or not _TOKEN.match(name):
        raise FieldError(where, f"{name!r} is not a header name (a token of 1-64 characters)")
    if name.lower() in _RESERVED_HEADERS:
        raise FieldError(
            where,
            f"{name} belongs to the proxy (framing or routing) and cannot be transformed; "
            f"not accepted: {', '.join(sorted(_RESERVED_HEADERS))}",
        )
    return name


def _parse_remove(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise FieldError(where, 'must be a non-empty list of header names, e.g. ["Cookie"]')
    out: list[str] = []
    for i, name in enumerate(value):
        hname = _header_name(name, f"{where}[{i}]")
        if hname.lower() not in (o.lower() for o in out):
            out.append(hname)
    return tuple(out)


def _parse_rule(raw: object, index: int) -> PolicyRule:
    where = f"rules[{index}]"
    if not isinstance(raw, Mapping):
        raise FieldError(where, f"{raw!r} is not an object with action and host")
    unknown = [k for k in raw if k not in _RULE_KEYS]
    if unknown:
        raise FieldError(
            f"{where}.{unknown[0]}", f"unknown field; accepted: {', '.join(_RULE_KEYS)}"
        )
    if "action" not in raw:
        raise FieldError(f"{where}.action", f"is missing; accepted: {', '.join(ACTIONS)}")
    action = cast(Action, _choice(raw["action"], f"{where}.action", ACTIONS))
    host_raw = raw.get("host")
    if not isinstance(host_raw, str):
        raise FieldError(
            f"{where}.host",
            "is missing or not a string; accepted: name, *.name, ip, cidr, each with :port",
        )
    try:
        # Kept in canonical form (its text too), so equal policies compare equal.
        host = parse_rule(parse_rule(host_raw).canonical)
    except InvalidArgument as exc:
        raise FieldError(f"{where}.host", str(exc)) from exc
    methods = _parse_methods(raw["methods"], f"{where}.methods") if "methods" in raw else None
    path = _parse_path(raw["path"], f"{where}.path") if "path" in raw else None
    set_headers = (
        _parse_headers(raw["set_headers"], f"{where}.set_headers") if "set_headers" in raw else ()
    )
    remove = (
        _parse_remove(raw["remove_headers"], f"{where}.remove_headers")
        if "remove_headers" in raw
        else ()
    )
    if action != "transform" and (set_headers or remove):
        field_name = "set_headers" if set_headers else "remove_headers"
        raise FieldError(
            f"{where}.{field_name}",
            f'only a "transform" rule rewrites headers; this rule is "{action}"',
        )
    if action == "transform" and not (set_headers or remove):
        raise FieldError(where, 'a "transform" rule needs set_headers or remove_headers')
    needs_request = methods is not None or path is not None or action == "transform"
    if needs_request and host.port is not None and host.port not in (80, 443):
        raise FieldError(
            f"{where}.host",
            f"port {host.port}: requests are read on ports 80 and 443 only (where hutch's "
            "proxy sees them); accepted: no port (both), :80 or :443",
        )
    if (methods is not None or path is not None) and host.kind in ("ip", "cidr"):
        field_name = "methods" if methods is not None else "path"
        raise FieldError(
            f"{where}.{field_name}",
            "needs a host name (requests are matched by their Host and SNI); an ip/cidr "
            "rule decides by address only",
        )
    if action == "transform" and host.kind in ("ip", "cidr"):
        raise FieldError(
            f"{where}.host",
            "a transform needs a name (the secret is bound to it); write a host name, "
            "not an address",
        )
    overlap = {n.lower() for n, _ in set_headers} & {n.lower() for n in remove}
    if overlap:
        raise FieldError(f"{where}.remove_headers", f"{sorted(overlap)[0]} is also in set_headers")
    return PolicyRule(index, action, host, methods, path, set_headers, remove)


def _check_enforceable(policy: OrderedPolicy) -> None:
    """Refuse rule orders the address-level enforcement could not keep exactly.

    Connections not decided by the proxy (ports other than 80/443) are allowed by
    address and port sets. "Every port but P" is no such set: a deny on a non-web port
    followed by an allow on any port of an overlapping destination would open P."""
    for later in policy.rules:
        if later.action == "deny" or later.host.port is not None or later.needs_http:
            continue  # request rules open the web ports only (see name_ports)
        for earlier in policy.rules[: later.index]:
            if earlier.action != "deny" or earlier.needs_http or earlier.host.port is None:
                continue
            if earlier.host.port in (80, 443) and earlier.host.kind in ("host", "wildcard"):
                continue  # TCP to a name on 80/443 is decided per connection by the proxy
            if _overlap(earlier.host, later.host):
                raise FieldError(
                    f"rules[{later.index}].host",
                    f"allows every port of {later.host.canonical} after rules[{earlier.index}] "
                    f"denied port {earlier.host.port} of an overlapping destination; hutch "
                    "cannot enforce 'every port but one' on addresses: give "
                    f"rules[{later.index}] the ports it needs (one rule per port)",
                )


def _overlap(a: EgressRule, b: EgressRule) -> bool:
    if a.network is not None and b.network is not None:
        return a.network.version == b.network.version and a.network.overlaps(b.network)
    if a.host is None or b.host is None:
        return False
    if a.kind == "host" and b.kind == "host":
        return a.host == b.host
    if a.kind == "wildcard" and b.kind == "wildcard":
        return a.host == b.host or a.host.endswith("." + b.host) or b.host.endswith("." + a.host)
    name, wild = (a.host, b.host) if a.kind == "host" else (b.host, a.host)
    return name.endswith("." + wild)


def parse_policy_document(raw: object) -> OrderedPolicy:
    """Validate and parse a policy object. Raises InvalidArgument naming the field
    (``egress policy rules[2].methods[0]: ...``) and what is accepted."""
    try:
        return _parse_policy(raw)
    except FieldError as exc:
        raise InvalidArgument(f"egress policy {exc.where}: {exc.why}") from exc


def _parse_policy(raw: object) -> OrderedPolicy:
    if not isinstance(raw, Mapping):
        raise FieldError("policy", "must be an object {default, inspection, dry_run, rules}")
    unknown = [k for k in raw if k not in _POLICY_KEYS]
    if unknown:
        raise FieldError(str(unknown[0]), f"unknown field; accepted: {', '.join(_POLICY_KEYS)}")
    default = cast(DefaultAction, _choice(raw.get("default", "deny"), "default", DEFAULTS))
    inspection = cast(Inspection, _choice(raw.get("inspection", "none"), "inspection", INSPECTIONS))
    dry_run = raw.get("dry_run", False)
    if not isinstance(dry_run, bool):
        raise FieldError("dry_run", f"{dry_run!r} is not accepted; accepted: true, false")
    rules_raw = raw.get("rules", [])
    if not isinstance(rules_raw, list):
        raise FieldError("rules", "must be a list of rule objects")
    if len(rules_raw) > MAX_EGRESS_RULES:
        raise FieldError("rules", f"{len(rules_raw)} rules; at most {MAX_EGRESS_RULES}")
    rules = tuple(_parse_rule(r, i) for i, r in enumerate(rules_raw))
    policy = OrderedPolicy(default, inspection, dry_run, rules)
    if inspection == "none":
        for rule in rules:
            if rule.needs_http:
                what = (
                    "transform"
                    if rule.action == "transform"
                    else ("methods" if rule.methods is not None else "path")
                )
                raise FieldError(
                    f"rules[{rule.index}].{what if what != 'transform' else 'action'}",
                    "needs the HTTP request, so it needs inspection partial or full; "
                    'inspection is "none" (addresses and names only)',
                )
    _check_enforceable(policy)
    return policy
