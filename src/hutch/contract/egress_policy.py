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

Parsing and validation are :mod:`hutch.contract.egress_policy_parse`
(``parse_policy_document``): errors name the rule (``rules[2].methods``), what was wrong
and what is accepted; a policy with one bad part is rejected whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Literal

from hutch.contract.egress import EgressMode, EgressRule, IpAddress, normalize_name
from hutch.contract.egress_http import (
    HttpRequest,
    SecretRef,
    Template,
    normalize_request_path,
    parse_template,
)

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
    "matches_host",
    "normalize_request_path",
    "parse_template",
]

Action = Literal["allow", "deny", "transform"]
DefaultAction = Literal["allow", "deny"]
Inspection = Literal["none", "partial", "full", "learn"]
ACTIONS: tuple[Action, ...] = ("allow", "deny", "transform")
DEFAULTS: tuple[DefaultAction, ...] = ("allow", "deny")
INSPECTIONS: tuple[Inspection, ...] = ("none", "partial", "full", "learn")


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
            if rule.needs_http or self.inspection == "full":
                # Requests are read on the web ports only (the proxy): a request rule
                # opens those, never every port (HTTP on another port would skip it);
                # inspection full reads every request, so every rule opens only those.
                for web in (80, 443) if port is None else (port,):
                    if web not in denied and web not in ports:
                        ports.append(web)
                continue
            if port is None:
                return (None,)
            if port not in denied and port not in ports:
                ports.append(port)
        return tuple(sorted(ports))
