"""The contract suite (see ``test_contract.py``), networking: egress rules and policies,
ports, private networks, and what a fork keeps of them; each test runs against the fake
and the real app."""

from __future__ import annotations

from typing import Any

import pytest

from hutch.contract.limits import EGRESS_LOG_MAX, MAX_EGRESS_RULES
from hutch.errors import Conflict, InvalidArgument, NotFound
from tests.component.contract_target import Target, error
from tests.component.contract_target import target as target  # the fixture

pytestmark = pytest.mark.timeout(120)


async def test_egress_rules(target: Target) -> None:
    sb = await target.sandbox()
    info = await sb.egress.get()
    assert (info.rules, info.mode) == ([], "open")
    info = await sb.egress.set(["Good.Test.", "*.cdn.test:443", "198.18.0.0/15", "good.test"])
    assert (info.rules, info.mode) == (["good.test", "*.cdn.test:443", "198.18.0.0/15"], "rules")
    for bad, why in [
        ("good.test:99999", "port 99999 is out of 1-65535"),
        ("10.0.0.1/8", "has host bits set"),
        ("http://good.test", "without a scheme"),
    ]:
        r = await target.raw.put(f"/v1/sandboxes/{sb.id}/egress", json={"rules": [bad]})
        assert why in error(r, 400, "invalid_argument"), bad
    r = await target.raw.put(
        f"/v1/sandboxes/{sb.id}/egress", json={"rules": ["deny-all", "good.test"]}
    )
    assert '"deny-all" must be the only egress rule' in error(r, 400, "invalid_argument")
    too_many = [f"h{i}.test" for i in range(MAX_EGRESS_RULES + 1)]
    r = await target.raw.put(f"/v1/sandboxes/{sb.id}/egress", json={"rules": too_many})
    error(r, 400, "invalid_argument")
    assert (await sb.egress.get()).rules == ["good.test", "*.cdn.test:443", "198.18.0.0/15"]
    assert (await sb.egress.set(["deny-all"])).mode == "deny-all"
    assert (await sb.egress.clear()).mode == "open"
    assert await sb.egress.log() == []
    r = await target.raw.get(
        f"/v1/sandboxes/{sb.id}/egress/log", params={"limit": EGRESS_LOG_MAX + 1}
    )
    error(r, 400, "invalid_argument")
    await sb.kill()


DOCS_POLICY: dict[str, Any] = {
    "default": "deny",
    "rules": [
        {"action": "deny", "host": "evil.good.test"},
        {"action": "allow", "host": "*.Good.Test:443"},
        {"action": "allow", "host": "198.18.0.0/24"},
    ],
}
DOCS_CANONICAL: dict[str, Any] = {
    "default": "deny",
    "inspection": "none",
    "dry_run": False,
    "rules": [
        {"action": "deny", "host": "evil.good.test"},
        {"action": "allow", "host": "*.good.test:443"},
        {"action": "allow", "host": "198.18.0.0/24"},
    ],
}


async def test_ordered_egress_policies(target: Target) -> None:
    sb = await target.sandbox()
    info = await sb.set_egress(policy=DOCS_POLICY)
    assert info.policy == DOCS_CANONICAL and info.mode == "rules"
    assert info.rules == [
        "rules[0] deny evil.good.test",
        "rules[1] allow *.good.test:443",
        "rules[2] allow 198.18.0.0/24",
        "default deny",
    ]
    assert (await sb.egress.get()).policy == DOCS_CANONICAL
    url = f"/v1/sandboxes/{sb.id}/egress"
    for body, why in [
        ({"default": "deny", "rules": [{"action": "allow", "host": "a.test", "path": "/x"}]},
         "egress policy rules[0].path: needs the HTTP request"),
        ({"rules": [{"action": "allow", "host": "a.test"}, {"action": "permit", "host": "b"}]},
         "egress policy rules[1].action: 'permit' is not accepted; accepted: allow, deny"),
        ({"default": "allow", "inspection": "learn"}, 'default: "allow" with inspection'),
        ({"default": "allow", "rules": [{"action": "deny", "host": "a.test:22"}]},
         'a name cannot be denied on port 22 alone'),
        ({"default": "deny", "rules": ["good.test"]}, "rules[0]: 'good.test' is not an object"),
        ({"policy": "nope"}, "egress policy 'nope' does not exist"),
        ({}, 'give "rules" (a list), a policy'),
    ]:  # fmt: skip
        r = await target.raw.put(url, json=body)
        status, code = (404, "not_found") if "does not exist" in why else (400, "invalid_argument")
        assert why in error(r, status, code), body
    # Nothing changed; a plain list still means what it meant.
    assert (await sb.egress.get()).policy == DOCS_CANONICAL
    plain = await sb.egress.set(["good.test"])
    assert (plain.rules, plain.mode, plain.policy) == (["good.test"], "rules", None)
    assert (await sb.set_egress(policy={"default": "deny"})).mode == "deny-all"
    assert (await sb.set_egress(policy={"default": "allow"})).mode == "open"
    deny_list = {
        "default": "allow",
        "rules": [
            {"action": "deny", "host": "evil.test"},
            {"action": "deny", "host": "198.18.0.0/24"},
        ],
    }
    shown = await sb.set_egress(policy=deny_list)  # fmt: skip
    assert (shown.mode, shown.rules[-1]) == ("rules", "default allow"), shown
    with pytest.raises(InvalidArgument, match=r"rules\[0\]\.host"):  # checked before sending
        await sb.set_egress(policy={"rules": [{"action": "allow", "host": "a b"}]})
    await sb.kill()


