"""Networking in the SDK (egress, ports, private networks, create fields), sync and async,
against the fake REST contract (hutch.testing)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import hutch.sdk
from hutch.errors import Conflict, InvalidArgument, NotFound
from hutch.sdk import (
    AsyncClient,
    AsyncSandbox,
    Client,
    EgressEvent,
    EgressInfo,
    NetworkInfo,
    PortInfo,
    ProtocolError,
    Sandbox,
    SandboxInfo,
    SandboxNetInfo,
)
from hutch.testing import FakeHutch

EVENT = {
    "time": "2026-11-30T03:00:01.500Z",
    "sandbox_id": "sb-000000000001",
    "destination": "198.18.0.7",
    "port": 443,
    "protocol": "tls",
    "name": "bad.test",
    "verdict": "deny",
    "rule": None,
    "reason": "no rule allows this name",
}


@pytest.fixture
def fake() -> FakeHutch:
    return FakeHutch()


@pytest.fixture
def conn(fake: FakeHutch) -> dict[str, Any]:
    return {"api_key": fake.api_key, "transport": fake.transport}


@pytest.fixture
def sb(conn: dict[str, Any]) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(**conn)
    yield sandbox
    sandbox.kill()
    sandbox.close()


@pytest.fixture
def client(conn: dict[str, Any]) -> Iterator[Client]:
    with Client(**conn) as c:
        yield c


@pytest.fixture
async def asb(conn: dict[str, Any]) -> AsyncIterator[AsyncSandbox]:
    sandbox = await AsyncSandbox.create(**conn)
    yield sandbox
    await sandbox.kill()
    await sandbox.close()


def _last(fake: FakeHutch) -> tuple[str, str, Any]:
    request = fake.requests[-1]
    body = json.loads(request.content) if request.content else None
    return request.method, request.url.path, body


# -- create ---------------------------------------------------------------------------


def test_plain_create_sends_no_network_fields(fake: FakeHutch, sb: Sandbox) -> None:
    # A daemon that predates networking rejects unknown fields: defaults stay unsent.
    create = next(r for r in fake.requests if r.method == "POST")
    assert set(json.loads(create.content)) == {"image", "vcpus", "memory_mib", "disk_gib"}
    assert sb.info.network == SandboxNetInfo(mode="default", address="10.213.0.6", networks=[])


def test_create_with_network_fields(fake: FakeHutch, conn: dict[str, Any]) -> None:
    net = fake.add_network("team")
    with Sandbox.create(
        egress=["Good.Test.", "*.cdn.test:443", "198.18.0.0/15"], networks=["team"], **conn
    ) as sb:
        body = json.loads(next(r for r in fake.requests if r.method == "POST").content)
        assert body["egress"] == ["Good.Test.", "*.cdn.test:443", "198.18.0.0/15"]
        assert body["networks"] == ["team"] and "network" not in body
        assert sb.info.network is not None and sb.info.network.networks == [net.id]
        # The daemon stores rules canonically: lower case, no trailing dot.
        assert sb.egress.get().rules == ["good.test", "*.cdn.test:443", "198.18.0.0/15"]
    with Sandbox.create(network="none", **conn) as none:
        assert none.info.network == SandboxNetInfo(mode="none", address=None, networks=[])
    creates = [json.loads(r.content) for r in fake.requests if r.method == "POST"]
    assert creates[-1]["network"] == "none"


def test_create_checks_network_fields_before_sending(fake: FakeHutch, conn: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument, match=r"network='host' is not one of 'default', 'none'"):
        Sandbox.create(network="host", **conn)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="must be a list of strings"):
        Sandbox.create(egress="good.test", **conn)
    with pytest.raises(InvalidArgument, match="networks must be a list"):
        Sandbox.create(networks="team", **conn)
    assert fake.requests == []


def test_create_errors_from_the_daemon_are_typed(fake: FakeHutch, conn: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument, match="egress rule 'bad_host!'"):
        Sandbox.create(egress=["good.test", "bad_host!"], **conn)
    with pytest.raises(NotFound, match="no network 'nope'"):
        Sandbox.create(networks=["nope"], **conn)
    assert fake.sandboxes == {}


# -- egress ---------------------------------------------------------------------------


def test_egress_get_set_clear(fake: FakeHutch, sb: Sandbox) -> None:
    assert sb.egress.get() == EgressInfo(rules=[], mode="open", allowed=0, denied=0)
    assert _last(fake) == ("GET", f"/v1/sandboxes/{sb.id}/egress", None)
    info = sb.egress.set(["good.test", "[2001:db8::1]:443"])
    assert _last(fake) == (
        "PUT",
        f"/v1/sandboxes/{sb.id}/egress",
        {"rules": ["good.test", "[2001:db8::1]:443"]},
    )
    assert info == EgressInfo(
        rules=["good.test", "[2001:db8::1]:443"], mode="rules", allowed=0, denied=0
    )
    assert sb.egress.set(["deny-all"]).mode == "deny-all"
    assert sb.egress.clear() == EgressInfo(rules=[], mode="open", allowed=0, denied=0)
    assert _last(fake)[2] == {"rules": []}


def test_an_invalid_rule_keeps_the_old_rules(fake: FakeHutch, sb: Sandbox) -> None:
    sb.egress.set(["good.test"])
    with pytest.raises(InvalidArgument, match=r"egress rule 'good\.test:99999'"):
        sb.egress.set(["other.test", "good.test:99999"])
    with pytest.raises(InvalidArgument, match='"deny-all" must be the only egress rule'):
        sb.egress.set(["deny-all", "good.test"])
    assert sb.egress.get().rules == ["good.test"]


def test_egress_set_checks_arguments_before_sending(fake: FakeHutch, sb: Sandbox) -> None:
    sent = len(fake.requests)
    with pytest.raises(InvalidArgument, match="must be a list of strings"):
        sb.egress.set("good.test")
    with pytest.raises(InvalidArgument, match="is not a non-empty string"):
        sb.egress.set(["good.test", ""])
    with pytest.raises(InvalidArgument, match="at most 256 are accepted"):
        sb.egress.set([f"h{i}.test" for i in range(257)])
    with pytest.raises(InvalidArgument, match="limit=0 is out of range; accepted: 1-1000"):
        sb.egress.log(0)
    assert len(fake.requests) == sent


def test_egress_counters_and_log(fake: FakeHutch, sb: Sandbox) -> None:
    state = fake.sandboxes[sb.id]
    state.allowed, state.denied = 5, 2
    state.egress_events += [EVENT, {**EVENT, "verdict": "allow", "rule": "good.test"}]
    info = sb.egress.get()
    assert (info.allowed, info.denied) == (5, 2)
    events = sb.egress.log(limit=1)
    assert fake.requests[-1].url.params["limit"] == "1"
    assert len(events) == 1 and events[0].verdict == "allow"
    (first, _) = sb.egress.log()
    assert isinstance(first, EgressEvent)
    assert (first.destination, first.port, first.name, first.rule) == (
        "198.18.0.7",
        443,
        "bad.test",
        None,
    )
    assert first.time is not None and first.time.tzinfo is not None
    # Fields a daemon leaves out (or an older one never sends) come back as None.
    assert first.to_dict() == {**EVENT, "method": None, "path": None, "rule_index": None}


def test_egress_on_a_missing_sandbox_is_not_found(client: Client) -> None:
    with pytest.raises(NotFound):
        hutch.sdk.Egress(client, "sb-000000000999").get()


def test_a_malformed_egress_answer_is_a_protocol_error(fake: FakeHutch, sb: Sandbox) -> None:
    fake.sandboxes[sb.id].egress = ["a.test", 5]  # type: ignore[list-item]
    with pytest.raises(ProtocolError, match="'rules' must be a list of strings"):
        sb.egress.get()


# -- ports ----------------------------------------------------------------------------


def test_ports_expose_list_close(fake: FakeHutch, sb: Sandbox) -> None:
    assert sb.ports.list() == []
    port = sb.ports.expose(8000)
    assert _last(fake) == ("POST", f"/v1/sandboxes/{sb.id}/ports", {"port": 8000})
    assert port == PortInfo(port=8000, host="127.0.0.1", host_port=40000, url=port.url)
    assert port.url == "http://127.0.0.1:40000"
    sb.ports.expose(9000)
    assert [p.port for p in sb.ports.list()] == [8000, 9000]
    sb.ports.close(8000)
    assert _last(fake) == ("DELETE", f"/v1/sandboxes/{sb.id}/ports/8000", None)
    assert [p.port for p in sb.ports.list()] == [9000]
    with pytest.raises(NotFound, match=r"port 8000 .* is not exposed"):
        sb.ports.close(8000)


def test_ports_refused_without_network_or_once_deleted(
    fake: FakeHutch, sb: Sandbox, conn: dict[str, Any]
) -> None:
    with Sandbox.create(network="none", **conn) as none:
        with pytest.raises(Conflict, match='network "none"'):
            none.ports.expose(80)
        with pytest.raises(Conflict, match='network "none"'):
            none.networks.join(fake.add_network("team").id)
    # As in the daemon: a paused sandbox keeps its network, a deleted one gave it back.
    sb.pause()
    assert sb.ports.expose(80).port == 80
    sb.kill()
    with pytest.raises(Conflict, match="has no network"):
        sb.ports.expose(81)


def test_port_arguments_are_checked_before_sending(fake: FakeHutch, sb: Sandbox) -> None:
    sent = len(fake.requests)
    for bad in (0, 65536, True, "80"):
        with pytest.raises(InvalidArgument, match="accepted: 1-65535"):
            sb.ports.expose(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="accepted: 1-65535"):
            sb.ports.close(bad)  # type: ignore[arg-type]
    assert len(fake.requests) == sent


# -- networks -------------------------------------------------------------------------


def test_networks_create_list_get_delete(fake: FakeHutch, client: Client) -> None:
    net = client.networks.create("team-a")
    assert _last(fake) == ("POST", "/v1/networks", {"name": "team-a"})
    assert isinstance(net, NetworkInfo)
    assert (net.id, net.name, net.members) == ("net-000000000001", "team-a", [])
    assert net.created_at is not None
    assert client.networks.get("team-a") == net == client.networks.get(net.id)
    assert client.networks.list() == [net]
    with pytest.raises(Conflict, match="already exists"):
        client.networks.create("team-a")
    client.networks.delete("team-a")
    assert _last(fake) == ("DELETE", "/v1/networks/team-a", None)
    assert client.networks.list() == []
    with pytest.raises(NotFound):
        client.networks.get(net.id)


def test_network_name_is_checked_before_sending(fake: FakeHutch, client: Client) -> None:
    with pytest.raises(InvalidArgument, match="name='Team_A' is not valid"):
        client.networks.create("Team_A")
    with pytest.raises(InvalidArgument, match=r"network id .* or name"):
        client.networks.get("")
    assert fake.requests == []


def test_join_leave_and_delete_while_in_use(fake: FakeHutch, sb: Sandbox, client: Client) -> None:
    net = client.networks.create("team")
    joined = sb.networks.join("team")
    assert _last(fake) == ("POST", f"/v1/sandboxes/{sb.id}/networks", {"network": "team"})
    assert joined.members == [sb.id]
    assert sb.networks.list() == [net.id]
    shown = sb.refresh().network
    assert shown is not None and shown.networks == [net.id]
    with pytest.raises(Conflict, match=f"in use by {sb.id}"):
        client.networks.delete(net.id)
    sb.networks.leave(net.id)
    assert _last(fake) == ("DELETE", f"/v1/sandboxes/{sb.id}/networks/{net.id}", None)
    assert sb.networks.list() == []
    with pytest.raises(NotFound, match="is not on"):
        sb.networks.leave(net.id)
    client.networks.delete(net.id)


def test_a_deleted_sandbox_leaves_its_networks(fake: FakeHutch, client: Client) -> None:
    net = client.networks.create("team")
    sb = Sandbox.create(networks=[net.id], client=client)
    assert client.networks.get(net.id).members == [sb.id]
    sb.kill()
    assert client.networks.get(net.id).members == []
    client.networks.delete(net.id)


def test_fork_keeps_rules_and_networks_with_a_new_address(
    fake: FakeHutch, sb: Sandbox, client: Client
) -> None:
    net = client.networks.create("team")
    sb.networks.join(net.id)
    sb.egress.set(["good.test"])
    (child,) = sb.fork()
    assert child.egress.get().rules == ["good.test"]
    mine, its = sb.refresh().network, child.info.network
    assert mine is not None and its is not None
    assert its.networks == [net.id] and its.address != mine.address


def test_sandbox_info_network_round_trips(fake: FakeHutch) -> None:
    raw = fake.add_sandbox(network="none").to_json()
    assert SandboxInfo.from_dict(raw).to_dict() == raw
    # A daemon that predates networking sends no block: it reads as None.
    old = {k: v for k, v in raw.items() if k != "network"}
    info = SandboxInfo.from_dict(old)
    assert info.network is None and info.to_dict()["network"] is None


def test_public_names() -> None:
    for name in (
        "Egress",
        "Ports",
        "Networks",
        "SandboxNetworks",
        "AsyncEgress",
        "AsyncPorts",
        "AsyncNetworks",
        "AsyncSandboxNetworks",
        "EgressInfo",
        "EgressEvent",
        "PortInfo",
        "NetworkInfo",
        "SandboxNetInfo",
    ):
        assert name in hutch.sdk.__all__ and hasattr(hutch.sdk, name), name


# -- async ----------------------------------------------------------------------------


async def test_async_egress_ports_networks(fake: FakeHutch, asb: AsyncSandbox) -> None:
    assert (await asb.egress.set(["good.test"])).mode == "rules"
    assert (await asb.egress.get()).rules == ["good.test"]
    fake.sandboxes[asb.id].egress_events.append(EVENT)
    assert [e.reason for e in await asb.egress.log()] == [EVENT["reason"]]
    assert (await asb.egress.clear()).mode == "open"
    port = await asb.ports.expose(8080)
    assert [p.port for p in await asb.ports.list()] == [8080]
    await asb.ports.close(port.port)
    assert await asb.ports.list() == []
    async with AsyncClient(api_key=fake.api_key, transport=fake.transport) as client:
        net = await client.networks.create("team")
        assert (await asb.networks.join("team")).members == [asb.id]
        assert await asb.networks.list() == [net.id]
        assert [n.id for n in await client.networks.list()] == [net.id]
        with pytest.raises(Conflict):
            await client.networks.delete("team")
        await asb.networks.leave("team")
        assert (await client.networks.get(net.id)).members == []
        await client.networks.delete(net.id)
        assert await client.networks.list() == []


async def test_async_create_with_network_fields(fake: FakeHutch, conn: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument, match='network "none" has no egress rules'):
        await AsyncSandbox.create(network="none", egress=["deny-all"], **conn)
    sb = await AsyncSandbox.create(network="none", **conn)
    try:
        body = json.loads(fake.requests[-1].content)
        assert body["network"] == "none" and "egress" not in body
        assert sb.info.network == SandboxNetInfo(mode="none", address=None, networks=[])
        assert (await sb.egress.get()).mode == "open"
        with pytest.raises(Conflict, match="has no network"):
            await sb.egress.set(["deny-all"])
        with pytest.raises(Conflict, match="has no network"):
            await sb.ports.expose(80)
    finally:
        await sb.kill()
        await sb.close()
