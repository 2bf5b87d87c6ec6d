"""Noisy neighbours with real VMs (issue 17, items 5 and 6): one guest floods its resolver
or sends denied packets as fast as it can; another sandbox of the same daemon still
resolves, connects and execs, and each sandbox's egress counters and log say what
happened to it (rate-limited / not logged, in summary lines, never one line a packet).

One daemon for the module, with small limits (``HUTCH_DNS_RATE=20``, burst 40: the
kernel ceiling is then 40/s, burst 80) so that even a TCG guest floods past both the
daemon's limit and the kernel's; ``HUTCH_DNS_UPSTREAM`` is the module's FakeInternet.
Nothing but the fake internet's addresses is contacted.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hutch.errors import HutchError
from hutch.sdk import Client, EgressInfo
from tests.e2e.conftest import Daemon
from tests.netfake import FakeInternet
from tests.vm.netlab import (
    NETWORK_VM_MARKS,
    Guest,
    gateway_of,
    make_guest,
    network_daemon,
    network_state,
    packets_from,
    resolve,
    tcp,
    udp,
)

pytestmark = NETWORK_VM_MARKS

FLOOD = Path(__file__).resolve().parents[1] / "netfake" / "flood.py"
DNS_RATE, DNS_BURST, LOG_RATE, LOG_BURST = 20, 40, 5, 10
FLOOD_S = 8.0
#: Packets from the tap that are not IPv4 and so pass no rule: the guest's ARP requests
#: for its gateway and its answers to the host's probes (7 in a run here).
ARP_SLACK = 25
FLOOD_ENV = {
    "HUTCH_DNS_RATE": str(DNS_RATE),
    "HUTCH_DNS_BURST": str(DNS_BURST),
    "HUTCH_DENY_LOG_RATE": str(LOG_RATE),
    "HUTCH_DENY_LOG_BURST": str(LOG_BURST),
}


@pytest.fixture(scope="module")
def netd(fakenet: FakeInternet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with network_daemon(tmp_path_factory.mktemp("hutchd-flood"), fakenet, FLOOD_ENV) as d:
        yield d


@pytest.fixture(scope="module")
def client(netd: Daemon) -> Iterator[Client]:
    with netd.client(timeout=300.0) as c:
        yield c


@pytest.fixture
def flooder(client: Client, fakenet: FakeInternet) -> Iterator[Guest]:
    """A fresh flooder per test (a template restore: cheap), so that what one flood
    leaves in a guest (its kernel's queues, its neighbour entry) is not the next one's
    starting point."""
    guest = make_guest(client, fakenet, "flooder", egress=["good.test"])
    guest.sb.files.write("/root/flood.py", FLOOD.read_bytes())
    yield guest
    with contextlib.suppress(HutchError):
        guest.sb.kill()


@pytest.fixture(scope="module")
def neighbour(client: Client, fakenet: FakeInternet) -> Iterator[Guest]:
    guest = make_guest(client, fakenet, "neighbour", egress=["good.test"])
    yield guest
    with contextlib.suppress(HutchError):
        guest.sb.kill()


def run_flood(guest: Guest, *args: str) -> Any:
    """Start ``flood.py args`` in the guest (a background process, so the test can act
    meanwhile); returns its handle."""
    return guest.sb.processes.start(["python3", "/root/flood.py", *args])


def flood_result(process: Any) -> dict[str, Any]:
    info = process.wait(timeout_s=FLOOD_S + 120)
    out = process.output()
    assert info.exit_code == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def arrived_since(guest: Guest, before: int, result: dict[str, Any]) -> int:
    """Packets that reached the host from ``guest`` since ``before`` (see
    :func:`packets_from`); prints the guest's NIC state when far fewer arrived than the
    guest says it sent, so that a guest-side stall is visible in the test's output."""
    arrived = packets_from(guest.sb) - before
    if result["sent"] - arrived > 100:
        print(f"\n{guest.sb.id} sent {result['sent']}, the host received {arrived}:")
        print(network_state(guest.sb))
    return arrived


def settled(sb: Any, check: Any, timeout_s: float = 15.0) -> EgressInfo:
    """The egress counters once ``check(info)`` holds (nft counters are polled every 2 s
    and the limiters' counts handed over every second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info: EgressInfo = sb.egress.get()
        if check(info) or time.monotonic() > deadline:
            return info
        time.sleep(0.5)


def test_a_dns_flood_is_limited_and_the_neighbour_resolves_and_execs(
    flooder: Guest, neighbour: Guest, fakenet: FakeInternet
) -> None:
    gateway = gateway_of(flooder.sb)
    before = neighbour.sb.egress.get()
    counted_before = flooder.sb.egress.get()
    packets_before = packets_from(flooder.sb)
    process = run_flood(flooder, "dns", gateway, str(FLOOD_S))
    started = time.monotonic()
    # While it floods: the neighbour's lookups, connections and execs work as usual.
    seen = 0
    while time.monotonic() - started < FLOOD_S - 1:
        answer = neighbour.sb.exec(["true"], timeout_s=60)
        assert answer.exit_code == 0
        neighbour.expect({"resolve": (resolve("good.test"), True)})
        # Port 2222 is not proxied: it works only through the address the resolver
        # learned into nft (from the data path's thread) for good.test.
        neighbour.expect({"tcp 2222 of good.test": (tcp(fakenet.web, 2222), True)})
        seen += 1
    assert seen >= 1
    result = flood_result(process)
    rcodes = result["rcodes"]
    # Every query that reached the host (a few ARP packets besides) is accounted for.
    arrived = arrived_since(flooder, packets_before, result)
    looked_at = rcodes.get("NXDOMAIN", 0)  # flood.test is not allowed: answered locally
    ceiling = 2 * DNS_BURST + 2 * DNS_RATE * (result["seconds"] + 2)
    # The guest flooded far past both limits (a TCG guest sends a few thousand a second).
    assert arrived > 4 * ceiling, (arrived, result)
    # The daemon looked at no more than its limit let through, told the guest REFUSED
    # for some more (between 1x and 2x the limit), and the kernel dropped the rest.
    assert looked_at <= DNS_BURST + DNS_RATE * (result["seconds"] + 2) + 5, result
    assert rcodes.get("REFUSED", 0) > 0, result
    assert result["replies"] <= ceiling + 10, result

    def counted(i: EgressInfo) -> int:
        return i.rate_limited + i.denied - counted_before.rate_limited - counted_before.denied

    info = settled(flooder.sb, lambda i: counted(i) >= arrived - ARP_SLACK)
    print(
        f"\nDNS flood: {result}, {arrived} packets reached the host; flooder's counters "
        f"{info}; neighbour ran {seen} rounds"
    )
    # Every query is accounted for: looked at (a denial), or rate-limited.
    assert arrived - ARP_SLACK <= counted(info) <= arrived, (arrived, info, result)
    assert info.rate_limited - counted_before.rate_limited >= rcodes.get("REFUSED", 0)
    events = flooder.sb.egress.log(limit=1000)
    lines = [e for e in events if e.reason.startswith("rate-limited")]
    assert lines, "no rate-limited summary in the egress log"
    assert len(lines) <= 3 * (FLOOD_S + 10), "summaries, not a line per packet"
    assert any(e.protocol == "dns" and "REFUSED" in e.reason for e in lines)
    assert any(e.protocol == "kernel" for e in lines), [e.reason for e in lines]
    # The neighbour was never limited, and resolves at once after the flood too.
    after = neighbour.sb.egress.get()
    assert after.rate_limited == before.rate_limited == 0
    neighbour.expect({"resolve": (resolve("good.test"), True)})


def test_a_denial_flood_does_not_hide_the_neighbours_denials(
    flooder: Guest, neighbour: Guest, fakenet: FakeInternet
) -> None:
    since = time.time()
    packets_before = packets_from(flooder.sb)
    process = run_flood(flooder, "udp", fakenet.cdn, "5", "9")
    time.sleep(1.0)
    # Five denied datagrams of the neighbour's, during the flood (each its own port).
    checks = {f"udp {p}": ({**udp(fakenet.cdn), "port": p, "timeout": 1.0}, False)
              for p in range(7001, 7006)}  # fmt: skip
    neighbour.expect(checks)
    result = flood_result(process)
    arrived = arrived_since(flooder, packets_before, result)
    assert arrived > 2000, (arrived, result)
    info = settled(flooder.sb, lambda i: i.log_dropped > 0)
    print(f"\ndenial flood: {result}; flooder's counters {info}")
    assert info.log_dropped > 0, info
    denied = [
        e
        for e in neighbour.sb.egress.log(limit=1000)
        if e.verdict == "deny" and e.time is not None and e.time.timestamp() >= since - 1
    ]
    ports = {e.port for e in denied if e.destination == fakenet.cdn and e.protocol == "udp"}
    assert ports >= set(range(7001, 7006)), denied
    assert neighbour.sb.egress.get().log_dropped == 0
    # The flooder's log says how many were not logged, in a few lines that add up to
    # the counter (once the last poll's line is in).
    deadline = time.monotonic() + 15
    while True:
        events = flooder.sb.egress.log(limit=1000)
        lines = [e for e in events if "not logged one by one" in e.reason]
        total = sum(int(e.reason.split()[0]) for e in lines)
        counted = flooder.sb.egress.get().log_dropped
        if (lines and total == counted) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert lines and total == counted, ([e.reason for e in lines], counted)
    assert all(e.protocol == "log" for e in lines)
    assert len(lines) <= 15, "summaries, not a line per packet"
