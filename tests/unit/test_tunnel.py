"""The overlay between hosts, as commands and rules (hutch.net.tunnel, the tunnel parts
hutch.net.nft_tunnel, hutch.services.overlay). The real devices and packets are proven by
the tunnel-e2e work in progress (see ARCHITECTURE.md, "Private networks across hosts")."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from ipaddress import IPv4Address, IPv4Network

import pytest

from hutch.config import load_settings
from hutch.errors import InvalidArgument, NetworkError
from hutch.net import links, tunnel, vxlan
from hutch.net.nft import RulesetState, render_cluster, render_table
from hutch.net.nft_common import TableConfig
from hutch.net.tunnel import (
    RULE_PRIORITY,
    VNI,
    TunnelConfig,
    TunnelDriver,
    TunnelPeer,
    TunnelState,
    host_mac,
    render_down,
    render_sync,
    render_up,
)
from hutch.net.vxlan import encode_newlink, localbypass_of, parse_attrs
from hutch.services.network import tunnel_config
from hutch.services.overlay import overlay_of
from hutch.store.net import RemoteMember, TunnelRow

CFG = TunnelConfig("1a2b", "w1", IPv4Address("127.0.0.1"), 14789)
B = TunnelPeer("w2", IPv4Address("127.0.0.1"), 14790, host_mac("w2"))
C = TunnelPeer("w3", IPv4Address("192.0.2.3"), 4789, host_mac("w3"))


def _table(tunnel: TunnelConfig | None) -> str:
    cfg = TableConfig("1a2b", IPv4Network("10.213.0.0/24"), 5353, 8443, 1000, tunnel=tunnel)
    return render_table(
        RulesetState(
            cfg,
            cluster_pools=(IPv4Network("10.214.0.0/24"),),
            tunnel_peers=(IPv4Address("192.0.2.3"),),
        )
    )


def test_the_device_is_vxlan_without_learning_or_local_bypass_and_its_own_rule() -> None:
    assert CFG.dev == "hx1a2b" and not CFG.dev.startswith("h1a2b")  # not a tap
    # The device: one RTM_NEWLINK (create, exclusive, ack) with its VXLAN settings.
    msg = encode_newlink(CFG.dev, mac=CFG.mac, vni=VNI, local=CFG.local, port=CFG.port)
    size, kind, flags = struct.unpack_from("=IHH", msg)
    assert (size, kind, flags) == (len(msg), 16, 0x1 | 0x4 | 0x200 | 0x400)
    attrs = dict(parse_attrs(msg[16 + 16 :]))
    assert attrs[3] == b"hx1a2b\0" and attrs[1] == bytes.fromhex(CFG.mac.replace(":", ""))
    info = dict(parse_attrs(attrs[18]))
    assert info[1] == b"vxlan"
    data = dict(parse_attrs(info[2]))
    assert struct.unpack("=I", data[1]) == (VNI,) and data[4] == bytes([127, 0, 0, 1])
    assert struct.unpack("!H", data[15]) == (14789,)  # dstport, network byte order
    assert data[7] == b"\0" and data[31] == b"\0"  # nolearning, nolocalbypass
    # Read back: the bypass as the kernel reports it; a kernel < 6.6 reports none.
    assert localbypass_of(msg[32:]) == 0

    def attr(kind: int, value: bytes) -> bytes:
        return struct.pack("=HH", 4 + len(value), kind) + value + b"\0" * (-len(value) % 4)

    old_kernel = attr(18 | 0x8000, attr(1, b"vxlan") + attr(2 | 0x8000, attr(1, b"\x75\x10\0\0")))
    assert localbypass_of(old_kernel) is None
    on = attr(18 | 0x8000, attr(2 | 0x8000, attr(7, b"\0") + attr(31, b"\1")))
    assert localbypass_of(attr(3, b"hx1a2b\0") + on) == 1
    up = render_up(CFG)
    assert ("sysctl", "-q", "-w", "net.ipv4.conf.hx1a2b.rp_filter=0") in up
    rule = ("ip", "rule", "add", "priority", str(RULE_PRIORITY), "fwmark", f"{CFG.mark:#x}")
    assert up[-1][: len(rule)] == rule and up[-1][-2:] == ("lookup", str(CFG.table))
    down = render_down(CFG)
    assert down[-1] == ("ip", "link", "del", "dev", "hx1a2b")
    assert ("ip", "route", "flush", "table", str(CFG.table)) in down
    assert down[0][:3] == ("ip", "rule", "del")
    # Two workers of one machine: their own marks and tables.
    other = TunnelConfig("1a2c", "w2", IPv4Address("127.0.0.1"), 14790)
    assert other.mark != CFG.mark and other.table != CFG.table and other.dev != CFG.dev
    assert host_mac("w1") != host_mac("w2") and int(host_mac("w1")[:2], 16) & 0b11 == 0b10


def test_sync_adds_peer_then_routes_and_removes_them_in_reverse() -> None:
    a, b = IPv4Address("10.214.0.6"), IPv4Address("10.214.0.10")
    one = TunnelState((B,), ((a, "w2"),))
    added = render_sync(CFG, TunnelState(), one)
    assert added == [
        ("bridge", "fdb", "replace", B.mac, "dev", "hx1a2b", "dst", "127.0.0.1", "port",
         "14790", "self", "permanent"),
        ("ip", "neigh", "replace", "10.214.0.6", "lladdr", B.mac, "dev", "hx1a2b", "nud",
         "permanent"),
        ("ip", "route", "replace", "10.214.0.6/32", "dev", "hx1a2b", "table", str(CFG.table)),
    ]  # fmt: skip
    assert render_sync(CFG, one, one) == []
    two = TunnelState((B,), ((a, "w2"), (b, "w2")))
    assert [c[:3] for c in render_sync(CFG, one, two)] == [
        ("ip", "neigh", "replace"),
        ("ip", "route", "replace"),
    ]
    removed = render_sync(CFG, two, TunnelState())
    assert removed[:2] == [
        ("ip", "route", "del", "10.214.0.6/32", "dev", "hx1a2b", "table", str(CFG.table)),
        ("ip", "neigh", "del", "10.214.0.6", "dev", "hx1a2b"),
    ]
    assert removed[-1] == (
        "bridge",
        "fdb",
        "del",
        B.mac,
        "dev",
        "hx1a2b",
        "dst",
        "127.0.0.1",
        "self",
    )
    # A route to a host whose end is unknown is not made.
    assert render_sync(CFG, TunnelState(), TunnelState((), ((a, "w2"),))) == []


def test_the_table_routes_marks_and_admits_tunnel_traffic_only_between_peers() -> None:
    plain = _table(None)
    assert "tunnel_mark" not in plain and "hx1a2b" not in plain
    # Always denied for every sandbox, tunnel or not: the other hosts' pools and ends.
    for text in (plain, _table(CFG)):
        assert "ip daddr @cluster_pools counter name iifname map @deny_ctr" in text
        assert "ip daddr @tunnel_peers counter name iifname map @deny_ctr" in text
        assert "add element inet hutch_1a2b cluster_pools { 10.214.0.0/24 }" in text
    text = _table(CFG)
    assert "type filter hook prerouting priority mangle" in text
    assert f"iifname @taps ip daddr @cluster_pools meta mark set {CFG.mark:#x}" in text
    assert 'iifname "hx1a2b" meta mark set 0' in text
    ingress = text.split("chain ingress {")[1].split("\n  }")[0]
    assert ingress.index('iifname "hx1a2b" jump peers') < ingress.index("counter drop")
    assert "udp dport 14789 ip saddr != @tunnel_peers counter drop" in text
    # Peer traffic is neither metered as egress nor NATed.
    for chain, then in (("chain sent {", "@tx_ctr"), ("chain postrouting {", "masquerade")):
        body = text.split(chain)[1].split("\n  }")[0]
        assert body.index('oifname "hx1a2b" return') < body.index(then)
    # The egress checks: peers pass first, then the other hosts' pools are sandboxes.
    egress = text.split("chain egress {")[1].split("\n  }")[0]
    assert egress.index("jump peers") < egress.index("@cluster_pools")


def test_render_cluster_replaces_both_sets() -> None:
    cfg = TableConfig("1a2b", IPv4Network("10.213.0.0/24"), 5353, 8443, 1000)
    text = render_cluster(cfg, [IPv4Network("10.214.0.0/24")], [IPv4Address("192.0.2.3")])
    assert text.splitlines() == [
        "flush set inet hutch_1a2b cluster_pools",
        "flush set inet hutch_1a2b tunnel_peers",
        "add element inet hutch_1a2b cluster_pools { 10.214.0.0/24 }",
        "add element inet hutch_1a2b tunnel_peers { 192.0.2.3 }",
    ]
    assert render_cluster(cfg, [], []).count("add element") == 0


def test_overlay_routes_only_members_of_networks_with_a_member_here() -> None:
    ends = [
        TunnelRow("w2", "127.0.0.1", 14790, B.mac, "10.214.0.0/24"),
        TunnelRow("w3", "192.0.2.3", 4789, C.mac, "10.215.0.0/24"),
        TunnelRow("bad", "not-an-ip", 1, "02:00:00:00:00:01", "10.216.0.0/24"),
    ]
    remote = [
        RemoteMember("net-aaaaaaaaaaaa", "sb-2", "w2", 1),  # 10.214.0.6
        RemoteMember("net-bbbbbbbbbbbb", "sb-3", "w3", 2),  # 10.215.0.10: no member here
        RemoteMember("net-aaaaaaaaaaaa", "sb-9", "gone", 1),  # a host with no end
    ]
    memberships = {
        "net-aaaaaaaaaaaa": ["sb-1", "sb-2", "sb-9"],
        "net-bbbbbbbbbbbb": ["sb-3", "sb-4"],
    }
    ov = overlay_of({"sb-1"}, memberships, remote, ends)
    assert ov.members == {
        "net-aaaaaaaaaaaa": {"sb-2": IPv4Address("10.214.0.6")},
        "net-bbbbbbbbbbbb": {"sb-3": IPv4Address("10.215.0.10")},
    }
    assert ov.tunnel == TunnelState((B,), ((IPv4Address("10.214.0.6"), "w2"),))
    assert ov.pools == (IPv4Network("10.214.0.0/24"), IPv4Network("10.215.0.0/24"))
    assert ov.endpoints == (IPv4Address("127.0.0.1"), IPv4Address("192.0.2.3"))
    # Nobody here: nothing routed, the device goes.
    assert overlay_of(set(), memberships, remote, ends).tunnel.empty


def test_tunnel_settings() -> None:
    base = {"HUTCH_STATE_DIR": "/tmp/hutch-unit-tunnel", "HUTCH_LISTEN": "127.0.0.1:7071"}
    assert tunnel_config(load_settings(base)) is None  # a single host: no tunnel
    worker = {**base, "HUTCH_ROLE": "worker", "HUTCH_HOST_ID": "w1"}
    assert tunnel_config(load_settings(worker)) is None  # off unless a port is set
    cfg = tunnel_config(load_settings({**worker, "HUTCH_TUNNEL_PORT": "4789"}))
    assert cfg is not None and cfg.port == 4789 and cfg.local == IPv4Address("127.0.0.1")
    cfg = tunnel_config(
        load_settings({**worker, "HUTCH_TUNNEL_PORT": "14789", "HUTCH_TUNNEL_ADDRESS": "10.0.0.5"})
    )
    assert cfg is not None and (cfg.port, str(cfg.local)) == (14789, "10.0.0.5")
    assert tunnel_config(load_settings({**worker, "HUTCH_TUNNEL_PORT": "0"})) is None
    with pytest.raises(InvalidArgument, match="HUTCH_TUNNEL_PORT=70000"):
        load_settings({**worker, "HUTCH_TUNNEL_PORT": "70000"})
    with pytest.raises(InvalidArgument, match="HUTCH_TUNNEL_ADDRESS='eth0'"):
        load_settings({**worker, "HUTCH_TUNNEL_ADDRESS": "eth0"})


async def test_local_peers_are_refused_where_the_kernel_keeps_the_local_bypass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran: list[tuple[str, ...]] = []
    bypass_off = [False]
    strict = [0]

    async def run_command(argv: Sequence[str], **_: object) -> tuple[int, str, str]:
        ran.append(tuple(argv))
        return 0, "", ""

    def create_vxlan(name: str, **_: object) -> bool:
        ran.append(("create", name))
        return bypass_off[0]

    monkeypatch.setattr(links, "run_command", run_command)
    monkeypatch.setattr(vxlan, "create_vxlan", create_vxlan)
    monkeypatch.setattr(tunnel, "_rp_filter_all", lambda: strict[0])
    a = IPv4Address("10.214.0.6")
    driver = TunnelDriver(CFG)
    # An old kernel, a peer on this machine (127.0.0.1): refused, naming the kernel.
    with pytest.raises(NetworkError, match=r"IFLA_VXLAN_LOCALBYPASS needs Linux 6.6"):
        await driver.sync(TunnelState((B,), ((a, "w2"),)))
    assert ("ip", "link", "del", "dev", "hx1a2b") in ran[-10:]
    assert not driver.up and driver.state.empty  # failed closed
    # ... a peer on another machine is fine there.
    await driver.sync(TunnelState((C,), ((a, "w3"),)))
    assert driver.up and ran[-1][:4] == ("ip", "route", "replace", "10.214.0.6/32")
    await driver.down()
    # A kernel that turned the bypass off: the local peer is fine.
    bypass_off[0] = True
    await driver.sync(TunnelState((B,), ((a, "w2"),)))
    assert driver.up and ("create", "hx1a2b") in ran
    await driver.down()
    # conf.all.rp_filter on would drop what comes out of the device: refused, named.
    strict[0] = 2
    with pytest.raises(NetworkError, match=r"net.ipv4.conf.all.rp_filter is 2"):
        await driver.sync(TunnelState((B,), ((a, "w2"),)))
    assert not driver.up
