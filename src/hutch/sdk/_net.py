"""Networking in the SDK, sans-IO: egress rules, exposed ports, private networks.

:class:`NetCalls` builds each request on a :class:`ClientCore` and says how to read the
answer; the ``check_*`` functions check arguments before anything is sent (the create
fields use them too); the value types are what the calls return. The shells
(``sb.egress``, ``sb.ports``, ``sb.networks``, ``client.networks``) are in
``_async/net.py`` and, generated from it, ``_sync/net.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal
from urllib.parse import quote

from hutch.contract.egress import parse_rules
from hutch.contract.egress_policy_parse import parse_policy_document
from hutch.contract.enums import NetworkMode
from hutch.contract.limits import (
    DEFAULT_EGRESS_LOG_LIMIT,
    EGRESS_LOG_MAX,
    MAX_EGRESS_RULES,
    PORT_RANGE,
)
from hutch.contract.names import NAME_RE, validate_name
from hutch.errors import InvalidArgument
from hutch.sdk._core import Call, ClientCore, list_of, nothing, one
from hutch.sdk._values import iso, maybe, moment, need, strings

__all__ = [
    "EGRESS_LOG_MAX",
    "MAX_EGRESS_RULES",
    "DryRunEvent",
    "EgressEvent",
    "EgressInfo",
    "NetCalls",
    "NetworkInfo",
    "NetworkModeArg",
    "PortInfo",
    "check_egress",
    "check_log_limit",
    "check_policy",
    "check_policy_name",
    "check_port",
    "check_ref",
    "check_rules",
    "network_mode",
]

#: What ``create(network=...)`` takes.
NetworkModeArg = NetworkMode | Literal["default", "none"]


# -- checks before sending ------------------------------------------------------------


def check_egress(egress: Sequence[str] | Mapping[str, Any]) -> list[str] | dict[str, Any]:
    """A rule list (:func:`check_rules`) or an ordered policy document, checked with the
    daemon's own validation (``hutch.contract.egress_policy``) before sending."""
    if isinstance(egress, Mapping):
        return check_policy(egress)
    return check_rules(egress)


def check_policy(policy: Mapping[str, Any]) -> dict[str, Any]:
    """A policy document, checked with the daemon's own validation before sending."""
    if not isinstance(policy, Mapping):
        raise InvalidArgument(
            'an egress policy is a mapping {"default", "inspection", "rules": [...]}, '
            f"got {policy!r}"
        )
    doc = dict(policy)
    parse_policy_document(doc)
    return doc


def check_policy_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise InvalidArgument(
            f"egress policy name {name!r} is invalid: 1-63 lower-case letters, digits and "
            "'-', starting and ending with a letter or digit"
        )
    return name


def check_rules(rules: Sequence[str]) -> list[str]:
    # A bare string is a sequence too: set("good.test") would send one rule per letter.
    if isinstance(rules, str | bytes) or not isinstance(rules, Sequence):
        raise InvalidArgument(
            f"egress rules must be a list of strings such as ['good.test', '*.good.test:443'], "
            f"got {rules!r}"
        )
    texts = list(rules)
    bad = [r for r in texts if not isinstance(r, str) or not r.strip()]
    if bad:
        raise InvalidArgument(f"egress rule {bad[0]!r} is not a non-empty string")
    if len(texts) > MAX_EGRESS_RULES:
        raise InvalidArgument(
            f"{len(texts)} egress rules; at most {MAX_EGRESS_RULES} are accepted "
            "(use a wildcard or a CIDR to cover several)"
        )
    # The daemon's own grammar: a bad rule is named exactly as the daemon would, unsent.
    # The texts go as written; the daemon stores the canonical form.
    parse_rules(texts)
    return texts


def check_port(port: int) -> int:
    lo, hi = PORT_RANGE
    if isinstance(port, bool) or not isinstance(port, int) or not lo <= port <= hi:
        raise InvalidArgument(f"port={port!r} is not a TCP port; accepted: {lo}-{hi}")
    return port


def check_ref(value: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{what} must be a network id (net-...) or name, got {value!r}")
    return value


def network_mode(mode: str) -> NetworkMode:
    try:
        return NetworkMode(mode)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in NetworkMode)
        raise InvalidArgument(f"network={mode!r} is not one of {choices}") from None


def check_log_limit(limit: int) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= EGRESS_LOG_MAX:
        raise InvalidArgument(f"limit={limit!r} is out of range; accepted: 1-{EGRESS_LOG_MAX}")
    return limit


