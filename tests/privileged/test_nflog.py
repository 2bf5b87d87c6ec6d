"""NFLOG: denials logged by hutch's table reach :class:`hutch.net.nflog.NflogReader`.

The reader runs in a subprocess inside the lab's host namespace (a netlink socket
belongs to the namespace it was opened in, and interface indices resolve there too).
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from ipaddress import IPv4Address, IPv4Network

import pytest

from hutch.net.addressing import host_addresses
from hutch.net.nflog import parse_packet_message, split_prefix
from hutch.net.nft import RulesetState, render_table
from hutch.net.nft_apply import apply, delete_table
from hutch.net.nft_common import SandboxNet, TableConfig
from hutch.net.rules import parse_policy

from .conftest import HOST_PORTS, REPO, Guest, Lab

GROUP = 7

READER = r"""
import asyncio, json, sys
from hutch.errors import NetworkError
from hutch.net.nflog import NflogReader

async def main():
    group, timeout = int(sys.argv[1]), float(sys.argv[2])
    wanted = set(sys.argv[3:])
    reader = NflogReader(group)
    try:
        NflogReader(group).close()
        second = "bound twice"
    except NetworkError as exc:
        second = str(exc)
    print(json.dumps({"ready": True, "second": second}), flush=True)
    got = []

    async def collect():
        async for p in reader:
            got.append({"prefix": p.prefix, "src": str(p.src), "dst": str(p.dst),
                        "protocol": p.protocol, "sport": p.sport, "dport": p.dport,
                        "indev": p.indev, "time": p.time})
            wanted.discard(p.prefix.split(" ")[-1])
            if not wanted:
                return

    try:
        await asyncio.wait_for(collect(), timeout)
    except asyncio.TimeoutError:
        pass
    # close() must end an iteration that is waiting for packets.
    pending = asyncio.ensure_future(reader.__anext__())
    await asyncio.sleep(0.05)
    reader.close()
    try:
        await asyncio.wait_for(pending, 2)
        stopped = "got a packet"
    except StopAsyncIteration:
        stopped = "stopped"
    print(json.dumps({"packets": got, "close": stopped}), flush=True)

asyncio.run(main())
"""


@pytest.fixture
def reader(lab: Lab) -> Iterator[subprocess.Popen[str]]:
    env = {"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    proc = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            lab.host,
            sys.executable,
            "-c",
            READER,
            str(GROUP),
            "8",
            "policy",
            "smtp",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.privileged
async def test_denials_arrive_with_prefix_and_addresses(
    lab: Lab, reader: subprocess.Popen[str]
) -> None:
    guest: Guest = lab.add_guest("n", 5)
    cfg = TableConfig(
        lab.tag, IPv4Network("10.213.0.0/16"), HOST_PORTS["dns"], HOST_PORTS["proxy"], GROUP
    )
    state = RulesetState(
        cfg,
        await host_addresses(lab.host),
        (SandboxNet(guest.sandbox_id, guest.tap, guest.address, parse_policy(["198.18.1.1"])),),
    )
    await apply(render_table(state), netns=lab.host)
    try:
        assert reader.stdout is not None
        hello = json.loads(reader.stdout.readline() or "{}")
        assert hello.get("ready"), reader.stderr.read() if reader.stderr else ""
        assert "another socket" in hello["second"], "a group has one reader per namespace"

        results = lab.probe(
            guest.netns,
            [
                {"proto": "tcp", "host": "198.18.3.1", "port": 2222},
                {"proto": "tcp", "host": "198.18.1.1", "port": 25},
            ],
        )
        assert all(r.startswith("FAIL:") for r in results), results
        out, err = reader.communicate(timeout=30)
    finally:
        await delete_table(lab.tag, netns=lab.host)
    report = json.loads(out.strip().splitlines()[-1])
    assert report["close"] == "stopped", "close() ends a pending iteration"
    packets = report["packets"]
    by_reason = {p["prefix"].split(" ")[-1]: p for p in packets}
    assert set(by_reason) >= {"policy", "smtp"}, (packets, err)

    policy = by_reason["policy"]
    assert policy["prefix"] == f"h{lab.tag} {guest.sandbox_id} policy"
    assert (policy["src"], policy["dst"]) == (str(guest.address), "198.18.3.1")
    assert (policy["protocol"], policy["dport"]) == ("tcp", 2222)
    assert policy["indev"] == guest.tap
    assert policy["sport"] and policy["time"] > 0

    smtp = by_reason["smtp"]
    assert smtp["prefix"] == f"h{lab.tag} - smtp"
    assert (smtp["dst"], smtp["dport"], smtp["indev"]) == ("198.18.1.1", 25, guest.tap)


# ------------------------------------------------------------------ pure (no root)


def _nla(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def test_parse_packet_message_ipv4_udp() -> None:
    ip = bytes([0x45, 0, 0, 28, 0, 0, 0, 0, 64, 17, 0, 0])
    ip += socket.inet_aton("10.213.0.6") + socket.inet_aton("198.18.3.1")
    udp = struct.pack("!HHHH", 40000, 9999, 8, 0)
    body = struct.pack("!BBH", 2, 0, GROUP)
    body += _nla(10, b"hab12 sb-0123456789ab policy\0")
    body += _nla(4, struct.pack("!I", 1))  # lo
    body += _nla(3, struct.pack("!QQ", 1700000000, 500000))
    body += _nla(9, ip + udp)
    packet = parse_packet_message(body)
    assert packet.prefix == "hab12 sb-0123456789ab policy"
    assert packet.src == IPv4Address("10.213.0.6") and packet.dst == IPv4Address("198.18.3.1")
    assert (packet.protocol, packet.sport, packet.dport) == ("udp", 40000, 9999)
    assert packet.indev == "lo"
    assert packet.time == 1700000000.5


def test_parse_packet_message_ipv6_and_garbage() -> None:
    ip6 = (
        bytes([0x60, 0, 0, 0, 0, 20, 6, 64])
        + socket.inet_pton(socket.AF_INET6, "fd00::2")
        + socket.inet_pton(socket.AF_INET6, "fd01::2")
    )
    body = struct.pack("!BBH", 10, 0, GROUP) + _nla(9, ip6 + struct.pack("!HH", 1234, 80))
    packet = parse_packet_message(body)
    assert (str(packet.src), str(packet.dst), packet.protocol, packet.dport) == (
        "fd00::2",
        "fd01::2",
        "tcp",
        80,
    )
    junk = parse_packet_message(struct.pack("!BBH", 2, 0, 1) + _nla(9, b"\x99\x00"))
    assert (junk.src, junk.dport, junk.prefix, junk.indev) == (None, None, "", None)


def test_split_prefix() -> None:
    assert split_prefix("hab12 sb-0123456789ab policy") == ("hab12", "sb-0123456789ab", "policy")
    assert split_prefix("hab12 - smtp") == ("hab12", None, "smtp")
