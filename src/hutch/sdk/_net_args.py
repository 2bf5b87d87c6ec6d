"""Checks of networking arguments, before anything is sent (shared by the core's create
and the networking calls in :mod:`hutch.sdk._net`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from hutch.contract.limits import EGRESS_LOG_MAX, MAX_EGRESS_RULES
from hutch.errors import InvalidArgument
from hutch.models import NetworkMode

__all__ = [
    "EGRESS_LOG_MAX",
    "MAX_EGRESS_RULES",
    "NetworkModeArg",
    "check_log_limit",
    "check_port",
    "check_ref",
    "check_rules",
    "create_fields",
]

#: What ``create(network=...)`` takes.
NetworkModeArg = NetworkMode | Literal["default", "none"]


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
    return texts


def check_port(port: int) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidArgument(f"port={port!r} is not a TCP port; accepted: 1-65535")
    return port


def check_ref(value: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{what} must be a network id (net-...) or name, got {value!r}")
    return value


def _network_mode(mode: str) -> NetworkMode:
    try:
        return NetworkMode(mode)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in NetworkMode)
        raise InvalidArgument(f"network={mode!r} is not one of {choices}") from None


def create_fields(
    network: str | None, egress: Sequence[str] | None, networks: Sequence[str] | None
) -> dict[str, Any]:
    """The networking fields of a create body. Each is sent only when it differs from
    the default, so a daemon that predates networking still accepts plain creates."""
    body: dict[str, Any] = {}
    mode = _network_mode(network) if network is not None else NetworkMode.DEFAULT
    if mode is not NetworkMode.DEFAULT:
        body["network"] = mode.value
    if egress is not None:
        body["egress"] = check_rules(egress)
    if networks:
        if isinstance(networks, str):
            raise InvalidArgument(f"networks must be a list of ids or names, got {networks!r}")
        body["networks"] = [check_ref(n, "networks item") for n in networks]
    return body


def check_log_limit(limit: int) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= EGRESS_LOG_MAX:
        raise InvalidArgument(f"limit={limit!r} is out of range; accepted: 1-{EGRESS_LOG_MAX}")
    return limit
