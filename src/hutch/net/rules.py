"""Egress rules: matching destinations against a parsed policy (pure, no I/O).

The grammar (rule forms, the host-name normal form, the canonical text, the limits) is
the contract's (:mod:`hutch.contract.egress`): the REST schemas, the SDK and the fake
parse with the same code. This module adds what only the daemon does with a policy:
decide whether a name or an address on a port is allowed, and list what the nftables
sets and the resolver need. The grammar's names are re-exported here for the drivers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from ipaddress import IPv4Network

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
from hutch.contract.limits import MAX_EGRESS_RULES

__all__ = [
    "ACCEPTED_FORMS",
    "DENY_ALL",
    "MAX_RULES",
    "EgressMode",
    "EgressPolicy",
    "EgressRule",
    "IpAddress",
    "IpNetwork",
    "RuleKind",
    "normalize_name",
    "parse_policy",
    "parse_rule",
]

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
    mode: EgressMode
    rules: tuple[EgressRule, ...] = ()

    @classmethod
    def open(cls) -> EgressPolicy:
        return cls("open", ())

    def texts(self) -> list[str]:
        """Canonical strings for GET and storage; ``parse_policy(p.texts())`` gives ``p``."""
        return ParsedRules(self.mode, self.rules).texts()

    def match_name(self, name: str, port: int | None) -> EgressRule | None:
        """The first host/wildcard rule allowing ``name`` on ``port`` (``None``: any rule
        for the name, whatever its port). Only rules are consulted: the caller handles
        open and deny-all modes. A name that is not a valid hostname matches nothing."""
        norm = normalize_name(name)
        if norm is None:
            return None
        for rule in self.rules:
            if _matches_name(rule, norm, port):
                return rule
        return None

    def name_allowed_any_port(self, name: str) -> EgressRule | None:
        """For DNS: a name is answered when some rule names it, on any port."""
        return self.match_name(name, None)

    def name_ports(self, name: str) -> tuple[int | None, ...]:
        """Ports the rules open for ``name``: ``(None,)`` when a rule allows any port,
        else the distinct ports of the matching ``host:port`` rules, ``()`` if none.
        Used by DNS learning to fill the address or the address.port set."""
        norm = normalize_name(name)
        if norm is None:
            return ()
        ports: list[int] = []
        for rule in self.rules:
            if _matches_name(rule, norm, None):
                if rule.port is None:
                    return (None,)
                if rule.port not in ports:
                    ports.append(rule.port)
        return tuple(sorted(ports))

    def match_ip(self, addr: IpAddress, port: int | None) -> EgressRule | None:
        for rule in self.rules:
            if _matches_ip(rule, addr, port):
                return rule
        return None

    def ip_networks(self) -> list[IPv4Network]:
        """IPv4 ip/cidr rules without a port (the data path is IPv4 only)."""
        return [
            r.network for r in self.rules if isinstance(r.network, IPv4Network) and r.port is None
        ]

    def ip_port_networks(self) -> list[tuple[IPv4Network, int]]:
        """IPv4 ip:port and cidr:port rules."""
        return [
            (r.network, r.port)
            for r in self.rules
            if isinstance(r.network, IPv4Network) and r.port is not None
        ]

    def names(self) -> list[tuple[str, int | None]]:
        """Host and wildcard rules as (canonical name pattern, port)."""
        return [
            (f"*.{r.host}" if r.kind == "wildcard" else str(r.host), r.port)
            for r in self.rules
            if r.kind in ("host", "wildcard")
        ]


def parse_policy(texts: Iterable[str]) -> EgressPolicy:
    """Parse a whole rule list with the contract's grammar
    (:func:`hutch.contract.egress.parse_rules`): ``[]`` -> open; ``["deny-all"]`` ->
    deny-all (it must be alone); anything else -> rules. Raises InvalidArgument naming the
    first bad rule; nothing is partially applied."""
    parsed = parse_rules(texts)
    return EgressPolicy(parsed.mode, parsed.rules)
