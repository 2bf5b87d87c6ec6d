"""The result views the REST layer renders: what the networking use cases return to the
API, MCP and CLI layers (pure data; the REST schemas read them by attribute)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from hutch.contract.egress import EgressMode
from hutch.contract.enums import NetworkMode

__all__ = [
    "DenialSpike",
    "EgressEvent",
    "EgressMode",
    "EgressView",
    "NetworkMode",
    "NetworkView",
    "PortView",
    "RuleCount",
    "SandboxNetView",
    "Verdict",
]

Verdict = Literal["allow", "deny"]


@dataclass(frozen=True)
class EgressView:
    rules: list[str]
    mode: EgressMode
    allowed: int  # connections (and DNS answers) let through since the daemon started
    denied: int
    # DNS queries and new proxy connections refused by the per-sandbox rate limits (by the
    # daemon, or dropped by the kernel's ceiling); not in ``denied``.
    rate_limited: int = 0
    # Of ``denied``, packets past the sandbox's log budget: counted, not logged one by one.
    log_dropped: int = 0
    # The ordered policy in force (``hutch.contract.egress_policy``, canonical document);
    # None when the egress is a plain rule list.
    policy: dict[str, Any] | None = None
    # Per rule of the ordered policy, by index (rules that decided nothing yet omitted).
    rule_counts: tuple[RuleCount, ...] = ()


@dataclass(frozen=True)
class EgressEvent:
    """One egress decision. ``rule`` is the matching rule's text (None: no rule matched);
    ``reason`` says why in words (e.g. "no rule allows this name", "always denied: SMTP")."""

    time: float  # UNIX epoch seconds
    sandbox_id: str
    destination: str  # an IP address, or the name asked for (DNS)
    port: int | None
    protocol: str  # "tcp", "udp", "icmp", "dns", "http", "tls", ...
    name: str | None
    verdict: Verdict
    rule: str | None
    reason: str
    # HTTP requests the proxy read (plain HTTP): the method and the path without its
    # query (query values can hold secrets); None otherwise.
    method: str | None = None
    path: str | None = None
    # The index of the ordered policy's rule that decided (``rules[i]``); None: a plain
    # rule list, the policy's default, or not a rule's decision.
    rule_index: int | None = None


@dataclass(frozen=True)
class RuleCount:
    """Decisions an ordered policy's rule made (resolver answers and proxied connections
    and requests; packets nft drops are counted in ``EgressView.denied`` only)."""

    index: int
    allowed: int
    denied: int


@dataclass(frozen=True)
class DenialSpike:
    """A sandbox's denials passed the spike threshold in one minute."""

    time: float  # UNIX epoch seconds, when the threshold was passed
    sandbox_id: str
    denials: int  # in the minute so far
    threshold: int
    last: EgressEvent  # the denial that passed it


@dataclass(frozen=True)
class PortView:
    port: int  # the guest port
    host: str  # the host address it is reachable on
    host_port: int
    url: str  # http://host:host_port


@dataclass(frozen=True)
class NetworkView:
    id: str  # net-<12 hex>
    name: str
    created_at: float
    members: list[str] = field(default_factory=list)  # sandbox ids


@dataclass(frozen=True)
class SandboxNetView:
    """The network part of a sandbox as the API shows it."""

    mode: NetworkMode
    address: str | None  # the guest's IPv4 address; None with mode none
    networks: list[str] = field(default_factory=list)  # private network ids
