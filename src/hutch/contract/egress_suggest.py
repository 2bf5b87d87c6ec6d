"""From a sandbox's egress log to a policy, and a policy against the log (pure).

``inspection: learn`` lets everything out and logs every proxied connection and request
(name, port, and under TLS termination or plain HTTP the method and the path without
its query). :func:`suggest_policy` turns those into the smallest ordered policy that
would have allowed exactly them: one ``allow`` per (host:port, path) with the methods
seen, a host:port rule where no request was read (TLS passed through), default deny,
and the inspection the rules need (``full`` when an HTTPS request was read, ``partial``
for plain HTTP only, else ``none``). :func:`dry_run` decides each logged proxied
decision again under another policy: what it would allow and deny, by which rule.

Only what passed the proxy (web ports 80/443) is in the log; DNS lookups and other
ports are not suggested (learn lets them pass unrecorded).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from hutch.contract.egress_http import HttpRequest, normalize_request_path
from hutch.contract.egress_policy import OrderedPolicy
from hutch.contract.egress_policy_parse import parse_policy_document
from hutch.contract.limits import MAX_EGRESS_RULES
from hutch.contract.views import EgressEvent
from hutch.errors import InvalidArgument

__all__ = ["DryRunResult", "dry_run", "list_as_policy", "suggest_policy"]

_PROXIED = ("http", "https", "tls")


def _proxied(events: Iterable[EgressEvent]) -> list[EgressEvent]:
    return [
        e
        for e in events
        if e.protocol in _PROXIED and e.name and e.port is not None and e.name != "-"
    ]


def suggest_policy(events: Iterable[EgressEvent]) -> dict[str, Any]:
    """The policy document (canonical, validated) allowing exactly what ``events``
    allowed. Raises InvalidArgument when that takes more rules than a policy holds."""
    hosts: dict[tuple[str, int], dict[str, set[str]]] = {}
    order: list[tuple[str, int]] = []
    tls_read = http_read = False
    for e in _proxied(events):
        if e.verdict != "allow":
            continue
        assert e.name is not None and e.port is not None
        key = (e.name.lower().rstrip("."), e.port)
        if key not in hosts:
            hosts[key] = {}
            order.append(key)
        if e.method is None or e.path is None or e.port not in (80, 443):
            # The destination alone (requests are read on the web ports only).
            hosts[key].setdefault("", set())
            continue
        path = normalize_request_path(e.path)
        if path is None or "*" in path:
            hosts[key].setdefault("", set())
            continue
        hosts[key].setdefault(path, set()).add(e.method)
        if e.protocol == "https":
            tls_read = True
        else:
            http_read = True
    rules: list[dict[str, Any]] = []
    for name, port in order:
        paths = hosts[(name, port)]
        if "" in paths or not paths:
            rules.append({"action": "allow", "host": f"{name}:{port}"})
            continue
        for path in sorted(paths):
            rules.append(
                {
                    "action": "allow",
                    "host": f"{name}:{port}",
                    "methods": sorted(paths[path]),
                    "path": path,
                }
            )
    if len(rules) > MAX_EGRESS_RULES:
        raise InvalidArgument(
            f"the log needs {len(rules)} rules, more than a policy holds "
            f"({MAX_EGRESS_RULES}); write a policy with wildcards or path globs instead"
        )
    inspection = "full" if tls_read else "partial" if http_read else "none"
    doc = {"default": "deny", "inspection": inspection, "rules": rules}
    return parse_policy_document(doc).document()


def list_as_policy(texts: list[str]) -> OrderedPolicy:
    """Today's rule list (canonical texts) as the ordered policy it means: ``[]`` open,
    ``["deny-all"]`` nothing, else allow each and deny the rest."""
    if not texts:
        return parse_policy_document({"default": "allow"})
    allow = [{"action": "allow", "host": t} for t in texts if t != "deny-all"]
    return parse_policy_document({"default": "deny", "rules": allow})


@dataclass(frozen=True)
class DryRunResult:
    """One logged decision decided again: what it was, what ``policy`` would do."""

    time: float
    name: str
    port: int
    method: str | None
    path: str | None
    was: Literal["allow", "deny"]
    would: Literal["allow", "deny"]
    rule: str | None
    why: str


def dry_run(policy: OrderedPolicy, events: Iterable[EgressEvent]) -> list[DryRunResult]:
    """Each proxied decision of ``events`` under ``policy`` (first match wins). A rule
    that needs the request, for a connection whose request was not read (TLS without
    inspection), is reported as denied: that is what the proxy would do."""
    out: list[DryRunResult] = []
    for e in _proxied(events):
        assert e.name is not None and e.port is not None
        if e.method is not None and e.path is not None:
            d = policy.decide(HttpRequest(e.name, None, e.port, e.method, e.path))
            would: Literal["allow", "deny"] = "allow" if d.allowed else "deny"
            rule, why = (d.rule.canonical if d.rule else None), d.why
        else:
            c = policy.decide_connection(e.name, None, e.port)
            rule = c.rule.canonical if c.rule else None
            if c.verdict == "inspect":
                would, why = "deny", f"{rule} needs the request, which was not read"
            else:
                would = "allow" if c.verdict == "allow" else "deny"
                why = f"{rule} matched" if rule else f"no rule matched; the default is {would}"
        was: Literal["allow", "deny"] = "allow" if e.verdict == "allow" else "deny"
        out.append(DryRunResult(e.time, e.name, e.port, e.method, e.path, was, would, rule, why))
    return out
