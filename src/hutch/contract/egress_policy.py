"""Ordered egress policies: the model, its validation and the evaluator (pure, no I/O).

Besides today's rule list (:mod:`hutch.contract.egress`, which keeps its meaning), a
sandbox's egress can be a *policy*::

    {"default": "deny",            # what happens when no rule matches: allow | deny
     "inspection": "none",         # none | partial | full | learn (see below)
     "dry_run": false,             # log would-be denials without denying
     "rules": [                    # evaluated in order, the first match wins
        {"action": "deny",  "host": "api.example.com:443", "methods": ["POST"],
         "path": "/admin"},
        {"action": "allow", "host": "api.example.com:443", "path": "/docs/*"},
        {"action": "transform", "host": "api.openai.com:443",
         "set_headers": {"Authorization": "Bearer {secret:openai}"},
         "remove_headers": ["Cookie"]},
        {"action": "allow", "host": "*.debian.org"}]}

- ``host`` is one of today's forms (name, ``*.name``, ip, cidr, each with an optional
  port); a name rule matches the name a connection asks for (DNS query, TLS SNI, HTTP
  Host), an ip/cidr rule the address it goes to.
- ``methods`` (HTTP methods, upper case) and ``path`` narrow a rule to HTTP requests.
  ``path`` is a *prefix* on whole segments (``/docs`` matches ``/docs`` and
  ``/docs/a`` but not ``/docsearch``; ``/docs/`` only below it), or a *glob* when it
  holds ``*`` or ``?`` (``*`` matches any characters, ``/`` included). A request's path
  is compared without its query, with percent-encoded unreserved characters decoded; a
  path with dot segments (``/a/../b``) or an encoded ``/`` or ``\\`` is ambiguous (servers
  read it differently) and matches no rule that names a path (a deny with no path still
  matches it; the default applies otherwise, and a ``deny`` default refuses it).
- ``transform`` allows the request and rewrites headers on the way out: ``set_headers``
  values are literals or hold ``{secret:NAME}`` references (``Bearer {secret:openai}``),
  resolved by the daemon, never by the guest; ``remove_headers`` are dropped.

A rule with ``methods``, ``path`` or action ``transform`` needs the HTTP request to be
decided, so it needs ``inspection`` other than ``none``. :meth:`OrderedPolicy.decide`
decides a request; :meth:`OrderedPolicy.decide_connection` decides what can be decided
from the destination alone (``inspect`` when a rule needs the request).

Validation errors name the rule (``rules[2].methods``), what was wrong and what is
accepted; a policy with one bad part is rejected whole.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Literal, cast

from hutch.contract.egress import EgressMode, EgressRule, IpAddress, normalize_name, parse_rule
from hutch.contract.egress_http import (
    FieldError,
    HttpRequest,
    SecretRef,
    Template,
    normalize_request_path,
    parse_template,
)
from hutch.contract.limits import MAX_EGRESS_RULES
from hutch.errors import InvalidArgument

__all__ = [
    "ACTIONS",
    "DEFAULTS",
    "INSPECTIONS",
    "Action",
    "ConnectionDecision",
    "Decision",
    "DefaultAction",
    "HttpRequest",
    "Inspection",
    "OrderedPolicy",
    "PolicyRule",
    "SecretRef",
    "Template",
    "is_policy_document",
    "matches_host",
    "normalize_request_path",
    "parse_policy_document",
    "parse_template",
    "require_available",
]

Action = Literal["allow", "deny", "transform"]
DefaultAction = Literal["allow", "deny"]
Inspection = Literal["none", "partial", "full", "learn"]
ACTIONS: tuple[Action, ...] = ("allow", "deny", "transform")
DEFAULTS: tuple[DefaultAction, ...] = ("allow", "deny")
INSPECTIONS: tuple[Inspection, ...] = ("none", "partial", "full", "learn")

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


# ---- rules and policies ----------------------------------------------------------------


def matches_host(
    rule: EgressRule, name: str | None, address: IpAddress | None, port: int | None
) -> bool:
    """Does ``rule`` (a host pattern) match a destination? A name rule matches the name
    (normalized here), an ip/cidr rule the address; ``port=None`` matches any rule port
    (a rule's missing port matches any port)."""
    if port is not None and rule.port is not None and port != rule.port:
        return False
    if rule.kind in ("host", "wildcard"):
        norm = normalize_name(name) if name is not None else None
        if norm is None:
            return False
        return norm == rule.host if rule.kind == "host" else norm.endswith("." + str(rule.host))
    if address is None or rule.network is None or address.version != rule.network.version:
        return False
    return address in rule.network


def _path_matches(pattern: str, path: str) -> bool:
    if "*" in pattern or "?" in pattern:
        return fnmatchcase(path, pattern)
    if pattern.endswith("/"):
        return path.startswith(pattern)
    return path == pattern or path.startswith(pattern + "/")


@dataclass(frozen=True)
class PolicyRule:
    """One rule (``index`` counts from 0, as in ``rules[index]``)."""

    index: int
    action: Action
    host: EgressRule
    methods: tuple[str, ...] | None = None
    path: str | None = None
    set_headers: tuple[tuple[str, Template], ...] = ()
    remove_headers: tuple[str, ...] = ()

    @property
    def needs_http(self) -> bool:
        """True when only the HTTP request can say whether this rule matches or what it
        does (methods, path, transform)."""
        return self.methods is not None or self.path is not None or self.action == "transform"

    @property
    def canonical(self) -> str:
        """One line naming the rule, for the egress log and 403 bodies:
        ``rules[1] allow GET,HEAD api.test:443/docs/*``."""
        what = self.host.canonical + (self.path or "")
        methods = ",".join(self.methods) + " " if self.methods else ""
        return f"rules[{self.index}] {self.action} {methods}{what}"

    def matches_request(self, request: HttpRequest) -> bool:
        if not matches_host(self.host, request.name, request.address, request.port):
            return False
        if self.methods is not None and request.method not in self.methods:
            return False
        if self.path is not None:
            path = request.path
            if path is None or not _path_matches(self.path, path):
                return False
        return True

    def document(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"action": self.action, "host": self.host.canonical}
        if self.methods is not None:
            doc["methods"] = list(self.methods)
        if self.path is not None:
            doc["path"] = self.path
        if self.set_headers:
            doc["set_headers"] = {name: tpl.text for name, tpl in self.set_headers}
        if self.remove_headers:
            doc["remove_headers"] = list(self.remove_headers)
        return doc


@dataclass(frozen=True)
class Decision:
    """A request's verdict: the rule that matched (None: the default decided)."""

    action: Action
    rule: PolicyRule | None

    @property
    def allowed(self) -> bool:
        return self.action != "deny"

    @property
    def why(self) -> str:
        if self.rule is None:
            return f"no rule matched; the policy's default is {self.action}"
        return f"{self.rule.canonical} matched"


@dataclass(frozen=True)
class ConnectionDecision:
    """What the destination alone decides: ``allow``/``deny`` by ``rule`` (None: the
    default), or ``inspect``: ``rule`` needs the HTTP request (methods, path,
    transform), so the request decides."""

    verdict: Literal["allow", "deny", "inspect"]
    rule: PolicyRule | None


@dataclass(frozen=True)
class OrderedPolicy:
    """A whole policy (see the module docstring). Build it with
    :func:`parse_policy_document`; :meth:`document` gives it back in canonical form."""

    default: DefaultAction = "deny"
    inspection: Inspection = "none"
    dry_run: bool = False
    rules: tuple[PolicyRule, ...] = field(default=())

    def document(self) -> dict[str, Any]:
        """The canonical JSON form: ``parse_policy_document(p.document()) == p``."""
        return {
            "default": self.default,
            "inspection": self.inspection,
            "dry_run": self.dry_run,
            "rules": [r.document() for r in self.rules],
        }

    @property
    def needs_http(self) -> bool:
        return any(r.needs_http for r in self.rules)

    @property
    def mode(self) -> EgressMode:
        """The address-level mode it makes: ``open`` (default allow, no deny rule),
        ``deny-all`` (default deny, no rule that allows) or ``rules``."""
        if self.default == "allow":
            return "rules" if any(r.action == "deny" for r in self.rules) else "open"
        return "rules" if any(r.action != "deny" for r in self.rules) else "deny-all"

    def lines(self) -> list[str]:
        """One line per rule, then the default (GET's ``rules`` for a policy)."""
        return [r.canonical for r in self.rules] + [f"default {self.default}"]

    @property
    def secrets(self) -> tuple[str, ...]:
        """Every secret name a transform references (distinct, in order)."""
        out: list[str] = []
        for rule in self.rules:
            for _, tpl in rule.set_headers:
                out += [s for s in tpl.secrets if s not in out]
        return tuple(out)

    def decide(self, request: HttpRequest) -> Decision:
        """The first rule matching ``request`` decides; none: the default."""
        for rule in self.rules:
            if rule.matches_request(request):
                return Decision(rule.action, rule)
        return Decision(self.default, None)

    def decide_connection(
        self, name: str | None, address: IpAddress | None, port: int | None
    ) -> ConnectionDecision:
        """What can be decided before any request is seen. Rules are walked in order;
        the first whose host matches decides, unless it needs the request (then
        ``inspect``: only the request can say whether it or a later rule applies)."""
        for rule in self.rules:
            if matches_host(rule.host, name, address, port):
                if rule.needs_http:
                    return ConnectionDecision("inspect", rule)
                return ConnectionDecision("allow" if rule.action == "allow" else "deny", rule)
        return ConnectionDecision(self.default, None)

    def name_denied_by(self, name: str) -> PolicyRule | None:
        """The deny rule that ends :meth:`name_may_be_allowed`'s search for ``name``
        (None: no rule did; the default, or the name is allowed)."""
        denied: set[int] = set()
        for rule in self.rules:
            if not matches_host(rule.host, name, None, None):
                continue
            if rule.action != "deny":
                if rule.host.port is not None and rule.host.port in denied:
                    continue  # shadowed, as in name_may_be_allowed
                return None
            if rule.needs_http:
                continue
            if rule.host.port is None:
                return rule
            denied.add(rule.host.port)
        return None

    def name_may_be_allowed(self, name: str) -> PolicyRule | None:
        """For DNS (no port known yet): the first rule by which some connection to
        ``name`` on some port could be allowed, or None when none can. A deny rule for
        the name on any port (and needing no request) ends the search; an allow on a port
        an earlier deny took is skipped (as in :meth:`name_ports`)."""
        denied: set[int] = set()
        for rule in self.rules:
            if not matches_host(rule.host, name, None, None):
                continue
            if rule.action == "deny":
                if rule.needs_http:
                    continue
                if rule.host.port is None:
                    return None
                denied.add(rule.host.port)
                continue
            if rule.host.port is not None and rule.host.port in denied:
                continue
            return rule
        return None

    def name_ports(self, name: str) -> tuple[int | None, ...]:
        """The ports on which connections to ``name`` can be allowed: ``(None,)`` for any
        port, else the distinct ports in order, ``()`` for none. A deny rule needing no
        request takes its port out of the later rules' ports; :func:`_check_enforceable`
        refused policies where that is not a finite list of ports."""
        ports: list[int] = []
        denied: set[int] = set()
        for rule in self.rules:
            if not matches_host(rule.host, name, None, None):
                continue
            port = rule.host.port
            if rule.action == "deny" and not rule.needs_http:
                if port is None:
                    break
                denied.add(port)
                continue
            if rule.action == "deny":
                continue  # a request-level deny: the request decides, not the address
            if rule.needs_http:
                # Requests are read on the web ports only (the proxy): a request rule
                # opens those, never every port (HTTP on another port would skip it).
                for web in (80, 443) if port is None else (port,):
                    if web not in denied and web not in ports:
                        ports.append(web)
                continue
            if port is None:
                return (None,)
            if port not in denied and port not in ports:
                ports.append(port)
        return tuple(sorted(ports))


def require_available(policy: OrderedPolicy) -> None:
    """Refuse what the daemon does not enforce yet (the API v1 as served today):
    inspection ``full`` and ``learn``, ``{secret:NAME}`` in a transform (no secrets
    store yet: literal values only), ``dry_run``, and a ``default: allow`` with deny
    rules (address-level enforcement is an allow list).
    ``partial`` is served for plain HTTP only: requests are decided by method and path;
    TLS to a destination whose rules need the request is refused (no TLS termination
    yet). InvalidArgument says what is accepted; the previous policy stays."""
    if policy.inspection not in ("none", "partial"):
        raise InvalidArgument(
            f'egress policy inspection: "{policy.inspection}" is not available on this '
            'daemon yet; accepted: "none" (addresses and names) or "partial" (plus '
            "methods and paths of plain-HTTP requests; TLS termination is not built yet)"
        )
    for rule in policy.rules:
        for header, tpl in rule.set_headers:
            if tpl.secrets:
                raise InvalidArgument(
                    f"egress policy rules[{rule.index}].set_headers.{header}: "
                    f"{{secret:{tpl.secrets[0]}}} needs the secrets store, which this daemon "
                    "does not have yet; accepted: literal values"
                )
    if policy.dry_run:
        raise InvalidArgument(
            "egress policy dry_run: true is not available on this daemon yet; accepted: false"
        )
    denies = [r for r in policy.rules if r.action == "deny"]
    if policy.default == "allow" and denies:
        raise InvalidArgument(
            f'egress policy default: "allow" with deny rules (rules[{denies[0].index}]) '
            'is not available on this daemon yet; accepted: default "deny" with the '
            'destinations to allow, or default "allow" without deny rules (open egress)'
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
