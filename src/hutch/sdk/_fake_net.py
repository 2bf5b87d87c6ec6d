"""The networking part of :class:`hutch.sdk.testing.FakeHutch`: egress rules, counters and
log, exposed ports and private networks, as the REST contract describes them.

Nothing is enforced (no packets exist here). Rules are checked for their *form* only
(``host``, ``host:port``, ``*.host``, ``ip``, ``ip:port``, ``cidr``, ``cidr:port``, IPv6
in brackets with a port, ``deny-all`` alone) and stored in canonical form (lower case,
no trailing dot); a bad one is refused with 400 naming it and the old rules stay.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any
from urllib.parse import unquote

import httpx

from hutch.models import NAME_RE
from hutch.sdk._fake_state import TIME, FakeError, FakeSandbox, json_body, require

__all__ = ["FakeNet", "FakeNetwork", "canonical_rules"]

_ENDED = ("destroyed", "failed")
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_MAX_RULES = 256


def _host_ok(host: str) -> bool:
    try:
        ascii_host = host.encode("idna").decode("ascii")
    except UnicodeError:
        return False
    return 0 < len(ascii_host) <= 253 and all(_LABEL.match(p) for p in ascii_host.split("."))


def _canonical(rule: str) -> str:
    """The canonical text of one rule; ``ValueError`` with the reason if it is bad."""
    text = rule.strip().lower()
    port: int | None = None
    target = text
    if text.startswith("["):
        target, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError("a bracketed IPv6 address needs a port: [2001:db8::1]:443")
        port_text = rest[1:]
    elif text.count(":") == 1:
        target, _, port_text = text.partition(":")
    else:
        port_text = ""
    if port_text:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ValueError(f"port {port_text!r} is not 1-65535")
        port = int(port_text)
    suffix = f":{port}" if port is not None else ""
    try:
        net = ipaddress.ip_network(target, strict=False)
    except ValueError:
        net = None
    if net is not None:
        body = str(net) if "/" in target else str(net.network_address)
        return f"[{body}]{suffix}" if port is not None and net.version == 6 else body + suffix
    host = target.rstrip(".")
    wildcard = host.startswith("*.")
    name = host[2:] if wildcard else host
    if not _host_ok(name):
        raise ValueError("not a host name, IP address or CIDR")
    ascii_name = name.encode("idna").decode("ascii")
    return ("*." if wildcard else "") + ascii_name + suffix


def canonical_rules(rules: Any) -> list[str]:
    """Check a rule list as the daemon would; raise a 400 :class:`FakeError` if bad."""
    if not isinstance(rules, list) or not all(isinstance(r, str) and r for r in rules):
        raise FakeError(400, "invalid_argument", "rules must be a list of non-empty strings")
    if len(rules) > _MAX_RULES:
        raise FakeError(400, "invalid_argument", f"at most {_MAX_RULES} egress rules")
    if "deny-all" in rules:
        if len(rules) > 1:
            raise FakeError(400, "invalid_argument", "egress rule 'deny-all' must be the only rule")
        return ["deny-all"]
    out: list[str] = []
    for rule in rules:
        try:
            out.append(_canonical(rule))
        except ValueError as exc:
            raise FakeError(400, "invalid_argument", f"egress rule {rule!r}: {exc}") from None
    return out


def _mode(rules: list[str]) -> str:
    if not rules:
        return "open"
    return "deny-all" if rules == ["deny-all"] else "rules"


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

    # -- create and fork ------------------------------------------------------------

    def setup(self, sb: FakeSandbox, spec: dict[str, Any]) -> None:
        """Give a new sandbox what its create body asks for (raise 4xx if bad)."""
        mode = spec.get("network", "default")
        if mode not in ("default", "none"):
            raise FakeError(400, "invalid_argument", f"network={mode!r} is not 'default' or 'none'")
        egress = spec.get("egress")
        sb.egress = [] if egress is None else canonical_rules(egress)
        refs = spec.get("networks") or []
        if mode == "none" and (sb.egress or refs):
            raise FakeError(
                400,
                "invalid_argument",
                "network 'none' has no egress rules or private networks; drop "
                "egress/networks or use network 'default'",
            )
        sb.networks = [self.network(ref).id for ref in refs]
        self.assign_address(sb)

    def assign_address(self, sb: FakeSandbox) -> None:
        if sb.spec.get("network", "default") == "none":
            sb.address = None
            return
        offset = 4 * self._next_block + 2
        self._next_block += 1
        sb.address = f"10.213.{offset >> 8}.{offset & 0xFF}"

    def members(self, network_id: str) -> list[str]:
        return [
            sb.id
            for sb in self._sandboxes.values()
            if network_id in sb.networks and sb.state not in _ENDED
        ]

    # -- /v1/networks ---------------------------------------------------------------

    def network(self, ref: str) -> FakeNetwork:
        found = self.networks.get(ref) or next(
            (n for n in self.networks.values() if n.name == ref), None
        )
        if found is None:
            raise FakeError(404, "not_found", f"no network {ref!r} (by id net-... or name)")
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
                raise FakeError(
                    409,
                    "conflict",
                    f"network {net.name} ({net.id}) is in use by {', '.join(members)}; "
                    "make them leave it or delete them first",
                )
            del self.networks[net.id]
            for sb in self._sandboxes.values():
                if net.id in sb.networks:
                    sb.networks.remove(net.id)
            return httpx.Response(204)
        raise FakeError(404, "not_found", f"no route {method} {path}")

    def _create_network(self, body: dict[str, Any]) -> httpx.Response:
        if set(body) - {"name"}:
            raise FakeError(400, "invalid_argument", f"unknown fields {set(body) - {'name'}}")
        name = body.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise FakeError(
                400,
                "invalid_argument",
                f"name={name!r} is not valid; use 1-63 lowercase letters, digits and '-'",
            )
        if any(n.name == name for n in self.networks.values()):
            raise FakeError(409, "conflict", f"a network named {name!r} exists already")
        return httpx.Response(201, json=self.network_json(self.add_network(name)))

    # -- /v1/sandboxes/{id}/egress|ports|networks -----------------------------------

    def sandbox_route(
        self, sb: FakeSandbox, method: str, rest: str, request: httpx.Request
    ) -> httpx.Response:
        if rest == "/egress" and method == "GET":
            return httpx.Response(200, json=self.egress_json(sb))
        if rest == "/egress" and method == "PUT":
            body = json_body(request)
            require(sb, "creating", "running", "pausing", "paused", "resuming")
            rules = canonical_rules(body.get("rules"))
            self._require_network(sb)
            sb.egress = rules
            return httpx.Response(200, json=self.egress_json(sb))
        if rest == "/egress/log" and method == "GET":
            raw = request.url.params.get("limit", "100")
            if not raw.isdigit() or not 1 <= int(raw) <= 1000:
                raise FakeError(400, "invalid_argument", f"limit={raw!r}; accepted: 1-1000")
            return httpx.Response(200, json={"events": sb.egress_events[-int(raw) :]})
        if rest == "/ports":
            return self._ports(sb, method, request)
        match = re.fullmatch(r"/ports/(\d+)", rest)
        if match and method == "DELETE":
            port = int(match.group(1))
            if port not in sb.ports:
                raise FakeError(404, "not_found", f"port {port} of {sb.id} is not exposed")
            del sb.ports[port]
            return httpx.Response(204)
        if rest == "/networks" and method == "POST":
            ref = json_body(request).get("network")
            if not isinstance(ref, str) or not ref:
                raise FakeError(400, "invalid_argument", "network: a network id or name")
            net = self.network(ref)
            require(sb, "creating", "running", "pausing", "paused", "resuming")
            self._require_network(sb)
            if net.id not in sb.networks:
                sb.networks.append(net.id)
            return httpx.Response(200, json=self.network_json(net))
        match = re.fullmatch(r"/networks/([^/]+)", rest)
        if match and method == "DELETE":
            net = self.network(unquote(match.group(1)))
            if net.id not in sb.networks:
                raise FakeError(404, "not_found", f"sandbox {sb.id} is not on {net.id}")
            sb.networks.remove(net.id)
            return httpx.Response(204)
        raise FakeError(404, "not_found", f"no route {method} /v1/sandboxes/{sb.id}{rest}")

    @staticmethod
    def _require_network(sb: FakeSandbox) -> None:
        if sb.spec.get("network", "default") == "none":
            raise FakeError(
                409,
                "conflict",
                f"sandbox {sb.id} has no network (created with network 'none'); create it "
                "with network 'default' to use egress rules, ports or networks",
            )

    def egress_json(self, sb: FakeSandbox) -> dict[str, Any]:
        return {
            "rules": list(sb.egress),
            "mode": _mode(sb.egress),
            "allowed": sb.allowed,
            "denied": sb.denied,
            "rate_limited": sb.rate_limited,
            "log_dropped": sb.log_dropped,
        }

    def _ports(self, sb: FakeSandbox, method: str, request: httpx.Request) -> httpx.Response:
        if method == "GET":
            return httpx.Response(200, json={"ports": [sb.ports[p] for p in sorted(sb.ports)]})
        if method != "POST":
            raise FakeError(405, "method_not_allowed", f"{method} not allowed")
        port = json_body(request).get("port")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise FakeError(400, "invalid_argument", f"port={port!r}; accepted: 1-65535")
        self._require_network(sb)
        require(sb, "running")
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
