"""`hutch egress | port | network`, `create --network --egress --join` and the network rows
of `inspect`, through click's CliRunner against the fake REST contract."""

from __future__ import annotations

import json
from typing import Any

from hutch.testing import FakeHutch
from tests.unit.conftest import inspect_rows, last

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


# -- create / inspect -----------------------------------------------------------------


def test_create_with_network_options(fake: FakeHutch, hutch: Any) -> None:
    net = fake.add_network("team")
    result = hutch(
        "create", "--egress", "good.test", "--egress", "*.cdn.test:443", "--join", "team"
    )
    assert result.exit_code == 0, result.stderr
    sb = fake.sandboxes[result.stdout.strip()]
    assert last(fake)[2] == {
        "image": "base",
        "vcpus": 1,
        "memory_mib": 512,
        "disk_gib": 4,
        "egress": ["good.test", "*.cdn.test:443"],
        "networks": ["team"],
    }
    assert (sb.egress, sb.networks) == (["good.test", "*.cdn.test:443"], [net.id])
    shown = inspect_rows(hutch("inspect", sb.id).stdout)
    assert (shown["network"], shown["address"], shown["networks"]) == (
        "default",
        "10.213.0.6",
        net.id,
    )


def test_create_network_none_and_plain_create(fake: FakeHutch, hutch: Any) -> None:
    none_id = hutch("create", "--network", "none").stdout.strip()
    assert last(fake)[2]["network"] == "none"
    shown = inspect_rows(hutch("inspect", none_id).stdout)
    assert (shown["network"], shown["address"]) == ("none", "-")
    assert "networks" not in shown
    hutch("create")
    assert not {"network", "egress", "networks"} & set(last(fake)[2])
    bad = hutch("create", "--network", "host")
    assert bad.exit_code == 2 and "'host' is not one of 'default', 'none'" in bad.stderr
    clash = hutch("create", "--network", "none", "--egress", "good.test")
    assert clash.exit_code == 1
    assert clash.stderr.startswith('error: network "none" has no egress rules')


def test_create_with_an_invalid_rule_fails_with_the_daemons_message(
    fake: FakeHutch, hutch: Any
) -> None:
    result = hutch("create", "--egress", "bad_host!")
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.startswith("error: egress rule 'bad_host!'")
    assert fake.sandboxes == {}


# -- egress ---------------------------------------------------------------------------


def test_egress_policies_from_the_cli(fake: FakeHutch, hutch: Any, tmp_path: Any) -> None:
    doc = {
        "default": "deny",
        "rules": [
            {"action": "deny", "host": "evil.good.test"},
            {"action": "allow", "host": "*.good.test:443"},
        ],
    }
    path = tmp_path / "web.json"
    path.write_text(json.dumps(doc))
    result = hutch("egress", "policy", "put", "web", str(path))
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["rules"][1] == {"action": "allow", "host": "*.good.test:443"}
    listed = hutch("egress", "policy", "list").stdout.split("\n")
    assert listed[0].split() == ["NAME", "DEFAULT", "INSPECTION", "RULES", "UPDATED"]
    assert listed[1].split()[:4] == ["web", "deny", "none", "2"]
    sb = fake.add_sandbox()
    shown = hutch("egress", "set", sb.id, "--policy", "web")
    assert shown.exit_code == 0, shown.stderr
    rows = shown.stdout.splitlines()
    assert "rule:" in rows[2] and "rules[0] deny evil.good.test" in rows[2]
    assert "default deny" in rows[4]
    got = json.loads(hutch("egress", "set", sb.id, "--policy-file", str(path), "--json").stdout)
    assert got["policy"]["rules"][0] == {"action": "deny", "host": "evil.good.test"}
    path.write_text(json.dumps({"rules": [{"action": "allow", "host": "a.test", "path": "x"}]}))
    bad = hutch("egress", "policy", "put", "web", str(path))
    assert bad.exit_code != 0 and "rules[0].path" in bad.stderr
    assert hutch("egress", "set", sb.id, "a.test", "--policy", "web").exit_code == 2
    created = hutch("create", "--egress-policy", "web", "--json")
    assert created.exit_code == 0, created.stderr
    assert last(fake)[2]["egress_policy"] == "web"
    deleted = hutch("egress", "policy", "delete", "web", "nope")
    assert deleted.stdout.split() == ["web"] and deleted.exit_code == 1
    assert "'nope' does not exist" in deleted.stderr


