"""Egress rules: matching destinations against a parsed policy (pure, no I/O).

The grammar (rule forms, the host-name normal form, the canonical text, the limits) is
the contract's (:mod:`hutch.contract.egress`): the REST schemas, the SDK and the fake
parse with the same code. This module adds what only the daemon does with a policy:
decide whether a name or an address on a port is allowed, and list what the nftables
sets and the resolver need. The grammar's names are re-exported here for the drivers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from ipaddress import IPv4Network
from typing import Any

from hutch.contract.egress import (
    ACCEPTED_FORMS,
    DENY_ALL,
    EgressMode,
    EgressRule,
    IpAddress,
    IpNetwork,
    ParsedRules,
    RuleKind,
    normalize_name,
    parse_rule,
    parse_rules,
)
from hutch.contract.egress_policy import OrderedPolicy, PolicyRule
from hutch.contract.egress_policy_parse import (
    is_policy_document,
    parse_policy_document,
    require_available,
)
from hutch.contract.limits import MAX_EGRESS_RULES
from hutch.errors import InvalidArgument

__all__ = [
    "ACCEPTED_FORMS",
    "DENY_ALL",
    "MAX_RULES",
    "EgressMode",
    "EgressPolicy",
    "EgressRule",
    "IpAddress",
    "IpNetwork",
    "Matched",
    "RuleKind",
    "StoredPolicy",
    "lower_policy",
    "normalize_name",
    "parse_policy",
    "parse_rule",
    "policy_from_stored",
]

#: What a match reports: today's rule, or a rule of an ordered policy (both name
#: themselves with ``canonical``, for the egress log and 403 bodies).
Matched = EgressRule | PolicyRule
#: A policy as stored and shown: today's rule list, or a policy document.
StoredPolicy = list[str] | dict[str, Any]

MAX_RULES = MAX_EGRESS_RULES


def _matches_name(rule: EgressRule, name: str, port: int | None) -> bool:
    """``name`` must already be normalized. ``port=None`` matches any rule port."""
    if port is not None and rule.port is not None and port != rule.port:
        return False
    if rule.kind == "host":
        return name == rule.host
    if rule.kind == "wildcard":
        return name.endswith("." + str(rule.host))  # never the apex itself
    return False


def _matches_ip(rule: EgressRule, addr: IpAddress, port: int | None) -> bool:
    if rule.network is None or addr.version != rule.network.version:
        return False
    if port is not None and rule.port is not None and port != rule.port:
        return False
    return addr in rule.network


@dataclass(frozen=True)
class EgressPolicy:
    """What the data path enforces. ``mode`` and ``rules`` are today's list; an ordered
    policy (``ordered``) is lowered by :func:`lower_policy` into the same shape: its mode,
    and the ip/cidr networks its rules allow in order (``lowered_ip``); its name rules
    are asked in order (first match wins) by every method below."""

    mode: EgressMode
    rules: tuple[EgressRule, ...] = ()
    ordered: OrderedPolicy | None = None
    lowered_ip: tuple[tuple[IPv4Network, int | None], ...] = field(default=(), compare=False)
    #: Default allow: the IPv4 networks (with a port or not) its ip/cidr deny rules take
    #: out of the open address level (checked after ``lowered_ip``, which then holds the
    #: allow rules' networks less earlier denies, so first match wins; see
    #: :func:`lower_policy`).
    lowered_deny: tuple[tuple[IPv4Network, int | None], ...] = field(default=(), compare=False)

    @classmethod
    def open(cls) -> EgressPolicy:
        return cls("open", ())

    @property
    def observe(self) -> str | None:
        """``"learn"`` or ``"dry run"`` when this policy only records what it would deny:
        the address level is open, web traffic still goes through the proxy (which
        decides by :meth:`shadow` and logs would-be denials), DNS is forwarded."""
        if self.ordered is None:
            return None
        if self.ordered.inspection == "learn":
            return "learn"
        return "dry run" if self.ordered.dry_run else None

    @property
    def screened(self) -> bool:
        """Default allow that still decides: the address level is open (less the ip/cidr
        denies), but names are checked in DNS and web traffic goes through the proxy
        (name denies by SNI and Host, request rules, inspection ``full``). Not for
        learn / dry run (:attr:`observe`), which only record."""
        o = self.ordered
        if o is None or o.default != "allow" or self.observe is not None:
            return False
        return o.inspection == "full" or any(
            r.host.kind in ("host", "wildcard") and (r.action == "deny" or r.needs_http)
            for r in o.rules
        )

    @property
    def web_only(self) -> bool:
        """Default allow with inspection ``full``: nothing but DNS and the proxied web
        ports leaves (non-HTTP is blocked, as full promises)."""
        return self.screened and self.ordered is not None and self.ordered.inspection == "full"

    def ip_denied(self) -> list[tuple[IPv4Network, int | None]]:
        """Default allow: the IPv4 networks (and ports) the ip/cidr deny rules drop."""
        return list(self.lowered_deny)

    def shadow(self) -> EgressPolicy:
        """The policy an observing one would enforce (itself when it enforces)."""
        if self.observe is None or self.ordered is None:
            return self
        return _lower(self.ordered)

    def texts(self) -> list[str]:
        """Canonical strings for GET (and for today's lists, storage): today's rules, or
        one line per ordered rule (``rules[0] allow api.test:443``) and the default."""
        if self.ordered is not None:
            return [r.canonical for r in self.ordered.rules] + [f"default {self.ordered.default}"]
        return ParsedRules(self.mode, self.rules).texts()

    def stored(self) -> StoredPolicy:
        """What the database keeps: ``policy_from_stored(p.stored()) == p``."""
        return self.ordered.document() if self.ordered is not None else self.texts()

    def match_name(self, name: str, port: int | None) -> Matched | None:
        """The rule allowing ``name`` on ``port`` (``None``: any rule for the name, whatever
        its port); ordered policies: the first rule whose host matches decides. Only rules
        are consulted: the caller handles open and deny-all modes. A name that is not a
        valid hostname matches nothing."""
        norm = normalize_name(name)
        if norm is None:
            return None
        if self.ordered is not None:
            if port is None:
                return self.ordered.name_may_be_allowed(norm)
            decided = self.ordered.decide_connection(norm, None, port)
            # "inspect": the request decides (the proxy asks it); the destination may be
            # reached, so a connection relayed for it is not cut by a rule change.
            return decided.rule if decided.verdict in ("allow", "inspect") else None
        for rule in self.rules:
            if _matches_name(rule, norm, port):
                return rule
        return None

    def name_allowed_any_port(self, name: str) -> Matched | None:
        """For DNS: a name is answered when some rule allows it, on any port."""
        return self.match_name(name, None)

    def name_ports(self, name: str) -> tuple[int | None, ...]:
        """Ports the rules open for ``name``: ``(None,)`` when a rule allows any port,
        else the distinct ports of the matching ``host:port`` rules, ``()`` if none.
        Used by DNS learning to fill the address or the address.port set."""
        norm = normalize_name(name)
        if norm is None:
            return ()
        if self.ordered is not None:
            return self.ordered.name_ports(norm)
        ports: list[int] = []
        for rule in self.rules:
            if _matches_name(rule, norm, None):
                if rule.port is None:
                    return (None,)
                if rule.port not in ports:
                    ports.append(rule.port)
        return tuple(sorted(ports))

    def match_ip(self, addr: IpAddress, port: int | None) -> Matched | None:
        if self.ordered is not None:
            decided = self.ordered.decide_connection(None, addr, port)
            return decided.rule if decided.verdict == "allow" else None
        for rule in self.rules:
            if _matches_ip(rule, addr, port):
                return rule
        return None

    def ip_networks(self) -> list[IPv4Network]:
        """IPv4 ip/cidr rules without a port (the data path is IPv4 only)."""
        if self.ordered is not None:
            return [net for net, port in self.lowered_ip if port is None]
        return [
            r.network for r in self.rules if isinstance(r.network, IPv4Network) and r.port is None
        ]

    def ip_port_networks(self) -> list[tuple[IPv4Network, int]]:
        """IPv4 ip:port and cidr:port rules."""
        if self.ordered is not None:
            return [(net, port) for net, port in self.lowered_ip if port is not None]
        return [
            (r.network, r.port)
            for r in self.rules
            if isinstance(r.network, IPv4Network) and r.port is not None
        ]

    def names(self) -> list[tuple[str, int | None]]:
        """Host and wildcard rules that allow, as (canonical name pattern, port)."""
        hosts = (
            [r.host for r in self.ordered.rules if r.action != "deny"]
            if self.ordered is not None
            else list(self.rules)
        )
        return [
            (f"*.{r.host}" if r.kind == "wildcard" else str(r.host), r.port)
            for r in hosts
            if r.kind in ("host", "wildcard")
        ]


def _subtract(nets: list[IPv4Network], hole: IPv4Network) -> list[IPv4Network]:
    out: list[IPv4Network] = []
    for net in nets:
        if not net.overlaps(hole):
            out.append(net)
        elif not net.subnet_of(hole):
            out += net.address_exclude(hole)
    return out


def _lower_ip(ordered: OrderedPolicy) -> tuple[tuple[IPv4Network, int | None], ...]:
    """The IPv4 networks (with a port or not) the ip/cidr rules allow, first match first:
    an allow rule's network less what earlier deny rules on its port (or on every port)
    took out. (A deny on one port before an allow on every port is refused by the
    contract's validation.)"""
    out: list[tuple[IPv4Network, int | None]] = []
    for rule in ordered.rules:
        net = rule.host.network
        if rule.action == "deny" or not isinstance(net, IPv4Network):
            continue
        left = [net]
        for earlier in ordered.rules[: rule.index]:
            hole = earlier.host.network
            if earlier.action != "deny" or not isinstance(hole, IPv4Network):
                continue
            if earlier.host.port is None or earlier.host.port == rule.host.port:
                left = _subtract(left, hole)
        out += [(n, rule.host.port) for n in left]
    return tuple(out)


def _lower_deny(ordered: OrderedPolicy) -> tuple[tuple[IPv4Network, int | None], ...]:
    """Default allow: every ip/cidr deny rule's IPv4 network and port. Earlier allow
    rules need not be taken out: their networks (:func:`_lower_ip`) are accepted before
    these are dropped, and a later allow already had these taken out of its own."""
    return tuple(
        (r.host.network, r.host.port)
        for r in ordered.rules
        if r.action == "deny" and not r.needs_http and isinstance(r.host.network, IPv4Network)
    )


def _lower(ordered: OrderedPolicy) -> EgressPolicy:
    """What ``ordered`` enforces (learn and dry run aside): default deny is rules mode
    (or deny-all); default allow is open at the address level, less its ip/cidr denies
    (with the allows before them accepted first), and :attr:`EgressPolicy.screened`
    when names or requests are still decided."""
    if ordered.default == "allow":
        denies = _lower_deny(ordered)
        allows = _lower_ip(ordered) if denies else ()
        return EgressPolicy("open", (), ordered, allows, denies)
    if ordered.mode == "deny-all":
        return EgressPolicy("deny-all", (), ordered)
    return EgressPolicy("rules", (), ordered, _lower_ip(ordered))


def lower_policy(ordered: OrderedPolicy) -> EgressPolicy:
    """The enforcement form of an ordered policy (see :func:`_lower`); learn and dry run
    are open and record what the policy would do (:attr:`EgressPolicy.observe`). What
    this daemon cannot enforce is refused with InvalidArgument naming it
    (:func:`require_available`), and the previous policy stays."""
    require_available(ordered)
    if ordered.inspection == "learn" or ordered.dry_run:
        return EgressPolicy("open", (), ordered)
    return _lower(ordered)


def policy_from_stored(stored: object) -> EgressPolicy:
    """A stored or requested policy: a list is today's rules (:func:`parse_policy`), an
    object an ordered policy (validated, then :func:`lower_policy`). Raises
    InvalidArgument naming what is wrong."""
    if is_policy_document(stored):
        return lower_policy(parse_policy_document(stored))
    if not isinstance(stored, list):
        raise InvalidArgument(
            "egress must be a list of rules or a policy object {default, inspection, rules}"
        )
    return parse_policy(stored)


def parse_policy(texts: Iterable[str]) -> EgressPolicy:
    """Parse a whole rule list with the contract's grammar
    (:func:`hutch.contract.egress.parse_rules`): ``[]`` -> open; ``["deny-all"]`` ->
    deny-all (it must be alone); anything else -> rules. Raises InvalidArgument naming the
    first bad rule; nothing is partially applied."""
    parsed = parse_rules(texts)
    return EgressPolicy(parsed.mode, parsed.rules)
