"""Egress bytes in the meter and egress/port events, with a real VM, real nftables and the
real egress proxy against the suite's fake internet (tests/netfake; nothing else is
contacted).

The guest sends a known number of bytes three ways: UDP datagrams forwarded to an
address an ``ip:port`` rule allows (counted by nft's per-sandbox ``tx`` counter), HTTP
POST bodies to a name rule (redirected to the proxy, which counts what it relays
upstream; nft does not see those bytes as forwarded), and UDP datagrams to an address
no rule allows (dropped: denied bytes and an ``egress.denied`` event).

Tolerance: nft counts whole IP packets, so a UDP datagram of P payload bytes is P + 28
(IPv4 20 + UDP 8), exactly; the proxy counts the request heads it wrote (about 100
bytes each) plus the bodies, exactly. The guest sends nothing else out on its own (DNS
goes to hutch's resolver on the host: input, not forwarded), so the expected total is a
lower bound and only stray packets can add to it: 16 KiB of slack above (a TCP
retransmission or a guest packet we did not start would show here).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from hutch.errors import HutchError
from hutch.sdk import Client, Sandbox
from tests.e2e.conftest import Daemon
from tests.netfake import FakeInternet
from tests.vm.netlab import NETWORK_VM_MARKS, network_daemon

pytestmark = NETWORK_VM_MARKS

UDP_COUNT, UDP_PAYLOAD = 400, 1000  # allowed, forwarded: 400 * 1028 bytes on the wire
POST_COUNT, POST_BODY = 6, 60000  # allowed, proxied: 6 * (head + 60000)
DENIED_COUNT, DENIED_PAYLOAD = 60, 500  # denied: 60 * 528 bytes dropped
SLACK = 16 * 1024
PRICE_EGRESS_GB = 1000.0

SENDER = r"""
import json, socket, sys, time
web, cdn, udp_n, udp_p, post_n, post_b, den_n, den_p = json.loads(sys.argv[1])
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(udp_n):
    u.sendto(b"u" * udp_p, (web, 7))
    if i % 50 == 49:
        time.sleep(0.05)  # let the echo answers drain; nothing is meant to queue up
heads = 0
for _ in range(post_n):
    head = (f"POST /upload HTTP/1.1\r\nHost: good.test\r\nContent-Length: {post_b}\r\n"
            "Connection: close\r\n\r\n").encode()
    s = socket.create_connection(("good.test", 80), timeout=30)
    s.sendall(head + b"p" * post_b)
    while s.recv(65536):
        pass
    s.close()
    heads += len(head)
for _ in range(den_n):
    u.sendto(b"d" * den_p, (cdn, 7))
print(json.dumps({"heads": heads}))
"""


@pytest.fixture(scope="module")
def meterd(fakenet: FakeInternet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    env = {
        "HUTCH_METER_HEARTBEAT_S": "1",
        "HUTCH_EGRESS_EVENT_S": "2",
        "HUTCH_PRICE_EGRESS_GB": str(PRICE_EGRESS_GB),
        "HUTCH_TEMPLATES": "off",
    }
    with network_daemon(tmp_path_factory.mktemp("hutchd-egress"), fakenet, env) as d:
        yield d


@pytest.fixture(scope="module")
def client(meterd: Daemon) -> Iterator[Client]:
    with meterd.client(timeout=300.0) as c:
        yield c


@pytest.fixture(scope="module")
def sender(client: Client, fakenet: FakeInternet) -> Iterator[Sandbox]:
    sb = Sandbox.create(
        "base",
        memory_mib=256,
        name="sender",
        client=client,
        egress=["good.test", f"{fakenet.web}:7"],
    )
    yield sb
    with contextlib.suppress(HutchError):
        sb.kill()


def _row(client: Client, sid: str, since: float) -> Any:
    rows = [r for r in client.usage(start=since, group_by="sandbox").rows if r.key == sid]
    return rows[0] if rows else None


def test_egress_bytes_and_denials_reach_usage_and_events(
    client: Client, sender: Sandbox, fakenet: FakeInternet
) -> None:
    since = time.time() - 3600
    before = _row(client, sender.id, since)
    assert before is None or before.egress_allowed_bytes == 0, before
    args = [fakenet.web, fakenet.cdn, UDP_COUNT, UDP_PAYLOAD, POST_COUNT, POST_BODY]
    args += [DENIED_COUNT, DENIED_PAYLOAD]
    out = sender.exec(["python3", "-c", SENDER, json.dumps(args)], timeout_s=300)
    assert out.exit_code == 0, out.stderr
    heads = json.loads(out.stdout)["heads"]
    allowed = UDP_COUNT * (UDP_PAYLOAD + 28) + POST_COUNT * POST_BODY + heads
    denied = DENIED_COUNT * (DENIED_PAYLOAD + 28)

    # The counters are read every 2 s and written every heartbeat (1 s here).
    deadline = time.monotonic() + 30
    row = _row(client, sender.id, since)
    while time.monotonic() < deadline and (
        row is None or row.egress_allowed_bytes < allowed or row.egress_denied_bytes < denied
    ):
        time.sleep(1)
        row = _row(client, sender.id, since)
    assert row is not None
    assert allowed <= row.egress_allowed_bytes <= allowed + SLACK, (row, allowed)
    assert denied <= row.egress_denied_bytes <= denied + SLACK, (row, denied)
    # Priced per GB (10^9 bytes) with HUTCH_PRICE_EGRESS_GB, on top of the rest.
    assert row.cost_usd >= row.egress_allowed_bytes / 1e9 * PRICE_EGRESS_GB

    # The denials are summed up: a few events at most (one per 2 s), never one per packet.
    deadline = time.monotonic() + 30
    events = sender.events(types="egress.denied").events
    while time.monotonic() < deadline and sum(e.data["denials"] for e in events) < DENIED_COUNT:
        time.sleep(1)
        events = sender.events(types="egress.denied").events
    assert 1 <= len(events) <= 3, events
    assert sum(e.data["denials"] for e in events) >= DENIED_COUNT, events
    assert sum(e.data["bytes"] for e in events) >= denied, events
    destinations = {t["destination"] for e in events for t in e.data["top"]}
    assert fakenet.cdn in destinations, events
    # The same through the project's audit trail.
    audit = client.events(types="egress.denied", sandbox_id=sender.id).events
    assert [e.seq for e in audit] == [e.seq for e in events]


def test_port_exposed_and_closed_are_recorded(client: Client, sender: Sandbox) -> None:
    port = sender.ports.expose(8080)
    sender.ports.close(8080)
    events = sender.events(types=["port.exposed", "port.closed"]).events
    assert [(e.type, e.data["port"]) for e in events] == [
        ("port.exposed", 8080),
        ("port.closed", 8080),
    ], events
    assert events[0].data["host_port"] == port.host_port
    assert events[0].actor is not None  # the caller's key
