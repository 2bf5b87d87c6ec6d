"""E2B network options → hutch egress rules (enforced on the host as for every sandbox).

E2B: egress is open unless ``denyOut`` (CIDRs) or ``allow_internet_access: false``
closes it; ``allowOut`` (CIDRs, IPs, domains) punches holes and wins over ``denyOut``.
hutch: no rules = open; a rule list = exactly what it names (an allow-list). So:

- nothing denied (no ``denyOut``, internet access not refused) → open egress; an
  ``allowOut`` alone changes nothing (E2B allows everything then too);
- ``denyOut`` containing ``0.0.0.0/0`` (E2B's "all traffic"), or internet access
  refused → the ``allowOut`` entries as hutch rules (domains, ``*.domain``, IPs, CIDRs,
  each also with ``:port``), or ``deny-all`` when there are none;
- ``denyOut`` naming only some ranges ("open except these") has no hutch equivalent and
  is refused with a message saying what to send instead;
- ``dnsServers`` is accepted and changes nothing: a hutch sandbox's DNS always goes to
  hutch's own resolver, which answers the allowed names;
- per-host transform ``rules``, ``egressProxy``, ``maskRequestHost``, ``httpsPorts`` and
  ``allowPublicTraffic: true`` are refused (not offered by hutch; see the README).
"""

from __future__ import annotations

from typing import Any

from hutch.contract.egress import parse_rules
from hutch.e2b.errors import E2bError, unsupported
from hutch.errors import InvalidArgument

__all__ = ["ALL_TRAFFIC", "egress_rules"]

ALL_TRAFFIC = "0.0.0.0/0"

#: Refused fields: (what E2B does with it, what hutch offers instead).
_REFUSED: dict[str, tuple[str, str]] = {
    "rules": (
        "per-host request transforms",
        "hutch enforces egress by name and address (allowOut) and rewrites no requests",
    ),
    "egressProxy": (
        "tunnelling egress through a SOCKS5 proxy",
        "hutch's egress leaves the host directly after its own checks",
    ),
    "maskRequestHost": (
        "masks for public sandbox URLs",
        "hutch has no public sandbox URLs; expose a port with `hutch port expose`",
    ),
    "httpsPorts": (
        "public HTTPS sandbox URLs",
        "hutch has no public sandbox URLs; expose a port with `hutch port expose`",
    ),
}


def _strings(value: Any, field: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise E2bError(400, f"network.{field} must be a list of strings")
    return value


def egress_rules(network: dict[str, Any] | None, allow_internet: bool | None) -> list[str] | None:
    """hutch egress rules for E2B's ``network`` and ``allow_internet_access``: None for
    open egress, else the rule list (``["deny-all"]`` for none allowed)."""
    network = network or {}
    if not isinstance(network, dict):
        raise E2bError(400, "network must be an object")
    for key, (what, instead) in _REFUSED.items():
        if network.get(key) not in (None, {}, []):
            raise unsupported(f"network.{key} ({what})", instead)
    if network.get("allowPublicTraffic") is True:
        raise unsupported(
            "network.allowPublicTraffic=true",
            "hutch sandboxes have no public URLs and every call needs the sandbox's "
            "token; expose a port with `hutch port expose`",
        )
    _strings(network.get("dnsServers"), "dnsServers")
    allow = _strings(network.get("allowOut"), "allowOut")
    deny = _strings(network.get("denyOut"), "denyOut")
    closed = ALL_TRAFFIC in deny or allow_internet is False
    if not closed:
        if deny:
            raise E2bError(
                400,
                f"network.denyOut {deny} without {ALL_TRAFFIC!r}: hutch egress rules are an "
                f"allow-list, so deny all ({ALL_TRAFFIC!r} in denyOut) and list what is "
                "allowed in allowOut (domains, *.domains, IPs, CIDRs, each optionally :port)",
            )
        return None
    if ALL_TRAFFIC in allow:
        return None  # E2B: allowOut wins over denyOut
    if not allow:
        return ["deny-all"]
    try:
        parse_rules(allow)
    except InvalidArgument as exc:
        raise E2bError(400, f"network.allowOut: {exc.message}") from exc
    return list(allow)
