"""Which addresses a *name* may lead a sandbox to (pure; the resolver and the proxy share it).

A name rule (``good.test``, ``*.good.test``) allows whatever the name resolves to, so
whoever controls that name's DNS chooses the destination. Two kinds of answers are
therefore never taken from DNS:

- ``always``: loopback, link-local (cloud metadata), 0.0.0.0/8, multicast and
  broadcast, the sandbox pool, and the host's own addresses (asked of the kernel when
  the answer is checked, see :mod:`hutch.net.host_addresses`). No rule opens them: nft
  drops them for every sandbox whatever its policy.
- ``private``: 10/8, 172.16/12, 192.168/16 (RFC 1918), 100.64/10 (shared/CGNAT) and
  240/4 (reserved): the host's LAN or VPC. Only an explicit ``ip``/``cidr`` rule opens
  them. When one of the sandbox's ip/cidr rules (with or without a port) covers such an
  address, the name is answered with it, but the address is *not* learned into the
  name's allow set: what the guest may reach there is exactly what that ip/cidr rule
  says (its port, if it has one), never the name rule's ports.

:func:`filter_answer` applies this to the A records of one answer.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address
from typing import Literal, Protocol

from hutch.net.addressing import ALWAYS_DENIED_NETWORKS, PRIVATE_NETWORKS, AddressPool

__all__ = [
    "AnswerFilter",
    "Forbidden",
    "ForbiddenCheck",
    "ForbiddenKind",
    "classify_destination",
    "filter_answer",
    "opened_by_ip_rule",
]

ForbiddenKind = Literal["always", "private"]


@dataclass(frozen=True)
class Forbidden:
    """Why a name must not lead to an address: ``kind`` (see the module docstring) and
    ``why`` in words ("loopback", "private range 10.0.0.0/8", "the host's own address")."""

    kind: ForbiddenKind
    why: str


ForbiddenCheck = Callable[[IPv4Address], "Forbidden | None"]


class IpRules(Protocol):
    """What :func:`opened_by_ip_rule` needs of ``hutch.net.rules.EgressPolicy``."""

    @property
    def mode(self) -> Literal["open", "rules", "deny-all"]: ...

    def ip_networks(self) -> list[IPv4Network]: ...

    def ip_port_networks(self) -> list[tuple[IPv4Network, int]]: ...


def classify_destination(
    addr: IPv4Address | IPv6Address | str,
    pool: AddressPool | IPv4Network | None = None,
    is_host: Callable[[IPv4Address], bool] | None = None,
) -> Forbidden | None:
    """None when a name may lead to ``addr``; else why not. ``is_host`` says whether an
    address is the host's own (None: not asked). IPv6 is always refused (the data path
    is IPv4 only), IPv4-mapped IPv6 is judged as the IPv4 address it maps."""
    address = ipaddress.ip_address(addr) if isinstance(addr, str) else addr
    if isinstance(address, IPv6Address):
        mapped = address.ipv4_mapped
        if mapped is None:
            return Forbidden("always", "IPv6 (sandboxes are IPv4 only)")
        address = mapped
    if address.is_loopback:
        return Forbidden("always", "loopback")
    if address.is_link_local:
        return Forbidden("always", "link-local (cloud metadata)")
    if address == IPv4Address("255.255.255.255") or address.is_multicast:
        return Forbidden("always", "multicast or broadcast")
    if any(address in net for net in ALWAYS_DENIED_NETWORKS):
        return Forbidden("always", "unspecified (0.0.0.0/8)")
    pool_net = pool.network if isinstance(pool, AddressPool) else pool
    if pool_net is not None and address in pool_net:
        return Forbidden("always", "a sandbox address")
    if is_host is not None and is_host(address):
        return Forbidden("always", "the host's own address")
    for net, why in PRIVATE_NETWORKS.items():
        if address in net:
            return Forbidden("private", why)
    return None


def opened_by_ip_rule(policy: IpRules, addr: IPv4Address, port: int | None = None) -> bool:
    """True when one of ``policy``'s explicit ip/cidr rules covers ``addr`` (on ``port``;
    None: on any port). Only rules mode has such rules."""
    if policy.mode != "rules":
        return False
    if any(addr in net for net in policy.ip_networks()):
        return True
    return any(addr in net and port in (None, p) for net, p in policy.ip_port_networks())


@dataclass(frozen=True)
class AnswerFilter:
    """One answer's A records sorted out: ``answer`` goes to the guest, ``learn`` into
    the name's allow set (``answer`` minus private addresses an ip rule opens),
    ``refused`` is dropped from the answer (address, why)."""

    answer: list[tuple[IPv4Address, int]]
    learn: list[tuple[IPv4Address, int]]
    refused: list[tuple[IPv4Address, Forbidden]]

    def refusal(self) -> str:
        """The refused addresses in words, for the egress log ("" when none)."""
        parts = []
        for addr, why in self.refused:
            rule = (
                "a name never opens a private address, only an ip/cidr rule does"
                if why.kind == "private"
                else "no rule opens it"
            )
            parts.append(f"{addr} ({why.why}: {rule})")
        return "; ".join(parts)


def filter_answer(
    addrs: Iterable[tuple[IPv4Address, int]], policy: IpRules, check: ForbiddenCheck
) -> AnswerFilter:
    """Sort the (address, ttl) A records of an answer for a sandbox with ``policy``."""
    answer: list[tuple[IPv4Address, int]] = []
    learn: list[tuple[IPv4Address, int]] = []
    refused: list[tuple[IPv4Address, Forbidden]] = []
    for addr, ttl in addrs:
        why = check(addr)
        if why is None:
            answer.append((addr, ttl))
            learn.append((addr, ttl))
        elif why.kind == "private" and opened_by_ip_rule(policy, addr):
            answer.append((addr, ttl))
        else:
            refused.append((addr, why))
    return AnswerFilter(answer, learn, refused)
