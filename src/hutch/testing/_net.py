"""The networking part of :class:`hutch.testing.FakeHutch`: egress rules, counters and
log, exposed ports and private networks, as the REST contract describes them.

Nothing is enforced (no packets exist here). Rules are parsed with the daemon's own
grammar (:mod:`hutch.contract.egress`), so they are accepted, refused (400 naming the
rule; the old rules stay) and stored in canonical form exactly as the daemon does.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from typing import Any, Literal
from urllib.parse import unquote

import httpx

from hutch.contract.egress import canonical_rules as _canonical_rules
from hutch.contract.egress import mode_of
from hutch.contract.egress_policy_parse import parse_policy_document, require_available
from hutch.contract.egress_suggest import dry_run, list_as_policy, suggest_policy
from hutch.contract.enums import DEFAULT_NETWORK_MODE, NetworkMode
from hutch.contract.limits import (
    DEFAULT_EGRESS_LOG_LIMIT,
    EGRESS_LOG_MAX,
    MAX_NETWORKS_PER_SANDBOX,
    PORT_RANGE,
)
from hutch.contract.names import NAME_RE, NETWORK_ID_RE, check_range
from hutch.contract.views import EgressEvent
from hutch.errors import Conflict, InvalidArgument, NotFound
from hutch.testing._state import TIME, FakeError, FakeSandbox, json_body

__all__ = ["FakeNet", "FakeNetwork", "canonical_rules"]

_ENDED = ("destroyed", "failed")


def _iso(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat().replace("+00:00", "Z")


def canonical_rules(rules: Any) -> list[str]:
    """Check a rule list as the daemon does; raise InvalidArgument (400) if bad."""
    if not isinstance(rules, list) or not all(isinstance(r, str) and r for r in rules):
        raise InvalidArgument("rules must be a list of non-empty strings")
    return _canonical_rules(rules)


class FakeNetwork:
    def __init__(self, id: str, name: str) -> None:
        self.id, self.name = id, name


class FakeNet:
    """Networks and ports of the fake daemon; the per-sandbox state lives on
    :class:`FakeSandbox` (``egress``, ``ports``, ``networks``, counters, events)."""

    def __init__(self, sandboxes: dict[str, FakeSandbox]) -> None:
        self._sandboxes = sandboxes
        self.networks: dict[str, FakeNetwork] = {}
        self._network_counter = 0
        self._next_host_port = 40000
        self._next_block = 1  # block 0 of the pool is never used, as in the daemon
        #: Named egress policies (API form, project 'default'), by name.
        self.policies: dict[str, dict[str, Any]] = {}

    # -- create and fork ------------------------------------------------------------

    def setup(self, sb: FakeSandbox, spec: dict[str, Any]) -> None:
        """Give a new sandbox what its create body asks for (raise 4xx if bad)."""
        mode = spec.get("network", DEFAULT_NETWORK_MODE.value)
        if mode not in {m.value for m in NetworkMode}:
            choices = ", ".join(repr(m.value) for m in NetworkMode)
            raise InvalidArgument(f"network={mode!r} is not one of {choices}")
        egress, named = spec.get("egress"), spec.get("egress_policy")
        if named is not None and egress:
            raise InvalidArgument(
                'give either "egress" (rules or a policy) or "egress_policy" (a named '
                "policy), not both"
            )
        sb.egress_doc = None
        if named is not None:
            self._apply(sb, self._named(named)["policy"])
        else:
            self._apply(sb, [] if egress is None else egress)
        refs = spec.get("networks") or []
        if mode == NetworkMode.NONE and (sb.egress or named or refs):
            raise InvalidArgument(
                'network "none" has no egress rules or private networks; drop '
                '"egress"/"networks" or use network "default"'
            )
        if len(refs) > MAX_NETWORKS_PER_SANDBOX:
            raise InvalidArgument(
                f"{len(refs)} networks given; a sandbox joins at most {MAX_NETWORKS_PER_SANDBOX}"
            )
        sb.networks = list(dict.fromkeys(self.network(ref).id for ref in refs))
        self.assign_address(sb)

    def assign_address(self, sb: FakeSandbox) -> None:
        if sb.spec.get("network", DEFAULT_NETWORK_MODE.value) == NetworkMode.NONE:
            sb.address = None
            return
        offset = 4 * self._next_block + 2
        self._next_block += 1
        sb.address = f"10.213.{offset >> 8}.{offset & 0xFF}"

    def members(self, network_id: str) -> list[str]:
        return sorted(
            sb.id
            for sb in self._sandboxes.values()
            if network_id in sb.networks and sb.state not in _ENDED
        )

    # -- /v1/networks ---------------------------------------------------------------

    def network(self, ref: str) -> FakeNetwork:
        found = self.networks.get(ref) or next(
            (n for n in self.networks.values() if n.name == ref), None
        )
        if found is None:
            raise NotFound(f"no network {ref!r}; GET /v1/networks lists them")
        return found

    def network_json(self, net: FakeNetwork) -> dict[str, Any]:
        return {"id": net.id, "name": net.name, "created_at": TIME, "members": self.members(net.id)}

    def add_network(self, name: str) -> FakeNetwork:
        self._network_counter += 1
        net = FakeNetwork(f"net-{self._network_counter:012x}", name)
        self.networks[net.id] = net
        return net

    def networks_route(self, method: str, path: str, request: httpx.Request) -> httpx.Response:
        if path == "/v1/networks":
            if method == "GET":
                found = [self.network_json(n) for n in self.networks.values()]
                return httpx.Response(200, json={"networks": found})
            if method == "POST":
                return self._create_network(json_body(request))
        match = re.fullmatch(r"/v1/networks/([^/]+)", path)
        if match and method in ("GET", "DELETE"):
            net = self.network(unquote(match.group(1)))
            if method == "GET":
                return httpx.Response(200, json=self.network_json(net))
            members = self.members(net.id)
            if members:
                raise Conflict(
                    f"network {net.id} is in use by {', '.join(members)}; take them off it "
                    f"(DELETE /v1/sandboxes/{{id}}/networks/{net.id}) or delete them first"
                )
            del self.networks[net.id]
            for sb in self._sandboxes.values():
                if net.id in sb.networks:
                    sb.networks.remove(net.id)
            return httpx.Response(204)
        raise NotFound(f"no route {method} {path}")

    def _create_network(self, body: dict[str, Any]) -> httpx.Response:
        if set(body) - {"name"}:
            raise InvalidArgument(f"unknown fields {sorted(set(body) - {'name'})}")
        name = body.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise InvalidArgument(
                f"network name {name!r} is not valid; use 1-63 lower-case letters, digits "
                "and '-', starting and ending with a letter or digit"
            )
        if NETWORK_ID_RE.match(name):
            raise InvalidArgument(f"network name {name!r} looks like a network id; pick another")
        if any(n.name == name for n in self.networks.values()):
            raise Conflict(f"a network named {name!r} already exists; choose another name")
        return httpx.Response(201, json=self.network_json(self.add_network(name)))

    # -- /v1/sandboxes/{id}/egress|ports|networks -----------------------------------

    def sandbox_route(
        self, sb: FakeSandbox, method: str, rest: str, request: httpx.Request
    ) -> httpx.Response:
        if rest == "/egress" and method == "GET":
            return httpx.Response(200, json=self.egress_json(sb))
        if rest == "/egress" and method == "PUT":
            wanted = self._requested(json_body(request))
            self._require_network(sb)
            self._apply(sb, wanted)
            return httpx.Response(200, json=self.egress_json(sb))
        if rest == "/egress/log" and method == "GET":
            raw = request.url.params.get("limit", str(DEFAULT_EGRESS_LOG_LIMIT))
            limit = check_range("limit", int(raw) if raw.isdigit() else -1, (1, EGRESS_LOG_MAX))
            return httpx.Response(200, json={"events": sb.egress_events[-limit:]})
        if rest == "/egress/suggest" and method == "GET":
            policy = suggest_policy(self._events(sb))
            return httpx.Response(200, json={"policy": policy, "events": len(sb.egress_events)})
        if rest == "/egress/dry-run" and method == "POST":
            wanted = self._requested(json_body(request))
            if isinstance(wanted, dict):
                ordered = parse_policy_document(wanted)
                require_available(ordered)
            else:
                ordered = list_as_policy(canonical_rules(wanted))
            results = [
                {**dataclasses.asdict(r), "time": _iso(r.time)}
                for r in dry_run(ordered, self._events(sb))
            ]
            would_deny = sum(r["would"] == "deny" for r in results)
            return httpx.Response(200, json={"results": results, "would_deny": would_deny})
        if rest == "/ports":
            return self._ports(sb, method, request)
        match = re.fullmatch(r"/ports/(\d+)", rest)
        if match and method == "DELETE":
            port = int(match.group(1))
            if port not in sb.ports:
                raise NotFound(
                    f"port {port} of sandbox {sb.id} is not exposed; "
                    f"GET /v1/sandboxes/{sb.id}/ports lists those that are"
                )
            del sb.ports[port]
            return httpx.Response(204)
        if rest == "/networks" and method == "POST":
            ref = json_body(request).get("network")
            if not isinstance(ref, str) or not ref:
                raise InvalidArgument("network: a network id or name")
            self._require_network(sb)
            net = self.network(ref)
            if net.id not in sb.networks and len(sb.networks) >= MAX_NETWORKS_PER_SANDBOX:
                raise Conflict(
                    f"sandbox {sb.id} is already on {len(sb.networks)} networks (the most)"
                )
            if net.id not in sb.networks:
                sb.networks.append(net.id)
            return httpx.Response(200, json=self.network_json(net))
        match = re.fullmatch(r"/networks/([^/]+)", rest)
        if match and method == "DELETE":
            net = self.network(unquote(match.group(1)))
            if net.id not in sb.networks:
                raise NotFound(f"sandbox {sb.id} is not on network {net.id} ({net.name})")
            sb.networks.remove(net.id)
            return httpx.Response(204)
        raise NotFound(f"no route {method} /v1/sandboxes/{sb.id}{rest}")

    @staticmethod
    def _require_network(sb: FakeSandbox) -> None:
        # As in the daemon, a deleted sandbox has given its network back: same answer.
        mode = sb.spec.get("network", DEFAULT_NETWORK_MODE.value)
        if mode == NetworkMode.NONE or sb.state in _ENDED:
            raise Conflict(
                f'sandbox {sb.id} has no network (created with network "none"); '
                'create it with network "default" to use egress rules, ports or networks'
            )

    # -- ordered and named policies (the daemon's validation, nothing enforced) -----

    def _requested(self, body: dict[str, Any]) -> Any:
        """What PUT .../egress asks for, read as the daemon's EgressRules does."""
        unknown = sorted(set(body) - {"rules", "default", "inspection", "dry_run", "policy"})
        if unknown:
            raise InvalidArgument(f"{unknown[0]}: unknown field")
        given = {
            k: body[k] for k in ("default", "inspection", "dry_run") if body.get(k) is not None
        }
        rules = body.get("rules")
        if body.get("policy") is not None:
            if given or rules is not None:
                raise InvalidArgument(
                    'give either "policy" (a named policy) or the rules/policy fields, not both'
                )
            return self._named(str(body["policy"]))["policy"]
        if given or any(isinstance(r, dict) for r in rules or []):
            return {**given, "rules": list(rules or [])}
        if rules is None:
            raise InvalidArgument(
                'give "rules" (a list), a policy ("default", "inspection", "rules") or '
                '"policy" (a named policy)'
            )
        return rules

    @staticmethod
    def _events(sb: FakeSandbox) -> list[EgressEvent]:
        """The fake's log (API form, as tests put it) as the contract's views."""
        out = []
        for e in sb.egress_events:
            when = e.get("time")
            seconds = dt.datetime.fromisoformat(when).timestamp() if isinstance(when, str) else 0.0
            verdict: Literal["allow", "deny"] = "allow" if e.get("verdict") == "allow" else "deny"
            where = (e.get("destination", ""), e.get("port"), e.get("protocol", ""), e.get("name"))
            said = (e.get("rule"), e.get("reason", ""), e.get("method"), e.get("path"))
            out.append(EgressEvent(seconds, sb.id, *where, verdict, *said, e.get("rule_index")))
        return out

    @staticmethod
    def _apply(sb: FakeSandbox, wanted: Any) -> None:
        if isinstance(wanted, dict):
            policy = parse_policy_document(wanted)
            require_available(policy)
            sb.egress, sb.egress_doc = policy.lines(), policy.document()
        else:
            sb.egress, sb.egress_doc = canonical_rules(wanted), None

    def _named(self, name: str) -> dict[str, Any]:
        found = self.policies.get(name)
        if found is None:
            raise NotFound(
                f"egress policy {name!r} does not exist in project 'default'; "
                "create it with PUT /v1/egress-policies/{name}"
            )
        return found

    def policies_route(self, method: str, path: str, request: httpx.Request) -> httpx.Response:
        if path == "/v1/egress-policies" and method == "GET":
            found = [self.policies[n] for n in sorted(self.policies)]
            return httpx.Response(200, json={"policies": found})
        match = re.fullmatch(r"/v1/egress-policies/([^/]+)", path)
        if not match:
            raise NotFound(f"no route {method} {path}")
        name = unquote(match.group(1))
        if not NAME_RE.match(name):
            raise InvalidArgument(f"egress policy name {name!r} is invalid")
        if method == "GET":
            return httpx.Response(200, json=self._named(name))
        if method == "DELETE":
            self._named(name)
            del self.policies[name]
            return httpx.Response(204)
        if method == "PUT":
            body = json_body(request)
            unknown = sorted(set(body) - {"rules", "default", "inspection", "dry_run"})
            if unknown:
                raise InvalidArgument(f"{unknown[0]}: unknown field")
            policy = parse_policy_document({k: v for k, v in body.items() if v is not None})
            require_available(policy)
            old = self.policies.get(name)
            now = TIME
            row = {
                "name": name,
                "project": "default",
                "policy": policy.document(),
                "created_at": old["created_at"] if old else now,
                "updated_at": now,
            }
            self.policies[name] = row
            return httpx.Response(201 if old is None else 200, json=row)
        raise NotFound(f"no route {method} {path}")

    def egress_json(self, sb: FakeSandbox) -> dict[str, Any]:
        return {
            "rules": list(sb.egress),
            "mode": parse_policy_document(sb.egress_doc).mode
            if sb.egress_doc is not None
            else mode_of(sb.egress),
            "policy": sb.egress_doc,
            "rule_counts": [],
            "allowed": sb.allowed,
            "denied": sb.denied,
            "rate_limited": sb.rate_limited,
            "log_dropped": sb.log_dropped,
        }

    def _ports(self, sb: FakeSandbox, method: str, request: httpx.Request) -> httpx.Response:
        if method == "GET":
            return httpx.Response(200, json={"ports": [sb.ports[p] for p in sorted(sb.ports)]})
        if method != "POST":
            raise FakeError(405, "method_not_allowed", "Method Not Allowed")
        port = json_body(request).get("port")
        lo, hi = PORT_RANGE
        if isinstance(port, bool) or not isinstance(port, int) or not lo <= port <= hi:
            raise InvalidArgument(f"port {port!r} is not a TCP port; accepted: {lo}-{hi}")
        self._require_network(sb)
        if port not in sb.ports:
            host_port = self._next_host_port
            self._next_host_port += 1
            sb.ports[port] = {
                "port": port,
                "host": "127.0.0.1",
                "host_port": host_port,
                "url": f"http://127.0.0.1:{host_port}",
            }
        return httpx.Response(201, json=sb.ports[port])
