"""Egress rules: the grammar and the canonical form (pure, no I/O).

A sandbox's egress policy is a list of rule strings. ``[]`` means open egress,
``["deny-all"]`` blocks everything, anything else means *rules* mode: only what a rule
matches is allowed. Rule forms::

    host            good.test               any port
    host:port       good.test:443
    *.host          *.good.test             subdomains only, never good.test itself
    *.host:port     *.good.test:443
    ip              198.18.0.7   2001:db8::1
    ip:port         198.18.0.7:443   [2001:db8::1]:443
    cidr            198.18.0.0/24   2001:db8::/32
    cidr:port       198.18.0.0/24:443   [2001:db8::/32]:443

Hostnames are compared in one normal form: lower case, no trailing dot, non-ASCII labels
turned into their IDNA A-label (``xn--...``), so ``Bücher.Example.`` and
``xn--bcher-kva.example`` are the same rule. A list with one bad rule is rejected as a
whole (the caller keeps the previous policy in force).

This module is the one grammar: the daemon's matcher (``hutch.net.rules``), the REST
schemas, the SDK's checks before sending and the in-memory fake all parse with it, so a
rule means the same thing everywhere and its canonical text is the same everywhere.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import Literal

import idna

from hutch.contract.limits import MAX_EGRESS_RULES, PORT_RANGE
from hutch.errors import InvalidArgument

__all__ = [
    "ACCEPTED_FORMS",
    "DENY_ALL",
    "RULE_FORMS",
    "EgressMode",
    "EgressRule",
    "IpAddress",
    "IpNetwork",
    "ParsedRules",
    "RuleKind",
    "canonical_rules",
    "mode_of",
    "normalize_name",
    "parse_rule",
    "parse_rules",
]

RuleKind = Literal["host", "wildcard", "ip", "cidr"]
EgressMode = Literal["open", "rules", "deny-all"]
DENY_ALL = "deny-all"

ACCEPTED_FORMS = (
    "accepted forms: host, host:port, *.host, *.host:port, ip, ip:port, cidr, cidr:port "
    "(IPv6 with a port in brackets: [2001:db8::1]:443, [2001:db8::/32]:443), "
    'or "deny-all" alone'
)
#: The forms in one line, for schema descriptions and help texts.
RULE_FORMS = (
    "`host`, `host:port`, `*.host`, `ip`, `ip:port`, `cidr`, `cidr:port` "
    "(IPv6 as `[2001:db8::1]:443`), or `deny-all` alone."
)

_LDH_LABEL = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
IpNetwork = IPv4Network | IPv6Network
IpAddress = IPv4Address | IPv6Address


@dataclass(frozen=True)
class EgressRule:
    """One parsed rule. ``text`` is what the user wrote (for errors); ``canonical`` is the
    normal form stored and shown by GET."""

    text: str
    kind: RuleKind
    host: str | None  # host/wildcard: normalized name (for wildcard: without "*.")
    network: IpNetwork | None  # ip -> /32 or /128
    port: int | None  # None = any port

    @property
    def canonical(self) -> str:
        if self.kind == "host":
            base = str(self.host)
        elif self.kind == "wildcard":
            base = f"*.{self.host}"
        else:
            assert self.network is not None
            single = self.network.prefixlen == self.network.max_prefixlen
            base = str(self.network.network_address) if single else str(self.network)
            if self.port is not None and self.network.version == 6:
                return f"[{base}]:{self.port}"
        return base if self.port is None else f"{base}:{self.port}"


@dataclass(frozen=True)
class ParsedRules:
    """A whole rule list, parsed: its mode and its distinct rules in order."""

    mode: EgressMode
    rules: tuple[EgressRule, ...] = ()

    def texts(self) -> list[str]:
        """Canonical strings for GET and storage; ``parse_rules(p.texts())`` gives ``p``."""
        if self.mode == "deny-all":
            return [DENY_ALL]
        return [r.canonical for r in self.rules]


def normalize_name(name: str) -> str | None:
    """The normal form of a hostname (lower case, no trailing dot, A-labels), or None when
    it is not a valid hostname (bad characters, empty or over-long labels, > 253 chars)."""
    name = name.strip()
    if name.endswith("."):
        name = name[:-1]
    if not name or len(name) > 253 * 2:  # cheap guard before IDNA work
        return None
    labels: list[str] = []
    for label in name.split("."):
        if label.isascii():
            label = label.lower()
        else:
            try:
                label = idna.encode(label, uts46=True).decode("ascii")
            except idna.IDNAError:
                return None
        if not _LDH_LABEL.match(label):
            return None
        labels.append(label)
    out = ".".join(labels)
    return out if len(out) <= 253 else None


class _RuleError(ValueError):
    pass


def _parse_port(text: str) -> int:
    if not text.isdigit():
        raise _RuleError(f"port {text!r} is not a number")
    port = int(text)
    lo, hi = PORT_RANGE
    if not lo <= port <= hi:
        raise _RuleError(f"port {port} is out of {lo}-{hi}")
    return port


def _parse_network(text: str) -> IpNetwork:
    """An address (-> /32 or /128) or a CIDR with no host bits set."""
    if "/" not in text:
        addr = ipaddress.ip_address(text)
        return ipaddress.ip_network(addr)
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        if "host bits set" in str(exc):
            loose = ipaddress.ip_network(text, strict=False)
            raise _RuleError(f"{text} has host bits set (did you mean {loose}?)") from exc
        raise


def _ip_rule(text: str, body: str, port: int | None) -> EgressRule:
    net = _parse_network(body)
    single = net.prefixlen == net.max_prefixlen
    return EgressRule(text, "ip" if single else "cidr", None, net, port)


def _looks_numeric(body: str) -> bool:
    return all(c.isdigit() or c in "./" for c in body)


def _parse_one(text: str) -> EgressRule:
    if not text:
        raise _RuleError("it is empty")
    if any(c.isspace() for c in text):
        raise _RuleError("it contains white space")
    if "://" in text:
        raise _RuleError("write the host name only, without a scheme or a path")
    if text.startswith("["):  # [v6] or [v6]:port or [v6/len]:port
        close = text.find("]")
        if close < 0:
            raise _RuleError("'[' without a closing ']'")
        rest = text[close + 1 :]
        if rest and not rest.startswith(":"):
            raise _RuleError("expected ':port' after ']'")
        inner = text[1:close]
        try:
            net = _parse_network(inner)
        except _RuleError:
            raise
        except ValueError as exc:
            raise _RuleError(f"{inner!r} is not an IPv6 address or network") from exc
        if net.version != 6:
            raise _RuleError("brackets are for IPv6 only; write IPv4 as 1.2.3.4:443")
        return _ip_rule(text, inner, _parse_port(rest[1:]) if rest else None)
    # Bare address or CIDR, IPv4 or IPv6 (IPv6 without brackets cannot carry a port).
    try:
        return _ip_rule(text, text, None)
    except _RuleError:
        raise
    except ValueError:
        pass
    body, port = text, None
    if ":" in text:
        body, _, port_text = text.rpartition(":")
        if ":" in body:
            raise _RuleError("an IPv6 address with a port must be in brackets: [2001:db8::1]:443")
        port = _parse_port(port_text)
    if _looks_numeric(body):
        try:
            return _ip_rule(text, body, port)
        except ValueError as exc:
            raise _RuleError(f"{body!r} is not a valid IPv4 address or network") from exc
    wildcard = body.startswith("*.")
    name = body[2:] if wildcard else body
    if "*" in name:
        raise _RuleError("'*' is only allowed as the whole first label: *.example.com")
    norm = normalize_name(name)
    if norm is None:
        raise _RuleError(
            f"{name!r} is not a valid hostname (labels of 1-63 letters, digits and "
            "hyphens, at most 253 characters)"
        )
    if norm.rsplit(".", 1)[-1].isdigit():
        raise _RuleError(f"{name!r} is neither an IP address nor a hostname")
    return EgressRule(text, "wildcard" if wildcard else "host", norm, None, port)


def parse_rule(text: str) -> EgressRule:
    """Parse one rule; raises InvalidArgument naming it and listing the accepted forms."""
    try:
        return _parse_one(text.strip())
    except _RuleError as exc:
        raise InvalidArgument(f"egress rule {text!r} is invalid: {exc}; {ACCEPTED_FORMS}") from exc


def parse_rules(texts: Iterable[str]) -> ParsedRules:
    """Parse a whole rule list. ``[]`` -> open; ``["deny-all"]`` -> deny-all (it must be
    alone); anything else -> rules. Duplicates (same canonical form) are kept once.
    Raises InvalidArgument naming the first bad rule; nothing is partially applied."""
    items = list(texts)
    if len(items) > MAX_EGRESS_RULES:
        raise InvalidArgument(
            f"{len(items)} egress rules given; at most {MAX_EGRESS_RULES} are allowed "
            "(use a wildcard or a CIDR rule to cover many destinations)"
        )
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise InvalidArgument(f"egress rule #{i + 1} ({item!r}) is not a string")
    if any(item.strip().lower() == DENY_ALL for item in items):
        if len(items) != 1:
            raise InvalidArgument(
                '"deny-all" must be the only egress rule (it blocks everything; '
                "to allow some destinations list only them)"
            )
        return ParsedRules("deny-all", ())
    if not items:
        return ParsedRules("open", ())
    rules: list[EgressRule] = []
    seen: set[str] = set()
    for item in items:
        rule = parse_rule(item)
        if rule.canonical not in seen:
            seen.add(rule.canonical)
            rules.append(rule)
    return ParsedRules("rules", tuple(rules))


def canonical_rules(texts: Iterable[str]) -> list[str]:
    """The canonical texts of a rule list (what the daemon stores and GET shows); raises
    InvalidArgument as :func:`parse_rules` does."""
    return parse_rules(texts).texts()


def mode_of(canonical: list[str]) -> EgressMode:
    """The mode a canonical rule list makes."""
    if not canonical:
        return "open"
    return "deny-all" if canonical == [DENY_ALL] else "rules"