# -- values ---------------------------------------------------------------------------


@dataclass(frozen=True)
class EgressInfo:
    """A sandbox's egress rules as the daemon enforces them.

    ``mode``: ``"open"`` (no rules: everything but the always-denied set may leave),
    ``"rules"`` (only what a rule matches) or ``"deny-all"``. ``rules`` are the canonical
    texts (lower-case, punycode names). ``allowed``/``denied`` count connections and DNS
    answers since the daemon started; ``rate_limited`` the DNS queries and new proxy
    connections refused by the per-sandbox rate limits (not in ``denied``);
    ``log_dropped`` the denials past the sandbox's log budget (counted in ``denied``, not
    in the egress log one by one). A daemon that predates the last two gives 0.
    """

    rules: list[str]
    mode: str
    allowed: int
    denied: int
    rate_limited: int = 0
    log_dropped: int = 0
    #: The ordered policy in force (canonical document); None for a plain rule list
    #: (``rules`` then are its rules; for a policy they are one line per rule).
    policy: dict[str, Any] | None = None
    #: Per rule of the ordered policy: ``{"index", "allowed", "denied"}`` (resolver
    #: answers and proxied connections; rules that decided nothing yet left out).
    rule_counts: list[dict[str, int]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, obj: Any) -> EgressInfo:
        w = "egress"
        return cls(
            rules=strings(obj, "rules", w),
            mode=need(obj, "mode", str, w),
            allowed=need(obj, "allowed", int, w),
            denied=need(obj, "denied", int, w),
            rate_limited=maybe(obj, "rate_limited", int, w) or 0,
            log_dropped=maybe(obj, "log_dropped", int, w) or 0,
            policy=maybe(obj, "policy", dict, w),
            rule_counts=[dict(c) for c in (maybe(obj, "rule_counts", list, w) or [])],
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "rules": list(self.rules),
            "mode": self.mode,
            "allowed": self.allowed,
            "denied": self.denied,
            "rate_limited": self.rate_limited,
            "log_dropped": self.log_dropped,
            "policy": self.policy,
            "rule_counts": [dict(c) for c in self.rule_counts],
        }


@dataclass(frozen=True)
class EgressEvent:
    """One egress decision. ``destination`` is an IP address (or, for DNS, the name
    asked for); ``name`` the host name when known (SNI, Host, DNS); ``verdict``
    ``"allow"`` or ``"deny"``; ``rule`` the matching rule (None: no rule matched);
    ``reason`` says why in words."""

    time: datetime | None
    sandbox_id: str
    destination: str
    port: int | None
    protocol: str
    name: str | None
    verdict: str
    rule: str | None
    reason: str
    #: Plain HTTP through the proxy: the method and the path without its query.
    method: str | None = None
    path: str | None = None
    #: The ordered policy's rule that decided (its index), None otherwise.
    rule_index: int | None = None

    @classmethod
    def from_dict(cls, obj: Any) -> EgressEvent:
        w = "egress event"
        return cls(
            time=moment(obj, "time", w),
            sandbox_id=need(obj, "sandbox_id", str, w),
            destination=need(obj, "destination", str, w),
            port=maybe(obj, "port", int, w),
            protocol=need(obj, "protocol", str, w),
            name=maybe(obj, "name", str, w),
            verdict=need(obj, "verdict", str, w),
            rule=maybe(obj, "rule", str, w),
            reason=need(obj, "reason", str, w),
            method=maybe(obj, "method", str, w),
            path=maybe(obj, "path", str, w),
            rule_index=maybe(obj, "rule_index", int, w),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": iso(self.time),
            "sandbox_id": self.sandbox_id,
            "destination": self.destination,
            "port": self.port,
            "protocol": self.protocol,
            "name": self.name,
            "verdict": self.verdict,
            "rule": self.rule,
            "reason": self.reason,
            "method": self.method,
            "path": self.path,
            "rule_index": self.rule_index,
        }


def _egress_body(
    rules: Sequence[str] | None, policy: Mapping[str, Any] | str | None
) -> dict[str, Any]:
    if (rules is None) == (policy is None):
        raise InvalidArgument("give either rules (a list) or policy (a document or a name)")
    if isinstance(policy, str):
        return {"policy": check_policy_name(policy)}
    if policy is not None:
        return check_policy(policy)
    assert rules is not None
    return {"rules": check_rules(rules)}