async def test_named_egress_policies(target: Target) -> None:
    policies = target.client.egress_policies
    assert await policies.list() == []
    made = await policies.put("web", DOCS_POLICY)
    assert (made.name, made.project, made.policy) == ("web", "default", DOCS_CANONICAL)
    r = await target.raw.put("/v1/egress-policies/web", json={"default": "allow"})
    assert r.status_code == 200  # replaced (201 was the create)
    r = await target.raw.put("/v1/egress-policies/web", json=DOCS_POLICY)
    assert r.status_code == 200
    bad = {"rules": [{"action": "allow", "host": "a.test", "methods": ["G3T"]}]}
    r = await target.raw.put("/v1/egress-policies/web", json=bad)
    assert "rules[0].methods[0]" in error(r, 400, "invalid_argument")
    r = await target.raw.put("/v1/egress-policies/Bad_Name", json=DOCS_POLICY)
    error(r, 400, "invalid_argument")
    assert [p.name for p in await policies.list()] == ["web"]
    assert (await policies.get("web")).policy == DOCS_CANONICAL
    # Attached at create, and by PUT: a copy.
    sb = await target.sandbox(egress_policy="web")
    assert (await sb.egress.get()).policy == DOCS_CANONICAL
    other = await target.sandbox(egress={"default": "deny"})
    assert (await other.egress.get()).mode == "deny-all"
    assert (await other.set_egress(policy="web")).policy == DOCS_CANONICAL
    await policies.put("web", {"default": "allow"})
    assert (await sb.egress.get()).policy == DOCS_CANONICAL  # the copy stays
    await policies.delete("web")
    assert (await other.egress.get()).policy == DOCS_CANONICAL
    with pytest.raises(NotFound, match="egress policy 'web' does not exist"):
        await policies.get("web")
    with pytest.raises(NotFound):
        await target.sandbox(egress_policy="web")
    r = await target.raw.post("/v1/sandboxes", json={"egress": ["a.test"], "egress_policy": "web"})
    assert "not both" in error(r, 400, "invalid_argument")
    await sb.kill()
    await other.kill()


async def test_ports(target: Target) -> None:
    sb = await target.sandbox()
    port = await sb.ports.expose(8000)
    assert (port.port, port.host) == (8000, "127.0.0.1")
    assert port.url == f"http://127.0.0.1:{port.host_port}"
    assert [p.port for p in await sb.ports.list()] == [8000]
    await sb.ports.close(8000)
    with pytest.raises(NotFound, match=f"port 8000 of sandbox {sb.id} is not exposed"):
        await sb.ports.close(8000)
    # A paused sandbox keeps its network: a port can be exposed (it answers on resume).
    await sb.pause()
    assert (await sb.ports.expose(8001)).port == 8001
    offline = await target.sandbox(network="none")
    assert offline.info.network is not None and offline.info.network.address is None
    with pytest.raises(Conflict, match='has no network \\(created with network "none"\\)'):
        await offline.ports.expose(8000)
    with pytest.raises(Conflict, match='has no network \\(created with network "none"\\)'):
        await offline.egress.set(["good.test"])
    r = await target.raw.post(f"/v1/sandboxes/{sb.id}/ports", json={"port": 0})
    error(r, 400, "invalid_argument")
    await offline.kill()
    await sb.kill()


async def test_private_networks(target: Target) -> None:
    nets = target.client.networks
    team = await nets.create("team")
    assert (team.name, team.members) == ("team", [])
    assert team.id.startswith("net-")
    with pytest.raises(Conflict, match="a network named 'team' already exists"):
        await nets.create("team")
    r = await target.raw.post("/v1/networks", json={"name": "Not Valid"})
    assert "is not valid" in error(r, 400, "invalid_argument")
    with pytest.raises(NotFound, match="no network 'nope'"):
        await nets.get("nope")
    a = await target.sandbox(networks=["team"])
    b = await target.sandbox()
    assert (await b.networks.join(team.id)).members == sorted([a.id, b.id])
    assert (await nets.get("team")).members == sorted([a.id, b.id])
    assert await a.networks.list() == [team.id]
    with pytest.raises(Conflict, match=f"network {team.id} is in use by "):
        await nets.delete(team.id)
    await b.networks.leave("team")
    with pytest.raises(NotFound, match=f"sandbox {b.id} is not on network {team.id}"):
        await b.networks.leave("team")
    await a.kill()
    await b.kill()
    await nets.delete("team")
    assert await nets.list() == []


async def test_fork_keeps_rules_and_networks(target: Target) -> None:
    await target.client.networks.create("crew")
    sb = await target.sandbox(egress=["good.test"], networks=["crew"])
    (child,) = await sb.fork()
    assert (await child.egress.get()).rules == ["good.test"]
    assert child.info.network is not None and sb.info.network is not None
    assert child.info.network.networks == sb.info.network.networks
    assert child.info.network.address != sb.info.network.address
    await child.kill()
    await sb.kill()