def test_egress_set_and_get(fake: FakeHutch, hutch: Any) -> None:
    sb = fake.add_sandbox()
    assert inspect_rows(hutch("egress", "get", sb.id).stdout) == {
        "mode": "open",
        "rules": "-",
        "allowed": "0",
        "denied": "0",
        "rate_limited": "0",
        "log_dropped": "0",
    }
    result = hutch("egress", "set", sb.id, "Good.Test", "198.18.0.0/15:80")
    assert result.exit_code == 0, result.stderr
    assert last(fake) == (
        "PUT",
        f"/v1/sandboxes/{sb.id}/egress",
        {"rules": ["Good.Test", "198.18.0.0/15:80"]},
    )
    assert inspect_rows(result.stdout)["rules"] == "good.test,198.18.0.0/15:80"
    sb.allowed, sb.denied, sb.rate_limited, sb.log_dropped = 3, 1, 7, 2
    data = json.loads(hutch("egress", "get", sb.id, "--json").stdout)
    assert data == {
        "rules": ["good.test", "198.18.0.0/15:80"],
        "mode": "rules",
        "allowed": 3,
        "denied": 1,
        "rate_limited": 7,
        "log_dropped": 2,
        "policy": None,
        "rule_counts": [],
    }
    cleared = json.loads(hutch("egress", "set", sb.id, "--clear", "--json").stdout)
    assert (cleared["mode"], cleared["rules"]) == ("open", [])


def test_egress_set_errors(fake: FakeHutch, hutch: Any) -> None:
    sb = fake.add_sandbox()
    sb.egress = ["good.test"]
    bad = hutch("egress", "set", sb.id, "ok.test", "no:such:port")
    assert bad.exit_code == 1 and bad.stderr.startswith("error: egress rule 'no:such:port'")
    assert sb.egress == ["good.test"]
    for args in ((), ("x.test", "--clear")):
        usage = hutch("egress", "set", sb.id, *args)
        assert (
            usage.exit_code == 2 and "--clear, --policy-file FILE or --policy NAME" in usage.stderr
        )
    missing = hutch("egress", "get", "sb-000000000999")
    assert (missing.exit_code, missing.stderr) == (
        1,
        "error: no sandbox sb-000000000999\n",
    )


def test_egress_log_table_and_json(fake: FakeHutch, hutch: Any) -> None:
    sb = fake.add_sandbox()
    assert hutch("egress", "log", sb.id).stdout.split() == [
        "TIME",
        "VERDICT",
        "PROTO",
        "DESTINATION",
        "PORT",
        "NAME",
        "RULE",
        "REASON",
    ]
    dns = {
        **EVENT,
        "destination": "good.test",
        "port": None,
        "protocol": "dns",
        "name": "good.test",
        "verdict": "allow",
        "rule": "good.test",
        "reason": "allowed",
    }
    sb.egress_events += [EVENT, dns]
    lines = hutch("egress", "log", sb.id).stdout.splitlines()
    assert lines[1].split() == [
        "2026-11-30T03:00:01",
        "deny",
        "tls",
        "198.18.0.7",
        "443",
        "bad.test",
        "-",
        "no",
        "rule",
        "allows",
        "this",
        "name",
    ]
    assert lines[2].split()[:7] == [
        "2026-11-30T03:00:01",
        "allow",
        "dns",
        "good.test",
        "-",
        "good.test",
        "good.test",
    ]
    unset = {"method": None, "path": None, "rule_index": None}  # plain HTTP / ordered only
    got = json.loads(hutch("egress", "log", sb.id, "--json").stdout)
    assert got == [{**EVENT, **unset}, {**dns, **unset}]
    hutch("egress", "log", sb.id, "--limit", "1")
    assert fake.requests[-1].url.params["limit"] == "1"
    assert hutch("egress", "log", sb.id, "--limit", "0").exit_code == 2


# -- ports ----------------------------------------------------------------------------