@dataclass(frozen=True)
class DryRunEvent:
    """One logged proxied decision decided again under another policy: what ``was``
    decided then, what the policy ``would`` decide (``"allow"``/``"deny"``), by which
    ``rule`` (None: its default) and ``why``."""

    time: datetime | None
    name: str
    port: int
    method: str | None
    path: str | None
    was: str
    would: str
    rule: str | None
    why: str

    @classmethod
    def from_dict(cls, obj: Any) -> DryRunEvent:
        w = "dry-run event"
        return cls(
            time=moment(obj, "time", w),
            name=need(obj, "name", str, w),
            port=need(obj, "port", int, w),
            method=maybe(obj, "method", str, w),
            path=maybe(obj, "path", str, w),
            was=need(obj, "was", str, w),
            would=need(obj, "would", str, w),
            rule=maybe(obj, "rule", str, w),
            why=need(obj, "why", str, w),
        )

    def to_dict(self) -> dict[str, Any]:
        keys = ("name", "port", "method", "path", "was", "would", "rule", "why")
        return {"time": iso(self.time), **{k: getattr(self, k) for k in keys}}


@dataclass(frozen=True)
class PortInfo:
    """An exposed guest ``port``, reachable at ``host``:``host_port`` (``url``)."""

    port: int
    host: str
    host_port: int
    url: str

    @classmethod
    def from_dict(cls, obj: Any) -> PortInfo:
        w = "port"
        return cls(
            port=need(obj, "port", int, w),
            host=need(obj, "host", str, w),
            host_port=need(obj, "host_port", int, w),
            url=need(obj, "url", str, w),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"port": self.port, "host": self.host, "host_port": self.host_port, "url": self.url}


@dataclass(frozen=True)
class NetworkInfo:
    """A private network: ``id`` (``net-<12 hex>``), its unique ``name`` and the ids of
    the sandboxes on it (``members``)."""

    id: str
    name: str
    created_at: datetime | None
    members: list[str]

    @classmethod
    def from_dict(cls, obj: Any) -> NetworkInfo:
        w = "network"
        return cls(
            id=need(obj, "id", str, w),
            name=need(obj, "name", str, w),
            created_at=moment(obj, "created_at", w),
            members=strings(obj, "members", w),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "created_at": iso(self.created_at),
            "members": list(self.members),
        }


@dataclass(frozen=True)
class NamedPolicyInfo:
    """A named egress policy of the project (``client.egress_policies``); ``policy`` is
    its document in canonical form. Sandboxes get a copy when it is attached."""

    name: str
    project: str
    policy: dict[str, Any]
    created_at: datetime | None
    updated_at: datetime | None

    @classmethod
    def from_dict(cls, obj: Any) -> NamedPolicyInfo:
        w = "egress policy"
        return cls(
            name=need(obj, "name", str, w),
            project=need(obj, "project", str, w),
            policy=need(obj, "policy", dict, w),
            created_at=moment(obj, "created_at", w),
            updated_at=moment(obj, "updated_at", w),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "project": self.project,
            "policy": dict(self.policy),
            "created_at": iso(self.created_at),
            "updated_at": iso(self.updated_at),
        }


# -- requests -------------------------------------------------------------------------


