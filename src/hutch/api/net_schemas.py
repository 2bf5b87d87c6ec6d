"""Request and response bodies of the networking part of the REST API (issue 5).

Responses are built from the service's views (``hutch.contract.views``) by attribute: the
API layer talks to services only, so it reads the views' fields without importing the
network driver package (``tests/unit/test_layers.py``).
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hutch.contract.egress import RULE_FORMS
from hutch.contract.limits import (
    EGRESS_RULE_MAX_CHARS,
    ID_MAX_CHARS,
    MAX_EGRESS_RULES,
    MAX_NETWORKS_PER_SANDBOX,
    NAME_MAX_CHARS,
    PORT_RANGE,
)
from hutch.errors import InvalidArgument
from hutch.models import NetworkMode

__all__ = [
    "MAX_EGRESS_RULES",
    "MAX_NETWORKS_PER_SANDBOX",
    "DryRunEvent",
    "Egress",
    "EgressDryRun",
    "EgressEvent",
    "EgressLog",
    "EgressRuleText",
    "EgressRules",
    "EgressSuggestion",
    "JoinNetwork",
    "NamedPolicy",
    "NamedPolicyList",
    "Network",
    "NetworkList",
    "NetworkRef",
    "NetworkRequest",
    "PolicyDocument",
    "Port",
    "PortList",
    "PortRequest",
    "SandboxNet",
]

# The limits are the contract's (``hutch.contract.limits``); the rule grammar refuses more
# than MAX_EGRESS_RULES too, and bounding the body here keeps a huge list from reaching it.
EgressRuleText = Annotated[
    str,
    Field(
        min_length=1,
        max_length=EGRESS_RULE_MAX_CHARS,
        description=RULE_FORMS,
    ),
]
#: A private network's id (``net-<12 hex>``) or its name.
NetworkRef = Annotated[str, Field(min_length=1, max_length=ID_MAX_CHARS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _FromView(BaseModel):
    # Built from the service's frozen dataclasses by attribute.
    model_config = ConfigDict(from_attributes=True)


def _iso(ts: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(ts, dt.UTC)


# -- egress ---------------------------------------------------------------------------


_POLICY_RULE = (
    "a policy rule: `{action: allow|deny|transform, host, methods?, path?, set_headers?, "
    "remove_headers?}`; `host` in the rule forms above (name, `*.name`, ip, cidr, with "
    "`:port`); `path` a prefix on whole segments (`/docs`) or a glob (`/docs/*`); "
    "`set_headers` values literal or with `{secret:NAME}`"
)


class PolicyDocument(_Strict):
    """An ordered egress policy: the first rule that matches decides, else `default`."""

    default: str | None = Field(
        default=None, description="`allow` or `deny` (the default): when no rule matches."
    )
    inspection: str | None = Field(
        default=None,
        description="`none` (the default: addresses and names only), `partial` (plus "
        "requests by method and path and transforms where a rule needs them: TLS "
        "terminated for those names only), `full` (TLS terminated by "
        "hutch's proxy with the project's CA, which the guest trusts: every HTTP(S) request "
        "decided, transforms with `{secret:NAME}`), `learn` (everything passes; every "
        "proxied connection and request is logged, see `.../egress/suggest`).",
    )
    dry_run: bool | None = Field(
        default=None,
        description="Log what the policy would deny (`dry run: would be denied: ...`) "
        "without denying.",
    )
    rules: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=MAX_EGRESS_RULES,
        description="In order; each is " + _POLICY_RULE + ".",
    )


class EgressRules(_Strict):
    """Today's rule list (`{rules: ["good.test"]}`), an ordered policy (`{default,
    inspection, rules: [{action, host, ...}]}`), or a named policy (`{policy: name}`)."""

    rules: list[EgressRuleText | dict[str, Any]] | None = Field(
        default=None,
        max_length=MAX_EGRESS_RULES,
        description="Replaces every rule at once. Strings: today's list (`[]`: open egress; "
        '`["deny-all"]`: nothing leaves; any rule: only what a rule allows). Objects (with '
        "`default`/`inspection`): " + _POLICY_RULE + ". An invalid rule rejects the whole "
        "request (400 naming `rules[i].field`) and the old rules stay.",
    )
    default: str | None = Field(
        default=None, description=PolicyDocument.model_fields["default"].description
    )
    inspection: str | None = Field(
        default=None, description=PolicyDocument.model_fields["inspection"].description
    )
    dry_run: bool | None = Field(
        default=None, description=PolicyDocument.model_fields["dry_run"].description
    )
    policy: Annotated[str, Field(min_length=1, max_length=NAME_MAX_CHARS)] | None = Field(
        default=None,
        description="A named policy of the project (`/v1/egress-policies`) to copy; "
        "later edits of the named policy do not change this sandbox.",
    )

    def requested(self) -> tuple[list[str] | dict[str, Any] | None, str | None]:
        """(rule list or policy document, named policy) as the service takes them."""
        fields = {"default": self.default, "inspection": self.inspection, "dry_run": self.dry_run}
        given = {k: v for k, v in fields.items() if v is not None}
        rules = self.rules
        if self.policy is not None:
            if given or rules is not None:
                raise InvalidArgument(
                    'give either "policy" (a named policy) or the rules/policy fields, not both'
                )
            return None, self.policy
        if given or any(isinstance(r, dict) for r in rules or []):
            return {**given, "rules": list(rules or [])}, None
        if rules is None:
            raise InvalidArgument(
                'give "rules" (a list), a policy ("default", "inspection", "rules") or '
                '"policy" (a named policy)'
            )
        return [str(r) for r in rules], None


class NamedPolicy(_FromView):
    name: str
    project: str
    policy: dict[str, Any] = Field(description="The policy document, in canonical form.")
    created_at: dt.datetime
    updated_at: dt.datetime

    @classmethod
    def of(cls, view: Any) -> NamedPolicy:
        return cls(
            name=view.name,
            project=view.project,
            policy=view.policy,
            created_at=_iso(view.created_at),
            updated_at=_iso(view.updated_at),
        )


class NamedPolicyList(BaseModel):
    policies: list[NamedPolicy]


class Egress(_FromView):
    rules: list[str]
    mode: Literal["open", "rules", "deny-all"]
    allowed: int = Field(description="Connections and DNS answers let through.")
    denied: int = Field(description="Connections and DNS queries refused.")
    rate_limited: int = Field(
        description="DNS queries and new proxy connections refused by the per-sandbox rate "
        "limits (answered REFUSED, closed, or dropped by the kernel past twice the limit); "
        "not in `denied`. The egress log has one summary line per second about them."
    )
    log_dropped: int = Field(
        description="Of `denied`, packets past the sandbox's log budget: counted but not in "
        "the egress log one by one (a summary line there says how many)."
    )
    policy: dict[str, Any] | None = Field(
        default=None,
        description="The ordered policy in force, in canonical form (then `rules` has one "
        "line per rule and the default); null when the egress is a plain rule list.",
    )
    rule_counts: list[RuleCount] = Field(
        default_factory=list,
        description="Per rule of the ordered policy (by index; rules that decided nothing "
        "yet are left out): resolver answers and proxied connections it allowed or denied. "
        "They start from zero when the policy is replaced.",
    )

    @classmethod
    def of(cls, view: object) -> Egress:
        return cls.model_validate(view)


class RuleCount(_FromView):
    index: int = Field(description="The rule's index in `policy.rules`.")
    allowed: int
    denied: int


class EgressEvent(BaseModel):
    time: dt.datetime
    sandbox_id: str
    destination: str = Field(description="An IP address, or the name asked for (DNS).")
    port: int | None
    protocol: str
    name: str | None
    verdict: Literal["allow", "deny"]
    rule: str | None = Field(description="The rule that matched; null: none did.")
    reason: str
    method: str | None = Field(
        default=None, description="A plain-HTTP request's method (null: not HTTP)."
    )
    path: str | None = Field(
        default=None,
        description="A plain-HTTP request's path, without its query (query values may "
        "hold secrets and are never logged).",
    )
    rule_index: int | None = Field(
        default=None,
        description="The index of the ordered policy's rule that decided (null: a plain "
        "rule list, the default, or not a rule's decision).",
    )

    @classmethod
    def of(cls, event: object) -> EgressEvent:
        data = EgressEventView.model_validate(event)
        return cls(**{**data.model_dump(), "time": _iso(data.time)})


class EgressEventView(_FromView):
    """The view's fields as they are (``time`` in epoch seconds)."""

    time: float
    sandbox_id: str
    destination: str
    port: int | None
    protocol: str
    name: str | None
    verdict: Literal["allow", "deny"]
    rule: str | None
    reason: str
    method: str | None = None
    path: str | None = None
    rule_index: int | None = None


class EgressLog(BaseModel):
    events: list[EgressEvent] = Field(description="Oldest first.")


class EgressSuggestion(BaseModel):
    policy: dict[str, Any] = Field(
        description="The smallest ordered policy allowing exactly the proxied connections "
        "and requests in the sandbox's egress log (canonical; PUT it to apply)."
    )
    events: int = Field(description="How many logged decisions it was made from.")


class DryRunEvent(BaseModel):
    time: dt.datetime
    name: str
    port: int
    method: str | None
    path: str | None
    was: Literal["allow", "deny"] = Field(description="What was decided then.")
    would: Literal["allow", "deny"] = Field(description="What the policy would decide.")
    rule: str | None = Field(description="The policy's rule that would decide (null: default).")
    why: str


class EgressDryRun(BaseModel):
    results: list[DryRunEvent] = Field(description="Each logged proxied decision, oldest first.")
    would_deny: int = Field(description="How many of them the policy would deny.")


# -- inbound ports --------------------------------------------------------------------


class PortRequest(_Strict):
    port: Annotated[int, Field(ge=PORT_RANGE[0], le=PORT_RANGE[1], strict=True)]


class Port(_FromView):
    port: int = Field(description="The guest port.")
    host: str = Field(description="The host address it is reachable on.")
    host_port: int
    url: str

    @classmethod
    def of(cls, view: object) -> Port:
        return cls.model_validate(view)


class PortList(BaseModel):
    ports: list[Port]


# -- private networks -----------------------------------------------------------------


class NetworkRequest(_Strict):
    # The service checks the name's characters and says which are accepted.
    name: Annotated[str, Field(min_length=1, max_length=NAME_MAX_CHARS)]


class JoinNetwork(_Strict):
    network: NetworkRef


class _NetworkView(_FromView):
    id: str
    name: str
    created_at: float
    members: list[str]


class Network(BaseModel):
    id: str
    name: str
    created_at: dt.datetime
    members: list[str] = Field(description="Ids of the sandboxes on it.")

    @classmethod
    def of(cls, view: object) -> Network:
        data = _NetworkView.model_validate(view)
        return cls(
            id=data.id, name=data.name, created_at=_iso(data.created_at), members=data.members
        )


class NetworkList(BaseModel):
    networks: list[Network]


class SandboxNet(_FromView):
    """The ``network`` block of a sandbox."""

    mode: NetworkMode
    address: str | None = Field(description="The guest's IPv4 address; null with mode none.")
    networks: list[str] = Field(description="Ids of the private networks it is on.")

    @classmethod
    def of(cls, view: object) -> SandboxNet:
        return cls.model_validate(view)