def test_port_expose_ls_close(fake: FakeHutch, hutch: Any) -> None:
    sb = fake.add_sandbox()
    result = hutch("port", "expose", sb.id, "8000")
    assert (result.exit_code, result.stdout) == (0, "http://127.0.0.1:40000\n")
    assert last(fake) == ("POST", f"/v1/sandboxes/{sb.id}/ports", {"port": 8000})
    data = json.loads(hutch("port", "expose", sb.id, "9000", "--json").stdout)
    assert data == {
        "port": 9000,
        "host": "127.0.0.1",
        "host_port": 40001,
        "url": "http://127.0.0.1:40001",
    }
    rows = [line.split() for line in hutch("port", "ls", sb.id).stdout.splitlines()]
    assert rows == [
        ["PORT", "HOST", "HOST_PORT", "URL"],
        ["8000", "127.0.0.1", "40000", "http://127.0.0.1:40000"],
        ["9000", "127.0.0.1", "40001", "http://127.0.0.1:40001"],
    ]
    assert json.loads(hutch("port", "ls", sb.id, "--json").stdout)[1] == data
    closed = hutch("port", "close", sb.id, "8000", "7")
    assert closed.exit_code == 1 and closed.stdout == "8000\n"
    assert closed.stderr == (
        f"error: 7: port 7 of sandbox {sb.id} is not exposed; "
        f"GET /v1/sandboxes/{sb.id}/ports lists those that are\n"
    )
    assert list(sb.ports) == [9000]


def test_port_errors(fake: FakeHutch, hutch: Any) -> None:
    none = fake.add_sandbox(network="none")
    refused = hutch("port", "expose", none.id, "80")
    assert (
        refused.exit_code == 1 and 'has no network (created with network "none")' in refused.stderr
    )
    usage = hutch("port", "expose", none.id, "70000")
    assert usage.exit_code == 2 and "70000 is not in the range 1<=x<=65535" in usage.stderr


# -- networks -------------------------------------------------------------------------


def test_network_create_ls_inspect_rm(fake: FakeHutch, hutch: Any) -> None:
    assert hutch("network", "ls").stdout.split() == ["ID", "NAME", "MEMBERS", "CREATED"]
    created = hutch("network", "create", "team")
    assert (created.exit_code, created.stdout) == (0, "net-000000000001\n")
    assert last(fake) == ("POST", "/v1/networks", {"name": "team"})
    other = json.loads(hutch("network", "create", "other", "--json").stdout)
    assert (other["id"], other["name"], other["members"]) == ("net-000000000002", "other", [])
    sb = fake.add_sandbox(networks=["team"])
    rows = [line.split() for line in hutch("network", "ls").stdout.splitlines()[1:]]
    assert rows == [
        ["net-000000000001", "team", sb.id, "2026-11-30", "03:00:00"],
        ["net-000000000002", "other", "-", "2026-11-30", "03:00:00"],
    ]
    listed = json.loads(hutch("network", "ls", "--json").stdout)
    assert [n["members"] for n in listed] == [[sb.id], []]
    shown = inspect_rows(hutch("network", "inspect", "team").stdout)
    assert (shown["id"], shown["members"]) == ("net-000000000001", sb.id)
    removed = hutch("network", "rm", "team", "other")
    assert removed.exit_code == 1 and removed.stdout == "other\n"
    assert f"error: team: network net-000000000001 is in use by {sb.id}" in (removed.stderr)
    assert list(fake.net.networks) == ["net-000000000001"]


def test_network_join_and_leave(fake: FakeHutch, hutch: Any) -> None:
    sb = fake.add_sandbox()
    net = fake.add_network("team")
    joined = hutch("network", "join", sb.id, "team")
    assert (joined.exit_code, joined.stdout) == (0, f"{net.id}\n")
    assert last(fake) == ("POST", f"/v1/sandboxes/{sb.id}/networks", {"network": "team"})
    assert sb.networks == [net.id]
    left = hutch("network", "leave", sb.id, net.id)
    assert (left.exit_code, left.stdout) == (0, f"{net.id}\n")
    assert last(fake)[:2] == ("DELETE", f"/v1/sandboxes/{sb.id}/networks/{net.id}")
    assert sb.networks == []
    again = hutch("network", "leave", sb.id, net.id)
    assert again.exit_code == 1 and "is not on" in again.stderr


def test_network_create_errors(fake: FakeHutch, hutch: Any) -> None:
    bad = hutch("network", "create", "Team_A")
    assert bad.exit_code == 1 and bad.stderr.startswith("error: name='Team_A' is not valid")
    hutch("network", "create", "team")
    dup = hutch("network", "create", "team")
    assert dup.exit_code == 1 and "already exists" in dup.stderr
    missing = hutch("network", "inspect", "nope")
    assert missing.exit_code == 1 and "no network 'nope'" in missing.stderr
