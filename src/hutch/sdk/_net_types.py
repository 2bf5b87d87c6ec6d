"""What the networking calls return: egress rules and log, exposed ports, private networks.

Like :mod:`hutch.sdk._types`: frozen values parsed from the API's JSON, with
``to_dict()`` giving back the API form (what the CLI's ``--json`` prints).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from hutch.sdk._errors import ProtocolError
from hutch.sdk._types import _get, _iso, _opt, _time

__all__ = ["EgressEvent", "EgressInfo", "NetworkInfo", "PortInfo"]


def _str_list(obj: Any, key: str, what: str) -> list[str]:
    items = _get(obj, key, list, what)
    if not all(isinstance(item, str) for item in items):
        raise ProtocolError(f"{what}: field {key!r} must be a list of strings, got {items!r}")
    return list(items)


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

    @classmethod
    def from_dict(cls, obj: Any) -> EgressInfo:
        w = "egress"
        return cls(
            rules=_str_list(obj, "rules", w),
            mode=_get(obj, "mode", str, w),
            allowed=_get(obj, "allowed", int, w),
            denied=_get(obj, "denied", int, w),
            rate_limited=_opt(obj, "rate_limited", int, w) or 0,
            log_dropped=_opt(obj, "log_dropped", int, w) or 0,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "rules": list(self.rules),
            "mode": self.mode,
            "allowed": self.allowed,
            "denied": self.denied,
            "rate_limited": self.rate_limited,
            "log_dropped": self.log_dropped,
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

    @classmethod
    def from_dict(cls, obj: Any) -> EgressEvent:
        w = "egress event"
        return cls(
            time=_time(obj, "time", w),
            sandbox_id=_get(obj, "sandbox_id", str, w),
            destination=_get(obj, "destination", str, w),
            port=_opt(obj, "port", int, w),
            protocol=_get(obj, "protocol", str, w),
            name=_opt(obj, "name", str, w),
            verdict=_get(obj, "verdict", str, w),
            rule=_opt(obj, "rule", str, w),
            reason=_get(obj, "reason", str, w),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": _iso(self.time),
            "sandbox_id": self.sandbox_id,
            "destination": self.destination,
            "port": self.port,
            "protocol": self.protocol,
            "name": self.name,
            "verdict": self.verdict,
            "rule": self.rule,
            "reason": self.reason,
        }


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
            port=_get(obj, "port", int, w),
            host=_get(obj, "host", str, w),
            host_port=_get(obj, "host_port", int, w),
            url=_get(obj, "url", str, w),
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
            id=_get(obj, "id", str, w),
            name=_get(obj, "name", str, w),
            created_at=_time(obj, "created_at", w),
            members=_str_list(obj, "members", w),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "created_at": _iso(self.created_at),
            "members": list(self.members),
        }