class NetCalls:
    """Builds every networking request of API v1 and reads every answer. No I/O."""

    def __init__(self, core: ClientCore) -> None:
        self.core = core

    def _sandbox(self, sandbox_id: str, suffix: str) -> str:
        return self.core.sandbox_path(sandbox_id, suffix)

    # -- egress -----------------------------------------------------------------------

    def egress_get(self, sandbox_id: str) -> Call[EgressInfo]:
        req = self.core.request("GET", self._sandbox(sandbox_id, "/egress"))
        return Call(req, one(EgressInfo.from_dict))

    def egress_set(
        self,
        sandbox_id: str,
        rules: Sequence[str] | None = None,
        policy: Mapping[str, Any] | str | None = None,
    ) -> Call[EgressInfo]:
        """``rules`` (today's list), or ``policy``: a policy document or a named policy."""
        body = _egress_body(rules, policy)
        req = self.core.request("PUT", self._sandbox(sandbox_id, "/egress"), json_body=body)
        return Call(req, one(EgressInfo.from_dict))

    def egress_suggest(self, sandbox_id: str) -> Call[dict[str, Any]]:
        req = self.core.request("GET", self._sandbox(sandbox_id, "/egress/suggest"))
        return Call(req, one(lambda obj: dict(need(obj, "policy", dict, "egress suggestion"))))

    def egress_dry_run(
        self,
        sandbox_id: str,
        rules: Sequence[str] | None = None,
        policy: Mapping[str, Any] | str | None = None,
    ) -> Call[list[DryRunEvent]]:
        """The egress log decided again under ``rules`` or ``policy`` (as for set)."""
        body = _egress_body(rules, policy)
        req = self.core.request(
            "POST", self._sandbox(sandbox_id, "/egress/dry-run"), json_body=body
        )
        return Call(req, list_of("results", DryRunEvent.from_dict))

    def egress_log(
        self, sandbox_id: str, limit: int = DEFAULT_EGRESS_LOG_LIMIT
    ) -> Call[list[EgressEvent]]:
        check_log_limit(limit)
        req = self.core.request(
            "GET", self._sandbox(sandbox_id, "/egress/log"), params=[("limit", str(limit))]
        )
        return Call(req, list_of("events", EgressEvent.from_dict))

    # -- named egress policies ----------------------------------------------------------

    @staticmethod
    def _policy_path(name: str) -> str:
        return f"/v1/egress-policies/{quote(check_policy_name(name), safe='')}"

    def put_policy(self, name: str, policy: Mapping[str, Any]) -> Call[NamedPolicyInfo]:
        req = self.core.request("PUT", self._policy_path(name), json_body=check_policy(policy))
        return Call(req, one(NamedPolicyInfo.from_dict))

    def get_policy(self, name: str) -> Call[NamedPolicyInfo]:
        return Call(
            self.core.request("GET", self._policy_path(name)), one(NamedPolicyInfo.from_dict)
        )

    def list_policies(self) -> Call[list[NamedPolicyInfo]]:
        req = self.core.request("GET", "/v1/egress-policies")
        return Call(req, list_of("policies", NamedPolicyInfo.from_dict))

    def delete_policy(self, name: str) -> Call[None]:
        return Call(self.core.request("DELETE", self._policy_path(name)), nothing)

    # -- ports ------------------------------------------------------------------------

    def expose_port(self, sandbox_id: str, port: int) -> Call[PortInfo]:
        body = {"port": check_port(port)}
        req = self.core.request("POST", self._sandbox(sandbox_id, "/ports"), json_body=body)
        return Call(req, one(PortInfo.from_dict))

    def list_ports(self, sandbox_id: str) -> Call[list[PortInfo]]:
        req = self.core.request("GET", self._sandbox(sandbox_id, "/ports"))
        return Call(req, list_of("ports", PortInfo.from_dict))

    def close_port(self, sandbox_id: str, port: int) -> Call[None]:
        path = self._sandbox(sandbox_id, f"/ports/{check_port(port)}")
        return Call(self.core.request("DELETE", path), nothing)

    # -- private networks -------------------------------------------------------------

    def _network_path(self, network: str) -> str:
        return f"/v1/networks/{quote(check_ref(network, 'network'), safe='')}"

    def create_network(self, name: str) -> Call[NetworkInfo]:
        if not isinstance(name, str):
            raise InvalidArgument(f"network name must be a string, got {name!r}")
        body = {"name": validate_name(name)}
        req = self.core.request("POST", "/v1/networks", json_body=body)
        return Call(req, one(NetworkInfo.from_dict))

    def list_networks(self) -> Call[list[NetworkInfo]]:
        req = self.core.request("GET", "/v1/networks")
        return Call(req, list_of("networks", NetworkInfo.from_dict))

    def get_network(self, network: str) -> Call[NetworkInfo]:
        req = self.core.request("GET", self._network_path(network))
        return Call(req, one(NetworkInfo.from_dict))

    def delete_network(self, network: str) -> Call[None]:
        return Call(self.core.request("DELETE", self._network_path(network)), nothing)

    def join_network(self, sandbox_id: str, network: str) -> Call[NetworkInfo]:
        body = {"network": check_ref(network, "network")}
        req = self.core.request("POST", self._sandbox(sandbox_id, "/networks"), json_body=body)
        return Call(req, one(NetworkInfo.from_dict))

    def leave_network(self, sandbox_id: str, network: str) -> Call[None]:
        ref = quote(check_ref(network, "network"), safe="")
        path = self._sandbox(sandbox_id, f"/networks/{ref}")
        return Call(self.core.request("DELETE", path), nothing)
