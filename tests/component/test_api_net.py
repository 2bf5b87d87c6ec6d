"""The networking REST API (egress, ports, private networks, the create fields and the
sandbox's `network` block) against the real service and NetworkManager.

The manager runs with its in-memory dataplane (no taps, no nftables: those need root and
are proven in tests/privileged and tests/vm); its resolver and proxy listen on loopback
ports but nothing here sends them traffic. Exposed ports really listen on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hutch.config import Settings
from hutch.contract.views import DenialSpike, EgressEvent, Verdict
from hutch.net.dataplane import MemoryDataplane
from hutch.net.nft_apply import SandboxCounters
from hutch.services.composed import Services
from tests.component.conftest import started_services

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def service(settings: Settings, tmp_path: Path) -> AsyncIterator[Services]:
    """The conftest's service, plus a NetworkManager on the in-memory dataplane."""
    async with started_services(settings, tmp_path, networked=True) as svc:
        yield svc


async def create(api: httpx.AsyncClient, **body: object) -> dict[str, Any]:
    r = await api.post("/v1/sandboxes", json=body)
    assert r.status_code == 201, r.text
    data: dict[str, Any] = r.json()
    return data


def can_bind(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:``port`` (no packet is sent)."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["code"] == code, body
    message: str = body["message"]
    return message


# -- create and the sandbox's network block -------------------------------------------


async def test_default_network_block(api: httpx.AsyncClient, settings: Settings) -> None:
    sb = await create(api)
    net = sb["network"]
    assert (net["mode"], net["networks"]) == ("default", [])
    assert ipaddress.IPv4Address(net["address"]) in settings.net_pool
    r = await api.get(f"/v1/sandboxes/{sb['id']}")
    assert r.json()["network"] == net
    listed = (await api.get("/v1/sandboxes")).json()["sandboxes"]
    assert [s["network"] for s in listed] == [net]
    other = await create(api)
    assert other["network"]["address"] != net["address"]


async def test_network_none(api: httpx.AsyncClient) -> None:
    sb = await create(api, network="none")
    assert sb["network"] == {"mode": "none", "address": None, "networks": []}
    r = await api.get(f"/v1/sandboxes/{sb['id']}/egress")
    assert r.status_code == 200 and r.json()["mode"] == "open"
    for r in (
        await api.put(f"/v1/sandboxes/{sb['id']}/egress", json={"rules": ["deny-all"]}),
        await api.post(f"/v1/sandboxes/{sb['id']}/ports", json={"port": 80}),
    ):
        assert "network" in error(r, 409, "conflict")
    r = await api.post("/v1/sandboxes", json={"network": "none", "egress": ["good.test"]})
    assert "drop" in error(r, 400, "invalid_argument")
    r = await api.post("/v1/sandboxes", json={"network": "bridge"})
    assert "network" in error(r, 400, "invalid_argument")


async def test_create_with_egress_rules(api: httpx.AsyncClient) -> None:
    sb = await create(api, egress=["Good.Test.", "*.cdn.test:443", "198.18.0.0/15"])
    r = await api.get(f"/v1/sandboxes/{sb['id']}/egress")
    assert r.status_code == 200, r.text
    assert r.json() == {
        "rules": ["good.test", "*.cdn.test:443", "198.18.0.0/15"],
        "mode": "rules",
        "allowed": 0,
        "denied": 0,
        "rate_limited": 0,
        "log_dropped": 0,
        "policy": None,
        "rule_counts": [],
    }


async def test_create_with_a_bad_rule_creates_nothing(
    api: httpx.AsyncClient, service: Services
) -> None:
    r = await api.post("/v1/sandboxes", json={"egress": ["good.test", "bad host"]})
    assert "bad host" in error(r, 400, "invalid_argument")
    r = await api.post("/v1/sandboxes", json={"egress": ["x"] * 257})
    assert "egress" in error(r, 400, "invalid_argument")
    r = await api.post("/v1/sandboxes", json={"egress": "good.test"})
    error(r, 400, "invalid_argument")
    assert service.sandboxes.list_sandboxes() == []


# -- egress ---------------------------------------------------------------------------


async def test_egress_put_get_and_bad_rules_keep_the_old(api: httpx.AsyncClient) -> None:
    sb = await create(api)
    url = f"/v1/sandboxes/{sb['id']}/egress"
    assert (await api.get(url)).json() == {
        "rules": [],
        "mode": "open",
        "allowed": 0,
        "denied": 0,
        "rate_limited": 0,
        "log_dropped": 0,
        "policy": None,
        "rule_counts": [],
    }
    r = await api.put(url, json={"rules": ["good.test", "[2001:db8::1]:443"]})
    assert r.status_code == 200, r.text
    assert (r.json()["mode"], len(r.json()["rules"])) == ("rules", 2)
    r = await api.put(url, json={"rules": ["other.test", "good.test:99999"]})
    assert "good.test:99999" in error(r, 400, "invalid_argument")
    r = await api.put(url, json={"rules": ["deny-all", "good.test"]})
    assert "deny-all" in error(r, 400, "invalid_argument")
    assert (await api.get(url)).json()["rules"][0] == "good.test"
    r = await api.put(url, json={"rules": ["deny-all"]})
    assert r.json()["mode"] == "deny-all"
    r = await api.put(url, json={"rules": []})
    assert r.json()["mode"] == "open"
    r = await api.put(url, json={"rules": ["a.test"], "extra": 1})
    error(r, 400, "invalid_argument")


async def test_egress_log_shape_and_limit(api: httpx.AsyncClient) -> None:
    sb = await create(api)
    url = f"/v1/sandboxes/{sb['id']}/egress/log"
    r = await api.get(url)
    assert r.status_code == 200 and r.json() == {"events": []}
    for bad in ("0", "1001", "x"):
        error(await api.get(url, params={"limit": bad}), 400, "invalid_argument")


async def test_egress_log_and_counters_show_recorded_decisions(
    api: httpx.AsyncClient, service: Services
) -> None:
    sb = await create(api, egress=["good.test"])
    assert service.core.net is not None
    # What the resolver and the proxy record (they are exercised in test_net_*.py).
    service.core.net.log.record(
        EgressEvent(
            1_800_000_000.25,
            sb["id"],
            "good.test",
            None,
            "dns",
            "good.test",
            "allow",
            "good.test",
            "a rule allows this name",
        )
    )
    service.core.net.log.record(
        EgressEvent(
            1_800_000_001.5,
            sb["id"],
            "198.18.0.7",
            443,
            "tls",
            "bad.test",
            "deny",
            None,
            "no rule allows this name",
        )
    )
    url = f"/v1/sandboxes/{sb['id']}/egress"
    r = await api.get(f"{url}/log")
    assert r.status_code == 200, r.text
    assert r.json()["events"] == [
        {
            "time": "2027-01-15T08:00:00.250000Z",
            "sandbox_id": sb["id"],
            "destination": "good.test",
            "port": None,
            "protocol": "dns",
            "name": "good.test",
            "verdict": "allow",
            "rule": "good.test",
            "reason": "a rule allows this name",
            "method": None,
            "path": None,
            "rule_index": None,
        },
        {
            "time": "2027-01-15T08:00:01.500000Z",
            "sandbox_id": sb["id"],
            "destination": "198.18.0.7",
            "port": 443,
            "protocol": "tls",
            "name": "bad.test",
            "verdict": "deny",
            "rule": None,
            "reason": "no rule allows this name",
            "method": None,
            "path": None,
            "rule_index": None,
        },
    ]
    newest = (await api.get(f"{url}/log", params={"limit": 1})).json()["events"]
    assert [e["verdict"] for e in newest] == ["deny"]
    counters = (await api.get(url)).json()
    assert (counters["allowed"], counters["denied"]) == (1, 1)


async def test_egress_of_a_missing_sandbox_is_404(api: httpx.AsyncClient) -> None:
    for r in (
        await api.get("/v1/sandboxes/sb-000000000999/egress"),
        await api.put("/v1/sandboxes/sb-000000000999/egress", json={"rules": []}),
        await api.get("/v1/sandboxes/sb-000000000999/egress/log"),
        await api.get("/v1/sandboxes/sb-000000000999/ports"),
    ):
        error(r, 404, "not_found")


# -- ports ----------------------------------------------------------------------------


async def test_ports_expose_list_close(api: httpx.AsyncClient) -> None:
    sb = await create(api)
    url = f"/v1/sandboxes/{sb['id']}/ports"
    assert (await api.get(url)).json() == {"ports": []}
    r = await api.post(url, json={"port": 8000})
    assert r.status_code == 201, r.text
    port = r.json()
    assert (port["port"], port["host"]) == (8000, "127.0.0.1")
    assert port["url"] == f"http://127.0.0.1:{port['host_port']}"
    # The host side really listens. Checked by binding, not connecting: a connection
    # would be forwarded to the guest address, which leads nowhere in this tier.
    assert not can_bind(port["host_port"])
    again = await api.post(url, json={"port": 8000})
    assert again.json() == port  # exposing twice gives the same port
    assert (await api.get(url)).json() == {"ports": [port]}
    assert (await api.delete(f"{url}/8000")).status_code == 204
    assert (await api.get(url)).json() == {"ports": []}
    assert "not exposed" in error(await api.delete(f"{url}/8000"), 404, "not_found")
    for bad in (0, 65536, "80", True):
        error(await api.post(url, json={"port": bad}), 400, "invalid_argument")
    error(await api.delete(f"{url}/0"), 400, "invalid_argument")


async def test_deleting_a_sandbox_closes_its_ports(api: httpx.AsyncClient) -> None:
    sb = await create(api)
    port = (await api.post(f"/v1/sandboxes/{sb['id']}/ports", json={"port": 22})).json()
    assert not can_bind(port["host_port"])
    assert (await api.delete(f"/v1/sandboxes/{sb['id']}")).status_code == 204
    assert can_bind(port["host_port"])


# -- private networks -----------------------------------------------------------------


async def test_networks_crud(api: httpx.AsyncClient) -> None:
    r = await api.post("/v1/networks", json={"name": "team-a"})
    assert r.status_code == 201, r.text
    net = r.json()
    assert net["id"].startswith("net-") and len(net["id"]) == len("net-") + 12
    assert (net["name"], net["members"]) == ("team-a", [])
    assert net["created_at"].endswith("Z") or "+00:00" in net["created_at"]
    assert (await api.get(f"/v1/networks/{net['id']}")).json() == net
    assert (await api.get("/v1/networks/team-a")).json() == net
    assert (await api.get("/v1/networks")).json() == {"networks": [net]}
    error(await api.post("/v1/networks", json={"name": "team-a"}), 409, "conflict")
    for bad in ("Team_A", "", "-x"):
        error(await api.post("/v1/networks", json={"name": bad}), 400, "invalid_argument")
    assert (await api.delete("/v1/networks/team-a")).status_code == 204
    error(await api.get(f"/v1/networks/{net['id']}"), 404, "not_found")
    error(await api.delete(f"/v1/networks/{net['id']}"), 404, "not_found")


async def test_join_leave_and_delete_while_in_use(api: httpx.AsyncClient) -> None:
    net = (await api.post("/v1/networks", json={"name": "team"})).json()
    a = await create(api, networks=["team"])
    assert a["network"]["networks"] == [net["id"]]
    b = await create(api, name="web")
    r = await api.post(f"/v1/sandboxes/{b['id']}/networks", json={"network": net["id"]})
    assert r.status_code == 200, r.text
    assert sorted(r.json()["members"]) == sorted([a["id"], b["id"]])
    shown = (await api.get(f"/v1/sandboxes/{b['id']}")).json()["network"]
    assert shown["networks"] == [net["id"]]
    message = error(await api.delete(f"/v1/networks/{net['id']}"), 409, "conflict")
    assert net["id"] in message
    r = await api.delete(f"/v1/sandboxes/{b['id']}/networks/team")
    assert r.status_code == 204
    r = await api.delete(f"/v1/sandboxes/{b['id']}/networks/team")
    error(r, 404, "not_found")
    assert (await api.get(f"/v1/networks/{net['id']}")).json()["members"] == [a["id"]]
    # A deleted sandbox leaves its networks, and the network can go.
    assert (await api.delete(f"/v1/sandboxes/{a['id']}")).status_code == 204
    assert (await api.get(f"/v1/networks/{net['id']}")).json()["members"] == []
    assert (await api.delete(f"/v1/networks/{net['id']}")).status_code == 204


async def test_join_errors(api: httpx.AsyncClient) -> None:
    r = await api.post("/v1/sandboxes", json={"networks": ["nope"]})
    assert "nope" in error(r, 404, "not_found")
    sb = await create(api)
    r = await api.post(f"/v1/sandboxes/{sb['id']}/networks", json={"network": "nope"})
    error(r, 404, "not_found")
    r = await api.post(f"/v1/sandboxes/{sb['id']}/networks", json={})
    error(r, 400, "invalid_argument")
    none = await create(api, network="none")
    await api.post("/v1/networks", json={"name": "team"})
    r = await api.post(f"/v1/sandboxes/{none['id']}/networks", json={"network": "team"})
    error(r, 409, "conflict")


# -- the SDK end to end over HTTP --------------------------------------------------------


async def test_sdk_against_the_real_api(api: httpx.AsyncClient) -> None:
    from hutch.sdk import AsyncSandbox

    sb = await AsyncSandbox.create(
        egress=["good.test"], base_url=str(api.base_url), api_key=api.headers["Authorization"][7:]
    )
    async with sb:
        assert sb.info.network is not None and sb.info.network.mode == "default"
        assert (await sb.egress.get()).rules == ["good.test"]
        assert (await sb.egress.set(["*.good.test:443"])).mode == "rules"
        port = await sb.ports.expose(8080)
        assert [p.port for p in await sb.ports.list()] == [8080]
        await sb.ports.close(port.port)
        assert await sb.egress.log() == []


async def test_networks_belong_to_their_project(api: httpx.AsyncClient) -> None:
    """A network is found by id or name in its own project only: the other project may
    use the same name, and does not see (404) or join this one."""
    other = {"Hutch-Project": "other"}
    assert (await api.post("/v1/projects", json={"name": "other"})).status_code == 201
    mine = (await api.post("/v1/networks", json={"name": "team"})).json()
    r = await api.post("/v1/networks", json={"name": "team"}, headers=other)
    assert r.status_code == 201, r.text
    theirs = r.json()
    assert theirs["id"] != mine["id"]
    listed = (await api.get("/v1/networks", headers=other)).json()["networks"]
    assert [n["id"] for n in listed] == [theirs["id"]]
    missing = "net-" + "0" * 12
    for ref in (mine["id"],):
        r = await api.get(f"/v1/networks/{ref}", headers=other)
        gone = await api.get(f"/v1/networks/{missing}", headers=other)
        assert error(r, 404, "not_found") == error(gone, 404, "not_found").replace(missing, ref)
        assert (await api.delete(f"/v1/networks/{ref}", headers=other)).status_code == 404
    sb = (await api.post("/v1/sandboxes", json={}, headers=other)).json()
    r = await api.post(
        f"/v1/sandboxes/{sb['id']}/networks", json={"network": mine["id"]}, headers=other
    )
    error(r, 404, "not_found")
    # By name it joins its own project's "team".
    r = await api.post(
        f"/v1/sandboxes/{sb['id']}/networks", json={"network": "team"}, headers=other
    )
    assert r.status_code == 200 and r.json()["id"] == theirs["id"], r.text
    r = await api.post("/v1/sandboxes", json={"networks": [mine["id"]]}, headers=other)
    error(r, 404, "not_found")


async def test_rule_counts_and_the_denial_spike_hook(
    api: httpx.AsyncClient, service: Services
) -> None:
    """What the resolver and the proxy record per ordered rule shows in GET .../egress,
    starts from zero with a new policy; a denial spike reaches the enforcer's one hook."""
    policy = {
        "default": "deny",
        "rules": [{"action": "deny", "host": "bad.test"}, {"action": "allow", "host": "good.test"}],
    }
    sb = await create(api, egress=policy)
    net = service.core.net
    assert net is not None
    spikes: list[DenialSpike] = []
    net.enforcer.denial_spike_hook = spikes.append

    def decision(verdict: Verdict, index: int | None, n: float) -> EgressEvent:
        return EgressEvent(
            1_800_000_000 + n, sb["id"], "bad.test", None, "dns", "bad.test", verdict,
            None, "test", rule_index=index,
        )  # fmt: skip

    net.log.record(decision("allow", 1, 0))
    for n in range(3):
        net.log.record(decision("deny", 0, n))
    url = f"/v1/sandboxes/{sb['id']}/egress"
    got = (await api.get(url)).json()
    assert got["rule_counts"] == [
        {"index": 0, "allowed": 0, "denied": 3},
        {"index": 1, "allowed": 1, "denied": 0},
    ]
    assert spikes == []
    threshold = net.log.spike_per_min
    assert threshold == service.core.settings.net_limits.deny_spike_per_min
    for n in range(threshold):
        net.log.record(decision("deny", None, n))
    assert len(spikes) == 1 and spikes[0].sandbox_id == sb["id"]
    log = (await api.get(f"{url}/log", params={"limit": 1000})).json()["events"]
    summaries = [e for e in log if e["protocol"] == "summary"]
    assert len(summaries) == 1 and "denial spike" in summaries[0]["reason"]
    r = await api.put(url, json=policy)
    assert r.status_code == 200 and r.json()["rule_counts"] == []


async def test_egress_bytes_and_denials_reach_usage_and_the_event_log(
    api: httpx.AsyncClient, service: Services
) -> None:
    """The enforcer's poll turns nft counter growth (set on the in-memory dataplane) into
    the meter's egress bytes and one egress.denied event, through GET /v1/usage and the
    event routes; a counter that grows again adds only its growth."""
    sb = await create(api, egress=["good.test"])
    net = service.core.net
    assert net is not None
    dataplane = net.enforcer.dataplane
    assert isinstance(dataplane, MemoryDataplane)
    dataplane.counter_values[sb["id"]] = SandboxCounters(
        allowed=3, denied=40, denied_bytes=4000, sent_bytes=100_000
    )
    for n in range(500):  # a flood of logged denials: still one event
        net.log.record(
            EgressEvent(1_800_000_000 + n, sb["id"], "bad.test", 443, "tcp", "bad.test",
                        "deny", None, "no rule allows bad.test"),
        )  # fmt: skip
    net.log.add_bytes(sb["id"], sent=2345)  # what the proxy relayed

    async def usage_row() -> dict[str, Any]:
        body = (await api.get("/v1/usage", params={"from": "0"})).json()
        rows = [r for r in body["rows"] if r["key"] == sb["id"]]
        return rows[0] if rows else {}

    deadline = asyncio.get_running_loop().time() + 20
    while (await usage_row()).get("egress_allowed_bytes") != 102_345:
        assert asyncio.get_running_loop().time() < deadline, await usage_row()
        await asyncio.sleep(0.2)
        service.core.heartbeat()
    dataplane.counter_values[sb["id"]] = SandboxCounters(
        allowed=3, denied=41, denied_bytes=4100, sent_bytes=150_000
    )
    while (await usage_row()).get("egress_allowed_bytes") != 152_345:
        assert asyncio.get_running_loop().time() < deadline, await usage_row()
        await asyncio.sleep(0.2)
        service.core.heartbeat()
    row = await usage_row()
    assert row["egress_denied_bytes"] == 4100
    service.core.egress_meter.flush_denials(0, force=True)
    page = await api.get(f"/v1/sandboxes/{sb['id']}/events", params={"type": "egress.denied"})
    events = page.json()["events"]
    assert len(events) == 1, events
    assert events[0]["data"]["denials"] == 541  # 41 dropped by nft + 500 refused
    assert events[0]["data"]["top"][0]["destination"] == "bad.test"
    audit = (await api.get("/v1/events", params={"type": "egress.*"})).json()["events"]
    assert [e["seq"] for e in audit] == [events[0]["seq"]]


async def test_suggest_and_dry_run_from_the_egress_log(
    api: httpx.AsyncClient, service: Services
) -> None:
    """GET .../egress/suggest turns the logged proxied decisions into a policy that PUT
    accepts; POST .../egress/dry-run decides the log again under a policy and changes
    nothing."""
    sb = await create(api, egress={"inspection": "learn"})
    net = service.core.net
    assert net is not None
    for method, path in (("GET", "/docs/a"), ("POST", "/admin")):
        event = EgressEvent(
            1_800_000_000.0, sb["id"], "198.18.0.10", 443, "https", "api.test", "allow",
            None, "learn: would be denied", method, path,
        )  # fmt: skip
        net.log.record(event)
    url = f"/v1/sandboxes/{sb['id']}/egress"
    got = (await api.get(f"{url}/suggest")).json()
    assert got["policy"]["inspection"] == "full"
    assert got["policy"]["rules"] == [
        {"action": "allow", "host": "api.test:443", "methods": ["POST"], "path": "/admin"},
        {"action": "allow", "host": "api.test:443", "methods": ["GET"], "path": "/docs/a"},
    ]
    docs_only = {"inspection": "full", "rules": [got["policy"]["rules"][1]]}
    r = await api.post(f"{url}/dry-run", json=docs_only)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert [(e["path"], e["would"]) for e in answer["results"]] == [
        ("/docs/a", "allow"), ("/admin", "deny"),
    ]  # fmt: skip
    assert answer["would_deny"] == 1
    assert (await api.get(url)).json()["policy"]["inspection"] == "learn"  # unchanged
    r = await api.put(url, json=got["policy"])
    assert r.status_code == 200 and r.json()["policy"]["inspection"] == "full"
    bad = await api.post(f"{url}/dry-run", json={"rules": [{"action": "permit", "host": "a"}]})
    assert bad.status_code == 400 and "rules[0].action" in bad.text
