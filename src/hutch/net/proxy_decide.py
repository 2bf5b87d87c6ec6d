"""What the egress proxy decides, without I/O: a destination (name, port) by the rules,
and an HTTP request (plain, or inside TLS the proxy terminated) by the ordered rules,
with a transform's headers rendered, ``{secret:NAME}`` values included.

Every refusal is a :class:`Denied` whose ``reason`` goes into the 403 body and the
egress log, with the deciding rule's text and index when a rule decided. A secret's
value is never part of a reason: only its name is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from hutch.contract.egress_policy import HttpRequest
from hutch.net.http_head import HeadError, RequestHead, rewrite_fields
from hutch.net.rules import EgressPolicy, normalize_name

__all__ = [
    "Allowed",
    "Denied",
    "HttpFacts",
    "SecretResolver",
    "decide_destination",
    "decide_request",
    "inspects_tls",
    "observed",
    "path_of",
    "still_allowed",
    "terminates_tls",
]


class Denied(Exception):
    def __init__(self, reason: str, rule: str | None = None, index: int | None = None) -> None:
        super().__init__(reason)
        self.reason, self.rule, self.index = reason, rule, index


class SecretResolver(Protocol):
    """Where a transform's ``{secret:NAME}`` values come from: the secrets service's
    ``reveal(name, project)`` (raises when the secret does not exist)."""

    def reveal(self, name: str, project: str) -> str: ...


def path_of(target: str) -> str:
    """A request target's path without its query (for 403 bodies and the log)."""
    if "://" in target:
        rest = target.split("://", 1)[1]
        target = "/" + rest.split("/", 1)[1] if "/" in rest else "/"
    return target.split("?", 1)[0]


@dataclass(frozen=True)
class HttpFacts:
    """What the egress log keeps of an HTTP request: the method and the path without
    its query (query values can hold secrets)."""

    method: str | None = None
    path: str | None = None

    @classmethod
    def of(cls, request: RequestHead | None) -> HttpFacts:
        if request is None:
            return cls()
        return cls(request.method, path_of(request.target))


@dataclass(frozen=True)
class Allowed:
    """An allowed destination or request: the rule (text, index; None: the default or
    open egress), whether the request must be read to decide (``inspect``), and for a
    transform the rewritten head and the secret values it holds (to redact)."""

    rule: str | None
    index: int | None
    inspect: bool = False
    head: RequestHead | None = None
    secrets: tuple[str, ...] = ()
    #: Learn / dry run: what the policy would have done instead ("learn: would be
    #: denied: ..."); the log's reason for this allowed decision.
    note: str | None = None


def inspects_tls(policy: EgressPolicy) -> bool:
    """True when the proxy may terminate this sandbox's TLS, so its guest must trust the
    project's CA: inspection ``full`` and ``learn`` (every TLS connection), and
    ``partial`` with a request rule (methods, path, transform) that can apply to port
    443 (TLS to the names it matches; see :func:`terminates_tls`)."""
    o = policy.ordered
    if o is None:
        return False
    if o.inspection in ("full", "learn"):
        return True
    return o.inspection == "partial" and any(
        r.needs_http and r.host.port in (None, 443) for r in o.rules
    )


def terminates_tls(policy: EgressPolicy, name: str, port: int) -> bool:
    """Is this TLS connection (SNI ``name``, dialled ``port``) terminated? Under ``full``
    and ``learn`` always; under ``partial`` only when the first rule matching the
    destination needs the request (what the connection decision calls ``inspect``),
    so that rule, or a later one, can read it. Other TLS passes, its SNI checked."""
    o = policy.ordered
    if o is None:
        return False
    if o.inspection in ("full", "learn"):
        return True
    if o.inspection != "partial" or normalize_name(name) is None:
        return False
    return o.decide_connection(normalize_name(name), None, port).verdict == "inspect"


def observed(decide: Callable[[EgressPolicy], Allowed], policy: EgressPolicy) -> Allowed:
    """``decide(policy)``, except that under learn / dry run (:attr:`EgressPolicy.observe`)
    the policy it would enforce decides and a denial is turned into an allowance whose
    ``note`` says what would have happened (no rule index: it is not a rule's count)."""
    what = policy.observe
    if what is None:
        return decide(policy)
    try:
        return decide(policy.shadow())
    except Denied as denied:
        return Allowed(denied.rule, None, note=f"{what}: would be denied: {denied.reason}")


def still_allowed(policy: EgressPolicy, name: str, port: int) -> str | None:
    """None when ``policy`` allows ``name`` on ``port`` through the proxy; else why not."""
    if policy.mode == "open" and not policy.screened:
        return None
    if policy.mode == "deny-all":
        return "egress is now deny-all"
    if policy.screened and policy.ordered is not None:
        decided = policy.ordered.decide_connection(normalize_name(name), None, port)
        if decided.verdict == "deny" and decided.rule is not None:
            return f"{decided.rule.canonical} denies {name} on port {port}"
        return None
    if policy.match_name(name, port) is None:
        return f"no rule allows {name} on port {port} any more"
    return None


def decide_destination(policy: EgressPolicy, name: str, port: int) -> Allowed:
    """The destination's verdict; ``inspect`` when a rule needs the request. Raises
    Denied naming the rule (or the default)."""
    if normalize_name(name) is None:
        raise Denied(f"{name!r} is not a valid hostname")
    if policy.mode == "deny-all":
        raise Denied("egress is deny-all")
    if policy.mode == "open" and not policy.screened:
        return Allowed(None, None)
    if policy.ordered is None:
        rule = policy.match_name(name, port)
        if rule is None:
            raise Denied(f"no rule allows {name} on port {port}")
        return Allowed(rule.canonical, None)
    # Ordered: the first rule whose host matches decides, and a denial names it.
    decided = policy.ordered.decide_connection(name, None, port)
    if decided.verdict == "inspect":
        assert decided.rule is not None
        return Allowed(decided.rule.canonical, decided.rule.index, inspect=True)
    if decided.verdict != "allow":
        if decided.rule is None:
            raise Denied(f"no rule allows {name} on port {port} (the default is deny)")
        raise Denied(
            f"{decided.rule.canonical} denies {name} on port {port}",
            decided.rule.canonical,
            decided.rule.index,
        )
    if decided.rule is None:
        return Allowed(None, None)
    return Allowed(decided.rule.canonical, decided.rule.index)


def decide_request(
    policy: EgressPolicy,
    name: str,
    port: int,
    request: RequestHead,
    reveal: Callable[[str], str] | None,
) -> Allowed:
    """The request decides, first match in order (:meth:`OrderedPolicy.decide`); a
    transform gives the rewritten head, its ``{secret:NAME}`` values rendered by
    ``reveal`` (None: no secrets store; a missing secret is a denial naming it). A
    request carrying a ``{secret:`` placeholder itself is refused: only a transform rule
    bound to the host fills secrets, never the guest's own request."""
    if b"{secret:" in request.head.lower():
        raise Denied(
            "the request carries a {secret:...} placeholder; hutch fills secrets only "
            "through a transform rule bound to the host, never from the guest's request"
        )
    if policy.ordered is None:  # a rule list: the destination decided (checked already)
        return decide_destination(policy, name, port)
    decision = policy.ordered.decide(HttpRequest(name, None, port, request.method, request.target))
    what = f"{request.method} {path_of(request.target)} on {name}:{port}"
    if decision.rule is None:
        if decision.allowed:
            return Allowed(None, None)
        raise Denied(f"no rule allows {what} (the default is deny)")
    rule = decision.rule
    if not decision.allowed:
        raise Denied(f"{rule.canonical} denies {what}", rule.canonical, rule.index)
    if decision.action != "transform":
        return Allowed(rule.canonical, rule.index)
    used: list[str] = []

    def value(secret: str) -> str:
        if reveal is None:
            raise LookupError(f"secret {secret!r}: this daemon has no secrets store")
        try:
            text = reveal(secret)
        except Exception as exc:  # NotFound, SecretError: their texts name, never show
            raise LookupError(f"secret {secret!r} is not available: {exc}") from None
        used.append(text)
        return text

    try:
        values = [(n, tpl.render(value)) for n, tpl in rule.set_headers]
        head = rewrite_fields(request.head, values, rule.remove_headers)
    except (HeadError, LookupError) as exc:
        # HeadError's text names the header, never its value (see rewrite_fields).
        raise Denied(f"{rule.canonical} cannot transform: {exc}", rule.canonical) from None
    rewritten = dataclasses.replace(request, head=head)
    return Allowed(rule.canonical, rule.index, head=rewritten, secrets=tuple(used))
